// Weight views of a Qwen3 / Llama model, straight over the (mmap'd) GGUF
// tensor bytes in their stored type. Nothing is dequantized or copied except
// the small norm vectors and the RoPE frequency table, which become fp32.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "gguf/gguf.hpp"
#include "model/config.hpp"

namespace kvq {

struct LayerWeights {
  std::vector<float> attn_norm;            // [d_model]
  Matrix wq, wk, wv, wo;                   // q: [n_heads*head_dim][d_model], o: [d_model][n_heads*head_dim]
  std::vector<float> q_norm, k_norm;       // [head_dim] (qwen3 only; empty otherwise)
  std::vector<float> ffn_norm;             // [d_model]
  Matrix w_gate, w_up, w_down;             // gate/up: [d_ff][d_model], down: [d_model][d_ff]
};

struct ModelWeights {
  Matrix token_embd;              // [vocab][d_model]
  std::vector<LayerWeights> layers;
  std::vector<float> output_norm; // [d_model]
  Matrix output;                  // [vocab][d_model]; equals token_embd when tied
  Rope rope;                      // frequencies per the architecture's scaling rules
};

// Finds a tensor by its GGUF name; nullptr when absent.
using TensorLookup = std::function<const gguf::TensorInfo*(const std::string& name)>;

// Builds the views and checks every tensor's presence, shape and type against
// the config; a problem is an Errc::format / unsupported error naming the tensor.
ModelWeights load_weights(const ModelConfig& cfg, const TensorLookup& find);
ModelWeights load_weights(const ModelConfig& cfg, const gguf::File& file);

// The RoPE table for cfg (theta, llama3 / linear scaling, or explicit
// per-frequency factors from a rope_freqs tensor when `freq_factors` is non-empty).
Rope make_rope(const ModelConfig& cfg, const std::vector<float>& freq_factors = {});

}  // namespace kvq
