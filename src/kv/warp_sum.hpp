// The "warp order" of a double sum: the one order in which every bit-exact
// row sum of the KV encoders is defined, on the CPU (here) and on the GPU
// (kv_codec_hooks.cuh, where one warp holds a row as element lane + 32 j in
// register j of lane `lane` and computes it with an xor butterfly).
//
// Sum of term(0) .. term(n-1), n >= 0 (any n; a row of D <= kMaxHeadDim
// values, or one 32-value group with n <= 32):
//   1. Element i belongs to lane i % 32, slot i / 32. Every lane l in 0..31
//      sums its own slots sequentially in slot order:
//        p[l] = 0.0;  p[l] = p[l] + term(l), p[l] = p[l] + term(l + 32), ...
//      (IEEE double adds, round to nearest). A lane with no element (l >= n)
//      keeps p[l] = +0.0; for n not a multiple of 32 the missing elements of
//      the last slot contribute nothing. (p never becomes -0.0: it starts at
//      +0.0 and +0.0 + -0.0 = +0.0, so "nothing" and "+0.0" are the same.)
//   2. The 32 partials are combined by an xor butterfly:
//        for k in 16, 8, 4, 2, 1:  p[l] = p[l] + p[l ^ k]  (every l at once)
//      IEEE addition is commutative, so p[l] and p[l ^ k] get the same bits
//      and after the last step every lane holds the same value; that is the
//      sum. Lane 0's tree: p[l] + p[l + h] for l < h, h = 16, 8, 4, 2, 1.
// The GPU: acc = 0.0; acc = __dadd_rn(acc, t[j]) for j = 0 .. kNJ - 1, then
//   for (o = 16; o; o >>= 1) acc = __dadd_rn(acc, __shfl_xor_sync(~0u, acc, o));
// A 32-value group g of a GPU row (elements [32g, 32g + 32): slot g of every
// lane) is the same sum with n = 32: one term per lane, then the butterfly.
// The terms themselves (products, differences) are computed by the caller,
// each rounded on its own (no FMA: the x86-64 build has none, the GPU code
// uses __dmul_rn / __dadd_rn).
#pragma once

namespace kvq::kv {

constexpr int kWarpSumLanes = 32;

// sum over i in [0, n) of term(i) in warp order; term(int) -> double.
template <class Term>
inline double warp_order_sum(int n, Term&& term) {
  double p[kWarpSumLanes];
  for (int l = 0; l < kWarpSumLanes; ++l) {
    double acc = 0.0;
    for (int i = l; i < n; i += kWarpSumLanes) acc = acc + double(term(i));
    p[l] = acc;
  }
  for (int h = kWarpSumLanes / 2; h > 0; h >>= 1)
    for (int l = 0; l < h; ++l) p[l] = p[l] + p[l + h];
  return p[0];
}

// The same over an array of n terms.
inline double warp_order_sum(const double* terms, int n) {
  return warp_order_sum(n, [terms](int i) { return terms[i]; });
}

}  // namespace kvq::kv
