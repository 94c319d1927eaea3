// Tensor-core decode attention (backend/cuda/attention_decode) vs the CPU
// `none` cache: flash_attention_decode_at() with the position in device
// memory, recorded ONCE into a CUDA graph and replayed at positions 0, 15, 16,
// 17, 1000, 4095 and 4099 (the last row of a 4100-token cache, whose last key
// tile runs past the cache), in caches of 4100 and 70000 tokens; the same
// positions through direct decode_at calls and flash_attention(n = 1); GQA
// groups 1, 2, 4, 5, 8, 16 and head_dim 64, 128, 256. Also two decode calls
// back to back (the fused merge's arrival counters must be back at zero).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/attention.hpp"
#include "backend/cuda/attention_decode.hpp"
#include "backend/cuda/cuda_kv_cache.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "gpu_test_util.hpp"
#include "kv/cache.hpp"

using namespace kvq;
using gputest::normal;

namespace {

constexpr int kFilled = 4100;  // tokens written into every cache (rows 0..4099)
const std::vector<int> kPositions = {0, 15, 16, 17, 1000, 4095, 4099};

struct DecodeCase {
  int G, n_kv, head_dim, max_tokens;
};


// Device output buffer with NaN payload and trailing sentinels, reset before
// every launch (its address must stay fixed: a recorded graph writes it).
class OutBuffer {
 public:
  explicit OutBuffer(size_t n) : n_(n), buf_(n + gputest::kSentinels) {}
  float* data() { return buf_.data(); }
  void poison() {
    std::vector<float> h(n_ + gputest::kSentinels, std::numeric_limits<float>::quiet_NaN());
    for (int i = 0; i < gputest::kSentinels; ++i) h[n_ + i] = gputest::sentinel(i);
    buf_.upload(h);
  }
  std::vector<float> result() {
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> h = buf_.download();
    for (int i = 0; i < gputest::kSentinels; ++i)
      EXPECT_EQ(h[n_ + i], gputest::sentinel(i)) << "wrote past the end (sentinel " << i << ")";
    h.resize(n_);
    return h;
  }

 private:
  size_t n_;
  cuda::DeviceBuffer<float> buf_;
};


void expect_counters_zero(const cuda::AttentionScratch& scratch) {
  if (scratch.decode_counters.size() == 0) return;
  const auto c = scratch.decode_counters.download();
  for (size_t i = 0; i < c.size(); ++i) ASSERT_EQ(c[i], 0u) << "arrival counter of KV head " << i << " not reset";
}

// Random K/V rows (with a shared direction, like real post-RoPE keys, so the
// softmax is peaked) written into a GPU cache of the case's capacity and a
// CPU `none` cache, plus one random query per position and its CPU result.
struct DecodeFixture {
  explicit DecodeFixture(const DecodeCase& c)
      : c(c), n_heads(c.G * c.n_kv), q_row(size_t(n_heads) * c.head_dim), scale(1.0f / std::sqrt(float(c.head_dim))) {
    Rng rng(uint64_t(c.G) * 1000003 + c.n_kv * 10007 + c.head_dim * 101 + c.max_tokens);
    const size_t kv_row = size_t(c.n_kv) * c.head_dim;
    auto k = normal(rng, kFilled * kv_row), v = normal(rng, kFilled * kv_row);
    for (int t = 0; t < kFilled; ++t)
      for (size_t i = 0; i < kv_row; ++i) k[t * kv_row + i] += (i % 3 == 0) ? 1.5f : 0.0f;
    cpu = kv::make_cpu_cache(kv::CodecOptions{}, kv::CacheShape{1, c.n_kv, c.head_dim, kFilled});
    gpu = cuda::make_cuda_kv_cache(kv::CodecOptions{}, kv::CacheShape{1, c.n_kv, c.head_dim, c.max_tokens});
    cpu->layer(0).write(0, kFilled, k.data(), v.data());
    cuda::DeviceBuffer<float> dk(k.size()), dv(v.size());
    dk.upload(k);
    dv.upload(v);
    gpu->layer(0).write(0, kFilled, dk.data(), dv.data());
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    for (int pos : kPositions) {
      q.push_back(normal(rng, q_row, 2.0f));
      ref.emplace_back(q_row);
      cpu->layer(0).attend(pos, 1, q.back().data(), n_heads, scale, ref.back().data());
    }
  }
  const cuda::GpuKvLayer& view() const { return dynamic_cast<cuda::CudaLayerCache&>(gpu->layer(0)).view(); }
  std::string label(const char* how, int pos) const { return std::string(how) + "_pos" + std::to_string(pos); }

  DecodeCase c;
  int n_heads;
  size_t q_row;
  float scale;
  std::unique_ptr<kv::Cache> cpu, gpu;
  std::vector<std::vector<float>> q, ref;  // per position
};

class CudaDecodeAttention : public ::testing::TestWithParam<DecodeCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaDecodeAttention, RecordedLaunchMatchesCpuAtEveryPosition) {
  const DecodeCase c = GetParam();
  DecodeFixture f(c);
  ASSERT_TRUE(cuda::flash_decode_supported(f.n_heads, c.n_kv, c.head_dim, nullptr, nullptr)) << "not the tensor-core path";
  const int splits = cuda::flash_decode_splits(f.view(), f.n_heads);
  EXPECT_GT(splits, 1) << "one split would not exercise the merge";
  EXPECT_LE(splits, cuda::kMaxDecodeSplits);

  cudaStream_t stream;
  KVQ_CUDA_CHECK(cudaStreamCreate(&stream));
  cuda::AttentionScratch scratch;
  cuda::DeviceBuffer<int> pos_dev(1);
  cuda::DeviceBuffer<float> dq(f.q_row);
  OutBuffer out(f.q_row);

  // Warm call (sizes the scratch, as the backend's warm step does), then record.
  pos_dev.upload(std::vector<int>{0});
  dq.upload(f.q[0]);
  cuda::flash_attention_decode_at(f.view(), pos_dev.data(), dq.data(), f.n_heads, f.scale, out.data(), scratch, stream);
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  const void* part_before = scratch.part.data();
  const void* counters_before = scratch.decode_counters.data();
  cudaGraph_t graph = nullptr;
  KVQ_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cuda::flash_attention_decode_at(f.view(), pos_dev.data(), dq.data(), f.n_heads, f.scale, out.data(), scratch, stream);
  KVQ_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  KVQ_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaGraphDestroy(graph);
  EXPECT_EQ(scratch.part.data(), part_before) << "the recorded call reallocated the scratch";
  EXPECT_EQ(scratch.decode_counters.data(), counters_before);

  for (size_t i = 0; i < kPositions.size(); ++i) {
    const int pos = kPositions[i];
    if (pos >= c.max_tokens) continue;
    pos_dev.upload(std::vector<int>{pos});
    dq.upload(f.q[i]);
    out.poison();
    KVQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
    gputest::expect_attention_close(out.result(), f.ref[i], c.head_dim, f.label("graph", pos));
    expect_counters_zero(scratch);
    if (HasFatalFailure()) break;
  }
  // Replays back to back on the stream, same position: same result each time.
  {
    const size_t i = 4;  // position 1000
    pos_dev.upload(std::vector<int>{kPositions[i]});
    dq.upload(f.q[i]);
    out.poison();
    for (int r = 0; r < 3; ++r) KVQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
    gputest::expect_attention_close(out.result(), f.ref[i], c.head_dim, "graph_x3_pos1000");
    expect_counters_zero(scratch);
  }
  cudaGraphExecDestroy(exec);

  // The same positions without a graph: decode_at (device position) and
  // flash_attention (host position; may use fewer splits).
  for (size_t i = 0; i < kPositions.size() && !HasFatalFailure(); ++i) {
    const int pos = kPositions[i];
    if (pos >= c.max_tokens) continue;
    pos_dev.upload(std::vector<int>{pos});
    dq.upload(f.q[i]);
    out.poison();
    cuda::flash_attention_decode_at(f.view(), pos_dev.data(), dq.data(), f.n_heads, f.scale, out.data(), scratch,
                                    stream);
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
    gputest::expect_attention_close(out.result(), f.ref[i], c.head_dim, f.label("decode_at", pos));
    out.poison();
    cuda::flash_attention(f.view(), pos, 1, dq.data(), f.n_heads, f.scale, out.data(), scratch, stream);
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
    gputest::expect_attention_close(out.result(), f.ref[i], c.head_dim, f.label("flash_attention", pos));
    expect_counters_zero(scratch);
  }
  KVQ_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_P(CudaDecodeAttention, TwoCallsBackToBack) {
  const DecodeCase c = GetParam();
  DecodeFixture f(c);
  cuda::AttentionScratch scratch;
  // Positions 17 and 4095 (indices 3 and 5), both queued before any sync: the
  // second launch only works if the first left every counter at zero.
  const size_t a = 3, b = 5;
  cuda::DeviceBuffer<int> pos_dev(2);
  pos_dev.upload(std::vector<int>{kPositions[a], kPositions[b]});
  cuda::DeviceBuffer<float> qa(f.q_row), qb(f.q_row);
  qa.upload(f.q[a]);
  qb.upload(f.q[b]);
  OutBuffer outa(f.q_row), outb(f.q_row);
  outa.poison();
  outb.poison();
  cuda::flash_attention_decode_at(f.view(), pos_dev.data(), qa.data(), f.n_heads, f.scale, outa.data(), scratch,
                                  nullptr);
  cuda::flash_attention_decode_at(f.view(), pos_dev.data() + 1, qb.data(), f.n_heads, f.scale, outb.data(), scratch,
                                  nullptr);
  gputest::expect_attention_close(outa.result(), f.ref[a], c.head_dim, "first");
  gputest::expect_attention_close(outb.result(), f.ref[b], c.head_dim, "second");
  expect_counters_zero(scratch);
}

std::vector<DecodeCase> decode_cases() {
  // KV head counts vary with G (odd ones included) so the split count varies
  // too, up to its cap (n_kv = 3).
  const int groups[][2] = {{1, 8}, {2, 5}, {4, 8}, {5, 3}, {8, 4}, {16, 2}};
  std::vector<DecodeCase> cases;
  for (int cap : {4100, 70000})
    for (int d : {64, 128, 256})
      for (const auto& gk : groups) cases.push_back({gk[0], gk[1], d, cap});
  return cases;
}

std::string decode_name(const ::testing::TestParamInfo<DecodeCase>& info) {
  const auto& p = info.param;
  return "G" + std::to_string(p.G) + "_kv" + std::to_string(p.n_kv) + "_d" + std::to_string(p.head_dim) + "_cap" +
         std::to_string(p.max_tokens);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaDecodeAttention, ::testing::ValuesIn(decode_cases()), decode_name);

TEST(CudaDecodeSupport, UnsupportedShapesKeepTheGeneralKernel) {
  EXPECT_FALSE(cuda::flash_decode_supported(34, 2, 128, nullptr, nullptr));  // G = 17
  EXPECT_FALSE(cuda::flash_decode_supported(8, 8, 96, nullptr, nullptr));    // head_dim 96
  EXPECT_FALSE(cuda::flash_decode_supported(8, 3, 128, nullptr, nullptr));   // not a multiple
  alignas(16) static float buf[8];
  EXPECT_FALSE(cuda::flash_decode_supported(8, 8, 128, buf, buf + 1));  // out not 16-byte aligned
  EXPECT_FALSE(cuda::flash_decode_supported(8, 8, 128, buf + 1, buf));  // q not 16-byte aligned
  EXPECT_TRUE(cuda::flash_decode_supported(8, 8, 128, buf, buf));
}

}  // namespace
