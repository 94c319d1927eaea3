// The whole forward pass on tiny in-memory models: against a naive
// double-precision implementation written here from the architecture
// definitions, and against itself (batched prefill == token-by-token decode,
// chunked == unchunked).
#include <gtest/gtest.h>

#include <cmath>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/f32_cache.hpp"
#include "core/error.hpp"
#include "forward_test_util.hpp"
#include "model/forward.hpp"

using namespace kvq;
using gguf::TensorType;
namespace tn = kvq::tensor_names;

namespace {

using Vec = std::vector<double>;

// Naive reference: every weight dequantized to double, plain loops, full
// recomputation over the whole sequence. Returns logits [T][vocab].
std::vector<Vec> naive_forward(const testutil::TinyModel& m, const std::vector<int32_t>& ids) {
  const ModelConfig& c = m.cfg;
  const int T = int(ids.size()), d = c.d_model, hd = c.head_dim, nh = c.n_heads, nkv = c.n_kv_heads,
            ff = c.d_ff, V = c.vocab_size;
  auto W = [&](const std::string& name) {
    auto f = m.t.dequantized(name);
    return Vec(f.begin(), f.end());
  };
  auto matvec = [](const Vec& w, const Vec& x, int rows, int cols) {
    Vec y(rows, 0.0);
    for (int r = 0; r < rows; ++r)
      for (int k = 0; k < cols; ++k) y[r] += w[size_t(r) * cols + k] * x[k];
    return y;
  };
  auto rmsnorm = [&](const double* x, const Vec& w, int n, double* out) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += x[i] * x[i];
    const double inv = 1.0 / std::sqrt(ss / n + c.norm_eps);
    for (int i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
  };
  auto rope = [&](double* v, int pos) {
    for (int i = 0; i < hd / 2; ++i) {
      const double a = pos * std::pow(c.rope.theta, -2.0 * i / hd);
      const int i0 = c.rope.neox ? i : 2 * i, i1 = c.rope.neox ? i + hd / 2 : 2 * i + 1;
      const double x0 = v[i0], x1 = v[i1];
      v[i0] = x0 * std::cos(a) - x1 * std::sin(a);
      v[i1] = x0 * std::sin(a) + x1 * std::cos(a);
    }
  };
  const Vec emb = W(tn::token_embd);
  std::vector<Vec> x(T, Vec(d));
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < d; ++i) x[t][i] = emb[size_t(ids[t]) * d + i];
  for (int l = 0; l < c.n_layers; ++l) {
    const Vec wq = W(tn::blk(l, tn::attn_q)), wk = W(tn::blk(l, tn::attn_k)), wv = W(tn::blk(l, tn::attn_v)),
              wo = W(tn::blk(l, tn::attn_output)), an = W(tn::blk(l, tn::attn_norm)),
              fn = W(tn::blk(l, tn::ffn_norm)), wg = W(tn::blk(l, tn::ffn_gate)), wu = W(tn::blk(l, tn::ffn_up)),
              wd = W(tn::blk(l, tn::ffn_down));
    Vec qn, kn;
    if (c.qk_norm) qn = W(tn::blk(l, tn::attn_q_norm)), kn = W(tn::blk(l, tn::attn_k_norm));
    std::vector<Vec> Q(T), K(T), Vv(T);
    for (int t = 0; t < T; ++t) {
      Vec h(d);
      rmsnorm(x[t].data(), an, d, h.data());
      Q[t] = matvec(wq, h, nh * hd, d);
      K[t] = matvec(wk, h, nkv * hd, d);
      Vv[t] = matvec(wv, h, nkv * hd, d);
      for (int hh = 0; hh < nh; ++hh) {
        if (c.qk_norm) rmsnorm(&Q[t][hh * hd], qn, hd, &Q[t][hh * hd]);
        rope(&Q[t][hh * hd], t);
      }
      for (int hh = 0; hh < nkv; ++hh) {
        if (c.qk_norm) rmsnorm(&K[t][hh * hd], kn, hd, &K[t][hh * hd]);
        rope(&K[t][hh * hd], t);
      }
    }
    for (int t = 0; t < T; ++t) {
      Vec att(nh * hd, 0.0);
      for (int hh = 0; hh < nh; ++hh) {
        const int g = hh / (nh / nkv);
        Vec s(t + 1);
        double mx = -1e300, z = 0;
        for (int j = 0; j <= t; ++j) {
          double dot = 0;
          for (int i = 0; i < hd; ++i) dot += Q[t][hh * hd + i] * K[j][g * hd + i];
          s[j] = dot / std::sqrt(double(hd));
          mx = std::max(mx, s[j]);
        }
        for (double& v : s) z += (v = std::exp(v - mx));
        for (int j = 0; j <= t; ++j)
          for (int i = 0; i < hd; ++i) att[hh * hd + i] += s[j] / z * Vv[j][g * hd + i];
      }
      const Vec o = matvec(wo, att, d, nh * hd);
      for (int i = 0; i < d; ++i) x[t][i] += o[i];
      Vec h(d);
      rmsnorm(x[t].data(), fn, d, h.data());
      const Vec gg = matvec(wg, h, ff, d), uu = matvec(wu, h, ff, d);
      Vec a(ff);
      for (int i = 0; i < ff; ++i) a[i] = gg[i] / (1 + std::exp(-gg[i])) * uu[i];
      const Vec dd = matvec(wd, a, d, ff);
      for (int i = 0; i < d; ++i) x[t][i] += dd[i];
    }
  }
  const Vec on = W(tn::output_norm);
  const Vec out = m.t.info.count(tn::output) ? W(tn::output) : emb;
  std::vector<Vec> logits(T);
  for (int t = 0; t < T; ++t) {
    Vec h(d);
    rmsnorm(x[t].data(), on, d, h.data());
    logits[t] = matvec(out, h, V, d);
  }
  return logits;
}

std::vector<int32_t> some_ids(int n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> ids(n);
  for (int32_t& id : ids) id = int32_t(rng.below(vocab));
  return ids;
}

struct Fixture {
  std::unique_ptr<testutil::TinyModel> tiny;
  std::unique_ptr<Backend> backend = cpu::make_cpu_backend();
  std::unique_ptr<Model> model;
  Fixture(Arch arch, TensorType t, bool tied = false, std::optional<TensorType> embd = std::nullopt)
      : tiny(testutil::make_tiny(arch, t, 11, tied, embd)) {
    model = std::make_unique<Model>(tiny->cfg, load_weights(tiny->cfg, tiny->t.lookup()), *backend);
  }
  // Logits of every position, feeding the ids in chunks of `chunk`.
  std::vector<float> run(const std::vector<int32_t>& ids, int chunk) {
    auto cache = cpu::make_f32_cache(model->cache_shape(128));
    const int V = tiny->cfg.vocab_size;
    std::vector<float> logits(ids.size() * V);
    for (size_t p = 0; p < ids.size(); p += chunk) {
      const int n = int(std::min<size_t>(chunk, ids.size() - p));
      model->forward(ids.data() + p, n, int(p), *cache, logits.data() + p * V, true);
    }
    return logits;
  }
};

const char* type_name(TensorType t) {
  switch (t) {
    case TensorType::F32: return "F32";
    case TensorType::F16: return "F16";
    case TensorType::BF16: return "BF16";
    case TensorType::Q8_0: return "Q8_0";
    case TensorType::Q4_0: return "Q4_0";
    default: return gguf::tensor_type_name(t);
  }
}

}  // namespace

class ForwardVsNaive : public ::testing::TestWithParam<std::tuple<Arch, TensorType, bool>> {};

// Bound: |kvq - naive| <= 1e-4 * max|naive| + 1e-5 per logit (kvq computes in
// fp32 over identical dequantized weights; the reference in double).
TEST_P(ForwardVsNaive, LogitsOfEveryPositionMatch) {
  auto [arch, type, tied] = GetParam();
  Fixture f(arch, type, tied);
  const auto ids = some_ids(13, f.tiny->cfg.vocab_size, 5);
  const auto got = f.run(ids, 8);  // chunks 8 + 5: tiled matmul and fused path both used
  const auto ref = naive_forward(*f.tiny, ids);
  const int V = f.tiny->cfg.vocab_size;
  double ref_max = 0;
  for (const auto& row : ref)
    for (double v : row) ref_max = std::max(ref_max, std::fabs(v));
  ASSERT_GT(ref_max, 0.1) << "degenerate logits make the comparison meaningless";
  const double bound = 1e-4 * ref_max + 1e-5;
  for (size_t t = 0; t < ids.size(); ++t)
    for (int i = 0; i < V; ++i)
      ASSERT_NEAR(got[t * V + i], ref[t][i], bound) << "position " << t << " token " << i;
}

INSTANTIATE_TEST_SUITE_P(
    AllArchsAndTypes, ForwardVsNaive,
    ::testing::Combine(::testing::Values(Arch::qwen3, Arch::llama),
                       ::testing::Values(TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q8_0,
                                         TensorType::Q4_0, TensorType::Q1_0, TensorType::Q2_K, TensorType::Q3_K,
                                         TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K),
                       ::testing::Bool()),
    [](const auto& info) {
      return std::string(std::get<0>(info.param) == Arch::qwen3 ? "qwen3_" : "llama_") +
             type_name(std::get<1>(info.param)) + (std::get<2>(info.param) ? "_tied" : "");
    });

// llama-quantize's Q4_0 (and Q1_0) outputs store token_embd as Q6_K; Q4_K_M
// files mix Q4_K and Q6_K. Tied, so the Q6_K table is also the LM head.
TEST(ForwardVsNaiveMixed, QuantizeToolMixesOfTypes) {
  for (auto [matrices, embd] : {std::pair{TensorType::Q4_0, TensorType::Q6_K}, {TensorType::Q1_0, TensorType::Q6_K},
                                {TensorType::Q4_K, TensorType::Q6_K}}) {
    Fixture f(Arch::qwen3, matrices, /*tied=*/true, embd);
    ASSERT_EQ(f.tiny->t.info.at(tensor_names::token_embd).type, embd);
    const auto ids = some_ids(9, f.tiny->cfg.vocab_size, 3);
    const auto got = f.run(ids, 5);
    const auto ref = naive_forward(*f.tiny, ids);
    const int V = f.tiny->cfg.vocab_size;
    double ref_max = 0;
    for (const auto& row : ref)
      for (double v : row) ref_max = std::max(ref_max, std::fabs(v));
    ASSERT_GT(ref_max, 0.1);
    for (size_t t = 0; t < ids.size(); ++t)
      for (int i = 0; i < V; ++i)
        ASSERT_NEAR(got[t * V + i], ref[t][i], 1e-4 * ref_max + 1e-5)
            << gguf::tensor_type_name(matrices) << " + " << gguf::tensor_type_name(embd) << " position " << t;
  }
}

TEST(ForwardConsistency, BatchedPrefillEqualsTokenByTokenDecode) {
  for (Arch arch : {Arch::qwen3, Arch::llama}) {
    Fixture f(arch, TensorType::Q8_0);
    const auto ids = some_ids(40, f.tiny->cfg.vocab_size, 9);
    const auto batched = f.run(ids, 40);
    const auto stepped = f.run(ids, 1);
    double m = 0;
    for (float v : batched) m = std::max(m, double(std::fabs(v)));
    for (size_t i = 0; i < batched.size(); ++i) ASSERT_NEAR(batched[i], stepped[i], 2e-5 * m) << i;
  }
}

TEST(ForwardConsistency, ChunkedPrefillEqualsUnchunked) {
  Fixture f(Arch::qwen3, TensorType::Q1_0);
  const auto ids = some_ids(50, f.tiny->cfg.vocab_size, 10);
  const auto whole = f.run(ids, 50);
  for (int chunk : {7, 16}) {
    const auto chunked = f.run(ids, chunk);
    double m = 0;
    for (float v : whole) m = std::max(m, double(std::fabs(v)));
    for (size_t i = 0; i < whole.size(); ++i) ASSERT_NEAR(whole[i], chunked[i], 2e-5 * m) << "chunk " << chunk;
  }
}

TEST(ForwardConsistency, LastTokenLogitsEqualAllLogitsLastRow) {
  Fixture f(Arch::llama, TensorType::F16);
  const auto ids = some_ids(9, f.tiny->cfg.vocab_size, 3);
  const int V = f.tiny->cfg.vocab_size;
  auto cache = cpu::make_f32_cache(f.model->cache_shape(16));
  std::vector<float> last(V);
  f.model->forward(ids.data(), 9, 0, *cache, last.data(), false);
  const auto all = f.run(ids, 9);
  // The single-row LM head takes the fused dot path, the 9-row one the tiled path.
  for (int i = 0; i < V; ++i) EXPECT_NEAR(last[i], all[8 * V + i], 1e-5 * (1 + std::fabs(all[8 * V + i])));
}

TEST(ForwardErrors, ContextOverflowIsAClearError) {
  Fixture f(Arch::qwen3, TensorType::F32);
  auto cache = cpu::make_f32_cache(f.model->cache_shape(4));
  const auto ids = some_ids(5, f.tiny->cfg.vocab_size, 1);
  std::vector<float> logits(f.tiny->cfg.vocab_size);
  try {
    f.model->forward(ids.data(), 5, 0, *cache, logits.data(), false);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::out_of_range);
    EXPECT_NE(std::string(e.what()).find("--ctx"), std::string::npos) << e.what();
  }
}

TEST(ForwardErrors, MissingOrMisshapenTensorNamesIt) {
  auto tiny = testutil::make_tiny(Arch::qwen3, TensorType::F32, 1);
  tiny->t.info.erase(tn::blk(1, tn::ffn_up));
  try {
    load_weights(tiny->cfg, tiny->t.lookup());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("blk.1.ffn_up.weight"), std::string::npos) << e.what();
  }
  auto tiny2 = testutil::make_tiny(Arch::llama, TensorType::F32, 1);
  tiny2->t.info[tn::blk(0, tn::attn_q)].ne = {128, 64};
  EXPECT_THROW(load_weights(tiny2->cfg, tiny2->t.lookup()), Error);
  auto tiny3 = testutil::make_tiny(Arch::llama, TensorType::F32, 1);
  tiny3->t.info[tn::blk(0, tn::attn_q)].type = TensorType(6);  // Q5_0: not supported
  try {
    load_weights(tiny3->cfg, tiny3->t.lookup());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported);
    EXPECT_NE(std::string(e.what()).find("blk.0.attn_q.weight"), std::string::npos) << e.what();
  }
}
