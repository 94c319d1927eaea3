// Per-position quality metrics computed from logits, and their summaries:
// KL(p_ref || p_codec), top-1 agreement, negative log-likelihood and
// perplexity. Plain double-precision arithmetic: these numbers judge codecs,
// so they must not add error of their own.
#pragma once

#include <cstdint>
#include <vector>

namespace kvq::eval {

// log sum_i exp(logits[i]), in double (max-shifted).
double log_sum_exp(const float* logits, int n);
// out[i] = log softmax(logits)[i] = logits[i] - log_sum_exp(logits), in double.
void log_softmax(const float* logits, int n, std::vector<double>& out);

// KL(p || q) in nats, p = softmax(p_logits), q = softmax(q_logits). Zero for
// identical logits; terms with p_i = 0 contribute nothing.
double kl_divergence(const float* p_logits, const float* q_logits, int n);
// The same with p's log-normaliser given (log_sum_exp(p_logits), computed
// once for a reference row that is compared with many codecs).
double kl_divergence(const float* p_logits, double p_log_z, const float* q_logits, int n);

// -log softmax(logits)[target] in nats.
double neg_log_likelihood(const float* logits, int n, int target);

// Index of the largest value; lowest index on ties; NaN never wins (0 when all are NaN).
int argmax(const float* x, int n);

// Nearest-rank percentile: the smallest value v such that at least p % of the
// values are <= v (p in (0, 100]); 0 for no values.
double percentile(std::vector<double> values, double p);

// Accumulates per-position scores of one codec over a text.
class QualitySummary {
 public:
  void add_kl(double kl, bool top1_agrees);
  void add_nll(double nll);

  int64_t kl_positions() const { return int64_t(kl_.size()); }
  int64_t nll_positions() const { return n_nll_; }
  double mean_kl() const;
  double p99_kl() const { return percentile(kl_, 99.0); }
  double max_kl() const;
  double top1_pct() const;   // % of positions whose argmax equals the reference's
  double mean_nll() const;   // nats per token
  double perplexity() const; // exp(mean_nll)

 private:
  std::vector<double> kl_;
  int64_t agree_ = 0;
  double nll_sum_ = 0;
  int64_t n_nll_ = 0;
};

}  // namespace kvq::eval
