// What every decode-GEMV kernel (gemv.cu: float, Q8_0, Q4_0, Q1_0;
// gemv_kquant.cu: Q2_K..Q6_K) takes from a GemvRequest, and the small device
// helpers they share. Internal to those two files.
#pragma once

#include <cstdint>

#include "backend/cuda/gemv.hpp"

namespace kvq::cuda::gemv_detail {

constexpr int kMaxOut = 3;     // outputs of one fused launch (GemvRequest::out)
constexpr int kMaxWarps = 16;  // GemvTuning::warps_per_cta at most

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
