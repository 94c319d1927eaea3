// runs.db (bench/runs_db.hpp): schema and migrations, append-only triggers,
// round trips of runs, cells, fits and eval results, transactions, home folder.
#include <gtest/gtest.h>

#include <initializer_list>
#include <sqlite3.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "backend/backend.hpp"
#include "bench/run_meta.hpp"
#include "bench/runs_db.hpp"
#include "core/error.hpp"

using namespace kvq;
using namespace kvq::bench;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path p;
  TempDir() {
    static int n = 0;
    p = fs::temp_directory_path() / ("kvq_runsdb_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::remove_all(p);
    fs::create_directories(p);
  }
  ~TempDir() { fs::remove_all(p); }
  std::string db() const { return (p / "runs.db").string(); }
};

RunMeta meta(const std::string& kind) {
  RunMeta m;
  m.kind = kind;
  m.model = "synthetic:tiny";
  m.device = "cpu";
  m.git_sha = "abc123";
  m.build_type = "Release";
  m.kvq_version = "0.1.0";
  m.host = "testhost";
  m.gpu_name = "Test CPU";
  m.copy_bw_gbs = 12.5;
  m.params_json = R"({"gen":8})";
  return m;
}

CellResult measured_cell() {
  CellResult c;
  c.codec = "k8v4";
  c.ctx = 128;
  c.gen = 8;
  c.status = "flagged";
  c.flags = {"digest", "kv_memory"};
  c.reps = 2;
  c.decode_tps = {100, 90, 110};
  c.ttft_s = {0.5, 0.4, 0.6};
  c.prefill_tps = {256, 250, 260};
  c.itl_p50_ms = {10, 9, 11};
  c.itl_p99_ms = {12, 11, 13};
  c.kv_seq = 132;
  c.kv_bytes = 1 << 20;
  c.bits_per_value = 6.25;
  c.kv_capacity_bytes = 2 << 20;
  c.device_mem_delta = -1;
  c.weight_bytes = 123456;
  c.step_bytes = 1.5e6;
  c.achieved_gbs = 0.15;
  c.pct_copy_bw = 1.2;
  c.dispatch.counted = true;
  c.dispatch.attention = {{0, "cpu-packed", false, 1}, {0, "cpu-packed", true, 7}, {1, "cpu-packed", true, 7}};
  c.digest = "0123456789abcdef";
  c.digests_agree = false;
  c.rep_results = {{110, 0.4, 260, 9, 11, 8, "0123456789abcdef"}, {90, 0.6, 250, 11, 13, 8, "fedcba9876543210"}};
  c.rep_results[1].refeed_s = 0.002;
  c.prefill_n = 2;
  c.prefill_results = {{0.4, 0.39, 256.4, 17}, {0.6, 0.58, 172.4, 17}};
  return c;
}

std::string query_text(sqlite3* db, const char* sql) {
  sqlite3_stmt* st = nullptr;
  EXPECT_EQ(sqlite3_prepare_v2(db, sql, -1, &st, nullptr), SQLITE_OK) << sql;
  std::string out;
  if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_text(st, 0))
    out = reinterpret_cast<const char*>(sqlite3_column_text(st, 0));
  sqlite3_finalize(st);
  return out;
}

void exec_sql(sqlite3* h, const std::string& q) {
  char* err = nullptr;
  const int rc = sqlite3_exec(h, q.c_str(), nullptr, nullptr, &err);
  EXPECT_EQ(rc, SQLITE_OK) << (err ? err : "") << "\n" << q;
  sqlite3_free(err);
}

// A runs.db file as a kvq of schema `version` left it: the migrations up to
// that version, each recorded, and the append-only triggers it made on
// `append_only`. The caller closes the handle.
sqlite3* open_old_db(const std::string& path, int version, std::initializer_list<const char*> append_only) {
  sqlite3* h = nullptr;
  EXPECT_EQ(sqlite3_open(path.c_str(), &h), SQLITE_OK);
  exec_sql(h, "PRAGMA journal_mode=WAL");
  for (int v = 0; v < version; ++v) {
    exec_sql(h, RunsDb::migration_sql(v));
    exec_sql(h, "INSERT INTO schema_version VALUES (" + std::to_string(v + 1) + ", '2025-01-01T00:00:00Z')");
  }
  for (const char* t : append_only)
    for (const char* op : {"UPDATE", "DELETE"})
      exec_sql(h, std::string("CREATE TRIGGER ") + t + "_no_" + op + " BEFORE " + op + " ON " + t +
                      " BEGIN SELECT RAISE(ABORT, 'runs.db is append-only'); END");
  return h;
}

}  // namespace

TEST(BenchRunsDb, FreshDatabaseHasCurrentSchemaAndWal) {
  TempDir d;
  RunsDb db(d.db());
  EXPECT_EQ(db.schema_version(), RunsDb::kSchemaVersion);
  EXPECT_EQ(query_text(db.handle(), "PRAGMA journal_mode"), "wal");
  for (const char* t : {"runs", "run_ends", "bench_cells", "bench_fits", "eval_results", "schema_version"})
    EXPECT_EQ(query_text(db.handle(), (std::string("SELECT name FROM sqlite_master WHERE name='") + t + "'").c_str()),
              t);
}

TEST(BenchRunsDb, RunsRoundTripAndEndRows) {
  TempDir d;
  RunsDb db(d.db());
  EXPECT_FALSE(db.latest_run().has_value());
  const int64_t a = db.begin_run(meta("bench"));
  const int64_t b = db.begin_run(meta("eval"));
  EXPECT_LT(a, b);
  db.end_run(a, "interrupted", R"({"cells":3})");
  const auto ra = db.run(a);
  ASSERT_TRUE(ra.has_value());
  EXPECT_EQ(ra->meta.kind, "bench");
  EXPECT_EQ(ra->meta.model, "synthetic:tiny");
  EXPECT_EQ(ra->meta.git_sha, "abc123");
  EXPECT_DOUBLE_EQ(ra->meta.copy_bw_gbs, 12.5);
  EXPECT_EQ(ra->meta.params_json, R"({"gen":8})");
  EXPECT_FALSE(ra->meta.started_at.empty());  // filled by begin_run
  EXPECT_EQ(ra->status, "interrupted");
  EXPECT_EQ(ra->summary_json, R"({"cells":3})");
  EXPECT_FALSE(ra->finished_at.empty());
  EXPECT_EQ(db.run(b)->status, "incomplete");  // no run_ends row
  EXPECT_FALSE(db.run(b + 100).has_value());
  EXPECT_EQ(db.runs().size(), 2u);
  ASSERT_EQ(db.runs("eval").size(), 1u);
  EXPECT_EQ(db.runs("eval")[0].run_id, b);
  EXPECT_EQ(*db.latest_run(), b);
  EXPECT_EQ(*db.latest_run("bench"), a);
  // A run ends once.
  try {
    db.end_run(a, "ok");
    FAIL() << "a run ended twice";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("already ended"), std::string::npos) << e.what();
  }
  EXPECT_EQ(db.run(a)->status, "interrupted");
  EXPECT_THROW(db.end_run(b + 100, "ok"), Error);
  EXPECT_THROW(db.add_cell(b + 100, CellResult{}), Error);
  EXPECT_THROW(db.add_fit(b + 100, ItlFit{}), Error);
}

TEST(BenchRunsDb, CellsAndFitsRoundTrip) {
  TempDir d;
  RunsDb db(d.db());
  const int64_t run = db.begin_run(meta("bench"));
  const CellResult c = measured_cell();
  CellResult failed;
  failed.codec = "turbo3";
  failed.ctx = 256;
  failed.gen = 8;
  failed.status = "unsupported";
  failed.error = "no GPU kernels for turbo3";
  db.add_cell(run, c);
  db.add_cell(run, failed);
  db.add_fit(run, {"k8v4", 1.5, 0.25, 0.01, 3, 64, 256});

  const auto cells = db.cells(run);
  ASSERT_EQ(cells.size(), 2u);
  const CellResult& g = cells[0];
  EXPECT_EQ(g.codec, "k8v4");
  EXPECT_EQ(g.ctx, 128);
  EXPECT_EQ(g.status, "flagged");
  EXPECT_EQ(g.flags, (std::vector<std::string>{"digest", "kv_memory"}));
  EXPECT_DOUBLE_EQ(g.decode_tps.median, 100);
  EXPECT_DOUBLE_EQ(g.decode_tps.min, 90);
  EXPECT_DOUBLE_EQ(g.itl_p99_ms.max, 13);
  EXPECT_EQ(g.kv_bytes, uint64_t(1) << 20);
  EXPECT_EQ(g.device_mem_delta, -1);
  EXPECT_DOUBLE_EQ(g.bits_per_value, 6.25);
  EXPECT_TRUE(g.dispatch.counted);
  ASSERT_EQ(g.dispatch.attention.size(), 3u);
  EXPECT_EQ(g.dispatch.total_calls(true), 14u);
  EXPECT_EQ(g.dispatch.total_calls(false), 1u);
  EXPECT_FALSE(g.digests_agree);
  ASSERT_EQ(g.rep_results.size(), 2u);
  EXPECT_EQ(g.rep_results[1].digest, "fedcba9876543210");
  EXPECT_EQ(g.rep_results[0].n_generated, 8);
  EXPECT_DOUBLE_EQ(g.rep_results[1].refeed_s, 0.002);
  EXPECT_EQ(g.prefill_n, 2);
  ASSERT_EQ(g.prefill_results.size(), 2u);
  EXPECT_DOUBLE_EQ(g.prefill_results[1].prefill_s, 0.58);
  EXPECT_EQ(g.prefill_results[0].first_token, 17);

  const CellResult& f = cells[1];
  EXPECT_EQ(f.status, "unsupported");
  EXPECT_EQ(f.error, "no GPU kernels for turbo3");
  EXPECT_TRUE(f.flags.empty());
  EXPECT_FALSE(f.measured());
  // Unmeasured values are NULL in the table, not zeros that would plot.
  EXPECT_EQ(query_text(db.handle(), "SELECT typeof(decode_tps) FROM bench_cells WHERE codec='turbo3'"), "null");
  EXPECT_EQ(query_text(db.handle(), "SELECT typeof(prefill_n) FROM bench_cells WHERE codec='turbo3'"), "null");
  EXPECT_EQ(query_text(db.handle(), "SELECT prefill_n FROM bench_cells WHERE codec='k8v4'"), "2");
  EXPECT_EQ(f.prefill_n, 0);
  EXPECT_EQ(query_text(db.handle(), "SELECT attn_kernels FROM bench_cells WHERE codec='k8v4'"),
            "cpu-packed (2 layers)");

  const auto fits = db.fits(run);
  ASSERT_EQ(fits.size(), 1u);
  EXPECT_EQ(fits[0].codec, "k8v4");
  EXPECT_DOUBLE_EQ(fits[0].b_ms_per_1k, 0.25);
  EXPECT_EQ(fits[0].ctx_max, 256);
}

TEST(BenchRunsDb, EvalResultsRoundTrip) {
  TempDir d;
  RunsDb db(d.db());
  const int64_t run = db.begin_run(meta("eval"));
  db.add_eval_result({run, "k8v4", "kl_mean", 4096, 0.0012, R"({"tokens":4096})", ""});
  db.add_eval_result({run, "turbo3", "needle_acc", std::nullopt, 0.9, "{}", ""});
  const auto rows = db.eval_results(run);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].codec, "k8v4");
  EXPECT_EQ(rows[0].metric, "kl_mean");
  ASSERT_TRUE(rows[0].ctx.has_value());
  EXPECT_EQ(*rows[0].ctx, 4096);
  EXPECT_DOUBLE_EQ(rows[0].value, 0.0012);
  EXPECT_EQ(rows[0].detail_json, R"({"tokens":4096})");
  EXPECT_FALSE(rows[0].created_at.empty());
  EXPECT_FALSE(rows[1].ctx.has_value());
  EXPECT_TRUE(db.eval_results(run + 1).empty());
  // Bad input is refused with a message, nothing half-written.
  EXPECT_THROW(db.add_eval_result({run, "k8v4", "kl", 1, 0, "not json", ""}), Error);
  EXPECT_THROW(db.add_eval_result({run, "", "kl", 1, 0, "{}", ""}), Error);
  EXPECT_THROW(db.add_eval_result({run + 1000, "k8v4", "kl", 1, 0, "{}", ""}), Error);  // no such run
  EXPECT_EQ(db.eval_results(run).size(), 2u);
}

TEST(BenchRunsDb, AppendOnly) {
  TempDir d;
  RunsDb db(d.db());
  const int64_t run = db.begin_run(meta("bench"));
  db.add_cell(run, measured_cell());
  db.add_eval_result({run, "k8v4", "ppl", 512, 7.5, "{}", ""});
  for (const char* sql : {"UPDATE runs SET model = 'x'", "DELETE FROM runs", "UPDATE bench_cells SET ctx = 1",
                          "DELETE FROM bench_cells", "DELETE FROM eval_results", "UPDATE eval_results SET value = 0",
                          "DELETE FROM schema_version"}) {
    char* err = nullptr;
    EXPECT_NE(sqlite3_exec(db.handle(), sql, nullptr, nullptr, &err), SQLITE_OK) << sql;
    EXPECT_NE(std::string(err ? err : "").find("append-only"), std::string::npos) << sql;
    sqlite3_free(err);
  }
  EXPECT_EQ(db.cells(run).size(), 1u);
  EXPECT_EQ(db.run(run)->meta.model, "synthetic:tiny");
}

TEST(BenchRunsDb, TransactionRollsBackOnError) {
  TempDir d;
  RunsDb db(d.db());
  const int64_t run = db.begin_run(meta("bench"));
  EXPECT_THROW(db.transaction([&] {
    db.add_cell(run, measured_cell());
    db.add_fit(run, {"k8v4", 1, 2, 3, 2, 64, 128});
    throw Error(Errc::internal, "simulated failure mid-cell");
  }),
               Error);
  EXPECT_TRUE(db.cells(run).empty());
  EXPECT_TRUE(db.fits(run).empty());
  db.transaction([&] { db.add_cell(run, measured_cell()); });
  EXPECT_EQ(db.cells(run).size(), 1u);
}

TEST(BenchRunsDb, ReopenKeepsDataAndRefusesNewerOrForeignFiles) {
  TempDir d;
  int64_t run = 0;
  {
    RunsDb db(d.db());
    run = db.begin_run(meta("bench"));
  }
  {
    RunsDb db(d.db());  // migrations are not re-applied
    EXPECT_EQ(db.schema_version(), RunsDb::kSchemaVersion);
    EXPECT_EQ(query_text(db.handle(), "SELECT count(*) FROM schema_version"), std::to_string(RunsDb::kSchemaVersion));
    ASSERT_TRUE(db.run(run).has_value());
    // A newer kvq migrated this file further.
    ASSERT_EQ(sqlite3_exec(db.handle(), "INSERT INTO schema_version VALUES (99, 'later')", nullptr, nullptr, nullptr),
              SQLITE_OK);
  }
  try {
    RunsDb db(d.db());
    FAIL() << "a newer schema was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::format);
    EXPECT_NE(std::string(e.what()).find("newer"), std::string::npos) << e.what();
  }
  // Someone else's SQLite file.
  const std::string other = (d.p / "other.db").string();
  sqlite3* h = nullptr;
  ASSERT_EQ(sqlite3_open(other.c_str(), &h), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(h, "CREATE TABLE photos(id INTEGER)", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(h);
  EXPECT_THROW(RunsDb{other}, Error);
  // Not a database at all.
  const std::string text = (d.p / "text.db").string();
  FILE* f = fopen(text.c_str(), "w");
  fputs("this is not an sqlite database, just some text that is long enough to have a header\n", f);
  fclose(f);
  EXPECT_THROW(RunsDb{text}, Error);
}

// A runs.db written by a kvq of schema version 1 (before prefill_n): it
// opens, migrates to the current version in place, keeps its rows (whose
// TTFT came from the `reps` measured runs) and takes new cells.
TEST(BenchRunsDb, SchemaVersion1DatabaseMigrates) {
  TempDir d;
  {
    // With the append-only triggers version 1 created.
    sqlite3* h = open_old_db(d.db(), 1, {"schema_version", "runs", "run_ends", "bench_cells", "bench_fits",
                                         "eval_results"});
    auto exec = [&](const std::string& q) { exec_sql(h, q); };
    exec("INSERT INTO runs(kind, started_at, model, device, git_sha, build_type, kvq_version, host, gpu_name, "
         "driver, clocks, copy_bw_gbs, params_json) VALUES ('bench', '2025-01-01T00:00:00Z', 'synthetic:tiny', "
         "'cpu', 'old', 'Release', '0.1.0', 'h', 'cpu', '', '', 1.0, '{\"reps\":3}')");
    exec("INSERT INTO bench_cells(run_id, codec, ctx, gen, reps, status, error, flags, decode_tps, decode_tps_min, "
         "decode_tps_max, ttft_s, ttft_s_min, ttft_s_max, prefill_tps, prefill_tps_min, prefill_tps_max, kv_bytes, "
         "attn_kernels, dispatch_json, digest, digests_agree, reps_json) VALUES (1, 'k8v4', 4096, 128, 3, 'ok', '', "
         "'', 300, 290, 310, 0.7, 0.69, 0.72, 6000, 5900, 6100, 1000, 'cpu-packed (2 layers)', '{}', "
         "'00000000000000aa', 1, '[{\"decode_tps\":300,\"ttft_s\":0.7,\"digest\":\"00000000000000aa\"}]')");
    exec("INSERT INTO bench_cells(run_id, codec, ctx, gen, reps, status, error, flags, attn_kernels, dispatch_json, "
         "digest, digests_agree, reps_json) VALUES (1, 'turbo3', 4096, 128, 3, 'oom', 'no memory', '', '', '{}', '', "
         "1, '[]')");
    sqlite3_close(h);
  }
  RunsDb db(d.db());
  EXPECT_EQ(db.schema_version(), RunsDb::kSchemaVersion);
  EXPECT_EQ(RunsDb::kSchemaVersion, 5);
  EXPECT_EQ(query_text(db.handle(), "SELECT group_concat(version) FROM schema_version"), "1,2,3,4,5");
  const auto old = db.cells(1);
  ASSERT_EQ(old.size(), 2u);
  EXPECT_EQ(old[0].codec, "k8v4");
  EXPECT_EQ(old[0].batch, 1);  // rows from before the step batch: one sequence per step
  EXPECT_EQ(old[0].kv_pages, 0);
  EXPECT_FALSE(old[0].capacity);
  EXPECT_DOUBLE_EQ(old[0].ttft_s.median, 0.7);
  EXPECT_EQ(old[0].prefill_n, 3);  // the old protocol: one prefill per measured run
  EXPECT_TRUE(old[0].prefill_results.empty());
  ASSERT_EQ(old[0].rep_results.size(), 1u);
  EXPECT_DOUBLE_EQ(old[0].rep_results[0].ttft_s, 0.7);
  EXPECT_EQ(old[1].status, "oom");
  EXPECT_EQ(old[1].prefill_n, 0);
  EXPECT_EQ(query_text(db.handle(), "SELECT typeof(prefill_n) FROM bench_cells WHERE cell_id = 1"), "null");

  // New cells go into the migrated file, with their prefill count.
  const int64_t run = db.begin_run(meta("bench"));
  db.add_cell(run, measured_cell());
  const auto now = db.cells(run);
  ASSERT_EQ(now.size(), 1u);
  EXPECT_EQ(now[0].prefill_n, 2);
  EXPECT_EQ(now[0].prefill_results.size(), 2u);
  // Still append-only, the new columns included.
  EXPECT_NE(sqlite3_exec(db.handle(), "UPDATE bench_cells SET prefill_n = 5", nullptr, nullptr, nullptr), SQLITE_OK);
  EXPECT_EQ(query_text(db.handle(), "PRAGMA integrity_check"), "ok");
  // Reopening applies nothing more.
  RunsDb again(d.db());
  EXPECT_EQ(query_text(again.handle(), "SELECT count(*) FROM schema_version"), "5");
}

// A runs.db of schema version 3 (before kvq bench serve) gains the
// serve_levels table, keeps its cells, and the new table is append-only.
TEST(BenchRunsDb, SchemaVersion3DatabaseGainsServeLevels) {
  TempDir d;
  {
    sqlite3* h = open_old_db(d.db(), 3, {});
    auto exec = [&](const std::string& q) { exec_sql(h, q); };
    exec("INSERT INTO runs(kind, started_at, model, device, git_sha, build_type, kvq_version, host, gpu_name, "
         "driver, clocks, copy_bw_gbs, params_json) VALUES ('bench', '2025-01-01T00:00:00Z', 'synthetic:tiny', "
         "'cpu', 'old', 'Release', '0.1.0', 'h', 'cpu', '', '', 1.0, '{}')");
    sqlite3_close(h);
  }
  RunsDb db(d.db());
  EXPECT_EQ(db.schema_version(), RunsDb::kSchemaVersion);
  EXPECT_EQ(query_text(db.handle(), "SELECT group_concat(version) FROM schema_version"), "1,2,3,4,5");
  EXPECT_TRUE(db.serve_levels(1).empty());

  const int64_t run = db.begin_run(meta("serve"));
  ServeLevel a;
  a.level = 0;
  a.mode = "concurrency";
  a.concurrency = 4;
  a.requests = 8;
  a.ok = 7;
  a.failed = 1;
  a.duration_s = 2.0;
  a.req_per_s = 3.5;
  a.out_tok_per_s = 28;
  a.in_tok_per_s = 112;
  a.prompt_tokens = 224;
  a.output_tokens = 56;
  a.ttft_mean_s = 0.05;
  a.ttft_s = {0.04, 0.06, 0.08};
  a.tpot_ms = {10, 12, 14};
  a.itl_ms = {9, 13, 20};
  a.e2e_s = {0.2, 0, 0.3};
  a.has_tpot = a.has_itl = true;
  a.errors_json = R"({"HTTP 500: boom": 1})";
  db.add_serve_level(run, a);
  ServeLevel b;  // nothing succeeded: no latencies
  b.level = 1;
  b.mode = "rate";
  b.concurrency = 64;
  b.rate = 2.5;
  b.requests = 3;
  b.failed = 3;
  b.errors_json = R"({"connection: refused": 3})";
  db.add_serve_level(run, b);
  EXPECT_THROW(db.add_serve_level(run, b), Error);  // (run, level) is the key
  EXPECT_THROW(db.add_serve_level(run + 100, a), Error);

  const auto got = db.serve_levels(run);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].mode, "concurrency");
  EXPECT_EQ(got[0].concurrency, 4);
  EXPECT_EQ(got[0].ok, 7);
  EXPECT_EQ(got[0].failed, 1);
  EXPECT_EQ(got[0].output_tokens, 56);
  EXPECT_DOUBLE_EQ(got[0].ttft_s.p99, 0.08);
  EXPECT_DOUBLE_EQ(got[0].tpot_ms.p90, 12);
  EXPECT_DOUBLE_EQ(got[0].itl_ms.p50, 9);
  EXPECT_DOUBLE_EQ(got[0].e2e_s.p99, 0.3);
  EXPECT_TRUE(got[0].has_tpot);
  EXPECT_EQ(got[0].errors_json, R"({"HTTP 500: boom": 1})");
  EXPECT_EQ(got[1].mode, "rate");
  EXPECT_DOUBLE_EQ(got[1].rate, 2.5);
  EXPECT_FALSE(got[1].has_tpot);
  EXPECT_FALSE(got[1].has_itl);
  EXPECT_EQ(query_text(db.handle(), "SELECT typeof(ttft_p99_s) FROM serve_levels WHERE level = 1"), "null");
  EXPECT_EQ(query_text(db.handle(), "SELECT typeof(rate) FROM serve_levels WHERE level = 0"), "null");
  EXPECT_NE(sqlite3_exec(db.handle(), "UPDATE serve_levels SET ok = 0", nullptr, nullptr, nullptr), SQLITE_OK);
  EXPECT_NE(sqlite3_exec(db.handle(), "DELETE FROM serve_levels", nullptr, nullptr, nullptr), SQLITE_OK);
}

// A runs.db of schema version 4 (serve levels before the soak) gains
// serve_levels.disconnected and server_json: its rows read back with nobody
// disconnected and no server check, new rows keep both, and the table stays
// append-only.
TEST(BenchRunsDb, SchemaVersion4DatabaseGainsDisconnectsAndServerState) {
  TempDir d;
  {
    sqlite3* h = open_old_db(d.db(), 4, {"schema_version", "runs", "run_ends", "bench_cells", "bench_fits",
                                         "eval_results", "serve_levels"});
    auto exec = [&](const std::string& q) { exec_sql(h, q); };
    exec("INSERT INTO runs(kind, started_at, model, device, git_sha, build_type, kvq_version, host, gpu_name, "
         "driver, clocks, copy_bw_gbs, params_json) VALUES ('serve', '2025-01-01T00:00:00Z', 'tiny @ http://h:1', "
         "'http', 'old', 'Release', '0.1.0', 'h', '', '', '', 0, '{}')");
    exec("INSERT INTO serve_levels(run_id, level, mode, concurrency, requests, ok, failed, duration_s, req_per_s, "
         "out_tok_per_s, in_tok_per_s, prompt_tokens, output_tokens, errors_json) VALUES (1, 0, 'concurrency', 8, "
         "64, 63, 1, 10.0, 6.3, 50.4, 201.6, 2016, 504, '{\"HTTP 429\": 1}')");
    sqlite3_close(h);
  }
  RunsDb db(d.db());
  EXPECT_EQ(db.schema_version(), 5);
  EXPECT_EQ(query_text(db.handle(), "SELECT group_concat(version) FROM schema_version"), "1,2,3,4,5");
  const auto old = db.serve_levels(1);
  ASSERT_EQ(old.size(), 1u);
  EXPECT_EQ(old[0].ok, 63);
  EXPECT_EQ(old[0].failed, 1);
  EXPECT_EQ(old[0].disconnected, 0);
  EXPECT_EQ(old[0].server_json, "{}");

  const int64_t run = db.begin_run(meta("serve"));
  ServeLevel l;
  l.mode = "concurrency";
  l.concurrency = 64;
  l.requests = 10000;
  l.ok = 8990;
  l.disconnected = 1000;
  l.failed = 10;
  l.errors_json = R"({"wrong length: 127 of 128 tokens": 10})";
  l.server_json = R"({"pages_used_after": 0, "sequences_running_after": 0, "rss_before": 1000, "rss_after": 1200})";
  db.add_serve_level(run, l);
  ServeLevel bad = l;
  bad.level = 1;
  bad.server_json = "[1]";  // not an object
  EXPECT_THROW(db.add_serve_level(run, bad), Error);
  const auto got = db.serve_levels(run);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].disconnected, 1000);
  EXPECT_EQ(got[0].failed, 10);
  EXPECT_EQ(got[0].server_json, l.server_json);
  EXPECT_NE(sqlite3_exec(db.handle(), "UPDATE serve_levels SET disconnected = 0", nullptr, nullptr, nullptr),
            SQLITE_OK);
  EXPECT_NE(sqlite3_exec(db.handle(), "DELETE FROM serve_levels", nullptr, nullptr, nullptr), SQLITE_OK);
  EXPECT_EQ(query_text(db.handle(), "PRAGMA integrity_check"), "ok");
}

TEST(BenchRunsDb, HomeFolderResolution) {
  TempDir d;
  const std::string flag = (d.p / "flag-home" / "nested").string();
  EXPECT_EQ(resolve_home(flag), flag);
  EXPECT_TRUE(fs::is_directory(flag));
  const char* old_home = std::getenv("KVQ_HOME");
  const std::string saved = old_home ? old_home : "";
  const std::string env_home = (d.p / "env-home").string();
  setenv("KVQ_HOME", env_home.c_str(), 1);
  EXPECT_EQ(resolve_home(""), env_home);
  EXPECT_EQ(resolve_home(flag), flag);  // --home wins over $KVQ_HOME
  unsetenv("KVQ_HOME");
  const char* home = std::getenv("HOME");
  if (home) EXPECT_EQ(resolve_home("") , (fs::path(home) / ".kvq").string());
  if (old_home) setenv("KVQ_HOME", saved.c_str(), 1);
  EXPECT_EQ(runs_db_path(flag), (fs::path(flag) / "runs.db").string());
  // A file where the folder should be.
  const std::string file = (d.p / "a-file").string();
  fclose(fopen(file.c_str(), "w"));
  EXPECT_THROW(resolve_home(file), Error);
}

TEST(BenchRunsDb, RunMetaDescribesBuildAndDevice) {
  auto be = make_backend("cpu");
  const RunMeta m = collect_run_meta(*be, /*measure_bandwidth=*/true);
  EXPECT_EQ(m.device, "cpu");
  EXPECT_FALSE(m.git_sha.empty());
  EXPECT_FALSE(m.build_type.empty());
  EXPECT_EQ(m.kvq_version, KVQ_VERSION);
  EXPECT_FALSE(m.gpu_name.empty());
  EXPECT_GT(m.copy_bw_gbs, 0.0);
  EXPECT_EQ(m.started_at.size(), std::string("2024-01-01T00:00:00Z").size());
}
