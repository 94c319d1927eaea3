#include "backend/weight_prefetch_plan.hpp"

#include <algorithm>

namespace kvq {

void WeightPrefetchPlan::observe(const void* const* mats, int n) {
  if (distance_ <= 0 || n <= 0 || !mats[0]) return;
  seen_.emplace_back(mats, mats + n);
}

void WeightPrefetchPlan::end_step() {
  if (distance_ <= 0 || seen_.empty() || seen_ == order_) {
    seen_.clear();
    return;
  }
  order_ = std::move(seen_);
  seen_.clear();
  next_.clear();
  const size_t launches = order_.size();
  std::unordered_map<const void*, int> uses;
  for (const auto& l : order_) ++uses[l[0]];
  for (size_t i = 0; i < launches; ++i) {
    const void* key = order_[i][0];
    if (uses[key] > 1) continue;  // ambiguous: which launch comes next depends on where it is
    std::vector<const void*> names;
    for (int d = 1; d <= distance_ && size_t(d) < launches; ++d) {
      for (const void* m : order_[(i + size_t(d)) % launches]) {
        const bool own = std::find(order_[i].begin(), order_[i].end(), m) != order_[i].end();
        const bool named = std::find(names.begin(), names.end(), m) != names.end();
        if (m && !own && !named && int(names.size()) < kMaxAhead) names.push_back(m);
      }
    }
    next_[key] = std::move(names);
  }
}

int WeightPrefetchPlan::ahead(const void* first, const void** out) const {
  if (distance_ <= 0) return 0;
  const auto it = next_.find(first);
  if (it == next_.end()) return 0;
  std::copy(it->second.begin(), it->second.end(), out);
  return int(it->second.size());
}

}  // namespace kvq
