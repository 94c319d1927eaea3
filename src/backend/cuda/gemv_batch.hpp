// Batched decode GEMV: the products of B sequences' decode steps against one
// set of weights in one launch, reading every weight row once for all B
// inputs (issue 25). Same fused forms as gemv() (gemv.hpp), per input row b:
//
//   input     u_b = x_b, or u_b = RMSNorm(x_b) * norm_weight   (prologue)
//   products  W_i u_b for up to three matrices of one type and width
//   output    y_i[b] = W_i u_b,  y_i[b] += W_i u_b (residual),  or
//             y[b] = silu(W_gate u_b) * (W_up u_b)               (epilogue)
//
// Arithmetic per type is gemv()'s: F32/F16/BF16 multiply fp32 u by the
// weights; Q8_0/Q4_0/Q1_0 and the K-quants stage u as int8 per 32 values
// (scale = amax / 127, round to nearest) and use dp4a (K-quants: over runs
// of 16 weights, kquant_runs.cuh), so each input element differs from the
// CPU's by at most half its quantization step (the bound tests/gpu/
// test_gemv.cpp and test_gemv_batch.cpp check). Only the order of the fp32
// sums differs from gemv(), so results agree with it within those bounds,
// not bit for bit; identical input rows give bit-identical output rows.
//
// Any batch >= 1 is accepted: up to kGemvBatchMax rows of x per launch (one
// read of the weights); a larger batch is split into launches of at most
// kGemvBatchMax rows, each reading the weights again. Past ~16 rows the
// product is a small GEMM and belongs on tensor cores (docs/perf.md,
// "Batched GEMV").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/gemv.hpp"

namespace kvq::cuda {

// Rows of x one launch reads the weights for.
constexpr int kGemvBatchMax = 16;

// One fused batched launch. All matrices have the same type and cols; for
// swiglu n_out == 2 (gate, up) with equal rows and the result goes to
// out[0].y (out[1].y is not written and may be null). Rows of x past
// `batch` are not read, rows of y past `batch` not written. No y may
// overlap x or norm_weight.
struct GemvBatchRequest {
  const float* x = nullptr;            // device, [batch][cols] fp32 row-major
  int batch = 1;                       // B >= 1
  const float* norm_weight = nullptr;  // device, cols floats; null: no norm
  float norm_eps = 0.0f;
  GemvOut out[3];                      // y: device, [batch][w->rows] fp32 row-major
  int n_out = 1;
  GemvEpilogue epilogue = GemvEpilogue::store;
  // Launch shape: 16 (one CTA of 16 warps per SM) or 8 (two CTAs of 8 per
  // SM); for A/B measurements in the kernel lab.
  int warps_per_cta = 16;
};

void gemv_batch(const GemvBatchRequest& req, cudaStream_t stream, const DeviceContext& ctx = default_context());

// y[b][rows] = W x[b] for b < batch (no norm, store).
void gemv_batch(const GpuMatrix& w, const float* x, int batch, float* y, cudaStream_t stream,
                const DeviceContext& ctx = default_context());

// Bytes one launch of up to kGemvBatchMax rows must move, for bandwidth
// reports: the weights once, plus batch rows of x and of y.
uint64_t gemv_batch_bytes(const GpuMatrix& w, int batch);

}  // namespace kvq::cuda
