// Tensor-core split-KV flash DECODE attention (one query token) over the
// packed GPU KV store (kv_store.hpp) of any codec with decode hooks
// (kv_codec_hooks.cuh): one kernel template over (head_dim, K block, V
// block), instances listed once in attention_decode.cu. flash_attention() with
// n == 1 and flash_attention_decode_at() route here when choose_attention()
// plans decode_tc or decode_km; prefill (n > 1) never does.
//
// Work split: grid (n_splits, n_kv_heads, n_seq), 4 warps per CTA; the z
// axis is the sequence of a batched step (flash_decode_batch): its query
// row, position, block table, arrival counters and partial states. n_splits is fixed
// per launch (one resident wave of CTAs, at most kMaxDecodeSplits; a batch
// that would leave its wave a third idle takes whole, nearly full waves
// instead when its sequences are long enough: flash_decode_splits); each CTA
// reads the position at run time and takes the keys
//   [split * chunk, min((split + 1) * chunk, pos + 1)),
//   chunk = round_up(ceil((pos + 1) / n_splits), 16),
// so one recorded launch (CUDA graph) serves every position. Its warps run
// independent online softmaxes over interleaved 16-key tiles with mma.sync
// (bf16 in, fp32 accumulate), merge in shared memory, and the CTA writes one
// partial state (m, l, o) per query head of its group. The last CTA of a KV
// head to finish (an arrival counter in AttentionScratch) merges that head's
// partials into `out` and resets the counter to 0: no second launch.
// Fragment and permutation layouts: attention_decode.cu.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/attention.hpp"
#include "backend/cuda/device_context.hpp"
#include "backend/cuda/kv_store.hpp"

namespace kvq::cuda {

constexpr int kMaxDecodeSplits = 64;  // bounds the serial merge done by the last CTA of each KV head

// The compiled instance for (head_dim, K block, V block) and a GQA group of
// G heads: its index (-1: none) and whether it runs in keys-major form (the
// staged low-bit V sides, G <= 8). choose_attention() asks.
struct DecodeInstance {
  int index = -1;
  bool keys_major = false;
};
DecodeInstance find_decode_instance(int head_dim, kv::Family k, int k_bits, bool k_qjl, kv::Family v, int v_bits,
                                    int G);
// True when an instance of the kernel exists for (head_dim, K block, V block).
bool flash_decode_instance_exists(int head_dim, kv::Family k, int k_bits, bool k_qjl, kv::Family v, int v_bits);

// True when the tensor-core decode kernel handles this shape: GQA group
// G = n_heads / n_kv_heads in 1..16, head_dim 64, 128 or 256, and `q` and
// `out` 16-byte aligned (they are read and written as float4s). flash_decode
// asserts it.
bool flash_decode_supported(int n_heads, int n_kv_heads, int head_dim, const float* q, const float* out);

// The number of key splits (gridDim.x) a decode launch of this shape uses when
// the position is only known on the device; depends on the shape, the GPU,
// the cache capacity and ctx.settings.decode_split_reserve, the number of
// sequences and a sequence's capacity in tokens (0: the one-sequence
// store's max_tokens), never on the positions.
int flash_decode_splits(const GpuKvLayer& layer, int n_heads, const DeviceContext& ctx = default_context(),
                        int n_seq = 1, int capacity = 0);

// Decode attention of one query token with the instance `plan` chose
// (decode_tc or decode_km for this store), at position pos (or *pos_dev when
// pos_dev is set: device memory, already range-checked; the launch then does
// not depend on the position). q, out: [n_heads][head_dim] fp32, device.
// Sizes scratch.part and scratch.decode_counters on first use (call once
// before recording a graph).
// prep: the fused q path (rope_params.hpp): q is raw, the kernel norms and
// rotates it and waits for its predecessor only before the step's own row.
// ctx.settings: attn_prefetch_tiles, decode_split_reserve, decode_trace.
void flash_decode(const AttentionPlan& plan, const GpuKvLayer& layer, int pos, const int* pos_dev, const float* q,
                  int n_heads, float scale, float* out, AttentionScratch& scratch, cudaStream_t stream,
                  const QPrep* prep = nullptr, const DeviceContext& ctx = default_context());

// One decode token of each of n_seq sequences over a paged store: sequence
// z's query is row z of q ([n_seq][n_heads][head_dim] fp32, device; out
// alike), at position pos_dev[z], its rows found through its block table
// pages[z * table_stride ...] (kv_store.hpp). The work split depends on
// n_seq and table_stride * page_tokens (a sequence's capacity), never on
// the positions. One sequence with pages == nullptr is flash_decode() over
// the identity table (the same split and results).
struct DecodeBatch {
  int n_seq = 1;
  const int32_t* pos_dev = nullptr;  // [n_seq] device positions; null: `pos` (one sequence)
  int pos = 0;
  const int32_t* pages = nullptr;    // [n_seq][table_stride] device block tables; null: identity (one sequence)
  int table_stride = 0;              // entries per table row (pages a sequence may hold)
};
void flash_decode_batch(const AttentionPlan& plan, const GpuKvLayer& layer, const DecodeBatch& batch, const float* q,
                        int n_heads, float scale, float* out, AttentionScratch& scratch, cudaStream_t stream,
                        const QPrep* prep = nullptr, const DeviceContext& ctx = default_context());

}  // namespace kvq::cuda
