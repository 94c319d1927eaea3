// Wall-clock timing for host-side stages. GPU work is timed with CUDA events
// in the CUDA backend, never with this.
#pragma once

#include <chrono>

namespace kvq {

class Timer {
 public:
  Timer() : start_(clock::now()) {}
  void reset() { start_ = clock::now(); }
  double seconds() const { return std::chrono::duration<double>(clock::now() - start_).count(); }
  double ms() const { return seconds() * 1e3; }

 private:
  using clock = std::chrono::steady_clock;
  clock::time_point start_;
};

}  // namespace kvq
