// Each sampling option on constructed logits: determinism given a seed,
// distribution checks where they make sense.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

#include "core/error.hpp"
#include "engine/sampler.hpp"

using namespace kvq;

namespace {

SamplingParams plain(float temp, uint64_t seed = 1) {
  SamplingParams p;
  p.temperature = temp;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.repeat_penalty = 1.0f;
  p.seed = seed;
  return p;
}

std::vector<float> ramp(int n) {  // logit i = i / 4: token n-1 is the most likely
  std::vector<float> l(n);
  for (int i = 0; i < n; ++i) l[i] = float(i) / 4.0f;
  return l;
}

std::map<TokenId, int> histogram(Sampler& s, const std::vector<float>& logits, int draws) {
  std::map<TokenId, int> h;
  for (int i = 0; i < draws; ++i) ++h[s.sample(logits.data(), int(logits.size()))];
  return h;
}

}  // namespace

TEST(Sampling, GreedyPicksArgmaxLowestIdOnTies) {
  Sampler s(plain(0.0f));
  const std::vector<float> l = {0.1f, 3.0f, -1.0f, 3.0f, 2.9f};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(s.sample(l.data(), 5), 1);
}

TEST(Sampling, NaNLogitsAreNeverChosen) {
  Sampler s(plain(0.0f));
  const std::vector<float> l = {NAN, 1.0f, NAN};
  EXPECT_EQ(s.sample(l.data(), 3), 1);
  Sampler t(plain(1.0f));
  for (int i = 0; i < 50; ++i) EXPECT_EQ(t.sample(l.data(), 3), 1);
}

TEST(Sampling, SameSeedSameSequenceDifferentSeedDifferent) {
  const auto l = ramp(50);
  auto draw = [&](uint64_t seed) {
    Sampler s(plain(1.0f, seed));
    std::vector<TokenId> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.sample(l.data(), 50));
    return out;
  };
  EXPECT_EQ(draw(42), draw(42));
  EXPECT_NE(draw(42), draw(43));
  Sampler s(plain(1.0f, 42));
  const auto first = s.sample(l.data(), 50);
  s.reset();
  EXPECT_EQ(s.sample(l.data(), 50), first) << "reset() re-seeds";
}

TEST(Sampling, TemperatureOneMatchesSoftmaxFrequencies) {
  const std::vector<float> l = {0.0f, std::log(2.0f), std::log(5.0f)};  // p = 1/8, 2/8, 5/8
  Sampler s(plain(1.0f, 7));
  const int n = 40000;
  auto h = histogram(s, l, n);
  EXPECT_NEAR(h[0] / double(n), 0.125, 0.01);
  EXPECT_NEAR(h[1] / double(n), 0.25, 0.01);
  EXPECT_NEAR(h[2] / double(n), 0.625, 0.01);
}

TEST(Sampling, LowTemperatureSharpensHighTemperatureFlattens) {
  const std::vector<float> l = {0.0f, 1.0f};
  const int n = 20000;
  Sampler cold(plain(0.25f, 3)), hot(plain(4.0f, 3));
  const double p_cold = histogram(cold, l, n)[1] / double(n);
  const double p_hot = histogram(hot, l, n)[1] / double(n);
  EXPECT_NEAR(p_cold, 1.0 / (1.0 + std::exp(-4.0)), 0.01);
  EXPECT_NEAR(p_hot, 1.0 / (1.0 + std::exp(-0.25)), 0.015);
}

TEST(Sampling, TopKNeverSamplesOutsideTheTopK) {
  auto p = plain(5.0f, 11);  // hot: without top-k every token would show up
  p.top_k = 3;
  Sampler s(p);
  const auto l = ramp(20);
  auto h = histogram(s, l, 5000);
  for (auto [id, c] : h) EXPECT_GE(id, 17) << "token " << id << " is not among the top 3";
  EXPECT_EQ(h.size(), 3u) << "all of the top 3 should be drawn";
}

TEST(Sampling, TopPKeepsTheSmallestNucleus) {
  // p = 0.5, 0.3, 0.15, 0.05: top-p 0.75 keeps {0, 1} (0.5 < 0.75 <= 0.8).
  const std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  auto p = plain(1.0f, 5);
  p.top_p = 0.75f;
  Sampler s(p);
  auto h = histogram(s, l, 20000);
  EXPECT_EQ(h.count(2) + h.count(3), 0u);
  EXPECT_NEAR(h[0] / 20000.0, 0.5 / 0.8, 0.015);  // renormalized within the nucleus
  s.sample(l.data(), 4);
  ASSERT_EQ(s.last_candidates().size(), 2u);
}

TEST(Sampling, MinPDropsTokensBelowTheThreshold) {
  // p proportional to 10, 5, 2, 0.9: min-p 0.1 keeps p >= 0.1 * p_max -> {0, 1, 2}.
  const std::vector<float> l = {std::log(10.0f), std::log(5.0f), std::log(2.0f), std::log(0.9f)};
  auto p = plain(1.0f, 9);
  p.min_p = 0.1f;
  Sampler s(p);
  auto h = histogram(s, l, 20000);
  EXPECT_EQ(h.count(3), 0u);
  EXPECT_GT(h[2], 0);
  p.min_p = 0.6f;  // keeps only token 0 (5/10 < 0.6)
  Sampler s2(p);
  auto h2 = histogram(s2, l, 200);
  EXPECT_EQ(h2.size(), 1u);
  EXPECT_EQ(h2.begin()->first, 0);
}

TEST(Sampling, RepetitionPenaltyChangesTheArgmax) {
  const std::vector<float> l = {2.0f, 1.8f, -1.0f};
  auto p = plain(0.0f);
  p.repeat_penalty = 1.2f;
  p.repeat_last_n = 4;
  Sampler s(p);
  EXPECT_EQ(s.sample(l.data(), 3), 0);
  s.accept(0);  // 2.0 / 1.2 = 1.67 < 1.8
  EXPECT_EQ(s.sample(l.data(), 3), 1);
  // Negative logits are multiplied: -1 * 1.2 = -1.2, so a penalized negative token gets less likely.
  const std::vector<float> neg = {-1.0f, -1.1f};
  Sampler s2(p);
  s2.accept(0);
  EXPECT_EQ(s2.sample(neg.data(), 2), 1);
}

TEST(Sampling, RepetitionPenaltyWindowForgetsOldTokens) {
  const std::vector<float> l = {2.0f, 1.8f, 0.0f};
  auto p = plain(0.0f);
  p.repeat_penalty = 1.5f;
  p.repeat_last_n = 2;
  Sampler s(p);
  s.accept(0);
  EXPECT_EQ(s.sample(l.data(), 3), 1);
  s.accept(2);
  s.accept(2);  // token 0 has left the window of 2
  EXPECT_EQ(s.sample(l.data(), 3), 0);
  p.repeat_last_n = 0;  // off
  Sampler off(p);
  off.accept(0);
  EXPECT_EQ(off.sample(l.data(), 3), 0);
}

TEST(Sampling, InvalidParametersAreClearErrors) {
  auto p = plain(1.0f);
  p.top_p = 0.0f;
  EXPECT_THROW(Sampler{p}, Error);
  p = plain(1.0f);
  p.min_p = 1.5f;
  EXPECT_THROW(Sampler{p}, Error);
  p = plain(1.0f);
  p.repeat_penalty = 0.0f;
  EXPECT_THROW(Sampler{p}, Error);
  p = plain(1.0f);
  p.repeat_last_n = -1;
  try {
    Sampler s(p);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("--repeat-last-n"), std::string::npos);
  }
}

TEST(Sampling, PresenceAndFrequencyPenaltiesSubtractPerTokenAndPerOccurrence) {
  const std::vector<float> l = {2.0f, 1.5f, 1.2f};
  auto p = plain(0.0f);
  p.repeat_last_n = 8;
  p.presence_penalty = 0.4f;  // token 0: 2.0 - 0.4 = 1.6 > 1.5, still the argmax
  Sampler s(p);
  s.accept(0);
  s.accept(0);
  EXPECT_EQ(s.sample(l.data(), 3), 0);
  EXPECT_FLOAT_EQ(s.last_candidates()[0].logit, 1.6f);  // once, however often it occurred
  p.presence_penalty = 0.0f;
  p.frequency_penalty = 0.3f;  // twice seen: 2.0 - 0.6 = 1.4 < 1.5
  Sampler f(p);
  f.accept(0);
  f.accept(0);
  EXPECT_EQ(f.sample(l.data(), 3), 1);
  f.accept(1);  // token 1 once: 1.5 - 0.3 = 1.2 < 1.4, so token 0 leads again
  EXPECT_EQ(f.sample(l.data(), 3), 0);
  EXPECT_FLOAT_EQ(f.last_candidates()[0].logit, 1.4f);
  EXPECT_TRUE(p.uses_history());
  // Negative penalties favour seen tokens (OpenAI allows [-2, 2]).
  auto n = plain(0.0f);
  n.presence_penalty = -1.0f;
  Sampler neg(n);
  neg.accept(2);
  EXPECT_EQ(neg.sample(l.data(), 3), 2);  // 1.2 + 1.0 = 2.2
  n.repeat_last_n = 0;  // the window is off: so are the penalties
  EXPECT_FALSE(n.uses_history());
  Sampler off(n);
  off.accept(2);
  EXPECT_EQ(off.sample(l.data(), 3), 0);
}

TEST(Sampling, LogitBiasAddsBeforeChoosingAndBansAtMinus100) {
  const std::vector<float> l = {2.0f, 1.5f, 1.2f};
  auto p = plain(0.0f);
  EXPECT_TRUE(p.plain_greedy());
  p.logit_bias = {{1, 0.6f}};  // 1.5 + 0.6 = 2.1 > 2.0
  EXPECT_FALSE(p.plain_greedy());
  Sampler s(p);
  EXPECT_EQ(s.sample(l.data(), 3), 1);
  EXPECT_FLOAT_EQ(s.last_candidates()[0].logit, 2.1f);
  // -100 in effect bans: at temperature 1 over 2000 draws token 0 never comes.
  auto t = plain(1.0f, 7);
  t.logit_bias = {{0, -100.0f}, {99, 5.0f}};  // an id past the vocabulary is ignored
  Sampler ban(t);
  const auto h = histogram(ban, l, 2000);
  EXPECT_EQ(h.count(0), 0u);
  EXPECT_GT(h.at(1), 0);
  EXPECT_GT(h.at(2), 0);
  // Out-of-range biases are clear errors.
  auto bad = plain(0.0f);
  bad.logit_bias = {{1, 100.5f}};
  EXPECT_THROW(Sampler{bad}, Error);
  bad.logit_bias = {{-1, 1.0f}};
  EXPECT_THROW(Sampler{bad}, Error);
  bad.logit_bias = {{1, NAN}};
  EXPECT_THROW(Sampler{bad}, Error);
}

TEST(Sampling, MinTokensSuppressesEndTokensForTheFirstSamplesOnly) {
  const std::vector<float> l = {5.0f, 1.0f, 0.5f};  // token 0 (say, end of generation) wins unsuppressed
  auto p = plain(0.0f);
  p.min_tokens = 3;
  p.min_tokens_suppress = {0};
  EXPECT_FALSE(p.plain_greedy());
  Sampler s(p);
  EXPECT_EQ(s.sample(l.data(), 3), 1);
  EXPECT_EQ(s.sample(l.data(), 3), 1);
  EXPECT_EQ(s.sample(l.data(), 3), 1);
  EXPECT_EQ(s.sample(l.data(), 3), 0);  // the fourth sample may end
  s.reset();                             // a restart counts again
  EXPECT_EQ(s.sample(l.data(), 3), 1);
  // Nothing to suppress: plain greedy again.
  p.min_tokens_suppress.clear();
  EXPECT_TRUE(p.plain_greedy());
  p.min_tokens = -1;
  EXPECT_THROW(Sampler{p}, Error);
}
