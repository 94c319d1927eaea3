#include "eval/metrics.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace kvq::eval {

void log_softmax(const float* x, int n, std::vector<double>& out) {
  KVQ_CHECK(n > 0, Errc::invalid_argument, "log_softmax of an empty row");
  out.resize(size_t(n));
  double m = -INFINITY;
  for (int i = 0; i < n; ++i) m = std::max(m, double(x[i]));
  double l = 0;
  for (int i = 0; i < n; ++i) l += std::exp(double(x[i]) - m);
  const double lz = m + std::log(l);
  for (int i = 0; i < n; ++i) out[size_t(i)] = double(x[i]) - lz;
}

template <typename T>
static double kl_impl(const T* lp, const float* q_logits, int n) {
  thread_local std::vector<double> lq;
  log_softmax(q_logits, n, lq);
  double kl = 0;
  for (int i = 0; i < n; ++i) {
    const double p = std::exp(double(lp[i]));
    if (p > 0) kl += p * (double(lp[i]) - lq[size_t(i)]);
  }
  return std::max(kl, 0.0);  // rounding can leave -1e-17 for identical rows
}

double kl_divergence_log_p(const float* log_p, const float* q_logits, int n) { return kl_impl(log_p, q_logits, n); }

double kl_divergence(const float* p_logits, const float* q_logits, int n) {
  thread_local std::vector<double> lp;
  log_softmax(p_logits, n, lp);
  return kl_impl(lp.data(), q_logits, n);
}

double neg_log_likelihood(const float* logits, int n, int target) {
  KVQ_CHECK(target >= 0 && target < n, Errc::out_of_range, "target token ", target, " outside the ", n,
            " logits");
  thread_local std::vector<double> lp;
  log_softmax(logits, n, lp);
  return -lp[size_t(target)];
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
