// Device-side KV codec hooks, encode side: how a block family's rows are
// written and read back value by value, one specialisation per family. The
// decode side (what the tensor-core decode kernel needs: KDecodeHooks /
// VDecodeHooks<F, B, D>) is kv_decode_hooks.cuh. Kernels are templated over
// the hooks of their K and V sides, so adding a codec means adding its hooks
// here and in kv_decode_hooks.cuh (and its decode instances to the
// KVQ_DECODE_*_INSTANCES X-macro lists in attention_decode.cu), never editing
// the kernels. A family without hooks fails to compile where it is used
// (static_assert in the primary templates).
//
// Hooks per family F:
//   EncodeHooks<F>:           encode_row(): one warp encodes one row (the CPU
//                             block's encode, bit for bit where deterministic).
//                             decode_value(): one value of a row (prefill's
//                             dequantization of the prefix into bf16 tiles).
// Rotations are hoisted out of the decode hooks: the decode kernel rotates q
// once per CTA before its key loop and un-rotates o once after its merge
// (DecodeParams::q_rot / o_rot; kv_rotation.cuh: every rotation kind,
// bit-identical to kv::Rotation); encoding rotates once per row.
//
// ---- Bit layouts (the same bytes as the CPU blocks in src/kv/blocks/) ----
// bf16: code row = D bf16 values (2 bytes each, dim i at bytes 2i..2i+1),
//       no side row. Values are sanitised (NaN -> 0, clamped to +-65504).
// q8:   code row = D int8 values (dim i at byte i); side row = D/32 fp16
//       scales (little-endian, scale g covers dims 32g..32g+31);
//       value = scale * int8. scale = fp16(absmax(group) / 127), an all-zero
//       group has scale 0; codes = clamp(rint(x / scale), -127, 127).
// rq8:  q8 of y = H (s * x) / sqrt(D) (random +-1 signs s per (layer, KV
//       head, side), H the Walsh-Hadamard matrix; kv/rotation.hpp). Rows are
//       in the rotated basis: the decode kernel (q8's instance) rotates q
//       once per CTA before building its fragments (q.k = Rq . Rk) and the
//       merging CTA un-rotates o once (attention_decode.cu, q_signs/o_signs).
// turbo2/3/4 (TurboQuant-MSE, kv/blocks/turbo.cpp): y = H (s * x) / sqrt(D)
//       (the rq8 rotation), n = ||y|| (double, warp order), u = y *
//       float(sqrt(D) / n), code_i = nearest Lloyd-Max centroid index of u_i
//       (the number of thresholds t with u_i > t). code row: N-bit indices in
//       bit planes (kv/bitpack.hpp: LSB-first in little-endian 32-bit words,
//       field i of a b-bit plane at bits [b i, b i + b); N = 2: one 2-bit
//       plane; N = 4: one 4-bit plane; N = 3: a 2-bit plane of the low bits
//       (D/4 bytes) then a 1-bit plane of the high bits (D/8 bytes)). side
//       row: fp16 a = n * g, g = kv::unbiased_row_gain(u, c) (double
//       sums in warp order), clamped to 65504. Value (rotated basis) =
//       (a / sqrt(D)) * centroid[code].
// tcq2/3 (kv/blocks/tcq.cpp, kv/tcq.hpp): the turbo rotation and u; a
//       32-state (memory 5) Viterbi over the 2^(N+1) union levels (index
//       4 m + subset), start state 0, free end; ties keep branch 0, the
//       first minimum level per subset, the first minimum final state. code
//       row: the branch plane (1 bit per value, D/8 bytes), then the level
//       plane ((N-1) bits per value). side row: fp16 a = n * g as turbo.
//       Value = (a / sqrt(D)) * levels[4 m_i + subset(w_i)], w_i = b_i |
//       b_{i-1} << 1 | ... | b_{i-5} << 5 (b_{<0} = 0), subset(w) =
//       2 parity(w & g1) + parity(w & g0).
// iso3/4, rotor3/4, planar3/4 (one "grouped" format, kv/blocks/grouped.cpp;
//       only the rotation differs: isoclinic 4-blocks, rotor 3-blocks, Givens
//       pairs, kv_rotation.cuh): per group g of 32 rotated values a fp16
//       scale s_g (from the group RMS, up to two least-squares refinements,
//       the lowest squared error kept; every group sum in double in warp
//       order over its 32 values; the codes chosen again against the
//       stored fp16 scale); code row: N-bit Lloyd-Max indices in turbo's
//       planes; side row: D/32 fp16 scales. Value = s_g * centroid[code].
// fp8:  code row = D OCP e4m3 bytes (value i at byte i; round to nearest
//       even, saturating to +-448; no NaN codes), no side row.
// +qjl (K sides, on any base): the base row, then in the base's rotated
//       basis r = R x - base reconstruction; the code row gets a 1-bit plane
//       of D sketch bits at GpuKvSide::qjl_code_offset (bit j = 1 when
//       sum_i S[j][i] r_i >= 0, summed in double in warp order), the side row the
//       fp16 ||r|| (|r|^2 in double, warp order) at qjl_side_offset.
//       Reconstruction (rotated basis) = base
//       + sqrt(pi/2)/D ||r|| S^T sign (kv/blocks/qjl.cpp).
//
// Bit-exactness: every encode below performs the CPU block's float and
// double operations in the CPU's order, each product and sum rounded on its
// own (__fmul_rn / __fadd_rn / __dmul_rn / __dadd_rn: nvcc would otherwise
// contract a * b + c into an FMA, the baseline x86-64 CPU build has none).
// Double sums over a row or a 32-value group are defined in "warp order" on
// both sides (kv::warp_order_sum, src/kv/warp_sum.hpp: per-lane sequential
// partials over element lane + 32 j, then an xor butterfly over the lanes;
// enc::warp_row_sum / warp_butterfly here), so the GPU writes the CPU's bytes.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/kv_rotation.cuh"
#include "backend/cuda/kv_store.hpp"
#include "backend/cuda/l2_prefetch.cuh"
#include "backend/cuda/ptx.cuh"
#include "core/half.hpp"
#include "kv/codebook.hpp"

namespace kvq::cuda {

template <kv::Family F>
inline constexpr bool kAlwaysFalse = false;

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float sanitize_kv(float x) {  // as kv::sanitize_value
  return x != x ? 0.0f : fminf(fmaxf(x, -65504.0f), 65504.0f);
}

// One row of D values held by a warp as kNJ = D / 32 registers per lane:
// fn(std::integral_constant<int, kNJ>) for the row sizes an encoder serves
// (Walsh-Hadamard families: D = 64, 128, 256; the others: any multiple of 32
// up to 256); another D traps (the callers check kv_encode_supported first).
enum WarpRowSizes { kWarpRowPow2, kWarpRowAny };
template <WarpRowSizes kSizes, class Fn>
__device__ __forceinline__ void with_warp_row(int D, Fn&& fn) {
  switch (D) {
    case 64: fn(std::integral_constant<int, 2>{}); return;
    case 128: fn(std::integral_constant<int, 4>{}); return;
    case 256: fn(std::integral_constant<int, 8>{}); return;
    default: break;
  }
  if constexpr (kSizes == kWarpRowAny) {
    switch (D) {
      case 32: fn(std::integral_constant<int, 1>{}); return;
      case 96: fn(std::integral_constant<int, 3>{}); return;
      case 160: fn(std::integral_constant<int, 5>{}); return;
      case 192: fn(std::integral_constant<int, 6>{}); return;
      case 224: fn(std::integral_constant<int, 7>{}); return;
      default: break;
    }
  }
  __trap();
}

namespace enc {

// kv::store_f16 (f32_to_f16_clamped) / kv::load_f16.
__device__ __forceinline__ uint16_t f16_clamped(float x) {
  if (!(x == x)) x = 0.0f;
  if (x > 65504.0f) x = 65504.0f;
  if (x < -65504.0f) x = -65504.0f;
  return ::kvq::f32_to_f16(x);
}
__device__ __forceinline__ void store_f16(uint8_t* p, float x) {
  const uint16_t h = f16_clamped(x);
  p[0] = uint8_t(h & 0xff);
  p[1] = uint8_t(h >> 8);
}
__device__ __forceinline__ float load_f16(const uint8_t* p) { return ::kvq::f16_to_f32(uint16_t(p[0] | (p[1] << 8))); }

// A Lloyd-Max codebook of 2^kBits levels held in registers (loaded once per
// row from GpuKvSide::codebook: the centroids, then the thresholds).
// index(x) = kv::nearest_index(thresholds, kLevels, x): that binary search
// returns the first i in [0, kLevels - 1) with !(x > t[i]), else kLevels - 1;
// the thresholds ascend, so x > t[i] holds for a prefix of i (for every
// finite x and +-inf; for NaN it never holds), and the answer is the number
// of thresholds below x: a branch-free count here, with the centroid of the
// index selected alongside (it moves from c[i] to c[i + 1] exactly when
// x > t[i]). NaN -> 0, -inf -> 0, +inf -> kLevels - 1, as the CPU.
template <int kBits>
struct RegCodebook {
  static constexpr int kLevels = 1 << kBits;
  float c[kLevels], t[kLevels - 1];
  __device__ __forceinline__ explicit RegCodebook(const float* codebook) {
#pragma unroll
    for (int i = 0; i < kLevels; ++i) c[i] = codebook[i];
#pragma unroll
    for (int i = 0; i + 1 < kLevels; ++i) t[i] = codebook[kLevels + i];
  }
  __device__ __forceinline__ unsigned index(float x, float& centroid) const {
    unsigned idx = 0;
    float cv = c[0];
#pragma unroll
    for (int i = 0; i + 1 < kLevels; ++i) {
      const bool above = x > t[i];
      idx += above ? 1u : 0u;
      cv = above ? c[i + 1] : cv;
    }
    centroid = cv;
    return idx;
  }
};

// ---- Warp-order double sums: kv::warp_order_sum (src/kv/warp_sum.hpp) ----
// The CPU defines every encoder sum over a row (or a 32-value group) in warp
// order: element i belongs to lane i % 32, slot i / 32; every lane sums its
// slots in slot order starting from +0.0; then p[l] = p[l] + p[l ^ k] for
// k = 16, 8, 4, 2, 1. A row held as load_rotated holds element lane + 32 j in
// register j of lane `lane`, so lane = i % 32 and j = i / 32: the lane's
// partial is 0.0 + t[0] + t[1] + ... + t[kNJ - 1] (lane_partial) and the
// butterfly below is the CPU's step 2 (IEEE addition is commutative, so both
// lanes of a pair get the same bits and every lane ends with the sum). A
// 32-value group g of such a row (elements [32 g, 32 g + 32)) is slot g of
// every lane: its sum is the butterfly of 0.0 + t[g].
__device__ __forceinline__ double warp_butterfly(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = __dadd_rn(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}
// N independent butterflies in lockstep (their shuffles and adds interleave).
template <int N>
__device__ __forceinline__ void warp_butterfly_many(double (&x)[N]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = __dadd_rn(x[i], __shfl_xor_sync(kFullMask, x[i], o));
}
__device__ __forceinline__ double sq(float v) { return __dmul_rn(double(v), double(v)); }
// The warp-order sum of a row: term(j) is this lane's term of element lane + 32 j.
template <int kNJ, class Term>
__device__ __forceinline__ double warp_row_sum(Term&& term) {
  double acc = 0.0;
#pragma unroll
  for (int j = 0; j < kNJ; ++j) acc = __dadd_rn(acc, term(j));
  return warp_butterfly(acc);
}

__device__ __forceinline__ size_t plane_bytes(int n, int b) { return (size_t(n) * b + 7) / 8 + 3 & ~size_t(3); }

// The kB-bit fields of elements 32 g + lane (one per lane) into 32-bit words
// g kB .. g kB + kB - 1 of a plane (kv::pack_plane's bit order: word w holds
// elements 32 g + w per .. + per - 1, per = 32 / kB, element t of them at
// bits t kB ..). A shuffle tree builds the words: after the step of span s,
// lane i holds the fields of elements i .. i + 2 s - 1 at their places, so
// lane w per ends with word w. log2(per) shuffles; the bit-by-bit gather from
// kB ballots it replaces cost ~130 instructions per group, a third of a
// 3-bit row's encode in the append (ncu, docs/perf.md session 8).
template <int kB>
__device__ __forceinline__ void pack_group(unsigned field, uint8_t* plane, int g, int lane) {
  static_assert(kB == 1 || kB == 2 || kB == 4 || kB == 8, "fields that tile a 32-bit word");
  constexpr int per = 32 / kB;  // fields per word
  uint32_t w;
  if constexpr (kB == 1) {
    w = __ballot_sync(kFullMask, field & 1u);
  } else {
    w = field & ((1u << kB) - 1u);
#pragma unroll
    for (int span = 1; span < per; span <<= 1) w |= __shfl_down_sync(kFullMask, w, span) << (span * kB);
  }
  if (lane % per == 0) reinterpret_cast<uint32_t*>(plane)[g * kB + lane / per] = w;
}
// kv::pack_codes for one group of 32 (N = 1..4; N = 3: 2-bit low plane, then
// the 1-bit high plane).
template <int kBits>
__device__ __forceinline__ void pack_codes_group(unsigned idx, uint8_t* code, int D, int g, int lane) {
  static_assert(kBits >= 1 && kBits <= 4, "codes of 1..4 bits");
  if constexpr (kBits == 3) {
    pack_group<2>(idx & 3u, code, g, lane);
    pack_group<1>(idx >> 2, code + plane_bytes(D, 2), g, lane);
  } else {
    pack_group<kBits>(idx, code, g, lane);
  }
}
__device__ __forceinline__ unsigned plane_get(const uint8_t* plane, int i, int b) {
  const size_t bit = size_t(i) * b;
  return (plane[bit >> 3] >> (bit & 7)) & ((1u << b) - 1u);
}
__device__ __forceinline__ unsigned code_get(const uint8_t* code, int D, int bits, int i) {
  if (bits != 3) return plane_get(code, i, bits);
  return plane_get(code, i, 2) | (plane_get(code + plane_bytes(D, 2), i, 1) << 2);
}

// v[j] = element lane + 32 j of R sanitize(x) (the block's sanitized_rotate).
template <int kNJ>
__device__ __forceinline__ void load_rotated(const GpuKvSide& s, int head, const float* x, int lane, float (&v)[kNJ]) {
  warp_rotate_regs<kNJ>(rotation_kind(s.family), s.rot_of(head), lane, false,
                        [x](int i) { return sanitize_kv(x[i]); }, v);
}

// kv::unbiased_row_gain(u, c, D, kGainMaxExcess), u and c held as load_rotated;
// <u,c>, |c|^2 and |u|^2 in warp order (lane partials, three butterflies in lockstep).
template <int kNJ>
__device__ __forceinline__ double unbiased_row_gain(const float (&u)[kNJ], const float (&c)[kNJ]) {
  double sums[3] = {0.0, 0.0, 0.0};  // uc, cc, uu
#pragma unroll
  for (int j = 0; j < kNJ; ++j) {
    sums[0] = __dadd_rn(sums[0], __dmul_rn(double(u[j]), double(c[j])));
    sums[1] = __dadd_rn(sums[1], sq(c[j]));
    sums[2] = __dadd_rn(sums[2], sq(u[j]));
  }
  warp_butterfly_many(sums);
  const double uc = sums[0], cc = sums[1], uu = sums[2];
  const double d = double(32 * kNJ);
  if (!(cc > 0) || !(uc > 0)) return cc > 0 ? __ddiv_rn(uc < 0.0 ? 0.0 : uc, cc) : 0.0;
  const double g_ls = __ddiv_rn(uc, cc);
  const double res = __dsub_rn(uu, __dmul_rn(uc, g_ls));
  const double e_ls = __ddiv_rn(res < 0.0 ? 0.0 : res, d);
  const double g_u = __ddiv_rn(uu, uc);
  const double other = __dadd_rn(g_ls, __dsqrt_rn(__ddiv_rn(__dmul_rn(__dmul_rn(kv::kGainMaxExcess, e_ls), d), cc)));
  return other < g_u ? other : g_u;
}

// turbo / tcq: n = ||y|| and y *= float(sqrt(D) / n) (the unit-variance row).
template <int kNJ>
__device__ __forceinline__ double to_unit_row(float (&v)[kNJ]) {
  const double nn = warp_row_sum<kNJ>([&](int j) { return sq(v[j]); });  // warp order
  const double n = __dsqrt_rn(nn);
  const float to_unit = n > 0 ? float(__ddiv_rn(__dsqrt_rn(double(32 * kNJ)), n)) : 0.0f;
#pragma unroll
  for (int j = 0; j < kNJ; ++j) v[j] = __fmul_rn(v[j], to_unit);
  return n;
}

// kv OCP e4m3 (fp8.cpp): exact values of the magnitude codes 0..0x7e.
__device__ __forceinline__ float e4m3_magnitude(int m) {
  const int exp = (m >> 3) & 15, man = m & 7;
  return exp == 0 ? ldexpf(float(man), -9) : ldexpf(__fadd_rn(1.0f, __fdiv_rn(float(man), 8.0f)), exp - 7);
}
__device__ __forceinline__ float e4m3_to_f32(uint8_t b) {
  const float v = e4m3_magnitude(b & 0x7f);
  return (b & 0x80) ? -v : v;
}
// kv::f32_to_e4m3 (nearest, ties to the even code, magnitudes clamped to 448,
// the sign kept on zero) is what the hardware conversion with saturation
// does: cvt.rn.satfinite.e4m3x2.f32 (one instruction instead of a binary
// search over computed magnitudes; x is sanitised, never NaN).
__device__ __forceinline__ uint8_t f32_to_e4m3(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ int tcq_subset(uint32_t w, uint32_t g0, uint32_t g1) {
  return 2 * (__popc(w & g1) & 1) + (__popc(w & g0) & 1);
}
// kv::tcq_encode's inner search: the first level m of subset j nearest to x
// (squared error in float, strict <, m ascending), over levels held in
// registers (j a compile-time index after unrolling); its error and level.
template <int kPerSubset>
__device__ __forceinline__ int tcq_best_level(const float (&levels)[4 * kPerSubset], int j, float x, float& err,
                                              float& level) {
  float be = __int_as_float(0x7f800000), bl = levels[j];
  int bm = 0;
#pragma unroll
  for (int m = 0; m < kPerSubset; ++m) {
    const float d = __fsub_rn(x, levels[4 * m + j]);
    const float dd = __fmul_rn(d, d);
    if (dd < be) be = dd, bm = m, bl = levels[4 * m + j];
  }
  err = be;
  level = bl;
  return bm;
}
// The same search for a subset k known only at run time (after the
// traceback): the candidate levels picked by selects (the same floats, the
// same order), not a dynamically indexed register array.
template <int kPerSubset>
__device__ __forceinline__ int tcq_best_level_at(const float (&levels)[4 * kPerSubset], int k, float x, float& level) {
  float be = __int_as_float(0x7f800000), bl = 0.0f;
  int bm = 0;
#pragma unroll
  for (int m = 0; m < kPerSubset; ++m) {
    const float lm = k == 0 ? levels[4 * m] : k == 1 ? levels[4 * m + 1] : k == 2 ? levels[4 * m + 2] : levels[4 * m + 3];
    if (m == 0) bl = lm;
    const float d = __fsub_rn(x, lm);
    const float dd = __fmul_rn(d, d);
    if (dd < be) be = dd, bm = m, bl = lm;
  }
  level = bl;
  return bm;
}

}  // namespace enc

// ---------------------------------------------------------------------------
// Encode / scalar decode. Every family:
//   encode_row(side, head, x, D, code, side_row, lane): the whole warp
//     encodes row x (D floats, any memory every lane may read) into the
//     row's code / side bytes (the +qjl sketch is added by encode_row_any /
//     encode_row_with, not here).
//   decode_value(side, code, side_row, D, d): value d of the row in the
//     block's rotated basis (the base block only; +qjl adds its sketch).
// ---------------------------------------------------------------------------
template <kv::Family F>
struct EncodeHooks {
  static_assert(kAlwaysFalse<F>, "no GPU encode hooks for this KV block family (add them in kv_codec_hooks.cuh)");
};

template <>
struct EncodeHooks<kv::Family::bf16> {
  __device__ static void encode_row(const GpuKvSide&, int, const float* x, int D, uint8_t* code, uint8_t*, int lane) {
    auto* c = reinterpret_cast<uint16_t*>(code);
    for (int d = lane; d < D; d += 32) c[d] = ::kvq::f32_to_bf16(sanitize_kv(x[d]));
  }
  __device__ static float decode_value(const GpuKvSide&, const uint8_t* code, const uint8_t*, int, int d) {
    return ::kvq::bf16_to_f32(reinterpret_cast<const uint16_t*>(code)[d]);
  }
};

// One 32-value q8 group held one value per lane (value v of dim 32g + lane):
// the CPU block's float operations (IEEE division, round-to-nearest-even), so
// the codes and the scale are bit-identical.
__device__ __forceinline__ void q8_encode_group(float v, int g, uint8_t* code, uint8_t* side, int lane) {
  float amax = fabsf(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
  const uint16_t h = ::kvq::f32_to_f16(__fdiv_rn(amax, 127.0f));  // amax <= 65504 (sanitised): never clamped
  const float s = ::kvq::f16_to_f32(h);
  const float inv = s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
  reinterpret_cast<int8_t*>(code)[32 * g + lane] = int8_t(fminf(fmaxf(rintf(__fmul_rn(v, inv)), -127.0f), 127.0f));
  if (lane == 0) {
    side[2 * g] = uint8_t(h & 0xff);
    side[2 * g + 1] = uint8_t(h >> 8);
  }
}

template <>
struct EncodeHooks<kv::Family::q8> {
  // D a multiple of 32: group g is dims 32g + lane.
  __device__ static void encode_row(const GpuKvSide&, int, const float* x, int D, uint8_t* code, uint8_t* side,
                                    int lane) {
    for (int g = 0; g < D / 32; ++g) q8_encode_group(sanitize_kv(x[32 * g + lane]), g, code, side, lane);
  }
  __device__ static float decode_value(const GpuKvSide&, const uint8_t* code, const uint8_t* side, int, int d) {
    const int g = d >> 5;
    return __fmul_rn(enc::load_f16(side + 2 * g), float(reinterpret_cast<const int8_t*>(code)[d]));
  }
};

// rq8: q8 of the row after the random-sign Walsh-Hadamard rotation (D = 64,
// 128 or 256). Layout as q8; the rows are in the rotated basis.
template <>
struct EncodeHooks<kv::Family::rq8> {
  template <int kNJ>
  __device__ static void encode_t(const GpuKvSide& s, int head, const float* x, uint8_t* code, uint8_t* side,
                                  int lane) {
    float v[kNJ];
    enc::load_rotated<kNJ>(s, head, x, lane, v);
#pragma unroll
    for (int j = 0; j < kNJ; ++j) q8_encode_group(v[j], j, code, side, lane);
  }
  __device__ static void encode_row(const GpuKvSide& s, int head, const float* x, int D, uint8_t* code,
                                    uint8_t* side, int lane) {
    with_warp_row<kWarpRowPow2>(D, [&](auto nj) { encode_t<decltype(nj)::value>(s, head, x, code, side, lane); });
  }
  __device__ static float decode_value(const GpuKvSide& s, const uint8_t* code, const uint8_t* side, int D, int d) {
    return EncodeHooks<kv::Family::q8>::decode_value(s, code, side, D, d);
  }
};

template <>
struct EncodeHooks<kv::Family::turbo> {
  template <int kNJ>
  __device__ static void encode_t(const GpuKvSide& s, int head, const float* x, uint8_t* code, uint8_t* side,
                                  int lane) {
    switch (s.bits) {
      case 2: encode_bits<kNJ, 2>(s, head, x, code, side, lane); break;
      case 3: encode_bits<kNJ, 3>(s, head, x, code, side, lane); break;
      case 4: encode_bits<kNJ, 4>(s, head, x, code, side, lane); break;
      default: __trap();
    }
  }
  template <int kNJ, int kBits>
  __device__ static void encode_bits(const GpuKvSide& s, int head, const float* x, uint8_t* code, uint8_t* side,
                                     int lane) {
    constexpr int D = 32 * kNJ;
    float v[kNJ];
    enc::load_rotated<kNJ>(s, head, x, lane, v);
    const double n = enc::to_unit_row<kNJ>(v);
    const enc::RegCodebook<kBits> cb(s.codebook);
    float c[kNJ];
    unsigned idx[kNJ];
#pragma unroll
    for (int j = 0; j < kNJ; ++j) idx[j] = cb.index(v[j], c[j]);
    const double g = enc::unbiased_row_gain<kNJ>(v, c);
#pragma unroll
    for (int j = 0; j < kNJ; ++j) enc::pack_codes_group<kBits>(idx[j], code, D, j, lane);
    if (lane == 0) enc::store_f16(side, float(__dmul_rn(n, g)));
  }
  __device__ static void encode_row(const GpuKvSide& s, int head, const float* x, int D, uint8_t* code,
                                    uint8_t* side, int lane) {
    with_warp_row<kWarpRowPow2>(D, [&](auto nj) { encode_t<decltype(nj)::value>(s, head, x, code, side, lane); });
  }
  __device__ static float decode_value(const GpuKvSide& s, const uint8_t* code, const uint8_t* side, int D, int d) {
    const float a = __fdiv_rn(enc::load_f16(side), __fsqrt_rn(float(D)));
    return __fmul_rn(a, s.codebook[enc::code_get(code, D, s.bits, d)]);
  }
};

template <>
struct EncodeHooks<kv::Family::tcq> {
  // kv::tcq_encode on one warp, lane = state (32 states, memory 5); row
  // element / position i = 32 j + l is v[j] of lane l (load_rotated). The
  // union levels (kBits 2 or 3: 8 or 16) are held in registers.
  //  1. Branch errors, before the trellis (they do not depend on the costs):
  //     lane l forms E_k = min_m (x_i - levels[4 m + k])^2 of its own values
  //     for the 4 subsets k. State s's two branches use the subsets
  //     sub0 = subset(s) and sub1 = subset(s | 32) = sub0 ^ 2 (bit 5 is in g1,
  //     not in g0: checked), i.e. E_f and E_{f+2} of its family f = sub0 & 1.
  //     One xor-16 exchange per pair of errors stores them so that one
  //     shuffle fetches a lane's own family: for position 32 j + 16 h + m,
  //     lane 16 f + m holds E_f in A[h][j] and E_{f+2} in B[h][j].
  //  2. Forward: per position two error shuffles (off the cost chain), the
  //     two predecessors' costs by shuffle, the CPU's float adds, c1 < c0
  //     (ties keep branch 0); the choice bits of position 32 j + l are a
  //     ballot kept by lane l in bp[j].
  //  3. Traceback (state S_i after position i: bit 0 = b_i ... bit 4 =
  //     b_{i-4}; S_{i-1} = (S_i >> 1) | (bit S_i of bp[i]) << 4, and that bit
  //     is b_{i-5}). Every lane follows all kNJ chunks of 32 positions at
  //     once, lane s starting from S_{32 j + 31} = s: it records the chunk's
  //     branch bits W[j] (bit l = b_{32 j + l}) and the state F[j] = S_{32 j - 1}
  //     it ends in. The final state (first minimum cost: an xor-butterfly
  //     argmin, ties to the lower state) then selects, chunk by chunk from
  //     the last, W[j] and the next chunk's exit state: kNJ dependent shuffles.
  //  4. Each lane codes its own positions from the branch bits: the window
  //     w_i = b_i | b_{i-1} << 1 | ... | b_{i-5} << 5 (b_{<0} = 0: the
  //     survivor path starts in state 0), subset k = subset(w_i), the level
  //     m_i = the first nearest level of subset k (kv::tcq_encode's best_m),
  //     the value levels[4 m_i + k] (kv::tcq_decode's).
  template <int kNJ>
  __device__ static void encode_t(const GpuKvSide& s, int head, const float* x, uint8_t* code, uint8_t* side,
                                  int lane) {
    if (s.bits == 2) encode_bits<kNJ, 2>(s, head, x, code, side, lane);
    else encode_bits<kNJ, 3>(s, head, x, code, side, lane);
  }
  template <int kNJ, int kBits>
  __device__ static void encode_bits(const GpuKvSide& s, int head, const float* x, uint8_t* code, uint8_t* side,
                                     int lane) {
    constexpr int D = 32 * kNJ;
    constexpr int kPer = 1 << (kBits - 1);  // levels per subset
    float L[4 * kPer];
#pragma unroll
    for (int i = 0; i < 4 * kPer; ++i) L[i] = s.codebook[i];
    const uint32_t g0 = s.tcq_g0, g1 = s.tcq_g1;
    if ((g0 & 32u) != 0u || (g1 & 32u) == 0u) __trap();  // step 1 needs subset(w | 32) = subset(w) ^ 2
    float v[kNJ];
    enc::load_rotated<kNJ>(s, head, x, lane, v);
    const double n = enc::to_unit_row<kNJ>(v);

    // 1. Branch errors. Lanes l < 16 keep E_0 / E_2 of their own position
    // (h = 0) and take E_0 / E_2 of position l + 16 (h = 1) from lane l ^ 16;
    // lanes l >= 16 keep E_1 / E_3 of their own (h = 1) and take E_1 / E_3 of
    // position l - 16 (h = 0) from lane l ^ 16.
    const bool lo = lane < 16;
    float A[2][kNJ], B[2][kNJ];
#pragma unroll
    for (int j = 0; j < kNJ; ++j) {
      float e[4], level;
#pragma unroll
      for (int k = 0; k < 4; ++k) enc::tcq_best_level<kPer>(L, k, v[j], e[k], level);
      const float ra = __shfl_xor_sync(kFullMask, lo ? e[1] : e[0], 16);
      const float rb = __shfl_xor_sync(kFullMask, lo ? e[3] : e[2], 16);
      A[0][j] = lo ? e[0] : ra;
      A[1][j] = lo ? ra : e[1];
      B[0][j] = lo ? e[2] : rb;
      B[1][j] = lo ? rb : e[3];
    }

    // 2. Forward. State s2 = lane; predecessors p0 = s2 >> 1 (window s2,
    // subset sub0) and p1 = p0 | 16 (window s2 | 32, subset sub0 ^ 2).
    const int sub0 = enc::tcq_subset(uint32_t(lane), g0, g1);
    const int fam_lanes = (sub0 & 1) << 4;  // lanes 16 f .. 16 f + 15 hold family f's errors
    const bool swap = (sub0 & 2) != 0;      // sub0 = f + 2: c0 takes E_{f+2}, c1 E_f
    const int p0 = lane >> 1, p1 = p0 | 16;
    float cur = lane == 0 ? 0.0f : __int_as_float(0x7f800000);
    uint32_t bp[kNJ];
#pragma unroll
    for (int j = 0; j < kNJ; ++j) {
      bp[j] = 0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll 4
        for (int m = 0; m < 16; ++m) {
          const float ef = __shfl_sync(kFullMask, A[h][j], fam_lanes | m);
          const float eg = __shfl_sync(kFullMask, B[h][j], fam_lanes | m);
          const float c0 = __fadd_rn(__shfl_sync(kFullMask, cur, p0), swap ? eg : ef);
          const float c1 = __fadd_rn(__shfl_sync(kFullMask, cur, p1), swap ? ef : eg);
          const bool one = c1 < c0;
          const uint32_t ball = __ballot_sync(kFullMask, one);
          if (lane == 16 * h + m) bp[j] = ball;
          cur = one ? c1 : c0;
        }
      }
    }

    // 3. Traceback, every chunk from every exit state at once.
    uint32_t W[kNJ];
    int F[kNJ];
#pragma unroll
    for (int j = 0; j < kNJ; ++j) W[j] = 0, F[j] = lane;
#pragma unroll 4
    for (int l = 31; l >= 0; --l)
#pragma unroll
      for (int j = 0; j < kNJ; ++j) {
        const uint32_t ball = __shfl_sync(kFullMask, bp[j], l);
        W[j] |= uint32_t(F[j] & 1) << l;
        F[j] = (F[j] >> 1) | int((ball >> F[j]) & 1u) << 4;
      }
    // The final state: kv::tcq_encode's first minimum (costs are never NaN:
    // finite levels and rows, and +inf only before every state is reached).
    float best = cur;
    int st = lane;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float oc = __shfl_xor_sync(kFullMask, best, o);
      const int os = __shfl_xor_sync(kFullMask, st, o);
      if (oc < best || (oc == best && os < st)) best = oc, st = os;
    }
    uint32_t Wb[kNJ];  // the branch plane: bit l of word j = b_{32 j + l} (uniform)
#pragma unroll
    for (int j = kNJ - 1; j >= 0; --j) {
      Wb[j] = __shfl_sync(kFullMask, W[j], st);
      if (j > 0) st = __shfl_sync(kFullMask, F[j], st);
    }

    // 4. Levels and values of this lane's positions i = 32 j + lane: window
    // bit t = b_{i-t} is bit 32 + lane - t of Wb[j]:Wb[j-1], i.e. bit
    // 31 - lane + t of its bit reversal.
    // The levels again from memory (L is dead through steps 2-3: fewer registers).
#pragma unroll
    for (int i = 0; i < 4 * kPer; ++i) L[i] = s.codebook[i];
    unsigned lv[kNJ];
    float cval[kNJ];
    uint32_t prev = 0;  // Wb[j - 1]; 0 before the row
#pragma unroll
    for (int j = 0; j < kNJ; ++j) {
      const uint64_t both = (uint64_t(Wb[j]) << 32) | prev;
      const uint32_t w = uint32_t(__brevll(both) >> (31 - lane)) & 63u;
      lv[j] = unsigned(enc::tcq_best_level_at<kPer>(L, enc::tcq_subset(w, g0, g1), v[j], cval[j]));
      prev = Wb[j];
    }
    const double g = enc::unbiased_row_gain<kNJ>(v, cval);
    uint8_t* level_plane = code + enc::plane_bytes(D, 1);
#pragma unroll
    for (int j = 0; j < kNJ; ++j) {
      if (lane == j) reinterpret_cast<uint32_t*>(code)[j] = Wb[j];  // kv::pack_plane's word j of the branch plane
      enc::pack_group<kBits - 1>(lv[j], level_plane, j, lane);
    }
    if (lane == 0) enc::store_f16(side, float(__dmul_rn(n, g)));
  }
  __device__ static void encode_row(const GpuKvSide& s, int head, const float* x, int D, uint8_t* code,
                                    uint8_t* side, int lane) {
    with_warp_row<kWarpRowPow2>(D, [&](auto nj) { encode_t<decltype(nj)::value>(s, head, x, code, side, lane); });
  }
  __device__ static float decode_value(const GpuKvSide& s, const uint8_t* code, const uint8_t* side, int D, int d) {
    const float a = __fdiv_rn(enc::load_f16(side), __fsqrt_rn(float(D)));
    uint32_t w = 0;
    for (int k = 0; k < 6 && d - k >= 0; ++k) w |= enc::plane_get(code, d - k, 1) << k;
    const unsigned m = enc::plane_get(code + enc::plane_bytes(D, 1), d, s.bits - 1);
    return __fmul_rn(a, s.codebook[4 * m + unsigned(enc::tcq_subset(w, s.tcq_g0, s.tcq_g1))]);
  }
};

// iso / rotor / planar: the grouped format (one implementation; the rotation
// comes from rotation_kind(family)). D a multiple of 32, at most 256.
struct GroupedEncode {
  // kv GroupedBlock::fit's code (and its centroid c) for the value y of this lane at scale sc.
  template <int kBits>
  __device__ static unsigned code_of(const enc::RegCodebook<kBits>& cb, float y, float sc, float& c) {
    const float inv = sc > 0 ? __fdiv_rn(1.0f, sc) : 0.0f;
    return cb.index(__fmul_rn(y, inv), c);
  }
  // The groups' scale searches run in lockstep: every sum is the warp-order
  // sum over its group's 32 elements (group g is slot g of every lane: the
  // butterfly of 0.0 + term, as kv GroupedBlock's warp_order_sum with one
  // term per lane), and the kNJ groups' butterflies (and err, yc, cc of one
  // fit) interleave, which keeps the latency of this one-warp-per-row encode
  // (it sits on the decode step's critical path) at one group's.
  template <int kNJ>
  __device__ static void encode_t(const GpuKvSide& s, int head, const float* x, uint8_t* code, uint8_t* side,
                                  int lane) {
    if (s.bits == 3) encode_bits<kNJ, 3>(s, head, x, code, side, lane);
    else if (s.bits == 4) encode_bits<kNJ, 4>(s, head, x, code, side, lane);
    else __trap();  // the grouped blocks are iso3/4, rotor3/4, planar3/4
  }
  template <int kNJ, int kBits>
  __device__ static void encode_bits(const GpuKvSide& s, int head, const float* x, uint8_t* code, uint8_t* side,
                                     int lane) {
    constexpr int D = 32 * kNJ;
    float v[kNJ];
    enc::load_rotated<kNJ>(s, head, x, lane, v);
    double e[kNJ];
#pragma unroll
    for (int g = 0; g < kNJ; ++g) e[g] = __dadd_rn(0.0, enc::sq(v[g]));
    enc::warp_butterfly_many(e);
    const enc::RegCodebook<kBits> cb(s.codebook);
    // Per group (kv GroupedBlock::encode): s starts at the group RMS, then up
    // to two least-squares steps s = <y,c>/<c,c>, keeping the best; a group
    // stops at cc <= 0; an all-zero group stores 0.
    float sc[kNJ], best_s[kNJ];
    double best_err[kNJ];
    bool active[kNJ];
#pragma unroll
    for (int g = 0; g < kNJ; ++g) {
      active[g] = e[g] > 0;
      best_s[g] = 0.0f;
      best_err[g] = __longlong_as_double(0x7ff0000000000000ll);
      sc[g] = active[g] ? float(__dsqrt_rn(__ddiv_rn(e[g], 32.0))) : 0.0f;
    }
    for (int step = 0; step < 3; ++step) {
      double sums[3 * kNJ];  // err, yc, cc of every group: this lane's partial (0.0 + its one term), then the butterfly
#pragma unroll
      for (int g = 0; g < kNJ; ++g) {
        float cf;
        code_of(cb, v[g], sc[g], cf);
        const double c = double(cf);
        const double d = __dsub_rn(double(v[g]), __dmul_rn(double(sc[g]), c));
        sums[3 * g] = __dadd_rn(0.0, __dmul_rn(d, d));
        sums[3 * g + 1] = __dadd_rn(0.0, __dmul_rn(double(v[g]), c));
        sums[3 * g + 2] = __dadd_rn(0.0, __dmul_rn(c, c));
      }
      enc::warp_butterfly_many(sums);
#pragma unroll
      for (int g = 0; g < kNJ; ++g) {
        if (!active[g]) continue;
        const double err = sums[3 * g], yc = sums[3 * g + 1], cc = sums[3 * g + 2];
        if (err < best_err[g]) best_err[g] = err, best_s[g] = sc[g];
        if (cc <= 0) active[g] = false;
        else sc[g] = float(__ddiv_rn(yc, cc));
      }
    }
#pragma unroll
    for (int g = 0; g < kNJ; ++g) {
      if (lane == 0) enc::store_f16(side + 2 * g, best_s[g]);
      const float stored = ::kvq::f16_to_f32(enc::f16_clamped(best_s[g]));  // codes against the stored scale
      float cf;
      enc::pack_codes_group<kBits>(code_of(cb, v[g], stored, cf), code, D, g, lane);
    }
  }
  __device__ static void encode_row(const GpuKvSide& s, int head, const float* x, int D, uint8_t* code,
                                    uint8_t* side, int lane) {
    with_warp_row<kWarpRowAny>(D, [&](auto nj) { encode_t<decltype(nj)::value>(s, head, x, code, side, lane); });
  }
  __device__ static float decode_value(const GpuKvSide& s, const uint8_t* code, const uint8_t* side, int D, int d) {
    return __fmul_rn(enc::load_f16(side + 2 * (d >> 5)), s.codebook[enc::code_get(code, D, s.bits, d)]);
  }
};
template <>
struct EncodeHooks<kv::Family::iso> : GroupedEncode {};
template <>
struct EncodeHooks<kv::Family::rotor> : GroupedEncode {};
template <>
struct EncodeHooks<kv::Family::planar> : GroupedEncode {};

template <>
struct EncodeHooks<kv::Family::fp8> {
  __device__ static void encode_row(const GpuKvSide&, int, const float* x, int D, uint8_t* code, uint8_t*, int lane) {
    for (int d = lane; d < D; d += 32) code[d] = enc::f32_to_e4m3(sanitize_kv(x[d]));
  }
  __device__ static float decode_value(const GpuKvSide&, const uint8_t* code, const uint8_t*, int, int d) {
    return enc::e4m3_to_f32(code[d]);
  }
};

// ---------------------------------------------------------------------------
// Runtime dispatch for kernels that serve several families in one instance
// (the fused RoPE + store, the prefill dequantization). The caller checked
// kv_encode_supported(); another family or head_dim traps.
// ---------------------------------------------------------------------------

// Families that have encode hooks (kv_encode_supported() answers from this).
__host__ __device__ constexpr bool has_encode_hooks(kv::Family f) {
  return f == kv::Family::bf16 || f == kv::Family::q8 || f == kv::Family::rq8 || f == kv::Family::turbo ||
         f == kv::Family::tcq || f == kv::Family::iso || f == kv::Family::rotor || f == kv::Family::planar ||
         f == kv::Family::fp8;
}

// Value d of a base row in the block's rotated basis (bit-identical to the
// CPU block's decode_rotated).
__device__ __forceinline__ float decode_value_any(const GpuKvSide& s, const uint8_t* code, const uint8_t* side, int D,
                                                  int d) {
  switch (s.family) {
    case kv::Family::bf16: return EncodeHooks<kv::Family::bf16>::decode_value(s, code, side, D, d);
    case kv::Family::q8:
    case kv::Family::rq8: return EncodeHooks<kv::Family::q8>::decode_value(s, code, side, D, d);
    case kv::Family::turbo: return EncodeHooks<kv::Family::turbo>::decode_value(s, code, side, D, d);
    case kv::Family::tcq: return EncodeHooks<kv::Family::tcq>::decode_value(s, code, side, D, d);
    case kv::Family::iso:
    case kv::Family::rotor:
    case kv::Family::planar: return GroupedEncode::decode_value(s, code, side, D, d);
    case kv::Family::fp8: return EncodeHooks<kv::Family::fp8>::decode_value(s, code, side, D, d);
    default: __trap();
  }
  return 0.0f;
}

// +qjl: the sketch of the residual of a row whose base code / side bytes this
// warp has just written (kv QjlBlock::encode after base_->encode); every
// projection is a warp-order sum over the row (all lanes, then the butterfly).
template <int kNJ>
__device__ void qjl_encode_t(const GpuKvSide& s, int head, const float* x, uint8_t* code, uint8_t* side, int lane) {
  constexpr int D = 32 * kNJ;
  __syncwarp();  // the base row's bytes, written by every lane, are visible to all
  float r[kNJ];
  enc::load_rotated<kNJ>(s, head, x, lane, r);
#pragma unroll
  for (int j = 0; j < kNJ; ++j) r[j] = __fsub_rn(r[j], decode_value_any(s, code, side, D, lane + 32 * j));
  const double rn = enc::warp_row_sum<kNJ>([&](int j) { return enc::sq(r[j]); });  // warp order, as QjlBlock
  // Projection j = sum_i S[j][i] r_i in warp order (kv QjlBlock::encode):
  // lane l's partial over i = l + 32 k, then the butterfly; the row of S is
  // read coalesced (consecutive lanes, consecutive i). Lane l keeps the sign
  // of projection 32 jj + l.
  const float* S = s.qjl + size_t(head) * D * D;
  unsigned bits[kNJ];
#pragma unroll
  for (int jj = 0; jj < kNJ; ++jj) {
    bits[jj] = 0;
#pragma unroll 8
    for (int l = 0; l < 32; ++l) {  // 8 projections' butterflies in flight at once
      const float* sj = S + size_t(32 * jj + l) * D;
      const double p = enc::warp_row_sum<kNJ>([&](int k) { return __dmul_rn(double(sj[lane + 32 * k]), double(r[k])); });
      if (lane == l) bits[jj] = p >= 0 ? 1u : 0u;
    }
  }
#pragma unroll
  for (int jj = 0; jj < kNJ; ++jj) enc::pack_group<1>(bits[jj], code + s.qjl_code_offset, jj, lane);
  if (lane == 0) enc::store_f16(side + s.qjl_side_offset, float(__dsqrt_rn(rn)));
}
__device__ __forceinline__ void qjl_encode(const GpuKvSide& s, int head, const float* x, int D, uint8_t* code,
                                           uint8_t* side, int lane) {
  with_warp_row<kWarpRowAny>(D, [&](auto nj) { qjl_encode_t<decltype(nj)::value>(s, head, x, code, side, lane); });
}

// The whole row of family F: the base encode, then the +qjl sketch if the
// side has one. head: the KV head (its rotation table and sketch).
template <kv::Family F>
__device__ __forceinline__ void encode_row_with(const GpuKvSide& s, int head, const float* x, int D, uint8_t* code,
                                                uint8_t* side, int lane) {
  EncodeHooks<F>::encode_row(s, head, x, D, code, side, lane);
  if (s.has_qjl) qjl_encode(s, head, x, D, code, side, lane);
}

// Asks L2 for the constants an encode of side s's rows of KV head `head`
// reads (rotation table, codebook, +qjl sketch): a hint (l2_prefetch.cuh),
// issued by one lane before the encoder's kernel waits for its predecessor.
__device__ __forceinline__ void prefetch_encode_constants(const GpuKvSide& s, int head, int D) {
  if (const float* t = s.rot_of(head)) prefetch_l2(t, uint64_t(s.rot_stride) * sizeof(float));
  if (s.codebook) {
    const int levels = s.family == kv::Family::tcq ? 2 << s.bits : (1 << s.bits) * 2 - 1;
    prefetch_l2(s.codebook, uint64_t(levels) * sizeof(float));
  }
  if (s.has_qjl) prefetch_l2(s.qjl + size_t(head) * D * D, uint64_t(D) * D * sizeof(float));
}

__device__ __forceinline__ void encode_row_any(const GpuKvSide& s, int head, const float* x, int D, uint8_t* code,
                                               uint8_t* side, int lane) {
  switch (s.family) {
    case kv::Family::bf16: EncodeHooks<kv::Family::bf16>::encode_row(s, head, x, D, code, side, lane); break;
    case kv::Family::q8: EncodeHooks<kv::Family::q8>::encode_row(s, head, x, D, code, side, lane); break;
    case kv::Family::rq8: EncodeHooks<kv::Family::rq8>::encode_row(s, head, x, D, code, side, lane); break;
    case kv::Family::turbo: EncodeHooks<kv::Family::turbo>::encode_row(s, head, x, D, code, side, lane); break;
    case kv::Family::tcq: EncodeHooks<kv::Family::tcq>::encode_row(s, head, x, D, code, side, lane); break;
    case kv::Family::iso:
    case kv::Family::rotor:
    case kv::Family::planar: GroupedEncode::encode_row(s, head, x, D, code, side, lane); break;
    case kv::Family::fp8: EncodeHooks<kv::Family::fp8>::encode_row(s, head, x, D, code, side, lane); break;
    default: __trap();
  }
  if (s.has_qjl) qjl_encode(s, head, x, D, code, side, lane);
}

// +qjl: value d of the full reconstruction in the rotated basis (kv
// QjlBlock::decode_rotated: base + sum_j (+-c) S[j][d], j ascending,
// c = float(sqrt(pi/2) / D) * ||r||). O(D) per value: prefill only.
__device__ __forceinline__ float qjl_decode_value(const GpuKvSide& s, int head, const uint8_t* code,
                                                  const uint8_t* side, int D, int d) {
  float y = decode_value_any(s, code, side, D, d);
  const float c = __fmul_rn(float(1.2533141373155002512 / D), enc::load_f16(side + s.qjl_side_offset));
  const uint8_t* bits = code + s.qjl_code_offset;
  const float* S = s.qjl + size_t(head) * D * D;
  for (int j = 0; j < D; ++j) {
    const float sj = enc::plane_get(bits, j, 1) ? c : -c;
    y = __fadd_rn(y, __fmul_rn(sj, S[size_t(j) * D + d]));
  }
  return y;
}

// +qjl: the sketch terms of kRows rows of one KV head together. y[r][k]
// holds value d = lane + 32 k (D = 32 kNJ) of row r's base reconstruction
// in the rotated basis, c[r] its float(sqrt(pi/2) / D) * ||r|| and
// bits[r][w] its sign bits j = 32 w .. 32 w + 31 (bit j of the plane at bit
// j - 32 w). Every value gets exactly qjl_decode_value's operations in its
// order (j ascending, a rounded product and a rounded sum per j); each j's
// S values (`S_head`: the head's D x D sketch) are loaded once for all the
// rows, and the kRows x kNJ chains of adds overlap.
template <int kNJ, int kRows>
__device__ __forceinline__ void qjl_add_sketch_rows(const float* S_head, int lane, const float (&c)[kRows],
                                                    const uint32_t (&bits)[kRows][kNJ], float (&y)[kRows][kNJ]) {
  constexpr int D = 32 * kNJ;
  const float* S = S_head + lane;
#pragma unroll
  for (int w = 0; w < kNJ; ++w) {
#pragma unroll 2
    for (int b = 0; b < 32; ++b) {
      const int j = 32 * w + b;
      float sv[kNJ];
#pragma unroll
      for (int k = 0; k < kNJ; ++k) sv[k] = S[size_t(j) * D + 32 * k];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float sj = ((bits[r][w] >> b) & 1u) ? c[r] : -c[r];
#pragma unroll
        for (int k = 0; k < kNJ; ++k) y[r][k] = __fadd_rn(y[r][k], __fmul_rn(sj, sv[k]));
      }
    }
  }
}

}  // namespace kvq::cuda
