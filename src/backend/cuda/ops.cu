// Elementwise / row-wise kernels. Written for plain correctness: one thread per
// output element (grid-stride), the CPU reference's formula verbatim, so the
// GPU results match cpu:: to a few ulps (tests bound the difference).
#include "backend/cuda/ops.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/kv_codec_hooks.cuh"
#include "backend/cuda/kquant.cuh"
#include "backend/cuda/l2_prefetch.cuh"
#include "backend/cuda/lab_trace.cuh"
#include "backend/cuda/qk_norm_rope.cuh"
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

// Weight (r, c) of a K-quant matrix (kquant.cuh: the CPU reference's value).
__device__ __forceinline__ float kquant_weight_at(const MatrixView& m, int64_t r, int64_t c) {
  const int64_t rec = r * (m.cols / 256) + c / 256;
  return kq::weight(m.type, m.codes + rec * kq::code_bytes(m.type), m.scales + rec * kq::scale_count(m.type),
                    int(c % 256));
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
    case TensorType::Q1_0: {  // transposed words: weight 4k + b of a word at bit 8b + k (gpu_layout.hpp)
      const uint32_t word = reinterpret_cast<const uint32_t*>(m.codes)[r * (m.cols / 32) + c / 32];
      const int j = int(c % 32);
      const float d = f16_to_f32(m.scales[r * (m.cols / 128) + c / 128]);
      return ((word >> (8 * (j % 4) + j / 4)) & 1u) ? d : -d;
    }
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K:
      return kquant_weight_at(m, r, c);
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

// One thread per 8 consecutive weights of a row (one 16-byte store of bf16),
// so consecutive threads read consecutive code bytes and write consecutive
// 16-byte pieces: the prefill tile is written at bandwidth, not per element.
// Values as weight_at() (d * q in fp32) rounded to bf16. The type is a
// template parameter: one instance per type, no switch per 8 weights.
template <TensorType kType>
__device__ __forceinline__ void dequant8(const MatrixView& m, int64_t r, int64_t c, float (&w)[8]) {
  switch (kType) {
    case TensorType::F32: {
      const float4* p = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(m.codes) + r * m.cols + c);
      const float4 a = p[0], b = p[1];
      w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
      return;
    }
    case TensorType::F16:
    case TensorType::BF16: {
      const uint4 u = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(m.codes) + r * m.cols + c);
      const uint32_t q[4] = {u.x, u.y, u.z, u.w};
      for (int j = 0; j < 4; ++j) {
        const uint16_t lo = uint16_t(q[j] & 0xffffu), hi = uint16_t(q[j] >> 16);
        w[2 * j] = kType == TensorType::F16 ? f16_to_f32(lo) : bf16_to_f32(lo);
        w[2 * j + 1] = kType == TensorType::F16 ? f16_to_f32(hi) : bf16_to_f32(hi);
      }
      return;
    }
    case TensorType::Q8_0: {
      const float d = f16_to_f32(m.scales[r * (m.cols / 32) + c / 32]);
      const int8_t* q = reinterpret_cast<const int8_t*>(m.codes) + r * m.cols + c;
      const uint2 u = *reinterpret_cast<const uint2*>(q);
      const int8_t* b = reinterpret_cast<const int8_t*>(&u);
      for (int j = 0; j < 8; ++j) w[j] = d * float(b[j]);
      return;
    }
    case TensorType::Q4_0: {
      const int64_t blk = c / 32;
      const int o = int(c % 32);  // 0, 8, 16 or 24
      const float d = f16_to_f32(m.scales[r * (m.cols / 32) + blk]);
      const uint2 u = *reinterpret_cast<const uint2*>(m.codes + r * (m.cols / 2) + blk * 16 + (o & 15));
      const uint8_t* b = reinterpret_cast<const uint8_t*>(&u);
      for (int j = 0; j < 8; ++j) w[j] = d * float((o < 16 ? (b[j] & 15) : (b[j] >> 4)) - 8);
      return;
    }
    case TensorType::Q1_0: {  // transposed words (gpu_layout.hpp); c is a multiple of 8
      const float d = f16_to_f32(m.scales[r * (m.cols / 128) + c / 128]);
      const uint32_t word = reinterpret_cast<const uint32_t*>(m.codes)[r * (m.cols / 32) + c / 32];
      const int j0 = int(c % 32);
      for (int j = 0; j < 8; ++j) w[j] = ((word >> (8 * ((j0 + j) % 4) + (j0 + j) / 4)) & 1u) ? d : -d;
      return;
    }
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K: {  // 8 weights of one record (c is a multiple of 8)
      const int64_t rec = r * (m.cols / 256) + c / 256;
      const uint8_t* codes = m.codes + rec * kq::code_bytes(m.type);
      const uint16_t* scales = m.scales + rec * kq::scale_count(m.type);
      for (int j = 0; j < 8; ++j) w[j] = kq::weight(kType, codes, scales, int(c % 256) + j);
      return;
    }
    default:
      return;
  }
}

// Grid: x over the 8-weight pieces of a row, y over rows (grid-stride), so
// no thread divides a 64-bit index (session 14: the flat index's division
// per 8 weights held a 12288 x 4096 Q1_0 tile to 79 us, 1.3 TB/s of bf16).
template <TensorType kType>
__global__ void dequant_bf16_kernel(MatrixView m, int64_t r0, int64_t n_rows, uint16_t* __restrict__ out) {
  const int per_row = int(m.cols / 8);
  const int p = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
  if (p >= per_row) return;
  for (int64_t r = blockIdx.y; r < n_rows; r += gridDim.y) {
    const size_t i = size_t(r) * per_row + p;
    float w[8];
    dequant8<kType>(m, r0 + r, int64_t(p) * 8, w);
    uint4 o;
    o.x = uint32_t(::kvq::f32_to_bf16(w[0])) | (uint32_t(::kvq::f32_to_bf16(w[1])) << 16);
    o.y = uint32_t(::kvq::f32_to_bf16(w[2])) | (uint32_t(::kvq::f32_to_bf16(w[3])) << 16);
    o.z = uint32_t(::kvq::f32_to_bf16(w[4])) | (uint32_t(::kvq::f32_to_bf16(w[5])) << 16);
    o.w = uint32_t(::kvq::f32_to_bf16(w[6])) | (uint32_t(::kvq::f32_to_bf16(w[7])) << 16);
    reinterpret_cast<uint4*>(out)[i] = o;
  }
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ x, uint16_t* __restrict__ y, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    y[i] = ::kvq::f32_to_bf16(x[i]);
}

// One block per row; sum of squares in double as the CPU reference does.
// Out: float, or uint16_t for bf16 bits (the fp32 value rounded to nearest
// even: what f32_to_bf16 of the float output gives).
template <typename Out>
__global__ void rms_norm_kernel(const float* x, const float* __restrict__ w, int dim, float eps, Out* y) {
  __shared__ double partial[kThreads];
  const float* xr = x + size_t(blockIdx.x) * dim;
  Out* yr = y + size_t(blockIdx.x) * dim;
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
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = xr[i] * inv * w[i];
    if constexpr (std::is_same_v<Out, float>) yr[i] = v;
    else yr[i] = ::kvq::f32_to_bf16(v);
  }
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
    v[i0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));  // the CPU's roundings (no fma), as norm_rope_row
    v[i1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
  }
}


// One warp per head: warps [0, nh) rotate q heads, [nh, nh + nkv) k heads,
// [nh + nkv, nh + 2 nkv) copy v heads; with q_in_attention the grid has only
// the k and v warps (the decode attention prepares q itself, from the same
// norm_rope_row) and lets its dependent start only once its own
// predecessor has finished: that attention reads the raw q the predecessor
// wrote without waiting for this kernel (attention_decode.cu). Lanes hold
// the dims of rope_lane_dims. Same arithmetic as the CPU's rms_norm / rope.
// kGeneric: the instance that can encode any family (encode_row_any); the
// lean one (false) serves only bf16 stores (both sides bf16) and no store,
// without the encoders' registers and stack.
// With q_in_attention the encode runs beside an attention that streams the
// cache at full bandwidth, and that attention's last tile waits for this
// kernel, so each of its dependent trips to memory is paid at loaded
// latency: the layer's constants (norm weight, RoPE frequencies, the side's
// rotation table, codebook and sketch) are asked into L2 before the wait
// (the predecessor writes none of them), and the row reaches the encoder
// through shared memory, not back through global memory. (Measured: within
// noise. Beside the attention this kernel is bound by instruction fetch of
// its cold, long encode paths; docs/perf.md, session 8.)
template <int kPer, bool kGeneric>
__global__ void __launch_bounds__(128)
    qk_rope_store_kernel(float* __restrict__ q, float* __restrict__ k, const float* __restrict__ v, int nh, int nkv,
                         bool q_in_attention, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                         float eps, int pos, const int* pos_dev, const int32_t* slot_dev, RopeParams rope,
                         GpuKvLayer kv, unsigned long long* trace) {
  constexpr int D = kPer * 32;
  // Token blockIdx.y of the step: its rows of q, k and v, its position and
  // its slot (without slots: the identity table, slot = position).
  const int tok = blockIdx.y;
  q += size_t(tok) * nh * D;
  k += size_t(tok) * nkv * D;
  v += size_t(tok) * nkv * D;
  const int warp = int((blockIdx.x * blockDim.x + threadIdx.x) >> 5) + (q_in_attention ? nh : 0);
  const int lane = threadIdx.x & 31;
  const bool in_grid = warp < nh + 2 * nkv;
  const bool is_q = warp < nh, is_k = !is_q && warp < nh + nkv;
  const int head = is_q ? warp : is_k ? warp - nh : warp - nh - nkv;
  const GpuKvSide& side = is_k ? kv.k : kv.v;
  if (in_grid && lane == 0) {
    const float* w = is_q ? q_norm : is_k ? k_norm : nullptr;
    if (w) prefetch_l2(w, D * sizeof(float));
    if (!is_q) prefetch_l2(rope.inv_freq, D / 2 * sizeof(float));
    if (kGeneric && !is_q && kv.k.code) prefetch_encode_constants(side, head, D);
  }
  if (!q_in_attention) allow_dependents();
  wait_for_predecessor();
  if (q_in_attention) allow_dependents();
  trace_warp_event(trace, 0);
  if (!in_grid) return;
  if (pos_dev) pos = pos_dev[tok];
  const float* src = is_q ? q + size_t(head) * D : is_k ? k + size_t(head) * D : v + size_t(head) * D;
  int dim[kPer];
  rope_lane_dims<kPer>(rope.neox, lane, dim);
  float x[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) x[j] = src[dim[j]];
  if (is_q || is_k) {
    norm_rope_row<kPer>(x, dim, is_q ? q_norm : k_norm, eps, pos, rope);
    float* dst = is_q ? q + size_t(head) * D : k + size_t(head) * D;
#pragma unroll
    for (int j = 0; j < kPer; ++j) dst[dim[j]] = x[j];
  }
  if (!is_q && kv.k.code) {
    // A slot of a window page (kv_store.hpp) takes the bf16 row; a windowed
    // store encodes the bf16 values into its packed pages.
    const StoreRow at = kv.slot_row(slot_dev ? slot_dev[tok] : pos, head);
    uint8_t* code = at.exact ? (is_k ? kv.xk : kv.xv).code + size_t(at.row) * (2 * D) : side.code + side.code_offset(at.row);
    if (at.exact || !kGeneric || side.family == kv::Family::bf16) {  // straight from the registers
      uint16_t* cache = reinterpret_cast<uint16_t*>(code);
#pragma unroll
      for (int j = 0; j < kPer; ++j) cache[dim[j]] = ::kvq::f32_to_bf16(sanitize_kv(x[j]));  // as the CPU `none` block
    } else if constexpr (kGeneric) {
      __shared__ float rows[4][D];  // one row per warp of the 128-thread CTA
      float* row = rows[threadIdx.x >> 5];
      if (kv.has_window()) {
#pragma unroll
        for (int j = 0; j < kPer; ++j) row[dim[j]] = ::kvq::bf16_to_f32(::kvq::f32_to_bf16(sanitize_kv(x[j])));
      } else {
#pragma unroll
        for (int j = 0; j < kPer; ++j) row[dim[j]] = x[j];
      }
      __syncwarp();
      uint8_t* s = side.side_bytes ? side.side + side.side_offset(at.row) : nullptr;
      encode_row_any(side, head, row, D, code, s, lane);
    }
  }
  trace_warp_event(trace, 1);
}

// Greedy argmax in one launch over many CTAs, one row of x per grid row
// (blockIdx.y; row r starts at x + r * stride). Each candidate is the 64-bit
// key (order-preserving bits of the value << 32) | (~index), so the largest
// key is the largest value with the lowest index among equals; NaN maps to
// -inf and -0 to +0 (the host rule compares values, not bits). Every CTA of
// a row folds its best key into the row's work[0] with atomicMax and takes a
// ticket in its work[1]; the last CTA of the row, which therefore sees every
// CTA's key, writes the index and resets both words to 0, so the next call
// (or graph replay) starts clean.
constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxMaxCtas = 264;

__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
  if (v != v) v = -INFINITY;
  if (v == 0.0f) v = 0.0f;
  const uint32_t u = __float_as_uint(v);
  const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | static_cast<uint32_t>(~uint32_t(i));
}

__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const float* __restrict__ x, int n, size_t stride,
                                                                int32_t* __restrict__ out, float* __restrict__ value,
                                                                unsigned long long* __restrict__ work) {
  __shared__ unsigned long long warp_best[kArgmaxThreads / 32];
  allow_dependents();
  wait_for_predecessor();
  x += size_t(blockIdx.y) * stride;
  out += blockIdx.y;
  work += 2 * size_t(blockIdx.y);
  unsigned long long best = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    best = max(best, argmax_key(x[i], i));
  for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kArgmaxThreads / 32; ++w) best = max(best, warp_best[w]);
  atomicMax(&work[0], best);
  __threadfence();
  if (atomicAdd(&work[1], 1ull) == gridDim.x - 1) {
    const unsigned long long final_key = atomicExch(&work[0], 0ull);
    work[1] = 0;
    *out = int32_t(~uint32_t(final_key & 0xffffffffull));
    if (value) {  // the winning value back from its ordered bits (NaN was -inf)
      const uint32_t ordered = uint32_t(final_key >> 32);
      value[blockIdx.y] = __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
    }
  }
}

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// Out: float, or uint16_t for bf16 bits (rms_norm_kernel).
template <typename Out>
__global__ void swiglu_kernel(const float* gate, const float* __restrict__ up, Out* out, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float v = silu_times(gate[i], up[i]);
    if constexpr (std::is_same_v<Out, float>) out[i] = v;
    else out[i] = ::kvq::f32_to_bf16(v);
  }
}

// swiglu_kernel four values a thread (16-byte loads: a prefill chunk's
// gate/up rows are ~100M values a layer); n4 = n / 4, gate and up 16-byte
// aligned, out aligned to its four values. The same arithmetic per value.
template <typename Out>
__global__ void swiglu4_kernel(const float4* gate, const float4* __restrict__ up, Out* out, size_t n4) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x) {
    const float4 g = gate[i], u = up[i];
    const float4 v = make_float4(silu_times(g.x, u.x), silu_times(g.y, u.y), silu_times(g.z, u.z), silu_times(g.w, u.w));
    if constexpr (std::is_same_v<Out, float>) {
      reinterpret_cast<float4*>(out)[i] = v;
    } else {
      reinterpret_cast<uint2*>(out)[i] =
          make_uint2(uint32_t(::kvq::f32_to_bf16(v.x)) | (uint32_t(::kvq::f32_to_bf16(v.y)) << 16),
                     uint32_t(::kvq::f32_to_bf16(v.z)) | (uint32_t(::kvq::f32_to_bf16(v.w)) << 16));
    }
  }
}

// The vectorized form when n and every pointer allow it.
template <typename Out>
void launch_swiglu(const float* gate, const float* up, Out* out, size_t n, cudaStream_t stream) {
  constexpr uintptr_t kOutAlign = 4 * sizeof(Out);  // four outputs: a float4 or a uint2
  const bool aligned = (reinterpret_cast<uintptr_t>(gate) | reinterpret_cast<uintptr_t>(up)) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % kOutAlign == 0;
  if (n % 4 == 0 && aligned) {
    swiglu4_kernel<<<grid_for(n / 4), kThreads, 0, stream>>>(reinterpret_cast<const float4*>(gate),
                                                            reinterpret_cast<const float4*>(up), out, n / 4);
  } else {
    swiglu_kernel<<<grid_for(n), kThreads, 0, stream>>>(gate, up, out, n);
  }
  KVQ_CUDA_CHECK_LAUNCH();
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
  KVQ_CHECK(w.cols % 8 == 0, Errc::internal, "dequantize_rows_bf16: ", w.cols, " columns (a multiple of 8 needed)");
  const dim3 grid(unsigned((w.cols / 8 + kThreads - 1) / kThreads), unsigned(std::min<int64_t>(n_rows, 65535)));
  const MatrixView v = view_of(w);
  switch (w.type) {
#define KVQ_DEQUANT_CASE(T)                                                         \
  case TensorType::T:                                                              \
    dequant_bf16_kernel<TensorType::T><<<grid, kThreads, 0, stream>>>(v, r0, n_rows, out); \
    break;
    KVQ_DEQUANT_CASE(F32)
    KVQ_DEQUANT_CASE(F16)
    KVQ_DEQUANT_CASE(BF16)
    KVQ_DEQUANT_CASE(Q8_0)
    KVQ_DEQUANT_CASE(Q4_0)
    KVQ_DEQUANT_CASE(Q1_0)
    KVQ_DEQUANT_CASE(Q2_K)
    KVQ_DEQUANT_CASE(Q3_K)
    KVQ_DEQUANT_CASE(Q4_K)
    KVQ_DEQUANT_CASE(Q5_K)
    KVQ_DEQUANT_CASE(Q6_K)
#undef KVQ_DEQUANT_CASE
    default:
      fail(Errc::unsupported, "dequantize_rows_bf16: no GPU decode for ", gguf::tensor_type_name(w.type));
  }
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

void rms_norm_bf16(const float* x, const float* weight, int n_rows, int dim, float eps, uint16_t* y,
                   cudaStream_t stream) {
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

void argmax(const float* x, int n, int32_t* out, unsigned long long* work, cudaStream_t stream,
            const DeviceContext& ctx) {
  argmax_rows(x, 1, n, size_t(n), out, nullptr, work, stream, ctx);
}

void argmax_rows(const float* x, int rows, int n, size_t stride, int32_t* out, float* value, unsigned long long* work,
                 cudaStream_t stream, const DeviceContext& ctx) {
  KVQ_CHECK(n > 0 && rows > 0 && rows <= 65535, Errc::internal, "argmax over ", rows, " rows of ", n, " values");
  // Rows share the SMs: fewer CTAs per row as rows grow, at least one.
  const int per_row = std::max(1, std::min(kArgmaxMaxCtas / rows, (n + kArgmaxThreads - 1) / kArgmaxThreads));
  launch_dependent(ctx, argmax_kernel, dim3(per_row, rows), dim3(kArgmaxThreads), 0, stream, x, n, stride, out, value,
                   work);
}

void swiglu(const float* gate, const float* up, float* out, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  launch_swiglu(gate, up, out, n, stream);
}

void swiglu_bf16(const float* gate, const float* up, uint16_t* out, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  launch_swiglu(gate, up, out, n, stream);
}

void add(float* x, const float* y, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, y, n);
  KVQ_CUDA_CHECK_LAUNCH();
}


namespace {
// True when the store's rows are encoded (any block but bf16 on both sides):
// the kernel then runs the codec's encoder, not a copy.
bool store_encodes(const GpuKvLayer& kv) {
  return !(kv.k.family == kv::Family::bf16 && kv.v.family == kv::Family::bf16 && !kv.k.has_qjl && !kv.v.has_qjl);
}
}  // namespace

bool qk_rope_store_supported(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

void qk_rope_store(float* q, float* k, const float* v, int n_heads, int n_kv_heads, int head_dim, const float* q_norm,
                   const float* k_norm, float eps, int pos, const int* pos_dev, const float* inv_freq, bool neox,
                   double pos_scale, const GpuKvLayer& kv, cudaStream_t stream, bool q_in_attention,
                   const DeviceContext& ctx, int n_tok, const int32_t* slot_dev) {
  KVQ_CHECK(qk_rope_store_supported(head_dim), Errc::internal, "qk_rope_store: head_dim ", head_dim);
  KVQ_CHECK(!kv.k.code || kv.head_dim == head_dim, Errc::internal, "qk_rope_store: cache head_dim ", kv.head_dim);
  KVQ_CHECK(!kv.k.code || kv_encode_supported(kv.k.family, kv.v.family, head_dim), Errc::internal,
            "qk_rope_store: no encode hooks for this store");
  KVQ_CHECK(!q_in_attention || kv.k.code, Errc::internal, "qk_rope_store: q left to an attention without a store");
  KVQ_CHECK(n_tok == 1 || (n_tok > 1 && n_tok <= 65535 && pos_dev && (slot_dev || !kv.k.code)), Errc::internal,
            "qk_rope_store: ", n_tok, " tokens (more than one need device positions and slots)");
  const int warps = (q_in_attention ? 0 : n_heads) + 2 * n_kv_heads;
  const int grid = (warps * 32 + 127) / 128;
  // No store, or plain bf16 on both sides (the kernel writes bf16 straight
  // from its registers): the lean instance.
  const bool lean = !kv.k.code || !store_encodes(kv);
  const RopeParams rope{inv_freq, neox, pos_scale};
  const auto launch = [&](auto kernel) {
    launch_dependent(ctx, kernel, dim3(grid, n_tok), dim3(128), 0, stream, q, k, v, n_heads, n_kv_heads,
                     q_in_attention, q_norm, k_norm, eps, pos, pos_dev, slot_dev, rope, kv,
                     ctx.settings.qk_rope_store_trace);
  };
  switch (head_dim) {
    case 64: lean ? launch(qk_rope_store_kernel<2, false>) : launch(qk_rope_store_kernel<2, true>); break;
    case 128: lean ? launch(qk_rope_store_kernel<4, false>) : launch(qk_rope_store_kernel<4, true>); break;
    default: lean ? launch(qk_rope_store_kernel<8, false>) : launch(qk_rope_store_kernel<8, true>); break;
  }
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace kvq::cuda
