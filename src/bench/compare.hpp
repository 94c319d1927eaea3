// `kvq bench compare` and `kvq bench list`: two runs side by side per cell,
// and the runs a runs.db holds.
#pragma once

#include <string>
#include <vector>

#include "bench/results.hpp"
#include "bench/runs_db.hpp"

namespace kvq::bench {

struct CellDelta {
  std::string codec;
  int ctx = 0;
  int batch = 1;
  const CellResult* a = nullptr;  // nullptr: the cell is not in that run
  const CellResult* b = nullptr;
  double tps_ratio = 0;   // b / a decode tok/s (medians); 0 unless both were measured
  double ttft_ratio = 0;  // b / a TTFT
  double itl_ratio = 0;   // b / a ITL p50
  bool regression = false;
  bool improvement = false;
  std::string verdict;    // "same", "faster", "REGRESSION: decode", "REGRESSION: now oom", ...
};

struct Comparison {
  std::vector<CellDelta> rows;  // A's cell order, then cells only in B
  int regressions = 0;
  int improvements = 0;
};

// A regression (or improvement) needs both: B's min..max range entirely
// below (above) A's, so the difference is beyond the repetitions' noise, and
// a median change larger than min_change (a fraction, e.g. 0.02), so single
// repetitions (min = max) do not flag every wobble. Decode tok/s and TTFT are
// judged; a cell measured in A that fails in B is a regression.
Comparison compare_cells(const std::vector<CellResult>& a, const std::vector<CellResult>& b,
                         double min_change = 0.02);

// Markdown table of a comparison with both runs' metadata.
std::string format_comparison(const RunRow& a, const RunRow& b, const Comparison& c);

// One line per run: id, start time, kind, status, model, device, git sha, cells.
std::string format_run_list(const RunsDb& db, const std::string& kind = "");

// "12", "latest", "latest~1" (the one before latest) -> a run id of `kind`
// ("": any). Throws Errc::invalid_argument when there is no such run.
int64_t resolve_run_id(const RunsDb& db, const std::string& ref, const std::string& kind = "");

}  // namespace kvq::bench
