// The device-resident KV cache of the CUDA backend for codec `none` (bf16).
//
// Preallocated for shape.max_tokens at construction: K and V separate, per
// layer [kv_head][token][head_dim] bf16 (attention.hpp), so decode never
// reallocates or copies through the host. The kv::LayerCache methods take
// DEVICE pointers here (the CUDA backend's buffers), unlike the CPU caches;
// only the CUDA backend calls them.
#pragma once

#include <memory>
#include <vector>

#include "backend/cuda/attention.hpp"
#include "backend/cuda/device_buffer.hpp"
#include "kv/cache.hpp"

namespace kvq::cuda {

class CudaLayerCache final : public kv::LayerCache {
 public:
  CudaLayerCache(KvLayerView view, AttentionScratch* scratch) : view_(view), scratch_(scratch) {}
  // k, v, q, out: device memory.
  void write(int pos, int n, const float* k, const float* v) override;
  void attend(int pos, int n, const float* q, int n_heads, float scale, float* out) const override;
  const KvLayerView& view() const { return view_; }
  // The partial-state scratch shared by the cache's layers (the backend
  // launches attention on its own stream with it).
  AttentionScratch& scratch() const { return *scratch_; }

 private:
  KvLayerView view_;
  AttentionScratch* scratch_;
};

class CudaKvCache final : public kv::Cache {
 public:
  explicit CudaKvCache(const kv::CacheShape& shape);
  const kv::CacheShape& shape() const override { return shape_; }
  std::string codec_name() const override { return "none"; }
  kv::LayerCache& layer(int i) override;
  uint64_t bytes_for_tokens(int n_tokens) const override;

 private:
  kv::CacheShape shape_;
  DeviceBuffer<uint16_t> k_, v_;  // [layer][kv_head][max_tokens][head_dim]
  AttentionScratch scratch_;      // shared by the layers (one runs at a time)
  std::vector<CudaLayerCache> layers_;
};

// The GPU cache for a codec request: `none` (aliases bf16, f16) only; any other
// codec is Errc::unsupported naming it (no silent CPU fallback).
std::unique_ptr<kv::Cache> make_cuda_kv_cache(const kv::CodecOptions& opts, const kv::CacheShape& shape);

}  // namespace kvq::cuda
