// Tensor-core causal GQA prefill attention (FlashAttention-2 style) over the
// bf16 cache; API in attention_prefill.hpp. Two kernels: prefill_attn_kernel
// (mma.sync; described here) and, for head_dim 128 in sm_90a builds on a 9.0
// device, prefill_attn_wgmma_kernel (the same split with 128 rows and 8
// warps per CTA; THE HOPPER KERNEL below).
//
// WORK SPLIT
//   grid = (n_kv, query tiles, key chunks); block = 4 warps (128 threads).
//   A CTA owns 64 query ROWS of one KV head: row r = (token t0 + r / G, query
//   head kvh * G + r % G), Tq = floor(64 / G) tokens, so every K/V tile it
//   loads serves all G heads of the group. Rows r >= Tq * G (G not dividing
//   64) and rows of tokens >= n are padding: zero queries, never written.
//   Warp w owns rows 16w .. 16w+15 (one m16 MMA tile).
//   blockIdx.y runs over the query tiles in REVERSE (the last tokens, which
//   see the most keys, start first) so the long CTAs do not end up in a
//   final partial wave.
//   Keys [0, pos + t0 + nt) (nt valid tokens in the tile) are streamed in
//   tiles of kKeys (64; 32 for head_dim 256). With one key chunk (the usual
//   prefill case, many query tiles) the CTA writes normalised output. When
//   the query tiles alone cannot fill the GPU (small n, long context) the
//   keys are split into chunks (multiples of kKeys); each CTA writes its
//   partial (m, l, o) state and merge_kernel combines them.
//
// PER TILE (per warp; D = head_dim, K = kKeys)
//   S[16][K]  = Q[16][D] . K_tile^T     mma m16n8k16: A = Q, B = K rows
//   causal mask (only on tiles with keys past the CTA's first row limit)
//   m' = max(m, rowmax S); P = exp2(S - m'); l = l exp2(m - m') + rowsum P
//   O[16][D]  = O exp2(m - m') + bf16(P)[16][K] . V_tile[K][D]
//   Q is pre-multiplied by scale * log2 e before its bf16 rounding, so S is
//   in log2 units and softmax is ex2.approx (one MUFU op per score).
//   Tiles are visited in increasing key order: the first one holds key 0,
//   which every row sees, so a row's max is finite from then on (with key
//   chunks a row may see nothing: m stays -inf, exp2 uses 0 instead).
//   A warp skips the compute (not the barriers) of a tile none of its valid
//   rows can see.
//
// MMA FRAGMENTS (PTX ISA, mma.m16n8k16 .bf16; lane = 4 * gid + tig)
//   A 16x16 (row-major): a0 = (gid, 2tig..+1), a1 = (gid+8, 2tig..+1),
//                        a2 = (gid, 2tig+8..+9), a3 = (gid+8, 2tig+8..+9)
//   B 16x8  (k x n):     b0 = (k 2tig..+1, n gid), b1 = (k 2tig+8..+9, n gid)
//   C 16x8  fp32:        c0,c1 = (gid, 2tig..+1), c2,c3 = (gid+8, 2tig..+1)
//   Each thread thus holds two rows of S and O: gid ("lo") and gid+8 ("hi");
//   row max / sum reduce over the 4 lanes of a quad (shfl_xor 1, 2).
//   Registers per thread: S s[K/8][4], O o[D/8][4] fp32; Q qf[D/16][4]
//   (bf16x2) for D <= 128, else Q is re-read from shared memory per k-step.
//   P needs no shuffle: the C fragments of S n-blocks 2c and 2c+1 are exactly
//   the A fragment of P for keys 16c..16c+15 (a0 = s[2c][0..1], a1 =
//   s[2c][2..3], a2 = s[2c+1][0..1], a3 = s[2c+1][2..3]), packed to bf16x2.
//   ldmatrix.x4 (each lane addresses one 16-byte row of one of four 8x8
//   matrices; lanes 8i..8i+7 matrix i; register i of every lane = matrix i):
//     Q  A operand:  matrix i = rows +8*(i&1), columns +8*(i>>1)
//     K  B operand:  matrix i = keys +8*(i>>1), dims +8*(i&1)
//                    -> regs 0,1 = n-block 2j, regs 2,3 = n-block 2j+1
//     V  B operand (.trans, V rows are keys = the k dimension):
//                    matrix i = keys +8*(i&1), dims +8*(i>>1)
//                    -> regs 0,1 = d-block 2j, regs 2,3 = d-block 2j+1
//
// SHARED MEMORY (bf16; every tile row-major [row][D], D*2 bytes per row)
//   stage 0: K tile [K][D], V tile [K][D];  stage 1: the same
//   Q [64][D]: aliases stage 1 when Q lives in registers (D <= 128: it is
//   read once, before stage 1 is first written), else its own region.
//   D=64: 32 KiB, D=128: 64 KiB, D=256 (K=32): 96 KiB per CTA.
//   Swizzle: the 16-byte chunk c of row r is stored at chunk c ^ (r & 7).
//   ldmatrix reads one chunk column of 8 consecutive rows; rows are a
//   multiple of 128 bytes apart, so unswizzled they would hit the same 4
//   banks (8-way conflict); XOR with r & 7 spreads them over all 32 banks.
//   The cp.async writes (consecutive threads = consecutive chunks of a row)
//   stay conflict free.
//   Pipeline: double buffered with cp.async (16 bytes, .cg: K/V are streamed
//   from L2, not L1): tile i+1 loads while tile i computes; keys past the
//   CTA's range are zero-filled (src-size 0) and never read from memory, so
//   nothing past pos + n (possibly past the cache allocation) is touched.
#include "backend/cuda/attention_prefill.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "backend/cuda/ptx.cuh"
#include "backend/cuda/softmax_state.cuh"
#include "backend/cuda/wgmma.cuh"
#include "core/error.hpp"

namespace kvq::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kRows = 64;  // query rows per CTA (16 per warp)
constexpr int kMaxGroup = kRows;
constexpr int kMinTilesPerChunk = 4;  // shortest key chunk when splitting: amortises the merge
constexpr size_t kPartialBudgetFloats = size_t(32) << 20;  // 128 MB of partial states at most

template <int D>
struct Tile {
  static constexpr int kKeys = D <= 128 ? 64 : 32;  // 32 for D=256 keeps S in 16 registers and smem at 96 KiB
  static constexpr bool kQInRegs = D <= 128;        // D=256: O alone is 128 registers; Q stays in smem
  static constexpr int kRowChunks = D / 8;          // 16-byte chunks per row
  static constexpr int kTileElems = kKeys * D;      // one K or V tile (bf16)
  static constexpr int kStageElems = 2 * kTileElems;
  static constexpr int kQElems = kRows * D;
  static constexpr int kSmemElems = kQInRegs ? 2 * kStageElems : 2 * kStageElems + kQElems;
  static constexpr size_t kSmemBytes = size_t(kSmemElems) * 2;
  static_assert(!kQInRegs || kQElems <= kStageElems, "Q must fit in the stage it aliases");
  static_assert(kRowChunks % 8 == 0, "the swizzle permutes groups of 8 chunks");
};

struct Params {
  const uint16_t* k;  // layer's K rows (D bf16 each), token t of head h at row rows.row(h, t)
  const uint16_t* v;
  const float* q;
  float* out;     // one key chunk: normalised output
  float* part_m;  // key chunks: [n * n_heads][n_chunks] (log2 units)
  float* part_l;
  float* part_o;  // [n * n_heads][n_chunks][D], unnormalised
  SeqRows rows;  // the sequence's rows (kv_store.hpp): its block table in a paged `none` store
  int pos, n, n_heads, G, Tq, chunk_len, n_chunks;
  float q_factor;  // scale * log2 e
};

// Element offset of (row, 16-byte chunk) in a swizzled [rows][D] bf16 tile.
template <int D>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

using ptx::cp_async_16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::mma_bf16;
using ptx::smem_u32;

// Two floats -> bf16x2 (round to nearest even); `lo` (the lower column) in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: exp2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The two shared-memory layouts of a [rows][D] bf16 tile: element offset of
// (row, 16-byte chunk).
// Rows of D * 2 bytes, chunk c at c ^ (row & 7) (the mma.sync kernel).
template <int D>
struct RowMajorSwizzle {
  __device__ __forceinline__ int operator()(int row, int chunk) const { return swizzled<D>(row, chunk); }
};
// wgmma's 128-byte-swizzle atoms (wgmma.cuh): the tile as D / 64 blocks of
// [rows][64], each row 128 bytes, chunk c & 7 at (c & 7) ^ (row & 7).
template <int kTileRows>
struct Sw128Blocks {
  __device__ __forceinline__ int operator()(int row, int chunk) const {
    return (chunk >> 3) * (kTileRows * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
  }
};

// K and V rows [kt, kt + kKeys) of KV head kvh into one stage; rows at or past
// key_end are zero-filled without reading memory.
template <int D, int kKeys, int kCtaThreads, class Layout>
__device__ __forceinline__ void load_kv_tile(const Params& p, int kvh, int kt, int key_end, uint16_t* sk,
                                             uint16_t* sv, int tid, Layout layout) {
  constexpr int kRowChunks = D / 8;
  static_assert((kKeys * kRowChunks) % kCtaThreads == 0, "tile loads spread evenly over the threads");
#pragma unroll
  for (int i = 0; i < kKeys * kRowChunks / kCtaThreads; ++i) {
    const int e = tid + i * kCtaThreads;
    const int r = e / kRowChunks, c = e % kRowChunks;
    const int key = kt + r;
    const bool inside = key < key_end;
    // kt < key_end always: an outside row points at the tile's first row (valid, not read).
    const size_t src = p.rows.row(kvh, inside ? key : kt) * D + c * 8;
    const int off = layout(r, c);
    cp_async_16(smem_u32(sk + off), p.k + src, inside ? 16 : 0);
    cp_async_16(smem_u32(sv + off), p.v + src, inside ? 16 : 0);
  }
}

// The CTA's kCtaRows query rows -> bf16 (x scale * log2 e) -> shared memory
// in `layout`; padding rows 0.
template <int D, int kCtaRows, int kCtaThreads, class Layout>
__device__ __forceinline__ void stage_queries(const Params& p, uint16_t* sq, int kvh, int t0, int nt, int tid,
                                              Layout layout) {
  constexpr int kRowChunks = D / 8;
  static_assert((kCtaRows * kRowChunks) % kCtaThreads == 0, "Q loads spread evenly over the threads");
  const int G = p.G;
#pragma unroll
  for (int i = 0; i < kCtaRows * kRowChunks / kCtaThreads; ++i) {
    const int e = tid + i * kCtaThreads;
    const int r = e / kRowChunks, c = e % kRowChunks;
    const int tq = r / G;
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (tq < nt) {
      const float* src = p.q + (size_t(t0 + tq) * p.n_heads + size_t(kvh) * G + (r - tq * G)) * D + c * 8;
      const float f = p.q_factor;
      packed.x = pack_bf16(src[0] * f, src[1] * f);
      packed.y = pack_bf16(src[2] * f, src[3] * f);
      packed.z = pack_bf16(src[4] * f, src[5] * f);
      packed.w = pack_bf16(src[6] * f, src[7] * f);
    }
    *reinterpret_cast<uint4*>(sq + layout(r, c)) = packed;
  }
}

// One thread's two query rows (gid and gid + 8 of its warp's 16): online
// softmax state and the last key each sees.
struct RowPair {
  float m_lo = -INFINITY, m_hi = -INFINITY;  // running max (log2 units), quad-uniform
  float l_lo = 0.0f, l_hi = 0.0f;            // running sum, this thread's columns only
  int limit_lo = 0, limit_hi = 0;            // padding rows: larger, harmless
};

// A CTA's share of the work (the header's WORK SPLIT) and the calling
// thread's place in it, for a key tile of K keys: its KV head, query tile
// (t0, nt valid tokens), key chunk and key range, and its two rows' limits
// (row 16 warp + gid and + 8).
template <int K>
struct CtaWork {
  int kvh, t0, chunk, nt;
  int tid, lane, warp, gid, tig;
  int first_limit;  // last key the tile's first token sees
  int key_begin, key_end, n_tiles;
  RowPair rows;
  __device__ __forceinline__ explicit CtaWork(const Params& p) {
    kvh = blockIdx.x;
    t0 = (gridDim.y - 1 - blockIdx.y) * p.Tq;  // late query tiles first
    chunk = blockIdx.z;
    nt = min(p.Tq, p.n - t0);
    tid = threadIdx.x;
    lane = tid & 31;
    warp = tid >> 5;
    gid = lane >> 2;
    tig = lane & 3;
    // Key range: causal end (the last valid token's position + 1) cut to
    // the key chunk.
    first_limit = p.pos + t0;
    key_begin = chunk * p.chunk_len;
    key_end = min(first_limit + nt, key_begin + p.chunk_len);
    n_tiles = key_end > key_begin ? (key_end - key_begin + K - 1) / K : 0;
    rows.limit_lo = first_limit + (warp * 16 + gid) / p.G;
    rows.limit_hi = first_limit + (warp * 16 + gid + 8) / p.G;
  }
};

// One key tile's scores s (keys kt .. kt + K - 1, log2 units, the C
// fragments of S = Q K^T) -> probabilities P = exp2(s - m') in s: the causal
// mask and the online-softmax update of (m, l). Returns in alpha_lo / _hi
// the factor exp2(m - m') that the output accumulated so far must take.
template <int K>
__device__ __forceinline__ void softmax_scores(float (&s)[K / 8][4], RowPair& r, int kt, int first_limit, int tig,
                                               float& alpha_lo, float& alpha_hi) {
  // Causal mask: only tiles that reach past the first row's limit (this
  // includes the zero-filled keys past key_end, which lie past every valid
  // row's limit).
  if (kt + K - 1 > first_limit) {
#pragma unroll
    for (int nb = 0; nb < K / 8; ++nb) {
      const int key = kt + nb * 8 + 2 * tig;
      if (key > r.limit_lo) s[nb][0] = -INFINITY;
      if (key + 1 > r.limit_lo) s[nb][1] = -INFINITY;
      if (key > r.limit_hi) s[nb][2] = -INFINITY;
      if (key + 1 > r.limit_hi) s[nb][3] = -INFINITY;
    }
  }
  float mx_lo = r.m_lo, mx_hi = r.m_hi;
#pragma unroll
  for (int nb = 0; nb < K / 8; ++nb) {
    mx_lo = fmaxf(mx_lo, fmaxf(s[nb][0], s[nb][1]));
    mx_hi = fmaxf(mx_hi, fmaxf(s[nb][2], s[nb][3]));
  }
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
  // A row that has seen no key yet (key chunks; or a tile wholly past a
  // row's limit) keeps m = -inf; subtracting 0 instead gives p = 0, alpha =
  // 0, no NaN.
  const float base_lo = mx_lo == -INFINITY ? 0.0f : mx_lo;
  const float base_hi = mx_hi == -INFINITY ? 0.0f : mx_hi;
  alpha_lo = fast_exp2(r.m_lo - base_lo);
  alpha_hi = fast_exp2(r.m_hi - base_hi);
  r.m_lo = mx_lo;
  r.m_hi = mx_hi;
  float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
  for (int nb = 0; nb < K / 8; ++nb) {
    s[nb][0] = fast_exp2(s[nb][0] - base_lo);
    s[nb][1] = fast_exp2(s[nb][1] - base_lo);
    s[nb][2] = fast_exp2(s[nb][2] - base_hi);
    s[nb][3] = fast_exp2(s[nb][3] - base_hi);
    sum_lo += s[nb][0] + s[nb][1];
    sum_hi += s[nb][2] + s[nb][3];
  }
  r.l_lo = r.l_lo * alpha_lo + sum_lo;
  r.l_hi = r.l_hi * alpha_hi + sum_hi;
}

// o (this thread's two rows) *= alpha.
template <int D>
__device__ __forceinline__ void rescale_rows(float (&o)[D / 8][4], float alpha_lo, float alpha_hi) {
#pragma unroll
  for (int db = 0; db < D / 8; ++db) {
    o[db][0] *= alpha_lo;
    o[db][1] *= alpha_lo;
    o[db][2] *= alpha_hi;
    o[db][3] *= alpha_hi;
  }
}

// softmax_scores, then the rescale of o.
template <int K, int D>
__device__ __forceinline__ void softmax_tile(float (&s)[K / 8][4], float (&o)[D / 8][4], RowPair& r, int kt,
                                             int first_limit, int tig) {
  float alpha_lo, alpha_hi;
  softmax_scores<K>(s, r, kt, first_limit, tig, alpha_lo, alpha_hi);
  rescale_rows<D>(o, alpha_lo, alpha_hi);
}

// P of keys 16c .. 16c + 15 as a bf16 A fragment: the C fragments of S
// n-blocks 2c and 2c + 1 (no shuffle, see the header).
template <int K>
__device__ __forceinline__ void p_fragment(const float (&s)[K / 8][4], int c, uint32_t (&a)[4]) {
  a[0] = pack_bf16(s[2 * c][0], s[2 * c][1]);
  a[1] = pack_bf16(s[2 * c][2], s[2 * c][3]);
  a[2] = pack_bf16(s[2 * c + 1][0], s[2 * c + 1][1]);
  a[3] = pack_bf16(s[2 * c + 1][2], s[2 * c + 1][3]);
}

// Row sums over the quad (each thread summed its own columns), then this
// thread's part of its two rows: normalised output (one key chunk) or the
// partial state.
template <int D, int K>
__device__ __forceinline__ void write_rows(const Params& p, const float (&o)[D / 8][4], CtaWork<K>& w) {
  RowPair& r = w.rows;
  const int kvh = w.kvh, t0 = w.t0, nt = w.nt, chunk = w.chunk, warp = w.warp, gid = w.gid, tig = w.tig;
  r.l_lo += __shfl_xor_sync(0xffffffffu, r.l_lo, 1);
  r.l_lo += __shfl_xor_sync(0xffffffffu, r.l_lo, 2);
  r.l_hi += __shfl_xor_sync(0xffffffffu, r.l_hi, 1);
  r.l_hi += __shfl_xor_sync(0xffffffffu, r.l_hi, 2);
  const int G = p.G;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = warp * 16 + gid + 8 * half;
    const int tq = row / G;
    if (tq >= nt) continue;  // padding row
    const size_t q_index = size_t(t0 + tq) * p.n_heads + size_t(kvh) * G + (row - tq * G);
    const float m = half ? r.m_hi : r.m_lo, l = half ? r.l_hi : r.l_lo;
    if (p.n_chunks == 1) {
      const float inv_l = 1.0f / l;  // l >= 1: every row sees key 0 (its max scores 2^0)
      float* dst = p.out + q_index * D + 2 * tig;
#pragma unroll
      for (int db = 0; db < D / 8; ++db) {
        dst[db * 8] = o[db][2 * half] * inv_l;
        dst[db * 8 + 1] = o[db][2 * half + 1] * inv_l;
      }
    } else {
      const size_t part = q_index * p.n_chunks + chunk;
      float* dst = p.part_o + part * D + 2 * tig;
#pragma unroll
      for (int db = 0; db < D / 8; ++db) {
        dst[db * 8] = o[db][2 * half];
        dst[db * 8 + 1] = o[db][2 * half + 1];
      }
      if (tig == 0) {
        p.part_m[part] = m;
        p.part_l[part] = l;
      }
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads, 2) prefill_attn_kernel(Params p) {
  using T = Tile<D>;
  constexpr int K = T::kKeys;
  extern __shared__ uint4 smem_raw[];  // uint4: 16-byte alignment for cp.async and ldmatrix
  uint16_t* const smem = reinterpret_cast<uint16_t*>(smem_raw);
  // Stage s starts at smem + s * kStageElems (arithmetic, not a pointer
  // array: a dynamically indexed array would go to local memory).
  uint16_t* const sq = smem + (T::kQInRegs ? T::kStageElems : 2 * T::kStageElems);
  const RowMajorSwizzle<D> layout;

  CtaWork<K> w(p);
  const int kvh = w.kvh, t0 = w.t0, nt = w.nt, G = p.G;
  const int tid = w.tid, lane = w.lane, warp = w.warp, tig = w.tig;
  const int first_limit = w.first_limit, key_begin = w.key_begin, key_end = w.key_end, n_tiles = w.n_tiles;
  RowPair& rows = w.rows;
  // Last key any valid row of this warp sees (-1: the warp has no valid row).
  const int warp_last_key = (warp * 16) / G < nt ? first_limit + min((warp * 16 + 15) / G, nt - 1) : -1;

  // (A CTA without keys, a key chunk past its tile's last token, only
  // writes its empty partial state.)
  if (n_tiles > 0) {
    load_kv_tile<D, K, kThreads>(p, kvh, key_begin, key_end, smem, smem + T::kTileElems, tid, layout);
    cp_async_commit();
    stage_queries<D, kRows, kThreads>(p, sq, kvh, t0, nt, tid, layout);
  }
  __syncthreads();

  // ldmatrix lane addressing (see the header comment).
  const int a_row = warp * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);  // Q: rows +8 for matrices 1, 3
  const int a_chunk = lane >> 4;                                        // Q: columns +8 for matrices 2, 3
  const int k_key = (lane & 7) + ((lane >> 4) << 3);                    // K: keys +8 for matrices 2, 3
  const int k_chunk = (lane >> 3) & 1;                                  // K: dims +8 for matrices 1, 3
  const int v_key = (lane & 7) + (((lane >> 3) & 1) << 3);              // V: keys +8 for matrices 1, 3
  const int v_chunk = lane >> 4;                                        // V: dims +8 for matrices 2, 3

  uint32_t qf[T::kQInRegs ? D / 16 : 1][4];
  if constexpr (T::kQInRegs) {
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) ldmatrix_x4(smem_u32(sq + swizzled<D>(a_row, 2 * kc + a_chunk)), qf[kc]);
    __syncthreads();  // Q's shared memory is stage 1, which the first iteration below refills
  }

  float o[D / 8][4];
#pragma unroll
  for (int db = 0; db < D / 8; ++db) o[db][0] = o[db][1] = o[db][2] = o[db][3] = 0.0f;

  for (int it = 0; it < n_tiles; ++it) {
    const int kt = key_begin + it * K;
    if (it + 1 < n_tiles) {
      uint16_t* next = smem + ((it + 1) & 1) * T::kStageElems;
      load_kv_tile<D, K, kThreads>(p, kvh, kt + K, key_end, next, next + T::kTileElems, tid, layout);
      cp_async_commit();
      cp_async_wait<1>();  // tile `it` has landed, tile it+1 may still be in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // A warp skips the compute of a tile none of its valid rows can see.
    if (kt <= warp_last_key) {
      const uint16_t* sk = smem + (it & 1) * T::kStageElems;
      const uint16_t* sv = sk + T::kTileElems;

      // S = Q K^T
      float s[K / 8][4];
#pragma unroll
      for (int nb = 0; nb < K / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t a[4];
        if constexpr (T::kQInRegs) {
          a[0] = qf[kc][0];
          a[1] = qf[kc][1];
          a[2] = qf[kc][2];
          a[3] = qf[kc][3];
        } else {
          ldmatrix_x4(smem_u32(sq + swizzled<D>(a_row, 2 * kc + a_chunk)), a);
        }
#pragma unroll
        for (int nb2 = 0; nb2 < K / 16; ++nb2) {
          uint32_t b[4];
          ldmatrix_x4(smem_u32(sk + swizzled<D>(nb2 * 16 + k_key, 2 * kc + k_chunk)), b);
          mma_bf16(s[2 * nb2], a, b[0], b[1]);
          mma_bf16(s[2 * nb2 + 1], a, b[2], b[3]);
        }
      }

      softmax_tile<K, D>(s, o, rows, kt, first_limit, tig);

      // O += P V
#pragma unroll
      for (int kc = 0; kc < K / 16; ++kc) {
        uint32_t a[4];
        p_fragment<K>(s, kc, a);
#pragma unroll
        for (int db2 = 0; db2 < D / 16; ++db2) {
          uint32_t b[4];
          ldmatrix_x4_trans(smem_u32(sv + swizzled<D>(kc * 16 + v_key, 2 * db2 + v_chunk)), b);
          mma_bf16(o[2 * db2], a, b[0], b[1]);
          mma_bf16(o[2 * db2 + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }

  write_rows<D>(p, o, w);
}

#if defined(KVQ_WGMMA)
// THE HOPPER KERNEL (head_dim 128, sm_90a): the mma.sync kernel's work split,
// causal mask, softmax and epilogue, with the products on warpgroup MMA
// (wgmma.cuh), 128 query rows per CTA and FlashAttention-3's warp
// specialization. Two CONSUMER warpgroups (warps 0-7, row 16 w + gid as
// before) each own 64 rows and share every K/V tile, which halves the L2
// traffic per FLOP of the 64-row CTA (at 64 rows, 32 KiB of K/V per 2.1
// MFLOP tile: ~4.6 TB/s from L2 at ~300 TFLOP/s, computed, not measured).
// A PRODUCER warpgroup (warps 8-11) streams the tiles with cp.async and
// does nothing else. Per consumer warpgroup:
//   S[64][64]  = Q[64][128] . K_tile^T   8 x m64n64k16, A = its Q rows and
//                                         B = K from shared memory (K-major)
//   O[64][128] += bf16(P)[64][64] . V    4 x m64n128k16, A = P from registers
//                                         (the S accumulators, as in the
//                                         mma.sync kernel), B = V N-major
// PIPELINE: kStages stages of K and V, each with two mbarriers (wgmma.cuh's
// pipe::): "full" completes when the producer's 128 threads' copies of the
// tile have landed (cp.async.mbarrier.arrive), "empty" when the 8 consumer
// warps are done with it; the producer refills a stage once it is empty.
// No CTA-wide barrier after the start: each warpgroup runs at its own pace.
// A consumer warpgroup issues tile i + 1's S = Q K^T and tile i's O += P V
// together, runs tile i + 1's softmax while P V (and the other warpgroup's
// products) run, then rescales O by tile i + 1's alpha (a warp skips it when
// every alpha is 1, which is most tiles once the row maxima settle) and
// packs its P.
// Measured and not kept (docs/perf.md, session 21): one producer warp (its
// cp.async issue could not keep up: TTFT 64k 9.5 s), two (6.1 s),
// FlashAttention-3's ping-pong, the two warpgroups taking strict turns on
// the tensor cores through named barriers (5.40 s against 5.13 without),
// and five stages (5.09 s against 5.11, within noise).
// SHARED MEMORY: every K or V tile is 64 keys x 128 dims = two
// 128-byte-swizzle blocks of [64][64] (Sw128Blocks<64>), stage s holds K at
// s * 32 KiB and V 16 KiB after it; Q after the stages is two blocks of
// [128][64] (Sw128Blocks<128>), warpgroup g's rows 64 g.. in each; the
// 2 kStages mbarriers after Q. One CTA per SM.
// Descriptors (128-byte swizzle): Q and K k-step kc at block kc / 4, +32
// bytes per step inside it, SBO 1024 (8 rows of 128 bytes); V key-step c at
// +2048 bytes (16 keys of 128 bytes), LBO 8192 (the second 64-dim block),
// SBO 1024 (8 keys).
namespace wg_prefill {
constexpr int kD = 128, kKeys = 64, kStages = 4;
constexpr int kConsumerWarps = 8, kProducerWarps = 4;
constexpr int kConsumerThreads = 32 * kConsumerWarps, kCtaThreads = kConsumerThreads + 32 * kProducerWarps;
constexpr int kCtaRows = 16 * kConsumerWarps;
constexpr int kTileElems = kKeys * kD;  // one K or V tile (16 KiB)
constexpr uint32_t kTileBytes = kTileElems * 2, kTileHalfBytes = kTileBytes / 2;
constexpr uint32_t kQHalfBytes = kCtaRows * 64 * 2;  // one 64-dim block of Q
constexpr int kQReadyBarrier = 1;                    // named barrier: the consumers' Q is staged
constexpr size_t kSmemBytes =  // + 1024 bytes of alignment slack
    size_t(2 * kStages) * kTileBytes + 2 * kQHalfBytes + 2 * kStages * sizeof(uint64_t) + 1024;
static_assert(kKeys == Tile<kD>::kKeys, "the host's key chunks assume the mma.sync kernel's key tile");

// S = Q K^T of this warpgroup's rows (Q at sq_addr, its first row's block
// offset included) and the tile at sk_addr (async: commit, then wait).
__device__ __forceinline__ void issue_scores(float (&s)[kKeys / 2], uint32_t sq_addr, uint32_t sk_addr) {
#if defined(KVQ_WGMMA_DEVICE)
  wgmma::fence();
#pragma unroll
  for (int kc = 0; kc < kD / 16; ++kc) {
    const uint32_t step = (kc & 3) * 32;
    wgmma::mma_m64n64k16_ss(s, wgmma::desc_sw128(sq_addr + (kc >> 2) * kQHalfBytes + step, 16, 1024),
                            wgmma::desc_sw128(sk_addr + (kc >> 2) * kTileHalfBytes + step, 16, 1024), kc > 0);
  }
  wgmma::commit();
#endif
}
}  // namespace wg_prefill

__global__ void __launch_bounds__(wg_prefill::kCtaThreads, 1) prefill_attn_wgmma_kernel(Params p) {
#if defined(KVQ_WGMMA_DEVICE)
  using namespace wg_prefill;
  constexpr int D = kD, K = kKeys;
  extern __shared__ uint4 smem_raw[];
  // The swizzle atoms must be 1024-byte aligned (descriptor base offset 0).
  const uint32_t raw_addr = smem_u32(smem_raw);
  uint16_t* const smem =
      reinterpret_cast<uint16_t*>(reinterpret_cast<char*>(smem_raw) + ((1024u - (raw_addr & 1023u)) & 1023u));
  uint16_t* const sq = smem + 2 * kStages * kTileElems;
  // Tile i's stage and barriers (arithmetic: a pointer array would go to
  // local memory); parity(i): which of its stage's uses tile i is, mod 2.
  const uint32_t bars = smem_u32(sq + kCtaRows * kD);  // full[kStages], then empty[kStages]
  auto full = [bars](int i) { return bars + uint32_t(i % kStages) * 8u; };
  auto empty = [bars](int i) { return bars + uint32_t(kStages + i % kStages) * 8u; };
  auto parity = [](int i) { return uint32_t(i / kStages) & 1u; };
  auto stage = [smem](int i) { return smem + (i % kStages) * 2 * kTileElems; };

  CtaWork<K> w(p);
  const int kvh = w.kvh, t0 = w.t0, nt = w.nt;
  const int tid = w.tid, lane = w.lane, warp = w.warp, tig = w.tig;
  const int first_limit = w.first_limit, key_begin = w.key_begin, key_end = w.key_end, n_tiles = w.n_tiles;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      pipe::init(full(s), 32 * kProducerWarps);
      pipe::init(empty(s), kConsumerWarps);
    }
    pipe::fence_init();
  }
  __syncthreads();  // the only CTA-wide barrier: the producer leaves early

  if (warp >= kConsumerWarps) {  // the producer
    const Sw128Blocks<kKeys> kv_layout;
    for (int i = 0; i < n_tiles; ++i) {
      if (i >= kStages) pipe::wait(empty(i), parity(i - kStages));
      load_kv_tile<D, K, 32 * kProducerWarps>(p, kvh, key_begin + i * K, key_end, stage(i), stage(i) + kTileElems,
                                              tid - kConsumerThreads, kv_layout);
      pipe::arrive_on_copies(full(i));
    }
    pipe::copies_wait_all();
    return;
  }

  RowPair& rows = w.rows;
  stage_queries<D, kCtaRows, kConsumerThreads>(p, sq, kvh, t0, nt, tid, Sw128Blocks<kCtaRows>());
  wgmma::fence_proxy_async();  // Q's stores, for the wgmma reads
  pipe::named_sync(kQReadyBarrier, kConsumerThreads);

  float o[D / 8][4];
#pragma unroll
  for (int db = 0; db < D / 8; ++db) o[db][0] = o[db][1] = o[db][2] = o[db][3] = 0.0f;
  float(&o_flat)[D / 2] = reinterpret_cast<float(&)[D / 2]>(o);
  float s[K / 8][4];
  float(&s_flat)[K / 2] = reinterpret_cast<float(&)[K / 2]>(s);
  uint32_t pa[K / 16][4];                                       // tile i's P as A fragments
  const uint32_t sq_addr = smem_u32(sq) + (warp >> 2) * (64 * 64 * 2);  // this warpgroup's 64 rows
  // Tile i has landed; then the producer's cp.async writes are made visible
  // to this thread's wgmma reads.
  auto wait_tile = [&](int i) {
    pipe::wait(full(i), parity(i));
    wgmma::fence_proxy_async();
  };

  if (n_tiles > 0) {
    wait_tile(0);
    issue_scores(s_flat, sq_addr, smem_u32(stage(0)));
    wgmma::wait<0>();
    wgmma::fence_operands(s_flat);
    float alpha_lo, alpha_hi;  // o is still 0
    softmax_scores<K>(s, rows, key_begin, first_limit, tig, alpha_lo, alpha_hi);
#pragma unroll
    for (int c = 0; c < K / 16; ++c) p_fragment<K>(s, c, pa[c]);
  }

  // O += P V of tile it (the fence: wgmma reads o and pa asynchronously).
  auto issue_pv = [&](int it) {
    wgmma::fence_operands(o_flat);
    wgmma::fence();
    const uint32_t sv_addr = smem_u32(stage(it)) + kTileBytes;
#pragma unroll
    for (int c = 0; c < K / 16; ++c)
      wgmma::mma_m64n128k16_rs_nmajor(o_flat, pa[c], wgmma::desc_sw128(sv_addr + c * 2048, kTileHalfBytes, 1024));
    wgmma::commit();
  };
  // Every tile but the last: tile it + 1's S and tile it's P V in flight
  // together, the softmax of S while P V runs. The last tile is peeled off
  // rather than guarded by branches: with S's issue and its wait each under
  // `if (has_next)`, ptxas could not match them up and serialized every
  // wgmma of the kernel (C7514).
  for (int it = 0; it + 1 < n_tiles; ++it) {
    wait_tile(it + 1);
    issue_scores(s_flat, sq_addr, smem_u32(stage(it + 1)));
    issue_pv(it);
    float alpha_lo, alpha_hi;
    wgmma::wait<1>();  // tile it + 1's scores (committed first); P V may still run
    wgmma::fence_operands(s_flat);
    softmax_scores<K>(s, rows, key_begin + (it + 1) * K, first_limit, tig, alpha_lo, alpha_hi);
    wgmma::wait<0>();
    wgmma::fence_operands(o_flat);
    if (lane == 0) pipe::arrive(empty(it));  // this warp is done with tile it's stage
    // Once a row's max settles alpha is 1 (ex2 of 0) tile after tile: the
    // warp skips the 64 multiplications when all its rows have it.
    if (__any_sync(0xffffffffu, alpha_lo != 1.0f || alpha_hi != 1.0f)) rescale_rows<D>(o, alpha_lo, alpha_hi);
#pragma unroll
    for (int c = 0; c < K / 16; ++c) p_fragment<K>(s, c, pa[c]);
  }
  if (n_tiles > 0) {  // the last tile's P V; no producer waits for its stage
    issue_pv(n_tiles - 1);
    wgmma::wait<0>();
    wgmma::fence_operands(o_flat);
  }

  write_rows<D>(p, o, w);
#endif  // KVQ_WGMMA_DEVICE
}
#endif  // KVQ_WGMMA

// Opts `kernel` into `smem` bytes of dynamic shared memory and returns how
// many of its CTAs of `threads` fit on one SM (both once per device:
// ctx.kernels()).
int configure_kernel(const DeviceContext& ctx, void (*kernel)(Params), int threads, size_t smem) {
  const void* key = reinterpret_cast<const void*>(kernel);
  KernelResources& kernels = ctx.kernels();
  kernels.raise_limit(key, smem, [kernel](size_t bytes) {
    KVQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  });
  return kernels.resident_ctas(key, threads, smem, [kernel, threads, smem] {
    int ctas = 0;
    KVQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, smem));
    return ctas;
  });
}

template <int D>
void launch_prefill(const KvLayerView& layer, int pos, int n, const float* q, int n_heads, float scale, float* out,
                    AttentionScratch& scratch, cudaStream_t stream, int key_splits, const DeviceContext& ctx) {
  constexpr int K = Tile<D>::kKeys;
  const int n_kv = layer.n_kv_heads;
  const int G = n_heads / n_kv;
  void (*kernel)(Params) = prefill_attn_kernel<D>;
  size_t smem = Tile<D>::kSmemBytes;
  int threads = kThreads, cta_rows = kRows;
#if defined(KVQ_WGMMA)
  if (flash_attention_prefill_wgmma(D, ctx)) {
    kernel = prefill_attn_wgmma_kernel;
    smem = wg_prefill::kSmemBytes;
    threads = wg_prefill::kCtaThreads;
    cta_rows = wg_prefill::kCtaRows;
  }
#endif
  const int Tq = cta_rows / G;
  const int q_tiles = (n + Tq - 1) / Tq;
  KVQ_CHECK(q_tiles <= 65535, Errc::out_of_range, "GPU prefill attention: ", n,
            " query tokens in one call is too many (lower --prefill-chunk)");
  const int ctas_per_sm = configure_kernel(ctx, kernel, threads, smem);

  // Key chunks: none when the query tiles fill the GPU's CTA slots at least
  // half way; otherwise as many as fill them in one wave, each at least
  // kMinTilesPerChunk tiles long, within the partial-state budget.
  const int len = pos + n;
  const int len_tiles = (len + K - 1) / K;
  int n_chunks = 1;
  if (key_splits > 0) {
    n_chunks = std::min(key_splits, len_tiles);
  } else {
    const int slots = ctx.sm_count() * ctas_per_sm;
    const int base = n_kv * q_tiles;
    n_chunks = std::max(1, std::min(slots / base, (len_tiles + kMinTilesPerChunk - 1) / kMinTilesPerChunk));
  }
  const size_t per_chunk = size_t(n) * n_heads * (D + 2);
  n_chunks = int(std::max<size_t>(1, std::min<size_t>(n_chunks, kPartialBudgetFloats / per_chunk)));
  const int chunk_tiles = (len_tiles + n_chunks - 1) / n_chunks;
  n_chunks = (len_tiles + chunk_tiles - 1) / chunk_tiles;  // no empty trailing chunk

  Params p{};
  p.k = layer.k;
  p.v = layer.v;
  p.q = q;
  p.out = out;
  p.pos = pos;
  p.n = n;
  p.n_heads = n_heads;
  p.G = G;
  p.Tq = Tq;
  p.rows = layer.rows();
  p.chunk_len = chunk_tiles * K;
  p.n_chunks = n_chunks;
  p.q_factor = prefill_query_factor(scale);
  const size_t rows = size_t(n) * n_heads;
  if (n_chunks > 1) {
    const size_t need = rows * n_chunks * (D + 2);
    if (scratch.part.size() < need) scratch.part.resize(need);
    p.part_m = scratch.part.data();
    p.part_l = p.part_m + rows * n_chunks;
    p.part_o = p.part_l + rows * n_chunks;
  }
  const dim3 grid(n_kv, q_tiles, n_chunks);
  kernel<<<grid, threads, smem, stream>>>(p);
  KVQ_CUDA_CHECK_LAUNCH();
  if (n_chunks > 1) {
    merge_partial_states(p.part_m, p.part_l, p.part_o, int(rows), n_chunks, D, out, stream);
    KVQ_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

bool flash_attention_prefill_wgmma(int head_dim, const DeviceContext& ctx) {
#if defined(KVQ_WGMMA)
  const cudaDeviceProp& prop = ctx.properties();
  return head_dim == 128 && ctx.settings.prefill_wgmma && prop.major == 9 && prop.minor == 0;
#else
  (void)head_dim;
  (void)ctx;
  return false;
#endif
}

bool flash_attention_prefill_supported(int n_heads, int n_kv_heads, int head_dim) {
  if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0) return false;
  if (n_heads / n_kv_heads > kMaxGroup) return false;
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

void flash_attention_prefill(const KvLayerView& layer, int pos, int n, const float* q, int n_heads, float scale,
                             float* out, AttentionScratch& scratch, cudaStream_t stream, int key_splits,
                             const DeviceContext& ctx) {
  KVQ_CHECK(pos >= 0 && n > 0 && int64_t(pos) + n <= layer.max_tokens, Errc::out_of_range,
            "GPU prefill attention: tokens [", pos, ", ", int64_t(pos) + n, ") outside the cache capacity of ",
            layer.max_tokens);
  KVQ_CHECK(flash_attention_prefill_supported(n_heads, layer.n_kv_heads, layer.head_dim), Errc::unsupported,
            "GPU prefill attention: unsupported shape (", n_heads, " heads, ", layer.n_kv_heads,
            " KV heads, head_dim ", layer.head_dim, "); needs head_dim 64/128/256 and a GQA group of at most ",
            kMaxGroup);
  // cp.async moves 16-byte chunks: rows (D * 2 bytes, D a multiple of 8) stay
  // aligned when the layer's base pointers are (cudaMalloc'd caches are).
  KVQ_CHECK((reinterpret_cast<uintptr_t>(layer.k) | reinterpret_cast<uintptr_t>(layer.v)) % 16 == 0, Errc::internal,
            "GPU prefill attention: K/V cache pointers not 16-byte aligned");
  switch (layer.head_dim) {
    case 64: launch_prefill<64>(layer, pos, n, q, n_heads, scale, out, scratch, stream, key_splits, ctx); break;
    case 128: launch_prefill<128>(layer, pos, n, q, n_heads, scale, out, scratch, stream, key_splits, ctx); break;
    default: launch_prefill<256>(layer, pos, n, q, n_heads, scale, out, scratch, stream, key_splits, ctx); break;
  }
}

}  // namespace kvq::cuda
