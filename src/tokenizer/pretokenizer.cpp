#include "tokenizer/pretokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <map>

#include "core/error.hpp"

namespace kvq {
namespace {

struct Spec {
  std::string name;
  std::string pattern;  // exactly as in the model's tokenizer.json
  bool nfc;
  bool ignore_merges;
};

// Qwen2/Qwen2.5/Qwen3 (and Bonsai, which reuses Qwen3's tokenizer): single digits,
// NFC normalizer. Llama 3: digits in runs of up to three, no normalizer, and
// the BPE model takes whole-vocabulary pre-tokens without merging.
const std::vector<Spec>& specs() {
  static const std::vector<Spec> s = {
      {"qwen2",
       R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
       true, false},
      {"llama-bpe",
       R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
       false, true},
  };
  return s;
}

const Spec& find_spec(const std::string& name) {
  for (const auto& s : specs())
    if (s.name == name) return s;
  std::string known;
  for (const auto& s : specs()) known += (known.empty() ? "" : ", ") + s.name;
  fail(Errc::unsupported, "unsupported pre-tokenizer '", name, "' (tokenizer.ggml.pre); kvq supports: ",
       known);
}

// The reference regex engines (Oniguruma in HF tokenizers) read \s as Unicode
// White_Space. PCRE2's UCP \s also matches U+180E MONGOLIAN VOWEL SEPARATOR
// (no longer a space since Unicode 6.3), so \s and \S are spelled out as
// White_Space = Z categories + TAB..CR + NEL before compiling.
std::string with_unicode_white_space(const std::string& re) {
  static const std::string ws = R"(\t-\r\x{85}\p{Z})";
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < re.size(); ++i) {
    const char c = re[i];
    if (c == '\\' && i + 1 < re.size()) {
      const char n = re[++i];
      if (n == 's') out += in_class ? ws : "[" + ws + "]";
      else if (n == 'S') {
        KVQ_CHECK(!in_class, Errc::internal, "\\S inside a character class is not supported");
        out += "[^" + ws + "]";
      } else {
        out += c;
        out += n;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < re.size() && re[i + 1] == '^') out += re[++i];
      if (i + 1 < re.size() && re[i + 1] == ']') out += re[++i];  // literal ] first in a class
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

struct PreTokenizer::Regex {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Regex() {
    if (code) pcre2_code_free(code);
  }
};

PreTokenizer::PreTokenizer(const std::string& name) : re_(std::make_unique<Regex>()) {
  const Spec& spec = find_spec(name);
  name_ = spec.name;
  nfc_ = spec.nfc;
  ignore_merges_ = spec.ignore_merges;
  int err = 0;
  PCRE2_SIZE err_off = 0;
  // UTF: patterns and subjects are UTF-8 code points, not bytes. UCP: \s, \d,
  // \w and case folding follow Unicode properties, as in the reference (Rust
  // regex / Oniguruma / JavaScript /u).
  const std::string pattern = with_unicode_white_space(spec.pattern);
  re_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                            PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
  if (!re_->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    fail(Errc::internal, "pre-tokenizer '", name, "' regex does not compile at offset ", err_off, ": ",
         reinterpret_cast<const char*>(msg));
  }
  re_->jit = pcre2_jit_compile(re_->code, PCRE2_JIT_COMPLETE) == 0;
}

PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;
PreTokenizer::~PreTokenizer() = default;

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& out) const {
  if (text.empty()) return;
  // Match data is per call so that one PreTokenizer serves many threads.
  struct MatchData {
    pcre2_match_data* md;
    ~MatchData() { pcre2_match_data_free(md); }
  } m{pcre2_match_data_create_from_pattern(re_->code, nullptr)};
  KVQ_CHECK(m.md != nullptr, Errc::internal, "out of memory creating PCRE2 match data");

  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  while (pos < text.size()) {
    // The caller validated the UTF-8 already; NO_UTF_CHECK avoids rescanning the
    // whole subject on every call (which would make splitting quadratic).
    // pcre2_match uses the JIT code when there is one; a very long run that
    // exhausts the JIT stack is retried by the interpreter (heap-allocated frames).
    int rc = pcre2_match(re_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, m.md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(re_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, m.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) {
      out.push_back(text.substr(pos));
      return;
    }
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      fail(Errc::internal, "pre-tokenizer '", name_, "' match failed: ", reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.md);
    size_t begin = ov[0], end = ov[1];
    if (begin > pos) out.push_back(text.substr(pos, begin - pos));  // unmatched gap
    if (end == begin) {
      // No supported regex matches the empty string; be safe anyway and step one
      // code point so that the loop always advances.
      end = begin + 1;
      while (end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) ++end;
    }
    out.push_back(text.substr(begin, end - begin));
    pos = end;
  }
}

const std::vector<std::string>& PreTokenizer::names() {
  static const std::vector<std::string> n = [] {
    std::vector<std::string> v;
    for (const auto& s : specs()) v.push_back(s.name);
    return v;
  }();
  return n;
}

const std::string& PreTokenizer::pattern(const std::string& name) { return find_spec(name).pattern; }

std::string PreTokenizer::name_for_pattern(std::string_view regex) {
  for (const auto& s : specs())
    if (s.pattern == regex) return s.name;
  return {};
}

}  // namespace kvq
