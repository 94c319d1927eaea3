// Hopper warpgroup MMA (wgmma, PTX ISA 9.7.15) for the kernels that use it:
// the shared-memory matrix descriptor, the fences and the few shapes used.
// sm_90a only: include from code compiled under KVQ_WGMMA and guard device
// bodies with KVQ_WGMMA_DEVICE (an sm_90a device pass).
//
// A warpgroup (4 consecutive warps, 128 threads) issues each instruction
// together; the accumulator D of m64nNk16 is laid out per warp like N/8
// mma.m16n8k16 C fragments side by side (warp w: rows 16w..16w+15; register
// 4j+e: e = 0, 1 row gid, columns 8j + 2tig + e; e = 2, 3 row gid + 8), and a
// register A operand is the m16n8k16 A fragment of the warp's 16 rows.
//
// SHARED-MEMORY OPERANDS use the 128-byte swizzle: an "atom" is 8 rows of
// 128 bytes (64 bf16), 1024-byte aligned, whose 16-byte chunk c of row r
// sits at chunk c ^ (r & 7). The descriptor holds the start address and two
// strides (bytes, >> 4):
//   K-major (the reduction dimension contiguous): SBO = from one 8-row group
//     to the next (1024 for rows of 128 bytes); LBO unused. A k16 step
//     inside an atom moves the start address by 32 bytes (the hardware
//     applies the swizzle to the address it forms).
//   N-major (B with imm-trans-b 1, N contiguous): LBO = from one 64-column
//     block of N to the next, SBO = from one 8-row group of K to the next.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KVQ_WGMMA_DEVICE 1
#endif

namespace kvq::cuda::wgmma {

// Matrix descriptor of an operand at shared address `addr` with the 128-byte
// swizzle (layout type 1 in bits 62-63; base offset 0: atoms 1024-aligned).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

#if defined(KVQ_WGMMA_DEVICE)
// Orders this thread's register writes (accumulators, A fragments) before
// the wgmma that reads them.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed groups of this warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (st.shared,
// cp.async) visible to wgmma's async-proxy reads; before the barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving reads or writes of d across an
// outstanding wgmma (the asm's operands tie them here).
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (+)= A B, m64n64k16: A (64 x 16) and B (K-major, 64 x 16) from shared memory.
__device__ __forceinline__ void mma_m64n64k16_ss(float (&d)[32], uint64_t a_desc, uint64_t b_desc, bool accumulate) {
  asm volatile(
      "{\n.reg .pred acc;\nsetp.ne.b32 acc, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, acc, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a_desc), "l"(b_desc), "r"(int(accumulate)));
}

// D += A B, m64n128k16: A (64 x 16 bf16) from registers (the m16n8k16 A
// fragment per warp), B (16 x 128) from shared memory N-major (imm-trans-b 1).
__device__ __forceinline__ void mma_m64n128k16_rs_nmajor(float (&d)[64], const uint32_t (&a)[4], uint64_t b_desc) {
  asm volatile(
      "{\n.reg .pred acc;\nsetp.eq.u32 acc, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, acc, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
}

// D += A B, m64n64k16: A (64 x 16 bf16) from registers (the m16n8k16 A
// fragment per warp), B (16 x 64) from shared memory N-major (imm-trans-b 1).
__device__ __forceinline__ void mma_m64n64k16_rs_nmajor(float (&d)[32], const uint32_t (&a)[4], uint64_t b_desc) {
  asm volatile(
      "{\n.reg .pred acc;\nsetp.eq.u32 acc, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, acc, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
}
#endif  // KVQ_WGMMA_DEVICE

}  // namespace kvq::cuda::wgmma

// Pipeline barriers for warp-specialized kernels (PTX ISA: mbarrier,
// cp.async.mbarrier.arrive, bar): a producer fills shared-memory stages and
// consumers wait on each stage's "full" barrier, then arrive on its "empty"
// one. Phases alternate: a waiter passes once the barrier's phase with the
// given parity has completed (the first phase has parity 0).
namespace kvq::cuda::pipe {
#if defined(KVQ_WGMMA_DEVICE)
__device__ __forceinline__ void init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// After the initialising thread's last init, before the CTA barrier that
// publishes them.
__device__ __forceinline__ void fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// One arrival once every cp.async this thread issued before it has landed
// (.noinc: the arrival is one of the `arrivals` the barrier was set up for).
__device__ __forceinline__ void arrive_on_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// A named CTA barrier (id 1..15; 0 is __syncthreads) that waits for
// `threads` threads, a subset of the CTA.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void copies_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
#endif  // KVQ_WGMMA_DEVICE
}  // namespace kvq::cuda::pipe
