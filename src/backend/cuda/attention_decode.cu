// Tensor-core split-KV flash decoding over any KV codec that has decode hooks
// (kv_codec_hooks.cuh); work split and merge in attention_decode.hpp. This
// comment documents the register layouts, with the bf16 (`none`) hooks as the
// example; the q8 hooks' variants are documented beside them.
//
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, lane = 4 g + t
// (g = lane / 4 in 0..7, t = lane % 4):
//   A (16 x 16, row major), 4 regs of 2 bf16 (low half = lower column):
//     a0 = (row g,   cols 2t, 2t+1)    a1 = (row g+8, cols 2t, 2t+1)
//     a2 = (row g,   cols 2t+8, 2t+9)  a3 = (row g+8, cols 2t+8, 2t+9)
//   B (16 x 8, "col"), 2 regs: b0 = (k rows 2t, 2t+1; col g), b1 = (k rows 2t+8, 2t+9; col g)
//   C (16 x 8 fp32): c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, cols 2t, 2t+1)
// M = 16 rows are the G query heads of the KV group (rows >= G hold zero
// queries; their results are computed and dropped).
//
// S = Q K^T, one 16-key tile = two n-tiles of 8 keys (key g and key 8 + g of
// the tile for lane g), K = head dims in D / 16 k-steps. A dot product may
// visit the dims in any order if Q and K use the same order, so lane t loads
// ONE 16-byte chunk (8 dims) of its key at physical dims [32p + 8t, 32p + 8t + 8)
// and uses its words as the B registers of k-steps 2p and 2p + 1:
//   step 2p:   b0 = dims 32p+8t+{0,1}, b1 = dims 32p+8t+{2,3}
//   step 2p+1: b0 = dims 32p+8t+{4,5}, b1 = dims 32p+8t+{6,7}
// i.e. logical k index (step 2p+h, 2t+i / 2t+8+i) = physical dim 32p+8t+4h+i / +2+i.
// The Q A fragments use exactly this map (built once per CTA into shared
// memory, q_frag[step][part][lane], one 16-byte load per lane and mma). One
// warp load instruction reads 8 keys x 64 contiguous bytes: whole 32-byte
// sectors, and the D / 32 instructions of a key cover its row.
//
// O = P V, M = 16 rows, K = the 16 keys of the tile, N = 8 dims per n-tile,
// D / 8 n-tiles. P's A fragment is S's C fragments of the two key n-tiles
// (a0 = S0.c0c1, a1 = S0.c2c3, a2 = S1.c0c1, a3 = S1.c2c3: keys 2t, 2t+1,
// 2t+8, 2t+9 of the tile). V's B fragment needs lane (g, t) to hold keys
// {2t, 2t+1, 2t+8, 2t+9} at one dim per n-tile; dims are permuted:
//   logical (n-tile j, column c) = physical dim (D/8) c + j,
// so lane (g, t) loads, for each of its 4 keys, the D/4 contiguous bytes of
// physical dims [(D/8) g, (D/8)(g+1)) (D / 64 16-byte loads; the 8 lanes of one
// t read a whole row), and b0 of n-tile j = __byte_perm of dim j of keys 2t
// and 2t+1 (b1: keys 2t+8, 2t+9). The C fragment of n-tile j then holds, for
// lane t, physical dims (D/4) t + j (c0/c2) and (D/4) t + D/8 + j (c1/c3):
// each lane owns the contiguous quarter [(D/4) t, (D/4)(t+1)) of its two rows,
// which is how o is un-permuted when it leaves the registers.
//
// Precision: K and V are bf16 already; q (fp32, pre-scaled by scale*log2 e)
// and p (fp32 in [0, 1]) are each split EXACTLY into three bf16 parts
// (hi = bf16(x), mid = bf16(x - hi), lo = x - hi - mid, which fits bf16
// because round-to-nearest leaves at most 24 - 8 - 8 significant bits), and
// every part is multiplied (small parts first), so all products are exact and
// S and o carry only fp32 accumulation error (the tensor core's, which
// truncates instead of rounding: a bias of ~2^-24 relative per mma). (Two
// parts, as first planned, leave |x - hi - lo| up to 2^-16 |x|: score errors
// of ~1e-5, too close to the 1e-4 test bound and to the 1e-5 agreement the
// decode-at test asks of two split counts.) 3 mma per (k-step or n-tile):
// 96 per 16-key tile (8 KB of K+V) at D = 128: at full HBM bandwidth an SM
// needs ~0.2 mma per clock, a fifth to a third of what mma.sync sustains.
//
// Shared memory (dynamic, bytes):
//   region 0: q_frag [D/16][3][32] uint4 during the key loop; afterwards the
//             per-warp o of the CTA merge, warp_o [4][G][D + 16] fp32, each row
//             stored as 4 quarters of D/4 floats at stride D/4 + 4 (the padding
//             makes the lanes' float4 stores conflict-free)
//   warp_m, warp_l [4][16]; split_w [n_splits][G] (final merge weights); flag.
//
// Latency: a warp's tile loop keeps the next tile's K and this tile's V in
// flight while it computes S (D <= 128; D = 256 has no registers to spare:
// o alone takes 128 per lane); the first tile is asked into L2 before the
// wait for the predecessor and loaded right after the q loads of the
// prologue. Register use (-Xptxas -v, sm_90, bf16 instances, with the paged
// tile addressing): D = 64 160, D = 128 253, D = 256 255, no spills: 2 CTAs
// (8 warps) per SM for D >= 128, 3 for D = 64. The keys-major instances are
// bounded to 3 CTAs (12 warps) per SM: <= 168 registers (the iso +qjl ones
// spill 12 bytes, as before paging). 4 CTAs at 128 registers (session 16:
// tsym3 and fp8 without spills, k8vturbo2 12 bytes, iso +qjl 160) ran
// slower: B = 32 batched decode -17 % at 4k and -16 % at 16k, one sequence
// -2 % at 64k; only B = 64 at 4k gained (+5 % tsym3).
//
// Paging (kv_store.hpp): a CTA's sequence is blockIdx.z; a 16-key tile's
// first row is resolved once (tile_row: block table, then PageGeometry) and
// its keys are the 15 rows after it. The tile's place in the block table is a
// shift (SeqRows::page_shift: 64-token pages, or one page), not a division.
#include "backend/cuda/attention_decode.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/kv_codec_hooks.cuh"
#include "backend/cuda/kv_decode_hooks.cuh"
#include "backend/cuda/kv_rotation.cuh"
#include "backend/cuda/qk_norm_rope.cuh"
#include "backend/cuda/l2_prefetch.cuh"
#include "backend/cuda/lab_trace.cuh"
#include "backend/cuda/ptx.cuh"
#include "backend/cuda/softmax_state.cuh"
#include "core/error.hpp"

namespace kvq::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileKeys = 16;
constexpr int kQFragEntries = 4;  // per 16 head dims: 3 bf16 parts, or 2 fp16 parts over 2D dims (+qjl)
constexpr int kMaxGroup = 16;         // M of the mma
constexpr int kMinKeysPerSplit = 64;  // with a known position: no split gets less than a tile per warp
constexpr int kMinBatchSplitKeys = 1024;  // keys of a full sequence per split before a batch splits to fill waves
constexpr float kLog2e = 1.4426950408889634f;

struct DecodeParams {
  GpuKvSide k, v;        // the packed store of this layer
  const float* q;        // [n_seq][n_heads][D]: sequence z's query is row z
  float* out;            // [n_seq][n_heads][D]
  // Rotated sides: this layer's rotation tables ([n_kv][stride] floats,
  // GpuKvSide::rot), else null. q is rotated in shared memory before its
  // fragments are built, and the last CTA un-rotates o before writing it: no
  // launch of their own. +qjl K sides also get S q_rot there (k.qjl).
  const float* q_rot;
  const float* o_rot;
  float* part_o;         // [n_seq][n_kv][n_splits][G][D] unnormalised partial outputs
  float* part_m;         // [n_seq][n_kv][n_splits][G] running max (log2 domain)
  float* part_l;         // [n_seq][n_kv][n_splits][G] running sum
  unsigned* counters;    // [n_seq][n_kv] arrival counters, 0 between launches
  const int* pos_dev;    // [n_seq] when set, sequence z's position is pos_dev[z]
  int pos;               // else the position (one sequence)
  // Where the rows are (kv_store.hpp): the store's geometry, its page shift
  // and the block tables [n_seq][table_stride] (device; rows.pages is
  // sequence 0's), or null: one sequence over the identity table.
  SeqRows rows;
  int table_stride;
  // Fused q path (QPrep): q is raw, as the QKV projection wrote it; every CTA
  // norms and rotates (RoPE) its group's rows itself, and the kernel waits
  // for its predecessor (the store's encode, qk_rope_store with
  // q_in_attention) only before it reads the step's own K/V row.
  bool q_fused;
  const float* q_norm;   // q's RMSNorm weight [D], or null
  float q_eps;
  RopeParams rope;
  int G;
  int capacity;          // tokens a sequence can hold (clamps the early prefetch)
  float q_scale;         // scale * log2(e)
  int prefetch_tiles;    // tiles per warp prefetched before the wait (KernelSettings::attn_prefetch_tiles)
  unsigned long long* trace;  // kernel-lab timeline (KernelSettings::decode_trace), or null
  // The exact recent window (GpuKvLayer::xk / xv; window_pages 0: none). A
  // sequence's window is the exact suffix of its table (page ids >=
  // n_packed_pages, at most window_pages of them), its keys [w, len): CTAs
  // split < packed_splits take the packed keys [0, w) as above, the others
  // (exact_window_part) the window's keys from bf16 rows.
  GpuKvSide xk, xv;
  int window_pages;
  int n_packed_pages;
  int packed_splits;     // gridDim.x without a window
};

__host__ __device__ constexpr size_t qfrag_bytes(int D) { return size_t(D / 16) * kQFragEntries * 32 * 16; }
template <class H>
constexpr int stage_bytes_of() {
  if constexpr (H::kStaged) return H::kStageBytes;
  else return 0;
}
__host__ __device__ constexpr int merge_row_stride(int D) { return D + 16; }    // floats; = 4 * (D/4 + 4)
__host__ __device__ constexpr int merge_quarter_stride(int D) { return D / 4 + 4; }
__host__ __device__ constexpr size_t merge_bytes(int D, int G) {
  return size_t(kWarps) * G * merge_row_stride(D) * sizeof(float);
}
// (The keys-major form keeps its q fragments in registers: region 0 is the merge's.)
__host__ __device__ constexpr size_t region0_bytes(int D, int G, bool keys_major = false) {
  return !keys_major && qfrag_bytes(D) > merge_bytes(D, G) ? qfrag_bytes(D) : merge_bytes(D, G);
}
// Low-bit formats add their pair tables (tcq) and their staging rings after
// region 0 (extra_bytes, a multiple of 16; kv_decode_hooks.cuh); rotated
// sides (and the fused q path) add one [G][2D] float row buffer at the end
// (the prepared q, the rotated q and, for +qjl, S q_rot; later the merged o
// before its un-rotation; kv_rotation.cuh's warp_rotate_row does both,
// bit-identical to the CPU rotations).
__host__ __device__ constexpr size_t smem_bytes(int D, int G, int n_splits, bool rotated, int extra_bytes,
                                                bool keys_major) {
  return region0_bytes(D, G, keys_major) + size_t(extra_bytes) + 2 * kWarps * kMaxGroup * sizeof(float) +
         size_t(n_splits) * G * sizeof(float) + 16 + (rotated ? size_t(G) * 2 * D * sizeof(float) : 0);
}
// The hooks of an instance, and the shared memory they add: the K and V pair
// tables, then kDecodeStages ring slots per warp for the staged sides.
// kKM: the keys-major form (below), for staged V sides whose K side is
// staged too or q8 (which the keys-major form stages as well).
template <int D, kv::Family KF, int KB, bool KQ, kv::Family VF, int VB, bool kKM = false>
struct InstanceHooks {
  using V = VDecodeHooks<VF, VB, D>;
  static constexpr bool kKeysMajorEligible =
      V::kStaged && (KDecodeHooks<KF, KB, D>::kStaged || KF == kv::Family::q8);
  using KBase = std::conditional_t<kKM && KF == kv::Family::q8,
                                   KDecodeLowBit<lowbit::Q8Format<D>, lowbit::Scale::group, D>, KDecodeHooks<KF, KB, D>>;
  using K = std::conditional_t<KQ, KDecodeQjl<KF, KB, D>, KBase>;
  static constexpr int kLutBytes = (4 * (K::kLutEntries + V::kLutEntries) + 15) / 16 * 16;
  static constexpr int kSlotBytes = stage_bytes_of<K>() + stage_bytes_of<V>();
  static constexpr int kRingBytes = kWarps * kDecodeStages * kSlotBytes;
  static constexpr int kExtraBytes = kLutBytes + kRingBytes;
};

// fp16 q parts: the exponent e of the power of two that brings the CTA's
// largest |q| * |q_scale| into [2^13, 2^14), so that no part is subnormal and
// none overflows (frexpf gives a = f 2^x, f in [0.5, 1)); amax: this thread's
// largest |q|. Block-wide (two barriers); warp_m is scratch until the merge.
__device__ __forceinline__ int q_prescale_exponent(float amax, float q_scale, float* warp_m, int lane, int warp) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) warp_m[warp] = amax;
  __syncthreads();
  amax = fmaxf(fmaxf(warp_m[0], warp_m[1]), fmaxf(warp_m[2], warp_m[3])) * fabsf(q_scale);
  __syncthreads();
  int x = 0;
  frexpf(amax, &x);
  return amax > 0.0f && isfinite(amax) ? 14 - x : 0;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Where the warps' o rows go in shared memory for the CTA merge. bf16 V: each
// lane owns the contiguous quarter [(D/4) t, (D/4)(t+1)) of its rows, stored
// as 4 quarters at stride D/4 + 4 (conflict-free float4 stores). q8 V: lane t
// owns dims 32a + 8t + {0..7} of group a; rows are plain (stride D + 16).
template <int D, bool kGroupMajorDims>
struct WarpOLayout;
template <int D>
struct WarpOLayout<D, false> {
  __device__ static void store(float* row, const float (&o)[D / 8][4], int r, int t, float inv_scale) {
    float* dst = row + t * merge_quarter_stride(D);
#pragma unroll
    for (int j = 0; j < D / 8; j += 4) {
      *reinterpret_cast<float4*>(dst + j) = make_float4(o[j][2 * r], o[j + 1][2 * r], o[j + 2][2 * r], o[j + 3][2 * r]);
      *reinterpret_cast<float4*>(dst + D / 8 + j) =
          make_float4(o[j][2 * r + 1], o[j + 1][2 * r + 1], o[j + 2][2 * r + 1], o[j + 3][2 * r + 1]);
    }
  }
  __device__ static int offset(int d) { return (d / (D / 4)) * merge_quarter_stride(D) + d % (D / 4); }
};
template <int D>
struct WarpOLayout<D, true> {
  __device__ static void store(float* row, const float (&o)[D / 8][4], int r, int t, float inv_scale) {
#pragma unroll
    for (int a = 0; a < D / 32; ++a) {
      float* dst = row + 32 * a + 8 * t;
      *reinterpret_cast<float4*>(dst) = make_float4(o[4 * a][2 * r] * inv_scale, o[4 * a + 1][2 * r] * inv_scale,
                                                    o[4 * a + 2][2 * r] * inv_scale, o[4 * a + 3][2 * r] * inv_scale);
      *reinterpret_cast<float4*>(dst + 4) =
          make_float4(o[4 * a][2 * r + 1] * inv_scale, o[4 * a + 1][2 * r + 1] * inv_scale,
                      o[4 * a + 2][2 * r + 1] * inv_scale, o[4 * a + 3][2 * r + 1] * inv_scale);
    }
  }
  __device__ static int offset(int d) { return d; }
};

// N consecutive bf16 values (N = 2, 4 or 8) in one load of 4, 8 or 16
// bytes (aligned to that), read as floats.
template <int N>
struct Bf16Run {
  uint32_t w[N / 2];
  __device__ __forceinline__ void load(const uint16_t* p) {
    if constexpr (N == 8) {
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    } else if constexpr (N == 4) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      w[0] = u.x, w[1] = u.y;
    } else {
      static_assert(N == 2, "runs of 2, 4 or 8 values");
      w[0] = *reinterpret_cast<const uint32_t*>(p);
    }
  }
  __device__ __forceinline__ float operator[](int i) const {
    const uint32_t x = w[i / 2];
    return __uint_as_float(i % 2 ? x & 0xffff0000u : x << 16);
  }
};

// The exact window's part of one (sequence, KV head) (DecodeParams::xk / xv):
// keys [begin, end) from bf16 rows on CUDA cores (at most window_pages pages:
// a few tiles), q as given (the original basis: exact rows are not rotated).
// Warp w takes the 16-key tiles from begin + 16 w on, every 4th; a tile's
// loads are all issued before its arithmetic (one memory round trip per
// tile: the window is read while the packed CTAs stream the cache, at loaded
// latency). Scores: lanes (key, half) dot a key's half row with q, for 4
// heads at a time; o: lane l accumulates dims [l D/32, (l + 1) D/32). Leaves
// each warp's state where the tensor-core path leaves its own: warp_m /
// warp_l [warp][kMaxGroup] (log2 domain: scores are scaled by q_scale),
// warp_o [warp][G] rows in the layout the CTA merge reads (OL::offset).
// q_group: the group's G rows of D floats, in global memory (written by a
// kernel before: read through L2) or, kQShared, in this CTA's shared memory.
template <int D, class OL, bool kQShared>
__device__ void exact_window_part(const DecodeParams& p, const float* q_group, int kvh, const SeqRows& rows, int begin,
                                  int end, float* warp_m, float* warp_l, float* warp_o) {
  constexpr int kHeads = 4, kPer = D / 32, kChunks = D / 16;  // a lane's half row: kChunks runs of 8
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, G = p.G;
  const int key_lane = lane & 15, half = lane >> 4;
  const uint16_t* xk = reinterpret_cast<const uint16_t*>(p.xk.code);
  const uint16_t* xv = reinterpret_cast<const uint16_t*>(p.xv.code);
  for (int h0 = 0; h0 < G; h0 += kHeads) {
    float o[kHeads][kPer], m[kHeads], l[kHeads];
#pragma unroll
    for (int r = 0; r < kHeads; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.0f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) o[r][j] = 0.0f;
    }
    for (int kb = begin + warp * kTileKeys; kb < end; kb += kWarps * kTileKeys) {
      // The tile's 16 keys are rows row0 .. row0 + 15 of one page (kv_store.hpp).
      const int i = rows.index_of(kb);
      const size_t row0 = rows.geo.row(rows.pages[i] - p.n_packed_pages, kvh, kb - i * rows.geo.page_tokens);
      Bf16Run<8> kk[kChunks];
      const uint16_t* krow = xk + (row0 + key_lane) * D + half * (D / 2);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) kk[c].load(krow + 8 * c);
      Bf16Run<kPer> vv[kTileKeys];
#pragma unroll
      for (int k = 0; k < kTileKeys; ++k) vv[k].load(xv + (row0 + k) * D + lane * kPer);
      const bool valid = kb + key_lane < end;  // keys past the sequence's last are masked
#pragma unroll
      for (int r = 0; r < kHeads; ++r) {
        float s = 0.0f;
        if (h0 + r < G) {
          const float* qh = q_group + size_t(h0 + r) * D + half * (D / 2);
#pragma unroll
          for (int c = 0; c < kChunks; ++c) {
            const float4* q4 = reinterpret_cast<const float4*>(qh + 8 * c);
            const float4 a = kQShared ? q4[0] : __ldcg(q4), b = kQShared ? q4[1] : __ldcg(q4 + 1);
            s = fmaf(a.x, kk[c][0], s);
            s = fmaf(a.y, kk[c][1], s);
            s = fmaf(a.z, kk[c][2], s);
            s = fmaf(a.w, kk[c][3], s);
            s = fmaf(b.x, kk[c][4], s);
            s = fmaf(b.y, kk[c][5], s);
            s = fmaf(b.z, kk[c][6], s);
            s = fmaf(b.w, kk[c][7], s);
          }
        }
        s += __shfl_xor_sync(0xffffffffu, s, 16);  // the other half row
        s = valid ? s * p.q_scale : -INFINITY;
        float mx = s;
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float m_new = fmaxf(m[r], mx);  // finite: the tile's first key is the sequence's
        const float alpha = exp2f(m[r] - m_new), e = exp2f(s - m_new);
        float sum = e;
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
#pragma unroll
        for (int j = 0; j < kPer; ++j) o[r][j] *= alpha;
#pragma unroll
        for (int k = 0; k < kTileKeys; ++k) {
          const float pk = __shfl_sync(0xffffffffu, e, k);
#pragma unroll
          for (int j = 0; j < kPer; ++j) o[r][j] = fmaf(pk, vv[k][j], o[r][j]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kHeads; ++r) {
      const int head = h0 + r;
      if (head >= G) break;
      if (lane == 0) {
        warp_m[warp * kMaxGroup + head] = m[r];
        warp_l[warp * kMaxGroup + head] = l[r];
      }
#pragma unroll
      for (int j = 0; j < kPer; ++j)
        warp_o[(warp * G + head) * merge_row_stride(D) + OL::offset(lane * kPer + j)] = o[r][j];
    }
  }
}

// Two resident CTAs per SM (8 warps) for every instance: bf16 tiles need
// ~240 registers. q8 was tried at 3 CTAs (registers capped at 168): it spills
// and decodes 10-17 % slower (docs/perf.md).
//
// Keys-major form (kKM, G <= 8; the staged low-bit sides): the transposes,
// S^T = K Q^T and O^T = V^T P^T, so that the tile's 16 keys are the M of the
// mma and the group's heads its N = 8: half the mma of the form above (whose
// M = 16 rows hold G <= 16 heads), half the accumulators (o^T: D/16 m-tiles,
// lane (g, t): dims km_dim(mt, g / g + 8) of heads 2t, 2t+1), half the
// exponentials. Q^T's B fragments (lane (g, t): head g, the K map's dims)
// stay in registers; P^T's come from S^T's C fragment by movmatrix.
#ifndef KVQ_KM_MIN_BLOCKS
#define KVQ_KM_MIN_BLOCKS 3
#endif
#define KVQ_KM_MIN_BLOCKS_EXPR (kKM ? KVQ_KM_MIN_BLOCKS : 2)
// The fused q path (DecodeParams::q_fused): q = RoPE(norm(q_raw)) of the
// group's G rows at the step's position `pos`, each warp a row at a time,
// into dst [G][stride] (shared memory), then a CTA barrier. q_raw was written
// by a kernel before this grid's predecessor: read through L2.
template <int D>
__device__ __forceinline__ void fused_q_rows(const DecodeParams& p, const float* q_raw, int G, int pos, float* dst,
                                             int stride, int warp, int lane) {
  constexpr int kPer = D / 32;
  for (int row = warp; row < G; row += kWarps) {
    int dim[kPer];
    rope_lane_dims<kPer>(p.rope.neox, lane, dim);
    float x[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) x[j] = __ldcg(q_raw + size_t(row) * D + dim[j]);
    norm_rope_row<kPer>(x, dim, p.q_norm, p.q_eps, pos, p.rope);
#pragma unroll
    for (int j = 0; j < kPer; ++j) dst[row * stride + dim[j]] = x[j];
  }
  __syncthreads();
}

template <int D, kv::Family KF, int KB, bool KQ, kv::Family VF, int VB, bool kKM>
__global__ void __launch_bounds__(kThreads, KVQ_KM_MIN_BLOCKS_EXPR) flash_decode_kernel(DecodeParams p) {
  using IH = InstanceHooks<D, KF, KB, KQ, VF, VB, kKM>;
  using KH = typename IH::K;
  using VH = typename IH::V;
  using OL = WarpOLayout<D, VH::kGroupMajorDims>;
  constexpr int kLutBytes = IH::kLutBytes;
  constexpr bool kKStaged = KH::kStaged, kVStaged = VH::kStaged, kAnyStaged = kKStaged || kVStaged;
  constexpr int kQDims = KQ ? 2 * D : D;  // q_rot, then S q_rot for +qjl
  constexpr int kSteps = kQDims / 16;     // k-steps of S = Q K^T
  constexpr int kDimTiles = D / 8;   // n-tiles of O
  constexpr int kQParts = KH::kQParts;
  static_assert(kSteps * kQParts <= (D / 16) * kQFragEntries, "q fragments exceed their shared memory");
  // D <= 128: the next tile's K and this tile's V are in flight while S is
  // computed. D = 256 has no registers for that (o alone is 128 per lane).
  constexpr bool kPipelined = D <= 128;

  extern __shared__ __align__(16) unsigned char smem[];
  const int G = p.G;
  uint4* q_frag = reinterpret_cast<uint4*>(smem);
  float* warp_o = reinterpret_cast<float*>(smem);  // after the key loop (aliases q_frag)
  uint32_t* lut_k = reinterpret_cast<uint32_t*>(smem + region0_bytes(D, G, kKM));  // pair tables (low-bit formats)
  uint32_t* lut_v = lut_k + KH::kLutEntries;
  // This warp's ring of staging slots (staged sides only): slot j holds the
  // K rows, then the V rows, of one of its tiles.
  unsigned char* ring = smem + region0_bytes(D, G, kKM) + kLutBytes + (threadIdx.x >> 5) * kDecodeStages * IH::kSlotBytes;
  float* warp_m = reinterpret_cast<float*>(smem + region0_bytes(D, G, kKM) + IH::kExtraBytes);
  float* warp_l = warp_m + kWarps * kMaxGroup;
  float* split_w = warp_l + kWarps * kMaxGroup;
  int* is_last = reinterpret_cast<int*>(split_w + gridDim.x * G);
  // [G][D] (rotated sides only), 16-byte aligned after is_last: smem_bytes'
  // 16 spare bytes cover the alignment.
  float* rot_rows = reinterpret_cast<float*>(
      smem + ((reinterpret_cast<uintptr_t>(is_last + 1) - reinterpret_cast<uintptr_t>(smem) + 15) & ~uintptr_t(15)));

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x, n_splits = gridDim.x, kvh = blockIdx.y, seq = blockIdx.z;
  // This CTA's (sequence, KV head): its q / out rows, counter and partials.
  const int seq_head = seq * int(gridDim.y) + kvh;
  // The row of the first key of the 16-key tile at kb (a multiple of 16): a
  // tile never straddles a page (kv_store.hpp), so its keys are rows
  // tile_row(kb) + 0..15. Direct hooks take (row0, key) and address row0 +
  // key: they get tile_row(kb) - kb (modulo 2^64, which the unsigned
  // arithmetic undoes).
  SeqRows seq_rows = p.rows;
  if (seq_rows.pages) seq_rows.pages += size_t(seq) * p.table_stride;
  auto tile_row = [&](int kb) -> size_t { return seq_rows.row(kvh, kb); };

  // This CTA's keys: whole 16-key tiles from a multiple of 16; the last tile of
  // the context may run past it (those keys are masked, their loads clamped).
  struct Range {
    int key0, key_end, n_tiles;
  };
  // With a window, keys [0, w) of the packed store are split over the packed
  // CTAs (range_of(w)); the others take the window (exact_window_part).
  const int range_splits = p.window_pages ? p.packed_splits : n_splits;
  const bool exact_cta = p.window_pages && split >= p.packed_splits;
  auto range_of = [&](int len) {
    const int chunk = ((len + range_splits - 1) / range_splits + kTileKeys - 1) / kTileKeys * kTileKeys;
    Range r;
    r.key0 = split * chunk;
    r.key_end = min(r.key0 + chunk, len);
    r.n_tiles = r.key_end > r.key0 && !exact_cta ? (r.key_end - r.key0 + kTileKeys - 1) / kTileKeys : 0;
    return r;
  };
  // The first key of a sequence of len keys that is in its window (len
  // without one): its table's exact suffix (page ids >= n_packed_pages, at
  // most window_pages entries; kv_store.hpp) among the pages holding keys.
  auto window_begin = [&](int len) {
    if (!p.window_pages) return len;
    const int used = seq_rows.index_of(len - 1) + 1;
    int i = used;
    while (i > 0 && used - i < p.window_pages && seq_rows.pages[i - 1] >= p.n_packed_pages) --i;
    return min(len, i * seq_rows.geo.page_tokens);
  };
  // Lane 0 asks L2 for the K and V rows of one of this CTA's tiles (a hint:
  // see l2_prefetch.cuh), clamped to the cache.
  // One tile's n <= 16 rows are consecutive (one page).
  auto prefetch_side = [&](const GpuKvSide& s, size_t row, int n) {
    prefetch_l2(s.code + row * s.code_bytes, uint64_t(n) * s.code_bytes);
    if (s.side_bytes) prefetch_l2(s.side + row * s.side_bytes, uint64_t(n) * s.side_bytes);
  };
  auto prefetch_tile = [&](const Range& r, int tile) {
    if (lane != 0 || tile >= r.n_tiles) return;
    const int kb = r.key0 + tile * kTileKeys;
    const int n = min(kTileKeys, p.capacity - kb);
    if (n <= 0) return;
    const size_t row = tile_row(kb);
    prefetch_side(p.k, row, n);
    prefetch_side(p.v, row, n);
  };

  // Dependent launch (dependent_launch.cuh): the K/V row at the position was
  // just written by the preceding kernel, so no load before the wait. The
  // keys before it were written by earlier steps, so their first tiles may
  // be prefetched into L2 first, from the position as it reads now (a hint:
  // a stale position only makes the hint less useful).
  trace_event(p.trace, 0);
  allow_dependents();
  if (p.prefetch_tiles > 0) {
    const int early_pos = p.pos_dev ? reinterpret_cast<const volatile int*>(p.pos_dev)[seq] : p.pos;
    const Range early = range_of(window_begin(min(max(early_pos, 0), p.capacity - 1) + 1));
    for (int j = 0; j < p.prefetch_tiles; ++j) prefetch_tile(early, warp + j * kWarps);
  }
  // Fused q: nothing this kernel reads before the step's own K/V row was
  // written by its predecessor (the raw q comes from the one before, which
  // had finished before this grid could start: qk_rope_store), so the wait
  // moves to the warp that takes the tile holding that row (takes_newest),
  // after its loop.
  // That warp's wait also keeps the launch chain transitive: this grid
  // completes only after its predecessor has.
  if (!p.q_fused) wait_for_predecessor();
  trace_event(p.trace, 1);

  // From L2: with the fused q path no wait has made this grid's view of
  // memory current (the position changes every step).
  const int len = (p.pos_dev ? __ldcg(p.pos_dev + seq) : p.pos) + 1;
  const int packed_end = window_begin(len);  // keys [packed_end, len): the window's
  if (exact_cta) {
    const float* q_raw = p.q + size_t(seq_head) * G * D;
    if (p.q_fused) {
      // The window holds the step's own row, which the predecessor (the
      // store) writes: this CTA's wait is the grid's only one (no packed key
      // is written in the step), and it keeps the launch chain transitive.
      // Its q = RoPE(norm(q_raw)) into shared memory [G][D], in the original
      // basis (window rows are not rotated).
      wait_for_predecessor();
      fused_q_rows<D>(p, q_raw, G, len - 1, rot_rows, D, warp, lane);
      exact_window_part<D, OL, true>(p, rot_rows, kvh, seq_rows, packed_end, len, warp_m, warp_l, warp_o);
    } else {
      exact_window_part<D, OL, false>(p, q_raw, kvh, seq_rows, packed_end, len, warp_m, warp_l, warp_o);
    }
    __syncthreads();
  } else {
  const Range range = range_of(packed_end);
  const int key0 = range.key0, n_tiles = range.n_tiles;
  const int last_key = packed_end - 1;
  // This CTA's tile holding key len - 1 (fused q only; -1 if none): kept out
  // of the tile loops (n_main: the tiles before it), so that they have no
  // branch for it; its warp takes it after the loop, after the wait, from L2.
  const int newest = p.q_fused && range.key_end == len ? n_tiles - 1 : -1;
  const int n_main = newest >= 0 ? newest : n_tiles;
  const bool takes_newest = newest >= 0 && newest % kWarps == warp;

  typename KH::Tile k_cur;
  typename VH::Tile v_cur;

  // Q fragments: entry (step, lane) -> rows g, g+8, dims 32(step/2) + 8t + 4(step%2) + {0..3},
  // split exactly into kQParts parts (bf16 or fp16 per the K hooks). Each
  // thread builds D / 64 entries; all their q loads (float4) are issued
  // first, so building costs one L2 round trip. fp16 parts need q scaled by
  // a power of two 2^e so that its largest value is near 2^14 (no part is
  // subnormal, none overflows); scores are multiplied by 2^-e afterwards.
  float score_factor = 1.0f;
  const float* q_group = p.q + size_t(seq_head) * G * D;
  int q_stride = D;
  if (p.q_fused) {  // q = RoPE(norm(q_raw)) of the group's rows, into shared memory [G][kQDims]
    fused_q_rows<D>(p, q_group, G, len - 1, rot_rows, kQDims, warp, lane);
    q_group = rot_rows;
    q_stride = kQDims;
  }
  if (p.q_rot || KQ) {  // rotated K side: q_rot = R q, once per CTA, into shared memory [G][kQDims]
    for (int row = warp; row < G; row += kWarps) {
      float* dst = rot_rows + row * kQDims;
      if (p.q_rot) {
        warp_rotate_row(rotation_kind(p.k.family), p.q_rot + size_t(kvh) * p.k.rot_stride,
                        q_group + size_t(row) * q_stride, dst, D, lane, false);
      } else {
        for (int d = lane; d < D; d += 32) dst[d] = q_group[size_t(row) * q_stride + d];
      }
    }
    __syncthreads();
    if constexpr (KQ) {  // S q_rot into the second half of each row (S row j: D floats)
      // A thread per row j of S, read once for 4 of the group's q rows at a
      // time (4 independent FMA chains; each output's chain is the same as
      // one thread per output would form, so the bits do not change).
      const float* S = p.k.qjl + size_t(kvh) * D * D;
      for (int j = tid; j < D; j += kThreads) {
        const float* sj = S + size_t(j) * D;
        for (int row0 = 0; row0 < G; row0 += 4) {
          const float* qr[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) qr[r] = rot_rows + min(row0 + r, G - 1) * kQDims;  // past G: computed, not stored
          float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          for (int i = 0; i < D; i += 4) {
            const float4 sv = __ldg(reinterpret_cast<const float4*>(sj + i));
#pragma unroll
            for (int r = 0; r < 4; ++r)
              acc[r] = fmaf(sv.x, qr[r][i], fmaf(sv.y, qr[r][i + 1], fmaf(sv.z, qr[r][i + 2], fmaf(sv.w, qr[r][i + 3], acc[r]))));
          }
#pragma unroll
          for (int r = 0; r < 4; ++r)
            if (row0 + r < G) rot_rows[(row0 + r) * kQDims + D + j] = acc[r];
        }
      }
      __syncthreads();
    }
    q_group = rot_rows;
    q_stride = kQDims;
  }
  uint32_t qb[kKM ? kSteps : 1][kQParts][2];  // keys-major: Q^T's B fragments
  if constexpr (kKM) {
    // Pre-scale over the whole group as below, then lane (g, t) takes head g
    // at the K map's dims: step 2p + h: b0 = dims 32p + 8t + 4h + {0, 1}, b1 = + {2, 3}.
    float amax = 0.0f;
    for (int e = tid; e < G * (kQDims / 4); e += kThreads) {
      const float4 v = *reinterpret_cast<const float4*>(q_group + size_t(e / (kQDims / 4)) * q_stride + 4 * (e % (kQDims / 4)));
      amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    const int e = q_prescale_exponent(amax, p.q_scale, warp_m, lane, warp);
    const float factor = ldexpf(p.q_scale, e);
    score_factor = ldexpf(1.0f, -e);
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      const int d0 = 32 * (step >> 1) + 8 * t + 4 * (step & 1);
      const float4 v = g < G ? *reinterpret_cast<const float4*>(q_group + size_t(g) * q_stride + d0)
                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      float rest[4] = {v.x * factor, v.y * factor, v.z * factor, v.w * factor};
#pragma unroll
      for (int part = 0; part < kQParts; ++part) {
        uint32_t bits[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float as_float;
          bits[i] = ptx::f16_bits(rest[i], as_float);
          rest[i] -= as_float;  // exact
        }
        qb[step][part][0] = ptx::pack2(bits[0], bits[1]);
        qb[step][part][1] = ptx::pack2(bits[2], bits[3]);
      }
    }
  } else
  {
    constexpr int kEntries = kSteps * 32 / kThreads;
    static_assert(kEntries * kThreads == kSteps * 32, "entries must split evenly over the threads");
    float4 qv[kEntries][2];
#pragma unroll
    for (int n = 0; n < kEntries; ++n) {
      const int e = tid + n * kThreads, step = e >> 5, fl = e & 31, fg = fl >> 2, ft = fl & 3;
      const int d0 = 32 * (step >> 1) + 8 * ft + 4 * (step & 1);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = fg + 8 * r;
        qv[n][r] = row < G ? *reinterpret_cast<const float4*>(q_group + size_t(row) * q_stride + d0)
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
    float factor = p.q_scale;
    if constexpr (KH::kPrescale) {
      float amax = 0.0f;
#pragma unroll
      for (int n = 0; n < kEntries; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          amax = fmaxf(amax, fmaxf(fmaxf(fabsf(qv[n][r].x), fabsf(qv[n][r].y)), fmaxf(fabsf(qv[n][r].z), fabsf(qv[n][r].w))));
      const int e = q_prescale_exponent(amax, p.q_scale, warp_m, lane, warp);
      factor = ldexpf(p.q_scale, e);
      score_factor = ldexpf(1.0f, -e);
    }
#pragma unroll
    for (int n = 0; n < kEntries; ++n) {
      const int e = tid + n * kThreads, step = e >> 5, fl = e & 31;
      float rest[2][4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        rest[r][0] = qv[n][r].x * factor;
        rest[r][1] = qv[n][r].y * factor;
        rest[r][2] = qv[n][r].z * factor;
        rest[r][3] = qv[n][r].w * factor;
      }
#pragma unroll
      for (int part = 0; part < kQParts; ++part) {
        uint32_t bits[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float as_float;
            bits[r][i] = KH::kF16 ? ptx::f16_bits(rest[r][i], as_float) : ptx::bf16_bits(rest[r][i], as_float);
            rest[r][i] -= as_float;  // exact
          }
        q_frag[(step * kQParts + part) * 32 + fl] =
            make_uint4(ptx::pack2(bits[0][0], bits[0][1]), ptx::pack2(bits[1][0], bits[1][1]),
                       ptx::pack2(bits[0][2], bits[0][3]), ptx::pack2(bits[1][2], bits[1][3]));
      }
    }
  }
  // Staged sides: the warp's tile i goes to ring slot i % kDecodeStages (K
  // rows, then V rows); every call commits one cp.async group, empty past the
  // warp's last tile, so that waiting for all but the newest
  // kDecodeStages - 1 groups always means "tile i has arrived".
  // The newest tile (fused q) is not staged ahead: its warp copies it after
  // its loop, after the wait (stage_newest).
  auto slot_k = [&](int i) { return ring + (i % kDecodeStages) * IH::kSlotBytes; };
  auto slot_v = [&](int i) { return slot_k(i) + stage_bytes_of<KH>(); };
  auto stage_copy = [&](int i) {
    const int tile = warp + i * kWarps;
    const int kb = key0 + tile * kTileKeys;
    const int n_valid = min(kTileKeys, packed_end - kb);
    const size_t row = tile_row(kb);
    if constexpr (kKStaged) KH::stage(p.k, row, n_valid, slot_k(i), lane);
    if constexpr (kVStaged) VH::stage(p.v, row, n_valid, slot_v(i), lane);
  };
  auto stage = [&](int i) {
    if constexpr (kAnyStaged) {
      const int tile = warp + i * kWarps;
      if (tile < n_main) stage_copy(i);
      ptx::cp_async_commit();
    }
  };
  // Every group before it is complete or empty: the warp's loop is done.
  auto stage_newest = [&](int i) {
    if constexpr (kAnyStaged) {
      stage_copy(i);
      ptx::cp_async_commit();
      ptx::cp_async_wait<0>();
      __syncwarp();
    }
  };
  // The first tiles are requested now, after the q loads: a warp's loads
  // return in order, so the q loads above do not wait for K and V (from HBM;
  // their first tile was asked into L2 before the wait).
  if constexpr (kAnyStaged)
    for (int i = 0; i < kDecodeStages - 1; ++i) stage(i);
  if (kPipelined && warp < n_main) {
    const int kb = key0 + warp * kTileKeys;
    const size_t row0 = tile_row(kb) - kb;
    if constexpr (!kKStaged) KH::load(p.k, row0, kb, last_key, g, t, k_cur, false);
    if constexpr (!kVStaged) VH::load(p.v, row0, kb, last_key, g, t, v_cur, false);
  }
  if constexpr (KH::kLutEntries > 0) KH::build_lut(p.k, lut_k, tid, kThreads);
  if constexpr (VH::kLutEntries > 0) VH::build_lut(p.v, lut_v, tid, kThreads);
  __syncthreads();
  typename KH::Ctx k_ctx;
  typename VH::Ctx v_ctx;
  KH::init_ctx(p.k, lut_k, k_ctx);
  VH::init_ctx(p.v, lut_v, v_ctx);
  trace_event(p.trace, 2);

  if constexpr (kKM) {
    // Online softmax per head (columns 2t, 2t+1 of S^T); l is this lane's
    // share (its keys), summed over the 8 lanes of a column at the end.
    float o[D / 16][4];
#pragma unroll
    for (int j = 0; j < D / 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    // One tile, staged in ring slot i.
    auto step = [&](int i, int tile) {
      const int kb = key0 + tile * kTileKeys;
      const size_t row = tile_row(kb);
      KH::bind_km(p.k, row, slot_k(i), g, k_cur);
      VH::bind_km(p.v, row, slot_v(i), g, v_cur);
      float s[4];  // keys g (0, 1), g + 8 (2, 3); heads 2t (0, 2), 2t + 1 (1, 3)
      KH::scores_km(qb, k_cur, lane, s, k_ctx);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[j] *= score_factor;  // exact: a power of two
        if (kb + g + 8 * (j >> 1) > last_key) s[j] = -INFINITY;
      }
      float alpha[2], m_use[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float tile_max = fmaxf(s[c], s[c + 2]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
        const float m_new = fmaxf(m_run[c], tile_max);
        m_use[c] = m_new == -INFINITY ? 0.0f : m_new;  // all masked so far: exp2(-inf - 0) = 0, no NaN
        alpha[c] = exp2f(m_run[c] - m_use[c]);
        m_run[c] = m_new;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) s[j] = exp2f(s[j] - m_use[j & 1]);
#pragma unroll
      for (int c = 0; c < 2; ++c) l_run[c] = l_run[c] * alpha[c] + (s[c] + s[c + 2]);
      VH::accumulate_km(s, alpha, v_cur, o, v_ctx);
    };
    for (int i = 0, tile = warp; tile < n_main; ++i, tile += kWarps) {
      stage(i + kDecodeStages - 1);
      ptx::cp_async_wait<kDecodeStages - 1>();
      __syncwarp();
      step(i, tile);
      __syncwarp();  // this slot is restaged by the next iteration
    }
    if (takes_newest) {
      wait_for_predecessor();
      stage_newest(newest / kWarps);
      step(newest / kWarps, newest);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) l_run[c] += __shfl_xor_sync(0xffffffffu, l_run[c], off);
    __syncthreads();  // every warp is done with the q region, which warp_o overwrites
    trace_event(p.trace, 3);
    if (g == 0) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        warp_m[warp * kMaxGroup + 2 * t + c] = m_run[c];
        warp_l[warp * kMaxGroup + 2 * t + c] = l_run[c];
      }
    }
    constexpr float kInv = 1.0f / VH::kOutScale;
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int head = 2 * t + (j & 1);
        if (head < G) warp_o[(warp * G + head) * merge_row_stride(D) + VH::km_dim(mt, g + 8 * (j >> 1))] = o[mt][j] * kInv;
      }
    __syncthreads();
  } else {
  // Online softmax state of rows g (index 0) and g + 8 (index 1); l is this
  // lane's share (its columns), summed over the quad at the end.
  float o[kDimTiles][4];
#pragma unroll
  for (int j = 0; j < kDimTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

  // Masks the tile, updates m and l, and turns S into P (in place) plus the
  // rescale factor of o.
  auto softmax = [&](int tile, float (&s)[2][4], float (&alpha)[2]) {
    const int kb = key0 + tile * kTileKeys;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (KH::kPrescale) s[nt][i] *= score_factor;  // exact: a power of two
        if (kb + 8 * nt + 2 * t + (i & 1) > last_key) s[nt][i] = -INFINITY;
      }
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float tile_max = quad_max(fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1])));
      const float m_new = fmaxf(m_run[r], tile_max);
      m_use[r] = m_new == -INFINITY ? 0.0f : m_new;  // all masked so far: exp2(-inf - 0) = 0, no NaN
      alpha[r] = exp2f(m_run[r] - m_use[r]);
      m_run[r] = m_new;
    }
    float row_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[nt][i] = exp2f(s[nt][i] - m_use[i >> 1]);
        row_sum[i >> 1] += s[nt][i];
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + row_sum[r];
  };

  // Direct sides, pipelined (D <= 128): the next tile's K and this tile's V
  // are in flight while S is computed; not pipelined (D = 256): loaded when
  // needed, o and V need the registers. Staged sides: the tile kDecodeStages
  // - 1 ahead is requested, then this one's slot is waited for.
  // One tile: staged sides in ring slot i, direct ones in k_cur / v_cur
  // (pipelined) or loaded here (V, not pipelined; from L2 for the newest).
  auto step = [&](int i, int tile, bool is_newest) {
    const int kb = key0 + tile * kTileKeys;
    if constexpr (kKStaged) KH::bind(p.k, tile_row(kb), slot_k(i), g, t, k_cur);
    if constexpr (kVStaged) VH::bind(p.v, tile_row(kb), slot_v(i), g, t, v_cur);
    float s[2][4], alpha[2];
    KH::scores(q_frag, k_cur, lane, s, k_ctx);
    softmax(tile, s, alpha);
    if constexpr (!kPipelined && !kVStaged) VH::load(p.v, tile_row(kb) - kb, kb, last_key, g, t, v_cur, is_newest);
    VH::accumulate(s, alpha, v_cur, o, v_ctx);
  };
  for (int i = 0, tile = warp; tile < n_main; ++i, tile += kWarps) {
    const int kb = key0 + tile * kTileKeys;
    if constexpr (kAnyStaged) {
      stage(i + kDecodeStages - 1);
      ptx::cp_async_wait<kDecodeStages - 1>();
      __syncwarp();  // the other lanes' copies of this slot are visible
    }
    typename KH::Tile k_next;
    bool has_next = false;
    if constexpr (kPipelined) {
      if constexpr (!kVStaged)
        if (tile != warp) VH::load(p.v, tile_row(kb) - kb, kb, last_key, g, t, v_cur, false);
      if constexpr (!kKStaged) {
        has_next = tile + kWarps < n_main;
        const int kb_next = kb + kWarps * kTileKeys;
        if (has_next) KH::load(p.k, tile_row(kb_next) - kb_next, kb_next, last_key, g, t, k_next, false);
      }
    } else {
      if constexpr (!kKStaged) KH::load(p.k, tile_row(kb) - kb, kb, last_key, g, t, k_cur, false);
    }
    step(i, tile, false);
    if constexpr (kPipelined && !kKStaged)
      if (has_next) k_cur = k_next;
    if constexpr (kAnyStaged) __syncwarp();  // this slot is restaged by the next iteration
  }
  if (takes_newest) {  // after the wait, from L2 (ld.global.cg / cp.async.cg): the step's own row
    const int i = newest / kWarps, kb = key0 + newest * kTileKeys;
    wait_for_predecessor();
    stage_newest(i);
    const size_t row0 = tile_row(kb) - kb;
    if constexpr (!kKStaged) KH::load(p.k, row0, kb, last_key, g, t, k_cur, true);
    if constexpr (kPipelined && !kVStaged) VH::load(p.v, row0, kb, last_key, g, t, v_cur, true);
    step(i, newest, true);
  }

  // ---- merge the 4 warps in shared memory
#pragma unroll
  for (int r = 0; r < 2; ++r) l_run[r] = quad_sum(l_run[r]);
  __syncthreads();  // every warp is done with q_frag, which warp_o overwrites
  trace_event(p.trace, 3);
  if (t == 0) {
    warp_m[warp * kMaxGroup + g] = m_run[0];
    warp_m[warp * kMaxGroup + g + 8] = m_run[1];
    warp_l[warp * kMaxGroup + g] = l_run[0];
    warp_l[warp * kMaxGroup + g + 8] = l_run[1];
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    if (row < G) OL::store(warp_o + (warp * G + row) * merge_row_stride(D), o, r, t, 1.0f / VH::kOutScale);
  }
  __syncthreads();

  }
  }  // the packed keys (exact_cta: the window's, above)

  const size_t part_base = (size_t(seq_head) * n_splits + split) * G;  // this CTA's first (split, row) record
  const int n_vec = G * (D / 4);
  for (int e = tid; e < n_vec; e += kThreads) {
    const int row = e / (D / 4), d = (e % (D / 4)) * 4;
    SoftmaxMerge<kWarps> mg;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mg.m[w] = warp_m[w * kMaxGroup + row];
    mg.finish_max();
    float L = 0.0f;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = mg.weight(w);
      L += wt * warp_l[w * kMaxGroup + row];
      const float4 x = *reinterpret_cast<const float4*>(warp_o + (w * G + row) * merge_row_stride(D) + OL::offset(d));
      acc.x += wt * x.x;
      acc.y += wt * x.y;
      acc.z += wt * x.z;
      acc.w += wt * x.w;
    }
    *reinterpret_cast<float4*>(p.part_o + (part_base + row) * D + d) = acc;
    if (d == 0) {
      p.part_m[part_base + row] = mg.M;
      p.part_l[part_base + row] = L;
    }
  }

  // ---- the last CTA of this KV head merges the n_splits partials
  __threadfence();  // release: this CTA's partial before its arrival
  __syncthreads();
  if (tid == 0) *is_last = atomicAdd(&p.counters[seq_head], 1u) == unsigned(n_splits - 1);
  __syncthreads();
  trace_event(p.trace, 4);
  if (!*is_last) return;
  __threadfence();  // acquire: the other CTAs' partials (read with ld.cg: L2, never a stale L1 line)
  if (tid == 0) p.counters[seq_head] = 0;  // every CTA of this launch has arrived: ready for the next launch

  const size_t head_base = size_t(seq_head) * n_splits * G;  // record (split s, row r) = head_base + s * G + r
  for (int row = warp; row < G; row += kWarps) {
    constexpr int kPerLane = kMaxDecodeSplits / 32;
    float m_s[kPerLane], l_s[kPerLane], M = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int s = lane + 32 * i;
      m_s[i] = s < n_splits ? __ldcg(p.part_m + head_base + size_t(s) * G + row) : -INFINITY;
      l_s[i] = s < n_splits ? __ldcg(p.part_l + head_base + size_t(s) * G + row) : 0.0f;
      M = fmaxf(M, m_s[i]);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float L = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      m_s[i] = merge_weight_log2(m_s[i], M);  // now the split's weight
      L += m_s[i] * l_s[i];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
    const float inv_l = L > 0.0f ? 1.0f / L : 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int s = lane + 32 * i;
      if (s < n_splits) split_w[s * G + row] = m_s[i] * inv_l;
    }
  }
  __syncthreads();
  // A rotated V side's packed partials are in its rotated basis and the
  // window's (exact_window_part) in the original one: the first are summed,
  // un-rotated, and the second added after.
  const int rotated_splits = p.o_rot && p.window_pages ? p.packed_splits : n_splits;
  for (int e = tid; e < n_vec; e += kThreads) {
    const int row = e / (D / 4), d = (e % (D / 4)) * 4;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 16
    for (int s = 0; s < rotated_splits; ++s) {
      const float w = split_w[s * G + row];
      const float4 x = __ldcg(reinterpret_cast<const float4*>(p.part_o + (head_base + size_t(s) * G + row) * D + d));
      acc.x += w * x.x;
      acc.y += w * x.y;
      acc.z += w * x.z;
      acc.w += w * x.w;
    }
    float* dst = p.o_rot ? rot_rows + row * D + d : p.out + (size_t(seq_head) * G + row) * D + d;
    *reinterpret_cast<float4*>(dst) = acc;
  }
  if (p.o_rot) {  // rotated V side: o = R^T o_rot, once per KV head
    __syncthreads();
    for (int row = warp; row < G; row += kWarps)
      warp_rotate_row(rotation_kind(p.v.family), p.o_rot + size_t(kvh) * p.v.rot_stride, rot_rows + row * D,
                      p.out + (size_t(seq_head) * G + row) * D, D, lane, true);
    if (rotated_splits < n_splits) {  // the window's partials, in the original basis
      __syncthreads();
      for (int e = tid; e < n_vec; e += kThreads) {
        const int row = e / (D / 4), d = (e % (D / 4)) * 4;
        float4* dst = reinterpret_cast<float4*>(p.out + (size_t(seq_head) * G + row) * D + d);
        float4 acc = *dst;
        for (int s = rotated_splits; s < n_splits; ++s) {
          const float w = split_w[s * G + row];
          const float4 x = __ldcg(reinterpret_cast<const float4*>(p.part_o + (head_base + size_t(s) * G + row) * D + d));
          acc.x += w * x.x;
          acc.y += w * x.y;
          acc.z += w * x.z;
          acc.w += w * x.w;
        }
        *dst = acc;
      }
    }
  }
  if (p.trace) {
    __syncthreads();
    trace_event(p.trace, 5);
  }
}

// ---- instances: (head_dim, K storage family, K bits, V storage family, V
// bits); storage_family() maps rq8 to q8 and rotor, planar to iso (same
// bytes). The default set covers every named codec at head_dim 128 (the
// Qwen3 / Llama shape) and the seam's bf16 / q8 shapes;
// KVQ_ALL_KERNEL_INSTANCES adds head_dim 64 and 256 for every named codec
// and the mixed bf16 / q8 pairs. find_decode_instance() (choose_attention)
// answers from this same list.
#define KVQ_DECODE_NAMED_INSTANCES(X, d) \
  X(d, q8, 8, false, turbo, 4)                  \
  X(d, q8, 8, false, turbo, 3)                  \
  X(d, q8, 8, false, turbo, 2)                  \
  X(d, q8, 8, false, tcq, 3)                    \
  X(d, q8, 8, false, tcq, 2)                    \
  X(d, turbo, 3, false, turbo, 3)               \
  X(d, turbo, 4, false, turbo, 4)               \
  X(d, q8, 8, false, iso, 4)                    \
  X(d, q8, 8, false, iso, 3)                    \
  X(d, iso, 4, false, bf16, 16)                 \
  X(d, iso, 3, false, bf16, 16)                 \
  X(d, iso, 3, false, iso, 3)                   \
  X(d, iso, 4, false, iso, 4)                   \
  X(d, fp8, 8, false, fp8, 8)            \
  X(d, iso, 3, true, iso, 3)              \
  X(d, iso, 4, true, iso, 4)              \
  X(d, iso, 3, true, bf16, 16)            \
  X(d, iso, 4, true, bf16, 16)
#define KVQ_DECODE_DEFAULT_INSTANCES(X) \
  X(64, bf16, 16, false, bf16, 16)             \
  X(128, bf16, 16, false, bf16, 16)            \
  X(256, bf16, 16, false, bf16, 16)            \
  X(64, q8, 8, false, q8, 8)                   \
  X(128, q8, 8, false, q8, 8)                  \
  KVQ_DECODE_NAMED_INSTANCES(X, 128)
#if defined(KVQ_ALL_KERNEL_INSTANCES)
#define KVQ_DECODE_EXTRA_INSTANCES(X) \
  X(256, q8, 8, false, q8, 8)                \
  X(64, q8, 8, false, bf16, 16)              \
  X(128, q8, 8, false, bf16, 16)             \
  X(256, q8, 8, false, bf16, 16)             \
  X(64, bf16, 16, false, q8, 8)              \
  X(128, bf16, 16, false, q8, 8)             \
  X(256, bf16, 16, false, q8, 8)             \
  KVQ_DECODE_NAMED_INSTANCES(X, 64)   \
  KVQ_DECODE_NAMED_INSTANCES(X, 256)
#else
#define KVQ_DECODE_EXTRA_INSTANCES(X)
#endif
#define KVQ_DECODE_INSTANCES(X) KVQ_DECODE_DEFAULT_INSTANCES(X) KVQ_DECODE_EXTRA_INSTANCES(X)

using KernelFn = void (*)(DecodeParams);

struct Instance {
  int D;
  kv::Family k;
  int k_bits;
  bool k_qjl;
  kv::Family v;
  int v_bits;
  KernelFn fn;        // the form above, any G <= 16
  int extra_bytes;    // its InstanceHooks::kExtraBytes
  KernelFn fn_km;     // the keys-major form (G <= 8), or null
  int extra_bytes_km;
};
template <int D, kv::Family KF, int KB, bool KQ, kv::Family VF, int VB>
constexpr KernelFn keys_major_fn() {
  if constexpr (InstanceHooks<D, KF, KB, KQ, VF, VB>::kKeysMajorEligible)
    return flash_decode_kernel<D, KF, KB, KQ, VF, VB, true>;
  else
    return nullptr;
}
#define KVQ_DECODE_ENTRY(d, kf, kb, kq, vf, vb)                                                                 \
  {d,                                                                                                       \
   kv::Family::kf,                                                                                          \
   kb,                                                                                                      \
   kq,                                                                                                      \
   kv::Family::vf,                                                                                          \
   vb,                                                                                                      \
   flash_decode_kernel<d, kv::Family::kf, kb, kq, kv::Family::vf, vb, false>,                              \
   InstanceHooks<d, kv::Family::kf, kb, kq, kv::Family::vf, vb>::kExtraBytes,                              \
   keys_major_fn<d, kv::Family::kf, kb, kq, kv::Family::vf, vb>(),                                         \
   InstanceHooks<d, kv::Family::kf, kb, kq, kv::Family::vf, vb, true>::kExtraBytes},
const Instance kInstances[] = {KVQ_DECODE_INSTANCES(KVQ_DECODE_ENTRY)};
#undef KVQ_DECODE_ENTRY
constexpr int kNumInstances = int(sizeof(kInstances) / sizeof(kInstances[0]));

// The bits that select an instance: fixed-width families have one format.
int instance_bits(kv::Family f, int bits) {
  switch (storage_family(f)) {
    case kv::Family::bf16: return 16;
    case kv::Family::q8:
    case kv::Family::fp8: return 8;
    default: return bits;
  }
}

// Index into kInstances, or -1.
int find_instance(int D, kv::Family k, int k_bits, bool k_qjl, kv::Family v, int v_bits) {
  const kv::Family ks = storage_family(k), vs = storage_family(v);
  const int kb = instance_bits(k, k_bits), vb = instance_bits(v, v_bits);
  for (int i = 0; i < kNumInstances; ++i)
    if (kInstances[i].D == D && kInstances[i].k == ks && kInstances[i].k_bits == kb && kInstances[i].k_qjl == k_qjl &&
        kInstances[i].v == vs &&
        kInstances[i].v_bits == vb)
      return i;
  return -1;
}

constexpr int kMaxKeysMajorGroup = 8;  // N of the keys-major mma

// The kernel of an instance for a group size: keys-major where it exists.
struct Variant {
  KernelFn fn;
  int extra_bytes;
  bool keys_major;
};
Variant variant_of(int index, int G) {
  const Instance& in = kInstances[index];
  if (in.fn_km && G <= kMaxKeysMajorGroup) return {in.fn_km, in.extra_bytes_km, true};
  return {in.fn, in.extra_bytes, false};
}

// Opt in to the most dynamic shared memory any G needs (G = 16, D = 256:
// ~74 KB), once per (device, kernel); then resident CTAs per SM for
// (instance, G), queried once per device with the largest shared memory a
// launch may take (the largest split count, the rotated row buffer), so the
// split count never asks for more CTAs than fit in one wave.
int resident_ctas(const DeviceContext& ctx, int index, int G) {
  const Variant v = variant_of(index, G);
  const int D = kInstances[index].D;
  KernelResources& kernels = ctx.kernels();
  kernels.raise_limit(reinterpret_cast<const void*>(v.fn),
                      smem_bytes(D, kMaxGroup, kMaxDecodeSplits, true, v.extra_bytes, v.keys_major), [&](size_t bytes) {
                        KVQ_CUDA_CHECK(
                            cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
                      });
  const size_t smem = smem_bytes(D, G, kMaxDecodeSplits, true, v.extra_bytes, v.keys_major);
  return kernels.resident_ctas(reinterpret_cast<const void*>(v.fn), kThreads, smem, [&] {
    int n = 0;
    KVQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, v.fn, kThreads, smem));
    return n;
  });
}

int instance_for(const GpuKvLayer& layer) {
  const int i =
      find_instance(layer.head_dim, layer.k.family, layer.k.bits, layer.k.has_qjl, layer.v.family, layer.v.bits);
  KVQ_CHECK(i >= 0, Errc::internal, "flash_decode: no kernel instance for head_dim ", layer.head_dim, ", K ",
            kv::family_name(layer.k.family), layer.k.bits, ", V ", kv::family_name(layer.v.family), layer.v.bits);
  return i;
}

}  // namespace

DecodeInstance find_decode_instance(int head_dim, kv::Family k, int k_bits, bool k_qjl, kv::Family v, int v_bits,
                                    int G) {
  DecodeInstance r;
  r.index = find_instance(head_dim, k, k_bits, k_qjl, v, v_bits);
  r.keys_major = r.index >= 0 && variant_of(r.index, G).keys_major;
  return r;
}

bool flash_decode_instance_exists(int head_dim, kv::Family k, int k_bits, bool k_qjl, kv::Family v, int v_bits) {
  return find_instance(head_dim, k, k_bits, k_qjl, v, v_bits) >= 0;
}

bool flash_decode_supported(int n_heads, int n_kv_heads, int head_dim, const float* q, const float* out) {
  if (n_kv_heads <= 0 || n_heads <= 0 || n_heads % n_kv_heads != 0) return false;
  const int G = n_heads / n_kv_heads;
  if (G < 1 || G > kMaxGroup) return false;
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return false;
  return reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
}

// One resident wave of the decode kernel for this store: every CTA streams
// its keys at the same time and they finish together (a second, partial
// wave would double the latency). Less the CTAs the store's encode
// (qk_rope_store: 2 n_kv warps, 4 CTAs at 8 KV heads) may displace while it
// runs beside a fused-q launch (KernelSettings::decode_split_reserve).
int decode_wave(const GpuKvLayer& layer, int G, const DeviceContext& ctx) {
  return std::max(
      1, resident_ctas(ctx, instance_for(layer), G) * ctx.sm_count() - std::max(0, ctx.settings.decode_split_reserve));
}

int flash_decode_splits(const GpuKvLayer& layer, int n_heads, const DeviceContext& ctx, int n_seq, int capacity) {
  const int G = n_heads / layer.n_kv_heads;
  // One resident wave (decode_wave); a batch shares it among its sequences.
  const int wave = decode_wave(layer, G, ctx);
  const int heads = layer.n_kv_heads * std::max(n_seq, 1);
  int n = std::max(1, wave / heads);
  n = std::min(n, kMaxDecodeSplits);
  // No more splits than tiles in a full sequence (the capacity, never the
  // positions: a recorded launch serves every step).
  const int cap = capacity > 0 ? capacity : layer.max_tokens;
  // A batch whose heads leave one wave less than 90 % used (B = 32 and 64 at
  // 8 KV heads and 3 CTAs per SM: 66 %) takes the fewest splits that fill
  // whole waves to 90 %, as long as every split keeps kMinBatchSplitKeys
  // keys of a full sequence. H200, bonsai-8b, B = 32 (docs/perf.md, session
  // 16): tsym3 +18 % tok/s at 4k, k8vturbo2 +14 % (at 16k, with the page
  // shift: +47 % / +44 %), B = 64 0-2 %; at ~600 keys (prompt 512) such splits were slower
  // (session 15), which the minimum keeps out. (ncu times one such launch
  // alike with 1 or 3 splits, ~123 us at 4k; by the step times, inside a
  // step the one-split grid takes ~40 us per layer longer.)
  auto used = [&](int splits) {
    const long ctas = long(heads) * splits, waves = (ctas + wave - 1) / wave;
    return double(ctas) / double(waves * wave);
  };
  if (n == 1 && used(1) < 0.9) {
    for (int s = 2; s <= 8 && cap / s >= kMinBatchSplitKeys; ++s)
      if (used(s) >= 0.9) {
        n = s;
        break;
      }
  }
  n = std::min(n, (cap + kTileKeys - 1) / kTileKeys);
  return std::max(n, 1);
}

void flash_decode(const AttentionPlan& plan, const GpuKvLayer& layer, int pos, const int* pos_dev, const float* q,
                  int n_heads, float scale, float* out, AttentionScratch& scratch, cudaStream_t stream,
                  const QPrep* prep, const DeviceContext& ctx) {
  KVQ_CHECK(pos_dev || (pos >= 0 && pos < layer.max_tokens), Errc::out_of_range, "flash_decode: position ", pos,
            " outside the cache capacity of ", layer.max_tokens);
  DecodeBatch one;
  one.pos = pos;
  one.pos_dev = pos_dev;
  flash_decode_batch(plan, layer, one, q, n_heads, scale, out, scratch, stream, prep, ctx);
}

void flash_decode_batch(const AttentionPlan& plan, const GpuKvLayer& layer, const DecodeBatch& b, const float* q,
                        int n_heads, float scale, float* out, AttentionScratch& scratch, cudaStream_t stream,
                        const QPrep* prep, const DeviceContext& ctx) {
  const int D = layer.head_dim, n_kv = layer.n_kv_heads;
  KVQ_CHECK(flash_decode_supported(n_heads, n_kv, D, q, out), Errc::internal, "flash_decode: unsupported shape (",
            n_heads, " heads, ", n_kv, " KV heads, head_dim ", D, ") or q / out not 16-byte aligned");
  KVQ_CHECK(b.n_seq >= 1 && b.n_seq <= 65535 && (b.n_seq == 1 || (b.pos_dev && b.pages)), Errc::internal,
            "flash_decode: ", b.n_seq, " sequences (more than one need device positions and block tables)");
  KVQ_CHECK(!b.pages || (b.table_stride >= 1 && b.table_stride <= layer.n_pages + layer.n_exact_pages), Errc::internal,
            "flash_decode: block tables of ", b.table_stride, " entries over a store of ", layer.n_pages + layer.n_exact_pages,
            " pages");
  KVQ_CHECK(layer.page_tokens % kTileKeys == 0 || layer.n_pages == 1, Errc::internal, "flash_decode: pages of ",
            layer.page_tokens, " tokens (a 16-key tile must not straddle two)");
  // Tokens one sequence can hold: its table's pages, or the one-sequence
  // store's capacity (the split does not depend on the positions).
  const int capacity = b.pages ? b.table_stride * layer.page_tokens : layer.max_tokens;
  KVQ_CHECK(b.pos_dev || (b.pos >= 0 && b.pos < capacity), Errc::out_of_range, "flash_decode: position ", b.pos,
            " outside the capacity of ", capacity);
  const int index = plan.instance;
  const int G = n_heads / n_kv;
  KVQ_CHECK(index >= 0 && index < kNumInstances && kInstances[index].D == D && plan.of.n_heads == n_heads &&
                variant_of(index, G).keys_major == (plan.kernel == AttentionKernel::decode_km),
            Errc::internal, "flash_decode: a plan made for another store or shape");
  int n_splits = flash_decode_splits(layer, n_heads, ctx, b.n_seq, capacity);
  // A known position needs no more splits than it has key tiles to share
  // (fewer partial states to merge); a device position gets the full split.
  if (!b.pos_dev) n_splits = std::min(n_splits, (b.pos + kMinKeysPerSplit) / kMinKeysPerSplit);
  // The exact window: one more CTA per (sequence, KV head) takes the
  // window's keys (at most window_pages pages) from the bf16 rows; the packed
  // keys keep their splits (taking one of them for the window left each
  // packed split 1.5x the keys at B = 32 and 3 splits: -11 % tok/s, session
  // 18).
  // An identity table (b.pages null) names packed pages only: no window then.
  const bool window = layer.has_window() && b.pages;
  int packed_splits = window ? std::min(n_splits, kMaxDecodeSplits - 1) : n_splits;
  // But where the packed splits fill one wave (one sequence: ~32-48 splits a
  // head), the window's CTAs would start a second one, or take the room
  // kept for the store's encode: one packed split fewer per head keeps the
  // grid in the wave (each split gets 1/(n-1) more keys, ~3 %).
  if (window && packed_splits > 1) {
    const long heads_all = long(b.n_seq) * n_kv, wave = decode_wave(layer, G, ctx);
    if (heads_all * packed_splits <= wave && heads_all * (packed_splits + 1) > wave) --packed_splits;
  }
  if (window) {
    KVQ_CHECK(layer.xk.code && layer.xv.code, Errc::internal, "flash_decode: a windowed store without its bf16 rows");
    n_splits = packed_splits + 1;
  }
  // q left raw (prep: the attention applies q's norm and RoPE) lets the
  // packed CTAs start before the step's store has written; only over a
  // window, where the step writes no packed key, may a batch do that.
  KVQ_CHECK(!prep || b.n_seq == 1 || window, Errc::internal,
            "flash_decode: q left raw for a batch over a store without an exact window");

  const size_t heads = size_t(b.n_seq) * n_kv;  // (sequence, KV head) pairs
  const size_t records = heads * n_splits * G;
  const size_t need = records * (D + 2);
  if (scratch.part.size() < need) scratch.part.resize(need);
  if (scratch.decode_counters.size() < heads) {
    scratch.decode_counters.resize(heads);
    KVQ_CUDA_CHECK(cudaMemsetAsync(scratch.decode_counters.data(), 0, scratch.decode_counters.bytes(), stream));
  }

  DecodeParams p;
  p.k = layer.k;
  p.v = layer.v;
  p.q = q;
  p.out = out;
  p.part_o = scratch.part.data();  // first: float4 aligned
  p.part_m = p.part_o + records * D;
  p.part_l = p.part_m + records;
  p.counters = scratch.decode_counters.data();
  p.pos_dev = b.pos_dev;
  p.pos = b.pos;
  p.rows = layer.rows(b.pages);
  p.table_stride = b.table_stride;
  p.q_fused = prep != nullptr;
  p.q_norm = prep ? prep->norm_w : nullptr;
  p.q_eps = prep ? prep->eps : 0.0f;
  if (prep) p.rope = prep->rope;
  KVQ_CHECK(!prep || prep->rope.inv_freq, Errc::internal, "flash_decode: a raw q without its RoPE table");
  p.G = G;
  p.capacity = capacity;
  p.q_scale = scale * kLog2e;
  p.prefetch_tiles = std::max(0, ctx.settings.attn_prefetch_tiles);
  p.trace = ctx.settings.decode_trace;
  p.xk = layer.xk;
  p.xv = layer.xv;
  p.window_pages = window ? layer.window_pages : 0;
  p.n_packed_pages = layer.n_pages;
  p.packed_splits = packed_splits;
  p.q_rot = is_rotated(layer.k.family) ? layer.k.rot : nullptr;
  p.o_rot = is_rotated(layer.v.family) ? layer.v.rot : nullptr;
  KVQ_CHECK((!is_rotated(layer.k.family) || p.q_rot) && (!is_rotated(layer.v.family) || p.o_rot) &&
                (!layer.k.has_qjl || layer.k.qjl),
            Errc::internal, "flash_decode: a rotated or +qjl store without its tables");
  resident_ctas(ctx, index, G);  // the shared-memory opt-in
  const Variant v = variant_of(index, G);
  launch_dependent(ctx, v.fn, dim3(n_splits, n_kv, b.n_seq), dim3(kThreads),
                   smem_bytes(D, G, n_splits, p.q_rot || p.o_rot || layer.k.has_qjl || p.q_fused, v.extra_bytes,
                              v.keys_major),
                   stream, p);
}

}  // namespace kvq::cuda
