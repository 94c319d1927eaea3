#include "tokenizer/unicode.hpp"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <vector>

#include "core/error.hpp"

namespace kvq::utf8 {

size_t expected_length(unsigned char c) {
  if (c < 0x80) return 1;
  if (c < 0xC2) return 0;  // continuation byte or overlong 2-byte lead
  if (c < 0xE0) return 2;
  if (c < 0xF0) return 3;
  if (c < 0xF5) return 4;
  return 0;
}

// Allowed range of the byte after lead c (Unicode Table 3-7).
static void second_byte_range(unsigned char c, unsigned char& lo, unsigned char& hi) {
  lo = 0x80;
  hi = 0xBF;
  if (c == 0xE0) lo = 0xA0;
  else if (c == 0xED) hi = 0x9F;
  else if (c == 0xF0) lo = 0x90;
  else if (c == 0xF4) hi = 0x8F;
}

size_t sequence_length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  const size_t n = expected_length(c);
  if (n <= 1) return n;
  if (i + n > s.size()) return 0;
  // Second-byte ranges exclude overlong forms, surrogates and code points > U+10FFFF
  // (Unicode Table 3-7, well-formed byte sequences).
  const unsigned char c1 = b(i + 1);
  unsigned char lo, hi;
  second_byte_range(c, lo, hi);
  if (c1 < lo || c1 > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if ((b(i + k) & 0xC0) != 0x80) return 0;
  return n;
}

bool is_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = sequence_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

size_t complete_prefix(std::string_view s) {
  // Only the last three bytes can start an unfinished character.
  const size_t start = s.size() > 3 ? s.size() - 3 : 0;
  for (size_t i = start; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = expected_length(c);
    if (n < 2 || i + n <= s.size()) continue;
    // The sequence runs past the end: hold it back if the bytes present so far
    // can still become a well-formed character.
    bool prefix_ok = true;
    for (size_t k = i + 1; k < s.size(); ++k) {
      const unsigned char ck = static_cast<unsigned char>(s[k]);
      unsigned char lo = 0x80, hi = 0xBF;
      if (k == i + 1) second_byte_range(c, lo, hi);
      if (ck < lo || ck > hi) prefix_ok = false;
    }
    if (prefix_ok) return i;
  }
  return s.size();
}

void append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

std::string sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = sequence_length(s, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

static const icu::Normalizer2& nfc_instance() {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status) || n == nullptr)
    fail(Errc::internal, "ICU NFC normalizer unavailable: ", u_errorName(status));
  return *n;
}

static bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

bool is_nfc(std::string_view s) {
  // ICU's isNormalizedUTF8 is quadratic in a run of combining marks (1 MB of
  // alternating marks: over 10 minutes); the linear nfc() decides instead.
  if (is_ascii(s)) return true;
  return nfc(s) == s;
}

static const icu::Normalizer2& nfd_instance() {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFDInstance(status);
  if (U_FAILURE(status) || n == nullptr)
    fail(Errc::internal, "ICU NFD normalizer unavailable: ", u_errorName(status));
  return *n;
}

// The code point of the well-formed sequence of length n at s[i].
static uint32_t decode_at(std::string_view s, size_t i, size_t n) {
  uint32_t cp = static_cast<unsigned char>(s[i]);
  if (n > 1) {
    cp &= (0x7F >> n);
    for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  }
  return cp;
}

static void icu_nfc_append(std::string_view s, std::string& out) {
  if (s.empty()) return;
  icu::StringByteSink<std::string> sink(&out);
  UErrorCode status = U_ZERO_ERROR;
  nfc_instance().normalizeUTF8(0, icu::StringPiece(s.data(), int32_t(s.size())), sink, nullptr, status);
  if (U_FAILURE(status)) fail(Errc::internal, "ICU NFC normalization failed: ", u_errorName(status));
}

std::string nfc_segment(std::string_view s) {
  const icu::Normalizer2& nfc = nfc_instance();
  const icu::Normalizer2& nfd = nfd_instance();
  // 1. Full canonical decomposition, code point by code point.
  std::vector<UChar32> d;
  d.reserve(s.size());
  icu::UnicodeString dec;
  for (size_t i = 0; i < s.size();) {
    size_t n = sequence_length(s, i);
    if (n == 0) n = 1;  // callers pass valid UTF-8; never loop forever
    const UChar32 cp = UChar32(decode_at(s, i, n));
    i += n;
    if (nfd.getDecomposition(cp, dec)) {
      for (int32_t k = 0; k < dec.length();) {
        const UChar32 c = dec.char32At(k);
        d.push_back(c);
        k += U16_LENGTH(c);
      }
    } else {
      d.push_back(cp);
    }
  }
  // 2. Canonical ordering: each run of non-starters stably sorted by class.
  std::vector<uint8_t> ccc(d.size());
  for (size_t i = 0; i < d.size(); ++i) ccc[i] = nfc.getCombiningClass(d[i]);
  std::vector<std::pair<uint8_t, UChar32>> run;
  for (size_t i = 0; i < d.size();) {
    if (ccc[i] == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && ccc[j] != 0) ++j;
    if (j - i > 1) {
      run.clear();
      for (size_t k = i; k < j; ++k) run.emplace_back(ccc[k], d[k]);
      std::stable_sort(run.begin(), run.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      for (size_t k = i; k < j; ++k) std::tie(ccc[k], d[k]) = run[k - i];
    }
    i = j;
  }
  // 3. Canonical composition: each character joins the last starter unless a
  // character kept between them has class 0 or a class >= its own. Kept
  // non-starters are in non-decreasing class order, so the last one kept
  // decides.
  std::vector<UChar32> out;
  out.reserve(d.size());
  ptrdiff_t starter = -1;  // index in out of the last starter
  int last_ccc = -1;       // class of the last character kept after it; -1: none
  for (size_t i = 0; i < d.size(); ++i) {
    const UChar32 c = d[i];
    const int cc = ccc[i];
    if (starter >= 0 && (last_ccc < 0 || (last_ccc != 0 && last_ccc < cc))) {
      const UChar32 p = nfc.composePair(out[size_t(starter)], c);
      if (p >= 0) {
        out[size_t(starter)] = p;
        continue;
      }
    }
    if (cc == 0) {
      starter = ptrdiff_t(out.size());
      last_ccc = -1;
    } else {
      last_ccc = cc;
    }
    out.push_back(c);
  }
  std::string bytes;
  bytes.reserve(s.size());
  for (UChar32 c : out) append(bytes, uint32_t(c));
  return bytes;
}

std::string nfc(std::string_view s) {
  if (is_ascii(s)) return std::string(s);
  KVQ_CHECK(s.size() < size_t(INT32_MAX), Errc::out_of_range,
            "text of ", s.size(), " bytes is too long to normalize; split it below 2 GiB");
  // Cut at normalization boundaries (NFC(a + b) = NFC(a) + NFC(b) when b
  // starts at one). Runs of short segments go to ICU together; a long
  // segment (a run of combining marks) goes to nfc_segment.
  const icu::Normalizer2& n = nfc_instance();
  std::string out;
  out.reserve(s.size());
  size_t pending = 0;    // start of the text not yet normalized
  size_t seg_start = 0;  // start of the current segment
  size_t seg_cps = 0;    // its length in code points
  bool long_seg = false;
  auto end_segment = [&](size_t end) {
    if (long_seg) {
      icu_nfc_append(s.substr(pending, seg_start - pending), out);
      out += nfc_segment(s.substr(seg_start, end - seg_start));
      pending = end;
    }
    seg_start = end;
    seg_cps = 0;
    long_seg = false;
  };
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : sequence_length(s, i);
    if (len == 0) len = 1;
    const bool boundary = c < 0x80 || n.hasBoundaryBefore(UChar32(decode_at(s, i, len)));
    if (boundary && i > seg_start) end_segment(i);
    long_seg = long_seg || ++seg_cps > kNfcIcuSegment;
    i += len;
  }
  end_segment(s.size());
  icu_nfc_append(s.substr(pending), out);
  return out;
}

std::string escape(std::string_view s) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = sequence_length(s, i);
    if (n == 1) {
      if (c == '\n') out += "\\n";
      else if (c == '\t') out += "\\t";
      else if (c == '\r') out += "\\r";
      else if (c == '\\') out += "\\\\";
      else if (c < 0x20 || c == 0x7F) out += {'\\', 'x', hex[c >> 4], hex[c & 15]};
      else out.push_back(char(c));
      ++i;
    } else if (n == 0) {
      out += {'\\', 'x', hex[c >> 4], hex[c & 15]};
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace kvq::utf8

namespace kvq::byte_unicode {
namespace {

struct Maps {
  std::array<uint32_t, 256> to_cp{};
  std::array<int16_t, 512> to_byte{};  // every image lies below U+0144
  Maps() {
    to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_cp[b] = printable ? uint32_t(b) : next++;
      to_byte[to_cp[b]] = int16_t(b);
    }
  }
};
const Maps& maps() {
  static const Maps m;
  return m;
}

}  // namespace

uint32_t byte_to_codepoint(uint8_t b) { return maps().to_cp[b]; }

int codepoint_to_byte(uint32_t cp) { return cp < 512 ? maps().to_byte[cp] : -1; }

std::string encode(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) utf8::append(out, maps().to_cp[static_cast<unsigned char>(c)]);
  return out;
}

std::string decode(std::string_view text, bool* ok) {
  std::string out;
  out.reserve(text.size());
  if (ok) *ok = true;
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8::sequence_length(text, i);
    if (n == 0) {  // not UTF-8 at all: keep the byte
      out.push_back(text[i++]);
      if (ok) *ok = false;
      continue;
    }
    uint32_t cp = static_cast<unsigned char>(text[i]);
    if (n > 1) {
      cp &= (0x7F >> n);
      for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3F);
    }
    const int b = codepoint_to_byte(cp);
    if (b >= 0) {
      out.push_back(char(b));
    } else {
      out.append(text.substr(i, n));
      if (ok) *ok = false;
    }
    i += n;
  }
  return out;
}

}  // namespace kvq::byte_unicode
