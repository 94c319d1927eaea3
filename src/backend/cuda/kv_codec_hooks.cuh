// Device-side KV codec hooks: everything a GPU kernel knows about a block's
// packed format, one specialisation per block family. Kernels are templated
// over the hooks of their K and V sides, so adding a codec means adding its
// hooks here (and its instances to attention_instances.hpp), never editing
// the kernels. A family without hooks fails to compile where it is used
// (static_assert in the primary templates).
//
// Hooks per family F:
//   EncodeHooks<F>:           encode_row(): one warp encodes one row (the CPU
//                             block's encode, bit for bit where deterministic).
//                             decode_value(): one value of a row (prefill's
//                             dequantization of the prefix into bf16 tiles).
//   KDecodeHooks<F, D>:       the K side of the tensor-core decode kernel:
//                             how q is prepared (number and type of its exact
//                             parts, pre-scaling), how a 16-key tile is loaded
//                             into registers, and S = Q K^T of one tile.
//   VDecodeHooks<F, D>:       the V side: load a 16-key tile, o += P V, and
//                             where each accumulator lands in the output row.
// Fragment conventions (lane = 4 g + t, mma m16n8k16): attention_decode.cu.
// Rotations are hoisted out of the decode hooks: q is rotated once before the
// kernel and o un-rotated once after it (rq8 below; turbo, tcq, iso, rotor,
// planar to come); only encoding rotates, once per row.
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
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "backend/cuda/kv_store.hpp"
#include "backend/cuda/ptx.cuh"
#include "core/half.hpp"

namespace kvq::cuda {

template <kv::Family F>
inline constexpr bool kAlwaysFalse = false;

__device__ __forceinline__ float sanitize_kv(float x) {  // as kv::sanitize_value
  return x != x ? 0.0f : fminf(fmaxf(x, -65504.0f), 65504.0f);
}

// ---------------------------------------------------------------------------
// Encode / scalar decode
// ---------------------------------------------------------------------------
template <kv::Family F>
struct EncodeHooks {
  static_assert(kAlwaysFalse<F>, "no GPU encode hooks for this KV block family (add them in kv_codec_hooks.cuh)");
};

template <>
struct EncodeHooks<kv::Family::bf16> {
  // x: D floats (any memory); the whole warp calls it.
  __device__ static void encode_row(const float* x, int D, uint8_t* code, uint8_t* /*side*/, int lane,
                                    const float* /*rot*/ = nullptr) {
    auto* c = reinterpret_cast<uint16_t*>(code);
    for (int d = lane; d < D; d += 32) c[d] = ::kvq::f32_to_bf16(sanitize_kv(x[d]));
  }
  __device__ static float decode_value(const uint8_t* code, const uint8_t* /*side*/, int d) {
    return ::kvq::bf16_to_f32(reinterpret_cast<const uint16_t*>(code)[d]);
  }
};

// One 32-value q8 group held one value per lane (value v of dim 32g + lane):
// the CPU block's float operations (IEEE division, round-to-nearest-even), so
// the codes and the scale are bit-identical.
__device__ __forceinline__ void q8_encode_group(float v, int g, uint8_t* code, uint8_t* side, int lane) {
  float amax = fabsf(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const uint16_t h = ::kvq::f32_to_f16(amax / 127.0f);  // amax <= 65504 (sanitised): never clamped
  const float s = ::kvq::f16_to_f32(h);
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  reinterpret_cast<int8_t*>(code)[32 * g + lane] = int8_t(fminf(fmaxf(rintf(v * inv), -127.0f), 127.0f));
  if (lane == 0) {
    side[2 * g] = uint8_t(h & 0xff);
    side[2 * g + 1] = uint8_t(h >> 8);
  }
}

template <>
struct EncodeHooks<kv::Family::q8> {
  // D a multiple of 32: group g is dims 32g + lane.
  __device__ static void encode_row(const float* x, int D, uint8_t* code, uint8_t* side, int lane,
                                    const float* /*rot*/ = nullptr) {
    for (int g = 0; g < D / 32; ++g) q8_encode_group(sanitize_kv(x[32 * g + lane]), g, code, side, lane);
  }
  __device__ static float decode_value(const uint8_t* code, const uint8_t* side, int d) {
    const int g = d >> 5;
    const float s = ::kvq::f16_to_f32(uint16_t(side[2 * g] | (side[2 * g + 1] << 8)));
    return s * float(reinterpret_cast<const int8_t*>(code)[d]);
  }
};

// The normalised Walsh-Hadamard transform of a row held by one warp, value j
// of a lane = element lane + 32 j (kNJ = D / 32): the stages of
// kv::fwht_normalized in its order (h = 1, 2, 4, ...; lower element a + b,
// upper a - b) and its final scale 1/sqrt(D), so results are bit-identical to
// the CPU rotation. Stages h < 32 pair lanes, the others pair a lane's values.
template <int kNJ>
__device__ __forceinline__ void warp_fwht_normalized(float (&v)[kNJ], int lane) {
#pragma unroll
  for (int h = 1; h < 32; h <<= 1)
#pragma unroll
    for (int j = 0; j < kNJ; ++j) {
      const float other = __shfl_xor_sync(0xffffffffu, v[j], h);
      v[j] = (lane & h) ? other - v[j] : v[j] + other;
    }
#pragma unroll
  for (int hj = 1; hj < kNJ; hj <<= 1)
#pragma unroll
    for (int j = 0; j < kNJ; ++j)
      if ((j & hj) == 0) {
        const float a = v[j], b = v[j + hj];
        v[j] = a + b;
        v[j + hj] = a - b;
      }
  const float s = 1.0f / sqrtf(float(32 * kNJ));
#pragma unroll
  for (int j = 0; j < kNJ; ++j) v[j] *= s;
}

// y = R x (forward: signs, then the transform) or x = R^T y (inverse: the
// transform, then signs) of one warp-held row, as kv::HadamardRotation.
template <int kNJ>
__device__ __forceinline__ void warp_hadamard(float (&v)[kNJ], const float* signs, int lane, bool inverse) {
  if (!inverse) {
#pragma unroll
    for (int j = 0; j < kNJ; ++j) v[j] *= signs[lane + 32 * j];
  }
  warp_fwht_normalized<kNJ>(v, lane);
  if (inverse) {
#pragma unroll
    for (int j = 0; j < kNJ; ++j) v[j] *= signs[lane + 32 * j];
  }
}

// rq8: q8 of the row after the random-sign Walsh-Hadamard rotation (D = 64,
// 128 or 256). Layout as q8; the rows are in the rotated basis.
template <>
struct EncodeHooks<kv::Family::rq8> {
  template <int kNJ>
  __device__ static void encode_rotated(const float* x, uint8_t* code, uint8_t* side, int lane, const float* rot) {
    float v[kNJ];
#pragma unroll
    for (int j = 0; j < kNJ; ++j) v[j] = sanitize_kv(x[lane + 32 * j]);
    warp_hadamard<kNJ>(v, rot, lane, false);
#pragma unroll
    for (int j = 0; j < kNJ; ++j) q8_encode_group(v[j], j, code, side, lane);
  }
  __device__ static void encode_row(const float* x, int D, uint8_t* code, uint8_t* side, int lane, const float* rot) {
    switch (D) {
      case 64: encode_rotated<2>(x, code, side, lane, rot); break;
      case 128: encode_rotated<4>(x, code, side, lane, rot); break;
      case 256: encode_rotated<8>(x, code, side, lane, rot); break;
      default: __trap();
    }
  }
  // The rotated-basis value (prefill dequantization un-rotates whole rows).
  __device__ static float decode_value(const uint8_t* code, const uint8_t* side, int d) {
    return EncodeHooks<kv::Family::q8>::decode_value(code, side, d);
  }
};

}  // namespace kvq::cuda

namespace kvq::cuda {

// Families that have encode hooks (kv_encode_supported() answers from this).
__host__ __device__ constexpr bool has_encode_hooks(kv::Family f) {
  return f == kv::Family::bf16 || f == kv::Family::q8 || f == kv::Family::rq8;
}


// Runtime dispatch for kernels that serve several families in one instance
// (the fused RoPE + store, the prefill dequantization). The caller checked
// has_encode_hooks(); another family traps.
// rot: the row's rotation table (GpuKvSide::rot + head * D) or null.
__device__ __forceinline__ void encode_row_any(kv::Family f, const float* x, int D, uint8_t* code, uint8_t* side,
                                               int lane, const float* rot) {
  switch (f) {
    case kv::Family::bf16: EncodeHooks<kv::Family::bf16>::encode_row(x, D, code, side, lane); break;
    case kv::Family::q8: EncodeHooks<kv::Family::q8>::encode_row(x, D, code, side, lane); break;
    case kv::Family::rq8: EncodeHooks<kv::Family::rq8>::encode_row(x, D, code, side, lane, rot); break;
    default: __trap();
  }
}
__device__ __forceinline__ float decode_value_any(kv::Family f, const uint8_t* code, const uint8_t* side, int d) {
  switch (f) {
    case kv::Family::bf16: return EncodeHooks<kv::Family::bf16>::decode_value(code, side, d);
    case kv::Family::q8:
    case kv::Family::rq8: return EncodeHooks<kv::Family::q8>::decode_value(code, side, d);
    default: __trap();
  }
  return 0.0f;
}

}  // namespace kvq::cuda
