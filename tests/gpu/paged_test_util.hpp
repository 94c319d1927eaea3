// Helpers of the paged-store GPU tests (test_paged.cpp, test_window.cpp):
// codec requests by name, readable test labels, a cache's device store of
// one layer, device bytes back to the host, and a tiny synthetic model.
#pragma once

#include <cctype>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "backend/backend.hpp"
#include "backend/cuda/attention.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/cuda_kv_cache.hpp"
#include "backend/cuda/ops.hpp"
#include "core/rng.hpp"
#include "gpu_test_util.hpp"
#include "kv/cache.hpp"
#include "model/forward.hpp"
#include "model/synth.hpp"

namespace kvq::gputest {

// "k8v4" is a named codec; "q8/turbo3" the per-side blocks --ctk q8 --ctv turbo3.
inline kv::CodecOptions codec(const std::string& name) {
  kv::CodecOptions o;
  const size_t slash = name.find('/');
  if (slash == std::string::npos) {
    o.kv = name;
  } else {
    o.ctk = name.substr(0, slash);
    o.ctv = name.substr(slash + 1);
  }
  return o;
}
// A gtest parameter label: every character that is not alphanumeric becomes '_'.
inline std::string label_of(const std::string& name) {
  std::string l = name;
  for (char& c : l)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return l;
}
inline const cuda::GpuKvLayer& store_of(kv::Cache& c, int layer) {
  return dynamic_cast<cuda::CudaLayerCache&>(c.layer(layer)).view();
}
inline std::vector<uint8_t> download_bytes(const uint8_t* p, size_t n) {
  std::vector<uint8_t> h(n);
  if (n) KVQ_CUDA_CHECK(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
  return h;
}
// Random q, k, v (seed 5) of tokens at positions `pos`, written to `slots`
// of layer 0 twice: by the fused q/k norm + RoPE + store (qk_rope_store)
// into `fused`, and by the plain slot store (write_kv_slots) of the k it
// rotated and of v into `plain`. The two stores must then hold the same rows.
// Returns q as the fused kernel left it (normed and rotated).
inline std::vector<float> store_fused_and_plain(kv::Cache& fused, kv::Cache& plain, int n_heads, int n_kv, int D,
                                  const std::vector<int32_t>& pos, const std::vector<int32_t>& slots) {
  const int n = int(pos.size());
  std::vector<float> inv_freq;
  for (int i = 0; i < D / 2; ++i) inv_freq.push_back(float(std::pow(1e6, -2.0 * i / D)));
  Rng rng(5);
  const auto q = normal(rng, size_t(n) * n_heads * D), kn = normal(rng, D), qn = normal(rng, D);
  const auto k = normal(rng, size_t(n) * n_kv * D), v = normal(rng, size_t(n) * n_kv * D);
  cuda::DeviceBuffer<float> freq(inv_freq.size()), dkn(D), dqn(D);
  freq.upload(inv_freq);
  dkn.upload(kn);
  dqn.upload(qn);
  cuda::DeviceBuffer<int32_t> dpos(pos.size()), dslots(slots.size());
  dpos.upload(pos);
  dslots.upload(slots);
  Guarded dq(q.size(), &q), dk(k.size(), &k), dv(v.size(), &v);
  cuda::qk_rope_store(dq.data(), dk.data(), dv.data(), n_heads, n_kv, D, dqn.data(), dkn.data(), 1e-6f, 0, dpos.data(),
                      freq.data(), true, 1.0, store_of(fused, 0), nullptr, false, cuda::default_context(), n,
                      dslots.data());
  cuda::write_kv_slots(store_of(plain, 0), dslots.data(), n, dk.data(), dv.data(), nullptr);  // dk: the rotated k
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  return dq.result();
}

// Random K and V rows for `slots` of layer 0 (a peaked softmax: every third
// K value + 1.5; outliers in V: every 97th value x 20), written into both
// stores (the CPU one from host memory, the CUDA one from device memory).
// Returns the rows written.
struct KvRows {
  std::vector<float> k, v;
};
inline KvRows write_peaked_rows(kv::Cache& cpu, kv::Cache& gpu, const std::vector<int32_t>& slots, int n_kv, int D,
                              Rng& rng) {
  const int n = int(slots.size());
  const size_t kv_row = size_t(n_kv) * D;
  auto k = normal(rng, size_t(n) * kv_row), v = normal(rng, size_t(n) * kv_row);
  for (int t = 0; t < n; ++t)
    for (size_t i = 0; i < kv_row; ++i) k[t * kv_row + i] += (i % 3 == 0) ? 1.5f : 0.0f;
  for (size_t i = 0; i < v.size(); i += 97) v[i] *= 20.0f;
  cpu.layer(0).write_slots(slots.data(), n, k.data(), v.data());
  Guarded dk(k.size(), &k), dv(v.size(), &v);
  gpu.layer(0).write_slots(slots.data(), n, dk.data(), dv.data());
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  return {std::move(k), std::move(v)};
}

// A synthetic tiny model (kvq synth, `seed`) on `be`, through a temporary GGUF file.
inline std::unique_ptr<Model> tiny_synthetic_model(Backend& be, uint64_t seed) {
  namespace fs = std::filesystem;
  const fs::path path = fs::temp_directory_path() /
                        ("kvq_gpu_batch_" + std::to_string(::getpid()) + "_" + std::to_string(seed) + ".gguf");
  SynthOptions so;
  so.shape = "tiny";
  so.seed = seed;
  write_synthetic(so, path.string());
  auto model = Model::open(path.string(), be);
  fs::remove(path);
  return model;
}

}  // namespace kvq::gputest
