// The GPU KV store: one packed store per layer, in the codec's own format
// (kv/codec_table.hpp, CodecDescriptor), resident in device memory for the
// cache's whole capacity. Kernels read and write it only through the codec
// hooks (kv_codec_hooks.cuh); nothing keeps a bf16 copy beside it.
//
// Per layer and side (K, V), two arrays of rows, paged (kv/page.hpp):
//   code [n_pages][n_kv_heads][page_tokens][code_bytes]
//   side [n_pages][n_kv_heads][page_tokens][side_bytes]   (absent when side_bytes == 0)
// so row r = PageGeometry::row(page, head, entry) is at code + r * code_bytes
// and side + r * side_bytes. A sequence's token t is in page table[t /
// page_tokens] of its block table (SeqRows); a one-sequence store over the
// identity table passes none. One page of max_tokens rows (page_tokens =
// max_tokens) is the contiguous [head][token] layout.
// Kernels find a row only through SeqRows / PageGeometry. The decode kernel
// resolves a 16-key tile's first row once (page_tokens is a multiple of 16,
// or the store is one page: a tile never straddles a page) and its hooks
// address the tile's keys from there.
// `none` is the bf16 block: code rows are the D bf16 values, no side array.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kv/family.hpp"
#include "kv/page.hpp"

#ifdef __CUDACC__
#define KVQ_STORE_HD __host__ __device__ __forceinline__
#else
#define KVQ_STORE_HD inline
#endif

namespace kvq::cuda {

// How a family's rows are rotated (kv/rotation.hpp): the GPU applies the same
// maps from the tables the CPU blocks export (kv::BlockTables::rotation).
enum class RotationKind : uint8_t { identity, hadamard, isoclinic, rotor, givens };

// One side (K or V) of one layer.
struct GpuKvSide {
  kv::Family family = kv::Family::bf16;
  int bits = 16;
  uint8_t* code = nullptr;
  uint8_t* side = nullptr;
  uint32_t code_bytes = 0;  // per row
  uint32_t side_bytes = 0;  // per row
  // Rotated families: this layer's rotation tables, [n_kv_heads][rot_stride]
  // floats in kv::Rotation::table() format (hadamard: D signs; isoclinic: per
  // 4-block a0..a3 b0..b3; rotor: per 3-block a row-major 3x3 matrix, then
  // cos, sin of a 2-tail; givens: per pair cos, sin); null for unrotated
  // blocks. Rows are stored in the rotated basis; attention rotates q and
  // un-rotates o once per step.
  const float* rot = nullptr;
  uint32_t rot_stride = 0;
  // Codebook families (turbo, iso, rotor, planar): 2^bits Lloyd-Max centroids
  // (ascending) then their 2^bits - 1 thresholds; tcq: the 2^(bits+1) union
  // levels (index 4 m + subset). Null otherwise.
  const float* codebook = nullptr;
  uint32_t tcq_g0 = 0, tcq_g1 = 0;  // tcq: subset generators over the 6-bit branch window
  // +qjl (K sides): the sketch matrices S, [n_kv_heads][D][D] row-major, and
  // where the sketch bits and the residual norm start in a row.
  const float* qjl = nullptr;
  uint32_t qjl_code_offset = 0, qjl_side_offset = 0;
  bool has_qjl = false;

  // Byte offsets of row r (PageGeometry::row) in the code and side arrays.
  KVQ_STORE_HD size_t code_offset(size_t row) const { return row * code_bytes; }
  KVQ_STORE_HD size_t side_offset(size_t row) const { return row * side_bytes; }
  KVQ_STORE_HD const float* rot_of(int head) const { return rot ? rot + size_t(head) * rot_stride : nullptr; }
};

KVQ_STORE_HD constexpr RotationKind rotation_kind(kv::Family f) {
  return f == kv::Family::rq8 || f == kv::Family::turbo || f == kv::Family::tcq ? RotationKind::hadamard
         : f == kv::Family::iso                                                   ? RotationKind::isoclinic
         : f == kv::Family::rotor                                                 ? RotationKind::rotor
         : f == kv::Family::planar                                                ? RotationKind::givens
                                                                                  : RotationKind::identity;
}
// Families whose rows are stored in a rotated basis (attention rotates q and
// un-rotates o in the decode kernel; prefill un-rotates the prefix).
KVQ_STORE_HD constexpr bool is_rotated(kv::Family f) { return rotation_kind(f) != RotationKind::identity; }
// Floats per KV head of a rotation table (kv::Rotation::table()).
KVQ_STORE_HD constexpr int rotation_table_floats(RotationKind k, int D) {
  return k == RotationKind::hadamard    ? D
         : k == RotationKind::isoclinic ? (D / 4) * 8
         : k == RotationKind::rotor     ? (D / 3) * 9 + (D % 3 == 2 ? 2 : 0)
         : k == RotationKind::givens    ? (D / 2) * 2
                                        : 0;
}
// The family whose decode hooks read a family's rows: rq8 rows are q8 rows
// of the rotated vector, so rq8 runs the q8 kernel instances.
// iso, rotor and planar rows are the same format (N-bit codes, 32-dim group
// scales; only the rotation differs): they run the iso instances.
KVQ_STORE_HD constexpr kv::Family storage_family(kv::Family f) {
  return f == kv::Family::rq8                                ? kv::Family::q8
         : f == kv::Family::rotor || f == kv::Family::planar ? kv::Family::iso
                                                             : f;
}

// One sequence's rows in a paged store: the store's geometry and the
// sequence's block table (device memory, token t in page pages[t /
// page_tokens]); pages == nullptr is the identity table (page t / page_tokens).
// Token t's place in its table, t / page_tokens, is a shift where the store
// allows one (page_shift, set by the constructor): the decode kernel finds a
// row per 16-key tile, and a runtime integer division there was among its
// hottest instructions (docs/perf.md, session 16). The row itself is always
// kv::PageGeometry::row.
struct SeqRows {
  kv::PageGeometry geo;
  const int32_t* pages = nullptr;
  // t >> page_shift is token t's index in its block table for every token the
  // store holds (0 <= t < its capacity): log2(page_tokens) when page_tokens is
  // a power of two (64 by default), 31 for a store of one page (every token is
  // in page 0), else -1 (a division).
  int page_shift = -1;

  SeqRows() = default;
  KVQ_STORE_HD SeqRows(const kv::PageGeometry& g, const int32_t* table, bool one_page = false)
      : geo(g), pages(table), page_shift(shift_for(g.page_tokens, one_page)) {}
  KVQ_STORE_HD static int shift_for(int page_tokens, bool one_page) {
    if (page_tokens > 0 && (page_tokens & (page_tokens - 1)) == 0) {
      int s = 0;
      while ((1 << s) < page_tokens) ++s;
      return s;
    }
    return one_page ? 31 : -1;
  }
  // Token t's index in its block table (t >= 0).
  KVQ_STORE_HD int index_of(int t) const { return page_shift >= 0 ? t >> page_shift : t / geo.page_tokens; }
  KVQ_STORE_HD int page_of(int t) const {
    const int i = index_of(t);
    return pages ? pages[i] : i;
  }
  // The row of token t of KV head `head`.
  KVQ_STORE_HD size_t row(int head, int t) const {
    const int i = index_of(t);
    return geo.row(pages ? pages[i] : i, head, t - i * geo.page_tokens);
  }
};

// Where one row of a store with an exact window lives: its packed row, or
// (a window page) its row in the exact bf16 sides.
struct StoreRow {
  bool exact;
  size_t row;
};

struct GpuKvLayer {
  GpuKvSide k, v;
  int n_kv_heads = 0;
  int head_dim = 0;
  int max_tokens = 0;  // tokens of one sequence over the identity table (the cache's shape)
  int page_tokens = 0;  // rows per page (kv::PageGeometry); max_tokens: one page
  int n_pages = 0;      // pages of the store: n_pages * n_kv_heads * page_tokens rows per side
  // The exact recent window (kv::CacheShape::window_pages, docs/architecture.md):
  // n_exact_pages pages of bf16 rows (xk, xv: family bf16, code_bytes 2 D, no
  // side array), [n_exact_pages][n_kv_heads][page_tokens] rows per side, named
  // n_pages .. n_pages + n_exact_pages - 1 in block tables and slots (one id
  // space). A sequence's exact pages are the last (at most window_pages)
  // entries of its table. Such a store encodes the bf16 values of K and V
  // into its packed pages (a row's codes do not depend on whether it was
  // written there or packed when its page left a window). 0: no window.
  GpuKvSide xk, xv;
  int n_exact_pages = 0;
  int window_pages = 0;
  bool is_bf16() const { return k.family == kv::Family::bf16 && v.family == kv::Family::bf16; }
  KVQ_STORE_HD bool has_window() const { return n_exact_pages > 0; }
  KVQ_STORE_HD kv::PageGeometry geometry() const { return {n_kv_heads, page_tokens}; }
  KVQ_STORE_HD SeqRows rows(const int32_t* pages = nullptr) const {
    return SeqRows(geometry(), pages, n_pages == 1 && n_exact_pages == 0);
  }
  // Tokens a store holds in all (n_pages pages, and its exact pages): the most one sequence's table can name.
  KVQ_STORE_HD int capacity() const { return (n_pages + n_exact_pages) * page_tokens; }
  // The row of slot `slot` (page * page_tokens + entry, exact pages included) of KV head `head`.
  KVQ_STORE_HD StoreRow slot_row(int32_t slot, int head) const {
    const int page = slot / page_tokens, entry = slot - page * page_tokens;
    if (page >= n_pages) return {true, geometry().row(page - n_pages, head, entry)};
    return {false, geometry().row(page, head, entry)};
  }
  // The row of a sequence's token t of KV head `head` (rows: its table).
  KVQ_STORE_HD StoreRow token_row(const SeqRows& rows, int head, int t) const {
    const int i = rows.index_of(t);
    const int page = rows.pages ? rows.pages[i] : i, entry = t - i * page_tokens;
    if (page >= n_pages) return {true, geometry().row(page - n_pages, head, entry)};
    return {false, geometry().row(page, head, entry)};
  }
};

}  // namespace kvq::cuda
