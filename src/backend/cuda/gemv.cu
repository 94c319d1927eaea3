// GEMV kernels. Layouts: see backend/gpu_layout.hpp (codes and fp16 scales in
// separate arrays, rows 16-byte aligned).
//
// Work split (all types): one warp computes ROWS consecutive output rows; each
// lane walks the row in 16- or 32-byte chunks strided by the warp, loads the
// matching piece of x once and reuses it for all ROWS rows, so x traffic is
// amortised and weight reads are coalesced 16-byte loads.
#include "backend/cuda/gemv.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/error.hpp"

namespace kvq::cuda {

using gguf::TensorType;

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kRows = 4;  // output rows per warp

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float half_bits_to_float(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}

// Spread 4 sign bits (LSB = first weight) into 4 bytes of 0/1.
__device__ __forceinline__ int spread_nibble(uint32_t n) {
  return int(((n & 0xfu) * 0x00204081u) & 0x01010101u);
}

// --- x quantization: one warp per 32 values --------------------------------
__global__ void quantize_x_kernel(const float* __restrict__ x, int8_t* __restrict__ xq,
                                  float* __restrict__ xscale, int32_t* __restrict__ xsum, int n_groups) {
  const int group = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (group >= n_groups) return;
  const float v = x[group * 32 + lane];
  float amax = fabsf(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = amax / 127.0f;
  const int q = scale > 0.0f ? __float2int_rn(v / scale) : 0;
  xq[group * 32 + lane] = int8_t(q);
  int s = q;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) {
    xscale[group] = scale;
    xsum[group] = s;
  }
}

// --- float weights -----------------------------------------------------------
template <typename T>
__device__ __forceinline__ void load8(const T* p, float out[8]);

template <>
__device__ __forceinline__ void load8<float>(const float* p, float out[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
template <>
__device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* p, float out[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void load8<__half>(const __half* p, float out[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <typename T>
__global__ void gemv_float_kernel(const T* __restrict__ w, const float* __restrict__ x,
                                  float* __restrict__ y, int rows, int cols) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = warp * kRows;
  if (row0 >= rows) return;
  float acc[kRows] = {};
  for (int c = lane * 8; c < cols; c += 32 * 8) {
    float xv[8];
    load8<float>(x + c, xv);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < rows) {
        float wv[8];
        load8<T>(w + size_t(row0 + r) * cols + c, wv);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r] = fmaf(wv[i], xv[i], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float s = warp_sum(acc[r]);
    if (lane == 0 && row0 + r < rows) y[row0 + r] = s;
  }
}

// --- Q8_0: lane chunk = 16 weights (half a block) -----------------------------
__global__ void gemv_q8_0_kernel(const int8_t* __restrict__ codes, const uint16_t* __restrict__ scales,
                                 const int8_t* __restrict__ xq, const float* __restrict__ xscale,
                                 float* __restrict__ y, int rows, int cols) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = warp * kRows;
  if (row0 >= rows) return;
  const int blocks = cols / 32;
  float acc[kRows] = {};
  for (int c = lane * 16; c < cols; c += 32 * 16) {
    const int4 xv = *reinterpret_cast<const int4*>(xq + c);
    const float sx = xscale[c / 32];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < rows) {
        const int4 wv = *reinterpret_cast<const int4*>(codes + size_t(row0 + r) * cols + c);
        int dot = __dp4a(wv.x, xv.x, 0);
        dot = __dp4a(wv.y, xv.y, dot);
        dot = __dp4a(wv.z, xv.z, dot);
        dot = __dp4a(wv.w, xv.w, dot);
        const float d = half_bits_to_float(scales[size_t(row0 + r) * blocks + c / 32]);
        acc[r] = fmaf(d * sx, float(dot), acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float s = warp_sum(acc[r]);
    if (lane == 0 && row0 + r < rows) y[row0 + r] = s;
  }
}

// --- Q4_0: lane chunk = one block (16 code bytes, 32 weights) -----------------
__global__ void gemv_q4_0_kernel(const uint8_t* __restrict__ codes, const uint16_t* __restrict__ scales,
                                 const int8_t* __restrict__ xq, const float* __restrict__ xscale,
                                 const int32_t* __restrict__ xsum, float* __restrict__ y, int rows, int cols) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = warp * kRows;
  if (row0 >= rows) return;
  const int blocks = cols / 32;
  float acc[kRows] = {};
  for (int b = lane; b < blocks; b += 32) {
    const int4 xa = reinterpret_cast<const int4*>(xq + b * 32)[0];  // weights 0..15
    const int4 xb = reinterpret_cast<const int4*>(xq + b * 32)[1];  // weights 16..31
    const float sx = xscale[b];
    const int sq = xsum[b];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < rows) {
        const uint4 q = *reinterpret_cast<const uint4*>(codes + (size_t(row0 + r) * blocks + b) * 16);
        int dot = __dp4a(int(q.x & 0x0f0f0f0fu), xa.x, 0);
        dot = __dp4a(int(q.y & 0x0f0f0f0fu), xa.y, dot);
        dot = __dp4a(int(q.z & 0x0f0f0f0fu), xa.z, dot);
        dot = __dp4a(int(q.w & 0x0f0f0f0fu), xa.w, dot);
        dot = __dp4a(int((q.x >> 4) & 0x0f0f0f0fu), xb.x, dot);
        dot = __dp4a(int((q.y >> 4) & 0x0f0f0f0fu), xb.y, dot);
        dot = __dp4a(int((q.z >> 4) & 0x0f0f0f0fu), xb.z, dot);
        dot = __dp4a(int((q.w >> 4) & 0x0f0f0f0fu), xb.w, dot);
        const float d = half_bits_to_float(scales[size_t(row0 + r) * blocks + b]);
        acc[r] = fmaf(d * sx, float(dot - 8 * sq), acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float s = warp_sum(acc[r]);
    if (lane == 0 && row0 + r < rows) y[row0 + r] = s;
  }
}

// --- Q1_0: lane chunk = one 32-bit word of signs (32 weights, one x group) ----
// sum_j s_j x_j with s = +-1 equals 2 * sum_{bit=1} x_j - sum_j x_j.
__global__ void gemv_q1_0_kernel(const uint32_t* __restrict__ bits, const uint16_t* __restrict__ scales,
                                 const int8_t* __restrict__ xq, const float* __restrict__ xscale,
                                 const int32_t* __restrict__ xsum, float* __restrict__ y, int rows, int cols) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = warp * kRows;
  if (row0 >= rows) return;
  const int words = cols / 32;
  const int blocks = cols / 128;
  float acc[kRows] = {};
  for (int wi = lane; wi < words; wi += 32) {
    const int4 xa = reinterpret_cast<const int4*>(xq + wi * 32)[0];
    const int4 xb = reinterpret_cast<const int4*>(xq + wi * 32)[1];
    const float sx = xscale[wi];
    const int sq = xsum[wi];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < rows) {
        const uint32_t b = bits[size_t(row0 + r) * words + wi];
        int dot = __dp4a(spread_nibble(b), xa.x, 0);
        dot = __dp4a(spread_nibble(b >> 4), xa.y, dot);
        dot = __dp4a(spread_nibble(b >> 8), xa.z, dot);
        dot = __dp4a(spread_nibble(b >> 12), xa.w, dot);
        dot = __dp4a(spread_nibble(b >> 16), xb.x, dot);
        dot = __dp4a(spread_nibble(b >> 20), xb.y, dot);
        dot = __dp4a(spread_nibble(b >> 24), xb.z, dot);
        dot = __dp4a(spread_nibble(b >> 28), xb.w, dot);
        const float d = half_bits_to_float(scales[size_t(row0 + r) * blocks + wi / 4]);
        acc[r] = fmaf(d * sx, float(2 * dot - sq), acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float s = warp_sum(acc[r]);
    if (lane == 0 && row0 + r < rows) y[row0 + r] = s;
  }
}

}  // namespace

GpuMatrix GpuMatrix::upload(const GpuMatrixLayout& layout) {
  GpuMatrix m;
  m.type = layout.type;
  m.rows = layout.rows;
  m.cols = layout.cols;
  m.codes.upload(layout.codes);
  if (!layout.scales.empty()) m.scales.upload(layout.scales);
  return m;
}

void GemvScratch::reserve(int64_t max_cols) {
  const size_t groups = size_t((max_cols + 31) / 32);
  if (xq.size() < groups * 32) {
    xq.resize(groups * 32);
    xscale.resize(groups);
    xsum.resize(groups);
  }
}

uint64_t gemv_bytes(const GpuMatrix& w) {
  return w.bytes() + uint64_t(w.cols) * sizeof(float) + uint64_t(w.rows) * sizeof(float);
}

void gemv(const GpuMatrix& w, const float* x, float* y, GemvScratch& scratch, cudaStream_t stream) {
  KVQ_CHECK(gpu_gemv_supported(w.type, w.cols), Errc::unsupported, "GPU GEMV: unsupported ",
            gguf::tensor_type_name(w.type), " matrix with ", w.cols, " columns");
  KVQ_CHECK(w.rows <= (int64_t(1) << 30) && w.cols <= (int64_t(1) << 30), Errc::out_of_range,
            "GPU GEMV: matrix too large");
  const int rows = int(w.rows), cols = int(w.cols);
  const int warps = (rows + kRows - 1) / kRows;
  const int grid = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int threads = kWarpsPerBlock * 32;
  switch (w.type) {
    case TensorType::F32:
      gemv_float_kernel<float><<<grid, threads, 0, stream>>>(
          reinterpret_cast<const float*>(w.codes.data()), x, y, rows, cols);
      break;
    case TensorType::F16:
      gemv_float_kernel<__half><<<grid, threads, 0, stream>>>(
          reinterpret_cast<const __half*>(w.codes.data()), x, y, rows, cols);
      break;
    case TensorType::BF16:
      gemv_float_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(
          reinterpret_cast<const __nv_bfloat16*>(w.codes.data()), x, y, rows, cols);
      break;
    case TensorType::Q8_0:
    case TensorType::Q4_0:
    case TensorType::Q1_0: {
      scratch.reserve(cols);
      const int groups = cols / 32;
      quantize_x_kernel<<<(groups * 32 + 127) / 128, 128, 0, stream>>>(
          x, scratch.xq.data(), scratch.xscale.data(), scratch.xsum.data(), groups);
      KVQ_CUDA_CHECK_LAUNCH();
      if (w.type == TensorType::Q8_0) {
        gemv_q8_0_kernel<<<grid, threads, 0, stream>>>(
            reinterpret_cast<const int8_t*>(w.codes.data()), w.scales.data(), scratch.xq.data(),
            scratch.xscale.data(), y, rows, cols);
      } else if (w.type == TensorType::Q4_0) {
        gemv_q4_0_kernel<<<grid, threads, 0, stream>>>(w.codes.data(), w.scales.data(), scratch.xq.data(),
                                                       scratch.xscale.data(), scratch.xsum.data(), y, rows,
                                                       cols);
      } else {
        gemv_q1_0_kernel<<<grid, threads, 0, stream>>>(
            reinterpret_cast<const uint32_t*>(w.codes.data()), w.scales.data(), scratch.xq.data(),
            scratch.xscale.data(), scratch.xsum.data(), y, rows, cols);
      }
      break;
    }
  }
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace kvq::cuda
