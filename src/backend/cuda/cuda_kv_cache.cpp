#include "backend/cuda/cuda_kv_cache.hpp"

#include "backend/cuda/cuda_check.hpp"
#include "core/error.hpp"
#include "kv/block.hpp"

namespace kvq::cuda {

void CudaLayerCache::write(int pos, int n, const float* k, const float* v) {
  write_kv(store_, pos, n, k, v, nullptr);
}

void CudaLayerCache::attend(int pos, int n, const float* q, int n_heads, float scale, float* out) const {
  flash_attention(store_, pos, n, q, n_heads, scale, out, *scratch_, nullptr);
}

CudaKvCache::CudaKvCache(const kv::CodecDescriptor& codec, const kv::CacheShape& shape, uint64_t seed)
    : codec_(codec), shape_(shape) {
  const int n_heads = shape.n_heads > 0 ? shape.n_heads : shape.n_kv_heads;
  KVQ_CHECK(shape.n_layers > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0 && shape.max_tokens > 0,
            Errc::invalid_argument, "GPU KV cache: empty shape (", shape.n_layers, " layers, ", shape.n_kv_heads,
            " KV heads, head_dim ", shape.head_dim, ", ", shape.max_tokens, " tokens)");
  KVQ_CHECK(codec.head_dim == shape.head_dim, Errc::internal, "GPU KV cache: codec described for head_dim ",
            codec.head_dim, ", cache head_dim ", shape.head_dim);
  for (bool decode : {true, false}) {
    AttentionCase c;
    c.head_dim = shape.head_dim;
    c.n_heads = n_heads;
    c.n_kv_heads = shape.n_kv_heads;
    c.k = codec.k.spec.family;
    c.v = codec.v.spec.family;
    c.decode = decode;
    const AttentionChoice choice = attention_support(c);
    KVQ_CHECK(choice.supported && !codec.k.spec.qjl, Errc::unsupported, "KV codec ", codec.name,
              " has no GPU kernels yet (", choice.supported ? std::string("+qjl") : choice.why,
              "); use --device cpu for it, or a codec that `kvq codecs` marks as GPU");
    (decode ? decode_kernel_ : prefill_kernel_) = choice.kernel;
  }
  const size_t rows_per_layer = size_t(shape.n_kv_heads) * shape.max_tokens;
  const size_t rows = rows_per_layer * shape.n_layers;
  const uint64_t bytes = uint64_t(rows) * codec.bytes_per_token_per_head();
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
    KVQ_CHECK(bytes < free_b, Errc::out_of_range, "GPU KV cache (", codec.name, ") for ", shape.max_tokens,
              " tokens needs ", bytes >> 20, " MiB but only ", free_b >> 20, " MiB of GPU memory are free; lower --ctx");
  k_code_.resize(rows * codec.k.code_bytes);
  v_code_.resize(rows * codec.v.code_bytes);
  if (codec.k.side_bytes) k_side_.resize(rows * codec.k.side_bytes);
  if (codec.v.side_bytes) v_side_.resize(rows * codec.v.side_bytes);
  allocated_ = k_code_.bytes() + v_code_.bytes() + k_side_.bytes() + v_side_.bytes();
  // Zeroed once so unwritten rows decode to finite values (they are never
  // read: attention is causal and masks the tail of its last tile).
  for (DeviceBuffer<uint8_t>* b : {&k_code_, &v_code_, &k_side_, &v_side_})
    if (b->size()) KVQ_CUDA_CHECK(cudaMemset(b->data(), 0, b->bytes()));
  // Rotation tables of rotated sides, from the CPU blocks themselves (the
  // same seed, layer, head and side: the same rotation, exactly).
  auto upload_rotations = [&](const kv::SideDescriptor& d, kv::Side which, DeviceBuffer<float>& dst) {
    if (!is_rotated(d.spec.family)) return;
    std::vector<float> signs;
    signs.reserve(size_t(shape.n_layers) * shape.n_kv_heads * shape.head_dim);
    for (int l = 0; l < shape.n_layers; ++l)
      for (int h = 0; h < shape.n_kv_heads; ++h) {
        const kv::BlockTables t = kv::make_block(d.spec, shape.head_dim, seed, l, h, which)->tables();
        KVQ_CHECK(t.rotation_kind == "hadamard" && int(t.rotation.size()) == shape.head_dim, Errc::internal,
                  "GPU KV cache: ", d.spec.name(), " has a ", t.rotation_kind, " rotation the GPU does not apply");
        signs.insert(signs.end(), t.rotation.begin(), t.rotation.end());
      }
    dst.upload(signs);
  };
  upload_rotations(codec.k, kv::Side::k, k_rot_);
  upload_rotations(codec.v, kv::Side::v, v_rot_);
  layers_.reserve(shape.n_layers);
  auto side_of = [&](const kv::SideDescriptor& d, DeviceBuffer<uint8_t>& code, DeviceBuffer<uint8_t>& side, int l,
                     const DeviceBuffer<float>& rot) {
    GpuKvSide s;
    s.family = d.spec.family;
    s.bits = d.spec.bits;
    s.code_bytes = d.code_bytes;
    s.side_bytes = d.side_bytes;
    s.code = code.data() + rows_per_layer * d.code_bytes * l;
    s.side = d.side_bytes ? side.data() + rows_per_layer * d.side_bytes * l : nullptr;
    s.rot = rot.size() ? rot.data() + size_t(l) * shape.n_kv_heads * shape.head_dim : nullptr;
    return s;
  };
  for (int l = 0; l < shape.n_layers; ++l) {
    GpuKvLayer store;
    store.k = side_of(codec.k, k_code_, k_side_, l, k_rot_);
    store.v = side_of(codec.v, v_code_, v_side_, l, v_rot_);
    store.n_kv_heads = shape.n_kv_heads;
    store.head_dim = shape.head_dim;
    store.max_tokens = shape.max_tokens;
    layers_.emplace_back(store, &scratch_, this, l);
  }
}

kv::LayerCache& CudaKvCache::layer(int i) {
  KVQ_CHECK(i >= 0 && i < shape_.n_layers, Errc::internal, "GPU KV cache: layer ", i, " of ", shape_.n_layers);
  return layers_[i];
}

uint64_t CudaKvCache::bytes_for_tokens(int n_tokens) const {
  return uint64_t(n_tokens) * shape_.n_layers * shape_.n_kv_heads * codec_.bytes_per_token_per_head();
}

std::vector<const void*> CudaKvCache::graph_addresses() const {
  // The cache's id first: a new cache whose buffers land at a freed one's
  // addresses (its shape or codec may differ) never replays its recording.
  return {reinterpret_cast<const void*>(uintptr_t(id())), k_code_.data(), k_side_.data(), v_code_.data(),
          v_side_.data(), k_rot_.data(), v_rot_.data(), scratch_.part.data(), scratch_.decode_counters.data()};
}

std::unique_ptr<kv::Cache> make_cuda_kv_cache(const kv::CodecOptions& opts, const kv::CacheShape& shape) {
  const kv::ResolvedCodec codec = kv::resolve_codec(opts);  // unknown names: invalid_argument listing the valid ones
  return std::make_unique<CudaKvCache>(kv::describe_codec(codec, shape.head_dim), shape, opts.seed);
}

}  // namespace kvq::cuda
