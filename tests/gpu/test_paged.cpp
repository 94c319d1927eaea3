// The paged GPU KV store and the batched decode (issue 25, docs/architecture.md
// "The step batch"): rows written at scrambled slots are byte-identical to the
// CPU store's, batched decode attention of sequences of different lengths over
// scrambled pages matches the CPU oracle's attend_runs over the same packed
// bytes, and BatchDecoder on the CUDA backend gives each sequence its solo
// result.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/batch.hpp"
#include "backend/cuda/attention.hpp"
#include "backend/cuda/attention_decode.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_kv_cache.hpp"
#include "backend/cuda/ops.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "engine/batch_decoder.hpp"
#include "gpu_test_util.hpp"
#include "paged_test_util.hpp"
#include "kv/cache.hpp"
#include "kv/codec_table.hpp"
#include "kv/page.hpp"
#include "model/forward.hpp"
#include "model/synth.hpp"

using namespace kvq;
using gputest::codec;
using gputest::download_bytes;
using gputest::Guarded;
using gputest::label_of;
using gputest::normal;
using gputest::store_of;
using gputest::tiny_synthetic_model;

namespace {

// Sequences over a store of 64-token pages whose block tables are scrambled
// (not in page order, pages of different sequences interleaved), with odd
// lengths that end inside a page.
constexpr int kPageTokens = 64;
struct Sequences {
  std::vector<int> lengths;
  std::vector<std::vector<int32_t>> tables;
  int n_pages = 0;
};
Sequences scrambled(const std::vector<int>& lengths, int spare_pages, uint64_t seed) {
  Sequences s;
  s.lengths = lengths;
  int need = spare_pages;
  for (int len : lengths) need += kv::pages_for(len, kPageTokens);
  s.n_pages = need;
  std::vector<int32_t> order(static_cast<size_t>(need));
  for (int i = 0; i < need; ++i) order[size_t(i)] = need - 1 - i;  // descending, then shuffled
  Rng rng(seed);
  for (int i = need - 1; i > 0; --i) std::swap(order[size_t(i)], order[size_t(rng.below(uint64_t(i + 1)))]);
  size_t next = 0;
  for (int len : lengths) {
    std::vector<int32_t> t;
    for (int p = 0; p < kv::pages_for(len, kPageTokens); ++p) t.push_back(order[next++]);
    s.tables.push_back(t);
  }
  return s;
}

// ---------------------------------------------------------------------------
// (a) Rows at scrambled slots: byte-identical to the CPU store's, every other
// row untouched (zero), for a codec of every storage family.
class CudaPagedStore : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaPagedStore, RowsAtScrambledSlotsMatchCpu) {
  const std::string name = GetParam();
  const int D = 128, n_kv = 2, layer = 1;
  const Sequences seqs = scrambled({5, 70, 131}, 2, 17);
  kv::CacheShape shape{2, n_kv, D, seqs.n_pages * kPageTokens};
  shape.n_heads = 4 * n_kv;
  shape.page_tokens = kPageTokens;
  auto cpu = kv::make_cpu_cache(codec(name), shape);
  auto gpu = cuda::make_cuda_kv_store_for_test(codec(name), shape);
  ASSERT_EQ(gpu->shape().page_tokens, kPageTokens);
  ASSERT_EQ(store_of(*gpu, layer).n_pages, seqs.n_pages);
  const kv::PageGeometry geo = gpu->shape().geometry();

  // Every token of every sequence, in one write (the slots interleave pages).
  std::vector<int32_t> slots;
  for (size_t s = 0; s < seqs.lengths.size(); ++s)
    for (int t = 0; t < seqs.lengths[s]; ++t) slots.push_back(geo.slot_of(seqs.tables[s].data(), t));
  const int n = int(slots.size());
  Rng rng(uint64_t(D) * 131 + n_kv);
  const auto k = normal(rng, size_t(n) * n_kv * D, 2.0f), v = normal(rng, size_t(n) * n_kv * D, 2.0f);
  cpu->layer(layer).write_slots(slots.data(), n, k.data(), v.data());
  Guarded dk(k.size(), &k), dv(v.size(), &v);
  gpu->layer(layer).write_slots(slots.data(), n, dk.data(), dv.data());
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());

  const size_t rows = size_t(seqs.n_pages) * n_kv * kPageTokens;
  for (bool v_side : {false, true}) {
    const cuda::GpuKvSide& side = v_side ? store_of(*gpu, layer).v : store_of(*gpu, layer).k;
    std::vector<uint8_t> want_code(rows * side.code_bytes), want_side(rows * side.side_bytes);
    for (int32_t slot : slots)
      for (int h = 0; h < n_kv; ++h) {
        const size_t r = geo.slot_row(slot, h);
        cpu->layer(layer).read_row(slot, h, v_side, want_code.data() + r * side.code_bytes,
                                   want_side.data() + r * side.side_bytes);
      }
    const auto code = download_bytes(side.code, want_code.size());
    const auto sb = download_bytes(side.side, want_side.size());
    for (size_t i = 0; i < code.size(); ++i)
      ASSERT_EQ(int(code[i]), int(want_code[i])) << name << (v_side ? " V" : " K") << " code byte " << i % side.code_bytes
                                                 << " of row " << i / side.code_bytes;
    for (size_t i = 0; i < sb.size(); ++i)
      ASSERT_EQ(int(sb[i]), int(want_side[i])) << name << (v_side ? " V" : " K") << " side byte " << i % side.side_bytes
                                               << " of row " << i / side.side_bytes;
    // Layer 0 never written.
    const cuda::GpuKvSide& other = v_side ? store_of(*gpu, 0).v : store_of(*gpu, 0).k;
    const auto zero = download_bytes(other.code, rows * other.code_bytes);
    ASSERT_TRUE(std::all_of(zero.begin(), zero.end(), [](uint8_t b) { return b == 0; })) << "layer 0 written";
  }
}

// Cache::copy_pages on the device (copy_kv_pages, every array of every
// layer) against the CPU store's copy of the same rows: the copied pages
// hold the bytes the CPU's do, the source pages and every page outside the
// copy are untouched.
TEST_P(CudaPagedStore, CopiedPagesMatchCpuCopies) {
  const std::string name = GetParam();
  const int D = 128, n_kv = 2, n_layers = 3;
  const Sequences seqs = scrambled({5, 70, 131}, 6, 29);  // 5 pages written, 6 spare
  kv::CacheShape shape{n_layers, n_kv, D, seqs.n_pages * kPageTokens};
  shape.n_heads = 4 * n_kv;
  shape.page_tokens = kPageTokens;
  auto cpu = kv::make_cpu_cache(codec(name), shape);
  auto gpu = cuda::make_cuda_kv_store_for_test(codec(name), shape);
  const kv::PageGeometry geo = gpu->shape().geometry();
  std::vector<int32_t> slots, used;
  for (size_t s = 0; s < seqs.lengths.size(); ++s) {
    for (int t = 0; t < seqs.lengths[s]; ++t) slots.push_back(geo.slot_of(seqs.tables[s].data(), t));
    used.insert(used.end(), seqs.tables[s].begin(), seqs.tables[s].end());
  }
  const int n = int(slots.size());
  Rng rng(41);
  for (int l = 0; l < n_layers; ++l) {
    const auto k = normal(rng, size_t(n) * n_kv * D, 2.0f), v = normal(rng, size_t(n) * n_kv * D, 2.0f);
    cpu->layer(l).write_slots(slots.data(), n, k.data(), v.data());
    Guarded dk(k.size(), &k), dv(v.size(), &v);
    gpu->layer(l).write_slots(slots.data(), n, dk.data(), dv.data());
  }
  // Copy the 70-token sequence's 2 pages and the 131-token one's 3 into 5 of the spare pages.
  std::vector<int32_t> src = seqs.tables[1], dst;
  src.insert(src.end(), seqs.tables[2].begin(), seqs.tables[2].end());
  for (int p = 0; p < seqs.n_pages && dst.size() < src.size(); ++p)
    if (std::find(used.begin(), used.end(), p) == used.end()) dst.push_back(p);
  ASSERT_EQ(dst.size(), src.size());
  cpu->copy_pages(src.data(), dst.data(), int(src.size()));
  gpu->copy_pages(src.data(), dst.data(), int(src.size()));
  EXPECT_THROW(gpu->copy_pages(src.data(), src.data(), int(src.size())), Error);  // a destination that is a source
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());

  const size_t rows = size_t(seqs.n_pages) * n_kv * kPageTokens;
  for (int l = 0; l < n_layers; ++l)
    for (bool v_side : {false, true}) {
      const cuda::GpuKvSide& side = v_side ? store_of(*gpu, l).v : store_of(*gpu, l).k;
      // Rows the CPU store holds (written or copied); zeros elsewhere.
      std::vector<uint8_t> want_code(rows * side.code_bytes, 0), want_side(rows * side.side_bytes, 0);
      for (int p = 0; p < seqs.n_pages; ++p) {
        const bool held = std::find(used.begin(), used.end(), p) != used.end() ||
                          std::find(dst.begin(), dst.end(), p) != dst.end();
        if (!held) continue;
        // Slots of the page that were written (a copied page carries its source's unwritten tail as zeros).
        const int32_t source = std::find(dst.begin(), dst.end(), p) != dst.end()
                                   ? src[size_t(std::find(dst.begin(), dst.end(), p) - dst.begin())]
                                   : p;
        for (int e = 0; e < kPageTokens; ++e) {
          if (std::find(slots.begin(), slots.end(), source * kPageTokens + e) == slots.end()) continue;
          for (int h = 0; h < n_kv; ++h) {
            const size_t r = geo.row(p, h, e);
            cpu->layer(l).read_row(p * kPageTokens + e, h, v_side, want_code.data() + r * side.code_bytes,
                                   want_side.data() + r * side.side_bytes);
          }
        }
      }
      const auto code = download_bytes(side.code, want_code.size());
      const auto sb = download_bytes(side.side, want_side.size());
      for (size_t i = 0; i < code.size(); ++i)
        ASSERT_EQ(int(code[i]), int(want_code[i])) << name << " layer " << l << (v_side ? " V" : " K")
                                                   << " code byte " << i % side.code_bytes << " of row "
                                                   << i / side.code_bytes;
      for (size_t i = 0; i < sb.size(); ++i)
        ASSERT_EQ(int(sb[i]), int(want_side[i])) << name << " layer " << l << (v_side ? " V" : " K")
                                                 << " side byte " << i % side.side_bytes << " of row "
                                                 << i / side.side_bytes;
    }
}

// The fused q/k norm + RoPE + store over a batch of tokens (each its own
// position and slot) writes the bytes write_kv_slots writes for the k it
// produced and for v.
TEST_P(CudaPagedStore, BatchedRopeStoreEqualsWriteKvSlots) {
  const std::string name = GetParam();
  const int D = 128, n_kv = 2, nh = 4 * n_kv;
  const Sequences seqs = scrambled({5, 70, 131}, 1, 23);
  kv::CacheShape shape{1, n_kv, D, seqs.n_pages * kPageTokens};
  shape.page_tokens = kPageTokens;
  auto fused = cuda::make_cuda_kv_store_for_test(codec(name), shape);
  auto plain = cuda::make_cuda_kv_store_for_test(codec(name), shape);
  const kv::PageGeometry geo = fused->shape().geometry();
  // One decode token per sequence (its last position).
  std::vector<int32_t> pos, slots;
  for (size_t s = 0; s < seqs.lengths.size(); ++s) {
    pos.push_back(seqs.lengths[s] - 1);
    slots.push_back(geo.slot_of(seqs.tables[s].data(), seqs.lengths[s] - 1));
  }
  const int n = int(pos.size());
  const std::vector<float> qr = gputest::store_fused_and_plain(*fused, *plain, nh, n_kv, D, pos, slots);
  const size_t rows = size_t(seqs.n_pages) * n_kv * kPageTokens;
  for (bool k_side : {true, false}) {
    const cuda::GpuKvSide& a = k_side ? store_of(*fused, 0).k : store_of(*fused, 0).v;
    const cuda::GpuKvSide& b = k_side ? store_of(*plain, 0).k : store_of(*plain, 0).v;
    EXPECT_EQ(download_bytes(a.code, rows * a.code_bytes), download_bytes(b.code, rows * b.code_bytes)) << name;
    EXPECT_EQ(download_bytes(a.side, rows * a.side_bytes), download_bytes(b.side, rows * b.side_bytes)) << name;
    // Each token's row is written (not all zero) at its own slot.
    const auto code = download_bytes(a.code, rows * a.code_bytes);
    for (int32_t slot : slots) {
      const size_t r = geo.slot_row(slot, 0);
      EXPECT_TRUE(std::any_of(code.begin() + ptrdiff_t(r * a.code_bytes), code.begin() + ptrdiff_t((r + 1) * a.code_bytes),
                              [](uint8_t x) { return x != 0; }))
          << name << " slot " << slot;
    }
  }
  // q was normed and rotated per token (its own position): token 0's q
  // differs from a q rotated at another token's position, so a kernel that
  // used one position for all would be caught by the model test; here only
  // check every element was written.
  for (float x : qr) ASSERT_TRUE(std::isfinite(x));
}

INSTANTIATE_TEST_SUITE_P(Codecs, CudaPagedStore,
                         ::testing::Values("none", "k8v8", "fp8", "k8v4", "tsym3", "k8vturbo3tcq", "iso3", "rotor3_sym",
                                           "rotor3_sym+qjl", "q8/turbo3"),
                         [](const auto& i) { return label_of(i.param); });

// ---------------------------------------------------------------------------
// (b) Batched decode attention: sequences of different lengths over scrambled
// pages in one launch (grid z = sequence) vs the CPU's attend_runs over the
// same packed bytes (the store rows were shown identical above).
struct BatchCase {
  const char* codec;
  int G, n_kv;
};
class CudaBatchedDecode : public ::testing::TestWithParam<BatchCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaBatchedDecode, MatchesCpuAttendRuns) {
  const BatchCase c = GetParam();
  const int D = 128, n_heads = c.G * c.n_kv;
  const kv::ResolvedCodec rc = kv::resolve_codec(codec(c.codec));
  ASSERT_TRUE(cuda::flash_decode_instance_exists(D, rc.k.family, rc.k.bits, rc.k.qjl, rc.v.family, rc.v.bits));
  const std::vector<int> lengths = {5, 70, 300, 1, 129};
  const Sequences seqs = scrambled(lengths, 3, 41);
  kv::CacheShape shape{1, c.n_kv, D, seqs.n_pages * kPageTokens};
  shape.n_heads = n_heads;
  shape.page_tokens = kPageTokens;
  auto cpu = kv::make_cpu_cache(codec(c.codec), shape);
  auto gpu = cuda::make_cuda_kv_cache(codec(c.codec), shape);
  const kv::PageGeometry geo = gpu->shape().geometry();
  std::vector<int32_t> slots;
  for (size_t s = 0; s < lengths.size(); ++s)
    for (int t = 0; t < lengths[s]; ++t) slots.push_back(geo.slot_of(seqs.tables[s].data(), t));
  const int n = int(slots.size());
  Rng rng(uint64_t(c.G) * 1009 + c.n_kv);
  const size_t kv_row = size_t(c.n_kv) * D, q_row = size_t(n_heads) * D;
  const auto [k, v] = gputest::write_peaked_rows(*cpu, *gpu, slots, c.n_kv, D, rng);
  // One query per sequence, at its last token; run z is row z.
  std::vector<kv::QueryRun> runs;
  for (size_t s = 0; s < lengths.size(); ++s) {
    kv::QueryRun r;
    r.pages = seqs.tables[s].data();
    r.n_pages = int(seqs.tables[s].size());
    r.first = int(s);
    r.n = 1;
    r.pos = lengths[s] - 1;
    runs.push_back(r);
  }
  const int n_seq = int(runs.size());
  const auto q = normal(rng, size_t(n_seq) * q_row, 2.0f);
  const float scale = 1.0f / std::sqrt(float(D));
  std::vector<float> ref(q.size());
  cpu->layer(0).attend_runs(runs.data(), n_seq, q.data(), n_heads, scale, ref.data());
  Guarded dq(q.size(), &q), out(q.size());
  gpu->layer(0).attend_runs(runs.data(), n_seq, dq.data(), n_heads, scale, out.data());
  gputest::expect_attention_close(out.result(), ref, D, label_of(c.codec) + "_batched");

  // Each sequence alone (a one-run call) gives the same values as in the
  // batch: the batch changes the work split, not what a sequence attends.
  for (int z = 0; z < n_seq; ++z) {
    kv::QueryRun one = runs[size_t(z)];
    one.first = 0;
    std::vector<float> qz(q.begin() + ptrdiff_t(z * q_row), q.begin() + ptrdiff_t((z + 1) * q_row));
    Guarded dqz(q_row, &qz), outz(q_row);
    gpu->layer(0).attend_runs(&one, 1, dqz.data(), n_heads, scale, outz.data());
    const std::vector<float> refz(ref.begin() + ptrdiff_t(z * q_row), ref.begin() + ptrdiff_t((z + 1) * q_row));
    gputest::expect_attention_close(outz.result(), refz, D, label_of(c.codec) + "_alone_" + std::to_string(z));
  }

  // The device-position form with the identity table (the recorded step's
  // path) still matches a one-sequence store: sequence 2 copied in page order.
  kv::CacheShape one_shape = shape;
  auto solo_cpu = kv::make_cpu_cache(codec(c.codec), one_shape);
  const int len = lengths[2];
  std::vector<float> ks, vs;
  size_t offset = 0;
  for (size_t s = 0; s < 2; ++s) offset += size_t(lengths[s]);
  ks.assign(k.begin() + ptrdiff_t(offset * kv_row), k.begin() + ptrdiff_t((offset + len) * kv_row));
  vs.assign(v.begin() + ptrdiff_t(offset * kv_row), v.begin() + ptrdiff_t((offset + len) * kv_row));
  auto solo_gpu = cuda::make_cuda_kv_cache(codec(c.codec), one_shape);
  {
    Guarded dk(ks.size(), &ks), dv(vs.size(), &vs);
    solo_gpu->layer(0).write(0, len, dk.data(), dv.data());
  }
  cuda::AttentionScratch scratch;
  cuda::DeviceBuffer<int> pos_dev(1);
  pos_dev.upload(std::vector<int>{len - 1});
  std::vector<float> q2(q.begin() + ptrdiff_t(2 * q_row), q.begin() + ptrdiff_t(3 * q_row));
  Guarded dq2(q_row, &q2), out2(q_row);
  cuda::flash_attention_decode_at(store_of(*solo_gpu, 0), pos_dev.data(), dq2.data(), n_heads, scale, out2.data(),
                                  scratch, nullptr);
  const std::vector<float> ref2(ref.begin() + ptrdiff_t(2 * q_row), ref.begin() + ptrdiff_t(3 * q_row));
  gputest::expect_attention_close(out2.result(), ref2, D, label_of(c.codec) + "_identity_decode_at");
}

INSTANTIATE_TEST_SUITE_P(Codecs, CudaBatchedDecode,
                         ::testing::Values(BatchCase{"none", 4, 2}, BatchCase{"k8v8", 4, 2}, BatchCase{"k8v8", 8, 1},
                                           BatchCase{"fp8", 4, 2}, BatchCase{"k8v4", 4, 2},
                                           BatchCase{"tsym3", 4, 2}, BatchCase{"k8vturbo3tcq", 4, 2},
                                           BatchCase{"iso3", 4, 2}, BatchCase{"rotor3_sym", 4, 2},
                                           BatchCase{"rotor3_sym+qjl", 4, 2}, BatchCase{"k8v4", 16, 1}),
                         [](const auto& i) {
                           return label_of(i.param.codec) + "_G" + std::to_string(i.param.G) + "_kv" +
                                  std::to_string(i.param.n_kv);
                         });

// Prefill chunks over a paged store: a sequence's chunk attends its prefix
// through its (scrambled) block table, for `none` (read in place) and a
// quantized store (dequantized through the table), vs the CPU's attend_runs.
TEST(CudaPagedPrefill, ChunkOverScrambledPagesMatchesCpu) {
  KVQ_SKIP_WITHOUT_GPU();
  for (const char* name : {"none", "k8v8", "k8v4", "rotor3_sym"}) {
    SCOPED_TRACE(name);
    const int D = 128, n_kv = 2, n_heads = 8;
    const Sequences seqs = scrambled({200}, 4, 77);
    kv::CacheShape shape{1, n_kv, D, seqs.n_pages * kPageTokens};
    shape.n_heads = n_heads;
    shape.page_tokens = kPageTokens;
    auto cpu = kv::make_cpu_cache(codec(name), shape);
    auto gpu = cuda::make_cuda_kv_cache(codec(name), shape);
    const kv::PageGeometry geo = gpu->shape().geometry();
    const int len = seqs.lengths[0], pos = 150, n = len - pos;
    std::vector<int32_t> slots;
    for (int t = 0; t < len; ++t) slots.push_back(geo.slot_of(seqs.tables[0].data(), t));
    Rng rng(3);
    const size_t kv_row = size_t(n_kv) * D, q_row = size_t(n_heads) * D;
    auto k = normal(rng, size_t(len) * kv_row), v = normal(rng, size_t(len) * kv_row);
    cpu->layer(0).write_slots(slots.data(), len, k.data(), v.data());
    Guarded dk(k.size(), &k), dv(v.size(), &v);
    gpu->layer(0).write_slots(slots.data(), len, dk.data(), dv.data());
    kv::QueryRun run;
    run.pages = seqs.tables[0].data();
    run.n_pages = int(seqs.tables[0].size());
    run.first = 0;
    run.n = n;
    run.pos = pos;
    const auto q = normal(rng, size_t(n) * q_row, 1.0f);
    const float scale = 1.0f / std::sqrt(float(D));
    std::vector<float> ref(q.size());
    cpu->layer(0).attend_runs(&run, 1, q.data(), n_heads, scale, ref.data());
    Guarded dq(q.size(), &q), out(q.size());
    gpu->layer(0).attend_runs(&run, 1, dq.data(), n_heads, scale, out.data());
    const auto y = out.result();
    // Tensor-core prefill rounds q and p to bf16: the e2e-style bound (see
    // prefill_test_util.hpp for the exact one; this only guards addressing:
    // a wrong page gives O(1) errors).
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << i;
      ASSERT_NEAR(y[i], ref[i], 2e-2 + 2e-2 * std::fabs(ref[i])) << "element " << i;
    }
  }
}

// ---------------------------------------------------------------------------
// (c) BatchDecoder on the CUDA backend: sequences of different lengths
// decoded together over a scrambled pool, each vs its solo run on the GPU (a
// one-sequence cache: the contiguous, recorded-step path). Their weight
// products take different kernels (the solo prefill of > 64 rows cuBLAS
// over bf16 tiles, its decode the one-row GEMV; the batch's 48-row chunks
// and 3-row steps gemv_batch), so logits differ by that rounding (~1e-2,
// not the 1e-4 attention alone keeps: CudaBatchedDecode): greedy tokens
// are compared where the solo top-1 margin is clear, logits within the e2e
// bound of test_forward_cuda.cpp.
class CudaBatchDecoder : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaBatchDecoder, EachSequenceGetsItsSoloResult) {
  const std::string name = GetParam();
  auto be = cuda::make_cuda_backend();
  auto model = tiny_synthetic_model(*be, 11);
  const int vocab = model->config().vocab_size;
  const kv::CodecOptions o = codec(name);
  const int steps = 8;
  const std::vector<int> lengths = {5, 70, 131};
  std::vector<std::vector<TokenId>> prompts;
  Rng rng(9);
  for (int len : lengths) {
    std::vector<TokenId> p(static_cast<size_t>(len));
    for (auto& t : p) t = TokenId(rng.below(uint64_t(vocab)));
    prompts.push_back(p);
  }
  SamplingParams greedy;
  greedy.temperature = 0;

  kv::CacheShape shape = model->cache_shape(kPageTokens * 12);
  shape.page_tokens = kPageTokens;
  BatchDecoder dec(*model, be->make_cache(o, shape), /*prefill_chunk=*/48);
  kv::BlockTable hole(dec.pool(), kPageTokens);  // scatter the pool: the sequences' pages are not in order
  hole.reserve(kPageTokens * 3);
  std::vector<int> handles;
  for (size_t i = 0; i < prompts.size(); ++i) {
    handles.push_back(dec.add(prompts[i], greedy));
    if (i == 0) hole.clear();
  }
  std::vector<std::vector<std::vector<float>>> batched(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) batched[i].push_back(dec.last_logits(handles[i]));
  for (int s = 0; s < steps; ++s) {
    dec.step();
    for (size_t i = 0; i < prompts.size(); ++i) batched[i].push_back(dec.last_logits(handles[i]));
  }

  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& p = prompts[i];
    auto cache = be->make_cache(o, model->cache_shape(int(p.size()) + steps + 1));
    std::vector<float> logits(static_cast<size_t>(vocab));
    // The solo prefill in the decoder's chunks (48): the same weight-product
    // kernels on both sides, so only the decode steps' kernels differ.
    for (int done = 0; done < int(p.size()); done += 48)
      model->forward(p.data() + done, std::min(48, int(p.size()) - done), done, *cache, logits.data(), false);
    const std::vector<TokenId>& toks = dec.tokens(handles[i]);
    int pos = int(p.size()), clear = 0;
    for (int s = 0; s <= steps; ++s) {
      const std::vector<float>& got = batched[i][size_t(s)];
      for (int j = 0; j < vocab; ++j)
        ASSERT_NEAR(got[size_t(j)], logits[size_t(j)], 0.05 + 0.02 * std::fabs(logits[size_t(j)]))
            << name << " sequence " << i << " step " << s << " logit " << j;
      std::vector<float> sorted = logits;
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      const TokenId solo_top = TokenId(std::max_element(logits.begin(), logits.end()) - logits.begin());
      const TokenId batch_top = toks[p.size() + size_t(s)];
      if (sorted[0] - sorted[1] > 0.2f) {
        ++clear;
        ASSERT_EQ(batch_top, solo_top) << name << " sequence " << i << " step " << s;
      }
      if (s == steps) break;
      // Both follow the batch's tokens (so a near-tie cannot fork the runs).
      model->forward(&batch_top, 1, pos++, *cache, logits.data(), false);
    }
    std::printf("[ %s ] sequence %zu: %d of %d steps had a clear top-1\n", name.c_str(), i, clear, steps + 1);
  }
}

// Decode steps of several sequences recorded and replayed per shape
// (Model::batch_step: CUDA graphs) give the tokens and logits of the same
// steps run directly, while sequences join and leave (the batch size
// changes) and cross page boundaries (the longest block table grows), with
// the host's sampling and with the backend's greedy choice.
TEST_P(CudaBatchDecoder, RecordedStepsEqualDirectSteps) {
  const std::string name = GetParam();
  auto be = cuda::make_cuda_backend();
  auto model = tiny_synthetic_model(*be, 12);
  const int vocab = model->config().vocab_size;
  Rng rng(10);
  std::vector<std::vector<TokenId>> prompts;
  for (int len : {60, 62, 186, 7}) {  // the third crosses a page (the longest table grows) at step 6
    std::vector<TokenId> p(static_cast<size_t>(len));
    for (auto& t : p) t = TokenId(rng.below(uint64_t(vocab)));
    prompts.push_back(p);
  }
  SamplingParams greedy;
  greedy.temperature = 0;
  struct Run {
    std::vector<std::vector<TokenId>> tokens;
    std::vector<std::vector<float>> logits;  // every step's rows, in handle order
    int replays = 0;
  };
  auto run = [&](bool graphs, bool keep_logits) {
    model->set_step_graphs(graphs);
    kv::CacheShape shape = model->cache_shape(kPageTokens * 16);
    shape.page_tokens = kPageTokens;
    BatchDecoder dec(*model, be->make_cache(codec(name), shape), 64);
    dec.set_keep_logits(keep_logits);
    std::vector<int> h = {dec.add(prompts[0], greedy), dec.add(prompts[1], greedy), dec.add(prompts[2], greedy)};
    Run r;
    for (int s = 0; s < 16; ++s) {
      if (s == 5) h.push_back(dec.add(prompts[3], greedy));  // 4 sequences from here
      if (s == 11) dec.remove(h[1]);                          // 3 again
      dec.step();
      for (int id : dec.live_sequences()) r.logits.push_back(dec.last_logits(id));
    }
    for (int id : h) r.tokens.push_back(id == h[1] ? std::vector<TokenId>{} : dec.tokens(id));
    r.replays = dec.batch_replays();
    return r;
  };
  for (bool keep_logits : {true, false}) {
    const Run direct = run(false, keep_logits), recorded = run(true, keep_logits);
    EXPECT_EQ(direct.replays, 0);
    EXPECT_GE(recorded.replays, 8) << name;  // shapes repeat: most steps replay
    EXPECT_EQ(recorded.tokens, direct.tokens) << name;
    ASSERT_EQ(recorded.logits.size(), direct.logits.size());
    for (size_t i = 0; i < direct.logits.size(); ++i)
      ASSERT_EQ(recorded.logits[i], direct.logits[i]) << name << " row " << i;  // empty without keep_logits
  }
  model->set_step_graphs(true);
}

INSTANTIATE_TEST_SUITE_P(Codecs, CudaBatchDecoder, ::testing::Values("none", "k8v8", "k8v4", "tsym3"),
                         [](const auto& i) { return label_of(i.param); });

}  // namespace
