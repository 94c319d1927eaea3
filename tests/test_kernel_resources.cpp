// CPU checks of the CUDA backend's per-device kernel caches
// (backend/cuda/kernel_resources.hpp): the shared-memory limit only grows,
// occupancy is cached per device and kernel, and two devices never share an
// entry. Pure logic: the CUDA calls are stand-ins that record what they were
// asked, so this runs without a GPU (and without CUDA).
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "backend/cuda/kernel_resources.hpp"

using kvq::cuda::KernelResources;
using kvq::cuda::PerDevice;

namespace {

// Stand-in kernels: only their addresses matter.
const int kernel_a = 0, kernel_b = 0;
const void* const A = &kernel_a;
const void* const B = &kernel_b;

// Records the limits set, and answers occupancy as 200 KiB / smem.
struct FakeDevice {
  std::vector<size_t> limits_set;
  int queries = 0;
  auto set_limit() {
    return [this](size_t bytes) { limits_set.push_back(bytes); };
  }
  auto occupancy() {
    return [this](size_t bytes) {
      ++queries;
      return int((200u << 10) / bytes);
    };
  }
};

}  // namespace

TEST(KernelResources, LimitOnlyGrows) {
  KernelResources r;
  FakeDevice d;
  r.raise_limit(A, 64 << 10, d.set_limit());
  r.raise_limit(A, 32 << 10, d.set_limit());  // smaller: left as it is
  r.raise_limit(A, 64 << 10, d.set_limit());  // equal: no call
  r.raise_limit(A, 96 << 10, d.set_limit());
  EXPECT_EQ(d.limits_set, (std::vector<size_t>{64 << 10, 96 << 10}));
  EXPECT_EQ(r.limit(A), size_t(96) << 10);
  EXPECT_EQ(r.limit(B), 0u);
}

TEST(KernelResources, ResidentCtasForLargestKeepsTheLargestRequest) {
  KernelResources r;
  FakeDevice d;
  EXPECT_EQ(r.resident_ctas_for_largest(A, 50 << 10, 512, d.set_limit(), d.occupancy()), 4);
  EXPECT_EQ(r.resident_ctas_for_largest(A, 100 << 10, 512, d.set_limit(), d.occupancy()), 2);
  // A smaller request afterwards gets the larger one's answer, without a query.
  EXPECT_EQ(r.resident_ctas_for_largest(A, 50 << 10, 512, d.set_limit(), d.occupancy()), 2);
  EXPECT_EQ(d.queries, 2);
  // Another block size of the same kernel is its own entry, but shares the
  // kernel's limit (never lowered by it).
  EXPECT_EQ(r.resident_ctas_for_largest(A, 40 << 10, 256, d.set_limit(), d.occupancy()), 5);
  EXPECT_EQ(d.limits_set, (std::vector<size_t>{50 << 10, 100 << 10}));
  EXPECT_EQ(r.limit(A), size_t(100) << 10);
  // An occupancy of 0 (does not fit) is reported as 1.
  EXPECT_EQ(r.resident_ctas_for_largest(B, 300 << 10, 128, d.set_limit(), d.occupancy()), 1);
}

TEST(KernelResources, ExactOccupancyQueriedOnce) {
  KernelResources r;
  int queries = 0;
  auto q = [&] { return ++queries, 3; };
  EXPECT_EQ(r.resident_ctas(A, 128, 1000, q), 3);
  EXPECT_EQ(r.resident_ctas(A, 128, 1000, q), 3);
  EXPECT_EQ(queries, 1);
  r.resident_ctas(A, 128, 2000, q);  // another smem: another entry
  r.resident_ctas(B, 128, 1000, q);  // another kernel
  EXPECT_EQ(queries, 3);
}

TEST(KernelResources, EachDeviceHasItsOwnCaches) {
  PerDevice<KernelResources> devices;
  std::vector<int> made;
  auto make = [&](int device) {
    made.push_back(device);
    return std::make_unique<KernelResources>();
  };
  KernelResources& d0 = devices.at(0, make);
  KernelResources& d1 = devices.at(1, make);
  EXPECT_NE(&d0, &d1);
  EXPECT_EQ(&devices.at(0, make), &d0);  // made once, same object after
  EXPECT_EQ(made, (std::vector<int>{0, 1}));
  EXPECT_EQ(devices.size(), 2u);

  // Raising a kernel's limit on device 0 leaves device 1 unconfigured: its
  // first launch still sets the limit there (cudaFuncSetAttribute applies to
  // the current device only).
  FakeDevice g0, g1;
  d0.raise_limit(A, 64 << 10, g0.set_limit());
  d1.raise_limit(A, 64 << 10, g1.set_limit());
  EXPECT_EQ(g0.limits_set.size(), 1u);
  EXPECT_EQ(g1.limits_set.size(), 1u);
  EXPECT_EQ(d0.resident_ctas_for_largest(A, 64 << 10, 512, g0.set_limit(), g0.occupancy()), 3);
  EXPECT_EQ(d1.resident_ctas_for_largest(A, 64 << 10, 512, g1.set_limit(), g1.occupancy()), 3);
  EXPECT_EQ(g0.queries, 1);
  EXPECT_EQ(g1.queries, 1);
}
