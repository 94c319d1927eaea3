// The ONE model configuration struct, filled from GGUF metadata.
// Supported architectures: qwen3, llama. Keys are `<arch>.<name>` as in
// llama.cpp's conventions (qwen3.block_count, qwen3.attention.head_count_kv, ...).
#pragma once

#include <cstdint>
#include <string>

namespace kvq {
namespace gguf { class File; }

enum class Arch { qwen3, llama };
const char* arch_name(Arch a);

enum class RopeScaling { none, linear, yarn, llama3 };

struct RopeConfig {
  double theta = 10000.0;            // <arch>.rope.freq_base
  RopeScaling scaling = RopeScaling::none;
  double factor = 1.0;               // <arch>.rope.scaling.factor
  uint64_t original_context = 0;     // <arch>.rope.scaling.original_context_length
  // llama3 scaling (rope_freqs tensor or these factors)
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  bool neox = true;                  // qwen3: NEOX (rotate halves); llama GGUF: normal (pairs)
};

struct ModelConfig {
  Arch arch = Arch::qwen3;
  std::string name;              // general.name (may be empty)
  int n_layers = 0;              // <arch>.block_count
  int d_model = 0;               // <arch>.embedding_length
  int d_ff = 0;                  // <arch>.feed_forward_length
  int n_heads = 0;               // <arch>.attention.head_count
  int n_kv_heads = 0;            // <arch>.attention.head_count_kv (default n_heads)
  int head_dim = 0;              // <arch>.attention.key_length (default d_model / n_heads)
  int head_dim_v = 0;            // <arch>.attention.value_length (default head_dim)
  int vocab_size = 0;            // token_embd rows / tokenizer token count
  uint64_t context_length = 0;   // <arch>.context_length
  float norm_eps = 1e-6f;        // <arch>.attention.layer_norm_rms_epsilon
  RopeConfig rope;
  bool qk_norm = false;          // attn_q_norm / attn_k_norm tensors present (qwen3)
  bool tied_embeddings = false;  // no output.weight tensor

  int gqa_ratio() const { return n_kv_heads ? n_heads / n_kv_heads : 0; }
  // Bytes of a bf16 KV cache per token across all layers (K and V).
  uint64_t kv_bytes_per_token_bf16() const {
    return uint64_t(n_layers) * n_kv_heads * (head_dim + head_dim_v) * 2;
  }

  // Throws kvq::Error naming the key for a missing required key or an
  // unsupported value (architecture, head geometry, scaling type, ...).
  static ModelConfig from_gguf(const gguf::File& f);
};

}  // namespace kvq
