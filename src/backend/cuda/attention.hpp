// Attention over the GPU KV store (kv_store.hpp), for every codec with GPU
// hooks. Which kernel runs a case is decided once, by choose_attention()
// (attention_plan.hpp); the launch functions here run what it chose.
//
// Kernels:
//  - decode (n == 1): the tensor-core split-KV kernel of attention_decode.hpp,
//    templated over the K and V blocks' hooks (kv_codec_hooks.cuh); it reads
//    the packed store directly. A bf16 store of a shape it does not cover
//    runs this file's CUDA-core kernel; a quantized one is unsupported.
//  - prefill (n > 1): the tensor-core flash kernel of attention_prefill.hpp
//    (or this file's CUDA-core kernel for other shapes) over bf16 rows. A
//    quantized store's prefix [0, pos + n) is first dequantized, per layer
//    and chunk, into the transient bf16 scratch of AttentionScratch (not a
//    mirror: it is overwritten by the next layer and never read by decode).
//
// The CUDA-core kernel (flash_attention over a KvLayerView, bf16 rows):
// causal grouped-query attention for n query tokens at
// positions pos..pos+n-1 (query t sees keys 0..pos+t), prefill and decode in
// one split-KV kernel:
//   grid = (kv_head, query tile of Tq tokens, key chunk). A CTA holds the
//   queries of all G = n_heads/n_kv_heads heads of its KV group for Tq
//   tokens (R = G*Tq rows), streams its key chunk through shared memory in
//   tiles of 64 keys (each K/V byte read once per CTA, shared by all R rows),
//   and keeps an online-softmax state (m, l, o) per row. Decode (n == 1) is
//   Tq = 1 with many chunks; prefill uses Tq up to 16.
//   A merge kernel combines the chunks' partial states:
//   M = max m_c, L = sum l_c e^(m_c-M), o = sum o_c e^(m_c-M) / L.
// Scores and accumulation are fp32 on CUDA cores. Decode (n == 1) of the
// common shapes runs the tensor-core kernel of attention_decode.hpp instead,
// and prefill (n > 1) of the shapes flash_attention_prefill_supported()
// accepts (head_dim 64/128/256, GQA group <= 64) the tensor-core kernel of
// attention_prefill.hpp (bf16 Q and P, fp32 accumulation); this kernel remains
// for the shapes those do not cover.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <string>

#include "backend/cuda/device_buffer.hpp"
#include "backend/cuda/attention_plan.hpp"
#include "backend/cuda/device_context.hpp"
#include "backend/cuda/kv_store.hpp"
#include "backend/cuda/rope_params.hpp"

namespace kvq::cuda {

// bf16 rows of one layer, K and V separate, head_dim values per row, rows
// found through rows() (kv_store.hpp): a `none` store (paged, with a
// sequence's block table), or the prefill scratch a quantized store is
// dequantized into (one page: [kv_head][max_tokens][head_dim]). Converts to
// the store it is (both sides bf16).
struct KvLayerView {
  uint16_t* k = nullptr;  // bf16 bits, rows of head_dim values
  uint16_t* v = nullptr;
  int n_kv_heads = 0;
  int head_dim = 0;
  int max_tokens = 0;       // tokens of the sequence the view can hold
  int page_tokens = 0;      // 0: max_tokens (one page, contiguous [head][token])
  const int32_t* pages = nullptr;  // the sequence's block table (device); null: identity
  int n_pages = 1;          // pages of the store (a `none` store's; 1 for the scratch)
  KVQ_STORE_HD SeqRows rows() const {
    return SeqRows({n_kv_heads, page_tokens ? page_tokens : max_tokens}, pages, page_tokens == 0 || n_pages == 1);
  }
  operator GpuKvLayer() const;
};
// The bf16 rows of a store whose sides are both bf16 (Errc::internal
// otherwise), for the sequence whose block table is `pages` (device; null:
// the identity table).
KvLayerView bf16_view(const GpuKvLayer& layer, const int32_t* pages = nullptr);

// Encodes k, v ([n][n_kv_heads][head_dim] fp32, device) for tokens
// [pos, pos+n) of a one-sequence store (the identity table: slot = position)
// with each side's encode hook (bf16: NaN -> 0, clamped to +-65504 like the
// CPU `none` block; q8: bit-identical to the CPU block). kv_encode.cu.
void write_kv(const GpuKvLayer& layer, int pos, int n, const float* k, const float* v, cudaStream_t stream);

// write_kv() of n tokens, token t at slot slots_dev[t] (device memory,
// already range-checked: kv/page.hpp, page * page_tokens + entry).
void write_kv_slots(const GpuKvLayer& layer, const int32_t* slots_dev, int n, const float* k, const float* v,
                    cudaStream_t stream);

// Copies page pairs_dev[2 i] to page pairs_dev[2 i + 1] (device memory,
// checked by the caller: kv::check_page_copy), i < n, in every layer of one
// store array: layer l's pages start at base + l * layer_stride, page p at
// p * page_bytes past that (kv_store.hpp's [layer][page][head][entry] rows).
// kv_encode.cu.
void copy_kv_pages(uint8_t* base, size_t layer_stride, int n_layers, size_t page_bytes, const int32_t* pairs_dev,
                   int n, cudaStream_t stream);

// Moves window pages into the codec's pages (kv::Cache::pack_pages) in one
// layer: for i < n, every row of exact page pairs_dev[2 i] (its index in the
// window's store, not its id) is encoded into packed page pairs_dev[2 i + 1]
// from its bf16 values (device memory, checked by the caller). kv_encode.cu.
void pack_kv_pages(const GpuKvLayer& layer, const int32_t* pairs_dev, int n, cudaStream_t stream);

// write_kv() of one token whose position is read from device memory
// (*pos_dev, already range-checked by the caller): a recorded launch (CUDA
// graph) serves every position.
void write_kv_at(const GpuKvLayer& layer, const int* pos_dev, const float* k, const float* v, cudaStream_t stream);

// True when the store's sides have encode hooks for this head_dim (write_kv).
bool kv_encode_supported(kv::Family k, kv::Family v, int head_dim);

// Dequantizes tokens [0, n_tokens) of every KV head of a sequence (its
// block table `pages`, device memory; null: the identity table) into bf16
// rows laid out as `dst` (dst.max_tokens >= n_tokens). kv_encode.cu.
void dequantize_kv_bf16(const GpuKvLayer& layer, int n_tokens, const KvLayerView& dst, cudaStream_t stream,
                        const int32_t* pages = nullptr);

// Scratch for the partial (m, l, o) states; grows on demand (a decode step at a
// given context reuses the same size, so it does not reallocate per step).
// decode_counters: per-(sequence, KV head) arrival counters of the tensor-core decode
// kernel (attention_decode.hpp), zeroed when allocated and left at zero by
// every launch; allocated by the first decode call (before any recording),
// and a recorded step bakes its address in like part's.
// prefix_k/prefix_v: the bf16 rows a quantized store's prefix is dequantized
// into for prefill (grown on demand, shared by the layers).
// batch_slots, batch_pos, batch_pages: device copies of a step's slots,
// positions and block tables for CudaLayerCache::write_slots / attend_runs.
struct AttentionScratch {
  DeviceBuffer<float> part;
  DeviceBuffer<unsigned> decode_counters;
  DeviceBuffer<uint16_t> prefix_k, prefix_v;
  DeviceBuffer<int32_t> batch_slots, batch_pos, batch_pages;
};

// True when the CUDA-core kernel supports this shape (head_dim a multiple of
// 32 up to 256, GQA group * head_dim <= 8192): every GPU attention case needs
// it (choose_attention asks first); `why` gets the reason otherwise.
bool flash_attention_supported(int n_heads, int n_kv_heads, int head_dim, const char** why);

// q [n][n_heads][head_dim] fp32 (post-RoPE), out [n][n_heads][head_dim] fp32.
// Runs the kernel choose_attention() plans for the store at n_heads (n == 1:
// decode, else prefill); Errc::unsupported when it plans none. pages: the
// sequence's block table (device memory, at least pages_for(pos + n)
// entries; null: the identity table of a one-sequence store).
void flash_attention(const GpuKvLayer& layer, int pos, int n, const float* q, int n_heads, float scale, float* out,
                     AttentionScratch& scratch, cudaStream_t stream, const DeviceContext& ctx = default_context(),
                     const int32_t* pages = nullptr);

// Decode attention (one query token) at the position *pos_dev (device memory,
// already range-checked) with a work split that depends only on the cache's
// max_tokens, not on the position, so one recorded launch (CUDA graph) serves
// every step (chunks sized as for a full cache, at most 512 keys each):
// chunks that start past the position write an empty partial state
// (m = -inf, l = 0), which the merge skips. Same arithmetic per key as
// flash_attention(); only the chunk boundaries (summation order) differ.
// Where choose_attention() plans the tensor-core decode kernel
// (attention_decode.hpp; its split also ignores the position) it runs that,
// else the kernel described here. prep (the fused q path, rope_params.hpp):
// q is raw and the tensor-core kernel prepares it; only where the plan says
// fused_q.
void flash_attention_decode_at(const GpuKvLayer& layer, const int* pos_dev, const float* q, int n_heads, float scale,
                               float* out, AttentionScratch& scratch, cudaStream_t stream, const QPrep* prep = nullptr,
                               const DeviceContext& ctx = default_context());

}  // namespace kvq::cuda
