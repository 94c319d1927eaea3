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
  std::vector<float> centroids_f;  // float copy for the kernels
  std::vector<float> thresholds_f;
  double mse = 0;                  // per value, unit-variance source
  double sqnr_db() const;          // 10 log10(1 / mse)
  int iterations = 0;              // Lloyd iterations used
};

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

// Standard normal density and distribution function.
double normal_pdf(double x);
double normal_cdf(double x);

}  // namespace kvq::kv
