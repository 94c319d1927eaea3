// src/eval: the metrics on hand-computable inputs, window planning, codec
// lists and floors, teacher-forced evaluation against an independent
// recomputation, unsupported codecs, and the needle cases.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/f32_cache.hpp"
#include "backend_test_util.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "eval/codecs.hpp"
#include "eval/metrics.hpp"
#include "eval/needle.hpp"
#include "eval/text_eval.hpp"
#include "forward_test_util.hpp"
#include "gguf/gguf.hpp"
#include "kv/cache.hpp"
#include "model/forward.hpp"
#include "tokenizer/tokenizer.hpp"

using namespace kvq;
using namespace kvq::eval;

TEST(EvalMetrics, KlOfIdenticalDistributionsIsZero) {
  Rng rng(3);
  std::vector<float> x(1000);
  for (auto& v : x) v = float(8 * rng.normal());
  EXPECT_EQ(kl_divergence(x.data(), x.data(), int(x.size())), 0.0);
  // softmax is shift invariant, so KL of shifted logits is (numerically) zero too
  std::vector<float> y = x;
  for (auto& v : y) v += 3.0f;
  EXPECT_NEAR(kl_divergence(x.data(), y.data(), int(x.size())), 0.0, 1e-12);
}

TEST(EvalMetrics, KlHandComputed) {
  // p = (1/2, 1/2), q = (1/4, 3/4): KL(p||q) = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3)
  const float p[2] = {0.0f, 0.0f};
  const float q[2] = {std::log(0.25f), std::log(0.75f)};
  EXPECT_NEAR(kl_divergence(p, q, 2), 0.5 * std::log(4.0 / 3.0), 1e-7);
  // and it is not symmetric: KL(q||p) = 1/4 ln(1/2) + 3/4 ln(3/2)
  EXPECT_NEAR(kl_divergence(q, p, 2), 0.25 * std::log(0.5) + 0.75 * std::log(1.5), 1e-7);
  // a zero-probability entry of p contributes nothing
  const float p0[3] = {0.0f, 0.0f, -std::numeric_limits<float>::infinity()};
  const float q0[3] = {0.0f, 0.0f, 0.0f};
  EXPECT_NEAR(kl_divergence(p0, q0, 3), std::log(1.5), 1e-7);  // sum 1/2 ln(1/2 / 1/3)
  // the form with the reference's normaliser given is the same arithmetic
  EXPECT_EQ(kl_divergence(q, log_sum_exp(q, 2), p, 2), kl_divergence(q, p, 2));
  EXPECT_NEAR(log_sum_exp(q, 2), 0.0, 1e-7);
  std::vector<double> lp;
  log_softmax(q, 2, lp);
  EXPECT_NEAR(lp[1], std::log(0.75), 1e-7);
}

TEST(EvalMetrics, NllPerplexityPercentileArgmax) {
  const std::vector<float> uniform(8, 1.5f);
  EXPECT_NEAR(neg_log_likelihood(uniform.data(), 8, 3), std::log(8.0), 1e-12);
  QualitySummary s;
  s.add_nll(std::log(2.0));
  s.add_nll(std::log(8.0));
  EXPECT_NEAR(s.mean_nll(), std::log(4.0), 1e-12);
  EXPECT_NEAR(s.perplexity(), 4.0, 1e-12);  // geometric mean of 2 and 8
  EXPECT_THROW(neg_log_likelihood(uniform.data(), 8, 8), Error);

  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);
  EXPECT_EQ(percentile(v, 99), 99.0);
  EXPECT_EQ(percentile(v, 100), 100.0);
  EXPECT_EQ(percentile(v, 50), 50.0);
  EXPECT_EQ(percentile({7.0}, 99), 7.0);
  EXPECT_EQ(percentile({}, 99), 0.0);

  QualitySummary k;
  k.add_kl(0.1, true);
  k.add_kl(0.3, false);
  k.add_kl(0.2, true);
  k.add_kl(0.0, true);
  EXPECT_NEAR(k.mean_kl(), 0.15, 1e-15);
  EXPECT_EQ(k.max_kl(), 0.3);
  EXPECT_EQ(k.p99_kl(), 0.3);
  EXPECT_EQ(k.top1_pct(), 75.0);

  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float a[5] = {nan, 1.0f, 3.0f, 3.0f, nan};
  EXPECT_EQ(argmax(a, 5), 2);  // NaN never wins, lowest index on ties
}

// Every target 1..n-1 is scored exactly once, whatever the stride.
TEST(EvalWindows, EveryTargetScoredOnce) {
  for (int n : {2, 10, 37, 100})
    for (int ctx : {2, 4, 16, 64, 200})
      for (int stride : {0, 1, 3, 8, 16}) {
        const int len = std::min(ctx, n);
        if (stride > len) {
          EXPECT_THROW(plan_windows(n, ctx, stride, 0), Error);
          continue;
        }
        const auto w = plan_windows(n, ctx, stride, 0);
        std::vector<int> hits(size_t(n), 0);
        for (const auto& x : w) {
          EXPECT_EQ(x.len, len);
          EXPECT_GE(x.first_target, 1);
          for (int j = x.first_target; j < x.len; ++j) ++hits[size_t(x.start + j)];
        }
        EXPECT_EQ(hits[0], 0);
        const int last = w.back().start + len;  // tokens past the last full window are not reached
        for (int t = 1; t < n; ++t) {
          if (stride == 0 || stride == len) {  // disjoint: a window's first token has no prediction
            EXPECT_LE(hits[size_t(t)], 1);
          } else if (t < last) {
            EXPECT_EQ(hits[size_t(t)], 1) << "n " << n << " ctx " << ctx << " stride " << stride << " t " << t;
          }
        }
      }
  EXPECT_EQ(plan_windows(100, 16, 8, 3).size(), 3u);
  EXPECT_THROW(plan_windows(1, 16, 0, 0), Error);
}

TEST(EvalCodecs, ListsAliasesPairsAndErrors) {
  const auto c = parse_eval_codecs("none, K8V4,turbo3/BF16,rotor3_sym+qjl,f32,f16,q8/turbo2");
  std::vector<std::string> labels;
  for (const auto& x : c) labels.push_back(x.label());
  // f16 is an alias of none (dropped as a duplicate); q8/turbo2 is the named codec k8vturbo2's pair
  EXPECT_EQ(labels, (std::vector<std::string>{"none", "k8v4", "turbo3/bf16", "rotor3_sym+qjl", "f32", "q8/turbo2"}));
  EXPECT_TRUE(c[4].f32);
  EXPECT_TRUE(c[3].codec.rotor_qjl);
  EXPECT_EQ(resolve(c[2])->k.name(), "turbo3");
  EXPECT_EQ(resolve(c[2])->v.name(), "bf16");
  EXPECT_FALSE(resolve(c[4]).has_value());
  EXPECT_EQ(all_eval_codecs().size(), kv::codec_table().size() + 4);  // + the rotor +qjl forms
  EXPECT_EQ(parse_eval_codecs("all,none").size(), all_eval_codecs().size());
  try {
    parse_eval_codec("turbo5");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("k8vturbo2tcq"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_eval_codec("k8v4+qjl"), Error);       // no rotor K side
  EXPECT_THROW(parse_eval_codec("bf16/turbo3+qjl"), Error);  // +qjl on V
  EXPECT_EQ(parse_eval_codec("turbo3+qjl/turbo3").label(), "turbo3+qjl/turbo3");
  EXPECT_THROW(parse_eval_codecs(""), Error);
}

TEST(EvalCodecs, SpecClassesAndFloors) {
  auto cls = [](const char* n) {
    const auto f = quality_floor(parse_eval_codec(n));
    return f ? f->name : std::string("-");
  };
  EXPECT_EQ(cls("none"), "-");
  EXPECT_EQ(cls("f32"), "-");
  EXPECT_EQ(cls("k8v8"), "8-bit");
  EXPECT_EQ(cls("fp8"), "8-bit");
  EXPECT_EQ(cls("k8v4"), "4-bit");
  EXPECT_EQ(cls("planar_k"), "4-bit");
  EXPECT_EQ(cls("tsym3"), "3-bit");
  EXPECT_EQ(cls("k_rotor3+qjl"), "3-bit");
  EXPECT_EQ(cls("turbo3/bf16"), "3-bit");
  EXPECT_EQ(cls("k8vturbo2tcq"), "2-bit");
  const QualityFloor f = *quality_floor(parse_eval_codec("tsym3"));
  EXPECT_EQ(f.max_mean_kl, 0.06);
  EXPECT_EQ(f.min_top1_pct, 90.0);
  EXPECT_EQ(floor_verdict(f, 0.06, 90.0), "yes");
  EXPECT_EQ(floor_verdict(f, 0.07, 90.0), "no (KL)");
  EXPECT_EQ(floor_verdict(f, 0.01, 89.9), "no (top-1)");
  EXPECT_EQ(floor_verdict(f, 0.07, 80.0), "no (KL, top-1)");
}

namespace {

struct TinyEval {
  std::unique_ptr<Backend> backend = cpu::make_cpu_backend();
  std::unique_ptr<testutil::TinyModel> tiny = testutil::make_tiny(Arch::qwen3, gguf::TensorType::F32, 5);
  std::unique_ptr<Model> model =
      std::make_unique<Model>(tiny->cfg, load_weights(tiny->cfg, tiny->t.lookup()), *backend);
  std::vector<int32_t> tokens;
  explicit TinyEval(int n) {
    Rng rng(9);
    for (int i = 0; i < n; ++i) tokens.push_back(int32_t(rng.below(uint64_t(tiny->cfg.vocab_size))));
  }
  // Logits of every position of tokens[start, start+len) through a fresh cache.
  std::vector<float> logits(const EvalCodec& c, int start, int len) {
    auto cache = make_session_cache(*model, c, len);
    const int V = model->config().vocab_size;
    std::vector<float> out(size_t(len) * V);
    model->forward(tokens.data() + start, len, 0, *cache, out.data(), true);
    return out;
  }
};

}  // namespace

// The teacher-forced numbers equal a direct recomputation: plain forward
// passes over each window, KL and NLL summed by hand.
TEST(EvalText, MatchesDirectRecomputation) {
  TinyEval t(40);
  const int V = t.model->config().vocab_size;
  const auto codecs = parse_eval_codecs("none,k8v8,tsym3,f32");
  TextEvalOptions o;
  o.ctx = 16;
  o.stride = 8;
  o.prefill_chunk = 16;  // one forward per window, as the recomputation below
  o.ref = parse_eval_codec("f32");
  const auto rep = evaluate_text(*t.model, t.tokens, codecs, o);
  ASSERT_EQ(rep.windows.size(), 4u);  // starts 0, 8, 16, 24
  ASSERT_EQ(rep.rows.size(), 4u);
  for (size_t ci = 0; ci < codecs.size(); ++ci) {
    double kl = 0, nll = 0;
    int agree = 0, n = 0;
    for (const auto& w : rep.windows) {
      const auto ref = t.logits(*o.ref, w.start, w.len);
      const auto got = t.logits(codecs[ci], w.start, w.len);
      for (int j = w.first_target; j < w.len; ++j, ++n) {
        const float* r = &ref[size_t(j - 1) * V];
        const float* g = &got[size_t(j - 1) * V];
        kl += kl_divergence(r, g, V);
        nll += neg_log_likelihood(g, V, t.tokens[size_t(w.start + j)]);
        agree += argmax(r, V) == argmax(g, V);
      }
    }
    const CodecQuality& q = rep.rows[ci];
    SCOPED_TRACE(q.codec.label());
    ASSERT_TRUE(q.error.empty());
    EXPECT_EQ(q.positions, 15 + 3 * 8);
    EXPECT_EQ(q.positions, n);
    EXPECT_NEAR(q.mean_kl, kl / n, 1e-9 * (kl / n) + 1e-15);
    EXPECT_NEAR(q.mean_nll, nll / n, 1e-12);
    EXPECT_NEAR(q.ppl, std::exp(nll / n), 1e-12 * q.ppl);
    EXPECT_NEAR(q.top1_pct, 100.0 * agree / n, 1e-9);
  }
  EXPECT_EQ(rep.rows[3].mean_kl, 0.0);  // f32 against itself
  EXPECT_EQ(rep.rows[3].top1_pct, 100.0);
  EXPECT_EQ(rep.ref->ppl, rep.rows[3].ppl);
  EXPECT_GT(rep.rows[2].mean_kl, rep.rows[1].mean_kl);  // 3-bit loses more than 8-bit
  EXPECT_GT(rep.rows[1].mean_kl, 0.0);
  EXPECT_EQ(rep.rows[1].k_bits, 8.5);
}

namespace {

// A backend that has kernels for codec `none` only: everything else is
// Errc::unsupported, and f32 (the CPU backend's reference cache) too.
class NoneOnlyBackend final : public testutil::ForwardingBackend {
 public:
  const char* name() const override { return "none-only"; }
  std::unique_ptr<kv::Cache> make_cache(const kv::CodecOptions& o, const kv::CacheShape& s) override {
    if (kv::resolve_codec(o).name != "none") fail(Errc::unsupported, "no kernels for codec ", kv::resolve_codec(o).name);
    return ForwardingBackend::make_cache(o, s);
  }
};

}  // namespace

TEST(EvalText, UnsupportedCodecsAreReportedAndSkipped) {
  NoneOnlyBackend b;
  auto tiny = testutil::make_tiny(Arch::qwen3, gguf::TensorType::F32, 5);
  Model m(tiny->cfg, load_weights(tiny->cfg, tiny->t.lookup()), b);
  std::vector<int32_t> tokens(20);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t((i * 7) % 96);
  TextEvalOptions o;
  o.ctx = 10;
  o.ref = parse_eval_codec("none");
  const auto rep = evaluate_text(m, tokens, parse_eval_codecs("k8v4,none,f32"), o);
  ASSERT_EQ(rep.rows.size(), 3u);
  EXPECT_TRUE(rep.rows[0].unsupported);
  EXPECT_NE(rep.rows[0].error.find("no kernels for codec k8v4"), std::string::npos) << rep.rows[0].error;
  EXPECT_TRUE(rep.rows[2].unsupported);  // f32 is the CPU backend's reference cache
  EXPECT_NE(rep.rows[2].error.find("f32"), std::string::npos);
  EXPECT_TRUE(rep.rows[1].error.empty());
  EXPECT_EQ(rep.rows[1].positions, 18);
  EXPECT_EQ(rep.rows[1].mean_kl, 0.0);
  // A reference the backend cannot run is an error, not a skipped row.
  o.ref = parse_eval_codec("k8v4");
  EXPECT_THROW(evaluate_text(m, tokens, parse_eval_codecs("none"), o), Error);
}

namespace {
const std::string kModel = std::string(KVQ_SOURCE_DIR) + "/models/kvq-tiny-code.gguf";
bool have_model() {
  if (FILE* f = std::fopen(kModel.c_str(), "rb")) {
    std::fclose(f);
    return true;
  }
  return false;
}
}  // namespace

TEST(EvalNeedle, CasesPlantTheValueAtTheDepth) {
  if (!have_model()) GTEST_SKIP() << "no " << kModel;
  const auto file = gguf::File::open(kModel);
  const Tokenizer tok = Tokenizer::from_gguf(file);
  NeedleOptions o;
  o.ctx = 300;
  o.depths = {0.0, 0.5, 1.0};
  o.trials = 2;
  const auto cases = build_needle_cases(tok, o);
  ASSERT_EQ(cases.size(), 6u);
  std::set<std::string> values;
  int prev_at = -1;
  for (const auto& c : cases) {
    EXPECT_EQ(int(c.prompt.size() + c.answer.size()), o.ctx);
    EXPECT_EQ(c.value.size(), 5u);
    values.insert(c.value);
    EXPECT_EQ(tok.decode(c.answer), c.value);
    const std::string text = tok.decode(c.prompt);
    // planted once, at needle_at, and the prompt ends with the query
    const std::string needle = "secret_value = " + c.value;
    EXPECT_EQ(text.find(needle), text.rfind(needle));
    const std::string head = tok.decode(std::vector<int32_t>(c.prompt.begin(), c.prompt.begin() + c.needle_at));
    EXPECT_EQ(text.find(needle), head.size() + 1) << "needle at token " << c.needle_at;  // after its newline
    EXPECT_EQ(text.substr(text.size() - 16), "\nsecret_value = ");
    if (c.trial == 0) {
      EXPECT_GT(c.needle_at, prev_at);  // deeper needles sit later
      prev_at = c.needle_at;
    }
    const double frac = double(c.needle_at) / double(o.ctx);
    EXPECT_NEAR(frac, c.depth * (1.0 - 20.0 / o.ctx), 0.12) << c.depth;
  }
  EXPECT_EQ(values.size(), 6u);
  EXPECT_EQ(cases[0].needle_at, 0);
}

// The trained model retrieves the needle with the exact cache and the 8-bit
// codec, and a needle it cannot see (a haystack cut off before it) is not found.
TEST(EvalNeedle, TrainedModelRetrieves) {
  if (!have_model()) GTEST_SKIP() << "no " << kModel;
  auto b = cpu::make_cpu_backend();
  auto m = Model::open(kModel, *b);
  const Tokenizer tok = Tokenizer::from_gguf(*m->file());
  NeedleOptions o;
  o.ctx = 256;
  o.depths = {0.2, 0.8};
  o.trials = 2;
  const auto rep = run_needle(*m, tok, parse_eval_codecs("f32,k8v8"), o);
  ASSERT_EQ(rep.rows.size(), 2u);
  for (const auto& r : rep.rows) {
    EXPECT_EQ(r.cases, 4);
    EXPECT_EQ(r.found, 4) << r.codec.label();
    EXPECT_EQ(r.found_at, (std::vector<int>{2, 2}));
    EXPECT_GT(r.mean_logprob(), -2.0);
  }
}
