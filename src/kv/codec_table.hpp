// THE codec table: every named KV codec (the seeds' 25 plus kvq's extras),
// its K and V blocks and aliases. Nothing else in kvq spells a codec; block
// formats live in kv/block.hpp + kv/blocks/. Whether the GPU runs a codec is
// the CUDA kernel selector's answer (backend.hpp, gpu_codec_support), not a
// flag here.
#pragma once

#include <string>
#include <vector>

#include "kv/block.hpp"
#include "kv/cache.hpp"

namespace kvq::kv {

struct CodecInfo {
  std::string name;                  // canonical, lower case
  std::vector<std::string> aliases;  // also accepted (case-insensitive)
  std::string k_block;               // block names (kv/block.hpp)
  std::string v_block;
  std::string notes;
  bool seed_codec = true;            // one of the seeds' 25 (false: kvq extra)
};

const std::vector<CodecInfo>& codec_table();

// Case-insensitive lookup by name or alias; nullptr when unknown.
const CodecInfo* find_codec(const std::string& name);
// "none, k8v8, ..." for error messages.
std::string codec_names_list();

struct ResolvedCodec {
  std::string name;  // canonical: "k8v4", "rotor3_sym+qjl", "ctk=q8,ctv=turbo3"
  BlockSpec k;
  BlockSpec v;
};

// Apply --kv, --ctk/--ctv and --rotor-qjl. Throws kvq::Error (invalid_argument)
// for unknown names (listing the valid ones) and for +qjl on a V side.
ResolvedCodec resolve_codec(const CodecOptions& opts);

// Bytes per token per layer for one KV head (K row + V row, codes and side).
size_t codec_bytes_per_token_per_head(const ResolvedCodec& c, int head_dim);

// The plain descriptor of one side (K or V) that both backends read: what the
// packed rows hold and where. Rows of one (layer, kv_head, side) live in two
// token-major arrays, codes (code_bytes per row) and side information
// (side_bytes per row: fp16 scales / norms). With +qjl the base block's row
// comes first in each array, then the sign sketch (code array, at
// qjl_code_offset) and its fp16 residual norm (side array, at qjl_side_offset).
struct SideDescriptor {
  BlockSpec spec;
  uint32_t code_bytes = 0, side_bytes = 0;            // per row, padding included
  uint32_t qjl_code_offset = 0, qjl_side_offset = 0;  // +qjl only
  bool rotation = false;  // tables: a non-identity rotation (rq8, turbo, tcq, iso, rotor, planar)
  bool codebook = false;  // tables: Lloyd-Max centroids (turbo, iso, rotor, planar)
  bool trellis = false;   // tables: tcq union levels
};
struct CodecDescriptor {
  std::string name;  // canonical (ResolvedCodec::name)
  int head_dim = 0;
  SideDescriptor k, v;
  uint64_t bytes_per_token_per_head() const { return uint64_t(k.code_bytes) + k.side_bytes + v.code_bytes + v.side_bytes; }
};
// Throws kvq::Error (unsupported) for a head_dim the blocks do not support.
CodecDescriptor describe_codec(const ResolvedCodec& c, int head_dim);

}  // namespace kvq::kv
