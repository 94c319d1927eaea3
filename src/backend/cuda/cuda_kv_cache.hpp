// The device-resident KV cache of the CUDA backend: one packed GPU KV store
// per layer (kv_store.hpp) in the codec's own format (kv::CodecDescriptor),
// for every codec whose blocks have GPU hooks (choose_attention() decides).
//
// Paged (kv_store.hpp): shape.page_tokens rows per page (a multiple of 16,
// or max_tokens: one page), shape.n_pages() pages. Preallocated at construction, so decode never
// reallocates or copies through the host; there is no bf16 copy beside a
// quantized store. The kv::LayerCache methods take DEVICE pointers here (the
// CUDA backend's buffers), unlike the CPU caches; only the CUDA backend calls
// them.
#pragma once

#include <memory>
#include <vector>

#include "backend/cuda/attention.hpp"
#include "backend/cuda/device_buffer.hpp"
#include "backend/cuda/kv_store.hpp"
#include "kv/cache.hpp"
#include "kv/codec_table.hpp"

namespace kvq::cuda {

class CudaLayerCache final : public kv::LayerCache {
 public:
  CudaLayerCache(GpuKvLayer store, AttentionScratch* scratch, const class CudaKvCache* owner, int index)
      : store_(store), scratch_(scratch), owner_(owner), index_(index) {}
  // k, v, q, out: device memory; slots and the runs' block tables: host
  // memory (copied to the device per call). Runs of one token each, run z
  // at row z, are one batched decode launch (flash_decode_batch); other
  // runs are attended one at a time through their block tables.
  void write(int pos, int n, const float* k, const float* v) override;
  void attend(int pos, int n, const float* q, int n_heads, float scale, float* out) const override;
  void write_slots(const int32_t* slots, int n, const float* k, const float* v) override;
  void attend_runs(const kv::QueryRun* runs, int n_runs, const float* q, int n_heads, float scale,
                   float* out) const override;
  const GpuKvLayer& view() const { return store_; }

 protected:
  int store_page_tokens() const override { return store_.page_tokens; }

 public:
  // The partial-state scratch shared by the cache's layers (the backend
  // launches attention on its own stream with it).
  AttentionScratch& scratch() const { return *scratch_; }
  const CudaKvCache& cache() const { return *owner_; }
  int index() const { return index_; }  // layer number in its cache

 private:
  GpuKvLayer store_;
  AttentionScratch* scratch_;
  const CudaKvCache* owner_;
  int index_;
};

class CudaKvCache final : public kv::Cache {
 public:
  // The attention kernels are chosen per GQA group: shape.n_heads (0: taken
  // as n_kv_heads). Throws Errc::unsupported when no GPU kernel serves the codec.
  // seed: the codec's rotation seed (kv::CodecOptions::seed): rotated sides
  // upload the same per-(layer, KV head) tables the CPU blocks build from it.
  // require_attention = false (tests of the store only: make_cuda_kv_store_for_test)
  // skips that check: the cache encodes (and prefill dequantizes) every
  // family with encode hooks, +qjl included, but decode attention over it
  // may be unsupported and throws when called.
  CudaKvCache(const kv::CodecDescriptor& codec, const kv::CacheShape& shape, uint64_t seed,
              bool require_attention = true);
  const kv::CacheShape& shape() const override { return shape_; }
  std::string codec_name() const override { return codec_.name + kv::exact_window_suffix(shape_.window_pages); }
  kv::LayerCache& layer(int i) override;
  uint64_t bytes_for_tokens(int n_tokens) const override;
  // On the device (the legacy stream, ordered with the backend's), every
  // array of every layer; returns once the copies are queued.
  void copy_pages(const int32_t* src, const int32_t* dst, int n) override;
  // The window's pages into the codec's (kv::Cache::pack_pages): every
  // layer's bf16 rows re-encoded on the device (pack_kv_pages), queued on
  // the legacy stream like copy_pages.
  void pack_pages(const int32_t* exact, const int32_t* packed, int n) override;
  const kv::CodecDescriptor& codec() const { return codec_; }
  // Every device address a recorded decode step (CUDA graph) bakes in from
  // this cache: the stores and the attention scratch. A recording replays
  // only over a cache whose list is the same.
  std::vector<const void*> graph_addresses() const;
  // Device bytes this cache allocated for its stores (capacity, not fill).
  uint64_t allocated_bytes() const { return allocated_; }
  // The kernels choose_attention() planned for this cache, by name (dispatch proof).
  const std::string& decode_kernel() const { return decode_kernel_; }
  const std::string& prefill_kernel() const { return prefill_kernel_; }

 private:
  kv::CodecDescriptor codec_;
  kv::CacheShape shape_;
  // One allocation per array, [layer][page][kv_head][page_tokens][row bytes].
  DeviceBuffer<uint8_t> k_code_, k_side_, v_code_, v_side_;
  // The exact window's bf16 rows, [layer][exact page][kv_head][page_tokens][2 D]
  // (GpuKvLayer::xk / xv); empty without a window.
  DeviceBuffer<uint8_t> k_exact_, v_exact_;
  // Per side: rotation tables [layer][kv_head][rot_stride], the codebook (one
  // for all layers), QJL sketches [layer][kv_head][D][D] (GpuKvSide).
  struct SideTables {
    DeviceBuffer<float> rot, codebook, qjl;
    uint32_t rot_stride = 0, tcq_g0 = 0, tcq_g1 = 0;
  };
  SideTables k_tables_, v_tables_;
  AttentionScratch scratch_;  // shared by the layers (one runs at a time)
  DeviceBuffer<int32_t> copy_pairs_;  // copy_pages' and pack_pages' (from, to) pairs
  const int32_t* upload_pairs(const std::vector<int32_t>& pairs);
  std::vector<CudaLayerCache> layers_;
  uint64_t allocated_ = 0;
  std::string decode_kernel_, prefill_kernel_;
};

// The checks a block table of a windowed store passes before its attention
// (the decode kernel finds a sequence's window as the exact suffix of its
// first `used` entries): its exact pages are a suffix, at most
// store.window_pages long. Errc::invalid_argument otherwise.
void check_window_table(const GpuKvLayer& store, const int32_t* pages, int used);

// The GPU cache for a codec request (--kv, --ctk/--ctv). Unknown names:
// invalid_argument listing the valid ones; a codec with no GPU kernels for
// this shape: Errc::unsupported naming why (no silent CPU fallback).
std::unique_ptr<kv::Cache> make_cuda_kv_cache(const kv::CodecOptions& opts, const kv::CacheShape& shape);
// For GPU tests of the encode kernels / prefill dequantization only: the
// cache of make_cuda_kv_cache without its attention-support check (still
// Errc::unsupported when the blocks have no GPU encode hooks for the
// head_dim). Never used by the engine.
std::unique_ptr<kv::Cache> make_cuda_kv_store_for_test(const kv::CodecOptions& opts, const kv::CacheShape& shape);

}  // namespace kvq::cuda
