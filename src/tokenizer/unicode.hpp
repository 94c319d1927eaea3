// UTF-8 helpers, Unicode normalization and the GPT-2 byte <-> unicode mapping
// used by byte-level BPE vocabularies. Unicode properties come from libraries
// (PCRE2 for the pre-tokenizer regexes, ICU for NFC), never from tables of our own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvq::utf8 {

// Length of the well-formed UTF-8 sequence starting at s[i] (1..4), or 0 when the
// bytes there are not a well-formed sequence (stray continuation, overlong form,
// surrogate, > U+10FFFF, or truncated at the end of s).
size_t sequence_length(std::string_view s, size_t i);

// Number of bytes that a lead byte announces (1..4), 0 for a continuation or invalid lead.
size_t expected_length(unsigned char lead);

bool is_valid(std::string_view s);

// Length of the longest prefix of s that does not end inside an incomplete (but so
// far well-formed) multi-byte sequence. Used by streaming decoders to hold back the
// start of a character whose remaining bytes have not arrived yet.
size_t complete_prefix(std::string_view s);

// Appends the UTF-8 encoding of code point cp.
void append(std::string& out, uint32_t cp);

// Replaces every ill-formed byte with U+FFFD (one per byte); valid text is unchanged.
std::string sanitize(std::string_view s);

// Unicode Normalization Form C of valid UTF-8 (ICU). ASCII and already-NFC
// text come back unchanged without copying more than once.
// Linear time on any input: ICU's canonical reordering is an insertion sort,
// quadratic in a run of combining marks (1 MB of alternating marks took
// minutes), so segments longer than kNfcIcuSegment code points between
// normalization boundaries are normalized by nfc_segment below instead.
std::string nfc(std::string_view s);
bool is_nfc(std::string_view s);

// Longest segment (code points from one normalization boundary to the next)
// handed to ICU as is; real text has segments of a few code points.
inline constexpr size_t kNfcIcuSegment = 32;
// NFC of valid UTF-8 by the Unicode algorithm itself (UAX #15): full canonical
// decomposition of each code point, canonical ordering by a stable sort of
// each run of non-starters (O(n log n)), then canonical composition in one
// pass. The property data (decompositions, combining classes, composites)
// come from ICU. Exposed so tests compare it with ICU's normalizer.
std::string nfc_segment(std::string_view s);

// Readable form of raw token bytes for terminals: printable UTF-8 as is, "\n",
// "\t", "\r", "\\" escaped, other control bytes and ill-formed bytes as \xNN.
std::string escape(std::string_view bytes);

}  // namespace kvq::utf8

namespace kvq::byte_unicode {

// GPT-2's reversible map from the 256 byte values to printable code points:
// bytes that are printable Latin-1 (0x21-0x7E, 0xA1-0xAC, 0xAE-0xFF) map to
// themselves; the remaining 68 map, in byte order, to U+0100, U+0101, ...
uint32_t byte_to_codepoint(uint8_t b);
// -1 when cp is not the image of a byte.
int codepoint_to_byte(uint32_t cp);

// "Hello world" -> "HelloĠworld" (each byte replaced by its code point in UTF-8).
std::string encode(std::string_view bytes);
// Inverse of encode; a code point outside the map is kept as its UTF-8 bytes
// (ok is cleared) so that malformed vocabularies degrade instead of failing.
std::string decode(std::string_view text, bool* ok = nullptr);

}  // namespace kvq::byte_unicode
