// `kvq bench` end to end as a user runs it (the CI sweep): a small sweep on
// the synthetic tiny model writes CSV, runs.db rows, a report with plots;
// list, compare and report work; Ctrl-C leaves a consistent runs.db;
// `kvq run --repeat` goes through the same measurement.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "cli_test_util.hpp"

extern char** environ;

namespace fs = std::filesystem;

namespace {

using Out = kvq::test::CliOut;

Out run_kvq(const std::string& args) { return kvq::test::kvq_cli(args); }

struct TempHome {
  fs::path p;
  TempHome() {
    static int n = 0;
    p = fs::temp_directory_path() / ("kvq_bench_cli_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::remove_all(p);
  }
  ~TempHome() { fs::remove_all(p); }
  std::string db() const { return (p / "runs.db").string(); }
};

// First column of the first row of a query, read with the sqlite3 C API the
// way a person inspecting runs.db would.
std::string sql(const std::string& db, const std::string& q) {
  sqlite3* h = nullptr;
  if (sqlite3_open_v2(db.c_str(), &h, SQLITE_OPEN_READONLY, nullptr) != SQLITE_OK) {
    sqlite3_close(h);
    return "<cannot open>";
  }
  sqlite3_busy_timeout(h, 5000);
  sqlite3_stmt* st = nullptr;
  std::string out = "<error>";
  if (sqlite3_prepare_v2(h, q.c_str(), -1, &st, nullptr) == SQLITE_OK) {
    out = "";
    if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_text(st, 0))
      out = reinterpret_cast<const char*>(sqlite3_column_text(st, 0));
  }
  sqlite3_finalize(st);
  sqlite3_close(h);
  return out;
}

std::string read(const fs::path& p) {
  std::ifstream f(p);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

size_t count_lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

// --kv-window 0: the codecs alone (the default window would name the k8v4
// rows k8v4+win1 and add its bf16 page to their bytes).
const char* kSweep = "bench -m synthetic:tiny --codecs none,k8v4 --contexts 64,128,256 --gen 8 --reps 2 -t 1 --kv-window 0";

}  // namespace

TEST(BenchCli, SweepWritesCsvDatabaseReportAndPlots) {
  TempHome h;
  const Out r = run_kvq(std::string(kSweep) + " --home " + h.p.string());
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("run 1 ok: 6 cells (6 ok, 0 flagged, 0 failed)"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("fit none"), std::string::npos) << r.out;

  // runs.db: one run, its end, six measured cells with the dispatch proof, fits.
  EXPECT_EQ(sql(h.db(), "SELECT count(*) FROM runs"), "1");
  EXPECT_EQ(sql(h.db(), "SELECT status FROM run_ends WHERE run_id = 1"), "ok");
  EXPECT_EQ(sql(h.db(), "SELECT model || ' ' || device || ' ' || build_type FROM runs"), "synthetic:tiny cpu Release");
  EXPECT_EQ(sql(h.db(), "SELECT count(*) FROM bench_cells WHERE run_id = 1 AND status = 'ok'"), "6");
  EXPECT_EQ(sql(h.db(), "SELECT count(*) FROM bench_cells WHERE decode_tps > 0 AND ttft_s > 0 AND itl_p50_ms > 0 "
                        "AND itl_p50_ms <= itl_p99_ms AND decode_tps_min <= decode_tps AND decode_tps <= decode_tps_max"),
            "6");
  EXPECT_EQ(sql(h.db(), "SELECT group_concat(DISTINCT attn_kernels) FROM bench_cells"), "cpu-packed (2 layers)");
  EXPECT_EQ(sql(h.db(), "SELECT sum(kv_host_device_bytes) FROM bench_cells"), "0");
  EXPECT_EQ(sql(h.db(), "SELECT bits_per_value FROM bench_cells WHERE codec = 'k8v4' AND ctx = 64"), "6.3125");
  EXPECT_EQ(sql(h.db(), "SELECT count(*) FROM bench_fits WHERE run_id = 1 AND n_points = 3"), "2");
  EXPECT_GT(std::stod(sql(h.db(), "SELECT copy_bw_gbs FROM runs")), 0.0);
  EXPECT_EQ(sql(h.db(), "PRAGMA journal_mode"), "wal");

  // CSV, report, plots under <home>/runs/1.
  const fs::path dir = h.p / "runs" / "1";
  EXPECT_EQ(count_lines(read(dir / "cells.csv")), 7u);
  const std::string md = read(dir / "report.md");
  EXPECT_NE(md.find("# kvq bench run 1"), std::string::npos);
  EXPECT_NE(md.find("| none | 64 | ok |"), std::string::npos) << md;
  EXPECT_NE(md.find("![tps_vs_ctx.svg](tps_vs_ctx.svg)"), std::string::npos);
  for (const char* plot : {"tps_vs_ctx", "kv_mib_vs_ctx", "itl_fit"})
    for (const char* ext : {".svg", ".png"}) {
      const fs::path f = dir / (std::string(plot) + ext);
      ASSERT_TRUE(fs::exists(f)) << f;
      EXPECT_GT(fs::file_size(f), 1000u) << f;
    }
  EXPECT_NE(read(dir / "tps_vs_ctx.svg").find("k8v4"), std::string::npos);  // a series per codec
}

TEST(BenchCli, ListCompareAndReport) {
  TempHome h;
  const std::string home = " --home " + h.p.string();
  ASSERT_EQ(run_kvq(std::string(kSweep) + home + " --no-plots").rc, 0);
  const fs::path out = h.p / "custom-out";
  const Out second = run_kvq(std::string(kSweep) + home + " --no-plots --out " + out.string());
  ASSERT_EQ(second.rc, 0) << second.err;
  EXPECT_TRUE(fs::exists(out / "report.md"));
  EXPECT_TRUE(fs::exists(out / "cells.csv"));
  EXPECT_FALSE(fs::exists(h.p / "runs" / "2"));

  const Out list = run_kvq("bench list" + home);
  ASSERT_EQ(list.rc, 0) << list.err;
  EXPECT_EQ(count_lines(list.out), 3u) << list.out;  // header + 2 runs
  EXPECT_NE(list.out.find("6/6"), std::string::npos) << list.out;
  EXPECT_NE(list.out.find("synthetic:tiny"), std::string::npos);

  const Out cmp = run_kvq("bench compare 1 latest" + home);
  ASSERT_EQ(cmp.rc, 0) << cmp.err;
  EXPECT_NE(cmp.out.find("B/A tok/s"), std::string::npos) << cmp.out;
  EXPECT_NE(cmp.out.find("| k8v4 | 256 |"), std::string::npos) << cmp.out;
  EXPECT_NE(cmp.out.find("in 6 cells"), std::string::npos) << cmp.out;
  const Out bad = run_kvq("bench compare 1 99" + home);
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.err.find("no run 99"), std::string::npos) << bad.err;

  const fs::path again = h.p / "again";
  const Out rep = run_kvq("bench report 1 --out " + again.string() + home);
  ASSERT_EQ(rep.rc, 0) << rep.err;
  EXPECT_NE(read(again / "report.md").find("# kvq bench run 1"), std::string::npos);
  EXPECT_EQ(count_lines(read(again / "cells.csv")), 7u);
  EXPECT_GT(fs::file_size(again / "itl_fit.svg"), 1000u);
}

TEST(BenchCli, ClearErrorsForBadOptions) {
  TempHome h;
  const std::string home = " --home " + h.p.string();
  const Out codec = run_kvq("bench -m synthetic:tiny --codecs none,turbo9 --contexts 64 --gen 4 --reps 1" + home);
  EXPECT_EQ(codec.rc, 2);
  EXPECT_NE(codec.err.find("turbo9"), std::string::npos) << codec.err;
  const Out ctx = run_kvq("bench -m synthetic:tiny --codecs none --contexts 64,x --gen 4 --reps 1" + home);
  EXPECT_EQ(ctx.rc, 2);
  EXPECT_NE(ctx.err.find("'x'"), std::string::npos) << ctx.err;
  const Out shape = run_kvq("bench -m synthetic:huge --codecs none --contexts 64 --gen 4 --reps 1" + home);
  EXPECT_EQ(shape.rc, 2);
  EXPECT_NE(shape.err.find("bonsai-8b"), std::string::npos) << "lists the shapes: " << shape.err;
  EXPECT_NE(run_kvq("bench -m synthetic:tiny --gen 1" + home).rc, 0);
  for (const char* bad : {"0", "-1"}) {
    const Out pr = run_kvq(std::string("bench -m synthetic:tiny --codecs none --contexts 64 --gen 4 --reps 1 --prefill-reps ") +
                       bad + home);
    EXPECT_EQ(pr.rc, 2) << bad;
    EXPECT_NE(pr.err.find("--prefill-reps must be at least 1"), std::string::npos) << pr.err;
  }
  EXPECT_EQ(sql(h.db(), "SELECT count(*) FROM runs"), "0");  // nothing recorded for refused setups
}

TEST(BenchCli, PrefillRepsAreRecordedAndDocumentedInHelp) {
  TempHome h;
  const Out r = run_kvq("bench -m synthetic:tiny --codecs none,k8v4 --contexts 64,128 --gen 6 --reps 3 --prefill-reps 2 "
                    "-t 1 --no-plots --home " + h.p.string());
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("2 prefill(s) per cell, 1 warm-up + 3 decode runs"), std::string::npos) << r.err;
  EXPECT_EQ(sql(h.db(), "SELECT count(*) FROM bench_cells WHERE prefill_n = 2 AND digests_agree = 1 AND status = 'ok'"),
            "4");
  EXPECT_EQ(sql(h.db(), "SELECT count(*) FROM bench_cells WHERE json_array_length(prefills_json) = 2 "
                        "AND json_array_length(reps_json) = 3 AND ttft_s_min <= ttft_s AND ttft_s <= ttft_s_max"),
            "4");
  EXPECT_EQ(sql(h.db(), "SELECT max(version) FROM schema_version"), "5");  // schema 5: serve_levels.disconnected, server_json
  const std::string csv = read(h.p / "runs" / "1" / "cells.csv");
  EXPECT_EQ(csv.rfind("run_id,codec,ctx,gen,reps,prefill_n,", 0), 0u) << csv;
  const Out help = run_kvq("bench --help");
  EXPECT_EQ(help.rc, 0);
  EXPECT_NE(help.out.find("--prefill-reps"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("--prefill-every-run"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("re-feed the last"), std::string::npos) << help.out;
  EXPECT_EQ(run_kvq("bench list --help").out.find("re-feed the last"), std::string::npos);
}

TEST(BenchCli, CtrlCStopsAfterTheCurrentCellWithAConsistentDatabase) {
  TempHome h;
  fs::create_directories(h.p);
  const std::string db = h.db();
  // Many cells, so the sweep is still running when the signal arrives.
  std::vector<std::string> args = {KVQ_BIN, "bench", "-m", "synthetic:tiny", "--codecs", "all", "--contexts",
                                   "64,128", "--gen", "8", "--reps", "2", "-t", "1", "--no-plots", "--home",
                                   h.p.string()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, KVQ_BIN, &fa, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  // Wait (up to a minute) until the first cell is in runs.db, then Ctrl-C.
  bool started = false;
  for (int i = 0; i < 600 && !started; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    // (before the schema exists the query answers "<error>" or "<cannot open>")
    const std::string n = fs::exists(db) ? sql(db, "SELECT count(*) FROM bench_cells") : "";
    started = !n.empty() && std::isdigit(static_cast<unsigned char>(n[0])) && std::stoi(n) >= 1;
  }
  ASSERT_TRUE(started) << "the sweep recorded no cell within a minute";
  ASSERT_EQ(kill(pid, SIGINT), 0);
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st)) << "killed by a signal instead of stopping";
  EXPECT_EQ(WEXITSTATUS(st), 130);
  EXPECT_EQ(sql(db, "SELECT status FROM run_ends WHERE run_id = 1"), "interrupted");
  const int cells = std::stoi(sql(db, "SELECT count(*) FROM bench_cells"));
  EXPECT_GE(cells, 1);
  EXPECT_LT(cells, 52);  // 26 codecs x 2 contexts planned
  EXPECT_EQ(sql(db, "SELECT count(*) FROM bench_cells WHERE status = 'ok'"), std::to_string(cells));
  EXPECT_EQ(sql(db, "PRAGMA integrity_check"), "ok");
  EXPECT_EQ(count_lines(read(h.p / "runs" / "1" / "cells.csv")), size_t(cells) + 1);
}

TEST(BenchCli, RunRepeatUsesTheBenchMeasurement) {
  const Out r = run_kvq("run -m synthetic:tiny --random-prompt 48 -n 6 --repeat 2 --kv k8v4 --kv-window 0 -t 1");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err.find("kvq: warm-up"), std::string::npos) << "progress lines only on a terminal: " << r.err;
  EXPECT_NE(r.err.find("kvq: run 2/2: prefill 48 tokens"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("median of 2 runs: prompt 48 tokens"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("KV k8v4"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("6.312 bits/value"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("WARNING"), std::string::npos) << r.err;
  const Out one = run_kvq("run -m synthetic:tiny --random-prompt 8 -n 1 --repeat 2 -t 1");
  EXPECT_EQ(one.rc, 2);
  EXPECT_NE(one.err.find("-n 2 or more"), std::string::npos) << one.err;
}

// --kv-window: the serving form of the exact window, through the bench (one
// sequence and a batch) and run; a server's --kv-budget pays for the windows
// first.
TEST(BenchCli, ExactWindowCellsAreNamedAndCountTheirPages) {
  TempHome h;
  const std::string home = " --home " + h.p.string();
  // Two decode runs: the second re-feeds the window's page the first packed
  // (tokens 64..99), and the cell still counts its single-token calls right.
  const Out r = run_kvq("bench -m synthetic:tiny --codecs tsym3 --contexts 100 --gen 40 --reps 2 --warmup 0 "
                        "--batch 1,2 --kv-window 1 --no-plots" + home);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(sql(h.db(), "SELECT count(*) FROM bench_cells WHERE codec = 'tsym3+win1' AND status = 'ok'"), "2");
  // 139 tokens: 128 packed (2 pages) and one exact page of 64 bf16 rows.
  const Out plain = run_kvq("bench -m synthetic:tiny --codecs tsym3 --contexts 100 --gen 40 --reps 1 --warmup 0 "
                            "--kv-window 0 --no-plots" + home);
  ASSERT_EQ(plain.rc, 0) << plain.err;
  const double with = std::stod(sql(h.db(), "SELECT kv_bytes FROM bench_cells WHERE codec = 'tsym3+win1' AND batch = 1"));
  const double without = std::stod(sql(h.db(), "SELECT kv_bytes FROM bench_cells WHERE codec = 'tsym3'"));
  EXPECT_GT(with, without);
  const Out run = run_kvq("run -m synthetic:tiny --kv k8v4 --kv-window 2 -n 150 -p hello");
  EXPECT_EQ(run.rc, 0) << run.err;
  const Out serve = run_kvq("serve -m synthetic:tiny --kv-window 1 --kv-budget 1K");
  EXPECT_EQ(serve.rc, 2) << serve.err;
  EXPECT_NE(serve.err.find("exact windows"), std::string::npos) << serve.err;
  // Capacity: a sequence of one page is that bf16 page, so a budget holds as
  // many as of `none`. Both without --kv-window: the default window is one
  // page for tsym3 and none for `none`.
  const std::string max = " --contexts 60 --gen 4 --reps 1 --batch max --kv-budget 1M --no-plots";
  const Out cap = run_kvq("bench -m synthetic:tiny --codecs tsym3" + max + home);
  const Out cap_none = run_kvq("bench -m synthetic:tiny --codecs none" + max + home);
  ASSERT_EQ(cap.rc, 0) << cap.err;
  ASSERT_EQ(cap_none.rc, 0) << cap_none.err;
  EXPECT_EQ(sql(h.db(), "SELECT count(*) FROM bench_cells WHERE codec = 'tsym3+win1' AND capacity = 1"), "1");
  EXPECT_EQ(sql(h.db(), "SELECT count(*) FROM bench_cells WHERE codec = 'none' AND capacity = 1"), "1");
  const Out bad = run_kvq("bench -m synthetic:tiny --codecs tsym3 --kv-window 1.5" + max + home);
  EXPECT_EQ(bad.rc, 2) << bad.err;
  EXPECT_NE(bad.err.find("is not a number of pages"), std::string::npos) << bad.err;
  auto admitted = [](const std::string& err) {
    const size_t at = err.find("@ 60 x ");
    return at == std::string::npos ? std::string() : err.substr(at + 7, err.find(' ', at + 7) - at - 7);
  };
  EXPECT_FALSE(admitted(cap.err).empty()) << cap.err;
  EXPECT_EQ(admitted(cap.err), admitted(cap_none.err));
}
