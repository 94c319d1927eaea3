// Token sampling: greedy, temperature, top-k, top-p, min-p and repetition
// penalty, seeded with kvq::Rng so a fixed seed reproduces the same tokens.
//
// Order of operations (llama.cpp's default chain):
//   0. logit_bias: each listed token's bias is added to its logit; while
//      fewer than min_tokens tokens have been sampled, the tokens of
//      min_tokens_suppress (a server's end-of-generation and stop tokens)
//      cannot be chosen;
//   1. repetition penalty over the distinct tokens among the last
//      repeat_last_n accepted tokens: a positive logit is divided by the
//      penalty, a negative one multiplied (so both move down); then the
//      OpenAI presence and frequency penalties over the same window:
//      logit -= presence * (count > 0) + frequency * count;
//   2. temperature <= 0: greedy argmax (lowest id on ties), done;
//   3. top-k (keep the k largest logits), top-p (smallest set of tokens,
//      in descending probability, whose probability sum reaches p), min-p
//      (drop tokens whose probability is below min_p times the largest) --
//      probabilities here are at temperature 1;
//   4. divide the survivors' logits by the temperature, softmax, draw one.
#pragma once

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "core/rng.hpp"

namespace kvq {

using TokenId = int32_t;

struct SamplingParams {
  float temperature = 0.6f;     // 0: greedy (negative is an error). 0.6 as Qwen3 recommends; small models ramble at 0.8
  int top_k = 40;               // 0: off
  float top_p = 0.95f;          // 1: off; (0, 1]
  float min_p = 0.05f;          // <= 0: off
  float repeat_penalty = 1.0f;  // 1: off
  int repeat_last_n = 64;       // window of past tokens the penalties look at; 0: off
  float presence_penalty = 0.0f;   // OpenAI's: subtracted once from each token seen in the window
  float frequency_penalty = 0.0f;  // OpenAI's: subtracted per occurrence in the window
  uint64_t seed = 0;
  // OpenAI's logit_bias: (token, bias in [-100, 100]) added to the logit
  // before anything else; -100 in effect bans a token, +100 forces it.
  std::vector<std::pair<TokenId, float>> logit_bias;
  // The first min_tokens sampled tokens are never one of
  // min_tokens_suppress (the caller lists what would end generation).
  int min_tokens = 0;
  std::vector<TokenId> min_tokens_suppress;

  // Throws Errc::invalid_argument naming the bad value.
  void validate() const;
  // True when the choice is the plain argmax of the logits (greedy, no
  // penalty, bias or suppression): a backend may then pick the token
  // itself without the logits leaving the device.
  bool plain_greedy() const {
    return temperature <= 0.0f && !uses_history() && logit_bias.empty() &&
           (min_tokens <= 0 || min_tokens_suppress.empty());
  }
  // True when sampling reads the token history (some penalty is on).
  bool uses_history() const {
    return repeat_last_n > 0 && (repeat_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f);
  }
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);

  // Picks the next token from logits[0..vocab). Does not record it; call
  // accept(). Counts toward min_tokens.
  TokenId sample(const float* logits, int vocab);
  // Records a token in the repetition-penalty window (prompt tokens too).
  void accept(TokenId id);
  void reset();  // forget history and the min_tokens count, re-seed
  const SamplingParams& params() const { return p_; }

  // The candidates that survived the last sample() call with their final
  // probabilities (after temperature): by descending logit when top-k or top-p
  // ordered them, else in id order. For tests and diagnostics.
  struct Candidate {
    TokenId id;
    float logit;
    float p;
  };
  const std::vector<Candidate>& last_candidates() const { return cand_; }

 private:
  SamplingParams p_;
  Rng rng_;
  std::deque<TokenId> history_;
  int sampled_ = 0;  // sample() calls since construction or reset()
  std::vector<Candidate> cand_;
  std::vector<float> work_;
};

}  // namespace kvq
