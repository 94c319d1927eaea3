// Kernel lab: the per-layer KV costs of one decode step for any codec, on
// one layer of the Qwen3-8B / Bonsai-8B shape (32 query heads, 8 KV heads,
// head_dim 128), the cache holding 65536 tokens as in the engine.
//   kvq_bench_kv_decode [--hot] [--split-reserve N] [iters] [codec ...]
//   (default codecs: a mix; --split-reserve: KernelSettings::decode_split_reserve, for an A/B)
// Per codec:
//   append_us: the fused q/k-norm + RoPE + store launch (qk_rope_store) that
//              writes the step's K and V rows: the codec's encode cost.
//   L=...:     flash_attention_decode_at() (position in device memory, the
//              launch a recorded step replays) at that context, in us, with
//              L2 flushed before each call (a decode step finds its KV rows
//              cold: the weights and the other layers passed through L2
//              since; --hot keeps whatever the last call left), then the
//              slope (us per 1k keys, 16k to 64k) next to the byte floor of
//              that slope at the copy bandwidth.
//   chain:     the append and the attention launched back to back at 8k and
//              32k, q prepared by the append or by the attention (QPrep,
//              the engine's default in a recorded step).
//   chain timeline: the fused 32k chain's milestones of both kernels.
//   timeline:  one 8k launch's CTA milestones (in-kernel %globaltimer), us
//              after the first CTA started: the last CTA past its wait, past
//              its prologue (q, tables, first tiles asked), the first and the
//              last CTA done with their keys, the merge done.
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
#include "backend/cuda/attention_decode.hpp"
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
    int arg = 1;
    bool hot = false;
    if (arg < argc && std::string(argv[arg]) == "--hot") hot = true, ++arg;
    // The lab's own device context: its knobs change only the launches given it.
    cuda::DeviceContext lab_ctx(cuda::current_device());
    if (arg + 1 < argc && std::string(argv[arg]) == "--split-reserve")
      lab_ctx.settings.decode_split_reserve = std::max(0, std::atoi(argv[arg + 1])), arg += 2;
    const int iters = arg < argc ? std::max(1, std::atoi(argv[arg++])) : 20;
    std::vector<std::string> codecs;
    for (; arg < argc; ++arg) codecs.push_back(argv[arg]);
    if (codecs.empty()) codecs = {"none", "k8v8", "fp8", "k8v4", "tsym3", "tsym4", "k8vturbo2", "iso4", "k8vturbo3tcq"};
    const int n_heads = 32, n_kv = 8, D = 128, max_tokens = 65536;
    const double copy = lab::copy_bandwidth_gbs();
    std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy);
    const int contexts[] = {4096, 8192, 16384, 32768, 65536};
    constexpr int kSlopeFrom = 2;  // 16k .. 64k: past the small contexts' fixed costs
    std::printf("%s L2 before each attention call\n", hot ? "warm" : "flushed");
    std::printf("%-16s %7s %10s", "codec", "bits", "append_us");
    for (int L : contexts) std::printf(" %8s%-5d", "L=", L);
    std::printf(" %12s %12s\n", "us/1k keys", "floor us/1k");
    lab::L2Flush flush;
    auto before = [&] {
      if (!hot) flush();
    };
    std::vector<std::pair<std::string, std::vector<double>>> timelines, chains, chain_timelines;

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
                                0, pos_dev.data(), inv_freq.data(), true, 1.0, layer.view(), nullptr, false, lab_ctx);
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
                                              layer.scratch(), nullptr, nullptr, lab_ctx);
            },
            iters, 2, before);
        us.push_back(ms * 1e3);
        std::printf(" %13.1f", ms * 1e3);
      }
      const double slope = (us.back() - us[kSlopeFrom]) / ((contexts[4] - contexts[kSlopeFrom]) / 1000.0);
      const double floor = double(cache->bytes_for_tokens(1000)) / (copy * 1e9) * 1e6;
      std::printf(" %12.3f %12.3f\n", slope, floor);
      std::fflush(stdout);

      // The step's chain of the two launches (append, then attention), as a
      // recorded step issues them: q prepared by the append (the attention
      // waits for it), or by the attention itself beside the append (QPrep).
      const cuda::QPrep prep{q_norm.data(), 1e-6f, cuda::RopeParams{inv_freq.data(), true, 1.0}};
      std::vector<double> chain_us;
      for (int L : {8192, 32768})
        for (bool fused : {false, true}) {
          pos_dev.upload(std::vector<int>{L - 1});
          chain_us.push_back(1e3 * lab::time_ms(
                                       [&] {
                                         cuda::qk_rope_store(q.data(), k.data(), v.data(), n_heads, n_kv, D,
                                                             q_norm.data(), k_norm.data(), 1e-6f, 0, pos_dev.data(),
                                                             inv_freq.data(), true, 1.0, layer.view(), nullptr, fused, lab_ctx);
                                         cuda::flash_attention_decode_at(layer.view(), pos_dev.data(), q.data(),
                                                                         n_heads, scale, out.data(), layer.scratch(),
                                                                         nullptr, fused ? &prep : nullptr, lab_ctx);
                                       },
                                       iters, 2, before));
        }
      q.upload(hq);
      chains.emplace_back(name, chain_us);

      // Timeline of the fused chain at 32k (median of 5 per milestone), us
      // after the append's first warp returned from its wait: the append's
      // last warp past its wait and done with its row; the attention's first
      // CTA start, last CTA past its prologue, last key loop done, merge done.
      {
        pos_dev.upload(std::vector<int>{32767});
        std::vector<unsigned long long> init_a(4), init_f(12);
        for (int i = 0; i < 4; ++i) init_a[i] = i % 2 == 0 ? ~0ull : 0ull;
        for (int i = 0; i < 12; ++i) init_f[i] = i % 2 == 0 ? ~0ull : 0ull;
        cuda::DeviceBuffer<unsigned long long> ta(4), tf(12);
        std::vector<std::vector<float>> at(6);
        for (int r = 0; r < 6; ++r) {
          ta.upload(init_a);
          tf.upload(init_f);
          before();
          cuda::DeviceContext traced = lab_ctx;
          traced.settings.qk_rope_store_trace = ta.data();
          traced.settings.decode_trace = tf.data();
          cuda::qk_rope_store(q.data(), k.data(), v.data(), n_heads, n_kv, D, q_norm.data(), k_norm.data(), 1e-6f, 0,
                              pos_dev.data(), inv_freq.data(), true, 1.0, layer.view(), nullptr, true, traced);
          cuda::flash_attention_decode_at(layer.view(), pos_dev.data(), q.data(), n_heads, scale, out.data(),
                                          layer.scratch(), nullptr, &prep, traced);
          KVQ_CUDA_CHECK(cudaDeviceSynchronize());
          const auto a = ta.download(), f = tf.download();
          if (r == 0) continue;  // warm-up
          const unsigned long long t0 = a[0];
          const unsigned long long m[6] = {a[1], a[3], f[0], f[5], f[7], f[11]};
          for (int i = 0; i < 6; ++i) at[i].push_back(float((double(m[i]) - double(t0)) * 1e-3));
        }
        std::vector<double> tl;
        for (auto& x : at) tl.push_back(lab::median(x));
        chain_timelines.emplace_back(name, tl);
      }

      // Timeline of one cold 8k launch (median of 5 per milestone).
      pos_dev.upload(std::vector<int>{8191});
      std::vector<unsigned long long> init(12);
      for (int i = 0; i < 12; ++i) init[i] = i % 2 == 0 ? ~0ull : 0ull;
      cuda::DeviceBuffer<unsigned long long> trace(12);
      std::vector<std::vector<float>> at(5);
      for (int r = 0; r < 6; ++r) {
        trace.upload(init);
        before();
        cuda::DeviceContext traced = lab_ctx;
        traced.settings.decode_trace = trace.data();
        cuda::flash_attention_decode_at(layer.view(), pos_dev.data(), q.data(), n_heads, scale, out.data(),
                                        layer.scratch(), nullptr, nullptr, traced);
        KVQ_CUDA_CHECK(cudaDeviceSynchronize());
        const auto e = trace.download();
        if (r == 0) continue;  // warm-up
        // last wait, last prologue, first loop end, last loop end, merged
        const unsigned long long v[5] = {e[3], e[5], e[6], e[7], e[11]};
        for (int i = 0; i < 5; ++i) at[i].push_back(float(double(v[i] - e[0]) * 1e-3));
      }
      std::vector<double> tl;
      for (auto& x : at) tl.push_back(lab::median(x));
      timelines.emplace_back(name, tl);
    }
    std::printf("\n8k timeline, us after the first CTA start (cold L2):\n%-16s %10s %10s %10s %10s %10s\n", "codec",
                "last wait", "last prol.", "first done", "last done", "merged");
    for (const auto& [name, tl] : timelines) {
      std::printf("%-16s", name.c_str());
      for (double x : tl) std::printf(" %10.2f", x);
      std::printf("\n");
    }
    std::printf("\nappend + attention chain, us (%s L2): q prepared by the append / by the attention (fused)\n"
                "%-16s %10s %10s %10s %10s\n", hot ? "warm" : "cold", "codec", "8k", "8k fused", "32k", "32k fused");
    for (const auto& [name, c] : chains) {
      std::printf("%-16s", name.c_str());
      for (double x : c) std::printf(" %10.2f", x);
      std::printf("\n");
    }
    std::printf("\n32k fused chain timeline, us after the append's first warp passed its wait (cold L2):\n"
                "%-16s %10s %10s %10s %10s %10s %10s\n",
                "codec", "app. wait", "app. done", "attn start", "last prol.", "last done", "merged");
    for (const auto& [name, tl] : chain_timelines) {
      std::printf("%-16s", name.c_str());
      for (double x : tl) std::printf(" %10.2f", x);
      std::printf("\n");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_bench_kv_decode: %s\n", e.what());
    return 1;
  }
}
