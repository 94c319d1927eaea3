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
//   F16 / BF16: round to nearest even; F32: copy.
void quantize_row(TensorType t, const float* src, uint8_t* dst, int64_t n);

}  // namespace kvq::gguf
