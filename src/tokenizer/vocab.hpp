// The tokenizer's data as plain C++: exactly what GGUF stores under
// tokenizer.ggml.* (llama.cpp conventions). Every loader (GGUF, Hugging Face
// tokenizer.json) produces a TokenizerData; Tokenizer is built from it, so
// there is one construction path whatever the source.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvq {
namespace gguf { class File; class Writer; }

// tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
enum class TokenType : int32_t {
  undefined = 0,
  normal = 1,        // ordinary BPE vocabulary entry, stored in GPT-2 byte-to-unicode form
  unknown = 2,
  control = 3,       // special token (<|im_end|>): recognised only with parse_special, hidden on display
  user_defined = 4,  // added token (<think>): always recognised in text, shown on display
  unused = 5,        // padding entries ([PAD151669]) that no text produces
  byte = 6,          // <0xNN> byte-fallback entry (SentencePiece vocabularies; not used by gpt2)
};

// GGUF metadata keys, in one place.
namespace tokenizer_keys {
inline constexpr const char* model = "tokenizer.ggml.model";
inline constexpr const char* pre = "tokenizer.ggml.pre";
inline constexpr const char* tokens = "tokenizer.ggml.tokens";
inline constexpr const char* token_type = "tokenizer.ggml.token_type";
inline constexpr const char* merges = "tokenizer.ggml.merges";
inline constexpr const char* bos_id = "tokenizer.ggml.bos_token_id";
inline constexpr const char* eos_id = "tokenizer.ggml.eos_token_id";
inline constexpr const char* eot_id = "tokenizer.ggml.eot_token_id";
inline constexpr const char* pad_id = "tokenizer.ggml.padding_token_id";
inline constexpr const char* add_bos = "tokenizer.ggml.add_bos_token";
inline constexpr const char* chat_template = "tokenizer.chat_template";
// kvq's own key (llama.cpp's GGUFs have none): the normalizer the tokenizer.json
// states, "NFC" or "none". Absent: the pre-tokenizer's usual one (qwen2: NFC,
// as Qwen's tokenizer.json says; llama-bpe: none).
inline constexpr const char* normalizer = "kvq.tokenizer.normalizer";
}  // namespace tokenizer_keys

// Normalizers kvq applies before pre-tokenizing (the values of tokenizer_keys::normalizer).
inline constexpr const char* kNormalizerNone = "none";
inline constexpr const char* kNormalizerNfc = "NFC";

struct TokenizerData {
  std::string model = "gpt2";          // tokenizer.ggml.model; only byte-level BPE is supported
  std::string pre;                     // "qwen2" or "llama-bpe"
  std::vector<std::string> tokens;     // id -> text (normal tokens in GPT-2 byte-to-unicode form)
  std::vector<int32_t> types;          // id -> TokenType; empty means all normal
  std::vector<std::string> merges;     // "left right", best (rank 0) first
  int32_t bos = -1, eos = -1, eot = -1, pad = -1;  // -1 when absent
  bool add_bos = false;
  std::string chat_template;           // Jinja text; may be empty
  std::string normalizer;              // "NFC", "none", or empty: the pre-tokenizer's usual one
};

// Reads tokenizer.ggml.* from a GGUF file; a missing required key or an
// unsupported value throws kvq::Error naming the key.
TokenizerData read_tokenizer_data(const gguf::File& f);
// Writes every key above into a GGUF writer (absent ids and an empty template are omitted).
void write_tokenizer_data(const TokenizerData& d, gguf::Writer& w);

}  // namespace kvq
