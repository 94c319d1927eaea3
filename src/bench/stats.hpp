// Small statistics for benchmark cells: spreads over repetitions,
// percentiles of inter-token latencies, the least-squares ITL fit, and the
// digest that shows two runs generated the same tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/results.hpp"

namespace kvq::bench {

// Median (mean of the middle two for even sizes), min and max; zeros for an empty sample.
Spread spread(std::vector<double> v);
// The spread of one field over runs (e.g. &RepResult::decode_tps).
template <class Run>
Spread spread_of(const std::vector<Run>& runs, double Run::*field) {
  std::vector<double> v;
  for (const auto& r : runs) v.push_back(r.*field);
  return spread(v);
}

// Nearest-rank percentile (p in [0, 100]) of a non-empty sample: the
// smallest value with at least p % of the sample at or below it.
double percentile(std::vector<double> v, double p);

// Least squares y = a + b x with the RMS residual; needs >= 2 distinct x
// (throws Errc::invalid_argument otherwise).
struct LineFit {
  double a = 0;
  double b = 0;
  double rms_residual = 0;
};
LineFit fit_line(const std::vector<double>& x, const std::vector<double>& y);

// The ITL fit of one codec's measured cells: ITL p50 (ms) = a + b * kv_seq/1000.
// Uses the cells at 8k context and above when there are at least two of
// them (the spec's range: long contexts, where the KV read dominates), else
// every measured cell. nullopt-like: n_points == 0 when fewer than two
// distinct contexts were measured.
ItlFit fit_itl(const std::string& codec, const std::vector<CellResult>& cells);

// The decode attention kernels of a dispatch count with how many layers ran
// each: "cpu-packed (36 layers)"; "not counted" when the backend keeps no counters.
std::string dispatch_summary(const DispatchStats& d);

// FNV-1a 64 of the token ids, as 16 hex digits.
std::string token_digest(const std::vector<int32_t>& tokens);

}  // namespace kvq::bench
