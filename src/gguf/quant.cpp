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
  }
  fail(Errc::internal, "internal error: quantize_row: type id ", uint32_t(t), " has no quantizer");
}

}  // namespace kvq::gguf
