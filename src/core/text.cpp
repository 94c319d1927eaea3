#include "core/text.hpp"

namespace kvq {
namespace {

// Length of the well-formed UTF-8 sequence at s[i], or 0 (Unicode Table 3-7).
size_t utf8_len(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c < 0x80) return 1;
  if (c < 0xC2) return 0;
  if (c < 0xE0) n = 2;
  else if (c < 0xF0) n = 3;
  else if (c < 0xF5) n = 4;
  else return 0;
  if (c == 0xE0) lo = 0xA0;
  else if (c == 0xED) hi = 0x9F;
  else if (c == 0xF0) lo = 0x90;
  else if (c == 0xF4) hi = 0x8F;
  if (i + n > s.size() || b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if ((b(i + k) & 0xC0) != 0x80) return 0;
  return n;
}

void hex_escape(std::string& out, unsigned char c) {
  static const char* hex = "0123456789abcdef";
  out += {'\\', 'x', hex[c >> 4], hex[c & 15]};
}

}  // namespace

std::string printable(std::string_view s, bool keep_newlines) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = utf8_len(s, i);
    if (n == 1) {
      if (c == '\n' && keep_newlines) out.push_back('\n');
      else if (c == '\n') out += "\\n";
      else if (c == '\r') out += "\\r";
      else if (c == '\t') out.push_back('\t');
      else if (c < 0x20 || c == 0x7F) hex_escape(out, c);
      else out.push_back(char(c));
      ++i;
    } else if (n == 0) {
      hex_escape(out, c);
      ++i;
    } else if (n == 2 && c == 0xC2 && static_cast<unsigned char>(s[i + 1]) < 0xA0) {  // C1 control
      out += "\\u00";
      static const char* hex = "0123456789abcdef";
      const unsigned char v = static_cast<unsigned char>(s[i + 1]);
      out += {hex[v >> 4], hex[v & 15]};
      i += 2;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

std::string ascii_lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
  return s;
}

std::string trim_space(std::string_view s) {
  auto space = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  size_t a = 0, b = s.size();
  while (a < b && space(s[a])) ++a;
  while (b > a && space(s[b - 1])) --b;
  return std::string(s.substr(a, b - a));
}

}  // namespace kvq
