// What one benchmark cell (one codec at one context) measured, and the
// per-codec ITL fit: the values `kvq bench` prints, stores in runs.db
// (bench/runs_db.hpp) and plots. See docs/bench.md for each field's meaning.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/dispatch_stats.hpp"

namespace kvq::bench {

// Median, minimum and maximum over the measured repetitions.
struct Spread {
  double median = 0;
  double min = 0;
  double max = 0;
};

// One measured decode run (warm-up excluded).
struct RepResult {
  double decode_tps = 0;   // (G-1) / (t_last - t_first): tokens 2..G
  // Prefill-every-run protocol only (MeasureOptions::prefill_every_run): this
  // run's own prefill. 0 when the cell prefilled separately (its prefills
  // are CellResult::prefill_results).
  double ttft_s = 0;       // prefill + first token
  double prefill_tps = 0;  // prompt tokens / prefill time
  double itl_p50_ms = 0;   // inter-token latency percentiles over tokens 2..G
  double itl_p99_ms = 0;
  int n_generated = 0;
  std::string digest;      // 16 hex digits: FNV-1a 64 of the generated token ids
  // Prefill-once protocol: seconds from the start of the run until token 1
  // was chosen (re-feeding the last prompt token at position L-1 over the
  // cached prompt, then picking the token). 0 in the prefill-every-run protocol.
  double refeed_s = 0;
};

// One timed prefill of the cell's prompt into an empty cache (prefill-once
// protocol: the cell does prefill_n of them before its decode runs).
struct PrefillResult {
  double ttft_s = 0;       // prefill of the L prompt tokens + choosing the first token
  double prefill_s = 0;    // the prefill's forward passes alone
  double prefill_tps = 0;  // L / prefill_s
  int first_token = -1;    // the token chosen from the prefill's logits
};

// A cell's outcome.
//   ok          measured, every check passed
//   flagged     measured, but a check failed (see flags)
//   oom         the cache or a buffer did not fit in memory
//   unsupported the device has no kernels for this codec
//   failed      any other error (see error)
struct CellResult {
  std::string codec;  // as requested (canonical codec name where it resolves)
  int ctx = 0;        // prompt tokens L
  int gen = 0;        // generated tokens G
  int batch = 1;      // sequences decoded together (kvq bench --batch); decode_tps is their aggregate
  bool capacity = false;  // batch is what the KV budget admitted (--batch max --kv-budget)
  std::string status = "failed";
  std::string error;                // message when status is oom/unsupported/failed
  std::vector<std::string> flags;   // "digest" (reps disagree), "dispatch", "kv_memory"

  int reps = 0;  // measured decode runs (warm-up runs went before them and are not in these numbers)
  // How many prefills ttft_s and prefill_tps are the median/min/max of. The
  // prefill-once protocol (the default): the cell's prefills (--prefill-reps),
  // after which every decode run starts from the cached prompt. The
  // prefill-every-run protocol: `reps` (each measured run prefilled).
  // Cells read from a runs.db written before schema version 2: `reps`.
  int prefill_n = 0;
  Spread decode_tps, ttft_s, prefill_tps, itl_p50_ms, itl_p99_ms;

  // KV footprint, counted by the cache itself.
  double kv_seq = 0;               // mean KV length the timed decode steps attend over (L + G/2)
  uint64_t kv_bytes = 0;           // resident bytes for the filled sequence (L + G - 1 tokens)
  double bits_per_value = 0;       // kv_bytes * 8 / (tokens * layers * kv_heads * head_dim * 2)
  uint64_t kv_capacity_bytes = 0;  // bytes_for_tokens(allocated context)
  int64_t device_mem_delta = -1;   // device memory taken by the cache (+ its scratch); -1: unknown (CPU)
  int kv_pages = 0;                // batch cells: KV pool pages the sequences hold; 0 for one-sequence cells

  // Achieved bandwidth: bytes a decode step must read over the step time.
  uint64_t weight_bytes = 0;       // weights read per step (one embedding row, all other tensors)
  double step_bytes = 0;           // weight_bytes + KV bytes at kv_seq
  double achieved_gbs = 0;         // step_bytes * decode_tps / 1e9
  double pct_copy_bw = 0;          // achieved / measured copy bandwidth, in %

  DispatchStats dispatch;          // counters over the measured reps
  std::string digest;              // the first rep's digest
  bool digests_agree = true;       // every rep (and the warm-up) generated the same tokens

  std::vector<RepResult> rep_results;
  std::vector<PrefillResult> prefill_results;  // prefill-once protocol: each timed prefill

  bool measured() const { return status == "ok" || status == "flagged"; }
};

// Least-squares fit ITL = a + b * kv_seq / 1000 over one codec's cells.
struct ItlFit {
  std::string codec;
  double a_ms = 0;          // fixed cost per decode step
  double b_ms_per_1k = 0;   // marginal cost per 1000 KV tokens
  double residual_ms = 0;   // RMS of the residuals
  int n_points = 0;
  int ctx_min = 0;
  int ctx_max = 0;
};

}  // namespace kvq::bench
