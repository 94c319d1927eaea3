// Turn-taking for requests that share one model: first come, first served,
// with a bound on how many may wait. A request enters (or is turned away when
// the queue is full), waits for its turn, runs, and leaves; leaving at any
// point (a client that hung up while waiting) frees its place.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>

namespace kvq::server {

class FairQueue {
 public:
  // max_running: requests that may run at once; max_waiting: how many more
  // may queue behind them before enter() turns requests away.
  FairQueue(int max_running, int max_waiting);
  FairQueue(const FairQueue&) = delete;
  FairQueue& operator=(const FairQueue&) = delete;

  // A place in the queue. Destroying it leaves the queue, or ends its turn.
  class Ticket {
   public:
    ~Ticket();
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    bool running() const { return running_; }

   private:
    friend class FairQueue;
    Ticket(FairQueue& q, uint64_t n) : q_(q), n_(n) {}
    FairQueue& q_;
    uint64_t n_;
    bool running_ = false;
  };

  // A place at the back, or nullptr when the running slots are taken and
  // max_waiting requests already wait.
  std::unique_ptr<Ticket> enter();
  // Blocks until it is t's turn (true), or until give_up() returns true
  // (false; give_up is polled every `poll` and when the queue moves, on the
  // waiting thread). Turns are taken strictly in order of enter().
  bool wait_turn(Ticket& t, const std::function<bool()>& give_up, std::chrono::milliseconds poll);
  // Ends the turn early (the ticket's destructor does it too).
  void finish(Ticket& t);

  int waiting() const;
  int running() const;
  int max_waiting() const { return max_waiting_; }

 private:
  void leave(Ticket& t);

  const int max_running_;
  const int max_waiting_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<uint64_t> queue_;  // waiting tickets in arrival order
  int running_ = 0;
  uint64_t next_ = 0;
};

}  // namespace kvq::server
