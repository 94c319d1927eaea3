// The inline-PTX helpers the CUDA kernels share: streaming loads, shared
// memory loads, cp.async, tensor-core mma.sync and fp16/bf16 packing. One
// copy here instead of one per kernel file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace kvq::cuda::ptx {

// 16 bytes read once per kernel (weights, KV rows): read-only for the
// kernel's lifetime and streamed, so kept out of L1.
__device__ __forceinline__ uint4 load_stream16(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// KV rows as load_stream16, except where `coherent` (warp-uniform): from L2
// (ld.global.cg). The decode attention's fused q path reads the step's own
// row while the grid that writes it may still have been running when this
// kernel started (after a wait for it, but the non-coherent path may serve
// a line it holds from before).
__device__ __forceinline__ uint4 load_kv16(const void* p, bool coherent) {
  uint4 r;
  asm volatile(
      "{ .reg .pred c;\n setp.ne.b32 c, %5, 0;\n"
      " @c ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      " @!c ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4]; }"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p), "r"(int(coherent)));
  return r;
}
__device__ __forceinline__ uint2 load_kv8(const void* p, bool coherent) {
  uint2 r;
  asm volatile(
      "{ .reg .pred c;\n setp.ne.b32 c, %3, 0;\n"
      " @c ld.global.cg.v2.u32 {%0, %1}, [%2];\n"
      " @!c ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2]; }"
      : "=r"(r.x), "=r"(r.y)
      : "l"(p), "r"(int(coherent)));
  return r;
}
__device__ __forceinline__ uint32_t load_kv4(const void* p, bool coherent) {
  uint32_t r;
  asm volatile(
      "{ .reg .pred c;\n setp.ne.b32 c, %2, 0;\n"
      " @c ld.global.cg.u32 %0, [%1];\n"
      " @!c ld.global.nc.L1::no_allocate.u32 %0, [%1]; }"
      : "=r"(r)
      : "l"(p), "r"(int(coherent)));
  return r;
}

// Volatile so that the compiler keeps a shared-memory load where it is written
// (in a loop) instead of hoisting every iteration's load into registers.
__device__ __forceinline__ uint4 load_shared16(const void* p) {
  uint4 r;
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16-byte cp.async (.cg: L2 only); src_bytes < 16 zero-fills the rest.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D += A B, m16n8k16, fp32 accumulators (fragment layouts: attention_decode.cu).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint4& a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_bf16(c, make_uint4(a[0], a[1], a[2], a[3]), b0, b1);
}
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint4& a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ uint32_t pack2(uint32_t low_bits, uint32_t high_bits) { return low_bits | (high_bits << 16); }

// Round-to-nearest of x, returned as bits and as the float it represents.
__device__ __forceinline__ uint32_t bf16_bits(float x, float& as_float) {
  const __nv_bfloat16 b = __float2bfloat16_rn(x);
  as_float = __bfloat162float(b);
  return __bfloat16_as_ushort(b);
}
__device__ __forceinline__ uint32_t f16_bits(float x, float& as_float) {
  const __half h = __float2half_rn(x);
  as_float = __half2float(h);
  return __half_as_ushort(h);
}

// The transpose of an 8x8 b16 matrix held as an mma fragment (lane 4 g + t:
// row g, columns 2t, 2t+1): afterwards the lane holds rows 2t, 2t+1 of
// column g, i.e. row g, columns 2t, 2t+1 of the transpose.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// Two int8 codes as an exact half2. sel is a byte-permute selector over the
// 8 bytes {b, a} (a = bytes 0-3, b = bytes 4-7) that puts the low code in
// byte 0 and the high code in byte 2 (bytes 1 and 3 are don't-cares). fp16
// 0x64XX is 1024 + XX, and x ^ 0x80 = x + 128 for an int8 x, so one PRMT, one
// LOP3 and one HSUB2 of 1152 turn two codes into two exact fp16 values
// (sel is a plain argument so that unrolled loops can pass their index; it
// folds to an immediate.)
__device__ __forceinline__ uint32_t int8x2_to_half2(uint32_t a, uint32_t b, unsigned sel) {
  uint32_t t = __byte_perm(a, b, sel);
  t = (t & 0x00FF00FFu) ^ 0x64806480u;
  const __half2 h = *reinterpret_cast<const __half2*>(&t);
  const __half2 r = __hsub2(h, __half2half2(__ushort_as_half(static_cast<unsigned short>(0x6480u))));  // 1152
  return *reinterpret_cast<const uint32_t*>(&r);
}

}  // namespace kvq::cuda::ptx
