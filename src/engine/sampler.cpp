#include "engine/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "core/error.hpp"

namespace kvq {

void SamplingParams::validate() const {
  KVQ_CHECK(std::isfinite(temperature), Errc::invalid_argument, "--temp must be a finite number");
  KVQ_CHECK(top_p > 0.0f && std::isfinite(top_p), Errc::invalid_argument, "--top-p ", top_p,
            " must be in (0, 1] (1 turns it off)");
  KVQ_CHECK(min_p >= 0.0f && min_p <= 1.0f, Errc::invalid_argument, "--min-p ", min_p,
            " must be in [0, 1] (0 turns it off)");
  KVQ_CHECK(repeat_penalty > 0.0f && std::isfinite(repeat_penalty), Errc::invalid_argument, "--repeat-penalty ",
            repeat_penalty, " must be positive (1 turns it off)");
  KVQ_CHECK(repeat_last_n >= 0, Errc::invalid_argument, "--repeat-last-n ", repeat_last_n,
            " must be >= 0 (0 turns it off)");
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) { p_.validate(); }

void Sampler::reset() {
  history_.clear();
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

  if (p_.repeat_penalty != 1.0f && !history_.empty()) {
    std::unordered_set<TokenId> seen(history_.begin(), history_.end());
    for (TokenId id : seen) {
      if (id < 0 || id >= vocab) continue;
      float& l = work_[id];
      l = l > 0.0f ? l / p_.repeat_penalty : l * p_.repeat_penalty;
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
  // depend on the sort implementation.
  auto by_logit = [](const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  };
  if (p_.top_k > 0 && p_.top_k < vocab) {
    std::partial_sort(cand_.begin(), cand_.begin() + p_.top_k, cand_.end(), by_logit);
    cand_.resize(p_.top_k);
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }

  // Probabilities at temperature 1 for top-p and min-p.
  auto softmax = [&](float temp) {
    const float m = cand_.front().logit;
    double sum = 0.0;
    for (Candidate& c : cand_) {
      c.p = std::isinf(c.logit) ? 0.0f : float(std::exp(double(c.logit - m) / temp));
      sum += c.p;
    }
    for (Candidate& c : cand_) c.p = float(c.p / sum);
  };
  if (std::isinf(cand_.front().logit)) {  // every logit was -inf/NaN: nothing sensible to sample
    cand_.resize(1);
    cand_[0].p = 1.0f;
    return cand_[0].id;
  }
  softmax(1.0f);
  if (p_.top_p < 1.0f) {
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
    const float threshold = p_.min_p * cand_.front().p;
    size_t keep = 1;
    while (keep < cand_.size() && cand_[keep].p >= threshold) ++keep;
    cand_.resize(keep);
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
