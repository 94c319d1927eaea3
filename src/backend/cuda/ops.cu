// Elementwise / row-wise kernels. Written for plain correctness: one thread per
// output element (grid-stride), the CPU reference's formula verbatim, so the
// GPU results match cpu:: to a few ulps (tests bound the difference).
#include "backend/cuda/ops.hpp"

#include <cmath>

#include "core/error.hpp"
#include "core/half.hpp"

namespace kvq::cuda {

using gguf::TensorType;

namespace {

constexpr int kThreads = 256;

int grid_for(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return int(blocks < 65536 * 8 ? (blocks ? blocks : 1) : 65536 * 8);
}

// Read-only view of a GpuMatrix (gpu_layout.hpp) for device code.
struct MatrixView {
  TensorType type;
  int64_t cols;
  const uint8_t* codes;
  const uint16_t* scales;
};

MatrixView view_of(const GpuMatrix& w) {
  return {w.type, w.cols, w.codes.data(), w.scales.data()};
}

// Weight (r, c) dequantized exactly like gguf/cpu dequantize_row: d * q in fp32.
__device__ __forceinline__ float weight_at(const MatrixView& m, int64_t r, int64_t c) {
  switch (m.type) {
    case TensorType::F32:
      return reinterpret_cast<const float*>(m.codes)[r * m.cols + c];
    case TensorType::F16:
      return f16_to_f32(reinterpret_cast<const uint16_t*>(m.codes)[r * m.cols + c]);
    case TensorType::BF16:
      return bf16_to_f32(reinterpret_cast<const uint16_t*>(m.codes)[r * m.cols + c]);
    case TensorType::Q8_0: {
      const float d = f16_to_f32(m.scales[r * (m.cols / 32) + c / 32]);
      return d * float(reinterpret_cast<const int8_t*>(m.codes)[r * m.cols + c]);
    }
    case TensorType::Q4_0: {
      const int64_t b = c / 32;
      const int j = int(c % 32);
      const uint8_t byte = m.codes[r * (m.cols / 2) + b * 16 + (j & 15)];
      const int q = j < 16 ? (byte & 15) : (byte >> 4);
      const float d = f16_to_f32(m.scales[r * (m.cols / 32) + b]);
      return d * float(q - 8);
    }
    case TensorType::Q1_0: {
      const uint8_t byte = m.codes[r * (m.cols / 8) + c / 8];
      const float d = f16_to_f32(m.scales[r * (m.cols / 128) + c / 128]);
      return ((byte >> (c % 8)) & 1) ? d : -d;
    }
  }
  return 0.0f;
}

__global__ void embed_kernel(MatrixView m, const int32_t* __restrict__ ids, int n, float* __restrict__ out) {
  const size_t total = size_t(n) * m.cols;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const int64_t t = int64_t(i / m.cols), c = int64_t(i % m.cols);
    out[i] = weight_at(m, ids[t], c);
  }
}

__global__ void dequant_bf16_kernel(MatrixView m, int64_t r0, int64_t n_rows, uint16_t* __restrict__ out) {
  const size_t total = size_t(n_rows) * m.cols;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const int64_t r = int64_t(i / m.cols), c = int64_t(i % m.cols);
    out[i] = ::kvq::f32_to_bf16(weight_at(m, r0 + r, c));
  }
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ x, uint16_t* __restrict__ y, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    y[i] = ::kvq::f32_to_bf16(x[i]);
}

// One block per row; sum of squares in double as the CPU reference does.
__global__ void rms_norm_kernel(const float* x, const float* __restrict__ w, int dim, float eps, float* y) {
  __shared__ double partial[kThreads];
  const float* xr = x + size_t(blockIdx.x) * dim;
  float* yr = y + size_t(blockIdx.x) * dim;
  double ss = 0.0;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += double(xr[i]) * xr[i];
  partial[threadIdx.x] = ss;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float inv = float(1.0 / sqrt(partial[0] / dim + double(eps)));
  // Every thread has read its x values above (the reduction synchronised), so
  // writing y in place is safe.
  for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

// One thread per (token, head, pair).
// pos_dev: when set, the position is read from device memory (recorded steps).
__global__ void rope_kernel(float* x, int n_tokens, int n_heads, int head_dim, int pos, const int* pos_dev,
                            const float* __restrict__ inv_freq, bool neox, double pos_scale) {
  if (pos_dev) pos = *pos_dev;
  const int half = head_dim / 2;
  const size_t total = size_t(n_tokens) * n_heads * half;
  for (size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const int i = int(idx % half);
    const size_t th = idx / half;  // token * n_heads + head
    const int t = int(th / n_heads);
    const double a = double(pos + t) * pos_scale * double(inv_freq[i]);
    const float c = float(cos(a)), s = float(sin(a));
    float* v = x + th * head_dim;
    const int i0 = neox ? i : 2 * i;
    const int i1 = neox ? i + half : 2 * i + 1;
    const float x0 = v[i0], x1 = v[i1];
    v[i0] = x0 * c - x1 * s;
    v[i1] = x0 * s + x1 * c;
  }
}

constexpr int kArgmaxThreads = 1024;

__device__ __forceinline__ bool argmax_better(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const float* __restrict__ x, int n,
                                                                int32_t* __restrict__ out) {
  __shared__ float sv[kArgmaxThreads / 32];
  __shared__ int si[kArgmaxThreads / 32];
  float bv = -INFINITY;
  int bi = n;  // sentinel: loses to any real index on a tie
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float v = x[i];
    if (v != v) v = -INFINITY;
    if (argmax_better(v, i, bv, bi)) {
      bv = v;
      bi = i;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (argmax_better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x / 32); ++w)
      if (argmax_better(sv[w], si[w], bv, bi)) {
        bv = sv[w];
        bi = si[w];
      }
    *out = bi < n ? bi : 0;  // every value NaN/-inf: index 0, as on the host
  }
}

__global__ void swiglu_kernel(const float* gate, const float* __restrict__ up, float* out, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void add_kernel(float* x, const float* y, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

}  // namespace

void embed_rows(const GpuMatrix& table, const int32_t* ids, int n, float* out, cudaStream_t stream) {
  if (n <= 0) return;
  embed_kernel<<<grid_for(size_t(n) * table.cols), kThreads, 0, stream>>>(view_of(table), ids, n, out);
  KVQ_CUDA_CHECK_LAUNCH();
}

void dequantize_rows_bf16(const GpuMatrix& w, int64_t r0, int64_t n_rows, uint16_t* out, cudaStream_t stream) {
  KVQ_CHECK(r0 >= 0 && n_rows >= 0 && r0 + n_rows <= w.rows, Errc::internal, "dequantize_rows_bf16: rows [", r0,
            ", ", r0 + n_rows, ") outside a matrix of ", w.rows, " rows");
  if (n_rows == 0) return;
  dequant_bf16_kernel<<<grid_for(size_t(n_rows) * w.cols), kThreads, 0, stream>>>(view_of(w), r0, n_rows, out);
  KVQ_CUDA_CHECK_LAUNCH();
}

void f32_to_bf16(const float* x, uint16_t* y, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  f32_to_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, y, n);
  KVQ_CUDA_CHECK_LAUNCH();
}

void rms_norm(const float* x, const float* weight, int n_rows, int dim, float eps, float* y, cudaStream_t stream) {
  if (n_rows <= 0) return;
  rms_norm_kernel<<<n_rows, kThreads, 0, stream>>>(x, weight, dim, eps, y);
  KVQ_CUDA_CHECK_LAUNCH();
}

void rope(float* x, int n_tokens, int n_heads, int head_dim, int pos, const float* inv_freq, bool neox,
          double pos_scale, cudaStream_t stream) {
  const size_t total = size_t(n_tokens) * n_heads * (head_dim / 2);
  if (total == 0) return;
  rope_kernel<<<grid_for(total), kThreads, 0, stream>>>(x, n_tokens, n_heads, head_dim, pos, nullptr, inv_freq,
                                                         neox, pos_scale);
  KVQ_CUDA_CHECK_LAUNCH();
}

void rope_at(float* x, int n_tokens, int n_heads, int head_dim, const int* pos_dev, const float* inv_freq, bool neox,
             double pos_scale, cudaStream_t stream) {
  const size_t total = size_t(n_tokens) * n_heads * (head_dim / 2);
  if (total == 0) return;
  rope_kernel<<<grid_for(total), kThreads, 0, stream>>>(x, n_tokens, n_heads, head_dim, 0, pos_dev, inv_freq, neox,
                                                         pos_scale);
  KVQ_CUDA_CHECK_LAUNCH();
}

void argmax(const float* x, int n, int32_t* out, cudaStream_t stream) {
  KVQ_CHECK(n > 0, Errc::internal, "argmax over an empty vector");
  argmax_kernel<<<1, kArgmaxThreads, 0, stream>>>(x, n, out);
  KVQ_CUDA_CHECK_LAUNCH();
}

void swiglu(const float* gate, const float* up, float* out, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  swiglu_kernel<<<grid_for(n), kThreads, 0, stream>>>(gate, up, out, n);
  KVQ_CUDA_CHECK_LAUNCH();
}

void add(float* x, const float* y, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, y, n);
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace kvq::cuda
