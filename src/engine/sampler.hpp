// Token sampling: greedy, temperature, top-k, top-p, min-p and repetition
// penalty, seeded with kvq::Rng so a fixed seed reproduces the same tokens.
//
// Order of operations (llama.cpp's default chain):
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

  // Throws Errc::invalid_argument naming the bad value.
  void validate() const;
  // True when sampling reads the token history (some penalty is on).
  bool uses_history() const {
    return repeat_last_n > 0 && (repeat_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f);
  }
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);

  // Picks the next token from logits[0..vocab). Does not record it; call accept().
  TokenId sample(const float* logits, int vocab);
  // Records a token in the repetition-penalty window (prompt tokens too).
  void accept(TokenId id);
  void reset();  // forget history and re-seed
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
  std::vector<Candidate> cand_;
  std::vector<float> work_;
};

}  // namespace kvq
