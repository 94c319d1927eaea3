// Bulk prefetch into L2 (Hopper's cp.async.bulk.prefetch): one instruction
// asks the memory system to bring a whole byte range into L2 and returns at
// once, holding no registers or shared memory. Decode attention uses it to
// ask for its first key tiles before waiting for its predecessor; the decode
// GEMVs use it to ask for the weights of the launches after them
// (L2PrefetchList). A prefetch is a hint: it never changes results, so it
// may name data a running kernel is still writing (the later loads read
// whatever L2 holds then).
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

// Byte ranges a launch asks L2 for on behalf of later launches (the weights
// of the next decode GEMVs: WeightPrefetchPlan). A kernel argument: built on
// the host, shared out by the kernel's warps.
struct L2PrefetchList {
  static constexpr int kMaxRanges = 12;
  const uint8_t* ptr[kMaxRanges];
  uint32_t bytes[kMaxRanges];
  int n;           // ranges in use
  uint64_t total;  // their bytes
};

// Every warp of the grid asks L2 for its share of `list` (one instruction
// per range its share touches, from lane 0): the list's bytes cut into
// grid-warps pieces of whole 256-byte granules, in order.
__device__ __forceinline__ void prefetch_l2_share(const L2PrefetchList& list) {
  if (list.n == 0 || (threadIdx.x & 31) != 0) return;
  const uint64_t warps = uint64_t(gridDim.x) * (blockDim.x / 32);
  const uint64_t warp = uint64_t(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  const uint64_t piece = ((list.total + warps - 1) / warps + 255) & ~uint64_t(255);
  const uint64_t lo = warp * piece, hi = lo + piece < list.total ? lo + piece : list.total;
  uint64_t base = 0;
  for (int i = 0; i < list.n && base < hi; ++i) {
    const uint64_t b0 = lo > base ? lo : base, end = base + list.bytes[i], b1 = hi < end ? hi : end;
    if (b0 < b1) prefetch_l2(list.ptr[i] + (b0 - base), b1 - b0);
    base = end;
  }
}

}  // namespace kvq::cuda
