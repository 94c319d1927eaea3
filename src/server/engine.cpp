#include "server/engine.hpp"

#include <algorithm>
#include <future>

#include "core/error.hpp"
#include "core/log.hpp"
#include "kv/codec_table.hpp"
#include "tokenizer/tokenizer.hpp"

namespace kvq::server {

// ---------------------------------------------------------------------------
// Stream
// ---------------------------------------------------------------------------

bool Stream::wait(std::vector<Token>& out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !q_.empty() || ended_; });
  out.insert(out.end(), std::make_move_iterator(q_.begin()), std::make_move_iterator(q_.end()));
  q_.clear();
  return ended_;
}

bool Stream::ended() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ended_;
}

StopReason Stream::reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reason_;
}

std::string Stream::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

// ---------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------

Engine::Engine(const Tokenizer& tok, int vocab, EngineSetup setup)
    : tok_(tok), vocab_(vocab), max_waiting_(setup.max_waiting), thread_init_(std::move(setup.thread_init)) {
  KVQ_CHECK(setup.model, Errc::internal, "Engine needs a model");
  KVQ_CHECK(setup.store, Errc::internal, "Engine needs a KV pool");
  KVQ_CHECK(max_waiting_ >= 0, Errc::invalid_argument, "--max-queue must be >= 0");
  codec_ = setup.store->codec_name();
  window_suffix_ = kv::exact_window_suffix(setup.store->shape().window_pages);
  page_bytes_ = setup.store->bytes_for_tokens(setup.store->shape().page_tokens);
  pool_bytes_ = setup.store->capacity_bytes();
  for (int i = 0; i < tok.vocab_size(); ++i)
    if (tok.is_eog(i)) eog_.push_back(i);
  SchedulerOptions so = setup.scheduler;
  so.vocab = vocab;
  so.max_waiting = 0;  // the engine bounds sequences in flight (submit)
  // The scheduler (its run state and scratch) is made on the engine thread,
  // where every step runs.
  std::promise<void> ready;
  std::future<void> made = ready.get_future();
  thread_ = std::thread([this, &ready, &setup, so] {
    try {
      if (thread_init_) thread_init_();
      sched_ = std::make_unique<Scheduler>(*setup.model, std::move(setup.store), so);
    } catch (...) {
      ready.set_exception(std::current_exception());
      return;
    }
    ready.set_value();
    engine_loop();
  });
  try {
    made.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

Engine::~Engine() {
  quit_ = true;
  if (sched_) sched_->cancel(0);  // wakes the engine thread (no sequence has id 0)
  thread_.join();
}

void Engine::check_codec(const std::string& kv_codec) const {
  // The pool's exact window is the server's (--kv-window): "k8v4" and
  // "k8v4+win1" both name a k8v4+win1 pool; another window does not.
  std::string name = kv_codec, window = window_suffix_;
  const size_t at = name.rfind("+win");
  if (at != std::string::npos && at + 4 < name.size() &&
      std::all_of(name.begin() + ptrdiff_t(at + 4), name.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
    window = name.substr(at);
    name.resize(at);
  }
  kv::CodecOptions c;
  c.kv = name;
  const kv::ResolvedCodec r = kv::resolve_codec(c);  // an unknown name says so, listing the names
  KVQ_CHECK(r.name + window == codec_, Errc::invalid_argument, "this server's KV pool holds codec '", codec_,
            "' (kvq serve --kv) and serves requests in that codec only; '", kv_codec,
            "' is not it (leave kv_codec out, or ask for '", codec_, "')");
}

void Engine::engine_loop() {
  while (!quit_) {
    if (!sched_->has_work()) {
      sched_->wait_for_work(std::chrono::milliseconds(100));
      continue;
    }
    try {
      sched_->step();
    } catch (const std::exception& e) {
      // A failed forward pass: every sequence in flight ends with the error
      // (a 500 to its client) rather than retrying a step that may fail again.
      log_warn("serve: a step failed: ", e.what());
      fail_all(e.what());
    }
  }
}

void Engine::fail_all(const std::string& message) {
  std::vector<std::shared_ptr<Stream>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : live_) all.push_back(s);
  }
  for (auto& s : all) {
    {
      std::lock_guard<std::mutex> lock(s->mu_);
      if (s->error_.empty()) s->error_ = message;
      s->ended_ = true;
    }
    s->cv_.notify_all();
    sched_->cancel(s->id_);
  }
}

void Engine::on_output(const std::shared_ptr<Stream>& s, const SeqOutput& o) {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(s->mu_);
    if (!s->ended_) {  // a failed stream hears nothing more
      for (TokenId id : o.tokens) {
        Stream::Token t;
        t.id = id;
        t.time = now;
        if (s->logprobs_ >= 0 && !o.logits.empty()) {
          t.has_logprob = true;
          t.logprob = token_logprob(o.logits.data(), vocab_, id, s->logprobs_);
        }
        s->q_.push_back(std::move(t));
      }
      if (o.finished) {
        s->ended_ = true;
        s->reason_ = o.reason;
      }
    }
  }
  s->cv_.notify_all();
  if (o.finished) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(o.id);
  }
}

std::vector<std::shared_ptr<Stream>> Engine::submit(std::vector<Job> jobs) {
  std::vector<std::shared_ptr<Stream>> out;
  std::lock_guard<std::mutex> lock(mu_);  // held until every stream is registered (on_output erases under it)
  if (live_.size() + jobs.size() > size_t(max_running()) + size_t(max_waiting_)) return out;
  const int max_seq = sched_->options().max_seq_tokens;
  try {
    for (Job& j : jobs) {
      auto s = std::make_shared<Stream>();
      s->logprobs_ = j.logprobs;
      SeqRequest r;
      r.prompt = std::move(j.prompt);
      r.sampling = j.sampling;
      // Without max_tokens the context end stops it (StopReason::context_full).
      r.max_tokens = j.max_tokens > 0 ? j.max_tokens : max_seq + 1;
      r.stop_tokens = std::move(j.stop_tokens);
      if (j.stop_at_eog) r.stop_tokens.insert(r.stop_tokens.end(), eog_.begin(), eog_.end());
      r.want_logits = j.logprobs >= 0;
      r.cache_prefix = j.cache_prompt;
      r.on_output = [this, s](const SeqOutput& o) { on_output(s, o); };
      const std::optional<SeqId> id = sched_->submit(std::move(r));
      KVQ_CHECK(id, Errc::internal, "the scheduler refused a sequence");  // it has no bound of its own here
      s->id_ = *id;
      live_[*id] = s;
      out.push_back(std::move(s));
    }
  } catch (...) {
    for (auto& s : out) sched_->cancel(s->id_);
    throw;
  }
  return out;
}

void Engine::cancel(const Stream& s) {
  if (!s.ended()) sched_->cancel(s.id_);
}

}  // namespace kvq::server
