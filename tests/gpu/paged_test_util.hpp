// Helpers of the paged-store GPU tests (test_paged.cpp, test_window.cpp):
// codec requests by name, readable test labels, a cache's device store of
// one layer, device bytes back to the host, and a tiny synthetic model.
#pragma once

#include <cctype>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "backend/backend.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/cuda_kv_cache.hpp"
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
