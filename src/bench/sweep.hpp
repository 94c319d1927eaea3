// `kvq bench`: the codec x context sweep (docs/bench.md, spec bench.md).
// One process, the model loaded once; per cell measure_cell (bench/measure.hpp)
// with a discarded warm-up; each finished cell is one transaction in runs.db
// and one CSV row, so an interrupted or crashed sweep leaves whole cells.
// A cell that fails (out of memory, a codec the device cannot run, any
// error) is recorded with its status and the sweep goes on.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "bench/results.hpp"

namespace kvq::bench {

struct SweepConfig {
  std::string model = "synthetic:tiny";  // GGUF path or synthetic:SHAPE
  std::string device = "cpu";
  std::vector<std::string> codecs;   // codec names (parse_codec_list)
  std::vector<int> contexts;         // prompt lengths (parse_context_list)
  std::vector<int> batches = {1};    // sequences per decode step (parse_batch_list); 1: measure_cell;
                                     // kBatchMax: as many as kv_budget holds (capacity mode)
  uint64_t kv_budget = 0;            // bytes of KV the capacity mode fills (--kv-budget); 0: none given
  // How batch cells fill their sequences' KV (--batch-fill): prefill each
  // prompt, or prefill one and copy its rows to the others
  // (MeasureOptions::copy_batch_kv); automatic: copies in capacity mode only.
  enum class BatchFill { automatic, prefill, copy };
  BatchFill batch_fill = BatchFill::automatic;
  // --kv-window: every codec's cells with an exact window of this many pages
  // per sequence (CodecRequest::window_pages; rows named NAME+winW). 0: none;
  // CodecRequest::kWindowAuto (the CLI's default): each codec's default
  // window (CodecRequest::window_for).
  int window_pages = 0;
  int gen = 128;                     // tokens generated per repetition (>= 2)
  int reps = 3;                      // measured repetitions per cell
  int warmup = 1;                    // discarded repetitions per cell
  int prefill_reps = 1;              // timed prefills per cell (>= 1); the decode runs start from the last
  bool prefill_every_run = false;    // the old protocol: every decode run prefills (prefill_reps unused)
  int prefill_chunk = 0;             // 0: the device's default
  int threads = 0;                   // CPU threads; 0: all cores
  uint64_t seed = 1;                 // prompt token seed
  std::string home;                  // home folder (resolve_home); runs.db lives there
  std::string out_dir;               // report folder; empty: <home>/runs/<run_id>
  bool plots = true;                 // run gnuplot for the report's plots
  std::string command_line;          // recorded in the run's params_json
  // Polled between cells: true stops the sweep after the current cell (Ctrl-C).
  std::function<bool()> should_stop;
  // The backend for `device`; empty: kvq::make_backend. (Tests pass one
  // that refuses some codecs, as the CUDA backend does today.)
  std::function<std::unique_ptr<Backend>(const std::string& device)> make_backend;
  BackendOptions backend;  // experiment knobs for kvq::make_backend (--batch-gemm-rows, ...)
};

struct SweepProgress {
  int cell = 0;        // 0-based index of the current cell
  int cells = 0;       // cells in the sweep
  std::string codec;
  int ctx = 0;
  int batch = 1;
  int rep = 0;         // current decode run (warm-up included), 0-based
  int reps = 0;        // decode runs per cell, warm-up included
  int warmup = 0;      // of which warm-up (the first ones)
  // The cell's prefills (prefill-once protocol): prefill_rep >= 0 while the
  // cell is in its prefill_rep-th prefill, -1 once it decodes.
  int prefill_rep = -1, prefill_reps = 0;
  int prefill_done = 0, prefill_total = 0;  // prefill tokens of the current prefill
  double elapsed_s = 0;
  double eta_s = -1;   // estimated seconds left; < 0 while unknown
};
// "[3/10] k8v4 @ 8192: prefill 1/1, 4096/8192 | 1m05s elapsed, ETA 2m10s", then
// "[3/10] k8v4 @ 8192: rep 2/3 | 1m12s elapsed, ETA 2m01s"
std::string format_progress(const SweepProgress& p);

struct SweepResult {
  int64_t run_id = 0;
  std::string status;       // "ok" (every cell ran), "interrupted"
  std::string out_dir;
  std::string csv_path, report_path;
  std::vector<CellResult> cells;
  std::vector<ItlFit> fits;
  std::vector<std::string> plot_paths;  // empty when plots were off or gnuplot is missing
  std::string plot_note;                // why there are no plots
};

// "all": every codec of the codec table; "seeds": the seeds' 25; otherwise a
// comma-separated list of codec names or aliases ("k8v4,turbo3", "rotor3_sym+qjl").
// Unknown names are an Errc::invalid_argument error listing the valid ones.
std::vector<std::string> parse_codec_list(const std::string& list);
// "1,8,32,64": sequences decoded together per step, each 1..4096, no
// repeats; "max" is kBatchMax (capacity mode: as many sequences of the
// context as the KV budget holds, per codec). Anything else is an
// Errc::invalid_argument error.
constexpr int kBatchMax = 0;
std::vector<int> parse_batch_list(const std::string& list);
// "120G", "512M", "64k" or plain bytes; Errc::invalid_argument otherwise.
uint64_t parse_byte_size(const std::string& text);
// Sequences of `tokens` tokens that fit in `budget` bytes of a codec's
// pages (64-token pages, every layer and KV head, K and V); with an exact
// window, each sequence's last window_pages pages in bf16.
int sequences_in_budget(const std::string& codec, int tokens, int n_layers, int n_kv_heads, int head_dim,
                        uint64_t budget, int window_pages = 0);
// "4k,8k,16k,100" -> {4096, 8192, 16384, 100}; k = 1024. Positive, unique.
// Longest context --contexts accepts (16M tokens); above the model's own
// context_length is refused by run_sweep before any cell runs.
inline constexpr long kMaxBenchContext = 1L << 24;
std::vector<int> parse_context_list(const std::string& list);

// Runs the sweep; `on_progress` is called often (at least per repetition and
// prefill chunk). Throws only for setup errors (bad options, no model, no
// device, unwritable home); cell failures are results.
SweepResult run_sweep(const SweepConfig& cfg, const std::function<void(const SweepProgress&)>& on_progress = {});

}  // namespace kvq::bench
