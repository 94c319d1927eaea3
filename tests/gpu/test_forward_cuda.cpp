// End to end: the synthetic tiny models through Model::forward on the CPU
// backend (with its `none` cache) and on the CUDA backend (with its GPU
// cache): a 40-token prefill, then 64 greedy decode steps (128 for quantized
// weights) fed with the CPU's choice (teacher forcing, so one near-tie cannot
// derail the comparison).
//
// Why the logits differ at all, and the bound:
//  - prefill GEMMs round activations and dequantized weights to bf16 (each
//    <= 2^-9 relative) before the tensor-core product;
//  - prefill attention (n > 1, attention_prefill.cu) rounds the scaled
//    queries and the probabilities to bf16 (output error <= 2^-8 max|v| from
//    P, plus the score shift of the bf16 queries: tests/gpu/prefill_test_util.hpp);
//  - quantized-weight decode GEMVs (block types and K-quants) round x to
//    int8 per 32 values (<= half a step, ~0.4% of the group's max);
//  - both caches store bf16 K/V, but a K/V value that differs slightly
//    before rounding can round to a neighbouring bf16 value;
//  - fp32 sums in a different order everywhere else.
// These are relative errors of ~2^-8 on every matrix product, through 2
// layers and the LM head; logits have std ~1 (synth.hpp scaling), so their
// absolute error is a few 1e-2 at most. The bound is kAbs + kRel * |ref| per
// logit. Top-1 must match wherever the CPU's top-1 margin exceeds the sum of
// the bounds of its two best logits (then no error within the bound can flip it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include <unistd.h>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "core/rng.hpp"
#include "gpu_test_util.hpp"
#include "model/forward.hpp"
#include "model/synth.hpp"

using namespace kvq;
namespace fs = std::filesystem;

namespace {

struct E2eCase {
  std::string shape;
  std::optional<gguf::TensorType> weights;
  double abs_bound;
  double rel_bound;
  int steps = 64;  // greedy decode steps compared
};

class CudaForward : public ::testing::TestWithParam<E2eCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

using gputest::clear_top1;
using gputest::top2;

TEST_P(CudaForward, MatchesCpuPrefillAndGreedyDecode) {
  const E2eCase c = GetParam();
  const fs::path path = fs::temp_directory_path() /
                        ("kvq_gpu_e2e_" + c.shape + "_" + std::to_string(::getpid()) + ".gguf");
  SynthOptions so;
  so.shape = c.shape;
  so.weights = c.weights;
  so.seed = 7;
  write_synthetic(so, path.string());
  auto cpu_be = cpu::make_cpu_backend();
  auto gpu_be = cuda::make_cuda_backend();
  auto cpu_model = Model::open(path.string(), *cpu_be);
  auto gpu_model = Model::open(path.string(), *gpu_be);
  fs::remove(path);
  const int vocab = cpu_model->config().vocab_size;
  const int prompt = 40, steps = c.steps, ctx = prompt + steps + 1;
  auto cpu_cache = cpu_be->make_cache(kv::CodecOptions{}, cpu_model->cache_shape(ctx));
  auto gpu_cache = gpu_be->make_cache(kv::CodecOptions{}, gpu_model->cache_shape(ctx));

  Rng rng(99);
  std::vector<int32_t> ids(prompt);
  for (auto& id : ids) id = int32_t(rng.below(uint64_t(vocab)));
  std::vector<float> lc(size_t(prompt) * vocab), lg(lc.size());
  cpu_model->forward(ids.data(), prompt, 0, *cpu_cache, lc.data(), true);
  gpu_model->forward(ids.data(), prompt, 0, *gpu_cache, lg.data(), true);

  double worst = 0, worst_rel_excess = 0;
  auto check = [&](const float* ref, const float* got, const std::string& where) {
    for (int i = 0; i < vocab; ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << where << " logit " << i;
      const double err = std::fabs(double(got[i]) - ref[i]);
      worst = std::max(worst, err);
      const double bound = c.abs_bound + c.rel_bound * std::fabs(ref[i]);
      worst_rel_excess = std::max(worst_rel_excess, err / bound);
      ASSERT_LE(err, bound) << where << " logit " << i << " cpu " << ref[i] << " gpu " << got[i];
    }
  };
  for (int t = 0; t < prompt; ++t)
    check(lc.data() + size_t(t) * vocab, lg.data() + size_t(t) * vocab, "prefill token " + std::to_string(t));

  int checked = 0, same = 0;
  int32_t next = top2(lc.data() + size_t(prompt - 1) * vocab, vocab).first;
  std::vector<float> sc(vocab), sg(vocab);
  for (int s = 0; s < steps; ++s) {
    cpu_model->forward(&next, 1, prompt + s, *cpu_cache, sc.data(), false);
    gpu_model->forward(&next, 1, prompt + s, *gpu_cache, sg.data(), false);
    check(sc.data(), sg.data(), "decode step " + std::to_string(s));
    const auto [cpu_top, margin] = top2(sc.data(), vocab);
    const int gpu_top = top2(sg.data(), vocab).first;
    same += cpu_top == gpu_top;
    if (clear_top1(sc[cpu_top], margin, c.abs_bound, c.rel_bound)) {
      ++checked;
      EXPECT_EQ(gpu_top, cpu_top) << "decode step " << s << " (CPU margin " << margin << ")";
    }
    next = cpu_top;
  }
  std::printf("[ %s ] max |logit diff| %.4g (%.0f%% of the bound), top-1 identical %d/%d, checked %d\n",
              c.shape.c_str(), worst, 100 * worst_rel_excess, same, steps, checked);
  // A comparison that checks no step would be vacuous.
  EXPECT_GE(checked, gputest::kMinClearSteps) << "too few decode steps had a clear top-1 to compare";
}

// The quantized-weight cases round x to int8 in the decode GEMVs (block
// types and K-quants alike), which dominates their error, so they share one
// bound (gputest::kInt8LogitAbs / kInt8LogitRel, gpu_test_util.hpp). With it
// fewer of a tiny model's steps have a top-1 margin clear enough to compare
// (Q3_K: 15 of 64 at 0.10), so they decode 128 steps (Q3_K: 36 clear at 0.10
// on the H200, session 24).
constexpr double kQ = gputest::kInt8LogitAbs, kQRel = gputest::kInt8LogitRel;
const E2eCase kCases[] = {
    {"tiny", std::nullopt, 0.05, 0.02},                  // qwen3: BF16 weights, q/k norm, NEOX RoPE
    {"tiny-llama", std::nullopt, 0.05, 0.02},            // llama: tied embeddings, adjacent-pair RoPE
    {"tiny", gguf::TensorType::Q1_0, kQ, kQRel, 128},    // Bonsai's type
    {"tiny-llama", gguf::TensorType::Q4_0, kQ, kQRel, 128},
    {"tiny", gguf::TensorType::Q8_0, kQ, kQRel, 128},
    {"tiny", gguf::TensorType::Q4_K, kQ, kQRel, 128},
    {"tiny-llama", gguf::TensorType::Q6_K, kQ, kQRel, 128},
    {"tiny", gguf::TensorType::Q2_K, kQ, kQRel, 128},
    {"tiny", gguf::TensorType::Q3_K, kQ, kQRel, 128},
    {"tiny-llama", gguf::TensorType::Q5_K, kQ, kQRel, 128},
};

std::string e2e_name(const ::testing::TestParamInfo<E2eCase>& info) {
  std::string n = info.param.shape + (info.param.weights ? std::string("_") + gguf::tensor_type_name(*info.param.weights) : "");
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

INSTANTIATE_TEST_SUITE_P(Synthetic, CudaForward, ::testing::ValuesIn(kCases), e2e_name);

}  // namespace

// The trained default model (models/kvq-tiny-code.gguf, Q8_0), a prompt,
// 64 free-running greedy tokens on each device: the GPU must choose the very
// tokens the CPU chooses (each device feeds back its own choice), through the
// recorded decode step and the GPU argmax; then one step's logits are
// compared value by value. A trained model's top-1 margins are
// large, so the rounding differences cannot flip one; the smallest margin is
// printed so a near-tie failure can be told from a real divergence.
TEST(CudaForwardTrained, GreedyTokensIdenticalToCpu) {
  KVQ_SKIP_WITHOUT_GPU();
  const std::string path = std::string(KVQ_SOURCE_DIR) + "/models/kvq-tiny-code.gguf";
  auto cpu_be = cpu::make_cpu_backend();
  auto gpu_be = cuda::make_cuda_backend();
  auto cpu_model = Model::open(path, *cpu_be);
  auto gpu_model = Model::open(path, *gpu_be);
  ASSERT_TRUE(gpu_model->step_graphs());
  const int vocab = cpu_model->config().vocab_size;
  // Ten seeded ids from its vocabulary as the prompt.
  std::vector<int32_t> ids(10);
  Rng rng(5);
  for (auto& id : ids) id = int32_t(rng.below(uint64_t(vocab)));
  const int steps = 64, ctx = int(ids.size()) + steps + 1;
  auto cpu_cache = cpu_be->make_cache(kv::CodecOptions{}, cpu_model->cache_shape(ctx));
  auto gpu_cache = gpu_be->make_cache(kv::CodecOptions{}, gpu_model->cache_shape(ctx));
  std::vector<float> lc(vocab), lg(vocab);
  cpu_model->forward(ids.data(), int(ids.size()), 0, *cpu_cache, lc.data(), false);
  gpu_model->forward(ids.data(), int(ids.size()), 0, *gpu_cache, lg.data(), false);
  int32_t cpu_next = top2(lc.data(), vocab).first, gpu_next = top2(lg.data(), vocab).first;
  ASSERT_EQ(gpu_next, cpu_next) << "first token after the prompt";
  std::vector<int32_t> cpu_tokens{cpu_next}, gpu_tokens{gpu_next};
  float min_margin = INFINITY;
  double worst = 0;
  for (int s = 0; s + 1 < steps; ++s) {
    const int pos = int(ids.size()) + s;
    cpu_model->forward(&cpu_next, 1, pos, *cpu_cache, lc.data(), false);
    const auto [top, margin] = top2(lc.data(), vocab);
    min_margin = std::min(min_margin, margin);
    cpu_next = top;
    gpu_next = gpu_model->forward_argmax(gpu_next, pos, *gpu_cache, vocab);
    cpu_tokens.push_back(cpu_next);
    gpu_tokens.push_back(gpu_next);
    ASSERT_EQ(gpu_tokens, cpu_tokens) << "step " << s << " (CPU top-1 margin " << margin << ")";
  }
  // The logits of one more step, compared value by value (download path).
  const int pos = int(ids.size()) + steps - 1;
  cpu_model->forward(&cpu_next, 1, pos, *cpu_cache, lc.data(), false);
  gpu_model->forward(&gpu_next, 1, pos, *gpu_cache, lg.data(), false);
  // The int8 rounding of GEMV inputs perturbs every logit by a fraction of the
  // row's scale, not of its own magnitude (measured: 0.10 on a logit of 0.2
  // with the row's largest near 15): 1 % of the largest |logit| plus 0.05.
  float row_max = 0;
  for (int i = 0; i < vocab; ++i) row_max = std::max(row_max, std::fabs(lc[i]));
  for (int i = 0; i < vocab; ++i) {
    const double err = std::fabs(double(lg[i]) - lc[i]);
    worst = std::max(worst, err);
    ASSERT_LE(err, 0.05 + 0.01 * row_max) << "logit " << i << " (largest |logit| " << row_max << ")";
  }
  EXPECT_TRUE(gpu_model->step_graph_recorded()) << "the GPU steps were not replayed from a recording";
  std::printf("[ kvq-tiny-code ] 64 greedy tokens identical, smallest CPU top-1 margin %.3f, last-step max |logit "
              "diff| %.4g\n",
              min_margin, worst);
}
