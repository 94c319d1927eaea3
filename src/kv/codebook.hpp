// Lloyd-Max scalar quantizers for a unit Gaussian, computed once (per process)
// by iterating the two Lloyd conditions to convergence with exact Gaussian
// integrals: thresholds are midpoints of neighbouring centroids, and each
// centroid is the conditional mean of its cell,
//   c_i = (phi(t_{i-1}) - phi(t_i)) / (Phi(t_i) - Phi(t_{i-1})).
// MSE = 1 - sum_i P_i c_i^2 (centroid condition). Reference values:
// 1 bit 0.3634, 2 bits 0.1175, 3 bits 0.03454, 4 bits 0.009497.
#pragma once

#include <vector>

namespace kvq::kv {

struct LloydMax {
  int bits = 0;
  std::vector<double> centroids;   // 2^bits, ascending, symmetric
  std::vector<double> thresholds;  // 2^bits - 1 cell boundaries, ascending
  std::vector<float> centroids_f;  // the blocks' levels: centroids rounded to fp16 (exact in float and fp16)
  std::vector<float> thresholds_f;  // midpoints of neighbouring centroids_f
  double mse = 0;                  // per value, unit-variance source
  double sqnr_db() const;          // 10 log10(1 / mse)
  int iterations = 0;              // Lloyd iterations used
};

// x rounded to the nearest fp16 value (codebook levels are fp16-exact so
// that the GPU's fp16 tensor-core fragments hold them exactly).
float round_to_f16(float x);

// bits in 1..8. Thread-safe, cached.
const LloydMax& lloyd_max_gaussian(int bits);

// Index of the nearest centroid of a sorted codebook given its thresholds.
inline int nearest_index(const float* thresholds, int n_levels, float x) {
  int lo = 0, hi = n_levels - 1;  // answer in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (x > thresholds[mid]) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// The gain g of a row coded as levels c[0..d) of its unit-variance rotated
// coordinates u[0..d) (sum u_i^2 = d): the reconstruction is g * c, and the
// block stores ||x|| * g as its fp16 scale. Lloyd-Max levels are conditional
// means, so c is shrunk towards 0 (E<u, c> = E|c|^2 = d (1 - mse)); with
// g = 1 every q.k and every attention output would be shrunk by (1 - mse)
// (2 bits: -11.8 %), a bias that does not average out over tokens. The
// unbiased gain g_u = d / <u, c> makes <g c, u> = |u|^2 (the reconstruction's
// projection on the row is the row), at a small cost in squared error. The
// gain returned is g_u, capped where it would cost more than `max_excess`
// (relative) squared error over the row's least-squares gain g* = <u,c>/|c|^2:
//   e(g) = e* + |c|^2 (g - g*)^2 / d,  so  g = min(g_u, g* + sqrt(max_excess e* d) / |c|).
// 0 for an all-zero code row. <u,c>, |c|^2 and |u|^2 are each summed in
// double in warp order (kv/warp_sum.hpp), the order the GPU encoder uses.
double unbiased_row_gain(const float* u, const float* c, int d, double max_excess);
// max_excess used by turbo and tcq: 0.2 dB (10^0.02 - 1).
constexpr double kGainMaxExcess = 0.047128548050899534;

// Standard normal density and distribution function.
double normal_pdf(double x);
double normal_cdf(double x);

}  // namespace kvq::kv
