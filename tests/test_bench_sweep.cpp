// run_sweep (bench/sweep.hpp) on the CPU with the synthetic tiny model:
// failing cells are recorded and the sweep goes on; a stop request leaves a
// consistent runs.db; CSV, report and plots are written.
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "backend/backend.hpp"
#include "backend_test_util.hpp"
#include "bench/runs_db.hpp"
#include "bench/sweep.hpp"
#include "core/error.hpp"
#include "kv/cache.hpp"
#include "kv/codec_table.hpp"
#include "bench/measure.hpp"
#include "bench/stats.hpp"
#include "engine/session.hpp"
#include "model/forward.hpp"
#include "model/model_spec.hpp"

using namespace kvq;
using namespace kvq::bench;
namespace fs = std::filesystem;

namespace {

// The CPU backend, except that its caches refuse some codecs (Errc::unsupported,
// as a backend without kernels for them does) and run out of memory above a
// token count (the CUDA cache's out_of_range "GPU memory" error).
class PickyBackend final : public testutil::ForwardingBackend {
 public:
  std::unique_ptr<kv::Cache> make_cache(const kv::CodecOptions& o, const kv::CacheShape& shape) override {
    const std::string name = kv::resolve_codec(o).name;
    if (name == "tsym3") fail(Errc::unsupported, "fused GPU decode for tsym3 is not implemented yet");
    if (name == "k8v4" && shape.max_tokens > 100)
      fail(Errc::out_of_range, "GPU KV cache for ", shape.max_tokens, " tokens needs 9 MiB but only 1 MiB of GPU memory are free");
    return ForwardingBackend::make_cache(o, shape);
  }
  double measure_copy_bandwidth() override { return 1e10; }
};

struct TempHome {
  fs::path p;
  TempHome() {
    static int n = 0;
    p = fs::temp_directory_path() / ("kvq_sweep_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::remove_all(p);
  }
  ~TempHome() { fs::remove_all(p); }
};

// One CPU thread: tiny matrices gain nothing from more, and on a loaded
// 2-core CI machine OpenMP barriers between busy threads cost seconds.
struct OneThread {
  int saved = omp_get_max_threads();
  ~OneThread() { omp_set_num_threads(saved); }
};

SweepConfig small_sweep(const std::string& home) {
  SweepConfig cfg;
  cfg.model = "synthetic:tiny";
  cfg.codecs = {"none", "k8v4", "tsym3"};
  cfg.contexts = {32, 64, 128};
  cfg.gen = 4;
  cfg.reps = 2;
  cfg.threads = 1;
  cfg.home = home;
  cfg.make_backend = [](const std::string&) { return std::make_unique<PickyBackend>(); };
  return cfg;
}

size_t lines(const fs::path& p) {
  std::ifstream f(p);
  size_t n = 0;
  for (std::string l; std::getline(f, l);) ++n;
  return n;
}

}  // namespace

TEST(BenchSweep, FailingCellsAreRecordedAndTheSweepGoesOn) {
  OneThread one;
  TempHome h;
  int progress_calls = 0;
  double last_elapsed = 0;
  const SweepResult r = run_sweep(small_sweep(h.p.string()), [&](const SweepProgress& p) {
    ++progress_calls;
    EXPECT_EQ(p.cells, 9);
    EXPECT_GE(p.elapsed_s, last_elapsed);
    last_elapsed = p.elapsed_s;
    EXPECT_FALSE(format_progress(p).empty());
  });
  EXPECT_GT(progress_calls, 9);
  EXPECT_EQ(r.status, "ok");
  ASSERT_EQ(r.cells.size(), 9u);
  // codec-major order; statuses per the backend above
  const std::vector<std::string> want = {"ok", "ok", "ok", "ok", "ok", "oom", "unsupported", "unsupported", "unsupported"};
  for (size_t i = 0; i < 9; ++i) EXPECT_EQ(r.cells[i].status, want[i]) << i << ": " << r.cells[i].error;
  EXPECT_NE(r.cells[5].error.find("GPU memory"), std::string::npos);
  EXPECT_NE(r.cells[6].error.find("tsym3"), std::string::npos);
  // Fits: none has 3 contexts, k8v4 two (the third ran out of memory), tsym3 none.
  ASSERT_EQ(r.fits.size(), 2u);
  EXPECT_EQ(r.fits[0].codec, "none");
  EXPECT_EQ(r.fits[0].n_points, 3);
  EXPECT_EQ(r.fits[1].codec, "k8v4");
  EXPECT_EQ(r.fits[1].n_points, 2);

  // The database holds the same cells and the run's end.
  RunsDb db(runs_db_path(h.p.string()));
  const auto run = db.run(r.run_id);
  ASSERT_TRUE(run.has_value());
  EXPECT_EQ(run->status, "ok");
  EXPECT_EQ(run->meta.kind, "bench");
  EXPECT_EQ(run->meta.model, "synthetic:tiny");
  EXPECT_DOUBLE_EQ(run->meta.copy_bw_gbs, 10.0);
  const auto cells = db.cells(r.run_id);
  ASSERT_EQ(cells.size(), 9u);
  for (size_t i = 0; i < 9; ++i) EXPECT_EQ(cells[i].status, want[i]);
  EXPECT_EQ(db.fits(r.run_id).size(), 2u);
  EXPECT_NEAR(cells[0].pct_copy_bw, 100.0 * cells[0].achieved_gbs / 10.0, 1e-6);

  // Outputs in <home>/runs/<id>
  EXPECT_EQ(fs::path(r.out_dir), h.p / "runs" / std::to_string(r.run_id));
  EXPECT_EQ(lines(r.csv_path), 10u);
  std::ifstream rep(r.report_path);
  const std::string md((std::istreambuf_iterator<char>(rep)), std::istreambuf_iterator<char>());
  EXPECT_NE(md.find("| tsym3 | 32 | unsupported |"), std::string::npos) << md;
  EXPECT_NE(md.find("| k8v4 | 128 | oom |"), std::string::npos);
  EXPECT_NE(md.find("## ITL fits"), std::string::npos);
  for (const auto& p : r.plot_paths) {
    EXPECT_TRUE(fs::exists(p)) << p;
    EXPECT_GT(fs::file_size(p), 1000u) << p;
  }
  EXPECT_EQ(r.plot_paths.size(), 6u) << r.plot_note;  // 3 plots x (svg, png): gnuplot is a dependency
}

TEST(BenchSweep, StopRequestEndsAfterTheCurrentCell) {
  OneThread one;
  TempHome h;
  SweepConfig cfg = small_sweep(h.p.string());
  cfg.codecs = {"none", "k8v8"};
  cfg.reps = 1;
  cfg.plots = false;
  int polls = 0;
  cfg.should_stop = [&] { return ++polls > 2; };  // two cells, then "Ctrl-C"
  const SweepResult r = run_sweep(cfg);
  EXPECT_EQ(r.status, "interrupted");
  ASSERT_EQ(r.cells.size(), 2u);
  RunsDb db(runs_db_path(h.p.string()));
  EXPECT_EQ(db.run(r.run_id)->status, "interrupted");
  EXPECT_EQ(db.cells(r.run_id).size(), 2u);
  EXPECT_EQ(lines(r.csv_path), 3u);
  EXPECT_TRUE(fs::exists(r.report_path));
  EXPECT_TRUE(r.plot_paths.empty());
}

// The prefill-once protocol through the sweep: --prefill-reps 1 and 2 record
// prefill_n per cell (runs.db, CSV, report); the decode runs agree and
// generate what a plain prefill + greedy decode of the same prompt does.
TEST(BenchSweep, PrefillRepsAreRecordedAndDecodeRunsMatchAPlainPrefill) {
  OneThread one;
  for (int n : {1, 2}) {
    SCOPED_TRACE("prefill_reps " + std::to_string(n));
    TempHome h;
    SweepConfig cfg = small_sweep(h.p.string());
    cfg.codecs = {"none", "k8v8"};
    cfg.contexts = {32, 64};
    cfg.prefill_reps = n;
    cfg.plots = false;
    std::vector<std::string> lines_seen;
    int prefill_steps = 0;
    const SweepResult r = run_sweep(cfg, [&](const SweepProgress& p) {
      EXPECT_EQ(p.prefill_reps, n);
      if (p.prefill_rep >= 0) {
        EXPECT_LT(p.prefill_rep, n);
        ++prefill_steps;
        EXPECT_NE(format_progress(p).find("prefill " + std::to_string(p.prefill_rep + 1) + "/" + std::to_string(n)),
                  std::string::npos)
            << format_progress(p);
      }
    });
    EXPECT_GE(prefill_steps, 4 * n);  // every cell announces each of its prefills
    ASSERT_EQ(r.cells.size(), 4u);

    auto be = make_backend("cpu");
    auto model = open_model("synthetic:tiny", *be);
    RunsDb db(runs_db_path(h.p.string()));
    const auto cells = db.cells(r.run_id);
    ASSERT_EQ(cells.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      const CellResult& c = cells[i];
      EXPECT_EQ(c.status, "ok") << c.error;
      EXPECT_EQ(c.prefill_n, n);
      EXPECT_EQ(c.prefill_results.size(), size_t(n));
      EXPECT_TRUE(c.digests_agree);
      for (const auto& rep : c.rep_results) EXPECT_EQ(rep.digest, c.digest);
      // The sweep's prompt for this context, prefilled and decoded plainly.
      const std::vector<int32_t> prompt = random_prompt(c.ctx, model->config().vocab_size, cfg.seed + uint64_t(c.ctx));
      kv::CodecOptions codec;
      codec.kv = c.codec;
      SessionOptions so;
      so.ctx = c.ctx + cfg.gen;
      Session s(*model, be->make_cache(codec, model->cache_shape(so.ctx)), nullptr, so);
      GenerateOptions g;
      g.n_predict = cfg.gen;
      g.stop_at_eog = false;
      g.sampling.temperature = 0;
      EXPECT_EQ(token_digest(s.generate(prompt, g).tokens), c.digest) << c.codec << " @ " << c.ctx;
    }
    EXPECT_EQ(db.run(r.run_id)->meta.params_json.find("\"protocol\":\"prefill-once\"") != std::string::npos, true);
    EXPECT_NE(db.run(r.run_id)->meta.params_json.find("\"prefill_reps\":" + std::to_string(n)), std::string::npos);
    // CSV: a prefill_n column holding n for every cell.
    std::ifstream csv(r.csv_path);
    std::string header, row;
    std::getline(csv, header);
    EXPECT_EQ(header.rfind("run_id,codec,ctx,gen,reps,prefill_n,status,", 0), 0u) << header;
    while (std::getline(csv, row))
      EXPECT_NE(row.find(",4,2," + std::to_string(n) + ",ok,"), std::string::npos) << row;  // gen 4, reps 2
    std::ifstream rep(r.report_path);
    const std::string md((std::istreambuf_iterator<char>(rep)), std::istreambuf_iterator<char>());
    EXPECT_NE(md.find(std::to_string(n) + " timed prefill(s) per cell"), std::string::npos) << md;
  }
}

TEST(BenchSweep, PrefillEveryRunKeepsTheOldProtocol) {
  OneThread one;
  TempHome h;
  SweepConfig cfg = small_sweep(h.p.string());
  cfg.codecs = {"k8v8"};
  cfg.contexts = {32};
  cfg.prefill_every_run = true;
  cfg.plots = false;
  const SweepResult r = run_sweep(cfg, [&](const SweepProgress& p) { EXPECT_LT(p.prefill_rep, 0); });
  ASSERT_EQ(r.cells.size(), 1u);
  EXPECT_EQ(r.cells[0].status, "ok") << r.cells[0].error;
  EXPECT_EQ(r.cells[0].prefill_n, cfg.reps);
  EXPECT_TRUE(r.cells[0].prefill_results.empty());
  for (const auto& rep : r.cells[0].rep_results) EXPECT_GT(rep.ttft_s, 0);
  RunsDb db(runs_db_path(h.p.string()));
  EXPECT_NE(db.run(r.run_id)->meta.params_json.find("prefill-every-run"), std::string::npos);
}

TEST(BenchSweep, SetupErrorsComeBeforeAnyRun) {
  OneThread one;
  TempHome h;
  SweepConfig cfg = small_sweep(h.p.string());
  cfg.codecs = {"none", "nope"};
  EXPECT_THROW(run_sweep(cfg), Error);
  cfg.codecs = {"none"};
  cfg.gen = 1;
  EXPECT_THROW(run_sweep(cfg), Error);
  cfg.gen = 4;
  for (int bad : {0, -3}) {
    cfg.prefill_reps = bad;
    try {
      run_sweep(cfg);
      ADD_FAILURE() << "prefill_reps " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("--prefill-reps must be at least 1"), std::string::npos) << e.what();
    }
  }
  cfg.prefill_reps = 1;
  cfg.model = "synthetic:nope";
  EXPECT_THROW(run_sweep(cfg), Error);
  // Nothing was recorded for the refused setups.
  RunsDb db(runs_db_path(h.p.string()));
  EXPECT_TRUE(db.runs().empty());
}

// kvq bench --batch on the CPU backend: B sequences per step over one paged
// pool, every codec family, recorded with its batch size and pages in
// runs.db, the CSV and the report (grid and tok/s-vs-batch plot).
TEST(BenchSweep, BatchCellsDecodeManySequencesPerStep) {
  OneThread one;
  TempHome h;
  SweepConfig cfg;
  cfg.model = "synthetic:tiny";
  cfg.codecs = {"none", "k8v8", "tsym3", "rotor3_sym+qjl"};
  cfg.contexts = {40};
  cfg.batches = {1, 3};
  cfg.gen = 4;
  cfg.reps = 1;
  cfg.warmup = 1;
  cfg.threads = 1;
  cfg.home = h.p.string();
  const SweepResult r = run_sweep(cfg, {});
  ASSERT_EQ(r.cells.size(), 8u);
  for (const auto& c : r.cells) {
    EXPECT_EQ(c.status, "ok") << c.codec << " x" << c.batch << ": " << c.error;
    EXPECT_GT(c.decode_tps.median, 0);
  }
  const CellResult& b3 = r.cells[1];
  EXPECT_EQ(b3.batch, 3);
  EXPECT_EQ(b3.kv_pages, 3);  // 3 sequences of 40 + 4 tokens: one 64-token page each
  EXPECT_EQ(b3.kv_bytes, 3 * r.cells[0].kv_bytes);
  ASSERT_EQ(b3.rep_results.size(), 1u);
  EXPECT_TRUE(b3.digests_agree);
  EXPECT_EQ(r.fits.size(), 0u);  // one context: nothing to fit

  RunsDb db(runs_db_path(h.p.string()));
  const auto cells = db.cells(r.run_id);
  ASSERT_EQ(cells.size(), 8u);
  EXPECT_EQ(cells[1].batch, 3);
  EXPECT_EQ(cells[1].kv_pages, 3);
  EXPECT_EQ(cells[0].batch, 1);
  std::ifstream rep(r.report_path);
  const std::string md((std::istreambuf_iterator<char>(rep)), std::istreambuf_iterator<char>());
  EXPECT_NE(md.find("## Batched decode: aggregate tok/s at prompt 40"), std::string::npos) << md;
  EXPECT_NE(md.find("| tsym3 | 40 | 3 | 3 | ok |"), std::string::npos) << md;
  bool batch_plot = false;
  for (const auto& p : r.plot_paths) batch_plot = batch_plot || p.find("tps_vs_batch.svg") != std::string::npos;
  EXPECT_TRUE(batch_plot) << r.plot_note;
}

TEST(BenchSweep, BatchListIsChecked) {
  EXPECT_EQ(parse_batch_list("1,8,32,64"), std::vector<int>({1, 8, 32, 64}));
  for (const char* bad : {"", "0", "1,,8", "8,8", "-1", "4097", "2x", "1.5"})
    EXPECT_THROW(parse_batch_list(bad), Error) << bad;
}

// Capacity mode: each codec admits as many sequences as the KV budget holds
// (a 3-bit codec about 5x what bf16 does) and decodes them together.
TEST(BenchSweep, CapacityModeAdmitsWhatTheBudgetHolds) {
  OneThread one;
  TempHome h;
  SweepConfig cfg;
  cfg.model = "synthetic:tiny";
  cfg.codecs = {"none", "tsym3"};
  cfg.contexts = {60};
  cfg.batches = {kBatchMax};
  cfg.gen = 4;
  cfg.reps = 1;
  cfg.warmup = 0;
  cfg.threads = 1;
  cfg.home = h.p.string();
  auto backend = make_backend("cpu");
  auto model = open_model(cfg.model, *backend);
  const ModelConfig& mc = model->config();
  const int none_one = sequences_in_budget("none", 64, mc.n_layers, mc.n_kv_heads, mc.head_dim, 1ull << 32);
  ASSERT_GT(none_one, 0);
  // A budget of exactly 3 `none` sequences (one 64-token page each).
  const uint64_t page_bytes = (1ull << 32) / uint64_t(none_one);
  cfg.kv_budget = 3 * page_bytes + page_bytes / 2;
  EXPECT_EQ(sequences_in_budget("none", 64, mc.n_layers, mc.n_kv_heads, mc.head_dim, cfg.kv_budget), 3);
  const int tsym3 = sequences_in_budget("tsym3", 64, mc.n_layers, mc.n_kv_heads, mc.head_dim, cfg.kv_budget);
  EXPECT_GE(tsym3, 3 * 4);  // 3.125 bits per value against 16
  const SweepResult r = run_sweep(cfg, {});
  ASSERT_EQ(r.cells.size(), 2u);
  EXPECT_EQ(r.cells[0].batch, 3);
  EXPECT_EQ(r.cells[1].batch, tsym3);
  for (const auto& c : r.cells) {
    EXPECT_TRUE(c.capacity);
    EXPECT_EQ(c.status, "ok") << c.error;
    EXPECT_EQ(c.kv_pages, c.batch);
    EXPECT_EQ(c.prefill_n, 1);  // --batch-fill auto: the others copy sequence 0's KV
  }
  // Each prefilled: the same pages, B prefills.
  cfg.codecs = {"none"};
  cfg.batch_fill = SweepConfig::BatchFill::prefill;
  const SweepResult p = run_sweep(cfg, {});
  ASSERT_EQ(p.cells.size(), 1u);
  EXPECT_EQ(p.cells[0].status, "ok") << p.cells[0].error;
  EXPECT_EQ(p.cells[0].prefill_n, 3);
  EXPECT_EQ(p.cells[0].kv_pages, 3);
  cfg.batch_fill = SweepConfig::BatchFill::automatic;
  // With an exact window of one page, a sequence of one page is that bf16
  // page: `none`'s count, whatever the codec; the cells decode in it.
  EXPECT_EQ(sequences_in_budget("tsym3", 64, mc.n_layers, mc.n_kv_heads, mc.head_dim, cfg.kv_budget, 1), 3);
  EXPECT_GT(sequences_in_budget("tsym3", 64 * 5, mc.n_layers, mc.n_kv_heads, mc.head_dim, 16 * cfg.kv_budget, 1),
            sequences_in_budget("none", 64 * 5, mc.n_layers, mc.n_kv_heads, mc.head_dim, 16 * cfg.kv_budget));
  cfg.codecs = {"tsym3"};
  cfg.window_pages = 1;
  const SweepResult w = run_sweep(cfg, {});
  ASSERT_EQ(w.cells.size(), 1u);
  EXPECT_EQ(w.cells[0].status, "ok") << w.cells[0].error;
  EXPECT_EQ(w.cells[0].batch, 3);
  EXPECT_EQ(w.cells[0].codec, "tsym3+win1");
  cfg.window_pages = 0;
  cfg.codecs = {"none", "tsym3"};
  RunsDb db(runs_db_path(h.p.string()));
  EXPECT_TRUE(db.cells(r.run_id)[1].capacity);
  cfg.kv_budget = 0;
  EXPECT_THROW(run_sweep(cfg, {}), Error);  // max needs a budget
  EXPECT_EQ(parse_byte_size("120G"), 120ull << 30);
  EXPECT_EQ(parse_byte_size("1.5k"), 1536u);
  for (const char* bad : {"", "G", "-1G", "12X", "0"}) EXPECT_THROW(parse_byte_size(bad), Error) << bad;
  EXPECT_EQ(parse_batch_list("1,max"), std::vector<int>({1, kBatchMax}));
}
