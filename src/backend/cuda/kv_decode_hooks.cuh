// Device-side KV decode hooks of the tensor-core flash-decode kernel
// (attention_decode.cu), one specialisation per storage format. The kernel is
// templated over the hooks of its K and V sides; a format without hooks fails
// to compile where it is used (static_assert in the primary templates).
//   KDecodeHooks<F, D>: the K side: how q is prepared (number and type of its
//                       exact parts, pre-scaling), how a 16-key tile is loaded
//                       into registers, and S = Q K^T of one tile.
//   VDecodeHooks<F, D>: the V side: load a 16-key tile, o += P V, and where
//                       each accumulator lands in the output row.
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
template <kv::Family F, int B, int D>
struct KDecodeHooks {
  static_assert(kAlwaysFalse<F>, "no GPU decode hooks (K side) for this KV block family (kv_codec_hooks.cuh)");
};

template <int B, int D>
struct KDecodeHooks<kv::Family::bf16, B, D> {
  static constexpr int kLutEntries = 0;
  static constexpr int kQParts = 3;       // bf16 parts: 24 bits, exact
  static constexpr bool kF16 = false;
  static constexpr bool kPrescale = false;
  static constexpr int kLoads = D / 32;   // 16-byte loads per key and lane
  struct Tile {
    uint4 r[2][kLoads];
  };
  // Lane (g, t): keys g and 8 + g of the tile at kb, 16-byte chunks at dims 32c + 8t.
  __device__ static void load(const GpuKvSide& s, size_t head_row0, int kb, int last_key, int g, int t, Tile& k) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint8_t* row = s.code + (head_row0 + min(kb + 8 * nt + g, last_key)) * size_t(2 * D) + 16 * t;
#pragma unroll
      for (int c = 0; c < kLoads; ++c) k.r[nt][c] = ptx::load_stream16(row + 64 * c);
    }
  }
  // S of one tile; two accumulator sets (even / odd k-steps) halve the
  // dependent mma chain; the small q parts go first.
  __device__ static void scores(const uint4* q_frag, const Tile& k, int lane, float (&s)[2][4],
                                const uint32_t* /*lut*/) {
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
  __device__ static void load(const GpuKvSide& s, size_t head_row0, int kb, int last_key, int g, int t, Tile& k) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint8_t* row = s.code + (head_row0 + min(kb + 8 * nt + g, last_key)) * size_t(D) + 8 * t;
#pragma unroll
      for (int p = 0; p < kGroups; ++p) k.code[nt][p] = ptx::load_stream8(row + 32 * p);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) load_side(s, head_row0, min(kb + 8 * (i >> 1) + 2 * t + (i & 1), last_key), k.side[i]);
  }
  __device__ static void load_side(const GpuKvSide& s, size_t head_row0, int key, uint32_t (&w)[kSideWords]) {
    const uint8_t* row = s.side + (head_row0 + key) * size_t(kSideBytes);
    if constexpr (kSideBytes == 16) {
      const uint4 v = ptx::load_stream16(row);
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if constexpr (kSideBytes == 8) {
      const uint2 v = ptx::load_stream8(row);
      w[0] = v.x, w[1] = v.y;
    } else {
      w[0] = ptx::load_stream4(row);
    }
  }
  __device__ static float scale_of(const uint32_t (&w)[kSideWords], int p) {
    const uint32_t word = w[p >> 1];
    return __half2float(__ushort_as_half(static_cast<unsigned short>((p & 1) ? word >> 16 : word & 0xffffu)));
  }
  __device__ static void scores(const uint4* q_frag, const Tile& k, int lane, float (&s)[2][4],
                                const uint32_t* /*lut*/) {
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
  static constexpr bool kGroupMajorDims = false;  // dim_of: quarters per lane t
  static constexpr int kLoads = D / 64;
  static constexpr int kPParts = 3;
  static constexpr float kOutScale = 1.0f;
  struct Tile {
    uint4 r[4][kLoads];
  };
  __device__ static void load(const GpuKvSide& s, size_t head_row0, int kb, int last_key, int g, int t, Tile& v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = kb + 2 * t + (i & 1) + 8 * (i >> 1);
      const uint8_t* row = s.code + (head_row0 + min(key, last_key)) * size_t(2 * D) + (D / 4) * g;
#pragma unroll
      for (int c = 0; c < kLoads; ++c) v.r[i][c] = ptx::load_stream16(row + 16 * c);
    }
  }
  __device__ static void accumulate(const float (&p)[2][4], const float (&alpha)[2], const Tile& v,
                                    float (&o)[D / 8][4], const uint32_t* /*lut*/) {
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
  static constexpr bool kGroupMajorDims = true;  // dim_of: 32-dim groups, lane t owns 8t..8t+7
  static constexpr int kGroups = D / 32;
  static constexpr int kSideBytes = D / 16;
  static constexpr int kSideWords = (kSideBytes + 3) / 4;
  static constexpr float kOutScale = 256.0f;
  struct Tile {
    uint32_t code[4][kGroups];
    uint32_t side[4][kSideWords];
  };
  __device__ static void load(const GpuKvSide& s, size_t head_row0, int kb, int last_key, int g, int t, Tile& v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = min(kb + 2 * t + (i & 1) + 8 * (i >> 1), last_key);
      const uint8_t* row = s.code + (head_row0 + key) * size_t(D) + 4 * g;
#pragma unroll
      for (int a = 0; a < kGroups; ++a) v.code[i][a] = ptx::load_stream4(row + 32 * a);
      KDecodeHooks<kv::Family::q8, 8, D>::load_side(s, head_row0, key, v.side[i]);
    }
  }
  __device__ static void accumulate(const float (&p)[2][4], const float (&alpha)[2], const Tile& v,
                                    float (&o)[D / 8][4], const uint32_t* /*lut*/) {
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
// Low-bit formats (turbo, tcq, iso/rotor/planar, fp8): codes become exact
// fp16 B fragments through a per-CTA pair table in shared memory (one LDS
// per two values) or, for fp8, the hardware e4m3x2 -> f16x2 conversion. The
// fragment maps are q8's: on the K side lane (g, t) reads the 8 dims
// 32p + 8t .. +7 of group p of its keys g, 8 + g (k-steps 2p, 2p+1); on the V
// side the 4 dims 32a + 4g .. +3 of keys 2t, 2t+1, 2t+8, 2t+9 (n-tiles
// 4a..4a+3). A format says how to fetch those bits (K: 8 dims, V: 4 dims)
// and how two neighbouring dims form a pair-table index.
//
// The blocks' levels are fp16-exact (kv/codebook.hpp, kv/tcq.cpp), so the
// table holds them exactly; q and P keep 22 bits (two fp16 parts) as for q8.
// Scales (row or 32-dim group, fp16 in the side row) are applied in fp32: K
// after the mma, V inside P (P' = p * scale * 2^8, as q8).
// ---------------------------------------------------------------------------
namespace lowbit {

__device__ __forceinline__ uint32_t ld_u8(const uint8_t* p) { return __ldg(p); }
__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) {
  return __ldg(reinterpret_cast<const unsigned short*>(p));
}
__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) { return __ldg(reinterpret_cast<const unsigned int*>(p)); }
__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float f16_low(uint32_t w) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
}

enum class Scale { none, row, group };

// N-bit Lloyd-Max indices (turbo, iso, rotor, planar): bitpack.hpp planes.
// Raw bits: the first plane's bits of the chunk at bit 0, a 3-bit code's
// high plane at bit 16. Pair index of dims (2k, 2k+1) of a chunk:
//   4 bits: byte k (low nibble = dim 2k); 2 bits: nibble k;
//   3 bits: nibble k of the low plane | high bits 2k, 2k+1 at bits 4, 5.
template <int B, int D>
struct CodebookFormat {
  static_assert(B >= 2 && B <= 4, "codebook blocks have 2, 3 or 4 bits");
  static constexpr int kLutEntries = 1 << (2 * B);
  static constexpr int kHighPlane = D / 4;  // 3 bits: the 1-bit plane after the 2-bit one
  __device__ static uint32_t lut_entry(const GpuKvSide& s, int i) {
    int i0, i1;
    if constexpr (B == 3) {
      i0 = (i & 3) | (((i >> 4) & 1) << 2);
      i1 = ((i >> 2) & 3) | (((i >> 5) & 1) << 2);
    } else {
      i0 = i & ((1 << B) - 1);
      i1 = i >> B;
    }
    return half2_bits(s.codebook[i0], s.codebook[i1]);
  }
  // K: dims d0 .. d0 + 7 (d0 = 32p + 8t).
  struct KRaw {
    uint32_t w;
  };
  __device__ static void load_k(const uint8_t* row, int d0, KRaw& r) {
    if constexpr (B == 4) r.w = ld_u32(row + d0 / 2);
    else if constexpr (B == 2) r.w = ld_u16(row + d0 / 4);
    else r.w = ld_u16(row + d0 / 4) | (ld_u8(row + kHighPlane + d0 / 8) << 16);
  }
  __device__ static uint32_t k_index(const KRaw& r, int k) { return index(r.w, k); }
  // V: dims d0 .. d0 + 3 (d0 = 32a + 4g).
  struct VRaw {
    uint32_t w;
  };
  __device__ static void load_v(const uint8_t* row, int d0, VRaw& r) {
    if constexpr (B == 4) r.w = ld_u16(row + d0 / 2);
    else if constexpr (B == 2) r.w = ld_u8(row + d0 / 4);
    else r.w = ld_u8(row + d0 / 4) | (((ld_u8(row + kHighPlane + d0 / 8) >> (d0 & 4)) & 0xfu) << 16);
  }
  __device__ static uint32_t v_index(const VRaw& r, int k) { return index(r.w, k); }
  __device__ static uint32_t index(uint32_t w, int k) {
    if constexpr (B == 4) return (w >> (8 * k)) & 0xffu;
    else if constexpr (B == 2) return (w >> (4 * k)) & 0xfu;
    else return ((w >> (4 * k)) & 0xfu) | (((w >> (16 + 2 * k)) & 3u) << 4);
  }
};

// tcq (kv/tcq.hpp): a branch plane (1 bit per dim, D/8 bytes) then a level
// plane (B - 1 bits per dim). The value of dim i is levels[4 m_i + subset(w_i)]
// with the window w_i = b_i | b_{i-1} << 1 | ... | b_{i-5} << 5. Raw bits:
// `win` holds the branch bits from dim d0 - 5 upwards (bit m = b_{d0-5+m};
// bits before dim 0 are 0), `lv` the level bits of the chunk. The 7 branch
// bits b_{i-5} .. b_{i+1} decide both windows of a pair (2k, 2k+1); pair
// index = those 7 bits | m_{2k} << 7 | m_{2k+1} << (7 + B - 1).
template <int B, int D>
struct TcqFormat {
  static_assert(B == 2 || B == 3, "tcq blocks have 2 or 3 bits");
  static constexpr int kLevelBits = B - 1;
  static constexpr int kLutEntries = 1 << (7 + 2 * kLevelBits);
  static constexpr int kLevelPlane = D / 8;
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
  // Branch bits from dim d0 - 5: words d0 / 32 and the one before it.
  __device__ static uint32_t window_bits(const uint8_t* row, int d0) {
    const int w = d0 >> 5, off = d0 & 31;
    const uint32_t cur = ld_u32(row + 4 * w);
    if (off >= 5) return cur >> (off - 5);
    const uint32_t prev = w > 0 ? ld_u32(row + 4 * w - 4) : 0u;
    return __funnelshift_r(prev, cur, 27 + off);
  }
  struct KRaw {
    uint32_t win, lv;
  };
  __device__ static void load_k(const uint8_t* row, int d0, KRaw& r) {
    r.win = window_bits(row, d0);
    r.lv = kLevelBits == 1 ? ld_u8(row + kLevelPlane + d0 / 8) : ld_u16(row + kLevelPlane + d0 / 4);
  }
  __device__ static uint32_t k_index(const KRaw& r, int k) { return index(r.win, r.lv, k); }
  struct VRaw {
    uint32_t win, lv;
  };
  __device__ static void load_v(const uint8_t* row, int d0, VRaw& r) {
    r.win = window_bits(row, d0);
    r.lv = kLevelBits == 1 ? (ld_u8(row + kLevelPlane + d0 / 8) >> (d0 & 4)) & 0xfu : ld_u8(row + kLevelPlane + d0 / 4);
  }
  __device__ static uint32_t v_index(const VRaw& r, int k) { return index(r.win, r.lv, k); }
  __device__ static uint32_t index(uint32_t win, uint32_t lv, int k) {
    const uint32_t m = (lv >> (2 * kLevelBits * k)) & ((1u << (2 * kLevelBits)) - 1u);
    return ((win >> (2 * k)) & 127u) | (m << 7);
  }
};

// fp8 (e4m3, one byte per dim): no table, the hardware converts pairs.
struct Fp8Format {
  static constexpr int kLutEntries = 0;
  __device__ static uint32_t lut_entry(const GpuKvSide&, int) { return 0; }
  struct KRaw {
    uint2 w;
  };
  __device__ static void load_k(const uint8_t* row, int d0, KRaw& r) {
    r.w = __ldg(reinterpret_cast<const uint2*>(row + d0));
  }
  struct VRaw {
    uint32_t w;
  };
  __device__ static void load_v(const uint8_t* row, int d0, VRaw& r) { r.w = ld_u32(row + d0); }
  __device__ static uint32_t convert(uint32_t two_bytes) {
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xffffu), __NV_E4M3);
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
  }
  __device__ static uint32_t k_pair(const KRaw& r, int k, const uint32_t*) {
    return convert(k < 2 ? r.w.x >> (16 * k) : r.w.y >> (16 * (k - 2)));
  }
  __device__ static uint32_t v_pair(const VRaw& r, int k, const uint32_t*) { return convert(r.w >> (16 * k)); }
};

// Pair values through the table (formats with kLutEntries > 0).
template <class Fmt>
__device__ __forceinline__ uint32_t k_pair(const typename Fmt::KRaw& r, int k, const uint32_t* lut) {
  if constexpr (Fmt::kLutEntries == 0) return Fmt::k_pair(r, k, lut);
  else return lut[Fmt::k_index(r, k)];
}
template <class Fmt>
__device__ __forceinline__ uint32_t v_pair(const typename Fmt::VRaw& r, int k, const uint32_t* lut) {
  if constexpr (Fmt::kLutEntries == 0) return Fmt::v_pair(r, k, lut);
  else return lut[Fmt::v_index(r, k)];
}

// The four keys' scales a lane needs (slot i = key 8 (i >> 1) + 2t + (i & 1)
// of the tile, as the C fragment's columns): none, one fp16 per row (turbo,
// tcq: the stored a = n * g, times 1 / sqrt(D)), or D/32 fp16 group scales.
template <Scale S, int D>
struct Scales {
  static constexpr int kWords = S == Scale::group ? (D / 16 + 3) / 4 : 1;
  uint32_t w[4][kWords];
  __device__ void load(const GpuKvSide& s, size_t head_row0, int i, int key) {
    const uint8_t* row = s.side + (head_row0 + key) * size_t(s.side_bytes);
    if constexpr (S == Scale::row) {
      w[i][0] = ld_u16(row);
    } else if constexpr (S == Scale::group) {
      if (s.side_bytes != D / 16) {  // +qjl rows append a norm: only 2-byte aligned
#pragma unroll
        for (int q = 0; q < kWords; ++q) w[i][q] = ld_u16(row + 4 * q) | (ld_u16(row + 4 * q + 2) << 16);
      } else if constexpr (D / 16 == 16) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(row));
        w[i][0] = v.x, w[i][1] = v.y, w[i][2] = v.z, w[i][3] = v.w;
      } else if constexpr (D / 16 == 8) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(row));
        w[i][0] = v.x, w[i][1] = v.y;
      } else {
        w[i][0] = ld_u32(row);
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

// The per-CTA pair table of a format (its K and V hooks build it the same way).
template <class Fmt>
struct PairTable {
  static constexpr int kLutEntries = Fmt::kLutEntries;
  __device__ static void build_lut(const GpuKvSide& s, uint32_t* lut, int tid, int n_threads) {
    for (int i = tid; i < kLutEntries; i += n_threads) lut[i] = Fmt::lut_entry(s, i);
  }
};

}  // namespace lowbit

// K side of a low-bit format: q in two fp16 parts (pre-scaled, as q8), one
// mma per part, k-step and key n-tile; the scales after the mma in fp32.
template <class Fmt, lowbit::Scale S, int D>
struct KDecodeLowBit : lowbit::PairTable<Fmt> {
  static constexpr int kQParts = 2;
  static constexpr bool kF16 = true;
  static constexpr bool kPrescale = true;
  static constexpr int kGroups = D / 32;
  struct Tile {
    typename Fmt::KRaw raw[2][kGroups];
    lowbit::Scales<S, D> sc;
  };
  __device__ static void load(const GpuKvSide& s, size_t head_row0, int kb, int last_key, int g, int t, Tile& k) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint8_t* row = s.code + (head_row0 + min(kb + 8 * nt + g, last_key)) * size_t(s.code_bytes);
#pragma unroll
      for (int p = 0; p < kGroups; ++p) Fmt::load_k(row, 32 * p + 8 * t, k.raw[nt][p]);
    }
    if constexpr (S != lowbit::Scale::none) {
#pragma unroll
      for (int i = 0; i < 4; ++i) k.sc.load(s, head_row0, i, min(kb + 8 * (i >> 1) + 2 * t + (i & 1), last_key));
    }
  }
  __device__ static void scores(const uint4* q_frag, const Tile& k, int lane, float (&s)[2][4], const uint32_t* lut) {
    float acc[2][4] = {};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int p = 0; p < kGroups; ++p) {
      uint32_t h[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) h[nt][j] = lowbit::k_pair<Fmt>(k.raw[nt][p], j, lut);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int step = 2 * p + hh;
#pragma unroll
        for (int part = kQParts - 1; part >= 0; --part) {
          const uint4 a = ptx::load_shared16(&q_frag[(step * kQParts + part) * 32 + lane]);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) ptx::mma_f16(acc[nt], a, h[nt][2 * hh], h[nt][2 * hh + 1]);
        }
      }
      if constexpr (S == lowbit::Scale::group) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float s0 = k.sc.get(2 * nt, p), s1 = k.sc.get(2 * nt + 1, p);
          s[nt][0] = fmaf(acc[nt][0], s0, s[nt][0]);
          s[nt][1] = fmaf(acc[nt][1], s1, s[nt][1]);
          s[nt][2] = fmaf(acc[nt][2], s0, s[nt][2]);
          s[nt][3] = fmaf(acc[nt][3], s1, s[nt][3]);
          acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
        }
      }
    }
    if constexpr (S != lowbit::Scale::group) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float s0 = k.sc.get(2 * nt, 0), s1 = k.sc.get(2 * nt + 1, 0);
        s[nt][0] = acc[nt][0] * s0;
        s[nt][1] = acc[nt][1] * s1;
        s[nt][2] = acc[nt][2] * s0;
        s[nt][3] = acc[nt][3] * s1;
      }
    }
  }
};

// V side of a low-bit format (q8's n-tile map and P scaling, kOutScale 2^8).
template <class Fmt, lowbit::Scale S, int D>
struct VDecodeLowBit : lowbit::PairTable<Fmt> {
  static constexpr int kGroups = D / 32;
  static constexpr float kOutScale = 256.0f;
  static constexpr bool kGroupMajorDims = true;
  struct Tile {
    typename Fmt::VRaw raw[4][kGroups];
    lowbit::Scales<S, D> sc;
  };
  __device__ static void load(const GpuKvSide& s, size_t head_row0, int kb, int last_key, int g, int t, Tile& v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = min(kb + 2 * t + (i & 1) + 8 * (i >> 1), last_key);
      const uint8_t* row = s.code + (head_row0 + key) * size_t(s.code_bytes);
#pragma unroll
      for (int a = 0; a < kGroups; ++a) Fmt::load_v(row, 32 * a + 4 * g, v.raw[i][a]);
      if constexpr (S != lowbit::Scale::none) v.sc.load(s, head_row0, i, key);
    }
  }
  __device__ static void accumulate(const float (&p)[2][4], const float (&alpha)[2], const Tile& v,
                                    float (&o)[D / 8][4], const uint32_t* lut) {
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
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int k = 0; k < 2; ++k) d[i][k] = lowbit::v_pair<Fmt>(v.raw[i][a], k, lut);
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
struct KDecodeHooks<kv::Family::fp8, B, D> : KDecodeLowBit<lowbit::Fp8Format, lowbit::Scale::none, D> {};
template <int B, int D>
struct VDecodeHooks<kv::Family::fp8, B, D> : VDecodeLowBit<lowbit::Fp8Format, lowbit::Scale::none, D> {};

// +qjl K sides (kv/blocks/qjl.cpp): q.k = q.k_base + sqrt(pi/2) / D * ||r|| *
// sum_j sign_j (S q_rot)_j. The kernel builds the Q fragments over 2D dims,
// [q_rot | S q_rot] (kQDims), so the sketch is a second K block of D dims
// whose values are +-1 (exact in fp16) and whose per-key scale is
// sqrt(pi/2) / D * ||r||: k-steps D/16 .. 2D/16 - 1 run on the sign bits
// with the same fragment map (lane t: sketch bits 32p + 8t .. +7, one byte).
template <class Base, int D>
struct KDecodeQjl {
  static_assert(Base::kF16 && Base::kQParts == 2, "+qjl extends an fp16 two-part K side");
  static constexpr int kQParts = 2;
  static constexpr bool kF16 = true;
  static constexpr bool kPrescale = true;
  static constexpr int kQDims = 2 * D;
  static constexpr int kGroups = D / 32;
  static constexpr int kLutEntries = Base::kLutEntries;
  struct Tile {
    typename Base::Tile base;
    uint32_t signs[2][kGroups];  // keys g, 8 + g: sketch bits 32p + 8t .. +7
    uint32_t norm[4];            // slots as the C fragment: fp16 ||r||
  };
  __device__ static void build_lut(const GpuKvSide& s, uint32_t* lut, int tid, int n_threads) {
    if constexpr (kLutEntries > 0) Base::build_lut(s, lut, tid, n_threads);
  }
  __device__ static void load(const GpuKvSide& s, size_t head_row0, int kb, int last_key, int g, int t, Tile& k) {
    Base::load(s, head_row0, kb, last_key, g, t, k.base);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint8_t* bits = s.code + (head_row0 + min(kb + 8 * nt + g, last_key)) * size_t(s.code_bytes) +
                            s.qjl_code_offset;
#pragma unroll
      for (int p = 0; p < kGroups; ++p) k.signs[nt][p] = lowbit::ld_u8(bits + 4 * p + t);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = min(kb + 8 * (i >> 1) + 2 * t + (i & 1), last_key);
      k.norm[i] = lowbit::ld_u16(s.side + (head_row0 + key) * size_t(s.side_bytes) + s.qjl_side_offset);
    }
  }
  // Two sign bits (bit 0: the lower dim) as fp16 +-1 values.
  __device__ static uint32_t sign_pair(uint32_t b) { return 0xBC00BC00u ^ ((b & 1u) << 15) ^ ((b & 2u) << 30); }
  __device__ static void scores(const uint4* q_frag, const Tile& k, int lane, float (&s)[2][4], const uint32_t* lut) {
    Base::scores(q_frag, k.base, lane, s, lut);
    float acc[2][4] = {};
#pragma unroll
    for (int p = 0; p < kGroups; ++p)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int step = D / 16 + 2 * p + hh;
#pragma unroll
        for (int part = kQParts - 1; part >= 0; --part) {
          const uint4 a = ptx::load_shared16(&q_frag[(step * kQParts + part) * 32 + lane]);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const uint32_t nib = k.signs[nt][p] >> (4 * hh);
            ptx::mma_f16(acc[nt], a, sign_pair(nib), sign_pair(nib >> 2));
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
};

}  // namespace kvq::cuda
