// Fused GEMV kernels; see gemv.hpp for what one launch computes and
// backend/gpu_layout.hpp for the weight layouts.
//
// Work split: a task is R consecutive rows of one output matrix (for swiglu:
// the same R rows of gate and of up). A CTA (16 warps by default,
// GemvTuning) first stages the input u in shared memory, then each warp
// takes tasks strided over the whole grid
// (the grid is capped near what stays resident, so the staging is paid once
// per CTA, not once per task). Each lane walks the rows in 16-byte chunks
// strided by the warp, U chunks x R rows per pipeline step, and loads step
// k+1 (of this task or the next) before computing step k, so HBM latency
// overlaps the dot products; each piece of u serves all R rows. Weights are
// loaded with ld.global.nc.L1::no_allocate: they are read exactly once per
// step. Launched as dependent launches
// (dependent_launch.cuh): the first weight loads (and the copy of the norm
// weight into shared memory) are issued before waiting for the kernel that
// produces x.
//
// Shared memory:
//   float types      float uf[cols]                 u = x (* norm weight)
//   quantized types  int8 uq[cols] in 16-byte units, unit i stored at
//                    swz(i) = (i & ~7) | ((i ^ (i >> 3)) & 7) so that the
//                    8 lanes of a shared-memory phase, which read units a
//                    block (or 16 values) apart, hit distinct banks;
//                    float us[cols/32] (scale of each 32 values),
//                    int   usum[cols/32] (sum of their int8 codes);
//   then, with a norm, float g[cols] (the norm weight, copied by cp.async).
// Chunk of 16 code bytes per type: F32 4 weights, F16/BF16 8, Q8_0 16 (half a
// block), Q4_0 32 (one block), Q1_0 128 (one block).
// Q1_0 also has an experimental kernel on the binary tensor cores (further
// down, opt-in): its own staging and work split.
#include "backend/cuda/gemv.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/gemv_kquant.hpp"
#include "backend/cuda/lab_trace.cuh"
#include "core/error.hpp"

namespace kvq::cuda {

using gguf::TensorType;

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxOut = 3;

struct KernelArgs {
  const uint8_t* codes[kMaxOut];
  const uint16_t* scales[kMaxOut];
  float* y[kMaxOut];
  int rows[kMaxOut];
  int task_end[kMaxOut];  // cumulative task counts: output s owns tasks [task_end[s-1], task_end[s])
  int n_tasks;
  const float* x;
  const float* norm;  // null: no norm
  float eps;
  int cols;
  GemvEpilogue epilogue;
  unsigned long long* trace;  // GemvRequest::trace
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ float half_bits_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }

__device__ __forceinline__ int swz(int unit) { return (unit & ~7) | ((unit ^ (unit >> 3)) & 7); }


// The staged input, as the per-type dot products read it.
struct Staged {
  const float* uf;      // float types
  const int4* uq;       // quantized: 16-byte units (swizzled)
  const float* us;      // quantized: scale per 32 values
  const int* usum;      // quantized: code sum per 32 values
};

// --- per-type traits: weights per 16-byte chunk, scales per row, dot of one chunk

template <TensorType T>
struct Weights;

template <>
struct Weights<TensorType::F32> {
  static constexpr int kPerChunk = 4;
  static constexpr int kPerScale = 0;  // no scales
  static __device__ __forceinline__ float dot(uint4 w, float, const Staged& s, int i) {
    const float4 u = reinterpret_cast<const float4*>(s.uf)[i];
    return __uint_as_float(w.x) * u.x + __uint_as_float(w.y) * u.y + __uint_as_float(w.z) * u.z +
           __uint_as_float(w.w) * u.w;
  }
};

// A 16-byte chunk of 8 half-precision weights (two per word, the lower
// half first), widened by Widen (float2 of one word), dotted with u.
template <typename Widen>
__device__ __forceinline__ float dot8(uint4 w, const float* uf, int i, Widen widen) {
  const float4 a = reinterpret_cast<const float4*>(uf)[2 * i];
  const float4 b = reinterpret_cast<const float4*>(uf)[2 * i + 1];
  const float2 w0 = widen(w.x), w1 = widen(w.y), w2 = widen(w.z), w3 = widen(w.w);
  float s = w0.x * a.x;
  s = fmaf(w0.y, a.y, s);
  s = fmaf(w1.x, a.z, s);
  s = fmaf(w1.y, a.w, s);
  s = fmaf(w2.x, b.x, s);
  s = fmaf(w2.y, b.y, s);
  s = fmaf(w3.x, b.z, s);
  return fmaf(w3.y, b.w, s);
}

template <>
struct Weights<TensorType::BF16> {
  static constexpr int kPerChunk = 8;
  static constexpr int kPerScale = 0;
  static __device__ __forceinline__ float dot(uint4 w, float, const Staged& s, int i) {
    return dot8(w, s.uf, i,
                [](uint32_t q) { return make_float2(__uint_as_float(q << 16), __uint_as_float(q & 0xffff0000u)); });
  }
};

template <>
struct Weights<TensorType::F16> {
  static constexpr int kPerChunk = 8;
  static constexpr int kPerScale = 0;
  static __device__ __forceinline__ float dot(uint4 w, float, const Staged& s, int i) {
    return dot8(w, s.uf, i, [](uint32_t q) { return __half22float2(*reinterpret_cast<const __half2*>(&q)); });
  }
};

template <>
struct Weights<TensorType::Q8_0> {
  static constexpr int kPerChunk = 16;
  static constexpr int kPerScale = 32;
  static __device__ __forceinline__ float dot(uint4 w, float d, const Staged& s, int i) {
    const int4 u = s.uq[swz(i)];
    int acc = __dp4a(int(w.x), u.x, 0);
    acc = __dp4a(int(w.y), u.y, acc);
    acc = __dp4a(int(w.z), u.z, acc);
    acc = __dp4a(int(w.w), u.w, acc);
    return d * s.us[i >> 1] * float(acc);
  }
};

template <>
struct Weights<TensorType::Q4_0> {
  static constexpr int kPerChunk = 32;
  static constexpr int kPerScale = 32;
  // Byte j of a block: low nibble = weight j, high nibble = weight j + 16; w = (q - 8) d.
  static __device__ __forceinline__ float dot(uint4 w, float d, const Staged& s, int i) {
    const int4 ua = s.uq[swz(2 * i)], ub = s.uq[swz(2 * i + 1)];
    int acc = __dp4a(int(w.x & 0x0f0f0f0fu), ua.x, 0);
    acc = __dp4a(int(w.y & 0x0f0f0f0fu), ua.y, acc);
    acc = __dp4a(int(w.z & 0x0f0f0f0fu), ua.z, acc);
    acc = __dp4a(int(w.w & 0x0f0f0f0fu), ua.w, acc);
    acc = __dp4a(int((w.x >> 4) & 0x0f0f0f0fu), ub.x, acc);
    acc = __dp4a(int((w.y >> 4) & 0x0f0f0f0fu), ub.y, acc);
    acc = __dp4a(int((w.z >> 4) & 0x0f0f0f0fu), ub.z, acc);
    acc = __dp4a(int((w.w >> 4) & 0x0f0f0f0fu), ub.w, acc);
    return d * s.us[i] * float(acc - 8 * s.usum[i]);
  }
};

// sum_j s_j u_j with signs s = +-1 equals 2 * sum_{bit=1} u_j - sum_j u_j; the
// sum over set bits is a dp4a of 0/1 bytes with int8 u. The GPU layout
// transposes each word of sign bits (weight 4k + b at bit 8b + k,
// gpu_layout.hpp), so weights 4k..4k+3 as 0/1 bytes are (w >> k) & 0x01010101:
// 3 instructions per 4 weights with the dp4a.
__device__ __forceinline__ int q1_set_sum(uint32_t w, int4 ua, int4 ub) {
  int acc = __dp4a(int(w & 0x01010101u), ua.x, 0);
  acc = __dp4a(int((w >> 1) & 0x01010101u), ua.y, acc);
  acc = __dp4a(int((w >> 2) & 0x01010101u), ua.z, acc);
  acc = __dp4a(int((w >> 3) & 0x01010101u), ua.w, acc);
  acc = __dp4a(int((w >> 4) & 0x01010101u), ub.x, acc);
  acc = __dp4a(int((w >> 5) & 0x01010101u), ub.y, acc);
  acc = __dp4a(int((w >> 6) & 0x01010101u), ub.z, acc);
  return __dp4a(int((w >> 7) & 0x01010101u), ub.w, acc);
}

template <>
struct Weights<TensorType::Q1_0> {
  static constexpr int kPerChunk = 128;
  static constexpr int kPerScale = 128;
  static __device__ __forceinline__ float dot(uint4 w, float d, const Staged& s, int i) {
    const int4* u = s.uq;
    const float4 sc = reinterpret_cast<const float4*>(s.us)[i];
    const int4 sm = reinterpret_cast<const int4*>(s.usum)[i];
    const int b = 8 * i;
    const float part = sc.x * float(2 * q1_set_sum(w.x, u[swz(b + 0)], u[swz(b + 1)]) - sm.x) +
                       sc.y * float(2 * q1_set_sum(w.y, u[swz(b + 2)], u[swz(b + 3)]) - sm.y) +
                       sc.z * float(2 * q1_set_sum(w.z, u[swz(b + 4)], u[swz(b + 5)]) - sm.z) +
                       sc.w * float(2 * q1_set_sum(w.w, u[swz(b + 6)], u[swz(b + 7)]) - sm.w);
    return d * part;
  }
};

// Bytes of codes per row: cols * bits / 8.
__host__ __device__ constexpr int64_t code_row_bytes(TensorType t, int64_t cols) {
  return t == TensorType::F32    ? cols * 4
         : t == TensorType::F16  ? cols * 2
         : t == TensorType::BF16 ? cols * 2
         : t == TensorType::Q8_0 ? cols
         : t == TensorType::Q4_0 ? cols / 2
                                 : cols / 8;
}

// Shared memory: the staged input, then (with a norm) the norm weight.
__host__ __device__ constexpr size_t staged_bytes(TensorType t, int cols) {
  return gemv_quantizes_x(t) ? size_t(cols) + size_t(cols / 32) * 8 : size_t(cols) * 4;
}
// Shared memory: the staged input, then (with a norm) the norm weight.
__host__ __device__ constexpr size_t gemv_smem_bytes(TensorType t, int cols, bool norm) {
  return staged_bytes(t, cols) + (norm ? size_t(cols) * 4 : 0);
}

// Rows per task and chunks per lane in flight, per type: Q1_0 rows are short
// Rows per task and 16-byte chunks per lane and row in one pipeline step. A
// SwiGLU task loads gate and up rows, so it takes half the rows. Q1_0 rows
// are short (512 bytes at 4096 columns: one chunk per lane), so its tasks are
// one step (the pipeline runs across tasks); kWide (Q1_0 with more than 4096
// columns) takes up to 4 chunks per lane (2 for SwiGLU pairs, for
// registers), so that a task of up to 16384 (8192) columns is still one step
// and its first step, loaded before the wait for the input, is all of it.
template <TensorType T, bool kPair, bool kWide = false>
struct Shape {
  static constexpr bool kQ1 = T == TensorType::Q1_0;
  static constexpr int kRows = kPair && !kQ1 ? 1 : 2;
  static constexpr int kUnroll = !kQ1 ? 4 : !kWide ? 1 : kPair ? 2 : 4;
};
constexpr int kQ1NarrowCols = 4096;  // Q1_0 matrices up to this width use the narrow shape

// A warp's pipeline walks (task, step within the task), its tasks strided by
// the grid's warp count: the position after (task, step).
struct PipelineStep {
  int task, step;
};
__device__ __forceinline__ PipelineStep next_pipeline_step(int task, int step, int steps_per_task, int stride) {
  return step + 1 == steps_per_task ? PipelineStep{task + stride, 0} : PipelineStep{task, step + 1};
}

// Staging reads x as float4s, kStageBatch independent loads per thread at a
// time (4096 columns: one batch per 256 threads), so it costs about one L2
// round trip per batch.
constexpr int kStageBatch = 4;
constexpr int kMaxWarps = 16;  // GemvTuning::warps_per_cta

// The norm weight is a model weight (nothing in flight writes it): each
// thread copies the float4s it will use into shared memory (cp.async, no
// registers held) before the kernel waits for its predecessor.
__device__ __forceinline__ void prefetch_norm(const KernelArgs& a, float4* smem_g) {
  if (!a.norm) return;
  const float4* g4 = reinterpret_cast<const float4*>(a.norm);
  for (int i = threadIdx.x; i < a.cols / 4; i += blockDim.x) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_g + i));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(g4 + i) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Stages u = x (* norm) into shared memory; returns 1/rms (1 without a norm).
// smem_g holds the norm weight (prefetch_norm; each thread reads back only
// what it copied itself, so waiting for its own copies is enough). For
// quantized types the 8 lanes holding one group of 32 values find its amax
// and code sum by shuffles; codes are round(u / scale).
template <TensorType T>
__device__ float stage_input(const KernelArgs& a, unsigned char* smem, const float4* smem_g) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int threads = blockDim.x;
  const int n4 = a.cols / 4;
  const float4* x4 = reinterpret_cast<const float4*>(a.x);
  if (a.norm) asm volatile("cp.async.wait_all;" ::: "memory");
  float ss = 0.0f;
  for (int base = 0; base < n4; base += threads * kStageBatch) {
    float4 v[kStageBatch];
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int i = base + b * threads + tid;
      v[b] = i < n4 ? x4[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int i = base + b * threads + tid;
      const float4 g = a.norm && i < n4 ? smem_g[i] : make_float4(1.f, 1.f, 1.f, 1.f);
      ss += v[b].x * v[b].x + v[b].y * v[b].y + v[b].z * v[b].z + v[b].w * v[b].w;
      const float4 u = make_float4(v[b].x * g.x, v[b].y * g.y, v[b].z * g.z, v[b].w * g.w);
      if constexpr (gemv_quantizes_x(T)) {
        // cols is a multiple of 256, so all lanes of a warp are in range or none.
        if (base + b * threads + (tid & ~31) >= n4) continue;
        float amax = fmaxf(fmaxf(fabsf(u.x), fabsf(u.y)), fmaxf(fabsf(u.z), fabsf(u.w)));
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float scale = amax / 127.0f;
        int q[4] = {0, 0, 0, 0};
        if (scale > 0.0f) {
          q[0] = __float2int_rn(u.x / scale);
          q[1] = __float2int_rn(u.y / scale);
          q[2] = __float2int_rn(u.z / scale);
          q[3] = __float2int_rn(u.w / scale);
        }
        // Values 4i..4i+3: byte (4i % 16) of 16-byte unit i / 4.
        int* uq = reinterpret_cast<int*>(smem);
        uq[swz(i >> 2) * 4 + (i & 3)] =
            (q[0] & 0xff) | ((q[1] & 0xff) << 8) | ((q[2] & 0xff) << 16) | (int(uint32_t(q[3]) << 24));
        int sum = q[0] + q[1] + q[2] + q[3];
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if ((lane & 7) == 0) {
          const int group = i >> 3;
          reinterpret_cast<float*>(smem + a.cols)[group] = scale;
          reinterpret_cast<int*>(smem + a.cols + (a.cols / 32) * 4)[group] = sum;
        }
      } else {
        if (i < n4) reinterpret_cast<float4*>(smem)[i] = u;
      }
    }
  }
  float inv_rms = 1.0f;
  if (a.norm) {
    __shared__ float partial[kMaxWarps];
    ss = warp_sum(ss);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < threads / 32; ++w) total += partial[w];
    inv_rms = 1.0f / sqrtf(total / float(a.cols) + a.eps);
  }
  __syncthreads();
  return inv_rms;
}

// The weights of one pipeline step: U chunks of R consecutive rows (rows past
// the matrix end re-read its last row; their results are never stored).
template <TensorType T, int R, int U>
struct RowBatch {
  uint4 w[U][R];
  float d[U][R];

  __device__ __forceinline__ void load(const uint8_t* codes, const uint16_t* scales, int row0, int rows,
                                       int64_t row_bytes, int scales_per_row, int base, int chunks) {
    using W = Weights<T>;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = min(row0 + r, rows - 1);
      const uint8_t* code_row = codes + row * row_bytes;
      const uint16_t* scale_row = scales + size_t(row) * scales_per_row;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + 32 * u;
        if (i < chunks) {
          w[u][r] = load_stream(code_row + size_t(i) * 16);
          if constexpr (W::kPerScale > 0)
            d[u][r] = half_bits_to_float(__ldg(scale_row + (i * W::kPerChunk) / W::kPerScale));
          else
            d[u][r] = 1.0f;
        } else {
          w[u][r] = make_uint4(0, 0, 0, 0);
          d[u][r] = 0.0f;
        }
      }
    }
  }
  __device__ __forceinline__ void accumulate(const Staged& s, int base, int chunks, float (&acc)[R]) const {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + 32 * u;
      if (i < chunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += Weights<T>::dot(w[u][r], d[u][r], s, i);
      }
    }
  }
};

template <TensorType T, bool kPair, bool kWide>
__global__ void __launch_bounds__(kMaxWarps * 32, 1) gemv_kernel(KernelArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int R = Shape<T, kPair, kWide>::kRows;
  constexpr int U = Shape<T, kPair, kWide>::kUnroll;
  constexpr int kMats = kPair ? 2 : 1;
  const int lane = threadIdx.x & 31;
  const int chunks = a.cols / Weights<T>::kPerChunk;
  const int steps_per_task = (chunks + 32 * U - 1) / (32 * U);  // warp-uniform
  const int64_t row_bytes = code_row_bytes(T, a.cols);
  const int scales_per_row = Weights<T>::kPerScale > 0 ? a.cols / Weights<T>::kPerScale : 0;
  const int warps = blockDim.x / 32;
  const int stride = gridDim.x * warps;

  // A pipeline step is (task, step within the task); the warp walks its tasks
  // (strided over the grid) step by step, loading step k+1 while computing k.
  auto segment_of = [&](int task) {
    int seg = 0;
    if (!kPair) {
      while (task >= a.task_end[seg]) ++seg;
    }
    return seg;
  };
  auto load = [&](RowBatch<T, R, U> (&batch)[kMats], int task, int step) {
    const int seg = segment_of(task);
    const int row0 = (task - (seg ? a.task_end[seg - 1] : 0)) * R;
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
      const int mi = kPair ? m : seg;
      batch[m].load(a.codes[mi], a.scales[mi], row0, a.rows[seg], row_bytes, scales_per_row,
                    lane + step * 32 * U, chunks);
    }
  };
  trace_event(a.trace, 0);
  allow_dependents();
  // The first step's weights do not depend on the input: issue their loads
  // before waiting for the kernel that writes x and before staging, so HBM
  // latency overlaps the predecessor's tail and the staging's L2 round trips.
  int task = blockIdx.x * warps + (threadIdx.x >> 5), step = 0;
  RowBatch<T, R, U> cur[kMats], next[kMats];
  if (task < a.n_tasks) load(cur, task, 0);
  float4* smem_g = reinterpret_cast<float4*>(smem + staged_bytes(T, a.cols));
  prefetch_norm(a, smem_g);
  wait_for_predecessor();
  trace_event(a.trace, 1);
  const float inv_rms = stage_input<T>(a, smem, smem_g);
  trace_event(a.trace, 2);
  Staged s;
  s.uf = reinterpret_cast<const float*>(smem);
  s.uq = reinterpret_cast<const int4*>(smem);
  s.us = reinterpret_cast<const float*>(smem + a.cols);
  s.usum = reinterpret_cast<const int*>(smem + a.cols + (a.cols / 32) * 4);

  float acc[kMats][R] = {};
  while (task < a.n_tasks) {
    const auto [next_task, next_step] = next_pipeline_step(task, step, steps_per_task, stride);
    if (next_task < a.n_tasks) load(next, next_task, next_step);
#pragma unroll
    for (int m = 0; m < kMats; ++m) cur[m].accumulate(s, lane + step * 32 * U, chunks, acc[m]);
    if (next_step == 0) {
      const int seg = segment_of(task);
      const int row0 = (task - (seg ? a.task_end[seg - 1] : 0)) * R;
      const int rows = a.rows[seg];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float v0 = warp_sum(acc[0][r]) * inv_rms;
        if constexpr (kPair) {
          const float v1 = warp_sum(acc[kMats - 1][r]) * inv_rms;
          if (lane == 0 && row0 + r < rows) a.y[0][row0 + r] = v0 / (1.0f + expf(-v0)) * v1;
        } else {
          if (lane == 0 && row0 + r < rows) {
            float* y = a.y[seg] + row0 + r;
            *y = a.epilogue == GemvEpilogue::add ? *y + v0 : v0;
          }
        }
#pragma unroll
        for (int m = 0; m < kMats; ++m) acc[m][r] = 0.0f;
      }
    }
#pragma unroll
    for (int m = 0; m < kMats; ++m) cur[m] = next[m];
    task = next_task;
    step = next_step;
  }
  if (a.trace) {
    __syncthreads();
    trace_event(a.trace, 3);
  }
}

// --- Q1_0 on the binary tensor cores (opt-in: set_q1_kernel) --------------
// The dp4a kernel above spends 4 integer instructions per 4 weights turning
// sign bits into bytes and multiplying, which makes large 1-bit GEMVs
// ALU-bound (~1-1.5 TB/s marginal on the H200). Here the bits never leave
// their words: the input is staged as int16 (one scale per 128 values, i.e.
// per Q1_0 block) in 16 bit-planes, and
//   mma.m8n8k128.and.popc   D[r][p] = popc(W_r & plane_p)
// counts, for 8 weight rows r and 8 planes p at once, the set bits that a
// row's sign bits share with a plane. For one block of 128 weights
//   sum_{bit=1} q_j = sum_{p<15} 2^p D[r][p] - 2^15 D[r][15]
// (two's complement), and sum_j s_j q_j = 2 * that - sum_j q_j, scaled by the
// block's weight scale d and input scale. int16 per 128 values is finer than
// the dp4a path's int8 per 32 for any input whose block maxima are within
// 258x of their 32-value maxima.
//
// Fragments (PTX m8n8k128 .b1, g = lane / 4, t = lane % 4): A holds row g,
// bits [32t, 32t + 32) of the block, i.e. word t of the row's 16-byte block;
// B holds plane g (then plane 8 + g), word t; D holds D[g][2t], D[g][2t + 1].
// Both operands use bit i of a word for the same weight (the planes are
// built in the transposed bit order of the sign words), so the pairing of
// bits in the AND is the same whatever order the hardware sums them in.
//
// The planes of an input are built once, by q1_prepare_kernel (one warp per
// block, 64 ballots per 128 values, plus one CTA for the norm's 1/rms), into
// a scratch buffer; every GEMV CTA copies them to shared memory. (Building
// them in every CTA, as a first version did, cost more than the products.)
// Prepared input layout (bytes): float inv_rms, 12 bytes pad, float
// scale[blocks], int sum[blocks], uint32 planes[blocks][16][4] (word t of
// plane p of block b at (b * 16 + p) * 4 + t: the 32 lanes of one B load read
// 32 consecutive words). Shared memory holds the same from `scale` on.
constexpr int kQ1Rows = 8;  // rows per task (mma M)

template <bool kPair>
struct Q1Shape {
  static constexpr int kBlocks = kPair ? 8 : 16;  // blocks per pipeline step: one word per lane and block
};

__host__ __device__ inline size_t q1_prepared_bytes(int cols) { return 16 + size_t(cols / 128) * (8 + 256); }
__host__ __device__ inline size_t q1_mma_smem(int cols) { return size_t(cols / 128) * (8 + 256); }

__global__ void __launch_bounds__(kThreads) q1_prepare_kernel(const float* __restrict__ x,
                                                              const float* __restrict__ norm, float eps, int cols,
                                                              unsigned char* __restrict__ out) {
  allow_dependents();
  wait_for_predecessor();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int blocks = cols / 128;
  float* block_scale = reinterpret_cast<float*>(out + 16);
  int* block_sum = reinterpret_cast<int*>(block_scale + blocks);
  uint32_t* planes = reinterpret_cast<uint32_t*>(block_sum + blocks);
  if (blockIdx.x == gridDim.x - 1) {  // the norm: 1/rms of x (1 without a norm)
    float ss = 0.0f;
    if (norm) {
      const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll 4
      for (int i = threadIdx.x; i < cols / 4; i += kThreads) {
        const float4 v = x4[i];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      }
    }
    __shared__ float partial[kWarps];
    ss = warp_sum(ss);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.0f;
      for (int w = 0; w < kWarps; ++w) total += partial[w];
      *reinterpret_cast<float*>(out) = norm ? 1.0f / sqrtf(total / float(cols) + eps) : 1.0f;
    }
    return;
  }
  // One warp per block. A ballot's bit l is lane l's predicate and must pair
  // with weight bit l of the transposed sign words (weight 4i + j at bit
  // 8j + i, gpu_layout.hpp): lane l holds value 4 (l % 8) + l / 8 of each 32.
  const int b = blockIdx.x * kWarps + warp;
  if (b >= blocks) return;
  const int value_of_lane = 4 * (lane & 7) + (lane >> 3);
  float v[4];
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int c = b * 128 + 32 * k + value_of_lane;
    v[k] = norm ? x[c] * norm[c] : x[c];
    amax = fmaxf(amax, fabsf(v[k]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = amax / 32767.0f;
  int sum = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int q = scale > 0.0f ? __float2int_rn(v[k] / scale) : 0;
    sum += q;
    uint32_t mine = 0;
#pragma unroll
    for (int p = 0; p < 16; ++p) {
      const uint32_t r = __ballot_sync(0xffffffffu, (q >> p) & 1);
      if (lane == p) mine = r;
    }
    if (lane < 16) planes[(b * 16 + lane) * 4 + k] = mine;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) {
    block_scale[b] = scale;
    block_sum[b] = sum;
  }
}

// Words of one pipeline step: block words of row g of each matrix, and their
// fp16 scales two to a word (blocks per row is even: cols % 256 == 0).
template <int kMats, int kBlocks>
struct Q1Step {
  uint32_t w[kMats][kBlocks];
  uint32_t d[kMats][kBlocks / 2];
};

template <bool kPair>
__global__ void __launch_bounds__(kThreads, 2) gemv_q1_mma_kernel(KernelArgs a, const unsigned char* prepared) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kMats = kPair ? 2 : 1;
  constexpr int kBlocks = Q1Shape<kPair>::kBlocks;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int blocks = a.cols / 128;
  const int steps_per_task = (blocks + kBlocks - 1) / kBlocks;
  const int64_t row_bytes = a.cols / 8;
  const int stride = gridDim.x * kWarps;
  const float* block_scale = reinterpret_cast<const float*>(smem);
  const int* block_sum = reinterpret_cast<const int*>(block_scale + blocks);
  const uint32_t* planes = reinterpret_cast<const uint32_t*>(block_sum + blocks);

  auto segment_of = [&](int task) {
    int seg = 0;
    if (!kPair) {
      while (task >= a.task_end[seg]) ++seg;
    }
    return seg;
  };
  auto load = [&](Q1Step<kMats, kBlocks>& st, int task, int step) {
    const int seg = segment_of(task);
    const int row = min((task - (seg ? a.task_end[seg - 1] : 0)) * kQ1Rows + g, a.rows[seg] - 1);
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
      const int mi = kPair ? m : seg;
      const uint8_t* code_row = a.codes[mi] + row * row_bytes;
      const uint16_t* scale_row = a.scales[mi] + size_t(row) * blocks;
#pragma unroll
      for (int k = 0; k < kBlocks; ++k) {
        const int b = step * kBlocks + k;
        st.w[m][k] = b < blocks ? __ldg(reinterpret_cast<const uint32_t*>(code_row + size_t(b) * 16) + t) : 0u;
        if (k % 2 == 0) st.d[m][k / 2] = b < blocks ? __ldg(reinterpret_cast<const uint32_t*>(scale_row + b)) : 0u;
      }
    }
  };

  allow_dependents();
  int task = blockIdx.x * kWarps + warp, step = 0;
  Q1Step<kMats, kBlocks> cur, next;
  if (task < a.n_tasks) load(cur, task, 0);  // weights: independent of the predecessor
  wait_for_predecessor();
  // The prepared input (q1_prepare_kernel) into shared memory.
  {
    const int n16 = int(q1_mma_smem(a.cols) / 16);
    const uint4* src = reinterpret_cast<const uint4*>(prepared + 16);
    for (int i = threadIdx.x; i < n16; i += kThreads) reinterpret_cast<uint4*>(smem)[i] = __ldcg(src + i);
  }
  const float inv_rms = __ldcg(reinterpret_cast<const float*>(prepared));
  __syncthreads();

  float acc[kMats] = {};
  while (task < a.n_tasks) {
    const auto [next_task, next_step] = next_pipeline_step(task, step, steps_per_task, stride);
    if (next_task < a.n_tasks) load(next, next_task, next_step);
#pragma unroll
    for (int k = 0; k < kBlocks; ++k) {
      const int b = step * kBlocks + k;
      if (b < blocks) {  // warp-uniform
        const uint32_t p_lo = planes[(b * 16 + g) * 4 + t], p_hi = planes[(b * 16 + 8 + g) * 4 + t];
        const float sb = block_scale[b];
        const int usum = t == 0 ? block_sum[b] : 0;  // subtracted once per row
#pragma unroll
        for (int m = 0; m < kMats; ++m) {
          int d0, d1, d2, d3;
          asm volatile("mma.sync.aligned.m8n8k128.row.col.s32.b1.b1.s32.and.popc {%0, %1}, {%2}, {%3}, {%4, %5};"
                       : "=r"(d0), "=r"(d1)
                       : "r"(cur.w[m][k]), "r"(p_lo), "r"(0), "r"(0));
          asm volatile("mma.sync.aligned.m8n8k128.row.col.s32.b1.b1.s32.and.popc {%0, %1}, {%2}, {%3}, {%4, %5};"
                       : "=r"(d2), "=r"(d3)
                       : "r"(cur.w[m][k]), "r"(p_hi), "r"(0), "r"(0));
          // Planes 2t, 2t+1 (d0, d1) and 8+2t, 9+2t (d2, d3); plane 15 (t == 3, d3) weighs -2^15.
          const int set_sum = (d0 << (2 * t)) + (d1 << (2 * t + 1)) + (d2 << (8 + 2 * t)) +
                              (t == 3 ? -(d3 << 15) : (d3 << (9 + 2 * t)));
          const uint16_t d = uint16_t(k % 2 ? cur.d[m][k / 2] >> 16 : cur.d[m][k / 2] & 0xffffu);
          acc[m] = fmaf(half_bits_to_float(d) * sb, float(2 * set_sum - usum), acc[m]);
        }
      }
    }
    if (next_step == 0) {
      // Row g's sum is spread over the 4 lanes of its group.
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
        acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], 1);
        acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], 2);
      }
      const int seg = segment_of(task);
      const int row = (task - (seg ? a.task_end[seg - 1] : 0)) * kQ1Rows + g;
      if (t == 0 && row < a.rows[seg]) {
        const float v0 = acc[0] * inv_rms;
        if constexpr (kPair) {
          const float v1 = acc[kMats - 1] * inv_rms;
          a.y[0][row] = v0 / (1.0f + expf(-v0)) * v1;
        } else {
          float* y = a.y[seg] + row;
          *y = a.epilogue == GemvEpilogue::add ? *y + v0 : v0;
        }
      }
#pragma unroll
      for (int m = 0; m < kMats; ++m) acc[m] = 0.0f;
    }
    cur = next;
    task = next_task;
    step = next_step;
  }
}


int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}
GemvTuning initial_tuning() {
  GemvTuning t;
  t.warps_per_cta = std::clamp(env_int("KVQ_GEMV_WARPS", t.warps_per_cta), 1, kMaxWarps);
  return t;
}
GemvTuning g_tuning = initial_tuning();

// CTAs of one kernel that stay resident per SM with `smem` bytes, cached per
// kernel (keyed by its address: instances share a function-pointer type).
template <typename Kernel>
int resident_ctas(Kernel kernel, size_t smem, int threads = kThreads) {
  struct Entry {
    size_t configured = 0;
    int ctas = 1;
  };
  static std::map<std::pair<const void*, int>, Entry> cache;
  Entry& e = cache[{reinterpret_cast<const void*>(kernel), threads}];
  if (smem > e.configured) {
    // Always raised: the static shared memory (the norm's partial sums) counts
    // against the 48 KiB default too.
    KVQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    int n = 0;
    KVQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
    e.ctas = std::max(1, n);
    e.configured = smem;
  }
  return e.ctas;
}

template <TensorType T, bool kPair, bool kWide = false>
void launch(KernelArgs& a, int rows_total_tasks, cudaStream_t stream) {
  const size_t smem = gemv_smem_bytes(T, a.cols, a.norm != nullptr);
  const int warps = std::clamp(g_tuning.warps_per_cta, 1, kMaxWarps);
  const int needed = (rows_total_tasks + warps - 1) / warps;
  const int per_sm = resident_ctas(gemv_kernel<T, kPair, kWide>, smem, warps * 32);
  const int grid = std::max(1, std::min(needed, per_sm * sm_count()));
  launch_dependent(gemv_kernel<T, kPair, kWide>, dim3(grid), dim3(warps * 32), smem, stream, a);
}

// The prepared-input buffer of calls that bring none (tests, the kernel lab).
DeviceBuffer<unsigned char>& fallback_q1_scratch() {
  static DeviceBuffer<unsigned char> buf;
  return buf;
}

template <bool kPair>
void launch_q1_mma(KernelArgs& a, DeviceBuffer<unsigned char>* scratch, cudaStream_t stream) {
  DeviceBuffer<unsigned char>& prepared = scratch ? *scratch : fallback_q1_scratch();
  KVQ_CHECK(prepared.size() >= q1_prepared_bytes(a.cols), Errc::internal, "GPU GEMV: Q1_0 scratch of ",
            prepared.size(), " bytes for ", a.cols, " columns (GemvScratch::reserve first)");
  const int blocks = a.cols / 128;
  launch_dependent(q1_prepare_kernel, dim3((blocks + kWarps - 1) / kWarps + 1), dim3(kThreads), 0, stream, a.x,
                   a.norm, a.eps, a.cols, prepared.data());
  const size_t smem = q1_mma_smem(a.cols);
  const int needed = (a.n_tasks + kWarps - 1) / kWarps;
  const int grid = std::max(1, std::min(needed, resident_ctas(gemv_q1_mma_kernel<kPair>, smem) * sm_count()));
  launch_dependent(gemv_q1_mma_kernel<kPair>, dim3(grid), dim3(kThreads), smem, stream, a,
                   static_cast<const unsigned char*>(prepared.data()));
}

template <bool kPair>
void dispatch(TensorType t, KernelArgs& a, DeviceBuffer<unsigned char>* q1_scratch, cudaStream_t stream) {
  switch (t) {
    case TensorType::F32: return launch<TensorType::F32, kPair>(a, a.n_tasks, stream);
    case TensorType::F16: return launch<TensorType::F16, kPair>(a, a.n_tasks, stream);
    case TensorType::BF16: return launch<TensorType::BF16, kPair>(a, a.n_tasks, stream);
    case TensorType::Q8_0: return launch<TensorType::Q8_0, kPair>(a, a.n_tasks, stream);
    case TensorType::Q4_0: return launch<TensorType::Q4_0, kPair>(a, a.n_tasks, stream);
    case TensorType::Q1_0:
      if (gemv_q1_uses_mma()) return launch_q1_mma<kPair>(a, q1_scratch, stream);
      if (a.cols > kQ1NarrowCols) return launch<TensorType::Q1_0, kPair, true>(a, a.n_tasks, stream);
      return launch<TensorType::Q1_0, kPair>(a, a.n_tasks, stream);
    default: break;
  }
  fail(Errc::internal, "GPU GEMV: no kernel for ", gguf::tensor_type_name(t));
}

template <bool kPair>
int rows_per_task(TensorType t) {
  switch (t) {
    case TensorType::F32: return Shape<TensorType::F32, kPair>::kRows;
    case TensorType::F16: return Shape<TensorType::F16, kPair>::kRows;
    case TensorType::BF16: return Shape<TensorType::BF16, kPair>::kRows;
    case TensorType::Q8_0: return Shape<TensorType::Q8_0, kPair>::kRows;
    case TensorType::Q4_0: return Shape<TensorType::Q4_0, kPair>::kRows;
    default: return gemv_q1_uses_mma() ? kQ1Rows : Shape<TensorType::Q1_0, kPair>::kRows;
  }
}

}  // namespace

namespace {
Q1Kernel initial_q1_kernel() {
  const char* env = std::getenv("KVQ_Q1_KERNEL");
  return env && std::strcmp(env, "mma") == 0 ? Q1Kernel::binary_mma : Q1Kernel::dp4a;
}
Q1Kernel g_q1_kernel = initial_q1_kernel();
}  // namespace

Q1Kernel q1_kernel() { return g_q1_kernel; }
GemvTuning gemv_tuning() { return g_tuning; }
void set_gemv_tuning(const GemvTuning& t) { g_tuning = t; }
void set_q1_kernel(Q1Kernel k) { g_q1_kernel = k; }
bool gemv_q1_uses_mma() { return g_q1_kernel == Q1Kernel::binary_mma; }

void GemvScratch::reserve(int64_t max_cols) {
  const size_t need = q1_prepared_bytes(int(max_cols));
  if (q1.size() < need) q1.resize(need);
}

GpuMatrix GpuMatrix::upload(const GpuMatrixLayout& layout) {
  GpuMatrix m;
  m.type = layout.type;
  m.rows = layout.rows;
  m.cols = layout.cols;
  m.codes.upload(layout.codes);
  if (!layout.scales.empty()) m.scales.upload(layout.scales);
  return m;
}

uint64_t gemv_bytes(const GpuMatrix& w) {
  return w.bytes() + uint64_t(w.cols) * sizeof(float) + uint64_t(w.rows) * sizeof(float);
}

void gemv(const GemvRequest& req, cudaStream_t stream) {
  KVQ_CHECK(req.n_out >= 1 && req.n_out <= kMaxOut && req.x, Errc::internal, "GPU GEMV: ", req.n_out,
            " outputs requested (1..3 with an input)");
  KVQ_CHECK(req.epilogue != GemvEpilogue::swiglu || req.n_out == 2, Errc::internal,
            "GPU GEMV: swiglu needs exactly two matrices (gate, up)");
  const GpuMatrix& w0 = *req.out[0].w;
  KVQ_CHECK(gpu_gemv_supported(w0.type, w0.cols), Errc::unsupported, "GPU GEMV: unsupported ",
            gguf::tensor_type_name(w0.type), " matrix with ", w0.cols, " columns");
  if (gguf::is_k_quant(w0.type)) return gemv_kquant(req, stream);  // gemv_kquant.cu
  // The staged input must fit in shared memory (200 KiB of the 227 available).
  const int capped_cols = int(std::min<int64_t>(w0.cols, 1 << 24));
  const size_t staged = w0.type == TensorType::Q1_0 && gemv_q1_uses_mma() ? q1_mma_smem(capped_cols)
                                                                          : gemv_smem_bytes(w0.type, capped_cols, req.norm_weight);
  KVQ_CHECK(staged <= 200 * 1024 &&
                w0.rows <= (int64_t(1) << 30),
            Errc::out_of_range, "GPU GEMV: matrix of ", w0.rows, " x ", w0.cols, " is too large");
  KernelArgs a{};
  a.x = req.x;
  a.norm = req.norm_weight;
  a.eps = req.norm_eps;
  a.cols = int(w0.cols);
  a.epilogue = req.epilogue;
  a.trace = req.trace;
  const int R = req.epilogue == GemvEpilogue::swiglu ? rows_per_task<true>(w0.type) : rows_per_task<false>(w0.type);
  int tasks = 0;
  for (int i = 0; i < req.n_out; ++i) {
    const GpuMatrix& w = *req.out[i].w;
    const bool needs_y = req.epilogue != GemvEpilogue::swiglu || i == 0;
    KVQ_CHECK(w.type == w0.type && w.cols == w0.cols && (req.out[i].y || !needs_y), Errc::internal,
              "GPU GEMV: fused matrices must share type and width (", gguf::tensor_type_name(w.type), " x ", w.cols,
              " vs ", gguf::tensor_type_name(w0.type), " x ", w0.cols, ")");
    KVQ_CHECK(w.rows >= 1, Errc::internal, "GPU GEMV: empty matrix");
    a.codes[i] = w.codes.data();
    a.scales[i] = w.scales.data();
    a.y[i] = req.out[i].y;
    if (a.y[i]) {
      const float* y = a.y[i];
      const bool overlaps_x = y < req.x + w.cols && req.x < y + w.rows;
      const bool overlaps_norm = req.norm_weight && y < req.norm_weight + w.cols && req.norm_weight < y + w.rows;
      KVQ_CHECK(!overlaps_x && !overlaps_norm, Errc::internal, "GPU GEMV: an output overlaps the input");
    }
    a.rows[i] = int(w.rows);
    if (req.epilogue != GemvEpilogue::swiglu || i == 0) tasks += int((w.rows + R - 1) / R);
    a.task_end[i] = tasks;
  }
  a.n_tasks = tasks;
  if (w0.type == TensorType::Q1_0 && gemv_q1_uses_mma() && !req.scratch) {
    DeviceBuffer<unsigned char>& fb = fallback_q1_scratch();
    if (fb.size() < q1_prepared_bytes(a.cols)) fb.resize(q1_prepared_bytes(a.cols));
  }
  if (req.epilogue == GemvEpilogue::swiglu) {
    KVQ_CHECK(req.out[1].w->rows == w0.rows, Errc::internal, "GPU GEMV: swiglu gate and up differ in rows");
    dispatch<true>(w0.type, a, req.scratch ? &req.scratch->q1 : nullptr, stream);
  } else {
    dispatch<false>(w0.type, a, req.scratch ? &req.scratch->q1 : nullptr, stream);
  }
}

void gemv(const GpuMatrix& w, const float* x, float* y, cudaStream_t stream) {
  GemvRequest req;
  req.x = x;
  req.out[0] = {&w, y};
  gemv(req, stream);
}

}  // namespace kvq::cuda
