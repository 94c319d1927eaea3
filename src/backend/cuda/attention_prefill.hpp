// Tensor-core causal GQA flash attention for PREFILL (n > 1 query tokens)
// over the bf16 GPU KV cache (layout: attention.hpp, KvLayerView).
//
// FlashAttention-2 style, mma.sync m16n8k16 bf16 -> fp32 (sm_80+): a CTA of
// 4 warps owns 64 query rows = (token, head) pairs of ONE KV head, so every
// K/V tile it streams through shared memory serves the whole GQA group;
// online softmax in registers. For head_dim 128 on Hopper (sm_90a builds)
// the same algorithm on warpgroup MMA (wgmma): 8 warps, 128 rows per CTA. Tile, fragment and shared-memory layouts are
// documented at the top of attention_prefill.cu.
//
// Precision: Q (pre-multiplied by scale * log2 e) and the probabilities P are
// rounded to bf16 for the tensor cores (standard FA2); scores, softmax state
// and the output accumulate in fp32. See tests/gpu/prefill_test_util.hpp for
// the error bound this implies and how the tests check it.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/attention.hpp"

namespace kvq::cuda {

// True when flash_attention_prefill() handles the shape: head_dim 64, 128 or
// 256 and a GQA group G = n_heads / n_kv_heads of 1..64 (any G, not only
// divisors of 64: a CTA holds floor(64 / G) tokens).
bool flash_attention_prefill_supported(int n_heads, int n_kv_heads, int head_dim);

// True when flash_attention_prefill() runs head_dim's prefill on the Hopper
// (wgmma) kernel on ctx's device: an sm_90a build, a compute-capability 9.0
// device, head_dim 128 and ctx.settings.prefill_wgmma.
bool flash_attention_prefill_wgmma(int head_dim, const DeviceContext& ctx = default_context());

// The factor q is multiplied by (in fp32) before its round-to-nearest-even
// conversion to bf16: scores then come out in log2 units, so softmax is exp2.
// Exposed so that tests can reproduce the kernel's bf16 queries exactly.
inline float prefill_query_factor(float scale) { return scale * 1.44269504088896340736f; }

// Causal attention of n query tokens at positions pos..pos+n-1 (query t sees
// keys 0..pos+t); q and out [n][n_heads][head_dim] fp32, device memory; the
// cache must already hold tokens [0, pos+n).
// key_splits: 0 picks the split of the keys automatically (no split when the
// query tiles alone fill the GPU, else enough key chunks to fill it, merged
// by a second kernel through scratch.part); > 0 forces that many key chunks
// (tests), at most one per key tile.
void flash_attention_prefill(const KvLayerView& layer, int pos, int n, const float* q, int n_heads, float scale,
                             float* out, AttentionScratch& scratch, cudaStream_t stream, int key_splits = 0,
                             const DeviceContext& ctx = default_context());

}  // namespace kvq::cuda
