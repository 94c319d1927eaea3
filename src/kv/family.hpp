// The KV block families. Both backends switch on this enum (the CUDA codec
// hooks are specialised per family); nothing compares family names as
// strings. C++17-clean: CUDA sources include it.
#pragma once

#include <cstdint>

namespace kvq::kv {

enum class Family : uint8_t { bf16, q8, rq8, fp8, turbo, tcq, iso, rotor, planar };
const char* family_name(Family f);  // "bf16", "q8", ..., "planar"
// Families whose name carries the bit count ("turbo3"); the others are fixed-width.
inline bool family_has_bits(Family f) {
  return f == Family::turbo || f == Family::tcq || f == Family::iso || f == Family::rotor || f == Family::planar;
}

}  // namespace kvq::kv
