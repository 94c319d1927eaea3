// Resident CTAs per SM of a kernel launched with `smem` bytes of dynamic
// shared memory and `threads` per CTA, with the kernel's shared-memory opt-in
// raised as needed; cached per (kernel, block size), shared by every kernel
// file (one copy: an earlier per-file copy could LOWER the opt-in for a
// second block size and break a later launch that relied on the larger one).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "backend/cuda/cuda_check.hpp"

namespace kvq::cuda {

template <typename Kernel>
int resident_ctas(Kernel kernel, size_t smem, int threads) {
  struct Entry {
    size_t configured = 0;
    int ctas = 1;
  };
  static std::mutex mu;
  static std::map<const void*, size_t> opted_in;                // per kernel: the largest opt-in so far
  static std::map<std::pair<const void*, int>, Entry> entries;  // per (kernel, block size)
  std::lock_guard<std::mutex> lock(mu);
  const void* key = reinterpret_cast<const void*>(kernel);
  Entry& e = entries[{key, threads}];
  if (smem > e.configured) {
    // Raised at least once even below 48 KiB: static shared memory counts
    // against the default limit too.
    size_t& opted = opted_in[key];
    if (smem > opted) {
      KVQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      opted = smem;
    }
    int n = 0;
    KVQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
    e.ctas = std::max(1, n);
    e.configured = smem;
  }
  return e.ctas;
}

}  // namespace kvq::cuda
