// A run's outputs besides runs.db: the CSV (one row per cell), the plots
// (gnuplot, SVG + PNG) and the Markdown report that ties them together.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/results.hpp"
#include "bench/runs_db.hpp"

namespace kvq::bench {

// CSV with a header line; fields quoted where needed; empty for values a
// cell that was not measured lacks.
std::string csv_header();
std::string csv_row(int64_t run_id, const CellResult& c);

struct Plots {
  std::vector<std::string> files;  // names inside the folder, e.g. "tps_vs_ctx.svg"
  std::string note;                // why some or all are missing ("" when all were made)
};
// Writes the plot data and gnuplot scripts under dir/plots-data and runs
// gnuplot: tok/s vs context per codec (min..max bars), KV MiB vs context,
// ITL vs KV length with the fitted lines. Never throws for a missing or
// failing gnuplot (the note says what happened); needs >= 1 measured cell.
Plots write_plots(const std::string& dir, const std::vector<CellResult>& cells, const std::vector<ItlFit>& fits);

// The Markdown report (run metadata, speed table, every cell, fits,
// problems, plots). `plots` are file names relative to the report.
std::string report_markdown(const RunRow& run, const std::vector<CellResult>& cells,
                            const std::vector<ItlFit>& fits, const Plots& plots);

// Writes report.md, cells.csv and the plots for a run into dir (created if
// missing); returns the report path. Used at the end of a sweep and by
// `kvq bench report RUN`.
std::string write_report(const std::string& dir, const RunRow& run, const std::vector<CellResult>& cells,
                         const std::vector<ItlFit>& fits, bool plots, Plots* made = nullptr);

}  // namespace kvq::bench
