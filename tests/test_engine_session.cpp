// The engine Session on a synthetic tiny model (regenerated from its recipe):
// determinism, prefix reuse across calls, logits sink alignment, stop rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/f32_cache.hpp"
#include "core/error.hpp"
#include "engine/session.hpp"
#include "gguf/gguf.hpp"
#include "model/forward.hpp"
#include "model/synth.hpp"
#include "tokenizer/tokenizer.hpp"

using namespace kvq;
namespace fs = std::filesystem;

namespace {

struct Tiny {
  std::unique_ptr<Backend> backend = cpu::make_cpu_backend();
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
  explicit Tiny(const std::string& shape = "tiny") {
    const fs::path p = fs::temp_directory_path() / ("kvq_engine_" + shape + "_" + std::to_string(::getpid()) + ".gguf");
    SynthOptions so;
    so.shape = shape;
    so.seed = 1;
    write_synthetic(so, p.string());
    model = Model::open(p.string(), *backend);
    tok = std::make_unique<Tokenizer>(Tokenizer::from_gguf(*model->file()));
    fs::remove(p);  // the mapping stays valid after unlink
  }
  std::unique_ptr<Session> session(int ctx = 128, int chunk = 512) {
    SessionOptions so;
    so.ctx = ctx;
    so.prefill_chunk = chunk;
    return std::make_unique<Session>(*model, cpu::make_f32_cache(model->cache_shape(ctx)), tok.get(), so);
  }
};

Tiny& tiny() {
  static Tiny t;
  return t;
}

GenerateOptions greedy(int n) {
  GenerateOptions g;
  g.n_predict = n;
  g.sampling.temperature = 0;
  g.stop_at_eog = false;  // random weights: do not let an early EOG shorten the test
  return g;
}

}  // namespace

TEST(EngineSession, SameSeedSameTokensDifferentSeedDiffers) {
  auto& t = tiny();
  const auto prompt = t.session()->tokenize("def add(a, b):", true, false);
  auto run = [&](uint64_t seed) {
    GenerateOptions g = greedy(24);
    g.sampling.temperature = 1.0f;
    g.sampling.top_k = 0;
    g.sampling.top_p = 1.0f;
    g.sampling.min_p = 0.0f;
    g.sampling.seed = seed;
    return t.session()->generate(prompt, g).tokens;
  };
  EXPECT_EQ(run(7), run(7));
  EXPECT_NE(run(7), run(8));
  auto s1 = t.session(), s2 = t.session();
  EXPECT_EQ(s1->generate(prompt, greedy(16)).tokens, s2->generate(prompt, greedy(16)).tokens);
}

TEST(EngineSession, ReusesTheCachedPrefixAndMatchesAFreshSession) {
  auto& t = tiny();
  auto s = t.session();
  const auto a = s->tokenize("The quick brown fox", true, false);
  auto ab = a;
  for (TokenId id : s->tokenize(" jumps over the lazy dog", false, false)) ab.push_back(id);
  const GenerateResult r1 = s->generate(a, greedy(4));
  EXPECT_EQ(r1.n_prompt, int(a.size()));
  const GenerateResult r2 = s->generate(ab, greedy(8));
  // Only the new suffix is prefilled (the cache kept a plus generated tokens, of
  // which the common prefix with ab is a).
  EXPECT_EQ(r2.n_prompt, int(ab.size() - a.size()));
  const GenerateResult fresh = t.session()->generate(ab, greedy(8));
  EXPECT_EQ(r2.tokens, fresh.tokens);
  EXPECT_EQ(r2.text, fresh.text);
}

TEST(EngineSession, ChunkedPrefillGivesTheSameGeneration) {
  auto& t = tiny();
  std::string text;
  for (int i = 0; i < 20; ++i) text += "for i in range(10): print(i)\n";
  const auto prompt = t.session(512)->tokenize(text, true, false);
  ASSERT_GT(prompt.size(), 64u);
  const auto whole = t.session(512, 512)->generate(prompt, greedy(12)).tokens;
  const auto chunked = t.session(512, 13)->generate(prompt, greedy(12)).tokens;
  EXPECT_EQ(whole, chunked);
}

// Two sequences on one model, decoding in turns (the server's case): each has
// its own run state and cache, so each produces exactly what it produces alone.
TEST(EngineSession, InterleavedSessionsOnOneModelMatchTheSessionsAlone) {
  auto& t = tiny();
  const auto pa = t.session()->tokenize("def add(a, b):", true, false);
  const auto pb = t.session()->tokenize("import os\nimport sys\n", true, false);
  const auto alone_a = t.session()->generate(pa, greedy(12)).tokens;
  const auto alone_b = t.session()->generate(pb, greedy(12)).tokens;
  auto a = t.session(), b = t.session();
  EXPECT_NE(&a->run_state(), &b->run_state());
  // Prefill both, then alternate single steps (greedy over the tokenizer's
  // vocabulary, as generate() samples).
  const int vocab = std::min(t.tok->vocab_size(), t.model->config().vocab_size);
  auto best = [&](const std::vector<float>& l) { return TokenId(std::max_element(l.begin(), l.begin() + vocab) - l.begin()); };
  std::vector<TokenId> ta{best(a->feed(pa))}, tb{best(b->feed(pb))};
  for (int i = 0; i + 1 < 12; ++i) {
    ta.push_back(a->feed_greedy(ta.back(), vocab));
    tb.push_back(b->feed_greedy(tb.back(), vocab));
  }
  EXPECT_EQ(ta, alone_a);
  EXPECT_EQ(tb, alone_b);
}

TEST(EngineSession, LogitsSinkHasARowForEveryToken) {
  auto& t = tiny();
  auto s = t.session();
  std::vector<TokenId> seen;
  std::vector<std::vector<float>> rows;
  s->set_logits_sink([&](TokenId id, const float* l, int v) {
    seen.push_back(id);
    rows.emplace_back(l, l + v);
  });
  const auto prompt = s->tokenize("hello world", true, false);
  const GenerateResult r = s->generate(prompt, greedy(5));
  ASSERT_EQ(r.tokens.size(), 5u);
  std::vector<TokenId> all = prompt;
  all.insert(all.end(), r.tokens.begin(), r.tokens.end());
  EXPECT_EQ(seen, all);
  // Greedy: each generated token is the argmax of the row before it.
  for (size_t i = prompt.size() - 1; i + 1 < all.size(); ++i) {
    const auto& row = rows[i];
    EXPECT_EQ(TokenId(std::max_element(row.begin(), row.end()) - row.begin()), all[i + 1]) << i;
  }
}

TEST(EngineSession, StopsAtMaxTokensContextAndStopStrings) {
  auto& t = tiny();
  const auto prompt = t.session()->tokenize("abc", true, false);
  EXPECT_EQ(t.session()->generate(prompt, greedy(7)).tokens.size(), 7u);
  const GenerateResult full = t.session(int(prompt.size()) + 3)->generate(prompt, greedy(50));
  EXPECT_EQ(full.stop_reason, StopReason::context_full);
  EXPECT_EQ(full.tokens.size(), 4u);  // 3 fed + 1 sampled at the end
  // A stop string taken from a greedy run's own text stops there and is excluded.
  const GenerateResult ref = t.session()->generate(prompt, greedy(20));
  ASSERT_GE(ref.text.size(), 4u);
  GenerateOptions g = greedy(20);
  g.stop = {ref.text.substr(2, 2)};
  const GenerateResult st = t.session()->generate(prompt, g);
  EXPECT_EQ(st.stop_reason, StopReason::stop_string);
  EXPECT_EQ(st.text, ref.text.substr(0, ref.text.find(g.stop[0])));
}

TEST(EngineSession, PromptLongerThanTheContextIsAClearError) {
  auto& t = tiny();
  auto s = t.session(8);
  std::vector<TokenId> prompt(9, 5);
  try {
    s->generate(prompt, greedy(1));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::out_of_range);
    EXPECT_NE(std::string(e.what()).find("--ctx"), std::string::npos) << e.what();
  }
}

TEST(EngineSession, OnTokenSeesEveryTokenWithItsLogitsAndCanCancel) {
  auto& t = tiny();
  const auto prompt = t.session()->tokenize("def add(a, b):", true, false);
  const GenerateResult ref = t.session()->generate(prompt, greedy(10));
  ASSERT_EQ(ref.tokens.size(), 10u);

  // Every token, in order; with token_logits the row it was chosen from (greedy: its argmax).
  std::vector<TokenId> seen;
  GenerateOptions g = greedy(10);
  g.token_logits = true;
  const int vocab = std::min(t.tok->vocab_size(), t.model->config().vocab_size);
  g.on_token = [&](TokenId id, const float* logits) {
    EXPECT_NE(logits, nullptr);
    if (logits) EXPECT_EQ(TokenId(std::max_element(logits, logits + vocab) - logits), id);
    seen.push_back(id);
    return true;
  };
  const GenerateResult r = t.session()->generate(prompt, g);
  EXPECT_EQ(seen, ref.tokens);
  EXPECT_EQ(r.tokens, ref.tokens);

  // Without token_logits (the backend-greedy path) no logits; false cancels after that token.
  int calls = 0;
  GenerateOptions c = greedy(10);
  c.on_token = [&](TokenId, const float* logits) {
    EXPECT_EQ(logits, nullptr);
    return ++calls < 4;
  };
  const GenerateResult cancelled = t.session()->generate(prompt, c);
  EXPECT_EQ(cancelled.stop_reason, StopReason::cancelled);
  EXPECT_EQ(cancelled.tokens, std::vector<TokenId>(ref.tokens.begin(), ref.tokens.begin() + 4));
  EXPECT_EQ(calls, 4);
}
