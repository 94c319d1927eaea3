#include "eval/metrics.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace kvq::eval {

double log_sum_exp(const float* x, int n) {
  KVQ_CHECK(n > 0, Errc::invalid_argument, "log_sum_exp of an empty row");
  double m = -INFINITY;
  for (int i = 0; i < n; ++i) m = std::max(m, double(x[i]));
  double l = 0;
  for (int i = 0; i < n; ++i) l += std::exp(double(x[i]) - m);
  return m + std::log(l);
}

void log_softmax(const float* x, int n, std::vector<double>& out) {
  const double lz = log_sum_exp(x, n);
  out.resize(size_t(n));
  for (int i = 0; i < n; ++i) out[size_t(i)] = double(x[i]) - lz;
}

double kl_divergence(const float* p_logits, double p_log_z, const float* q_logits, int n) {
  const double q_log_z = log_sum_exp(q_logits, n);
  double kl = 0;
  for (int i = 0; i < n; ++i) {
    const double lp = double(p_logits[i]) - p_log_z;
    const double p = std::exp(lp);
    if (p > 0) kl += p * (lp - (double(q_logits[i]) - q_log_z));
  }
  return std::max(kl, 0.0);  // rounding can leave -1e-17 for identical rows
}

double kl_divergence(const float* p_logits, const float* q_logits, int n) {
  return kl_divergence(p_logits, log_sum_exp(p_logits, n), q_logits, n);
}

double neg_log_likelihood(const float* logits, int n, int target) {
  KVQ_CHECK(target >= 0 && target < n, Errc::out_of_range, "target token ", target, " outside the ", n,
            " logits");
  return log_sum_exp(logits, n) - double(logits[target]);
}

int argmax(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best] || (!(x[best] == x[best]) && x[i] == x[i])) best = i;
  return best;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  KVQ_CHECK(p > 0 && p <= 100, Errc::invalid_argument, "percentile ", p, " not in (0, 100]");
  std::sort(v.begin(), v.end());
  const size_t rank = size_t(std::ceil(p / 100.0 * double(v.size())));  // 1-based
  return v[std::max<size_t>(rank, 1) - 1];
}

void QualitySummary::add_kl(double kl, bool agrees) {
  kl_.push_back(kl);
  agree_ += agrees;
}

void QualitySummary::add_nll(double nll) {
  nll_sum_ += nll;
  ++n_nll_;
}

double QualitySummary::mean_kl() const {
  if (kl_.empty()) return 0;
  double s = 0;
  for (double k : kl_) s += k;
  return s / double(kl_.size());
}

double QualitySummary::max_kl() const { return kl_.empty() ? 0 : *std::max_element(kl_.begin(), kl_.end()); }

double QualitySummary::top1_pct() const { return kl_.empty() ? 0 : 100.0 * double(agree_) / double(kl_.size()); }

double QualitySummary::mean_nll() const { return n_nll_ ? nll_sum_ / double(n_nll_) : 0; }

double QualitySummary::perplexity() const { return std::exp(mean_nll()); }

}  // namespace kvq::eval
