// The exact recent window's serving form (docs/architecture.md, "The exact
// recent window"): block tables whose newest pages come from a second pool,
// a CPU store that keeps those pages' rows in bf16 and packs them into the
// codec's pages when they leave, and attention over both parts.
#include <gtest/gtest.h>

#include <cstring>

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "kv/cache.hpp"
#include "kv/codec_table.hpp"
#include "kv/page_pool.hpp"
#include "kv_test_util.hpp"

using namespace kvq;

namespace {

std::vector<float> bf16_rounded(std::vector<float> x) {
  for (float& f : x) f = bf16_to_f32(f32_to_bf16(f));
  return x;
}

}  // namespace

TEST(WindowTable, TheNewestPagesAreExactAndLeavingOnesAreMoved) {
  const int P = 4, W = 2;
  kv::PagePool packed(6), exact(3);
  const int32_t base = 6;  // exact page e is named 6 + e
  kv::BlockTable t(packed, P, exact, base, W);
  std::vector<kv::PageMove> moves;
  t.reserve(5, &moves);  // 2 pages, both in the window
  EXPECT_TRUE(moves.empty());
  EXPECT_EQ(t.exact_from(), 0);
  EXPECT_TRUE(t.is_exact(t.pages()[0]) && t.is_exact(t.pages()[1]));
  EXPECT_EQ(exact.used_pages(), 2);
  t.reserve(8, &moves);  // still 2 pages
  EXPECT_TRUE(moves.empty());
  const int32_t oldest = t.pages()[0];
  t.reserve(9, &moves);  // a third page opens: the first leaves the window
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].exact, oldest);
  EXPECT_EQ(moves[0].packed, t.pages()[0]);
  EXPECT_FALSE(t.is_exact(t.pages()[0]));
  EXPECT_EQ(t.exact_from(), 1);
  EXPECT_EQ(exact.used_pages(), 2);  // the new page took the one that left (packed before it is written)
  EXPECT_EQ(t.pages()[2], oldest);
  moves.clear();

  // A long step (a prompt chunk) writes its older pages straight into packed ones.
  t.reserve(26, &moves);  // 7 pages: 0..4 packed, 5..6 exact
  EXPECT_EQ(moves.size(), 2u);  // pages 1 and 2 leave
  EXPECT_EQ(t.exact_from(), 5);
  for (int i = 0; i < 7; ++i) EXPECT_EQ(t.is_exact(t.pages()[size_t(i)]), i >= 5) << i;
  moves.clear();
  EXPECT_EQ(packed.used_pages(), 5);
  EXPECT_EQ(exact.used_pages(), 2);

  // A pool that runs out leaves the table as it was.
  const std::vector<int32_t> before = t.pages();
  EXPECT_THROW(t.reserve(36, &moves), Error);  // needs 3 more packed pages, 1 free
  EXPECT_EQ(t.pages(), before);
  EXPECT_TRUE(moves.empty());
  EXPECT_EQ(packed.used_pages(), 5);
  EXPECT_EQ(exact.used_pages(), 2);
  {
    kv::BlockTable w(packed, P, exact, base, W);
    try {
      w.reserve(8, &moves);  // 2 exact pages, 1 free
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::out_of_range);
      EXPECT_NE(std::string(e.what()).find("window pool is full"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(w.pages().empty());
    EXPECT_EQ(exact.used_pages(), 2);
  }

  // A copy takes pages of the same kinds; exact pages are never shared.
  kv::PagePool packed2(6), exact2(3);
  {
    kv::BlockTable u(packed, P, exact, base, W);
    EXPECT_THROW(u.reserve_like(t, 26), Error);  // 5 packed pages needed, 1 free
    EXPECT_TRUE(u.pages().empty());
    EXPECT_EQ(packed.used_pages(), 5);
    kv::BlockTable s(packed, P, exact, base, W);
    EXPECT_THROW(s.share_prefix(t, 26), Error);
    s.share_prefix(t, 20);  // the packed pages only
    EXPECT_EQ(packed.refs(t.pages()[0]), 2);
  }
  t.shrink(18);  // 5 pages: the exact page 5 and 6 go back
  EXPECT_EQ(exact.used_pages(), 0);
  EXPECT_EQ(t.exact_from(), 5);
  t.reserve(21, &moves);  // page 5 is new: the window again
  EXPECT_TRUE(moves.empty());
  EXPECT_TRUE(t.is_exact(t.pages()[5]));
  t.clear();
  EXPECT_EQ(packed.used_pages(), 0);
  EXPECT_EQ(exact.used_pages(), 0);
  EXPECT_THROW(kv::BlockTable(packed, P, exact, 3, W), Error);  // exact ids must follow the packed ones
}

// A store with a window pool: rows written to exact pages are bf16, packing
// them gives the codec's rows of those bf16 values, and attention over a
// table of packed pages and a window equals the evaluation form of the window
// (every row also kept exact) at a decode step, to the bit.
TEST(WindowStore, PackedPagesAndAttentionMatchTheEvaluationForm) {
  const int H = 2, D = 64, n_heads = 4, P = kv::kDefaultPageTokens;  // the evaluation form's page size
  for (const char* name : {"tsym3", "k8v4", "k8vturbo2", "iso3_sym", "rotor3_sym+qjl", "fp8", "none"}) {
    for (const int W : {1, 2}) {
      for (const int T : {40, 64, 65, 190}) {
        SCOPED_TRACE(std::string(name) + " W=" + std::to_string(W) + " T=" + std::to_string(T));
        kv::CodecOptions o;
        o.kv = name;
        kv::CacheShape shape{2, H, D, 4 * P, n_heads, P};
        shape.window_pages = W;
        shape.exact_pages = 3;
        auto win = kv::make_cpu_cache(o, shape);
        EXPECT_EQ(win->codec_name(), kv::resolve_codec(o).name + "+win" + std::to_string(W));
        kv::CodecOptions eval = o;
        eval.exact_window_pages = W;
        auto ref = kv::make_cpu_cache(eval, kv::CacheShape{2, H, D, 4 * P, n_heads, P});
        Rng rng(uint64_t(T) * 7 + uint64_t(W));
        const std::vector<float> k = bf16_rounded(test::gaussian(rng, size_t(T) * H * D));
        const std::vector<float> v = bf16_rounded(test::gaussian(rng, size_t(T) * H * D));
        // The window's table: packed pages 3, 1, ... then exact pages 4 + 2, 4 + 0.
        const int pages = kv::pages_for(T, P), first = kv::window_first_page(T, P, W);
        std::vector<int32_t> table;
        const int32_t packed_ids[] = {3, 1, 0, 2}, exact_ids[] = {4 + 2, 4 + 0, 4 + 1};
        for (int i = 0; i < pages; ++i) table.push_back(i < first ? packed_ids[i] : exact_ids[i - first]);
        const kv::PageGeometry geo = shape.geometry();
        std::vector<int32_t> slots, ref_slots;
        for (int t = 0; t < T; ++t) {
          slots.push_back(geo.slot_of(table.data(), t));
          ref_slots.push_back(t);
        }
        for (int l = 0; l < 2; ++l) {
          win->layer(l).write_slots(slots.data(), T, k.data(), v.data());
          ref->layer(l).write_slots(ref_slots.data(), T, k.data(), v.data());
        }
        const std::vector<float> q = test::gaussian(rng, size_t(n_heads) * D);
        std::vector<float> a(q.size()), b(q.size());
        const kv::QueryRun run{table.data(), pages, 0, 1, T - 1};
        for (int l = 0; l < 2; ++l) {
          win->layer(l).attend_runs(&run, 1, q.data(), n_heads, 0.125f, a.data());
          ref->layer(l).attend(T - 1, 1, q.data(), n_heads, 0.125f, b.data());
          ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "layer " << l;
        }
        // Pack the oldest exact page; its rows are what encoding the bf16 values gives.
        if (pages - first < 1 || first + 1 > 4) continue;
        const int32_t from = table[size_t(first)], to = packed_ids[first];
        win->pack_pages(&from, &to, 1);
        const kv::ResolvedCodec rc = kv::resolve_codec(o);
        for (int l = 0; l < 2; ++l)
          for (const bool vs : {false, true}) {
            const kv::RowLayout lay = kv::block_layout(vs ? rc.v : rc.k, D);
            std::vector<uint8_t> ca(lay.code_bytes), sa(lay.side_bytes + 1), cb(lay.code_bytes),
                sb(lay.side_bytes + 1);
            for (int e = 0; e < P && first * P + e < T; ++e)
              for (int h = 0; h < H; ++h) {
                win->layer(l).read_row(to * P + e, h, vs, ca.data(), sa.data());
                ref->layer(l).read_row(first * P + e, h, vs, cb.data(), sb.data());
                ASSERT_EQ(ca, cb) << "layer " << l << " entry " << e << " head " << h << (vs ? " V" : " K");
                ASSERT_TRUE(std::equal(sa.begin(), sa.begin() + ptrdiff_t(lay.side_bytes), sb.begin()));
              }
            std::vector<uint8_t> row(size_t(2 * D));
            EXPECT_THROW(win->layer(l).read_row(from * P, 0, vs, row.data(), nullptr), Error);  // unwritten now
          }
      }
    }
  }
}

TEST(WindowStore, BadTablesAndMovesAreErrors) {
  const int H = 1, D = 64, P = 8;
  kv::CodecOptions o;
  o.kv = "k8v8";
  kv::CacheShape shape{1, H, D, 4 * P, 1, P};  // packed pages 0..3
  shape.window_pages = 1;
  shape.exact_pages = 2;  // exact pages 4, 5
  auto c = kv::make_cpu_cache(o, shape);
  std::vector<float> k(size_t(2 * P) * D, 0.5f), q(D, 1.0f), out(D);
  const std::vector<int32_t> good = {1, 4}, bad = {4, 0};
  std::vector<int32_t> slots;
  for (int t = 0; t < 2 * P; ++t) slots.push_back(shape.geometry().slot_of(bad.data(), t));
  c->layer(0).write_slots(slots.data(), 2 * P, k.data(), k.data());
  const kv::QueryRun exact_then_packed{bad.data(), 2, 0, 1, 2 * P - 1};
  EXPECT_THROW(c->layer(0).attend_runs(&exact_then_packed, 1, q.data(), 1, 1.0f, out.data()), Error);
  const kv::QueryRun ok{good.data(), 2, 0, 1, 2 * P - 1};
  EXPECT_THROW(c->layer(0).attend_runs(&ok, 1, q.data(), 1, 1.0f, out.data()), Error);  // page 1 unwritten
  for (int t = 0; t < 2 * P; ++t) slots[size_t(t)] = shape.geometry().slot_of(good.data(), t);
  c->layer(0).write_slots(slots.data(), 2 * P, k.data(), k.data());
  c->layer(0).attend_runs(&ok, 1, q.data(), 1, 1.0f, out.data());
  for (float x : out) EXPECT_NEAR(x, 0.5f, 1e-4f);  // the q8 scale is fp16
  const int32_t p0 = 0, p1 = 1, e4 = 4, e5 = 5, outside = 6;
  EXPECT_THROW(c->pack_pages(&p0, &p1, 1), Error);      // from a packed page
  EXPECT_THROW(c->pack_pages(&e4, &e5, 1), Error);      // into an exact page
  EXPECT_THROW(c->pack_pages(&outside, &p1, 1), Error);  // no such page
  EXPECT_THROW(c->copy_pages(&e4, &p1, 1), Error);      // across the two stores
  c->copy_pages(&e4, &e5, 1);                           // within the window's store
  const int32_t slot = 6 * P;
  EXPECT_THROW(c->layer(0).write_slots(&slot, 1, k.data(), k.data()), Error);  // past the window's store
  // Shapes: a window needs a pool and a pool a window; the two forms exclude each other.
  kv::CacheShape no_pool = shape;
  no_pool.exact_pages = 0;
  EXPECT_THROW(kv::make_cpu_cache(o, no_pool), Error);
  kv::CodecOptions eval = o;
  eval.exact_window_pages = 1;
  EXPECT_THROW(kv::make_cpu_cache(eval, shape), Error);
  kv::CacheShape plain{1, H, D, 4 * P, 1, P};
  EXPECT_THROW(kv::make_cpu_cache(o, plain)->pack_pages(&e4, &p1, 1), Error);
  // Bytes: packed rows before the window, whole bf16 pages in it.
  const uint64_t page = uint64_t(P) * H * D * 2 * 2;
  EXPECT_EQ(c->exact_page_bytes(), page);
  EXPECT_EQ(c->bytes_for_sequence(3), page);
  EXPECT_EQ(c->bytes_for_sequence(2 * P + 1), c->bytes_for_tokens(2 * P) + page);
  EXPECT_EQ(kv::make_cpu_cache(o, plain)->bytes_for_sequence(20), kv::make_cpu_cache(o, plain)->bytes_for_tokens(20));
}
