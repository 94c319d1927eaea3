// runs.db: kvq's own record of every benchmark and evaluation run (SQLite,
// one file under the home folder). Shared by `kvq bench` and `kvq eval`.
//
//  - Versioned schema: table schema_version holds one row per applied
//    migration; opening a database applies the missing ones in a transaction.
//    A database written by a newer kvq (unknown version) is refused.
//  - WAL journal, so readers (sqlite3 CLI, `kvq bench list`) never block a
//    running sweep.
//  - Append-only: triggers reject UPDATE and DELETE on every table. A run is a
//    `runs` row; its end is a separate `run_ends` row (a run without one was
//    killed). Results are added in transactions, so an interrupted process
//    leaves whole rows only.
//
// Tables (docs/bench.md has every column):
//   runs(run_id, kind, started_at, model, device, git_sha, build_type,
//        kvq_version, host, gpu_name, driver, clocks, copy_bw_gbs, params_json)
//   run_ends(run_id, finished_at, status, summary_json)
//   bench_cells(cell_id, run_id, codec, ctx, gen, reps, status, ..., reps_json,
//               prefill_n, prefills_json)   (the last two since schema 2)
//   bench_fits(run_id, codec, a_ms, b_ms_per_1k, residual_ms, n_points, ctx_min, ctx_max)
//   eval_results(result_id, run_id, codec, metric, ctx, value, detail_json, created_at)
//   serve_levels(run_id, level, mode, concurrency, rate, requests, ok, failed, ...)  (since schema 4:
//                kvq bench serve, one row per load level; disconnected and server_json since schema 5)
//
// Typical use (an evaluation):
//   RunsDb db(runs_db_path(resolve_home(home_flag)));
//   RunMeta meta = collect_run_meta(backend);   // bench/run_meta.hpp
//   meta.kind = "eval"; meta.model = ...; meta.params_json = ...;
//   const int64_t run = db.begin_run(meta);
//   db.add_eval_result({run, "k8v4", "kl_mean", 4096, 0.0012, R"({"tokens":4096})"});
//   db.end_run(run, "ok");
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench/results.hpp"

struct sqlite3;

namespace kvq::bench {

// The home folder: `flag` (--home) when not empty, else $KVQ_HOME, else
// ~/.kvq. Created (with parents) if missing; throws Errc::io when it cannot be.
std::string resolve_home(const std::string& flag);
// <home>/runs.db
std::string runs_db_path(const std::string& home);

// Who measured what, where, with which build.
struct RunMeta {
  std::string kind;          // "bench", "eval", ...: what wrote the run
  std::string model;         // model path or "synthetic:SHAPE"
  std::string device;        // "cpu" or "cuda"
  std::string git_sha;       // source revision ("-dirty" appended for local changes); "unknown" if none
  std::string build_type;    // CMAKE_BUILD_TYPE
  std::string kvq_version;
  std::string host;          // host name
  std::string gpu_name;      // device name (the CPU model on cpu)
  std::string driver;        // GPU driver / runtime versions; empty on cpu
  std::string clocks;        // GPU clocks at start; empty when unknown
  double copy_bw_gbs = 0;    // measured copy bandwidth, GB/s (read + write); 0: not measured
  std::string params_json = "{}";  // the run's parameters, a JSON object
  std::string started_at;    // ISO 8601 UTC; begin_run fills it when empty
};

struct RunRow {
  int64_t run_id = 0;
  RunMeta meta;
  std::string finished_at;   // empty: no run_ends row (still running, or killed)
  std::string status;        // run_ends.status ("ok", "interrupted", "failed"), or "incomplete"
  std::string summary_json;  // run_ends.summary_json, "{}" when none
};

// A generic quality result (kvq eval): one metric of one codec, optionally at
// one context length, with free-form details as a JSON object.
struct EvalResult {
  int64_t run_id = 0;
  std::string codec;              // e.g. "k8v4"
  std::string metric;             // e.g. "kl_mean", "ppl", "top1_pct", "needle_acc"
  std::optional<int64_t> ctx;     // context length, when the metric has one
  double value = 0;
  std::string detail_json = "{}"; // e.g. {"tokens": 4096, "dataset": "..."}
  std::string created_at;         // ISO 8601 UTC; filled on insert when empty
};

// One load level of `kvq bench serve` (bench/serve_bench.hpp): a fixed
// concurrency or a Poisson request rate, measured over HTTP.
struct Percentiles {
  double p50 = 0, p90 = 0, p99 = 0;
};
struct ServeLevel {
  int level = 0;                // 0, 1, ... in the order run
  std::string mode;             // "concurrency" or "rate"
  int concurrency = 0;          // requests in flight at most (rate mode: the cap)
  double rate = 0;              // requests per second (rate mode)
  int requests = 0;             // sent
  int ok = 0;                   // answered in full, with the length asked for
  int disconnected = 0;         // hung up on purpose (--disconnect): neither ok nor failed
  int failed = 0;               // requests - ok - disconnected
  double duration_s = 0;        // first request sent .. last one finished
  double req_per_s = 0;         // ok / duration
  double out_tok_per_s = 0;     // output tokens of ok requests / duration
  double in_tok_per_s = 0;      // prompt tokens of ok requests / duration
  int64_t prompt_tokens = 0;    // of ok requests
  int64_t output_tokens = 0;    // of ok requests
  double ttft_mean_s = 0;
  Percentiles ttft_s;           // request sent .. first token chunk
  Percentiles tpot_ms;          // (end - first token) / (tokens - 1), requests with >= 2 tokens
  Percentiles itl_ms;           // every gap between token chunks
  Percentiles e2e_s;            // p50 and p99 only
  bool has_tpot = false, has_itl = false;
  std::string errors_json = "{}";  // failure reason -> count
  // The server's state after the level (kvq serve, from its /metrics):
  // {"pages_used_after": N, "sequences_running_after": M, "rss_before": B,
  // "rss_after": B} (the rss keys when it exports process_resident_memory_bytes),
  // {"error": "..."} when its /metrics stopped answering; {} for a server
  // without kvq's metrics (nothing checked).
  std::string server_json = "{}";
};

class RunsDb {
 public:
  // The schema version this build writes and understands.
  // 1: the first schema. 2: bench_cells.prefill_n and prefills_json (the
  // prefill-once protocol, docs/bench.md).
  // 3: bench_cells.batch, kv_pages, capacity. 4: serve_levels (kvq bench serve).
  // 5: serve_levels.disconnected and server_json (the soak: --disconnect, the server check).
  static constexpr int kSchemaVersion = 5;
  // The SQL that takes a database from schema `from_version` to the next
  // (tests build databases of earlier versions with it).
  static const char* migration_sql(int from_version);

  // Opens (creating if needed) and migrates the database at `path`. Throws
  // Errc::io when it cannot be opened and Errc::format for a database of a
  // newer schema or one that is not a runs.db.
  explicit RunsDb(const std::string& path);
  ~RunsDb();
  RunsDb(const RunsDb&) = delete;
  RunsDb& operator=(const RunsDb&) = delete;

  const std::string& path() const { return path_; }
  int schema_version() const;

  // Runs body inside one transaction (BEGIN IMMEDIATE ... COMMIT); an
  // exception rolls it back and is rethrown. The add_* calls below open their
  // own transaction unless called inside one.
  void transaction(const std::function<void()>& body);

  // --- runs
  int64_t begin_run(const RunMeta& meta);                 // returns run_id
  // Adds the run's end row (once per run; status e.g. "ok", "interrupted", "failed").
  void end_run(int64_t run_id, const std::string& status, const std::string& summary_json = "{}");
  std::optional<RunRow> run(int64_t run_id) const;
  std::vector<RunRow> runs(const std::string& kind = "") const;  // oldest first; kind "": all
  // The newest run of `kind` ("": any); nullopt when there is none.
  std::optional<int64_t> latest_run(const std::string& kind = "") const;

  // Every add_* below throws Errc::invalid_argument for a run_id that does not exist.
  // --- bench
  void add_cell(int64_t run_id, const CellResult& cell);
  std::vector<CellResult> cells(int64_t run_id) const;      // in insertion order
  void add_fit(int64_t run_id, const ItlFit& fit);
  std::vector<ItlFit> fits(int64_t run_id) const;

  // --- serve (kvq bench serve)
  void add_serve_level(int64_t run_id, const ServeLevel& level);
  std::vector<ServeLevel> serve_levels(int64_t run_id) const;  // by level

  // --- eval
  void add_eval_result(const EvalResult& r);
  std::vector<EvalResult> eval_results(int64_t run_id) const;  // in insertion order

  // The underlying handle, for read-only queries the API above lacks.
  sqlite3* handle() const { return db_; }

 private:
  void exec(const char* sql) const;
  void require_run(int64_t run_id) const;  // Errc::invalid_argument naming the id
  void migrate();
  void in_transaction(const std::function<void()>& body);

  std::string path_;
  sqlite3* db_ = nullptr;
  int tx_depth_ = 0;
};

}  // namespace kvq::bench
