// Weight layout for the GPU GEMV kernels: the same quantized values and scales
// as the GGUF blocks (the stored type is kept; nothing is re-quantized), split
// into two arrays so that every row of codes is 16-byte aligned and a warp's
// lanes read consecutive 16-byte chunks:
//
//   F32 / F16 / BF16 : codes = the row-major matrix as stored; no scales.
//   Q8_0  : codes int8  [rows][cols]        scales fp16 [rows][cols/32]
//   Q4_0  : codes uint8 [rows][cols/2]      scales fp16 [rows][cols/32]
//           each 16-byte chunk is one block's nibbles in ggml order
//           (byte j: low nibble = weight j, high nibble = weight j+16), w = (q-8)*d
//   Q1_0  : codes uint32 [rows][cols/32]    scales fp16 [rows][cols/128]
//           w = bit ? +d : -d. GGUF stores weight 32i + j of a row at bit j of
//           (little-endian) word i; here each word is transposed as 4 x 8:
//           weight 32i + 4k + b sits at bit 8b + k, so (word >> k) & 0x01010101
//           is weights 4k..4k+3 as four 0/1 bytes, ready for one dp4a with
//           four int8 inputs (q1_transpose_word).
//   K-quants (256-weight super-blocks, gguf/quant.hpp), one record per super-block,
//   row-major, every record a multiple of 16 bytes:
//     Q4_K  : codes = the 144-byte block as stored (d, dmin, scales, nibbles)   no scales
//     Q5_K  : codes = the 176-byte block as stored                              no scales
//     Q6_K  : codes = ql, qh, int8 scales (208 bytes)           scales fp16 [rows][blocks]: d
//     Q2_K  : codes = scale/min bytes, 2-bit codes (80 bytes)   scales fp16 [rows][blocks][2]: d, dmin
//     Q3_K  : codes = high bits, low bits, 12 scale bytes, 4 zero bytes (112)
//                                                               scales fp16 [rows][blocks]: d
//   i.e. the fp16 super-scales that end a Q2_K/Q3_K/Q6_K block move to `scales`.
//
// This is plain CPU code (tested in CI); the CUDA backend uploads the result.
#pragma once

#include <cstdint>
#include <vector>

#include "gguf/types.hpp"

namespace kvq {

struct GpuMatrixLayout {
  gguf::TensorType type = gguf::TensorType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> codes;
  std::vector<uint16_t> scales;  // fp16 bits; empty for float types
};

// Per-super-block sizes of a K-quant in the GPU layout above.
struct GpuKQuantRecord {
  uint32_t code_bytes;  // multiple of 16
  uint32_t scales;      // fp16 super-scales moved to `scales` (0, 1 or 2)
};
GpuKQuantRecord gpu_kquant_record(gguf::TensorType t);  // throws for non-K-quants

// True when the GPU GEMV supports this type and column count (cols must be a
// multiple of 256 for quantized types and of 8 for float types).
bool gpu_gemv_supported(gguf::TensorType type, int64_t cols);

// `data` is a GGUF tensor with ne = {cols, rows}. Throws Errc::unsupported
// naming the type and shape when gpu_gemv_supported() is false.
GpuMatrixLayout pack_matrix_for_gpu(gguf::TensorType type, int64_t rows, int64_t cols,
                                    const uint8_t* data);

// The Q1_0 word transpose above (weight bit j -> bit 8 (j % 4) + j / 4) and its inverse.
uint32_t q1_transpose_word(uint32_t gguf_word);
uint32_t q1_untranspose_word(uint32_t gpu_word);

// Inverse of pack_matrix_for_gpu (tests): back to GGUF block bytes.
std::vector<uint8_t> unpack_matrix_from_gpu(const GpuMatrixLayout& m);

}  // namespace kvq
