// Host-side bookkeeping of a paged KV store (kv/page.hpp): which pages are
// free, who holds each, and each sequence's pages in token order. No device
// code and no KV bytes here: a store (kv::Cache) holds the rows, this decides
// where they go.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvq::kv {

// A free list with reference counts over pages 0..n_pages-1. A page shared by
// several sequences (a common prompt prefix) is free again when its last
// holder releases it.
class PagePool {
 public:
  explicit PagePool(int n_pages);

  int n_pages() const { return int(refs_.size()); }
  int free_pages() const { return int(free_.size()); }
  int used_pages() const { return n_pages() - free_pages(); }
  int refs(int page) const;

  // A free page with one reference; Errc::out_of_range when none is free.
  int32_t alloc();
  // One more holder of an allocated page.
  void retain(int32_t page);
  // One holder less; the page is free when none is left. Releasing a free
  // page is an Errc::internal error (a double free), never silent.
  void release(int32_t page);

  // Marks an allocated page as one a cache holds (engine/prefix_cache.hpp),
  // so that the pool can count, as references come and go, the pages only
  // such a holder keeps (idle_cached()), without anyone walking the pages.
  void set_cached(int32_t page, bool cached);
  // Pages marked cached whose one reference is the cache's.
  int idle_cached() const { return idle_cached_; }

 private:
  std::vector<int32_t> free_;  // a stack: the lowest pages are handed out first
  std::vector<int32_t> refs_;
  std::vector<uint8_t> cached_;  // set_cached
  int idle_cached_ = 0;
};

// A sequence's pages in token order: token t lives in page pages()[t / page_tokens].
class BlockTable {
 public:
  BlockTable(PagePool& pool, int page_tokens);
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;
  BlockTable(BlockTable&& o) noexcept;
  BlockTable& operator=(BlockTable&& o) noexcept;
  ~BlockTable();

  // Makes room for `tokens` tokens, taking pages from the pool. When the
  // pool runs out this throws Errc::out_of_range naming the pool size and
  // leaves the table as it was (pages taken by this call are given back).
  void reserve(int tokens);
  // Gives back the pages past the first `tokens` tokens.
  void shrink(int tokens);
  // Gives back every page.
  void clear();
  // Shares the first `tokens` tokens' pages of `other` (same pool): this
  // table must be empty. A partly filled last page is shared too; the caller
  // must not write into a page it shares (copy-on-write is the prefix
  // cache's job).
  void share_prefix(const BlockTable& other, int tokens);
  // Appends pages that others hold (a cached prefix), one more reference
  // each; the caller must not write into them.
  void adopt(const std::vector<int32_t>& pages);
  // Puts `page` (one more reference) where the index-th page was, and gives
  // that one back: a full page swapped for another holding the same rows.
  void replace(size_t index, int32_t page);

  const std::vector<int32_t>& pages() const { return pages_; }
  int page_tokens() const { return page_tokens_; }
  int capacity() const { return int(pages_.size()) * page_tokens_; }
  int32_t slot(int t) const { return pages_[size_t(t / page_tokens_)] * page_tokens_ + t % page_tokens_; }

 private:
  PagePool* pool_;
  int page_tokens_;
  std::vector<int32_t> pages_;
};

}  // namespace kvq::kv
