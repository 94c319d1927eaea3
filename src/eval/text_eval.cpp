#include "eval/text_eval.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "engine/session.hpp"
#include "kv/block.hpp"
#include "model/forward.hpp"

namespace kvq::eval {

std::vector<Window> plan_windows(int n_tokens, int ctx, int stride, int max_windows) {
  KVQ_CHECK(n_tokens >= 2, Errc::invalid_argument, "the text has ", n_tokens,
            " tokens; at least 2 are needed to score a prediction");
  KVQ_CHECK(ctx >= 2, Errc::invalid_argument, "--ctx must be at least 2 tokens");
  const int len = std::min(ctx, n_tokens);
  if (stride <= 0) stride = len;
  KVQ_CHECK(stride <= len, Errc::invalid_argument, "--stride ", stride, " exceeds the window of ", len,
            " tokens; tokens between windows would never be scored");
  std::vector<Window> w;
  for (int start = 0; start + len <= n_tokens; start += stride) {
    if (max_windows > 0 && int(w.size()) == max_windows) break;
    w.push_back({start, len, w.empty() ? 1 : std::max(1, len - stride)});
  }
  return w;
}

namespace {

// Runs the model over the first len - 1 tokens of the window with one cache
// and hands every scored row (the prediction of target j, j >= first_target)
// to `row(j, logits)`.
void run_window(Model& m, const EvalCodec& c, const std::vector<int32_t>& tokens, const Window& w,
                int prefill_chunk, const std::function<void(int, const float*)>& row) {
  SessionOptions so;
  so.ctx = w.len;
  so.prefill_chunk = prefill_chunk;
  Session s(m, make_session_cache(m, c, w.len), nullptr, so);
  int r = 0;
  s.set_logits_sink([&](TokenId, const float* logits, int) {
    const int target = r + 1;
    if (target >= w.first_target) row(target, logits);
    ++r;
  });
  s.feed(std::vector<TokenId>(tokens.begin() + w.start, tokens.begin() + w.start + w.len - 1));
  KVQ_CHECK(r == w.len - 1, Errc::internal, "the session produced ", r, " logits rows for ", w.len - 1, " tokens");
}

void fill(CodecQuality& q, const QualitySummary& s, bool has_kl) {
  q.positions = s.nll_positions();
  q.has_kl = has_kl;
  if (has_kl) {
    q.mean_kl = s.mean_kl();
    q.p99_kl = s.p99_kl();
    q.max_kl = s.max_kl();
    q.top1_pct = s.top1_pct();
  }
  q.mean_nll = s.mean_nll();
  q.ppl = s.perplexity();
}

CodecQuality describe(const EvalCodec& c, int head_dim) {
  CodecQuality q;
  q.codec = c;
  if (const auto r = resolve(c)) {
    q.k_bits = kv::block_bits_per_value(r->k, head_dim);
    q.v_bits = kv::block_bits_per_value(r->v, head_dim);
  }
  return q;
}

}  // namespace

TextEvalReport evaluate_text(Model& m, const std::vector<int32_t>& tokens, const std::vector<EvalCodec>& codecs,
                             const TextEvalOptions& opts) {
  TextEvalReport rep;
  rep.n_tokens = int(tokens.size());
  rep.opts = opts;
  rep.windows = plan_windows(int(tokens.size()), opts.ctx, opts.stride, opts.max_windows);
  const int V = m.config().vocab_size, D = m.config().head_dim;
  for (int32_t t : tokens)
    KVQ_CHECK(t >= 0 && t < V, Errc::invalid_argument, "token id ", t, " is outside the model's vocabulary of ", V);

  const size_t nc = codecs.size();
  std::vector<QualitySummary> sum(nc);
  for (const auto& c : codecs) rep.rows.push_back(describe(c, D));
  QualitySummary ref_sum;
  std::vector<float> ref_logits;  // the scored rows of the current window, [row][V]
  std::vector<double> ref_lz;     // their log-normalisers
  std::vector<int> ref_top;
  const int nw = int(rep.windows.size());

  for (int wi = 0; wi < nw; ++wi) {
    const Window& w = rep.windows[size_t(wi)];
    const int rows = w.len - w.first_target;
    auto target_of = [&](int j) { return tokens[size_t(w.start + j)]; };
    if (opts.ref) {
      if (opts.on_pass) opts.on_pass(opts.ref->label(), wi, nw);
      ref_logits.resize(size_t(rows) * V);
      ref_lz.resize(size_t(rows));
      ref_top.resize(size_t(rows));
      run_window(m, *opts.ref, tokens, w, opts.prefill_chunk, [&](int j, const float* logits) {
        const int r = j - w.first_target;
        std::copy_n(logits, V, ref_logits.data() + size_t(r) * V);
        ref_lz[size_t(r)] = log_sum_exp(logits, V);
        ref_top[size_t(r)] = argmax(logits, V);
        ref_sum.add_nll(ref_lz[size_t(r)] - double(logits[target_of(j)]));
      });
    }
    for (size_t ci = 0; ci < nc; ++ci) {
      CodecQuality& q = rep.rows[ci];
      if (!q.error.empty()) continue;
      if (opts.ref && codecs[ci] == *opts.ref) {  // the reference itself: identical rows by construction
        for (int r = 0; r < rows; ++r) {
          sum[ci].add_kl(0.0, true);
          sum[ci].add_nll(ref_lz[size_t(r)] - double(ref_logits[size_t(r) * V + size_t(target_of(w.first_target + r))]));
        }
        continue;
      }
      if (opts.on_pass) opts.on_pass(codecs[ci].label(), wi, nw);
      try {
        run_window(m, codecs[ci], tokens, w, opts.prefill_chunk, [&](int j, const float* logits) {
          const int r = j - w.first_target;
          if (opts.ref)
            sum[ci].add_kl(kl_divergence(ref_logits.data() + size_t(r) * V, ref_lz[size_t(r)], logits, V),
                           argmax(logits, V) == ref_top[size_t(r)]);
          sum[ci].add_nll(neg_log_likelihood(logits, V, target_of(j)));
        });
      } catch (const Error& e) {
        // A codec this backend cannot run (e.g. no GPU kernels yet) is
        // reported and skipped; anything else is a real failure.
        if (e.code() != Errc::unsupported) throw;
        q.error = e.what();
        q.unsupported = true;
      }
    }
  }
  for (size_t ci = 0; ci < nc; ++ci)
    if (rep.rows[ci].error.empty()) fill(rep.rows[ci], sum[ci], opts.ref.has_value());
  if (opts.ref) {
    rep.ref = describe(*opts.ref, D);
    fill(*rep.ref, ref_sum, false);
  }
  return rep;
}

}  // namespace kvq::eval
