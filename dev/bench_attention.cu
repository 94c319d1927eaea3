// Kernel lab: production attention (backend/cuda/attention*) over one layer
// of a bf16 cache of the Qwen3-8B / Bonsai-8B shape (32 query heads, 8 KV
// heads, head_dim 128), at contexts 2k..64k.
//   kvq_bench_attention [iters]
// decode: one query token at position L-1 (reads L * 4 KiB of K+V per layer);
// prints time, GB/s and % of the device-to-device copy bandwidth, for
// flash_attention(n = 1) (host position) and flash_attention_decode_at()
// (position in device memory, the launch a recorded decode step replays; the
// cache holds 65536 tokens, so its split is the same at every context).
// prefill: a 512- and a 2048-token chunk ending at position L-1 (causal; the
// tensor-core kernel of attention_prefill.cu); prints time and TFLOP/s
// counting only unmasked work, 4 * heads * D * visible keys per query token.
// Last line: the attention time of a whole 64k-token prompt prefilled in
// 2048-token chunks over 36 layers, from the measured chunk times
// (interpolated linearly in the context between the measured points).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>
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
    constexpr int kChunks[2] = {512, 2048};
    const int max_chunk = kChunks[1];
    cuda::DeviceBuffer<float> q(size_t(max_chunk) * n_heads * D), out(q.size());
    fill_f32<<<1024, 256>>>(q.data(), q.size(), 3);
    KVQ_CUDA_CHECK(cudaDeviceSynchronize());
    cuda::KvLayerView layer{k.data(), v.data(), n_kv, D, max_tokens};
    cuda::AttentionScratch scratch;
    cuda::DeviceBuffer<int> pos_dev(1);
    const float scale = 0.08838834764831845f;
    const cuda::AttentionPlan plan = cuda::choose_attention(cuda::AttentionCase::of(layer, n_heads, true));
    const bool tensor_core =
        plan.kernel == cuda::AttentionKernel::decode_tc || plan.kernel == cuda::AttentionKernel::decode_km;
    std::printf("decode kernel: %s", tensor_core ? "tensor-core split-KV" : "general (CUDA cores)");
    if (tensor_core) std::printf(", %d splits x %d KV heads", cuda::flash_decode_splits(layer, n_heads), n_kv);
    std::printf("\n");
    // 4 * heads * D * sum over the chunk's queries of their visible keys.
    auto prefill_flops = [&](int L, int chunk) {
      double keys = 0;
      for (int t = 0; t < chunk; ++t) keys += L - chunk + t + 1;
      return 4.0 * n_heads * D * keys;
    };
    std::printf("%8s %10s %8s %7s %10s %8s %7s %14s %9s %15s %9s\n", "context", "decode_us", "GB/s", "%copy",
                "dec_at_us", "GB/s", "%copy", "prefill512_ms", "TFLOP/s", "prefill2048_ms", "TFLOP/s");
    std::vector<std::pair<int, double>> chunk2048_ms;  // (context, ms) for the whole-prompt estimate
    for (int L : {2048, 4096, 8192, 16384, 32768, 65536}) {
      const double dec = lab::time_ms([&] { cuda::flash_attention(layer, L - 1, 1, q.data(), n_heads, scale, out.data(),
                                                              scratch, nullptr); }, iters);
      pos_dev.upload(std::vector<int>{L - 1});
      const double dec_at = lab::time_ms([&] { cuda::flash_attention_decode_at(layer, pos_dev.data(), q.data(), n_heads,
                                                                           scale, out.data(), scratch, nullptr); },
                                         iters);
      const double bytes = double(L) * n_kv * D * 2 * 2;
      double pre[2];
      for (int c = 0; c < 2; ++c) {
        const int chunk = kChunks[c];
        pre[c] = lab::time_ms([&] { cuda::flash_attention(layer, L - chunk, chunk, q.data(), n_heads, scale,
                                                         out.data(), scratch, nullptr); }, std::max(3, iters / 4));
      }
      chunk2048_ms.emplace_back(L, pre[1]);
      std::printf("%8d %10.1f %8.0f %6.1f%% %10.1f %8.0f %6.1f%% %14.3f %9.1f %15.3f %9.1f\n", L, dec * 1e3,
                  bytes / (dec * 1e-3) / 1e9, 100.0 * bytes / (dec * 1e-3) / 1e9 / copy, dec_at * 1e3,
                  bytes / (dec_at * 1e-3) / 1e9, 100.0 * bytes / (dec_at * 1e-3) / 1e9 / copy, pre[0],
                  prefill_flops(L, 512) / (pre[0] * 1e-3) / 1e12, pre[1],
                  prefill_flops(L, 2048) / (pre[1] * 1e-3) / 1e12);
    }
    // The recorded step's launch against its L2 prefetch distance (tiles of a
    // warp; 0 = off). The table above used the default.
    {
      const int defaults = cuda::KernelSettings{}.attn_prefetch_tiles;
      const int dists[] = {0, 1, 2};
      std::printf("decode_at us by L2 prefetch distance (default %d):\n%8s", defaults, "context");
      for (int dist : dists) std::printf(" %9s%-3d", "prefetch ", dist);
      std::printf("\n");
      for (int L : {2048, 4096, 8192, 16384, 32768, 65536}) {
        pos_dev.upload(std::vector<int>{L - 1});
        std::printf("%8d", L);
        for (int dist : dists) {
          cuda::DeviceContext lab_ctx(cuda::current_device());  // the lab's own knobs
          lab_ctx.settings.attn_prefetch_tiles = dist;
          const double ms = lab::time_ms([&] { cuda::flash_attention_decode_at(layer, pos_dev.data(), q.data(), n_heads,
                                                                           scale, out.data(), scratch, nullptr,
                                                                           nullptr, lab_ctx); },
                                         iters);
          std::printf(" %12.1f", ms * 1e3);
        }
        std::printf("\n");
      }
    }
    // Timeline of the recorded step's launch (default prefetch), us after the
    // first CTA's start: wait returned (first, last), Q fragments built (last),
    // key loop done (first, last), arrival counted (last), merge done.
    {
      std::vector<unsigned long long> init(12);
      for (int i = 0; i < 12; ++i) init[i] = i % 2 == 0 ? ~0ull : 0ull;
      cuda::DeviceBuffer<unsigned long long> trace(12);
      std::printf("decode_at timeline, us after the first CTA start:\n%8s %11s %11s %11s %11s %11s %11s %11s\n",
                  "context", "first wait", "last wait", "last qfrag", "first loop", "last loop", "last arrive",
                  "merged");
      for (int L : {2048, 4096, 16384, 65536}) {
        pos_dev.upload(std::vector<int>{L - 1});
        std::vector<double> sum(7, 0.0);
        const int reps = 5;
        for (int r = 0; r < reps + 1; ++r) {
          trace.upload(init);
          cuda::DeviceContext traced(cuda::current_device());
          traced.settings.decode_trace = trace.data();
          cuda::flash_attention_decode_at(layer, pos_dev.data(), q.data(), n_heads, scale, out.data(), scratch,
                                          nullptr, nullptr, traced);
          KVQ_CUDA_CHECK(cudaDeviceSynchronize());
          const auto e = trace.download();
          if (r == 0) continue;  // warm-up
          const double t0 = double(e[0]);
          const double v[7] = {double(e[2]), double(e[3]), double(e[5]), double(e[6]), double(e[7]), double(e[9]),
                               double(e[11])};
          for (int i = 0; i < 7; ++i) sum[i] += (v[i] - t0) * 1e-3 / reps;
        }
        std::printf("%8d", L);
        for (double x : sum) std::printf(" %11.2f", x);
        std::printf("\n");
      }
    }
    // Whole 64k prompt: chunks ending at 2048, 4096, ..., 65536.
    auto interpolate_ms = [&](int L) {
      for (size_t i = 1; i < chunk2048_ms.size(); ++i)
        if (L <= chunk2048_ms[i].first) {
          const auto [l0, t0] = chunk2048_ms[i - 1];
          const auto [l1, t1] = chunk2048_ms[i];
          return t0 + (t1 - t0) * double(L - l0) / double(l1 - l0);
        }
      return chunk2048_ms.back().second;
    };
    double prompt_ms = 0, prompt_flops = 0;
    for (int L = 2048; L <= 65536; L += 2048) {
      prompt_ms += interpolate_ms(L);
      prompt_flops += prefill_flops(L, 2048);
    }
    constexpr int kLayers = 36;
    std::printf("64k-token prompt, 2048-token chunks, %d layers: attention %.2f s (%.1f TFLOP/s)\n", kLayers,
                kLayers * prompt_ms * 1e-3, prompt_flops / (prompt_ms * 1e-3) / 1e12);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_bench_attention: %s\n", e.what());
    return 1;
  }
}
