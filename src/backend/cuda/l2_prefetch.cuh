// Bulk prefetch into L2 (Hopper's cp.async.bulk.prefetch): one instruction
// asks the memory system to bring a whole byte range into L2 and returns at
// once, holding no registers or shared memory. Decode attention uses it to
// ask for its first key tiles before waiting for its predecessor. A prefetch
// is a hint: it never changes results, so it may name data a running kernel
// is still writing (the later loads read whatever L2 holds then).
#pragma once

#include <cstdint>

namespace kvq::cuda {

// Prefetches [p, p + bytes) widened to 16-byte boundaries (the instruction's
// alignment; the widening stays inside the 256-byte granules of cudaMalloc).
__device__ __forceinline__ void prefetch_l2(const void* p, uint64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (bytes == 0) return;
  const uint64_t begin = reinterpret_cast<uint64_t>(p) & ~uint64_t(15);
  const uint64_t end = (reinterpret_cast<uint64_t>(p) + bytes + 15) & ~uint64_t(15);
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(begin), "r"(uint32_t(end - begin)) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace kvq::cuda
