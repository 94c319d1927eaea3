// K-quant GPU kernels on records of random bytes (every bit pattern of every
// field: negative Q6_K scales, all Q3_K masks, the high bits of the 6-bit
// Q4_K/Q5_K scales; only the fp16 super-scales are kept finite) against the
// CPU reference: the GEMV (gemv_kquant.cu, plain and fused; its input is
// rounded to int8 per 32 values, so the bound adds half a rounding step per
// element), the embedding lookup and the prefill dequantization (ops.cu,
// bit-exact). Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/gemv.hpp"
#include "backend/cuda/ops.hpp"
#include "backend/gpu_layout.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "gguf/quant.hpp"
#include "gpu_test_util.hpp"

using namespace kvq;
using gguf::TensorType;
using gputest::Guarded;

namespace {

constexpr TensorType kKQuants[] = {TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K, TensorType::Q5_K,
                                   TensorType::Q6_K};

// rows x cols of random K-quant blocks with finite super-scales in +-[0.001, 0.02].
std::vector<uint8_t> random_records(TensorType t, int rows, int cols, uint64_t seed) {
  const auto& info = gguf::tensor_type_info(t);
  Rng rng(seed);
  const size_t n_blocks = size_t(rows) * (cols / 256);
  std::vector<uint8_t> out(n_blocks * info.block_bytes);
  for (auto& b : out) b = uint8_t(rng.next_u64());
  std::vector<int> scale_offsets;
  switch (t) {
    case TensorType::Q2_K: scale_offsets = {80, 82}; break;
    case TensorType::Q3_K: scale_offsets = {108}; break;
    case TensorType::Q6_K: scale_offsets = {208}; break;
    default: scale_offsets = {0, 2}; break;
  }
  for (size_t b = 0; b < n_blocks; ++b)
    for (int off : scale_offsets) {
      const float v = float(0.001 + 0.019 * rng.uniform()) * (rng.uniform() < 0.5 ? -1.0f : 1.0f);
      const uint16_t h = f32_to_f16(v);
      out[b * info.block_bytes + off] = uint8_t(h & 0xff);
      out[b * info.block_bytes + off + 1] = uint8_t(h >> 8);
    }
  return out;
}

class KQuantGpu : public ::testing::Test {
 protected:
  void SetUp() override { KVQ_SKIP_WITHOUT_GPU(); }
};

TEST_F(KQuantGpu, GemvOnRandomRecordsMatchesCpuReference) {
  Rng rng(4);
  for (TensorType t : kKQuants) {
    for (const auto [rows, cols] : {std::pair{1, 256}, {37, 768}, {130, 4096}, {9, 12288}}) {
      SCOPED_TRACE(std::string(gguf::tensor_type_name(t)) + " " + std::to_string(rows) + "x" + std::to_string(cols));
      const auto w = random_records(t, rows, cols, uint64_t(rows) * 31 + cols + int(t));
      const auto x = gputest::normal(rng, cols);
      const uint64_t rb = gguf::tensor_row_bytes(t, cols);
      std::vector<float> wrow(cols);
      std::vector<double> ref(rows), bound(rows);
      const std::vector<float> step = gputest::int8_input_steps(x.data(), x.size());
      for (int r = 0; r < rows; ++r) {
        gguf::dequantize_row(t, w.data() + r * rb, wrow.data(), cols);
        double s = 0, mag = 0, qerr = 0;
        for (int c = 0; c < cols; ++c) {
          s += double(wrow[c]) * x[c];
          mag += std::fabs(double(wrow[c]) * x[c]);
          qerr += std::fabs(double(wrow[c])) * 0.5 * step[c];
        }
        ref[r] = s;
        // x rounded to int8 (<= half a step per element), then fp32 sums.
        bound[r] = 1.2e-7 * (cols / 32 + 16) * mag + qerr * 1.0001 + 1e-6;
      }
      auto gw = cuda::GpuMatrix::upload(pack_matrix_for_gpu(t, rows, cols, w.data()));
      Guarded dx(cols, &x), dy(rows);
      cuda::gemv(gw, dx.data(), dy.data(), nullptr);
      const auto y = dy.result();
      for (int r = 0; r < rows; ++r) {
        ASSERT_TRUE(std::isfinite(y[r])) << "row " << r << " not written";
        ASSERT_LE(std::fabs(y[r] - ref[r]), bound[r]) << "row " << r << " gpu " << y[r] << " ref " << ref[r];
      }
    }
  }
}

TEST_F(KQuantGpu, EmbedAndPrefillDequantizationAreBitExact) {
  for (TensorType t : kKQuants) {
    SCOPED_TRACE(gguf::tensor_type_name(t));
    const int rows = 23, cols = 1024;
    const auto w = random_records(t, rows, cols, 77 + int(t));
    const uint64_t rb = gguf::tensor_row_bytes(t, cols);
    std::vector<float> ref(size_t(rows) * cols);
    for (int r = 0; r < rows; ++r) gguf::dequantize_row(t, w.data() + r * rb, ref.data() + size_t(r) * cols, cols);
    auto gw = cuda::GpuMatrix::upload(pack_matrix_for_gpu(t, rows, cols, w.data()));

    // Embedding rows 22, 0, 7, 7: fp32, identical to the CPU's values.
    const std::vector<int32_t> ids = {22, 0, 7, 7};
    cuda::DeviceBuffer<int32_t> dids(ids.size());
    dids.upload(ids);
    Guarded emb(ids.size() * cols);
    cuda::embed_rows(gw, dids.data(), int(ids.size()), emb.data(), nullptr);
    const auto e = emb.result();
    for (size_t i = 0; i < ids.size(); ++i)
      for (int c = 0; c < cols; ++c)
        ASSERT_EQ(e[i * cols + c], ref[size_t(ids[i]) * cols + c]) << "id " << ids[i] << " col " << c;

    // Prefill tile of rows [3, 20): the CPU value rounded to bf16.
    const int r0 = 3, n = 17;
    cuda::DeviceBuffer<uint16_t> tile(size_t(n) * cols + 8);
    std::vector<uint16_t> poison(tile.size(), 0xffff);
    tile.upload(poison);
    cuda::dequantize_rows_bf16(gw, r0, n, tile.data(), nullptr);
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = tile.download();
    for (int r = 0; r < n; ++r)
      for (int c = 0; c < cols; ++c)
        ASSERT_EQ(got[size_t(r) * cols + c], f32_to_bf16(ref[size_t(r0 + r) * cols + c])) << "row " << r0 + r
                                                                                           << " col " << c;
    for (int i = 0; i < 8; ++i) ASSERT_EQ(got[size_t(n) * cols + i], 0xffff) << "wrote past the tile";
  }
}

// The fused request (norm prologue, three outputs, SwiGLU) on random records.
TEST_F(KQuantGpu, FusedRequestsOnRandomRecords) {
  Rng rng(12);
  for (TensorType t : kKQuants) {
    SCOPED_TRACE(gguf::tensor_type_name(t));
    const int cols = 1536;
    const auto x = gputest::normal(rng, cols, 2.0f);
    std::vector<float> g(cols);
    for (auto& v : g) v = 0.5f + float(rng.uniform());
    double ss = 0;
    for (float v : x) ss += double(v) * v;
    const double inv = 1.0 / std::sqrt(ss / cols + 1e-6);
    const int rows[2] = {45, 45};
    std::vector<float> u(cols);
    for (int c = 0; c < cols; ++c) u[c] = x[c] * g[c];
    const std::vector<float> step = gputest::int8_input_steps(u.data(), u.size());
    std::vector<std::vector<double>> ref(2), bound(2);
    std::vector<cuda::GpuMatrix> mats;
    for (int m = 0; m < 2; ++m) {
      const auto w = random_records(t, rows[m], cols, 500 + 10 * m + int(t));
      const uint64_t rb = gguf::tensor_row_bytes(t, cols);
      std::vector<float> wrow(cols);
      for (int r = 0; r < rows[m]; ++r) {
        gguf::dequantize_row(t, w.data() + r * rb, wrow.data(), cols);
        double s = 0, mag = 0, qerr = 0;
        for (int c = 0; c < cols; ++c) {
          const double uc = double(u[c]);
          s += double(wrow[c]) * uc;
          mag += std::fabs(double(wrow[c]) * uc);
          qerr += std::fabs(double(wrow[c])) * 0.5 * step[c];
        }
        ref[m].push_back(s * inv);
        bound[m].push_back(inv * (1.2e-7 * (cols / 32 + 16) * mag + qerr * 1.0001) + 2e-6 * std::fabs(s * inv) + 1e-6);
      }
      mats.push_back(cuda::GpuMatrix::upload(pack_matrix_for_gpu(t, rows[m], cols, w.data())));
    }
    Guarded dx(cols, &x), dg(cols, &g), out(rows[0]);
    cuda::GemvRequest req;
    req.x = dx.data();
    req.norm_weight = dg.data();
    req.norm_eps = 1e-6f;
    req.n_out = 2;
    req.out[0] = {&mats[0], out.data()};
    req.out[1] = {&mats[1], nullptr};
    req.epilogue = cuda::GemvEpilogue::swiglu;
    cuda::gemv(req, nullptr);
    const auto y = out.result();
    for (int r = 0; r < rows[0]; ++r) {
      const double gv = ref[0][r], uv = ref[1][r], eg = bound[0][r], eu = bound[1][r];
      const double want = gv / (1 + std::exp(-gv)) * uv;
      const double tol = 1.1 * eg * (std::fabs(uv) + eu) + (std::fabs(gv) + 1.1 * eg) * eu + 1e-6 * std::fabs(want) + 1e-6;
      ASSERT_LE(std::fabs(y[r] - want), tol) << "row " << r << " gpu " << y[r] << " ref " << want;
    }
  }
}

}  // namespace
