// KV cache interface used by the forward pass. The codec table (kv/codec_table.hpp)
// defines every storage format; this header is all the model code needs.
//
// A Cache is the paged store of one codec (docs/architecture.md, "The step
// batch"): n_pages pages of page_tokens rows per (layer, KV head, side), a
// row found through kv::PageGeometry (kv/page.hpp) and nowhere else. Which
// pages a sequence uses is its block table (kv/page_pool.hpp), held by the
// caller; a store knows nothing of sequences.
//
// Contract (CPU stores):
//  - Rows are stored in the codec's packed format; nothing else (no fp32/bf16
//    mirror) is kept for a quantized codec.
//  - write_slots() encodes n tokens' rows at their slots. k and v are fp32,
//    laid out [n][n_kv_heads][head_dim]; K is post-RoPE (and post k-norm).
//  - attend_runs() is causal grouped-query attention for runs of query
//    tokens, one run per sequence: query i of a run sits at position
//    pos + i and sees its sequence's tokens [0, pos + i] (found through the
//    run's block table). q: [rows][n_heads][head_dim] fp32 (post-RoPE),
//    out: the same shape. It reads the packed store directly (rotate q once,
//    accumulate in the rotated basis, un-rotate the output once): the
//    algorithm the GPU runs. Attending a row that was never written is an
//    error, not a read of stale bytes.
//  - write(pos, n) / attend(pos, n) are the one-sequence forms over the
//    identity block table (token t in page t / page_tokens): a Session's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kv/page.hpp"

namespace kvq::kv {

struct CacheShape {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int max_tokens = 0;  // tokens the store holds in all (one sequence's context, or a pool's)
  int n_heads = 0;     // query heads (0: unknown; GPU kernels are chosen per GQA group)
  // Rows per page. A backend may choose another (the CUDA store takes one
  // page of max_tokens rows when page_tokens >= max_tokens, and refuses
  // pages that are not a multiple of 16, its attention tile); shape() says.
  int page_tokens = kDefaultPageTokens;
  // The exact recent window (docs/architecture.md): each sequence's newest
  // window_pages pages (the partial tail page included) hold bf16 rows, taken
  // from a second pool of exact_pages pages; its older pages hold the codec's
  // rows. In block tables and slots the exact pages are pages n_pages() ..
  // total_pages() - 1 (one id space, two stores); a sequence's exact pages
  // are the last entries of its table. Such a store encodes the bf16 values
  // of K and V into its packed pages, whether written there or packed from
  // a window page (Cache::pack_pages): the same codes either way. 0 / 0: no
  // window.
  int window_pages = 0;
  int exact_pages = 0;

  int n_pages() const { return pages_for(max_tokens, page_tokens); }
  int total_pages() const { return n_pages() + exact_pages; }
  bool is_exact_page(int32_t page) const { return page >= n_pages(); }
  PageGeometry geometry() const { return {n_kv_heads, page_tokens}; }
};

// What the user asked for: a named codec (--kv), optionally per-side blocks
// (--ctk/--ctv override the named codec's sides) and QJL on rotor K sides.
struct CodecOptions {
  std::string kv = "none";
  std::string ctk;          // empty: from `kv`
  std::string ctv;          // empty: from `kv`
  bool rotor_qjl = false;
  uint64_t seed = 0x6b7671;  // rotation / sketch seed; per layer and head derived from it
  // The exact recent window (issue 28 item 1), evaluation form: a query at
  // position p reads tokens from 64 * max(0, p / 64 - W + 1) on as exact
  // bf16 rows (its newest W 64-token pages, what the window of
  // CacheShape::window_pages holds at decode time, applied to every query
  // of a prefill too) and older tokens from the codec. CPU store only, and
  // it keeps the bf16 rows of every token (no memory saved): it measures
  // quality (`kvq eval kl --kv-window`). The serving window is
  // CacheShape::window_pages / exact_pages. 0: off.
  int exact_window_pages = 0;
};

// The suffix a codec's name takes with an exact window: "+winW", or "" for none.
inline std::string exact_window_suffix(int window_pages) {
  return window_pages > 0 ? "+win" + std::to_string(window_pages) : std::string();
}

// Tokens of the exact window of a query at position pos (see above).
inline int exact_window_start(int pos, int window_pages) {
  const int page = pos / kDefaultPageTokens - window_pages + 1;
  return page > 0 ? page * kDefaultPageTokens : 0;
}

// The first block-table index of a sequence's exact window once it holds
// `tokens` tokens: pages before it hold the codec's rows, pages from it on
// (at most window_pages of them) bf16 rows. With a window of 0 pages: every
// page is packed.
inline int window_first_page(int tokens, int page_tokens, int window_pages) {
  const int pages = pages_for(tokens, page_tokens);
  return window_pages > 0 ? std::max(0, pages - window_pages) : pages;
}

// Bytes of one exact (window) page of a store of this shape: bf16 K and V
// rows of every layer and KV head.
inline uint64_t exact_page_bytes(const CacheShape& s) {
  return uint64_t(s.n_layers) * s.n_kv_heads * s.page_tokens * s.head_dim * 2 * 2;
}

// The query tokens of one sequence in a step: rows [first, first + n) of q
// and out, at positions pos .. pos + n - 1, over the sequence's pages.
struct QueryRun {
  const int32_t* pages = nullptr;  // block table: token t in page pages[t / page_tokens]
  int n_pages = 0;                 // entries of `pages` (at least pages_for(pos + n))
  int first = 0;
  int n = 0;
  int pos = 0;
};

class LayerCache {
 public:
  virtual ~LayerCache() = default;
  virtual void write_slots(const int32_t* slots, int n, const float* k, const float* v) = 0;
  virtual void attend_runs(const QueryRun* runs, int n_runs, const float* q, int n_heads, float scale,
                           float* out) const = 0;
  // One sequence over the identity block table (see the top of this file).
  virtual void write(int pos, int n, const float* k, const float* v);
  virtual void attend(int pos, int n, const float* q, int n_heads, float scale, float* out) const;
  // The stored bytes of one row (K side, or V side when v_side): code_bytes
  // into `code` and side_bytes into `side` (host memory), for tests that
  // check rows byte for byte. Stores that cannot read back say
  // Errc::unsupported.
  virtual void read_row(int32_t slot, int head, bool v_side, uint8_t* code, uint8_t* side) const;

 protected:
  virtual int store_page_tokens() const = 0;
};

class Cache {
 public:
  Cache();
  virtual ~Cache() = default;
  // Unique for the process's lifetime: a recorded decode step remembers the
  // cache it was made over by this, never by address (a freed cache's address
  // can come back for a new one).
  uint64_t id() const { return id_; }
  virtual const CacheShape& shape() const = 0;
  virtual std::string codec_name() const = 0;  // canonical name, e.g. "k8v4" or "ctk=q8,ctv=turbo3"
  virtual LayerCache& layer(int i) = 0;
  // Bytes resident in the packed store for n_tokens tokens (codes plus every
  // scale, norm and index), all layers, K and V.
  virtual uint64_t bytes_for_tokens(int n_tokens) const = 0;
  // Copies every layer's rows of page src[i] (K and V: codes, side data and
  // whatever else the store keeps per row) into page dst[i], for i < n (host
  // arrays; pages of this store, dst pages distinct and none of them a src
  // page). A sequence gets another's KV this way without a prefill (kvq
  // bench's capacity mode fills its pool so). A page number outside the
  // store is Errc::out_of_range; stores that cannot copy say
  // Errc::unsupported.
  virtual void copy_pages(const int32_t* src, const int32_t* dst, int n);
  // Moves a window's oldest pages into the codec's store: encodes every
  // layer's bf16 rows of exact page exact[i] into packed page packed[i], for
  // i < n (page ids as in a block table: exact ones >= shape().n_pages()).
  // The packed rows equal those write_slots would make from the bf16 values;
  // rows of the exact page never written stay unwritten in the packed one.
  // The exact pages are left unwritten (their pool may hand them out again).
  // Stores without a window say Errc::unsupported.
  virtual void pack_pages(const int32_t* exact, const int32_t* packed, int n);
  // Bytes of one exact page, all layers, K and V (bf16 rows).
  uint64_t exact_page_bytes() const { return kv::exact_page_bytes(shape()); }
  // Bytes of every page the store holds: packed pages and exact ones.
  uint64_t capacity_bytes() const;
  // Bytes a sequence of n_tokens tokens holds: its packed pages' rows
  // (bytes_for_tokens of the tokens before its window) plus whole exact
  // pages for its window.
  uint64_t bytes_for_sequence(int n_tokens) const;

 private:
  uint64_t id_;
};

// The identity block table of a one-sequence store: pages 0 .. n_pages-1.
std::vector<int32_t> identity_pages(int n_pages);

// The checks every Cache::copy_pages makes before copying anything: pages in
// [0, n_pages), no destination twice, no destination that is also a source
// (so the copies may run in any order).
void check_page_copy(const int32_t* src, const int32_t* dst, int n, int n_pages);

// Throws kvq::Error (invalid_argument) for an unknown codec or block name,
// listing the valid ones.
std::unique_ptr<Cache> make_cpu_cache(const CodecOptions& opts, const CacheShape& shape);

}  // namespace kvq::kv
