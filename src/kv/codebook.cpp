#include "kv/codebook.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <mutex>

#include "core/error.hpp"
#include "core/half.hpp"
#include "kv/warp_sum.hpp"

namespace kvq::kv {

double normal_pdf(double x) { return std::exp(-0.5 * x * x) * 0.39894228040143267794; }
double normal_cdf(double x) { return 0.5 * std::erfc(-x * 0.70710678118654752440); }

float round_to_f16(float x) { return f16_to_f32(f32_to_f16(x)); }

double LloydMax::sqnr_db() const { return -10.0 * std::log10(mse); }

static LloydMax compute_lloyd_max(int bits) {
  const int n = 1 << bits;
  LloydMax q;
  q.bits = bits;
  q.centroids.resize(size_t(n));
  q.thresholds.resize(size_t(n - 1));
  // Start from uniform spacing over +-3 sigma.
  for (int i = 0; i < n; ++i) q.centroids[i] = -3.0 + 6.0 * (i + 0.5) / n;
  for (int it = 0; it < 200000; ++it) {
    for (int i = 0; i + 1 < n; ++i) q.thresholds[i] = 0.5 * (q.centroids[i] + q.centroids[i + 1]);
    double change = 0;
    for (int i = 0; i < n; ++i) {
      const double a = i == 0 ? -INFINITY : q.thresholds[i - 1];
      const double b = i == n - 1 ? INFINITY : q.thresholds[i];
      const double pa = std::isinf(a) ? 0.0 : normal_pdf(a), pb = std::isinf(b) ? 0.0 : normal_pdf(b);
      const double mass = normal_cdf(b) - normal_cdf(a);
      const double c = (pa - pb) / mass;
      change = std::max(change, std::fabs(c - q.centroids[i]));
      q.centroids[i] = c;
    }
    q.iterations = it + 1;
    if (change < 1e-13) break;
  }
  for (int i = 0; i + 1 < n; ++i) q.thresholds[i] = 0.5 * (q.centroids[i] + q.centroids[i + 1]);
  double energy = 0;
  for (int i = 0; i < n; ++i) {
    const double a = i == 0 ? -INFINITY : q.thresholds[i - 1];
    const double b = i == n - 1 ? INFINITY : q.thresholds[i];
    energy += (normal_cdf(b) - normal_cdf(a)) * q.centroids[i] * q.centroids[i];
  }
  q.mse = 1.0 - energy;
  // The blocks code with fp16-exact levels (what the GPU's tensor cores
  // read): the rounding moves a level by at most 2^-12 of itself, a change of
  // the MSE far below 1e-6; thresholds are the midpoints of the rounded levels.
  for (double c : q.centroids) q.centroids_f.push_back(round_to_f16(float(c)));
  for (int i = 0; i + 1 < n; ++i)
    q.thresholds_f.push_back(float(0.5 * (double(q.centroids_f[i]) + q.centroids_f[i + 1])));
  return q;
}

double unbiased_row_gain(const float* u, const float* c, int d, double max_excess) {
  // Each sum in warp order (kv/warp_sum.hpp): the GPU encoder's butterfly.
  const double uc = warp_order_sum(d, [&](int i) { return double(u[i]) * c[i]; });
  const double cc = warp_order_sum(d, [&](int i) { return double(c[i]) * c[i]; });
  const double uu = warp_order_sum(d, [&](int i) { return double(u[i]) * u[i]; });
  if (!(cc > 0) || !(uc > 0)) return cc > 0 ? std::max(uc, 0.0) / cc : 0.0;
  const double g_ls = uc / cc, e_ls = std::max(uu - uc * g_ls, 0.0) / d;  // per value
  const double g_u = uu / uc;
  return std::min(g_u, g_ls + std::sqrt(max_excess * e_ls * d / cc));
}

const LloydMax& lloyd_max_gaussian(int bits) {
  KVQ_CHECK(bits >= 1 && bits <= 8, Errc::invalid_argument, "Lloyd-Max codebook: bits ", bits, " not in 1..8");
  static std::array<std::unique_ptr<LloydMax>, 9> cache;
  static std::array<std::once_flag, 9> once;
  std::call_once(once[size_t(bits)], [&] { cache[size_t(bits)] = std::make_unique<LloydMax>(compute_lloyd_max(bits)); });
  return *cache[size_t(bits)];
}

}  // namespace kvq::kv
