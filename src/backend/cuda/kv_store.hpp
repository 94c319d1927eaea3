// The GPU KV store: one packed store per layer, in the codec's own format
// (kv/codec_table.hpp, CodecDescriptor), resident in device memory for the
// cache's whole capacity. Kernels read and write it only through the codec
// hooks (kv_codec_hooks.cuh); nothing keeps a bf16 copy beside it.
//
// Per layer and side (K, V), two token-major arrays per KV head:
//   code [n_kv_heads][max_tokens][code_bytes]
//   side [n_kv_heads][max_tokens][side_bytes]   (absent when side_bytes == 0)
// `none` is the bf16 block: code rows are the D bf16 values, no side array.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kv/family.hpp"

#ifdef __CUDACC__
#define KVQ_STORE_HD __host__ __device__ __forceinline__
#else
#define KVQ_STORE_HD inline
#endif

namespace kvq::cuda {

// One side (K or V) of one layer.
struct GpuKvSide {
  kv::Family family = kv::Family::bf16;
  int bits = 16;
  uint8_t* code = nullptr;
  uint8_t* side = nullptr;
  uint32_t code_bytes = 0;  // per row
  uint32_t side_bytes = 0;  // per row
  // rq8: this layer's random-sign Walsh-Hadamard signs, [n_kv_heads][head_dim]
  // (kv/rotation.hpp); null for unrotated blocks. Rows are stored in the
  // rotated basis; attention rotates q and un-rotates o once per step.
  const float* rot = nullptr;

  KVQ_STORE_HD size_t code_offset(int head, int token, int max_tokens) const {
    return (size_t(head) * max_tokens + token) * code_bytes;
  }
  KVQ_STORE_HD size_t side_offset(int head, int token, int max_tokens) const {
    return (size_t(head) * max_tokens + token) * side_bytes;
  }
};

// Families whose rows are stored in a rotated basis (attention rotates q and
// un-rotates o around the decode kernel; prefill un-rotates the prefix).
KVQ_STORE_HD constexpr bool is_rotated(kv::Family f) { return f == kv::Family::rq8; }
// The family whose decode hooks read a family's rows: rq8 rows are q8 rows
// of the rotated vector, so rq8 runs the q8 kernel instances.
KVQ_STORE_HD constexpr kv::Family storage_family(kv::Family f) { return f == kv::Family::rq8 ? kv::Family::q8 : f; }

struct GpuKvLayer {
  GpuKvSide k, v;
  int n_kv_heads = 0;
  int head_dim = 0;
  int max_tokens = 0;
  bool is_bf16() const { return k.family == kv::Family::bf16 && v.family == kv::Family::bf16; }
};

}  // namespace kvq::cuda
