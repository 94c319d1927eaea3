// Kernel lab: the per-layer KV costs of one decode step for any codec, on
// one layer of the Qwen3-8B / Bonsai-8B shape (32 query heads, 8 KV heads,
// head_dim 128), the cache holding 65536 tokens as in the engine.
//   kvq_bench_kv_decode [iters] [codec ...]      (default codecs: a mix)
// Per codec:
//   append_us: the fused q/k-norm + RoPE + store launch (qk_rope_store) that
//              writes the step's K and V rows: the codec's encode cost.
//   L=...:     flash_attention_decode_at() (position in device memory, the
//              launch a recorded step replays) at that context, in us, and
//              the implied slope (us per 1k keys between the first and last
//              context) next to the byte floor of that slope at the copy
//              bandwidth.
// The cache is filled by the codec's bulk GPU encode from random rows.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/attention.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/cuda_kv_cache.hpp"
#include "backend/cuda/device_buffer.hpp"
#include "backend/cuda/ops.hpp"
#include "kv/codec_table.hpp"
#include "lab_timing.cuh"

using namespace kvq;

namespace {

// Host-generated uniform values in [-2, 2) (a .cpp lab: kv/ headers are C++20
// that nvcc does not take).
void fill(std::vector<float>& h, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1u;
  for (float& f : h) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    f = float(x & 0xffff) / 16384.0f - 2.0f;
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int iters = argc > 1 ? std::max(1, std::atoi(argv[1])) : 20;
    std::vector<std::string> codecs;
    for (int i = 2; i < argc; ++i) codecs.push_back(argv[i]);
    if (codecs.empty()) codecs = {"none", "k8v8", "fp8", "k8v4", "tsym3", "tsym4", "k8vturbo2", "iso4", "k8vturbo3tcq"};
    const int n_heads = 32, n_kv = 8, D = 128, max_tokens = 65536;
    const double copy = lab::copy_bandwidth_gbs();
    std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy);
    const int contexts[] = {4096, 16384, 65536};
    std::printf("%-16s %7s %10s", "codec", "bits", "append_us");
    for (int L : contexts) std::printf(" %8s%-5d", "L=", L);
    std::printf(" %12s %12s\n", "us/1k keys", "floor us/1k");

    const int chunk = 4096;
    cuda::DeviceBuffer<float> k(size_t(chunk) * n_kv * D), v(k.size()), q(size_t(n_heads) * D), out(q.size());
    cuda::DeviceBuffer<float> q_norm(D), k_norm(D), inv_freq(D / 2);
    std::vector<float> hq(q.size()), hk(k.size()), hv(v.size());
    fill(hq, 3);
    q.upload(hq);
    std::vector<float> ones(D, 1.0f), freqs(D / 2);
    for (int i = 0; i < D / 2; ++i) freqs[i] = float(std::pow(1e6, -2.0 * i / D));
    q_norm.upload(ones);
    k_norm.upload(ones);
    inv_freq.upload(freqs);
    cuda::DeviceBuffer<int> pos_dev(1);
    const float scale = 0.08838834764831845f;
    for (const std::string& name : codecs) {
      kv::CodecOptions opts;
      opts.kv = name;
      kv::CacheShape shape{1, n_kv, D, max_tokens, n_heads};
      auto cache = cuda::make_cuda_kv_cache(opts, shape);
      auto& layer = static_cast<cuda::CudaLayerCache&>(cache->layer(0));
      for (int p0 = 0; p0 < max_tokens; p0 += chunk) {
        fill(hk, 11u + p0);
        fill(hv, 17u + p0);
        k.upload(hk);
        v.upload(hv);
        layer.write(p0, chunk, k.data(), v.data());
      }
      KVQ_CUDA_CHECK(cudaDeviceSynchronize());
      const double bits = 8.0 * double(cache->bytes_for_tokens(1)) / (2.0 * n_kv * D);
      // The append launch at a late position (its rows are overwritten: the
      // cache content barely changes).
      pos_dev.upload(std::vector<int>{max_tokens - 2});
      const double append = lab::time_ms(
          [&] {
            cuda::qk_rope_store(q.data(), k.data(), v.data(), n_heads, n_kv, D, q_norm.data(), k_norm.data(), 1e-6f,
                                0, pos_dev.data(), inv_freq.data(), true, 1.0, layer.view(), nullptr);
          },
          iters);
      q.upload(hq);  // the append launch normalised and rotated q in place
      std::printf("%-16s %7.3f %10.2f", name.c_str(), bits, append * 1e3);
      std::vector<double> us;
      for (int L : contexts) {
        pos_dev.upload(std::vector<int>{L - 1});
        const double ms = lab::time_ms(
            [&] {
              cuda::flash_attention_decode_at(layer.view(), pos_dev.data(), q.data(), n_heads, scale, out.data(),
                                              layer.scratch(), nullptr);
            },
            iters);
        us.push_back(ms * 1e3);
        std::printf(" %13.1f", ms * 1e3);
      }
      const double slope = (us.back() - us.front()) / ((contexts[2] - contexts[0]) / 1000.0);
      const double floor = double(cache->bytes_for_tokens(1000)) / (copy * 1e9) * 1e6;
      std::printf(" %12.3f %12.3f\n", slope, floor);
      std::fflush(stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_bench_kv_decode: %s\n", e.what());
    return 1;
  }
}
