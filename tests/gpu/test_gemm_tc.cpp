// Tensor-core batched GEMM (backend/cuda/gemm_tc.hpp) vs the CPU reference
// and vs gemv_batch(). Weights quantized with gguf::quantize_row and
// dequantized with gguf::dequantize_row (the CPU backend's weights), dot
// products in double; fresh random inputs, every supported type, batches 1,
// 3, 8, 17, 33, 64 and past kGemmTcMax (split into launches), odd row
// counts, Q/K/V-like triples, all three epilogues, with and without the
// norm, one and several K tiles per CTA, K slices that are empty. Output
// buffers are poisoned with NaN and followed by sentinels.
//
// Bounds: against the CPU, test_gemv_batch.cpp's (fp32 summation over sum
// |w u| plus sum |w| * step / 2 for the int8 rounding of u, scaled by 1/rms,
// plus the rounding of 1/rms); the int8 step is amax / 127 over 32 values,
// over 128 for gemm_tc's Q1_0 path (one x scale per weight group). Against
// gemv_batch(): Q8_0 and Q4_0 round u to the same int8 values in both
// kernels and compute the same exact integer block sums, so only the fp32
// summation orders differ: twice the fp32 part of that bound; Q1_0 adds
// both kernels' int8 terms. Identical input rows give bit-identical outputs.
// gemm_tc runs twice, with x quantized once per launch into a workspace and
// with every CTA staging its own K slice (no workspace): the two must agree
// bit for bit.
// Skips cleanly when no GPU is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/gemm_tc.hpp"
#include "backend/cuda/gemv.hpp"
#include "backend/cuda/gemv_batch.hpp"
#include "core/rng.hpp"
#include "gguf/quant.hpp"
#include "gpu_test_util.hpp"

using namespace kvq;
using gguf::TensorType;
using cuda::GemvEpilogue;

namespace {

// Results of gemm_tc with x prestaged (a workspace) and staged in every CTA
// (none): identical bits.
enum class Path { prestaged, in_cta, gemv_batch };

void run_path(Path p, const cuda::GemvBatchRequest& req) {
  if (p == Path::gemv_batch) return cuda::gemv_batch(req, nullptr);
  cuda::DeviceBuffer<uint8_t> ws;
  cuda::GemmTcWorkspace w;
  if (p == Path::prestaged) {
    ws.resize(cuda::gemm_tc_workspace_bytes(req.batch, req.out[0].w->cols));
    w = {ws.data(), ws.bytes()};
  }
  cuda::gemm_tc(req, w, nullptr);
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());  // before ws is freed
}

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(std::memcmp(&a[i], &b[i], sizeof(float)), 0)
        << what << ": element " << i << " prestaged " << a[i] << " in-CTA " << b[i];
}

const TensorType kTcTypes[] = {TensorType::Q1_0, TensorType::Q8_0, TensorType::Q4_0};

struct TestMatrix {
  cuda::GpuMatrix gpu;
  std::vector<float> w;  // [rows][cols], the CPU's weights
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

// Reference W u_b with bounds: gemm_tc against the CPU (`bound`, x rounded
// in steps over tc_span values) and gemm_tc against gemv_batch (`pair`,
// half of what the two may differ by: their fp32 summation orders, plus the
// int8 rounding terms when their steps differ).
struct Reference {
  std::vector<double> value, bound, pair;  // [batch][rows]
};

int tc_span(TensorType t) { return t == TensorType::Q1_0 ? 128 : 32; }

Reference reference(const TestMatrix& m, int rows, int cols, const std::vector<float>& x,
                    const std::vector<float>* norm, float eps, int batch, int span) {
  Reference ref;
  ref.value.resize(size_t(batch) * rows);
  ref.bound.resize(size_t(batch) * rows);
  ref.pair.resize(size_t(batch) * rows);
  std::vector<float> u(cols), step(cols), step32(cols);
  for (int b = 0; b < batch; ++b) {
    const float* xb = x.data() + size_t(b) * cols;
    double ss = 0;
    for (int j = 0; j < cols; ++j) ss += double(xb[j]) * xb[j];
    const double inv = norm ? 1.0 / std::sqrt(ss / cols + eps) : 1.0;
    for (int j = 0; j < cols; ++j) u[j] = norm ? xb[j] * (*norm)[j] : xb[j];
    auto steps = [&](int n, std::vector<float>& out) {  // the kernels' int8 step of each element
      for (int g0 = 0; g0 < cols; g0 += n) {
        float amax = 0;
        for (int j = g0; j < g0 + n; ++j) amax = std::max(amax, std::fabs(u[j]));
        for (int j = g0; j < g0 + n; ++j) out[j] = amax / 127.0f;
      }
    };
    steps(span, step);
    steps(32, step32);
    for (int r = 0; r < rows; ++r) {
      const float* w = m.w.data() + size_t(r) * cols;
      double s = 0, mag = 0, qerr = 0, qerr32 = 0;
      for (int j = 0; j < cols; ++j) {
        s += double(w[j]) * u[j];
        mag += std::fabs(double(w[j]) * u[j]);
        qerr += std::fabs(double(w[j])) * 0.5 * step[j];
        qerr32 += std::fabs(double(w[j])) * 0.5 * step32[j];
      }
      const double fp = 1.2e-7 * (cols / 32 + 16 + 16) * mag;
      const double inv_rel = norm ? 0.6e-7 * (cols / 128 + 16) + 4e-7 : 0.0;
      const size_t i = size_t(b) * rows + r;
      ref.value[i] = s * inv;
      const double order = inv * fp + std::max(2e-6, inv_rel) * std::fabs(s * inv) + 1e-6;
      ref.bound[i] = order + inv * qerr * 1.0001;
      ref.pair[i] = order + (span == 32 ? 0.0 : 0.5 * inv * (qerr + qerr32) * 1.0001);
    }
  }
  return ref;
}

struct TcCase {
  TensorType type;
  int cols;
  std::vector<int> rows;  // one per matrix; swiglu: gate and up
  int batch;
  bool norm;
  GemvEpilogue epilogue;
};

class GemmTcTest : public ::testing::TestWithParam<TcCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

double silu(double v) { return v / (1.0 + std::exp(-v)); }

// Expected value and tolerance of output element i of matrix m, given each
// matrix's value and error bound (`bounds`: bound or pair).
void expect_of(const TcCase& c, int m, size_t i, const std::vector<Reference>& refs,
               const std::vector<std::vector<double>*>& bounds, const std::vector<std::vector<float>>& y0,
               double& want, double& tol) {
  want = refs[m].value[i];
  tol = (*bounds[m])[i];
  if (c.epilogue == GemvEpilogue::add) {
    want += y0[m][i];
    tol += 1e-6 * std::fabs(want);
  } else if (c.epilogue == GemvEpilogue::swiglu) {
    const double gv = refs[0].value[i], uv = refs[1].value[i], eg = (*bounds[0])[i], eu = (*bounds[1])[i];
    want = silu(gv) * uv;
    tol = 1.1 * eg * (std::fabs(uv) + eu) + (std::fabs(silu(gv)) + 1.1 * eg) * eu + 1e-6 * std::fabs(want) + 1e-6;
  }
}

TEST_P(GemmTcTest, MatchesCpuReferenceAndGemvBatch) {
  const TcCase& c = GetParam();
  ASSERT_TRUE(cuda::gemm_tc_supported(c.type));
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
    refs.push_back(reference(mats.back(), c.rows[m], c.cols, x, c.norm ? &g : nullptr, eps, c.batch, tc_span(c.type)));
  }
  cuda::DeviceBuffer<float> dx(x.size()), dg(g.size());
  dx.upload(x);
  dg.upload(g);

  // The same request through gemm_tc and gemv_batch, each on fresh outputs.
  std::vector<std::vector<float>> y0(n_out);
  for (int m = 0; m < n_out; ++m)
    if (c.epilogue != GemvEpilogue::store) y0[m] = gputest::normal(rng, size_t(c.batch) * c.rows[m]);
  auto run = [&](Path path) {
    std::vector<std::unique_ptr<gputest::Guarded>> dy;
    for (int m = 0; m < n_out; ++m) {
      const size_t n = size_t(c.batch) * c.rows[m];
      dy.push_back(c.epilogue == GemvEpilogue::store ? std::make_unique<gputest::Guarded>(n)
                                                     : std::make_unique<gputest::Guarded>(n, &y0[m]));
    }
    cuda::GemvBatchRequest req;
    req.x = dx.data();
    req.batch = c.batch;
    req.norm_weight = c.norm ? dg.data() : nullptr;
    req.norm_eps = eps;
    req.n_out = n_out;
    req.epilogue = c.epilogue;
    for (int m = 0; m < n_out; ++m) req.out[m] = {&mats[m].gpu, dy[m]->data()};
    run_path(path, req);
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<std::vector<float>> out;
    for (auto& d : dy) out.push_back(d->result());  // checks the sentinels
    return out;
  };
  const std::vector<std::vector<float>> ytc = run(Path::prestaged), ycta = run(Path::in_cta),
                                        ygb = run(Path::gemv_batch);
  for (int m = 0; m < n_out; ++m) expect_same_bits(ytc[m], ycta[m], "output");

  std::vector<std::vector<double>*> bounds, pairs;
  for (auto& r : refs) {
    bounds.push_back(&r.bound);
    pairs.push_back(&r.pair);
  }
  for (int m = 0; m < n_out; ++m) {
    const int rows = c.rows[m];
    for (int b = 0; b < c.batch; ++b) {
      for (int r = 0; r < rows; ++r) {
        const size_t i = size_t(b) * rows + r;
        const float y = ytc[m][i];
        if (c.epilogue == GemvEpilogue::swiglu && m == 1) {
          ASSERT_EQ(y, y0[1][i]) << "swiglu wrote the up output, input " << b << " row " << r;
          continue;
        }
        ASSERT_TRUE(std::isfinite(y)) << "output " << m << " input " << b << " row " << r << " not written";
        double want, tol;
        expect_of(c, m, i, refs, bounds, y0, want, tol);
        ASSERT_LE(std::fabs(y - want), tol)
            << "output " << m << " input " << b << " row " << r << " gpu " << y << " ref " << want;
        // Against gemv_batch: summation orders (and for Q1_0 both int8 roundings).
        double want2, tol2;
        expect_of(c, m, i, refs, pairs, y0, want2, tol2);
        ASSERT_LE(std::fabs(double(y) - ygb[m][i]), 2 * tol2)
            << "output " << m << " input " << b << " row " << r << " gemm_tc " << y << " gemv_batch " << ygb[m][i];
      }
    }
  }
}

std::vector<TcCase> tc_cases() {
  using E = GemvEpilogue;
  std::vector<TcCase> out;
  for (TensorType t : kTcTypes) {
    out.push_back({t, 256, {37}, 1, false, E::store});
    out.push_back({t, 512, {37}, 3, true, E::store});
    out.push_back({t, 768, {37, 5, 11}, 8, true, E::store});  // Q/K/V-like; 6 groups over 4 slices: one empty
    out.push_back({t, 1024, {67}, 17, false, E::add});
    out.push_back({t, 512, {45, 45}, 33, true, E::swiglu});
    out.push_back({t, 1024, {23, 23}, 3, false, E::swiglu});
    out.push_back({t, 4096, {300}, 64, true, E::store});          // two m-tiles, the second partial
    out.push_back({t, 4096, {131, 131}, 64, false, E::swiglu});   // two SwiGLU m-tiles
    out.push_back({t, 2048, {517, 129, 3}, 33, false, E::add});   // outputs straddling warps and m-tiles
    out.push_back({t, 24576, {19}, 64, true, E::store});          // several K tiles per CTA
    // Several K tiles at a small batch (NT = 1: Q1_0's 4-deep prefetch ring
    // crosses a tile boundary); 1602 groups over 8 slices, a slice's groups
    // not a multiple of the ring's depth.
    out.push_back({t, 205056, {19}, 5, true, E::store});
    out.push_back({t, 1024, {13}, 65, false, E::store});          // 64 + 1: two launches
    out.push_back({t, 512, {21, 21}, 130, true, E::swiglu});      // 64 + 64 + 2
  }
  return out;
}

std::string tc_name(const ::testing::TestParamInfo<TcCase>& info) {
  const auto& p = info.param;
  const char* ep = p.epilogue == GemvEpilogue::store ? "store" : p.epilogue == GemvEpilogue::add ? "add" : "swiglu";
  std::string name = std::string(gguf::tensor_type_name(p.type)) + "_c" + std::to_string(p.cols) + "_b" +
                     std::to_string(p.batch) + "_" + ep + (p.norm ? "_norm" : "");
  for (int r : p.rows) name += "_" + std::to_string(r);
  return name;
}

INSTANTIATE_TEST_SUITE_P(TcTypes, GemmTcTest, ::testing::ValuesIn(tc_cases()), tc_name);

// B copies of one input row: the B output rows are bit-identical, and equal
// to the single-vector gemv() of that row within both kernels' bounds.
struct CopiesCase {
  TensorType type;
  int cols, rows, batch;
};

class GemmTcCopiesTest : public ::testing::TestWithParam<CopiesCase> {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

TEST_P(GemmTcCopiesTest, IdenticalRowsGiveIdenticalOutputs) {
  const CopiesCase& c = GetParam();
  Rng rng(uint64_t(c.cols) * 3 + c.rows * 17 + c.batch + int(c.type) * 29);
  const float eps = 1e-6f;
  const std::vector<float> x1 = gputest::normal(rng, c.cols, 2.0f);
  std::vector<float> g(c.cols);
  for (auto& v : g) v = 0.5f + float(rng.uniform());
  std::vector<float> x;
  for (int b = 0; b < c.batch; ++b) x.insert(x.end(), x1.begin(), x1.end());
  const TestMatrix m = random_matrix(rng, c.type, c.rows, c.cols);
  const Reference ref = reference(m, c.rows, c.cols, x1, &g, eps, 1, tc_span(c.type));
  cuda::DeviceBuffer<float> dx(x.size()), dg(g.size());
  dx.upload(x);
  dg.upload(g);

  gputest::Guarded single(c.rows), batched(size_t(c.batch) * c.rows), batched_cta(size_t(c.batch) * c.rows);
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
  run_path(Path::prestaged, many);
  many.out[0] = {&m.gpu, batched_cta.data()};
  run_path(Path::in_cta, many);
  const std::vector<float> y1 = single.result(), yb = batched.result();
  expect_same_bits(yb, batched_cta.result(), "copies");
  for (int r = 0; r < c.rows; ++r) {
    ASSERT_TRUE(std::isfinite(yb[r])) << "row " << r << " not written";
    ASSERT_LE(std::fabs(double(yb[r]) - y1[r]), 2 * ref.bound[r])
        << "row " << r << " gemm_tc " << yb[r] << " gemv " << y1[r] << " ref " << ref.value[r];
    for (int b = 1; b < c.batch; ++b)
      ASSERT_EQ(yb[size_t(b) * c.rows + r], yb[r]) << "input " << b << " row " << r << " differs from input 0";
  }
}

std::vector<CopiesCase> copies_cases() {
  std::vector<CopiesCase> out;
  for (TensorType t : kTcTypes) {
    out.push_back({t, 4096, 67, 64});
    out.push_back({t, 1024, 33, 5});
    out.push_back({t, 2048, 300, 40});
  }
  return out;
}

std::string copies_name(const ::testing::TestParamInfo<CopiesCase>& info) {
  const auto& p = info.param;
  return std::string(gguf::tensor_type_name(p.type)) + "_c" + std::to_string(p.cols) + "_r" + std::to_string(p.rows) +
         "_b" + std::to_string(p.batch);
}

INSTANTIATE_TEST_SUITE_P(TcTypes, GemmTcCopiesTest, ::testing::ValuesIn(copies_cases()), copies_name);

TEST(GemmTc, WorkspaceTooSmallIsRejected) {
  KVQ_SKIP_WITHOUT_GPU();
  Rng rng(7);
  const TestMatrix m = random_matrix(rng, TensorType::Q8_0, 16, 512);
  cuda::DeviceBuffer<float> x(size_t(9) * 512), y(size_t(9) * 16);
  const size_t need = cuda::gemm_tc_workspace_bytes(9, 512);
  EXPECT_GT(need, cuda::gemm_tc_workspace_bytes(8, 512));  // 16 token slots vs 8
  EXPECT_EQ(cuda::gemm_tc_workspace_bytes(200, 512), cuda::gemm_tc_workspace_bytes(64, 512));
  cuda::DeviceBuffer<uint8_t> ws(need - 16);
  EXPECT_ANY_THROW(cuda::gemm_tc(m.gpu, x.data(), 9, y.data(), {ws.data(), ws.bytes()}, nullptr));
}

TEST(GemmTc, SupportedTypes) {
  EXPECT_TRUE(cuda::gemm_tc_supported(TensorType::Q1_0));
  EXPECT_TRUE(cuda::gemm_tc_supported(TensorType::Q8_0));
  EXPECT_TRUE(cuda::gemm_tc_supported(TensorType::Q4_0));
  EXPECT_FALSE(cuda::gemm_tc_supported(TensorType::BF16));
  EXPECT_FALSE(cuda::gemm_tc_supported(TensorType::Q4_K));
}

}  // namespace
