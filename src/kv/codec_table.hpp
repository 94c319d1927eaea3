// THE codec table: every named KV codec (the seeds' 25 plus kvq's extras),
// its K and V blocks, aliases, and whether a fused GPU decode exists. Nothing
// else in kvq spells a codec; block formats live in kv/block.hpp + kv/blocks/.
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
  // A fused flash-decode kernel reads this codec's packed store on the GPU.
  // The CUDA backend flips these as its kernels land.
  bool gpu_fused_decode = false;
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

}  // namespace kvq::kv
