// Tensor-core split-KV flash decoding; work split and merge in
// attention_decode.hpp. This comment documents the register layouts.
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
// prologue. Register use (-Xptxas -v, sm_90): D = 64 148, D = 128 242,
// D = 256 250, no spills: 2 CTAs (8 warps) per SM for D >= 128, 3 for D = 64.
#include "backend/cuda/attention_decode.hpp"

#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/l2_prefetch.cuh"
#include "backend/cuda/lab_trace.cuh"
#include "core/error.hpp"

namespace kvq::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileKeys = 16;
constexpr int kQParts = 3;            // q = hi + mid + lo, exactly
constexpr int kPParts = 3;            // p = hi + mid + lo, exactly
constexpr int kMaxGroup = 16;         // M of the mma
constexpr int kMinKeysPerSplit = 64;  // with a known position: no split gets less than a tile per warp
constexpr float kLog2e = 1.4426950408889634f;

struct DecodeParams {
  const uint16_t* k;     // [n_kv][max_tokens][D] bf16 bits
  const uint16_t* v;
  const float* q;        // [n_heads][D]
  float* out;            // [n_heads][D]
  float* part_o;         // [n_kv][n_splits][G][D] unnormalised partial outputs
  float* part_m;         // [n_kv][n_splits][G] running max (log2 domain)
  float* part_l;         // [n_kv][n_splits][G] running sum
  unsigned* counters;    // [n_kv] arrival counters, 0 between launches
  const int* pos_dev;    // when set, the position is read from here
  int pos;
  int G;
  int max_tokens;
  float q_scale;         // scale * log2(e)
  int prefetch_tiles;    // tiles per warp prefetched before the wait (decode_prefetch_tiles())
  unsigned long long* trace;  // kernel-lab timeline (flash_decode_trace), or null
};


__host__ __device__ constexpr size_t qfrag_bytes(int D) { return size_t(D / 16) * kQParts * 32 * 16; }
__host__ __device__ constexpr int merge_row_stride(int D) { return D + 16; }    // floats; = 4 * (D/4 + 4)
__host__ __device__ constexpr int merge_quarter_stride(int D) { return D / 4 + 4; }
__host__ __device__ constexpr size_t merge_bytes(int D, int G) {
  return size_t(kWarps) * G * merge_row_stride(D) * sizeof(float);
}
__host__ __device__ constexpr size_t region0_bytes(int D, int G) {
  return qfrag_bytes(D) > merge_bytes(D, G) ? qfrag_bytes(D) : merge_bytes(D, G);
}
__host__ __device__ constexpr size_t smem_bytes(int D, int G, int n_splits) {
  return region0_bytes(D, G) + 2 * kWarps * kMaxGroup * sizeof(float) + size_t(n_splits) * G * sizeof(float) + 16;
}

__device__ __forceinline__ uint4 load_stream16(const uint16_t* p) {
  // Read-only for the kernel's lifetime; streamed once, so keep it out of L1.
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Volatile so the compiler keeps these loads in the key loop instead of
// hoisting all D/16 * 3 fragments into registers.
__device__ __forceinline__ uint4 load_shared16(const uint4* p) {
  uint4 r;
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint4& a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// bf16 round-to-nearest of x, returned as bits and as the float it represents.
__device__ __forceinline__ uint32_t bf16_bits(float x, float& as_float) {
  const __nv_bfloat16 b = __float2bfloat16_rn(x);
  as_float = __bfloat162float(b);
  return __bfloat16_as_ushort(b);
}

__device__ __forceinline__ uint32_t pack2(uint32_t low_bits, uint32_t high_bits) { return low_bits | (high_bits << 16); }

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int D>
__global__ void __launch_bounds__(kThreads, 2) flash_decode_kernel(DecodeParams p) {
  constexpr int kSteps = D / 16;     // k-steps of S = Q K^T
  constexpr int kKLoads = D / 32;    // 16-byte K loads per key and lane
  constexpr int kVLoads = D / 64;    // 16-byte V loads per key and lane
  constexpr int kDimTiles = D / 8;   // n-tiles of O
  constexpr int kQuarter = D / 4;    // contiguous output dims per lane and row
  // D <= 128: the next tile's K and this tile's V are in flight while S is
  // computed. D = 256 has no registers for that (o alone is 128 per lane).
  constexpr bool kPipelined = D <= 128;

  extern __shared__ __align__(16) unsigned char smem[];
  const int G = p.G;
  uint4* q_frag = reinterpret_cast<uint4*>(smem);
  float* warp_o = reinterpret_cast<float*>(smem);  // after the key loop (aliases q_frag)
  float* warp_m = reinterpret_cast<float*>(smem + region0_bytes(D, G));
  float* warp_l = warp_m + kWarps * kMaxGroup;
  float* split_w = warp_l + kWarps * kMaxGroup;
  int* is_last = reinterpret_cast<int*>(split_w + gridDim.x * G);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x, n_splits = gridDim.x, kvh = blockIdx.y;
  const uint16_t* k_head = p.k + size_t(kvh) * p.max_tokens * D;
  const uint16_t* v_head = p.v + size_t(kvh) * p.max_tokens * D;

  // This CTA's keys: whole 16-key tiles from a multiple of 16; the last tile of
  // the context may run past it (those keys are masked, their loads clamped).
  struct Range {
    int key0, key_end, n_tiles;
  };
  auto range_of = [&](int len) {
    const int chunk = ((len + n_splits - 1) / n_splits + kTileKeys - 1) / kTileKeys * kTileKeys;
    Range r;
    r.key0 = split * chunk;
    r.key_end = min(r.key0 + chunk, len);
    r.n_tiles = r.key_end > r.key0 ? (r.key_end - r.key0 + kTileKeys - 1) / kTileKeys : 0;
    return r;
  };
  // Lane 0 asks L2 for the K and V rows of one of this CTA's tiles (a hint:
  // see l2_prefetch.cuh), clamped to the cache.
  auto prefetch_tile = [&](const Range& r, int tile) {
    if (lane != 0 || tile >= r.n_tiles) return;
    const int kb = r.key0 + tile * kTileKeys;
    const int n = min(kTileKeys, p.max_tokens - kb);
    if (n <= 0) return;
    prefetch_l2(k_head + size_t(kb) * D, uint64_t(n) * D * 2);
    prefetch_l2(v_head + size_t(kb) * D, uint64_t(n) * D * 2);
  };

  // Dependent launch (dependent_launch.cuh): the K/V row at the position was
  // just written by the preceding kernel, so no load before the wait. The
  // keys before it were written by earlier steps, so their first tiles may
  // be prefetched into L2 first, from the position as it reads now (a hint:
  // a stale position only makes the hint less useful).
  trace_event(p.trace, 0);
  allow_dependents();
  if (p.prefetch_tiles > 0) {
    const int early_pos = p.pos_dev ? *reinterpret_cast<const volatile int*>(p.pos_dev) : p.pos;
    const Range early = range_of(min(max(early_pos, 0), p.max_tokens - 1) + 1);
    for (int j = 0; j < p.prefetch_tiles; ++j) prefetch_tile(early, warp + j * kWarps);
  }
  wait_for_predecessor();
  trace_event(p.trace, 1);

  const int len = (p.pos_dev ? *p.pos_dev : p.pos) + 1;
  const Range range = range_of(len);
  const int key0 = range.key0, n_tiles = range.n_tiles;
  const int last_key = len - 1;

  // Lane (g, t): keys g and 8 + g of the tile, 16-byte chunks at dims 32c + 8t.
  auto load_k = [&](int tile, uint4 (&kr)[2][kKLoads]) {
    const int kb = key0 + tile * kTileKeys;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint16_t* row = k_head + size_t(min(kb + 8 * nt + g, last_key)) * D + 8 * t;
#pragma unroll
      for (int c = 0; c < kKLoads; ++c) kr[nt][c] = load_stream16(row + 32 * c);
    }
  };
  // Lane (g, t): keys 2t, 2t+1, 2t+8, 2t+9 of the tile, dims [(D/8) g, (D/8)(g+1)).
  auto load_v = [&](int tile, uint4 (&vr)[4][kVLoads]) {
    const int kb = key0 + tile * kTileKeys;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = kb + 2 * t + (i & 1) + 8 * (i >> 1);
      const uint16_t* row = v_head + size_t(min(key, last_key)) * D + (D / 8) * g;
#pragma unroll
      for (int c = 0; c < kVLoads; ++c) vr[i][c] = load_stream16(row + 8 * c);
    }
  };

  uint4 k_cur[2][kKLoads];
  uint4 v_cur[4][kVLoads];

  // Q fragments: entry (step, lane) -> rows g, g+8, dims 32(step/2) + 8t + 4(step%2) + {0..3}.
  // Each thread builds D / 64 entries; all their q loads (float4) are issued
  // first, so building costs one L2 round trip.
  {
    constexpr int kEntries = kSteps * 32 / kThreads;
    static_assert(kEntries * kThreads == kSteps * 32, "entries must split evenly over the threads");
    const float* q_group = p.q + size_t(kvh) * G * D;
    float4 qv[kEntries][2];
#pragma unroll
    for (int n = 0; n < kEntries; ++n) {
      const int e = tid + n * kThreads, step = e >> 5, fl = e & 31, fg = fl >> 2, ft = fl & 3;
      const int d0 = 32 * (step >> 1) + 8 * ft + 4 * (step & 1);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = fg + 8 * r;
        qv[n][r] = row < G ? *reinterpret_cast<const float4*>(q_group + size_t(row) * D + d0)
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
#pragma unroll
    for (int n = 0; n < kEntries; ++n) {
      const int e = tid + n * kThreads, step = e >> 5, fl = e & 31;
      float rest[2][4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        rest[r][0] = qv[n][r].x * p.q_scale;
        rest[r][1] = qv[n][r].y * p.q_scale;
        rest[r][2] = qv[n][r].z * p.q_scale;
        rest[r][3] = qv[n][r].w * p.q_scale;
      }
#pragma unroll
      for (int part = 0; part < kQParts; ++part) {
        uint32_t bits[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float as_float;
            bits[r][i] = bf16_bits(rest[r][i], as_float);
            rest[r][i] -= as_float;  // exact
          }
        q_frag[(step * kQParts + part) * 32 + fl] =
            make_uint4(pack2(bits[0][0], bits[0][1]), pack2(bits[1][0], bits[1][1]), pack2(bits[0][2], bits[0][3]),
                       pack2(bits[1][2], bits[1][3]));
      }
    }
  }
  // Pipelined: the first tile's K and V are requested now, after the q loads:
  // a warp's loads return in order, and q (in L2) would otherwise wait for
  // K and V (from HBM; their first tile was asked into L2 before the wait).
  if (kPipelined && warp < n_tiles) {
    load_k(warp, k_cur);
    load_v(warp, v_cur);
  }
  __syncthreads();
  trace_event(p.trace, 2);

  // Online softmax state of rows g (index 0) and g + 8 (index 1); l is this
  // lane's share (its columns), summed over the quad at the end.
  float o[kDimTiles][4];
#pragma unroll
  for (int j = 0; j < kDimTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

  // S of one tile: two accumulator sets (even / odd k-steps) halve the
  // dependent mma chain; the small q parts go first.
  auto scores = [&](const uint4 (&kr)[2][kKLoads], float (&s)[2][4]) {
    float acc[2][2][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) acc[a][nt][0] = acc[a][nt][1] = acc[a][nt][2] = acc[a][nt][3] = 0.0f;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      const int c = step >> 1, h = step & 1;
#pragma unroll
      for (int part = kQParts - 1; part >= 0; --part) {
        const uint4 a = load_shared16(&q_frag[(step * kQParts + part) * 32 + lane]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) mma_bf16(acc[h][nt], a, word_of(kr[nt][c], 2 * h), word_of(kr[nt][c], 2 * h + 1));
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = acc[0][nt][i] + acc[1][nt][i];
  };

  // Masks the tile, updates m and l, and returns P split exactly into bf16
  // parts (part 0 = hi) as A fragments, plus the rescale factor of o.
  auto softmax = [&](int tile, float (&s)[2][4], uint4 (&pf)[kPParts], float (&alpha)[2]) {
    const int kb = key0 + tile * kTileKeys;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (kb + 8 * nt + 2 * t + (i & 1) > last_key) s[nt][i] = -INFINITY;
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float tile_max = quad_max(fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1])));
      const float m_new = fmaxf(m_run[r], tile_max);
      m_use[r] = m_new == -INFINITY ? 0.0f : m_new;  // all masked so far: exp2(-inf - 0) = 0, no NaN
      alpha[r] = exp2f(m_run[r] - m_use[r]);
      m_run[r] = m_new;
    }
    uint32_t bits[kPParts][2][4];
    float row_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float rest = exp2f(s[nt][i] - m_use[i >> 1]);
        row_sum[i >> 1] += rest;  // the parts sum to exactly this
#pragma unroll
        for (int part = 0; part < kPParts; ++part) {
          float as_float;
          bits[part][nt][i] = bf16_bits(rest, as_float);
          rest -= as_float;  // exact
        }
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + row_sum[r];
#pragma unroll
    for (int part = 0; part < kPParts; ++part)
      pf[part] = make_uint4(pack2(bits[part][0][0], bits[part][0][1]), pack2(bits[part][0][2], bits[part][0][3]),
                            pack2(bits[part][1][0], bits[part][1][1]), pack2(bits[part][1][2], bits[part][1][3]));
  };

  // o = alpha o + P V (small parts of P first). Adding each tile's P V to a
  // fresh accumulator and then to o with fmaf would keep the tensor core's
  // truncating fp32 accumulation out of the long sum over tiles, but costs
  // registers that D = 128/256 do not have (spills); its bias is ~2^-24 per
  // mma relative to |o|, ~3e-6 over the 93 mma of a 64k-key warp.
  auto accumulate_pv = [&](const uint4 (&pf)[kPParts], const float (&alpha)[2], const uint4 (&vr)[4][kVLoads]) {
#pragma unroll
    for (int j = 0; j < kDimTiles; ++j) {
      // Dim j of the lane's chunk: 16-byte load j / 8, word (j % 8) / 2, half j % 2.
      const int c = j >> 3, w = (j & 7) >> 1;
      const unsigned sel = (j & 1) ? 0x7632u : 0x5410u;
      const uint32_t b0 = __byte_perm(word_of(vr[0][c], w), word_of(vr[1][c], w), sel);
      const uint32_t b1 = __byte_perm(word_of(vr[2][c], w), word_of(vr[3][c], w), sel);
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
#pragma unroll
      for (int part = kPParts - 1; part >= 0; --part) mma_bf16(o[j], pf[part], b0, b1);
    }
  };

  if constexpr (kPipelined) {
    for (int tile = warp; tile < n_tiles; tile += kWarps) {
      if (tile != warp) load_v(tile, v_cur);
      uint4 k_next[2][kKLoads];
      const bool has_next = tile + kWarps < n_tiles;
      if (has_next) load_k(tile + kWarps, k_next);
      float s[2][4], alpha[2];
      scores(k_cur, s);
      uint4 pf[kPParts];
      softmax(tile, s, pf, alpha);
      accumulate_pv(pf, alpha, v_cur);
      if (has_next) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int c = 0; c < kKLoads; ++c) k_cur[nt][c] = k_next[nt][c];
      }
    }
  } else {
    for (int tile = warp; tile < n_tiles; tile += kWarps) {
      load_k(tile, k_cur);  // not carried across iterations: o and V need the registers
      float s[2][4], alpha[2];
      scores(k_cur, s);
      uint4 pf[kPParts];
      softmax(tile, s, pf, alpha);
      load_v(tile, v_cur);
      accumulate_pv(pf, alpha, v_cur);
    }
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
  {
    constexpr int RS = merge_row_stride(D), QS = merge_quarter_stride(D);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r;
      if (row < G) {
        float* dst = warp_o + (warp * G + row) * RS + t * QS;
#pragma unroll
        for (int j = 0; j < kDimTiles; j += 4) {
          *reinterpret_cast<float4*>(dst + j) = make_float4(o[j][2 * r], o[j + 1][2 * r], o[j + 2][2 * r], o[j + 3][2 * r]);
          *reinterpret_cast<float4*>(dst + D / 8 + j) =
              make_float4(o[j][2 * r + 1], o[j + 1][2 * r + 1], o[j + 2][2 * r + 1], o[j + 3][2 * r + 1]);
        }
      }
    }
  }
  __syncthreads();

  const size_t part_base = (size_t(kvh) * n_splits + split) * G;  // this CTA's first (split, row) record
  const int n_vec = G * (D / 4);
  for (int e = tid; e < n_vec; e += kThreads) {
    const int row = e / (D / 4), d = (e % (D / 4)) * 4;
    float m_w[kWarps], M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      m_w[w] = warp_m[w * kMaxGroup + row];
      M = fmaxf(M, m_w[w]);
    }
    float L = 0.0f;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = m_w[w] == -INFINITY ? 0.0f : exp2f(m_w[w] - M);
      L += wt * warp_l[w * kMaxGroup + row];
      const float4 x = *reinterpret_cast<const float4*>(warp_o + (w * G + row) * merge_row_stride(D) +
                                                        (d / kQuarter) * merge_quarter_stride(D) + d % kQuarter);
      acc.x += wt * x.x;
      acc.y += wt * x.y;
      acc.z += wt * x.z;
      acc.w += wt * x.w;
    }
    *reinterpret_cast<float4*>(p.part_o + (part_base + row) * D + d) = acc;
    if (d == 0) {
      p.part_m[part_base + row] = M;
      p.part_l[part_base + row] = L;
    }
  }

  // ---- the last CTA of this KV head merges the n_splits partials
  __threadfence();  // release: this CTA's partial before its arrival
  __syncthreads();
  if (tid == 0) *is_last = atomicAdd(&p.counters[kvh], 1u) == unsigned(n_splits - 1);
  __syncthreads();
  trace_event(p.trace, 4);
  if (!*is_last) return;
  __threadfence();  // acquire: the other CTAs' partials (read with ld.cg: L2, never a stale L1 line)
  if (tid == 0) p.counters[kvh] = 0;  // every CTA of this launch has arrived: ready for the next launch

  const size_t head_base = size_t(kvh) * n_splits * G;  // record (split s, row r) = head_base + s * G + r
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
      m_s[i] = m_s[i] == -INFINITY ? 0.0f : exp2f(m_s[i] - M);  // now the split's weight
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
  for (int e = tid; e < n_vec; e += kThreads) {
    const int row = e / (D / 4), d = (e % (D / 4)) * 4;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 16
    for (int s = 0; s < n_splits; ++s) {
      const float w = split_w[s * G + row];
      const float4 x = __ldcg(reinterpret_cast<const float4*>(p.part_o + (head_base + size_t(s) * G + row) * D + d));
      acc.x += w * x.x;
      acc.y += w * x.y;
      acc.z += w * x.z;
      acc.w += w * x.w;
    }
    *reinterpret_cast<float4*>(p.out + (size_t(kvh) * G + row) * D + d) = acc;
  }
  if (p.trace) {
    __syncthreads();
    trace_event(p.trace, 5);
  }
}


template <int D>
void prepare_kernel() {
  // Opt in to the most dynamic shared memory any G needs (G = 16, D = 256:
  // ~74 KB), once per instantiation.
  static const bool done = [] {
    KVQ_CUDA_CHECK(cudaFuncSetAttribute(flash_decode_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(smem_bytes(D, kMaxGroup, kMaxDecodeSplits))));
    return true;
  }();
  (void)done;
}

// Resident CTAs per SM for (D, G), queried once (with the largest split count's
// shared memory, which the launch never exceeds).
template <int D>
int resident_ctas(int G) {
  static std::atomic<int> cached[kMaxGroup + 1];
  int n = cached[G].load(std::memory_order_relaxed);
  if (n == 0) {
    prepare_kernel<D>();
    KVQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, flash_decode_kernel<D>, kThreads,
                                                                 smem_bytes(D, G, kMaxDecodeSplits)));
    n = std::max(n, 1);
    cached[G].store(n, std::memory_order_relaxed);
  }
  return n;
}

int resident_ctas_for(int D, int G) {
  switch (D) {
    case 64: return resident_ctas<64>(G);
    case 128: return resident_ctas<128>(G);
    default: return resident_ctas<256>(G);
  }
}

template <int D>
void launch(const DecodeParams& p, int n_splits, int n_kv, cudaStream_t stream) {
  prepare_kernel<D>();
  launch_dependent(flash_decode_kernel<D>, dim3(n_splits, n_kv), dim3(kThreads), smem_bytes(D, p.G, n_splits), stream, p);
}

}  // namespace

bool flash_decode_supported(int n_heads, int n_kv_heads, int head_dim, const float* q, const float* out) {
  if (n_kv_heads <= 0 || n_heads <= 0 || n_heads % n_kv_heads != 0) return false;
  const int G = n_heads / n_kv_heads;
  if (G < 1 || G > kMaxGroup) return false;
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return false;
  return reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
}

namespace {
int initial_prefetch_tiles() {
  const char* env = std::getenv("KVQ_ATTN_PREFETCH");
  return env && *env ? std::max(0, std::atoi(env)) : 1;
}
int g_prefetch_tiles = initial_prefetch_tiles();
unsigned long long* g_trace = nullptr;
}  // namespace

int decode_prefetch_tiles() { return g_prefetch_tiles; }
void set_decode_prefetch_tiles(int tiles) { g_prefetch_tiles = std::max(0, tiles); }
void flash_decode_trace(unsigned long long* events) { g_trace = events; }

int flash_decode_splits(const KvLayerView& layer, int n_heads) {
  const int G = n_heads / layer.n_kv_heads;
  // One resident wave: every CTA streams its keys at the same time and they
  // finish together (a second, partial wave would double the latency).
  const int wave = resident_ctas_for(layer.head_dim, G) * sm_count();
  int n = std::max(1, wave / layer.n_kv_heads);
  n = std::min(n, kMaxDecodeSplits);
  n = std::min(n, (layer.max_tokens + kTileKeys - 1) / kTileKeys);  // no more splits than tiles in a full cache
  return std::max(n, 1);
}

void flash_decode(const KvLayerView& layer, int pos, const int* pos_dev, const float* q, int n_heads, float scale,
                  float* out, AttentionScratch& scratch, cudaStream_t stream) {
  const int D = layer.head_dim, n_kv = layer.n_kv_heads;
  KVQ_CHECK(flash_decode_supported(n_heads, n_kv, D, q, out), Errc::internal, "flash_decode: unsupported shape (",
            n_heads, " heads, ", n_kv, " KV heads, head_dim ", D, ")");
  KVQ_CHECK(pos_dev || (pos >= 0 && pos < layer.max_tokens), Errc::out_of_range, "flash_decode: position ", pos,
            " outside the cache capacity of ", layer.max_tokens);
  const int G = n_heads / n_kv;
  int n_splits = flash_decode_splits(layer, n_heads);
  // A known position needs no more splits than it has key tiles to share
  // (fewer partial states to merge); a device position gets the full split.
  if (!pos_dev) n_splits = std::min(n_splits, (pos + kMinKeysPerSplit) / kMinKeysPerSplit);

  const size_t records = size_t(n_kv) * n_splits * G;
  const size_t need = records * (D + 2);
  if (scratch.part.size() < need) scratch.part.resize(need);
  if (scratch.decode_counters.size() < size_t(n_kv)) {
    scratch.decode_counters.resize(n_kv);
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
  p.pos_dev = pos_dev;
  p.pos = pos;
  p.G = G;
  p.max_tokens = layer.max_tokens;
  p.q_scale = scale * kLog2e;
  p.prefetch_tiles = decode_prefetch_tiles();
  p.trace = g_trace;
  switch (D) {
    case 64: launch<64>(p, n_splits, n_kv, stream); break;
    case 128: launch<128>(p, n_splits, n_kv, stream); break;
    default: launch<256>(p, n_splits, n_kv, stream); break;
  }
}

}  // namespace kvq::cuda
