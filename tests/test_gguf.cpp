// GGUF reader/writer round trips, the type table and the reference quantizers.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "gguf/gguf.hpp"
#include "gguf/quant.hpp"
#include "gguf/types.hpp"

using namespace kvq;
using namespace kvq::gguf;

namespace {

std::vector<uint8_t> f32_bytes(const std::vector<float>& xs) {
  std::vector<uint8_t> b(xs.size() * 4);
  std::memcpy(b.data(), xs.data(), b.size());
  return b;
}

std::string temp_path(const std::string& stem) {
  return (std::filesystem::temp_directory_path() / (stem + "." + std::to_string(::getpid()) + ".gguf"))
      .string();
}

}  // namespace

TEST(GgufTypes, TableHasBlockGeometry) {
  struct Want { TensorType t; const char* name; uint32_t bs, bb; };
  const Want want[] = {{TensorType::F32, "F32", 1, 4},     {TensorType::F16, "F16", 1, 2},
                       {TensorType::BF16, "BF16", 1, 2},   {TensorType::Q8_0, "Q8_0", 32, 34},
                       {TensorType::Q4_0, "Q4_0", 32, 18}, {TensorType::Q1_0, "Q1_0", 128, 18}};
  for (const auto& w : want) {
    const TensorTypeInfo* info = tensor_type_info(uint32_t(w.t));
    ASSERT_NE(info, nullptr) << w.name;
    EXPECT_STREQ(info->name, w.name);
    EXPECT_EQ(info->block_size, w.bs) << w.name;
    EXPECT_EQ(info->block_bytes, w.bb) << w.name;
    EXPECT_EQ(tensor_type_from_name(w.name), w.t);
  }
  EXPECT_EQ(uint32_t(TensorType::Q1_0), 41u);
  EXPECT_EQ(tensor_type_from_name("q1_0"), TensorType::Q1_0);
  EXPECT_EQ(tensor_type_from_name("bf16"), TensorType::BF16);
  EXPECT_FALSE(tensor_type_from_name("q5_0").has_value());  // a real ggml type kvq does not read
  EXPECT_EQ(tensor_type_info(6u), nullptr);
  EXPECT_STREQ(ggml_type_id_name(6), "Q5_0");
  EXPECT_STREQ(ggml_type_id_name(12), "Q4_K");
  EXPECT_EQ(ggml_type_id_name(1000), nullptr);
  EXPECT_EQ(tensor_row_bytes(TensorType::Q1_0, 4096), 4096u / 128 * 18);
  EXPECT_EQ(tensor_row_bytes(TensorType::Q8_0, 64), 68u);
  EXPECT_THROW(tensor_row_bytes(TensorType::Q4_0, 33), Error);
}

TEST(GgufRoundTrip, EveryValueTypeAndNestedArrays) {
  Writer w;
  w.set("general.architecture", Value::string("test"));
  w.set("t.u8", Value::u8(200));
  w.set("t.i8", {ValueType::INT8, int64_t(-100)});
  w.set("t.u16", {ValueType::UINT16, uint64_t(60000)});
  w.set("t.i16", {ValueType::INT16, int64_t(-30000)});
  w.set("t.u32", Value::u32(4000000000u));
  w.set("t.i32", Value::i32(-2000000000));
  w.set("t.u64", Value::u64(1ull << 60));
  w.set("t.i64", {ValueType::INT64, int64_t(-(1ll << 60))});
  w.set("t.f32", Value::f32(1.5f));
  w.set("t.f64", {ValueType::FLOAT64, 3.141592653589793});
  w.set("t.bool", Value::boolean(true));
  w.set("t.str", Value::string("h\xc3\xa9llo"));
  w.set("t.empty", Value::string(""));
  w.set("t.strs", Value::string_array({"a", "", "ccc"}));
  w.set("t.i32s", Value::i32_array({1, -2, 3}));
  w.set("t.f32s", Value::f32_array({0.25f, -8.0f}));
  w.set("t.nested", Value::array(ValueType::ARRAY, {Value::i32_array({1, 2}), Value::i32_array({})}));
  w.set("t.u32", Value::u32(7));  // replaces, keeps position
  const auto bytes = w.to_bytes();
  File f = File::parse(bytes.data(), bytes.size(), "mem.gguf");

  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  ASSERT_EQ(f.metadata().size(), 18u);
  EXPECT_EQ(f.metadata()[5].first, "t.u32");
  EXPECT_EQ(f.get_u64("t.u8"), 200u);
  EXPECT_EQ(f.get("t.u8").type, ValueType::UINT8);
  EXPECT_EQ(f.get("t.i8").as_i64(), -100);
  EXPECT_EQ(f.get_u64("t.u16"), 60000u);
  EXPECT_EQ(f.get("t.i16").as_i64(), -30000);
  EXPECT_EQ(f.get_u64("t.u32"), 7u);
  EXPECT_EQ(f.get("t.i32").as_i64(), -2000000000);
  EXPECT_EQ(f.get_u64("t.u64"), 1ull << 60);
  EXPECT_EQ(f.get("t.i64").as_i64(), -(1ll << 60));
  EXPECT_EQ(f.get_f64("t.f32"), 1.5);
  EXPECT_EQ(f.get_f64("t.f64"), 3.141592653589793);
  EXPECT_TRUE(f.get_bool_or("t.bool", false));
  EXPECT_EQ(f.get_string("t.str"), "h\xc3\xa9llo");
  EXPECT_EQ(f.get_string("t.empty"), "");
  const Array& strs = f.get("t.strs").as_array();
  ASSERT_EQ(strs.items.size(), 3u);
  EXPECT_EQ(strs.elem_type, ValueType::STRING);
  EXPECT_EQ(strs.items[2].as_string(), "ccc");
  EXPECT_EQ(f.get("t.i32s").as_array().items[1].as_i64(), -2);
  EXPECT_EQ(f.get("t.f32s").as_array().items[1].as_f64(), -8.0);
  const Array& nested = f.get("t.nested").as_array();
  ASSERT_EQ(nested.items.size(), 2u);
  EXPECT_EQ(nested.items[0].as_array().items[1].as_i64(), 2);
  EXPECT_TRUE(nested.items[1].as_array().items.empty());

  // Typed accessors name the key on a type mismatch; defaults apply when absent.
  try {
    f.get_u64("t.str");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::format);
    EXPECT_NE(std::string(e.what()).find("t.str"), std::string::npos) << e.what();
  }
  EXPECT_THROW(f.get_u64("t.i8"), Error);  // negative
  try {
    f.get("no.such.key");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing required key 'no.such.key'"), std::string::npos);
  }
  EXPECT_EQ(f.get_u64_or("nope", 5), 5u);
  EXPECT_EQ(f.get_string_or("nope", "x"), "x");
  EXPECT_EQ(f.get("t.strs").to_string(), "string[3] [\"a\", \"\", \"ccc\"]");
}

TEST(GgufRoundTrip, TensorsOffsetsAndAlignmentV2AndV3) {
  for (uint32_t version : {2u, 3u}) {
    for (uint64_t align : {32u, 64u, 1u, 4096u}) {
      Writer w(version, align);
      std::vector<float> a = {1, 2, 3, 4, 5};  // 20 bytes: forces padding before the next tensor
      std::vector<float> b(64);
      for (size_t i = 0; i < b.size(); ++i) b[i] = float(i) * 0.5f;
      w.add_tensor("a", TensorType::F32, {5}, f32_bytes(a));
      w.add_tensor("b", TensorType::F32, {16, 4}, f32_bytes(b));
      std::vector<uint8_t> q(2 * 34);
      quantize_row(TensorType::Q8_0, b.data(), q.data(), 64);
      w.add_tensor("c", TensorType::Q8_0, {64}, q);
      const auto bytes = w.to_bytes();
      File f = File::parse(bytes.data(), bytes.size());
      EXPECT_EQ(f.version(), version);
      EXPECT_EQ(f.alignment(), align);
      ASSERT_EQ(f.tensors().size(), 3u);
      const TensorInfo& ta = f.tensor("a");
      const TensorInfo& tb = f.tensor("b");
      const TensorInfo& tc = f.tensor("c");
      EXPECT_EQ(ta.offset, 0u);
      EXPECT_EQ(tb.offset % align, 0u);
      EXPECT_EQ(tc.offset % align, 0u);
      EXPECT_GE(tb.offset, 20u);
      EXPECT_EQ(tb.ne, (std::vector<uint64_t>{16, 4}));
      EXPECT_EQ(tb.n_elements, 64u);
      EXPECT_EQ(tb.n_bytes, 256u);
      EXPECT_EQ(tc.type, TensorType::Q8_0);
      EXPECT_EQ(tc.n_bytes, 68u);
      EXPECT_EQ(size_t(ta.data - bytes.data()) % align, 0u);
      EXPECT_EQ(std::memcmp(ta.data, a.data(), 20), 0);
      EXPECT_EQ(std::memcmp(tb.data, b.data(), 256), 0);
      EXPECT_EQ(std::memcmp(tc.data, q.data(), 68), 0);
      EXPECT_EQ(f.find_tensor("zzz"), nullptr);
      EXPECT_THROW(f.tensor("zzz"), Error);
    }
  }
}

TEST(GgufRoundTrip, WriteToFileAndMmapOpen) {
  const std::string path = temp_path("kvq_rt");
  Writer w;
  w.set("general.architecture", Value::string("x"));
  std::vector<float> a(256);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::sin(float(i));
  w.add_tensor("big", TensorType::F32, {256}, [&](uint8_t* dst, uint64_t n) {
    ASSERT_EQ(n, 1024u);
    std::memcpy(dst, a.data(), n);
  });
  w.write(path);
  {
    File f = File::open(path);
    EXPECT_EQ(f.path(), path);
    EXPECT_EQ(f.file_size(), std::filesystem::file_size(path));
    EXPECT_EQ(std::memcmp(f.tensor("big").data, a.data(), 1024), 0);
    File moved = std::move(f);  // the mapping moves with it
    EXPECT_EQ(std::memcmp(moved.tensor("big").data, a.data(), 1024), 0);
  }
  // Writing over an existing file replaces it whole (temp + rename).
  Writer w2;
  w2.write(path);
  EXPECT_EQ(File::open(path).tensors().size(), 0u);
  std::filesystem::remove(path);
}

TEST(GgufWriter, RejectsBadInput) {
  EXPECT_THROW(Writer(1), Error);
  EXPECT_THROW(Writer(3, 48), Error);
  Writer w;
  w.add_tensor("a", TensorType::F32, {4}, f32_bytes({1, 2, 3, 4}));
  EXPECT_THROW(w.add_tensor("a", TensorType::F32, {4}, f32_bytes({1, 2, 3, 4})), Error);  // dup
  EXPECT_THROW(w.add_tensor("b", TensorType::Q8_0, {33}, std::vector<uint8_t>(34)), Error);
  EXPECT_THROW(w.add_tensor("c", TensorType::F32, {4}, std::vector<uint8_t>(15)), Error);
  EXPECT_THROW(w.add_tensor("d", TensorType::F32, {}, std::vector<uint8_t>()), Error);
  EXPECT_THROW(w.add_tensor("e", TensorType::F32, {1, 1, 1, 1, 1}, std::vector<uint8_t>(4)), Error);
  w.set("general.alignment", Value::u32(64));  // disagrees with the writer's 32
  EXPECT_THROW(w.to_bytes(), Error);
  Writer w3;
  w3.set("x", Value::array(ValueType::INT32, {Value::string("no")}));
  EXPECT_THROW(w3.to_bytes(), Error);
}

// ---------------------------------------------------------------------------
// Quantizers
// ---------------------------------------------------------------------------

TEST(GgufQuant, Q1_0BitLayoutOnAHandMadeBlock) {
  // d = 0.5 (fp16 0x3800); bits: weight 0 +, weight 1 -, weight 9 +, weight 127 +.
  std::vector<uint8_t> blk(18, 0);
  blk[0] = 0x00;
  blk[1] = 0x38;
  blk[2] = 0x01;         // weight 0
  blk[3] = 0x02;         // weight 9 (bit 1 of byte 1)
  blk[2 + 15] = 0x80;    // weight 127
  std::vector<float> out(128);
  dequantize_row(TensorType::Q1_0, blk.data(), out.data(), 128);
  for (int j = 0; j < 128; ++j) {
    const bool plus = j == 0 || j == 9 || j == 127;
    EXPECT_EQ(out[j], plus ? 0.5f : -0.5f) << j;
  }
  // Quantizing those values gives the same bytes back (d = mean |x| = 0.5).
  std::vector<uint8_t> again(18);
  quantize_row(TensorType::Q1_0, out.data(), again.data(), 128);
  EXPECT_EQ(again, blk);
}

TEST(GgufQuant, Q4_0AndQ8_0LayoutOnAHandMadeBlock) {
  // Q4_0: d = 2 (0x4000); qs[j] low = weight j, high = weight j+16; w = (q-8)*d.
  std::vector<uint8_t> q4(18, 0x88);  // all q=8 -> 0
  q4[0] = 0x00;
  q4[1] = 0x40;
  q4[2] = 0xF0;  // weight 0 -> q 0 -> -16; weight 16 -> q 15 -> 14
  std::vector<float> out(32);
  dequantize_row(TensorType::Q4_0, q4.data(), out.data(), 32);
  EXPECT_EQ(out[0], -16.0f);
  EXPECT_EQ(out[16], 14.0f);
  for (int j : {1, 15, 17, 31}) EXPECT_EQ(out[j], 0.0f);
  // ggml's Q4_0 quantizer: d = max / -8, so the max-magnitude value maps to q = 0 exactly.
  std::vector<uint8_t> q4b(18);
  quantize_row(TensorType::Q4_0, out.data(), q4b.data(), 32);
  EXPECT_EQ(q4b, q4);

  std::vector<uint8_t> q8(34, 0);
  q8[0] = 0x00;
  q8[1] = 0x3c;  // d = 1
  q8[2] = uint8_t(int8_t(-127));
  q8[3] = 5;
  q8[33] = 127;
  dequantize_row(TensorType::Q8_0, q8.data(), out.data(), 32);
  EXPECT_EQ(out[0], -127.0f);
  EXPECT_EQ(out[1], 5.0f);
  EXPECT_EQ(out[31], 127.0f);
  EXPECT_EQ(out[2], 0.0f);
  std::vector<uint8_t> q8b(34);
  quantize_row(TensorType::Q8_0, out.data(), q8b.data(), 32);
  EXPECT_EQ(q8b, q8);
}

TEST(GgufQuant, RoundTripErrorBounds) {
  Rng rng(7);
  const int64_t n = 128 * 16;
  std::vector<float> x(n), y(n);
  for (auto& v : x) v = float(rng.normal() * 0.3);
  struct Case { TensorType t; };
  for (TensorType t : {TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q8_0,
                       TensorType::Q4_0, TensorType::Q1_0}) {
    const TensorTypeInfo& info = tensor_type_info(t);
    std::vector<uint8_t> buf(size_t(n / info.block_size * info.block_bytes));
    quantize_row(t, x.data(), buf.data(), n);
    dequantize_row(t, buf.data(), y.data(), n);
    for (int64_t b = 0; b < n / 32; ++b) {
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b * 32 + j]));
      for (int j = 0; j < 32; ++j) {
        const int64_t i = b * 32 + j;
        const float err = std::fabs(x[i] - y[i]);
        switch (t) {
          case TensorType::F32: EXPECT_EQ(x[i], y[i]); break;
          case TensorType::F16: EXPECT_LE(err, std::fabs(x[i]) * 0x1p-11f + 1e-7f) << i; break;
          case TensorType::BF16: EXPECT_LE(err, std::fabs(x[i]) * 0x1p-8f) << i; break;
          // half a step of d = amax/127, plus fp16 rounding of d (q <= 127 steps of rel 2^-11)
          case TensorType::Q8_0: EXPECT_LE(err, amax / 127 * 0.5f + amax * 0x1p-10f) << i; break;
          // step d = amax/8; the clamp at q=15 costs at most one step on the positive side
          case TensorType::Q4_0: EXPECT_LE(err, amax / 8 * 1.0f + amax * 0x1p-9f) << i; break;
          case TensorType::Q1_0: break;  // checked per 128-block below
        }
      }
    }
    if (t == TensorType::Q1_0) {
      for (int64_t b = 0; b < n / 128; ++b) {
        double mean_abs = 0;
        for (int j = 0; j < 128; ++j) mean_abs += std::fabs(x[b * 128 + j]);
        mean_abs /= 128;
        for (int j = 0; j < 128; ++j) {
          const int64_t i = b * 128 + j;
          EXPECT_NEAR(std::fabs(y[i]), mean_abs, mean_abs * 0x1p-10) << i;
          EXPECT_EQ(y[i] > 0, x[i] >= 0) << i;
        }
      }
    }
  }
  EXPECT_THROW(quantize_row(TensorType::Q1_0, x.data(), nullptr, 100), Error);
  EXPECT_THROW(dequantize_row(TensorType::Q8_0, nullptr, y.data(), 31), Error);
}
