// Recorded (CUDA graph) decode steps and the GPU greedy argmax.
//
//  - A replayed step runs the very kernels of a directly launched step in
//    step mode (same grid, same position read from device memory), so their
//    logits must be bit-identical.
//  - Against the old per-step launches (graphs off) only the attention's
//    chunk boundaries differ (fixed max-length grid vs one sized for the
//    current length): fp32 sums in another order, so a tight bound.
//  - The GPU argmax must pick exactly what the host scan of the downloaded
//    logits picks (NaN never wins, lowest index on ties).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <cstdio>

#include <unistd.h>

#include "backend/cuda/attention.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_kv_cache.hpp"
#include "backend/cuda/ops.hpp"
#include "core/rng.hpp"
#include "gguf/quant.hpp"
#include "gpu_test_util.hpp"
#include "model/forward.hpp"
#include "model/synth.hpp"

using namespace kvq;
namespace fs = std::filesystem;

namespace {

// The greedy Sampler's rule on the host.
int host_argmax(const float* x, int n) {
  auto val = [&](int i) { return std::isnan(x[i]) ? -INFINITY : x[i]; };
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (val(i) > val(best)) best = i;
  return best;
}

class DecodeGraph : public ::testing::TestWithParam<std::pair<std::string, std::optional<gguf::TensorType>>> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

struct GpuModel {
  std::unique_ptr<Backend> be;
  std::unique_ptr<Model> model;
  std::unique_ptr<kv::Cache> cache;
};

GpuModel open_gpu(const fs::path& path, int ctx, bool graphs) {
  GpuModel g;
  g.be = cuda::make_cuda_backend();
  g.model = Model::open(path.string(), *g.be);
  g.model->set_step_graphs(graphs);
  g.cache = g.be->make_cache(kv::CodecOptions{}, g.model->cache_shape(ctx));
  return g;
}

TEST_P(DecodeGraph, ReplayMatchesDirectLaunches) {
  const auto [shape, weights] = GetParam();
  const fs::path path =
      fs::temp_directory_path() / ("kvq_graph_" + shape + "_" + std::to_string(::getpid()) + ".gguf");
  SynthOptions so;
  so.shape = shape;
  so.weights = weights;
  so.seed = 11;
  write_synthetic(so, path.string());
  const int prompt = 24, steps = 40, ctx = 200;  // ctx > prompt + steps: chunks past the position stay empty
  GpuModel replay = open_gpu(path, ctx, true);   // recorded once, then replayed
  GpuModel direct = open_gpu(path, ctx, true);   // step mode, re-armed every step: never replays
  GpuModel plain = open_gpu(path, ctx, false);   // the per-op path with the length-sized attention grid
  fs::remove(path);
  ASSERT_TRUE(replay.model->step_graphs()) << "the CUDA backend should support recorded steps";
  const int vocab = replay.model->config().vocab_size;

  Rng rng(5);
  std::vector<int32_t> ids(prompt);
  for (auto& id : ids) id = int32_t(rng.below(uint64_t(vocab)));
  std::vector<float> lr(vocab), ld(vocab), lp(vocab);
  replay.model->forward(ids.data(), prompt, 0, *replay.cache, lr.data(), false);
  direct.model->forward(ids.data(), prompt, 0, *direct.cache, ld.data(), false);
  plain.model->forward(ids.data(), prompt, 0, *plain.cache, lp.data(), false);

  int32_t next = host_argmax(lr.data(), vocab);
  double worst_plain = 0;
  int replayed = 0;
  for (int s = 0; s < steps; ++s) {
    const int pos = prompt + s;
    const bool will_replay = replay.model->step_graph_recorded();
    replay.model->forward(&next, 1, pos, *replay.cache, lr.data(), false);
    replayed += will_replay;
    direct.model->set_step_graphs(true);  // drops the recording: this step runs directly
    direct.model->forward(&next, 1, pos, *direct.cache, ld.data(), false);
    EXPECT_FALSE(direct.model->step_graph_recorded());
    plain.model->forward(&next, 1, pos, *plain.cache, lp.data(), false);
    for (int i = 0; i < vocab; ++i) {
      ASSERT_TRUE(std::isfinite(lr[i])) << "step " << s << " logit " << i;
      ASSERT_EQ(lr[i], ld[i]) << "replayed vs direct, step " << s << " logit " << i;
      const double err = std::fabs(double(lr[i]) - lp[i]);
      worst_plain = std::max(worst_plain, err);
      // Attention sums in another order (another split count): ~1e-6
      // relative; the quantized GEMVs' int8 rounding of x can turn that into
      // whole quantization steps, i.e. the GPU-vs-CPU bound of
      // test_forward_cuda.cpp for quantized weights.
      const double abs_bound = weights ? 0.08 : 1e-3, rel_bound = weights ? 0.03 : 1e-3;
      ASSERT_LE(err, abs_bound + rel_bound * std::fabs(lp[i])) << "replayed vs graphs off, step " << s << " logit " << i;
    }
    next = host_argmax(lr.data(), vocab);
  }
  // Step 0 runs directly (sizing scratch), step 1 records and replays, the rest replay.
  EXPECT_EQ(replayed, steps - 2);
  std::printf("[ %s ] replayed %d/%d steps, max |logit diff| vs graphs off %.3g\n", shape.c_str(), replayed, steps,
              worst_plain);
}

TEST_P(DecodeGraph, ForwardArgmaxMatchesHostArgmaxOfLogits) {
  const auto [shape, weights] = GetParam();
  const fs::path path =
      fs::temp_directory_path() / ("kvq_argmax_" + shape + "_" + std::to_string(::getpid()) + ".gguf");
  SynthOptions so;
  so.shape = shape;
  so.weights = weights;
  so.seed = 12;
  write_synthetic(so, path.string());
  const int prompt = 8, steps = 40, ctx = 64;
  for (bool graphs : {true, false}) {
    GpuModel a = open_gpu(path, ctx, graphs), b = open_gpu(path, ctx, graphs);
    const int vocab = a.model->config().vocab_size;
    std::vector<int32_t> ids(prompt);
    Rng rng(3);
    for (auto& id : ids) id = int32_t(rng.below(uint64_t(vocab)));
    std::vector<float> la(vocab), lb(vocab);
    a.model->forward(ids.data(), prompt, 0, *a.cache, la.data(), false);
    b.model->forward(ids.data(), prompt, 0, *b.cache, lb.data(), false);
    int32_t next = host_argmax(lb.data(), vocab);
    for (int s = 0; s < steps; ++s) {
      // A restricted vocabulary too (tokenizer smaller than the embedding table).
      const int n = s % 2 ? vocab : vocab - 7;
      const int32_t got = a.model->forward_argmax(next, prompt + s, *a.cache, n);
      b.model->forward(&next, 1, prompt + s, *b.cache, lb.data(), false);
      ASSERT_EQ(got, host_argmax(lb.data(), n)) << (graphs ? "graphs" : "no graphs") << " step " << s;
      next = got;
    }
  }
  fs::remove(path);
}

INSTANTIATE_TEST_SUITE_P(Synthetic, DecodeGraph,
                         ::testing::Values(std::make_pair(std::string("tiny"), std::optional<gguf::TensorType>()),
                                           std::make_pair(std::string("tiny-llama"),
                                                          std::optional<gguf::TensorType>()),
                                           std::make_pair(std::string("tiny"),
                                                          std::optional<gguf::TensorType>(gguf::TensorType::Q1_0))),
                         [](const auto& info) {
                           std::string n = info.param.first + (info.param.second ? "_q1_0" : "");
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(CudaArgmax, MatchesHostRuleOnEdgeCases) {
  KVQ_SKIP_WITHOUT_GPU();
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = INFINITY;
  Rng rng(1);
  std::vector<std::vector<float>> cases;
  std::vector<float> r(151936);
  for (auto& x : r) x = float(rng.normal());
  cases.push_back(r);
  r[100] = 50.0f;
  r[90000] = 50.0f;  // tie: the lower index wins
  cases.push_back(r);
  r[5] = nan;
  r[150000] = inf;  // +inf beats everything
  cases.push_back(r);
  cases.push_back(std::vector<float>(3000, nan));    // all NaN: 0
  cases.push_back(std::vector<float>(3000, -inf));   // all -inf: 0
  cases.push_back({nan, -inf, -3.0f, nan});          // NaN never wins
  cases.push_back({7.0f});
  std::vector<float> ramp(1025);
  for (size_t i = 0; i < ramp.size(); ++i) ramp[i] = -float(i);  // max at 0, one past a block of 1024
  cases.push_back(ramp);
  ramp.back() = 1.0f;
  cases.push_back(ramp);
  cuda::DeviceBuffer<int32_t> out(1);
  cuda::DeviceBuffer<unsigned long long> work(2);
  KVQ_CUDA_CHECK(cudaMemset(work.data(), 0, work.bytes()));
  cases.push_back({-0.0f, 0.0f, -1.0f});  // -0 == +0: the lower index wins
  for (size_t c = 0; c < cases.size(); ++c) {
    cuda::DeviceBuffer<float> x(cases[c].size());
    x.upload(cases[c]);
    cuda::argmax(x.data(), int(cases[c].size()), out.data(), work.data(), nullptr);
    EXPECT_EQ(out.download()[0], host_argmax(cases[c].data(), int(cases[c].size()))) << "case " << c;
    const auto w = work.download();
    EXPECT_EQ(w[0], 0u) << "work not reset after case " << c;
    EXPECT_EQ(w[1], 0u) << "ticket not reset after case " << c;
  }
  // Through the backend interface too.
  auto be = cuda::make_cuda_backend();
  auto buf = be->alloc(cases[2].size());
  be->upload(cases[2].data(), buf->data(), cases[2].size());
  EXPECT_EQ(be->argmax(buf->data(), cases[2].size()), 150000);
}

// Fixed max-length grid with the position in device memory vs the
// length-sized grid, for positions in the first chunk, on chunk boundaries
// and at the end of the cache.
TEST(CudaAttentionDecodeAt, MatchesLengthSizedGrid) {
  KVQ_SKIP_WITHOUT_GPU();
  struct Case {
    int n_heads, n_kv, head_dim, max_tokens;
  };
  for (const Case c : {Case{32, 8, 128, 3000}, Case{8, 8, 64, 700}, Case{16, 2, 256, 130},
                       Case{8, 2, 64, 40000}}) {  // chunk length capped: many chunks
    const kv::CacheShape shape{1, c.n_kv, c.head_dim, c.max_tokens};
    auto cache = cuda::make_cuda_kv_cache(kv::CodecOptions{}, shape);
    auto& layer = static_cast<cuda::CudaLayerCache&>(cache->layer(0));
    Rng rng(uint64_t(c.max_tokens));
    const size_t kv_row = size_t(c.n_kv) * c.head_dim, q_row = size_t(c.n_heads) * c.head_dim;
    std::vector<float> k(size_t(c.max_tokens) * kv_row), v(k.size()), q(q_row);
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = float(rng.normal()) + (i % 3 == 0 ? 1.5f : 0.0f);
      v[i] = float(rng.normal());
    }
    for (auto& x : q) x = 2.0f * float(rng.normal());
    cuda::DeviceBuffer<float> dk(k.size()), dv(v.size()), dq(q.size());
    dk.upload(k);
    dv.upload(v);
    dq.upload(q);
    cuda::write_kv(layer.view(), 0, c.max_tokens, dk.data(), dv.data(), nullptr);
    const float scale = 1.0f / std::sqrt(float(c.head_dim));
    cuda::DeviceBuffer<int32_t> pos_dev(1);
    for (int pos : {0, 1, 63, 64, 65, c.max_tokens / 2, c.max_tokens - 1}) {
      gputest::Guarded ref(q_row), got(q_row);
      cuda::flash_attention(layer.view(), pos, 1, dq.data(), c.n_heads, scale, ref.data(), layer.scratch(), nullptr);
      const std::vector<float> r = ref.result();
      const int32_t p = pos;
      pos_dev.upload(&p, 1);
      cuda::flash_attention_decode_at(layer.view(), pos_dev.data(), dq.data(), c.n_heads, scale, got.data(),
                                      layer.scratch(), nullptr);
      const std::vector<float> g = got.result();
      for (size_t i = 0; i < q_row; ++i)
        ASSERT_NEAR(g[i], r[i], 1e-5 + 1e-5 * std::fabs(r[i])) << "pos " << pos << " of " << c.max_tokens << " i " << i;
    }
  }
}

// write_kv_at writes the same bf16 row as write_kv at that position.
TEST(CudaWriteKvAt, MatchesWriteKv) {
  KVQ_SKIP_WITHOUT_GPU();
  const kv::CacheShape shape{1, 4, 64, 50};
  auto a = cuda::make_cuda_kv_cache(kv::CodecOptions{}, shape), b = cuda::make_cuda_kv_cache(kv::CodecOptions{}, shape);
  auto& la = static_cast<cuda::CudaLayerCache&>(a->layer(0));
  auto& lb = static_cast<cuda::CudaLayerCache&>(b->layer(0));
  Rng rng(2);
  std::vector<float> k(4 * 64), v(4 * 64);
  for (auto& x : k) x = float(rng.normal());
  for (auto& x : v) x = float(rng.normal());
  cuda::DeviceBuffer<float> dk(k.size()), dv(v.size());
  dk.upload(k);
  dv.upload(v);
  cuda::DeviceBuffer<int32_t> pos_dev(1);
  const int32_t pos = 37;
  pos_dev.upload(&pos, 1);
  cuda::write_kv(la.view(), pos, 1, dk.data(), dv.data(), nullptr);
  cuda::write_kv_at(lb.view(), pos_dev.data(), dk.data(), dv.data(), nullptr);
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  const size_t n = size_t(4) * 50 * 64;
  std::vector<uint16_t> ka(n), kb(n), va(n), vb(n);
  KVQ_CUDA_CHECK(cudaMemcpy(ka.data(), la.view().k.code, n * 2, cudaMemcpyDeviceToHost));
  KVQ_CUDA_CHECK(cudaMemcpy(kb.data(), lb.view().k.code, n * 2, cudaMemcpyDeviceToHost));
  KVQ_CUDA_CHECK(cudaMemcpy(va.data(), la.view().v.code, n * 2, cudaMemcpyDeviceToHost));
  KVQ_CUDA_CHECK(cudaMemcpy(vb.data(), lb.view().v.code, n * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(ka, kb);
  EXPECT_EQ(va, vb);
  size_t nonzero = 0;
  for (uint16_t x : kb) nonzero += x != 0;
  EXPECT_EQ(nonzero, k.size()) << "exactly the row at the position was written";
}

}  // namespace
