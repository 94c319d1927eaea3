#include "server/fair_queue.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace kvq::server {

FairQueue::FairQueue(int max_running, int max_waiting) : max_running_(max_running), max_waiting_(max_waiting) {
  KVQ_CHECK(max_running >= 1, Errc::invalid_argument, "at least one request must be able to run");
  KVQ_CHECK(max_waiting >= 0, Errc::invalid_argument, "--max-queue must be >= 0");
}

std::unique_ptr<FairQueue::Ticket> FairQueue::enter() {
  std::lock_guard<std::mutex> lock(mu_);
  // Free running slots admit as many more; beyond them max_waiting may wait.
  if (int(queue_.size()) >= max_waiting_ + (max_running_ - running_)) return nullptr;
  const uint64_t n = next_++;
  queue_.push_back(n);
  return std::unique_ptr<Ticket>(new Ticket(*this, n));
}

bool FairQueue::wait_turn(Ticket& t, const std::function<bool()>& give_up, std::chrono::milliseconds poll) {
  std::unique_lock<std::mutex> lock(mu_);
  if (t.running_) return true;
  while (true) {
    // Its turn: among the first (free slots) of the queue.
    const auto it = std::find(queue_.begin(), queue_.end(), t.n_);
    KVQ_ASSERT(it != queue_.end());
    if (it - queue_.begin() < max_running_ - running_) {
      queue_.erase(it);
      ++running_;
      t.running_ = true;
      return true;
    }
    lock.unlock();
    const bool stop = give_up && give_up();
    lock.lock();
    if (stop) return false;  // still queued; the ticket's destructor leaves
    cv_.wait_for(lock, poll);
  }
}

void FairQueue::finish(Ticket& t) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!t.running_) return;
  t.running_ = false;
  t.n_ = UINT64_MAX;  // finished: neither running nor queued
  --running_;
  cv_.notify_all();
}

void FairQueue::leave(Ticket& t) {
  std::lock_guard<std::mutex> lock(mu_);
  if (t.running_) {
    t.running_ = false;
    --running_;
  } else {
    const auto it = std::find(queue_.begin(), queue_.end(), t.n_);
    if (it != queue_.end()) queue_.erase(it);
  }
  cv_.notify_all();
}

FairQueue::Ticket::~Ticket() { q_.leave(*this); }

int FairQueue::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int(queue_.size());
}

int FairQueue::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

}  // namespace kvq::server
