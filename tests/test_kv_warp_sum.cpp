// kv::warp_order_sum (src/kv/warp_sum.hpp): the summation order of every
// bit-exact row and group sum of the KV encoders, shared with the GPU's
// one-warp-per-row encoders. Checked against an independent simulation of a
// 32-lane warp (lane l holds elements l + 32 j; per-lane sequential partials,
// then p[l] += p[l ^ k] for k = 16 .. 1 on all lanes at once, every lane
// ending with the same bits), and on hand-made cases that pin the order.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/rng.hpp"
#include "kv/warp_sum.hpp"

using namespace kvq;
using namespace kvq::kv;

namespace {

uint64_t bits_of(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// What a warp computes: every lane's value after the xor butterfly.
std::array<double, 32> simulate_warp(const std::vector<double>& t) {
  std::array<double, 32> p{};
  const int n = int(t.size());
  const int slots = (n + 31) / 32;
  for (int l = 0; l < 32; ++l) {
    double acc = 0.0;
    for (int j = 0; j < slots; ++j)
      if (l + 32 * j < n) acc = acc + t[size_t(l + 32 * j)];
    p[size_t(l)] = acc;
  }
  for (int k = 16; k > 0; k >>= 1) {
    std::array<double, 32> q{};
    for (int l = 0; l < 32; ++l) q[size_t(l)] = p[size_t(l)] + p[size_t(l ^ k)];
    p = q;
  }
  return p;
}

}  // namespace

TEST(KvWarpSum, MatchesWarpSimulationBitForBit) {
  Rng rng(2024);
  for (int n : {0, 1, 2, 5, 31, 32, 33, 63, 64, 80, 96, 100, 128, 160, 192, 224, 256, 257, 1000, 1024}) {
    for (int rep = 0; rep < 20; ++rep) {
      std::vector<double> t(static_cast<size_t>(n));
      for (auto& v : t) {  // wide dynamic range and both signs: rounding differs between orders
        const float f = float(rng.normal() * std::exp(4.0 * rng.normal()));
        v = rep % 2 ? double(f) * f : double(f) * float(rng.normal());
      }
      const auto lanes = simulate_warp(t);
      for (int l = 1; l < 32; ++l) ASSERT_EQ(bits_of(lanes[size_t(l)]), bits_of(lanes[0])) << "n " << n << " lane " << l;
      EXPECT_EQ(bits_of(warp_order_sum(t.data(), n)), bits_of(lanes[0])) << "n " << n;
      EXPECT_EQ(bits_of(warp_order_sum(n, [&](int i) { return t[size_t(i)]; })), bits_of(lanes[0])) << "n " << n;
    }
  }
}

TEST(KvWarpSum, PinsTheOrder) {
  // 2^53 + 1 rounds back to 2^53 (tie to even). Sequentially,
  // 2^53 + t1 + ... + t33 loses both ones; in warp order lane 1 sums
  // t1 + t33 = 2 first (slot order), and 2^53 + 2 is exact.
  std::vector<double> t(34, 0.0);
  t[0] = 9007199254740992.0;  // 2^53
  t[1] = 1.0;
  t[33] = 1.0;
  double seq = 0;
  for (double v : t) seq += v;
  EXPECT_EQ(seq, 9007199254740992.0);
  EXPECT_EQ(warp_order_sum(t.data(), 34), 9007199254740994.0);

  // One term per lane (a 32-value group): the butterfly pairs lane l with
  // l ^ 16 first, then l ^ 8, ...
  std::vector<double> u(32, 0.0);
  u[0] = 9007199254740992.0;
  u[16] = 1.0;
  u[8] = 1.0;
  // lane 0: 2^53 + 1 -> 2^53; lane 8: 1 + 0 = 1; then 2^53 + 1 -> 2^53.
  EXPECT_EQ(warp_order_sum(u.data(), 32), 9007199254740992.0);
  u[16] = 0.0;
  u[24] = 1.0;
  // lane 0 keeps 2^53, lane 8 holds 1 + 1 = 2 after the first step; 2^53 + 2 is exact.
  EXPECT_EQ(warp_order_sum(u.data(), 32), 9007199254740994.0);
}

TEST(KvWarpSum, SignedZerosAndExactSums) {
  EXPECT_FALSE(std::signbit(warp_order_sum(nullptr, 0)));
  std::vector<double> z(80, -0.0);
  EXPECT_EQ(bits_of(warp_order_sum(z.data(), 80)), bits_of(0.0));  // partials start at +0.0
  std::vector<double> k(256);
  for (int i = 0; i < 256; ++i) k[size_t(i)] = double(i * i);
  EXPECT_EQ(warp_order_sum(k.data(), 256), 5559680.0);  // integers: every order is exact
  EXPECT_EQ(warp_order_sum(k.data(), 80), 167480.0);
}
