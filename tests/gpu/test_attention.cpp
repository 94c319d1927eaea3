// GPU KV cache (codec none, bf16) and split-KV flash attention vs the CPU
// `none` cache (kv/cpu_cache.cpp), decode (n == 1: the tensor-core kernel of
// attention_decode.cu for all these shapes) and causal prefill (n > 1), GQA
// ratios 1..8, head_dim 64/96/128/256, contexts that need one and many key
// chunks. Prefill of the shapes the tensor-core kernel supports runs it (bf16
// Q and P): those cases use its bounds (prefill_test_util.hpp); the rest keep
// the fp32 kernel's bound.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/cuda/attention_prefill.hpp"
#include "backend/cuda/cuda_kv_cache.hpp"
#include "core/error.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "gpu_test_util.hpp"
#include "kv/cache.hpp"
#include "prefill_test_util.hpp"

using namespace kvq;
using gputest::normal;
using gputest::write_peaked_kv;
using gputest::Guarded;

namespace {

struct AttnCase {
  int n_heads, n_kv, head_dim, pos, n;
};

class CudaAttention : public ::testing::TestWithParam<AttnCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};


TEST_P(CudaAttention, MatchesCpuNoneCache) {
  const AttnCase c = GetParam();
  Rng rng(uint64_t(c.n_heads) * 1000003 + c.n_kv * 10007 + c.head_dim * 101 + c.pos * 7 + c.n);
  const int total = c.pos + c.n;
  const kv::CacheShape shape{2, c.n_kv, c.head_dim, total + 5};
  auto cpu_cache = kv::make_cpu_cache(kv::CodecOptions{}, shape);
  auto gpu_cache = cuda::make_cuda_kv_cache(kv::CodecOptions{}, shape);
  ASSERT_EQ(gpu_cache->codec_name(), "none");
  const size_t kv_row = size_t(c.n_kv) * c.head_dim, q_row = size_t(c.n_heads) * c.head_dim;
  const int layer = 1;
  const auto [k, v] = write_peaked_kv(rng, *cpu_cache, *gpu_cache, layer, c.pos, c.n, kv_row);
  const auto q = normal(rng, size_t(c.n) * q_row, 2.0f);
  const float scale = 1.0f / std::sqrt(float(c.head_dim));

  std::vector<float> ref(size_t(c.n) * q_row);
  cpu_cache->layer(layer).attend(c.pos, c.n, q.data(), c.n_heads, scale, ref.data());
  Guarded dq(q.size(), &q), out(ref.size());
  gpu_cache->layer(layer).attend(c.pos, c.n, dq.data(), c.n_heads, scale, out.data());
  const auto y = out.result();
  // fp32 kernel: both read the same bf16 K/V and compute in fp32 in
  // different orders: score errors ~ head_dim * 2^-24 * |q||k| (~1e-5 here),
  // hence output errors of that order relative to max|v| (~4): 1e-4 absolute
  // is ~10x that.
  // Tensor-core prefill: bounds (1) and (2) of prefill_test_util.hpp, (1)
  // against the reference run on the kernel's own bf16 queries.
  const bool tensor_core_prefill =
      c.n > 1 && cuda::flash_attention_prefill_supported(c.n_heads, c.n_kv, c.head_dim);
  std::vector<float> ref_bf16q;
  gputest::KvHeadStats stats;
  if (tensor_core_prefill) {
    const auto q_bf16 = gputest::prefill_bf16_queries(q, scale);
    ref_bf16q.resize(ref.size());
    cpu_cache->layer(layer).attend(c.pos, c.n, q_bf16.data(), c.n_heads, gputest::kLn2, ref_bf16q.data());
    stats = gputest::kv_head_stats(k, v, total, c.n_kv, c.head_dim);
  }
  const int group = c.n_heads / c.n_kv;
  double worst = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << "element " << i << " not written";
    const size_t t = i / q_row, hq = (i % q_row) / c.head_dim;
    const double err = std::fabs(double(y[i]) - ref[i]);
    worst = std::max(worst, err);
    if (!tensor_core_prefill) {
      ASSERT_LE(err, 1e-4 + 1e-4 * std::fabs(ref[i])) << "token " << t << " head " << hq << " dim " << i % c.head_dim;
      continue;
    }
    const int h = int(hq) / group;
    ASSERT_LE(std::fabs(double(y[i]) - ref_bf16q[i]), gputest::prefill_bound_bf16_queries(ref_bf16q[i], stats.v_max[h]))
        << "vs bf16-query reference: token " << t << " head " << hq << " dim " << i % c.head_dim;
    const double q_norm = gputest::row_norm(q.data() + (t * c.n_heads + hq) * c.head_dim, c.head_dim);
    ASSERT_LE(err, gputest::prefill_bound_fp32_queries(ref[i], stats.v_max[h], scale, q_norm, stats.k_norm_max[h]))
        << "vs fp32 reference: token " << t << " head " << hq << " dim " << i % c.head_dim;
  }
  RecordProperty("max_abs_err", std::to_string(worst));

  // The cache rows: bf16 of the inputs at their positions; the other layer untouched (zero).
  const auto& view = dynamic_cast<cuda::CudaLayerCache&>(gpu_cache->layer(layer)).view();
  // (The store is paged: token t of head h is row geometry().row(t / P, h, t % P).)
  std::vector<uint16_t> kc(size_t(view.n_pages) * c.n_kv * view.page_tokens * c.head_dim);
  KVQ_CUDA_CHECK(cudaMemcpy(kc.data(), view.k.code, kc.size() * 2, cudaMemcpyDeviceToHost));
  for (int h = 0; h < c.n_kv; ++h)
    for (int t = 0; t < shape.max_tokens; ++t)
      for (int d = 0; d < c.head_dim; ++d) {
        const size_t row = view.geometry().row(t / view.page_tokens, h, t % view.page_tokens);
        const uint16_t got = kc[row * c.head_dim + d];
        const uint16_t want = t < total ? f32_to_bf16(k[t * kv_row + h * c.head_dim + d]) : 0;
        ASSERT_EQ(got, want) << "K cache head " << h << " token " << t << " dim " << d;
      }
  const auto& view0 = dynamic_cast<cuda::CudaLayerCache&>(gpu_cache->layer(0)).view();
  std::vector<uint16_t> k0(kc.size());
  KVQ_CUDA_CHECK(cudaMemcpy(k0.data(), view0.k.code, k0.size() * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < k0.size(); ++i) ASSERT_EQ(k0[i], 0) << "layer 0 written by a layer 1 write";
}

std::vector<AttnCase> attn_cases() {
  return {
      // decode
      {32, 8, 128, 0, 1},
      {32, 8, 128, 1000, 1},
      {32, 8, 128, 5000, 1},   // many key chunks: exercises the merge
      {8, 4, 64, 77, 1},
      {16, 2, 256, 300, 1},    // G = 8, head_dim 256
      {12, 12, 64, 130, 1},    // MHA
      {40, 8, 128, 63, 1},     // G = 5
      // prefill (causal)
      {32, 8, 128, 0, 37},
      {8, 4, 64, 100, 50},
      {32, 8, 128, 200, 129},
      {16, 2, 256, 0, 70},
      {40, 8, 128, 33, 17},
      {8, 8, 128, 1500, 3},
      {8, 4, 96, 20, 33},      // head_dim 96: not a tensor-core shape, the fp32 kernel
  };
}

std::string attn_name(const ::testing::TestParamInfo<AttnCase>& info) {
  const auto& p = info.param;
  return "h" + std::to_string(p.n_heads) + "_kv" + std::to_string(p.n_kv) + "_d" + std::to_string(p.head_dim) + "_pos" +
         std::to_string(p.pos) + "_n" + std::to_string(p.n);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttention, ::testing::ValuesIn(attn_cases()), attn_name);

TEST(CudaKvCache, SanitizesLikeTheCpuBlock) {
  KVQ_SKIP_WITHOUT_GPU();
  const kv::CacheShape shape{1, 1, 64, 4};
  auto cache = cuda::make_cuda_kv_cache(kv::CodecOptions{}, shape);
  std::vector<float> k(64, 1.0f), v(64, -2.0f);
  k[0] = std::nanf("");
  k[1] = 1e9f;
  k[2] = -1e9f;
  cuda::DeviceBuffer<float> dk(64), dv(64);
  dk.upload(k);
  dv.upload(v);
  cache->layer(0).write(2, 1, dk.data(), dv.data());
  const auto& view = dynamic_cast<cuda::CudaLayerCache&>(cache->layer(0)).view();
  std::vector<uint16_t> kc(4 * 64);
  KVQ_CUDA_CHECK(cudaMemcpy(kc.data(), view.k.code, kc.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(kc[2 * 64 + 0], f32_to_bf16(0.0f));
  EXPECT_EQ(kc[2 * 64 + 1], f32_to_bf16(65504.0f));
  EXPECT_EQ(kc[2 * 64 + 2], f32_to_bf16(-65504.0f));
  EXPECT_EQ(kc[2 * 64 + 3], f32_to_bf16(1.0f));
  EXPECT_THROW(cache->layer(0).write(3, 2, dk.data(), dv.data()), Error);  // past capacity
}

TEST(CudaKvCache, QuantizedCodecsAreAClearError) {
  KVQ_SKIP_WITHOUT_GPU();
  kv::CodecOptions o;
  o.kv = "bf16";  // alias of none
  EXPECT_EQ(cuda::make_cuda_kv_cache(o, kv::CacheShape{1, 1, 64, 4})->codec_name(), "none");
  o.kv = "k8v4";
  try {
    cuda::make_cuda_kv_cache(o, kv::CacheShape{1, 1, 64, 4});
    FAIL() << "k8v4 on the GPU should be unsupported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported);
    EXPECT_NE(std::string(e.what()).find("k8v4"), std::string::npos) << e.what();
  }
}

}  // namespace
