// Kernel lab: time one decode step's worth of GEMVs for a model shape with the
// production gemv() (weights resident in the GPU layout, random contents),
// against the measured device-to-device copy bandwidth.
//   kvq_bench_gemv [bonsai-8b|qwen3-8b|q8-8b|q4-8b|q2k-8b|q3k-8b|q4k-8b|q5k-8b|q6k-8b] [iters]
// Prints per-matrix-kind and whole-step times (CUDA events, median of iters
// after warm-up), GB/s and % of copy bandwidth.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/gemv.hpp"
#include "lab_timing.cuh"

using namespace kvq;
using gguf::TensorType;

namespace {

__global__ void fill_random_bytes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = uint8_t(h);
  }
}
__global__ void fill_value_u16(uint16_t* p, size_t n, uint16_t v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = v;
}

cuda::GpuMatrix random_matrix(TensorType t, int64_t rows, int64_t cols, uint32_t seed) {
  cuda::GpuMatrix m;
  m.type = t;
  m.rows = rows;
  m.cols = cols;
  const auto& info = gguf::tensor_type_info(t);
  const bool q = t == TensorType::Q8_0 || t == TensorType::Q4_0 || t == TensorType::Q1_0;
  const size_t blocks = size_t(rows) * (cols / info.block_size);
  if (gguf::is_k_quant(t)) {  // random records (values are irrelevant to the timing), fp16 super-scales ~0.0078
    const GpuKQuantRecord rec = gpu_kquant_record(t);
    m.codes.resize(blocks * rec.code_bytes);
    fill_random_bytes<<<1024, 256>>>(m.codes.data(), m.codes.size(), seed);
    if (rec.scales) {
      m.scales.resize(blocks * rec.scales);
      fill_value_u16<<<1024, 256>>>(m.scales.data(), m.scales.size(), 0x2000);
    }
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    return m;
  }
  m.codes.resize(blocks * (q ? info.block_bytes - 2 : info.block_bytes));
  fill_random_bytes<<<1024, 256>>>(m.codes.data(), m.codes.size(), seed);
  if (t == TensorType::BF16) {  // keep values finite: overwrite with a constant bf16 pattern
    fill_value_u16<<<1024, 256>>>(reinterpret_cast<uint16_t*>(m.codes.data()), m.codes.size() / 2, 0x3c00);
  } else if (t == TensorType::F16) {
    fill_value_u16<<<1024, 256>>>(reinterpret_cast<uint16_t*>(m.codes.data()), m.codes.size() / 2, 0x2000);
  }
  if (q) {
    m.scales.resize(blocks);
    fill_value_u16<<<1024, 256>>>(m.scales.data(), blocks, 0x2000);  // fp16 ~0.0078
  }
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string shape = argc > 1 ? argv[1] : "bonsai-8b";
  const int iters = argc > 2 ? std::atoi(argv[2]) : 20;
  TensorType t = TensorType::Q1_0;
  if (shape == "qwen3-8b") t = TensorType::BF16;
  else if (shape == "q8-8b") t = TensorType::Q8_0;
  else if (shape == "q4-8b") t = TensorType::Q4_0;
  else if (shape == "q2k-8b") t = TensorType::Q2_K;
  else if (shape == "q3k-8b") t = TensorType::Q3_K;
  else if (shape == "q4k-8b") t = TensorType::Q4_K;
  else if (shape == "q5k-8b") t = TensorType::Q5_K;
  else if (shape == "q6k-8b") t = TensorType::Q6_K;
  const int layers = 36, d = 4096, qd = 4096, kvd = 1024, ff = 12288, vocab = 151936;
  struct Kind { const char* name; int rows, cols; };
  const Kind kinds[] = {{"attn_q", qd, d}, {"attn_k", kvd, d}, {"attn_v", kvd, d}, {"attn_output", d, qd},
                        {"ffn_gate", ff, d}, {"ffn_up", ff, d}, {"ffn_down", d, ff}};
  std::vector<std::vector<cuda::GpuMatrix>> mats(7);
  uint32_t seed = 1;
  for (int k = 0; k < 7; ++k)
    for (int l = 0; l < layers; ++l) mats[k].push_back(random_matrix(t, kinds[k].rows, kinds[k].cols, seed++));
  auto out = random_matrix(t, vocab, d, seed++);
  cuda::DeviceBuffer<float> x(ff), y(vocab);
  std::vector<float> hx(ff);
  for (int i = 0; i < ff; ++i) hx[i] = std::sin(0.1f * i);
  x.upload(hx);
  const double copy_gbs = lab::copy_bandwidth_gbs(size_t(2) << 30);
  std::printf("shape %s, weights %s, device-to-device copy %.0f GB/s (read+write)\n", shape.c_str(),
              gguf::tensor_type_name(t), copy_gbs);
  std::printf("%-12s %8s %8s %10s %8s %7s\n", "matrix", "rows", "cols", "us/layer", "GB/s", "%copy");
  double total_bytes = 0, total_ms = 0;
  for (int k = 0; k < 7; ++k) {
    const double ms = lab::time_ms(
        [&] {
          for (int l = 0; l < layers; ++l) cuda::gemv(mats[k][l], x.data(), y.data(), nullptr);
        },
        iters, 3);
    const double bytes = double(cuda::gemv_bytes(mats[k][0])) * layers;
    total_bytes += bytes;
    total_ms += ms;
    std::printf("%-12s %8d %8d %10.2f %8.0f %6.1f%%\n", kinds[k].name, kinds[k].rows, kinds[k].cols,
                ms * 1e3 / layers, bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
  }
  {
    const double ms = lab::time_ms([&] { cuda::gemv(out, x.data(), y.data(), nullptr); }, iters, 3);
    const double bytes = double(cuda::gemv_bytes(out));
    total_bytes += bytes;
    total_ms += ms;
    std::printf("%-12s %8d %8d %10.2f %8.0f %6.1f%%\n", "output", vocab, d, ms * 1e3, bytes / (ms * 1e-3) / 1e9,
                100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
  }
  std::printf("all GEMVs of one decode step: %.3f ms, %.2f GB, %.0f GB/s = %.1f%% of copy bandwidth\n", total_ms,
              total_bytes / 1e9, total_bytes / (total_ms * 1e-3) / 1e9,
              100.0 * total_bytes / (total_ms * 1e-3) / 1e9 / copy_gbs);
  // The fused launches of a decode step as the CUDA backend issues them:
  // per layer norm+QKV, O + residual, norm+gate/up+SwiGLU, down + residual.
  {
    cuda::DeviceBuffer<float> xr(d), norm(ff), q(qd), k(kvd), v(kvd), act(ff);
    std::vector<float> ones(ff, 1.0f);
    norm.upload(ones);
    xr.upload(std::vector<float>(hx.begin(), hx.begin() + d));
    act.upload(hx);
    constexpr int kEvents = 8;  // GemvRequest::trace
    cuda::DeviceContext lab_ctx(cuda::current_device());  // the lab's own knobs (GEMV warps)
    auto fused_step = [&](unsigned long long* trace) {
      for (int l = 0; l < layers; ++l) {
        auto slot = [&](int i) { return trace ? trace + (4 * l + i) * kEvents : nullptr; };
        cuda::GemvRequest qkv;
        qkv.x = xr.data();
        qkv.norm_weight = norm.data();
        qkv.norm_eps = 1e-6f;
        qkv.n_out = 3;
        qkv.out[0] = {&mats[0][l], q.data()};
        qkv.out[1] = {&mats[1][l], k.data()};
        qkv.out[2] = {&mats[2][l], v.data()};
        qkv.trace = slot(0);
        cuda::gemv(qkv, nullptr, lab_ctx);
        cuda::GemvRequest o;
        o.x = q.data();
        o.out[0] = {&mats[3][l], xr.data()};
        o.epilogue = cuda::GemvEpilogue::add;
        o.trace = slot(1);
        cuda::gemv(o, nullptr, lab_ctx);
        cuda::GemvRequest gu;
        gu.x = xr.data();
        gu.norm_weight = norm.data();
        gu.norm_eps = 1e-6f;
        gu.n_out = 2;
        gu.out[0] = {&mats[4][l], act.data()};
        gu.out[1] = {&mats[5][l], nullptr};
        gu.epilogue = cuda::GemvEpilogue::swiglu;
        gu.trace = slot(2);
        cuda::gemv(gu, nullptr, lab_ctx);
        cuda::GemvRequest down;
        down.x = act.data();
        down.out[0] = {&mats[6][l], xr.data()};
        down.epilogue = cuda::GemvEpilogue::add;
        down.trace = slot(3);
        cuda::gemv(down, nullptr, lab_ctx);
      }
    };
    double bytes = 0;
    for (int kk = 0; kk < 7; ++kk) bytes += double(cuda::gemv_bytes(mats[kk][0])) * layers;
    const int defaults = lab_ctx.settings.gemv_warps;
    // The fused step at 16 (the default) and 8 warps per CTA.
    for (int warps : {16, 8}) {
      lab_ctx.settings.gemv_warps = warps;
      const double ms = lab::time_ms([&] { fused_step(nullptr); }, iters, 3);
      std::printf("fused: 4 launches per layer, %d layers, %d warps per CTA: %.3f ms, %.2f GB, %.0f GB/s = %.1f%% of "
                  "copy bandwidth\n",
                  layers, warps, ms, bytes / 1e9, bytes / (ms * 1e-3) / 1e9,
                  100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
    }
    lab_ctx.settings.gemv_warps = defaults;
    // Timeline of one fused step with the default tuning: per launch kind,
    // the mean over layers 1..35 of (us, relative to the previous launch's
    // last CTA end) the first (0) and last (1) CTA to start, to return from
    // the wait for its predecessor, to finish staging the input, and to end.
    {
      const size_t n = size_t(layers) * 4 * kEvents;
      std::vector<unsigned long long> init(n);
      for (size_t i = 0; i < n; ++i) init[i] = i % 2 == 0 ? ~0ull : 0ull;
      cuda::DeviceBuffer<unsigned long long> trace(n);
      for (int rep = 0; rep < 3; ++rep) {  // the last of three warm runs is reported
        trace.upload(init);
        fused_step(trace.data());
        KVQ_CUDA_CHECK(cudaDeviceSynchronize());
      }
      const std::vector<unsigned long long> tr = trace.download();
      const char* names[4] = {"norm+QKV", "O+add", "norm+gate/up", "down+add"};
      std::printf("timeline (us after the previous launch's last CTA end; mean of layers 1..%d):\n", layers - 1);
      std::printf("%-14s %8s %8s %8s %8s %8s %8s %8s %8s\n", "launch", "start0", "start1", "wait0", "wait1",
                  "staged0", "staged1", "end0", "end1");
      for (int kind = 0; kind < 4; ++kind) {
        double sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int l = 1; l < layers; ++l) {
          const unsigned long long* e = tr.data() + (4 * l + kind) * kEvents;
          const int prev = 4 * l + kind - 1;
          const double ref = double(tr[prev * kEvents + 7]);
          for (int i = 0; i < 8; ++i) sum[i] += (double(e[i]) - ref) * 1e-3;
        }
        std::printf("%-14s", names[kind]);
        for (int i = 0; i < 8; ++i) std::printf(" %8.2f", sum[i] / (layers - 1));
        std::printf("\n");
      }
    }
  }
  KVQ_CUDA_CHECK(cudaGetLastError());
  return 0;
}
