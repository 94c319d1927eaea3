// Pre-tokenizers of byte-level BPE models: a regex splits text into pieces
// that BPE merges never cross. The regexes are the Hugging Face ones verbatim
// (they need Unicode properties and lookahead), run by PCRE2 in UTF + UCP mode.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvq {

class PreTokenizer {
 public:
  // name: a tokenizer.ggml.pre value. Throws Errc::unsupported listing the
  // supported names otherwise.
  explicit PreTokenizer(const std::string& name);
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;
  ~PreTokenizer();

  // Splits valid UTF-8 into pieces (views into text), appended to out. Text
  // between regex matches also becomes a piece (HF "Isolated" behaviour), so
  // the pieces always concatenate back to text.
  void split(std::string_view text, std::vector<std::string_view>& out) const;

  const std::string& name() const { return name_; }
  // Whether models with this pre-tokenizer usually normalize text to NFC
  // first (Qwen2/3: yes): the default when the tokenizer states no normalizer.
  bool nfc() const { return nfc_; }
  // Whether a pre-token that is itself in the vocabulary is taken whole before
  // any merge (HF BPE "ignore_merges"; Llama 3: yes).
  bool ignore_merges() const { return ignore_merges_; }

  // Supported names and the Hugging Face Split regex of each.
  static const std::vector<std::string>& names();
  static const std::string& pattern(const std::string& name);
  // The tokenizer.ggml.pre name whose regex is exactly `regex`; empty if none.
  static std::string name_for_pattern(std::string_view regex);

 private:
  struct Regex;
  std::string name_;
  bool nfc_ = false;
  bool ignore_merges_ = false;
  std::unique_ptr<Regex> re_;
};

}  // namespace kvq
