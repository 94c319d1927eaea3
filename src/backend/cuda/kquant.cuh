// Device-side decoding of K-quant super-blocks (Q2_K..Q6_K) in the GPU layout
// (backend/gpu_layout.hpp: one record of codes per 256 weights, the trailing
// fp16 super-scales of Q2_K/Q3_K/Q6_K moved to `scales`). Each weight comes
// out exactly as the CPU reference computes it (gguf/quant.hpp):
// (d * sc) * q - (dmin * m) in fp32, so dequantized values are bit-identical.
// Used by the prefill dequantization and the embedding lookup (ops.cu). The
// decode GEMVs (gemv_kquant.cu, gemv_batch.cu) do not dequantize: they dot
// the codes of each run of 16 weights with an int8 input and apply the
// run's scale and min once (kquant_runs.cuh).
#pragma once

#include <cstdint>

#include "core/half.hpp"
#include "gguf/types.hpp"

namespace kvq::cuda::kq {

// Bytes of codes and fp16 scales per super-block record (gpu_kquant_record()).
__host__ __device__ constexpr int code_bytes(gguf::TensorType t) {
  return t == gguf::TensorType::Q2_K   ? 80
         : t == gguf::TensorType::Q3_K ? 112
         : t == gguf::TensorType::Q4_K ? 144
         : t == gguf::TensorType::Q5_K ? 176
                                       : 208;  // Q6_K
}
__host__ __device__ constexpr int scale_count(gguf::TensorType t) {
  return t == gguf::TensorType::Q2_K ? 2 : t == gguf::TensorType::Q4_K || t == gguf::TensorType::Q5_K ? 0 : 1;
}

__device__ __forceinline__ float f16_at(const uint8_t* p) { return f16_to_f32(uint16_t(p[0] | (p[1] << 8))); }

// 6-bit scale and min of sub-block s (0..7) from a Q4_K/Q5_K sm[12].
__device__ __forceinline__ void scale_min_k4(const uint8_t* sm, int s, int& sc, int& m) {
  if (s < 4) {
    sc = sm[s] & 63;
    m = sm[s + 4] & 63;
  } else {
    sc = (sm[s + 4] & 15) | ((sm[s - 4] >> 6) << 4);
    m = (sm[s + 4] >> 4) | ((sm[s] >> 6) << 4);
  }
}

// Q3_K: the 6-bit scale of sub-block k (0..15) minus 32.
__device__ __forceinline__ int scale_q3k(const uint8_t* sc12, int k) {
  const int low = k < 8 ? sc12[k] & 15 : sc12[k - 8] >> 4;
  return (low | (((sc12[8 + k % 4] >> (2 * (k / 4))) & 3) << 4)) - 32;
}

// Weight i (0..255) of the record at `c` with super-scales at `s`.
__device__ __forceinline__ float weight(gguf::TensorType t, const uint8_t* c, const uint16_t* s, int i) {
  switch (t) {
    case gguf::TensorType::Q4_K:
    case gguf::TensorType::Q5_K: {
      const int sb = i / 32, l = i % 32;
      const uint8_t* qs = c + (t == gguf::TensorType::Q4_K ? 16 : 48);
      const uint8_t byte = qs[32 * (i / 64) + l];
      int q = sb % 2 == 0 ? byte & 15 : byte >> 4;
      if (t == gguf::TensorType::Q5_K) q += 16 * ((c[16 + l] >> sb) & 1);
      int sc, m;
      scale_min_k4(c + 4, sb, sc, m);
      return f16_at(c) * float(sc) * float(q) - f16_at(c + 2) * float(m);
    }
    case gguf::TensorType::Q6_K: {
      const int h = i / 128, g = (i % 128) / 32, l = i % 32;
      const uint8_t lq = c[64 * h + 32 * (g % 2) + l];
      const int low = g < 2 ? lq & 15 : lq >> 4;
      const int high = (c[128 + 32 * h + l] >> (2 * g)) & 3;
      return f16_to_f32(s[0]) * float(int8_t(c[192 + i / 16])) * float((low | (high << 4)) - 32);
    }
    case gguf::TensorType::Q2_K: {
      const int n = i / 128, j = (i % 128) / 32, l = i % 32, k = i / 16;
      const int q = (c[16 + 32 * n + l] >> (2 * j)) & 3;
      return f16_to_f32(s[0]) * float(c[k] & 15) * float(q) - f16_to_f32(s[1]) * float(c[k] >> 4);
    }
    case gguf::TensorType::Q3_K: {
      const int n = i / 128, j = (i % 128) / 32, l = i % 32, k = i / 16;
      const int q = ((c[32 + 32 * n + l] >> (2 * j)) & 3) - (((c[l] >> (4 * n + j)) & 1) ? 0 : 4);
      return f16_to_f32(s[0]) * float(scale_q3k(c + 96, k)) * float(q);
    }
    default: return 0.0f;
  }
}

}  // namespace kvq::cuda::kq
