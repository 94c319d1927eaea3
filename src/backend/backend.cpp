// Default implementations of Backend's optional capabilities, and the
// device-independent entry points of backend.hpp: the --device factory and
// the GPU codec question (both name every backend room, so they live above
// them, not in one of them).
#include "backend/backend.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include "backend/cpu/cpu_backend.hpp"
#include "core/error.hpp"
#include "kv/block.hpp"

#ifdef KVQ_HAVE_CUDA
#include "backend/cuda/attention_plan.hpp"
#include "backend/cuda/cuda_backend.hpp"
#endif

namespace kvq {

int32_t Backend::argmax(const float* x, size_t n) {
  KVQ_CHECK(n > 0, Errc::internal, "argmax over an empty vector");
  std::vector<float> host(n);
  download(x, host.data(), n);
  // The greedy Sampler's rule: NaN counts as -inf, the lowest index wins ties.
  auto value = [&](size_t i) { return std::isnan(host[i]) ? -INFINITY : host[i]; };
  size_t best = 0;
  for (size_t i = 1; i < n; ++i)
    if (value(i) > value(best)) best = i;
  return int32_t(best);
}

void Backend::argmax_rows(const float* x, int rows, size_t n, size_t stride, int32_t* out, float* value) {
  std::vector<float> host(n);
  for (int r = 0; r < rows; ++r) {
    download(x + size_t(r) * stride, host.data(), n);
    // The greedy Sampler's rule: NaN counts as -inf, the lowest index wins ties.
    auto v = [&](size_t i) { return std::isnan(host[i]) ? -INFINITY : host[i]; };
    size_t best = 0;
    for (size_t i = 1; i < n; ++i)
      if (v(i) > v(best)) best = i;
    out[r] = int32_t(best);
    value[r] = v(best);
  }
}

void Backend::norm_matmul(const float* x, const float* norm_w, int n, int dim, float eps, float* h,
                          const Matrix* const* ws, float* const* ys, int count) {
  rms_norm(x, norm_w, n, dim, eps, h);
  for (int i = 0; i < count; ++i) matmul(*ws[i], h, n, ys[i]);
}

void Backend::matmul_add(const Matrix& w, const float* a, int n, float* x, float* tmp) {
  matmul(w, a, n, tmp);
  add(x, tmp, size_t(n) * size_t(w.rows));
}

void Backend::norm_swiglu(const float* x, const float* norm_w, int n, int dim, float eps, float* h,
                          const Matrix& w_gate, const Matrix& w_up, float* up, float* out) {
  rms_norm(x, norm_w, n, dim, eps, h);
  matmul(w_gate, h, n, out);
  matmul(w_up, h, n, up);
  swiglu(out, up, out, size_t(n) * size_t(w_gate.rows));
}

void Backend::mlp_residual(float* x, const float* norm_w, int n, int dim, float eps, float* h,
                           const Matrix& w_gate, const Matrix& w_up, const Matrix& w_down, float* up, float* gate) {
  norm_swiglu(x, norm_w, n, dim, eps, h, w_gate, w_up, up, gate);
  matmul_add(w_down, gate, n, x, h);
}

void Backend::qk_rope_write_kv(kv::LayerCache& layer, const StepBatch& batch, float* q, float* k, const float* v,
                               int n_heads, int n_kv_heads, int head_dim, const float* q_norm,
                               const float* k_norm, float eps, const Rope& r) {
  const int n = batch.n_tok();
  if (q_norm) rms_norm(q, q_norm, n * n_heads, head_dim, eps, q);
  if (k_norm) rms_norm(k, k_norm, n * n_kv_heads, head_dim, eps, k);
  // A sequence's tokens are consecutive rows at consecutive positions.
  for (const kv::QueryRun& run : batch.runs) {
    rope(q + size_t(run.first) * n_heads * head_dim, run.n, n_heads, head_dim, run.pos, r);
    rope(k + size_t(run.first) * n_kv_heads * head_dim, run.n, n_kv_heads, head_dim, run.pos, r);
  }
  write_kv(layer, batch, k, v);
}

DeviceInfo Backend::device_info() {
  DeviceInfo d;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon != std::string::npos) d.name = line.substr(line.find_first_not_of(" \t", colon + 1));
    break;
  }
  if (d.name.empty()) d.name = "unknown CPU";
  return d;
}

double Backend::measure_copy_bandwidth() {
  // Buffers well past any last-level cache, touched before timing; the best
  // of a few copies (the others lose time to the neighbours on a shared host).
  const size_t bytes = size_t(128) << 20;
  std::unique_ptr<char[]> src(new char[bytes]), dst(new char[bytes]);
  std::memset(src.get(), 1, bytes);
  std::memset(dst.get(), 0, bytes);
  double best = 1e30;
  for (int rep = 0; rep < 4; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.get(), src.get(), bytes);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
    src[rep] = dst[bytes - 1 - rep];  // keeps the copies observable
  }
  return 2.0 * double(bytes) / best;  // read + write
}

namespace {
[[noreturn]] void no_step_graphs(const char* backend) {
  fail(Errc::unsupported, "the ", backend, " backend cannot record decode steps (check supports_step_graphs() first)");
}
}  // namespace

void Backend::begin_step(const StepBatch&) { no_step_graphs(name()); }
void Backend::record_begin() { no_step_graphs(name()); }
std::unique_ptr<StepGraph> Backend::record_end() { no_step_graphs(name()); }
bool Backend::replay(const StepGraph&, kv::Cache&) { no_step_graphs(name()); }

GpuCodecSupport gpu_codec_support(const kv::BlockSpec& k, const kv::BlockSpec& v, int head_dim, int n_heads,
                                  int n_kv_heads) {
  GpuCodecSupport r;
#ifdef KVQ_HAVE_CUDA
  const cuda::AttentionPlan dec =
      cuda::choose_attention(cuda::AttentionCase::of(k, v, head_dim, n_heads, n_kv_heads, true));
  const cuda::AttentionPlan pre =
      cuda::choose_attention(cuda::AttentionCase::of(k, v, head_dim, n_heads, n_kv_heads, false));
  r.supported = dec.supported() && pre.supported();
  r.decode_kernel = dec.name();
  r.prefill_kernel = pre.name();
  r.why = !dec.supported() ? dec.why : pre.why;
#else
  (void)k, (void)v, (void)head_dim, (void)n_heads, (void)n_kv_heads;
  r.why = "built without CUDA";
#endif
  return r;
}

std::unique_ptr<Backend> make_backend(const std::string& device, const BackendOptions& options) {
  if (device == "cpu") return cpu::make_cpu_backend();
  if (device == "cuda") {
#ifdef KVQ_HAVE_CUDA
    return cuda::make_cuda_backend(options);
#else
    fail(Errc::unsupported,
         "the CUDA backend is not available in this build (configure with -DKVQ_CUDA=ON where nvcc is "
         "installed); use --device cpu");
#endif
  }
  fail(Errc::invalid_argument, "unknown device '", device, "' (valid: cpu, cuda)");
}

}  // namespace kvq
