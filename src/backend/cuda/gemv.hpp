// Decode-time matrix-vector products y = W x on the GPU, one kernel per
// weight type, reading the layout of backend/gpu_layout.hpp.
//
// Float types (F32/F16/BF16) multiply in fp32 against fp32 x. Quantized types
// (Q8_0/Q4_0/Q1_0) first quantize x to int8 per 32 values (scale = amax/127,
// round to nearest) and use integer dot products (dp4a) per block; the only
// difference from the CPU reference is that rounding of x, bounded per
// element by half a quantization step (tests check exactly that bound).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/device_buffer.hpp"
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

// Scratch for the int8 copy of x (sized for the widest matrix).
struct GemvScratch {
  DeviceBuffer<int8_t> xq;     // [cols]
  DeviceBuffer<float> xscale;  // [cols/32]
  DeviceBuffer<int32_t> xsum;  // [cols/32]
  void reserve(int64_t max_cols);
};

// y[rows] = W[rows][cols] x[cols]; x, y device pointers (fp32).
// x_quantized: the scratch already holds this x quantized (a previous gemv of
// a quantized matrix with the same x and cols, nothing written to x since);
// then quantized types skip the quantize launch (Q/K/V and gate/up share x).
void gemv(const GpuMatrix& w, const float* x, float* y, GemvScratch& scratch, cudaStream_t stream,
          bool x_quantized = false);

// True when gemv() of this matrix type quantizes x into the scratch.
inline bool gemv_quantizes_x(gguf::TensorType t) {
  return t == gguf::TensorType::Q8_0 || t == gguf::TensorType::Q4_0 || t == gguf::TensorType::Q1_0;
}

// Bytes the kernel must read from device memory for one product (weights + x),
// for bandwidth reports.
uint64_t gemv_bytes(const GpuMatrix& w);

}  // namespace kvq::cuda
