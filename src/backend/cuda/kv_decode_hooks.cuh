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
template <kv::Family F, int D>
struct KDecodeHooks {
  static_assert(kAlwaysFalse<F>, "no GPU decode hooks (K side) for this KV block family (kv_codec_hooks.cuh)");
};

template <int D>
struct KDecodeHooks<kv::Family::bf16, D> {
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
  __device__ static void scores(const uint4* q_frag, const Tile& k, int lane, float (&s)[2][4]) {
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
template <int D>
struct KDecodeHooks<kv::Family::q8, D> {
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
  __device__ static void scores(const uint4* q_frag, const Tile& k, int lane, float (&s)[2][4]) {
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
template <kv::Family F, int D>
struct VDecodeHooks {
  static_assert(kAlwaysFalse<F>, "no GPU decode hooks (V side) for this KV block family (kv_codec_hooks.cuh)");
};

// bf16 V: logical (n-tile j, column c) = physical dim (D/8) c + j, so lane
// (g, t) loads the D/4 contiguous bytes of dims [(D/8) g, (D/8)(g+1)) of
// keys 2t, 2t+1, 2t+8, 2t+9; p is split exactly into three bf16 parts.
template <int D>
struct VDecodeHooks<kv::Family::bf16, D> {
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
                                    float (&o)[D / 8][4]) {
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
// exact in fp16; the group scale goes into P: P'_a = p * scale_a * 2^14, two
// fp16 parts (22 bits; the 2^14 keeps them out of the subnormal range), and
// o carries the factor 2^14 until it leaves the registers.
template <int D>
struct VDecodeHooks<kv::Family::q8, D> {
  static constexpr int kGroups = D / 32;
  static constexpr int kSideBytes = D / 16;
  static constexpr int kSideWords = (kSideBytes + 3) / 4;
  static constexpr float kOutScale = 16384.0f;
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
      KDecodeHooks<kv::Family::q8, D>::load_side(s, head_row0, key, v.side[i]);
    }
  }
  __device__ static void accumulate(const float (&p)[2][4], const float (&alpha)[2], const Tile& v,
                                    float (&o)[D / 8][4]) {
    // Past the first tiles the running max rarely moves: skip the rescale
    // (64 multiplies at D = 128) when no row of the warp needs it.
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
      }
    }
#pragma unroll
    for (int a = 0; a < kGroups; ++a) {
      // Scale slot of C element (nt, i): key 8 nt + 2t + (i & 1) = slot 2 nt + (i & 1).
      float sc[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[i] = KDecodeHooks<kv::Family::q8, D>::scale_of(v.side[i], a) * kOutScale;
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
      // A fragment: a0 = (row g, keys 2t, 2t+1), a1 = (row g+8, same keys), a2/a3: keys 2t+8, 2t+9.
      const uint4 a_hi = make_uint4(hi[0][0], hi[0][1], hi[1][0], hi[1][1]);
      const uint4 a_lo = make_uint4(lo[0][0], lo[0][1], lo[1][0], lo[1][1]);
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

}  // namespace kvq::cuda
