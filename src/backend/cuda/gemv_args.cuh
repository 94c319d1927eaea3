// What every decode-GEMV kernel (gemv.cu: float, Q8_0, Q4_0, Q1_0;
// gemv_kquant.cu: Q2_K..Q6_K) takes from a GemvRequest, and the small device
// helpers they share. Internal to those two files.
#pragma once

#include <cstdint>

#include "backend/cuda/gemv.hpp"
#include "core/error.hpp"
#include "gguf/types.hpp"

namespace kvq::cuda::gemv_detail {

constexpr int kMaxOut = 3;     // outputs of one fused launch (GemvRequest::out)
constexpr int kMaxWarps = 16;  // KernelSettings::gemv_warps at most

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

// The launch arguments of a request whose matrices the caller has checked
// for its kernel (type, size), with every output's consistency checks and
// its task ranges: output s owns ceil(rows / rows_per_task) tasks (SwiGLU's
// up matrix none: its rows ride along with the gate's).
inline KernelArgs kernel_args(const GemvRequest& req, int rows_per_task) {
  const GpuMatrix& w0 = *req.out[0].w;
  KernelArgs a{};
  a.x = req.x;
  a.norm = req.norm_weight;
  a.eps = req.norm_eps;
  a.cols = int(w0.cols);
  a.epilogue = req.epilogue;
  a.trace = req.trace;
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
    if (needs_y) tasks += int((w.rows + rows_per_task - 1) / rows_per_task);
    a.task_end[i] = tasks;
  }
  a.n_tasks = tasks;
  if (req.epilogue == GemvEpilogue::swiglu)
    KVQ_CHECK(req.out[1].w->rows == w0.rows, Errc::internal, "GPU GEMV: swiglu gate and up differ in rows");
  return a;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The RMSNorm factor 1/rms of the staged input from each thread's partial sum
// of squares ss (every thread of the CTA calls it; `warps` warps): 1 without
// a norm. The caller synchronises before reading what it staged.
__device__ __forceinline__ float cta_inv_rms(float ss, const KernelArgs& a, int lane, int warp, int warps) {
  if (!a.norm) return 1.0f;
  __shared__ float partial[kMaxWarps];
  ss = warp_sum(ss);
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += partial[w];
  return 1.0f / sqrtf(total / float(a.cols) + a.eps);
}

// Weights are read exactly once: no L1 allocation. Not volatile (unlike
// ptx::load_stream16), so the compiler may move these loads within the
// GEMVs' software pipelines.
__device__ __forceinline__ uint4 load_weights16(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

}  // namespace kvq::cuda::gemv_detail
