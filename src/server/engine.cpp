#include "server/engine.hpp"

#include "core/error.hpp"
#include "kv/codec_table.hpp"

namespace kvq::server {
namespace {

// Thrown from the prefill progress callback to stop a prefill whose client left.
struct Abandoned {};

}  // namespace

Engine::Engine(const Tokenizer& tok, int vocab, EngineSetup setup)
    : tok_(tok), vocab_(vocab), setup_(std::move(setup)), queue_(1, setup_.max_waiting) {
  KVQ_CHECK(setup_.make_session, Errc::internal, "Engine needs a session factory");
  thread_ = std::thread([this] {
    if (setup_.thread_init) setup_.thread_init();
    engine_loop();
  });
}

void Engine::check_codec(const std::string& kv_codec) const {
  if (setup_.check_codec) {
    setup_.check_codec(kv_codec);
  } else {
    kv::CodecOptions c;
    c.kv = kv_codec;
    kv::resolve_codec(c);
  }
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Engine::engine_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return task_ != nullptr || quit_; });
    if (!task_) return;  // quit with nothing left to run
    const std::function<void()>* f = task_;
    lock.unlock();
    std::exception_ptr err;
    try {
      (*f)();
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    task_ = nullptr;
    task_error_ = err;
    task_done_ = true;
    cv_.notify_all();
  }
}

void Engine::execute(const std::function<void()>& f) {
  std::unique_lock<std::mutex> lock(mu_);
  KVQ_CHECK(task_ == nullptr && !quit_, Errc::internal, "engine thread busy or stopped");
  task_ = &f;
  task_done_ = false;
  task_error_ = nullptr;
  cv_.notify_all();
  cv_.wait(lock, [&] { return task_done_; });
  if (task_error_) std::rethrow_exception(task_error_);
}

std::optional<GenerateResult> Engine::run(FairQueue::Ticket& ticket, const Job& job,
                                          const std::function<void(const std::string&)>& on_text,
                                          const std::function<bool()>& abandon, std::chrono::milliseconds poll) {
  auto give_up = [&] { return stopping_ || (abandon && abandon()); };
  if (!queue_.wait_turn(ticket, give_up, poll)) return std::nullopt;
  // The turn ends when this function returns, however it returns.
  struct EndTurn {
    FairQueue& q;
    FairQueue::Ticket& t;
    ~EndTurn() { q.finish(t); }
  } end_turn{queue_, ticket};

  std::optional<GenerateResult> out;
  execute([&] {
    std::unique_ptr<Session> session = setup_.make_session(job.kv_codec, job.ctx, [&](int, int) {
      if (give_up()) throw Abandoned{};
    });
    // Bytes the cache holds for its whole capacity (allocated up front).
    const uint64_t bytes = session->cache().bytes_for_tokens(session->cache().shape().max_tokens);
    kv_bytes_ += bytes;
    try {
      out = session->generate(job.prompt, job.gen, on_text);
    } catch (const Abandoned&) {
      out.reset();
    } catch (...) {
      session.reset();
      kv_bytes_ -= bytes;
      throw;
    }
    session.reset();  // the cache is freed before the next request's turn
    kv_bytes_ -= bytes;
  });
  return out;
}

}  // namespace kvq::server
