// Error bounds for the tensor-core prefill attention (attention_prefill.cu)
// against the CPU `none` cache, which computes in fp32 from the same bf16 K/V.
//
// The kernel rounds two things to bf16 (unit roundoff u = 2^-8, round to
// nearest even): the queries, after multiplying them by scale * log2 e, and the
// probabilities P before the P.V product. Scores, the softmax state (m, l, with
// l summed from the unrounded P) and O accumulate in fp32.
//
// (1) Against the reference fed the kernel's OWN bf16 queries
//     (prefill_bf16_queries(): q_e = bf16(q * scale * log2 e) and scale ln 2,
//     so the reference's scores are the kernel's log2-unit scores times ln 2)
//     the only bf16 step left is P: the kernel returns
//       o = sum_j bf16(p_j) v_j / sum_j p_j,  |bf16(p) - p| <= u p,
//     hence |o - o_ref| <= u * sum_j p_j |v_j| / sum_j p_j <= u * max_j |v_j|.
//     Plus the fp32 allowance of the fp32 kernel's test, 1e-4 + 1e-4 |ref|
//     (summation order, ex2.approx, tensor-core accumulation: ~1e-6 relative
//     per score).
// (2) Against the plain fp32-query reference, additionally each score (natural
//     log units) moves by |D_j| <= u * scale * sum_d |q_d k_jd|
//     <= u * scale * |q|_2 * max_j |k_j|_2 =: E (Cauchy-Schwarz). Softmax
//     weights w_j = e^(s_j) / sum e^(s_k) then change by a factor within
//     [e^-2E, e^2E], so |sum_j (w'_j - w_j) v_j| <= (e^2E - 1) max |v|:
//       |o - o_ref| <= max|v| * (u + expm1(2E)) + 1e-4 + 1e-4 |ref|.
//     This is a worst case (every rounding error aligned); typical errors are
//     ~sqrt(D) times smaller, so (1) is the check with teeth and (2) proves the
//     stated end-to-end bound.
// max|v| is taken over all the KV head's cached rows (>= the visible ones).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cuda/attention_prefill.hpp"
#include "core/half.hpp"

namespace kvq::gputest {

constexpr double kBf16Unit = 1.0 / 256.0;           // u = 2^-8
constexpr float kLn2 = 0.693147180559945309417f;     // the reference's scale for bf16 log2-unit queries

// The queries exactly as the kernel rounds them (fp32 multiply, then RNE to bf16).
inline std::vector<float> prefill_bf16_queries(const std::vector<float>& q, float scale) {
  const float f = cuda::prefill_query_factor(scale);
  std::vector<float> out(q.size());
  for (size_t i = 0; i < q.size(); ++i) out[i] = bf16_to_f32(f32_to_bf16(q[i] * f));
  return out;
}

// Per KV head: max |v| and max_j |k_j|_2 over the cached (bf16) rows.
// k, v: [tokens][n_kv][D] fp32 as written to the caches.
struct KvHeadStats {
  std::vector<double> v_max, k_norm_max;
};
inline KvHeadStats kv_head_stats(const std::vector<float>& k, const std::vector<float>& v, int tokens, int n_kv,
                                 int D) {
  KvHeadStats s{std::vector<double>(n_kv, 0.0), std::vector<double>(n_kv, 0.0)};
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < n_kv; ++h) {
      const size_t off = (size_t(t) * n_kv + h) * D;
      double norm2 = 0;
      for (int d = 0; d < D; ++d) {
        const double kb = bf16_to_f32(f32_to_bf16(k[off + d])), vb = bf16_to_f32(f32_to_bf16(v[off + d]));
        norm2 += kb * kb;
        s.v_max[h] = std::max(s.v_max[h], std::fabs(vb));
      }
      s.k_norm_max[h] = std::max(s.k_norm_max[h], std::sqrt(norm2));
    }
  return s;
}

inline double fp32_allowance(double ref) { return 1e-4 + 1e-4 * std::fabs(ref); }

// Bound (1): vs the reference on prefill_bf16_queries().
inline double prefill_bound_bf16_queries(double ref, double v_max) {
  return fp32_allowance(ref) + kBf16Unit * v_max;
}

// Bound (2): vs the fp32-query reference; q_norm = |q|_2 of this output's query row.
inline double prefill_bound_fp32_queries(double ref, double v_max, double scale, double q_norm, double k_norm_max) {
  const double E = kBf16Unit * scale * q_norm * k_norm_max;
  return fp32_allowance(ref) + v_max * (kBf16Unit + std::expm1(2.0 * E));
}

inline double row_norm(const float* x, int D) {
  double s = 0;
  for (int d = 0; d < D; ++d) s += double(x[d]) * x[d];
  return std::sqrt(s);
}

}  // namespace kvq::gputest
