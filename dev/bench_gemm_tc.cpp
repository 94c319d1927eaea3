// Kernel lab: the tensor-core batched GEMM (backend/cuda/gemm_tc.hpp) beside
// the batched decode GEMV (gemv_batch.hpp) on the four fused launches of one
// bonsai-8b / Qwen3-8B layer (d_model 4096, q 4096, kv 1024, d_ff 12288), for
// B = 1, 8, 16, 32, 64 input rows.
//   kvq_bench_gemm_tc [iters] [type ...]   (default types: Q1_0 Q8_0 Q4_0; gemm_tc
//                                          types only, BF16 is not implemented)
// For a profiler run, environment variables narrow the work (so that the
// first gemm_tc launch is the one wanted): KVQ_LAB_BATCHES=8,64 (the B values),
// KVQ_LAB_LAUNCHES=gate (launches whose name contains the text),
// KVQ_LAB_PATHS=tc,cta,gb (which paths run; the others print 0),
// KVQ_LAB_MAX_CLUSTER=4 (gemm_tc's largest thread-block cluster, 1..8).
// Per type, launch kind and B:
//   tc us     time of one gemm_tc request with x quantized once per launch
//             into a workspace (the backend's path; CUDA events around a loop
//             over rotating copies of the weights, divided by the copies;
//             median of iters after warm-up); the copies together exceed
//             256 MB, so L2 (50 MB) does not hold the weights from one launch
//             to the next
//   cta us    the same without a workspace: every CTA stages its K slice of x
//   gb us     the same request through gemv_batch (B > 16: several launches)
//   tc/tok    tc us / B: microseconds per token
//   speedup   gb us / tc us
//   floor     weight bytes at the copy bandwidth
// and the layer (4 launches) sums. Weights are random bytes in the GPU layout
// (values do not affect timing; scales fp16 ~0.0078).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/device_buffer.hpp"
#include "backend/cuda/gemv.hpp"
#include "backend/cuda/gemm_tc.hpp"
#include "backend/cuda/gemv_batch.hpp"
#include "backend/gpu_layout.hpp"
#include "lab_timing.cuh"

using namespace kvq;
using gguf::TensorType;

namespace {

constexpr int kDModel = 4096, kQDim = 4096, kKvDim = 1024, kDff = 12288;
constexpr size_t kRotateBytes = size_t(256) << 20;

// Bytes of random data, generated once and uploaded into every matrix.
const std::vector<uint8_t>& random_bytes(size_t n) {
  static std::vector<uint8_t> bytes;
  if (bytes.size() < n) {
    bytes.resize(n);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < n; i += 8) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      for (size_t k = 0; k < 8 && i + k < n; ++k) bytes[i + k] = uint8_t(s >> (8 * k));
    }
  }
  return bytes;
}

// Bytes of codes and number of fp16 scales of a matrix in the GPU layout.
struct LayoutSize {
  size_t code_bytes = 0, n_scales = 0;
  size_t bytes() const { return code_bytes + 2 * n_scales; }
};
LayoutSize layout_size(TensorType t, int rows, int cols) {
  const auto& info = gguf::tensor_type_info(t);
  const size_t blocks = size_t(rows) * (cols / info.block_size);
  LayoutSize s;
  if (gguf::is_k_quant(t)) {
    const GpuKQuantRecord rec = gpu_kquant_record(t);
    s.code_bytes = blocks * rec.code_bytes;
    s.n_scales = blocks * rec.scales;
  } else if (cuda::gemv_quantizes_x(t)) {
    s.code_bytes = blocks * (info.block_bytes - 2);
    s.n_scales = blocks;
  } else {
    s.code_bytes = blocks * info.block_bytes;
  }
  return s;
}

// A matrix in the GPU layout with random contents.
cuda::GpuMatrix random_matrix(TensorType t, int rows, int cols) {
  cuda::GpuMatrix m;
  m.type = t;
  m.rows = rows;
  m.cols = cols;
  const LayoutSize size = layout_size(t, rows, cols);
  const size_t code_bytes = size.code_bytes, n_scales = size.n_scales;
  m.codes.resize(code_bytes);
  if (t == TensorType::F16 || t == TensorType::BF16 || t == TensorType::F32) {
    // A finite pattern (random bytes would be NaNs and infinities).
    std::vector<uint8_t> h(code_bytes);
    for (size_t i = 0; i + 1 < code_bytes; i += 2) {
      h[i] = 0x00;
      h[i + 1] = t == TensorType::F16 ? 0x20 : 0x3c;
    }
    m.codes.upload(h.data(), code_bytes);
  } else {
    m.codes.upload(random_bytes(code_bytes).data(), code_bytes);
  }
  if (n_scales) {
    std::vector<uint16_t> s(n_scales, 0x2000);  // fp16 ~0.0078
    m.scales.upload(s);
  }
  return m;
}

// One fused launch of a layer, its matrices in `copies` rotating sets.
struct Launch {
  const char* name;
  std::vector<int> rows;  // per matrix
  int cols;
  bool norm;
  cuda::GemvEpilogue epilogue;
  std::vector<std::vector<cuda::GpuMatrix>> sets;  // [copy][matrix]
  size_t weight_bytes = 0;                          // one set
};

}  // namespace

int main(int argc, char** argv) {
  const auto t_start = std::chrono::steady_clock::now();
  std::vector<const char*> args(argv + 1, argv + argc);
  const int iters = !args.empty() ? std::max(3, std::atoi(args[0])) : 20;
  std::vector<TensorType> types;
  for (size_t i = 1; i < args.size(); ++i) {
    bool found = false;
    for (TensorType t : {TensorType::Q8_0, TensorType::Q4_0, TensorType::Q1_0})
      if (args[i] == std::string(gguf::tensor_type_name(t))) {
        types.push_back(t);
        found = true;
      }
    if (!found) {
      std::fprintf(stderr, "unknown or unsupported weight type %s (Q1_0 Q8_0 Q4_0)\n", args[i]);
      return 2;
    }
  }
  if (types.empty()) types = {TensorType::Q1_0, TensorType::Q8_0, TensorType::Q4_0};
  std::vector<int> batches = {1, 8, 16, 32, 64};
  if (const char* e = std::getenv("KVQ_LAB_BATCHES")) {
    batches.clear();
    for (const char* p = e; *p;) {
      const int b = std::atoi(p);
      if (b < 1 || b > 64) {
        std::fprintf(stderr, "KVQ_LAB_BATCHES: %s is not a list of 1..64\n", e);
        return 2;
      }
      batches.push_back(b);
      while (*p && *p != ',') ++p;
      if (*p == ',') ++p;
    }
  }
  const int kNB = int(batches.size());
  constexpr int kMaxB = 64;
  const char* launch_filter = std::getenv("KVQ_LAB_LAUNCHES");
  const std::string paths = std::getenv("KVQ_LAB_PATHS") ? std::getenv("KVQ_LAB_PATHS") : "tc,cta,gb";
  cuda::KernelSettings settings;
  if (const char* e = std::getenv("KVQ_LAB_MAX_CLUSTER")) settings.gemm_tc_max_cluster = std::atoi(e);
  const cuda::DeviceContext ctx(cuda::current_device(), settings);
  auto path_on = [&](const char* name) { return ("," + paths + ",").find("," + std::string(name) + ",") != std::string::npos; };

  const double copy_gbs = lab::copy_bandwidth_gbs(size_t(2) << 30);
  std::printf("device-to-device copy %.0f GB/s (read+write); bonsai-8b layer shapes, median of %d\n", copy_gbs, iters);

  cuda::DeviceBuffer<float> x(size_t(kMaxB) * kDff), norm(kDff);
  {
    std::vector<float> hx(x.size()), ones(kDff, 1.0f);
    for (size_t i = 0; i < hx.size(); ++i) hx[i] = 0.01f * float(int(i % 201) - 100);
    x.upload(hx);
    norm.upload(ones);
  }
  cuda::DeviceBuffer<uint8_t> ws(cuda::gemm_tc_workspace_bytes(kMaxB, kDff));
  std::vector<cuda::DeviceBuffer<float>> y;
  for (int i = 0; i < 3; ++i) {
    y.emplace_back(size_t(kMaxB) * kDff);
    KVQ_CUDA_CHECK(cudaMemset(y.back().data(), 0, y.back().bytes()));
  }

  for (TensorType t : types) {
    using E = cuda::GemvEpilogue;
    std::vector<Launch> launches;
    launches.push_back({"norm+QKV", {kQDim, kKvDim, kKvDim}, kDModel, true, E::store, {}});
    launches.push_back({"O+add", {kDModel}, kQDim, false, E::add, {}});
    launches.push_back({"norm+gate/up", {kDff, kDff}, kDModel, true, E::swiglu, {}});
    launches.push_back({"down+add", {kDModel}, kDff, false, E::add, {}});
    std::printf("\n%s\n%-14s %3s %9s %9s %9s %9s %8s %9s\n", gguf::tensor_type_name(t), "launch", "B", "tc us",
                "cta us", "gb us", "tc/tok", "speedup", "floor us");
    std::vector<double> layer_tc(kNB), layer_cta(kNB), layer_gb(kNB);
    double layer_bytes = 0;
    for (Launch& l : launches) {
      if (launch_filter && !std::strstr(l.name, launch_filter)) continue;
      for (int r : l.rows) l.weight_bytes += layout_size(t, r, l.cols).bytes();
      const int copies = int(std::clamp<size_t>((kRotateBytes + l.weight_bytes - 1) / l.weight_bytes, 2, 64));
      for (int c = 0; c < copies; ++c) {
        l.sets.emplace_back();
        for (int r : l.rows) l.sets.back().push_back(random_matrix(t, r, l.cols));
      }
      layer_bytes += double(l.weight_bytes);
      enum Path { prestaged, in_cta, gemv_batch };
      auto run = [&](int batch, Path path) {
        for (auto& set : l.sets) {
          cuda::GemvBatchRequest req;
          req.x = x.data();
          req.batch = batch;
          req.norm_weight = l.norm ? norm.data() : nullptr;
          req.norm_eps = 1e-6f;
          req.n_out = int(set.size());
          req.epilogue = l.epilogue;
          for (size_t m = 0; m < set.size(); ++m) req.out[m] = {&set[m], y[m].data()};
          if (path == prestaged) cuda::gemm_tc(req, {ws.data(), ws.bytes()}, nullptr, ctx);
          else if (path == in_cta) cuda::gemm_tc(req, {}, nullptr, ctx);
          else cuda::gemv_batch(req, nullptr, ctx);
        }
      };
      const double floor_us = double(l.weight_bytes) / (copy_gbs * 1e9) * 1e6;
      for (int i = 0; i < kNB; ++i) {
        const int b = batches[i];
        auto time_path = [&](Path p, const char* name) {
          return path_on(name) ? lab::time_ms([&] { run(b, p); }, iters, 2) * 1e3 / copies : 0.0;
        };
        const double tc = time_path(prestaged, "tc");
        const double cta = time_path(in_cta, "cta");
        const double gb = time_path(gemv_batch, "gb");
        layer_tc[i] += tc;
        layer_cta[i] += cta;
        layer_gb[i] += gb;
        std::printf("%-14s %3d %9.2f %9.2f %9.2f %9.3f %7.2fx %9.2f\n", l.name, b, tc, cta, gb, tc / b, gb / tc,
                    floor_us);
      }
      l.sets.clear();  // frees this launch's copies before the next
    }
    const double floor_us = layer_bytes / (copy_gbs * 1e9) * 1e6;
    for (int i = 0; i < kNB; ++i) {
      const int b = batches[i];
      std::printf("%-14s %3d %9.2f %9.2f %9.2f %9.3f %7.2fx %9.2f\n", "layer (4)", b, layer_tc[i], layer_cta[i],
                  layer_gb[i], layer_tc[i] / b, layer_gb[i] / layer_tc[i], floor_us);
    }
  }
  KVQ_CUDA_CHECK(cudaGetLastError());
  std::printf("\n%.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count());
  return 0;
}
