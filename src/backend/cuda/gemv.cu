// Fused GEMV kernels; see gemv.hpp for what one launch computes and
// backend/gpu_layout.hpp for the weight layouts.
//
// Work split: a task is R consecutive rows of one output matrix (for swiglu:
// the same R rows of gate and of up). A CTA (16 warps by default,
// KernelSettings::gemv_warps) first stages the input u in shared memory, then each warp
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
// Shared memory (staged by gemv_stage.cuh, code sums per 32 values):
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
// (A Q1_0 kernel on the binary tensor cores, mma.m8n8k128.and.popc over
// int16 bit-planes of the input, was correct but 2.7x slower than dp4a and
// was removed; its design and numbers are in docs/perf.md and git history.)
#include "backend/cuda/gemv.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/gemv_args.cuh"
#include "backend/cuda/gemv_stage.cuh"
#include "backend/cuda/occupancy.hpp"
#include "backend/cuda/gemv_kquant.hpp"
#include "backend/cuda/lab_trace.cuh"
#include "core/error.hpp"

namespace kvq::cuda {

using gguf::TensorType;

namespace {

using gemv_detail::KernelArgs;
using gemv_detail::kMaxOut;
using gemv_detail::kMaxWarps;
using gemv_detail::warp_sum;
using gemv_detail::load_weights16;
using gemv_detail::Staged;

__device__ __forceinline__ float half_bits_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }

__device__ __forceinline__ int swz(int unit) { return (unit & ~7) | ((unit ^ (unit >> 3)) & 7); }
struct UnitSwizzle {
  static __device__ __forceinline__ int at(int unit) { return swz(unit); }
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

__host__ __device__ constexpr size_t staged_bytes(TensorType t, int cols) {
  return gemv_detail::staged_input_bytes(gemv_quantizes_x(t), 32, cols);
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
          w[u][r] = load_weights16(code_row + size_t(i) * 16);
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
  auto segment_of = [&](int task) { return kPair ? 0 : gemv_detail::segment_of(a, task); };
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
  gemv_detail::prefetch_norm(a, smem_g);
  wait_for_predecessor();
  trace_event(a.trace, 1);
  const float inv_rms = gemv_detail::stage_input<gemv_quantizes_x(T), UnitSwizzle>(a, smem, smem_g);
  trace_event(a.trace, 2);
  const Staged s = gemv_detail::staged_view(smem, a.cols);

  float acc[kMats][R] = {};
  while (task < a.n_tasks) {
    const auto [next_task, next_step] = gemv_detail::next_pipeline_step(task, step, steps_per_task, stride);
    if (next_task < a.n_tasks) load(next, next_task, next_step);
#pragma unroll
    for (int m = 0; m < kMats; ++m) cur[m].accumulate(s, lane + step * 32 * U, chunks, acc[m]);
    if (next_step == 0) {
      const int seg = segment_of(task);
      const int row0 = (task - (seg ? a.task_end[seg - 1] : 0)) * R;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        gemv_detail::finish_row<kPair>(a, seg, row0 + r, acc[0][r], acc[kMats - 1][r], inv_rms, lane);
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

template <TensorType T, bool kPair, bool kWide = false>
void launch(KernelArgs& a, int rows_total_tasks, cudaStream_t stream, const DeviceContext& ctx) {
  const size_t smem = gemv_smem_bytes(T, a.cols, a.norm != nullptr);
  const int warps = std::clamp(ctx.settings.gemv_warps, 1, kMaxWarps);
  const int needed = (rows_total_tasks + warps - 1) / warps;
  const int per_sm = resident_ctas(ctx, gemv_kernel<T, kPair, kWide>, smem, warps * 32);
  const int grid = std::max(1, std::min(needed, per_sm * ctx.sm_count()));
  launch_dependent(ctx, gemv_kernel<T, kPair, kWide>, dim3(grid), dim3(warps * 32), smem, stream, a);
}

template <bool kPair>
void dispatch(TensorType t, KernelArgs& a, cudaStream_t stream, const DeviceContext& ctx) {
  switch (t) {
    case TensorType::F32: return launch<TensorType::F32, kPair>(a, a.n_tasks, stream, ctx);
    case TensorType::F16: return launch<TensorType::F16, kPair>(a, a.n_tasks, stream, ctx);
    case TensorType::BF16: return launch<TensorType::BF16, kPair>(a, a.n_tasks, stream, ctx);
    case TensorType::Q8_0: return launch<TensorType::Q8_0, kPair>(a, a.n_tasks, stream, ctx);
    case TensorType::Q4_0: return launch<TensorType::Q4_0, kPair>(a, a.n_tasks, stream, ctx);
    case TensorType::Q1_0:
      if (a.cols > kQ1NarrowCols) return launch<TensorType::Q1_0, kPair, true>(a, a.n_tasks, stream, ctx);
      return launch<TensorType::Q1_0, kPair>(a, a.n_tasks, stream, ctx);
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
    default: return Shape<TensorType::Q1_0, kPair>::kRows;
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

uint64_t gemv_bytes(const GpuMatrix& w) {
  return w.bytes() + uint64_t(w.cols) * sizeof(float) + uint64_t(w.rows) * sizeof(float);
}

void gemv(const GemvRequest& req, cudaStream_t stream, const DeviceContext& ctx) {
  KVQ_CHECK(req.n_out >= 1 && req.n_out <= kMaxOut && req.x, Errc::internal, "GPU GEMV: ", req.n_out,
            " outputs requested (1..3 with an input)");
  KVQ_CHECK(req.epilogue != GemvEpilogue::swiglu || req.n_out == 2, Errc::internal,
            "GPU GEMV: swiglu needs exactly two matrices (gate, up)");
  const GpuMatrix& w0 = *req.out[0].w;
  KVQ_CHECK(gpu_gemv_supported(w0.type, w0.cols), Errc::unsupported, "GPU GEMV: unsupported ",
            gguf::tensor_type_name(w0.type), " matrix with ", w0.cols, " columns");
  if (gguf::is_k_quant(w0.type)) return gemv_kquant(req, stream, ctx);  // gemv_kquant.cu
  // The staged input must fit in shared memory (200 KiB of the 227 available).
  const int capped_cols = int(std::min<int64_t>(w0.cols, 1 << 24));
  const size_t staged = gemv_smem_bytes(w0.type, capped_cols, req.norm_weight);
  KVQ_CHECK(staged <= 200 * 1024 &&
                w0.rows <= (int64_t(1) << 30),
            Errc::out_of_range, "GPU GEMV: matrix of ", w0.rows, " x ", w0.cols, " is too large");
  const int R = req.epilogue == GemvEpilogue::swiglu ? rows_per_task<true>(w0.type) : rows_per_task<false>(w0.type);
  KernelArgs a = gemv_detail::kernel_args(req, R);
  if (req.epilogue == GemvEpilogue::swiglu) dispatch<true>(w0.type, a, stream, ctx);
  else dispatch<false>(w0.type, a, stream, ctx);
}

void gemv(const GpuMatrix& w, const float* x, float* y, cudaStream_t stream, const DeviceContext& ctx) {
  GemvRequest req;
  req.x = x;
  req.out[0] = {&w, y};
  gemv(req, stream, ctx);
}

}  // namespace kvq::cuda
