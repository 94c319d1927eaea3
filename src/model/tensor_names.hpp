// GGUF tensor names (llama.cpp conventions) shared by the loader, the
// synthetic-model writer, `kvq info` and the converters. Matrices are stored
// with ne = {in, out}: ne[0] is the input (fastest) dimension.
#pragma once

#include <string>

namespace kvq::tensor_names {

inline const char* token_embd = "token_embd.weight";    // ne {d_model, vocab}
inline const char* output_norm = "output_norm.weight";  // ne {d_model}
inline const char* output = "output.weight";            // ne {d_model, vocab}; absent when tied

inline std::string blk(int layer, const char* what) {
  return "blk." + std::to_string(layer) + "." + what + ".weight";
}
// Per-layer tensor short names, used as blk(i, attn_q) etc.
inline const char* attn_norm = "attn_norm";      // ne {d_model}
inline const char* attn_q = "attn_q";            // ne {d_model, n_heads*head_dim}
inline const char* attn_k = "attn_k";            // ne {d_model, n_kv_heads*head_dim}
inline const char* attn_v = "attn_v";            // ne {d_model, n_kv_heads*head_dim}
inline const char* attn_output = "attn_output";  // ne {n_heads*head_dim, d_model}
inline const char* attn_q_norm = "attn_q_norm";  // ne {head_dim} (qwen3)
inline const char* attn_k_norm = "attn_k_norm";  // ne {head_dim} (qwen3)
inline const char* ffn_norm = "ffn_norm";        // ne {d_model}
inline const char* ffn_gate = "ffn_gate";        // ne {d_model, d_ff}
inline const char* ffn_up = "ffn_up";            // ne {d_model, d_ff}
inline const char* ffn_down = "ffn_down";        // ne {d_ff, d_model}

}  // namespace kvq::tensor_names
