// The one place the server touches the model: a continuous-batching
// Scheduler (engine/scheduler.hpp, docs/architecture.md "Scheduler") over
// one paged KV pool, driven by one engine thread.
//
// Every prompt of a request becomes a sequence (SeqRequest): many run at
// once, each decoding one token per step while others prefill in chunks
// beside them, their pages taken from the pool when admitted and given back
// when they finish, fail or are cancelled. The pool has one codec, the
// server's (--kv); a request may name only that one (check_codec).
//
// The engine thread calls Scheduler::step() in a loop and waits when there
// is nothing to do. Its output callback only pushes token ids (and, for
// logprobs, the token's log-probabilities) into the sequence's Stream, a
// per-request channel; the request's own thread drains the stream,
// detokenizes, matches stop strings and writes into the HTTP exchange. The
// engine thread never touches a socket and never waits for a client, so a
// slow or stalled client cannot slow a step. Cancelling a stream (a client
// that left, a stop string) sets the sequence's cancel flag, read at the next
// step, which frees its pages.
//
// All model work runs on the engine thread: OpenMP keeps a thread team per
// calling thread, so forward passes from many threads would multiply the
// compute threads.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/scheduler.hpp"
#include "server/openai.hpp"

namespace kvq {
class Tokenizer;
}

namespace kvq::server {

// What the engine needs from its owner (`kvq serve` builds it from the CLI options).
struct EngineSetup {
  Model* model = nullptr;
  // The KV pool: a paged store for the model (make_paged_pool,
  // engine/runtime.hpp), in the server's codec.
  std::unique_ptr<kv::Cache> store;
  // Scheduler options: max_running (--max-seqs), max_step_tokens
  // (--prefill-chunk), max_seq_tokens (--ctx). max_waiting and vocab are
  // the engine's (below).
  SchedulerOptions scheduler;
  // Sequences that may wait beyond the max_running that run (--max-queue):
  // a request whose prompts would take the sequences submitted and not yet
  // finished past max_running + max_waiting gets 429.
  int max_waiting = 32;
  // Runs first on the engine thread (OpenMP's thread count, for one, is a
  // per-thread setting).
  std::function<void()> thread_init;
};

// One prompt of a request.
struct Job {
  std::vector<TokenId> prompt;
  SamplingParams sampling;
  int max_tokens = -1;                // -1: until end of generation or the context end
  bool stop_at_eog = true;            // the tokenizer's end-of-generation tokens end it
  std::vector<TokenId> stop_tokens;   // more tokens that end it (stop_token_ids)
  int logprobs = -1;                  // -1: none; else alternatives listed per token
  bool cache_prompt = true;           // use and feed the prefix cache (when the server has one)
};

// One sequence's output channel: the engine thread pushes, the request's
// thread drains.
class Stream {
 public:
  struct Token {
    TokenId id = 0;
    std::chrono::steady_clock::time_point time;  // when the engine chose it
    bool has_logprob = false;
    TokenLogprob logprob;
  };
  // Waits until tokens arrive or the sequence ends, at most `timeout`, and
  // appends what arrived to `out`. Returns true once the sequence has ended
  // and every token is in `out`.
  bool wait(std::vector<Token>& out, std::chrono::milliseconds timeout);
  bool ended() const;
  // After the end: why the scheduler ended it, and a non-empty message when
  // generation failed.
  StopReason reason() const;
  std::string error() const;
  SeqId id() const { return id_; }

 private:
  friend class Engine;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Token> q_;
  bool ended_ = false;
  StopReason reason_ = StopReason::max_tokens;
  std::string error_;
  SeqId id_ = 0;
  int logprobs_ = -1;
};

class Engine {
 public:
  // vocab: the ids that can be sampled (tokenizer and embedding both have them).
  Engine(const Tokenizer& tok, int vocab, EngineSetup setup);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const Tokenizer& tokenizer() const { return tok_; }
  int vocab() const { return vocab_; }
  // The pool's codec name (what /v1/models reports is the CLI's spelling).
  const std::string& codec() const { return codec_; }
  // Throws kvq::Error naming the problem when kv_codec cannot be served: an
  // unknown name, or another codec than the pool's (one pool, one codec).
  void check_codec(const std::string& kv_codec) const;

  // Queues every job as a sequence, all or none: an empty vector when they
  // would take the sequences in flight past max_running + max_waiting (429).
  // A job the scheduler refuses is a kvq::Error (nothing stays queued).
  std::vector<std::shared_ptr<Stream>> submit(std::vector<Job> jobs);
  // Ends the stream's sequence at the next step (its pages go back then);
  // an ended stream is left alone.
  void cancel(const Stream& s);

  // Ends service: requests see stopping() and give up.
  void shut_down() { stopping_ = true; }
  bool stopping() const { return stopping_; }

  // The scheduler's counters as of its last step.
  SchedulerMetrics metrics() const { return sched_->metrics(); }
  int waiting() const { return metrics().waiting; }
  int running() const { return metrics().running; }
  int max_waiting() const { return max_waiting_; }
  int max_running() const { return sched_->options().max_running; }
  uint64_t page_bytes() const { return page_bytes_; }
  uint64_t kv_bytes() const { return uint64_t(metrics().pages_used) * page_bytes_; }  // pages held by sequences
  uint64_t pool_bytes() const { return pool_bytes_; }                              // the whole pool

 private:
  void engine_loop();
  // Every live stream fails with `message`; their sequences are cancelled.
  void fail_all(const std::string& message);
  void on_output(const std::shared_ptr<Stream>& s, const SeqOutput& o);

  const Tokenizer& tok_;
  int vocab_;
  int max_waiting_;
  std::string codec_;
  std::string window_suffix_;  // "+winW" of the pool's exact window, or ""
  uint64_t page_bytes_ = 0, pool_bytes_ = 0;
  std::vector<TokenId> eog_;  // the tokenizer's end-of-generation ids
  std::function<void()> thread_init_;
  std::unique_ptr<Scheduler> sched_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> quit_{false};

  std::mutex mu_;  // live_
  std::unordered_map<SeqId, std::shared_ptr<Stream>> live_;  // submitted, not yet ended
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace kvq::server
