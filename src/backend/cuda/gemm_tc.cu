// Tensor-core batched GEMM for decode steps (gemm_tc.hpp): Y[b][m] = sum_k
// W[m][k] u_b[k] for B <= 64 input rows, int8 mma.sync with the weights as A
// (M = output rows) and the staged inputs as B (N = batch).
//
// STAGING ONCE PER LAUNCH
//   x is quantized to int8 once per launch (stage_x_int8: one warp per 128
//   values of a token: x^2 sum, u = x * g, amax, scale, codes) into a
//   caller-owned workspace, already in the shared-memory order of xq and sx
//   below; the GEMM's CTAs copy their K slices of it with cp.async. Before,
//   every CTA quantized its whole K slice for all B tokens (~150 instructions
//   per 128 values per lane, the IEEE division of the rounding), and every
//   m-tile repeated it: gate/up (96 CTAs, C = 1) quantized all of x 96 times,
//   which made the time grow with B far above the mma loop's instruction
//   count (H200, Q1_0 layer at B = 64: 411 us). Both paths call the same
//   stage_segment (quantize4_int8 of stage_int8.cuh), and the prestaged
//   path adds the per-128-column x^2 sums in the same order, so results are
//   bit-identical; the in-CTA path (no workspace) stays for A/B measurements.
//   The staging kernel waits for its predecessor (x, and the previous
//   launch's reads of the workspace); the GEMM waits for the staging kernel.
//   Q1_0 gets one x scale per 128 columns, the others one per 32
//   (x_scale_span; the sx layout keeps four entries per group either way).
//   Workspace (ws_layout, NT8 token slots, slots past the batch zero):
//   codes [NT8][cols] (a token row in xq order: block pair P at 64 P),
//   scales [cols/64][NT8/2][4] (sx order), x^2 sums [NT8][cols/128].
//
// WORK SPLIT
//   A CTA (16 warps, 512 threads, one per SM: up to 128 registers) owns an
//   m-tile of 256 rows — the fused outputs' rows concatenated (Q, then K,
//   then V), or for SwiGLU 128 gate rows (warps 0-7) and the same 128 up rows
//   (warps 8-15) — and one of C slices of K (C = 1, 2 or 4, at most
//   KernelSettings::gemm_tc_max_cluster: 8 is allowed but measured slower,
//   chosen so that m-tiles x C fills the SMs). The C CTAs of an m-tile form a thread-block
//   cluster: each computes the partial products of its K slice, writes them
//   to its own shared memory, and after a cluster barrier CTA r sums rows
//   [r 256/C, (r+1) 256/C) of all C partials in rank order (distributed
//   shared memory), applies 1/rms and the epilogue and stores y. No global
//   workspace for the partial sums, deterministic, every weight read by
//   exactly one warp once.
//   Warp w: rows 16w..16w+15 of the m-tile, all N = 8 NT tokens (NT n-tiles of
//   8, NT = 1, 2, 4, 8 by batch): NT mma per 32-column k-step, accumulators
//   acc[NT][4] fp32 (Q1_0 also s[NT][4], see below).
//   A K slice is walked in tiles of up to `tg` groups of 128 columns: per tile
//   the CTA copies the tile's prestaged x (all NT8 token slots; without a
//   workspace: every warp stages its share of the batch rows), barrier,
//   every warp multiplies its rows over the tile, barrier.
//
// MMA FRAGMENTS (PTX ISA, mma.m16n8k32 .s8; lane = 4 g + t)
//   A 16x32 (row): a0 = (row g,   k 4t..4t+3)   a1 = (row g+8, k 4t..4t+3)
//                  a2 = (row g,   k 16+4t..+3)  a3 = (row g+8, k 16+4t..+3)
//   B 32x8  (col): b0 = (k 4t..4t+3, col g)     b1 = (k 16+4t..+3, col g)
//   C 16x8  s32:   c0, c1 = (row g, cols 2t, 2t+1)   c2, c3 = (row g+8, cols 2t, 2t+1)
//   A k-step is exactly one 32-value block (one x scale, one Q8_0/Q4_0 weight
//   scale), so the mma's integer sums are the exact block dot products. The
//   order of k inside a block does not change an exact integer sum, so the
//   logical k of the mma is mapped to block positions to suit the loads:
//   logical 4t+i -> position 8t+i, logical 16+4t+i -> position 8t+4+i. Lane t
//   thus needs positions 8t..8t+7 of each block: one 8-byte load of a Q8_0
//   row, 8 bytes of a Q4_0 block, two shifts of a Q1_0 word; and from x the
//   same 8 positions of token g (b0 = positions 8t..8t+3, b1 = 8t+4..8t+7).
//
// WEIGHT DECODE (registers, never to memory)
//   Q8_0: a0/a2 = the 8 bytes at row + 32 j + 8t as loaded.
//   Q4_0: block j is 16 bytes, byte i = weight i (low nibble) and i + 16
//         (high); positions 8t..8t+7 are the low (t < 2) or high (t >= 2)
//         nibbles of bytes 8(t&1)..8(t&1)+7. ((v << 4 or v) & 0xF0F0F0F0) ^
//         0x80808080 is 16 (q - 8) per byte (one shift, one LOP3); the 16 is
//         folded into the weight scale (d / 16, exact).
//   Q1_0: word j holds position 4k+b at bit 8b+k (gpu_layout.hpp); positions
//         8t..8t+3 are bits k = 2t, 8t+4..8t+7 bits k = 2t+1:
//         ((w << (7-k)) & 0x80808080) ^ 0xC0C0C0C0 is +64 / -64 per byte for a
//         set / clear bit; the 64 is folded into d / 64 (exact).
//   Products stay below 2^22 in magnitude (Q8_0: 32*128*127, Q4_0: 16*32*8*127,
//   Q1_0: 64*32*127), so the mma starts from the bits of 1.5*2^23 (0x4B400000)
//   and its result read as fp32 is exactly 1.5*2^23 + dot: one FADD converts
//   (no I2F, a slow pipe on sm_90).
//   Per k-step j: Q8_0/Q4_0: acc += ((dot * dx_j) * dw_j). Q1_0 has one
//   weight scale per 4 blocks, and x is staged with one scale per 128
//   columns for it (x_scale_span; gemv_batch keeps one per 32): the 4
//   k-steps chain in the mma's integer accumulator (|sum| <= 64*127*128 <
//   2^22), then acc += ((sum * dx) * dw), 3 fp32 ops per element per 4 mma
//   (session 12's per-block scaling took 8, and ncu counted 19 instructions
//   per mma). Identical tokens run identical instructions on identical
//   data: identical outputs.
//   Q8_0 / Q4_0 weights go straight from global memory to registers
//   (ld.global.nc, no L1 allocation), one group ahead of the one being
//   multiplied (the first before waiting for the kernel that writes x).
//   Q1_0 weights (288 bytes per warp and group) pass through a warp-private
//   ring in shared memory instead at NT <= 2 (smem_weights): 8 stages of
//   two groups, copied by cp.async, so up to 14 groups per warp are in
//   flight where registers held 1-3. Stage s sits in slot s % 8: [group
//   h][row r][16 bytes] of codes at 256 h + 16 r (a quarter warp reads 8
//   consecutive rows: conflict-free), then [row r][2] fp16 scales at 512 +
//   4 r; lanes 0-15 copy group 0 of the stage (16 bytes of row lane & 15),
//   lanes 16-31 group 1, lanes 0-15 the scales (4 bytes per row). At the
//   first group of a stage the slot of the previous stage is refilled
//   (after a warp barrier) and the wait leaves the stages ahead in flight;
//   the stage's two groups are multiplied together so that their mma chains
//   interleave. x tiles are then copied through registers (a cp.async wait
//   would also wait for the weights). Measured (H200, session 14): the Q1_0
//   layer 57 -> 54 us at B = 1 and 59 -> 57 at B = 8, replacing session
//   13's 4-deep register ring (which had taken gate/up only from 24 to 21
//   us). Most of a launch at B <= 8 is not the loop: ncu of O at B = 8 puts
//   ~25 % of the warps' stall samples in the group loop, ~33 % before it
//   (setup, the x copy) and ~27 % in the cluster reduction after it.
//   Session 12 tried an L2 bulk prefetch of each row's next 512 bytes: 4-9
//   us slower at B <= 32 (about 1,000 small bulk requests per SM at the
//   start), dropped.
//   Per group a warp decodes the four k-steps' A fragments, then walks its
//   n-tiles, so Q1_0's per-group sums s live for one n-tile (NT = 8 spilled
//   to local memory when they lived for all).
//
// SHARED MEMORY (bytes from 0; NT8 = 8 NT tokens, TG = groups per tile,
// S = 128 TG + 64 = the token row stride, = 64 mod 128)
//   staging (one tile):
//     int8 xq[NT8][S]: block pair p (blocks 2p, 2p+1 of the tile) at 64p; its
//       16-byte chunk t = positions 8t..8t+7 of block 2p, then of block 2p+1,
//       so lane (g, t) reads b0, b1 of two k-steps with one LDS.128. A
//       quarter warp reads tokens g, g+1 at 64 contiguous bytes each; S = 64
//       mod 128 puts them on different banks: conflict-free.
//     float sx[TG*2][NT8/2][4]: block scales of x; entry (j, b) at
//       ((j/2) NT8/2 + b/2) 4 + (j%2) 2 + b%2, so lane t reads the scales of
//       tokens 2t, 2t+1 of an n-tile for blocks 2p and 2p+1 as one float4.
//     float ss_seg[NT8][TG]: sum of x^2 per 128 columns (with a norm)
//   partials (after the last tile, aliasing the staging area):
//     float part[NT8][260]: the CTA's partial sums, token-major (row stride
//       256 + 4: the fragment stores of a warp hit 32 distinct banks)
//   then (never aliased): float ss_part[NT8] (the CTA's x^2 sums, read by
//   the cluster), float inv_rms[NT8], and for Q1_0 the 16 warps' weight
//   rings at NT <= 2 (16-byte aligned, 8 x 576 bytes each).
//   Tokens batch..NT8-1 are zero in xq and sx (prestaged: zero in the
//   workspace; in-CTA: set once per launch): they contribute nothing and
//   are never stored. ss_seg is used by the in-CTA path only.
//
// RMSNorm: u = x * g is staged and 1/rms multiplies the reduced products, as
// in gemv_batch; x^2 is summed per 128 columns (warp tree), the segments in
// order per CTA, the CTAs of a cluster in rank order: the same order for every
// token.
//
// PERFORMANCE MODEL (a prediction, not a measurement; docs/perf.md, "Tensor-
// core batched GEMM"). Per warp and k-step at B = 64: 8 mma, 8 LDS.128 of x,
// 8 LDS.128 of scales every two k-steps, the decode (Q1_0: 8 ops) and 2-3
// fp32 ops per accumulator element (32 elements): ~100 issue slots for 8
// mma, so the kernel is issue-bound on the per-block scaling, not on the
// tensor pipe. Q1_0 with one x scale per group (session 13): per warp and
// group at B = 64, 32 mma, 16 LDS.128 of x, 8 LDS.64 of scales, 16 decode
// ops and 3 fp32 ops per element and n-tile (96): ~170 slots for 32 mma
// (~5 per mma, ~12 before), so the layer should fall from ~190 us towards
// ~100 us at B = 64 if it stays issue-bound. Staging costs ~14 instructions
// per x value (the IEEE division of the rounding): once per launch with a
// workspace, else once per m-tile.
#include "backend/cuda/gemm_tc.hpp"

#include <cooperative_groups.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/occupancy.hpp"
#include "backend/cuda/stage_int8.cuh"
#include "core/error.hpp"

namespace kvq::cuda {

using gguf::TensorType;
namespace cg = cooperative_groups;

namespace {

constexpr int kMaxOut = 3;
constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = kWarps * 16;     // rows of an m-tile (SwiGLU: half gate, half up)
constexpr int kPartStride = kTileRows + 4;  // floats per token row of the partials
constexpr int kGroupCols = 128;             // columns per group (a Q1_0 scale, four blocks)
constexpr int kMaxCluster = 8;
constexpr int kStageBatch = 4;               // independent x loads per lane in flight while staging
constexpr int kBiasBits = 0x4B400000;        // 1.5 * 2^23
constexpr float kBias = 12582912.0f;
constexpr size_t kSmemBudget = 200 * 1024;

struct TcArgs {
  const uint8_t* codes[kMaxOut];
  const uint16_t* scales[kMaxOut];
  float* y[kMaxOut];
  int rows[kMaxOut];
  int row_end[kMaxOut];  // cumulative rows (not SwiGLU)
  int n_out;
  int total_rows;  // rows of the concatenated outputs; SwiGLU: rows of gate
  const float* x;
  const float* norm;  // null: no norm
  float eps;
  int cols;
  int batch;
  GemvEpilogue epilogue;
  int groups;    // cols / 128
  int cluster;   // C
  int gpr;       // groups per K slice
  int tg;        // groups per tile
  int row_stride;  // S
  int sx_offset, ss_seg_offset, ss_part_offset, inv_offset;
  // x staged once per launch by stage_x_int8 (null: every CTA stages its own
  // K slice): int8 codes [NT8][cols] (each token row in the shared-memory
  // order of xq), scales [cols / 64][NT8 / 2][4] (the order of sx), x^2 sums
  // [NT8][groups] (with a norm).
  const unsigned char* ws_codes;
  const float* ws_sx;
  const float* ws_ss;
  int x_span;  // lanes sharing an x scale: 8 (32 values) or 32 (128 values, Q1_0)
  int w_offset;  // Q1_0: the warps' weight rings in shared memory (smem_weights)
};

// Where stage_x_int8 puts x for one launch of NT8 token slots (tokens past
// the batch are zero), and the bytes it needs.
struct WsLayout {
  size_t codes = 0, sx = 0, ss = 0, total = 0;
};
constexpr size_t align16c(size_t n) { return (n + 15) / 16 * 16; }
constexpr WsLayout ws_layout(int nt8, int64_t cols) {
  WsLayout l;
  l.sx = align16c(size_t(nt8) * size_t(cols));
  l.ss = l.sx + align16c(size_t(nt8) * size_t(cols / 32) * 4);
  l.total = l.ss + align16c(size_t(nt8) * size_t(cols / 128) * 4);
  return l;
}
// n-tiles of 8 tokens for a launch of `batch` rows (launch_bucket's choice).
// Lanes of a staging warp (4 values each) that share one x scale: Q1_0 has
// one weight scale per 128 columns, so x gets one per 128 too and a group's
// four k-steps accumulate as integers in the mma; Q8_0 and Q4_0 have a
// weight scale per 32 columns anyway.
constexpr int x_scale_span(TensorType t) { return t == TensorType::Q1_0 ? 32 : 8; }
// Q1_0 weights at NT <= 2 go to registers through a ring in shared memory
// (cp.async, warp-private; layout at the top): a Q1_0 group is 288 bytes per
// warp, so many groups fit in flight, where registers held 1-3 (a Q1_0
// group is 10 registers, a Q8_0 / Q4_0 group 24). Larger NT keep one group
// ahead in registers: with the ring (4 stages) B = 32 was 9 % slower and
// B = 64 no faster on the H200 (session 14).
constexpr bool smem_weights(TensorType t, int nt) { return t == TensorType::Q1_0 && nt <= 2; }
constexpr int kRingGroups = 2;                                          // groups per ring stage
constexpr int kRingCodeBytes = 16 * 16;                                 // one group of a warp's 16 rows
constexpr int kRingStageBytes = kRingGroups * kRingCodeBytes + 16 * 4;  // codes [2][16][16 B], scales [16][2]
constexpr int kRingStages = 8;                                          // stages per warp ring
constexpr int n_tiles(int batch) { return batch <= 8 ? 1 : batch <= 16 ? 2 : batch <= 32 ? 4 : 8; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ldg_stream8(const void* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ float half_bits(uint32_t h) { return __half2float(__ushort_as_half(uint16_t(h))); }

// C += A B on the integer bits (Q1_0: a group's four k-steps in one chain
// that starts from the bits of 1.5 * 2^23).
__device__ __forceinline__ void mma_s8_acc(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                           uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D = A B + 1.5 * 2^23 (bits), returned as the exact fp32 dot products.
__device__ __forceinline__ void mma_s8(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
  int c[4] = {kBiasBits, kBiasBits, kBiasBits, kBiasBits};
  mma_s8_acc(c, a0, a1, a2, a3, b0, b1);
#pragma unroll
  for (int e = 0; e < 4; ++e) d[e] = __int_as_float(c[e]) - kBias;
}

// One 128-column group of a lane's two rows (g, g + 8): raw codes and the
// weight scales with the decode's factor folded in.
template <TensorType T>
struct Group;

template <>
struct Group<TensorType::Q1_0> {
  uint4 w[2];  // words of blocks 0..3
  float d[2];  // d / 64
  __device__ __forceinline__ void load(const uint8_t* const (&codes)[2], const uint16_t* const (&scales)[2], int gg,
                                       int) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      w[r] = ldg_stream16(codes[r] + size_t(gg) * 16);
      d[r] = half_bits(__ldg(scales[r] + gg)) * 0.015625f;
    }
  }
  // Group h of a ring stage (layout at the top) for rows g and g + 8.
  __device__ __forceinline__ void load_ring(const unsigned char* stage, int h, int g) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      w[r] = *reinterpret_cast<const uint4*>(stage + h * kRingCodeBytes + (g + 8 * r) * 16);
      d[r] = half_bits(*reinterpret_cast<const uint16_t*>(stage + kRingGroups * kRingCodeBytes + (g + 8 * r) * 4 + h * 2)) *
             0.015625f;
    }
  }
  // a0/a2 (or a1/a3) of block kb for lane t.
  __device__ __forceinline__ void frag(int r, int kb, int t, uint32_t& lo, uint32_t& hi) const {
    const uint32_t word = kb == 0 ? w[r].x : kb == 1 ? w[r].y : kb == 2 ? w[r].z : w[r].w;
    lo = ((word << (7 - 2 * t)) & 0x80808080u) ^ 0xC0C0C0C0u;
    hi = ((word << (6 - 2 * t)) & 0x80808080u) ^ 0xC0C0C0C0u;
  }
};

// Q8_0 and Q4_0: 8 bytes of each of the 4 blocks, 4 scales per row.
template <TensorType T>
struct Group8 {
  uint2 w[2][4];
  float d[2][4];  // Q8_0: d; Q4_0: d / 16
  __device__ __forceinline__ void load(const uint8_t* const (&codes)[2], const uint16_t* const (&scales)[2], int gg,
                                       int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        const int block = 4 * gg + kb;
        const size_t off = T == TensorType::Q8_0 ? size_t(block) * 32 + 8 * t : size_t(block) * 16 + 8 * (t & 1);
        w[r][kb] = ldg_stream8(codes[r] + off);
      }
      const uint2 s = ldg_stream8(scales[r] + 4 * gg);
      const float f = T == TensorType::Q8_0 ? 1.0f : 0.0625f;
      d[r][0] = half_bits(s.x & 0xffffu) * f;
      d[r][1] = half_bits(s.x >> 16) * f;
      d[r][2] = half_bits(s.y & 0xffffu) * f;
      d[r][3] = half_bits(s.y >> 16) * f;
    }
  }
  __device__ __forceinline__ void frag(int r, int kb, int t, uint32_t& lo, uint32_t& hi) const {
    if constexpr (T == TensorType::Q8_0) {
      lo = w[r][kb].x;
      hi = w[r][kb].y;
    } else {
      const int sh = t < 2 ? 4 : 0;  // low nibbles move up to the high half of each byte
      lo = ((w[r][kb].x << sh) & 0xF0F0F0F0u) ^ 0x80808080u;
      hi = ((w[r][kb].y << sh) & 0xF0F0F0F0u) ^ 0x80808080u;
    }
  }
};
template <>
struct Group<TensorType::Q8_0> : Group8<TensorType::Q8_0> {};
template <>
struct Group<TensorType::Q4_0> : Group8<TensorType::Q4_0> {};

__host__ __device__ constexpr int64_t row_code_bytes(TensorType t, int64_t cols) {
  return t == TensorType::Q8_0 ? cols : t == TensorType::Q4_0 ? cols / 2 : cols / 8;
}
__host__ __device__ constexpr int64_t row_scales(TensorType t, int64_t cols) {
  return t == TensorType::Q1_0 ? cols / 128 : cols / 32;
}

// Byte of word w (positions 4w..4w+3) of block j in a staged token row, and
// the index of block j's scale of token b in sx (layout at the top;
// half_tokens = NT8 / 2).
__device__ __forceinline__ int xq_offset(int j, int w) { return (j >> 1) * 64 + (w >> 1) * 16 + (j & 1) * 8 + (w & 1) * 4; }
__device__ __forceinline__ int sx_index(int j, int b, int half_tokens) {
  return ((j >> 1) * half_tokens + (b >> 1)) * 4 + (j & 1) * 2 + (b & 1);
}

// One 128-value segment of an input row held by a warp (4 values per lane,
// v): its x^2 sum (with a norm, g128 = the norm weights of the segment; else
// 0), u = x * g, and u as int8 codes and a scale per 32 values. Both staging
// paths (stage_tile, stage_x_int8) call this, so they stage the same bits.
__device__ __forceinline__ void stage_segment(float4 u, const float* g128, int lane, int span, float& ss, float& scale,
                                              int (&q)[4]) {
  ss = 0.0f;
  if (g128) {
    ss = warp_sum(u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w);
    const float4 g = __ldg(reinterpret_cast<const float4*>(g128 + 4 * lane));
    u = make_float4(u.x * g.x, u.y * g.y, u.z * g.z, u.w * g.w);
  }
  quantize4_int8(u, scale, q, span);
}

// Stages groups [tg0, tg0 + ng) of the batch's x rows (layout at the top).
template <int NT>
__device__ void stage_tile(const TcArgs& a, unsigned char* smem, int tg0, int ng) {
  constexpr int kHalfTokens = NT * 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int items = a.batch * ng;
  float* sx = reinterpret_cast<float*>(smem + a.sx_offset);
  float* ss_seg = reinterpret_cast<float*>(smem + a.ss_seg_offset);
  for (int base = warp; base < items; base += kWarps * kStageBatch) {
    float4 v[kStageBatch];
#pragma unroll
    for (int k = 0; k < kStageBatch; ++k) {
      const int item = base + k * kWarps;
      v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (item < items) {
        const int b = item / ng, seg = item - b * ng;
        v[k] = *reinterpret_cast<const float4*>(a.x + size_t(b) * a.cols + size_t(tg0 + seg) * kGroupCols + 4 * lane);
      }
    }
#pragma unroll
    for (int k = 0; k < kStageBatch; ++k) {
      const int item = base + k * kWarps;
      if (item >= items) continue;  // warp-uniform
      const int b = item / ng, seg = item - b * ng;
      float ss, scale;
      int q[4];
      stage_segment(v[k], a.norm ? a.norm + size_t(tg0 + seg) * kGroupCols : nullptr, lane, a.x_span, ss, scale, q);
      if (a.norm && lane == 0) ss_seg[b * a.tg + seg] = ss;
      // Word w = lane & 7 (positions 4w..4w+3) of block j of the tile.
      const int j = 4 * seg + (lane >> 3), w = lane & 7;
      *reinterpret_cast<int*>(smem + size_t(b) * a.row_stride + xq_offset(j, w)) = pack_int8x4(q);
      if (w == 0) sx[sx_index(j, b, kHalfTokens)] = scale;
    }
  }
}

// x staged once per launch (TcArgs::ws_*): one warp per 128-value segment of
// a token slot, slots past the batch written as zeros.
constexpr int kPrestageWarps = 8;
struct PrestageArgs {
  const float* x;
  const float* norm;
  int cols, groups, batch, nt8;
  int span;  // lanes sharing an x scale (x_scale_span)
  unsigned char* codes;
  float* sx;
  float* ss;
};

__global__ void __launch_bounds__(kPrestageWarps * 32) stage_x_int8(PrestageArgs a) {
  allow_dependents();
  // x is written by earlier kernels; the workspace may still be read by the
  // previous gemm_tc launch.
  wait_for_predecessor();
  const int lane = threadIdx.x & 31;
  const int item = blockIdx.x * kPrestageWarps + (threadIdx.x >> 5);
  if (item >= a.nt8 * a.groups) return;  // warp-uniform
  const int b = item / a.groups, seg = item - b * a.groups;
  float scale = 0.0f;
  int q[4] = {0, 0, 0, 0};
  if (b < a.batch) {  // warp-uniform
    const float4 v = *reinterpret_cast<const float4*>(a.x + size_t(b) * a.cols + size_t(seg) * kGroupCols + 4 * lane);
    float ss;
    stage_segment(v, a.norm ? a.norm + size_t(seg) * kGroupCols : nullptr, lane, a.span, ss, scale, q);
    if (a.norm && lane == 0) a.ss[size_t(b) * a.groups + seg] = ss;
  }
  const int j = 4 * seg + (lane >> 3), w = lane & 7;  // block j of the row, word w of the block
  *reinterpret_cast<int*>(a.codes + size_t(b) * a.cols + xq_offset(j, w)) = pack_int8x4(q);
  if (w == 0) a.sx[sx_index(j, b, a.nt8 / 2)] = scale;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Copies groups [tg0, tg0 + ng) of the prestaged x (all NT8 token slots)
// into xq and sx; the caller's barrier publishes them. kDirect: through
// registers instead of cp.async, whose wait would also wait for the weight
// rings' copies in flight (smem_weights).
template <int NT, bool kDirect>
__device__ void copy_tile(const TcArgs& a, unsigned char* smem, int tg0, int ng) {
  constexpr int NT8 = NT * 8;
  const int row_chunks = ng * (kGroupCols / 16);
  // The scales of groups tg0.. are contiguous: 4 blocks x NT8 tokens per group.
  const float* sx = a.ws_sx + size_t(tg0) * 4 * NT8;
  if constexpr (kDirect) {
#pragma unroll 4
    for (int i = threadIdx.x; i < NT8 * row_chunks; i += kThreads) {
      const int b = i / row_chunks, c = i - b * row_chunks;
      *reinterpret_cast<uint4*>(smem + size_t(b) * a.row_stride + 16 * c) = *reinterpret_cast<const uint4*>(
          a.ws_codes + size_t(b) * a.cols + size_t(tg0) * kGroupCols + 16 * c);
    }
    for (int i = threadIdx.x; i < ng * NT8; i += kThreads)
      *reinterpret_cast<float4*>(smem + a.sx_offset + 16 * i) = *reinterpret_cast<const float4*>(sx + 4 * i);
  } else {
    for (int i = threadIdx.x; i < NT8 * row_chunks; i += kThreads) {
      const int b = i / row_chunks, c = i - b * row_chunks;
      cp_async16(smem + size_t(b) * a.row_stride + 16 * c,
                 a.ws_codes + size_t(b) * a.cols + size_t(tg0) * kGroupCols + 16 * c);
    }
    for (int i = threadIdx.x; i < ng * NT8; i += kThreads) cp_async16(smem + a.sx_offset + 16 * i, sx + 4 * i);
    cp_async_wait_all();
  }
}

// One staged group (gl: its index in the tile) times the warp's rows for
// all NT n-tiles, into acc.
template <TensorType T, int NT>
__device__ __forceinline__ void multiply_group(const Group<T>& grp, int gl, const unsigned char* xq, const float* sx,
                                               int row_stride, int g, int t, float (&acc)[NT][4]) {
  constexpr bool kQ1 = T == TensorType::Q1_0;
  constexpr int kHalfTokens = NT * 4;
  // The group's four k-steps of A (both row halves) decoded once, then
  // n-tile by n-tile: Q1_0's integer group sums live for one n-tile only
  // (4 registers instead of 4 NT), which keeps NT = 8 out of local memory.
  uint32_t af[4][4];
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    grp.frag(0, kb, t, af[kb][0], af[kb][2]);
    grp.frag(1, kb, t, af[kb][1], af[kb][3]);
  }
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const unsigned char* xrow = xq + size_t(n * 8 + g) * row_stride + t * 16;
    if constexpr (kQ1) {
      // One x scale per group (x_scale_span): the four k-steps sum as
      // integers in the mma (|dot| <= 64 * 127 * 128 < 2^22), then one
      // conversion and two scalings per element.
      int c[4] = {kBiasBits, kBiasBits, kBiasBits, kBiasBits};
#pragma unroll
      for (int kp = 0; kp < 2; ++kp) {
        const uint4 bx = *reinterpret_cast<const uint4*>(xrow + (2 * gl + kp) * 64);
        mma_s8_acc(c, af[2 * kp][0], af[2 * kp][1], af[2 * kp][2], af[2 * kp][3], bx.x, bx.y);
        mma_s8_acc(c, af[2 * kp + 1][0], af[2 * kp + 1][1], af[2 * kp + 1][2], af[2 * kp + 1][3], bx.z, bx.w);
      }
      // Tokens 2t, 2t + 1 of the n-tile (the group's four block scales are equal).
      const float2 dx = *reinterpret_cast<const float2*>(sx + (size_t(2 * gl) * kHalfTokens + n * 4 + t) * 4);
      acc[n][0] = fmaf((__int_as_float(c[0]) - kBias) * dx.x, grp.d[0], acc[n][0]);
      acc[n][1] = fmaf((__int_as_float(c[1]) - kBias) * dx.y, grp.d[0], acc[n][1]);
      acc[n][2] = fmaf((__int_as_float(c[2]) - kBias) * dx.x, grp.d[1], acc[n][2]);
      acc[n][3] = fmaf((__int_as_float(c[3]) - kBias) * dx.y, grp.d[1], acc[n][3]);
    } else {
#pragma unroll
      for (int kp = 0; kp < 2; ++kp) {
        // Blocks 2 kp and 2 kp + 1 of the group: block pair p of the tile.
        const int p = 2 * gl + kp;
        const uint4 bx = *reinterpret_cast<const uint4*>(xrow + p * 64);
        const float4 dx = *reinterpret_cast<const float4*>(sx + (size_t(p) * kHalfTokens + n * 4 + t) * 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int kb = 2 * kp + h;
          float d[4];
          mma_s8(d, af[kb][0], af[kb][1], af[kb][2], af[kb][3], h ? bx.z : bx.x, h ? bx.w : bx.y);
          const float dx0 = h ? dx.z : dx.x, dx1 = h ? dx.w : dx.y;
          acc[n][0] = fmaf(d[0] * dx0, grp.d[0][kb], acc[n][0]);
          acc[n][1] = fmaf(d[1] * dx1, grp.d[0][kb], acc[n][1]);
          acc[n][2] = fmaf(d[2] * dx0, grp.d[1][kb], acc[n][2]);
          acc[n][3] = fmaf(d[3] * dx1, grp.d[1][kb], acc[n][3]);
        }
      }
    }
  }
}

template <TensorType T, int NT, bool kPair>
__global__ void __launch_bounds__(kThreads, 1) gemm_tc_kernel(TcArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int NT8 = NT * 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rank = a.cluster > 1 ? int(cg::this_cluster().block_rank()) : 0;
  const int mtile = blockIdx.x / a.cluster;
  const int g_lo = min(a.groups, rank * a.gpr), g_hi = min(a.groups, g_lo + a.gpr);

  constexpr bool kRing = smem_weights(T, NT);
  // Weight row i (0..15) of this warp; rows past the matrix re-read its
  // last row (their sums are never stored).
  const int64_t code_bytes = row_code_bytes(T, a.cols), n_scales = row_scales(T, a.cols);
  int row0;
  if constexpr (kPair) row0 = mtile * (kTileRows / 2) + 16 * (warp % (kWarps / 2));
  else row0 = mtile * kTileRows + 16 * warp;
  const bool active = row0 < a.total_rows;  // the warp has at least one real row
  auto weight_row = [&](int i, const uint8_t*& c, const uint16_t*& sc) {
    if constexpr (kPair) {
      const int m = warp >= kWarps / 2 ? 1 : 0;  // gate, then up
      const int row = min(row0 + i, a.total_rows - 1);
      c = a.codes[m] + size_t(row) * code_bytes;
      sc = a.scales[m] + size_t(row) * n_scales;
    } else {
      const int gr = min(row0 + i, a.total_rows - 1);
      int seg = 0;
      while (seg + 1 < a.n_out && gr >= a.row_end[seg]) ++seg;
      const int row = gr - (seg ? a.row_end[seg - 1] : 0);
      c = a.codes[seg] + size_t(row) * code_bytes;
      sc = a.scales[seg] + size_t(row) * n_scales;
    }
  };
  // This lane's two rows (g and g + 8) for the register path; for the ring,
  // the row it copies (lane & 15: lanes 0-15 copy group 0 of a stage, 16-31
  // group 1, and lanes 0-15 the stage's scales).
  const uint8_t* codes[2];
  const uint16_t* scales[2];
  weight_row(kRing ? (lane & 15) : g, codes[0], scales[0]);
  weight_row(g + 8, codes[1], scales[1]);

  // In-CTA staging: zero the staging area (tokens past the batch stay zero)
  // and the x^2 sums. (Prestaged: every tile copies all NT8 token slots.)
  float* ss_part = reinterpret_cast<float*>(smem + a.ss_part_offset);
  if (!a.ws_codes) {
    const int words = a.ss_seg_offset / 16;  // xq and sx
    for (int i = threadIdx.x; i < words; i += kThreads) reinterpret_cast<int4*>(smem)[i] = make_int4(0, 0, 0, 0);
    for (int i = threadIdx.x; i < NT8; i += kThreads) ss_part[i] = 0.0f;
  }

  using G = Group<T>;
  // Register path: the group being multiplied (ring[0]) and the next one
  // (ring[1]); the first is loaded before waiting for the kernel that
  // writes x.
  G ring[2];
  // Shared-memory path (Q1_0): the warp's ring of kStages stages of two
  // groups, stage s in slot s % kStages; the first kStages - 1 are in flight
  // before the wait for the kernel that writes x. One cp.async group per
  // stage (empty past the slice), so wait_group counts stages.
  constexpr int kStages = kRingStages;
  unsigned char* wring = smem + a.w_offset + size_t(warp) * kStages * kRingStageBytes;
  auto issue_stage = [&](int s) {
    const int gg0 = g_lo + kRingGroups * s;
    if (gg0 < g_hi) {  // a slice holds an even number of groups (launch)
      unsigned char* slot = wring + (s % kStages) * kRingStageBytes;
      const int h = lane >> 4, r = lane & 15;
      cp_async16(slot + h * kRingCodeBytes + r * 16, codes[0] + size_t(gg0 + h) * 16);
      if (lane < 16) cp_async4(slot + kRingGroups * kRingCodeBytes + r * 4, scales[0] + gg0);
    }
    cp_async_commit();
  };
  if (active) {
    if constexpr (kRing) {
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) issue_stage(s);
    } else {
      if (g_lo < g_hi) ring[0].load(codes, scales, g_lo, t);
    }
  }
  allow_dependents();
  wait_for_predecessor();  // x or the prestaged x (and y for add) are written by earlier kernels

  // Prestaged: the CTA's x^2 sums, its segments in order from 0 (the order
  // in which the in-CTA path adds them up tile by tile).
  if (a.ws_codes) {
    for (int b = threadIdx.x; b < NT8; b += kThreads) {
      float s = 0.0f;
      if (a.norm && b < a.batch)
        for (int gg = g_lo; gg < g_hi; ++gg) s += a.ws_ss[size_t(b) * a.groups + gg];
      ss_part[b] = s;
    }
  }

  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;

  const unsigned char* xq = smem;
  const float* sx = reinterpret_cast<const float*>(smem + a.sx_offset);
  // Stages the tile that starts at group gg (all threads of the CTA).
  int tg0 = g_lo, tile_end = g_lo;
  auto start_tile = [&](int gg) {
    tg0 = gg;
    const int ng = min(a.tg, g_hi - tg0);
    tile_end = tg0 + ng;
    __syncthreads();  // the previous tile has been multiplied (and the zeroing is done)
    if (a.ws_codes) copy_tile<NT, kRing>(a, smem, tg0, ng);
    else stage_tile<NT>(a, smem, tg0, ng);
    __syncthreads();
    if (!a.ws_codes && a.norm && threadIdx.x < a.batch) {
      const float* ss_seg = reinterpret_cast<const float*>(smem + a.ss_seg_offset) + threadIdx.x * a.tg;
      float s = ss_part[threadIdx.x];
      for (int seg = 0; seg < ng; ++seg) s += ss_seg[seg];
      ss_part[threadIdx.x] = s;
    }
  };
  if constexpr (kRing) {
    // Tiles, then their groups; at the first group of a stage the slot of
    // the previous stage (read by every lane: the warp barrier) is refilled
    // with the stage kStages - 1 ahead, and the wait leaves that many in
    // flight. Both groups of a stage in one tile are multiplied together,
    // so their mma chains interleave.
    for (int t0 = g_lo; t0 < g_hi; t0 += a.tg) {
      start_tile(t0);
      if (!active) continue;
      for (int gg = t0; gg < tile_end;) {
        const int i = gg - g_lo;
        const unsigned char* stage = wring + ((i / kRingGroups) % kStages) * kRingStageBytes;
        if (i % kRingGroups == 0) {
          __syncwarp();
          issue_stage(i / kRingGroups + kStages - 1);
          cp_async_wait<kStages - 1>();
          __syncwarp();
          if (NT <= 2 && gg + 1 < tile_end) {  // larger NT: no registers to spare
            G g0, g1;
            g0.load_ring(stage, 0, g);
            g1.load_ring(stage, 1, g);
            multiply_group<T, NT>(g0, gg - tg0, xq, sx, a.row_stride, g, t, acc);
            multiply_group<T, NT>(g1, gg + 1 - tg0, xq, sx, a.row_stride, g, t, acc);
            gg += 2;
            continue;
          }
        }
        G g1;
        g1.load_ring(stage, i % kRingGroups, g);
        multiply_group<T, NT>(g1, gg - tg0, xq, sx, a.row_stride, g, t, acc);
        ++gg;
      }
    }
    cp_async_wait<0>();  // no copy outlives the kernel (the empty tail stages)
  } else {
    // Tiles, then their groups with one group ahead (the current one in
    // ring[0], the next in ring[1]): session 12's loop. B = 32 and 64 got
    // 5-7 % slower in the H200 lab while a flat loop over the groups (a tile
    // check per group) stood here (session 13; not isolated as the cause).
    for (int t0 = g_lo; t0 < g_hi; t0 += a.tg) {
      start_tile(t0);
      if (!active) continue;
      for (int gg = t0; gg < tile_end; ++gg) {
        if (gg + 1 < g_hi) ring[1].load(codes, scales, gg + 1, t);
        multiply_group<T, NT>(ring[0], gg - t0, xq, sx, a.row_stride, g, t, acc);
        ring[0] = ring[1];
      }
    }
  }

  // Partials to shared memory (aliasing the staging area): part[token][row].
  __syncthreads();
  float* part = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      part[(n * 8 + 2 * t + (e & 1)) * kPartStride + 16 * warp + g + 8 * (e >> 1)] = acc[n][e];

  cg::cluster_group cluster = cg::this_cluster();
  if (a.cluster > 1) cluster.sync();
  else __syncthreads();

  // 1/rms of each token: the CTAs' x^2 sums in rank order.
  float* inv_rms = reinterpret_cast<float*>(smem + a.inv_offset);
  if (threadIdx.x < a.batch) {
    float r = 1.0f;
    if (a.norm) {
      float ss = 0.0f;
      for (int q = 0; q < a.cluster; ++q) {
        const float* sp = reinterpret_cast<const float*>(smem + a.ss_part_offset);
        if (a.cluster > 1) sp = cluster.map_shared_rank(sp, q);
        ss += sp[threadIdx.x];
      }
      r = 1.0f / sqrtf(ss / float(a.cols) + a.eps);
    }
    inv_rms[threadIdx.x] = r;
  }
  __syncthreads();

  // This CTA's slice of the m-tile's rows, summed over the cluster in rank order.
  constexpr int kOutRows = kPair ? kTileRows / 2 : kTileRows;
  const int slice = kOutRows / a.cluster;
  const int r_lo = rank * slice;
  for (int e = threadIdx.x; e < a.batch * slice; e += kThreads) {
    const int b = e / slice, lr = r_lo + e % slice;
    const int grow = mtile * kOutRows + lr;
    if (grow >= a.total_rows) continue;
    float v0 = 0.0f, v1 = 0.0f;
    for (int q = 0; q < a.cluster; ++q) {
      const float* pq = part;
      if (a.cluster > 1) pq = cluster.map_shared_rank(part, q);
      v0 += pq[b * kPartStride + lr];
      if (kPair) v1 += pq[b * kPartStride + kOutRows + lr];
    }
    const float gv = v0 * inv_rms[b];
    if constexpr (kPair) {
      const float uv = v1 * inv_rms[b];
      a.y[0][size_t(b) * a.total_rows + grow] = gv / (1.0f + expf(-gv)) * uv;
    } else {
      int seg = 0;
      while (seg + 1 < a.n_out && grow >= a.row_end[seg]) ++seg;
      const int row = grow - (seg ? a.row_end[seg - 1] : 0);
      float* y = a.y[seg] + size_t(b) * a.rows[seg] + row;
      *y = a.epilogue == GemvEpilogue::add ? *y + gv : gv;
    }
  }
  // No CTA leaves while the others may still read its shared memory.
  if (a.cluster > 1) cluster.sync();
}

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

template <TensorType T, int NT, bool kPair>
void launch(TcArgs a, void* ws, cudaStream_t stream, const DeviceContext& ctx) {
  constexpr int NT8 = NT * 8;
  static_assert(NT == n_tiles(NT8), "launch_bucket and n_tiles disagree");
  const int out_rows = kPair ? kTileRows / 2 : kTileRows;
  const int mtiles = (a.total_rows + out_rows - 1) / out_rows;
  a.groups = a.cols / kGroupCols;
  a.x_span = x_scale_span(T);
  int c = 1;
  const int max_cluster = std::clamp(ctx.settings.gemm_tc_max_cluster, 1, kMaxCluster);
  while (c * 2 <= max_cluster && c * 2 <= a.groups && mtiles * c * 2 <= ctx.sm_count()) c *= 2;
  a.cluster = c;
  a.gpr = (a.groups + c - 1) / c;
  // The weight rings copy two groups per stage: every slice starts at an
  // even group and holds an even number (groups is even: cols % 256 == 0).
  constexpr bool kRing = smem_weights(T, NT);
  if (kRing) a.gpr += a.gpr % 2;
  const size_t ring_bytes = kRing ? size_t(kWarps) * kRingStages * kRingStageBytes : 0;
  // Groups per tile: as many as fit the budget (the whole slice when it fits).
  const size_t per_group = size_t(NT8) * (kGroupCols + 4 * 4 + 4);  // xq, sx (4 blocks), ss_seg
  const size_t fixed = size_t(NT8) * 64;
  a.tg = int(std::clamp<size_t>((kSmemBudget - ring_bytes - fixed) / per_group, 1, size_t(a.gpr)));
  a.row_stride = a.tg * kGroupCols + 64;
  a.sx_offset = NT8 * a.row_stride;
  a.ss_seg_offset = a.sx_offset + a.tg * 4 * NT8 * 4;
  const size_t staging = align16(size_t(a.ss_seg_offset) + size_t(NT8) * a.tg * 4);
  const size_t partials = size_t(NT8) * kPartStride * 4;
  const size_t region = std::max(staging, partials);
  a.ss_part_offset = int(region);
  a.inv_offset = int(region + NT8 * 4);
  a.w_offset = int(align16(region + 2 * NT8 * 4));
  const size_t smem = a.w_offset + ring_bytes;
  KVQ_CHECK(smem <= 220 * 1024, Errc::out_of_range, "GPU tensor-core GEMM: ", smem, " bytes of shared memory");

  if (ws) {  // quantize x once for all CTAs
    const WsLayout l = ws_layout(NT8, a.cols);
    PrestageArgs p{};
    p.x = a.x;
    p.norm = a.norm;
    p.cols = a.cols;
    p.groups = a.groups;
    p.batch = a.batch;
    p.nt8 = NT8;
    p.span = a.x_span;
    p.codes = static_cast<unsigned char*>(ws) + l.codes;
    p.sx = reinterpret_cast<float*>(static_cast<unsigned char*>(ws) + l.sx);
    p.ss = reinterpret_cast<float*>(static_cast<unsigned char*>(ws) + l.ss);
    const int items = NT8 * a.groups;
    launch_dependent(ctx, stage_x_int8, dim3((items + kPrestageWarps - 1) / kPrestageWarps), dim3(kPrestageWarps * 32),
                     0, stream, p);
    a.ws_codes = p.codes;
    a.ws_sx = p.sx;
    a.ws_ss = p.ss;
  }

  auto* kernel = gemm_tc_kernel<T, NT, kPair>;
  resident_ctas(ctx, kernel, smem, kThreads);  // raises the kernel's shared-memory opt-in
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(mtiles * c);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = ctx.settings.dependent_launches ? 1 : 0;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = unsigned(c);
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = c > 1 ? 2 : 1;  // no cluster attribute for single CTAs
  KVQ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a));
}

template <TensorType T, bool kPair>
void launch_bucket(const TcArgs& a, void* ws, cudaStream_t stream, const DeviceContext& ctx) {
  switch (n_tiles(a.batch)) {
    case 1: return launch<T, 1, kPair>(a, ws, stream, ctx);
    case 2: return launch<T, 2, kPair>(a, ws, stream, ctx);
    case 4: return launch<T, 4, kPair>(a, ws, stream, ctx);
    default: return launch<T, 8, kPair>(a, ws, stream, ctx);
  }
}

template <bool kPair>
void dispatch(TensorType t, const TcArgs& a, void* ws, cudaStream_t stream, const DeviceContext& ctx) {
  switch (t) {
    case TensorType::Q8_0: return launch_bucket<TensorType::Q8_0, kPair>(a, ws, stream, ctx);
    case TensorType::Q4_0: return launch_bucket<TensorType::Q4_0, kPair>(a, ws, stream, ctx);
    case TensorType::Q1_0: return launch_bucket<TensorType::Q1_0, kPair>(a, ws, stream, ctx);
    default: break;
  }
  fail(Errc::unsupported, "GPU tensor-core GEMM: no kernel for ", gguf::tensor_type_name(t));
}

// One launch of at most kGemmTcMax rows (the request and workspace are
// checked; ws null: in-CTA staging).
void launch_chunk(const GemvBatchRequest& req, void* ws, cudaStream_t stream, const DeviceContext& ctx) {
  const GpuMatrix& w0 = *req.out[0].w;
  const bool pair = req.epilogue == GemvEpilogue::swiglu;
  TcArgs a{};
  a.x = req.x;
  a.norm = req.norm_weight;
  a.eps = req.norm_eps;
  a.cols = int(w0.cols);
  a.batch = req.batch;
  a.epilogue = req.epilogue;
  a.n_out = req.n_out;
  int total = 0;
  for (int i = 0; i < req.n_out; ++i) {
    const GpuMatrix& w = *req.out[i].w;
    a.codes[i] = w.codes.data();
    a.scales[i] = w.scales.data();
    a.y[i] = req.out[i].y;
    a.rows[i] = int(w.rows);
    total += int(w.rows);
    a.row_end[i] = total;
  }
  a.total_rows = pair ? int(w0.rows) : total;
  if (pair) dispatch<true>(w0.type, a, ws, stream, ctx);
  else dispatch<false>(w0.type, a, ws, stream, ctx);
}

}  // namespace

bool gemm_tc_supported(TensorType t) {
  return t == TensorType::Q8_0 || t == TensorType::Q4_0 || t == TensorType::Q1_0;
}

size_t gemm_tc_workspace_bytes(int batch, int64_t cols) {
  return ws_layout(8 * n_tiles(std::clamp(batch, 1, kGemmTcMax)), cols).total;
}

void gemm_tc(const GemvBatchRequest& req, const GemmTcWorkspace& ws, cudaStream_t stream, const DeviceContext& ctx) {
  KVQ_CHECK(req.n_out >= 1 && req.n_out <= kMaxOut && req.x && req.out[0].w && req.batch >= 1, Errc::internal,
            "GPU tensor-core GEMM: ", req.n_out, " outputs and a batch of ", req.batch,
            " requested (1..3 outputs, a batch >= 1, with an input)");
  KVQ_CHECK(req.epilogue != GemvEpilogue::swiglu || req.n_out == 2, Errc::internal,
            "GPU tensor-core GEMM: swiglu needs exactly two matrices (gate, up)");
  const GpuMatrix& w0 = *req.out[0].w;
  KVQ_CHECK(gemm_tc_supported(w0.type) && gpu_gemv_supported(w0.type, w0.cols), Errc::unsupported,
            "GPU tensor-core GEMM: unsupported ", gguf::tensor_type_name(w0.type), " matrix with ", w0.cols,
            " columns (Q8_0, Q4_0, Q1_0 with a multiple of 256 columns; others: gemv_batch)");
  const int64_t x_floats = int64_t(req.batch) * w0.cols;
  int64_t total_rows = 0;
  for (int i = 0; i < req.n_out; ++i) {
    KVQ_CHECK(req.out[i].w, Errc::internal, "GPU tensor-core GEMM: output ", i, " has no matrix");
    const GpuMatrix& w = *req.out[i].w;
    const bool needs_y = req.epilogue != GemvEpilogue::swiglu || i == 0;
    KVQ_CHECK(w.type == w0.type && w.cols == w0.cols && (req.out[i].y || !needs_y), Errc::internal,
              "GPU tensor-core GEMM: fused matrices must share type and width (", gguf::tensor_type_name(w.type),
              " x ", w.cols, " vs ", gguf::tensor_type_name(w0.type), " x ", w0.cols, ")");
    KVQ_CHECK(w.rows >= 1 && w.cols <= (int64_t(1) << 24), Errc::out_of_range, "GPU tensor-core GEMM: matrix of ",
              w.rows, " x ", w.cols, " is out of range");
    KVQ_CHECK(reinterpret_cast<uintptr_t>(w.codes.data()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(w.scales.data()) % 4 == 0,
              Errc::internal, "GPU tensor-core GEMM: weight codes must be 16-byte and scales 4-byte aligned");
    total_rows += w.rows;
    if (needs_y) {
      const float* y = req.out[i].y;
      const int64_t y_floats = int64_t(req.batch) * w.rows;
      const bool overlaps_x = y < req.x + x_floats && req.x < y + y_floats;
      const bool overlaps_norm = req.norm_weight && y < req.norm_weight + w.cols && req.norm_weight < y + y_floats;
      KVQ_CHECK(!overlaps_x && !overlaps_norm, Errc::internal, "GPU tensor-core GEMM: an output overlaps the input");
    }
  }
  KVQ_CHECK(total_rows <= (int64_t(1) << 30), Errc::out_of_range, "GPU tensor-core GEMM: ", total_rows,
            " rows are out of range");
  if (req.epilogue == GemvEpilogue::swiglu)
    KVQ_CHECK(req.out[1].w->rows == w0.rows, Errc::internal, "GPU tensor-core GEMM: swiglu gate and up differ in rows");
  if (ws.data) {
    const size_t need = gemm_tc_workspace_bytes(req.batch, w0.cols);
    KVQ_CHECK(ws.bytes >= need && reinterpret_cast<uintptr_t>(ws.data) % 16 == 0, Errc::internal,
              "GPU tensor-core GEMM: a workspace of ", ws.bytes, " bytes for ", need,
              " (16-byte aligned) at batch ", req.batch, " and ", w0.cols, " columns");
    const auto* lo = static_cast<const unsigned char*>(ws.data);
    const auto* hi = lo + need;
    auto overlaps = [&](const float* p, int64_t n) {
      const auto* b = reinterpret_cast<const unsigned char*>(p);
      return p && b < hi && lo < reinterpret_cast<const unsigned char*>(p + n);
    };
    bool bad = overlaps(req.x, x_floats) || (req.norm_weight && overlaps(req.norm_weight, w0.cols));
    for (int i = 0; i < req.n_out; ++i) bad = bad || overlaps(req.out[i].y, int64_t(req.batch) * req.out[i].w->rows);
    KVQ_CHECK(!bad, Errc::internal, "GPU tensor-core GEMM: the workspace overlaps the input or an output");
  }
  for (int b0 = 0; b0 < req.batch; b0 += kGemmTcMax) {
    GemvBatchRequest part = req;
    part.batch = std::min(kGemmTcMax, req.batch - b0);
    part.x = req.x + int64_t(b0) * w0.cols;
    for (int i = 0; i < req.n_out; ++i)
      if (part.out[i].y) part.out[i].y += int64_t(b0) * req.out[i].w->rows;
    launch_chunk(part, ws.data, stream, ctx);
  }
}

void gemm_tc(const GpuMatrix& w, const float* x, int batch, float* y, const GemmTcWorkspace& ws, cudaStream_t stream,
             const DeviceContext& ctx) {
  GemvBatchRequest req;
  req.x = x;
  req.batch = batch;
  req.out[0] = {&w, y};
  gemm_tc(req, ws, stream, ctx);
}

}  // namespace kvq::cuda
