// The order of a decode step's weight launches, learnt by watching a step
// run, so that each launch can ask the cache for the weights of the launches
// after it (the CUDA backend's GemvRequest::prefetch: a batch-1 decode step
// reads ~1.1 GB of bonsai-8b weights in ~145 short launches, each of which
// waits for its predecessor before streaming its own; asking L2 for the next
// launch's weights keeps HBM busy across those waits).
//
// A step is watched launch by launch (observe: the matrices one launch
// reads, any opaque ids; the first is the launch's key). When a step ends
// with an order different from the last one learnt, the plan is rebuilt:
// launch i names the matrices of launches i+1 .. i+distance, wrapping from
// the step's last launch (the LM head) to its first ones (the next step's
// first layer), at most kMaxAhead of them. Steps replayed from a recording
// launch nothing through the backend: they observe nothing and keep the
// plan. A key seen at two places in one step names nothing (ambiguous).
//
// Only a hint is derived from it: a wrong or stale plan costs bandwidth,
// never results.
#pragma once

#include <unordered_map>
#include <vector>

namespace kvq {

class WeightPrefetchPlan {
 public:
  static constexpr int kMaxAhead = 6;

  // distance: launches ahead whose matrices a launch names; 0: none.
  explicit WeightPrefetchPlan(int distance = 0) : distance_(distance) {}

  int distance() const { return distance_; }

  void begin_step() { seen_.clear(); }
  // One launch of the step, reading mats[0..n).
  void observe(const void* const* mats, int n);
  void end_step();

  // The matrices after the launch keyed by `first` (out holds kMaxAhead);
  // returns how many (0: unknown key, or distance 0).
  int ahead(const void* first, const void** out) const;

  // Launches in the order learnt (tests and diagnostics).
  int learnt_launches() const { return int(order_.size()); }

 private:
  int distance_;
  std::vector<std::vector<const void*>> seen_;   // this step's launches so far
  std::vector<std::vector<const void*>> order_;  // the order learnt
  std::unordered_map<const void*, std::vector<const void*>> next_;
};

}  // namespace kvq
