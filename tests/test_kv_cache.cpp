// The KV cache interface (kv/cache.hpp) over the `none` codec and the codec
// name resolution; per-codec attention checks live in test_kv_attention.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "kv/cache.hpp"
#include "kv_test_util.hpp"

using namespace kvq;
using namespace kvq::kv;
using kvq::test::gaussian;
using kvq::test::naive_attention;

TEST(KvCacheNone, AttentionEqualsNaiveOverBf16Values) {
  const CacheShape shape{2, 2, 64, 100};
  auto cache = make_cpu_cache(CodecOptions{}, shape);
  EXPECT_EQ(cache->codec_name(), "none");
  Rng rng(7);
  const int T = 37, n_heads = 6, D = 64, H = 2;
  for (int layer = 0; layer < 2; ++layer) {
    auto k = gaussian(rng, size_t(T) * H * D), v = gaussian(rng, size_t(T) * H * D);
    // prefill in two chunks, then attend for the last 5 tokens
    cache->layer(layer).write(0, 20, k.data(), v.data());
    cache->layer(layer).write(20, T - 20, k.data() + 20 * H * D, v.data() + 20 * H * D);
    std::vector<float> kr(k), vr(v);
    for (auto* a : {&kr, &vr})
      for (auto& x : *a) x = bf16_to_f32(f32_to_bf16(x));
    const int pos = T - 5, n = 5;
    auto q = gaussian(rng, size_t(n) * n_heads * D);
    std::vector<float> out(q.size());
    cache->layer(layer).attend(pos, n, q.data(), n_heads, 0.125f, out.data());
    std::vector<double> ref;
    naive_attention(kr, vr, H, D, pos, n, q.data(), n_heads, 0.125f, ref);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-5 + 1e-5 * std::fabs(ref[i])) << i;
  }
}

TEST(KvCacheNone, BytesForTokensIsBf16Size) {
  auto cache = make_cpu_cache(CodecOptions{}, CacheShape{36, 8, 128, 16});
  EXPECT_EQ(cache->bytes_for_tokens(1), 147456u);  // Bonsai-8B: 36 * 8 * 128 * 2 * 2
  EXPECT_EQ(cache->bytes_for_tokens(1000), 147456000u);
}

TEST(KvCacheNone, AliasesAndCaseInsensitiveNames) {
  for (const char* n : {"none", "NONE", "bf16", "F16"}) {
    CodecOptions o;
    o.kv = n;
    EXPECT_EQ(make_cpu_cache(o, CacheShape{1, 1, 64, 4})->codec_name(), "none") << n;
  }
}

TEST(KvCacheNone, UnknownCodecListsValidNames) {
  CodecOptions o;
  o.kv = "q5_bogus";
  try {
    make_cpu_cache(o, CacheShape{1, 1, 64, 4});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    const std::string m = e.what();
    EXPECT_NE(m.find("q5_bogus"), std::string::npos);
    EXPECT_NE(m.find("k8v4"), std::string::npos);
    EXPECT_NE(m.find("rot_k_tq4v"), std::string::npos);
  }
}

TEST(KvCacheNone, CapacityAndOrderErrors) {
  auto cache = make_cpu_cache(CodecOptions{}, CacheShape{1, 1, 64, 4});
  std::vector<float> k(5 * 64, 1.0f), v(5 * 64, 1.0f), q(64, 1.0f), out(64);
  EXPECT_THROW(cache->layer(0).write(0, 5, k.data(), v.data()), Error);  // over capacity
  // Rows go to any slot (a paged store), but attention over a row never
  // written is an error, not a read of stale bytes.
  EXPECT_THROW(cache->layer(0).attend(0, 1, q.data(), 1, 1.0f, out.data()), Error);  // nothing written
  cache->layer(0).write(1, 1, k.data(), v.data());
  EXPECT_THROW(cache->layer(0).attend(1, 1, q.data(), 1, 1.0f, out.data()), Error);  // token 0 missing
  EXPECT_THROW(cache->layer(1), Error);
  cache->layer(0).write(0, 4, k.data(), v.data());
  cache->layer(0).attend(3, 1, q.data(), 1, 1.0f, out.data());
  for (float x : out) EXPECT_FLOAT_EQ(x, 1.0f);
}
