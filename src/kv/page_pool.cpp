#include "kv/page_pool.hpp"

#include <algorithm>

#include "core/error.hpp"
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

BlockTable::BlockTable(PagePool& pool, int page_tokens) : pool_(&pool), page_tokens_(page_tokens) {
  KVQ_CHECK(page_tokens > 0, Errc::invalid_argument, "page size must be positive, not ", page_tokens);
}

BlockTable::BlockTable(BlockTable&& o) noexcept
    : pool_(o.pool_), page_tokens_(o.page_tokens_), pages_(std::move(o.pages_)) {
  o.pages_.clear();
}

BlockTable& BlockTable::operator=(BlockTable&& o) noexcept {
  if (this != &o) {
    clear();
    pool_ = o.pool_;
    page_tokens_ = o.page_tokens_;
    pages_ = std::move(o.pages_);
    o.pages_.clear();
  }
  return *this;
}

BlockTable::~BlockTable() { clear(); }

void BlockTable::reserve(int tokens) {
  const size_t want = size_t(pages_for(std::max(tokens, 0), page_tokens_));
  const size_t had = pages_.size();
  try {
    while (pages_.size() < want) pages_.push_back(pool_->alloc());
  } catch (...) {
    while (pages_.size() > had) {
      pool_->release(pages_.back());
      pages_.pop_back();
    }
    throw;
  }
}

void BlockTable::shrink(int tokens) {
  const size_t keep = size_t(pages_for(std::max(tokens, 0), page_tokens_));
  while (pages_.size() > keep) {
    pool_->release(pages_.back());
    pages_.pop_back();
  }
}

void BlockTable::clear() {
  if (!pool_) return;
  for (auto it = pages_.rbegin(); it != pages_.rend(); ++it) pool_->release(*it);
  pages_.clear();
}

void BlockTable::share_prefix(const BlockTable& other, int tokens) {
  KVQ_CHECK(pages_.empty(), Errc::internal, "share_prefix into a block table that holds pages");
  KVQ_CHECK(other.pool_ == pool_ && other.page_tokens_ == page_tokens_, Errc::internal,
            "share_prefix across pools");
  const size_t n = size_t(pages_for(tokens, page_tokens_));
  KVQ_CHECK(n <= other.pages_.size(), Errc::internal, "share_prefix of ", tokens, " tokens from a table of ",
            other.capacity());
  for (size_t i = 0; i < n; ++i) {
    pool_->retain(other.pages_[i]);
    pages_.push_back(other.pages_[i]);
  }
}

void BlockTable::replace(size_t index, int32_t page) {
  KVQ_CHECK(index < pages_.size(), Errc::internal, "replace of page ", index, " in a table of ", pages_.size());
  pool_->retain(page);
  pool_->release(pages_[index]);
  pages_[index] = page;
}

void BlockTable::adopt(const std::vector<int32_t>& pages) {
  for (int32_t p : pages) {
    pool_->retain(p);
    pages_.push_back(p);
  }
}

}  // namespace kvq::kv
