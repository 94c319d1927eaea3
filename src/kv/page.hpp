// Where a KV row lives: the one row-addressing function of every store and
// kernel (docs/architecture.md, "The step batch").
//
// A store holds pages of page_tokens rows per (layer, KV head, side). Within
// a layer and side the rows are laid out page-major, then head, then entry:
//   row(page, head, entry) = (page * n_kv_heads + head) * page_tokens + entry
// so one page of one head is page_tokens consecutive rows (a 16-key tile
// never straddles a page when page_tokens is a multiple of 16). A token's
// place in the pool is its slot, page * page_tokens + entry; a sequence's
// block table maps its token index t to page table[t / page_tokens].
//
// A store with a single page of capacity rows (page_tokens = capacity) is
// the contiguous [head][token] layout: row(0, head, t) = head * capacity + t.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define KVQ_PAGE_HD __host__ __device__ __forceinline__
#else
#define KVQ_PAGE_HD inline
#endif

namespace kvq::kv {

// Rows per page unless a store says otherwise.
constexpr int kDefaultPageTokens = 64;

struct PageGeometry {
  int n_kv_heads = 0;
  int page_tokens = 0;

  KVQ_PAGE_HD size_t row(int page, int head, int entry) const {
    return (size_t(page) * n_kv_heads + head) * page_tokens + entry;
  }
  // The row of a slot (page * page_tokens + entry) for one head.
  KVQ_PAGE_HD size_t slot_row(int32_t slot, int head) const {
    return row(slot / page_tokens, head, slot % page_tokens);
  }
  // The slot of token t of a sequence whose block table is `pages`.
  KVQ_PAGE_HD int32_t slot_of(const int32_t* pages, int t) const {
    return pages[t / page_tokens] * page_tokens + t % page_tokens;
  }
  // The row of token t of such a sequence, for one head.
  KVQ_PAGE_HD size_t token_row(const int32_t* pages, int t, int head) const {
    return row(pages[t / page_tokens], head, t % page_tokens);
  }
  KVQ_PAGE_HD size_t rows_per_page() const { return size_t(n_kv_heads) * page_tokens; }
};

// Pages needed for n tokens.
KVQ_PAGE_HD int pages_for(int tokens, int page_tokens) { return (tokens + page_tokens - 1) / page_tokens; }

}  // namespace kvq::kv
