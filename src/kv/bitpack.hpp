// Bit packing shared by every block. Bit order: LSB-first within little-endian
// 32-bit words, i.e. field i of a b-bit plane (b in {1, 2, 4, 8}) occupies bits
// [b*i, b*i + b) of the plane; fields never straddle a byte, so the byte view
// and the 32-bit word view agree on a little-endian machine (x86, every GPU).
// An N-bit code is split into planes that never straddle: N=1 [1], 2 [2],
// 3 [2 (low bits), 1 (high bit)], 4 [4], 8 [8]. Each plane starts on a 4-byte
// boundary (plane bytes rounded up to a multiple of 4).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvq::kv {

inline size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

inline size_t plane_bytes(int n, int b) { return round_up((size_t(n) * b + 7) / 8, 4); }

// Sizes of the planes of an N-bit code: first plane bits and the second (0 if none).
inline void code_planes(int bits, int& first, int& second) {
  first = bits == 3 ? 2 : bits;
  second = bits == 3 ? 1 : 0;
}

inline size_t code_bytes(int n, int bits) {
  int a, b;
  code_planes(bits, a, b);
  return plane_bytes(n, a) + (b ? plane_bytes(n, b) : 0);
}

// b in {1, 2, 4, 8}
inline void pack_plane(const uint8_t* idx, int n, int b, uint8_t* out) {
  const size_t nb = plane_bytes(n, b);
  for (size_t i = 0; i < nb; ++i) out[i] = 0;
  const unsigned mask = (1u << b) - 1u;
  for (int i = 0; i < n; ++i) {
    const size_t bit = size_t(i) * b;
    out[bit >> 3] |= uint8_t((idx[i] & mask) << (bit & 7));
  }
}

inline unsigned plane_get(const uint8_t* plane, int i, int b) {
  const size_t bit = size_t(i) * b;
  return (plane[bit >> 3] >> (bit & 7)) & ((1u << b) - 1u);
}

// Pack n N-bit codes (values < 2^N) into their planes starting at out.
inline void pack_codes(const uint8_t* idx, int n, int bits, uint8_t* out) {
  int a, b;
  code_planes(bits, a, b);
  if (!b) {
    pack_plane(idx, n, a, out);
    return;
  }
  // 3-bit: low 2 bits in the first plane, high bit in the second.
  uint8_t tmp[1024];
  for (int i = 0; i < n; ++i) tmp[i] = idx[i] & 3u;
  pack_plane(tmp, n, 2, out);
  for (int i = 0; i < n; ++i) tmp[i] = uint8_t(idx[i] >> 2);
  pack_plane(tmp, n, 1, out + plane_bytes(n, 2));
}

// One plane into idx (overwrite) or OR-ed in at bit `shift` (accumulate).
inline void unpack_plane(const uint8_t* plane, int n, int b, uint8_t* idx, bool accumulate, int shift) {
  const int per_byte = 8 / b;
  const unsigned mask = (1u << b) - 1u;
  int i = 0;
  for (; i + per_byte <= n; i += per_byte) {
    unsigned byte = plane[i / per_byte];
    for (int k = 0; k < per_byte; ++k, byte >>= b) {
      const uint8_t v = uint8_t((byte & mask) << shift);
      idx[i + k] = accumulate ? uint8_t(idx[i + k] | v) : v;
    }
  }
  for (; i < n; ++i) {
    const uint8_t v = uint8_t(plane_get(plane, i, b) << shift);
    idx[i] = accumulate ? uint8_t(idx[i] | v) : v;
  }
}

inline void unpack_codes(const uint8_t* in, int n, int bits, uint8_t* idx) {
  int a, b;
  code_planes(bits, a, b);
  unpack_plane(in, n, a, idx, false, 0);
  if (b) unpack_plane(in + plane_bytes(n, a), n, 1, idx, true, 2);
}

}  // namespace kvq::kv
