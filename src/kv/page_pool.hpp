// Host-side bookkeeping of a paged KV store (kv/page.hpp): which pages are
// free, who holds each, and each sequence's pages in token order. No device
// code and no KV bytes here: a store (kv::Cache) holds the rows, this decides
// where they go.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvq::kv {

class Cache;

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

// An exact page leaving a sequence's window (kv/cache.hpp, CacheShape::
// window_pages): its rows go into the packed page that took its place in the
// table (Cache::pack_pages) before anything writes an exact page again.
struct PageMove {
  int32_t exact;   // the exact page (its id in the table: the exact pool's page + exact_base)
  int32_t packed;  // the packed page now in its place
};

// Packs the moves of a step's reservations into `store` (Cache::pack_pages,
// one call for all of them) and empties the list; nothing when it is empty.
void pack_moved_pages(Cache& store, std::vector<PageMove>& moves);

// A sequence's pages in token order: token t lives in page pages()[t / page_tokens].
//
// With an exact window of W pages the table's last entries (at most W, from
// window_first_page(tokens) on) are pages of a second pool, named
// exact_base + page (the store's id space: exact pages follow the packed
// ones), and the entries before them packed pages. reserve() keeps it so:
// new entries past the window are packed pages (a long prompt's older pages
// are written straight into the codec's store), and exact entries that the
// growing window leaves behind are swapped for fresh packed pages, returned
// as PageMoves for the caller to pack.
class BlockTable {
 public:
  BlockTable(PagePool& pool, int page_tokens);
  BlockTable(PagePool& pool, int page_tokens, PagePool& exact_pool, int32_t exact_base, int window_pages);
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;
  BlockTable(BlockTable&& o) noexcept;
  BlockTable& operator=(BlockTable&& o) noexcept;
  ~BlockTable();

  // Makes room for `tokens` tokens, taking pages from the pool. When the
  // pool runs out this throws Errc::out_of_range naming the pool size and
  // leaves the table as it was (pages taken by this call are given back).
  // With a window, the exact pages that leave it are appended to `moves`
  // (required then): the table names their packed pages already and has
  // given the exact pages back to their pool (a page crossing takes the
  // page it frees), so the caller must pack them (Cache::pack_pages) before
  // anything writes an exact page or attends the packed ones: reserve every
  // sequence of a step, pack, then run the step.
  void reserve(int tokens, std::vector<PageMove>* moves = nullptr);
  // Pages of the (packed) pool that reserve(tokens) would take: new pages
  // before the window and one per page leaving it.
  int packed_pages_needed(int tokens) const;
  // Gives back the pages past the first `tokens` tokens.
  void shrink(int tokens);
  // Gives back every page.
  void clear();
  // Shares the first `tokens` tokens' pages of `other` (same pool): this
  // table must be empty. A partly filled last page is shared too; the caller
  // must not write into a page it shares (copy-on-write is the prefix
  // cache's job). Exact (window) pages are never shared: they are private to
  // their sequence.
  void share_prefix(const BlockTable& other, int tokens);
  // Takes pages for the first `tokens` tokens as `other` holds them: a packed
  // page where other has one, an exact page where other has one (same pools;
  // this table must be empty), so that Cache::copy_pages can copy other's
  // rows page by page. Throws like reserve() and then keeps nothing.
  void reserve_like(const BlockTable& other, int tokens);
  // Appends pages that others hold (a cached prefix), one more reference
  // each; the caller must not write into them.
  void adopt(const std::vector<int32_t>& pages);
  // Puts `page` (one more reference) where the index-th page was, and gives
  // that one back: a full page swapped for another holding the same rows.
  void replace(size_t index, int32_t page);

  const std::vector<int32_t>& pages() const { return pages_; }
  int page_tokens() const { return page_tokens_; }
  int window_pages() const { return window_pages_; }
  // The index of the first exact entry (pages().size() when there is none).
  int exact_from() const { return exact_from_; }
  bool is_exact(int32_t page) const { return exact_pool_ && page >= exact_base_; }
  int capacity() const { return int(pages_.size()) * page_tokens_; }
  int32_t slot(int t) const { return pages_[size_t(t / page_tokens_)] * page_tokens_ + t % page_tokens_; }

 private:
  void give_back(int32_t page);
  // What reserve(tokens) changes.
  struct Growth {
    int want = 0, had = 0;
    int first = 0;      // entries before it packed once the tokens are held
    int leaving = 0;    // exact entries that become packed
    int new_packed = 0, new_exact = 0;  // new entries of each kind
  };
  Growth growth(int tokens) const;

  PagePool* pool_;
  int page_tokens_;
  std::vector<int32_t> pages_;
  PagePool* exact_pool_ = nullptr;  // the window's pool (null: no window)
  int32_t exact_base_ = 0;
  int window_pages_ = 0;
  int exact_from_ = 0;
};

}  // namespace kvq::kv
