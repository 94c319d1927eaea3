// Kernel lab: the production split-KV flash attention (backend/cuda/attention)
// over one layer of a bf16 cache of the Qwen3-8B / Bonsai-8B shape (32 query
// heads, 8 KV heads, head_dim 128), at contexts 4k..64k.
//   kvq_bench_attention [iters]
// decode: one query token at position L-1 (reads L * 4 KiB of K+V per layer);
// prints time, GB/s and % of the device-to-device copy bandwidth, for
// flash_attention(n = 1) (host position) and flash_attention_decode_at()
// (position in device memory, the launch a recorded decode step replays; the
// cache holds 65536 tokens, so its split is the same at every context).
// prefill: a 512-token chunk at positions L-512..L-1 (causal); prints time and
// the fp32 FLOP rate (4 * heads * D * visible keys per query), since prefill is
// compute bound.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/cuda/attention.hpp"
#include "backend/cuda/attention_decode.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/device_buffer.hpp"
#include "lab_timing.cuh"

using namespace kvq;

namespace {

__global__ void fill_bf16(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    // bf16 in [-2, 2): sign, exponent 126..127, random mantissa.
    p[i] = uint16_t(((h & 1u) << 15) | ((126u + ((h >> 1) & 1u)) << 7) | ((h >> 2) & 0x7fu));
  }
}
__global__ void fill_f32(float* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2246822519u ^ seed;
    h ^= h >> 13;
    h *= 2654435761u;
    p[i] = float(h & 0xffff) / 32768.0f - 1.0f;
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int iters = argc > 1 ? std::max(1, std::atoi(argv[1])) : 20;
    const int n_heads = 32, n_kv = 8, D = 128, max_tokens = 65536;
    const double copy = lab::copy_bandwidth_gbs();
    std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy);
    cuda::DeviceBuffer<uint16_t> k(size_t(n_kv) * max_tokens * D), v(k.size());
    fill_bf16<<<1024, 256>>>(k.data(), k.size(), 1);
    fill_bf16<<<1024, 256>>>(v.data(), v.size(), 2);
    const int chunk = 512;
    cuda::DeviceBuffer<float> q(size_t(chunk) * n_heads * D), out(q.size());
    fill_f32<<<1024, 256>>>(q.data(), q.size(), 3);
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    cuda::KvLayerView layer{k.data(), v.data(), n_kv, D, max_tokens};
    cuda::AttentionScratch scratch;
    cuda::DeviceBuffer<int> pos_dev(1);
    const float scale = 0.08838834764831845f;
    const bool tensor_core = cuda::flash_decode_supported(n_heads, n_kv, D, out.data());
    std::printf("decode kernel: %s", tensor_core ? "tensor-core split-KV" : "general (CUDA cores)");
    if (tensor_core) std::printf(", %d splits x %d KV heads", cuda::flash_decode_splits(layer, n_heads), n_kv);
    std::printf("\n%8s %12s %10s %8s %12s %10s %8s %14s %12s\n", "context", "decode_us", "GB/s", "%copy", "dec_at_us",
                "GB/s", "%copy", "prefill512_ms", "TFLOP/s");
    for (int L : {4096, 8192, 16384, 32768, 65536}) {
      const double dec = lab::time_ms([&] { cuda::flash_attention(layer, L - 1, 1, q.data(), n_heads, scale, out.data(),
                                                              scratch, nullptr); }, iters);
      pos_dev.upload(std::vector<int>{L - 1});
      const double dec_at = lab::time_ms([&] { cuda::flash_attention_decode_at(layer, pos_dev.data(), q.data(), n_heads,
                                                                           scale, out.data(), scratch, nullptr); },
                                         iters);
      const double bytes = double(L) * n_kv * D * 2 * 2;
      const double pre = lab::time_ms([&] { cuda::flash_attention(layer, L - chunk, chunk, q.data(), n_heads, scale,
                                                              out.data(), scratch, nullptr); }, std::max(3, iters / 4));
      double keys = 0;
      for (int t = 0; t < chunk; ++t) keys += L - chunk + t + 1;
      const double flops = 4.0 * n_heads * D * keys;
      std::printf("%8d %12.1f %10.0f %7.1f%% %12.1f %10.0f %7.1f%% %14.3f %12.2f\n", L, dec * 1e3,
                  bytes / (dec * 1e-3) / 1e9, 100.0 * bytes / (dec * 1e-3) / 1e9 / copy, dec_at * 1e3,
                  bytes / (dec_at * 1e-3) / 1e9, 100.0 * bytes / (dec_at * 1e-3) / 1e9 / copy, pre,
                  flops / (pre * 1e-3) / 1e12);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_bench_attention: %s\n", e.what());
    return 1;
  }
}
