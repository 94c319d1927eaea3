// K-quants (Q2_K..Q6_K): kvq's scalar reference dequantizer (gguf/quant.cpp)
// and CPU kernels (backend/cpu) against values decoded by an independent
// Python implementation (tools/gguf_py/kquants.py, fixtures written by
// tools/gguf_py/make_kquant_fixtures.py), the CPU dot products and matmul
// against the reference, and the quantizers' error bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "backend/cpu/kernels.hpp"
#include "cli_test_util.hpp"
#include "core/error.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "gguf/gguf.hpp"
#include "gguf/quant.hpp"

using namespace kvq;
using gguf::TensorType;
namespace fs = std::filesystem;

namespace {

constexpr TensorType kKQuants[] = {TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K, TensorType::Q5_K,
                                   TensorType::Q6_K};

const gguf::File& fixtures() {
  static const gguf::File f = gguf::File::open(std::string(KVQ_TEST_DATA) + "/kquant/kquants.gguf");
  return f;
}

std::vector<float> f32_values(const gguf::TensorInfo& t) {
  std::vector<float> v(t.n_elements);
  std::memcpy(v.data(), t.data, t.n_bytes);
  return v;
}

// Random bytes with finite fp16 super-scales: every bit pattern of every
// other field (signed Q6_K scales, Q3_K high bits, the 6-bit Q4_K/Q5_K scales).
std::vector<uint8_t> random_blocks(TensorType t, int n_blocks, uint64_t seed) {
  const auto& info = gguf::tensor_type_info(t);
  Rng rng(seed);
  std::vector<uint8_t> out(size_t(n_blocks) * info.block_bytes);
  for (auto& b : out) b = uint8_t(rng.next_u64());
  std::vector<int> scale_offsets;
  switch (t) {
    case TensorType::Q2_K: scale_offsets = {80, 82}; break;
    case TensorType::Q3_K: scale_offsets = {108}; break;
    case TensorType::Q6_K: scale_offsets = {208}; break;
    default: scale_offsets = {0, 2}; break;
  }
  for (int b = 0; b < n_blocks; ++b)
    for (int off : scale_offsets) {
      const uint16_t h = f32_to_f16(float(0.001 + 0.05 * rng.uniform()) * (rng.uniform() < 0.5 ? -1.0f : 1.0f));
      out[size_t(b) * info.block_bytes + off] = uint8_t(h & 0xff);
      out[size_t(b) * info.block_bytes + off + 1] = uint8_t(h >> 8);
    }
  return out;
}

}  // namespace

TEST(KQuant, TypeTableHasTheGgmlGeometry) {
  const std::pair<TensorType, uint32_t> want[] = {{TensorType::Q2_K, 84}, {TensorType::Q3_K, 110},
                                                  {TensorType::Q4_K, 144}, {TensorType::Q5_K, 176},
                                                  {TensorType::Q6_K, 210}};
  for (const auto& [t, bytes] : want) {
    const auto* info = gguf::tensor_type_info(uint32_t(t));
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->block_size, 256u);
    EXPECT_EQ(info->block_bytes, bytes);
    EXPECT_STREQ(info->name, gguf::ggml_type_id_name(uint32_t(t)));  // ids 10..14 as upstream names them
    EXPECT_TRUE(gguf::is_k_quant(t));
    EXPECT_TRUE(cpu::supports_weight_type(t));
    EXPECT_EQ(cpu::block_bytes(t), bytes);
  }
  EXPECT_FALSE(gguf::is_k_quant(TensorType::Q4_0));
  EXPECT_EQ(gguf::tensor_type_from_name("q6_k"), TensorType::Q6_K);
}

// Blocks built by hand from the layouts (gguf/quant.hpp), with values worked
// out on paper, including the fields that are easiest to get wrong: the high
// bits of Q4_K's 6-bit scales of sub-blocks 4..7, Q6_K's negative scales and
// high bit pairs, Q3_K's scale bits and its "no -4" mask.
TEST(KQuant, HandBuiltBlocksDecodeAsTheLayoutSays) {
  auto put_f16 = [](uint8_t* p, float v) {
    const uint16_t h = f32_to_f16(v);
    p[0] = uint8_t(h & 0xff);
    p[1] = uint8_t(h >> 8);
  };
  auto both = [](TensorType t, const std::vector<uint8_t>& b, int i) {
    float ref[256], fast[256];
    gguf::dequantize_row(t, b.data(), ref, 256);
    cpu::dequantize_row(t, b.data(), fast, 256);
    EXPECT_EQ(ref[i], fast[i]) << gguf::tensor_type_name(t) << " weight " << i;
    return ref[i];
  };
  {  // Q4_K: d = 1, dmin = 0.5
    std::vector<uint8_t> b(144, 0);
    put_f16(&b[0], 1.0f);
    put_f16(&b[2], 0.5f);
    uint8_t* sm = &b[4];
    sm[0] = 2;          // sub-block 0: scale 2
    sm[4] = 1;          //              min 1
    sm[9] = 5 | (2 << 4);  // sub-block 5: scale low bits 0101, min low bits 0010
    sm[1] |= 2 << 6;    //              scale high bits 10 -> 37
    sm[5] |= 3 << 6;    //              min high bits 11 -> 50
    uint8_t* qs = &b[16];
    qs[0] = 3;          // weight 0 (sub-block 0, low nibble) q = 3
    qs[71] = 0x90;      // weight 167 = 64*2 + 32 + 7 (sub-block 5, high nibble of qs[32*2 + 7]) q = 9
    EXPECT_EQ(both(TensorType::Q4_K, b, 0), 1.0f * 2 * 3 - 0.5f * 1);
    EXPECT_EQ(both(TensorType::Q4_K, b, 167), 1.0f * 37 * 9 - 0.5f * 50);
    EXPECT_EQ(both(TensorType::Q4_K, b, 32), 0.0f);  // sub-block 1: scale 0, min 0
  }
  {  // Q6_K: d = 0.25
    std::vector<uint8_t> b(210, 0);
    put_f16(&b[208], 0.25f);
    b[192 + 3] = uint8_t(int8_t(-5));  // sub-block 3 (weights 48..63)
    b[192 + 7] = 1;                    // sub-block 7 (weights 112..127)
    b[50] = 0x0A;         // weight 50 = 32*1 + 18: low nibble of ql[32 + 18] = 10
    b[128 + 18] = 0x0C;   //                        bits 2-3 of qh[18] = 3 -> q = 58
    EXPECT_EQ(both(TensorType::Q6_K, b, 50), 0.25f * -5 * (58 - 32));
    EXPECT_EQ(both(TensorType::Q6_K, b, 114), 0.25f * 1 * (0 - 32));  // high nibble of ql[50], qh bits 6-7: 0
  }
  {  // Q3_K: d = 2
    std::vector<uint8_t> b(110, 0);
    put_f16(&b[108], 2.0f);
    uint8_t* sc12 = &b[96];
    sc12[1] |= 8 << 4;    // sub-block 9: low 4 bits of its scale (high nibble of sc12[9 - 8])
    sc12[9] |= 2 << 4;    //              high 2 bits in bits 4-5 (9 / 4 = 2) of sc12[8 + 9 % 4] -> 40 - 32 = 8
    b[32 + 32 + 19] = 1;  // weight 147 = 128 + 0*32 + 19: low bits (qs[32*1 + 19] bits 0-1) = 1
    // hm[19] bit 4 clear: "-4" -> q = -3
    EXPECT_EQ(both(TensorType::Q3_K, b, 147), 2.0f * 8 * -3);
    b[19] |= 1 << 4;      // set: q = 1
    EXPECT_EQ(both(TensorType::Q3_K, b, 147), 2.0f * 8 * 1);
  }
  {  // Q2_K: d = 1, dmin = 0.25
    std::vector<uint8_t> b(84, 0);
    put_f16(&b[80], 1.0f);
    put_f16(&b[82], 0.25f);
    b[13] = 7 | (3 << 4);  // sub-block 13 (weights 208..223): scale 7, min 3
    b[16 + 32 + 16] = 2 << 4;  // weight 208 = 128 + 32*2 + 16: bits 4-5 (j = 2) of qs[32 + 16] = 2
    EXPECT_EQ(both(TensorType::Q2_K, b, 208), 1.0f * 7 * 2 - 0.25f * 3);
  }
  {  // Q5_K: the fifth bit of weight 64*3 + 32 + 5 = 229 is bit 7 of qh[5]
    std::vector<uint8_t> b(176, 0);
    put_f16(&b[0], 1.0f);
    b[4 + 8 + 3] = 1;   // sub-block 7: scale low bits 1 (sm[7 + 4]), high bits 0
    b[16 + 5] = 0x80;   // qh[5] bit 7
    b[48 + 96 + 5] = 0x20;  // qs[32*3 + 5] high nibble 2 -> q = 2 + 16
    EXPECT_EQ(both(TensorType::Q5_K, b, 229), 1.0f * 1 * 18);
  }
}

// Both of kvq's dequantizers give exactly the Python decoder's values: on
// blocks its quantizer wrote and on random bytes.
TEST(KQuant, DequantizersMatchTheIndependentPythonDecoder) {
  const gguf::File& f = fixtures();
  for (TensorType t : kKQuants) {
    for (const char* kind : {".quantized", ".random"}) {
      const std::string name = std::string(gguf::tensor_type_name(t)) + kind;
      const gguf::TensorInfo& q = f.tensor(name);
      const std::vector<float> want = f32_values(f.tensor(name + ".ref"));
      ASSERT_EQ(q.type, t) << name;
      ASSERT_EQ(want.size(), q.n_elements) << name;
      std::vector<float> ref(q.n_elements), fast(q.n_elements);
      gguf::dequantize_row(t, q.data, ref.data(), int64_t(q.n_elements));
      cpu::dequantize_row(t, q.data, fast.data(), int64_t(q.n_elements));
      size_t mismatches = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        if (ref[i] != want[i] || fast[i] != want[i]) ++mismatches;
        if (mismatches <= 5) {
          EXPECT_EQ(ref[i], want[i]) << name << " weight " << i;
          EXPECT_EQ(fast[i], want[i]) << name << " weight " << i;
        }
      }
      EXPECT_EQ(mismatches, 0u) << name;
      // Not a degenerate fixture: many distinct values.
      std::vector<float> sorted = want;
      std::sort(sorted.begin(), sorted.end());
      EXPECT_GT(std::unique(sorted.begin(), sorted.end()) - sorted.begin(), 64) << name;
    }
  }
}

TEST(KQuant, CpuKernelEqualsReferenceOnRandomBlocks) {
  for (TensorType t : kKQuants) {
    const auto blocks = random_blocks(t, 16, 3 + uint64_t(t));
    std::vector<float> ref(16 * 256), fast(16 * 256);
    gguf::dequantize_row(t, blocks.data(), ref.data(), 16 * 256);
    cpu::dequantize_row(t, blocks.data(), fast.data(), 16 * 256);
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(fast[i], ref[i]) << gguf::tensor_type_name(t) << " " << i;
  }
}

// The quantizers: the round-trip error of each value is bounded by its
// sub-block's step (scales and mins are themselves quantized, so a step is
// about range / levels, widened by the scale codes' rounding).
TEST(KQuant, QuantizerRoundTripErrorIsBoundedBySubBlockRange) {
  Rng rng(5);
  const int64_t n = 256 * 12;
  std::vector<float> x(n), y(n);
  for (auto& v : x) v = float(rng.normal());
  for (int i = 0; i < 40; ++i) x[size_t(rng.below(uint64_t(n)))] *= 6.0f;  // outliers
  for (TensorType t : kKQuants) {
    std::vector<uint8_t> q(gguf::tensor_row_bytes(t, n));
    gguf::quantize_row(t, x.data(), q.data(), n);
    gguf::dequantize_row(t, q.data(), y.data(), n);
    // (levels per sub-block, sub-block size)
    const int levels = t == TensorType::Q2_K ? 3 : t == TensorType::Q3_K ? 7 : t == TensorType::Q4_K ? 15
                                                  : t == TensorType::Q5_K ? 31 : 63;
    const int sub = t == TensorType::Q4_K || t == TensorType::Q5_K ? 32 : 16;
    double sq = 0, sq_x = 0;
    for (int64_t b = 0; b < n / 256; ++b) {
      float block_range = 0;  // the largest sub-block range in the super-block sets the scale step
      for (int s = 0; s < 256; s += sub) {
        float lo = 0, hi = 0;
        for (int i = 0; i < sub; ++i) {
          lo = std::min(lo, x[b * 256 + s + i]);
          hi = std::max(hi, x[b * 256 + s + i]);
        }
        block_range = std::max(block_range, hi - lo);
      }
      for (int s = 0; s < 256; s += sub) {
        float lo = 0, hi = 0;
        for (int i = 0; i < sub; ++i) {
          lo = std::min(lo, x[b * 256 + s + i]);
          hi = std::max(hi, x[b * 256 + s + i]);
        }
        // Half a step of this sub-block, plus the error of representing its
        // scale (and min) with 4-8-bit codes of the super-block's largest.
        const float bound = 0.5f * (hi - lo) / float(levels) * 1.2f + block_range / 14.0f + 1e-6f;
        for (int i = 0; i < sub; ++i) {
          const int64_t k = b * 256 + s + i;
          ASSERT_LE(std::fabs(x[k] - y[k]), bound) << gguf::tensor_type_name(t) << " value " << k;
        }
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      sq += double(x[i] - y[i]) * (x[i] - y[i]);
      sq_x += double(x[i]) * x[i];
    }
    // More bits, less error: relative RMS error per type.
    const double rel = std::sqrt(sq / sq_x);
    const double limit = t == TensorType::Q2_K ? 0.45 : t == TensorType::Q3_K ? 0.25 : t == TensorType::Q4_K ? 0.12
                         : t == TensorType::Q5_K ? 0.06 : 0.04;
    EXPECT_LT(rel, limit) << gguf::tensor_type_name(t);
  }
  EXPECT_THROW(gguf::quantize_row(TensorType::Q4_K, x.data(), nullptr, 255), Error);
}

// Fused dot products and both matmul paths (few tokens: one dot per row;
// a prefill chunk: dequantized tiles) against the reference in double.
TEST(KQuant, CpuDotAndMatmulMatchTheReference) {
  const int64_t rows = 37, cols = 768;
  Rng rng(9);
  for (TensorType t : kKQuants) {
    const auto w = random_blocks(t, int(rows * cols / 256), 100 + uint64_t(t));
    std::vector<float> wf(rows * cols);
    gguf::dequantize_row(t, w.data(), wf.data(), rows * cols);
    Matrix m;
    m.type = t;
    m.rows = rows;
    m.cols = cols;
    m.data = w.data();
    m.row_bytes = gguf::tensor_row_bytes(t, cols);
    for (int n_tokens : {1, 3, 7}) {
      std::vector<float> x(size_t(n_tokens) * cols), y(size_t(n_tokens) * rows);
      for (auto& v : x) v = float(rng.normal());
      cpu::matmul(m, x.data(), n_tokens, y.data());
      for (int tok = 0; tok < n_tokens; ++tok)
        for (int64_t r = 0; r < rows; ++r) {
          double ref = 0, mag = 0;
          for (int64_t c = 0; c < cols; ++c) {
            ref += double(wf[r * cols + c]) * x[tok * cols + c];
            mag += std::fabs(double(wf[r * cols + c]) * x[tok * cols + c]);
          }
          ASSERT_NEAR(y[size_t(tok) * rows + r], ref, 1e-5 * mag + 1e-6)
              << gguf::tensor_type_name(t) << " tokens " << n_tokens << " row " << r;
          if (tok == 0)
            ASSERT_NEAR(cpu::dot_row(t, m.row(r), x.data(), cols), ref, 1e-5 * mag + 1e-6);
        }
    }
  }
}

// End to end: a synthetic model with K-quant matrices is written, described
// and run like any other.
TEST(KQuant, SynthInfoAndRunOnKQuantModels) {
  for (const char* type : {"Q4_K", "Q6_K", "Q2_K"}) {
    const fs::path p = fs::temp_directory_path() / (std::string("kvq_kquant_") + type + ".gguf");
    const auto s = kvq::test::kvq_cli("synth --shape tiny --weights " + std::string(type) + " -o " + p.string());
    ASSERT_EQ(s.rc, 0) << s.err;
    const auto i = kvq::test::kvq_cli("info -m " + p.string());
    ASSERT_EQ(i.rc, 0) << i.err;
    EXPECT_NE(i.out.find(std::string("  ") + type), std::string::npos) << i.out;
    const auto r = kvq::test::kvq_cli("run -m " + p.string() + " -p 'def f' -n 8 --temp 0");
    EXPECT_EQ(r.rc, 0) << r.err;
    EXPECT_NE(r.err.find("generated 8"), std::string::npos) << r.err;
    fs::remove(p);
  }
}
