// The one place the server touches the model. Each request gets its own
// Session over a fresh KV cache (its own codec), created when its turn comes
// and freed when it ends, whether it finished, failed or its client left.
//
// One sequence runs at a time and the others wait in a fair FIFO
// (FairQueue): each request runs Session::generate, a loop over one
// sequence. The step batch (engine/batch_decoder.hpp, docs/architecture.md)
// is what the serving scheduler will drive instead (issue 26).
//
// Generation runs on one engine thread, whichever HTTP worker thread the
// request arrived on: OpenMP keeps a thread team per calling thread, so
// forward passes from many HTTP threads would multiply the compute threads.
// The request's thread blocks while its job runs; the job's callbacks run on
// the engine thread. (check_codec, which asks the backend for a one-token
// cache of a request's codec, runs on the HTTP thread.)
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/session.hpp"
#include "server/fair_queue.hpp"

namespace kvq {
class Tokenizer;
}

namespace kvq::server {

// A Session over a fresh cache of `ctx` tokens with codec `kv_codec` (empty:
// the server's default), calling on_prefill_chunk(done, total) after each
// prefill chunk.
using SessionFactory = std::function<std::unique_ptr<Session>(const std::string& kv_codec, int ctx,
                                                              std::function<void(int, int)> on_prefill_chunk)>;

// What the engine needs from its owner (`kvq serve` builds it from the CLI options).
struct EngineSetup {
  SessionFactory make_session;
  // Throws kvq::Error when a request's kv_codec cannot be served (an unknown
  // name, or one the backend does not support); called on request threads,
  // before the request queues. Empty: the codec table decides.
  std::function<void(const std::string& kv_codec)> check_codec;
  // Runs first on the engine thread (OpenMP's thread count, for one, is a
  // per-thread setting).
  std::function<void()> thread_init;
  int max_waiting = 32;  // requests that may wait for their turn (--max-queue)
};

struct Job {
  std::vector<TokenId> prompt;
  GenerateOptions gen;   // n_predict, stop, sampling; on_token returning false cancels
  std::string kv_codec;  // empty: the server's default
  int ctx = 0;           // KV capacity in tokens (prompt + room to generate)
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
  // Throws kvq::Error naming the problem when kv_codec cannot be served.
  void check_codec(const std::string& kv_codec) const;

  // A place in the queue, or nullptr when it is full (HTTP 429).
  std::unique_ptr<FairQueue::Ticket> enter() { return queue_.enter(); }

  // Waits for the ticket's turn, then prefills and generates on a fresh
  // session. `abandon` is polled while waiting and between prefill chunks
  // (every `poll`); when it returns true the request is dropped: nullopt
  // before or during prefill. During decoding the job's on_token decides
  // (StopReason::cancelled). Errors propagate (kvq::Error). on_text,
  // on_token and abandon (once the turn came) run on the engine thread
  // while the caller waits, so they may use the caller's state unlocked.
  std::optional<GenerateResult> run(FairQueue::Ticket& ticket, const Job& job,
                                    const std::function<void(const std::string&)>& on_text,
                                    const std::function<bool()>& abandon,
                                    std::chrono::milliseconds poll = std::chrono::milliseconds(200));

  // Ends service: waiting requests give up, running ones should see stopping().
  void shut_down() { stopping_ = true; }
  bool stopping() const { return stopping_; }

  int waiting() const { return queue_.waiting(); }
  int running() const { return queue_.running(); }
  int max_waiting() const { return queue_.max_waiting(); }
  uint64_t kv_bytes() const { return kv_bytes_; }  // allocated for live sessions

 private:
  // Runs f on the engine thread and waits for it; rethrows what it threw.
  void execute(const std::function<void()>& f);
  void engine_loop();

  const Tokenizer& tok_;
  int vocab_;
  EngineSetup setup_;
  FairQueue queue_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> kv_bytes_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void()>* task_ = nullptr;
  bool task_done_ = false;
  bool quit_ = false;
  std::exception_ptr task_error_;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace kvq::server
