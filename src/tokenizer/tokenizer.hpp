// Byte-level BPE tokenizer loaded from GGUF metadata (tokenizer.ggml.*), with
// the qwen2 and llama-bpe pre-tokenizers, special/added tokens and streaming-
// safe detokenization. Chat formatting lives in tokenizer/chat.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/vocab.hpp"

namespace kvq {
namespace gguf { class File; }

using TokenId = int32_t;

// A byte range [begin, end) of a text.
struct TextSpan {
  size_t begin = 0, end = 0;
};

class Tokenizer {
 public:
  // Throws kvq::Error naming the key when tokenizer metadata is missing or unsupported.
  static Tokenizer from_gguf(const gguf::File& f);
  // From a Hugging Face tokenizer.json (used by `kvq synth --vocab` and tests).
  static Tokenizer from_hf_json(const std::string& path);
  // From plain data (every loader ends here). Throws kvq::Error naming the
  // offending key when the data is inconsistent or unsupported.
  static Tokenizer from_data(TokenizerData data);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // parse_special: recognise control tokens written literally in text
  // (user-defined added tokens are recognised either way, as in HF).
  std::vector<TokenId> encode(std::string_view text, bool parse_special = false) const;
  // encode(text, true), except that no control token is recognised where it
  // would overlap one of `literal` (byte ranges of text): text such as chat
  // message content, which stays text whatever it spells. Tokenizing the
  // whole text at once (rather than piece by piece) keeps the pre-tokenizer's
  // splits across the boundaries exactly as for encode(text, true).
  std::vector<TokenId> encode_with_literals(std::string_view text, const std::vector<TextSpan>& literal) const;
  // Concatenated bytes of the tokens; control tokens omitted when !show_special.
  std::string decode(const std::vector<TokenId>& ids, bool show_special = false) const;
  std::string piece(TokenId id) const;  // raw bytes of one token
  int vocab_size() const;
  bool is_control(TokenId id) const;
  bool is_eog(TokenId id) const;        // end of generation (eos, eot, im_end, ...)
  std::vector<TokenId> eog_ids() const;  // every id for which is_eog() is true, ascending
  TokenId bos() const;                   // -1 when none
  TokenId eos() const;                   // -1 when none
  bool add_bos() const;                  // tokenizer.ggml.add_bos_token
  TokenId find_token(std::string_view text) const;  // -1 when absent
  const std::string& pre() const;        // pre-tokenizer name ("qwen2", "llama-bpe")
  const std::string& chat_template() const;  // may be empty

  // Additions beyond the first interface.
  const std::string& bytes_of(TokenId id) const;  // like piece(), without a copy
  TokenType type(TokenId id) const;
  // Shown by decode(ids, show_special = false): normal, user-defined and byte tokens.
  bool is_displayed(TokenId id) const;
  TokenId eot() const;                   // -1 when none
  TokenId pad() const;                   // -1 when none
  const TokenizerData& data() const;     // what the tokenizer was built from
  // Whether text is normalized to NFC before pre-tokenizing: as the
  // tokenizer's normalizer says (kvq.tokenizer.normalizer, or the
  // tokenizer.json's), else the pre-tokenizer's usual one.
  bool normalizes_nfc() const;

 private:
  Tokenizer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Streaming detokenizer: feed ids one at a time, get back only complete UTF-8
// (a multi-byte character split across tokens is held until complete). The
// output is always valid UTF-8: bytes that can never complete a character
// come out as U+FFFD, one per byte. For token sequences that decode to valid
// UTF-8, the concatenated output equals decode(ids, show_special).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool show_special = false);
  std::string push(TokenId id);
  std::string flush();  // whatever is left (invalid trailing bytes as U+FFFD)

 private:
  const Tokenizer* tok_;
  bool show_special_;
  std::string pending_;
};

}  // namespace kvq
