// Decode-time matrix-vector products on the GPU, reading the layout of
// backend/gpu_layout.hpp, with the neighbouring elementwise work of the
// forward pass fused in so that a decode step needs few launches:
//
//   input     u = x, or u = RMSNorm(x) * norm_weight          (prologue)
//   products  W_i u for up to three matrices of one type and width
//             (Q/K/V of a layer share one launch)
//   output    y_i = W_i u,  y_i += W_i u (residual),  or
//             y = silu(W_gate u) * (W_up u)                   (epilogue)
//
// Every CTA stages u in shared memory once and its warps then stream weight
// rows (16-byte loads, several in flight per lane). Float types (F32/F16/BF16)
// multiply in fp32. Quantized types (Q8_0/Q4_0/Q1_0) stage u as int8 per 32
// values (scale = amax/127, round to nearest) and use integer dot products
// (dp4a); the only difference from the CPU reference is that rounding of u,
// bounded per element by half a quantization step (tests check that bound).
// K-quants (Q2_K..Q6_K) have their own kernel (gemv_kquant.hpp) behind the
// same request, with the same int8 input and dp4a over each run of 16 weights.
// With a norm, u = x * norm_weight is what gets staged and the row's 1/rms is
// applied to each finished dot product (the same value up to rounding).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/device_buffer.hpp"
#include "backend/cuda/device_context.hpp"
#include "backend/gpu_layout.hpp"

namespace kvq::cuda {

// A weight matrix resident on the GPU.
struct GpuMatrix {
  gguf::TensorType type = gguf::TensorType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  DeviceBuffer<uint8_t> codes;
  DeviceBuffer<uint16_t> scales;

  static GpuMatrix upload(const GpuMatrixLayout& layout);
  size_t bytes() const { return codes.bytes() + scales.bytes(); }
};

enum class GemvEpilogue { store, add, swiglu };

struct GemvOut {
  const GpuMatrix* w = nullptr;
  float* y = nullptr;  // device, w->rows floats
};

// One fused launch (see the top of this file). All matrices have the same
// type and cols; for swiglu n_out == 2 (gate, up) with equal rows and the
// result goes to out[0].y. No y may overlap x or norm_weight.
struct GemvRequest {
  const float* x = nullptr;            // device, cols floats
  const float* norm_weight = nullptr;  // device, cols floats; null: no norm
  float norm_eps = 0.0f;
  GemvOut out[3];
  int n_out = 1;
  GemvEpilogue epilogue = GemvEpilogue::store;
  // Kernel-lab timeline (dp4a and float kernels): 8 device uint64 the launch
  // folds its CTAs' global-timer readings into, as min/max pairs of: CTA
  // start, predecessor wait returned, input staged, CTA end. The caller sets
  // the mins to UINT64_MAX and the maxes to 0 first. Null: no timing.
  unsigned long long* trace = nullptr;
};

// The launch shape (warps per CTA) is ctx.settings.gemv_warps, read when the
// launch is issued.
void gemv(const GemvRequest& req, cudaStream_t stream, const DeviceContext& ctx = default_context());

// y[rows] = W[rows][cols] x[cols] (no norm, store).
void gemv(const GpuMatrix& w, const float* x, float* y, cudaStream_t stream,
          const DeviceContext& ctx = default_context());

// True when gemv() (and gemv_batch()) of this matrix type rounds its input
// to integers (int8 per 32 values, round-to-nearest of u * (127 / amax)):
// the block types and the K-quants (gemv_kquant.hpp).
constexpr bool gemv_quantizes_x(gguf::TensorType t) {
  using gguf::TensorType;
  return t == TensorType::Q8_0 || t == TensorType::Q4_0 || t == TensorType::Q1_0 || t == TensorType::Q2_K ||
         t == TensorType::Q3_K || t == TensorType::Q4_K || t == TensorType::Q5_K || t == TensorType::Q6_K;
}

// Bytes the kernel must read from device memory for one product (weights + x),
// for bandwidth reports.
uint64_t gemv_bytes(const GpuMatrix& w);

}  // namespace kvq::cuda
