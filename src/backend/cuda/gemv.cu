// GEMV kernels. Layouts: see backend/gpu_layout.hpp (codes and fp16 scales in
// separate arrays, rows 16-byte aligned).
//
// Work split (all types): one warp computes R consecutive output rows (R = 1,
// 2 or 4 by matrix height, so that small matrices still fill the GPU); each
// lane walks the row in 16-byte chunks strided by the warp, loads the matching
// piece of x once and reuses it for all R rows, so x traffic is amortised and
// weight reads are coalesced 16-byte loads. Q1_0 stages int8 x in shared
// memory per CTA (see its kernel).
#include "backend/cuda/gemv.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/error.hpp"

namespace kvq::cuda {

using gguf::TensorType;

namespace {


__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Reduces each row's per-lane partial sums over the warp; lane 0 writes the
// rows that exist (the last warp of a matrix may own fewer than R rows).
template <int R>
__device__ __forceinline__ void store_rows(const float (&acc)[R], float* __restrict__ y, int row0, int rows,
                                           int lane) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float s = warp_sum(acc[r]);
    if (lane == 0 && row0 + r < rows) y[row0 + r] = s;
  }
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

template <typename T, int kRows>
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
  store_rows<kRows>(acc, y, row0, rows, lane);
}

// --- Q8_0: lane chunk = 16 weights (half a block) -----------------------------
template <int kRows>
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
  store_rows<kRows>(acc, y, row0, rows, lane);
}

// --- Q4_0: lane chunk = one block (16 code bytes, 32 weights) -----------------
template <int kRows>
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
  store_rows<kRows>(acc, y, row0, rows, lane);
}

// --- Q1_0: lane chunk = one block (16 bytes of signs = 128 weights) --------
// sum_j s_j x_j with s = +-1 equals 2 * sum_{bit=1} x_j - sum_j x_j; the sum
// over set bits is a dp4a of the 0/1-spread sign nibbles with int8 x.
// The CTA stages the int8 copy of x in shared memory once for all its rows,
// 16-byte chunks XOR-swizzled by block index so that the 8 lanes of a
// shared-memory phase (consecutive blocks, same chunk) hit distinct banks.
constexpr int kQ1Warps = 8;

__device__ __forceinline__ int q1_dot_word(uint32_t w, int4 xa, int4 xb) {
  int dot = __dp4a(spread_nibble(w), xa.x, 0);
  dot = __dp4a(spread_nibble(w >> 4), xa.y, dot);
  dot = __dp4a(spread_nibble(w >> 8), xa.z, dot);
  dot = __dp4a(spread_nibble(w >> 12), xa.w, dot);
  dot = __dp4a(spread_nibble(w >> 16), xb.x, dot);
  dot = __dp4a(spread_nibble(w >> 20), xb.y, dot);
  dot = __dp4a(spread_nibble(w >> 24), xb.z, dot);
  return __dp4a(spread_nibble(w >> 28), xb.w, dot);
}

template <int kRows>
__global__ void __launch_bounds__(kQ1Warps * 32)
    gemv_q1_0_kernel(const uint4* __restrict__ bits, const uint16_t* __restrict__ scales,
                     const int8_t* __restrict__ xq, const float* __restrict__ xscale,
                     const int32_t* __restrict__ xsum, float* __restrict__ y, int rows, int cols) {
  extern __shared__ int4 smem[];
  const int blocks = cols / 128;
  int4* xs = smem;                                            // [blocks * 8] swizzled
  float4* ss = reinterpret_cast<float4*>(smem + blocks * 8);  // [blocks] x scales of the 4 groups
  int4* qs = reinterpret_cast<int4*>(ss + blocks);            // [blocks] x sums of the 4 groups
  const int4* xq4 = reinterpret_cast<const int4*>(xq);
  for (int i = threadIdx.x; i < blocks * 8; i += blockDim.x) {
    const int b = i >> 3, c = i & 7;
    xs[b * 8 + (c ^ (b & 7))] = xq4[i];
  }
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
    ss[b] = reinterpret_cast<const float4*>(xscale)[b];
    qs[b] = reinterpret_cast<const int4*>(xsum)[b];
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kQ1Warps + warp) * kRows;
  if (row0 >= rows) return;
  float acc[kRows] = {};
  for (int b = lane; b < blocks; b += 32) {
    uint4 wb[kRows];
    float d[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = min(row0 + r, rows - 1);  // tail rows recompute the last row; not stored
      wb[r] = bits[size_t(row) * blocks + b];
      d[r] = half_bits_to_float(scales[size_t(row) * blocks + b]);
    }
    int4 xv[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) xv[c] = xs[b * 8 + (c ^ (b & 7))];
    const float4 sx = ss[b];
    const int4 sq = qs[b];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float part = sx.x * float(2 * q1_dot_word(wb[r].x, xv[0], xv[1]) - sq.x) +
                         sx.y * float(2 * q1_dot_word(wb[r].y, xv[2], xv[3]) - sq.y) +
                         sx.z * float(2 * q1_dot_word(wb[r].z, xv[4], xv[5]) - sq.z) +
                         sx.w * float(2 * q1_dot_word(wb[r].w, xv[6], xv[7]) - sq.w);
      acc[r] = fmaf(d[r], part, acc[r]);
    }
  }
  store_rows<kRows>(acc, y, row0, rows, lane);
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

namespace {

// Rows per warp: enough warps to fill the GPU for small matrices (K/V
// projections have 1024 rows), several rows per warp for big ones so that
// each lane keeps several independent 16-byte loads in flight.
int rows_per_warp(int rows) { return rows >= 8192 ? 4 : rows >= 3072 ? 2 : 1; }

template <int R>
void launch(const GpuMatrix& w, const float* x, float* y, GemvScratch& scratch, cudaStream_t stream,
            bool x_quantized) {
  const int rows = int(w.rows), cols = int(w.cols);
  constexpr int kWarps = 4;
  const int grid = (rows + kWarps * R - 1) / (kWarps * R);
  const int threads = kWarps * 32;
  switch (w.type) {
    case TensorType::F32:
      gemv_float_kernel<float, R><<<grid, threads, 0, stream>>>(
          reinterpret_cast<const float*>(w.codes.data()), x, y, rows, cols);
      return;
    case TensorType::F16:
      gemv_float_kernel<__half, R><<<grid, threads, 0, stream>>>(
          reinterpret_cast<const __half*>(w.codes.data()), x, y, rows, cols);
      return;
    case TensorType::BF16:
      gemv_float_kernel<__nv_bfloat16, R><<<grid, threads, 0, stream>>>(
          reinterpret_cast<const __nv_bfloat16*>(w.codes.data()), x, y, rows, cols);
      return;
    default: break;
  }
  if (!x_quantized) {
    scratch.reserve(cols);
    const int groups = cols / 32;
    quantize_x_kernel<<<(groups * 32 + 127) / 128, 128, 0, stream>>>(x, scratch.xq.data(), scratch.xscale.data(),
                                                                     scratch.xsum.data(), groups);
    KVQ_CUDA_CHECK_LAUNCH();
  } else {
    KVQ_CHECK(scratch.xq.size() >= size_t(cols), Errc::internal, "gemv: x marked quantized but the scratch holds ",
              scratch.xq.size(), " values for ", cols, " columns");
  }
  if (w.type == TensorType::Q8_0) {
    gemv_q8_0_kernel<R><<<grid, threads, 0, stream>>>(reinterpret_cast<const int8_t*>(w.codes.data()),
                                                      w.scales.data(), scratch.xq.data(), scratch.xscale.data(),
                                                      y, rows, cols);
  } else if (w.type == TensorType::Q4_0) {
    gemv_q4_0_kernel<R><<<grid, threads, 0, stream>>>(w.codes.data(), w.scales.data(), scratch.xq.data(),
                                                      scratch.xscale.data(), scratch.xsum.data(), y, rows, cols);
  } else {
    const int q1_grid = (rows + kQ1Warps * R - 1) / (kQ1Warps * R);
    const size_t smem = size_t(cols / 128) * (8 * 16 + 16 + 16);
    gemv_q1_0_kernel<R><<<q1_grid, kQ1Warps * 32, smem, stream>>>(
        reinterpret_cast<const uint4*>(w.codes.data()), w.scales.data(), scratch.xq.data(), scratch.xscale.data(),
        scratch.xsum.data(), y, rows, cols);
  }
}

}  // namespace

void gemv(const GpuMatrix& w, const float* x, float* y, GemvScratch& scratch, cudaStream_t stream, bool x_quantized) {
  KVQ_CHECK(gpu_gemv_supported(w.type, w.cols), Errc::unsupported, "GPU GEMV: unsupported ",
            gguf::tensor_type_name(w.type), " matrix with ", w.cols, " columns");
  // Q1_0 stages x in shared memory: 160 bytes per 128 columns (48 KiB default limit).
  KVQ_CHECK(w.rows <= (int64_t(1) << 30) && w.cols <= 300 * 128, Errc::out_of_range,
            "GPU GEMV: matrix of ", w.rows, " x ", w.cols, " is too large");
  switch (rows_per_warp(int(w.rows))) {
    case 4: launch<4>(w, x, y, scratch, stream, x_quantized); break;
    case 2: launch<2>(w, x, y, scratch, stream, x_quantized); break;
    default: launch<1>(w, x, y, scratch, stream, x_quantized); break;
  }
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace kvq::cuda
