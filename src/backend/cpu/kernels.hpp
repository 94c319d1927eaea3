// CPU reference kernels: fp32 arithmetic over weights in their stored GGUF
// type, dequantized on the fly. These are the oracle every GPU kernel is
// compared with, so each one is written to be plainly correct first; speed
// comes from blocking and OpenMP, never from changing the arithmetic.
//
// Weight block layouts (ggml conventions; d is an IEEE fp16 scale):
//   F32, F16, BF16 : plain arrays
//   Q8_0 : 32 weights = { f16 d; int8 q[32] }             w = d * q         (34 bytes)
//   Q4_0 : 32 weights = { f16 d; uint8 q[16] }            w[j]    = d * ((q[j] & 15) - 8)
//                                                          w[j+16] = d * ((q[j] >> 4) - 8)  (18 bytes)
//   Q1_0 : 128 weights = { f16 d; uint8 bits[16] }        w[i] = bit i (LSB first) ? +d : -d (18 bytes)
//   Q2_K, Q3_K, Q4_K, Q5_K, Q6_K : 256-weight super-blocks of 84, 110, 144,
//          176, 210 bytes with per-sub-block scales (layouts in gguf/quant.hpp)
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/backend.hpp"

namespace kvq::cpu {

// True for the weight types these kernels implement.
bool supports_weight_type(gguf::TensorType t);
// Names of the supported weight types, for error messages ("F32, F16, ...").
const char* supported_weight_types();
// Weights per block and bytes per block of a supported type (throws for others).
int block_size(gguf::TensorType t);
size_t block_bytes(gguf::TensorType t);
size_t row_bytes(gguf::TensorType t, int64_t n);

// Dequantizes n weights (n a multiple of the block size) starting at a block boundary.
void dequantize_row(gguf::TensorType t, const uint8_t* src, float* dst, int64_t n);
// Fused dequantize + dot product of one stored row with fp32 x (n values).
float dot_row(gguf::TensorType t, const uint8_t* row, const float* x, int64_t n);

float dot_f32(const float* a, const float* b, int64_t n);

// y[t][r] = sum_c W[r][c] * x[t][c]: one row of W per output feature. For few
// tokens each output is a fused dot over the stored row; for a prefill chunk a
// block of W rows is dequantized once into an fp32 tile and multiplied by all
// tokens. Parallel over output rows; every output element is computed by one
// thread in a fixed order, so results do not depend on the thread count.
void matmul(const Matrix& w, const float* x, int n_tokens, float* y);

void rms_norm(const float* x, const float* weight, int n_rows, int dim, float eps, float* y);
void rope(float* x, int n_tokens, int n_heads, int head_dim, int pos, const Rope& rope);
void swiglu(const float* gate, const float* up, float* out, size_t n);
void add(float* x, const float* y, size_t n);
// In-place softmax over n values; returns nothing, handles -inf entries.
void softmax(float* x, int64_t n);

// Plain causal grouped-query attention over fp32 K/V rows: the arithmetic
// definition every cache's attend() is compared with.
//   q [n][n_heads][head_dim], k/v [n_ctx][n_kv_heads][head_dim] (rows 0..pos+n-1),
//   out [n][n_heads][head_dim]; query t sees rows 0..pos+t.
void attention_f32(const float* q, const float* k, const float* v, int pos, int n, int n_heads,
                   int n_kv_heads, int head_dim, float scale, float* out);

}  // namespace kvq::cpu
