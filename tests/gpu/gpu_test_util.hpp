// Shared helpers for the GPU tests: device buffers poisoned with NaN and
// followed by sentinels, so a kernel that skips an element or writes past
// the end is caught.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/device_buffer.hpp"
#include "core/rng.hpp"

namespace kvq::gputest {

constexpr int kSentinels = 16;
inline float sentinel(int i) { return 12345.0f + float(i); }

// n floats of payload (NaN, or `init` when given) + kSentinels sentinels.
struct Guarded {
  explicit Guarded(size_t n, const std::vector<float>* init = nullptr) : n(n), buf(n + kSentinels) {
    std::vector<float> h(n + kSentinels, std::numeric_limits<float>::quiet_NaN());
    if (init) std::copy(init->begin(), init->end(), h.begin());
    for (int i = 0; i < kSentinels; ++i) h[n + i] = sentinel(i);
    buf.upload(h);
  }
  float* data() { return buf.data(); }
  // Downloads the payload after checking (with gtest) that the sentinels survived.
  std::vector<float> result() {
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> h = buf.download();
    for (int i = 0; i < kSentinels; ++i) EXPECT_EQ(h[n + i], sentinel(i)) << "wrote past the end (sentinel " << i << ")";
    h.resize(n);
    return h;
  }
  size_t n;
  cuda::DeviceBuffer<float> buf;
};

// n values of N(0, s^2).
inline std::vector<float> normal(Rng& rng, size_t n, float s = 1.0f) {
  std::vector<float> v(n);
  for (auto& x : v) x = float(rng.normal()) * s;
  return v;
}

#define KVQ_SKIP_WITHOUT_GPU() \
  if (!::kvq::cuda::device_available()) GTEST_SKIP() << "no CUDA device"

}  // namespace kvq::gputest
