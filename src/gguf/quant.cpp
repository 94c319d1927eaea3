#include "gguf/quant.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.hpp"
#include "core/half.hpp"

namespace kvq::gguf {
namespace {

uint16_t load_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
void store_u16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v & 0xff);
  p[1] = uint8_t(v >> 8);
}

int64_t checked_blocks(TensorType t, int64_t n, const char* what) {
  const TensorTypeInfo& info = tensor_type_info(t);
  if (n < 0 || n % info.block_size != 0)
    fail(Errc::invalid_argument, what, ": row of ", n, " values is not a multiple of the ", info.name,
         " block size ", info.block_size);
  return n / info.block_size;
}

// ---------------------------------------------------------------------------
// K-quants, one weight at a time straight from the layouts in quant.hpp.

float f16_at(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

// 6-bit scale and min of sub-block s (0..7) of a Q4_K/Q5_K block's sm[12].
void scale_min_k4(const uint8_t* sm, int s, int& sc, int& m) {
  if (s < 4) {
    sc = sm[s] & 63;
    m = sm[s + 4] & 63;
  } else {
    sc = (sm[s + 4] & 15) | ((sm[s - 4] >> 6) << 4);
    m = (sm[s + 4] >> 4) | ((sm[s] >> 6) << 4);
  }
}

// 6-bit scale of sub-block k (0..15) of a Q3_K block's sc12[12], minus 32.
int scale_q3k(const uint8_t* sc12, int k) {
  const int low = k < 8 ? sc12[k] & 15 : sc12[k - 8] >> 4;
  const int high = (sc12[8 + k % 4] >> (2 * (k / 4))) & 3;
  return (low | (high << 4)) - 32;
}

float k_weight(TensorType t, const uint8_t* b, int i) {
  switch (t) {
    case TensorType::Q4_K:
    case TensorType::Q5_K: {
      const int s = i / 32, l = i % 32;
      const uint8_t* qs = b + (t == TensorType::Q4_K ? 16 : 48);
      int q = s % 2 == 0 ? qs[32 * (i / 64) + l] & 15 : qs[32 * (i / 64) + l] >> 4;
      if (t == TensorType::Q5_K) q += 16 * ((b[16 + l] >> s) & 1);
      int sc, m;
      scale_min_k4(b + 4, s, sc, m);
      return f16_at(b) * float(sc) * float(q) - f16_at(b + 2) * float(m);
    }
    case TensorType::Q6_K: {
      const int h = i / 128, g = (i % 128) / 32, l = i % 32;
      const uint8_t lq = b[64 * h + 32 * (g % 2) + l];
      const int low = g < 2 ? lq & 15 : lq >> 4;
      const int high = (b[128 + 32 * h + l] >> (2 * g)) & 3;
      return f16_at(b + 208) * float(int8_t(b[192 + i / 16])) * float((low | (high << 4)) - 32);
    }
    case TensorType::Q2_K: {
      const int n = i / 128, j = (i % 128) / 32, l = i % 32, k = i / 16;
      const int q = (b[16 + 32 * n + l] >> (2 * j)) & 3;
      return f16_at(b + 80) * float(b[k] & 15) * float(q) - f16_at(b + 82) * float(b[k] >> 4);
    }
    case TensorType::Q3_K: {
      const int n = i / 128, j = (i % 128) / 32, l = i % 32, k = i / 16;
      const int q = ((b[32 + 32 * n + l] >> (2 * j)) & 3) - (((b[l] >> (4 * n + j)) & 1) ? 0 : 4);
      return f16_at(b + 108) * float(scale_q3k(b + 96, k)) * float(q);
    }
    default: break;
  }
  fail(Errc::internal, "internal error: k_weight: ", tensor_type_name(t), " is not a K-quant");
}

int nearest(float x) { return int(std::lround(x)); }

// Codes of n values against step `d` (0: all zero) and offset `min`: q = round((x + min) / d) in [lo, hi].
void codes(const float* x, int n, float d, float min, int lo, int hi, int* q) {
  for (int i = 0; i < n; ++i) q[i] = d != 0.0f ? std::clamp(nearest((x[i] + min) / d), lo, hi) : std::max(lo, 0);
}

// Quantizes one super-block of 256 values.
void quantize_k_block(TensorType t, const float* x, uint8_t* b) {
  int q[256];
  switch (t) {
    case TensorType::Q4_K:
    case TensorType::Q5_K: {
      const int nmax = t == TensorType::Q4_K ? 15 : 31;
      float scale[8], min[8], max_scale = 0, max_min = 0;
      for (int s = 0; s < 8; ++s) {
        float lo = 0.0f, hi = x[32 * s];
        for (int i = 0; i < 32; ++i) {
          lo = std::min(lo, x[32 * s + i]);
          hi = std::max(hi, x[32 * s + i]);
        }
        scale[s] = (hi - lo) / float(nmax);
        min[s] = -lo;
        max_scale = std::max(max_scale, scale[s]);
        max_min = std::max(max_min, min[s]);
      }
      const uint16_t dh = f32_to_f16(max_scale / 63.0f), mh = f32_to_f16(max_min / 63.0f);
      const float d = f16_to_f32(dh), dmin = f16_to_f32(mh);
      int sc[8], m[8];
      for (int s = 0; s < 8; ++s) {
        sc[s] = d > 0.0f ? std::clamp(nearest(scale[s] / d), 0, 63) : 0;
        m[s] = dmin > 0.0f ? std::clamp(nearest(min[s] / dmin), 0, 63) : 0;
        codes(x + 32 * s, 32, d * float(sc[s]), dmin * float(m[s]), 0, nmax, q + 32 * s);
      }
      store_u16(b, dh);
      store_u16(b + 2, mh);
      uint8_t* sm = b + 4;
      for (int s = 0; s < 4; ++s) {
        sm[s] = uint8_t((sc[s] & 63) | ((sc[s + 4] >> 4) << 6));
        sm[s + 4] = uint8_t((m[s] & 63) | ((m[s + 4] >> 4) << 6));
        sm[s + 8] = uint8_t((sc[s + 4] & 15) | ((m[s + 4] & 15) << 4));
      }
      uint8_t* qs = b + (t == TensorType::Q4_K ? 16 : 48);
      if (t == TensorType::Q5_K) std::memset(b + 16, 0, 32);
      for (int p = 0; p < 4; ++p)
        for (int l = 0; l < 32; ++l) {
          const int lo = q[64 * p + l], hi = q[64 * p + 32 + l];
          qs[32 * p + l] = uint8_t((lo & 15) | ((hi & 15) << 4));
          if (t == TensorType::Q5_K) b[16 + l] |= uint8_t(((lo >> 4) << (2 * p)) | ((hi >> 4) << (2 * p + 1)));
        }
      return;
    }
    case TensorType::Q6_K: {
      // Per 16 weights: scale = (value of largest magnitude) / -32, so that
      // value maps to -32 exactly (the code range is -32..31).
      float scale[16], amax_scale = 0;
      for (int k = 0; k < 16; ++k) {
        float amax = 0, v = 0;
        for (int i = 0; i < 16; ++i)
          if (std::fabs(x[16 * k + i]) > amax) {
            amax = std::fabs(x[16 * k + i]);
            v = x[16 * k + i];
          }
        scale[k] = v / -32.0f;
        amax_scale = std::max(amax_scale, std::fabs(scale[k]));
      }
      const uint16_t dh = f32_to_f16(amax_scale / 127.0f);
      const float d = f16_to_f32(dh);
      for (int k = 0; k < 16; ++k) {
        const int sc = d > 0.0f ? std::clamp(nearest(scale[k] / d), -127, 127) : 0;
        b[192 + k] = uint8_t(int8_t(sc));
        codes(x + 16 * k, 16, d * float(sc), 0.0f, -32, 31, q + 16 * k);
        for (int i = 0; i < 16; ++i) q[16 * k + i] += 32;
      }
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          const int* qq = q + 128 * h + l;
          b[64 * h + l] = uint8_t((qq[0] & 15) | ((qq[64] & 15) << 4));
          b[64 * h + 32 + l] = uint8_t((qq[32] & 15) | ((qq[96] & 15) << 4));
          b[128 + 32 * h + l] = uint8_t((qq[0] >> 4) | ((qq[32] >> 4) << 2) | ((qq[64] >> 4) << 4) | ((qq[96] >> 4) << 6));
        }
      store_u16(b + 208, dh);
      return;
    }
    case TensorType::Q2_K: {
      float scale[16], min[16], max_scale = 0, max_min = 0;
      for (int k = 0; k < 16; ++k) {
        float lo = 0.0f, hi = x[16 * k];
        for (int i = 0; i < 16; ++i) {
          lo = std::min(lo, x[16 * k + i]);
          hi = std::max(hi, x[16 * k + i]);
        }
        scale[k] = (hi - lo) / 3.0f;
        min[k] = -lo;
        max_scale = std::max(max_scale, scale[k]);
        max_min = std::max(max_min, min[k]);
      }
      const uint16_t dh = f32_to_f16(max_scale / 15.0f), mh = f32_to_f16(max_min / 15.0f);
      const float d = f16_to_f32(dh), dmin = f16_to_f32(mh);
      for (int k = 0; k < 16; ++k) {
        const int sc = d > 0.0f ? std::clamp(nearest(scale[k] / d), 0, 15) : 0;
        const int m = dmin > 0.0f ? std::clamp(nearest(min[k] / dmin), 0, 15) : 0;
        b[k] = uint8_t(sc | (m << 4));
        codes(x + 16 * k, 16, d * float(sc), dmin * float(m), 0, 3, q + 16 * k);
      }
      std::memset(b + 16, 0, 64);
      for (int i = 0; i < 256; ++i) b[16 + 32 * (i / 128) + i % 32] |= uint8_t(q[i] << (2 * ((i % 128) / 32)));
      store_u16(b + 80, dh);
      store_u16(b + 82, mh);
      return;
    }
    case TensorType::Q3_K: {
      // Per 16 weights: scale = (value of largest magnitude) / -4 (codes -4..3).
      float scale[16], amax_scale = 0;
      for (int k = 0; k < 16; ++k) {
        float amax = 0, v = 0;
        for (int i = 0; i < 16; ++i)
          if (std::fabs(x[16 * k + i]) > amax) {
            amax = std::fabs(x[16 * k + i]);
            v = x[16 * k + i];
          }
        scale[k] = v / -4.0f;
        amax_scale = std::max(amax_scale, std::fabs(scale[k]));
      }
      const uint16_t dh = f32_to_f16(amax_scale / 31.0f);
      const float d = f16_to_f32(dh);
      std::memset(b, 0, 110);
      for (int k = 0; k < 16; ++k) {
        const int sc = d > 0.0f ? std::clamp(nearest(scale[k] / d), -32, 31) : 0;
        const int s6 = sc + 32;
        if (k < 8) b[96 + k] |= uint8_t(s6 & 15);
        else b[96 + k - 8] |= uint8_t((s6 & 15) << 4);
        b[96 + 8 + k % 4] |= uint8_t((s6 >> 4) << (2 * (k / 4)));
        codes(x + 16 * k, 16, d * float(sc), 0.0f, -4, 3, q + 16 * k);
      }
      for (int i = 0; i < 256; ++i) {
        const int n = i / 128, j = (i % 128) / 32, l = i % 32;
        const int u = q[i] + 4;  // 0..7: the high bit set means "no -4"
        b[32 + 32 * n + l] |= uint8_t((u & 3) << (2 * j));
        if (u & 4) b[l] |= uint8_t(1u << (4 * n + j));
      }
      store_u16(b + 108, dh);
      return;
    }
    default: break;
  }
  fail(Errc::internal, "internal error: quantize_k_block: ", tensor_type_name(t), " is not a K-quant");
}

}  // namespace

void dequantize_row(TensorType t, const uint8_t* src, float* dst, int64_t n) {
  const int64_t nb = checked_blocks(t, n, "dequantize_row");
  switch (t) {
    case TensorType::F32:
      std::memcpy(dst, src, size_t(n) * 4);
      return;
    case TensorType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(load_u16(src + 2 * i));
      return;
    case TensorType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load_u16(src + 2 * i));
      return;
    case TensorType::Q8_0:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = src + b * 34;
        const float d = f16_to_f32(load_u16(blk));
        for (int j = 0; j < 32; ++j) dst[b * 32 + j] = float(int8_t(blk[2 + j])) * d;
      }
      return;
    case TensorType::Q4_0:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = src + b * 18;
        const float d = f16_to_f32(load_u16(blk));
        for (int j = 0; j < 16; ++j) {
          dst[b * 32 + j] = float(int(blk[2 + j] & 0x0f) - 8) * d;
          dst[b * 32 + j + 16] = float(int(blk[2 + j] >> 4) - 8) * d;
        }
      }
      return;
    case TensorType::Q1_0:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = src + b * 18;
        const float d = f16_to_f32(load_u16(blk));
        for (int j = 0; j < 128; ++j) dst[b * 128 + j] = ((blk[2 + j / 8] >> (j % 8)) & 1) ? d : -d;
      }
      return;
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K: {
      const uint32_t bytes = tensor_type_info(t).block_bytes;
      for (int64_t b = 0; b < nb; ++b)
        for (int i = 0; i < 256; ++i) dst[b * 256 + i] = k_weight(t, src + b * bytes, i);
      return;
    }
  }
  fail(Errc::internal, "internal error: dequantize_row: type id ", uint32_t(t), " has no dequantizer");
}

void quantize_row(TensorType t, const float* src, uint8_t* dst, int64_t n) {
  const int64_t nb = checked_blocks(t, n, "quantize_row");
  switch (t) {
    case TensorType::F32:
      std::memcpy(dst, src, size_t(n) * 4);
      return;
    case TensorType::F16:
      for (int64_t i = 0; i < n; ++i) store_u16(dst + 2 * i, f32_to_f16(src[i]));
      return;
    case TensorType::BF16:
      for (int64_t i = 0; i < n; ++i) store_u16(dst + 2 * i, f32_to_bf16(src[i]));
      return;
    case TensorType::Q8_0:
      for (int64_t b = 0; b < nb; ++b) {
        const float* x = src + b * 32;
        uint8_t* blk = dst + b * 34;
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        store_u16(blk, f32_to_f16(d));
        for (int j = 0; j < 32; ++j) blk[2 + j] = uint8_t(int8_t(std::lround(x[j] * id)));
      }
      return;
    case TensorType::Q4_0:
      for (int64_t b = 0; b < nb; ++b) {
        const float* x = src + b * 32;
        uint8_t* blk = dst + b * 18;
        float amax = 0.0f, m = 0.0f;
        for (int j = 0; j < 32; ++j) {
          if (std::fabs(x[j]) > amax) {
            amax = std::fabs(x[j]);
            m = x[j];
          }
        }
        const float d = m / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        store_u16(blk, f32_to_f16(d));
        for (int j = 0; j < 16; ++j) {
          const int q0 = std::min(15, int(int8_t(x[j] * id + 8.5f)));
          const int q1 = std::min(15, int(int8_t(x[j + 16] * id + 8.5f)));
          blk[2 + j] = uint8_t(q0 | (q1 << 4));
        }
      }
      return;
    case TensorType::Q1_0:
      for (int64_t b = 0; b < nb; ++b) {
        const float* x = src + b * 128;
        uint8_t* blk = dst + b * 18;
        double sum = 0.0;
        for (int j = 0; j < 128; ++j) sum += std::fabs(x[j]);
        store_u16(blk, f32_to_f16(float(sum / 128.0)));
        std::memset(blk + 2, 0, 16);
        for (int j = 0; j < 128; ++j)
          if (x[j] >= 0.0f) blk[2 + j / 8] |= uint8_t(1u << (j % 8));
      }
      return;
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K: {
      const uint32_t bytes = tensor_type_info(t).block_bytes;
      for (int64_t b = 0; b < nb; ++b) quantize_k_block(t, src + b * 256, dst + b * bytes);
      return;
    }
  }
  fail(Errc::internal, "internal error: quantize_row: type id ", uint32_t(t), " has no quantizer");
}

}  // namespace kvq::gguf
