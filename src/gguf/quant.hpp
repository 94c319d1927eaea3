// Scalar reference (de)quantizers for every tensor type in the type table.
// These are the oracle for backend kernels and what the synthetic-model writer
// uses to produce quantized weights.
//
// Block layouts (little endian, d = fp16 scale):
//   Q8_0 (32 weights, 34 bytes): d | int8 q[32]           w = q * d
//   Q4_0 (32 weights, 18 bytes): d | uint8 qs[16]         w = (nibble - 8) * d
//        qs[j] low nibble = weight j, high nibble = weight j + 16
//   Q1_0 (128 weights, 18 bytes): d | uint8 bits[16]      w = bit ? +d : -d
//        weight j is bit (j % 8) of bits[j / 8] (LSB first)
//
// K-quants (ggml's QK_K = 256 weights per super-block; i = 0..255 below):
//   Q4_K (144 bytes): d | dmin | uint8 sm[12] | uint8 qs[128]
//        sub-block s = i / 32 has a 6-bit scale sc(s) and 6-bit min m(s) packed in sm:
//          s < 4: sc = sm[s] & 63,  m = sm[s + 4] & 63
//          s >= 4: sc = (sm[s + 4] & 15) | (sm[s - 4] >> 6) << 4,  m = (sm[s + 4] >> 4) | (sm[s] >> 6) << 4
//        q = nibble of qs[32 (i / 64) + i % 32]: low for even s, high for odd s
//        w = d * sc(s) * q - dmin * m(s)
//   Q5_K (176 bytes): d | dmin | uint8 sm[12] | uint8 qh[32] | uint8 qs[128]
//        as Q4_K plus a fifth bit: q += 16 * ((qh[i % 32] >> s) & 1)
//   Q6_K (210 bytes): uint8 ql[128] | uint8 qh[64] | int8 sc[16] | d
//        with h = i / 128, g = (i % 128) / 32, l = i % 32:
//        low 4 bits = nibble of ql[64 h + 32 (g % 2) + l] (low for g < 2, high for g >= 2)
//        high 2 bits = (qh[32 h + l] >> 2 g) & 3;  w = d * sc[i / 16] * (q - 32)
//   Q2_K (84 bytes): uint8 sm[16] | uint8 qs[64] | d | dmin
//        with n = i / 128, j = (i % 128) / 32, l = i % 32, k = i / 16:
//        q = (qs[32 n + l] >> 2 j) & 3;  w = d * (sm[k] & 15) * q - dmin * (sm[k] >> 4)
//   Q3_K (110 bytes): uint8 hm[32] | uint8 qs[64] | uint8 sc12[12] | d
//        n, j, l, k as Q2_K; q = ((qs[32 n + l] >> 2 j) & 3) - (((hm[l] >> (4 n + j)) & 1) ? 0 : 4)
//        6-bit scale of sub-block k: low 4 bits = k < 8 ? sc12[k] & 15 : sc12[k - 8] >> 4,
//        high 2 bits = (sc12[8 + k % 4] >> 2 (k / 4)) & 3;  w = d * (scale - 32) * q
//   All products are evaluated as (d * sc) * q - (dmin * m) in fp32.
#pragma once

#include <cstdint>

#include "gguf/types.hpp"

namespace kvq::gguf {

// n must be a multiple of the type's block size (throws Errc::invalid_argument otherwise).
void dequantize_row(TensorType t, const uint8_t* src, float* dst, int64_t n);

// Quantizers:
//   Q8_0: d = amax / 127, q = round-to-nearest(x / d)
//   Q4_0: as ggml: d = m / -8 where m is the value of largest magnitude (with its sign),
//         q = min(15, int(x / d + 8.5))
//   Q1_0: d = mean |x| over the block, bit = (x >= 0)
//   K-quants (simple, not llama.cpp's error-minimising search): per sub-block
//     a scale (and, for Q2_K/Q4_K/Q5_K, a min = -min(0, min x)) covering its
//     range; the scales (mins) quantized against d = max / (their max code);
//     q = round((x + min) / (d * sc)) clamped to the code range.
//   F16 / BF16: round to nearest even; F32: copy.
void quantize_row(TensorType t, const float* src, uint8_t* dst, int64_t n);

}  // namespace kvq::gguf
