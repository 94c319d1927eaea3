// Kernel-lab timelines without a profiler: a kernel given a trace buffer
// folds its CTAs' %globaltimer readings into min/max pairs at the points it
// marks (GemvRequest::trace; KernelSettings::decode_trace and
// qk_rope_store_trace). Nothing is recorded when the buffer is null, which is
// how production launches run.
#pragma once

#include <cstdint>

namespace kvq::cuda {

// Nanoseconds of the GPU's global timer.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Folds the caller's timer reading into event `event` of trace: the
// minimum at trace[2 event], the maximum at trace[2 event + 1] (the caller
// sets them to UINT64_MAX and 0 first).
__device__ __forceinline__ void fold_timer(unsigned long long* trace, int event) {
  const unsigned long long t = global_timer_ns();
  atomicMin(trace + 2 * event, t);
  atomicMax(trace + 2 * event + 1, t);
}

// This CTA's reading (thread 0); no-op without a trace.
__device__ __forceinline__ void trace_event(unsigned long long* trace, int event) {
  if (trace && threadIdx.x == 0) fold_timer(trace, event);
}

// This warp's reading (lane 0), for kernels whose warps finish at different
// times; no-op without a trace.
__device__ __forceinline__ void trace_warp_event(unsigned long long* trace, int event) {
  if (trace && (threadIdx.x & 31) == 0) fold_timer(trace, event);
}

}  // namespace kvq::cuda
