// KV cache interface used by the forward pass. The codec table (kv/codec_table.hpp)
// defines every storage format; this header is all the model code needs.
//
// Contract (CPU backend):
//  - Rows are stored per (layer, kv_head, token) in the codec's packed format;
//    nothing else (no fp32/bf16 mirror) is kept for a quantized codec.
//  - write() encodes tokens [pos, pos + n) of one layer. k and v are fp32,
//    laid out [n][n_kv_heads][head_dim]; K is post-RoPE (and post k-norm).
//  - attend() is causal grouped-query attention for n query tokens at
//    positions pos .. pos+n-1: query token t sees cache rows [0, pos + t].
//    q: [n][n_heads][head_dim] fp32 (post-RoPE), out: [n][n_heads][head_dim].
//    It reads the packed store directly (rotate q once, accumulate in the
//    rotated basis, un-rotate the output once): the algorithm the GPU runs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvq::kv {

struct CacheShape {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int max_tokens = 0;  // preallocated capacity per sequence
  int n_heads = 0;     // query heads (0: unknown; GPU kernels are chosen per GQA group)
};

// What the user asked for: a named codec (--kv), optionally per-side blocks
// (--ctk/--ctv override the named codec's sides) and QJL on rotor K sides.
struct CodecOptions {
  std::string kv = "none";
  std::string ctk;          // empty: from `kv`
  std::string ctv;          // empty: from `kv`
  bool rotor_qjl = false;
  uint64_t seed = 0x6b7671;  // rotation / sketch seed; per layer and head derived from it
};

class LayerCache {
 public:
  virtual ~LayerCache() = default;
  virtual void write(int pos, int n, const float* k, const float* v) = 0;
  virtual void attend(int pos, int n, const float* q, int n_heads, float scale, float* out) const = 0;
};

class Cache {
 public:
  Cache();
  virtual ~Cache() = default;
  // Unique for the process's lifetime: a recorded decode step remembers the
  // cache it was made over by this, never by address (a freed cache's address
  // can come back for a new one).
  uint64_t id() const { return id_; }
  virtual const CacheShape& shape() const = 0;
  virtual std::string codec_name() const = 0;  // canonical name, e.g. "k8v4" or "ctk=q8,ctv=turbo3"
  virtual LayerCache& layer(int i) = 0;
  // Bytes resident in the packed store for the first n_tokens tokens (codes
  // plus every scale, norm and index), all layers, K and V.
  virtual uint64_t bytes_for_tokens(int n_tokens) const = 0;

 private:
  uint64_t id_;
};

// Throws kvq::Error (invalid_argument) for an unknown codec or block name,
// listing the valid ones.
std::unique_ptr<Cache> make_cpu_cache(const CodecOptions& opts, const CacheShape& shape);

}  // namespace kvq::kv
