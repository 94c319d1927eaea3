#include "engine/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "core/error.hpp"

namespace kvq {

void SamplingParams::validate() const {
  KVQ_CHECK(std::isfinite(temperature) && temperature >= 0.0f, Errc::invalid_argument, "--temp ", temperature,
            " must be a finite number >= 0 (0: greedy)");
  KVQ_CHECK(top_k >= 0, Errc::invalid_argument, "--top-k ", top_k, " must be >= 0 (0 turns it off)");
  KVQ_CHECK(top_p > 0.0f && top_p <= 1.0f, Errc::invalid_argument, "--top-p ", top_p,
            " must be in (0, 1] (1 turns it off)");
  KVQ_CHECK(min_p >= 0.0f && min_p <= 1.0f, Errc::invalid_argument, "--min-p ", min_p,
            " must be in [0, 1] (0 turns it off)");
  KVQ_CHECK(repeat_penalty > 0.0f && std::isfinite(repeat_penalty), Errc::invalid_argument, "--repeat-penalty ",
            repeat_penalty, " must be positive (1 turns it off)");
  KVQ_CHECK(std::isfinite(presence_penalty) && std::isfinite(frequency_penalty), Errc::invalid_argument,
            "presence and frequency penalties must be finite numbers");
  KVQ_CHECK(repeat_last_n >= 0, Errc::invalid_argument, "--repeat-last-n ", repeat_last_n,
            " must be >= 0 (0 turns it off)");
  for (const auto& [id, bias] : logit_bias)
    KVQ_CHECK(id >= 0 && std::isfinite(bias) && bias >= -100.0f && bias <= 100.0f, Errc::invalid_argument,
              "logit_bias: token ", id, " bias ", bias, " (want a token id >= 0 and a bias in [-100, 100])");
  KVQ_CHECK(min_tokens >= 0, Errc::invalid_argument, "min_tokens ", min_tokens, " must be >= 0");
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) { p_.validate(); }

void Sampler::reset() {
  history_.clear();
  sampled_ = 0;
  rng_ = Rng(p_.seed);
}

void Sampler::accept(TokenId id) {
  if (p_.repeat_last_n <= 0) return;
  history_.push_back(id);
  while (int(history_.size()) > p_.repeat_last_n) history_.pop_front();
}

TokenId Sampler::sample(const float* logits, int vocab) {
  KVQ_CHECK(vocab > 0, Errc::internal, "sample: empty vocabulary");
  work_.assign(logits, logits + vocab);
  for (float& l : work_)
    if (std::isnan(l)) l = -INFINITY;  // a NaN logit must never be chosen
  for (const auto& [id, bias] : p_.logit_bias)
    if (id >= 0 && id < vocab) work_[id] += bias;
  if (sampled_ < p_.min_tokens)
    for (TokenId id : p_.min_tokens_suppress)
      if (id >= 0 && id < vocab) work_[id] = -INFINITY;
  ++sampled_;

  if (p_.uses_history() && !history_.empty()) {
    std::unordered_map<TokenId, int> count;
    for (TokenId id : history_) ++count[id];
    for (const auto& [id, n] : count) {
      if (id < 0 || id >= vocab) continue;
      float& l = work_[id];
      if (p_.repeat_penalty != 1.0f) l = l > 0.0f ? l / p_.repeat_penalty : l * p_.repeat_penalty;
      l -= p_.presence_penalty + p_.frequency_penalty * float(n);
    }
  }

  cand_.clear();
  if (p_.temperature <= 0.0f) {
    TokenId best = 0;
    for (int i = 1; i < vocab; ++i)
      if (work_[i] > work_[best]) best = i;
    cand_.push_back({best, work_[best], 1.0f});
    return best;
  }

  cand_.reserve(vocab);
  for (int i = 0; i < vocab; ++i) cand_.push_back({TokenId(i), work_[i], 0.0f});
  // Descending logit, ascending id on ties: a total order, so results never
  // depend on the sort implementation. Only top-k and top-p need an order;
  // without them the candidates stay in id order (no sort of a 150k vocabulary
  // per token).
  auto by_logit = [](const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  };
  if (p_.top_k > 0 && p_.top_k < vocab) {
    std::partial_sort(cand_.begin(), cand_.begin() + p_.top_k, cand_.end(), by_logit);
    cand_.resize(p_.top_k);
  } else if (p_.top_p < 1.0f) {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }

  // Softmax over the candidates at temperature `temp`; returns the largest probability.
  auto softmax = [&](float temp) {
    float m = -INFINITY;
    for (const Candidate& c : cand_) m = std::max(m, c.logit);
    double sum = 0.0;
    for (Candidate& c : cand_) {
      c.p = std::isinf(c.logit) ? 0.0f : float(std::exp(double(c.logit - m) / temp));
      sum += c.p;
    }
    float pmax = 0.0f;
    for (Candidate& c : cand_) {
      c.p = float(c.p / sum);
      pmax = std::max(pmax, c.p);
    }
    return pmax;
  };
  float best = -INFINITY;
  for (const Candidate& c : cand_) best = std::max(best, c.logit);
  if (std::isinf(best)) {  // every logit was -inf/NaN: nothing sensible to sample
    auto it = std::min_element(cand_.begin(), cand_.end(), [](auto& a, auto& b) { return a.id < b.id; });
    const TokenId id = it->id;
    cand_.assign(1, {id, best, 1.0f});
    return id;
  }
  // Probabilities at temperature 1 for top-p and min-p.
  const float pmax = softmax(1.0f);
  if (p_.top_p < 1.0f) {  // candidates are sorted here
    double cum = 0.0;
    size_t keep = cand_.size();
    for (size_t i = 0; i < cand_.size(); ++i) {
      cum += cand_[i].p;
      if (cum >= p_.top_p) {
        keep = i + 1;
        break;
      }
    }
    cand_.resize(keep);
  }
  if (p_.min_p > 0.0f) {
    const float threshold = p_.min_p * pmax;
    cand_.erase(std::remove_if(cand_.begin(), cand_.end(), [&](const Candidate& c) { return c.p < threshold; }),
                cand_.end());
  }
  softmax(p_.temperature);

  const double u = rng_.uniform();
  double cum = 0.0;
  for (const Candidate& c : cand_) {
    cum += c.p;
    if (u < cum) return c.id;
  }
  return cand_.back().id;  // u beyond the rounded total
}

}  // namespace kvq
