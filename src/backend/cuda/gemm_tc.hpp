// Tensor-core batched weight product for decode steps of many sequences
// (issue 25, item 4): the same request and results as gemv_batch()
// (gemv_batch.hpp) — per input row b, u_b = x_b or RMSNorm(x_b) * norm_weight,
// y_i[b] = W_i u_b, y_i[b] += W_i u_b, or y[b] = silu(W_gate u_b) * (W_up u_b)
// — computed with int8 mma.sync (m16n8k32) instead of dp4a, so that B = 16..64
// rows stay cheap where gemv_batch becomes compute-bound.
//
// Types: Q8_0, Q4_0, Q1_0 (gemm_tc_supported()). Each input row is staged as
// int8 per 32 values exactly as gemv()/gemv_batch() stage it (the shared
// quantize4_int8, stage_int8.cuh), each 32-value block's integer dot product
// is exact (the same integer dp4a sums), and d_w * d_x is applied in fp32
// per block; so results differ from gemv_batch() only in the order of fp32
// sums, and identical input rows give bit-identical output rows.
// Not here: F32/F16/BF16 and the K-quants (Q2_K..Q6_K) — they stay on
// gemv_batch().
//
// Any batch >= 1: up to kGemmTcMax rows of x per launch, every weight read
// once per launch; a larger batch is split into launches of kGemmTcMax rows.
// The weights are never expanded in global memory. x is quantized to int8
// once per launch by a small kernel into a caller-owned workspace
// (gemm_tc_workspace_bytes()), which the GEMM's CTAs copy their K slices
// from; without a workspace every CTA quantizes its K slice itself (the
// original path, kept for A/B measurements: same results bit for bit).
// Partial sums over K are reduced through the distributed shared memory of
// a thread-block cluster. Hopper (sm_90) only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/gemv_batch.hpp"

namespace kvq::cuda {

// Rows of x one launch reads the weights for.
constexpr int kGemmTcMax = 64;

// True for the weight types gemm_tc() multiplies (Q8_0, Q4_0, Q1_0). Column
// counts are those of gpu_gemv_supported() (a multiple of 256).
bool gemm_tc_supported(gguf::TensorType t);

// Device scratch of a gemm_tc() call: x quantized once per launch.
struct GemmTcWorkspace {
  // Device memory, 16-byte aligned, at least gemm_tc_workspace_bytes(batch,
  // cols) bytes; reused by the launches of one call (stream order) and free
  // again when the call's last kernel has finished. Null: every CTA stages
  // its own K slice of x (no prestaging pass; slower, same results).
  void* data = nullptr;
  size_t bytes = 0;
};

// Workspace bytes a gemm_tc() call of `batch` rows of `cols` values needs
// (batch > kGemmTcMax: that of kGemmTcMax rows).
size_t gemm_tc_workspace_bytes(int batch, int64_t cols);

// One fused batched product (GemvBatchRequest as for gemv_batch();
// warps_per_cta is ignored). Throws Errc::unsupported for other types and
// Errc::internal for a workspace that is too small.
void gemm_tc(const GemvBatchRequest& req, const GemmTcWorkspace& ws, cudaStream_t stream,
             const DeviceContext& ctx = default_context());

// y[b][rows] = W x[b] for b < batch (no norm, store), with a workspace.
void gemm_tc(const GpuMatrix& w, const float* x, int batch, float* y, const GemmTcWorkspace& ws, cudaStream_t stream,
             const DeviceContext& ctx = default_context());

}  // namespace kvq::cuda
