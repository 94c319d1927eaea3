// GEMV kernels vs the CPU reference (dequantize with gguf::dequantize_row, dot
// in double). Fresh random inputs, odd row counts, a poisoned output buffer
// with sentinels after it. Skips cleanly when no GPU is present.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/gemv.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "gguf/quant.hpp"

using namespace kvq;
using gguf::TensorType;

namespace {

struct Case {
  TensorType type;
  int rows;
  int cols;
};

class GemvTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

bool quantized(TensorType t) { return t == TensorType::Q8_0 || t == TensorType::Q4_0 || t == TensorType::Q1_0; }

TEST_P(GemvTest, MatchesCpuReference) {
  const Case c = GetParam();
  Rng rng(uint64_t(c.rows) * 131 + c.cols + int(c.type));
  const uint64_t rb = gguf::tensor_row_bytes(c.type, c.cols);
  std::vector<uint8_t> w(rb * c.rows);
  std::vector<float> row(c.cols), x(c.cols);
  for (int r = 0; r < c.rows; ++r) {
    for (auto& v : row) v = float(rng.normal()) * 0.05f;
    gguf::quantize_row(c.type, row.data(), w.data() + r * rb, c.cols);
  }
  for (auto& v : x) v = float(rng.normal());

  // Reference in double over the dequantized weights, plus the rigorous bound
  // for rounding x to int8 per 32 values (|error| <= step/2 per element).
  std::vector<double> ref(c.rows), bound(c.rows);
  // (Only quantized types round x; float types have cols that need not be a
  // multiple of 32, so the last group may be short.)
  std::vector<float> step((c.cols + 31) / 32);
  for (size_t g = 0; g < step.size(); ++g) {
    float amax = 0;
    for (int j = int(g) * 32; j < std::min(c.cols, int(g) * 32 + 32); ++j) amax = std::max(amax, std::fabs(x[j]));
    step[g] = amax / 127.0f;
  }
  for (int r = 0; r < c.rows; ++r) {
    gguf::dequantize_row(c.type, w.data() + r * rb, row.data(), c.cols);
    double s = 0, mag = 0, qerr = 0;
    for (int j = 0; j < c.cols; ++j) {
      s += double(row[j]) * x[j];
      mag += std::fabs(double(row[j]) * x[j]);
      qerr += std::fabs(double(row[j])) * 0.5 * step[j / 32];
    }
    ref[r] = s;
    // fp32 accumulation: each lane sums cols/32 products then a 5-level tree.
    bound[r] = 1.2e-7 * (c.cols / 32 + 16) * mag + 1e-6 + (quantized(c.type) ? qerr * 1.0001 : 0.0);
  }

  auto gw = cuda::GpuMatrix::upload(pack_matrix_for_gpu(c.type, c.rows, c.cols, w.data()));
  cuda::DeviceBuffer<float> dx(c.cols);
  dx.upload(x);
  const int sentinel = 16;
  std::vector<float> poison(c.rows + sentinel, std::numeric_limits<float>::quiet_NaN());
  for (int i = 0; i < sentinel; ++i) poison[c.rows + i] = 12345.0f + i;
  cuda::DeviceBuffer<float> dy(poison.size());
  dy.upload(poison);
  cuda::GemvScratch scratch;
  cuda::gemv(gw, dx.data(), dy.data(), scratch, nullptr);
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  const auto y = dy.download();
  for (int r = 0; r < c.rows; ++r) {
    ASSERT_TRUE(std::isfinite(y[r])) << "row " << r << " not written";
    ASSERT_LE(std::fabs(y[r] - ref[r]), bound[r]) << "row " << r << " gpu " << y[r] << " ref " << ref[r];
  }
  for (int i = 0; i < sentinel; ++i) ASSERT_EQ(y[c.rows + i], 12345.0f + i) << "wrote past the end";
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (TensorType t : {TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q8_0, TensorType::Q4_0,
                       TensorType::Q1_0}) {
    out.push_back({t, 1, 256});
    out.push_back({t, 37, 512});
    out.push_back({t, 131, 4096});
    out.push_back({t, 7, 12288});
  }
  out.push_back({TensorType::F32, 5, 8});
  out.push_back({TensorType::BF16, 3, 24});
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return std::string(gguf::tensor_type_name(info.param.type)) + "_" + std::to_string(info.param.rows) + "x" +
         std::to_string(info.param.cols);
}

INSTANTIATE_TEST_SUITE_P(AllTypes, GemvTest, ::testing::ValuesIn(cases()), case_name);

}  // namespace
