#include "backend/cuda/cuda_kv_cache.hpp"

#include "core/error.hpp"
#include "kv/codec_table.hpp"

namespace kvq::cuda {

void CudaLayerCache::write(int pos, int n, const float* k, const float* v) {
  write_kv(view_, pos, n, k, v, nullptr);
}

void CudaLayerCache::attend(int pos, int n, const float* q, int n_heads, float scale, float* out) const {
  flash_attention(view_, pos, n, q, n_heads, scale, out, *scratch_, nullptr);
}

CudaKvCache::CudaKvCache(const kv::CacheShape& shape) : shape_(shape) {
  KVQ_CHECK(shape.n_layers > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0 && shape.max_tokens > 0,
            Errc::invalid_argument, "GPU KV cache: empty shape (", shape.n_layers, " layers, ", shape.n_kv_heads,
            " KV heads, head_dim ", shape.head_dim, ", ", shape.max_tokens, " tokens)");
  const size_t per_layer = size_t(shape.n_kv_heads) * shape.max_tokens * shape.head_dim;
  const size_t total = per_layer * shape.n_layers;
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
    KVQ_CHECK(2 * total * sizeof(uint16_t) < free_b, Errc::out_of_range, "GPU KV cache for ", shape.max_tokens,
              " tokens needs ", 2 * total * sizeof(uint16_t) / (1 << 20), " MiB but only ", free_b / (1 << 20),
              " MiB of GPU memory are free; lower --ctx");
  k_.resize(total);
  v_.resize(total);
  // Zeroed once so unwritten rows are finite (they are never read: attention is causal).
  KVQ_CUDA_CHECK(cudaMemset(k_.data(), 0, k_.bytes()));
  KVQ_CUDA_CHECK(cudaMemset(v_.data(), 0, v_.bytes()));
  layers_.reserve(shape.n_layers);
  for (int l = 0; l < shape.n_layers; ++l) {
    KvLayerView view;
    view.k = k_.data() + per_layer * l;
    view.v = v_.data() + per_layer * l;
    view.n_kv_heads = shape.n_kv_heads;
    view.head_dim = shape.head_dim;
    view.max_tokens = shape.max_tokens;
    layers_.emplace_back(view, &scratch_);
  }
}

kv::LayerCache& CudaKvCache::layer(int i) {
  KVQ_CHECK(i >= 0 && i < shape_.n_layers, Errc::internal, "GPU KV cache: layer ", i, " of ", shape_.n_layers);
  return layers_[i];
}

uint64_t CudaKvCache::bytes_for_tokens(int n_tokens) const {
  return uint64_t(n_tokens) * shape_.n_layers * shape_.n_kv_heads * shape_.head_dim * 2 /*K,V*/ * 2 /*bf16*/;
}

std::unique_ptr<kv::Cache> make_cuda_kv_cache(const kv::CodecOptions& opts, const kv::CacheShape& shape) {
  const kv::ResolvedCodec codec = kv::resolve_codec(opts);  // unknown names: invalid_argument listing the valid ones
  KVQ_CHECK(codec.name == "none", Errc::unsupported, "fused GPU decode for ", codec.name,
            " is not implemented yet; use --kv none with --device cuda, or --device cpu for this codec");
  return std::make_unique<CudaKvCache>(shape);
}

}  // namespace kvq::cuda
