// CPU checks of the GPU weight layout (runs in CI without a GPU).
#include <gtest/gtest.h>

#include <cstring>

#include "backend/gpu_layout.hpp"
#include "core/error.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "gguf/quant.hpp"

using namespace kvq;
using gguf::TensorType;

namespace {
std::vector<uint8_t> random_matrix(TensorType t, int64_t rows, int64_t cols, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> row(cols);
  const uint64_t rb = gguf::tensor_row_bytes(t, cols);
  std::vector<uint8_t> out(rb * rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (auto& v : row) v = float(rng.normal());
    gguf::quantize_row(t, row.data(), out.data() + r * rb, cols);
  }
  return out;
}
}  // namespace

TEST(GpuLayout, PackUnpackRoundTripsEveryType) {
  for (TensorType t : {TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q8_0, TensorType::Q4_0,
                       TensorType::Q1_0}) {
    const auto data = random_matrix(t, 7, 512, 11);
    const auto packed = pack_matrix_for_gpu(t, 7, 512, data.data());
    EXPECT_EQ(unpack_matrix_from_gpu(packed), data) << gguf::tensor_type_name(t);
    // Code rows are a multiple of 16 bytes, so every row starts 16-byte aligned.
    EXPECT_EQ(packed.codes.size() % (7 * 16), 0u);
  }
}

TEST(GpuLayout, Q1_0SplitsScaleFromSignBits) {
  // One row of 256 weights: block 0 all +, block 1 alternating starting with -.
  std::vector<float> w(256);
  for (int j = 0; j < 128; ++j) w[j] = 0.5f;
  for (int j = 128; j < 256; ++j) w[j] = (j % 2) ? 0.25f : -0.25f;
  std::vector<uint8_t> blocks(gguf::tensor_row_bytes(TensorType::Q1_0, 256));
  gguf::quantize_row(TensorType::Q1_0, w.data(), blocks.data(), 256);
  const auto p = pack_matrix_for_gpu(TensorType::Q1_0, 1, 256, blocks.data());
  ASSERT_EQ(p.scales.size(), 2u);
  ASSERT_EQ(p.codes.size(), 32u);
  EXPECT_FLOAT_EQ(f16_to_f32(p.scales[0]), 0.5f);
  EXPECT_FLOAT_EQ(f16_to_f32(p.scales[1]), 0.25f);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(p.codes[i], 0xff);
  // Block 1: weights 129, 131, ... positive, i.e. GGUF words 0xaaaaaaaa; in the
  // transposed word weight 4k + b sits at bit 8b + k, so the odd weights
  // (b = 1, 3) fill bytes 1 and 3.
  for (int i = 16; i < 32; ++i) EXPECT_EQ(p.codes[i], (i % 2) ? 0xff : 0x00) << "byte " << i;
}

TEST(GpuLayout, Q1_0WordTransposeIsABijection) {
  for (int j = 0; j < 32; ++j) {
    const uint32_t w = q1_transpose_word(1u << j);
    EXPECT_EQ(w, 1u << (8 * (j % 4) + j / 4)) << "weight " << j;
    EXPECT_EQ(q1_untranspose_word(w), 1u << j);
  }
  uint32_t x = 0x12345678u;
  for (int i = 0; i < 1000; ++i, x = x * 1664525u + 1013904223u) EXPECT_EQ(q1_untranspose_word(q1_transpose_word(x)), x);
  // weights 4k..4k+3 as bytes: (word >> k) & 0x01010101
  const uint32_t w = q1_transpose_word(0xf0u);  // weights 4..7 set: k = 1
  EXPECT_EQ((w >> 1) & 0x01010101u, 0x01010101u);
  EXPECT_EQ(w & 0x01010101u, 0u);
}

TEST(GpuLayout, RejectsUnsupportedShapes) {
  std::vector<uint8_t> d(gguf::tensor_row_bytes(TensorType::Q8_0, 96));
  EXPECT_THROW(pack_matrix_for_gpu(TensorType::Q8_0, 1, 96, d.data()), Error);
  EXPECT_FALSE(gpu_gemv_supported(TensorType::F32, 12));
  EXPECT_TRUE(gpu_gemv_supported(TensorType::Q1_0, 4096));
}
