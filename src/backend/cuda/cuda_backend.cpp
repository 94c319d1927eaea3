#include "backend/cuda/cuda_backend.hpp"

#include <cublas_v2.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "backend/cuda/attention.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/cuda_kv_cache.hpp"
#include "backend/cuda/device_buffer.hpp"
#include "backend/cuda/gemv.hpp"
#include "backend/cuda/ops.hpp"
#include "backend/gpu_layout.hpp"
#include "core/error.hpp"
#include "kv/cache.hpp"

#define KVQ_CUBLAS_CHECK(call)                                                                          \
  do {                                                                                                  \
    const cublasStatus_t kvq_st_ = (call);                                                              \
    if (kvq_st_ != CUBLAS_STATUS_SUCCESS)                                                               \
      ::kvq::fail(::kvq::Errc::cuda, #call, " failed: cuBLAS status ", int(kvq_st_), " (", __FILE__, ":", \
                  __LINE__, ")");                                                                       \
  } while (0)

namespace kvq::cuda {

namespace {

// The bf16 weight tile of a prefill GEMM holds at most this many elements
// (64 Mi x 2 bytes = 128 MiB); larger matrices are multiplied in row blocks.
constexpr size_t kTileElems = size_t(64) << 20;

class DeviceFloatBuffer final : public Buffer {
 public:
  explicit DeviceFloatBuffer(size_t n) : b_(n) {
    if (n) KVQ_CUDA_CHECK(cudaMemset(b_.data(), 0, b_.bytes()));
  }
  float* data() override { return b_.data(); }
  size_t size() const override { return b_.size(); }

 private:
  DeviceBuffer<float> b_;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend() { KVQ_CUBLAS_CHECK(cublasCreate(&cublas_)); }
  ~CudaBackend() override {
    if (cublas_) cublasDestroy(cublas_);
  }
  const char* name() const override { return "cuda"; }

  std::unique_ptr<Buffer> alloc(size_t n) override { return std::make_unique<DeviceFloatBuffer>(n); }

  Matrix upload(const Matrix& host) override {
    // Tied embeddings upload the same host tensor twice: keep one copy. The key
    // includes type and shape because a caller's freed buffer can be reused at
    // the same address for another matrix (host weights must not change while
    // the backend lives; mmap'd model files never do).
    const HostKey key{host.data, host.type, host.rows, host.cols};
    if (auto it = by_host_.find(key); it != by_host_.end()) return it->second;
    KVQ_CHECK(gpu_gemv_supported(host.type, host.cols), Errc::unsupported, "the CUDA backend does not support ",
              gguf::tensor_type_name(host.type), " weights with ", host.cols,
              " columns (quantized types need a multiple of 256 columns, float types a multiple of 8)");
    auto gm = std::make_unique<GpuMatrix>(
        GpuMatrix::upload(pack_matrix_for_gpu(host.type, host.rows, host.cols, host.data)));
    Matrix dev = host;
    dev.data = gm->codes.data();  // device address: only this backend dereferences it
    dev.handle = gm.get();
    owned_.push_back(std::move(gm));
    by_host_[key] = dev;
    return dev;
  }
  void upload(const float* host, float* dst, size_t n) override {
    if (n) KVQ_CUDA_CHECK(cudaMemcpy(dst, host, n * sizeof(float), cudaMemcpyHostToDevice));
  }
  void download(const float* src, float* host, size_t n) override {
    if (n) KVQ_CUDA_CHECK(cudaMemcpy(host, src, n * sizeof(float), cudaMemcpyDeviceToHost));
  }

  void embed(const Matrix& table, const int32_t* ids, int n, float* out) override {
    const GpuMatrix& t = find(table);
    for (int i = 0; i < n; ++i)
      KVQ_CHECK(ids[i] >= 0 && ids[i] < table.rows, Errc::out_of_range, "token id ", ids[i],
                " is outside the model's vocabulary of ", table.rows, " tokens");
    if (ids_.size() < size_t(n)) ids_.resize(size_t(n));
    ids_.upload(ids, size_t(n));
    embed_rows(t, ids_.data(), n, out, nullptr);
  }

  void matmul(const Matrix& w, const float* x, int n, float* y) override {
    const GpuMatrix& m = find(w);
    if (n == 1) {
      gemv(m, x, y, gemv_scratch_, nullptr);
      return;
    }
    if (n <= 0) return;
    // Prefill: y^T (rows x n, column-major) = W (rows x cols) * x^T, with W read
    // as the column-major cols x rows matrix it is in memory (op T).
    const size_t xn = size_t(n) * m.cols;
    if (xbf_.size() < xn) xbf_.resize(xn);
    f32_to_bf16(x, xbf_.data(), xn, nullptr);
    const int64_t block_rows = std::max<int64_t>(1, int64_t(kTileElems / size_t(m.cols)));
    const float alpha = 1.0f, beta = 0.0f;
    for (int64_t r0 = 0; r0 < m.rows; r0 += block_rows) {
      const int64_t rows = std::min(block_rows, m.rows - r0);
      const void* a = nullptr;
      if (m.type == gguf::TensorType::BF16) {
        a = m.codes.data() + size_t(r0) * m.cols * 2;  // already bf16: no copy
      } else {
        if (tile_.size() < size_t(rows) * m.cols) tile_.resize(size_t(std::min(block_rows, m.rows)) * m.cols);
        dequantize_rows_bf16(m, r0, rows, tile_.data(), nullptr);
        a = tile_.data();
      }
      KVQ_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(rows), n, int(m.cols), &alpha, a,
                                    CUDA_R_16BF, int(m.cols), xbf_.data(), CUDA_R_16BF, int(m.cols), &beta,
                                    y + r0, CUDA_R_32F, int(m.rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  }

  void rms_norm(const float* x, const float* weight, int n, int dim, float eps, float* y) override {
    cuda::rms_norm(x, weight, n, dim, eps, y, nullptr);
  }
  void rope(float* x, int n, int n_heads, int head_dim, int pos, const Rope& r) override {
    KVQ_CHECK(int(r.inv_freq.size()) == head_dim / 2, Errc::internal, "rope: ", r.inv_freq.size(),
              " frequencies for head_dim ", head_dim);
    // The table is uploaded once and re-uploaded only if a different one is passed.
    if (inv_freq_host_ != r.inv_freq) {
      inv_freq_host_ = r.inv_freq;
      inv_freq_.upload(inv_freq_host_);
    }
    cuda::rope(x, n, n_heads, head_dim, pos, inv_freq_.data(), r.neox, r.pos_scale, nullptr);
  }
  void swiglu(const float* gate, const float* up, float* out, size_t n) override {
    cuda::swiglu(gate, up, out, n, nullptr);
  }
  void add(float* x, const float* y, size_t n) override { cuda::add(x, y, n, nullptr); }

  void write_kv(kv::LayerCache& layer, int pos, int n, const float* k, const float* v) override {
    gpu_layer(layer).write(pos, n, k, v);
  }
  void attention(const kv::LayerCache& layer, int pos, int n, const float* q, int n_heads, float scale,
                 float* out) override {
    gpu_layer(layer).attend(pos, n, q, n_heads, scale, out);
  }

  std::unique_ptr<kv::Cache> make_cache(const kv::CodecOptions& opts, const kv::CacheShape& shape) override {
    return make_cuda_kv_cache(opts, shape);
  }

 private:
  const GpuMatrix& find(const Matrix& w) const {
    const auto* gm = static_cast<const GpuMatrix*>(w.handle);
    KVQ_CHECK(gm && w.data == gm->codes.data(), Errc::internal,
              "CUDA backend: a matrix was used that this backend did not upload (call Backend::upload first)");
    return *gm;
  }
  static CudaLayerCache& gpu_layer(kv::LayerCache& layer) {
    auto* g = dynamic_cast<CudaLayerCache*>(&layer);
    KVQ_CHECK(g, Errc::unsupported,
              "the CUDA backend needs its own KV cache (Backend::make_cache); a CPU cache was passed");
    return *g;
  }
  static const CudaLayerCache& gpu_layer(const kv::LayerCache& layer) {
    auto* g = dynamic_cast<const CudaLayerCache*>(&layer);
    KVQ_CHECK(g, Errc::unsupported,
              "the CUDA backend needs its own KV cache (Backend::make_cache); a CPU cache was passed");
    return *g;
  }

  cublasHandle_t cublas_ = nullptr;
  std::vector<std::unique_ptr<GpuMatrix>> owned_;      // Matrix::handle points at these
  using HostKey = std::tuple<const uint8_t*, gguf::TensorType, int64_t, int64_t>;
  std::map<HostKey, Matrix> by_host_;  // host tensor -> upload (tied embeddings share one)
  GemvScratch gemv_scratch_;
  DeviceBuffer<int32_t> ids_;
  DeviceBuffer<uint16_t> xbf_, tile_;
  DeviceBuffer<float> inv_freq_;
  std::vector<float> inv_freq_host_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() {
  KVQ_CHECK(device_available(), Errc::unsupported,
            "the CUDA backend is not available: no CUDA device is visible (check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES); use --device cpu");
  return std::make_unique<CudaBackend>();
}

}  // namespace kvq::cuda
