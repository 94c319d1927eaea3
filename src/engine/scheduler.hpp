// Continuous batching over one paged KV store (issue 26, item 1;
// docs/architecture.md, "Scheduler"): many requests, each a sequence that
// waits, runs (prefill, then decode), may be preempted and resumed, and
// finishes. Every step() is one Model::forward over a StepBatch that mixes
// one decode token of every running sequence with prefill chunks of others,
// under a per-step token budget.
//
// A step, in order:
//   1. drain the inbox: requests submitted and cancelled from other threads
//      since the last step;
//   2. finish every cancelled sequence (waiting or running): its pages go
//      back to the pool now;
//   3. decode slots: each running sequence that has one token to feed
//      reserves the slot for it, in arrival order; when the pool has no page
//      left, the youngest running sequence is preempted (by recompute, below)
//      until the slot fits or the sequence itself was the youngest;
//   4. the batch: one token of each of those sequences, then prefill chunks
//      of running sequences still prefilling (oldest first) and then of
//      waiting sequences admitted now (oldest first), until max_step_tokens
//      tokens are in the step. A waiting sequence is admitted when the pool
//      has free pages for all the tokens it must prefill (its prompt, plus
//      what it generated before a preemption), and only in arrival order: a
//      sequence that does not fit keeps every later one waiting (oldest
//      first served; none overtakes);
//   5. one forward pass; each sequence whose pending tokens are all in the
//      store samples its next token; stop tokens, max_tokens and the
//      context end finish sequences, whose pages go back to the pool;
//   6. outputs (new tokens, finish reasons) go to each request's callback.
//
// With an exact window (a store shaped with CacheShape::window_pages), each
// sequence's newest pages are exact pages of a second pool sized for
// max_running windows; the pages that leave windows in a step are packed
// (Cache::pack_pages) before its forward pass. Only packed pages enter the
// prefix cache (a page is cached once it has left its sequence's window), and
// an adopter's window starts after what it adopted.
//
// With SchedulerOptions::prefix_cache, an admission first adopts the cached
// pages of the longest cached prefix of the sequence's tokens (whole pages,
// never its last token) and prefills only the rest; after each pass every
// page a sequence has filled goes into the cache (engine/prefix_cache.hpp).
// A reservation that the free list cannot serve evicts idle cached pages
// (least recently used leaves) before anything is preempted. A waiting
// sequence whose opening pages a running one is still prefilling waits for
// them (and with it every later arrival) instead of computing them again:
// n sequences sent with one prompt prefill it once.
//
// Preemption is by recompute: the preempted sequence's pages go back to
// the pool, it keeps its tokens and its sampler (history and random state)
// and goes back to the waiting queue in arrival order (ahead of every later
// request); when it is admitted again it prefills prompt + generated tokens
// and samples on from there, so its tokens are those of an uninterrupted
// run (bit for bit on the CPU backend). There is no swap to host memory: the
// pool is the memory we mean to fill, and recompute needs no host budget,
// no transfer path and no second copy of a codec's pages; it is what vLLM
// v1 does by default. Its price is a second prefill of the preempted
// tokens (not measured yet).
//
// Text, stop strings, token healing, detokenizing and logprobs stay with
// the caller (the server): the scheduler deals in token ids, and hands a
// request that asks for them (want_logits) the logits row of each token. The
// scheduler owns no thread: the caller's engine thread calls step() in a
// loop (wait_for_work() between steps when idle); submit(), cancel() and
// metrics() may be called from any thread.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "engine/batch_decoder.hpp"
#include "engine/prefix_cache.hpp"
#include "engine/sampler.hpp"
#include "engine/session.hpp"  // StopReason
#include "kv/cache.hpp"
#include "kv/page_pool.hpp"
#include "model/forward.hpp"

namespace kvq {

// Seconds on a monotonic clock; injectable so tests control time.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual double now() const = 0;  // must be callable from any thread
};
// std::chrono::steady_clock, in seconds since the clock was made.
class SteadyClock : public Clock {
 public:
  double now() const override;

 private:
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

using SeqId = uint64_t;  // 1, 2, 3, ... in arrival (submit) order

enum class SeqState { waiting, running, preempted, finished };
const char* to_string(SeqState s);

// What a request hears back: new tokens, and at the end why it ended.
struct SeqOutput {
  SeqId id = 0;
  std::vector<TokenId> tokens;  // sampled this step (one per step today); may be empty on a finish
  bool finished = false;
  StopReason reason = StopReason::max_tokens;  // when finished
  double time = 0;     // the scheduler clock when the token was chosen (or the sequence ended)
  double arrival = 0;  // the scheduler clock at submit(): time - arrival is TTFT on the first output
  int n_prompt = 0;
  int n_generated = 0;  // tokens generated so far, these included
  int preemptions = 0;  // times this sequence was preempted so far
  // With SeqRequest::want_logits: the logits row tokens[0] was sampled from
  // (the first `vocab` ids, SchedulerOptions::vocab); else empty.
  std::vector<float> logits;
};
// Called on the thread that runs step(), after the step's state is settled;
// it must not block (the server's will push into a per-request channel) and
// may call submit() and cancel().
using OutputFn = std::function<void(const SeqOutput&)>;

// One request.
struct SeqRequest {
  std::vector<TokenId> prompt;  // not empty
  SamplingParams sampling;      // its own sampler and seed
  int max_tokens = 128;         // >= 1
  // Sampling one of these ends the sequence (StopReason::eog); the token is
  // part of its output (the server adds the tokenizer's end-of-generation
  // tokens and does not stream their text).
  std::vector<TokenId> stop_tokens;
  OutputFn on_output;
  // Hand each sampled token's logits row to on_output (SeqOutput::logits;
  // the server's logprobs). A step with such a row downloads its logits
  // rows: the backend's greedy shortcut is off for that step.
  bool want_logits = false;
  // With SchedulerOptions::prefix_cache: start from the cached pages of the
  // longest cached prefix of the prompt, and leave this sequence's full
  // pages in the cache (false: neither; the server's cache_prompt).
  bool cache_prefix = true;
};

struct SchedulerOptions {
  // Tokens per forward step (decodes + prefill chunks); 0: the backend's
  // default_prefill_chunk() (512 on the CPU, 2048 on CUDA).
  int max_step_tokens = 0;
  // Running sequences at most (each decodes one token per step, so this is
  // the largest decode batch); 0: min(256, max_step_tokens). Must not exceed
  // max_step_tokens, so every running sequence's decode token fits a step.
  int max_running = 0;
  // Tokens one sequence may hold (prompt + generated); 0: the whole pool.
  // A sequence that reaches it ends with StopReason::context_full.
  int max_seq_tokens = 0;
  // Requests that may wait (submitted, not yet admitted; preempted ones do
  // not count); submit() refuses more (HTTP 429). 0: no limit.
  int max_waiting = 0;
  // Token ids that may be sampled: the first `vocab` (the tokenizer's, when
  // the embedding table is padded past it); 0: the model's vocab_size.
  int vocab = 0;
  // Let the backend choose greedy tokens when every row of a step samples
  // greedily without penalties (the logits stay where they are).
  bool backend_greedy = true;
  // Automatic prefix caching (engine/prefix_cache.hpp): full pages stay in
  // the pool after their sequences end, and a sequence admitted later whose
  // tokens start with theirs adopts them instead of prefilling them again.
  // Idle cached pages are evicted (least recently used) when a sequence
  // needs pages the free list does not have.
  bool prefix_cache = false;
};

// Counters for operators (/metrics) and tests. "now" fields describe the
// scheduler after the last step; step_* fields the last step that ran a
// forward pass; the rest are totals since construction.
struct SchedulerMetrics {
  int waiting = 0;    // submitted or preempted, not running (the inbox included)
  int running = 0;    // admitted: holding pages, prefilling or decoding
  int preempted = 0;  // of `waiting`: preempted, waiting to be resumed
  // pages_used: held by sequences; pages_cached: held only by the prefix
  // cache (idle, reclaimable); pages_free: in the free list. They add up to
  // pages_total.
  int pages_total = 0, pages_used = 0, pages_cached = 0, pages_free = 0;
  int step_prefill_tokens = 0, step_decode_tokens = 0;
  int step_sequences = 0;  // sequences in the last step's batch
  double step_seconds = 0;
  uint64_t steps = 0;  // steps that ran a forward pass
  uint64_t prefill_tokens = 0, decode_tokens = 0;
  uint64_t submitted = 0, admitted = 0, preemptions = 0, finished = 0, cancelled = 0, refused = 0;
  // Prefix cache: prompt tokens looked up at admission (the cacheable part:
  // all but the last, in whole pages) and those found cached (not prefilled).
  uint64_t prefix_lookup_tokens = 0, prefix_hit_tokens = 0;
  uint64_t prefix_evicted_pages = 0;
  // Sequences per step, over every step that ran: counts per bucket (not
  // cumulative) for upper bounds kBatchBounds, the last bucket above them.
  static constexpr std::array<int, 9> kBatchBounds = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  std::array<uint64_t, kBatchBounds.size() + 1> step_sequences_hist{};
  uint64_t step_sequences_sum = 0;
};

class Scheduler {
 public:
  // `store` must be shaped for the model (model.cache_shape(...), any page
  // size); its pages are this scheduler's pool. `clock`: nullptr for a
  // SteadyClock; else it must outlive the scheduler.
  Scheduler(Model& model, std::unique_ptr<kv::Cache> store, SchedulerOptions opts = {}, const Clock* clock = nullptr);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Thread-safe. Queues a request; it joins at the next step. Returns its
  // id, or nullopt when max_waiting requests already wait. A request that
  // can never run (an empty prompt, max_tokens < 1, bad sampling options, a
  // prompt longer than max_seq_tokens) is a kvq::Error here, on the
  // caller's thread.
  std::optional<SeqId> submit(SeqRequest req);
  // Thread-safe. Sets the sequence's cancel flag, read at the next step: the
  // sequence then finishes with StopReason::cancelled (one last output) and
  // its pages go back to the pool. Unknown or finished ids are ignored.
  void cancel(SeqId id);

  // One step (above). Returns the number of tokens it ran (0: nothing to do).
  // A forward pass that throws feeds nothing: every sequence keeps its
  // tokens, and the pages and admissions of the step stand (a next step
  // tries the same tokens again); what ended before the pass (cancels) is
  // delivered, then the error is rethrown. Ending the step's sequences on a
  // persistent error is the caller's choice (cancel them). An output
  // callback that throws is rethrown after the other callbacks ran.
  int step();
  // The stepping thread: whether a step would do anything (live sequences
  // or inbox entries).
  bool has_work() const;
  // The stepping thread: blocks until there is work (a submit() or cancel()
  // from another thread wakes it) or `timeout` passes; true when there is
  // work. For the engine thread between steps when idle.
  bool wait_for_work(std::chrono::milliseconds timeout);

  // Thread-safe: a copy of the counters as of the last step.
  SchedulerMetrics metrics() const;

  // The stepping thread only (tests, diagnostics). A finished or unknown id
  // gives SeqState::finished.
  SeqState state(SeqId id) const;
  // Tokens of a live sequence: prompt + generated (empty when not live).
  std::vector<TokenId> tokens(SeqId id) const;

  const SchedulerOptions& options() const { return opts_; }
  kv::PagePool& pool() { return pool_; }
  PrefixCache* prefix_cache() { return prefix_.get(); }
  kv::Cache& store() { return *store_; }
  Model& model() { return model_; }

 private:
  struct Sequence {
    SeqId id = 0;
    SeqState state = SeqState::waiting;
    std::vector<TokenId> tokens;  // prompt, then every sampled token
    int n_prompt = 0;
    int cached = 0;         // tokens whose K/V are in the store
    int prefill_until = 0;  // tokens below this, fed since admission, count as prefill
    kv::BlockTable table;
    Sampler sampler;
    int max_tokens = 0;
    std::vector<TokenId> stop_tokens;
    OutputFn on_output;
    bool cancelled = false;  // the flag read at every step
    int preemptions = 0;
    double arrival = 0;
    bool want_logits = false;
    bool cache_prefix = false;                // reads and feeds the prefix cache
    std::vector<PrefixCache::NodeId> nodes;   // cache nodes of its first full pages, in order
    int pending() const { return int(tokens.size()) - cached; }  // tokens to feed
    int generated() const { return int(tokens.size()) - n_prompt; }
  };
  using SeqPtr = std::unique_ptr<Sequence>;

  void drain_inbox();
  // Queues an output of s for this step's callbacks.
  void emit(Sequence& s, std::vector<TokenId> tokens, double time);
  // Ends s: its pages go back now; its last output says why.
  void finish(Sequence& s, StopReason reason, double time);
  void preempt(Sequence& s);
  bool try_reserve(Sequence& s, int tokens);
  kv::BlockTable new_table();
  // Pages a reservation may take: free ones and evictable cached ones.
  int available_pages() const;
  // Adopts the cached pages of s's longest cached prefix (admission).
  void adopt_cached_prefix(Sequence& s);
  // Puts s's newly filled full pages into the prefix cache.
  void cache_full_pages(Sequence& s);
  // Whether a running sequence is still prefilling whole pages that s
  // could adopt once they are cached (then s waits rather than computing
  // them a second time: n > 1, or many clients sending one prompt at once).
  bool shared_prefill_pending(const Sequence& s) const;
  void insert_waiting(SeqPtr s);
  void insert_running(SeqPtr s);
  // Moves finished sequences out of running_ and waiting_ into done_ (kept
  // until their last output is delivered).
  void remove_finished();
  // Copies the stepping thread's counters into metrics_ (under mu_).
  void publish_metrics();
  // Runs this step's output callbacks and drops the finished sequences;
  // returns the first exception a callback threw.
  std::exception_ptr deliver();

  Model& model_;
  std::unique_ptr<kv::Cache> store_;
  kv::PagePool pool_;
  // An exact window's pages (CacheShape::window_pages; null without one):
  // max_running windows at most, so a running sequence always finds its own.
  std::unique_ptr<kv::PagePool> exact_pool_;
  std::vector<kv::PageMove> moves_;  // pages leaving windows this step, packed before the pass
  std::unique_ptr<PrefixCache> prefix_;  // null: prefix caching off (after pool_: gives its pages back first)
  std::unique_ptr<RunState> run_;
  SchedulerOptions opts_;
  SteadyClock own_clock_;
  const Clock* clock_;
  int page_tokens_ = 0;

  std::deque<SeqPtr> waiting_;   // by arrival; preempted ones among them
  std::vector<SeqPtr> running_;  // by arrival; the youngest last
  StepBatch batch_;
  StepSample sampled_;
  std::vector<Sampler*> samplers_;
  std::vector<Sequence*> batch_seqs_;  // per run of batch_
  std::vector<Sequence*> row_seqs_;    // per logit row of batch_
  std::vector<SeqPtr> done_;           // finished this step, alive until their outputs are delivered
  struct Out {
    Sequence* seq;
    SeqOutput out;
  };
  std::vector<Out> out_;  // this step's outputs, in order
  SchedulerMetrics own_;               // the stepping thread's counters

  // Shared with other threads.
  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::vector<SeqPtr> inbox_;
  std::vector<SeqId> cancel_inbox_;
  SeqId next_id_ = 1;
  int queued_ = 0;  // waiting_ less the preempted, as of the last step (max_waiting)
  SchedulerMetrics metrics_;
};

}  // namespace kvq
