// The exact recent window on the GPU (docs/architecture.md, "The exact recent
// window"): a store whose sequences keep their newest pages as bf16 rows in a
// second store. Against the CPU store with the same window: rows written at
// scrambled slots (packed pages get the codes of the bf16 values, window
// pages the bf16 rows), pages packed when they leave a window, pages copied
// within the window's store, the fused RoPE + store, batched decode attention
// (the window's keys as one more split), prefill chunks over both kinds of
// page, and BatchDecoder end to end (recorded steps == direct steps; the CPU
// decoder's logits within the end-to-end bound).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cuda/attention.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_kv_cache.hpp"
#include "backend/cuda/ops.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "engine/batch_decoder.hpp"
#include "gpu_test_util.hpp"
#include "kv/cache.hpp"
#include "kv/codec_table.hpp"
#include "kv/page.hpp"
#include "paged_test_util.hpp"

using namespace kvq;
using gputest::codec;
using gputest::download_bytes;
using gputest::Guarded;
using gputest::label_of;
using gputest::normal;
using gputest::store_of;

namespace {

constexpr int P = 64;  // tokens per page

// Sequences whose block tables are a window store's: packed pages before
// kv::window_first_page, exact ones (ids from n_packed on) after, each kind
// scrambled across the sequences; `spare_*` pages of each kind stay free.
struct WindowSequences {
  std::vector<int> lengths;
  std::vector<std::vector<int32_t>> tables;
  int n_packed = 0, n_exact = 0;
  std::vector<int32_t> spare_packed, spare_exact;  // free page ids of each kind
};
WindowSequences windowed(const std::vector<int>& lengths, int W, int spare_packed, int spare_exact, uint64_t seed) {
  WindowSequences s;
  s.lengths = lengths;
  s.n_packed = spare_packed;
  s.n_exact = spare_exact;
  for (int len : lengths) {
    const int first = kv::window_first_page(len, P, W);
    s.n_packed += first;
    s.n_exact += kv::pages_for(len, P) - first;
  }
  Rng rng(seed);
  auto shuffled = [&](int n, int base) {
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) ids[size_t(i)] = base + n - 1 - i;
    for (int i = n - 1; i > 0; --i) std::swap(ids[size_t(i)], ids[size_t(rng.below(uint64_t(i + 1)))]);
    return ids;
  };
  const std::vector<int32_t> packed = shuffled(s.n_packed, 0), exact = shuffled(s.n_exact, s.n_packed);
  size_t np = 0, ne = 0;
  for (int len : lengths) {
    const int first = kv::window_first_page(len, P, W);
    std::vector<int32_t> t;
    for (int i = 0; i < kv::pages_for(len, P); ++i) t.push_back(i < first ? packed[np++] : exact[ne++]);
    s.tables.push_back(t);
  }
  s.spare_packed.assign(packed.begin() + ptrdiff_t(np), packed.end());
  s.spare_exact.assign(exact.begin() + ptrdiff_t(ne), exact.end());
  return s;
}

kv::CacheShape window_shape(int n_layers, int n_kv, int D, int n_heads, const WindowSequences& s, int W) {
  kv::CacheShape shape{n_layers, n_kv, D, s.n_packed * P, n_heads, P};
  shape.window_pages = W;
  shape.exact_pages = s.n_exact;
  return shape;
}

// Every token of every sequence, in table order.
std::vector<int32_t> all_slots(const WindowSequences& s, const kv::PageGeometry& geo) {
  std::vector<int32_t> slots;
  for (size_t i = 0; i < s.lengths.size(); ++i)
    for (int t = 0; t < s.lengths[i]; ++t) slots.push_back(geo.slot_of(s.tables[i].data(), t));
  return slots;
}

// The bytes a GPU store side should hold: the CPU store's rows (read_row) of
// `slots`, zero elsewhere. exact: the window's bf16 side (slots of exact
// pages), else the packed side (slots of packed pages).
std::vector<uint8_t> expected_side(kv::Cache& cpu, int layer, const std::vector<int32_t>& slots, bool v_side,
                                   bool exact, const cuda::GpuKvSide& side, size_t rows, bool codes) {
  const kv::CacheShape& shape = cpu.shape();
  const kv::PageGeometry geo = shape.geometry();
  const size_t bytes = codes ? side.code_bytes : side.side_bytes;
  std::vector<uint8_t> want(rows * bytes, 0), code(side.code_bytes), sb(side.side_bytes + 1);
  for (int32_t slot : slots) {
    const int page = slot / P;
    if (shape.is_exact_page(page) != exact) continue;
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      cpu.layer(layer).read_row(slot, h, v_side, code.data(), sb.data());
      const size_t r = exact ? geo.row(page - shape.n_pages(), h, slot % P) : geo.slot_row(slot, h);
      const uint8_t* src = codes ? code.data() : sb.data();
      std::copy(src, src + bytes, want.begin() + ptrdiff_t(r * bytes));
    }
  }
  return want;
}

// Every array of `layer` of the GPU store equals the CPU store's rows of `slots`.
void expect_store_equal(kv::Cache& cpu, kv::Cache& gpu, int layer, const std::vector<int32_t>& slots,
                        const std::string& what) {
  const cuda::GpuKvLayer& g = store_of(gpu, layer);
  const size_t packed_rows = size_t(g.n_pages) * g.n_kv_heads * P, exact_rows = size_t(g.n_exact_pages) * g.n_kv_heads * P;
  for (bool v_side : {false, true}) {
    const cuda::GpuKvSide& side = v_side ? g.v : g.k;
    const cuda::GpuKvSide& x = v_side ? g.xv : g.xk;
    const std::string label = what + (v_side ? " V" : " K");
    EXPECT_EQ(download_bytes(side.code, packed_rows * side.code_bytes),
              expected_side(cpu, layer, slots, v_side, false, side, packed_rows, true))
        << label << " packed codes";
    EXPECT_EQ(download_bytes(side.side, packed_rows * side.side_bytes),
              expected_side(cpu, layer, slots, v_side, false, side, packed_rows, false))
        << label << " packed side bytes";
    EXPECT_EQ(download_bytes(x.code, exact_rows * x.code_bytes),
              expected_side(cpu, layer, slots, v_side, true, x, exact_rows, true))
        << label << " exact rows";
  }
}

class CudaWindowStore : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

// Writes at scrambled slots of both kinds, then a page packed out of a window
// and a window page copied: the GPU store's bytes equal the CPU store's after
// each (packed rows: the codec's rows of the bf16 values; exact rows: bf16).
TEST_P(CudaWindowStore, RowsPacksAndCopiesMatchCpu) {
  const std::string name = GetParam();
  const int D = 128, n_kv = 2, W = 2, layer = 1;
  const WindowSequences seqs = windowed({5, 70, 131, 200}, W, 2, 2, 17);
  const kv::CacheShape shape = window_shape(2, n_kv, D, 4 * n_kv, seqs, W);
  auto cpu = kv::make_cpu_cache(codec(name), shape);
  auto gpu = cuda::make_cuda_kv_store_for_test(codec(name), shape);
  ASSERT_EQ(store_of(*gpu, layer).n_exact_pages, seqs.n_exact);
  ASSERT_TRUE(store_of(*gpu, layer).has_window());
  std::vector<int32_t> slots = all_slots(seqs, shape.geometry());
  const int n = int(slots.size());
  Rng rng(uint64_t(D) * 131 + n_kv);
  auto k = normal(rng, size_t(n) * n_kv * D, 2.0f), v = normal(rng, size_t(n) * n_kv * D, 2.0f);
  k[7] = std::nanf("");  // sanitized alike on both sides
  v[9] = 1e6f;
  cpu->layer(layer).write_slots(slots.data(), n, k.data(), v.data());
  {
    Guarded dk(k.size(), &k), dv(v.size(), &v);
    gpu->layer(layer).write_slots(slots.data(), n, dk.data(), dv.data());
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  }
  expect_store_equal(*cpu, *gpu, layer, slots, name + " written");

  // The oldest window page of the 200-token sequence (pages 2, 3 exact)
  // leaves: packed into a spare packed page on both.
  const std::vector<int32_t>& table = seqs.tables[3];
  const int first = kv::window_first_page(200, P, W);
  ASSERT_TRUE(shape.is_exact_page(table[size_t(first)]));
  const int32_t from = table[size_t(first)], to = seqs.spare_packed[0];
  cpu->pack_pages(&from, &to, 1);
  gpu->pack_pages(&from, &to, 1);
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> after;  // the slots the CPU store now holds: `from`'s moved to `to`
  for (int32_t s : slots) after.push_back(s / P == from ? to * P + s % P : s);
  // The GPU leaves the packed exact page's bytes (the pool reuses it); the CPU
  // forgets them: compare only the packed side there, and the exact side
  // against the CPU rows the copy below brings.
  {
    const cuda::GpuKvLayer& g = store_of(*gpu, layer);
    const size_t packed_rows = size_t(g.n_pages) * n_kv * P;
    for (bool v_side : {false, true}) {
      const cuda::GpuKvSide& side = v_side ? g.v : g.k;
      EXPECT_EQ(download_bytes(side.code, packed_rows * side.code_bytes),
                expected_side(*cpu, layer, after, v_side, false, side, packed_rows, true))
          << name << (v_side ? " V" : " K") << " packed codes after pack_pages";
      EXPECT_EQ(download_bytes(side.side, packed_rows * side.side_bytes),
                expected_side(*cpu, layer, after, v_side, false, side, packed_rows, false))
          << name << (v_side ? " V" : " K") << " packed side bytes after pack_pages";
    }
  }
  // The 131-token sequence's newest page copied into a spare exact page.
  const int32_t src = seqs.tables[2].back(), dst = seqs.spare_exact[0];
  cpu->copy_pages(&src, &dst, 1);
  gpu->copy_pages(&src, &dst, 1);
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  const cuda::GpuKvLayer& g = store_of(*gpu, layer);
  const size_t exact_rows = size_t(g.n_exact_pages) * n_kv * P;
  std::vector<int32_t> copied;
  for (int32_t s : after)
    if (s / P == src) copied.push_back(dst * P + s % P);
  for (bool v_side : {false, true}) {
    const cuda::GpuKvSide& x = v_side ? g.xv : g.xk;
    const auto got = download_bytes(x.code, exact_rows * x.code_bytes);
    const auto want = expected_side(*cpu, layer, copied, v_side, true, x, exact_rows, true);
    const size_t page_bytes = size_t(n_kv) * P * x.code_bytes, at = size_t(dst - shape.n_pages()) * page_bytes;
    EXPECT_TRUE(std::equal(got.begin() + ptrdiff_t(at), got.begin() + ptrdiff_t(at + page_bytes),
                           want.begin() + ptrdiff_t(at)))
        << name << (v_side ? " V" : " K") << " copied window page";
  }
  // Crossing kinds, or packing from a packed page, is refused.
  EXPECT_THROW(gpu->copy_pages(&src, &to, 1), Error);
  EXPECT_THROW(gpu->pack_pages(&to, &from, 1), Error);
}

// The fused q/k norm + RoPE + store over a decode batch whose tokens fall in
// window pages and packed pages writes what write_kv_slots writes.
TEST_P(CudaWindowStore, FusedRopeStoreEqualsWriteKvSlots) {
  const std::string name = GetParam();
  const int D = 128, n_kv = 2, nh = 4 * n_kv, W = 1;
  const WindowSequences seqs = windowed({5, 70, 131}, W, 1, 1, 23);
  const kv::CacheShape shape = window_shape(1, n_kv, D, nh, seqs, W);
  auto fused = cuda::make_cuda_kv_store_for_test(codec(name), shape);
  auto plain = cuda::make_cuda_kv_store_for_test(codec(name), shape);
  const kv::PageGeometry geo = shape.geometry();
  // Each sequence's last token (a window page) and its first (a packed page
  // for the two longer ones).
  std::vector<int32_t> pos, slots;
  for (size_t s = 0; s < seqs.lengths.size(); ++s)
    for (int t : {seqs.lengths[s] - 1, 0}) {
      pos.push_back(t);
      slots.push_back(geo.slot_of(seqs.tables[s].data(), t));
    }
  const int n = int(pos.size());
  (void)gputest::store_fused_and_plain(*fused, *plain, nh, n_kv, D, pos, slots);
  const cuda::GpuKvLayer &a = store_of(*fused, 0), &b = store_of(*plain, 0);
  const size_t packed_rows = size_t(a.n_pages) * n_kv * P, exact_rows = size_t(a.n_exact_pages) * n_kv * P;
  // The rows of the window pages' tokens, and only those, were written in the window's store.
  std::vector<bool> exact_row(exact_rows, false);
  for (int32_t slot : slots)
    if (shape.is_exact_page(slot / P))
      for (int h = 0; h < n_kv; ++h) exact_row[geo.row(slot / P - shape.n_pages(), h, slot % P)] = true;
  // Each sequence's last token, and the 5-token sequence's first (its one page is its window).
  ASSERT_EQ(std::count(exact_row.begin(), exact_row.end(), true), 4 * n_kv);
  for (bool k_side : {true, false}) {
    const cuda::GpuKvSide &sa = k_side ? a.k : a.v, &sb = k_side ? b.k : b.v;
    const cuda::GpuKvSide &xa = k_side ? a.xk : a.xv, &xb = k_side ? b.xk : b.xv;
    EXPECT_EQ(download_bytes(sa.code, packed_rows * sa.code_bytes), download_bytes(sb.code, packed_rows * sb.code_bytes))
        << name;
    EXPECT_EQ(download_bytes(sa.side, packed_rows * sa.side_bytes), download_bytes(sb.side, packed_rows * sb.side_bytes))
        << name;
    const auto ex = download_bytes(xa.code, exact_rows * xa.code_bytes);
    EXPECT_EQ(ex, download_bytes(xb.code, exact_rows * xb.code_bytes)) << name;
    for (size_t r = 0; r < exact_rows; ++r) {
      const bool written = std::any_of(ex.begin() + ptrdiff_t(r * xa.code_bytes),
                                       ex.begin() + ptrdiff_t((r + 1) * xa.code_bytes), [](uint8_t x) { return x != 0; });
      EXPECT_EQ(written, exact_row[r]) << name << (k_side ? " K" : " V") << " window row " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, CudaWindowStore,
                         ::testing::Values("none", "k8v8", "fp8", "k8v4", "tsym3", "k8vturbo2", "k8vturbo3tcq", "iso3",
                                           "rotor3_sym", "rotor3_sym+qjl", "q8/turbo3"),
                         [](const auto& i) { return label_of(i.param); });

// ---------------------------------------------------------------------------
// Attention: sequences of different lengths with windows of W pages, decoded
// in one batched launch (the window's keys in one more split) and alone, and
// a prefill chunk over packed and window pages, vs the CPU store's
// attend_runs over the same rows.
struct WindowCase {
  const char* codec;
  int G, n_kv, W;
};
class CudaWindowAttention : public ::testing::TestWithParam<WindowCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaWindowAttention, MatchesCpuAttendRuns) {
  const WindowCase c = GetParam();
  const int D = 128, n_heads = c.G * c.n_kv;
  const std::vector<int> lengths = {5, 70, 300, 1, 129, 64, 65};
  const WindowSequences seqs = windowed(lengths, c.W, 1, 0, 41);
  const kv::CacheShape shape = window_shape(1, c.n_kv, D, n_heads, seqs, c.W);
  auto cpu = kv::make_cpu_cache(codec(c.codec), shape);
  auto gpu = cuda::make_cuda_kv_cache(codec(c.codec), shape);
  const std::vector<int32_t> slots = all_slots(seqs, shape.geometry());
  const int n = int(slots.size());
  Rng rng(uint64_t(c.G) * 1009 + c.n_kv * 7 + c.W);
  const size_t q_row = size_t(n_heads) * D;
  (void)gputest::write_peaked_rows(*cpu, *gpu, slots, c.n_kv, D, rng);
  std::vector<kv::QueryRun> runs;
  for (size_t s = 0; s < lengths.size(); ++s)
    runs.push_back({seqs.tables[s].data(), int(seqs.tables[s].size()), int(s), 1, lengths[s] - 1});
  const int n_seq = int(runs.size());
  const auto q = normal(rng, size_t(n_seq) * q_row, 2.0f);
  const float scale = 1.0f / std::sqrt(float(D));
  std::vector<float> ref(q.size());
  cpu->layer(0).attend_runs(runs.data(), n_seq, q.data(), n_heads, scale, ref.data());
  const std::string label = label_of(c.codec) + "_W" + std::to_string(c.W);
  {
    Guarded dq(q.size(), &q), out(q.size());
    gpu->layer(0).attend_runs(runs.data(), n_seq, dq.data(), n_heads, scale, out.data());
    gputest::expect_attention_close(out.result(), ref, D, label + "_batched");
  }
  for (int z = 0; z < n_seq; ++z) {
    kv::QueryRun one = runs[size_t(z)];
    one.first = 0;
    std::vector<float> qz(q.begin() + ptrdiff_t(z * q_row), q.begin() + ptrdiff_t((z + 1) * q_row));
    Guarded dqz(q_row, &qz), outz(q_row);
    gpu->layer(0).attend_runs(&one, 1, dqz.data(), n_heads, scale, outz.data());
    const std::vector<float> refz(ref.begin() + ptrdiff_t(z * q_row), ref.begin() + ptrdiff_t((z + 1) * q_row));
    gputest::expect_attention_close(outz.result(), refz, D, label + "_alone_" + std::to_string(z));
  }

  // A prefill chunk: the 300-token sequence's last 110 tokens (packed pages
  // and its window) as queries.
  const int pos = 190, m = 110;
  kv::QueryRun chunk{seqs.tables[2].data(), int(seqs.tables[2].size()), 0, m, pos};
  const auto qc = normal(rng, size_t(m) * q_row, 1.0f);
  std::vector<float> refc(qc.size());
  cpu->layer(0).attend_runs(&chunk, 1, qc.data(), n_heads, scale, refc.data());
  Guarded dqc(qc.size(), &qc), outc(qc.size());
  gpu->layer(0).attend_runs(&chunk, 1, dqc.data(), n_heads, scale, outc.data());
  const auto y = outc.result();
  // Tensor-core prefill rounds q and p to bf16 (test_paged.cpp's bound: a
  // wrong page gives O(1) errors).
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << i;
    ASSERT_NEAR(y[i], refc[i], 2e-2 + 2e-2 * std::fabs(refc[i])) << label << " prefill element " << i;
  }

  // A table whose window is not its last pages is refused.
  std::vector<int32_t> bad = seqs.tables[2];
  std::swap(bad.front(), bad.back());
  kv::QueryRun wrong{bad.data(), int(bad.size()), 0, 1, lengths[2] - 1};
  Guarded dq1(q_row), out1(q_row);
  EXPECT_THROW(gpu->layer(0).attend_runs(&wrong, 1, dq1.data(), n_heads, scale, out1.data()), Error);
}

INSTANTIATE_TEST_SUITE_P(
    Codecs, CudaWindowAttention,
    ::testing::Values(WindowCase{"none", 4, 2, 1}, WindowCase{"k8v8", 4, 2, 1}, WindowCase{"fp8", 4, 2, 2},
                      WindowCase{"k8v4", 4, 2, 1}, WindowCase{"tsym3", 4, 2, 1}, WindowCase{"tsym3", 4, 2, 3},
                      WindowCase{"k8vturbo2", 4, 2, 1}, WindowCase{"k8vturbo3tcq", 4, 2, 2},
                      WindowCase{"iso3", 4, 2, 1}, WindowCase{"rotor3_sym", 4, 2, 2},
                      WindowCase{"rotor3_sym+qjl", 4, 2, 1}, WindowCase{"k8v4", 16, 1, 1},
                      WindowCase{"tsym3", 8, 1, 2}, WindowCase{"k8v8", 6, 2, 1}),
    [](const auto& i) {
      return label_of(i.param.codec) + "_G" + std::to_string(i.param.G) + "_kv" + std::to_string(i.param.n_kv) + "_W" +
             std::to_string(i.param.W);
    });

// ---------------------------------------------------------------------------
// BatchDecoder with a window on the CUDA backend: sequences cross pages (their
// oldest window page is packed on the device), recorded steps give the direct
// steps' tokens and logits, and the CPU backend's windowed decoder gives the
// same logits within the end-to-end bound of the weight products
// (test_paged.cpp's CudaBatchDecoder).
class CudaWindowDecoder : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaWindowDecoder, MatchesTheCpuDecoderAndItsRecording) {
  const std::string name = GetParam();
  const int W = 1, steps = 12;
  auto gpu_be = cuda::make_cuda_backend();
  auto cpu_be = cpu::make_cpu_backend();
  auto gpu_model = gputest::tiny_synthetic_model(*gpu_be, 13);
  auto cpu_model = gputest::tiny_synthetic_model(*cpu_be, 13);
  const int vocab = gpu_model->config().vocab_size;
  Rng rng(14);
  std::vector<std::vector<TokenId>> prompts;
  for (int len : {60, 62, 130}) {  // each crosses a page within the steps
    std::vector<TokenId> p(static_cast<size_t>(len));
    for (auto& t : p) t = TokenId(rng.below(uint64_t(vocab)));
    prompts.push_back(p);
  }
  SamplingParams greedy;
  greedy.temperature = 0;
  struct Run {
    std::vector<std::vector<TokenId>> tokens;
    std::vector<std::vector<float>> logits;
    int replays = 0;
  };
  auto run = [&](Model& model, Backend& be, bool graphs) {
    model.set_step_graphs(graphs);
    kv::CacheShape shape = model.cache_shape(P * 12);
    shape.page_tokens = P;
    shape.window_pages = W;
    shape.exact_pages = 3 * W;
    BatchDecoder dec(model, be.make_cache(codec(name), shape), 48);
    EXPECT_EQ(dec.store().codec_name(), kv::resolve_codec(codec(name)).name + "+win1");
    std::vector<int> h;
    for (const auto& p : prompts) h.push_back(dec.add(p, greedy));
    Run r;
    for (int s = 0; s < steps; ++s) {
      dec.step();
      for (int id : h) r.logits.push_back(dec.last_logits(id));
      EXPECT_EQ(dec.exact_pool()->used_pages(), 3 * W);  // each sequence holds its W window pages
    }
    for (int id : h) r.tokens.push_back(dec.tokens(id));
    r.replays = dec.batch_replays();
    return r;
  };
  const Run direct = run(*gpu_model, *gpu_be, false), recorded = run(*gpu_model, *gpu_be, true);
  EXPECT_GE(recorded.replays, 6) << name;
  EXPECT_EQ(recorded.tokens, direct.tokens) << name;
  ASSERT_EQ(recorded.logits.size(), direct.logits.size());
  for (size_t i = 0; i < direct.logits.size(); ++i) ASSERT_EQ(recorded.logits[i], direct.logits[i]) << name << " row " << i;
  gpu_model->set_step_graphs(true);

  // The CPU decoder, greedy too, compared while a sequence's tokens are the
  // GPU's (a near tie may fork the two). Its K and V inputs differ from the
  // GPU's in the last bits (the weight products round differently): at 8
  // bits and in bf16 the logits stay within the end-to-end bound, below 8
  // bits a flipped code moves a logit further (test_kv_codecs.cpp's
  // TrainedModelTokensMatchCpu), so there each GPU choice must be among the
  // CPU's 5 best.
  const Run cpu = run(*cpu_model, *cpu_be, false);
  const bool close = name == "none" || name == "k8v8";
  int compared = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const size_t first = prompts[i].size();  // the token sampled from the prompt's logits
    if (direct.tokens[i][first] != cpu.tokens[i][first]) continue;
    for (int s = 0; s < steps; ++s) {
      const size_t row = size_t(s) * prompts.size() + i, next = first + size_t(s) + 1;
      const std::vector<float>&got = direct.logits[row], &want = cpu.logits[row];
      if (close) {
        for (int j = 0; j < vocab; ++j)
          ASSERT_NEAR(got[size_t(j)], want[size_t(j)], 0.05 + 0.02 * std::fabs(want[size_t(j)]))
              << name << " sequence " << i << " step " << s << " logit " << j;
      } else {
        std::vector<float> sorted = want;
        std::nth_element(sorted.begin(), sorted.begin() + 4, sorted.end(), std::greater<float>());
        EXPECT_GE(want[size_t(direct.tokens[i][next])], sorted[4]) << name << " sequence " << i << " step " << s;
      }
      ++compared;
      if (direct.tokens[i][next] != cpu.tokens[i][next]) break;
    }
  }
  std::printf("[ %s ] %d windowed steps compared with the CPU decoder's\n", name.c_str(), compared);
  EXPECT_GE(compared, int(prompts.size()) * steps / 2) << name << ": the runs forked early";
}

INSTANTIATE_TEST_SUITE_P(Codecs, CudaWindowDecoder, ::testing::Values("none", "k8v8", "tsym3", "k8vturbo2"),
                         [](const auto& i) { return label_of(i.param); });

}  // namespace
