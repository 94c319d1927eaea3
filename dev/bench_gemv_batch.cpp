// Kernel lab: the batched decode GEMV (backend/cuda/gemv_batch.hpp) on the
// four fused launches of one bonsai-8b / Qwen3-8B layer (d_model 4096, q 4096,
// kv 1024, d_ff 12288), for B = 1, 2, 4, 8, 16 input rows per launch.
//   kvq_bench_gemv_batch [--warps 16|8] [iters] [type ...]   (default types: Q1_0 Q8_0 Q4_K BF16)
// Per type, launch kind and B:
//   us        time of one launch (CUDA events around a loop over rotating
//             copies of the weights, divided by the copies; median of iters
//             after warm-up); the copies together exceed 256 MB, so L2 (50 MB)
//             does not hold the weights from one launch to the next
//   GB/s      weight bytes / us (each launch reads every weight once)
//   %copy     of the measured device-to-device copy bandwidth (read + write)
//   floor     weight bytes at the copy bandwidth: the time to beat
//   x/token   speedup per token against B separate single-vector gemv()
//             launches of the same fused request: B * t(gemv) / t(gemv_batch)
// Weights are random bytes in the GPU layout (values do not affect timing;
// float weights are a constant finite pattern, scales fp16 ~0.0078).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/device_buffer.hpp"
#include "backend/cuda/gemv.hpp"
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
  int warps = 16;  // GemvBatchRequest::warps_per_cta
  std::vector<const char*> args;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--warps" && i + 1 < argc) warps = std::atoi(argv[++i]);
    else args.push_back(argv[i]);
  }
  const int iters = !args.empty() ? std::max(3, std::atoi(args[0])) : 20;
  std::vector<TensorType> types;
  for (size_t i = 1; i < args.size(); ++i) {
    bool found = false;
    for (TensorType t : {TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q8_0, TensorType::Q4_0,
                         TensorType::Q1_0, TensorType::Q2_K, TensorType::Q3_K, TensorType::Q4_K, TensorType::Q5_K,
                         TensorType::Q6_K})
      if (args[i] == std::string(gguf::tensor_type_name(t))) {
        types.push_back(t);
        found = true;
      }
    if (!found) {
      std::fprintf(stderr, "unknown weight type %s (F32 F16 BF16 Q8_0 Q4_0 Q1_0 Q2_K..Q6_K)\n", args[i]);
      return 2;
    }
  }
  if (types.empty()) types = {TensorType::Q1_0, TensorType::Q8_0, TensorType::Q4_K, TensorType::BF16};
  const int batches[] = {1, 2, 4, 8, 16};
  constexpr int kMaxB = 16;

  const double copy_gbs = lab::copy_bandwidth_gbs(size_t(2) << 30);
  std::printf("device-to-device copy %.0f GB/s (read+write); bonsai-8b layer shapes, median of %d; %d warps per CTA\n",
              copy_gbs, iters, warps);

  // Inputs and outputs for up to 16 rows (x never overlaps an output).
  cuda::DeviceBuffer<float> x(size_t(kMaxB) * kDff), norm(kDff);
  {
    std::vector<float> hx(x.size()), ones(kDff, 1.0f);
    for (size_t i = 0; i < hx.size(); ++i) hx[i] = 0.01f * float(int(i % 201) - 100);
    x.upload(hx);
    norm.upload(ones);
  }
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
    std::printf("\n%s\n%-14s %3s %9s %9s %8s %7s %9s %9s\n", gguf::tensor_type_name(t), "launch", "B", "us",
                "floor us", "GB/s", "%copy", "gemv us", "x/token");
    double layer_us[kMaxB + 1] = {}, layer_gemv_us = 0, layer_bytes = 0;
    for (Launch& l : launches) {
      for (int r : l.rows) l.weight_bytes += layout_size(t, r, l.cols).bytes();
      const int copies = int(std::clamp<size_t>((kRotateBytes + l.weight_bytes - 1) / l.weight_bytes, 2, 64));
      for (int c = 0; c < copies; ++c) {
        l.sets.emplace_back();
        for (int r : l.rows) l.sets.back().push_back(random_matrix(t, r, l.cols));
      }
      layer_bytes += double(l.weight_bytes);
      auto batched = [&](int batch) {
        for (auto& set : l.sets) {
          cuda::GemvBatchRequest req;
          req.x = x.data();
          req.batch = batch;
          req.norm_weight = l.norm ? norm.data() : nullptr;
          req.norm_eps = 1e-6f;
          req.n_out = int(set.size());
          req.epilogue = l.epilogue;
          req.warps_per_cta = warps;
          for (size_t m = 0; m < set.size(); ++m) req.out[m] = {&set[m], y[m].data()};
          cuda::gemv_batch(req, nullptr);
        }
      };
      auto single = [&] {
        for (auto& set : l.sets) {
          cuda::GemvRequest req;
          req.x = x.data();
          req.norm_weight = l.norm ? norm.data() : nullptr;
          req.norm_eps = 1e-6f;
          req.n_out = int(set.size());
          req.epilogue = l.epilogue;
          for (size_t m = 0; m < set.size(); ++m) req.out[m] = {&set[m], y[m].data()};
          cuda::gemv(req, nullptr);
        }
      };
      const double gemv_us = lab::time_ms(single, iters, 2) * 1e3 / copies;
      layer_gemv_us += gemv_us;
      const double floor_us = double(l.weight_bytes) / (copy_gbs * 1e9) * 1e6;
      for (int b : batches) {
        const double us = lab::time_ms([&] { batched(b); }, iters, 2) * 1e3 / copies;
        layer_us[b] += us;
        const double gbs = double(l.weight_bytes) / (us * 1e-6) / 1e9;
        std::printf("%-14s %3d %9.2f %9.2f %8.0f %6.1f%% %9.2f %8.2fx\n", l.name, b, us, floor_us, gbs,
                    100.0 * gbs / copy_gbs, gemv_us, b * gemv_us / us);
      }
      l.sets.clear();  // frees this launch's copies before the next
    }
    const double floor_us = layer_bytes / (copy_gbs * 1e9) * 1e6;
    for (int b : batches) {
      const double gbs = layer_bytes / (layer_us[b] * 1e-6) / 1e9;
      std::printf("%-14s %3d %9.2f %9.2f %8.0f %6.1f%% %9.2f %8.2fx\n", "layer (4)", b, layer_us[b], floor_us, gbs,
                  100.0 * gbs / copy_gbs, layer_gemv_us, b * layer_gemv_us / layer_us[b]);
    }
  }
  KVQ_CUDA_CHECK(cudaGetLastError());
  return 0;
}
