// The CUDA backend's forward ops vs the CPU backend (backend/cpu/kernels.cpp,
// the oracle) on random inputs of odd shapes, through the Backend interface
// the forward pass uses. Outputs go to NaN-poisoned device buffers followed
// by sentinels. Bounds are `tol + |ref| * eps` per element, with the reason
// for each tolerance next to it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/kernels.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/device_buffer.hpp"
#include "backend/cuda/ops.hpp"
#include "core/error.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "gguf/quant.hpp"
#include "gpu_test_util.hpp"

using namespace kvq;
using gputest::normal;
using gguf::TensorType;
using gputest::Guarded;

namespace {


// Quantized test matrix [rows][cols] of type t, values ~ N(0, 0.05^2).
std::vector<uint8_t> random_matrix(Rng& rng, TensorType t, int rows, int cols) {
  const uint64_t rb = gguf::tensor_row_bytes(t, cols);
  std::vector<uint8_t> w(rb * rows);
  std::vector<float> row(cols);
  for (int r = 0; r < rows; ++r) {
    for (auto& v : row) v = float(rng.normal()) * 0.05f;
    gguf::quantize_row(t, row.data(), w.data() + r * rb, cols);
  }
  return w;
}

Matrix host_matrix(TensorType t, int rows, int cols, const std::vector<uint8_t>& bytes) {
  Matrix m;
  m.type = t;
  m.rows = rows;
  m.cols = cols;
  m.data = bytes.data();
  m.row_bytes = gguf::tensor_row_bytes(t, cols);
  return m;
}

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    KVQ_SKIP_WITHOUT_GPU();
    gpu = cuda::make_cuda_backend();
  }
  std::unique_ptr<Backend> gpu;
  Rng rng{20261130};
};

TEST_F(CudaOps, RmsNormMatchesCpu) {
  for (auto [rows, dim] : {std::pair{1, 256}, {3, 33}, {17, 128}, {5, 4096}, {2, 5000}}) {
    const auto x = normal(rng, size_t(rows) * dim, 3.0f), w = normal(rng, dim);
    std::vector<float> ref(x.size());
    cpu::rms_norm(x.data(), w.data(), rows, dim, 1e-6f, ref.data());
    Guarded dx(x.size(), &x), dw(w.size(), &w), dy(x.size());
    gpu->rms_norm(dx.data(), dw.data(), rows, dim, 1e-6f, dy.data());
    const auto y = dy.result();
    // Same formula, sum of squares in double in another order: inv may differ by an ulp.
    for (size_t i = 0; i < y.size(); ++i)
      ASSERT_LE(std::fabs(y[i] - ref[i]), 1e-7 + 5e-7 * std::fabs(ref[i])) << rows << "x" << dim << " at " << i;
    // In place.
    gpu->rms_norm(dx.data(), dw.data(), rows, dim, 1e-6f, dx.data());
    const auto yi = dx.result();
    for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(yi[i], y[i]) << "in-place result differs at " << i;
  }
}

TEST_F(CudaOps, RopeMatchesCpuBothStyles) {
  for (bool neox : {true, false}) {
    for (auto [n, heads, hd, pos, pscale] : {std::tuple{5, 3, 64, 0, 1.0}, {3, 7, 128, 40000, 1.0},
                                             {9, 2, 256, 123, 0.25}, {1, 32, 128, 65535, 1.0}}) {
      Rope r;
      r.neox = neox;
      r.pos_scale = pscale;
      for (int i = 0; i < hd / 2; ++i) r.inv_freq.push_back(float(std::pow(1e6, -2.0 * i / hd)));
      const auto x = normal(rng, size_t(n) * heads * hd);
      auto ref = x;
      cpu::rope(ref.data(), n, heads, hd, pos, r);
      Guarded dx(x.size(), &x);
      gpu->rope(dx.data(), n, heads, hd, pos, r);
      const auto y = dx.result();
      // cos/sin in double on both sides; the float rotation may be fused (fma)
      // on the GPU: a few ulps of |x0| + |x1| (<= ~10 for N(0,1) inputs).
      for (size_t i = 0; i < y.size(); ++i)
        ASSERT_LE(std::fabs(y[i] - ref[i]), 4e-6 + 1e-6 * std::fabs(ref[i]))
            << (neox ? "neox" : "normal") << " n=" << n << " hd=" << hd << " pos=" << pos << " at " << i;
    }
  }
}

// The fused single-token q/k norm + RoPE + KV store (qk_rope_store) vs the
// CPU reference ops: rms_norm per head, rope, bf16 rows like the `none` block.
TEST_F(CudaOps, QkRopeStoreMatchesCpu) {
  for (bool neox : {true, false}) {
    for (auto [nh, nkv, hd, pos, with_norm] : {std::tuple{32, 8, 128, 4097, true}, {7, 1, 64, 0, true},
                                              {4, 2, 256, 65535, false}, {12, 12, 128, 3, true}}) {
      Rope r;
      r.neox = neox;
      for (int i = 0; i < hd / 2; ++i) r.inv_freq.push_back(float(std::pow(1e6, -2.0 * i / hd)));
      auto q = normal(rng, size_t(nh) * hd, 2.0f), k = normal(rng, size_t(nkv) * hd, 2.0f),
           v = normal(rng, size_t(nkv) * hd, 2.0f);
      v[0] = std::numeric_limits<float>::quiet_NaN();  // sanitised to 0 in the cache
      v[1] = 1e9f;                                     // clamped to 65504
      const auto qn = normal(rng, hd), kn = normal(rng, hd);
      auto rq = q, rk = k;
      if (with_norm) {
        cpu::rms_norm(rq.data(), qn.data(), nh, hd, 1e-6f, rq.data());
        cpu::rms_norm(rk.data(), kn.data(), nkv, hd, 1e-6f, rk.data());
      }
      cpu::rope(rq.data(), 1, nh, hd, pos, r);
      cpu::rope(rk.data(), 1, nkv, hd, pos, r);
      const int max_tokens = pos + 2;
      cuda::DeviceBuffer<uint16_t> kc(size_t(nkv) * max_tokens * hd), vc(kc.size());
      KVQ_CUDA_CHECK(cudaMemset(kc.data(), 0, kc.bytes()));
      KVQ_CUDA_CHECK(cudaMemset(vc.data(), 0, vc.bytes()));
      cuda::DeviceBuffer<float> freq(r.inv_freq.size()), dqn(hd), dkn(hd);
      freq.upload(r.inv_freq);
      dqn.upload(qn);
      dkn.upload(kn);
      Guarded dq(q.size(), &q), dk(k.size(), &k), dv(v.size(), &v);
      const cuda::KvLayerView view{kc.data(), vc.data(), nkv, hd, max_tokens};
      cuda::qk_rope_store(dq.data(), dk.data(), dv.data(), nh, nkv, hd, with_norm ? dqn.data() : nullptr,
                          with_norm ? dkn.data() : nullptr, 1e-6f, pos, nullptr, freq.data(), neox, 1.0, view, nullptr);
      const auto yq = dq.result(), yk = dk.result(), yv = dv.result();
      // As RmsNormMatchesCpu and RopeMatchesCpuBothStyles combined (norm outputs up to ~10).
      for (size_t i = 0; i < yq.size(); ++i)
        ASSERT_LE(std::fabs(yq[i] - rq[i]), 2e-5 + 2e-6 * std::fabs(rq[i])) << "q at " << i << (neox ? " neox" : "");
      for (size_t i = 0; i < yk.size(); ++i)
        ASSERT_LE(std::fabs(yk[i] - rk[i]), 2e-5 + 2e-6 * std::fabs(rk[i])) << "k at " << i << (neox ? " neox" : "");
      for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(std::memcmp(&yv[i], &v[i], 4), 0) << "v input changed at " << i;
      std::vector<uint16_t> hk(kc.size()), hv(vc.size());
      KVQ_CUDA_CHECK(cudaMemcpy(hk.data(), kc.data(), kc.bytes(), cudaMemcpyDeviceToHost));
      KVQ_CUDA_CHECK(cudaMemcpy(hv.data(), vc.data(), vc.bytes(), cudaMemcpyDeviceToHost));
      for (int h = 0; h < nkv; ++h)
        for (int t = 0; t < max_tokens; ++t)
          for (int d = 0; d < hd; ++d) {
            const size_t at = (size_t(h) * max_tokens + t) * hd + d;
            const size_t src = size_t(h) * hd + d;
            if (t != pos) {
              ASSERT_EQ(hk[at], 0) << "K row " << t << " written";
              ASSERT_EQ(hv[at], 0) << "V row " << t << " written";
              continue;
            }
            ASSERT_EQ(hk[at], f32_to_bf16(yk[src])) << "K cache head " << h << " dim " << d;
            const float vv = std::isnan(v[src]) ? 0.0f : std::min(std::max(v[src], -65504.0f), 65504.0f);
            ASSERT_EQ(hv[at], f32_to_bf16(vv)) << "V cache head " << h << " dim " << d;
          }
    }
  }
}

TEST_F(CudaOps, SwigluAndAddMatchCpu) {
  for (size_t n : {size_t(1), size_t(1000), size_t(12289), size_t(3 * 12288 + 7)}) {
    const auto g = normal(rng, n, 4.0f), u = normal(rng, n);
    std::vector<float> ref(n);
    cpu::swiglu(g.data(), u.data(), ref.data(), n);
    Guarded dg(n, &g), du(n, &u), dy(n);
    gpu->swiglu(dg.data(), du.data(), dy.data(), n);
    auto y = dy.result();
    // expf (<= 2 ulp) vs std::exp, then one division and one product: a few ulps.
    for (size_t i = 0; i < n; ++i) ASSERT_LE(std::fabs(y[i] - ref[i]), 1e-30 + 1e-6 * std::fabs(ref[i])) << i;
    gpu->swiglu(dg.data(), du.data(), dg.data(), n);  // in place
    const auto yi = dg.result();
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(yi[i], y[i]) << "in-place swiglu differs at " << i;

    auto sum = g;
    cpu::add(sum.data(), u.data(), n);
    Guarded da(n, &g);
    gpu->add(da.data(), du.data(), n);
    const auto s = da.result();
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(s[i], sum[i]) << "add at " << i;  // one IEEE add: exact
  }
}

// argmax over rows on the device vs the host rule (Backend's default: NaN is
// -inf, the lowest index wins ties), with the winning values; rows of odd
// lengths in a padded stride, ties, NaN, and a row of only NaN / -inf.
TEST_F(CudaOps, ArgmaxRowsFollowsTheGreedyRule) {
  auto cpu_be = cpu::make_cpu_backend();
  for (int n : {1, 37, 151936}) {
    for (int rows : {1, 3, 64}) {
      const size_t stride = size_t(n) + 5;
      std::vector<float> x = normal(rng, stride * rows);
      if (n > 10) {
        x[3] = std::numeric_limits<float>::quiet_NaN();                 // NaN never wins
        if (rows > 1) x[stride + 7] = x[stride + 9] = 1e30f;            // tie: the lower index
        if (rows > 2)
          for (int i = 0; i < n; ++i) x[2 * stride + size_t(i)] = i % 2 ? -INFINITY : std::nanf("");
      }
      std::vector<int32_t> want(static_cast<size_t>(rows)), got(static_cast<size_t>(rows));
      std::vector<float> want_v(static_cast<size_t>(rows)), got_v(static_cast<size_t>(rows));
      cpu_be->argmax_rows(x.data(), rows, size_t(n), stride, want.data(), want_v.data());
      Guarded dx(x.size(), &x);
      gpu->argmax_rows(dx.data(), rows, size_t(n), stride, got.data(), got_v.data());
      EXPECT_EQ(got, want) << n << " x " << rows;
      for (int r = 0; r < rows; ++r) EXPECT_EQ(got_v[size_t(r)], want_v[size_t(r)]) << n << " row " << r;
      if (rows > 2 && n > 10) EXPECT_EQ(got_v[2], -INFINITY);
      if (n > 10 && rows > 1) EXPECT_EQ(got[1], 7);
      gpu->argmax_rows(dx.data(), rows, size_t(n), stride, got.data(), got_v.data());  // state left clean
      EXPECT_EQ(got, want);
    }
  }
}

const TensorType kTypes[] = {TensorType::F32,  TensorType::F16,  TensorType::BF16, TensorType::Q8_0,
                             TensorType::Q4_0, TensorType::Q1_0, TensorType::Q2_K, TensorType::Q3_K,
                             TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K};

TEST_F(CudaOps, EmbedMatchesCpuExactly) {
  auto cpu_be = cpu::make_cpu_backend();
  for (TensorType t : kTypes) {
    const int rows = 37, cols = 512;
    const auto bytes = random_matrix(rng, t, rows, cols);
    const Matrix host = host_matrix(t, rows, cols, bytes);
    const Matrix dev = gpu->upload(host);
    const std::vector<int32_t> ids = {0, 36, 5, 5, 17, 1, 30};
    const int n = int(ids.size());
    std::vector<float> ref(size_t(n) * cols);
    cpu_be->embed(host, ids.data(), n, ref.data());
    Guarded out(ref.size());
    gpu->embed(dev, ids.data(), n, out.data());
    const auto y = out.result();
    // Same dequantization arithmetic (d * q in fp32): bit-identical.
    for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], ref[i]) << gguf::tensor_type_name(t) << " at " << i;
    const int32_t bad = rows;
    EXPECT_THROW(gpu->embed(dev, &bad, 1, out.data()), Error);
  }
}

// Prefill GEMM (n > 1): bf16 weight tile x bf16 activations, fp32 accumulate.
struct MatmulCase {
  TensorType type;
  int rows, cols, n;
};

class CudaMatmul : public ::testing::TestWithParam<MatmulCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaMatmul, PrefillMatchesDoubleReference) {
  const MatmulCase c = GetParam();
  Rng rng(uint64_t(c.rows) * 7919 + c.cols * 31 + c.n + int(c.type));
  auto gpu = cuda::make_cuda_backend();
  const auto bytes = random_matrix(rng, c.type, c.rows, c.cols);
  const Matrix host = host_matrix(c.type, c.rows, c.cols, bytes);
  const auto x = normal(rng, size_t(c.n) * c.cols);
  const Matrix dev = gpu->upload(host);
  Guarded dx(x.size(), &x), dy(size_t(c.n) * c.rows);
  gpu->matmul(dev, dx.data(), c.n, dy.data());
  const auto y = dy.result();

  // Each weight (dequantized in fp32) and each x value is rounded once to bf16
  // (relative error <= 2^-9 each, so <= 2^-8 + 2^-18 for the product); the
  // fp32 accumulation adds <= cols * 2^-24 relative. Both scale with
  // sum_j |w_j x_j|, computed here in double from the stored weights.
  std::vector<float> wrow(c.cols);
  const uint64_t rb = gguf::tensor_row_bytes(c.type, c.cols);
  for (int r = 0; r < c.rows; ++r) {
    gguf::dequantize_row(c.type, bytes.data() + r * rb, wrow.data(), c.cols);
    for (int t = 0; t < c.n; ++t) {
      const float* xt = x.data() + size_t(t) * c.cols;
      double s = 0, mag = 0;
      for (int j = 0; j < c.cols; ++j) {
        s += double(wrow[j]) * xt[j];
        mag += std::fabs(double(wrow[j]) * xt[j]);
      }
      const double bound = 1e-6 + (std::ldexp(1.0, -8) * 1.01 + c.cols * 6e-8) * mag;
      const float got = y[size_t(t) * c.rows + r];
      ASSERT_TRUE(std::isfinite(got)) << "row " << r << " token " << t << " not written";
      ASSERT_LE(std::fabs(got - s), bound) << "row " << r << " token " << t << " gpu " << got << " ref " << s;
    }
  }
}

std::vector<MatmulCase> matmul_cases() {
  std::vector<MatmulCase> out;
  for (TensorType t : kTypes) {
    out.push_back({t, 37, 256, 2});
    out.push_back({t, 131, 1024, 17});
  }
  // Larger than one 64 Mi-element tile: exercises the row-block loop.
  out.push_back({TensorType::Q4_0, 16411, 4096, 3});
  out.push_back({TensorType::BF16, 16411, 4096, 3});
  out.push_back({TensorType::Q6_K, 16411, 4096, 3});
  return out;
}

std::string matmul_name(const ::testing::TestParamInfo<MatmulCase>& info) {
  const auto& p = info.param;
  return std::string(gguf::tensor_type_name(p.type)) + "_" + std::to_string(p.rows) + "x" +
         std::to_string(p.cols) + "_n" + std::to_string(p.n);
}

INSTANTIATE_TEST_SUITE_P(AllTypes, CudaMatmul, ::testing::ValuesIn(matmul_cases()), matmul_name);

// The prefill forms of the fused ops (n > 1): the norm writes the GEMMs'
// bf16 input once (rms_norm_bf16) and matmul_add accumulates in the GEMM
// (beta = 1). Against the plain ops on the same backend: norm_matmul and
// norm_swiglu bit for bit (the same bf16 input bits, the same GEMM calls);
// matmul_add within the GEMM's own accumulation error (cuBLAS may choose
// another algorithm when it accumulates into C).
TEST_F(CudaOps, FusedPrefillFormsMatchPlainOps) {
  for (TensorType t : {TensorType::Q8_0, TensorType::Q4_0, TensorType::BF16, TensorType::Q6_K}) {
    const int n = 17, dim = 256, rows = 131;
    std::vector<std::vector<uint8_t>> bytes;
    std::vector<Matrix> dev;
    for (int i = 0; i < 3; ++i) {
      bytes.push_back(random_matrix(rng, t, rows, dim));
      dev.push_back(gpu->upload(host_matrix(t, rows, dim, bytes.back())));
    }
    const auto x = normal(rng, size_t(n) * dim, 2.0f), nw = normal(rng, dim);
    Guarded dx(x.size(), &x), dnw(nw.size(), &nw), dh(x.size());
    const size_t ny = size_t(n) * rows;
    std::vector<Guarded> fused, plain;
    fused.reserve(3);
    plain.reserve(3);
    for (int i = 0; i < 3; ++i) {
      fused.emplace_back(ny);
      plain.emplace_back(ny);
    }
    const Matrix* ws[3] = {&dev[0], &dev[1], &dev[2]};
    float* ys[3] = {fused[0].data(), fused[1].data(), fused[2].data()};
    gpu->norm_matmul(dx.data(), dnw.data(), n, dim, 1e-6f, dh.data(), ws, ys, 3);
    gpu->rms_norm(dx.data(), dnw.data(), n, dim, 1e-6f, dh.data());
    for (int i = 0; i < 3; ++i) gpu->matmul(dev[i], dh.data(), n, plain[i].data());
    for (int i = 0; i < 3; ++i) {
      const auto f = fused[i].result(), p = plain[i].result();
      for (size_t j = 0; j < ny; ++j)
        ASSERT_EQ(f[j], p[j]) << gguf::tensor_type_name(t) << " norm_matmul output " << i << " at " << j;
    }

    // norm_swiglu: gate = fused[0], up scratch = fused[1]; plain: matmuls and swiglu.
    gpu->norm_swiglu(dx.data(), dnw.data(), n, dim, 1e-6f, dh.data(), dev[0], dev[1], fused[1].data(),
                     fused[0].data());
    gpu->rms_norm(dx.data(), dnw.data(), n, dim, 1e-6f, dh.data());
    gpu->matmul(dev[0], dh.data(), n, plain[0].data());
    gpu->matmul(dev[1], dh.data(), n, plain[1].data());
    gpu->swiglu(plain[0].data(), plain[1].data(), plain[0].data(), ny);
    {
      const auto f = fused[0].result(), p = plain[0].result();
      for (size_t j = 0; j < ny; ++j) ASSERT_EQ(f[j], p[j]) << gguf::tensor_type_name(t) << " norm_swiglu at " << j;
    }

    // matmul_add: x2 (n x rows) += W a with a = n x dim.
    const auto x2 = normal(rng, ny);
    Guarded acc(ny, &x2), tmp(ny);
    gpu->matmul_add(dev[2], dx.data(), n, acc.data(), tmp.data());
    gpu->matmul(dev[2], dx.data(), n, plain[2].data());
    const auto got = acc.result(), prod = plain[2].result();
    std::vector<float> wrow(dim);
    const uint64_t rb = gguf::tensor_row_bytes(t, dim);
    for (int r = 0; r < rows; ++r) {
      gguf::dequantize_row(t, bytes[2].data() + r * rb, wrow.data(), dim);
      for (int k = 0; k < n; ++k) {
        double mag = 0;
        for (int j = 0; j < dim; ++j) mag += std::fabs(double(wrow[j]) * x[size_t(k) * dim + j]);
        const size_t j = size_t(k) * rows + r;
        const double ref = double(x2[j]) + double(prod[j]);
        // Two fp32 accumulation orders of the same bf16 products, then one add.
        const double bound = 1e-6 + 1e-6 * std::fabs(ref) + 2.0 * dim * 6e-8 * mag;
        ASSERT_LE(std::fabs(double(got[j]) - ref), bound)
            << gguf::tensor_type_name(t) << " matmul_add row " << r << " token " << k;
      }
    }
  }
}

// mlp_residual's prefill form (norm -> bf16 once, SwiGLU -> bf16, the down
// GEMM adding into x) against norm_swiglu + matmul_add on the same backend:
// the same bf16 GEMM inputs and the same accumulating GEMM, so bit for bit.
TEST_F(CudaOps, MlpResidualPrefillMatchesItsParts) {
  for (TensorType t : {TensorType::Q8_0, TensorType::Q1_0, TensorType::BF16, TensorType::Q4_K}) {
    const int n = 23, dim = 256, ff = 512;
    const auto bg = random_matrix(rng, t, ff, dim), bu = random_matrix(rng, t, ff, dim),
               bd = random_matrix(rng, t, dim, ff);
    const Matrix g = gpu->upload(host_matrix(t, ff, dim, bg)), u = gpu->upload(host_matrix(t, ff, dim, bu)),
                 d = gpu->upload(host_matrix(t, dim, ff, bd));
    const auto x = normal(rng, size_t(n) * dim, 2.0f), nw = normal(rng, dim);
    Guarded x1(x.size(), &x), x2(x.size(), &x), dnw(nw.size(), &nw), h(x.size()), up(size_t(n) * ff),
        gate(size_t(n) * ff);
    gpu->mlp_residual(x1.data(), dnw.data(), n, dim, 1e-6f, h.data(), g, u, d, up.data(), gate.data());
    gpu->norm_swiglu(x2.data(), dnw.data(), n, dim, 1e-6f, h.data(), g, u, up.data(), gate.data());
    gpu->matmul_add(d, gate.data(), n, x2.data(), h.data());
    const auto a = x1.result(), b = x2.result();
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(std::isfinite(a[i])) << gguf::tensor_type_name(t) << " at " << i;
      ASSERT_EQ(a[i], b[i]) << gguf::tensor_type_name(t) << " at " << i;
    }
  }
}

// rms_norm_bf16 writes exactly the bf16 rounding of rms_norm's output.
TEST_F(CudaOps, RmsNormBf16IsTheRoundedRmsNorm) {
  for (auto [rows, dim] : {std::pair{1, 256}, {3, 33}, {17, 4096}}) {
    const auto x = normal(rng, size_t(rows) * dim, 3.0f), w = normal(rng, dim);
    Guarded dx(x.size(), &x), dw(w.size(), &w), dy(x.size());
    gpu->rms_norm(dx.data(), dw.data(), rows, dim, 1e-6f, dy.data());
    const auto y = dy.result();
    cuda::DeviceBuffer<uint16_t> bf(x.size());
    cuda::rms_norm_bf16(dx.data(), dw.data(), rows, dim, 1e-6f, bf.data(), nullptr);
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = bf.download();
    for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(got[i], f32_to_bf16(y[i])) << rows << "x" << dim << " at " << i;
  }
}

}  // namespace

// swiglu_bf16 writes exactly the bf16 rounding of swiglu's output, on the
// vectorized path (n a multiple of 4) and the scalar one.
TEST_F(CudaOps, SwigluBf16IsTheRoundedSwiglu) {
  for (size_t n : {size_t(1000), size_t(12289), size_t(4 * 12288)}) {
    const auto g = normal(rng, n, 4.0f), u = normal(rng, n);
    Guarded dg(n, &g), du(n, &u), dy(n);
    gpu->swiglu(dg.data(), du.data(), dy.data(), n);
    const auto y = dy.result();
    cuda::DeviceBuffer<uint16_t> bf(n);
    cuda::swiglu_bf16(dg.data(), du.data(), bf.data(), n, nullptr);
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = bf.download();
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], f32_to_bf16(y[i])) << n << " values, at " << i;
  }
}
