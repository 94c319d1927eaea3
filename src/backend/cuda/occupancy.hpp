// Resident CTAs per SM of a kernel launched with `smem` bytes of dynamic
// shared memory and `threads` per CTA, with the kernel's shared-memory limit
// raised as needed, on ctx's device; cached per (device, kernel, block size)
// for the largest smem so far (KernelResources::resident_ctas_for_largest).
// Shared by every kernel file (one cache per device: an earlier per-file copy
// could LOWER the limit for a second block size and break a later launch
// that relied on the larger one).
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/device_context.hpp"

namespace kvq::cuda {

template <typename Kernel>
int resident_ctas(const DeviceContext& ctx, Kernel kernel, size_t smem, int threads) {
  return ctx.kernels().resident_ctas_for_largest(
      reinterpret_cast<const void*>(kernel), smem, threads,
      [&](size_t bytes) {
        KVQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
      },
      [&](size_t bytes) {
        int n = 0;
        KVQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, bytes));
        return n;
      });
}

}  // namespace kvq::cuda
