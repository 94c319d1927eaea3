// The per-head q/k preparation of a decode step, one warp per head row:
// RMS norm with the head's weight, then RoPE at the step's position. Shared
// by qk_rope_store (ops.cu: k, and q when the attention does not take it)
// and the decode attention's fused q path (attention_decode.cu), so that both
// give the same bits. The arithmetic is the CPU's (cpu::rms_norm, cpu::rope):
// sum of squares and angles in double, products rounded one at a time (no
// contraction into fma), so the GPU rows match the CPU's to the ulp of the
// fp32 sine and cosine.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/rope_params.hpp"

namespace kvq::cuda {

// Which dims lane `lane` holds (kPer = D / 32 of them), chosen so that both
// members of every RoPE pair sit in the same lane: NEOX pairs (i, i + D/2):
// dims lane + 32 j; adjacent pairs (2i, 2i+1): dims lane * kPer + j.
template <int kPer>
__device__ __forceinline__ void rope_lane_dims(bool neox, int lane, int (&dim)[kPer]) {
#pragma unroll
  for (int j = 0; j < kPer; ++j) dim[j] = neox ? lane + 32 * j : lane * kPer + j;
}

// x (the lane's dims, rope_lane_dims) = RoPE(pos)(x / rms(x) * w); no norm when w is null.
template <int kPer>
__device__ __forceinline__ void norm_rope_row(float (&x)[kPer], const int (&dim)[kPer], const float* w, float eps,
                                              int pos, const RopeParams& rope) {
  constexpr int D = kPer * 32;
  if (w) {
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) ss = __dadd_rn(ss, __dmul_rn(double(x[j]), double(x[j])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss = __dadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
    const float inv = float(1.0 / sqrt(ss / D + double(eps)));
#pragma unroll
    for (int j = 0; j < kPer; ++j) x[j] = __fmul_rn(__fmul_rn(x[j], inv), w[dim[j]]);
  }
  // Pair (j, partner), frequency i; j and partner are compile-time (a
  // partner chosen at run time puts x in local memory).
  const auto rotate_pair = [&](const int j, const int partner, const int i) {
    const double a = double(pos) * rope.pos_scale * double(rope.inv_freq[i]);
    const float c = float(cos(a)), s = float(sin(a));
    const float x0 = x[j], x1 = x[partner];
    x[j] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    x[partner] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
  };
  if (rope.neox) {  // j < kPer/2 pairs with j + kPer/2
#pragma unroll
    for (int j = 0; j < kPer / 2; ++j) rotate_pair(j, j + kPer / 2, dim[j]);
  } else {  // even j pairs with j + 1
#pragma unroll
    for (int j = 0; j < kPer; j += 2) rotate_pair(j, j + 1, dim[j] / 2);
  }
}

}  // namespace kvq::cuda
