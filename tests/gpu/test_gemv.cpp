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

// The quantization step of each input element as the GPU rounds it: int8
// per 32 values (gemv.hpp). The rounding error of an element is at most half
// its step.
std::vector<float> input_steps(TensorType t, const std::vector<float>& u) {
  const size_t group = 32;
  const float levels = 127.0f;
  std::vector<float> step(u.size());
  for (size_t g0 = 0; g0 < u.size(); g0 += group) {
    float amax = 0;
    for (size_t j = g0; j < std::min(u.size(), g0 + group); ++j) amax = std::max(amax, std::fabs(u[j]));
    for (size_t j = g0; j < std::min(u.size(), g0 + group); ++j) step[j] = amax / levels;
  }
  return step;
}

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
  const std::vector<float> step = input_steps(c.type, x);
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
  const std::vector<float> step = input_steps(c.type, u);

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

// gemv_chain (the block after the attention in one launch, grid-wide
// barriers between O, gate/up and down) against the three launches it
// replaces, whose arithmetic it shares: equal bit for bit. Two chains run
// concurrently on two streams, so that CTAs of one wait at their barriers
// while the other holds SMs (a barrier that needed every CTA resident could
// hang there); each launch must leave its barrier state ready for the next.
namespace {

struct ChainCase {
  int d, ff;
  bool with_o;
};

class GemvChainTest : public ::testing::TestWithParam<ChainCase> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

cuda::GpuMatrix random_q1(Rng& rng, int rows, int cols) {
  const uint64_t rb = gguf::tensor_row_bytes(TensorType::Q1_0, cols);
  std::vector<uint8_t> w(rb * rows);
  std::vector<float> row(cols);
  for (int r = 0; r < rows; ++r) {
    for (auto& v : row) v = float(rng.normal()) * 0.05f;
    gguf::quantize_row(TensorType::Q1_0, row.data(), w.data() + r * rb, cols);
  }
  return cuda::GpuMatrix::upload(pack_matrix_for_gpu(TensorType::Q1_0, rows, cols, w.data()));
}

std::vector<float> random_vector(Rng& rng, size_t n, float scale, float offset = 0.0f) {
  std::vector<float> v(n);
  for (auto& x : v) x = offset + float(rng.normal()) * scale;
  return v;
}

TEST_P(GemvChainTest, EqualsTheSeparateLaunches) {
  const ChainCase c = GetParam();
  Rng rng(uint64_t(c.d) * 31 + c.ff + (c.with_o ? 7 : 0));
  // Two layers' weights: one per stream.
  struct Layer {
    cuda::GpuMatrix wo, gate, up, down;
  };
  std::vector<Layer> layers;
  for (int l = 0; l < 2; ++l)
    layers.push_back({random_q1(rng, c.d, c.d), random_q1(rng, c.ff, c.d), random_q1(rng, c.ff, c.d),
                      random_q1(rng, c.d, c.ff)});
  const std::vector<float> x0 = random_vector(rng, c.d, 1.0f), attn = random_vector(rng, c.d, 1.0f),
                           g = random_vector(rng, c.d, 0.2f, 1.0f);
  cuda::DeviceBuffer<float> d_attn(c.d), d_g(c.d);
  d_attn.upload(attn);
  d_g.upload(g);
  const float eps = 1e-6f;

  // The three launches, `steps` times over x (each step feeds the next).
  const int steps = 12;
  auto separate = [&](const Layer& L) {
    cuda::DeviceBuffer<float> x(c.d), act(c.ff);
    x.upload(x0);
    for (int s = 0; s < steps; ++s) {
      if (c.with_o) {
        cuda::GemvRequest o;
        o.x = d_attn.data();
        o.out[0] = {&L.wo, x.data()};
        o.epilogue = cuda::GemvEpilogue::add;
        cuda::gemv(o, nullptr);
      }
      cuda::GemvRequest gu;
      gu.x = x.data();
      gu.norm_weight = d_g.data();
      gu.norm_eps = eps;
      gu.n_out = 2;
      gu.out[0] = {&L.gate, act.data()};
      gu.out[1] = {&L.up, nullptr};
      gu.epilogue = cuda::GemvEpilogue::swiglu;
      cuda::gemv(gu, nullptr);
      cuda::GemvRequest dn;
      dn.x = act.data();
      dn.out[0] = {&L.down, x.data()};
      dn.epilogue = cuda::GemvEpilogue::add;
      cuda::gemv(dn, nullptr);
    }
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    return x.download();
  };
  const std::vector<float> want0 = separate(layers[0]), want1 = separate(layers[1]);

  cudaStream_t streams[2];
  for (auto& s : streams) KVQ_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cuda::DeviceBuffer<unsigned> state(2 * cuda::gemv_chain_state_words());
  KVQ_CUDA_CHECK(cudaMemset(state.data(), 0, state.bytes()));
  std::vector<cuda::DeviceBuffer<float>> xs, acts;
  std::vector<cuda::GemvChainRequest> reqs(2);
  for (int l = 0; l < 2; ++l) {
    xs.emplace_back(c.d);
    xs.back().upload(x0);
    acts.emplace_back(c.ff);
  }
  for (int l = 0; l < 2; ++l) {
    cuda::GemvChainRequest& r = reqs[size_t(l)];
    r.wo = c.with_o ? &layers[size_t(l)].wo : nullptr;
    r.attn = d_attn.data();
    r.x = xs[size_t(l)].data();
    r.norm_weight = d_g.data();
    r.norm_eps = eps;
    r.gate = &layers[size_t(l)].gate;
    r.up = &layers[size_t(l)].up;
    r.down = &layers[size_t(l)].down;
    r.act = acts[size_t(l)].data();
    r.state = state.data() + size_t(l) * cuda::gemv_chain_state_words();
    ASSERT_TRUE(cuda::gemv_chain_supported(r));
  }
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  for (int s = 0; s < steps; ++s)
    for (int l = 0; l < 2; ++l) cuda::gemv_chain(reqs[size_t(l)], streams[l]);
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got0 = xs[0].download(), got1 = xs[1].download();
  for (auto& s : streams) KVQ_CUDA_CHECK(cudaStreamDestroy(s));
  ASSERT_EQ(std::memcmp(got0.data(), want0.data(), want0.size() * sizeof(float)), 0) << "chain 0";
  ASSERT_EQ(std::memcmp(got1.data(), want1.data(), want1.size() * sizeof(float)), 0) << "chain 1";
  for (float v : got0) ASSERT_TRUE(std::isfinite(v));
  // Every launch left its state zeroed.
  const std::vector<unsigned> st = state.download();
  for (size_t i = 0; i < st.size(); ++i) ASSERT_EQ(st[i], 0u) << "state word " << i;
}

TEST(GemvChain, RejectsWhatItDoesNotFuse) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  Rng rng(5);
  cuda::GpuMatrix gate = random_q1(rng, 4352, 512), up = random_q1(rng, 4352, 512), down = random_q1(rng, 512, 4352);
  cuda::DeviceBuffer<float> x(512), act(4352);
  cuda::DeviceBuffer<unsigned> state(cuda::gemv_chain_state_words());
  cuda::GemvChainRequest r;
  r.x = x.data();
  r.gate = &gate;
  r.up = &up;
  r.down = &down;
  r.act = act.data();
  r.state = state.data();
  EXPECT_TRUE(cuda::gemv_chain_supported(r));
  r.state = nullptr;
  EXPECT_FALSE(cuda::gemv_chain_supported(r));  // no barrier state
  r.state = state.data();
  r.down = &gate;
  EXPECT_FALSE(cuda::gemv_chain_supported(r));  // down's shape is not gate's transpose
  // A non-Q1_0 down.
  std::vector<uint8_t> w(gguf::tensor_row_bytes(TensorType::Q8_0, 4352) * 512);
  cuda::GpuMatrix q8 = cuda::GpuMatrix::upload(pack_matrix_for_gpu(TensorType::Q8_0, 512, 4352, w.data()));
  r.down = &q8;
  EXPECT_FALSE(cuda::gemv_chain_supported(r));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemvChainTest,
                         ::testing::Values(ChainCase{512, 4352, true}, ChainCase{512, 4352, false},
                                           ChainCase{4096, 12288, true}, ChainCase{1024, 8192, true}),
                         [](const ::testing::TestParamInfo<ChainCase>& i) {
                           return "d" + std::to_string(i.param.d) + "_ff" + std::to_string(i.param.ff) +
                                  (i.param.with_o ? "_o" : "");
                         });

}  // namespace
