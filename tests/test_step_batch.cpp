// The step batch (docs/architecture.md): page bookkeeping, paged stores whose
// rows do not depend on where their pages are, and many sequences per
// forward step giving each sequence exactly its solo result, on the CPU
// backend (the oracle the GPU kernels are held to).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "backend/batch.hpp"
#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/f32_cache.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "engine/batch_decoder.hpp"
#include "engine/session.hpp"
#include "forward_test_util.hpp"
#include "kv/block.hpp"
#include "kv/cache.hpp"
#include "kv/codec_table.hpp"
#include "kv/page_pool.hpp"
#include "kv_test_util.hpp"
#include "model/forward.hpp"

using namespace kvq;

namespace {

// Every named codec, the +qjl rows, fp8 and a K/V pair.
std::vector<kv::CodecOptions> every_codec() {
  std::vector<kv::CodecOptions> r;
  for (const kv::CodecInfo& c : kv::codec_table()) {
    kv::CodecOptions o;
    o.kv = c.name;
    r.push_back(o);
  }
  for (const char* q : {"rotor3_sym+qjl", "k_rotor4+qjl"}) {
    kv::CodecOptions o;
    o.kv = q;
    r.push_back(o);
  }
  kv::CodecOptions pair;
  pair.ctk = "q8";
  pair.ctv = "turbo3";
  r.push_back(pair);
  return r;
}

}  // namespace

TEST(PagePool, AllocReleaseAndReferenceCounts) {
  kv::PagePool pool(3);
  EXPECT_EQ(pool.free_pages(), 3);
  const int a = pool.alloc(), b = pool.alloc(), c = pool.alloc();
  EXPECT_EQ(std::vector<int>({a, b, c}), std::vector<int>({0, 1, 2}));  // lowest first
  EXPECT_EQ(pool.free_pages(), 0);
  try {
    pool.alloc();
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::out_of_range);
    EXPECT_NE(std::string(e.what()).find("all 3 pages"), std::string::npos) << e.what();
  }
  pool.retain(b);
  pool.release(b);
  EXPECT_EQ(pool.refs(b), 1);
  pool.release(b);
  EXPECT_EQ(pool.refs(b), 0);
  EXPECT_EQ(pool.free_pages(), 1);
  EXPECT_THROW(pool.release(b), Error);  // double free is loud
  EXPECT_THROW(pool.retain(b), Error);
  EXPECT_THROW(kv::PagePool(0), Error);
}

TEST(BlockTable, ReserveShareAndExhaustionLeavesNothingBehind) {
  kv::PagePool pool(5);
  kv::BlockTable a(pool, 4);
  a.reserve(9);  // 3 pages
  EXPECT_EQ(a.pages().size(), 3u);
  EXPECT_EQ(a.capacity(), 12);
  EXPECT_EQ(a.slot(5), a.pages()[1] * 4 + 1);
  kv::BlockTable b(pool, 4);
  b.share_prefix(a, 6);  // the first two pages, shared
  EXPECT_EQ(pool.refs(a.pages()[0]), 2);
  EXPECT_EQ(pool.free_pages(), 2);
  kv::BlockTable c(pool, 4);
  EXPECT_THROW(c.reserve(12), Error);  // needs 3, 2 free
  EXPECT_TRUE(c.pages().empty());
  EXPECT_EQ(pool.free_pages(), 2);  // what the failed call took went back
  a.clear();
  EXPECT_EQ(pool.free_pages(), 3);  // shared pages stay with b
  b.shrink(0);
  EXPECT_EQ(pool.free_pages(), 5);
  {
    kv::BlockTable d(pool, 4);
    d.reserve(20);
    EXPECT_EQ(pool.free_pages(), 0);
  }  // a table gives its pages back when it goes
  EXPECT_EQ(pool.free_pages(), 5);
}

TEST(StepBatch, SlotsFollowTheBlockTable) {
  const std::vector<int32_t> pages_a = {3, 0}, pages_b = {1};
  const int32_t ids_a[3] = {7, 8, 9}, ids_b[1] = {5};
  StepBatch b;
  b.add_sequence(ids_a, 3, 2, pages_a.data(), 2, 4, StepBatch::Logits::all);
  b.add_sequence(ids_b, 1, 3, pages_b.data(), 1, 4, StepBatch::Logits::last);
  EXPECT_EQ(b.n_tok(), 4);
  EXPECT_EQ(b.n_seq(), 2);
  EXPECT_EQ(b.slot, std::vector<int32_t>({3 * 4 + 2, 3 * 4 + 3, 0 * 4 + 0, 1 * 4 + 3}));
  EXPECT_EQ(b.pos, std::vector<int32_t>({2, 3, 4, 3}));
  EXPECT_EQ(b.seq, std::vector<int32_t>({0, 0, 0, 1}));
  EXPECT_EQ(b.logit_rows, std::vector<int32_t>({0, 1, 2, 3}));
  EXPECT_FALSE(b.is_one_contiguous_sequence());
  EXPECT_THROW(b.add_sequence(ids_b, 1, 4, pages_b.data(), 1, 4, StepBatch::Logits::last), Error);  // past its pages
  const std::vector<int32_t> identity = kv::identity_pages(2);
  EXPECT_TRUE(StepBatch::one_sequence(ids_a, 3, 5, identity, 4, StepBatch::Logits::last).is_one_contiguous_sequence());
}

// Rows written through a scrambled block table with small pages are byte for
// byte the rows of the identity table (and of the block's own encoder), and
// attention over them gives the same floats: a row's bytes and a
// sequence's result do not depend on where its pages are.
TEST(PagedStore, RowsAndAttentionDoNotDependOnPagePlacement) {
  const int H = 2, D = 64, T = 77, n_heads = 4;
  for (const kv::CodecOptions& o : every_codec()) {
    SCOPED_TRACE(kv::resolve_codec(o).name);
    kv::CacheShape identity_shape{1, H, D, 128, n_heads, 64};
    kv::CacheShape paged_shape{1, H, D, 160, n_heads, 16};  // 10 pages of 16
    auto a = kv::make_cpu_cache(o, identity_shape);
    auto b = kv::make_cpu_cache(o, paged_shape);
    const std::vector<int32_t> scrambled = {7, 2, 9, 0, 5};  // 80 tokens
    Rng rng(11);
    const std::vector<float> k = test::gaussian(rng, size_t(T) * H * D), v = test::gaussian(rng, size_t(T) * H * D);
    const kv::PageGeometry geo = paged_shape.geometry();
    // odd write sizes across page boundaries
    for (int t0 = 0, n = 1; t0 < T; t0 += n, n = n % 13 + 2) {
      n = std::min(n, T - t0);
      std::vector<int32_t> slots(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) slots[size_t(i)] = geo.slot_of(scrambled.data(), t0 + i);
      a->layer(0).write(t0, n, k.data() + size_t(t0) * H * D, v.data() + size_t(t0) * H * D);
      b->layer(0).write_slots(slots.data(), n, k.data() + size_t(t0) * H * D, v.data() + size_t(t0) * H * D);
    }
    const kv::ResolvedCodec rc = kv::resolve_codec(o);
    for (const bool vs : {false, true}) {
      const kv::RowLayout l = kv::block_layout(vs ? rc.v : rc.k, D);
      std::vector<uint8_t> ca(l.code_bytes), sa(l.side_bytes + 1), cb(l.code_bytes), sb(l.side_bytes + 1),
          ce(l.code_bytes), se(l.side_bytes + 1);
      for (int h = 0; h < H; ++h) {
        const auto block = kv::make_block(vs ? rc.v : rc.k, D, o.seed, 0, h, vs ? kv::Side::v : kv::Side::k);
        for (int t = 0; t < T; ++t) {
          a->layer(0).read_row(t, h, vs, ca.data(), sa.data());
          b->layer(0).read_row(geo.slot_of(scrambled.data(), t), h, vs, cb.data(), sb.data());
          block->encode((vs ? v : k).data() + (size_t(t) * H + h) * D, ce.data(), se.data());
          ASSERT_EQ(ca, cb) << "token " << t << " head " << h << (vs ? " V" : " K");
          ASSERT_EQ(ca, ce) << "token " << t << " head " << h << (vs ? " V" : " K");
          ASSERT_TRUE(std::equal(sa.begin(), sa.begin() + ptrdiff_t(l.side_bytes), sb.begin()));
          ASSERT_TRUE(std::equal(sa.begin(), sa.begin() + ptrdiff_t(l.side_bytes), se.begin()));
        }
      }
    }
    const int n = 5, pos = T - n;
    const std::vector<float> q = test::gaussian(rng, size_t(n) * n_heads * D);
    std::vector<float> out_a(q.size()), out_b(q.size());
    a->layer(0).attend(pos, n, q.data(), n_heads, 0.125f, out_a.data());
    const kv::QueryRun run{scrambled.data(), int(scrambled.size()), 0, n, pos};
    b->layer(0).attend_runs(&run, 1, q.data(), n_heads, 0.125f, out_b.data());
    EXPECT_EQ(0, std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)));
  }
}

// Cache::copy_pages: the copied pages hold the source pages' bytes (every
// codec; the exact window's bf16 rows too) and attention through a block
// table of copies gives the source's floats; bad copies change nothing.
TEST(PagedStore, CopiedPagesHoldTheSameRowsAndAttention) {
  const int H = 2, D = 64, T = 45, n_heads = 4;
  std::vector<kv::CodecOptions> codecs = every_codec();
  kv::CodecOptions window;
  window.kv = "tsym3";
  window.exact_window_pages = 1;
  codecs.push_back(window);
  for (const kv::CodecOptions& o : codecs) {
    auto c = kv::make_cpu_cache(o, kv::CacheShape{2, H, D, 160, n_heads, 16});  // 10 pages of 16
    SCOPED_TRACE(c->codec_name());
    const std::vector<int32_t> from = {7, 2, 9}, to = {0, 5, 3};  // 48 tokens' pages, copies elsewhere
    Rng rng(13);
    const std::vector<float> k = test::gaussian(rng, size_t(T) * H * D), v = test::gaussian(rng, size_t(T) * H * D);
    const kv::PageGeometry geo = c->shape().geometry();
    std::vector<int32_t> slots;
    for (int t = 0; t < T; ++t) slots.push_back(geo.slot_of(from.data(), t));
    for (int l = 0; l < 2; ++l) c->layer(l).write_slots(slots.data(), T, k.data(), v.data());
    EXPECT_THROW(c->copy_pages(from.data(), std::vector<int32_t>{0, 0, 3}.data(), 3), Error);  // dst twice
    EXPECT_THROW(c->copy_pages(from.data(), std::vector<int32_t>{0, 9, 3}.data(), 3), Error);  // dst is a src
    EXPECT_THROW(c->copy_pages(from.data(), std::vector<int32_t>{0, 5, 10}.data(), 3), Error);  // outside
    // Nothing was copied: the destinations are still unwritten.
    const int n = 3, pos = T - n;
    const std::vector<float> q = test::gaussian(rng, size_t(n) * n_heads * D);
    std::vector<float> out_a(q.size()), out_b(q.size());
    const kv::QueryRun copied{to.data(), int(to.size()), 0, n, pos};
    EXPECT_THROW(c->layer(1).attend_runs(&copied, 1, q.data(), n_heads, 0.125f, out_b.data()), Error);
    c->copy_pages(from.data(), to.data(), 3);
    const kv::ResolvedCodec rc = kv::resolve_codec(o);
    for (int l = 0; l < 2; ++l)
      for (const bool vs : {false, true}) {
        const kv::RowLayout lay = kv::block_layout(vs ? rc.v : rc.k, D);
        std::vector<uint8_t> ca(lay.code_bytes), sa(lay.side_bytes + 1), cb(lay.code_bytes), sb(lay.side_bytes + 1);
        for (int h = 0; h < H; ++h)
          for (int t = 0; t < T; ++t) {
            c->layer(l).read_row(geo.slot_of(from.data(), t), h, vs, ca.data(), sa.data());
            c->layer(l).read_row(geo.slot_of(to.data(), t), h, vs, cb.data(), sb.data());
            ASSERT_EQ(ca, cb) << "layer " << l << " token " << t << " head " << h << (vs ? " V" : " K");
            ASSERT_TRUE(std::equal(sa.begin(), sa.begin() + ptrdiff_t(lay.side_bytes), sb.begin()));
          }
      }
    const kv::QueryRun source{from.data(), int(from.size()), 0, n, pos};
    for (int l = 0; l < 2; ++l) {
      c->layer(l).attend_runs(&source, 1, q.data(), n_heads, 0.125f, out_a.data());
      c->layer(l).attend_runs(&copied, 1, q.data(), n_heads, 0.125f, out_b.data());
      EXPECT_EQ(0, std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float))) << "layer " << l;
    }
  }
}

TEST(PagedStore, UnwrittenRowsAndBadTablesAreErrors) {
  kv::CodecOptions o;
  o.kv = "none";
  auto c = kv::make_cpu_cache(o, kv::CacheShape{1, 1, 64, 32, 1, 8});
  std::vector<float> k(64, 1.0f), q(64, 1.0f), out(64);
  const int32_t slot = 9;
  c->layer(0).write_slots(&slot, 1, k.data(), k.data());
  const std::vector<int32_t> pages = {1};  // token 1 is slot 9
  const kv::QueryRun ok{pages.data(), 1, 0, 1, 1};
  EXPECT_THROW(c->layer(0).attend_runs(&ok, 1, q.data(), 1, 1.0f, out.data()), Error);  // token 0 never written
  const int32_t slot0 = 8;
  c->layer(0).write_slots(&slot0, 1, k.data(), k.data());
  c->layer(0).attend_runs(&ok, 1, q.data(), 1, 1.0f, out.data());
  for (float x : out) EXPECT_FLOAT_EQ(x, 1.0f);
  const std::vector<int32_t> outside = {4};  // the store has 4 pages
  const kv::QueryRun bad{outside.data(), 1, 0, 1, 0};
  EXPECT_THROW(c->layer(0).attend_runs(&bad, 1, q.data(), 1, 1.0f, out.data()), Error);
  const int32_t past = 32;
  EXPECT_THROW(c->layer(0).write_slots(&past, 1, k.data(), k.data()), Error);
}

namespace {

struct BatchFixture {
  std::unique_ptr<testutil::TinyModel> tiny = testutil::make_tiny(Arch::qwen3, gguf::TensorType::Q8_0, 21);
  std::unique_ptr<Backend> backend = cpu::make_cpu_backend();
  std::unique_ptr<Model> model;
  BatchFixture() { model = std::make_unique<Model>(tiny->cfg, load_weights(tiny->cfg, tiny->t.lookup()), *backend); }

  std::vector<TokenId> prompt(int n, uint64_t seed) const {
    Rng rng(seed);
    std::vector<TokenId> p(static_cast<size_t>(n));
    for (auto& t : p) t = TokenId(rng.next_u64() % uint64_t(tiny->cfg.vocab_size));
    return p;
  }

  // The sequence alone: prefill, then greedy steps through Model::forward
  // over a one-sequence store; every step's logits.
  std::vector<std::vector<float>> solo(const kv::CodecOptions& o, const std::vector<TokenId>& p, int steps,
                                       std::vector<TokenId>* tokens) const {
    const int V = tiny->cfg.vocab_size;
    auto cache = backend->make_cache(o, model->cache_shape(int(p.size()) + steps + 1));
    std::vector<std::vector<float>> rows;
    std::vector<float> logits(static_cast<size_t>(V));
    model->forward(p.data(), int(p.size()), 0, *cache, logits.data(), false);
    rows.push_back(logits);
    int pos = int(p.size());
    for (int s = 0; s < steps; ++s) {
      const TokenId next = TokenId(std::max_element(logits.begin(), logits.end()) - logits.begin());
      tokens->push_back(next);
      model->forward(&next, 1, pos++, *cache, logits.data(), false);
      rows.push_back(logits);
    }
    return rows;
  }
};

SamplingParams greedy() {
  SamplingParams s;
  s.temperature = 0;
  return s;
}

float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace

// Sequences of different lengths decoded together give each its solo run:
// the same greedy tokens and the same logits to the bit. Attention reads each
// sequence's rows alone, and the CPU's weight products give every token the
// same sums whatever else shares the call (up to 64 tokens per call: these
// prompts and steps). The GPU is held to identical tokens for bf16 and q8
// and 1e-4 for the low-bit codecs.
TEST(BatchDecode, EachSequenceGetsItsSoloResult) {
  BatchFixture f;
  const int steps = 6;
  for (const char* codec : {"none", "k8v8", "tsym3", "k8vturbo3", "rotor3_sym+qjl"}) {
    SCOPED_TRACE(codec);
    kv::CodecOptions o;
    o.kv = codec;
    kv::CacheShape shape = f.model->cache_shape(24 * 8);
    shape.page_tokens = 8;
    BatchDecoder dec(*f.model, f.backend->make_cache(o, shape), /*prefill_chunk=*/5);
    // Scatter the pool first, so the sequences' pages are not in order.
    kv::BlockTable hole(dec.pool(), 8);
    hole.reserve(8 * 3);
    const std::vector<int> lengths = {3, 17, 8, 30};
    std::vector<std::vector<TokenId>> prompts;
    std::vector<int> handles;
    for (size_t i = 0; i < lengths.size(); ++i) {
      prompts.push_back(f.prompt(lengths[i], 100 + i));
      handles.push_back(dec.add(prompts.back(), greedy()));
      if (i == 1) hole.clear();
    }
    std::vector<std::vector<std::vector<float>>> batched(lengths.size());
    for (size_t i = 0; i < lengths.size(); ++i) batched[i].push_back(dec.last_logits(handles[i]));
    for (int s = 0; s < steps; ++s) {
      dec.step();
      for (size_t i = 0; i < lengths.size(); ++i) batched[i].push_back(dec.last_logits(handles[i]));
    }
    for (size_t i = 0; i < lengths.size(); ++i) {
      std::vector<TokenId> solo_tokens;
      const auto solo = f.solo(o, prompts[i], steps, &solo_tokens);
      const std::vector<TokenId>& toks = dec.tokens(handles[i]);
      ASSERT_EQ(toks.size(), prompts[i].size() + steps + 1);
      EXPECT_TRUE(std::equal(solo_tokens.begin(), solo_tokens.end(), toks.begin() + ptrdiff_t(prompts[i].size())))
          << "sequence " << i;
      for (int s = 0; s <= steps; ++s)
        EXPECT_EQ(max_diff(solo[size_t(s)], batched[i][size_t(s)]), 0.0f) << "sequence " << i << ", step " << s;
    }
  }
}

// Sequences join, finish and leave between steps at random; every one of
// them is held to its solo run, and every page comes back at the end.
TEST(BatchDecode, RandomScheduleMatchesSoloRuns) {
  BatchFixture f;
  kv::CodecOptions o;
  o.kv = "k8v4";
  kv::CacheShape shape = f.model->cache_shape(16 * 40);
  shape.page_tokens = 16;
  BatchDecoder dec(*f.model, f.backend->make_cache(o, shape), 7);
  Rng rng(5);
  struct Tracked {
    int handle;
    std::vector<TokenId> prompt;
    int steps_left;
  };
  std::vector<Tracked> live;
  int started = 0, finished = 0;
  for (int tick = 0; tick < 40; ++tick) {
    if (live.size() < 5 && rng.next_u64() % 3 != 0) {
      Tracked t{0, f.prompt(1 + int(rng.next_u64() % 40), 1000 + uint64_t(started)), 1 + int(rng.next_u64() % 12)};
      t.handle = dec.add(t.prompt, greedy());
      live.push_back(t);
      ++started;
    }
    dec.step();
    for (size_t i = 0; i < live.size();) {
      if (--live[i].steps_left > 0) {
        ++i;
        continue;
      }
      const std::vector<TokenId> got = dec.tokens(live[i].handle);
      const int decoded = int(got.size() - live[i].prompt.size()) - 1;
      std::vector<TokenId> solo_tokens;
      f.solo(o, live[i].prompt, decoded, &solo_tokens);
      EXPECT_TRUE(std::equal(solo_tokens.begin(), solo_tokens.end(), got.begin() + ptrdiff_t(live[i].prompt.size())))
          << "sequence " << live[i].handle;
      dec.remove(live[i].handle);
      live.erase(live.begin() + ptrdiff_t(i));
      ++finished;
    }
  }
  for (const Tracked& t : live) dec.remove(t.handle);
  EXPECT_GT(started, 8);
  EXPECT_GT(finished, 5);
  EXPECT_EQ(dec.pool().used_pages(), 0);
}

TEST(BatchDecode, PoolExhaustionIsAClearErrorAndCorruptsNothing) {
  BatchFixture f;
  kv::CodecOptions o;
  o.kv = "k8v8";
  kv::CacheShape shape = f.model->cache_shape(8 * 6);  // 6 pages of 8
  shape.page_tokens = 8;
  BatchDecoder dec(*f.model, f.backend->make_cache(o, shape), 16);
  const auto p = f.prompt(20, 3);  // 3 pages
  const int a = dec.add(p, greedy());
  const int b = dec.add(f.prompt(16, 4), greedy());  // 2 pages: 1 left
  try {
    dec.add(f.prompt(9, 5), greedy());  // needs 2
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::out_of_range);
    EXPECT_NE(std::string(e.what()).find("KV pool is full"), std::string::npos) << e.what();
  }
  EXPECT_EQ(dec.pool().used_pages(), 5);
  for (int s = 0; s < 4; ++s) dec.step();  // a: 20 -> 24 cached, b: 16 -> 20 (its third page)
  EXPECT_EQ(dec.pool().free_pages(), 0);
  EXPECT_THROW(for (int s = 0; s < 8; ++s) dec.step(), Error);  // a needs a fourth page
  dec.remove(b);
  dec.step();  // room again
  std::vector<TokenId> solo_tokens;
  const int decoded = int(dec.tokens(a).size() - p.size()) - 1;
  f.solo(o, p, decoded, &solo_tokens);
  EXPECT_TRUE(std::equal(solo_tokens.begin(), solo_tokens.end(), dec.tokens(a).begin() + ptrdiff_t(p.size())));
}

// A copied sequence (BatchDecoder::add_copy) decodes exactly as its source,
// in pages of its own; a copy the pool cannot hold takes nothing.
TEST(BatchDecode, CopiedSequenceDecodesAsItsSource) {
  BatchFixture f;
  for (const char* codec : {"none", "tsym3"}) {
    SCOPED_TRACE(codec);
    kv::CodecOptions o;
    o.kv = codec;
    kv::CacheShape shape = f.model->cache_shape(8 * 12);  // 12 pages of 8
    shape.page_tokens = 8;
    BatchDecoder dec(*f.model, f.backend->make_cache(o, shape), 16);
    const auto p = f.prompt(19, 8);  // 3 pages
    const int a = dec.add(p, greedy());
    dec.step();
    dec.step();  // 21 cached
    const int b = dec.add_copy(a, greedy());
    EXPECT_EQ(dec.cached(b), dec.cached(a));
    EXPECT_EQ(dec.tokens(b), dec.tokens(a));
    EXPECT_EQ(dec.pool().used_pages(), 3 + 3);
    for (int s = 0; s < 5; ++s) {
      dec.step();
      ASSERT_EQ(dec.tokens(b), dec.tokens(a)) << "step " << s;
      ASSERT_EQ(max_diff(dec.last_logits(a), dec.last_logits(b)), 0.0f) << "step " << s;
    }
    std::vector<TokenId> solo_tokens;
    f.solo(o, p, 7, &solo_tokens);
    EXPECT_TRUE(std::equal(solo_tokens.begin(), solo_tokens.end(), dec.tokens(b).begin() + ptrdiff_t(p.size())));
    // 26 cached in 4 pages each: 8 of 12 used; a third copy needs 4 of the 4 free.
    const int c = dec.add_copy(a, greedy());
    EXPECT_EQ(dec.pool().free_pages(), 0);
    try {
      dec.add_copy(a, greedy());
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::out_of_range) << e.what();
    }
    EXPECT_EQ(dec.live(), 3);
    dec.remove(c);
    EXPECT_EQ(dec.pool().used_pages(), 8);
  }
}

// Two backends in one process, each with its own model and pool, stepping in
// turns: neither sees the other's state (kernel settings, caches, pools), so
// each sequence gets its solo result. (Two GPUs need a machine that has
// them; the CUDA backend's per-device state is its DeviceContext.)
TEST(BatchDecode, TwoBackendsInOneProcessStayApart) {
  BatchFixture a, b;
  kv::CodecOptions o;
  o.kv = "k8v4";
  kv::CacheShape shape = a.model->cache_shape(64 * 8);
  BatchDecoder da(*a.model, a.backend->make_cache(o, shape), 8);
  BatchDecoder db(*b.model, b.backend->make_cache(o, shape), 8);
  const auto pa = a.prompt(12, 7), pb = b.prompt(23, 8);
  const int sa = da.add(pa, greedy()), sb = db.add(pb, greedy());
  for (int s = 0; s < 5; ++s) {
    da.step();
    db.step();
  }
  std::vector<TokenId> solo_a, solo_b;
  a.solo(o, pa, 5, &solo_a);
  b.solo(o, pb, 5, &solo_b);
  EXPECT_TRUE(std::equal(solo_a.begin(), solo_a.end(), da.tokens(sa).begin() + ptrdiff_t(pa.size())));
  EXPECT_TRUE(std::equal(solo_b.begin(), solo_b.end(), db.tokens(sb).begin() + ptrdiff_t(pb.size())));
}

// Greedy steps chosen by the backend (logits left where they are) pick what
// the host sampler picks from the downloaded logits.
TEST(BatchDecode, BackendChoiceEqualsHostGreedy) {
  BatchFixture f;
  kv::CodecOptions o;
  o.kv = "tsym3";
  const kv::CacheShape shape = f.model->cache_shape(64 * 8);
  BatchDecoder host(*f.model, f.backend->make_cache(o, shape), 8);
  BatchDecoder dev(*f.model, f.backend->make_cache(o, shape), 8);
  dev.set_keep_logits(false);
  std::vector<int> hs, ds;
  for (int i = 0; i < 3; ++i) {
    const auto p = f.prompt(5 + 9 * i, 40 + uint64_t(i));
    hs.push_back(host.add(p, greedy()));
    ds.push_back(dev.add(p, greedy()));
  }
  for (int s = 0; s < 6; ++s) {
    host.step();
    dev.step();
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(host.tokens(hs[size_t(i)]), dev.tokens(ds[size_t(i)])) << i;
    EXPECT_TRUE(dev.last_logits(ds[size_t(i)]).empty());
  }
}

TEST(StepBatch, ArgmaxRowsFollowsTheGreedyRule) {
  auto be = cpu::make_cpu_backend();
  const float nan = std::nanf("");
  const std::vector<float> x = {1, 3, 3, 0, /**/ nan, -1, nan, -2, /**/ nan, -INFINITY, nan, nan};
  int32_t idx[3];
  float val[3];
  be->argmax_rows(x.data(), 3, 4, 4, idx, val);
  EXPECT_EQ(idx[0], 1);
  EXPECT_EQ(val[0], 3.0f);
  EXPECT_EQ(idx[1], 1);
  EXPECT_EQ(val[1], -1.0f);
  EXPECT_EQ(val[2], -INFINITY);  // nothing finite: callers report it
}

namespace {

// A decoder over a store with an exact window of W pages of 8 tokens.
std::unique_ptr<BatchDecoder> windowed_decoder(BatchFixture& f, const char* codec, int W, int pages, int exact_pages,
                                               int prefill_chunk) {
  kv::CodecOptions o;
  o.kv = codec;
  kv::CacheShape shape = f.model->cache_shape(8 * pages);
  shape.page_tokens = 8;
  shape.window_pages = W;
  shape.exact_pages = exact_pages;
  return std::make_unique<BatchDecoder>(*f.model, f.backend->make_cache(o, shape), prefill_chunk);
}

}  // namespace

// With an exact window, sequences decoded together give each its result
// alone (to the bit) while their oldest window pages are packed; each holds
// at most W exact pages; a rewind to the prompt decodes the same tokens
// again; a copy decodes as its source; every page of both pools comes back.
TEST(BatchDecode, WindowedSequencesDecodeAsTheyDoAlone) {
  BatchFixture f;
  const int steps = 13, W = 1;
  for (const char* codec : {"tsym3", "k8vturbo2", "none"}) {
    SCOPED_TRACE(codec);
    const std::vector<int> lengths = {3, 19, 8, 30};
    std::vector<std::vector<TokenId>> prompts;
    for (size_t i = 0; i < lengths.size(); ++i) prompts.push_back(f.prompt(lengths[i], 200 + i));
    // Alone: one decoder per sequence.
    std::vector<std::vector<std::vector<float>>> alone(lengths.size());
    std::vector<std::vector<TokenId>> alone_tokens(lengths.size());
    for (size_t i = 0; i < lengths.size(); ++i) {
      auto dec = windowed_decoder(f, codec, W, 12, 2, 16);
      const int h = dec->add(prompts[i], greedy());
      alone[i].push_back(dec->last_logits(h));
      for (int s = 0; s < steps; ++s) {
        dec->step();
        alone[i].push_back(dec->last_logits(h));
        EXPECT_LE(dec->exact_pool()->used_pages(), W);
      }
      alone_tokens[i] = dec->tokens(h);
      // Back to the prompt: the same tokens and logits again.
      dec->rewind(h, int(prompts[i].size()));
      for (int s = 0; s < steps; ++s) {
        dec->step();
        ASSERT_EQ(max_diff(dec->last_logits(h), alone[i][size_t(s + 1)]), 0.0f) << "after the rewind, step " << s;
      }
      EXPECT_EQ(dec->tokens(h), alone_tokens[i]);
      EXPECT_LE(dec->exact_pool()->used_pages(), W);
    }
    // Together, over a scattered pool.
    auto dec = windowed_decoder(f, codec, W, 40, 5, 16);  // 4 windows and a copy's
    kv::BlockTable hole(dec->pool(), 8);
    hole.reserve(8 * 3);
    std::vector<int> handles;
    for (size_t i = 0; i < lengths.size(); ++i) {
      handles.push_back(dec->add(prompts[i], greedy()));
      if (i == 1) hole.clear();
    }
    for (size_t i = 0; i < lengths.size(); ++i) EXPECT_EQ(max_diff(dec->last_logits(handles[i]), alone[i][0]), 0.0f);
    for (int s = 0; s < steps; ++s) {
      dec->step();
      for (size_t i = 0; i < lengths.size(); ++i) {
        ASSERT_EQ(max_diff(dec->last_logits(handles[i]), alone[i][size_t(s + 1)]), 0.0f)
            << "sequence " << i << ", step " << s;
        const kv::BlockTable& t = dec->table(handles[i]);
        EXPECT_EQ(t.exact_from(), kv::window_first_page(dec->cached(handles[i]), 8, W));
      }
      EXPECT_LE(dec->exact_pool()->used_pages(), int(lengths.size()) * W);
    }
    for (size_t i = 0; i < lengths.size(); ++i) EXPECT_EQ(dec->tokens(handles[i]), alone_tokens[i]);
    // A copy holds the same kinds of pages and decodes as its source.
    const int c = dec->add_copy(handles[1], greedy());
    dec->step();
    dec->step();
    EXPECT_EQ(dec->tokens(c), dec->tokens(handles[1]));
    EXPECT_EQ(max_diff(dec->last_logits(c), dec->last_logits(handles[1])), 0.0f);
    for (int h : dec->live_sequences()) dec->remove(h);
    EXPECT_EQ(dec->pool().used_pages(), 0);
    EXPECT_EQ(dec->exact_pool()->used_pages(), 0);
  }
}

// A window as long as the context holds every row exact: the decoder then
// computes what the evaluation form of the window does with every row in its
// window (both read only bf16 rows), to the bit.
TEST(BatchDecode, AWindowOfEveryPageIsExactAttention) {
  BatchFixture f;
  kv::CodecOptions eval;
  eval.kv = "tsym3";
  eval.exact_window_pages = 64;
  const auto p = f.prompt(21, 9);
  std::vector<TokenId> solo_tokens;
  const auto solo = f.solo(eval, p, 9, &solo_tokens);
  auto dec = windowed_decoder(f, "tsym3", 8, 8, 8, 16);
  const int h = dec->add(p, greedy());
  EXPECT_EQ(max_diff(dec->last_logits(h), solo[0]), 0.0f);
  for (int s = 0; s < 9; ++s) {
    dec->step();
    ASSERT_EQ(max_diff(dec->last_logits(h), solo[size_t(s + 1)]), 0.0f) << "step " << s;
  }
  EXPECT_EQ(dec->pool().used_pages(), 0);  // no page left the window
  EXPECT_EQ(dec->exact_pool()->used_pages(), 4);
}

// A window pool too small for the sequences is a clear error that leaves
// every sequence as it was.
TEST(BatchDecode, WindowPoolExhaustionIsAClearError) {
  BatchFixture f;
  auto dec = windowed_decoder(f, "k8v4", 2, 12, 3, 16);
  const int a = dec->add(f.prompt(12, 1), greedy());  // 2 exact pages
  try {
    dec->add(f.prompt(12, 2), greedy());  // 2 more, 1 free
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::out_of_range) << e.what();
  }
  EXPECT_EQ(dec->live(), 1);
  EXPECT_EQ(dec->exact_pool()->used_pages(), 2);
  for (int s = 0; s < 10; ++s) dec->step();  // crosses a page: one leaves, one comes
  EXPECT_EQ(dec->exact_pool()->used_pages(), 2);
  EXPECT_EQ(dec->pool().used_pages(), 1);
  dec->remove(a);
  EXPECT_EQ(dec->exact_pool()->used_pages(), 0);
  EXPECT_EQ(dec->pool().used_pages(), 0);
}

// A Session over a store with an exact window (one sequence, its own pools)
// computes what a windowed BatchDecoder does, and truncating into pages that
// left the window feeds their tokens again.
TEST(BatchDecode, WindowedSessionDecodesAsTheDecoder) {
  BatchFixture f;
  const int W = 1, steps = 12;
  const auto p = f.prompt(21, 31);
  auto dec = windowed_decoder(f, "k8vturbo2", W, 8, 1, 16);
  const int h = dec->add(p, greedy());
  std::vector<std::vector<float>> want = {dec->last_logits(h)};
  for (int s = 0; s < steps; ++s) {
    dec->step();
    want.push_back(dec->last_logits(h));
  }
  kv::CodecOptions o;
  o.kv = "k8vturbo2";
  kv::CacheShape shape = f.model->cache_shape(64);
  shape.page_tokens = 8;
  shape.window_pages = W;
  shape.exact_pages = W;
  SessionOptions so;
  so.ctx = 64;
  so.prefill_chunk = 16;
  Session s(*f.model, f.backend->make_cache(o, shape), nullptr, so);
  EXPECT_EQ(s.cache().codec_name(), "k8vturbo2+win1");
  EXPECT_EQ(max_diff(s.feed(p), want[0]), 0.0f);
  const std::vector<TokenId>& toks = dec->tokens(h);
  for (int i = 0; i < steps; ++i) {
    const auto& logits = s.feed({toks[p.size() + size_t(i)]});
    ASSERT_EQ(max_diff(logits, want[size_t(i + 1)]), 0.0f) << "step " << i;
  }
  // 33 tokens cached, the window is page 4 (tokens 32..): truncating to 30
  // would put page 3 back in the window, so tokens from 24 are fed again.
  s.truncate(30);
  EXPECT_EQ(s.tokens().size(), 24u);
  std::vector<TokenId> again(toks.begin() + 24, toks.begin() + 32);
  s.feed(again);
  const auto& logits = s.feed({toks[32]});  // decode step 11 of the decoder's
  EXPECT_EQ(max_diff(logits, want[12]), 0.0f);
}
