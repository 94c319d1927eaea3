// CPU kernels against plain scalar definitions written from the formats.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include <omp.h>

#include "backend/cpu/kernels.hpp"
#include "core/error.hpp"
#include "forward_test_util.hpp"
#include "gguf/quant.hpp"

using namespace kvq;
using gguf::TensorType;
using testutil::quantize;
using testutil::weight_at;

namespace {

const TensorType kAllTypes[] = {TensorType::F32, TensorType::F16, TensorType::BF16,
                                TensorType::Q8_0, TensorType::Q4_0, TensorType::Q1_0};

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

}  // namespace

TEST(ForwardKernels, DequantizeMatchesScalarLayout) {
  Rng rng(1);
  for (TensorType t : kAllTypes) {
    const int64_t n = 512;
    const auto x = testutil::randn(rng, n, 2.0f);
    const auto q = quantize(t, x.data(), n);
    ASSERT_EQ(q.size(), cpu::row_bytes(t, n));
    std::vector<float> got(n);
    cpu::dequantize_row(t, q.data(), got.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], weight_at(t, q.data(), i)) << int(t) << " at " << i;
  }
}

TEST(ForwardKernels, QuantizedValuesAreCloseToTheirSource) {
  // Guards the test quantizers themselves: the types decode to roughly the input.
  Rng rng(2);
  const int64_t n = 1024;
  const auto x = testutil::randn(rng, n, 1.0f);
  const std::pair<TensorType, double> bounds[] = {
      {TensorType::F16, 1e-3}, {TensorType::BF16, 1e-2}, {TensorType::Q8_0, 0.03}, {TensorType::Q4_0, 0.35}};
  for (auto [t, bound] : bounds) {
    const auto q = quantize(t, x.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(weight_at(t, q.data(), i), x[i], bound * 3.5) << int(t);
  }
  const auto q1 = quantize(TensorType::Q1_0, x.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(weight_at(TensorType::Q1_0, q1.data(), i) > 0, x[i] >= 0);
}

TEST(ForwardKernels, DotRowEqualsDequantizeThenDot) {
  Rng rng(3);
  for (TensorType t : kAllTypes) {
    for (int64_t n : {128, 384, 4096}) {
      const auto w = testutil::randn(rng, n, 1.0f);
      const auto x = testutil::randn(rng, n, 1.0f);
      const auto q = quantize(t, w.data(), n);
      double ref = 0, mag = 0;
      for (int64_t i = 0; i < n; ++i) {
        ref += double(weight_at(t, q.data(), i)) * x[i];
        mag += std::fabs(double(weight_at(t, q.data(), i)) * x[i]);
      }
      const float got = cpu::dot_row(t, q.data(), x.data(), n);
      EXPECT_NEAR(got, ref, 1e-5 * mag + 1e-6) << "type " << int(t) << " n " << n;
    }
  }
}

TEST(ForwardKernels, MatmulTiledAndFusedPathsAgreeWithDoubleReference) {
  Rng rng(4);
  for (TensorType t : kAllTypes) {
    const int64_t rows = 37, cols = 256;  // odd row count: exercises the tile tail
    const auto w = testutil::randn(rng, rows * cols, 0.5f);
    std::vector<uint8_t> bytes;
    for (int64_t r = 0; r < rows; ++r) {
      auto q = quantize(t, w.data() + r * cols, cols);
      bytes.insert(bytes.end(), q.begin(), q.end());
    }
    Matrix m{t, rows, cols, bytes.data(), cpu::row_bytes(t, cols)};
    for (int n_tok : {1, 3, 4, 9}) {
      const auto x = testutil::randn(rng, size_t(n_tok) * cols, 1.0f);
      std::vector<float> y(size_t(n_tok) * rows + 1, 12345.0f);  // sentinel after the output
      cpu::matmul(m, x.data(), n_tok, y.data());
      EXPECT_EQ(y.back(), 12345.0f) << "matmul wrote past its output";
      for (int tt = 0; tt < n_tok; ++tt)
        for (int64_t r = 0; r < rows; ++r) {
          double ref = 0, mag = 0;
          for (int64_t c = 0; c < cols; ++c) {
            const double p = double(weight_at(t, m.row(r), c)) * x[tt * cols + c];
            ref += p;
            mag += std::fabs(p);
          }
          ASSERT_NEAR(y[tt * rows + r], ref, 1e-5 * mag + 1e-6) << "type " << int(t) << " tokens " << n_tok;
        }
    }
  }
}

TEST(ForwardKernels, MatmulDoesNotDependOnThreadCount) {
  Rng rng(5);
  const int64_t rows = 64, cols = 256;
  const auto w = testutil::randn(rng, rows * cols, 0.5f);
  const auto q = quantize(TensorType::Q8_0, w.data(), rows * cols);
  Matrix m{TensorType::Q8_0, rows, cols, q.data(), cpu::row_bytes(TensorType::Q8_0, cols)};
  const auto x = testutil::randn(rng, 8 * cols, 1.0f);
  std::vector<float> y1(8 * rows), y2(8 * rows);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  cpu::matmul(m, x.data(), 8, y1.data());
  omp_set_num_threads(3);
  cpu::matmul(m, x.data(), 8, y2.data());
  omp_set_num_threads(saved);
  EXPECT_EQ(y1, y2);
}

TEST(ForwardKernels, RmsNorm) {
  const std::vector<float> x = {1, -2, 3, -4, 0.5f, 0.25f, 2, 2};
  const std::vector<float> w = {1, 2, 0.5f, 1};
  std::vector<float> y(8);
  cpu::rms_norm(x.data(), w.data(), 2, 4, 1e-6f, y.data());
  for (int r = 0; r < 2; ++r) {
    double ss = 0;
    for (int i = 0; i < 4; ++i) ss += x[r * 4 + i] * x[r * 4 + i];
    const double inv = 1.0 / std::sqrt(ss / 4 + 1e-6);
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(y[r * 4 + i], x[r * 4 + i] * inv * w[i], 1e-6);
  }
}

TEST(ForwardKernels, RopeNeoxRotatesHalvesAndNormalRotatesPairs) {
  const int hd = 8, half = 4;
  Rope r;
  r.inv_freq = {1.0f, 0.5f, 0.25f, 0.125f};
  std::vector<float> base(hd);
  std::iota(base.begin(), base.end(), 1.0f);
  const int pos = 3;
  for (bool neox : {true, false}) {
    r.neox = neox;
    auto x = base;
    cpu::rope(x.data(), 1, 1, hd, pos, r);
    for (int i = 0; i < half; ++i) {
      const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
      const double a = pos * double(r.inv_freq[i]);
      EXPECT_NEAR(x[i0], base[i0] * std::cos(a) - base[i1] * std::sin(a), 1e-5) << neox;
      EXPECT_NEAR(x[i1], base[i0] * std::sin(a) + base[i1] * std::cos(a), 1e-5) << neox;
    }
  }
}

TEST(ForwardKernels, RopeDotProductDependsOnlyOnRelativePosition) {
  Rng rng(6);
  const int hd = 64;
  ModelConfig cfg;
  cfg.head_dim = hd;
  cfg.rope.theta = 10000;
  for (bool neox : {true, false}) {
    cfg.rope.neox = neox;
    const Rope r = make_rope(cfg);
    const auto q0 = testutil::randn(rng, hd, 1.0f), k0 = testutil::randn(rng, hd, 1.0f);
    auto dot_at = [&](int pq, int pk) {
      auto q = q0, k = k0;
      cpu::rope(q.data(), 1, 1, hd, pq, r);
      cpu::rope(k.data(), 1, 1, hd, pk, r);
      return cpu::dot_f32(q.data(), k.data(), hd);
    };
    EXPECT_NEAR(dot_at(10, 7), dot_at(103, 100), 1e-3);
    EXPECT_NEAR(dot_at(0, 0), cpu::dot_f32(q0.data(), k0.data(), hd), 1e-4);
  }
}

TEST(ForwardKernels, Llama3RopeScalingFollowsTheReferenceFormula) {
  ModelConfig cfg;
  cfg.head_dim = 128;
  cfg.rope.theta = 500000;
  cfg.rope.scaling = RopeScaling::llama3;
  cfg.rope.factor = 8;
  cfg.rope.low_freq_factor = 1;
  cfg.rope.high_freq_factor = 4;
  cfg.rope.original_context = 8192;
  const Rope r = make_rope(cfg);
  int n_high = 0, n_low = 0, n_mid = 0;
  for (int i = 0; i < 64; ++i) {
    const double f = 1.0 / std::pow(500000.0, 2.0 * i / 128);
    const double wavelen = 2 * M_PI / f;
    double want;
    if (wavelen < 8192 / 4.0) { want = f; ++n_high; }
    else if (wavelen > 8192 / 1.0) { want = f / 8; ++n_low; }
    else {
      const double s = (8192 / wavelen - 1) / (4 - 1);
      want = (1 - s) * f / 8 + s * f;
      ++n_mid;
    }
    EXPECT_NEAR(r.inv_freq[i], want, 1e-6 * f) << i;
  }
  EXPECT_GT(n_high, 0);
  EXPECT_GT(n_low, 0);
  EXPECT_GT(n_mid, 0);
  // Explicit rope_freqs factors take precedence over the config formula.
  std::vector<float> factors(64, 2.0f);
  const Rope r2 = make_rope(cfg, factors);
  EXPECT_NEAR(r2.inv_freq[5], 0.5 / std::pow(500000.0, 10.0 / 128), 1e-7);  // float storage
}

TEST(ForwardKernels, SwigluAndSoftmax) {
  const std::vector<float> g = {-2, 0, 1, 5}, u = {1, 2, 3, -1};
  std::vector<float> o(4);
  cpu::swiglu(g.data(), u.data(), o.data(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(o[i], g[i] / (1 + std::exp(-g[i])) * u[i], 1e-6);
  std::vector<float> s = {1, 2, -INFINITY, 3};
  cpu::softmax(s.data(), 4);
  const double z = std::exp(-2.0) + std::exp(-1.0) + 1;
  EXPECT_NEAR(s[0], std::exp(-2.0) / z, 1e-6);
  EXPECT_EQ(s[2], 0.0f);
  EXPECT_NEAR(s[3], 1 / z, 1e-6);
}

TEST(ForwardKernels, AttentionIsCausalGqa) {
  Rng rng(7);
  const int nh = 4, nkv = 2, hd = 16, pos = 5, n = 3, ctx = pos + n;
  const auto q = testutil::randn(rng, size_t(n) * nh * hd, 1.0f);
  const auto k = testutil::randn(rng, size_t(ctx) * nkv * hd, 1.0f);
  const auto v = testutil::randn(rng, size_t(ctx) * nkv * hd, 1.0f);
  std::vector<float> out(size_t(n) * nh * hd);
  const float scale = 0.25f;
  cpu::attention_f32(q.data(), k.data(), v.data(), pos, n, nh, nkv, hd, scale, out.data());
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < nh; ++h) {
      const int kvh = h / (nh / nkv);
      std::vector<double> p(pos + t + 1);
      double m = -1e300, z = 0;
      for (int j = 0; j <= pos + t; ++j) {
        double s = 0;
        for (int d = 0; d < hd; ++d) s += double(q[(t * nh + h) * hd + d]) * k[(j * nkv + kvh) * hd + d];
        p[j] = s * scale;
        m = std::max(m, p[j]);
      }
      for (double& x : p) z += (x = std::exp(x - m));
      for (int d = 0; d < hd; ++d) {
        double o = 0;
        for (int j = 0; j <= pos + t; ++j) o += p[j] / z * v[(j * nkv + kvh) * hd + d];
        ASSERT_NEAR(out[(t * nh + h) * hd + d], o, 1e-5);
      }
    }
}

TEST(ForwardKernels, UnsupportedTypeIsAClearError) {
  EXPECT_FALSE(cpu::supports_weight_type(TensorType(6)));  // Q5_0
  try {
    cpu::block_size(TensorType(6));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported);
    EXPECT_NE(std::string(e.what()).find("Q1_0"), std::string::npos);
  }
}

// The gguf layer's scalar reference (de)quantizers are the project's oracle
// for the type table; the CPU kernels must agree with them exactly.
TEST(ForwardKernels, AgreeWithTheGgufReferenceDequantizer) {
  Rng rng(8);
  for (TensorType t : kAllTypes) {
    const int64_t n = 1024;
    const auto x = testutil::randn(rng, n, 1.5f);
    std::vector<uint8_t> q(cpu::row_bytes(t, n));
    gguf::quantize_row(t, x.data(), q.data(), n);
    std::vector<float> ref(n), got(n);
    gguf::dequantize_row(t, q.data(), ref.data(), n);
    cpu::dequantize_row(t, q.data(), got.data(), n);
    EXPECT_EQ(got, ref) << "type " << int(t);
    const auto v = testutil::randn(rng, n, 1.0f);
    double dot = 0, mag = 0;
    for (int64_t i = 0; i < n; ++i) dot += double(ref[i]) * v[i], mag += std::fabs(double(ref[i]) * v[i]);
    EXPECT_NEAR(cpu::dot_row(t, q.data(), v.data(), n), dot, 1e-5 * mag) << "type " << int(t);
  }
}
