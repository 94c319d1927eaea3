// Device-side KV decode hooks of the tensor-core flash-decode kernel
// (attention_decode.cu), one specialisation per storage format. The kernel is
// templated over the hooks of its K and V sides; a format without hooks fails
// to compile where it is used (static_assert in the primary templates).
// (F: the storage family, B: its bits, D: head_dim)
//   KDecodeHooks<F, B, D>: the K side: how q is prepared (number and type of
//                          its exact parts, pre-scaling), how a 16-key tile is
//                          loaded into registers, and S = Q K^T of one tile.
//   VDecodeHooks<F, B, D>: the V side: load a 16-key tile, o += P V, and
//                          where each accumulator lands in the output row.
// Rows (kv_store.hpp, paged): direct hooks take (row_base, kb) and read key
// j of the tile at row row_base + j, where row_base = (the tile's first row)
// - kb, modulo 2^64: the decode kernel resolves the tile's page once and its
// 16 keys are consecutive rows of that page. Staged hooks take the tile's
// first row itself (row0).
// bf16 and q8 sides load their tiles straight into registers (kStaged =
// false); the low-bit sides are staged (rows copied into a per-warp ring in
// shared memory by cp.async, decoded from there) and also serve the
// keys-major form of the kernel (bind_km / scores_km / accumulate_km).
// Fragment conventions (lane = 4 g + t, mma m16n8k16): attention_decode.cu.
// Bit layouts: kv_codec_hooks.cuh (the encode side) and src/kv/blocks/.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "backend/cuda/kv_codec_hooks.cuh"
#include "backend/cuda/kv_store.hpp"
#include "backend/cuda/ptx.cuh"

namespace kvq::cuda {

// ---------------------------------------------------------------------------
// Tensor-core decode: K side
// ---------------------------------------------------------------------------
// Every K hook uses the same Q fragment map: entry (step, part, lane) holds
// rows g, g+8 at dims 32(step/2) + 8t + 4(step%2) + {0..3}; q is split
// exactly into kQParts parts of the hook's element type (bf16 or fp16).
// Per-lane decode state of a side (register tables, the pair table's
// address): none for the formats that load straight into registers.
struct DirectCtx {};

template <kv::Family F, int B, int D>
struct KDecodeHooks {
  static_assert(kAlwaysFalse<F>, "no GPU decode hooks (K side) for this KV block family (kv_codec_hooks.cuh)");
};

template <int B, int D>
struct KDecodeHooks<kv::Family::bf16, B, D> {
  static constexpr int kLutEntries = 0;
  static constexpr bool kStaged = false;  // loaded into registers by the lanes that use them
  using Ctx = DirectCtx;
  __device__ static void init_ctx(const GpuKvSide&, const uint32_t*, Ctx&) {}
  static constexpr int kQParts = 3;       // bf16 parts: 24 bits, exact
  static constexpr bool kF16 = false;
  static constexpr bool kPrescale = false;
  static constexpr int kLoads = D / 32;   // 16-byte loads per key and lane
  struct Tile {
    uint4 r[2][kLoads];
  };
  // Lane (g, t): keys g and 8 + g of the tile at kb, 16-byte chunks at dims 32c + 8t.
  // coherent: from L2 (ptx::load_kv16), for the tile a fused-q launch reads last.
  __device__ static void load(const GpuKvSide& s, size_t row_base, int kb, int last_key, int g, int t, Tile& k,
                              bool coherent) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint8_t* row = s.code + (row_base + min(kb + 8 * nt + g, last_key)) * size_t(2 * D) + 16 * t;
#pragma unroll
      for (int c = 0; c < kLoads; ++c) k.r[nt][c] = ptx::load_kv16(row + 64 * c, coherent);
    }
  }
  // S of one tile; two accumulator sets (even / odd k-steps) halve the
  // dependent mma chain; the small q parts go first.
  __device__ static void scores(const uint4* q_frag, const Tile& k, int lane, float (&s)[2][4],
                                const Ctx& /*ctx*/) {
    float acc[2][2][4] = {};
#pragma unroll
    for (int step = 0; step < D / 16; ++step) {
      const int c = step >> 1, h = step & 1;
#pragma unroll
      for (int part = kQParts - 1; part >= 0; --part) {
        const uint4 a = ptx::load_shared16(&q_frag[(step * kQParts + part) * 32 + lane]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          ptx::mma_bf16(acc[h][nt], a, ptx::word_of(k.r[nt][c], 2 * h), ptx::word_of(k.r[nt][c], 2 * h + 1));
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = acc[0][nt][i] + acc[1][nt][i];
  }
};

// q8 K: codes are exact in fp16, so the tile runs on fp16 tensor cores with
// q in two fp16 parts (22 bits; q is pre-scaled by a power of two so that no
// part is subnormal); one accumulator per 32-dim group (k-steps 2p, 2p + 1
// are exactly group p under the fragment map), scaled by each key's group
// scale in fp32 afterwards.
template <int B, int D>
struct KDecodeHooks<kv::Family::q8, B, D> {
  static constexpr int kLutEntries = 0;
  static constexpr bool kStaged = false;  // loaded into registers by the lanes that use them
  using Ctx = DirectCtx;
  __device__ static void init_ctx(const GpuKvSide&, const uint32_t*, Ctx&) {}
  static constexpr int kQParts = 2;
  static constexpr bool kF16 = true;
  static constexpr bool kPrescale = true;
  static constexpr int kGroups = D / 32;
  static constexpr int kSideBytes = D / 16;  // kGroups fp16 scales
  static constexpr int kSideWords = (kSideBytes + 3) / 4;
  struct Tile {
    uint2 code[2][kGroups];      // keys g, 8 + g: group p dims [32p + 8t, +8)
    uint32_t side[4][kSideWords];  // keys 2t, 2t+1, 8+2t, 9+2t: their scales
  };
  __device__ static void load(const GpuKvSide& s, size_t row_base, int kb, int last_key, int g, int t, Tile& k,
                              bool coherent) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint8_t* row = s.code + (row_base + min(kb + 8 * nt + g, last_key)) * size_t(D) + 8 * t;
#pragma unroll
      for (int p = 0; p < kGroups; ++p) k.code[nt][p] = ptx::load_kv8(row + 32 * p, coherent);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
      load_side(s, row_base, min(kb + 8 * (i >> 1) + 2 * t + (i & 1), last_key), k.side[i], coherent);
  }
  __device__ static void load_side(const GpuKvSide& s, size_t row_base, int key, uint32_t (&w)[kSideWords],
                                   bool coherent) {
    const uint8_t* row = s.side + (row_base + key) * size_t(kSideBytes);
    if constexpr (kSideBytes == 16) {
      const uint4 v = ptx::load_kv16(row, coherent);
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if constexpr (kSideBytes == 8) {
      const uint2 v = ptx::load_kv8(row, coherent);
      w[0] = v.x, w[1] = v.y;
    } else {
      w[0] = ptx::load_kv4(row, coherent);
    }
  }
  __device__ static float scale_of(const uint32_t (&w)[kSideWords], int p) {
    const uint32_t word = w[p >> 1];
    return __half2float(__ushort_as_half(static_cast<unsigned short>((p & 1) ? word >> 16 : word & 0xffffu)));
  }
  __device__ static void scores(const uint4* q_frag, const Tile& k, int lane, float (&s)[2][4],
                                const Ctx& /*ctx*/) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int p = 0; p < kGroups; ++p) {
      float acc[2][4] = {};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int step = 2 * p + h;
        uint32_t b0[2], b1[2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint32_t w = h ? k.code[nt][p].y : k.code[nt][p].x;  // dims 4h + {0..3} of the lane's 8
          b0[nt] = ptx::int8x2_to_half2(w, 0u, 0x0100u);            // dims 0, 1 (k rows 2t, 2t+1)
          b1[nt] = ptx::int8x2_to_half2(w, 0u, 0x0302u);            // dims 2, 3 (k rows 2t+8, 2t+9)
        }
#pragma unroll
        for (int part = kQParts - 1; part >= 0; --part) {
          const uint4 a = ptx::load_shared16(&q_frag[(step * kQParts + part) * 32 + lane]);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) ptx::mma_f16(acc[nt], a, b0[nt], b1[nt]);
        }
      }
      // C element (nt, i): key 8 nt + 2t + (i & 1) = scale slot 2 nt + (i & 1).
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float s0 = scale_of(k.side[2 * nt], p), s1 = scale_of(k.side[2 * nt + 1], p);
        s[nt][0] = fmaf(acc[nt][0], s0, s[nt][0]);
        s[nt][1] = fmaf(acc[nt][1], s1, s[nt][1]);
        s[nt][2] = fmaf(acc[nt][2], s0, s[nt][2]);
        s[nt][3] = fmaf(acc[nt][3], s1, s[nt][3]);
      }
    }
  }
};

// ---------------------------------------------------------------------------
// Tensor-core decode: V side
// ---------------------------------------------------------------------------
// accumulate(): o = alpha o + P V for one 16-key tile. p[nt][i] are the
// tile's probabilities in the S C-fragment layout (row g / g+8, key
// 8 nt + 2t + (i & 1)); o[j] is the C fragment of output n-tile j, whose
// column c maps to a physical dim the hook chooses (dim_of). The o scale
// (kOutScale) is undone by the kernel when o leaves the registers.
// o = alpha o for the two rows a lane holds; skipped when no row of the warp
// needs it (past the first tiles the running max rarely moves).
template <int D>
__device__ __forceinline__ void rescale_o(const float (&alpha)[2], float (&o)[D / 8][4]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
    }
  }
}

// P' = p * sc (sc[slot]: the scale of key slot 2 nt + (i & 1) of C element
// (nt, i)) as the A fragment of P' V in two exact fp16 parts (hi + lo, 22
// bits): a0 = (row g, keys 2t, 2t+1), a1 = (row g+8, same keys), a2/a3:
// keys 2t+8, 2t+9.
__device__ __forceinline__ void split_scaled_p(const float (&p)[2][4], const float (&sc)[4], uint4& a_hi,
                                               uint4& a_lo) {
  uint32_t hi[2][2], lo[2][2];  // [nt][row half]: keys (2t, 2t+1) of n-tile nt, rows g / g+8
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float x0 = p[nt][2 * r] * sc[2 * nt], x1 = p[nt][2 * r + 1] * sc[2 * nt + 1];
      const __half2 h = __floats2half2_rn(x0, x1);
      const float2 hf = __half22float2(h);
      const __half2 l = __floats2half2_rn(x0 - hf.x, x1 - hf.y);
      hi[nt][r] = *reinterpret_cast<const uint32_t*>(&h);
      lo[nt][r] = *reinterpret_cast<const uint32_t*>(&l);
    }
  a_hi = make_uint4(hi[0][0], hi[0][1], hi[1][0], hi[1][1]);
  a_lo = make_uint4(lo[0][0], lo[0][1], lo[1][0], lo[1][1]);
}

template <kv::Family F, int B, int D>
struct VDecodeHooks {
  static_assert(kAlwaysFalse<F>, "no GPU decode hooks (V side) for this KV block family (kv_codec_hooks.cuh)");
};

// bf16 V: logical (n-tile j, column c) = physical dim (D/8) c + j, so lane
// (g, t) loads the D/4 contiguous bytes of dims [(D/8) g, (D/8)(g+1)) of
// keys 2t, 2t+1, 2t+8, 2t+9; p is split exactly into three bf16 parts.
template <int B, int D>
struct VDecodeHooks<kv::Family::bf16, B, D> {
  static constexpr int kLutEntries = 0;
  static constexpr bool kStaged = false;  // loaded into registers by the lanes that use them
  using Ctx = DirectCtx;
  __device__ static void init_ctx(const GpuKvSide&, const uint32_t*, Ctx&) {}
  static constexpr bool kGroupMajorDims = false;  // dim_of: quarters per lane t
  static constexpr int kLoads = D / 64;
  static constexpr int kPParts = 3;
  static constexpr float kOutScale = 1.0f;
  struct Tile {
    uint4 r[4][kLoads];
  };
  __device__ static void load(const GpuKvSide& s, size_t row_base, int kb, int last_key, int g, int t, Tile& v,
                              bool coherent) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = kb + 2 * t + (i & 1) + 8 * (i >> 1);
      const uint8_t* row = s.code + (row_base + min(key, last_key)) * size_t(2 * D) + (D / 4) * g;
#pragma unroll
      for (int c = 0; c < kLoads; ++c) v.r[i][c] = ptx::load_kv16(row + 16 * c, coherent);
    }
  }
  __device__ static void accumulate(const float (&p)[2][4], const float (&alpha)[2], const Tile& v,
                                    float (&o)[D / 8][4], const Ctx& /*ctx*/) {
    uint32_t bits[kPParts][2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float rest = p[nt][i];
#pragma unroll
        for (int part = 0; part < kPParts; ++part) {
          float as_float;
          bits[part][nt][i] = ptx::bf16_bits(rest, as_float);
          rest -= as_float;  // exact
        }
      }
    uint4 pf[kPParts];
#pragma unroll
    for (int part = 0; part < kPParts; ++part)
      pf[part] = make_uint4(ptx::pack2(bits[part][0][0], bits[part][0][1]), ptx::pack2(bits[part][0][2], bits[part][0][3]),
                            ptx::pack2(bits[part][1][0], bits[part][1][1]), ptx::pack2(bits[part][1][2], bits[part][1][3]));
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      // Dim j of the lane's chunk: 16-byte load j / 8, word (j % 8) / 2, half j % 2.
      const int c = j >> 3, w = (j & 7) >> 1;
      const unsigned sel = (j & 1) ? 0x7632u : 0x5410u;
      const uint32_t b0 = __byte_perm(ptx::word_of(v.r[0][c], w), ptx::word_of(v.r[1][c], w), sel);
      const uint32_t b1 = __byte_perm(ptx::word_of(v.r[2][c], w), ptx::word_of(v.r[3][c], w), sel);
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
#pragma unroll
      for (int part = kPParts - 1; part >= 0; --part) ptx::mma_bf16(o[j], pf[part], b0, b1);
    }
  }
  __host__ __device__ static constexpr int dim_of(int j, int c) { return (D / 8) * c + j; }
};

// q8 V: logical (n-tile j, column c) = physical dim 32 (j / 4) + 4 c + j % 4,
// so n-tiles 4a..4a+3 are exactly group a and lane (g, t) loads 4 bytes
// (dims 32a + 4g + {0..3}) per group of keys 2t, 2t+1, 2t+8, 2t+9. Codes are
// exact in fp16; the group scale goes into P: P'_a = p * scale_a * 2^8, two
// fp16 parts (22 bits), and o carries the factor 2^8 until it leaves the
// registers. 2^8 balances the two ends of fp16: P' overflows only for a
// group absmax above 127 * 65504 / 2^8 = 32512 (2^14, used before, overflowed
// above 508), and a part below fp16's normal range (P' < 2^-14) still keeps
// an absolute precision of 2^-24 / 2^8 per key in o.
template <int B, int D>
struct VDecodeHooks<kv::Family::q8, B, D> {
  static constexpr int kLutEntries = 0;
  static constexpr bool kStaged = false;  // loaded into registers by the lanes that use them
  using Ctx = DirectCtx;
  __device__ static void init_ctx(const GpuKvSide&, const uint32_t*, Ctx&) {}
  static constexpr bool kGroupMajorDims = true;  // dim_of: 32-dim groups, lane t owns 8t..8t+7
  static constexpr int kGroups = D / 32;
  static constexpr int kSideBytes = D / 16;
  static constexpr int kSideWords = (kSideBytes + 3) / 4;
  static constexpr float kOutScale = 256.0f;
  struct Tile {
    uint32_t code[4][kGroups];
    uint32_t side[4][kSideWords];
  };
  __device__ static void load(const GpuKvSide& s, size_t row_base, int kb, int last_key, int g, int t, Tile& v,
                              bool coherent) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = min(kb + 2 * t + (i & 1) + 8 * (i >> 1), last_key);
      const uint8_t* row = s.code + (row_base + key) * size_t(D) + 4 * g;
#pragma unroll
      for (int a = 0; a < kGroups; ++a) v.code[i][a] = ptx::load_kv4(row + 32 * a, coherent);
      KDecodeHooks<kv::Family::q8, 8, D>::load_side(s, row_base, key, v.side[i], coherent);
    }
  }
  __device__ static void accumulate(const float (&p)[2][4], const float (&alpha)[2], const Tile& v,
                                    float (&o)[D / 8][4], const Ctx& /*ctx*/) {
    // Past the first tiles the running max rarely moves: skip the rescale
    // (64 multiplies at D = 128) when no row of the warp needs it.
    rescale_o<D>(alpha, o);
#pragma unroll
    for (int a = 0; a < kGroups; ++a) {
      // Scale slot of C element (nt, i): key 8 nt + 2t + (i & 1) = slot 2 nt + (i & 1).
      float sc[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[i] = KDecodeHooks<kv::Family::q8, 8, D>::scale_of(v.side[i], a) * kOutScale;
      uint4 a_hi, a_lo;
      split_scaled_p(p, sc, a_hi, a_lo);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const unsigned sel = unsigned(m) | (unsigned(4 + m) << 8);  // byte m of a -> byte 0, of b -> byte 2
        const uint32_t b0 = ptx::int8x2_to_half2(v.code[0][a], v.code[1][a], sel);  // keys 2t, 2t+1
        const uint32_t b1 = ptx::int8x2_to_half2(v.code[2][a], v.code[3][a], sel);  // keys 2t+8, 2t+9
        ptx::mma_f16(o[4 * a + m], a_lo, b0, b1);
        ptx::mma_f16(o[4 * a + m], a_hi, b0, b1);
      }
    }
  }
  __host__ __device__ static constexpr int dim_of(int j, int c) { return 32 * (j / 4) + 4 * c + (j % 4); }
};

// ---------------------------------------------------------------------------
// ---------------------------------------------------------------------------
// Low-bit formats (turbo, tcq, iso/rotor/planar, fp8), +qjl included.
//
// Staging: these sides are not loaded into registers by the lanes that use
// them. Each warp copies the code and side rows of its next tiles (16 keys,
// contiguous in the store) into a ring of kDecodeStages slots of its own in
// shared memory with cp.async (16-byte granules, L2 only; rows past the
// context are zero-filled), so kDecodeStages - 1 tiles are in flight per warp
// without holding registers, and a few wide requests replace the ~50 one- and
// two-byte loads per lane and tile that the fragment maps would need.
// Rows whose size is a multiple of 32 bytes get 16 bytes of padding per row in
// the slot (4-bit, 2-bit and fp8 rows would otherwise put the 8 keys a warp
// reads at once into the same banks); other rows (3-bit: 48 bytes) are
// conflict-free packed, and rows of a size that is not a multiple of 16 (and
// the side rows) are copied as one packed range from the 16-byte boundary at
// or below the tile's first row.
//
// Decoding: codes become exact fp16 B fragments. Codebook formats (turbo,
// iso, rotor, planar) keep their 4, 8 or 16 fp16 levels in registers as byte
// tables (the low bytes of the levels in one or more words, the high bytes in
// as many) and select four levels at once with byte permutes (PRMT), the codes
// spread to 4-bit selectors first: no memory access per value. tcq's values
// depend on a 6-bit branch window, so tcq keeps a per-CTA pair table in
// shared memory (one LDS per two values); fp8 converts in hardware
// (e4m3x2 -> f16x2). The fragment maps are q8's: on the K side lane (g, t)
// reads the 8 dims 32p + 8t .. +7 of group p of its keys g, 8 + g (k-steps
// 2p, 2p+1); on the V side the 4 dims 32a + 4g .. +3 of keys 2t, 2t+1, 2t+8,
// 2t+9 (n-tiles 4a..4a+3).
//
// The blocks' levels are fp16-exact (kv/codebook.hpp, kv/tcq.cpp), so the
// tables hold them exactly; q and P keep 22 bits (two fp16 parts) as for q8.
// Scales (row or 32-dim group, fp16 in the side row) are applied in fp32: K
// after the mma, V inside P (P' = p * scale * 2^8, as q8).
// ---------------------------------------------------------------------------
constexpr int kDecodeStages = 4;  // ring slots per warp: tiles in flight = kDecodeStages - 1

namespace lowbit {

// Reads from a staged slot by 32-bit shared-memory address (volatile: they
// stay after the cp.async wait and the warp barrier that publish the slot).
__device__ __forceinline__ uint32_t rd_u8(uint32_t a) {
  uint32_t r;
  asm volatile("ld.shared.u8 %0, [%1];" : "=r"(r) : "r"(a));
  return r;
}
__device__ __forceinline__ uint32_t rd_u16(uint32_t a) {
  uint32_t r;
  asm volatile("ld.shared.u16 %0, [%1];" : "=r"(r) : "r"(a));
  return r;
}
__device__ __forceinline__ uint32_t rd_u32(uint32_t a) {
  uint32_t r;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(a));
  return r;
}
__device__ __forceinline__ uint2 rd_u64(uint32_t a) {
  uint2 r;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(a));
  return r;
}
__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float f16_low(uint32_t w) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
}

// ---- staging geometry (bytes; row sizes are multiples of 2)
__host__ __device__ constexpr bool rows_aligned(int row_bytes) { return row_bytes % 16 == 0; }
__host__ __device__ constexpr int slot_row_stride(int row_bytes) {
  return rows_aligned(row_bytes) && row_bytes % 32 == 0 ? row_bytes + 16 : row_bytes;
}
// Granules of a packed copy: 16 rows from any offset within a 16-byte granule.
__host__ __device__ constexpr int packed_granules(int row_bytes) { return (15 + 16 * row_bytes + 15) / 16; }
__host__ __device__ constexpr int slot_bytes(int row_bytes) {
  return row_bytes == 0 ? 0 : rows_aligned(row_bytes) ? 16 * slot_row_stride(row_bytes) : 16 * packed_granules(row_bytes);
}

// Rows row0 .. row0 + 15 of `base` (row_bytes each) into `slot`; rows from
// n_valid on are zero (zero-fill copies, which name the tile's first row:
// rows past the context may lie past the store). slot_rows() finds them again.
__device__ __forceinline__ void stage_rows(unsigned char* slot, const uint8_t* base, int row_bytes, size_t row0,
                                           int n_valid, int lane) {
  const uint32_t dst = ptx::smem_u32(slot);
  if (rows_aligned(row_bytes)) {
    const int per_row = row_bytes / 16, stride = slot_row_stride(row_bytes);
    const uint8_t* src = base + row0 * row_bytes;
    for (int i = lane; i < 16 * per_row; i += 32) {
      const int r = i / per_row, j = i - r * per_row;
      ptx::cp_async_16(dst + r * stride + 16 * j, r < n_valid ? src + 16 * i : src, r < n_valid ? 16 : 0);
    }
  } else {
    const uintptr_t start = reinterpret_cast<uintptr_t>(base + row0 * row_bytes);
    const uintptr_t end = start + uintptr_t(n_valid) * row_bytes, first = start & ~uintptr_t(15);
    const int n = int((start + 16 * row_bytes - first + 15) / 16);
    for (int i = lane; i < n; i += 32) {
      const uintptr_t gs = first + 16 * uintptr_t(i);
      const int valid = gs >= end ? 0 : int(min(uintptr_t(16), end - gs));
      ptx::cp_async_16(dst + 16 * i, reinterpret_cast<const void*>(valid ? gs : first), valid);
    }
  }
}
// stage_rows for a row size known at compile time (every store at D = 128
// and 256; D = 64 rows may be padded: the caller checks): no division, no
// loop bounds, no 64-bit arithmetic per granule.
template <int kRowBytes>
__device__ __forceinline__ void stage_rows_fixed(unsigned char* slot, const uint8_t* base, size_t row0, int n_valid,
                                                 int lane) {
  const uint32_t dst = ptx::smem_u32(slot);
  if constexpr (rows_aligned(kRowBytes)) {
    constexpr int kPerRow = kRowBytes / 16, kStride = slot_row_stride(kRowBytes), kN = 16 * kPerRow;
    const uint8_t* src = base + row0 * kRowBytes;
#pragma unroll
    for (int i0 = 0; i0 < kN; i0 += 32) {
      const int i = i0 + lane;
      if (kN % 32 == 0 || i < kN) {
        const int r = i / kPerRow, j = i - r * kPerRow;
        ptx::cp_async_16(dst + r * kStride + 16 * j, r < n_valid ? src + 16 * i : src, r < n_valid ? 16 : 0);
      }
    }
  } else {
    constexpr int kN = packed_granules(kRowBytes);
    const uint8_t* start = base + row0 * kRowBytes;
    const uint8_t* first = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(start) & ~uintptr_t(15));
    const int end = int(start - first) + n_valid * kRowBytes;  // valid bytes from `first`
#pragma unroll
    for (int i0 = 0; i0 < kN; i0 += 32) {
      const int i = i0 + lane;
      if (i < kN) {
        const int valid = min(max(end - 16 * i, 0), 16);
        ptx::cp_async_16(dst + 16 * i, valid ? first + 16 * i : first, valid);
      }
    }
  }
}

// Where stage_rows put row 0 of the tile, and the distance between rows.
struct SlotRows {
  uint32_t row0;  // shared-memory address
  int stride;
  __device__ uint32_t row(int r) const { return row0 + r * stride; }
};
__device__ __forceinline__ SlotRows slot_rows(const unsigned char* slot, const uint8_t* base, int row_bytes,
                                              size_t row0) {
  if (rows_aligned(row_bytes)) return {ptx::smem_u32(slot), slot_row_stride(row_bytes)};
  const uintptr_t start = reinterpret_cast<uintptr_t>(base + row0 * row_bytes);
  return {ptx::smem_u32(slot) + uint32_t(start & 15), row_bytes};
}

enum class Scale { none, row, group };

// N-bit Lloyd-Max indices (turbo, iso, rotor, planar): bitpack.hpp planes
// (N = 3: a 2-bit plane of the low bits, then a 1-bit plane of the high bits).
// Decoding is integer work, and the integer pipes (half the FP32 rate) are
// what these kernels run out of (ncu: math-pipe throttle), so the codes go
// through a pair table in shared memory, one LDS per two values (the memory
// pipe has room), replicated so that random codes do not serialise on
// banks: entry e of replica r at word kReplicas e + r, lane l reads replica
// l % kReplicas. 2 and 3 bits: one replica per lane (no conflicts; 2 / 8 KB
// per side and CTA); 4 bits: 8 replicas (8 KB; lanes l, l + 8, l + 16,
// l + 24 may meet in a bank). Pair index of dims (2k, 2k+1) of a chunk:
// 4 bits: byte k; 2 bits: nibble k; 3 bits: nibble k of the low plane | high
// bits 2k, 2k+1 at bits 4, 5.
template <int B, int D>
struct CodebookFormat {
  static_assert(B >= 2 && B <= 4, "codebook blocks have 2, 3 or 4 bits");
  static constexpr int kReplicas = B == 4 ? 8 : 32;
  static constexpr int kLutEntries = kReplicas << (2 * B);
  static constexpr int kLutRun = kReplicas;  // words in a row with the same value
  static constexpr int kRowBytes = B * D / 8;
  static constexpr int kHighPlane = D / 4;  // 3 bits: the 1-bit plane after the 2-bit one
  struct Ctx {
    uint32_t lut;  // this lane's replica (shared address)
  };
  __device__ static uint32_t lut_entry(const GpuKvSide& s, int i) {
    const int e = i / kReplicas;
    int i0, i1;
    if constexpr (B == 3) {
      i0 = (e & 3) | (((e >> 4) & 1) << 2);
      i1 = ((e >> 2) & 3) | (((e >> 5) & 1) << 2);
    } else {
      i0 = e & ((1 << B) - 1);
      i1 = e >> B;
    }
    return half2_bits(s.codebook[i0], s.codebook[i1]);
  }
  __device__ static void init_ctx(const GpuKvSide&, const uint32_t* lut, Ctx& c) {
    c.lut = ptx::smem_u32(lut) + 4u * ((threadIdx.x & 31) % kReplicas);
  }
  __device__ static uint32_t pair(const Ctx& c, uint32_t index) { return rd_u32(c.lut + index * (4 * kReplicas)); }
  // K: dims d0 .. d0 + 7 (d0 = 32p + 8t) as 4 pairs.
  __device__ static void k8(uint32_t row, int d0, const Ctx& c, uint32_t (&h)[4]) {
    if constexpr (B == 4) {
      const uint32_t w = rd_u32(row + d0 / 2);
#pragma unroll
      for (int k = 0; k < 4; ++k) h[k] = pair(c, (w >> (8 * k)) & 0xffu);
    } else if constexpr (B == 2) {
      const uint32_t lo = rd_u16(row + d0 / 4);
#pragma unroll
      for (int k = 0; k < 4; ++k) h[k] = pair(c, (lo >> (4 * k)) & 0xfu);
    } else {
      const uint32_t lo = rd_u16(row + d0 / 4), hi = rd_u8(row + kHighPlane + d0 / 8);
#pragma unroll
      for (int k = 0; k < 4; ++k) h[k] = pair(c, ((lo >> (4 * k)) & 0xfu) | (((hi >> (2 * k)) & 3u) << 4));
    }
  }
  // V: dims d0 .. d0 + 3 (d0 = 32a + 4g) as 2 pairs.
  __device__ static void v4(uint32_t row, int d0, const Ctx& c, uint32_t (&h)[2]) {
    if constexpr (B == 4) {
      const uint32_t w = rd_u16(row + d0 / 2);
      h[0] = pair(c, w & 0xffu), h[1] = pair(c, w >> 8);
    } else if constexpr (B == 2) {
      const uint32_t lo = rd_u8(row + d0 / 4);
      h[0] = pair(c, lo & 0xfu), h[1] = pair(c, lo >> 4);
    } else {
      const uint32_t lo = rd_u8(row + d0 / 4), hi = rd_u8(row + kHighPlane + d0 / 8) >> (d0 & 4);
      h[0] = pair(c, (lo & 0xfu) | ((hi & 3u) << 4));
      h[1] = pair(c, (lo >> 4) | (((hi >> 2) & 3u) << 4));
    }
  }
};

// tcq (kv/tcq.hpp): a branch plane (1 bit per dim, D/8 bytes) then a level
// plane (B - 1 bits per dim). The value of dim i is levels[4 m_i + subset(w_i)]
// with the window w_i = b_i | b_{i-1} << 1 | ... | b_{i-5} << 5. The 7 branch
// bits b_{i-5} .. b_{i+1} decide both windows of a pair (2k, 2k+1); pair table
// index = those 7 bits | m_{2k} << 7 | m_{2k+1} << (7 + B - 1), one table per
// CTA in shared memory (512 / 2048 entries).
template <int B, int D>
struct TcqFormat {
  static_assert(B == 2 || B == 3, "tcq blocks have 2 or 3 bits");
  static constexpr int kLevelBits = B - 1;
  static constexpr int kLutEntries = 1 << (7 + 2 * kLevelBits);
  static constexpr int kLutRun = 1;
  static constexpr int kLevelPlane = D / 8;
  static constexpr int kRowBytes = B * D / 8;
  struct Ctx {
    const uint32_t* lut;
  };
  __device__ static void init_ctx(const GpuKvSide&, const uint32_t* lut, Ctx& c) { c.lut = lut; }
  __device__ static uint32_t reverse6(uint32_t e) { return __brev(e) >> 26; }
  __device__ static float value(const GpuKvSide& s, uint32_t e6, uint32_t m) {
    const uint32_t w = reverse6(e6);  // bit k = b_{i-k}
    const uint32_t sub = 2u * (__popc(w & s.tcq_g1) & 1) + (__popc(w & s.tcq_g0) & 1);
    return s.codebook[4 * m + sub];
  }
  __device__ static uint32_t lut_entry(const GpuKvSide& s, int i) {
    const uint32_t e7 = uint32_t(i) & 127u, mask = (1u << kLevelBits) - 1u;
    const uint32_t m0 = (uint32_t(i) >> 7) & mask, m1 = (uint32_t(i) >> (7 + kLevelBits)) & mask;
    return half2_bits(value(s, e7 & 63u, m0), value(s, e7 >> 1, m1));
  }
  // Branch bits from dim d0 - 5 (bit m = b_{d0-5+m}; bits before dim 0 are 0).
  __device__ static uint32_t window_bits(uint32_t row, int d0) {
    const int w = d0 >> 5, off = d0 & 31;
    const uint32_t cur = rd_u32(row + 4 * w);
    if (off >= 5) return cur >> (off - 5);
    const uint32_t prev = w > 0 ? rd_u32(row + 4 * w - 4) : 0u;
    return __funnelshift_r(prev, cur, 27 + off);
  }
  __device__ static uint32_t index(uint32_t win, uint32_t lv, int k) {
    const uint32_t m = (lv >> (2 * kLevelBits * k)) & ((1u << (2 * kLevelBits)) - 1u);
    return ((win >> (2 * k)) & 127u) | (m << 7);
  }
  __device__ static void k8(uint32_t row, int d0, const Ctx& c, uint32_t (&h)[4]) {
    const uint32_t win = window_bits(row, d0);
    const uint32_t lv = kLevelBits == 1 ? rd_u8(row + kLevelPlane + d0 / 8) : rd_u16(row + kLevelPlane + d0 / 4);
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = c.lut[index(win, lv, k)];
  }
  __device__ static void v4(uint32_t row, int d0, const Ctx& c, uint32_t (&h)[2]) {
    const uint32_t win = window_bits(row, d0);
    const uint32_t lv = kLevelBits == 1 ? (rd_u8(row + kLevelPlane + d0 / 8) >> (d0 & 4)) & 0xfu
                                        : rd_u8(row + kLevelPlane + d0 / 4);
#pragma unroll
    for (int k = 0; k < 2; ++k) h[k] = c.lut[index(win, lv, k)];
  }
};

// What a format that decodes without a table declares (fp8, q8): no pair
// table, no per-lane context.
struct TablelessFormat {
  static constexpr int kLutEntries = 0;
  static constexpr int kLutRun = 1;
  struct Ctx {};
  __device__ static void init_ctx(const GpuKvSide&, const uint32_t*, Ctx&) {}
  __device__ static uint32_t lut_entry(const GpuKvSide&, int) { return 0; }
};

// fp8 (e4m3, one byte per dim): the hardware converts pairs.
template <int D>
struct Fp8Format : TablelessFormat {
  static constexpr int kRowBytes = D;
  __device__ static uint32_t convert(uint32_t two_bytes) {
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xffffu), __NV_E4M3);
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
  }
  __device__ static void k8(uint32_t row, int d0, const Ctx&, uint32_t (&h)[4]) {
    const uint2 w = rd_u64(row + d0);
    h[0] = convert(w.x), h[1] = convert(w.x >> 16), h[2] = convert(w.y), h[3] = convert(w.y >> 16);
  }
  __device__ static void v4(uint32_t row, int d0, const Ctx&, uint32_t (&h)[2]) {
    const uint32_t w = rd_u32(row + d0);
    h[0] = convert(w), h[1] = convert(w >> 16);
  }
};

// q8 (int8 codes, 32-dim group scales) as a staged format: the keys-major
// kernel's K side of the k8v* codecs (their V sides are staged formats).
template <int D>
struct Q8Format : TablelessFormat {
  static constexpr int kRowBytes = D;
  __device__ static void k8(uint32_t row, int d0, const Ctx&, uint32_t (&h)[4]) {
    const uint2 w = rd_u64(row + d0);
    h[0] = ptx::int8x2_to_half2(w.x, 0u, 0x0100u), h[1] = ptx::int8x2_to_half2(w.x, 0u, 0x0302u);
    h[2] = ptx::int8x2_to_half2(w.y, 0u, 0x0100u), h[3] = ptx::int8x2_to_half2(w.y, 0u, 0x0302u);
  }
  __device__ static void v4(uint32_t row, int d0, const Ctx&, uint32_t (&h)[2]) {
    const uint32_t w = rd_u32(row + d0);
    h[0] = ptx::int8x2_to_half2(w, 0u, 0x0100u), h[1] = ptx::int8x2_to_half2(w, 0u, 0x0302u);
  }
};

// The keys' scales a lane needs: none, one fp16 per row (turbo, tcq: the
// stored a = n * g, times 1 / sqrt(D)), or D/32 fp16 group scales. Slots:
// head-major form, slot i = key 8 (i >> 1) + 2t + (i & 1) of the tile (the C
// fragment's columns; V: 2t + (i & 1) + 8 (i >> 1)); keys-major form, slots
// 0 and 1 = keys g and g + 8 (the rows of S^T).
template <Scale S, int D>
struct Scales {
  static constexpr int kRowBytes = S == Scale::none ? 0 : S == Scale::row ? 2 : D / 16;
  static constexpr int kWords = S == Scale::group ? (D / 16 + 3) / 4 : 1;
  uint32_t w[4][kWords];
  // From a staged side row of kSideBytes bytes (the base block's scales first).
  template <int kSideBytes>
  __device__ void load(int i, uint32_t row) {
    if constexpr (S == Scale::row) {
      w[i][0] = rd_u16(row);
    } else if constexpr (S == Scale::group) {
      if constexpr (kSideBytes % 4 == 0) {  // slot rows then start at a multiple of 4 (stage_rows' packed offset is the store's)
#pragma unroll
        for (int q = 0; q < kWords; ++q) w[i][q] = rd_u32(row + 4 * q);
      } else {  // +qjl rows append a 2-byte norm
#pragma unroll
        for (int q = 0; q < kWords; ++q) w[i][q] = rd_u16(row + 4 * q) | (rd_u16(row + 4 * q + 2) << 16);
      }
    }
  }
  __device__ float get(int i, int p) const {
    if constexpr (S == Scale::none) return 1.0f;
    else if constexpr (S == Scale::row) return f16_low(w[i][0]) * rsqrt_d();
    else return f16_low(w[i][p >> 1] >> (16 * (p & 1)));
  }
  __device__ static constexpr float rsqrt_d() {  // 1 / sqrt(D), D in {64, 128, 256}
    static_assert(D == 64 || D == 128 || D == 256, "row scales are for the Walsh-Hadamard head dims");
    return D == 64 ? 0.125f : D == 128 ? 0.08838834764831845f : 0.0625f;
  }
};

// What a staged side keeps per tile: where its rows are in the slot.
struct StagedTile {
  SlotRows code, side;
};

// The staging half of a side's hooks (K or V): code rows of up to
// kMaxCodeBytes, side rows of up to kMaxSideBytes (the +qjl rows are longer
// than the base block's; the store's actual sizes are GpuKvSide's).
template <int kMaxCodeBytes, int kMaxSideBytes>
struct Staged {
  static constexpr bool kStaged = true;
  static constexpr int kCodeSlot = slot_bytes(kMaxCodeBytes), kSideSlot = slot_bytes(kMaxSideBytes);
  static constexpr int kStageBytes = kCodeSlot + kSideSlot;
  // The row sizes are kMaxCodeBytes / kMaxSideBytes except for padded D = 64
  // code rows (kv::block_layout), which take the general copy.
  __device__ static void stage(const GpuKvSide& s, size_t row0, int n_valid, unsigned char* slot, int lane) {
    if (s.code_bytes == kMaxCodeBytes) stage_rows_fixed<kMaxCodeBytes>(slot, s.code, row0, n_valid, lane);
    else stage_rows(slot, s.code, int(s.code_bytes), row0, n_valid, lane);
    if constexpr (kMaxSideBytes > 0) stage_rows_fixed<kMaxSideBytes>(slot + kCodeSlot, s.side, row0, n_valid, lane);
  }
  __device__ static StagedTile rows_of(const GpuKvSide& s, size_t row0, const unsigned char* slot) {
    StagedTile t;
    t.code = slot_rows(slot, s.code, int(s.code_bytes), row0);
    t.side = kMaxSideBytes > 0 ? slot_rows(slot + kCodeSlot, s.side, kMaxSideBytes, row0) : SlotRows{ptx::smem_u32(slot), 0};
    return t;
  }
};

// What the K and V hooks of a staged format share: the per-lane context and
// pair table of the format, and a tile = the slot's rows plus the scales of
// the keys the lane needs.
template <class Fmt, Scale S, int D, int kCodeBytes, int kSideBytes>
struct StagedSide : Staged<kCodeBytes, kSideBytes> {
  static constexpr int kLutEntries = Fmt::kLutEntries;
  using Ctx = typename Fmt::Ctx;
  struct Tile {
    StagedTile rows;
    Scales<S, D> sc;
  };
  // Replicated tables (kLutRun equal words in a row, a multiple of 4) are
  // written 16 bytes at a time, one entry computed per 4 words: the build
  // is part of every CTA's prologue, on the critical path of short contexts.
  __device__ static void build_lut(const GpuKvSide& s, uint32_t* lut, int tid, int n_threads) {
    if constexpr (kLutEntries > 0 && Fmt::kLutRun % 4 == 0) {
      for (int c = tid; c < kLutEntries / 4; c += n_threads) {
        const uint32_t e = Fmt::lut_entry(s, 4 * c);
        *reinterpret_cast<uint4*>(lut + 4 * c) = make_uint4(e, e, e, e);
      }
    } else if constexpr (kLutEntries > 0) {
      for (int i = tid; i < kLutEntries; i += n_threads) lut[i] = Fmt::lut_entry(s, i);
    }
  }
  __device__ static void init_ctx(const GpuKvSide& s, const uint32_t* lut, Ctx& c) { Fmt::init_ctx(s, lut, c); }
  // The tile staged in `slot` (rows row0 .. row0 + 15 of the store), the
  // scales of tile keys key_of(0) .. key_of(kKeys - 1) in slots 0 .. kKeys - 1.
  template <int kKeys, class KeyOf>
  __device__ static void bind_keys(const GpuKvSide& s, size_t row0, const unsigned char* slot, Tile& x, KeyOf key_of) {
    x.rows = Staged<kCodeBytes, kSideBytes>::rows_of(s, row0, slot);
    if constexpr (S != Scale::none) {
#pragma unroll
      for (int i = 0; i < kKeys; ++i) x.sc.template load<kSideBytes>(i, x.rows.side.row(key_of(i)));
    }
  }
  // Keys-major form, both sides: slots 0 and 1 = keys g and g + 8 (the rows of S^T).
  __device__ static void bind_km(const GpuKvSide& s, size_t row0, const unsigned char* slot, int g, Tile& x) {
    bind_keys<2>(s, row0, slot, x, [g](int i) { return g + 8 * i; });
  }
};

}  // namespace lowbit

// K side of a low-bit format: q in two fp16 parts (pre-scaled, as q8), one
// mma per part, k-step and key n-tile; the scales after the mma in fp32.
// kCodeBytes / kSideBytes: the longest rows this side may have (+qjl's).
template <class Fmt, lowbit::Scale S, int D, int kCodeBytes = Fmt::kRowBytes,
          int kSideBytes = lowbit::Scales<S, D>::kRowBytes>
struct KDecodeLowBit : lowbit::StagedSide<Fmt, S, D, kCodeBytes, kSideBytes> {
  using Side = lowbit::StagedSide<Fmt, S, D, kCodeBytes, kSideBytes>;
  using Ctx = typename Side::Ctx;
  using Tile = typename Side::Tile;
  static constexpr int kQParts = 2;
  static constexpr bool kF16 = true;
  static constexpr bool kPrescale = true;
  static constexpr int kGroups = D / 32;
  // The tile staged in `slot`; scale slot i = key 8 (i >> 1) + 2t + (i & 1).
  __device__ static void bind(const GpuKvSide& s, size_t row0, const unsigned char* slot, int g, int t, Tile& k) {
    Side::template bind_keys<4>(s, row0, slot, k, [t](int i) { return 8 * (i >> 1) + 2 * t + (i & 1); });
  }
  // Two accumulator sets (even / odd k-steps) halve the dependent mma chain.
  __device__ static void scores(const uint4* q_frag, const Tile& k, int lane, float (&s)[2][4], const Ctx& ctx) {
    const int g = lane >> 2, t = lane & 3;
    float acc[2][2][4] = {};  // [k-step parity][nt]
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int p = 0; p < kGroups; ++p) {
      uint32_t h[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) Fmt::k8(k.rows.code.row(8 * nt + g), 32 * p + 8 * t, ctx, h[nt]);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int step = 2 * p + hh;
#pragma unroll
        for (int part = kQParts - 1; part >= 0; --part) {
          const uint4 a = ptx::load_shared16(&q_frag[(step * kQParts + part) * 32 + lane]);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) ptx::mma_f16(acc[hh][nt], a, h[nt][2 * hh], h[nt][2 * hh + 1]);
        }
      }
      if constexpr (S == lowbit::Scale::group) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float s0 = k.sc.get(2 * nt, p), s1 = k.sc.get(2 * nt + 1, p);
          s[nt][0] = fmaf(acc[0][nt][0] + acc[1][nt][0], s0, s[nt][0]);
          s[nt][1] = fmaf(acc[0][nt][1] + acc[1][nt][1], s1, s[nt][1]);
          s[nt][2] = fmaf(acc[0][nt][2] + acc[1][nt][2], s0, s[nt][2]);
          s[nt][3] = fmaf(acc[0][nt][3] + acc[1][nt][3], s1, s[nt][3]);
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[0][nt][i] = acc[1][nt][i] = 0.0f;
        }
      }
    }
    if constexpr (S != lowbit::Scale::group) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float s0 = k.sc.get(2 * nt, 0), s1 = k.sc.get(2 * nt + 1, 0);
        s[nt][0] = (acc[0][nt][0] + acc[1][nt][0]) * s0;
        s[nt][1] = (acc[0][nt][1] + acc[1][nt][1]) * s1;
        s[nt][2] = (acc[0][nt][2] + acc[1][nt][2]) * s0;
        s[nt][3] = (acc[0][nt][3] + acc[1][nt][3]) * s1;
      }
    }
  }

  // ---- keys-major (attention_decode.cu): S^T = K Q^T with the tile's keys
  // as the 16 rows of A (lane g: keys g, g + 8; the same 8 dims per group as
  // above) and the group's query heads as the 8 columns of B; scale slots 0
  // and 1 are keys g and g + 8 (Side::bind_km).
  // s: C fragment (key g: heads 2t, 2t+1; key g + 8: heads 2t, 2t+1).
  template <int kSteps, int kParts>
  __device__ static void scores_km(const uint32_t (&qb)[kSteps][kParts][2], const Tile& k, int lane, float (&s)[4],
                                   const Ctx& ctx) {
    const int g = lane >> 2, t = lane & 3;
    float acc[2][4] = {};  // [k-step parity]: two dependent mma chains instead of one
    s[0] = s[1] = s[2] = s[3] = 0.0f;
#pragma unroll
    for (int p = 0; p < kGroups; ++p) {
      uint32_t h0[4], h1[4];  // keys g, g + 8: dims 32p + 8t .. +7 as pairs
      Fmt::k8(k.rows.code.row(g), 32 * p + 8 * t, ctx, h0);
      Fmt::k8(k.rows.code.row(g + 8), 32 * p + 8 * t, ctx, h1);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const uint4 a = make_uint4(h0[2 * hh], h1[2 * hh], h0[2 * hh + 1], h1[2 * hh + 1]);
#pragma unroll
        for (int part = kParts - 1; part >= 0; --part)
          ptx::mma_f16(acc[hh], a, qb[2 * p + hh][part][0], qb[2 * p + hh][part][1]);
      }
      if constexpr (S == lowbit::Scale::group) {
        const float s0 = k.sc.get(0, p), s1 = k.sc.get(1, p);
        s[0] = fmaf(acc[0][0] + acc[1][0], s0, s[0]);
        s[1] = fmaf(acc[0][1] + acc[1][1], s0, s[1]);
        s[2] = fmaf(acc[0][2] + acc[1][2], s1, s[2]);
        s[3] = fmaf(acc[0][3] + acc[1][3], s1, s[3]);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[0][i] = acc[1][i] = 0.0f;
      }
    }
    if constexpr (S != lowbit::Scale::group) {
      const float s0 = k.sc.get(0, 0), s1 = k.sc.get(1, 0);
      s[0] = (acc[0][0] + acc[1][0]) * s0;
      s[1] = (acc[0][1] + acc[1][1]) * s0;
      s[2] = (acc[0][2] + acc[1][2]) * s1;
      s[3] = (acc[0][3] + acc[1][3]) * s1;
    }
  }
};

// V side of a low-bit format (q8's n-tile map and P scaling, kOutScale 2^8).
template <class Fmt, lowbit::Scale S, int D>
struct VDecodeLowBit : lowbit::StagedSide<Fmt, S, D, Fmt::kRowBytes, lowbit::Scales<S, D>::kRowBytes> {
  using Side = lowbit::StagedSide<Fmt, S, D, Fmt::kRowBytes, lowbit::Scales<S, D>::kRowBytes>;
  using Ctx = typename Side::Ctx;
  using Tile = typename Side::Tile;
  static constexpr int kGroups = D / 32;
  static constexpr float kOutScale = 256.0f;
  static constexpr bool kGroupMajorDims = true;
  // The tile staged in `slot`; scale slot i = key 2t + (i & 1) + 8 (i >> 1).
  __device__ static void bind(const GpuKvSide& s, size_t row0, const unsigned char* slot, int g, int t, Tile& v) {
    Side::template bind_keys<4>(s, row0, slot, v, [t](int i) { return 2 * t + (i & 1) + 8 * (i >> 1); });
  }
  __device__ static void accumulate(const float (&p)[2][4], const float (&alpha)[2], const Tile& v,
                                    float (&o)[D / 8][4], const Ctx& ctx) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    rescale_o<D>(alpha, o);
    uint4 a_hi, a_lo;
    auto split_p = [&](int a) {
      float sc[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[i] = v.sc.get(i, a) * kOutScale;
      split_scaled_p(p, sc, a_hi, a_lo);
    };
    if constexpr (S != lowbit::Scale::group) split_p(0);  // one scale per key: the same P' for every group
#pragma unroll
    for (int a = 0; a < kGroups; ++a) {
      if constexpr (S == lowbit::Scale::group) split_p(a);
      uint32_t d[4][2];  // key slot i, pair k: dims 4g + 2k, 4g + 2k + 1
#pragma unroll
      for (int i = 0; i < 4; ++i) Fmt::v4(v.rows.code.row(2 * t + (i & 1) + 8 * (i >> 1)), 32 * a + 4 * g, ctx, d[i]);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const unsigned sel = (m & 1) ? 0x7632u : 0x5410u;
        const uint32_t b0 = __byte_perm(d[0][m >> 1], d[1][m >> 1], sel);  // keys 2t, 2t+1 at dim 4g + m
        const uint32_t b1 = __byte_perm(d[2][m >> 1], d[3][m >> 1], sel);  // keys 2t+8, 2t+9
        ptx::mma_f16(o[4 * a + m], a_lo, b0, b1);
        ptx::mma_f16(o[4 * a + m], a_hi, b0, b1);
      }
    }
  }
  __host__ __device__ static constexpr int dim_of(int j, int c) { return 32 * (j / 4) + 4 * c + (j % 4); }

  // ---- keys-major (attention_decode.cu): O^T += V^T P'^T. A = V^T: rows =
  // dims, columns = the tile's keys, so lane (g, t) holds keys 2t, 2t+1,
  // 2t+8, 2t+9 (as above) at 2 dims per m-tile: m-tile 2a + u, row g = dim
  // 32a + 4g + u, row g + 8 = dim 32a + 4g + 2 + u (km_dim()). B = P'^T: P is
  // scaled (slots 0, 1 = keys g, g + 8, the rows of S^T), split into two fp16
  // parts in S^T's layout, and each 8 x 8 half transposed by movmatrix
  // (Side::bind_km: scale slots 0, 1 = keys g, g + 8).
  __host__ __device__ static constexpr int km_dim(int mt, int row) {
    return 32 * (mt >> 1) + 4 * (row & 7) + 2 * (row >> 3) + (mt & 1);
  }
  // p: S^T's C fragment after the softmax; alpha: the o factors of heads 2t, 2t+1.
  __device__ static void accumulate_km(const float (&p)[4], const float (&alpha)[2], const Tile& v,
                                       float (&o)[D / 16][4], const Ctx& ctx) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[1];
        o[j][2] *= alpha[0];
        o[j][3] *= alpha[1];
      }
    }
    uint32_t b_hi[2], b_lo[2];
    auto split_p = [&](int a) {
      const float s0 = v.sc.get(0, a) * kOutScale, s1 = v.sc.get(1, a) * kOutScale;
      const float x[4] = {p[0] * s0, p[1] * s0, p[2] * s1, p[3] * s1};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __half2 hi = __floats2half2_rn(x[2 * h], x[2 * h + 1]);
        const float2 hf = __half22float2(hi);
        const __half2 lo = __floats2half2_rn(x[2 * h] - hf.x, x[2 * h + 1] - hf.y);
        b_hi[h] = ptx::movmatrix_trans(*reinterpret_cast<const uint32_t*>(&hi));
        b_lo[h] = ptx::movmatrix_trans(*reinterpret_cast<const uint32_t*>(&lo));
      }
    };
    if constexpr (S != lowbit::Scale::group) split_p(0);
#pragma unroll
    for (int a = 0; a < kGroups; ++a) {
      if constexpr (S == lowbit::Scale::group) split_p(a);
      uint32_t d[4][2];  // key slot i (key 2t + (i & 1) + 8 (i >> 1)), pair k: dims 4g + 2k, +1 of group a
#pragma unroll
      for (int i = 0; i < 4; ++i) Fmt::v4(v.rows.code.row(2 * t + (i & 1) + 8 * (i >> 1)), 32 * a + 4 * g, ctx, d[i]);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const unsigned sel = u ? 0x7632u : 0x5410u;
        const uint4 av = make_uint4(__byte_perm(d[0][0], d[1][0], sel), __byte_perm(d[0][1], d[1][1], sel),
                                    __byte_perm(d[2][0], d[3][0], sel), __byte_perm(d[2][1], d[3][1], sel));
        ptx::mma_f16(o[2 * a + u], av, b_lo[0], b_lo[1]);
        ptx::mma_f16(o[2 * a + u], av, b_hi[0], b_hi[1]);
      }
    }
  }
};

// The families' hooks. iso, rotor and planar share one storage format
// (storage_family() maps them to iso): N-bit codes with 32-dim group scales.
template <int B, int D>
struct KDecodeHooks<kv::Family::turbo, B, D> : KDecodeLowBit<lowbit::CodebookFormat<B, D>, lowbit::Scale::row, D> {};
template <int B, int D>
struct VDecodeHooks<kv::Family::turbo, B, D> : VDecodeLowBit<lowbit::CodebookFormat<B, D>, lowbit::Scale::row, D> {};
template <int B, int D>
struct KDecodeHooks<kv::Family::iso, B, D> : KDecodeLowBit<lowbit::CodebookFormat<B, D>, lowbit::Scale::group, D> {};
template <int B, int D>
struct VDecodeHooks<kv::Family::iso, B, D> : VDecodeLowBit<lowbit::CodebookFormat<B, D>, lowbit::Scale::group, D> {};
template <int B, int D>
struct KDecodeHooks<kv::Family::tcq, B, D> : KDecodeLowBit<lowbit::TcqFormat<B, D>, lowbit::Scale::row, D> {};
template <int B, int D>
struct VDecodeHooks<kv::Family::tcq, B, D> : VDecodeLowBit<lowbit::TcqFormat<B, D>, lowbit::Scale::row, D> {};
template <int B, int D>
struct KDecodeHooks<kv::Family::fp8, B, D> : KDecodeLowBit<lowbit::Fp8Format<D>, lowbit::Scale::none, D> {};
template <int B, int D>
struct VDecodeHooks<kv::Family::fp8, B, D> : VDecodeLowBit<lowbit::Fp8Format<D>, lowbit::Scale::none, D> {};

// The K side of a family with its +qjl rows: the base block's hooks over the
// longer rows (the sketch follows the base codes, the norm the base scales).
template <kv::Family F, int B, int D>
struct KDecodeWithQjlRows;
template <int B, int D>
struct KDecodeWithQjlRows<kv::Family::turbo, B, D>
    : KDecodeLowBit<lowbit::CodebookFormat<B, D>, lowbit::Scale::row, D, B * D / 8 + D / 8, 2 + 2> {};
template <int B, int D>
struct KDecodeWithQjlRows<kv::Family::iso, B, D>
    : KDecodeLowBit<lowbit::CodebookFormat<B, D>, lowbit::Scale::group, D, B * D / 8 + D / 8, D / 16 + 2> {};
template <int B, int D>
struct KDecodeWithQjlRows<kv::Family::tcq, B, D>
    : KDecodeLowBit<lowbit::TcqFormat<B, D>, lowbit::Scale::row, D, B * D / 8 + D / 8, 2 + 2> {};
template <int B, int D>
struct KDecodeWithQjlRows<kv::Family::fp8, B, D>
    : KDecodeLowBit<lowbit::Fp8Format<D>, lowbit::Scale::none, D, D + D / 8, 2> {};

// +qjl K sides (kv/blocks/qjl.cpp): q.k = q.k_base + sqrt(pi/2) / D * ||r|| *
// sum_j sign_j (S q_rot)_j. The kernel builds the Q fragments over 2D dims,
// [q_rot | S q_rot] (kQDims), so the sketch is a second K block of D dims
// whose values are +-1 (exact in fp16) and whose per-key scale is
// sqrt(pi/2) / D * ||r||: k-steps D/16 .. 2D/16 - 1 run on the sign bits
// with the same fragment map (lane t: sketch bits 32p + 8t .. +7, one byte),
// read from the same staged rows as the base codes.
template <kv::Family F, int B, int D>
struct KDecodeQjl : KDecodeWithQjlRows<F, B, D> {
  using Base = KDecodeWithQjlRows<F, B, D>;
  static_assert(Base::kF16 && Base::kQParts == 2, "+qjl extends an fp16 two-part K side");
  static constexpr int kQDims = 2 * D;
  static constexpr int kGroups = D / 32;
  using Ctx = typename Base::Ctx;
  struct Tile {
    typename Base::Tile base;
    uint32_t norm[4];  // slots as the C fragment: fp16 ||r||
    int code_offset;   // of the sketch in a code row
  };
  __device__ static void bind(const GpuKvSide& s, size_t row0, const unsigned char* slot, int g, int t, Tile& k) {
    Base::bind(s, row0, slot, g, t, k.base);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      k.norm[i] = lowbit::rd_u16(k.base.rows.side.row(8 * (i >> 1) + 2 * t + (i & 1)) + s.qjl_side_offset);
    k.code_offset = int(s.qjl_code_offset);
  }
  // Two sign bits (bit 0: the lower dim) as fp16 +-1 values.
  __device__ static uint32_t sign_pair(uint32_t b) { return 0xBC00BC00u ^ ((b & 1u) << 15) ^ ((b & 2u) << 30); }
  __device__ static void scores(const uint4* q_frag, const Tile& k, int lane, float (&s)[2][4], const Ctx& ctx) {
    Base::scores(q_frag, k.base, lane, s, ctx);
    const int g = lane >> 2, t = lane & 3;
    float acc[2][4] = {};
#pragma unroll
    for (int p = 0; p < kGroups; ++p) {
      uint32_t signs[2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) signs[nt] = lowbit::rd_u8(k.base.rows.code.row(8 * nt + g) + k.code_offset + 4 * p + t);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int step = D / 16 + 2 * p + hh;
#pragma unroll
        for (int part = Base::kQParts - 1; part >= 0; --part) {
          const uint4 a = ptx::load_shared16(&q_frag[(step * Base::kQParts + part) * 32 + lane]);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const uint32_t nib = signs[nt] >> (4 * hh);
            ptx::mma_f16(acc[nt], a, sign_pair(nib), sign_pair(nib >> 2));
          }
        }
      }
    }
    constexpr float kC = 1.2533141373155003f / D;  // sqrt(pi/2) / m, m = D projections
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float r0 = lowbit::f16_low(k.norm[2 * nt]) * kC, r1 = lowbit::f16_low(k.norm[2 * nt + 1]) * kC;
      s[nt][0] = fmaf(acc[nt][0], r0, s[nt][0]);
      s[nt][1] = fmaf(acc[nt][1], r1, s[nt][1]);
      s[nt][2] = fmaf(acc[nt][2], r0, s[nt][2]);
      s[nt][3] = fmaf(acc[nt][3], r1, s[nt][3]);
    }
  }

  // ---- keys-major: norm slots 0, 1 = keys g, g + 8.
  __device__ static void bind_km(const GpuKvSide& s, size_t row0, const unsigned char* slot, int g, Tile& k) {
    Base::bind_km(s, row0, slot, g, k.base);
    k.norm[0] = lowbit::rd_u16(k.base.rows.side.row(g) + s.qjl_side_offset);
    k.norm[1] = lowbit::rd_u16(k.base.rows.side.row(g + 8) + s.qjl_side_offset);
    k.code_offset = int(s.qjl_code_offset);
  }
  template <int kSteps, int kParts>
  __device__ static void scores_km(const uint32_t (&qb)[kSteps][kParts][2], const Tile& k, int lane, float (&s)[4],
                                   const Ctx& ctx) {
    static_assert(kSteps == 2 * D / 16, "+qjl: q fragments over [q_rot | S q_rot]");
    Base::scores_km(qb, k.base, lane, s, ctx);
    const int g = lane >> 2, t = lane & 3;
    float acc[2][4] = {};
#pragma unroll
    for (int p = 0; p < kGroups; ++p) {
      const uint32_t s0 = lowbit::rd_u8(k.base.rows.code.row(g) + k.code_offset + 4 * p + t);
      const uint32_t s1 = lowbit::rd_u8(k.base.rows.code.row(g + 8) + k.code_offset + 4 * p + t);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const uint32_t n0 = s0 >> (4 * hh), n1 = s1 >> (4 * hh);
        const uint4 a = make_uint4(sign_pair(n0), sign_pair(n1), sign_pair(n0 >> 2), sign_pair(n1 >> 2));
#pragma unroll
        for (int part = kParts - 1; part >= 0; --part)
          ptx::mma_f16(acc[hh], a, qb[D / 16 + 2 * p + hh][part][0], qb[D / 16 + 2 * p + hh][part][1]);
      }
    }
    constexpr float kC = 1.2533141373155003f / D;
    const float r0 = lowbit::f16_low(k.norm[0]) * kC, r1 = lowbit::f16_low(k.norm[1]) * kC;
    s[0] = fmaf(acc[0][0] + acc[1][0], r0, s[0]);
    s[1] = fmaf(acc[0][1] + acc[1][1], r0, s[1]);
    s[2] = fmaf(acc[0][2] + acc[1][2], r1, s[2]);
    s[3] = fmaf(acc[0][3] + acc[1][3], r1, s[3]);
  }
};

}  // namespace kvq::cuda
