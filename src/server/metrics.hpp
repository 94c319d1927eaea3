// Server metrics in the Prometheus text exposition format (version 0.0.4):
// request counts by route and status, token counts, time-to-first-token and
// inter-token-latency histograms, and gauges read at scrape time (the
// scheduler's sequences, pages and steps among them, and the process's
// resident memory under its standard Prometheus name).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/scheduler.hpp"

namespace kvq::server {

// A cumulative histogram over fixed upper bounds (seconds), +Inf implied.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  // `name_bucket`, `name_sum`, `name_count` lines with HELP and TYPE.
  void write(std::string& out, const std::string& name, const std::string& help) const;
  uint64_t count() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; last is +Inf
  double sum_ = 0;
  uint64_t n_ = 0;
};

// This process's resident set size in bytes (/proc/self/statm's resident
// pages x the page size); 0 where it cannot be read (no /proc).
uint64_t process_resident_bytes();

// Gauges read from the engine when scraped.
struct Gauges {
  int queue_depth = 0;    // sequences waiting to be admitted (preempted ones included)
  int running = 0;        // sequences admitted: prefilling or decoding
  uint64_t kv_bytes = 0;  // KV bytes of the pool's pages that sequences hold
  uint64_t kv_pool_bytes = 0;  // KV bytes of the whole pool
  SchedulerMetrics sched;      // the scheduler's counters as of its last step
};

class Metrics {
 public:
  Metrics();
  // One finished HTTP exchange; routes outside `known` count as "other".
  void request(const std::string& route, int status);
  void tokens(int prompt, int generated);
  void cancelled() { ++cancelled_; }
  Histogram& ttft() { return ttft_; }
  Histogram& itl() { return itl_; }
  Histogram& e2e() { return e2e_; }  // arrival to the last token of a request answered in full

  std::string render(const Gauges& g) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  std::atomic<uint64_t> prompt_tokens_{0}, generated_tokens_{0}, cancelled_{0};
  Histogram ttft_, itl_, e2e_;
};

}  // namespace kvq::server
