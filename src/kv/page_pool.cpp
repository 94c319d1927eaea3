#include "kv/page_pool.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "kv/cache.hpp"
#include "kv/page.hpp"

namespace kvq::kv {

PagePool::PagePool(int n_pages) {
  KVQ_CHECK(n_pages > 0, Errc::invalid_argument, "a KV page pool needs at least one page, not ", n_pages);
  refs_.assign(size_t(n_pages), 0);
  cached_.assign(size_t(n_pages), 0);
  free_.reserve(size_t(n_pages));
  for (int p = n_pages - 1; p >= 0; --p) free_.push_back(p);
}

int PagePool::refs(int page) const {
  KVQ_CHECK(page >= 0 && page < n_pages(), Errc::internal, "KV page ", page, " is outside the pool of ", n_pages());
  return refs_[size_t(page)];
}

int32_t PagePool::alloc() {
  KVQ_CHECK(!free_.empty(), Errc::out_of_range, "the KV pool is full: all ", n_pages(),
            " pages are in use (fewer or shorter sequences, a smaller codec, or a larger pool)");
  const int32_t p = free_.back();
  free_.pop_back();
  refs_[size_t(p)] = 1;
  return p;
}

void PagePool::retain(int32_t page) {
  KVQ_CHECK(refs(page) > 0, Errc::internal, "retain of free KV page ", page);
  if (cached_[size_t(page)] && refs_[size_t(page)] == 1) --idle_cached_;
  ++refs_[size_t(page)];
}

void PagePool::release(int32_t page) {
  KVQ_CHECK(refs(page) > 0, Errc::internal, "release of free KV page ", page, " (double free)");
  KVQ_CHECK(!cached_[size_t(page)] || refs_[size_t(page)] > 1, Errc::internal, "KV page ", page,
            " released by its last holder while marked cached");
  if (--refs_[size_t(page)] == 0) free_.push_back(page);
  if (cached_[size_t(page)] && refs_[size_t(page)] == 1) ++idle_cached_;
}

void PagePool::set_cached(int32_t page, bool cached) {
  KVQ_CHECK(refs(page) > 0, Errc::internal, "cache mark on free KV page ", page);
  if (bool(cached_[size_t(page)]) == cached) return;
  cached_[size_t(page)] = cached;
  if (refs_[size_t(page)] == 1) idle_cached_ += cached ? 1 : -1;
}

void pack_moved_pages(Cache& store, std::vector<PageMove>& moves) {
  if (moves.empty()) return;
  std::vector<int32_t> exact, packed;
  for (const PageMove& m : moves) {
    exact.push_back(m.exact);
    packed.push_back(m.packed);
  }
  moves.clear();
  store.pack_pages(exact.data(), packed.data(), int(exact.size()));
}

BlockTable::BlockTable(PagePool& pool, int page_tokens) : pool_(&pool), page_tokens_(page_tokens) {
  KVQ_CHECK(page_tokens > 0, Errc::invalid_argument, "page size must be positive, not ", page_tokens);
}

BlockTable::BlockTable(PagePool& pool, int page_tokens, PagePool& exact_pool, int32_t exact_base, int window_pages)
    : BlockTable(pool, page_tokens) {
  KVQ_CHECK(window_pages > 0 && exact_base >= pool.n_pages(), Errc::invalid_argument, "an exact window of ",
            window_pages, " pages named from ", exact_base, " over a pool of ", pool.n_pages(),
            " pages (needs >= 1 page, named past the pool)");
  exact_pool_ = &exact_pool;
  exact_base_ = exact_base;
  window_pages_ = window_pages;
}

BlockTable::BlockTable(BlockTable&& o) noexcept
    : pool_(o.pool_),
      page_tokens_(o.page_tokens_),
      pages_(std::move(o.pages_)),
      exact_pool_(o.exact_pool_),
      exact_base_(o.exact_base_),
      window_pages_(o.window_pages_),
      exact_from_(o.exact_from_) {
  o.pages_.clear();
  o.exact_from_ = 0;
}

BlockTable& BlockTable::operator=(BlockTable&& o) noexcept {
  if (this != &o) {
    clear();
    pool_ = o.pool_;
    page_tokens_ = o.page_tokens_;
    pages_ = std::move(o.pages_);
    exact_pool_ = o.exact_pool_;
    exact_base_ = o.exact_base_;
    window_pages_ = o.window_pages_;
    exact_from_ = o.exact_from_;
    o.pages_.clear();
    o.exact_from_ = 0;
  }
  return *this;
}

BlockTable::~BlockTable() { clear(); }

void BlockTable::give_back(int32_t page) {
  if (is_exact(page)) exact_pool_->release(page - exact_base_);
  else pool_->release(page);
}

BlockTable::Growth BlockTable::growth(int tokens) const {
  Growth g;
  g.want = pages_for(std::max(tokens, 0), page_tokens_);
  g.had = int(pages_.size());
  g.first = exact_pool_ ? window_first_page(std::max(tokens, 0), page_tokens_, window_pages_) : g.want;
  g.leaving = std::max(0, std::min(g.first, g.had) - exact_from_);
  g.new_packed = std::max(0, std::min(g.want, g.first) - std::min(g.had, g.first));
  g.new_exact = std::max(0, g.want - std::max(g.had, g.first));
  return g;
}

int BlockTable::packed_pages_needed(int tokens) const {
  const Growth g = growth(tokens);
  return g.leaving + g.new_packed;
}

void BlockTable::reserve(int tokens, std::vector<PageMove>* moves) {
  const Growth g = growth(tokens);
  const int want = g.want, had = g.had, first = g.first, leaving = g.leaving, new_exact = g.new_exact;
  if (want <= had && leaving == 0) return;
  KVQ_CHECK(leaving == 0 || moves, Errc::internal, "a windowed block table grew without a list for its moves");
  // The pages leaving the window go back before the new ones are taken (their
  // rows are packed before anything writes an exact page again), so a step
  // that crosses a page needs no exact page more than the window holds.
  KVQ_CHECK(new_exact <= (exact_pool_ ? exact_pool_->free_pages() : 0) + leaving, Errc::out_of_range,
            "the KV window pool is full: all ", exact_pool_ ? exact_pool_->n_pages() : 0,
            " exact pages are in use (fewer sequences, a shorter --kv-window, or a larger pool)");
  std::vector<int32_t> packed;  // taken by this call, in the order they are placed
  try {
    for (int i = 0; i < leaving + g.new_packed; ++i) packed.push_back(pool_->alloc());
  } catch (...) {
    for (int32_t p : packed) pool_->release(p);
    throw;
  }
  size_t next = 0;
  for (int i = 0; i < leaving; ++i) {
    int32_t& entry = pages_[size_t(exact_from_ + i)];
    moves->push_back({entry, packed[next]});
    exact_pool_->release(entry - exact_base_);
    entry = packed[next++];
  }
  for (int i = had; i < want; ++i) pages_.push_back(i < first ? packed[next++] : exact_base_ + exact_pool_->alloc());
  // The exact entries are a suffix: the first of them is where the packed ones end.
  exact_from_ += leaving;
  while (exact_from_ < int(pages_.size()) && !is_exact(pages_[size_t(exact_from_)])) ++exact_from_;
}

void BlockTable::reserve_like(const BlockTable& other, int tokens) {
  KVQ_CHECK(pages_.empty(), Errc::internal, "reserve_like into a block table that holds pages");
  KVQ_CHECK(other.pool_ == pool_ && other.exact_pool_ == exact_pool_ && other.page_tokens_ == page_tokens_,
            Errc::internal, "reserve_like across pools");
  const size_t n = size_t(pages_for(std::max(tokens, 0), page_tokens_));
  KVQ_CHECK(n <= other.pages_.size(), Errc::internal, "reserve_like of ", tokens, " tokens from a table of ",
            other.capacity());
  try {
    for (size_t i = 0; i < n; ++i)
      pages_.push_back(other.is_exact(other.pages_[i]) ? exact_base_ + exact_pool_->alloc() : pool_->alloc());
  } catch (...) {
    clear();
    throw;
  }
  exact_from_ = std::min(other.exact_from_, int(n));
}

void BlockTable::shrink(int tokens) {
  const size_t keep = size_t(pages_for(std::max(tokens, 0), page_tokens_));
  while (pages_.size() > keep) {
    give_back(pages_.back());
    pages_.pop_back();
  }
  exact_from_ = std::min(exact_from_, int(pages_.size()));
}

void BlockTable::clear() {
  if (!pool_) return;
  for (auto it = pages_.rbegin(); it != pages_.rend(); ++it) give_back(*it);
  pages_.clear();
  exact_from_ = 0;
}

void BlockTable::share_prefix(const BlockTable& other, int tokens) {
  KVQ_CHECK(pages_.empty(), Errc::internal, "share_prefix into a block table that holds pages");
  KVQ_CHECK(other.pool_ == pool_ && other.page_tokens_ == page_tokens_, Errc::internal,
            "share_prefix across pools");
  const size_t n = size_t(pages_for(tokens, page_tokens_));
  KVQ_CHECK(n <= other.pages_.size(), Errc::internal, "share_prefix of ", tokens, " tokens from a table of ",
            other.capacity());
  for (size_t i = 0; i < n; ++i)
    KVQ_CHECK(!other.is_exact(other.pages_[i]), Errc::internal, "share_prefix of an exact (window) page");
  for (size_t i = 0; i < n; ++i) {
    pool_->retain(other.pages_[i]);
    pages_.push_back(other.pages_[i]);
  }
  exact_from_ = int(pages_.size());
}

void BlockTable::replace(size_t index, int32_t page) {
  KVQ_CHECK(index < pages_.size(), Errc::internal, "replace of page ", index, " in a table of ", pages_.size());
  KVQ_CHECK(!is_exact(pages_[index]) && !is_exact(page), Errc::internal, "replace of an exact (window) page");
  pool_->retain(page);
  pool_->release(pages_[index]);
  pages_[index] = page;
}

void BlockTable::adopt(const std::vector<int32_t>& pages) {
  KVQ_CHECK(exact_from_ == int(pages_.size()), Errc::internal, "adopt after exact (window) pages");
  for (int32_t p : pages) {
    pool_->retain(p);
    pages_.push_back(p);
  }
  exact_from_ = int(pages_.size());
}

}  // namespace kvq::kv
