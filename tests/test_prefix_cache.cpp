// The prefix cache's bookkeeping (engine/prefix_cache.hpp) over a page pool:
// matching by exact tokens page by page, duplicates, reference counts, and
// eviction of idle leaves, least recently used first. The scheduler's use of
// it (outputs equal with and without it) is in test_scheduler.cpp.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "core/error.hpp"
#include "engine/prefix_cache.hpp"
#include "kv/page_pool.hpp"

using namespace kvq;

namespace {

constexpr int kPt = 4;  // tokens per page

std::vector<TokenId> seq(int n, int first) {
  std::vector<TokenId> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

// Caches the full pages of `tokens` from fresh pages, as a finished
// sequence would leave them; returns the nodes. The pages stay held by the
// cache only.
std::vector<PrefixCache::NodeId> leave(PrefixCache& c, kv::PagePool& pool, const std::vector<TokenId>& tokens) {
  std::vector<PrefixCache::NodeId> nodes;
  PrefixCache::NodeId parent = 0;
  for (size_t i = 0; i + kPt <= tokens.size(); i += kPt) {
    const int32_t page = pool.alloc();
    parent = c.insert(parent, tokens.data() + i, page);
    nodes.push_back(parent);
    pool.release(page);  // the sequence ends: only the cache (if it kept this page) holds it
  }
  return nodes;
}

}  // namespace

TEST(PrefixCache, MatchesWholePagesOfTheSameTokensOnly) {
  kv::PagePool pool(16);
  PrefixCache c(pool, kPt);
  const std::vector<TokenId> a = seq(10, 100);  // two full pages, 2 tokens left over
  leave(c, pool, a);
  EXPECT_EQ(c.cached_pages(), 2);
  EXPECT_EQ(pool.used_pages(), 2);
  EXPECT_EQ(c.idle_pages(), 2);

  PrefixCache::Match m = c.match(a.data(), 2);  // a holds two whole pages; the partial third was never cached
  ASSERT_EQ(m.pages.size(), 2u);
  EXPECT_EQ(m.tokens(kPt), 8);
  EXPECT_EQ(c.match(a.data(), 1).pages.size(), 1u);  // max_pages holds
  EXPECT_EQ(c.match(a.data(), 0).pages.size(), 0u);

  std::vector<TokenId> b = a;
  b[5] = 7;  // the second page differs
  m = c.match(b.data(), 2);
  EXPECT_EQ(m.pages.size(), 1u);
  b[0] = 7;  // the first too: nothing, although the second page's own tokens might match elsewhere
  EXPECT_EQ(c.match(b.data(), 2).pages.size(), 0u);

  // The same page content under another parent is another prefix.
  const std::vector<TokenId> shifted = {1, 2, 3, 4, 104, 105, 106, 107};
  EXPECT_EQ(c.match(shifted.data(), 2).pages.size(), 0u);
}

TEST(PrefixCache, DuplicatesKeepTheCachedPageAndReferencesAreExact) {
  kv::PagePool pool(8);
  PrefixCache c(pool, kPt);
  const std::vector<TokenId> t = seq(8, 0);
  const int32_t p0 = pool.alloc(), p1 = pool.alloc();  // a running sequence's pages
  const PrefixCache::NodeId n0 = c.insert(0, t.data(), p0);
  const PrefixCache::NodeId n1 = c.insert(n0, t.data() + kPt, p1);
  EXPECT_EQ(pool.refs(p0), 2);
  EXPECT_EQ(c.idle_pages(), 0);  // the sequence still holds them

  // A second sequence that prefilled the same tokens itself: the cache keeps
  // its own page, and the sequence swaps its copy for it (the scheduler's
  // way, so that every cached node a sequence chains from is a page it holds).
  kv::BlockTable second(pool, kPt);
  second.reserve(kPt);
  const int32_t q0 = second.pages()[0];
  EXPECT_EQ(c.insert(0, t.data(), q0), n0);
  EXPECT_EQ(pool.refs(q0), 1);
  EXPECT_EQ(c.cached_pages(), 2);
  EXPECT_EQ(c.page(n0), p0);
  second.replace(0, c.page(n0));
  EXPECT_EQ(pool.refs(q0), 0);  // freed
  EXPECT_EQ(pool.refs(p0), 3);  // the first sequence, the cache, the second
  second.clear();

  pool.release(p0);
  pool.release(p1);
  EXPECT_EQ(c.idle_pages(), 2);
  const PrefixCache::Match m = c.match(t.data(), 2);
  ASSERT_EQ(m.nodes.size(), 2u);
  EXPECT_EQ(m.nodes[1], n1);
  EXPECT_EQ(m.pages[0], p0);
  c.clear();
  EXPECT_EQ(pool.used_pages(), 0);
  EXPECT_EQ(c.cached_pages(), 0);
}

TEST(PrefixCache, EvictsIdleLeavesLeastRecentlyUsedFirst) {
  kv::PagePool pool(16);
  PrefixCache c(pool, kPt);
  const std::vector<TokenId> a = seq(12, 0), b = seq(8, 500);  // chains of 3 and 2 pages
  const auto na = leave(c, pool, a);
  const auto nb = leave(c, pool, b);
  c.match(a.data(), 3);  // a is now the most recently used

  // A sequence holds b's first page: not idle, and not evicted.
  const PrefixCache::Match held = c.match(b.data(), 1);
  pool.retain(held.pages[0]);
  EXPECT_EQ(c.idle_pages(), 4);

  EXPECT_EQ(c.evict(1), 1);  // b's second page: the oldest idle leaf
  EXPECT_EQ(c.match(b.data(), 2).pages.size(), 1u);
  EXPECT_EQ(c.match(a.data(), 3).pages.size(), 3u);

  // a's chain goes from its end; b's first page is held, so it stays.
  EXPECT_EQ(c.evict(2), 2);
  EXPECT_EQ(c.match(a.data(), 3).pages.size(), 1u);
  EXPECT_EQ(c.evict(10), 1);  // only a's first page was left idle
  EXPECT_EQ(c.match(a.data(), 3).pages.size(), 0u);
  EXPECT_EQ(c.cached_pages(), 1);
  EXPECT_EQ(pool.used_pages(), 1);
  pool.release(held.pages[0]);
  EXPECT_EQ(c.idle_pages(), 1);
  EXPECT_EQ(c.evict(0), 0);
  EXPECT_EQ(c.evict(1), 1);
  EXPECT_EQ(pool.used_pages(), 0);
  (void)na;
  (void)nb;
}

TEST(PrefixCache, ABadParentIsAnError) {
  kv::PagePool pool(2);
  PrefixCache c(pool, kPt);
  const std::vector<TokenId> t = seq(4, 0);
  EXPECT_THROW(c.insert(99, t.data(), 0), Error);
  EXPECT_THROW(PrefixCache(pool, 0), Error);
}

// A sequence that prefilled a page the cache already had keeps its own copy;
// its next page chains under the cached one, which is then idle but cannot
// be evicted while that next page is held (evictable_pages says so, and a
// reservation counts only those).
TEST(PrefixCache, AnIdlePageAboveAHeldOneIsNotEvictable) {
  kv::PagePool pool(8);
  PrefixCache c(pool, kPt);
  const std::vector<TokenId> t = seq(8, 0);
  const auto first = leave(c, pool, std::vector<TokenId>(t.begin(), t.begin() + kPt));  // cached page 0, idle
  const int32_t own0 = pool.alloc(), own1 = pool.alloc();                               // a second sequence's pages
  EXPECT_EQ(c.insert(0, t.data(), own0), first[0]);                                     // a duplicate: not cached
  const PrefixCache::NodeId n1 = c.insert(first[0], t.data() + kPt, own1);              // chains under the cached page
  EXPECT_NE(n1, 0u);
  EXPECT_EQ(c.idle_pages(), 1);
  EXPECT_EQ(c.evictable_pages(), 0);
  EXPECT_EQ(c.evict(1), 0);
  pool.release(own1);  // the sequence ends
  pool.release(own0);
  EXPECT_EQ(c.evictable_pages(), 2);
  EXPECT_EQ(c.evict(2), 2);
  EXPECT_EQ(pool.used_pages(), 0);
}

// The pool counts the pages only a cache holds as references come and go
// (what the scheduler's metrics read every step), and a marked page cannot
// be let go by its last holder without being unmarked first.
TEST(PrefixCache, ThePoolCountsIdleCachedPages) {
  kv::PagePool pool(4);
  const int32_t p = pool.alloc();
  pool.retain(p);  // a sequence and the cache
  pool.set_cached(p, true);
  EXPECT_EQ(pool.idle_cached(), 0);
  pool.release(p);  // the sequence ends
  EXPECT_EQ(pool.idle_cached(), 1);
  pool.retain(p);  // another adopts it
  EXPECT_EQ(pool.idle_cached(), 0);
  pool.release(p);
  EXPECT_EQ(pool.idle_cached(), 1);
  EXPECT_THROW(pool.release(p), Error);  // still marked
  EXPECT_EQ(pool.refs(p), 1);
  pool.set_cached(p, false);
  EXPECT_EQ(pool.idle_cached(), 0);
  pool.release(p);
  EXPECT_EQ(pool.used_pages(), 0);
}
