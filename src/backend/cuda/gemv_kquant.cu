// K-quant GEMV kernels; see gemv_kquant.hpp for the work split and
// backend/gpu_layout.hpp / gguf/quant.hpp for the record layouts.
//
// The input is staged as int8 per 32 values with code sums per 16
// (gemv_stage.cuh), as the Q8_0/Q4_0/Q1_0 kernels stage it; each lane turns
// its codes of a run of 16 weights into 16 bytes (masks and shifts, no
// per-weight conversion) and dots them with the staged codes by dp4a. A run
// shares one scale (and one min or offset), so its sum is exact in int32 and
// the record's scales are applied once per run in fp32:
//   sum_i (d sc q_i - dmin m) x_i = s_x (d sc dot(q, u) - dmin m sum(u))
// for x_i = s_x u_i (s_x: the scale of u's group of 32). Offsets (Q6_K's
// q - 32, Q3_K's q - 4) enter as dot(q + o, u) - o sum(u), so the bytes stay
// non-negative.
// The lanes' parts of a record, their runs, bit layouts and shared-memory
// swizzles are in kquant_runs.cuh (shared with gemv_batch.cu).
#include "backend/cuda/gemv_kquant.hpp"

#include <cuda_fp16.h>

#include <algorithm>
#include <map>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/gemv_args.cuh"
#include "backend/cuda/gemv_stage.cuh"
#include "backend/cuda/occupancy.hpp"
#include "backend/cuda/kquant.cuh"
#include "backend/cuda/kquant_runs.cuh"
#include "backend/cuda/lab_trace.cuh"
#include "core/error.hpp"

namespace kvq::cuda {

using gguf::TensorType;

namespace {

using KArgs = gemv_detail::KernelArgs;
using gemv_detail::kMaxOut;
using gemv_detail::kMaxWarps;
using gemv_detail::Staged;

// A lane's part of one super-block against the staged input: the sum of
// its runs (kquant_runs.cuh).
template <TensorType T>
struct KLane : kq::Runs<T> {
  using R = kq::Runs<T>;
  static __device__ __forceinline__ float dot(const typename R::Data& d, int j, const Staged& s, int b) {
    float acc = 0.0f;
#pragma unroll
    for (int r = 0; r < R::kRuns; ++r) {
      const int c = R::unit(j, r), u = 16 * b + c;
      const int dot = kq::dot_run(R::codes(d, j, r), s.uq[R::Swizzle::in_block(b, c)]);
      acc += kq::run_value(R::scale(d, j, r), dot, s.usum[u], s.us[u >> 1]);
    }
    return acc;
  }
};

// Super-blocks per lane and pipeline step. The step being computed and the
// next one are both held (kMats x kUnroll records each); within 128
// registers a lane holds 4 Q4_K records (8 words each) per matrix, or 2 of
// the wider ones (10-13 words), and half that for SwiGLU pairs.
template <TensorType T, bool kPair>
constexpr int kUnroll = (T == TensorType::Q4_K ? 4 : 2) / (kPair ? 2 : 1);

template <TensorType T, int U>
struct RecordBatch {
  typename KLane<T>::Data d[U];
};

// A task is one row (for SwiGLU: the same row of gate and of up); a warp
// walks its tasks (strided over the grid) in steps of kSlots x U
// super-blocks, loading step k+1 (of this task or the next) while computing
// step k; the first step is loaded before the wait for the producer of x.
template <TensorType T, bool kPair>
__global__ void __launch_bounds__(kMaxWarps * 32, 1) gemv_kquant_kernel(KArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  using L = KLane<T>;
  constexpr int kRec = kq::code_bytes(T), kSc = kq::scale_count(T);
  constexpr int kSlots = 32 / L::kLanes;  // super-blocks side by side in a warp
  constexpr int U = kUnroll<T, kPair>;
  constexpr int kPerStep = kSlots * U;
  constexpr int kMats = kPair ? 2 : 1;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int slot = lane / L::kLanes, j = lane % L::kLanes;
  const int blocks = a.cols / 256;
  const int steps_per_task = (blocks + kPerStep - 1) / kPerStep;  // warp-uniform
  const int stride = gridDim.x * warps;
  auto segment_of = [&](int task) { return kPair ? 0 : gemv_detail::segment_of(a, task); };
  auto row_of = [&](int task, int seg) { return task - (seg ? a.task_end[seg - 1] : 0); };
  auto block_of = [&](int step, int u) { return step * kPerStep + slot + kSlots * u; };
  auto load = [&](RecordBatch<T, U> (&batch)[kMats], int task, int step) {
    const int seg = segment_of(task);
    const int row = row_of(task, seg);
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
      const int mi = kPair ? m : seg;
      const uint8_t* codes = a.codes[mi] + size_t(row) * blocks * kRec;
      const uint16_t* scales = a.scales[mi] + size_t(row) * blocks * kSc;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int b = block_of(step, u);
        if (b < blocks) batch[m].d[u] = L::load(codes + size_t(b) * kRec, scales + b * kSc, j);
      }
    }
  };
  trace_event(a.trace, 0);
  allow_dependents();
  int task = blockIdx.x * warps + (threadIdx.x >> 5), step = 0;
  RecordBatch<T, U> cur[kMats], next[kMats];
  if (task < a.n_tasks) load(cur, task, 0);
  float4* smem_g = reinterpret_cast<float4*>(smem + gemv_detail::staged_input_bytes(true, 16, a.cols));
  gemv_detail::prefetch_norm(a, smem_g);
  wait_for_predecessor();
  trace_event(a.trace, 1);
  const float inv_rms = gemv_detail::stage_input<true, typename L::Swizzle, 16>(a, smem, smem_g);
  trace_event(a.trace, 2);
  const Staged s = gemv_detail::staged_view(smem, a.cols);

  float acc[kMats] = {};
  while (task < a.n_tasks) {
    const auto [next_task, next_step] = gemv_detail::next_pipeline_step(task, step, steps_per_task, stride);
    if (next_task < a.n_tasks) load(next, next_task, next_step);
#pragma unroll
    for (int m = 0; m < kMats; ++m)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int b = block_of(step, u);
        if (b < blocks) acc[m] += L::dot(cur[m].d[u], j, s, b);
      }
    if (next_step == 0) {
      const int seg = segment_of(task);
      gemv_detail::finish_row<kPair>(a, seg, row_of(task, seg), acc[0], acc[kMats - 1], inv_rms, lane);
#pragma unroll
      for (int m = 0; m < kMats; ++m) acc[m] = 0.0f;
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

// Shared memory: the staged input, then (with a norm) the norm weight.
size_t kquant_smem_bytes(int cols, bool norm) {
  return gemv_detail::staged_input_bytes(true, 16, cols) + (norm ? size_t(cols) * 4 : 0);
}

template <TensorType T, bool kPair>
void launch(const KArgs& a, cudaStream_t stream, const DeviceContext& ctx) {
  const size_t smem = kquant_smem_bytes(a.cols, a.norm != nullptr);
  const int warps = std::clamp(ctx.settings.gemv_warps, 1, kMaxWarps);
  const int needed = (a.n_tasks + warps - 1) / warps;
  const int per_sm = resident_ctas(ctx, gemv_kquant_kernel<T, kPair>, smem, warps * 32);
  const int grid = std::max(1, std::min(needed, per_sm * ctx.sm_count()));
  launch_dependent(ctx, gemv_kquant_kernel<T, kPair>, dim3(grid), dim3(warps * 32), smem, stream, a);
}

template <bool kPair>
void dispatch(TensorType t, const KArgs& a, cudaStream_t stream, const DeviceContext& ctx) {
  switch (t) {
    case TensorType::Q2_K: return launch<TensorType::Q2_K, kPair>(a, stream, ctx);
    case TensorType::Q3_K: return launch<TensorType::Q3_K, kPair>(a, stream, ctx);
    case TensorType::Q4_K: return launch<TensorType::Q4_K, kPair>(a, stream, ctx);
    case TensorType::Q5_K: return launch<TensorType::Q5_K, kPair>(a, stream, ctx);
    case TensorType::Q6_K: return launch<TensorType::Q6_K, kPair>(a, stream, ctx);
    default: break;
  }
  fail(Errc::internal, "GPU GEMV: ", gguf::tensor_type_name(t), " is not a K-quant");
}

}  // namespace

void gemv_kquant(const GemvRequest& req, cudaStream_t stream, const DeviceContext& ctx) {
  KVQ_CHECK(req.n_out >= 1 && req.n_out <= kMaxOut && req.x, Errc::internal, "GPU GEMV: ", req.n_out,
            " outputs requested (1..3 with an input)");
  KVQ_CHECK(req.epilogue != GemvEpilogue::swiglu || req.n_out == 2, Errc::internal,
            "GPU GEMV: swiglu needs exactly two matrices (gate, up)");
  const GpuMatrix& w0 = *req.out[0].w;
  KVQ_CHECK(gguf::is_k_quant(w0.type) && gpu_gemv_supported(w0.type, w0.cols), Errc::unsupported,
            "GPU K-quant GEMV: unsupported ", gguf::tensor_type_name(w0.type), " matrix with ", w0.cols, " columns");
  KVQ_CHECK(kquant_smem_bytes(int(std::min<int64_t>(w0.cols, 1 << 24)), req.norm_weight) <= 200 * 1024 &&
                w0.rows <= (int64_t(1) << 30),
            Errc::out_of_range,
            "GPU GEMV: matrix of ", w0.rows, " x ", w0.cols, " is too large");
  KArgs a = gemv_detail::kernel_args(req, 1);  // one row per task
  if (req.epilogue == GemvEpilogue::swiglu) dispatch<true>(w0.type, a, stream, ctx);
  else dispatch<false>(w0.type, a, stream, ctx);
}

}  // namespace kvq::cuda
