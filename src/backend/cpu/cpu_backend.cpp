#include "backend/cpu/cpu_backend.hpp"

#include <algorithm>
#include <array>
#include <map>
#include <vector>

#include "backend/cpu/kernels.hpp"
#include "core/error.hpp"
#include "kv/block.hpp"
#include "kv/cache.hpp"

namespace kvq::cpu {

namespace {

class HostBuffer final : public Buffer {
 public:
  explicit HostBuffer(size_t n) : v_(n, 0.0f) {}
  float* data() override { return v_.data(); }
  size_t size() const override { return v_.size(); }

 private:
  std::vector<float> v_;
};

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }

  std::unique_ptr<Buffer> alloc(size_t n) override { return std::make_unique<HostBuffer>(n); }
  Matrix upload(const Matrix& host) override {
    KVQ_CHECK(supports_weight_type(host.type), Errc::unsupported, "weight type id ", uint32_t(host.type),
              " is not supported by the CPU backend (supported: ", supported_weight_types(), ")");
    return host;  // zero copy: the mmap'd GGUF bytes are used in place
  }
  void upload(const float* host, float* dst, size_t n) override { std::copy_n(host, n, dst); }
  void download(const float* src, float* host, size_t n) override { std::copy_n(src, n, host); }

  void embed(const Matrix& table, const int32_t* ids, int n, float* out) override {
    for (int t = 0; t < n; ++t) {
      KVQ_CHECK(ids[t] >= 0 && ids[t] < table.rows, Errc::out_of_range, "token id ", ids[t],
                " is outside the model's vocabulary of ", table.rows, " tokens");
      dequantize_row(table.type, table.row(ids[t]), out + size_t(t) * table.cols, table.cols);
    }
  }
  void matmul(const Matrix& w, const float* x, int n, float* y) override { cpu::matmul(w, x, n, y); }
  void rms_norm(const float* x, const float* weight, int n, int dim, float eps, float* y) override {
    cpu::rms_norm(x, weight, n, dim, eps, y);
  }
  void rope(float* x, int n, int n_heads, int head_dim, int pos, const Rope& r) override {
    cpu::rope(x, n, n_heads, head_dim, pos, r);
  }
  void swiglu(const float* gate, const float* up, float* out, size_t n) override { cpu::swiglu(gate, up, out, n); }
  void add(float* x, const float* y, size_t n) override { cpu::add(x, y, n); }
  void write_kv(kv::LayerCache& layer, const StepBatch& b, const float* k, const float* v) override {
    layer.write_slots(b.slot.data(), b.n_tok(), k, v);
  }
  void attention(const kv::LayerCache& layer, const StepBatch& b, const float* q, int n_heads, float scale,
                 float* out) override {
    layer.attend_runs(b.runs.data(), b.n_seq(), q, n_heads, scale, out);
    // A step whose every sequence has one token is a decode step.
    const bool decode = b.n_tok() == b.n_seq();
    if (auto it = attention_calls_.find(&layer); it != attention_calls_.end()) ++it->second[decode ? 1 : 0];
  }

  // The CPU has one attention path: the cache's own attend() over its store
  // (packed codes, or the fp32 reference cache). No device, so no KV copies.
  // Only caches passed to reset_dispatch_stats are counted (a chat session
  // pays nothing for this).
  void reset_dispatch_stats(kv::Cache& cache) override {
    for (int l = 0; l < cache.shape().n_layers; ++l) attention_calls_[&cache.layer(l)] = {0, 0};
  }
  DispatchStats dispatch_stats(kv::Cache& cache) override {
    DispatchStats s;
    s.counted = true;
    const std::string kernel = cache.codec_name() == "f32" ? "cpu-f32" : "cpu-packed";
    for (int l = 0; l < cache.shape().n_layers; ++l) {
      const auto it = attention_calls_.find(&cache.layer(l));
      if (it == attention_calls_.end()) continue;
      for (int decode = 0; decode < 2; ++decode)
        if (it->second[decode]) s.attention.push_back({l, kernel, decode == 1, it->second[decode]});
    }
    return s;
  }

 private:
  // Attention calls per registered layer cache: [0] multi-token (prefill), [1] single-token (decode).
  std::map<const kv::LayerCache*, std::array<uint64_t, 2>> attention_calls_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace kvq::cpu

namespace kvq {

std::unique_ptr<kv::Cache> Backend::make_cache(const kv::CodecOptions& opts, const kv::CacheShape& shape) {
  return kv::make_cpu_cache(opts, shape);
}

}  // namespace kvq
