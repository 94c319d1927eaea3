// WeightPrefetchPlan: the decode step's launch order learnt from a watched
// step, and what each launch then names for the cache (the CUDA GEMVs' L2
// prefetch; the kernels themselves are timed on the GPU, results never
// depend on the plan).
#include <gtest/gtest.h>

#include <vector>

#include "backend/weight_prefetch_plan.hpp"

using namespace kvq;

namespace {

// Matrix ids: addresses of distinct ints.
int m[16];

void watch(WeightPrefetchPlan& p, const std::vector<std::vector<const void*>>& launches) {
  p.begin_step();
  for (const auto& l : launches) p.observe(l.data(), int(l.size()));
  p.end_step();
}

std::vector<const void*> ahead(const WeightPrefetchPlan& p, const void* key) {
  const void* out[WeightPrefetchPlan::kMaxAhead];
  const int n = p.ahead(key, out);
  return std::vector<const void*>(out, out + n);
}

// One layer's launches (QKV, O, gate/up, down) and the LM head.
std::vector<std::vector<const void*>> two_layers_and_head() {
  return {{&m[0], &m[1], &m[2]}, {&m[3]}, {&m[4], &m[5]}, {&m[6]},
          {&m[7], &m[8], &m[9]}, {&m[10]}, {&m[11], &m[12]}, {&m[13]}, {&m[14]}};
}

}  // namespace

TEST(WeightPrefetchPlan, NamesTheNextLaunchesAndWrapsToTheFirst) {
  WeightPrefetchPlan p(1);
  EXPECT_TRUE(ahead(p, &m[0]).empty());  // nothing learnt yet
  watch(p, two_layers_and_head());
  EXPECT_EQ(p.learnt_launches(), 9);
  EXPECT_EQ(ahead(p, &m[0]), (std::vector<const void*>{&m[3]}));
  EXPECT_EQ(ahead(p, &m[3]), (std::vector<const void*>{&m[4], &m[5]}));
  EXPECT_EQ(ahead(p, &m[6]), (std::vector<const void*>{&m[7], &m[8], &m[9]}));
  EXPECT_EQ(ahead(p, &m[14]), (std::vector<const void*>{&m[0], &m[1], &m[2]}));  // the LM head: the next step's first
  EXPECT_TRUE(ahead(p, &m[1]).empty());  // not a launch's key
}

TEST(WeightPrefetchPlan, DistanceTwoConcatenatesAndCapsAtKMaxAhead) {
  WeightPrefetchPlan p(2);
  watch(p, two_layers_and_head());
  EXPECT_EQ(ahead(p, &m[0]), (std::vector<const void*>{&m[3], &m[4], &m[5]}));
  EXPECT_EQ(ahead(p, &m[6]), (std::vector<const void*>{&m[7], &m[8], &m[9], &m[10]}));
  WeightPrefetchPlan p3(3);
  watch(p3, two_layers_and_head());
  // O, gate/up and down of layer 0 after its QKV: 4 matrices; from the down
  // launch, layer 1's QKV (3) + O (1) + gate/up (2) = 6, the cap.
  EXPECT_EQ(ahead(p3, &m[6]).size(), size_t(WeightPrefetchPlan::kMaxAhead));
  EXPECT_EQ(ahead(p3, &m[6]).back(), &m[12]);
}

TEST(WeightPrefetchPlan, NeverNamesALaunchsOwnMatricesOrRepeats) {
  WeightPrefetchPlan p(3);
  watch(p, {{&m[0]}, {&m[1]}});  // two launches: distance 3 wraps onto itself
  EXPECT_EQ(ahead(p, &m[0]), (std::vector<const void*>{&m[1]}));
  EXPECT_EQ(ahead(p, &m[1]), (std::vector<const void*>{&m[0]}));
}

TEST(WeightPrefetchPlan, ReplayedStepsKeepThePlanAndAChangedOrderReplacesIt) {
  WeightPrefetchPlan p(1);
  watch(p, two_layers_and_head());
  watch(p, {});  // a replayed step launches nothing through the backend
  EXPECT_EQ(ahead(p, &m[0]), (std::vector<const void*>{&m[3]}));
  watch(p, {{&m[0], &m[1], &m[2]}, {&m[6]}});
  EXPECT_EQ(p.learnt_launches(), 2);
  EXPECT_EQ(ahead(p, &m[0]), (std::vector<const void*>{&m[6]}));
  EXPECT_TRUE(ahead(p, &m[3]).empty());  // forgotten with the old order
}

TEST(WeightPrefetchPlan, AKeyAtTwoPlacesNamesNothing) {
  WeightPrefetchPlan p(1);
  watch(p, {{&m[0]}, {&m[1]}, {&m[0]}, {&m[2]}});
  EXPECT_TRUE(ahead(p, &m[0]).empty());
  EXPECT_EQ(ahead(p, &m[1]), (std::vector<const void*>{&m[0]}));
}

TEST(WeightPrefetchPlan, DistanceZeroIsOff) {
  WeightPrefetchPlan p(0);
  watch(p, two_layers_and_head());
  EXPECT_EQ(p.learnt_launches(), 0);
  EXPECT_TRUE(ahead(p, &m[0]).empty());
}
