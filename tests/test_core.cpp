#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"

using namespace kvq;

TEST(Half, F16RoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t x = uint16_t(h);
    const float f = f16_to_f32(x);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    EXPECT_EQ(f32_to_f16(f), x) << "h=" << h;
  }
}

TEST(Half, F16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // ties-to-even overflow
  EXPECT_EQ(f32_to_f16(1e9f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-1e9f), 0xfc00);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);          // half of min subnormal: even -> 0
  EXPECT_EQ(f32_to_f16(std::ldexp(1.5f, -25)), 0x0001);          // above half -> 1
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);   // tie -> even
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(3.0f, -11)), 0x3c02);   // tie -> even (up)
}

TEST(Half, Bf16RoundTripAndRounding) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_f32(uint16_t(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_bf16(f), uint16_t(h));
  }
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // tie -> even
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Rng, DeterministicAndRoughlyNormal) {
  Rng a(42), b(42);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.next_u64(), b.next_u64());
  Rng r(7);
  double s = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = r.normal();
    s += x;
    s2 += x * x;
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.02);
}

TEST(Error, CarriesCodeAndMessage) {
  try {
    fail(Errc::format, "tensor '", "blk.0", "' has ", 3, " dims");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::format);
    EXPECT_STREQ(e.what(), "tensor 'blk.0' has 3 dims");
  }
}
