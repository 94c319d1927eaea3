// Synthetic models: the exact tensor shapes and types of a named model shape,
// with seeded random weights scaled so activations stay finite. Used by tests
// (tiny, tiny-llama) and benchmarks (bonsai-8b, qwen3-8b), where decode speed
// does not depend on the weight values.
//
// Weight scale: every matrix W with fan-in n (ne[0]) has i.i.d. entries of
// standard deviation 1/sqrt(n), so x -> W x keeps the RMS of its input;
// token_embd and output use 1/sqrt(d_model) so logits have std ~1 after the
// final RMS norm (neither flat nor one-hot). Norm weights are 1.
// Values are an Irwin-Hall(4) approximation of a normal (fast, bounded by
// +-2*sqrt(3) std, no Inf/NaN possible). Q1_0 matrices get random signs and a
// per-block scale d = s * (0.75 + 0.5 u), u uniform in [0, 1), whose mean is
// the target std s. Each tensor row has its own RNG stream seeded from
// (seed, tensor name, row), so output is identical for any thread count.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gguf/types.hpp"

namespace kvq {
namespace gguf { class Writer; }

struct SynthShape {
  std::string name;           // "tiny", "tiny-llama", "bonsai-8b", "qwen3-8b"
  std::string arch;           // "qwen3" or "llama"
  int n_layers, d_model, d_ff, n_heads, n_kv_heads, head_dim;
  int vocab_size;             // 0: the built-in vocabulary's natural size
  uint64_t context_length;
  double rope_base;
  bool qk_norm;
  bool tied_embeddings;
  gguf::TensorType matrix_type;  // default type of every matrix incl. token_embd/output
  std::string description;
};

// Every named shape, in a fixed order (for help text and `kvq synth --list`).
const std::vector<SynthShape>& synth_shapes();
// Throws Errc::invalid_argument listing the known names when `name` is unknown.
const SynthShape& synth_shape(const std::string& name);

struct SynthOptions {
  std::string shape = "tiny";
  std::optional<gguf::TensorType> weights;  // override the matrix type
  std::string vocab_json;                   // Hugging Face tokenizer.json; empty = built-in vocabulary
  uint64_t seed = 0;
};

// Adds the metadata, tokenizer and tensors (with streaming fill functions) of a
// synthetic model to `w`. `w` must be empty.
void build_synthetic(const SynthOptions& opt, gguf::Writer& w);
// build_synthetic + Writer::write.
void write_synthetic(const SynthOptions& opt, const std::string& path);

// The built-in byte-level GPT-2-style vocabulary (tokenizer.ggml.model "gpt2",
// pre "qwen2"): the 256 byte tokens in GPT-2 byte-to-unicode form, BPE merges
// learnt deterministically from a small built-in English/code text, and the
// control tokens <|endoftext|>, <|im_start|>, <|im_end|>. With pad_to > 0 the
// vocabulary is padded with unused tokens "[PAD<id>]" (type 5) to exactly
// pad_to entries, the control tokens placed at Qwen's ids 151643..151645 when
// pad_to is Qwen's 151936. Writes all tokenizer.ggml.* keys; returns the token count.
int add_builtin_vocab(gguf::Writer& w, int pad_to = 0);

// Number of tokens in the built-in vocabulary without padding.
int builtin_vocab_size();

}  // namespace kvq
