// Tensor-core prefill attention (backend/cuda/attention_prefill) vs the CPU
// `none` cache over odd shapes: n in {2, 17, 63, 64, 65, 300} (not multiples
// of the CTA's token tile), pos in {0, 1, 100, 1000} (pos + n rarely a
// multiple of the key tile), GQA groups 1, 2, 3, 4, 5, 8, 16, 64, head_dim 64,
// 128, 256, with and without key chunks (split + merge). Error bounds:
// prefill_test_util.hpp. Odd n: the cache holds exactly pos + n tokens (a read
// past them leaves the allocation); even n: 37 more rows hold huge K/V that
// must never be read. Head_dim 128 runs both kernels where the build has the
// Hopper one (wgmma, sm_90a): the default context's and the mma.sync one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "backend/cuda/attention_prefill.hpp"
#include "backend/cuda/cuda_kv_cache.hpp"
#include "core/error.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "gpu_test_util.hpp"
#include "kv/cache.hpp"
#include "prefill_test_util.hpp"
#include "wgmma_test_kernels.hpp"

using namespace kvq;
using gputest::normal;
using gputest::write_peaked_kv;
using gputest::Guarded;

namespace {

struct PrefillCase {
  int n_kv, G, head_dim, pos, n;
  int key_splits;  // 0: automatic (also checked through the cache's attend()); > 0 forced
};

class CudaPrefillAttention : public ::testing::TestWithParam<PrefillCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};


// One case: the kernel (direct call) vs both CPU references, and the routed
// flash_attention() for automatic splits. Fatal gtest failures on mismatch.
// mma_sync: the mma.sync kernel even where the default is the wgmma one.
void check_prefill(const PrefillCase& c, bool mma_sync = false) {
  const int n_heads = c.n_kv * c.G, D = c.head_dim;
  ASSERT_TRUE(cuda::flash_attention_prefill_supported(n_heads, c.n_kv, D));
  Rng rng(uint64_t(c.n_kv) * 1000003 + c.G * 10007 + D * 101 + c.pos * 7 + c.n + c.key_splits * 31);
  const int total = c.pos + c.n;
  const int slack = c.n % 2 ? 0 : 37;
  const kv::CacheShape shape{2, c.n_kv, D, total + slack};
  auto cpu_cache = kv::make_cpu_cache(kv::CodecOptions{}, shape);
  auto gpu_cache = cuda::make_cuda_kv_cache(kv::CodecOptions{}, shape);
  const size_t kv_row = size_t(c.n_kv) * D, q_row = size_t(n_heads) * D;
  const int layer = 1;  // the last layer: its last KV head ends the allocation
  const auto [k, v] = write_peaked_kv(rng, *cpu_cache, *gpu_cache, layer, c.pos, c.n, kv_row);
  const auto q = normal(rng, size_t(c.n) * q_row, 2.0f);
  const float scale = 1.0f / std::sqrt(float(D));
  if (slack > 0) {  // rows past pos + n: K/V = 65504 (bf16-clamped), fatal if attended
    cuda::DeviceBuffer<float> poison(size_t(slack) * kv_row);
    poison.upload(std::vector<float>(poison.size(), 65504.0f));
    gpu_cache->layer(layer).write(total, slack, poison.data(), poison.data());
  }

  const auto& view = dynamic_cast<cuda::CudaLayerCache&>(gpu_cache->layer(layer)).view();
  cuda::AttentionScratch scratch;
  Guarded dq(q.size(), &q), out(size_t(c.n) * q_row);
  cuda::KernelSettings settings;
  settings.prefill_wgmma = !mma_sync;
  const cuda::DeviceContext ctx(cuda::current_device(), settings);
  cuda::flash_attention_prefill(cuda::bf16_view(view), c.pos, c.n, dq.data(), n_heads, scale, out.data(), scratch, nullptr,
                                c.key_splits, ctx);
  const auto y = out.result();

  std::vector<float> ref(y.size()), ref_bf16q(y.size());
  cpu_cache->layer(layer).attend(c.pos, c.n, q.data(), n_heads, scale, ref.data());
  const auto q_bf16 = gputest::prefill_bf16_queries(q, scale);
  cpu_cache->layer(layer).attend(c.pos, c.n, q_bf16.data(), n_heads, gputest::kLn2, ref_bf16q.data());
  const auto stats = gputest::kv_head_stats(k, v, total, c.n_kv, D);

  double worst_bf16q = 0, worst = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const size_t t = i / q_row, hq = (i % q_row) / D;
    const int h = int(hq) / c.G;
    ASSERT_TRUE(std::isfinite(y[i])) << "element " << i << " not written (or not finite)";
    const double err_bf16q = std::fabs(double(y[i]) - ref_bf16q[i]);
    worst_bf16q = std::max(worst_bf16q, err_bf16q);
    ASSERT_LE(err_bf16q, gputest::prefill_bound_bf16_queries(ref_bf16q[i], stats.v_max[h]))
        << "vs bf16-query reference: token " << t << " head " << hq << " dim " << i % D;
    const double err = std::fabs(double(y[i]) - ref[i]);
    worst = std::max(worst, err);
    const double q_norm = gputest::row_norm(q.data() + (t * n_heads + hq) * D, D);
    ASSERT_LE(err, gputest::prefill_bound_fp32_queries(ref[i], stats.v_max[h], scale, q_norm, stats.k_norm_max[h]))
        << "vs fp32 reference: token " << t << " head " << hq << " dim " << i % D;
  }
  ::testing::Test::RecordProperty("max_abs_err_vs_bf16_queries", std::to_string(worst_bf16q));
  ::testing::Test::RecordProperty("max_abs_err_vs_fp32", std::to_string(worst));

  // flash_attention() (the cache's attend) routes n > 1 here: same kernel,
  // same automatic split, so the same bits.
  if (c.key_splits == 0 && !mma_sync) {
    Guarded routed(y.size());
    gpu_cache->layer(layer).attend(c.pos, c.n, dq.data(), n_heads, scale, routed.data());
    const auto yr = routed.result();
    ASSERT_EQ(std::memcmp(yr.data(), y.data(), y.size() * sizeof(float)), 0)
        << "flash_attention() did not take the prefill kernel";
  }
}

TEST_P(CudaPrefillAttention, MatchesCpuNoneCache) {
  check_prefill(GetParam());
  if (HasFatalFailure() || !cuda::flash_attention_prefill_wgmma(GetParam().head_dim)) return;
  SCOPED_TRACE("the mma.sync kernel");
  check_prefill(GetParam(), true);
}

// The causal diagonal at every offset within a key tile (64 keys; 32 for
// head_dim 256): the mask must apply exactly on the tiles that reach past a
// CTA's first query, also when the tile's last key is that query's position + 1.
TEST(CudaPrefillAttentionSweep, DiagonalAtEveryKeyTileOffset) {
  KVQ_SKIP_WITHOUT_GPU();
  for (int D : {64, 128, 256})
    for (int G : {1, 4, 5})
      for (int pos = 0; pos < 66; pos += G == 4 ? 1 : 5) {
        const PrefillCase c{1, G, D, pos, G == 1 ? 70 : 33, pos % 3 == 2 ? 2 : 0};
        SCOPED_TRACE("head_dim " + std::to_string(D) + " G " + std::to_string(G) + " pos " + std::to_string(pos));
        check_prefill(c);
        if (HasFatalFailure()) return;
      }
}

std::vector<PrefillCase> prefill_cases() {
  return {
      // head_dim 128 (Qwen3-8B: 8 KV heads, G = 4)
      {8, 4, 128, 0, 2, 0},
      {8, 4, 128, 1, 17, 0},
      {8, 4, 128, 100, 63, 0},
      {8, 4, 128, 1000, 64, 0},
      {8, 4, 128, 1000, 65, 1},  // one key chunk over 1065 keys
      {8, 4, 128, 100, 300, 0},
      {2, 4, 128, 1000, 300, 0},
      {2, 4, 128, 1000, 300, 7},  // chunk ends inside query tiles' causal ranges
      {2, 1, 128, 0, 65, 0},      // G = 1: 64 tokens per CTA, the second tile holds 1
      {2, 1, 128, 1, 300, 1},
      {2, 2, 128, 100, 17, 0},
      {2, 8, 128, 1000, 63, 0},
      {1, 8, 128, 0, 300, 3},
      {2, 5, 128, 33, 17, 0},   // G = 5: 12 tokens, 60 of 64 rows
      {1, 16, 128, 7, 9, 0},    // 4 tokens per CTA
      {1, 64, 128, 10, 3, 0},   // 1 token per CTA
      {1, 3, 128, 1000, 2, 0},  // G = 3: 21 tokens, 63 rows
      // head_dim 64
      {4, 1, 64, 0, 2, 0},
      {2, 1, 64, 1000, 64, 0},
      {2, 2, 64, 1, 65, 0},
      {2, 4, 64, 100, 300, 1},
      {2, 8, 64, 1000, 17, 0},
      {3, 3, 64, 100, 63, 2},
      // head_dim 256 (32-key tiles, Q read from shared memory)
      {2, 1, 256, 0, 17, 0},
      {2, 2, 256, 1, 63, 0},
      {2, 4, 256, 100, 65, 0},
      {1, 8, 256, 1000, 64, 0},
      {2, 4, 256, 1000, 300, 1},
      {1, 2, 256, 0, 300, 5},
  };
}

std::string prefill_name(const ::testing::TestParamInfo<PrefillCase>& info) {
  const auto& p = info.param;
  return "kv" + std::to_string(p.n_kv) + "_g" + std::to_string(p.G) + "_d" + std::to_string(p.head_dim) + "_pos" +
         std::to_string(p.pos) + "_n" + std::to_string(p.n) + "_split" + std::to_string(p.key_splits);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaPrefillAttention, ::testing::ValuesIn(prefill_cases()), prefill_name);

// The Hopper kernel runs wherever it was built (sm_90a device code on a 9.0
// device), for head_dim 128 only, and the setting turns it off.
TEST(CudaPrefillAttentionShapes, HopperKernelWhereBuilt) {
  KVQ_SKIP_WITHOUT_GPU();
  const bool built = gputest::wgmma_device_code();
  RecordProperty("wgmma_device_code", built ? "yes" : "no");
  EXPECT_EQ(cuda::flash_attention_prefill_wgmma(128), built);
  EXPECT_FALSE(cuda::flash_attention_prefill_wgmma(64));
  EXPECT_FALSE(cuda::flash_attention_prefill_wgmma(256));
  cuda::KernelSettings off;
  off.prefill_wgmma = false;
  EXPECT_FALSE(cuda::flash_attention_prefill_wgmma(128, cuda::DeviceContext(cuda::current_device(), off)));
}

// The two wgmma products alone on one tile of random bf16 values, against
// double sums of the same values (fp32 accumulation: 1e-4 relative to the
// sum of |terms|): a wrong descriptor or fragment layout shows here by name.
TEST(CudaWgmma, ProductsMatchCpu) {
  KVQ_SKIP_WITHOUT_GPU();
  if (!gputest::wgmma_device_code()) GTEST_SKIP() << "no sm_90a device code (build without 90a, or not a 9.0 device)";
  Rng rng(2026);
  auto bf16_tile = [&rng](size_t n) {
    std::vector<uint16_t> bits(n);
    for (auto& b : bits) b = f32_to_bf16(float(rng.normal()));
    return bits;
  };
  const auto a = bf16_tile(64 * 128), b = bf16_tile(64 * 128), p = bf16_tile(64 * 64), v = bf16_tile(64 * 128);
  cuda::DeviceBuffer<uint16_t> da(a.size()), db(b.size()), dp(p.size()), dv(v.size());
  da.upload(a);
  db.upload(b);
  dp.upload(p);
  dv.upload(v);
  cuda::DeviceBuffer<float> qk(64 * 64), pv(64 * 128);
  gputest::wgmma_qk_product(da.data(), db.data(), qk.data());
  gputest::wgmma_pv_product(dp.data(), dv.data(), pv.data());
  const auto got_qk = qk.download(), got_pv = pv.download();
  for (int r = 0; r < 64; ++r)
    for (int col = 0; col < 64; ++col) {
      double sum = 0, mag = 0;
      for (int k = 0; k < 128; ++k) {
        const double t = double(bf16_to_f32(a[size_t(r) * 128 + k])) * bf16_to_f32(b[size_t(col) * 128 + k]);
        sum += t;
        mag += std::fabs(t);
      }
      ASSERT_NEAR(got_qk[size_t(r) * 64 + col], sum, 1e-4 * mag + 1e-6) << "Q.K^T row " << r << " column " << col;
    }
  for (int r = 0; r < 64; ++r)
    for (int col = 0; col < 128; ++col) {
      double sum = 0, mag = 0;
      for (int k = 0; k < 64; ++k) {
        const double t = double(bf16_to_f32(p[size_t(r) * 64 + k])) * bf16_to_f32(v[size_t(k) * 128 + col]);
        sum += t;
        mag += std::fabs(t);
      }
      ASSERT_NEAR(got_pv[size_t(r) * 128 + col], sum, 1e-4 * mag + 1e-6) << "P.V row " << r << " column " << col;
    }
}

TEST(CudaPrefillAttentionShapes, UnsupportedShapesAreRefused) {
  EXPECT_TRUE(cuda::flash_attention_prefill_supported(32, 8, 128));
  EXPECT_TRUE(cuda::flash_attention_prefill_supported(40, 8, 64));
  EXPECT_FALSE(cuda::flash_attention_prefill_supported(32, 8, 96));   // head_dim
  EXPECT_FALSE(cuda::flash_attention_prefill_supported(32, 8, 512));  // head_dim
  EXPECT_FALSE(cuda::flash_attention_prefill_supported(130, 1, 64));  // group > 64
  EXPECT_FALSE(cuda::flash_attention_prefill_supported(30, 8, 128));  // not a multiple
  KVQ_SKIP_WITHOUT_GPU();
  const kv::CacheShape shape{1, 8, 96, 8};
  auto cache = cuda::make_cuda_kv_cache(kv::CodecOptions{}, shape);
  const auto& view = dynamic_cast<cuda::CudaLayerCache&>(cache->layer(0)).view();
  cuda::AttentionScratch scratch;
  cuda::DeviceBuffer<float> q(size_t(2) * 32 * 96), out(q.size());
  try {
    cuda::flash_attention_prefill(cuda::bf16_view(view), 0, 2, q.data(), 32, 0.1f, out.data(), scratch, nullptr);
    FAIL() << "head_dim 96 should be unsupported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported);
  }
}

}  // namespace
