// Shared helpers for the GPU tests: device buffers poisoned with NaN and
// followed by sentinels, so a kernel that skips an element or writes past
// the end is caught.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/device_buffer.hpp"
#include "core/rng.hpp"
#include "kv/cache.hpp"

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

// The rounding step of each of n values u as the decode GEMVs round their
// input to int8 (cuda::gemv_quantizes_x types): amax / 127 of its group of
// 32 (the last group may be short). An element's error is at most half its
// step (codes are round(u * (127 / amax)): plus 127 * 2^-22 of a step).
inline std::vector<float> int8_input_steps(const float* u, size_t n) {
  std::vector<float> step(n);
  for (size_t g0 = 0; g0 < n; g0 += 32) {
    const size_t g1 = std::min(n, g0 + 32);
    float amax = 0;
    for (size_t j = g0; j < g1; ++j) amax = std::max(amax, std::fabs(u[j]));
    for (size_t j = g0; j < g1; ++j) step[j] = amax / 127.0f;
  }
  return step;
}

// End to end, a model whose decode GEMVs round x to int8 (quantized weights,
// cuda::gemv_quantizes_x) against the CPU, which does not: each logit within
// kInt8LogitAbs + kInt8LogitRel |logit| of the CPU's. On the H200 (session
// 24, synthetic tiny models, 128 teacher-forced steps) the worst errors are
// 0.085-0.106 (Q2_K 0.106, Q4_K 0.111 on a larger logit).
constexpr double kInt8LogitAbs = 0.12, kInt8LogitRel = 0.03;

// The fewest decode steps with a clear top-1 (clear_top1) that an end-to-end
// token comparison must have checked: fewer would make it near vacuous.
constexpr int kMinClearSteps = 16;

// The index of the largest of n logits and its margin over the second.
inline std::pair<int, float> top2(const float* l, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (l[i] > l[best]) best = i;
  float second = -INFINITY;
  for (int i = 0; i < n; ++i)
    if (i != best) second = std::max(second, l[i]);
  return {best, l[best] - second};
}

// True when a top-1 logit l1 ahead of the second by `margin` stays ahead
// however both move within abs + rel |logit| (in opposite directions).
inline bool clear_top1(float l1, float margin, double abs, double rel) {
  const float l2 = l1 - margin;
  return margin > 2 * abs + rel * (std::fabs(l1) + std::fabs(l2));
}

// n values of N(0, s^2).
inline std::vector<float> normal(Rng& rng, size_t n, float s = 1.0f) {
  std::vector<float> v(n);
  for (auto& x : v) x = float(rng.normal()) * s;
  return v;
}

// Attention inputs shared by the attention tests: K and V for tokens
// [0, pos + n), the keys sharing a direction (like real post-RoPE keys, so
// softmax is peaked, not flat), written to `layer` of the CPU and the GPU
// cache as the forward pass writes them: the history [0, pos), then the n new
// tokens at pos. Returns the host K and V.
struct PeakedKv {
  std::vector<float> k, v;
};
inline PeakedKv write_peaked_kv(Rng& rng, kv::Cache& cpu_cache, kv::Cache& gpu_cache, int layer, int pos, int n,
                                size_t kv_row) {
  const int total = pos + n;
  PeakedKv kv{normal(rng, total * kv_row), normal(rng, total * kv_row)};
  for (int t = 0; t < total; ++t)
    for (size_t i = 0; i < kv_row; ++i) kv.k[t * kv_row + i] += (i % 3 == 0) ? 1.5f : 0.0f;
  cuda::DeviceBuffer<float> dk(kv.k.size()), dv(kv.v.size());
  dk.upload(kv.k);
  dv.upload(kv.v);
  if (pos > 0) {
    cpu_cache.layer(layer).write(0, pos, kv.k.data(), kv.v.data());
    gpu_cache.layer(layer).write(0, pos, dk.data(), dv.data());
  }
  cpu_cache.layer(layer).write(pos, n, kv.k.data() + pos * kv_row, kv.v.data() + pos * kv_row);
  gpu_cache.layer(layer).write(pos, n, dk.data() + pos * kv_row, dv.data() + pos * kv_row);
  return kv;
}

// Decode attention output vs the CPU reference: every element written and
// finite, |y - ref| <= 1e-4 + 1e-4 |ref| (the fp32 allowance of
// tests/gpu/test_attention.cpp); the worst error is recorded as a property.
inline void expect_attention_close(const std::vector<float>& y, const std::vector<float>& ref, int head_dim, const std::string& what) {
  ASSERT_EQ(y.size(), ref.size());
  double worst = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << what << ": element " << i << " not written";
    const double err = std::fabs(double(y[i]) - ref[i]);
    worst = std::max(worst, err);
    ASSERT_LE(err, 1e-4 + 1e-4 * std::fabs(ref[i]))
        << what << ": head " << i / head_dim << " dim " << i % head_dim << " got " << y[i] << " want " << ref[i];
  }
  ::testing::Test::RecordProperty(what + "_max_abs_err", std::to_string(worst));
}

#define KVQ_SKIP_WITHOUT_GPU() \
  if (!::kvq::cuda::device_available()) GTEST_SKIP() << "no CUDA device"

}  // namespace kvq::gputest
