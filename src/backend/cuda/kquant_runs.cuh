// K-quant records (Q2_K..Q6_K in the GPU layout, backend/gpu_layout.hpp and
// gguf/quant.hpp) as the decode GEMVs read them against an input staged as
// int8 (gemv_stage.cuh: scale per 32 values, code sums per 16): a lane
// holds one 16-byte part of a super-block's codes (plus the header or high
// bits it needs) and walks it in runs of 16 weights. Every run has one
// scale and one min or offset, so with x = s_x u (int8 codes u)
//   sum_i w_i x_i = s_x (mul dot(q, u) - (mul offset + sub) sum(u)),
//   w_i = mul (q_i - offset) - sub,
// where q are the run's codes as non-negative bytes, dot(q, u) four dp4a and
// sum(u) the staged code sum of the run's 16 columns. Shared by gemv_kquant.cu
// (one input) and gemv_batch.cu (up to 16 inputs per decoded run).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "backend/cuda/gemv_args.cuh"
#include "gguf/types.hpp"

namespace kvq::cuda::kq {

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ int byte_of(const uint4& v, int k) { return int((word_of(v, k >> 2) >> (8 * (k & 3))) & 0xffu); }
__device__ __forceinline__ float half_at(const uint16_t* p) { return __half2float(__ushort_as_half(__ldg(p))); }

constexpr uint32_t kLow4 = 0x0f0f0f0fu, kLow2 = 0x03030303u, kBit0 = 0x01010101u;

// A run's codes: four words of 4 bytes (weights 4k..4k+3 of the run in word k).
struct RunCodes {
  uint32_t q[4];
};
// w = mul (q - offset) - sub for every weight of the run.
struct RunScale {
  float mul, sub;
  int offset;
};

// dp4a of a run's codes with the 16 staged codes of its columns.
__device__ __forceinline__ int dot_run(const RunCodes& c, const int4& u) {
  int acc = __dp4a(int(c.q[0]), u.x, 0);
  acc = __dp4a(int(c.q[1]), u.y, acc);
  acc = __dp4a(int(c.q[2]), u.z, acc);
  return __dp4a(int(c.q[3]), u.w, acc);
}
// The run's part of the dot product, given its dp4a sum, its columns' code
// sum and the scale of their group of 32.
__device__ __forceinline__ float run_value(const RunScale& s, int dot, int usum, float us) {
  return us * (s.mul * float(dot - s.offset * usum) - s.sub * float(usum));
}

// Where the staged 16-byte unit i (columns 16i..16i+15) lives in shared
// memory, per lane mapping: the 8 lanes of a shared-memory phase (a quarter
// warp, 16 bytes each) must read 8 distinct bank groups (unit mod 8). Every
// swizzle permutes units within an aligned block of 16 or 8, so it stays
// inside a staged row of any multiple of 256 columns; in_block(b, c) =
// at(16 b + c) for unit c (0..15) of super-block b (c is fixed per lane).
// Q4_K/Q5_K: a phase is one super-block's 8 lanes, reading units
// {0,1,4,5,8,9,12,13} (low nibbles) or those + 2 (high): bits 0, 2, 3 of the
// unit become the bank group, bit 1 the half.
struct SwizzleK45 {
  static __device__ __forceinline__ int at(int u) {
    return (u & ~15) | ((u & 2) << 2) | ((u & 8) >> 1) | ((u & 4) >> 1) | (u & 1);
  }
  static __device__ __forceinline__ int in_block(int b, int c) { return 16 * b + at(c); }
};
// Q6_K: units {0,1,2,3,8,9,10,11} (or + 4): bit 3 folded into bit 2.
struct SwizzleK6 {
  static __device__ __forceinline__ int at(int u) { return u ^ ((u >> 1) & 4); }
  static __device__ __forceinline__ int in_block(int b, int c) { return 16 * b + at(c); }
};
// Q2_K/Q3_K: a phase is two consecutive super-blocks' 4 lanes, reading units
// 2 r + {0, 1, 8, 9} of each (run r fixed): bits 3 and 4 of the unit (which
// half of the super-block, which super-block) are XORed into bits 1 and 2.
struct SwizzleK23 {
  static __device__ __forceinline__ int at(int u) { return u ^ (((u >> 3) & 3) << 1); }
  static __device__ __forceinline__ int in_block(int b, int c) { return (16 * b + at(c)) ^ ((b & 1) << 2); }
};

// Per type: kLanes lanes per super-block, kRuns runs of 16 weights per lane,
// Data (the lane's part of a record), load(record, super-scales, j) for lane
// j of the super-block, unit(j, r) (the run's 16 columns as a unit of the
// super-block), codes(d, j, r) and scale(d, j, r).
template <gguf::TensorType T>
struct Runs;

// Q4_K / Q5_K: lane j (0..7) holds nibble chunk j: bytes qs[16 j .. 16 j + 16) = qs[32 p + 16 h + t]
// with p = j / 2, h = j % 2: run 0 (low nibbles) is weights 64 p + 16 h + t (sub-block 2 p, unit
// 4 p + h), run 1 (high nibbles) 64 p + 32 + 16 h + t (sub-block 2 p + 1, unit 4 p + 2 + h). Q5_K's
// fifth bits of those weights are bits 2 p and 2 p + 1 of qh[16 h + t].
template <bool kQ5>
struct Runs45 {
  static constexpr int kLanes = 8, kRuns = 2;
  using Swizzle = SwizzleK45;
  struct Data {
    uint4 head, qs, qh;
  };
  static __device__ __forceinline__ Data load(const uint8_t* rec, const uint16_t*, int j) {
    using gemv_detail::load_weights16;
    Data d;
    d.head = load_weights16(rec);
    d.qs = load_weights16(rec + (kQ5 ? 48 : 16) + 16 * j);
    d.qh = kQ5 ? load_weights16(rec + 16 + 16 * (j % 2)) : make_uint4(0, 0, 0, 0);
    return d;
  }
  static __device__ __forceinline__ int unit(int j, int r) { return 4 * (j / 2) + 2 * r + (j % 2); }
  static __device__ __forceinline__ RunCodes codes(const Data& d, int j, int r) {
    RunCodes c;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      c.q[k] = (word_of(d.qs, k) >> (4 * r)) & kLow4;
      if (kQ5) c.q[k] |= ((word_of(d.qh, k) >> (2 * (j / 2) + r)) & kBit0) << 4;
    }
    return c;
  }
  // The 6-bit scale and min of sub-block 2p + r from the header's sm[12]
  // (bytes 4..15 = words y, z, w): sub-blocks 0..3 keep theirs in the low 6
  // bits of bytes 0..3 of y (sc) and z (m); 4..7 take the nibbles of w and
  // the top 2 bits of y (sc) or z (m). Four bytes at a time, then the lane's.
  static __device__ __forceinline__ RunScale scale(const Data& d, int j, int r) {
    const int p = j / 2;
    const uint32_t sc = p < 2 ? d.head.y & 0x3f3f3f3fu : (d.head.w & kLow4) | ((d.head.y >> 2) & 0x30303030u);
    const uint32_t m = p < 2 ? d.head.z & 0x3f3f3f3fu : ((d.head.w >> 4) & kLow4) | ((d.head.z >> 2) & 0x30303030u);
    const int shift = 16 * (p & 1) + 8 * r;  // sub-block 2p + r is byte 2 (p % 2) + r of its word
    const float dd = __half2float(__ushort_as_half(uint16_t(d.head.x & 0xffffu)));
    const float dmin = __half2float(__ushort_as_half(uint16_t(d.head.x >> 16)));
    return {dd * float((sc >> shift) & 0xffu), dmin * float((m >> shift) & 0xffu), 0};
  }
};
template <>
struct Runs<gguf::TensorType::Q4_K> : Runs45<false> {};
template <>
struct Runs<gguf::TensorType::Q5_K> : Runs45<true> {};

// Q6_K: lane j (0..7) holds ql chunk j = ql[64 h + 32 g2 + l0 + t] with h = j / 4, g2 = (j / 2) % 2,
// l0 = 16 (j % 2): run 0 (low nibbles) is weights 128 h + 32 g2 + l0 + t (unit r0 = 8 h + 2 g2 + j % 2
// of the super-block), run 1 (high nibbles) unit r0 + 4; their high 2 bits are bits 2 g of
// qh[32 h + l0 + t] (g = g2, g2 + 2). Unit u has the int8 scale sc[u] and weights d sc (q - 32).
template <>
struct Runs<gguf::TensorType::Q6_K> {
  static constexpr int kLanes = 8, kRuns = 2;
  using Swizzle = SwizzleK6;
  struct Data {
    uint4 ql, qh, sc;
    float d;
  };
  static __device__ __forceinline__ Data load(const uint8_t* rec, const uint16_t* s, int j) {
    using gemv_detail::load_weights16;
    Data d;
    d.ql = load_weights16(rec + 16 * j);
    d.qh = load_weights16(rec + 128 + 32 * (j / 4) + 16 * (j % 2));
    d.sc = load_weights16(rec + 192);
    d.d = half_at(s);
    return d;
  }
  static __device__ __forceinline__ int unit(int j, int r) { return 8 * (j / 4) + 2 * ((j / 2) % 2) + (j % 2) + 4 * r; }
  static __device__ __forceinline__ RunCodes codes(const Data& d, int j, int r) {
    const int g2 = (j / 2) % 2;
    RunCodes c;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      c.q[k] = ((word_of(d.ql, k) >> (4 * r)) & kLow4) | (((word_of(d.qh, k) >> (2 * g2 + 4 * r)) & kLow2) << 4);
    return c;
  }
  static __device__ __forceinline__ RunScale scale(const Data& d, int j, int r) {
    return {d.d * float(int8_t(byte_of(d.sc, unit(j, r)))), 0.0f, 32};
  }
};

// Q2_K / Q3_K: lane j (0..3) holds code chunk j = qs[32 n + l0 + t] with n = j / 2, l0 = 16 (j % 2):
// bits 2 r of each byte (run r) are weight 128 n + 32 r + l0 + t, unit (and sub-block of 16)
// k = 8 n + 2 r + j % 2 of the super-block. Q3_K's "no -4" bit of that weight is bit 4 n + r of
// hm[l0 + t]: its code byte is q + 4 = (2-bit code) + 4 (high bit), in 0..7.
template <>
struct Runs<gguf::TensorType::Q2_K> {
  static constexpr int kLanes = 4, kRuns = 4;
  using Swizzle = SwizzleK23;
  struct Data {
    uint4 sm, qs;
    float d, dmin;
  };
  static __device__ __forceinline__ Data load(const uint8_t* rec, const uint16_t* s, int j) {
    using gemv_detail::load_weights16;
    Data d;
    d.sm = load_weights16(rec);
    d.qs = load_weights16(rec + 16 + 16 * j);
    d.d = half_at(s);
    d.dmin = half_at(s + 1);
    return d;
  }
  static __device__ __forceinline__ int unit(int j, int r) { return 8 * (j / 2) + 2 * r + (j % 2); }
  static __device__ __forceinline__ RunCodes codes(const Data& d, int, int r) {
    RunCodes c;
#pragma unroll
    for (int k = 0; k < 4; ++k) c.q[k] = (word_of(d.qs, k) >> (2 * r)) & kLow2;
    return c;
  }
  static __device__ __forceinline__ RunScale scale(const Data& d, int j, int r) {
    const int sm = byte_of(d.sm, unit(j, r));
    return {d.d * float(sm & 15), d.dmin * float(sm >> 4), 0};
  }
};

template <>
struct Runs<gguf::TensorType::Q3_K> {
  static constexpr int kLanes = 4, kRuns = 4;
  using Swizzle = SwizzleK23;
  struct Data {
    uint4 hm, qs, sc;
    float d;
  };
  static __device__ __forceinline__ Data load(const uint8_t* rec, const uint16_t* s, int j) {
    using gemv_detail::load_weights16;
    Data d;
    d.hm = load_weights16(rec + 16 * (j % 2));
    d.qs = load_weights16(rec + 32 + 16 * j);
    d.sc = load_weights16(rec + 96);  // 12 scale bytes and the record's 4 bytes of padding
    d.d = half_at(s);
    return d;
  }
  static __device__ __forceinline__ int unit(int j, int r) { return 8 * (j / 2) + 2 * r + (j % 2); }
  static __device__ __forceinline__ RunCodes codes(const Data& d, int j, int r) {
    RunCodes c;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      c.q[k] = ((word_of(d.qs, k) >> (2 * r)) & kLow2) | (((word_of(d.hm, k) >> (4 * (j / 2) + r)) & kBit0) << 2);
    return c;
  }
  static __device__ __forceinline__ RunScale scale(const Data& d, int j, int r) {
    const int k = unit(j, r);
    const int low = k < 8 ? byte_of(d.sc, k) & 15 : byte_of(d.sc, k - 8) >> 4;
    const int s = (low | (((byte_of(d.sc, 8 + k % 4) >> (2 * (k / 4))) & 3) << 4)) - 32;
    return {d.d * float(s), 0.0f, 4};
  }
};

}  // namespace kvq::cuda::kq
