// Elementwise and row-wise CUDA kernels of the forward pass (everything but
// GEMV and attention), each a launch wrapper over device pointers. Each one
// has a CPU reference in backend/cpu/kernels.hpp and a test in tests/gpu/.
// C++17-clean: included by .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/attention.hpp"
#include "backend/cuda/gemv.hpp"

namespace kvq::cuda {

// out[t][:] = row ids[t] of `table`, dequantized to fp32 (ids: device memory,
// already range-checked by the caller).
void embed_rows(const GpuMatrix& table, const int32_t* ids, int n, float* out, cudaStream_t stream);

// Rows [r0, r0 + n_rows) of w dequantized to bf16 (bits), row-major [n_rows][cols]:
// the tile fed to cuBLAS for prefill GEMMs.
void dequantize_rows_bf16(const GpuMatrix& w, int64_t r0, int64_t n_rows, uint16_t* out, cudaStream_t stream);

// fp32 -> bf16 bits (round to nearest even), n values.
void f32_to_bf16(const float* x, uint16_t* y, size_t n, cudaStream_t stream);

// Same arithmetic as cpu::rms_norm (sum of squares in double). In place allowed.
void rms_norm(const float* x, const float* weight, int n_rows, int dim, float eps, float* y, cudaStream_t stream);
// The same, written as bf16 bits (each value rounded to nearest even, as
// f32_to_bf16 of rms_norm's output): the input of a prefill GEMM. Not in place.
void rms_norm_bf16(const float* x, const float* weight, int n_rows, int dim, float eps, uint16_t* y,
                   cudaStream_t stream);

// Same arithmetic as cpu::rope: angle (pos+t)*pos_scale*inv_freq[i] in double.
// inv_freq: device, head_dim/2 floats. neox: pairs (i, i+d/2), else (2i, 2i+1).
void rope(float* x, int n_tokens, int n_heads, int head_dim, int pos, const float* inv_freq, bool neox,
          double pos_scale, cudaStream_t stream);

// rope() for one step whose position lives in device memory (*pos_dev), so a
// recorded launch (CUDA graph) serves every position.
void rope_at(float* x, int n_tokens, int n_heads, int head_dim, const int* pos_dev, const float* inv_freq, bool neox,
             double pos_scale, cudaStream_t stream);

// *out = index of the largest of x[0..n) (device memory); NaN counts as -inf,
// the lowest index wins ties (the greedy Sampler's rule). work: 2 words of
// device memory, zero before the first call; every call leaves them zero.
// Calls sharing a work buffer must not run concurrently.
void argmax(const float* x, int n, int32_t* out, unsigned long long* work, cudaStream_t stream,
            const DeviceContext& ctx = default_context());
// The same for `rows` rows (row r at x + r * stride) into out[0..rows), and
// each row's largest value into value[0..rows) when value is not null (-inf
// when the row holds only NaN and -inf); work: 2 words per row, the same
// contract.
void argmax_rows(const float* x, int rows, int n, size_t stride, int32_t* out, float* value,
                 unsigned long long* work, cudaStream_t stream, const DeviceContext& ctx = default_context());

// The single-token form of: per-head RMSNorm of q and k (each only when its
// weight is non-null), RoPE of both at position pos (or *pos_dev when set),
// in place, and, when kv.k.code is set, k and v encoded into that store at
// the position with its encode hooks (exactly as write_kv). One launch, one warp per head; the same
// arithmetic as rms_norm + rope + write_kv. q [n_heads][head_dim], k and v
// [n_kv_heads][head_dim] fp32 device memory. q_in_attention: q is left
// as it is, for a decode attention given the matching QPrep
// (attention_decode.hpp) to norm and rotate itself (where the attention's
// plan says fused_q, attention_plan.hpp); that attention may then
// start as soon as this kernel's predecessor has finished, overlapping the
// store's encode with its keys.
bool qk_rope_store_supported(int head_dim);
// n_tok > 1: one token of each of n_tok rows of q, k, v (a batched decode
// step), token t at position pos_dev[t] and KV slot slot_dev[t] (device
// memory, kv/page.hpp); with n_tok == 1 and no slot_dev the slot is the
// position (a one-sequence store's identity table).
void qk_rope_store(float* q, float* k, const float* v, int n_heads, int n_kv_heads, int head_dim, const float* q_norm,
                   const float* k_norm, float eps, int pos, const int* pos_dev, const float* inv_freq, bool neox,
                   double pos_scale, const GpuKvLayer& kv, cudaStream_t stream, bool q_in_attention = false,
                   const DeviceContext& ctx = default_context(), int n_tok = 1, const int32_t* slot_dev = nullptr);

// out = silu(gate) * up; in place (out == gate) allowed.
void swiglu(const float* gate, const float* up, float* out, size_t n, cudaStream_t stream);
// The same, written as bf16 bits (rounded to nearest even): a prefill GEMM's input.
void swiglu_bf16(const float* gate, const float* up, uint16_t* out, size_t n, cudaStream_t stream);

// x += y.
void add(float* x, const float* y, size_t n, cudaStream_t stream);

}  // namespace kvq::cuda
