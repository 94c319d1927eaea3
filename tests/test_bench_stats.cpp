// bench/stats, bench/compare, list parsing, CSV rows and measure_cell on
// the synthetic tiny model: the numbers `kvq bench` reports.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "backend/backend.hpp"
#include "bench/compare.hpp"
#include "bench/measure.hpp"
#include "bench/report.hpp"
#include "bench/stats.hpp"
#include "bench/sweep.hpp"
#include "core/error.hpp"
#include "engine/session.hpp"
#include "kv/codec_table.hpp"
#include "model/forward.hpp"
#include "model/model_spec.hpp"

using namespace kvq;
using namespace kvq::bench;

namespace {

CellResult cell(const std::string& codec, int ctx, Spread tps, Spread ttft = {1, 1, 1}, double itl = 10,
                double kv_seq = 0) {
  CellResult c;
  c.codec = codec;
  c.ctx = ctx;
  c.gen = 8;
  c.reps = 3;
  c.status = "ok";
  c.decode_tps = tps;
  c.ttft_s = ttft;
  c.itl_p50_ms = {itl, itl, itl};
  c.kv_seq = kv_seq ? kv_seq : ctx + 4;
  return c;
}

// Splits one CSV line, honouring quotes ("" inside a quoted field is one quote).
std::vector<std::string> csv_split(const std::string& line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char ch = line[i];
    if (quoted) {
      if (ch == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        out.back() += '"';
        ++i;
      } else if (ch == '"') {
        quoted = false;
      } else {
        out.back() += ch;
      }
    } else if (ch == '"') {
      quoted = true;
    } else if (ch == ',') {
      out.emplace_back();
    } else if (ch != '\n') {
      out.back() += ch;
    }
  }
  return out;
}

// One CPU thread for the model runs (tiny matrices; a loaded CI machine).
struct OneThread {
  int saved = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved); }
};

}  // namespace

TEST(BenchStats, SpreadAndPercentile) {
  const Spread odd = spread({3, 1, 2});
  EXPECT_DOUBLE_EQ(odd.median, 2);
  EXPECT_DOUBLE_EQ(odd.min, 1);
  EXPECT_DOUBLE_EQ(odd.max, 3);
  EXPECT_DOUBLE_EQ(spread({4, 1, 3, 2}).median, 2.5);
  EXPECT_DOUBLE_EQ(spread({}).median, 0);
  std::vector<double> v;
  for (int i = 10; i >= 1; --i) v.push_back(i);
  EXPECT_DOUBLE_EQ(percentile(v, 50), 5);
  EXPECT_DOUBLE_EQ(percentile(v, 99), 10);
  EXPECT_DOUBLE_EQ(percentile(v, 90), 9);
  EXPECT_DOUBLE_EQ(percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(percentile({7}, 99), 7);
  EXPECT_THROW(percentile({}, 50), Error);
}

TEST(BenchStats, LineFit) {
  const LineFit exact = fit_line({1, 2, 4}, {5, 7, 11});  // y = 3 + 2x
  EXPECT_NEAR(exact.a, 3, 1e-12);
  EXPECT_NEAR(exact.b, 2, 1e-12);
  EXPECT_NEAR(exact.rms_residual, 0, 1e-12);
  const LineFit noisy = fit_line({0, 1, 2, 3}, {1, 2, 2, 3});
  EXPECT_NEAR(noisy.b, 0.6, 1e-12);
  EXPECT_NEAR(noisy.a, 1.1, 1e-12);
  EXPECT_NEAR(noisy.rms_residual, std::sqrt(0.2 / 4), 1e-12);  // residuals -0.1, 0.3, -0.3, 0.1
  EXPECT_THROW(fit_line({1}, {1}), Error);
  EXPECT_THROW(fit_line({2, 2}, {1, 3}), Error);
}

TEST(BenchStats, ItlFitUsesLongContextsWhenThereAreTwo) {
  std::vector<CellResult> cells = {
      cell("a", 4096, {1, 1, 1}, {1, 1, 1}, 100.0, 4000),  // off the line: ignored when >= 2 long cells exist
      cell("a", 8192, {1, 1, 1}, {1, 1, 1}, 2 + 0.5 * 8, 8000),
      cell("a", 16384, {1, 1, 1}, {1, 1, 1}, 2 + 0.5 * 16, 16000),
      cell("a", 32768, {1, 1, 1}, {1, 1, 1}, 2 + 0.5 * 32, 32000),
      cell("b", 64, {1, 1, 1}, {1, 1, 1}, 1 + 0.25 * 0.1, 100),
      cell("b", 128, {1, 1, 1}, {1, 1, 1}, 1 + 0.25 * 0.2, 200),
      cell("c", 64, {1, 1, 1}, {1, 1, 1}, 1, 100),
  };
  cells.push_back(cell("b", 256, {1, 1, 1}, {1, 1, 1}, 99, 300));
  cells.back().status = "oom";  // failed cells are not points
  const ItlFit a = fit_itl("a", cells);
  EXPECT_EQ(a.n_points, 3);
  EXPECT_NEAR(a.a_ms, 2, 1e-9);
  EXPECT_NEAR(a.b_ms_per_1k, 0.5, 1e-9);
  EXPECT_NEAR(a.residual_ms, 0, 1e-9);
  EXPECT_EQ(a.ctx_min, 8192);
  EXPECT_EQ(a.ctx_max, 32768);
  const ItlFit b = fit_itl("b", cells);  // short contexts only: all measured cells
  EXPECT_EQ(b.n_points, 2);
  EXPECT_NEAR(b.a_ms, 1, 1e-9);
  EXPECT_NEAR(b.b_ms_per_1k, 0.25, 1e-9);
  EXPECT_EQ(fit_itl("c", cells).n_points, 0);  // one point: no fit
  EXPECT_EQ(fit_itl("missing", cells).n_points, 0);
}

TEST(BenchStats, TokenDigestAndDispatchSummary) {
  EXPECT_EQ(token_digest({}), "cbf29ce484222325");  // FNV-1a 64 offset basis
  EXPECT_EQ(token_digest({1, 2, 3}), token_digest({1, 2, 3}));
  EXPECT_NE(token_digest({1, 2, 3}), token_digest({3, 2, 1}));
  EXPECT_NE(token_digest({1}), token_digest({256}));
  EXPECT_EQ(token_digest({1, 2}).size(), 16u);
  DispatchStats d;
  EXPECT_EQ(dispatch_summary(d), "not counted");
  d.counted = true;
  EXPECT_EQ(dispatch_summary(d), "none");
  d.attention = {{0, "k1", false, 3}, {0, "k1", true, 5}, {1, "k1", true, 5}, {2, "k2", true, 5}};
  EXPECT_EQ(dispatch_summary(d), "k1 (2 layers), k2 (1 layer)");
  EXPECT_EQ(d.total_calls(true), 15u);
  EXPECT_EQ(d.total_calls(false), 3u);
}

TEST(BenchStats, ParseLists) {
  EXPECT_EQ(parse_context_list("4k, 8K,100,4096"), (std::vector<int>{4096, 8192, 100}));
  for (const char* bad : {"", "0", "-4", "abc", "4q", "4kk", "1,,x"})
    EXPECT_THROW(parse_context_list(bad), Error) << bad;
  EXPECT_EQ(parse_codec_list("all").size(), kv::codec_table().size());
  EXPECT_EQ(parse_codec_list("seeds").size(), 25u);
  {  // every: all, then the four +qjl rows
    const std::vector<std::string> every = parse_codec_list("every");
    ASSERT_EQ(every.size(), kv::codec_table().size() + 4);
    EXPECT_EQ(std::vector<std::string>(every.begin(), every.begin() + long(kv::codec_table().size())),
              parse_codec_list("all"));
    EXPECT_EQ(std::vector<std::string>(every.end() - 4, every.end()),
              (std::vector<std::string>{"rotor3_sym+qjl", "rotor4_sym+qjl", "k_rotor3+qjl", "k_rotor4+qjl"}));
    for (const auto& name : every) {
      kv::CodecOptions o;
      o.kv = name;
      EXPECT_EQ(kv::resolve_codec(o).name, name);  // each a valid codec name, canonical
    }
  }
  EXPECT_EQ(parse_codec_list("BF16,k8v4,none,rotor3_sym+qjl"),
            (std::vector<std::string>{"none", "k8v4", "rotor3_sym+qjl"}));
  try {
    parse_codec_list("none,turbo9");
    FAIL() << "unknown codec accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("k8v4"), std::string::npos) << "lists the valid names: " << e.what();
  }
  EXPECT_THROW(parse_codec_list(" , "), Error);
}

TEST(BenchStats, CompareFlagsOnlyBeyondNoise) {
  std::vector<CellResult> a = {cell("none", 64, {100, 95, 105}), cell("none", 128, {100, 95, 105}),
                               cell("k8v4", 64, {100, 99, 101}), cell("k8v4", 128, {50, 50, 50}),
                               cell("tsym3", 64, {100, 99, 101}, {1.0, 0.99, 1.01}),
                               cell("fp8", 64, {100, 99, 101})};
  a.back().status = "unsupported";
  std::vector<CellResult> b = {cell("none", 64, {90, 85, 94}),     // ranges apart, -10 %: regression
                               cell("none", 128, {98, 96, 104}),   // overlapping: same
                               cell("k8v4", 64, {120, 119, 121}),  // faster
                               cell("k8v4", 128, {50.5, 50.5, 50.5}),  // 1 % apart, single reps: below threshold
                               cell("tsym3", 64, {100, 99, 101}, {1.5, 1.4, 1.6}),  // TTFT worse
                               cell("fp8", 64, {100, 99, 101}),    // was unsupported, now measured
                               cell("iso3", 64, {1, 1, 1})};
  CellResult oom = cell("none", 256, {1, 1, 1});
  a.push_back(cell("none", 256, {10, 9, 11}));
  oom.status = "oom";
  b.push_back(oom);
  const Comparison c = compare_cells(a, b, 0.02);
  ASSERT_EQ(c.rows.size(), 8u);
  auto row = [&](const std::string& codec, int ctx) {
    for (const auto& r : c.rows)
      if (r.codec == codec && r.ctx == ctx) return r;
    ADD_FAILURE() << "no row " << codec << " " << ctx;
    return CellDelta{};
  };
  EXPECT_TRUE(row("none", 64).regression);
  EXPECT_EQ(row("none", 64).verdict, "REGRESSION: decode");
  EXPECT_NEAR(row("none", 64).tps_ratio, 0.9, 1e-12);
  EXPECT_FALSE(row("none", 128).regression);
  EXPECT_FALSE(row("none", 128).improvement);
  EXPECT_TRUE(row("k8v4", 64).improvement);
  EXPECT_FALSE(row("k8v4", 128).regression || row("k8v4", 128).improvement);
  EXPECT_TRUE(row("tsym3", 64).regression);
  EXPECT_EQ(row("tsym3", 64).verdict, "REGRESSION: ttft");
  EXPECT_TRUE(row("fp8", 64).improvement);
  EXPECT_TRUE(row("none", 256).regression);
  EXPECT_EQ(row("none", 256).verdict, "REGRESSION: now oom");
  EXPECT_EQ(row("iso3", 64).verdict, "only in B");
  EXPECT_EQ(c.regressions, 3);
  EXPECT_EQ(c.improvements, 2);
  // A looser threshold forgives the 10 % drop.
  EXPECT_FALSE(compare_cells({a[0]}, {b[0]}, 0.2).rows[0].regression);
}

TEST(BenchStats, CsvRowsMatchTheHeader) {
  const auto header = csv_split(csv_header());
  CellResult ok = cell("k8v4", 64, {10, 9, 11});
  ok.kv_bytes = 1024;
  ok.prefill_n = 2;
  ok.digest = "00000000000000aa";
  CellResult bad;
  bad.codec = "ctk=q8,ctv=turbo3";  // a comma inside a field
  bad.ctx = 64;
  bad.status = "failed";
  bad.error = "it said \"no\", twice";
  for (const auto& c : {ok, bad}) {
    const auto f = csv_split(csv_row(7, c));
    ASSERT_EQ(f.size(), header.size());
    EXPECT_EQ(f[0], "7");
    EXPECT_EQ(f[1], c.codec);
    EXPECT_EQ(f.back(), c.error);
  }
  const auto f = csv_split(csv_row(7, bad));
  const auto col = [&](const std::string& name) {
    return size_t(std::find(header.begin(), header.end(), name) - header.begin());
  };
  EXPECT_EQ(f[col("decode_tps")], "");  // not measured: empty, not 0
  EXPECT_EQ(csv_split(csv_row(7, ok))[col("kv_bytes")], "1024");
  ASSERT_LT(col("prefill_n"), header.size());
  EXPECT_EQ(csv_split(csv_row(7, ok))[col("prefill_n")], "2");  // TTFT is from 2 prefills
  EXPECT_EQ(f[col("prefill_n")], "");
}

// The prefill-every-run protocol (kvq bench --prefill-every-run, kvq run
// --repeat): every run prefills; TTFT over the measured runs.
TEST(BenchMeasure, CellOnSyntheticTinyModel) {
  OneThread one;
  auto be = make_backend("cpu");
  auto model = open_model("synthetic:tiny", *be);
  const ModelConfig& cfg = model->config();
  const std::vector<int32_t> prompt = random_prompt(40, cfg.vocab_size, 5);
  EXPECT_EQ(prompt, random_prompt(40, cfg.vocab_size, 5));
  EXPECT_NE(prompt, random_prompt(40, cfg.vocab_size, 6));
  MeasureOptions mo;
  mo.gen = 6;
  mo.reps = 2;
  mo.warmup = 1;
  mo.prefill_chunk = 16;  // chunks 16 + 16 + 8
  mo.prefill_every_run = true;
  mo.copy_bw = 10e9;
  int reps_seen = 0;
  mo.on_rep = [&](int rep, int total) {
    EXPECT_EQ(rep, reps_seen++);
    EXPECT_EQ(total, 3);
  };
  kv::CodecOptions codec;
  codec.kv = "k8v4";
  const CellResult c = measure_cell(*model, CodecRequest{codec}, prompt, mo);
  EXPECT_EQ(reps_seen, 3);
  EXPECT_EQ(c.codec, "k8v4");
  EXPECT_EQ(c.status, "ok") << c.error;
  EXPECT_EQ(c.ctx, 40);
  EXPECT_EQ(c.prefill_n, 2);  // the measured runs' prefills
  EXPECT_TRUE(c.prefill_results.empty());
  ASSERT_EQ(c.rep_results.size(), 2u);
  for (const auto& r : c.rep_results) {
    EXPECT_EQ(r.n_generated, 6);
    EXPECT_GT(r.decode_tps, 0);
    EXPECT_GT(r.ttft_s, 0);
    EXPECT_EQ(r.refeed_s, 0);
    EXPECT_LE(r.itl_p50_ms, r.itl_p99_ms);
    EXPECT_EQ(r.digest, c.digest);
  }
  EXPECT_TRUE(c.digests_agree);
  EXPECT_LE(c.decode_tps.min, c.decode_tps.median);
  EXPECT_LE(c.decode_tps.median, c.decode_tps.max);

  // The digest is the greedy continuation's, computed here independently.
  {
    SessionOptions so;
    so.ctx = 64;
    Session s(*model, be->make_cache(codec, model->cache_shape(64)), nullptr, so);
    GenerateOptions g;
    g.n_predict = 6;
    g.stop_at_eog = false;
    g.sampling.temperature = 0;
    EXPECT_EQ(token_digest(s.generate(prompt, g).tokens), c.digest);
  }

  // KV bytes from the codec table: 45 tokens (40 + 6 - 1) of every layer and KV head.
  const size_t per_head = kv::codec_bytes_per_token_per_head(kv::resolve_codec(codec), cfg.head_dim);
  EXPECT_EQ(c.kv_bytes, uint64_t(45) * cfg.n_layers * cfg.n_kv_heads * per_head);
  EXPECT_EQ(c.kv_capacity_bytes, uint64_t(46) * cfg.n_layers * cfg.n_kv_heads * per_head);
  EXPECT_NEAR(c.bits_per_value, (8.5 + 4.125) / 2, 1e-9);
  EXPECT_DOUBLE_EQ(c.kv_seq, 43);
  EXPECT_EQ(c.device_mem_delta, -1);  // the CPU has no device memory to read
  EXPECT_EQ(c.weight_bytes, model->step_weight_bytes());
  EXPECT_GT(c.step_bytes, double(c.weight_bytes));
  EXPECT_NEAR(c.pct_copy_bw, 100.0 * c.achieved_gbs * 1e9 / 10e9, 1e-9);

  // Dispatch proof: per layer, 2 reps x 5 decode steps single-token calls and
  // 2 x 3 prefill chunks, on the CPU's packed kernel, no KV copies.
  ASSERT_TRUE(c.dispatch.counted);
  for (int l = 0; l < cfg.n_layers; ++l) {
    uint64_t dec = 0, pre = 0;
    for (const auto& k : c.dispatch.attention)
      if (k.layer == l) {
        EXPECT_EQ(k.kernel, "cpu-packed");
        (k.decode ? dec : pre) += k.calls;
      }
    EXPECT_EQ(dec, 10u) << "layer " << l;
    EXPECT_EQ(pre, 6u) << "layer " << l;
  }
  EXPECT_EQ(c.dispatch.kv_host_to_device_bytes + c.dispatch.kv_device_to_host_bytes, 0u);
}

// A straightforward prefill of `prompt` into a fresh cache and `gen` greedy
// tokens: what the prefill-every-run protocol measures.
std::vector<int32_t> plain_greedy(Model& model, Backend& be, const kv::CodecOptions& codec,
                                  const std::vector<int32_t>& prompt, int gen, int chunk) {
  SessionOptions so;
  so.ctx = int(prompt.size()) + gen;
  so.prefill_chunk = chunk;
  Session s(model, be.make_cache(codec, model.cache_shape(so.ctx)), nullptr, so);
  GenerateOptions g;
  g.n_predict = gen;
  g.stop_at_eog = false;
  g.sampling.temperature = 0;
  return s.generate(prompt, g).tokens;
}

// The default protocol: the cell prefills N times, then every decode run
// starts from the cached prompt by re-feeding its last token at L-1.
TEST(BenchMeasure, PrefillOnceDecodesFromTheCachedPrompt) {
  OneThread one;
  auto be = make_backend("cpu");
  auto model = open_model("synthetic:tiny", *be);
  const ModelConfig& cfg = model->config();
  const std::vector<int32_t> prompt = random_prompt(40, cfg.vocab_size, 5);
  for (const char* name : {"none", "k8v4", "tsym3"})
    for (int n : {1, 2}) {
      SCOPED_TRACE(std::string(name) + " prefill_reps " + std::to_string(n));
      kv::CodecOptions codec;
      codec.kv = name;
      MeasureOptions mo;
      mo.gen = 6;
      mo.reps = 3;
      mo.warmup = 1;
      mo.prefill_reps = n;
      mo.prefill_chunk = 16;
      std::vector<std::string> events;
      mo.on_prefill_rep = [&](int j, int total) {
        EXPECT_EQ(total, n);
        events.push_back("p" + std::to_string(j));
      };
      mo.on_rep = [&](int rep, int total) {
        EXPECT_EQ(total, 4);
        events.push_back("d" + std::to_string(rep));
      };
      const CellResult c = measure_cell(*model, CodecRequest{codec}, prompt, mo);
      EXPECT_EQ(c.status, "ok") << c.error;
      std::vector<std::string> want;
      for (int j = 0; j < n; ++j) want.push_back("p" + std::to_string(j));
      for (int i = 0; i < 4; ++i) want.push_back("d" + std::to_string(i));
      EXPECT_EQ(events, want);  // all prefills first, then warm-up + reps decode runs

      EXPECT_EQ(c.prefill_n, n);
      ASSERT_EQ(c.prefill_results.size(), size_t(n));
      std::vector<double> ttft;
      for (const auto& p : c.prefill_results) {
        EXPECT_GT(p.prefill_s, 0);
        EXPECT_GE(p.ttft_s, p.prefill_s);
        EXPECT_NEAR(p.prefill_tps, 40 / p.prefill_s, 1e-6 * p.prefill_tps);
        ttft.push_back(p.ttft_s);
      }
      EXPECT_DOUBLE_EQ(c.ttft_s.median, spread(ttft).median);
      EXPECT_DOUBLE_EQ(c.ttft_s.min, *std::min_element(ttft.begin(), ttft.end()));
      EXPECT_DOUBLE_EQ(c.ttft_s.max, *std::max_element(ttft.begin(), ttft.end()));
      if (n == 1) {
        EXPECT_DOUBLE_EQ(c.ttft_s.min, c.ttft_s.median);
        EXPECT_DOUBLE_EQ(c.ttft_s.max, c.ttft_s.median);
      }

      ASSERT_EQ(c.rep_results.size(), 3u);
      for (const auto& r : c.rep_results) {
        EXPECT_EQ(r.n_generated, 6);
        EXPECT_GT(r.decode_tps, 0);
        EXPECT_EQ(r.ttft_s, 0);  // no prefill inside a decode run
        EXPECT_GT(r.refeed_s, 0);
        EXPECT_EQ(r.digest, c.digest);
      }
      EXPECT_TRUE(c.digests_agree);

      // The decode runs produce exactly what a full prefill + greedy decode does.
      const std::vector<int32_t> ref = plain_greedy(*model, *be, codec, prompt, 6, 16);
      EXPECT_EQ(token_digest(ref), c.digest);
      for (const auto& p : c.prefill_results) EXPECT_EQ(p.first_token, ref[0]);

      // Dispatch over the measured runs: per run the re-fed token and 5 decode
      // steps are single-token calls; no prefill chunk ran in them.
      ASSERT_TRUE(c.dispatch.counted);
      EXPECT_EQ(c.dispatch.total_calls(true), uint64_t(3 * 6 * cfg.n_layers));
      EXPECT_EQ(c.dispatch.total_calls(false), 0u);
      // Rows 0..L+G-2 are filled, as in the other protocol.
      const size_t per_head = kv::codec_bytes_per_token_per_head(kv::resolve_codec(codec), cfg.head_dim);
      EXPECT_EQ(c.kv_bytes, uint64_t(45) * cfg.n_layers * cfg.n_kv_heads * per_head);
    }
}

TEST(BenchMeasure, PrefillOnceWithAOneTokenPrompt) {
  OneThread one;
  auto be = make_backend("cpu");
  auto model = open_model("synthetic:tiny", *be);
  MeasureOptions mo;
  mo.gen = 4;
  mo.reps = 2;
  const std::vector<int32_t> prompt = {7};
  const CellResult c = measure_cell(*model, {}, prompt, mo);
  EXPECT_EQ(c.status, "ok") << c.error;
  EXPECT_EQ(c.prefill_n, 1);
  EXPECT_EQ(token_digest(plain_greedy(*model, *be, {}, prompt, 4, 512)), c.digest);
}

TEST(BenchMeasure, OneTokenPrefillChunkCountsAsSingleTokenCall) {
  OneThread one;
  auto be = make_backend("cpu");
  auto model = open_model("synthetic:tiny", *be);
  MeasureOptions mo;
  mo.gen = 3;
  mo.reps = 1;
  mo.warmup = 0;
  mo.prefill_every_run = true;
  mo.prefill_chunk = 16;  // 33 tokens: 16 + 16 + 1
  const CellResult c = measure_cell(*model, {}, random_prompt(33, model->config().vocab_size, 1), mo);
  EXPECT_EQ(c.status, "ok") << c.error;  // 2 decode steps + the 1-token chunk = 3 single-token calls expected
  EXPECT_EQ(c.dispatch.total_calls(true), uint64_t(3 * model->config().n_layers));
}

TEST(BenchMeasure, RejectsBadOptions) {
  OneThread one;
  auto be = make_backend("cpu");
  auto model = open_model("synthetic:tiny", *be);
  MeasureOptions mo;
  mo.gen = 1;
  EXPECT_THROW(measure_cell(*model, {}, {1, 2, 3}, mo), Error);
  mo.gen = 4;
  mo.reps = 0;
  EXPECT_THROW(measure_cell(*model, {}, {1, 2, 3}, mo), Error);
  mo.reps = 1;
  for (int bad : {0, -1}) {
    mo.prefill_reps = bad;
    try {
      measure_cell(*model, {}, {1, 2, 3}, mo);
      ADD_FAILURE() << "prefill_reps " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("--prefill-reps must be at least 1"), std::string::npos) << e.what();
    }
  }
  mo.prefill_reps = 1;
  EXPECT_THROW(measure_cell(*model, {}, {}, mo), Error);
  kv::CodecOptions unknown;
  unknown.kv = "nope";
  EXPECT_THROW(measure_cell(*model, CodecRequest{unknown}, {1, 2, 3}, mo), Error);
  EXPECT_THROW(open_model("synthetic:nope", *be), Error);
}
