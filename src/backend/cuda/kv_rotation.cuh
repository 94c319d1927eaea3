// Per-row KV rotations on one warp, bit-identical to kv::Rotation::apply /
// apply_inverse (src/kv/rotation.cpp) for every RotationKind: the same
// float operations in the same order, each product and sum rounded on its
// own (__fmul_rn / __fadd_rn / __fsub_rn: nvcc must not contract them into
// FMAs, the CPU build has none).
//
// Table formats (GpuKvSide::rot_of(head), kv::Rotation::table()):
//   identity  none (table may be null).
//   hadamard  D signs (+1 / -1); y = H (s * x) / sqrt(D), H the natural-order
//             Walsh-Hadamard matrix. D a power of two in [32, 256].
//   isoclinic per 4-block b: a0..a3 (left unit quaternion), b0..b3 (right):
//             8 floats per block; y = a * x * b (quaternion products in
//             kv::qmul's order), inverse conj(a) * y * conj(b). A tail of
//             D mod 4 coordinates is copied.
//   rotor     per 3-block b: its row-major 3x3 matrix m (9 floats); y_r =
//             (m[3r] v0 + m[3r+1] v1) + m[3r+2] v2, inverse x_c = (m[c] v0 +
//             m[3+c] v1) + m[6+c] v2. D mod 3 == 2: cos, sin appended
//             (y0 = c x0 - s x1, y1 = s x0 + c x1; inverse with -s);
//             D mod 3 == 1: the last coordinate is copied.
//   givens    per pair p: cos, sin (2 floats); y0 = c a - s b, y1 = s a + c b
//             (inverse with -s); an odd last coordinate is copied.
//
// API (all lanes of the warp call every function, with the same arguments
// except lane):
//   rotate_element(kind, table, D, i, inverse, load) -> element i of R x
//       (or R^T x) where load(j) returns x_j; local kinds and identity only
//       (hadamard mixes every element: use the warp functions).
//   warp_rotate_regs<kNJ>(kind, table, lane, inverse, load, v): D = 32 kNJ;
//       v[j] = element lane + 32 j of R x (R^T x), x_j = load(j). Every kind.
//   warp_rotate_row(kind, table, x, y, D, lane, inverse): memory to memory
//       (global or shared), x == y allowed (in place). D <= 256 (hadamard:
//       32, 64, 128, 256; the local kinds any D). It __syncwarp()s before
//       reading (other lanes' writes to x are visible) and after writing;
//       rows written by other warps need the caller's __syncthreads().
//   warp_hadamard<kNJ>(v, signs, lane, inverse), warp_fwht_normalized<kNJ>:
//       the Walsh-Hadamard rotation of a row held one value per lane per j.
#pragma once

#include <cstdint>

#include "backend/cuda/kv_store.hpp"

namespace kvq::cuda {

// The normalised Walsh-Hadamard transform of a row held by one warp, value j
// of a lane = element lane + 32 j (kNJ = D / 32): the stages of
// kv::fwht_normalized in its order (h = 1, 2, 4, ...; lower element a + b,
// upper a - b) and its final scale 1/sqrt(D), so results are bit-identical to
// the CPU rotation. Stages h < 32 pair lanes, the others pair a lane's values.
template <int kNJ>
__device__ __forceinline__ void warp_fwht_normalized(float (&v)[kNJ], int lane) {
#pragma unroll
  for (int h = 1; h < 32; h <<= 1)
#pragma unroll
    for (int j = 0; j < kNJ; ++j) {
      const float other = __shfl_xor_sync(0xffffffffu, v[j], h);
      v[j] = (lane & h) ? __fsub_rn(other, v[j]) : __fadd_rn(v[j], other);
    }
#pragma unroll
  for (int hj = 1; hj < kNJ; hj <<= 1)
#pragma unroll
    for (int j = 0; j < kNJ; ++j)
      if ((j & hj) == 0) {
        const float a = v[j], b = v[j + hj];
        v[j] = __fadd_rn(a, b);
        v[j + hj] = __fsub_rn(a, b);
      }
  const float s = __fdiv_rn(1.0f, __fsqrt_rn(float(32 * kNJ)));
#pragma unroll
  for (int j = 0; j < kNJ; ++j) v[j] = __fmul_rn(v[j], s);
}

// y = R x (forward: signs, then the transform) or x = R^T y (inverse: the
// transform, then signs) of one warp-held row, as kv::HadamardRotation.
template <int kNJ>
__device__ __forceinline__ void warp_hadamard(float (&v)[kNJ], const float* signs, int lane, bool inverse) {
  if (!inverse) {
#pragma unroll
    for (int j = 0; j < kNJ; ++j) v[j] = __fmul_rn(v[j], signs[lane + 32 * j]);
  }
  warp_fwht_normalized<kNJ>(v, lane);
  if (inverse) {
#pragma unroll
    for (int j = 0; j < kNJ; ++j) v[j] = __fmul_rn(v[j], signs[lane + 32 * j]);
  }
}

namespace rot_detail {
struct Quat {
  float w, x, y, z;
};
// kv::qmul: each component a left-to-right sum of rounded products.
__device__ __forceinline__ Quat qmul(const Quat& a, const Quat& b) {
  Quat r;
  r.w = __fsub_rn(__fsub_rn(__fsub_rn(__fmul_rn(a.w, b.w), __fmul_rn(a.x, b.x)), __fmul_rn(a.y, b.y)),
                  __fmul_rn(a.z, b.z));
  r.x = __fsub_rn(__fadd_rn(__fadd_rn(__fmul_rn(a.w, b.x), __fmul_rn(a.x, b.w)), __fmul_rn(a.y, b.z)),
                  __fmul_rn(a.z, b.y));
  r.y = __fadd_rn(__fadd_rn(__fsub_rn(__fmul_rn(a.w, b.y), __fmul_rn(a.x, b.z)), __fmul_rn(a.y, b.w)),
                  __fmul_rn(a.z, b.x));
  r.z = __fadd_rn(__fsub_rn(__fadd_rn(__fmul_rn(a.w, b.z), __fmul_rn(a.x, b.y)), __fmul_rn(a.y, b.x)),
                  __fmul_rn(a.z, b.w));
  return r;
}
__device__ __forceinline__ float qcomp(const Quat& q, int c) { return c == 0 ? q.w : c == 1 ? q.x : c == 2 ? q.y : q.z; }
}  // namespace rot_detail

// Element i of R x (inverse: R^T x) for the local kinds (isoclinic, rotor,
// givens) and identity; x_j = load(j). Exactly the CPU's operations for that
// element (the whole block's product is formed, the element picked).
template <class Load>
__device__ __forceinline__ float rotate_element(RotationKind kind, const float* t, int D, int i, bool inverse,
                                                Load&& load) {
  using rot_detail::Quat;
  switch (kind) {
    case RotationKind::isoclinic: {
      const int b = i >> 2;
      if (b >= D / 4) return load(i);
      const float* q = t + 8 * b;
      Quat a{q[0], q[1], q[2], q[3]}, c{q[4], q[5], q[6], q[7]};
      if (inverse) {
        a.x = -a.x, a.y = -a.y, a.z = -a.z;
        c.x = -c.x, c.y = -c.y, c.z = -c.z;
      }
      const Quat v{load(4 * b), load(4 * b + 1), load(4 * b + 2), load(4 * b + 3)};
      return rot_detail::qcomp(rot_detail::qmul(rot_detail::qmul(a, v), c), i & 3);
    }
    case RotationKind::rotor: {
      const int nb = D / 3, b = i / 3;
      if (b < nb) {
        const float* m = t + 9 * b;
        const int r = i - 3 * b;
        const float v0 = load(3 * b), v1 = load(3 * b + 1), v2 = load(3 * b + 2);
        if (!inverse) return __fadd_rn(__fadd_rn(__fmul_rn(m[3 * r], v0), __fmul_rn(m[3 * r + 1], v1)), __fmul_rn(m[3 * r + 2], v2));
        return __fadd_rn(__fadd_rn(__fmul_rn(m[r], v0), __fmul_rn(m[3 + r], v1)), __fmul_rn(m[6 + r], v2));
      }
      const int t0 = 3 * nb;
      if (D - t0 == 1) return load(i);
      // 2-tail: (c, s) after the matrices
      const float c = t[9 * nb], s = inverse ? -t[9 * nb + 1] : t[9 * nb + 1];
      const float x0 = load(t0), x1 = load(t0 + 1);
      return i == t0 ? __fsub_rn(__fmul_rn(c, x0), __fmul_rn(s, x1)) : __fadd_rn(__fmul_rn(s, x0), __fmul_rn(c, x1));
    }
    case RotationKind::givens: {
      const int p = i >> 1;
      if (p >= D / 2) return load(i);
      const float c = t[2 * p], s = inverse ? -t[2 * p + 1] : t[2 * p + 1];
      const float a = load(2 * p), b = load(2 * p + 1);
      return (i & 1) ? __fadd_rn(__fmul_rn(s, a), __fmul_rn(c, b)) : __fsub_rn(__fmul_rn(c, a), __fmul_rn(s, b));
    }
    default: return load(i);  // identity (hadamard never comes here)
  }
}

// v[j] = element lane + 32 j of R x (R^T x), D = 32 kNJ, x_j = load(j).
template <int kNJ, class Load>
__device__ __forceinline__ void warp_rotate_regs(RotationKind kind, const float* t, int lane, bool inverse, Load&& load,
                                                 float (&v)[kNJ]) {
  if (kind == RotationKind::hadamard) {
#pragma unroll
    for (int j = 0; j < kNJ; ++j) v[j] = load(lane + 32 * j);
    warp_hadamard<kNJ>(v, t, lane, inverse);
    return;
  }
#pragma unroll
  for (int j = 0; j < kNJ; ++j) v[j] = rotate_element(kind, t, 32 * kNJ, lane + 32 * j, inverse, load);
}

namespace rot_detail {
template <int kNJ>
__device__ __forceinline__ void hadamard_row(const float* signs, const float* x, float* y, int lane, bool inverse) {
  float v[kNJ];
#pragma unroll
  for (int j = 0; j < kNJ; ++j) v[j] = x[lane + 32 * j];
  warp_hadamard<kNJ>(v, signs, lane, inverse);
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kNJ; ++j) y[lane + 32 * j] = v[j];
}
}  // namespace rot_detail

// y = R x (inverse: R^T x), any memory, in place allowed; see the top.
__device__ __forceinline__ void warp_rotate_row(RotationKind kind, const float* t, const float* x, float* y, int D,
                                                int lane, bool inverse) {
  __syncwarp();
  if (kind == RotationKind::hadamard) {
    switch (D) {
      case 32: rot_detail::hadamard_row<1>(t, x, y, lane, inverse); break;
      case 64: rot_detail::hadamard_row<2>(t, x, y, lane, inverse); break;
      case 128: rot_detail::hadamard_row<4>(t, x, y, lane, inverse); break;
      case 256: rot_detail::hadamard_row<8>(t, x, y, lane, inverse); break;
      default: __trap();
    }
    __syncwarp();
    return;
  }
  if (D > 256) __trap();
  float v[8];
  const auto load = [x](int j) { return x[j]; };
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int i = lane + 32 * j;
    v[j] = i < D ? rotate_element(kind, t, D, i, inverse, load) : 0.0f;
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (lane + 32 * j < D) y[lane + 32 * j] = v[j];
  __syncwarp();
}

}  // namespace kvq::cuda
