#include "engine/session.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.hpp"
#include "core/timer.hpp"
#include "gguf/finite.hpp"
#include "tokenizer/tokenizer.hpp"

namespace kvq {

const char* to_string(StopReason r) {
  switch (r) {
    case StopReason::eog: return "eog";
    case StopReason::stop_string: return "stop string";
    case StopReason::max_tokens: return "max tokens";
    case StopReason::context_full: return "context full";
    case StopReason::cancelled: return "cancelled";
  }
  return "unknown";
}

Session::Session(Model& model, std::unique_ptr<kv::Cache> cache, const Tokenizer* tok, SessionOptions opts)
    : model_(model), cache_(std::move(cache)), run_(model.new_run_state()), tok_(tok), opts_(std::move(opts)) {
  KVQ_CHECK(cache_, Errc::internal, "Session needs a KV cache");
  KVQ_CHECK(opts_.ctx > 0, Errc::invalid_argument, "--ctx must be positive");
  KVQ_CHECK(opts_.prefill_chunk > 0, Errc::invalid_argument, "--prefill-chunk must be positive");
  KVQ_CHECK(cache_->shape().max_tokens >= opts_.ctx, Errc::internal, "KV cache holds ",
            cache_->shape().max_tokens, " tokens, fewer than the context of ", opts_.ctx);
  const kv::CacheShape& sh = cache_->shape();
  if (sh.window_pages > 0) {
    pool_ = std::make_unique<kv::PagePool>(sh.n_pages());
    exact_pool_ = std::make_unique<kv::PagePool>(sh.exact_pages);
    table_ = std::make_unique<kv::BlockTable>(*pool_, sh.page_tokens, *exact_pool_, sh.n_pages(), sh.window_pages);
  }
}

void Session::truncate(int n) {
  if (n < int(tokens_.size())) tokens_.resize(std::max(n, 0));
  if (!table_) return;
  // The next token fed (position size()) sees the window from page `first`;
  // pages of it that were packed meanwhile are fed again.
  const int P = cache_->shape().page_tokens, kept = int(tokens_.size());
  table_->shrink(kept);
  const int first = kv::window_first_page(kept + 1, P, cache_->shape().window_pages);
  if (table_->exact_from() > first) {
    tokens_.resize(size_t(first) * P);
    table_->shrink(first * P);
  }
}

void Session::reserve_window(int tokens) {
  table_->reserve(tokens, &moves_);
  kv::pack_moved_pages(*cache_, moves_);
}

const StepBatch& Session::step_batch(const TokenId* ids, int n, int pos, StepBatch::Logits logits) {
  const int P = cache_->shape().page_tokens;
  batch_.clear();
  reserve_window(pos + n);
  batch_.add_sequence(ids, n, pos, table_->pages().data(), int(table_->pages().size()), P, logits);
  return batch_;
}

std::vector<TokenId> Session::tokenize(const std::string& text, bool add_bos, bool parse_special) const {
  KVQ_CHECK(tok_, Errc::internal, "Session::tokenize without a tokenizer");
  std::vector<TokenId> ids;
  if (add_bos && tok_->add_bos() && tok_->bos() >= 0) ids.push_back(tok_->bos());
  const auto body = tok_->encode(text, parse_special);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

namespace {

// Index of the first NaN/infinite value of x[0..n), or -1.
int64_t first_non_finite(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return i;
  return -1;
}

}  // namespace

void Session::fail_non_finite(int pos, int64_t index, float value) const {
  // Say which weight is to blame when the model came from a file; scanning
  // every tensor takes a while, but only on this failure path.
  std::string cause;
  if (const gguf::File* f = model_.file()) {
    if (const auto bad = gguf::find_non_finite(*f))
      cause = str("tensor '", bad->tensor, "' holds ", bad->value, " at element ", bad->index,
                  ": the model file is corrupt (re-download or re-convert it)");
    else
      cause = "every weight in the file is finite, so the activations overflowed (try --device cpu, or report it)";
  } else {
    cause = "the model's weights or activations hold NaN/inf";
  }
  fail(Errc::format, "the model produced a non-finite logit (", value, " for token id ", index,
       ") at position ", pos, ": ", cause);
}

const std::vector<float>& Session::feed(const std::vector<TokenId>& ids) {
  const int vocab = model_.config().vocab_size;
  const int total = int(ids.size());
  if (total == 0) return last_logits_;
  KVQ_CHECK(int(tokens_.size()) + total <= opts_.ctx, Errc::out_of_range, "feeding ", total,
            " tokens after ", tokens_.size(), " would exceed the context of ", opts_.ctx, " tokens (--ctx)");
  last_logits_.resize(vocab);
  // With an exact window, the pages of the whole feed at once: those before
  // its window are written straight into packed pages (as BatchDecoder's
  // prompts are), whatever the chunks.
  if (table_) reserve_window(int(tokens_.size()) + total);
  for (int done = 0; done < total;) {
    const int n = std::min(opts_.prefill_chunk, total - done);
    const int pos = int(tokens_.size());
    if (sink_) {
      all_logits_.resize(size_t(n) * vocab);
      if (table_)
        model_.forward(step_batch(ids.data() + done, n, pos, StepBatch::Logits::all), *cache_, all_logits_.data(), *run_);
      else
        model_.forward(ids.data() + done, n, pos, *cache_, all_logits_.data(), true, *run_);
      for (int t = 0; t < n; ++t)
        if (const int64_t bad = first_non_finite(all_logits_.data() + size_t(t) * vocab, vocab); bad >= 0)
          fail_non_finite(pos + t, bad, all_logits_[size_t(t) * vocab + size_t(bad)]);
      for (int t = 0; t < n; ++t) sink_(ids[done + t], all_logits_.data() + size_t(t) * vocab, vocab);
      std::copy_n(all_logits_.data() + size_t(n - 1) * vocab, vocab, last_logits_.data());
    } else {
      if (table_)
        model_.forward(step_batch(ids.data() + done, n, pos, StepBatch::Logits::last), *cache_, last_logits_.data(),
                       *run_);
      else
        model_.forward(ids.data() + done, n, pos, *cache_, last_logits_.data(), false, *run_);
      // NaN weights make every logit NaN; sampling would then pick token 0
      // forever and exit successfully. The last row of each chunk is checked
      // (NaNs propagate to it from any earlier position).
      if (const int64_t bad = first_non_finite(last_logits_.data(), vocab); bad >= 0)
        fail_non_finite(pos + n - 1, bad, last_logits_[size_t(bad)]);
    }
    tokens_.insert(tokens_.end(), ids.begin() + done, ids.begin() + done + n);
    done += n;
    if (opts_.on_prefill_progress && total > 1) opts_.on_prefill_progress(done, total);
  }
  return last_logits_;
}

TokenId Session::feed_greedy(TokenId id, int vocab) {
  KVQ_CHECK(int(tokens_.size()) + 1 <= opts_.ctx, Errc::out_of_range, "feeding a token after ", tokens_.size(),
            " would exceed the context of ", opts_.ctx, " tokens (--ctx)");
  // The greedy path never sees a logits row, so the winning logit is checked:
  // a NaN hidden state makes every logit NaN and argmax would pick token 0
  // forever and succeed (issue 29). One float per step crosses to the host.
  float chosen = 0;
  TokenId next = 0;
  if (table_) {  // the step checks its winning logit itself (Errc::format)
    int32_t out = 0;
    model_.forward_argmax(step_batch(&id, 1, int(tokens_.size()), StepBatch::Logits::last), *cache_, vocab, &out,
                          *run_);
    next = out;
  } else {
    next = model_.forward_argmax(id, int(tokens_.size()), *cache_, vocab, *run_, &chosen);
    if (!std::isfinite(chosen)) fail_non_finite(int(tokens_.size()), next, chosen);
  }
  tokens_.push_back(id);
  return next;
}

GenerateResult Session::generate(const std::vector<TokenId>& prompt, const GenerateOptions& g,
                                 const std::function<void(const std::string&)>& on_text) {
  GenerateResult r;
  KVQ_CHECK(!prompt.empty(), Errc::invalid_argument, "the prompt is empty (it tokenized to no tokens)");
  KVQ_CHECK(int(prompt.size()) <= opts_.ctx, Errc::out_of_range, "the prompt has ", prompt.size(),
            " tokens but the context holds ", opts_.ctx, "; shorten the prompt or raise --ctx (the model allows ",
            model_.config().context_length, ")");
  // Reuse the cached prefix; always recompute at least the last prompt token
  // so there are logits to sample from.
  size_t common = 0;
  while (common < tokens_.size() && common < prompt.size() && tokens_[common] == prompt[common]) ++common;
  if (common == prompt.size()) --common;
  truncate(int(common));  // may keep fewer (an exact window's packed pages are fed again)
  const std::vector<TokenId> todo(prompt.begin() + ptrdiff_t(tokens_.size()), prompt.end());

  Sampler sampler(g.sampling);
  for (TokenId id : prompt) sampler.accept(id);

  Timer t_prefill;
  const std::vector<float>* logits = &feed(todo);
  r.prefill_s = t_prefill.seconds();
  r.n_prompt = int(todo.size());

  std::unique_ptr<StreamDecoder> detok;
  if (tok_) detok = std::make_unique<StreamDecoder>(*tok_);
  StopMatcher stops(g.stop);
  // Bytes of the healed prefix still to swallow from the stream (they are
  // the start of the first generated token and were part of the prompt).
  size_t swallow = g.healing.prefix.size();
  auto unhealed = [&](std::string s) {
    const size_t drop = std::min(swallow, s.size());
    s.erase(0, drop);
    swallow -= drop;
    return s;
  };
  auto emit = [&](const std::string& s) {
    if (s.empty()) return;
    r.text += s;
    if (on_text) on_text(s);
  };

  Timer t_decode;
  // Embedding tables are often padded past the tokenizer (Qwen3: 151936 rows,
  // 151669 tokens); ids without a token are never sampled.
  const int vocab = tok_ ? std::min(tok_->vocab_size(), model_.config().vocab_size) : model_.config().vocab_size;
  r.stop_reason = StopReason::max_tokens;
  bool last_fed = true;
  // Plain greedy decoding needs only the argmax of each step's logits: the
  // backend computes it and the logits stay where they are (on a GPU the
  // vocab-sized download per token is skipped). Any sampler state that reads
  // logits (temperature, penalties), a logits sink or token_logits takes the
  // download path.
  const SamplingParams& sp = g.sampling;
  const bool backend_greedy =
      !sink_ && !g.token_logits && sp.plain_greedy();
  TokenId greedy_next = -1;  // the backend's choice for the next token, when backend_greedy
  for (int i = 0; g.n_predict < 0 || i < g.n_predict; ++i) {
    TokenId id;
    if (i == 0 && g.healing.active()) {
      // Constrain the first token to those that start with the healed text.
      std::vector<float> masked(size_t(vocab), -std::numeric_limits<float>::infinity());
      for (TokenId a : g.healing.first_allowed)
        if (a >= 0 && a < vocab) masked[a] = (*logits)[a];
      id = sampler.sample(masked.data(), vocab);
    } else if (greedy_next >= 0) {
      id = greedy_next;
    } else {
      id = sampler.sample(logits->data(), vocab);
    }
    sampler.accept(id);
    r.tokens.push_back(id);
    r.token_s.push_back(t_decode.seconds());
    last_fed = false;
    if (g.on_token && !g.on_token(id, g.token_logits ? logits->data() : nullptr)) {
      r.stop_reason = StopReason::cancelled;
      break;
    }
    if ((g.stop_at_eog && tok_ && tok_->is_eog(id)) ||
        std::find(g.stop_tokens.begin(), g.stop_tokens.end(), id) != g.stop_tokens.end()) {
      r.stop_reason = StopReason::eog;
      break;
    }
    if (detok) {
      bool stopped = false;
      emit(stops.push(unhealed(detok->push(id)), &stopped));
      if (stopped) {
        r.stop_reason = StopReason::stop_string;
        break;
      }
    }
    if (g.n_predict >= 0 && i + 1 == g.n_predict) break;  // its logits are not needed
    if (int(tokens_.size()) >= opts_.ctx) {
      r.stop_reason = StopReason::context_full;
      break;
    }
    if (backend_greedy)
      greedy_next = feed_greedy(id, vocab);
    else
      logits = &feed({id});
    last_fed = true;
    ++r.n_decoded;
  }
  r.decode_s = t_decode.seconds();
  // A logits sink gets a row for every token, the final one included, so a
  // dump lines up with its token list; this extra step is not timed.
  if (sink_ && !last_fed && int(tokens_.size()) < opts_.ctx) feed({r.tokens.back()});
  if (detok && r.stop_reason != StopReason::stop_string && r.stop_reason != StopReason::cancelled) {
    bool stopped = false;
    emit(stops.push(unhealed(detok->flush()), &stopped));
    if (!stopped) emit(stops.flush());
  }
  return r;
}

}  // namespace kvq
