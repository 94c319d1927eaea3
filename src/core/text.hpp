// Text from files and users made safe to print on a terminal.
#pragma once

#include <string>
#include <string_view>

namespace kvq {

// `s` with every byte a terminal could act on written as an escape: C0
// control bytes (ESC, BEL, CR, ... and, unless keep_newlines, '\n'), DEL, C1
// controls (U+0080..U+009F) and bytes that are not well-formed UTF-8 become
// \xNN (\n, \r, \t as such); tabs and everything else, including printable
// non-ASCII text, pass through unchanged. Backslashes are not doubled: this
// is for display, not a reversible encoding.
std::string printable(std::string_view s, bool keep_newlines = false);

// `s` with ASCII letters lowered; every other byte unchanged (names and
// options, not text: no locale, no Unicode case folding).
std::string ascii_lower(std::string s);
// `s` without leading and trailing ASCII whitespace (space, \t, \n, \v, \f, \r).
std::string trim_space(std::string_view s);

}  // namespace kvq
