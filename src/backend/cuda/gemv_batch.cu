// Batched decode GEMV (gemv_batch.hpp): y[b] = W u[b] for b < B <= 16 rows
// of x, every weight row read once per launch for all B inputs. CUDA cores,
// not tensor cores: for B <= 16 the product is bound by weight bytes at
// small B and by per-weight ALU work (B dot products per decoded weight) at
// large B; docs/perf.md ("Batched GEMV") has the arithmetic.
//
// Launch: 16 warps per CTA and one CTA per SM (GemvBatchRequest::
// warps_per_cta = 8: 8 warps, two CTAs per SM), up to 200 (110) KB of shared
// memory per CTA, at most 128 registers per thread (__launch_bounds__(512,
// 1)), a grid of about one (two) CTAs per SM: every CTA stages all B input
// rows, so the fewer CTAs the less of x is read from L2. K-quant SwiGLU pairs
// at B >= 8 run as one CTA of 8 warps per SM with up to 255 registers
// (Shape::kWideRegs).
// A task is R consecutive rows of one output matrix (for swiglu the same R
// rows of gate and of up); CTA c owns the contiguous tasks
// [c * tasks_per_cta, (c + 1) * tasks_per_cta), its warp w the tasks
// w, w + warps, ... of that range. R = 2 when (matrices per task) x B <= 16 so
// that each staged input value read from shared memory serves two rows, else
// 1 (registers: a task holds (matrices x R x B) fp32 sums per lane).
// K-quants always take R = 1.
//
// Column tiles: the B staged inputs need B times gemv()'s shared memory
// (16 x 4096 fp32 values are 256 KB), so the columns are walked in tiles of
// tile_cols (a multiple of 256, as wide as fits; one tile whenever it fits).
// Per tile: every warp of the CTA stages its share of the tile's columns of
// all B rows, __syncthreads, then each warp walks its tasks over the tile's
// columns. A task's per-lane sums are reduced across the warp (a transposing
// butterfly: N sums of 32 lanes in N - 1 + log2(32 / N) shuffles, not
// 5 N) and added to the task's slot in shared memory; after the last tile
// the slot holds the full dot products and the warp runs the epilogue. Each
// weight byte is still read exactly once.
//
// Per-warp work split inside a tile:
//   F32/F16/BF16, Q8_0, Q4_0, Q1_0: lane l takes 16-byte chunks l, l + 32, ...
//     of each of the task's rows (F32 4 weights per chunk, F16/BF16 8, Q8_0
//     16, Q4_0 32, Q1_0 128); it decodes the chunk once (widening, nibble or
//     bit masks) and then dots it with the B staged inputs. The next chunk
//     (of this task or the warp's next) is loaded before the current one is
//     computed; the first load of each tile is issued before the tile is
//     staged (on tile 0 before waiting for the kernel that writes x).
//   Q4_K/Q5_K/Q6_K: 8 lanes per 256-weight super-block, 32 weights each (two
//     runs of 16); Q2_K/Q3_K: 4 lanes per super-block, 64 weights (four runs
//     of 16); a warp step covers 4 (8) super-blocks. Each run's codes become
//     four words of bytes once (kquant_runs.cuh), then a dp4a sum with each
//     of the B inputs, scaled in fp32 (pairs at B = 4: gate's record, then
//     up's, for registers).
//
// Shared memory (dynamic, bytes from 0; B = the launch's batch, T = tile_cols):
//   staged tile, fp32 types (F32/F16/BF16):
//     float u[B][T]                        u = x (* norm weight)
//   staged tile, int8 types (Q8_0/Q4_0/Q1_0, K-quants):
//     int8  q[B][T] in 16-byte units, unit i of a row stored at
//           swz(i) = (i & ~7) | ((i ^ (i >> 3)) & 7) (the 8 lanes of a
//           shared-memory phase read units 1, 2 or 8 apart: distinct banks;
//           K-quants: their lane mapping's swizzle, kquant_runs.cuh);
//     float scale[B][T / 32], int sum[B][T / S] (code sum per S values:
//           32, K-quants 16)
//   float ss_seg[B][T / 128]               sum of x^2 per 128 staged columns
//   float ss_total[16], inv_rms[16]        per input row
//   float sums[slots][N]                   N = matrices x R x B16 per task, B16 the
//                                          bucket; slots = warps (one per warp) with one
//                                          tile, tasks_per_cta with several
// The RMSNorm of row b: u_b = x_b * g is staged and 1/rms_b multiplies the
// finished dot products (as gemv() does); ss is summed per 128-column
// segment, then per row in a fixed order, so identical rows get identical
// 1/rms.
#include "backend/cuda/gemv_batch.hpp"

#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/kquant.cuh"
#include "backend/cuda/kquant_runs.cuh"
#include "backend/cuda/occupancy.hpp"
#include "backend/cuda/stage_int8.cuh"
#include "core/error.hpp"

namespace kvq::cuda {

using gguf::TensorType;

namespace {

constexpr int kMaxOut = 3;
constexpr int kSegCols = 128;   // a warp stages 128 columns (a float4 per lane) of one row at a time
constexpr int kTileAlign = 256;  // tile widths: K-quant super-blocks, whole int8 unit groups
constexpr int kStageBatch = 4;   // independent x loads per lane in flight while staging

__host__ __device__ constexpr bool is_kquant(TensorType t) {
  return t == TensorType::Q2_K || t == TensorType::Q3_K || t == TensorType::Q4_K || t == TensorType::Q5_K ||
         t == TensorType::Q6_K;
}
__host__ __device__ constexpr bool stages_int8(TensorType t) {
  return t == TensorType::Q8_0 || t == TensorType::Q4_0 || t == TensorType::Q1_0 || is_kquant(t);
}
// Staged values per code sum (K-quants change scale every 16 weights).
__host__ __device__ constexpr int sum_span(TensorType t) { return is_kquant(t) ? 16 : 32; }
// Bytes of one staged input row of `tile` columns.
__host__ __device__ constexpr size_t staged_data_bytes(TensorType t, int tile) {
  return stages_int8(t) ? size_t(tile) + size_t(tile / 32) * 4 + size_t(tile / sum_span(t)) * 4 : size_t(tile) * 4;
}
// Weights per 16-byte chunk of codes and per fp16 scale (0: no scales), non-K types.
__host__ __device__ constexpr int weights_per_chunk(TensorType t) {
  return t == TensorType::F32 ? 4 : t == TensorType::Q8_0 ? 16 : t == TensorType::Q4_0 ? 32 : t == TensorType::Q1_0 ? 128 : 8;
}
__host__ __device__ constexpr int weights_per_scale(TensorType t) {
  return t == TensorType::Q8_0 || t == TensorType::Q4_0 ? 32 : t == TensorType::Q1_0 ? 128 : 0;
}
// Bytes of codes per row, and fp16 scales per row.
__host__ __device__ constexpr int64_t row_code_bytes(TensorType t, int64_t cols) {
  return is_kquant(t) ? cols / 256 * kq::code_bytes(t) : cols / weights_per_chunk(t) * 16;
}
__host__ __device__ constexpr int64_t row_scales(TensorType t, int64_t cols) {
  return is_kquant(t) ? cols / 256 * kq::scale_count(t) : weights_per_scale(t) ? cols / weights_per_scale(t) : 0;
}

// Shared-memory bytes per staged input row of a tile of `tile` columns
// (staged values and the sum-of-squares segments).
__host__ __device__ constexpr size_t staged_row_bytes(TensorType t, int tile) {
  return staged_data_bytes(t, tile) + size_t(tile / kSegCols) * 4;
}

template <TensorType T, int BB, bool kPair>
struct Shape {
  static constexpr int kMats = kPair ? 2 : 1;
  // Q1_0 also holds 8 bit-mask words per loaded row: 4 rows x 8 inputs
  // would spill, so its SwiGLU pairs take 2 rows only up to B = 4.
  static constexpr int kRows =
      !is_kquant(T) && kMats * BB <= (T == TensorType::Q1_0 && kPair ? 8 : 16) ? 2 : 1;
  static constexpr int kLoaded = kMats * kRows;  // rows of weights a lane holds per step
  static constexpr int kSums = kLoaded * BB;     // per-lane fp32 sums of one task (a power of two)
  // K-quant pairs from B = 8 hold 2 x B sums next to two records and two
  // decoded runs: more than 128 registers, so they run as one CTA of 8 warps
  // per SM with up to 255 (the others: 16 warps, at most 128).
  static constexpr bool kWideRegs = is_kquant(T) && kPair && BB >= 8;
  static constexpr int kMaxWarps = kWideRegs ? 8 : 16;
};

struct BatchArgs {
  const uint8_t* codes[kMaxOut];
  const uint16_t* scales[kMaxOut];
  float* y[kMaxOut];
  int rows[kMaxOut];
  int task_end[kMaxOut];  // cumulative: output s owns tasks [task_end[s-1], task_end[s])
  int n_out;
  int n_tasks;
  int tasks_per_cta;
  const float* x;
  const float* norm;  // null: no norm
  float eps;
  int cols;
  int batch;  // rows of x, <= the kernel's bucket
  GemvEpilogue epilogue;
  int tile_cols;
  int n_tiles;
  int ss_offset;    // byte offsets in dynamic shared memory (top of this file)
  int rms_offset;
  int sums_offset;
};

// The decode GEMV's (gemv_args.cuh, through kquant_runs.cuh): weights are
// read exactly once, with no L1 allocation.
using gemv_detail::load_weights16;
using gemv_detail::warp_sum;

__device__ __forceinline__ int swz(int unit) { return (unit & ~7) | ((unit ^ (unit >> 3)) & 7); }
// Where a type's staged unit lives (the K-quants' lanes read other patterns).
template <TensorType T>
__device__ __forceinline__ int unit_at(int unit) {
  if constexpr (is_kquant(T)) return kq::Runs<T>::Swizzle::at(unit);
  else return swz(unit);
}
using kq::half_at;
using kq::word_of;

// The staged tile as the dot products read it (layout at the top of this file).
struct Tile {
  const unsigned char* base;
  int cols;   // tile_cols (the row stride)
  int batch;
  int sum_span;  // staged values per code sum
  __device__ const float4* uf4(int b) const { return reinterpret_cast<const float4*>(base) + size_t(b) * (cols / 4); }
  __device__ const int4* uq(int b) const { return reinterpret_cast<const int4*>(base) + b * (cols / 16); }
  __device__ const float* us(int b) const {
    return reinterpret_cast<const float*>(base + size_t(batch) * cols) + b * (cols / 32);
  }
  __device__ const int* usum(int b) const {
    return reinterpret_cast<const int*>(base + size_t(batch) * cols + size_t(batch) * (cols / 32) * 4) +
           b * (cols / sum_span);
  }
};

// Stages columns [col0, col0 + ncols) of the batch's rows of u = x (* norm)
// and each 128-column segment's sum of x^2 (with a norm). Work items are
// (row b, segment): a warp stages a segment with one float4 per lane,
// kStageBatch items per round so their x loads are in flight together. For
// int8 types the 8 lanes holding one group of 32 values find its amax and
// code sum by shuffles (stage_int8.cuh's rounding: q = round(u * (127 / amax))).
template <TensorType T>
__device__ void stage_tile(const BatchArgs& a, unsigned char* smem, int col0, int ncols) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int segs = (ncols + kSegCols - 1) / kSegCols;
  const int items = a.batch * segs;
  float* ss_seg = reinterpret_cast<float*>(smem + a.ss_offset);
  const int warps = blockDim.x >> 5;
  for (int base = warp; base < items; base += warps * kStageBatch) {
    float4 v[kStageBatch];
#pragma unroll
    for (int k = 0; k < kStageBatch; ++k) {
      const int item = base + k * warps;
      v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (item < items) {
        const int b = item / segs, seg = item - b * segs;
        const int lc = seg * kSegCols + 4 * lane;
        if (lc < ncols) v[k] = *reinterpret_cast<const float4*>(a.x + size_t(b) * a.cols + col0 + lc);
      }
    }
#pragma unroll
    for (int k = 0; k < kStageBatch; ++k) {
      const int item = base + k * warps;
      if (item >= items) continue;  // warp-uniform
      const int b = item / segs, seg = item - b * segs;
      const int lc = seg * kSegCols + 4 * lane;
      float4 u = v[k];
      if (a.norm) {
        const float ss = warp_sum(u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w);
        if (lane == 0) ss_seg[b * (a.tile_cols / kSegCols) + seg] = ss;
        if (lc < ncols) {
          const float4 g = __ldg(reinterpret_cast<const float4*>(a.norm + col0 + lc));
          u = make_float4(u.x * g.x, u.y * g.y, u.z * g.z, u.w * g.w);
        }
      }
      if constexpr (stages_int8(T)) {
        // ncols is a multiple of 256 for these types: every lane is in range.
        float scale;
        int q[4];
        quantize4_int8(u, scale, q);
        // Values lc..lc+3: word (lc / 4) % 4 of 16-byte unit lc / 16 of row b.
        int* uq = reinterpret_cast<int*>(smem) + b * (a.tile_cols / 4);
        uq[unit_at<T>(lc >> 4) * 4 + ((lc >> 2) & 3)] = pack_int8x4(q);
        constexpr int kSpan = sum_span(T);
        int sum = q[0] + q[1] + q[2] + q[3];
#pragma unroll
        for (int o = kSpan / 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        const int groups = a.tile_cols / 32, spans = a.tile_cols / kSpan;
        float* us = reinterpret_cast<float*>(smem + size_t(a.batch) * a.tile_cols);
        int* usum = reinterpret_cast<int*>(smem + size_t(a.batch) * a.tile_cols + size_t(a.batch) * groups * 4);
        if ((lane & 7) == 0) us[b * groups + (lc >> 5)] = scale;
        if ((lane & (kSpan / 4 - 1)) == 0) usum[b * spans + lc / kSpan] = sum;
      } else {
        // Columns past the matrix (a float type's last tile) are staged as 0.
        reinterpret_cast<float4*>(smem)[(size_t(b) * a.tile_cols + lc) / 4] = u;
      }
    }
  }
}

// One tile's staging: waits for the producer of x (tile 0) or for every warp
// to be done with the previous tile, stages the tile, and adds its sums of
// squares to each row's total (thread b, segments in order); after the last
// tile, 1/rms of each row is ready for every warp.
template <TensorType T>
__device__ __forceinline__ void stage_step(const BatchArgs& a, unsigned char* smem, int col0, int ncols, bool first,
                                           bool last) {
  if (first) wait_for_predecessor();
  else __syncthreads();
  stage_tile<T>(a, smem, col0, ncols);
  __syncthreads();
  const int b = threadIdx.x;
  if (b < a.batch) {
    float* ss_total = reinterpret_cast<float*>(smem + a.rms_offset);
    float* inv_rms = ss_total + kGemvBatchMax;
    if (a.norm) {
      const float* ss_seg = reinterpret_cast<const float*>(smem + a.ss_offset) + b * (a.tile_cols / kSegCols);
      float s = 0.0f;
      for (int seg = 0; seg < (ncols + kSegCols - 1) / kSegCols; ++seg) s += ss_seg[seg];
      ss_total[b] = first ? s : ss_total[b] + s;
    }
    if (last) inv_rms[b] = a.norm ? 1.0f / sqrtf(ss_total[b] / float(a.cols) + a.eps) : 1.0f;
  }
  if (last) __syncthreads();
}

// ---- non-K types: a 16-byte chunk of R rows (x matrices), decoded once, dotted with B inputs

template <int NW>
struct Chunks {
  uint4 w[NW];
  float d[NW];  // the chunk's fp16 scale (1 for float types)
};

// acc[n][b] += chunk n . u_b for the chunk `il` of the tile (il counts chunks from the tile start).
template <TensorType T, int NW, int BB>
__device__ __forceinline__ void accumulate_chunk(const Chunks<NW>& c, const Tile& t, int il, float (&acc)[NW][BB]) {
  if constexpr (T == TensorType::F32) {
#pragma unroll
    for (int b = 0; b < BB; ++b) {
      if (b >= t.batch) continue;  // (continue, not break: a constant trip count keeps the loop unrolled)
      const float4 u = t.uf4(b)[il];
#pragma unroll
      for (int n = 0; n < NW; ++n) {
        const uint4 w = c.w[n];
        acc[n][b] += __uint_as_float(w.x) * u.x + __uint_as_float(w.y) * u.y + __uint_as_float(w.z) * u.z +
                     __uint_as_float(w.w) * u.w;
      }
    }
  } else if constexpr (T == TensorType::F16 || T == TensorType::BF16) {
    float wf[NW][8];
#pragma unroll
    for (int n = 0; n < NW; ++n) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t q = word_of(c.w[n], k);
        if constexpr (T == TensorType::BF16) {
          wf[n][2 * k] = __uint_as_float(q << 16);
          wf[n][2 * k + 1] = __uint_as_float(q & 0xffff0000u);
        } else {
          const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&q));
          wf[n][2 * k] = f.x;
          wf[n][2 * k + 1] = f.y;
        }
      }
    }
#pragma unroll
    for (int b = 0; b < BB; ++b) {
      if (b >= t.batch) continue;
      const float4 ua = t.uf4(b)[2 * il], ub = t.uf4(b)[2 * il + 1];
#pragma unroll
      for (int n = 0; n < NW; ++n) {
        float s = wf[n][0] * ua.x;
        s = fmaf(wf[n][1], ua.y, s);
        s = fmaf(wf[n][2], ua.z, s);
        s = fmaf(wf[n][3], ua.w, s);
        s = fmaf(wf[n][4], ub.x, s);
        s = fmaf(wf[n][5], ub.y, s);
        s = fmaf(wf[n][6], ub.z, s);
        acc[n][b] += fmaf(wf[n][7], ub.w, s);
      }
    }
  } else if constexpr (T == TensorType::Q8_0) {
#pragma unroll
    for (int b = 0; b < BB; ++b) {
      if (b >= t.batch) continue;
      const int4 u = t.uq(b)[swz(il)];
      const float us = t.us(b)[il >> 1];
#pragma unroll
      for (int n = 0; n < NW; ++n) {
        int dot = __dp4a(int(c.w[n].x), u.x, 0);
        dot = __dp4a(int(c.w[n].y), u.y, dot);
        dot = __dp4a(int(c.w[n].z), u.z, dot);
        dot = __dp4a(int(c.w[n].w), u.w, dot);
        acc[n][b] += c.d[n] * us * float(dot);
      }
    }
  } else if constexpr (T == TensorType::Q4_0) {
    // Byte j of a block: low nibble = weight j, high nibble = weight j + 16; w = (q - 8) d.
    uint32_t lo[NW][4], hi[NW][4];
#pragma unroll
    for (int n = 0; n < NW; ++n) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        lo[n][k] = word_of(c.w[n], k) & 0x0f0f0f0fu;
        hi[n][k] = (word_of(c.w[n], k) >> 4) & 0x0f0f0f0fu;
      }
    }
#pragma unroll
    for (int b = 0; b < BB; ++b) {
      if (b >= t.batch) continue;
      const int4 ua = t.uq(b)[swz(2 * il)], ub = t.uq(b)[swz(2 * il + 1)];
      const float us = t.us(b)[il];
      const int usum = t.usum(b)[il];
#pragma unroll
      for (int n = 0; n < NW; ++n) {
        int dot = __dp4a(int(lo[n][0]), ua.x, 0);
        dot = __dp4a(int(lo[n][1]), ua.y, dot);
        dot = __dp4a(int(lo[n][2]), ua.z, dot);
        dot = __dp4a(int(lo[n][3]), ua.w, dot);
        dot = __dp4a(int(hi[n][0]), ub.x, dot);
        dot = __dp4a(int(hi[n][1]), ub.y, dot);
        dot = __dp4a(int(hi[n][2]), ub.z, dot);
        dot = __dp4a(int(hi[n][3]), ub.w, dot);
        acc[n][b] += c.d[n] * us * float(dot - 8 * usum);
      }
    }
  } else {  // Q1_0
    // sum_j s_j u_j with signs s = +-1 is 2 * (sum over set bits of u_j) - sum_j u_j. The GPU
    // layout transposes each word (weight 4k + i at bit 8i + k), so weights 4k..4k+3 as 0/1
    // bytes are (word >> k) & 0x01010101: one dp4a with four int8 inputs. The masks of a
    // word are built once and serve all B inputs.
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t m[NW][8];
#pragma unroll
      for (int n = 0; n < NW; ++n) {
        const uint32_t w = word_of(c.w[n], k);
#pragma unroll
        for (int s = 0; s < 8; ++s) m[n][s] = (w >> s) & 0x01010101u;
      }
#pragma unroll
      for (int b = 0; b < BB; ++b) {
        if (b >= t.batch) continue;
        const int4 ua = t.uq(b)[swz(8 * il + 2 * k)], ub = t.uq(b)[swz(8 * il + 2 * k + 1)];
        const float us = t.us(b)[4 * il + k];
        const int usum = t.usum(b)[4 * il + k];
#pragma unroll
        for (int n = 0; n < NW; ++n) {
          int set = __dp4a(int(m[n][0]), ua.x, 0);
          set = __dp4a(int(m[n][1]), ua.y, set);
          set = __dp4a(int(m[n][2]), ua.z, set);
          set = __dp4a(int(m[n][3]), ua.w, set);
          set = __dp4a(int(m[n][4]), ub.x, set);
          set = __dp4a(int(m[n][5]), ub.y, set);
          set = __dp4a(int(m[n][6]), ub.z, set);
          set = __dp4a(int(m[n][7]), ub.w, set);
          acc[n][b] += c.d[n] * us * float(2 * set - usum);
        }
      }
    }
  }
}

// ---- the warp's per-task reduction

// Sums each of the N (a power of two) per-lane values over the warp with N - 1
// + log2(32 / N) shuffles instead of 5 N: each step halves the values a lane
// holds, the lane keeping the half its partner does not. Afterwards, for
// N >= 32, lane l holds in v[k] (k < N / 32) the total of value k + (N / 32) l;
// for N < 32, v[0] of lane l is the total of value l >> (5 - log2 N). Every
// value's total is summed over the same butterfly tree as warp_sum.
// Steps are instantiated one by one (template recursion) so that every
// index is a constant: a loop over steps with a step-dependent inner trip
// count stayed rolled and put v in local memory.
template <int N>
constexpr int log2_of() {
  return N >= 32 ? 5 : N >= 16 ? 4 : N >= 8 ? 3 : N >= 4 ? 2 : N >= 2 ? 1 : 0;
}
template <int N, int S>
__device__ __forceinline__ void transpose_reduce_step(float (&v)[N], int lane) {
  if constexpr (S < log2_of<N>()) {
    constexpr int o = 16 >> S, h = N >> (S + 1);
    const bool upper = (lane & o) != 0;
#pragma unroll
    for (int i = 0; i < h; ++i) {
      // Select values, not addresses (a select of two array elements can
      // become a dynamically indexed local array).
      const float lower_half = v[i], upper_half = v[i + h];
      const float send = upper ? lower_half : upper_half;
      const float keep = upper ? upper_half : lower_half;
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
    transpose_reduce_step<N, S + 1>(v, lane);
  }
}
template <int N>
__device__ __forceinline__ void transpose_reduce(float (&v)[N], int lane) {
  transpose_reduce_step<N, 0>(v, lane);
  if constexpr (N < 32) {
#pragma unroll
    for (int o = 16 >> log2_of<N>(); o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
  }
}

// Output segment (which of the fused matrices) and first row of a task.
template <int R, bool kPair>
__device__ __forceinline__ void task_rows(const BatchArgs& a, int task, int& seg, int& row0) {
  seg = 0;
  if (!kPair) {
    while (task >= a.task_end[seg]) ++seg;
  }
  row0 = (task - (seg ? a.task_end[seg - 1] : 0)) * R;
}

// Reduces a task's per-lane sums for this tile into its slot; after the last
// tile, writes the task's outputs (lanes over (row, input) pairs).
template <TensorType T, int BB, bool kPair>
__device__ __forceinline__ void finish_task(const BatchArgs& a, int task, float* slot, bool first_tile,
                                            bool last_tile, const float* inv_rms,
                                            float (&acc)[Shape<T, BB, kPair>::kLoaded][BB]) {
  using S = Shape<T, BB, kPair>;
  constexpr int R = S::kRows, KM = S::kMats, N = S::kSums;
  const int lane = threadIdx.x & 31;
  // Sum index of (row r, input b, matrix m): ((r * BB) + b) * KM + m; acc's row index is m * R + r.
  float v[N];
#pragma unroll
  for (int m = 0; m < KM; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < BB; ++b) v[(r * BB + b) * KM + m] = acc[m * R + r][b];
  transpose_reduce<N>(v, lane);
  if constexpr (N >= 32) {
#pragma unroll
    for (int k = 0; k < N / 32; ++k) {
      const int idx = k + (N / 32) * lane;
      slot[idx] = first_tile ? v[k] : slot[idx] + v[k];
    }
  } else {
    constexpr int kShift = N >= 16 ? 1 : N >= 8 ? 2 : N >= 4 ? 3 : N >= 2 ? 4 : 5;
    if ((lane & ((1 << kShift) - 1)) == 0) {
      const int idx = lane >> kShift;
      slot[idx] = first_tile ? v[0] : slot[idx] + v[0];
    }
  }
  __syncwarp();
  if (last_tile) {
    int seg, row0;
    task_rows<R, kPair>(a, task, seg, row0);
    const int rows = a.rows[seg];
    for (int e = lane; e < R * BB; e += 32) {
      const int r = e / BB, b = e % BB;
      if (b >= a.batch || row0 + r >= rows) continue;
      const float g = slot[e * KM] * inv_rms[b];
      float* y = a.y[seg] + size_t(b) * rows + row0 + r;
      if constexpr (kPair) {
        const float u = slot[e * KM + 1] * inv_rms[b];
        *y = g / (1.0f + expf(-g)) * u;
      } else {
        *y = a.epilogue == GemvEpilogue::add ? *y + g : g;
      }
    }
  }
  __syncwarp();  // the slot is rewritten by the warp's next task
}

template <TensorType T, int BB, bool kPair>
// (512, 1): at most 128 registers, so that 16 warps fit an SM (or two CTAs
// of 8); (256, 1) for the K-quant pairs of Shape::kWideRegs.
__global__ void __launch_bounds__(Shape<T, BB, kPair>::kMaxWarps * 32, 1) gemv_batch_kernel(BatchArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  using S = Shape<T, BB, kPair>;
  constexpr int R = S::kRows, NW = S::kLoaded, N = S::kSums;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int task_lo = blockIdx.x * a.tasks_per_cta;
  const int task_hi = min(a.n_tasks, task_lo + a.tasks_per_cta);
  const float* inv_rms = reinterpret_cast<const float*>(smem + a.rms_offset) + kGemvBatchMax;
  float* sums = reinterpret_cast<float*>(smem + a.sums_offset);
  const int64_t code_bytes = row_code_bytes(T, a.cols);
  const int64_t n_scales = row_scales(T, a.cols);
  allow_dependents();

  // Row pointers of weight row n (= m * R + r) of a task; rows past the
  // matrix re-read its last row (their sums are never stored).
  auto row_of = [&](int task, int n, const uint8_t*& codes, const uint16_t*& scales) {
    int seg, row0;
    task_rows<R, kPair>(a, task, seg, row0);
    const int m = n / R, r = n % R;
    const int mi = kPair ? m : seg;
    const int row = min(row0 + r, a.rows[kPair ? 0 : seg] - 1);
    codes = a.codes[mi] + size_t(row) * code_bytes;
    scales = a.scales[mi] + size_t(row) * n_scales;
  };

  for (int tile = 0; tile < a.n_tiles; ++tile) {
    const int col0 = tile * a.tile_cols;
    const int ncols = min(a.tile_cols, a.cols - col0);
    const bool first = tile == 0, last = tile == a.n_tiles - 1;
    const Tile view{smem, a.tile_cols, a.batch, sum_span(T)};
    auto slot_of = [&](int task) {
      return a.n_tiles == 1 ? sums + warp * N : sums + size_t(task - task_lo) * N;
    };

    if constexpr (!is_kquant(T)) {
      constexpr int PC = weights_per_chunk(T), PS = weights_per_scale(T);
      const int chunk_lo = col0 / PC, chunk_hi = (col0 + ncols) / PC;
      const int steps = (chunk_hi - chunk_lo + 31) / 32;
      auto load = [&](Chunks<NW>& c, int task, int i) {
#pragma unroll
        for (int n = 0; n < NW; ++n) {
          const uint8_t* codes;
          const uint16_t* scales;
          row_of(task, n, codes, scales);
          if (i < chunk_hi) {
            c.w[n] = load_weights16(codes + size_t(i) * 16);
            c.d[n] = PS > 0 ? half_at(scales + (i * PC) / PS) : 1.0f;
          } else {
            c.w[n] = make_uint4(0, 0, 0, 0);
            c.d[n] = 0.0f;
          }
        }
      };
      // The first chunk of the warp's first task goes out before the tile is
      // staged (on tile 0, before waiting for the producer of x).
      int task = task_lo + warp, step = 0;
      Chunks<NW> cur, next;
      if (task < task_hi) load(cur, task, chunk_lo + lane);
      stage_step<T>(a, smem, col0, ncols, first, last);
      float acc[NW][BB] = {};
      while (task < task_hi) {
        int next_task = task, next_step = step + 1;
        if (next_step == steps) {
          next_task += warps;
          next_step = 0;
        }
        if (next_task < task_hi) load(next, next_task, chunk_lo + lane + 32 * next_step);
        const int il = lane + 32 * step;
        if (chunk_lo + il < chunk_hi) accumulate_chunk<T, NW, BB>(cur, view, il, acc);
        if (next_step == 0) {
          finish_task<T, BB, kPair>(a, task, slot_of(task), first, last, inv_rms, acc);
#pragma unroll
          for (int n = 0; n < NW; ++n)
#pragma unroll
            for (int b = 0; b < BB; ++b) acc[n][b] = 0.0f;
        }
        cur = next;
        task = next_task;
        step = next_step;
      }
    } else {
      using K = kq::Runs<T>;
      constexpr int kSlots = 32 / K::kLanes;  // super-blocks per warp step
      constexpr int kRec = kq::code_bytes(T), kSc = kq::scale_count(T);
      const int slot_sb = lane / K::kLanes, j = lane % K::kLanes;
      const int sb_lo = col0 / 256, sb_hi = (col0 + ncols) / 256;
      // Pairs at B = 4 load and decode gate and up in turn (both rows'
      // records next to 2 x 4 sums would spill at 128 registers); from B = 8
      // they have 255 (Shape::kWideRegs).
      constexpr bool kKSerial = NW > 1 && BB == 4;
      stage_step<T>(a, smem, col0, ncols, first, last);
      for (int task = task_lo + warp; task < task_hi; task += warps) {
        float acc[NW][BB] = {};
        for (int sb = sb_lo + slot_sb; sb < sb_hi; sb += kSlots) {
          const int tb = sb - sb_lo;  // the super-block's index in the tile
          auto load_part = [&](int n) {
            const uint8_t* codes;
            const uint16_t* scales;
            row_of(task, n, codes, scales);
            return K::load(codes + size_t(sb) * kRec, scales + size_t(sb) * kSc, j);
          };
          // Run r of the lane against every input: its staged codes, their
          // group scale and code sum.
          auto add_run = [&](const typename K::Data& d, int r, float (&acc_n)[BB]) {
            const int c = K::unit(j, r), unit = 16 * tb + c, at = K::Swizzle::in_block(tb, c);
            const kq::RunCodes q = K::codes(d, j, r);
            const kq::RunScale sc = K::scale(d, j, r);
#pragma unroll
            for (int b = 0; b < BB; ++b) {
              if (b >= a.batch) continue;
              const int dot = kq::dot_run(q, view.uq(b)[at]);
              acc_n[b] += kq::run_value(sc, dot, view.usum(b)[unit], view.us(b)[unit >> 1]);
            }
          };
          if constexpr (kKSerial) {
            // One matrix's record at a time; each input is read once per matrix.
#pragma unroll
            for (int n = 0; n < NW; ++n) {
              const typename K::Data d = load_part(n);
#pragma unroll
              for (int r = 0; r < K::kRuns; ++r) add_run(d, r, acc[n]);
            }
          } else {
            typename K::Data d[NW];
#pragma unroll
            for (int n = 0; n < NW; ++n) d[n] = load_part(n);
#pragma unroll
            for (int r = 0; r < K::kRuns; ++r)
#pragma unroll
              for (int n = 0; n < NW; ++n) add_run(d[n], r, acc[n]);
          }
        }
        finish_task<T, BB, kPair>(a, task, slot_of(task), first, last, inv_rms, acc);
      }
    }
  }
}

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// Launch shapes: 16 warps, one CTA per SM (the default: every CTA stages
// all B input rows, so fewer CTAs read less of x from L2), or 8 warps, two
// CTAs per SM (a CTA's staging overlaps the other's streaming).
struct LaunchShape {
  int warps, ctas_per_sm;
  size_t smem_budget;  // per CTA
};
LaunchShape launch_shape(int warps_per_cta) {
  return warps_per_cta == 8 ? LaunchShape{8, 2, 110 * 1024} : LaunchShape{16, 1, 200 * 1024};
}

// Grid, tiles and shared-memory layout of one launch (top of this file).
template <TensorType T, int BB, bool kPair>
void launch(BatchArgs a, const LaunchShape& requested, cudaStream_t stream, const DeviceContext& ctx) {
  using S = Shape<T, BB, kPair>;
  const LaunchShape shape = S::kWideRegs ? LaunchShape{8, 1, 200 * 1024} : requested;
  // Tasks of S::kRows rows per output (SwiGLU's up matrix has none: its rows
  // ride along with the gate's).
  int tasks = 0;
  for (int i = 0; i < a.n_out; ++i) {
    if (!kPair || i == 0) tasks += (a.rows[i] + S::kRows - 1) / S::kRows;
    a.task_end[i] = tasks;
  }
  a.n_tasks = tasks;
  const size_t sum_bytes = size_t(S::kSums) * sizeof(float);
  const size_t budget = shape.smem_budget;
  // About ctas_per_sm CTAs per SM: each stages the inputs once for all its tasks.
  int grid =
      std::max(1, std::min((a.n_tasks + shape.warps - 1) / shape.warps, shape.ctas_per_sm * ctx.sm_count()));
  int tasks_per_cta = (a.n_tasks + grid - 1) / grid;
  auto smem_for = [&](int tile, size_t sums) {
    const size_t data = size_t(a.batch) * staged_data_bytes(T, tile);
    a.ss_offset = int(data);
    a.rms_offset = int(data + align16(size_t(a.batch) * (tile / kSegCols) * 4));
    a.sums_offset = a.rms_offset + 2 * kGemvBatchMax * int(sizeof(float));
    return size_t(a.sums_offset) + sums;
  };
  const int full = (a.cols + kTileAlign - 1) / kTileAlign * kTileAlign;
  int tile = full;
  if (smem_for(full, shape.warps * sum_bytes) > budget) {
    // Several tiles: every task keeps its sums in shared memory between
    // tiles; more CTAs (fewer tasks each) when they would take half the budget.
    while (size_t(tasks_per_cta) * sum_bytes > budget / 2 && tasks_per_cta > 1) {
      grid *= 2;
      tasks_per_cta = (a.n_tasks + grid - 1) / grid;
    }
    // At least two tiles (full >= 512 here: 256 columns of 16 rows always fit),
    // so that the sums live in the per-task slots sized below.
    tile = std::clamp(int(budget / (size_t(a.batch) * staged_row_bytes(T, kTileAlign))) * kTileAlign, kTileAlign,
                      full - kTileAlign);
    while (tile > kTileAlign && smem_for(tile, size_t(tasks_per_cta) * sum_bytes) > budget) tile -= kTileAlign;
  }
  a.tile_cols = tile;
  a.n_tiles = (a.cols + tile - 1) / tile;
  a.tasks_per_cta = tasks_per_cta;
  grid = (a.n_tasks + tasks_per_cta - 1) / tasks_per_cta;
  const size_t smem = smem_for(tile, (a.n_tiles == 1 ? size_t(shape.warps) : size_t(tasks_per_cta)) * sum_bytes);
  KVQ_CHECK(smem <= 220 * 1024, Errc::out_of_range, "GPU batched GEMV: ", a.n_tasks, " tasks x ", a.cols,
            " columns need ", smem, " bytes of shared memory");
  auto* kernel = gemv_batch_kernel<T, BB, kPair>;
  resident_ctas(ctx, kernel, smem, shape.warps * 32);  // raises the kernel's shared-memory opt-in
  launch_dependent(ctx, kernel, dim3(grid), dim3(shape.warps * 32), smem, stream, a);
}

template <TensorType T, bool kPair>
void launch_bucket(const BatchArgs& a, const LaunchShape& shape, cudaStream_t stream, const DeviceContext& ctx) {
  if (a.batch <= 1) return launch<T, 1, kPair>(a, shape, stream, ctx);
  if (a.batch <= 2) return launch<T, 2, kPair>(a, shape, stream, ctx);
  if (a.batch <= 4) return launch<T, 4, kPair>(a, shape, stream, ctx);
  if (a.batch <= 8) return launch<T, 8, kPair>(a, shape, stream, ctx);
  return launch<T, 16, kPair>(a, shape, stream, ctx);
}

template <bool kPair>
void dispatch(TensorType t, const BatchArgs& a, const LaunchShape& shape, cudaStream_t stream,
              const DeviceContext& ctx) {
  switch (t) {
    case TensorType::F32: return launch_bucket<TensorType::F32, kPair>(a, shape, stream, ctx);
    case TensorType::F16: return launch_bucket<TensorType::F16, kPair>(a, shape, stream, ctx);
    case TensorType::BF16: return launch_bucket<TensorType::BF16, kPair>(a, shape, stream, ctx);
    case TensorType::Q8_0: return launch_bucket<TensorType::Q8_0, kPair>(a, shape, stream, ctx);
    case TensorType::Q4_0: return launch_bucket<TensorType::Q4_0, kPair>(a, shape, stream, ctx);
    case TensorType::Q1_0: return launch_bucket<TensorType::Q1_0, kPair>(a, shape, stream, ctx);
    case TensorType::Q2_K: return launch_bucket<TensorType::Q2_K, kPair>(a, shape, stream, ctx);
    case TensorType::Q3_K: return launch_bucket<TensorType::Q3_K, kPair>(a, shape, stream, ctx);
    case TensorType::Q4_K: return launch_bucket<TensorType::Q4_K, kPair>(a, shape, stream, ctx);
    case TensorType::Q5_K: return launch_bucket<TensorType::Q5_K, kPair>(a, shape, stream, ctx);
    case TensorType::Q6_K: return launch_bucket<TensorType::Q6_K, kPair>(a, shape, stream, ctx);
  }
  fail(Errc::internal, "GPU batched GEMV: no kernel for ", gguf::tensor_type_name(t));
}

// One launch of at most kGemvBatchMax rows (the request is checked).
void launch_chunk(const GemvBatchRequest& req, cudaStream_t stream, const DeviceContext& ctx) {
  const GpuMatrix& w0 = *req.out[0].w;
  const bool pair = req.epilogue == GemvEpilogue::swiglu;
  BatchArgs a{};
  a.x = req.x;
  a.norm = req.norm_weight;
  a.eps = req.norm_eps;
  a.cols = int(w0.cols);
  a.batch = req.batch;
  a.epilogue = req.epilogue;
  a.n_out = req.n_out;
  for (int i = 0; i < req.n_out; ++i) {
    const GpuMatrix& w = *req.out[i].w;
    a.codes[i] = w.codes.data();
    a.scales[i] = w.scales.data();
    a.y[i] = req.out[i].y;
    a.rows[i] = int(w.rows);
  }
  const LaunchShape shape = launch_shape(req.warps_per_cta);
  if (pair) dispatch<true>(w0.type, a, shape, stream, ctx);
  else dispatch<false>(w0.type, a, shape, stream, ctx);
}

}  // namespace

void gemv_batch(const GemvBatchRequest& req, cudaStream_t stream, const DeviceContext& ctx) {
  KVQ_CHECK(req.n_out >= 1 && req.n_out <= kMaxOut && req.x && req.out[0].w && req.batch >= 1, Errc::internal,
            "GPU batched GEMV: ", req.n_out, " outputs and a batch of ", req.batch,
            " requested (1..3 outputs, a batch >= 1, with an input)");
  KVQ_CHECK(req.epilogue != GemvEpilogue::swiglu || req.n_out == 2, Errc::internal,
            "GPU batched GEMV: swiglu needs exactly two matrices (gate, up)");
  KVQ_CHECK(req.warps_per_cta == 8 || req.warps_per_cta == 16, Errc::internal,
            "GPU batched GEMV: warps_per_cta is ", req.warps_per_cta, " (8 or 16)");
  const GpuMatrix& w0 = *req.out[0].w;
  KVQ_CHECK(gpu_gemv_supported(w0.type, w0.cols), Errc::unsupported, "GPU batched GEMV: unsupported ",
            gguf::tensor_type_name(w0.type), " matrix with ", w0.cols, " columns");
  const int64_t x_floats = int64_t(req.batch) * w0.cols;
  for (int i = 0; i < req.n_out; ++i) {
    KVQ_CHECK(req.out[i].w, Errc::internal, "GPU batched GEMV: output ", i, " has no matrix");
    const GpuMatrix& w = *req.out[i].w;
    const bool needs_y = req.epilogue != GemvEpilogue::swiglu || i == 0;
    KVQ_CHECK(w.type == w0.type && w.cols == w0.cols && (req.out[i].y || !needs_y), Errc::internal,
              "GPU batched GEMV: fused matrices must share type and width (", gguf::tensor_type_name(w.type), " x ",
              w.cols, " vs ", gguf::tensor_type_name(w0.type), " x ", w0.cols, ")");
    KVQ_CHECK(w.rows >= 1 && w.rows <= (int64_t(1) << 30) && w.cols <= (int64_t(1) << 24), Errc::out_of_range,
              "GPU batched GEMV: matrix of ", w.rows, " x ", w.cols, " is out of range");
    if (needs_y) {
      const float* y = req.out[i].y;
      const int64_t y_floats = int64_t(req.batch) * w.rows;
      const bool overlaps_x = y < req.x + x_floats && req.x < y + y_floats;
      const bool overlaps_norm = req.norm_weight && y < req.norm_weight + w.cols && req.norm_weight < y + y_floats;
      KVQ_CHECK(!overlaps_x && !overlaps_norm, Errc::internal, "GPU batched GEMV: an output overlaps the input");
    }
  }
  if (req.epilogue == GemvEpilogue::swiglu)
    KVQ_CHECK(req.out[1].w->rows == w0.rows, Errc::internal, "GPU batched GEMV: swiglu gate and up differ in rows");
  // More than kGemvBatchMax rows: launches of at most kGemvBatchMax, each
  // reading the weights once.
  for (int b0 = 0; b0 < req.batch; b0 += kGemvBatchMax) {
    GemvBatchRequest part = req;
    part.batch = std::min(kGemvBatchMax, req.batch - b0);
    part.x = req.x + int64_t(b0) * w0.cols;
    for (int i = 0; i < req.n_out; ++i)
      if (part.out[i].y) part.out[i].y += int64_t(b0) * req.out[i].w->rows;
    launch_chunk(part, stream, ctx);
  }
}

void gemv_batch(const GpuMatrix& w, const float* x, int batch, float* y, cudaStream_t stream,
                const DeviceContext& ctx) {
  GemvBatchRequest req;
  req.x = x;
  req.batch = batch;
  req.out[0] = {&w, y};
  gemv_batch(req, stream, ctx);
}

uint64_t gemv_batch_bytes(const GpuMatrix& w, int batch) {
  return w.bytes() + uint64_t(batch) * uint64_t(w.cols + w.rows) * sizeof(float);
}

}  // namespace kvq::cuda
