// Batched GEMV (backend/cuda/gemv_batch.hpp) vs the CPU reference: weights
// quantized with gguf::quantize_row and dequantized with
// gguf::dequantize_row (the CPU backend's weights), dot products in double.
// Fresh random inputs, odd batches and row counts, every weight type and
// epilogue, column counts that need one and several shared-memory tiles,
// batches above kGemvBatchMax (split into launches). Each output buffer is
// poisoned with NaN and followed by sentinels. The bound per element is
// test_gemv.cpp's: fp32 summation (2 ulp per level of a lane's chain plus
// the tree) over sum |w u|, plus, for the types that round u to int8 per 32
// values, sum |w| * step / 2 with step = amax / 127 of each group of u; with a
// norm all of it is scaled by 1/rms, plus the rounding of 1/rms itself (its
// fp32 sum of squares, derived in reference()).
// Skips cleanly when no GPU is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/gemv.hpp"
#include "backend/cuda/gemv_batch.hpp"
#include "core/rng.hpp"
#include "gguf/quant.hpp"
#include "gpu_test_util.hpp"

using namespace kvq;
using gguf::TensorType;
using cuda::GemvEpilogue;

namespace {

const TensorType kAllTypes[] = {TensorType::F32,  TensorType::F16,  TensorType::BF16, TensorType::Q8_0,
                                TensorType::Q4_0, TensorType::Q1_0, TensorType::Q2_K, TensorType::Q3_K,
                                TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K};

// A random matrix on the GPU and its dequantized rows (the CPU's weights).
struct TestMatrix {
  cuda::GpuMatrix gpu;
  std::vector<float> w;  // [rows][cols]
};

TestMatrix random_matrix(Rng& rng, TensorType t, int rows, int cols) {
  const uint64_t rb = gguf::tensor_row_bytes(t, cols);
  std::vector<uint8_t> q(rb * rows);
  std::vector<float> row(cols);
  TestMatrix m;
  m.w.resize(size_t(rows) * cols);
  for (int r = 0; r < rows; ++r) {
    for (auto& v : row) v = float(rng.normal()) * 0.05f;
    gguf::quantize_row(t, row.data(), q.data() + r * rb, cols);
    gguf::dequantize_row(t, q.data() + r * rb, m.w.data() + size_t(r) * cols, cols);
  }
  m.gpu = cuda::GpuMatrix::upload(pack_matrix_for_gpu(t, rows, cols, q.data()));
  return m;
}

// The GPU's rounding step of each element of u (int8 types only; zero otherwise).
std::vector<float> input_steps(TensorType t, const float* u, int n) {
  if (!cuda::gemv_quantizes_x(t)) return std::vector<float>(n, 0.0f);
  return gputest::int8_input_steps(u, size_t(n));
}

// Reference W u_b for each row of each matrix and input, with its bound.
struct Reference {
  std::vector<double> value, bound;  // [batch][rows]
};

Reference reference(const TestMatrix& m, TensorType t, int rows, int cols, const std::vector<float>& x,
                    const std::vector<float>* norm, float eps, int batch) {
  Reference ref;
  ref.value.resize(size_t(batch) * rows);
  ref.bound.resize(size_t(batch) * rows);
  std::vector<float> u(cols);
  for (int b = 0; b < batch; ++b) {
    const float* xb = x.data() + size_t(b) * cols;
    double ss = 0;
    for (int j = 0; j < cols; ++j) ss += double(xb[j]) * xb[j];
    const double inv = norm ? 1.0 / std::sqrt(ss / cols + eps) : 1.0;
    for (int j = 0; j < cols; ++j) u[j] = norm ? xb[j] * (*norm)[j] : xb[j];
    const std::vector<float> step = input_steps(t, u.data(), cols);
    for (int r = 0; r < rows; ++r) {
      const float* w = m.w.data() + size_t(r) * cols;
      double s = 0, mag = 0, qerr = 0;
      for (int j = 0; j < cols; ++j) {
        s += double(w[j]) * u[j];
        mag += std::fabs(double(w[j]) * u[j]);
        qerr += std::fabs(double(w[j])) * 0.5 * step[j];
      }
      // fp32: each lane sums cols/32 products per tile, a 5-level tree, and
      // the tiles' partial sums (at most 16 here) are added.
      const double fp = 1.2e-7 * (cols / 32 + 16 + 16) * mag;
      // 1/rms: the kernel sums x^2 over 128-column segments (a tree) and the
      // segments in order, 2 ulp per level, halved by the square root, plus
      // the mean, sqrt and division.
      const double inv_rel = norm ? 0.6e-7 * (cols / 128 + 16) + 4e-7 : 0.0;
      ref.value[size_t(b) * rows + r] = s * inv;
      ref.bound[size_t(b) * rows + r] =
          inv * (fp + qerr * 1.0001) + std::max(2e-6, inv_rel) * std::fabs(s * inv) + 1e-6;
    }
  }
  return ref;
}

struct BatchCase {
  TensorType type;
  int cols;
  std::vector<int> rows;  // one per matrix; swiglu: gate and up
  int batch;
  bool norm;
  GemvEpilogue epilogue;
};

class GemvBatchTest : public ::testing::TestWithParam<BatchCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

TEST_P(GemvBatchTest, MatchesCpuReference) {
  const BatchCase& c = GetParam();
  Rng rng(uint64_t(c.cols) * 7 + c.rows[0] * 13 + c.batch * 101 + int(c.type) * 11 + int(c.epilogue) * 3 +
          (c.norm ? 5 : 0));
  const int n_out = int(c.rows.size());
  const float eps = 1e-6f;
  std::vector<float> x = gputest::normal(rng, size_t(c.batch) * c.cols, 3.0f);
  std::vector<float> g(c.cols);
  for (auto& v : g) v = 0.5f + float(rng.uniform());
  std::vector<TestMatrix> mats;
  std::vector<Reference> refs;
  for (int m = 0; m < n_out; ++m) {
    mats.push_back(random_matrix(rng, c.type, c.rows[m], c.cols));
    refs.push_back(reference(mats.back(), c.type, c.rows[m], c.cols, x, c.norm ? &g : nullptr, eps, c.batch));
  }
  cuda::DeviceBuffer<float> dx(x.size()), dg(g.size());
  dx.upload(x);
  dg.upload(g);
  // Both launch shapes (GemvBatchRequest::warps_per_cta), each on fresh outputs.
  for (int warps : {16, 8}) {
    SCOPED_TRACE(std::to_string(warps) + " warps per CTA");
    std::vector<std::vector<float>> y0(n_out);
    std::vector<std::unique_ptr<gputest::Guarded>> dy;
    for (int m = 0; m < n_out; ++m) {
      const size_t n = size_t(c.batch) * c.rows[m];
      if (c.epilogue == GemvEpilogue::store) {
        dy.push_back(std::make_unique<gputest::Guarded>(n));  // NaN: every element must be written
      } else {
        y0[m] = gputest::normal(rng, n);
        dy.push_back(std::make_unique<gputest::Guarded>(n, &y0[m]));
      }
    }
    cuda::GemvBatchRequest req;
    req.x = dx.data();
    req.batch = c.batch;
    req.norm_weight = c.norm ? dg.data() : nullptr;
    req.norm_eps = eps;
    req.n_out = n_out;
    req.epilogue = c.epilogue;
    req.warps_per_cta = warps;
    for (int m = 0; m < n_out; ++m) req.out[m] = {&mats[m].gpu, dy[m]->data()};
    cuda::gemv_batch(req, nullptr);
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());

    auto silu = [](double v) { return v / (1.0 + std::exp(-v)); };
    for (int m = 0; m < n_out; ++m) {
      const std::vector<float> y = dy[m]->result();  // checks the sentinels
      const int rows = c.rows[m];
      for (int b = 0; b < c.batch; ++b) {
        for (int r = 0; r < rows; ++r) {
          const size_t i = size_t(b) * rows + r;
          double want = refs[m].value[i], tol = refs[m].bound[i];
          if (c.epilogue == GemvEpilogue::add) {
            want += y0[m][i];
            tol += 1e-6 * std::fabs(want);
          } else if (c.epilogue == GemvEpilogue::swiglu) {
            if (m == 1) {
              ASSERT_EQ(y[i], y0[1][i]) << "swiglu wrote the up output, input " << b << " row " << r;
              continue;
            }
            const double gv = refs[0].value[i], uv = refs[1].value[i], eg = refs[0].bound[i], eu = refs[1].bound[i];
            want = silu(gv) * uv;
            tol = 1.1 * eg * (std::fabs(uv) + eu) + (std::fabs(silu(gv)) + 1.1 * eg) * eu + 1e-6 * std::fabs(want) +
                  1e-6;
          }
          ASSERT_TRUE(std::isfinite(y[i])) << "output " << m << " input " << b << " row " << r << " not written";
          ASSERT_LE(std::fabs(y[i] - want), tol)
              << "output " << m << " input " << b << " row " << r << " gpu " << y[i] << " ref " << want;
        }
      }
    }
  }
}

std::vector<BatchCase> batch_cases() {
  using E = GemvEpilogue;
  std::vector<BatchCase> out;
  for (TensorType t : kAllTypes) {
    out.push_back({t, 256, {37}, 1, false, E::store});
    out.push_back({t, 512, {37}, 3, false, E::store});
    out.push_back({t, 4096, {131}, 16, false, E::store});        // fp32 types: several tiles
    out.push_back({t, 768, {37, 5, 11}, 7, true, E::store});     // Q/K/V-like: three heights
    out.push_back({t, 1024, {67}, 9, false, E::add});            // residual update
    out.push_back({t, 512, {45, 45}, 13, true, E::swiglu});      // gate/up
    out.push_back({t, 512, {23, 23}, 2, true, E::swiglu});       // gate/up, two rows per task
    out.push_back({t, 12288, {19}, 5, true, E::store});          // wide rows
    out.push_back({t, 12288, {13, 13}, 16, true, E::swiglu});    // wide, B = 16: several tiles for every type
  }
  out.push_back({TensorType::Q1_0, 4096, {33, 9, 9}, 19, true, E::store});  // 16 + 3: two launches
  out.push_back({TensorType::Q4_K, 4096, {21}, 33, false, E::add});         // 16 + 16 + 1
  out.push_back({TensorType::BF16, 4096, {29, 29}, 17, true, E::swiglu});
  out.push_back({TensorType::F32, 8, {5}, 3, false, E::store});  // float types need only cols % 8 == 0
  out.push_back({TensorType::BF16, 24, {3}, 11, true, E::store});
  out.push_back({TensorType::F16, 264, {7}, 6, false, E::add});
  return out;
}

std::string batch_name(const ::testing::TestParamInfo<BatchCase>& info) {
  const auto& p = info.param;
  const char* ep = p.epilogue == GemvEpilogue::store ? "store" : p.epilogue == GemvEpilogue::add ? "add" : "swiglu";
  std::string name = std::string(gguf::tensor_type_name(p.type)) + "_c" + std::to_string(p.cols) + "_b" +
                     std::to_string(p.batch) + "_" + ep + (p.norm ? "_norm" : "");
  for (int r : p.rows) name += "_" + std::to_string(r);
  return name;
}

INSTANTIATE_TEST_SUITE_P(AllTypes, GemvBatchTest, ::testing::ValuesIn(batch_cases()), batch_name);

// B copies of one input row: the B output rows are bit-identical (the
// kernel treats every input alike, 1/rms included), and equal to the
// single-vector gemv() of that row within both kernels' bounds (the two sum
// in different orders, so not bit for bit).
struct CopiesCase {
  TensorType type;
  int cols, rows, batch;
};

class GemvBatchCopiesTest : public ::testing::TestWithParam<CopiesCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

TEST_P(GemvBatchCopiesTest, IdenticalRowsMatchSingleGemv) {
  const CopiesCase& c = GetParam();
  Rng rng(uint64_t(c.cols) * 3 + c.rows * 17 + c.batch + int(c.type) * 29);
  const float eps = 1e-6f;
  const std::vector<float> x1 = gputest::normal(rng, c.cols, 2.0f);
  std::vector<float> g(c.cols);
  for (auto& v : g) v = 0.5f + float(rng.uniform());
  std::vector<float> x;
  for (int b = 0; b < c.batch; ++b) x.insert(x.end(), x1.begin(), x1.end());
  const TestMatrix m = random_matrix(rng, c.type, c.rows, c.cols);
  const Reference ref = reference(m, c.type, c.rows, c.cols, x1, &g, eps, 1);
  cuda::DeviceBuffer<float> dx(x.size()), dg(g.size());
  dx.upload(x);
  dg.upload(g);

  gputest::Guarded single(c.rows), batched(size_t(c.batch) * c.rows);
  cuda::GemvRequest one;
  one.x = dx.data();
  one.norm_weight = dg.data();
  one.norm_eps = eps;
  one.out[0] = {&m.gpu, single.data()};
  cuda::gemv(one, nullptr);
  cuda::GemvBatchRequest many;
  many.x = dx.data();
  many.batch = c.batch;
  many.norm_weight = dg.data();
  many.norm_eps = eps;
  many.out[0] = {&m.gpu, batched.data()};
  cuda::gemv_batch(many, nullptr);
  const std::vector<float> y1 = single.result(), yb = batched.result();
  for (int r = 0; r < c.rows; ++r) {
    ASSERT_TRUE(std::isfinite(yb[r])) << "row " << r << " not written";
    ASSERT_LE(std::fabs(double(yb[r]) - y1[r]), 2 * ref.bound[r])
        << "row " << r << " batched " << yb[r] << " gemv " << y1[r] << " ref " << ref.value[r];
    for (int b = 1; b < c.batch; ++b)
      ASSERT_EQ(yb[size_t(b) * c.rows + r], yb[r]) << "input " << b << " row " << r << " differs from input 0";
  }
}

std::vector<CopiesCase> copies_cases() {
  std::vector<CopiesCase> out;
  for (TensorType t : kAllTypes) {
    out.push_back({t, 4096, 67, 16});
    out.push_back({t, 1024, 33, 5});
  }
  return out;
}

std::string copies_name(const ::testing::TestParamInfo<CopiesCase>& info) {
  const auto& p = info.param;
  return std::string(gguf::tensor_type_name(p.type)) + "_c" + std::to_string(p.cols) + "_r" + std::to_string(p.rows) +
         "_b" + std::to_string(p.batch);
}

INSTANTIATE_TEST_SUITE_P(AllTypes, GemvBatchCopiesTest, ::testing::ValuesIn(copies_cases()), copies_name);

}  // namespace
