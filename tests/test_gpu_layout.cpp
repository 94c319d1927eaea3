// CPU checks of the GPU weight layout (runs in CI without a GPU).
#include <gtest/gtest.h>

#include <cstring>
#include <map>

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
                       TensorType::Q1_0, TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K, TensorType::Q5_K,
                       TensorType::Q6_K}) {
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

TEST(GpuLayout, KQuantRecordsAre16ByteMultiplesHoldingTheBlock) {
  const std::map<TensorType, std::pair<uint32_t, uint32_t>> want = {{TensorType::Q2_K, {80, 2}},
                                                                     {TensorType::Q3_K, {112, 1}},
                                                                     {TensorType::Q4_K, {144, 0}},
                                                                     {TensorType::Q5_K, {176, 0}},
                                                                     {TensorType::Q6_K, {208, 1}}};
  for (const auto& [t, sizes] : want) {
    const GpuKQuantRecord rec = gpu_kquant_record(t);
    EXPECT_EQ(rec.code_bytes, sizes.first) << gguf::tensor_type_name(t);
    EXPECT_EQ(rec.scales, sizes.second) << gguf::tensor_type_name(t);
    // Codes, scales and padding account for every byte of a GGUF block.
    EXPECT_GE(rec.code_bytes + 2 * rec.scales, gguf::tensor_type_info(t).block_bytes);
    EXPECT_LT(rec.code_bytes + 2 * rec.scales, gguf::tensor_type_info(t).block_bytes + 16);
    const auto data = random_matrix(t, 3, 768, 5);
    const auto p = pack_matrix_for_gpu(t, 3, 768, data.data());
    ASSERT_EQ(p.codes.size(), size_t(3 * 3 * rec.code_bytes));
    ASSERT_EQ(p.scales.size(), size_t(3 * 3 * rec.scales));
    // Block 4 (row 1, block 1): its leading bytes, and its trailing fp16 scales.
    const size_t bb = gguf::tensor_type_info(t).block_bytes;
    const uint8_t* src = data.data() + 4 * bb;
    EXPECT_EQ(std::memcmp(p.codes.data() + 4 * rec.code_bytes, src, bb - 2 * rec.scales), 0);
    for (uint32_t k = 0; k < rec.scales; ++k)
      EXPECT_EQ(p.scales[4 * rec.scales + k], uint16_t(src[bb - 2 * rec.scales + 2 * k] |
                                                       (src[bb - 2 * rec.scales + 2 * k + 1] << 8)));
  }
  EXPECT_THROW(gpu_kquant_record(TensorType::Q8_0), Error);
}

TEST(GpuLayout, RejectsUnsupportedShapes) {
  std::vector<uint8_t> d(gguf::tensor_row_bytes(TensorType::Q8_0, 96));
  EXPECT_THROW(pack_matrix_for_gpu(TensorType::Q8_0, 1, 96, d.data()), Error);
  EXPECT_FALSE(gpu_gemv_supported(TensorType::F32, 12));
  EXPECT_TRUE(gpu_gemv_supported(TensorType::Q1_0, 4096));
}
