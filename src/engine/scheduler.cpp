#include "engine/scheduler.hpp"

#include <algorithm>
#include <exception>

#include "core/error.hpp"
#include "kv/page.hpp"

namespace kvq {

double SteadyClock::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

const char* to_string(SeqState s) {
  switch (s) {
    case SeqState::waiting: return "waiting";
    case SeqState::running: return "running";
    case SeqState::preempted: return "preempted";
    case SeqState::finished: return "finished";
  }
  return "?";
}

Scheduler::Scheduler(Model& model, std::unique_ptr<kv::Cache> store, SchedulerOptions opts, const Clock* clock)
    : model_(model),
      store_(std::move(store)),
      pool_(store_ ? store_->shape().n_pages() : 1),
      run_(model.new_run_state()),
      opts_(opts),
      clock_(clock ? clock : &own_clock_) {
  KVQ_CHECK(store_, Errc::internal, "Scheduler needs a KV store");
  const kv::CacheShape& s = store_->shape();
  KVQ_CHECK(s.max_tokens == s.n_pages() * s.page_tokens, Errc::internal, "a KV pool of ", s.max_tokens,
            " tokens is not a whole number of ", s.page_tokens, "-token pages");
  page_tokens_ = s.page_tokens;
  if (opts_.max_step_tokens == 0) opts_.max_step_tokens = model.backend().default_prefill_chunk();
  KVQ_CHECK(opts_.max_step_tokens > 0, Errc::invalid_argument, "max_step_tokens must be positive, not ",
            opts_.max_step_tokens);
  if (opts_.max_running == 0) opts_.max_running = std::min(256, opts_.max_step_tokens);
  KVQ_CHECK(opts_.max_running > 0 && opts_.max_running <= opts_.max_step_tokens, Errc::invalid_argument,
            "max_running (", opts_.max_running, ") must be between 1 and max_step_tokens (", opts_.max_step_tokens,
            "): every running sequence's decode token must fit a step");
  const int pool_tokens = s.max_tokens;
  if (opts_.max_seq_tokens == 0) opts_.max_seq_tokens = pool_tokens;
  KVQ_CHECK(opts_.max_seq_tokens > 0 && opts_.max_seq_tokens <= pool_tokens, Errc::invalid_argument,
            "max_seq_tokens (", opts_.max_seq_tokens, ") must be between 1 and the pool's ", pool_tokens, " tokens");
  if (opts_.vocab == 0) opts_.vocab = model.config().vocab_size;
  KVQ_CHECK(opts_.vocab > 0 && opts_.vocab <= model.config().vocab_size, Errc::invalid_argument, "vocab (",
            opts_.vocab, ") must be between 1 and the model's ", model.config().vocab_size);
  KVQ_CHECK(opts_.max_waiting >= 0, Errc::invalid_argument, "max_waiting must not be negative");
  if (s.window_pages > 0) {
    KVQ_CHECK(int64_t(s.exact_pages) >= int64_t(opts_.max_running) * s.window_pages, Errc::invalid_argument,
              "an exact window of ", s.window_pages, " pages for ", opts_.max_running, " running sequences needs ",
              int64_t(opts_.max_running) * s.window_pages, " exact pages; the store has ", s.exact_pages);
    exact_pool_ = std::make_unique<kv::PagePool>(s.exact_pages);
  }
  if (opts_.prefix_cache) prefix_ = std::make_unique<PrefixCache>(pool_, page_tokens_);
  own_.pages_total = metrics_.pages_total = pool_.n_pages();
  own_.pages_free = metrics_.pages_free = pool_.free_pages();
}

Scheduler::~Scheduler() = default;

// ---------------------------------------------------------------------------
// Other threads
// ---------------------------------------------------------------------------

std::optional<SeqId> Scheduler::submit(SeqRequest req) {
  KVQ_CHECK(!req.prompt.empty(), Errc::invalid_argument, "the prompt is empty (it tokenized to no tokens)");
  KVQ_CHECK(req.max_tokens >= 1, Errc::invalid_argument, "max_tokens must be at least 1, not ", req.max_tokens);
  KVQ_CHECK(int64_t(req.prompt.size()) <= opts_.max_seq_tokens, Errc::out_of_range, "the prompt has ",
            req.prompt.size(), " tokens; a sequence may hold at most ", opts_.max_seq_tokens);
  const int vocab = model_.config().vocab_size;
  for (TokenId t : req.prompt)
    KVQ_CHECK(t >= 0 && t < vocab, Errc::invalid_argument, "token id ", t, " is outside the vocabulary of ", vocab);
  req.sampling.validate();
  auto s = std::make_unique<Sequence>(Sequence{0, SeqState::waiting, std::move(req.prompt), 0, 0, 0,
                                               new_table(), Sampler(req.sampling),
                                               req.max_tokens, std::move(req.stop_tokens),
                                               std::move(req.on_output), false, 0, clock_->now(),
                                               req.want_logits, prefix_ && req.cache_prefix, {}});
  s->n_prompt = int(s->tokens.size());
  for (TokenId id : s->tokens) s->sampler.accept(id);
  SeqId id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (opts_.max_waiting > 0 && queued_ + int(inbox_.size()) >= opts_.max_waiting) {
      ++metrics_.refused;
      return std::nullopt;
    }
    id = next_id_++;
    s->id = id;
    inbox_.push_back(std::move(s));
    ++metrics_.submitted;
    ++metrics_.waiting;
  }
  work_cv_.notify_all();
  return id;
}

void Scheduler::cancel(SeqId id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancel_inbox_.push_back(id);
  }
  work_cv_.notify_all();
}

bool Scheduler::wait_for_work(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return work_cv_.wait_for(lock, timeout, [&] {
    return !inbox_.empty() || !cancel_inbox_.empty() || !running_.empty() || !waiting_.empty();
  });
}

bool Scheduler::has_work() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !inbox_.empty() || !cancel_inbox_.empty() || !running_.empty() || !waiting_.empty();
}

SchedulerMetrics Scheduler::metrics() const {
  std::lock_guard<std::mutex> lock(mu_);
  return metrics_;
}

// ---------------------------------------------------------------------------
// The stepping thread
// ---------------------------------------------------------------------------

SeqState Scheduler::state(SeqId id) const {
  for (const SeqPtr& s : running_)
    if (s->id == id) return s->state;
  for (const SeqPtr& s : waiting_)
    if (s->id == id) return s->state;
  std::lock_guard<std::mutex> lock(mu_);
  for (const SeqPtr& s : inbox_)
    if (s->id == id) return SeqState::waiting;
  return SeqState::finished;
}

std::vector<TokenId> Scheduler::tokens(SeqId id) const {
  for (const SeqPtr& s : running_)
    if (s->id == id) return s->tokens;
  for (const SeqPtr& s : waiting_)
    if (s->id == id) return s->tokens;
  return {};
}

void Scheduler::drain_inbox() {
  std::vector<SeqPtr> fresh;
  std::vector<SeqId> cancels;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fresh.swap(inbox_);
    cancels.swap(cancel_inbox_);
  }
  for (SeqPtr& s : fresh) insert_waiting(std::move(s));
  for (SeqId id : cancels) {
    for (SeqPtr& s : running_)
      if (s->id == id) s->cancelled = true;
    for (SeqPtr& s : waiting_)
      if (s->id == id) s->cancelled = true;
  }
}

void Scheduler::insert_waiting(SeqPtr s) {
  auto at = std::upper_bound(waiting_.begin(), waiting_.end(), s->id,
                             [](SeqId id, const SeqPtr& o) { return id < o->id; });
  waiting_.insert(at, std::move(s));
}

void Scheduler::insert_running(SeqPtr s) {
  auto at = std::upper_bound(running_.begin(), running_.end(), s->id,
                             [](SeqId id, const SeqPtr& o) { return id < o->id; });
  running_.insert(at, std::move(s));
}

int Scheduler::available_pages() const {
  return pool_.free_pages() + (prefix_ ? prefix_->evictable_pages() : 0);
}

kv::BlockTable Scheduler::new_table() {
  if (!exact_pool_) return kv::BlockTable(pool_, page_tokens_);
  const kv::CacheShape& sh = store_->shape();
  return kv::BlockTable(pool_, page_tokens_, *exact_pool_, sh.n_pages(), sh.window_pages);
}

bool Scheduler::try_reserve(Sequence& s, int tokens) {
  const int need = s.table.packed_pages_needed(tokens);
  if (need > pool_.free_pages()) {  // idle cached pages make up the difference, or nothing does
    if (need > available_pages()) return false;
    own_.prefix_evicted_pages += uint64_t(prefix_->evict(need - pool_.free_pages()));
    KVQ_CHECK(need <= pool_.free_pages(), Errc::internal, "prefix cache: evicted to ", pool_.free_pages(),
              " free pages of the ", need, " it counted as evictable");
  }
  s.table.reserve(tokens, &moves_);  // a window's exact pages: max_running windows fit (constructor)
  return true;
}

void Scheduler::adopt_cached_prefix(Sequence& s) {
  if (!s.cache_prefix) return;
  // Whole pages only, and never the last token: its logits row is what
  // the admission's prefill must produce.
  const int max_pages = (int(s.tokens.size()) - 1) / page_tokens_;
  PrefixCache::Match m = prefix_->match(s.tokens.data(), max_pages);
  s.table.adopt(m.pages);
  s.nodes = std::move(m.nodes);
  s.cached = m.tokens(page_tokens_);
}

bool Scheduler::shared_prefill_pending(const Sequence& s) const {
  if (!s.cache_prefix) return false;
  const size_t cacheable = size_t(int(s.tokens.size()) - 1) / size_t(page_tokens_);  // whole pages before the last token
  if (s.nodes.size() >= cacheable) return false;
  for (const SeqPtr& r : running_) {
    if (!r->cache_prefix || r->pending() <= 1) continue;  // decoding: what it will cache is cached already
    const size_t n = std::min(s.tokens.size(), r->tokens.size());
    const size_t same = size_t(std::mismatch(s.tokens.begin(), s.tokens.begin() + ptrdiff_t(n), r->tokens.begin()).first -
                               s.tokens.begin());
    const size_t pages = std::min(same / size_t(page_tokens_), cacheable);
    if (pages > s.nodes.size() && size_t(r->cached) < pages * size_t(page_tokens_)) return true;
  }
  return false;
}

void Scheduler::cache_full_pages(Sequence& s) {
  if (!s.cache_prefix) return;
  // Full pages that left the window (exact pages are private to their sequence).
  const size_t full = size_t(std::min(s.cached / page_tokens_, s.table.exact_from()));
  while (s.nodes.size() < full) {
    const size_t i = s.nodes.size();
    const PrefixCache::NodeId parent = i ? s.nodes[i - 1] : 0;
    const PrefixCache::NodeId id = prefix_->insert(parent, s.tokens.data() + i * size_t(page_tokens_), s.table.pages()[i]);
    // The cache had these tokens already (another sequence prefilled them at
    // the same time): share its page and free ours, so every node of s.nodes
    // is a page s holds and none of them can be evicted under it.
    if (prefix_->page(id) != s.table.pages()[i]) s.table.replace(i, prefix_->page(id));
    s.nodes.push_back(id);
  }
}

void Scheduler::emit(Sequence& s, std::vector<TokenId> tokens, double time) {
  SeqOutput o;
  o.id = s.id;
  o.tokens = std::move(tokens);
  o.time = time;
  o.n_prompt = s.n_prompt;
  o.n_generated = s.generated();
  o.preemptions = s.preemptions;
  o.arrival = s.arrival;
  out_.push_back({&s, std::move(o)});
}

void Scheduler::finish(Sequence& s, StopReason reason, double time) {
  s.table.clear();
  s.nodes.clear();
  s.state = SeqState::finished;
  // A token sampled this step is in out_ already: the finish goes with it.
  if (out_.empty() || out_.back().seq != &s) emit(s, {}, time);
  out_.back().out.finished = true;
  out_.back().out.reason = reason;
  ++own_.finished;
  if (reason == StopReason::cancelled) ++own_.cancelled;
}

void Scheduler::preempt(Sequence& s) {
  // Recompute: the pages go back; tokens and sampler stay; the next
  // admission prefills all of tokens (prompt + generated) again.
  s.table.clear();
  s.nodes.clear();
  s.cached = 0;
  s.state = SeqState::preempted;
  ++s.preemptions;
  ++own_.preemptions;
  for (size_t i = 0; i < running_.size(); ++i)
    if (running_[i].get() == &s) {
      SeqPtr p = std::move(running_[i]);
      running_.erase(running_.begin() + ptrdiff_t(i));
      insert_waiting(std::move(p));
      return;
    }
  KVQ_CHECK(false, Errc::internal, "preempted sequence ", s.id, " was not running");
}

void Scheduler::remove_finished() {
  auto sweep = [&](auto& list) {
    size_t kept = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i]->state == SeqState::finished)
        done_.push_back(std::move(list[i]));
      else
        list[kept++] = std::move(list[i]);
    }
    list.resize(kept);
  };
  sweep(running_);
  sweep(waiting_);
}

void Scheduler::publish_metrics() {
  own_.running = int(running_.size());
  own_.preempted = 0;
  for (const SeqPtr& s : waiting_) own_.preempted += s->state == SeqState::preempted;
  own_.pages_cached = prefix_ ? prefix_->idle_pages() : 0;
  own_.pages_used = pool_.used_pages() - own_.pages_cached;
  own_.pages_free = pool_.free_pages();
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t submitted = metrics_.submitted, refused = metrics_.refused;
  metrics_ = own_;
  metrics_.submitted = submitted;
  metrics_.refused = refused;
  metrics_.waiting = int(waiting_.size() + inbox_.size());
  queued_ = int(waiting_.size()) - own_.preempted;
}

int Scheduler::step() {
  const double t0 = clock_->now();
  drain_inbox();
  out_.clear();

  // Cancelled sequences leave first, so their pages serve this step.
  for (SeqPtr& s : running_)
    if (s->cancelled) finish(*s, StopReason::cancelled, t0);
  for (SeqPtr& s : waiting_)
    if (s->cancelled) finish(*s, StopReason::cancelled, t0);
  remove_finished();

  // Decode slots, oldest first; the youngest running sequence gives its
  // pages back (preemption by recompute) while one is missing.
  for (size_t i = 0; i < running_.size(); ++i) {
    Sequence& s = *running_[i];
    if (s.pending() != 1) continue;  // still prefilling: its pages were reserved at admission
    if (s.cached + 1 > opts_.max_seq_tokens) {
      finish(s, StopReason::context_full, t0);
      continue;
    }
    bool preempted_self = false;
    while (!try_reserve(s, s.cached + 1)) {
      Sequence* victim = nullptr;
      for (size_t j = running_.size(); j-- > 0;)
        if (running_[j]->state == SeqState::running) {
          victim = running_[j].get();
          break;
        }
      if (victim == &s && std::count_if(running_.begin(), running_.end(), [](const SeqPtr& o) {
                            return o->state == SeqState::running;
                          }) == 1) {
        // Alone and still no page: cannot happen while max_seq_tokens <=
        // the pool (checked at construction), kept as a clear end rather
        // than a loop.
        finish(s, StopReason::context_full, t0);
        break;
      }
      preempt(*victim);
      if (victim == &s) {
        preempted_self = true;
        break;
      }
    }
    if (preempted_self) break;  // everything younger is preempted too
  }
  remove_finished();

  // The batch: one decode token of every running sequence, then prefill
  // chunks (running ones oldest first, then admissions in arrival order)
  // while the budget lasts.
  batch_.clear();
  batch_seqs_.clear();
  row_seqs_.clear();
  int budget = opts_.max_step_tokens;
  int prefill = 0, decode = 0;
  auto add = [&](Sequence& s, int n) {
    const bool last = n == s.pending();
    batch_.add_sequence(s.tokens.data() + s.cached, n, s.cached, s.table.pages().data(),
                        int(s.table.pages().size()), page_tokens_,
                        last ? StepBatch::Logits::last : StepBatch::Logits::none);
    batch_seqs_.push_back(&s);
    if (last) row_seqs_.push_back(&s);
    const int pre = std::max(0, std::min(s.cached + n, s.prefill_until) - s.cached);
    prefill += pre;
    decode += n - pre;
    budget -= n;
  };
  for (SeqPtr& s : running_)
    if (s->pending() == 1) add(*s, 1);  // fits: running_.size() <= max_running <= max_step_tokens
  for (SeqPtr& s : running_) {
    if (budget == 0) break;
    if (s->pending() > 1) add(*s, std::min(s->pending(), budget));
  }
  while (budget > 0 && !waiting_.empty() && int(running_.size()) < opts_.max_running) {
    Sequence& s = *waiting_.front();
    adopt_cached_prefix(s);
    if (shared_prefill_pending(s) || !try_reserve(s, int(s.tokens.size()))) {  // oldest first: nobody overtakes it
      s.table.clear();
      s.nodes.clear();
      s.cached = 0;
      break;
    }
    if (s.cache_prefix) {
      own_.prefix_lookup_tokens += uint64_t((int(s.tokens.size()) - 1) / page_tokens_ * page_tokens_);
      own_.prefix_hit_tokens += uint64_t(s.cached);
    }
    s.state = SeqState::running;
    s.prefill_until = int(s.tokens.size());
    SeqPtr p = std::move(waiting_.front());
    waiting_.pop_front();
    insert_running(std::move(p));
    ++own_.admitted;
    add(s, std::min(s.pending(), budget));
  }

  // The pages that left windows, packed before the pass writes any exact page.
  kv::pack_moved_pages(*store_, moves_);

  const int n_tok = batch_.n_tok();
  if (n_tok > 0) {
    samplers_.clear();
    bool keep_logits = false;
    for (Sequence* s : row_seqs_) {
      samplers_.push_back(&s->sampler);
      keep_logits = keep_logits || s->want_logits;
    }
    try {
      forward_and_sample(model_, *store_, *run_, batch_, samplers_.data(), opts_.vocab,
                         opts_.backend_greedy && !keep_logits, sampled_);
    } catch (...) {
      // Nothing was fed: every sequence stays as it is and the next step
      // tries its tokens again. What ended before the pass is delivered.
      publish_metrics();
      std::exception_ptr err = std::current_exception();
      deliver();
      std::rethrow_exception(err);
    }
    for (size_t r = 0; r < batch_seqs_.size(); ++r) {
      batch_seqs_[r]->cached += batch_.runs[r].n;
      cache_full_pages(*batch_seqs_[r]);
    }
    const double now = clock_->now();
    for (size_t r = 0; r < row_seqs_.size(); ++r) {
      Sequence& s = *row_seqs_[r];
      const TokenId t = sampled_.chosen[r];
      s.tokens.push_back(t);
      emit(s, {t}, now);
      if (s.want_logits && !sampled_.logits.empty()) {
        const float* row = sampled_.logits.data() + r * size_t(model_.config().vocab_size);
        out_.back().out.logits.assign(row, row + opts_.vocab);
      }
      if (std::find(s.stop_tokens.begin(), s.stop_tokens.end(), t) != s.stop_tokens.end())
        finish(s, StopReason::eog, now);
      else if (s.generated() >= s.max_tokens)
        finish(s, StopReason::max_tokens, now);
      else if (int(s.tokens.size()) > opts_.max_seq_tokens)  // no slot for the token just sampled
        finish(s, StopReason::context_full, now);
    }
    remove_finished();
  }

  const double t1 = clock_->now();
  if (n_tok > 0) {
    ++own_.steps;
    own_.step_prefill_tokens = prefill;
    own_.step_decode_tokens = decode;
    own_.step_sequences = int(batch_seqs_.size());
    {
      const auto& bounds = SchedulerMetrics::kBatchBounds;
      const size_t bucket = size_t(std::lower_bound(bounds.begin(), bounds.end(), own_.step_sequences) - bounds.begin());
      ++own_.step_sequences_hist[bucket];
      own_.step_sequences_sum += uint64_t(own_.step_sequences);
    }
    own_.step_seconds = t1 - t0;
    own_.prefill_tokens += uint64_t(prefill);
    own_.decode_tokens += uint64_t(decode);
  }
  publish_metrics();

  std::exception_ptr err = deliver();
  if (err) std::rethrow_exception(err);
  return n_tok;
}

std::exception_ptr Scheduler::deliver() {
  // Outputs last, with the state settled; every callback runs even when
  // one throws (the first exception is returned).
  std::exception_ptr err;
  for (const Out& o : out_) {
    if (!o.seq->on_output) continue;
    try {
      o.seq->on_output(o.out);
    } catch (...) {
      if (!err) err = std::current_exception();
    }
  }
  out_.clear();
  done_.clear();  // finished sequences go only now: their callbacks ran
  return err;
}

}  // namespace kvq
