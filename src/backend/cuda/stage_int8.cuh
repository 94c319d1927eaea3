// The int8 staging of an input vector that the dp4a GEMVs (gemv_stage.cuh,
// gemv_batch.cu) and the tensor-core batched GEMM (gemm_tc.cu) share, so that
// all round every input value the same way: each group of 32 consecutive
// values is held by 8 consecutive lanes (4 values each, lane & 7 = position in
// the group), scale = amax / 127 of the group, q = round-to-nearest(u * (127 /
// amax)) (0 for an all-zero group). The tensor-core GEMM's Q1_0 path takes one
// scale per 128 values instead (span 32: the whole warp).
// One IEEE division per lane, not one per value as u / scale was (the
// divisions were most of the staging's arithmetic: H200, bonsai-8b, the fused
// GEMVs of a step 1.08 -> 1.04 ms, session 24). The product differs from
// u / scale by an ulp or two, so a value within ~1e-5 of a half step may round
// the other way than the quotient would; either way the code is within half a
// step (+ 127 * 2^-22 of a step) of u / scale.
#pragma once

#include <cuda_runtime.h>

namespace kvq::cuda {

// Every lane of the warp must call it (shuffles over lanes xor 4, 2, 1; with
// span 32 also xor 16, 8: one scale for the warp's 128 values, the grain of
// the tensor-core GEMM's Q1_0 path, whose weights have one scale per 128).
__device__ __forceinline__ void quantize4_int8(const float4& u, float& scale, int (&q)[4], int span = 8) {
  float amax = fmaxf(fmaxf(fabsf(u.x), fabsf(u.y)), fmaxf(fabsf(u.z), fabsf(u.w)));
  for (int o = span / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  scale = amax / 127.0f;
  q[0] = q[1] = q[2] = q[3] = 0;
  if (scale > 0.0f) {
    const float inv = 127.0f / amax;  // |u * inv| <= 127 (1 + 2^-23): never rounds past 127
    q[0] = __float2int_rn(u.x * inv);
    q[1] = __float2int_rn(u.y * inv);
    q[2] = __float2int_rn(u.z * inv);
    q[3] = __float2int_rn(u.w * inv);
  }
}

// Four int8 codes as one little-endian word (code 0 in the low byte).
__device__ __forceinline__ int pack_int8x4(const int (&q)[4]) {
  return (q[0] & 0xff) | ((q[1] & 0xff) << 8) | ((q[2] & 0xff) << 16) | int(uint32_t(q[3]) << 24);
}

}  // namespace kvq::cuda
