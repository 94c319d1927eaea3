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
#include "gpu_test_util.hpp"

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

// Runs body(ctx) once per launch variant, each a device context of its own:
// 16 and 8 warps per CTA.
template <typename Body>
void for_each_kernel_variant(TensorType /*t*/, Body body) {
  struct Variant {
    const char* name;
    int warps;
  };
  const Variant variants[] = {{"16 warps per CTA", 16}, {"8 warps per CTA", 8}};
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    cuda::DeviceContext ctx(cuda::current_device());
    ctx.settings.gemv_warps = v.warps;
    body(ctx);
    if (::testing::Test::HasFatalFailure()) break;
  }
}

void check_gemv(const Case& c, const cuda::DeviceContext& ctx);

TEST_P(GemvTest, MatchesCpuReference) {
  for_each_kernel_variant(GetParam().type, [&](const cuda::DeviceContext& ctx) { check_gemv(GetParam(), ctx); });
}

void check_gemv(const Case& c, const cuda::DeviceContext& ctx) {
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
  const std::vector<float> step = gputest::int8_input_steps(x.data(), x.size());
  for (int r = 0; r < c.rows; ++r) {
    gguf::dequantize_row(c.type, w.data() + r * rb, row.data(), c.cols);
    double s = 0, mag = 0, qerr = 0;
    for (int j = 0; j < c.cols; ++j) {
      s += double(row[j]) * x[j];
      mag += std::fabs(double(row[j]) * x[j]);
      qerr += std::fabs(double(row[j])) * 0.5 * step[j];
    }
    ref[r] = s;
    // fp32 accumulation: each lane sums cols/32 products then a 5-level tree.
    bound[r] = 1.2e-7 * (c.cols / 32 + 16) * mag + 1e-6 + (cuda::gemv_quantizes_x(c.type) ? qerr * 1.0001 : 0.0);
  }

  auto gw = cuda::GpuMatrix::upload(pack_matrix_for_gpu(c.type, c.rows, c.cols, w.data()));
  cuda::DeviceBuffer<float> dx(c.cols);
  dx.upload(x);
  const int sentinel = 16;
  std::vector<float> poison(c.rows + sentinel, std::numeric_limits<float>::quiet_NaN());
  for (int i = 0; i < sentinel; ++i) poison[c.rows + i] = 12345.0f + i;
  cuda::DeviceBuffer<float> dy(poison.size());
  dy.upload(poison);
  cuda::gemv(gw, dx.data(), dy.data(), nullptr, ctx);
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
                       TensorType::Q1_0, TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K, TensorType::Q5_K,
                       TensorType::Q6_K}) {
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

// The fused forms (gemv.hpp): RMSNorm prologue, up to three matrices per
// launch, residual add and SwiGLU epilogues, against a double reference with
// the same rigorous bound as above (computed on the staged input u = x * norm,
// scaled by 1/rms) plus a few ulps for the float 1/rms.
namespace {

struct FusedCase {
  TensorType type;
  int cols;
  std::vector<int> rows;
  bool norm;
  cuda::GemvEpilogue epilogue;
};

class GemvFusedTest : public ::testing::TestWithParam<FusedCase> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

void check_fused(const FusedCase& c, const cuda::DeviceContext& ctx);

TEST_P(GemvFusedTest, MatchesCpuReference) {
  for_each_kernel_variant(GetParam().type, [&](const cuda::DeviceContext& ctx) { check_fused(GetParam(), ctx); });
}

void check_fused(const FusedCase& c, const cuda::DeviceContext& ctx) {
  Rng rng(uint64_t(c.cols) * 7 + c.rows.size() * 3 + int(c.type) * 11 + int(c.epilogue) + (c.norm ? 5 : 0));
  const int n_out = int(c.rows.size());
  const uint64_t rb = gguf::tensor_row_bytes(c.type, c.cols);
  std::vector<float> x(c.cols), g(c.cols);
  for (auto& v : x) v = float(rng.normal()) * 3.0f;
  for (auto& v : g) v = 0.5f + float(rng.uniform());
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  const float eps = 1e-6f;
  const double inv = c.norm ? 1.0 / std::sqrt(ss / c.cols + eps) : 1.0;
  std::vector<float> u(c.cols);
  for (int j = 0; j < c.cols; ++j) u[j] = c.norm ? x[j] * g[j] : x[j];
  const std::vector<float> step = gputest::int8_input_steps(u.data(), u.size());

  std::vector<cuda::GpuMatrix> mats;
  std::vector<std::vector<double>> ref(n_out), bound(n_out);
  std::vector<float> row(c.cols);
  for (int m = 0; m < n_out; ++m) {
    std::vector<uint8_t> w(rb * c.rows[m]);
    for (int r = 0; r < c.rows[m]; ++r) {
      for (auto& v : row) v = float(rng.normal()) * 0.05f;
      gguf::quantize_row(c.type, row.data(), w.data() + r * rb, c.cols);
      gguf::dequantize_row(c.type, w.data() + r * rb, row.data(), c.cols);
      double s = 0, mag = 0, qerr = 0;
      for (int j = 0; j < c.cols; ++j) {
        s += double(row[j]) * u[j];
        mag += std::fabs(double(row[j]) * u[j]);
        qerr += std::fabs(double(row[j])) * 0.5 * step[j];
      }
      ref[m].push_back(s * inv);
      bound[m].push_back(inv * (1.2e-7 * (c.cols / 32 + 16) * mag + (cuda::gemv_quantizes_x(c.type) ? qerr * 1.0001 : 0.0)) +
                         2e-6 * std::fabs(s * inv) + 1e-6);
    }
    mats.push_back(cuda::GpuMatrix::upload(pack_matrix_for_gpu(c.type, c.rows[m], c.cols, w.data())));
  }
  cuda::DeviceBuffer<float> dx(c.cols), dg(c.cols);
  dx.upload(x);
  dg.upload(g);
  std::vector<std::vector<float>> y0(n_out);
  std::vector<cuda::DeviceBuffer<float>> dy;
  for (int m = 0; m < n_out; ++m) {
    y0[m].resize(c.rows[m] + 16);
    for (int r = 0; r < c.rows[m]; ++r) y0[m][r] = float(rng.normal());
    for (int i = 0; i < 16; ++i) y0[m][c.rows[m] + i] = 12345.0f + i;
    dy.emplace_back(y0[m].size());
    dy.back().upload(y0[m]);
  }
  cuda::GemvRequest req;
  req.x = dx.data();
  req.norm_weight = c.norm ? dg.data() : nullptr;
  req.norm_eps = eps;
  req.n_out = n_out;
  req.epilogue = c.epilogue;
  for (int m = 0; m < n_out; ++m) req.out[m] = {&mats[m], dy[m].data()};
  cuda::gemv(req, nullptr, ctx);
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());

  auto silu = [](double v) { return v / (1.0 + std::exp(-v)); };
  for (int m = 0; m < n_out; ++m) {
    const auto y = dy[m].download();
    for (int i = 0; i < 16; ++i) ASSERT_EQ(y[c.rows[m] + i], 12345.0f + i) << "output " << m << " wrote past the end";
    for (int r = 0; r < c.rows[m]; ++r) {
      double want = ref[m][r], tol = bound[m][r];
      if (c.epilogue == cuda::GemvEpilogue::add) {
        want += y0[m][r];
        tol += 1e-6 * std::fabs(want);
      } else if (c.epilogue == cuda::GemvEpilogue::swiglu) {
        if (m == 1) {
          ASSERT_EQ(y[r], y0[1][r]) << "swiglu wrote the up output, row " << r;
          continue;
        }
        const double gv = ref[0][r], uv = ref[1][r], eg = bound[0][r], eu = bound[1][r];
        want = silu(gv) * uv;
        tol = 1.1 * eg * (std::fabs(uv) + eu) + (std::fabs(silu(gv)) + 1.1 * eg) * eu + 1e-6 * std::fabs(want) + 1e-6;
      }
      ASSERT_TRUE(std::isfinite(y[r])) << "output " << m << " row " << r << " not written";
      ASSERT_LE(std::fabs(y[r] - want), tol) << "output " << m << " row " << r << " gpu " << y[r] << " ref " << want;
    }
  }
}

std::vector<FusedCase> fused_cases() {
  using E = cuda::GemvEpilogue;
  std::vector<FusedCase> out;
  for (TensorType t : {TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q8_0, TensorType::Q4_0,
                       TensorType::Q1_0, TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K, TensorType::Q5_K,
                       TensorType::Q6_K}) {
    out.push_back({t, 512, {37, 5, 11}, true, E::store});  // Q/K/V-like: three heights, one launch
    out.push_back({t, 768, {131}, false, E::add});         // residual update
    out.push_back({t, 512, {67, 67}, true, E::swiglu});    // gate/up
  }
  out.push_back({TensorType::Q1_0, 4096, {300, 64, 64}, true, E::store});
  out.push_back({TensorType::Q1_0, 12288, {41}, false, E::add});
  out.push_back({TensorType::BF16, 4096, {97, 97}, true, E::swiglu});
  out.push_back({TensorType::BF16, 12288, {23}, false, E::add});
  out.push_back({TensorType::Q4_K, 4096, {300, 64, 64}, true, E::store});
  out.push_back({TensorType::Q6_K, 12288, {41}, false, E::add});
  out.push_back({TensorType::Q5_K, 4096, {97, 97}, true, E::swiglu});
  return out;
}

std::string fused_name(const ::testing::TestParamInfo<FusedCase>& info) {
  const auto& p = info.param;
  const char* ep = p.epilogue == cuda::GemvEpilogue::store ? "store" : p.epilogue == cuda::GemvEpilogue::add ? "add" : "swiglu";
  std::string name = std::string(gguf::tensor_type_name(p.type)) + "_c" + std::to_string(p.cols) + "_" + ep +
                     (p.norm ? "_norm" : "");
  for (int r : p.rows) name += "_" + std::to_string(r);
  return name;
}

INSTANTIATE_TEST_SUITE_P(Fused, GemvFusedTest, ::testing::ValuesIn(fused_cases()), fused_name);

}  // namespace
