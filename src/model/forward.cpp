#include "model/forward.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/error.hpp"
#include "core/log.hpp"

namespace kvq {

namespace {
// The LM head runs over at most this many tokens at once, which bounds the
// logits scratch (rows x vocab floats) when every position's logits are wanted.
constexpr int kLogitRows = 32;
// A recorded decode step of several sequences (Model::batch_step) runs the
// LM head over all its rows at once, up to this many (the scheduler's
// largest decode batch): the logits scratch grows to the step's rows then.
constexpr int kBatchStepRows = 256;
}  // namespace

Model::Model(ModelConfig cfg, ModelWeights weights, Backend& backend)
    : cfg_(std::move(cfg)), w_(std::move(weights)), backend_(backend), own_run_(backend) {
  KVQ_CHECK(int(w_.layers.size()) == cfg_.n_layers, Errc::internal, "model has ", w_.layers.size(),
            " layer weight sets for ", cfg_.n_layers, " layers");
  token_embd_ = backend_.upload(w_.token_embd);
  output_ = backend_.upload(w_.output);
  output_norm_ = upload_vector(w_.output_norm);
  for (const LayerWeights& L : w_.layers) {
    LayerDev d;
    d.wq = backend_.upload(L.wq);
    d.wk = backend_.upload(L.wk);
    d.wv = backend_.upload(L.wv);
    d.wo = backend_.upload(L.wo);
    d.w_gate = backend_.upload(L.w_gate);
    d.w_up = backend_.upload(L.w_up);
    d.w_down = backend_.upload(L.w_down);
    d.attn_norm = upload_vector(L.attn_norm);
    d.ffn_norm = upload_vector(L.ffn_norm);
    if (cfg_.qk_norm) {
      d.q_norm = upload_vector(L.q_norm);
      d.k_norm = upload_vector(L.k_norm);
    }
    layers_.push_back(d);
  }
  set_step_graphs(backend_.options().step_graphs);
}

void Model::set_step_graphs(bool on) {
  step_graphs_ = on && backend_.supports_step_graphs();
  own_run_.drop_recordings();
  own_run_.warm_cache_ = 0;
}

Model::~Model() = default;

float* Model::upload_vector(const std::vector<float>& v) {
  owned_.push_back(backend_.alloc(v.size()));
  float* p = owned_.back()->data();
  backend_.upload(v.data(), p, v.size());
  return p;
}

kv::CacheShape Model::cache_shape(int max_tokens) const {
  kv::CacheShape s;
  s.n_layers = cfg_.n_layers;
  s.n_kv_heads = cfg_.n_kv_heads;
  s.head_dim = cfg_.head_dim;
  s.max_tokens = max_tokens;
  s.n_heads = cfg_.n_heads;
  return s;
}

uint64_t Model::step_weight_bytes() const {
  auto bytes = [](const Matrix& m) { return uint64_t(m.rows) * m.row_bytes; };
  auto floats = [](const std::vector<float>& v) { return uint64_t(v.size()) * sizeof(float); };
  uint64_t n = w_.token_embd.row_bytes + bytes(w_.output) + floats(w_.output_norm);  // one embedding row
  for (const LayerWeights& l : w_.layers) {
    for (const Matrix* m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) n += bytes(*m);
    n += floats(l.attn_norm) + floats(l.ffn_norm) + floats(l.q_norm) + floats(l.k_norm);
  }
  return n;
}

void Model::ensure_scratch(RunState& r, int n) {
  if (n <= r.scratch_tokens_) return;
  const size_t d = cfg_.d_model, q_dim = size_t(cfg_.n_heads) * cfg_.head_dim,
               kv_dim = size_t(cfg_.n_kv_heads) * cfg_.head_dim, ff = cfg_.d_ff;
  r.x_ = backend_.alloc(n * d);
  r.h_ = backend_.alloc(n * d);
  r.q_ = backend_.alloc(n * q_dim);
  r.k_ = backend_.alloc(n * kv_dim);
  r.v_ = backend_.alloc(n * kv_dim);
  r.attn_ = backend_.alloc(n * q_dim);
  r.gate_ = backend_.alloc(n * ff);
  r.up_ = backend_.alloc(n * ff);
  r.logit_rows_ = std::max(r.logit_rows_, std::min(n, kLogitRows));
  r.logits_ = backend_.alloc(size_t(r.logit_rows_) * cfg_.vocab_size);
  r.scratch_tokens_ = n;
  r.drop_recordings();
  r.warm_cache_ = 0;
}

void Model::forward(const int32_t* ids, int n, int pos, kv::Cache& cache, float* logits, bool all_logits,
                    RunState& r) {
  KVQ_CHECK(n > 0, Errc::invalid_argument, "forward: no tokens to process");
  KVQ_CHECK(&r.backend_ == &backend_, Errc::internal, "forward: a run state of another backend");
  const size_t vocab = size_t(cfg_.vocab_size);
  check_fits(cache, pos, n);
  if (n == 1 && step_graphs_ && !r.graphs_failed_) {
    decode_step(r, ids[0], pos, cache);
    backend_.download(r.logits_->data(), logits, vocab);
    return;
  }
  const std::vector<int32_t> pages = kv::identity_pages(kv::pages_for(pos + n, cache.shape().page_tokens));
  const StepBatch b = StepBatch::one_sequence(ids, n, pos, pages, cache.shape().page_tokens,
                                              all_logits ? StepBatch::Logits::all : StepBatch::Logits::last);
  forward(b, cache, logits, r);
}

template <class F>
void Model::lm_head_runs(RunState& r, const StepBatch& b, F&& use) {
  // Final norm and LM head, only for the rows whose logits are wanted:
  // consecutive rows in one call, up to kLogitRows at a time, into
  // r.logits_; use(first index into logit_rows, rows) takes them from there.
  const int d = cfg_.d_model;
  const std::vector<int32_t>& want = b.logit_rows;
  for (size_t i = 0; i < want.size();) {
    size_t j = i + 1;
    while (j < want.size() && want[j] == want[j - 1] + 1 && int(j - i) < kLogitRows) ++j;
    const int rows = int(j - i);
    const Matrix* head = &output_;
    float* logits = r.logits_->data();
    backend_.norm_matmul(r.x_->data() + size_t(want[i]) * d, output_norm_, rows, d, cfg_.norm_eps, r.h_->data(),
                         &head, &logits, 1);
    use(i, rows);
    i = j;
  }
}

void Model::forward(const StepBatch& b, kv::Cache& cache, float* logits, RunState& r) {
  KVQ_CHECK(b.n_tok() > 0, Errc::invalid_argument, "forward: no tokens to process");
  KVQ_CHECK(&r.backend_ == &backend_, Errc::internal, "forward: a run state of another backend");
  const size_t vocab = size_t(cfg_.vocab_size);
  if (batch_step(r, b, cache)) {
    backend_.download(r.logits_->data(), logits, size_t(b.n_tok()) * vocab);
    return;
  }
  run_layers(r, b, cache);
  lm_head_runs(r, b, [&](size_t i, int rows) {
    backend_.download(r.logits_->data(), logits + i * vocab, size_t(rows) * vocab);
  });
}

void Model::forward_argmax(const StepBatch& b, kv::Cache& cache, int vocab, int32_t* out, RunState& r) {
  KVQ_CHECK(vocab > 0 && vocab <= cfg_.vocab_size, Errc::internal, "forward_argmax over ", vocab,
            " logits of a model with ", cfg_.vocab_size);
  KVQ_CHECK(&r.backend_ == &backend_, Errc::internal, "forward_argmax: a run state of another backend");
  const bool replayed = batch_step(r, b, cache);
  if (!replayed) run_layers(r, b, cache);
  auto choose = [&](size_t i, int rows) {
    r.chosen_value_.resize(size_t(rows));
    backend_.argmax_rows(r.logits_->data(), rows, size_t(vocab), size_t(cfg_.vocab_size), out + i,
                         r.chosen_value_.data());
    for (int k = 0; k < rows; ++k)
      KVQ_CHECK(std::isfinite(r.chosen_value_[size_t(k)]), Errc::format, "the model produced no finite logit for row ",
                b.logit_rows[i + size_t(k)], " of the step (the largest is ", r.chosen_value_[size_t(k)],
                "): its weights or activations hold NaN/inf");
  };
  if (replayed)
    choose(0, b.n_tok());
  else
    lm_head_runs(r, b, choose);
}

bool Model::batch_step(RunState& r, const StepBatch& b, kv::Cache& cache) {
  const int n = b.n_tok();
  // One sequence over its identity table is decode_step's; over a block
  // table (a paged sequence alone in its step, a Session with an exact
  // window) it is a step of this kind, recorded like the others (run
  // directly it re-uploaded the step's tables before every layer's ops).
  if (!step_graphs_ || r.graphs_failed_ || (b.n_seq() < 2 && b.is_one_contiguous_sequence()) || n > kBatchStepRows ||
      int(b.logit_rows.size()) != n)
    return false;
  int stride = 0;
  for (int z = 0; z < b.n_seq(); ++z) {
    const kv::QueryRun& run = b.runs[size_t(z)];
    if (run.n != 1 || run.first != z || b.logit_rows[size_t(z)] != z) return false;
    stride = std::max(stride, run.n_pages);
  }
  ensure_scratch(r, n);  // before begin_step: it drops recordings when it grows
  if (r.logit_rows_ < n) {  // the LM head over every row at once
    r.logit_rows_ = n;
    r.logits_ = backend_.alloc(size_t(n) * cfg_.vocab_size);
    r.drop_recordings();
  }
  Backend& be = backend_;
  auto run_direct = [&] {
    run_layers(r, b, cache);
    const Matrix* head = &output_;
    float* logits = r.logits_->data();
    be.norm_matmul(r.x_->data(), output_norm_, n, cfg_.d_model, cfg_.norm_eps, r.h_->data(), &head, &logits, 1);
  };
  const uint64_t tick = ++r.batch_steps_;
  auto same = [&](const RunState::BatchGraph& g) { return g.n_tok == n && g.stride == stride && g.cache == cache.id(); };
  be.begin_step(b);
  try {
    auto found = std::find_if(r.batch_graphs_.begin(), r.batch_graphs_.end(), same);
    if (found != r.batch_graphs_.end() && be.replay(*found->graph, cache)) {
      found->last_used = tick;
      ++r.batch_replays_;
    } else if (found == r.batch_graphs_.end() && !same(r.last_batch_shape_)) {
      // A shape not seen in the step before: run it (and size its scratch).
      run_direct();
      r.last_batch_shape_ = {n, stride, cache.id(), tick, nullptr};
    } else {
      if (found != r.batch_graphs_.end()) r.batch_graphs_.erase(found);  // recorded over other buffers
      be.record_begin();
      std::unique_ptr<StepGraph> graph;
      try {
        run_direct();
        graph = be.record_end();
        ++r.recordings_;
      } catch (const Error& e) {
        // Nothing of this step ran while recording: say why, stop recording
        // for this run state and run the step directly.
        be.record_abort();
        r.graphs_failed_ = true;
        r.batch_graphs_.clear();
        log_warn("recording a decode step of ", b.n_seq(), " sequences failed, running without step graphs: ",
                 e.what());
        run_direct();
        be.end_step();
        return true;
      } catch (...) {
        be.record_abort();
        throw;
      }
      KVQ_CHECK(be.replay(*graph, cache), Errc::internal, "a decode step just recorded does not replay");
      if (r.batch_graphs_.size() >= RunState::kBatchGraphs)
        r.batch_graphs_.erase(std::min_element(r.batch_graphs_.begin(), r.batch_graphs_.end(),
                                               [](const auto& a, const auto& c) { return a.last_used < c.last_used; }));
      r.batch_graphs_.push_back({n, stride, cache.id(), tick, std::move(graph)});
    }
  } catch (...) {
    be.end_step();
    throw;
  }
  be.end_step();
  return true;
}

void Model::check_fits(const kv::Cache& cache, int pos, int n) const {
  const int64_t max_tokens = cache.shape().max_tokens;
  KVQ_CHECK(pos >= 0 && int64_t(pos) + n <= max_tokens, Errc::out_of_range, "tokens [", pos, ", ", pos + n,
            ") do not fit the context of ", max_tokens, " tokens; raise --ctx or shorten the prompt");
}

int32_t Model::forward_argmax(int32_t id, int pos, kv::Cache& cache, int vocab, RunState& r, float* chosen_logit) {
  KVQ_CHECK(vocab > 0 && vocab <= cfg_.vocab_size, Errc::internal, "forward_argmax over ", vocab,
            " logits of a model with ", cfg_.vocab_size);
  KVQ_CHECK(&r.backend_ == &backend_, Errc::internal, "forward_argmax: a run state of another backend");
  if (step_graphs_ && !r.graphs_failed_) {
    decode_step(r, id, pos, cache);
  } else {
    check_fits(cache, pos, 1);
    const std::vector<int32_t> pages = kv::identity_pages(kv::pages_for(pos + 1, cache.shape().page_tokens));
    run_layers(r, StepBatch::one_sequence(&id, 1, pos, pages, cache.shape().page_tokens, StepBatch::Logits::last),
               cache);
    lm_head_row(r, 0);
  }
  const int32_t best = backend_.argmax(r.logits_->data(), size_t(vocab));
  if (chosen_logit) backend_.download(r.logits_->data() + best, chosen_logit, 1);
  return best;
}

void Model::lm_head_row(RunState& r, int t) {
  Backend& be = backend_;
  const int d = cfg_.d_model;
  const Matrix* head = &output_;
  float* out = r.logits_->data();
  be.norm_matmul(r.x_->data() + size_t(t) * d, output_norm_, 1, d, cfg_.norm_eps, r.h_->data(), &head, &out, 1);
}

void Model::decode_step(RunState& r, int32_t id, int pos, kv::Cache& cache) {
  // Checked here because a replay does not pass through embed()/forward checks.
  KVQ_CHECK(id >= 0 && id < token_embd_.rows, Errc::out_of_range, "token id ", id,
            " is outside the model's vocabulary of ", token_embd_.rows, " tokens");
  const int64_t max_tokens = cache.shape().max_tokens;
  KVQ_CHECK(pos >= 0 && int64_t(pos) + 1 <= max_tokens, Errc::out_of_range, "token at position ", pos,
            " does not fit the context of ", max_tokens, " tokens; raise --ctx or shorten the prompt");
  ensure_scratch(r, 1);  // before begin_step: it may drop the recording
  const std::vector<int32_t> pages = kv::identity_pages(kv::pages_for(pos + 1, cache.shape().page_tokens));
  const StepBatch b = StepBatch::one_sequence(&id, 1, pos, pages, cache.shape().page_tokens, StepBatch::Logits::last);
  Backend& be = backend_;
  be.begin_step(b);
  try {
    if (r.step_graph_ && be.replay(*r.step_graph_, cache)) {
      // replayed
    } else if (r.warm_cache_ != cache.id()) {
      // First step over this cache: run it directly so lazily sized scratch exists.
      r.step_graph_.reset();
      run_layers(r, b, cache);
      lm_head_row(r, 0);
      r.warm_cache_ = cache.id();
    } else {
      r.step_graph_.reset();
      be.record_begin();
      try {
        run_layers(r, b, cache);
        lm_head_row(r, 0);
        r.step_graph_ = be.record_end();
        ++r.recordings_;
      } catch (const Error& e) {
        // Nothing of this step ran while recording: say why, stop recording
        // for this sequence and run the step directly (decoding stays
        // correct, only slower). Tests assert that steps are replayed.
        be.record_abort();
        r.step_graph_.reset();
        r.graphs_failed_ = true;
        log_warn("recording the decode step failed, running without step graphs: ", e.what());
        run_layers(r, b, cache);
        lm_head_row(r, 0);
        be.end_step();
        return;
      } catch (...) {
        be.record_abort();
        throw;
      }
      KVQ_CHECK(be.replay(*r.step_graph_, cache), Errc::internal, "a decode step just recorded does not replay");
    }
  } catch (...) {
    be.end_step();
    throw;
  }
  be.end_step();
}

void Model::run_layers(RunState& r, const StepBatch& b, kv::Cache& cache) {
  const int n = b.n_tok();
  KVQ_CHECK(n > 0, Errc::invalid_argument, "forward: no tokens to process");
  const kv::CacheShape& cs = cache.shape();
  KVQ_CHECK(cs.n_layers == cfg_.n_layers && cs.n_kv_heads == cfg_.n_kv_heads && cs.head_dim == cfg_.head_dim,
            Errc::internal, "KV cache shape does not match the model");
  ensure_scratch(r, n);
  Backend& be = backend_;
  const int d = cfg_.d_model, hd = cfg_.head_dim, nh = cfg_.n_heads, nkv = cfg_.n_kv_heads;
  const float eps = cfg_.norm_eps;
  const float scale = 1.0f / std::sqrt(float(hd));
  float *x = r.x_->data(), *h = r.h_->data(), *q = r.q_->data(), *k = r.k_->data(), *v = r.v_->data(),
        *attn = r.attn_->data(), *gate = r.gate_->data(), *up = r.up_->data();

  be.prepare_step(b);
  be.embed(token_embd_, b.token.data(), n, x);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const LayerDev& L = layers_[l];
    kv::LayerCache& lc = cache.layer(l);
    // attention block
    const Matrix* qkv_w[3] = {&L.wq, &L.wk, &L.wv};
    float* qkv_y[3] = {q, k, v};
    be.norm_matmul(x, L.attn_norm, n, d, eps, h, qkv_w, qkv_y, 3);
    be.qk_rope_write_kv(lc, b, q, k, v, nh, nkv, hd, cfg_.qk_norm ? L.q_norm : nullptr,
                        cfg_.qk_norm ? L.k_norm : nullptr, eps, w_.rope);
    be.attention(lc, b, q, nh, scale, attn);
    be.matmul_add(L.wo, attn, n, x, h);
    // MLP block
    be.mlp_residual(x, L.ffn_norm, n, d, eps, h, L.w_gate, L.w_up, L.w_down, up, gate);
  }
}

}  // namespace kvq
