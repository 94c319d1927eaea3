// ModelConfig from GGUF metadata. Required keys that are missing, values kvq
// does not support and tensors whose shapes disagree with the config are
// errors naming the key or tensor, so a bad model fails at load, not mid-decode.
#include "model/config.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "gguf/gguf.hpp"
#include "model/tensor_names.hpp"

namespace kvq {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::qwen3: return "qwen3";
    case Arch::llama: return "llama";
  }
  return "?";
}

namespace {

// Upper bounds that no real model reaches; they keep later size arithmetic
// (d_model * vocab, n_layers * ...) far from overflow on hostile files.
constexpr uint64_t kMaxLayers = 1024;
constexpr uint64_t kMaxWidth = 1u << 20;     // d_model, d_ff, head_dim
constexpr uint64_t kMaxHeads = 4096;
constexpr uint64_t kMaxVocab = 1u << 24;

struct Keys {
  const gguf::File& f;
  std::string arch;

  std::string k(const char* name) const { return arch + "." + name; }

  // A positive integer no larger than max; `required` false returns def when absent.
  int get_int(const char* name, uint64_t max, bool required, int def = 0) const {
    const std::string key = k(name);
    const gguf::Value* v = f.find(key);
    if (!v) {
      if (required) fail(Errc::format, f.path(), ": missing required key '", key, "'");
      return def;
    }
    if (v->type == gguf::ValueType::ARRAY)
      fail(Errc::unsupported, f.path(), ": key '", key,
           "' is a per-layer array; kvq supports only one value for all layers");
    const uint64_t x = f.get_u64(key);
    if (x == 0 || x > max)
      fail(Errc::format, f.path(), ": key '", key, "' = ", x, " is out of range (1..", max, ")");
    return int(x);
  }
  double get_positive(const char* name, double def, bool required) const {
    const std::string key = k(name);
    if (!f.has(key)) {
      if (required) fail(Errc::format, f.path(), ": missing required key '", key, "'");
      return def;
    }
    const double x = f.get_f64(key);
    if (!(x > 0.0) || !std::isfinite(x))
      fail(Errc::format, f.path(), ": key '", key, "' = ", x, " must be a positive finite number");
    return x;
  }
};

std::string shape_str(const std::vector<uint64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

// Shapes compare equal ignoring trailing 1s (some converters store {n, 1}).
bool same_shape(std::vector<uint64_t> a, std::vector<uint64_t> b) {
  while (a.size() > 1 && a.back() == 1) a.pop_back();
  while (b.size() > 1 && b.back() == 1) b.pop_back();
  return a == b;
}

void expect_shape(const gguf::File& f, const std::string& name, std::vector<uint64_t> want) {
  const gguf::TensorInfo* t = f.find_tensor(name);
  if (!t) fail(Errc::format, f.path(), ": missing tensor '", name, "' (expected shape ", shape_str(want), ")");
  if (!same_shape(t->ne, want))
    fail(Errc::format, f.path(), ": tensor '", name, "' has shape ", shape_str(t->ne),
         " but the config implies ", shape_str(want));
}

}  // namespace

ModelConfig ModelConfig::from_gguf(const gguf::File& f) {
  ModelConfig c;
  const std::string arch = f.get_string("general.architecture");
  if (arch == "qwen3") {
    c.arch = Arch::qwen3;
  } else if (arch == "llama") {
    c.arch = Arch::llama;
  } else {
    fail(Errc::unsupported, f.path(), ": general.architecture '", arch,
         "' is not supported (supported: qwen3, llama)");
  }
  const Keys keys{f, arch};
  c.name = f.get_string_or("general.name", "");

  c.n_layers = keys.get_int("block_count", kMaxLayers, true);
  c.d_model = keys.get_int("embedding_length", kMaxWidth, true);
  c.d_ff = keys.get_int("feed_forward_length", kMaxWidth, true);
  c.n_heads = keys.get_int("attention.head_count", kMaxHeads, true);
  c.n_kv_heads = keys.get_int("attention.head_count_kv", kMaxHeads, false, c.n_heads);
  if (c.n_heads % c.n_kv_heads != 0)
    fail(Errc::unsupported, f.path(), ": key '", keys.k("attention.head_count"), "' = ", c.n_heads,
         " is not a multiple of '", keys.k("attention.head_count_kv"), "' = ", c.n_kv_heads);
  const bool has_key_length = f.has(keys.k("attention.key_length"));
  if (!has_key_length && c.d_model % c.n_heads != 0)
    fail(Errc::format, f.path(), ": key '", keys.k("attention.key_length"), "' is missing and '",
         keys.k("embedding_length"), "' = ", c.d_model, " is not divisible by '",
         keys.k("attention.head_count"), "' = ", c.n_heads);
  c.head_dim = keys.get_int("attention.key_length", kMaxWidth, false, c.d_model / c.n_heads);
  if (c.head_dim % 2 != 0)
    fail(Errc::unsupported, f.path(), ": key '", keys.k("attention.key_length"), "' = ", c.head_dim,
         " must be even (RoPE rotates pairs)");
  // Partial rotary embeddings (RoPE on fewer than head_dim dims) are not implemented.
  if (f.has(keys.k("rope.dimension_count"))) {
    const uint64_t rot = f.get_u64(keys.k("rope.dimension_count"));
    if (rot != uint64_t(c.head_dim))
      fail(Errc::unsupported, f.path(), ": key '", keys.k("rope.dimension_count"), "' = ", rot,
           " differs from head_dim ", c.head_dim, " (partial RoPE is not supported)");
  }
  c.head_dim_v = keys.get_int("attention.value_length", kMaxWidth, false, c.head_dim);
  c.context_length = uint64_t(keys.get_int("context_length", uint64_t(1) << 30, true));
  c.norm_eps = float(keys.get_positive("attention.layer_norm_rms_epsilon", 1e-6, true));

  // RoPE
  c.rope.neox = c.arch == Arch::qwen3;  // llama.cpp: qwen3 NEOX, llama "normal" (adjacent pairs)
  c.rope.theta = keys.get_positive("rope.freq_base", 10000.0, false);
  const std::string scaling_key = keys.k("rope.scaling.type");
  const std::string scaling = f.get_string_or(scaling_key, "none");
  if (scaling == "none") c.rope.scaling = RopeScaling::none;
  else if (scaling == "linear") c.rope.scaling = RopeScaling::linear;
  else if (scaling == "yarn") c.rope.scaling = RopeScaling::yarn;
  else if (scaling == "llama3") c.rope.scaling = RopeScaling::llama3;
  else
    fail(Errc::unsupported, f.path(), ": key '", scaling_key, "' = '", scaling,
         "' is not supported (none, linear, yarn, llama3)");
  if (c.rope.scaling != RopeScaling::none) {
    c.rope.factor = keys.get_positive("rope.scaling.factor", 1.0, true);
    c.rope.original_context = f.get_u64_or(keys.k("rope.scaling.original_context_length"), 0);
    if (c.rope.scaling != RopeScaling::linear && c.rope.original_context == 0)
      fail(Errc::format, f.path(), ": missing required key '", keys.k("rope.scaling.original_context_length"),
           "' for ", scaling, " RoPE scaling");
  }
  c.rope.low_freq_factor = keys.get_positive("rope.scaling.low_freq_factor", 1.0, false);
  c.rope.high_freq_factor = keys.get_positive("rope.scaling.high_freq_factor", 4.0, false);

  // Tensor-derived facts.
  namespace tn = tensor_names;
  const gguf::TensorInfo* embd = f.find_tensor(tn::token_embd);
  if (!embd) fail(Errc::format, f.path(), ": missing tensor '", tn::token_embd, "'");
  if (embd->ne.size() < 2 || embd->ne[1] == 0 || embd->ne[1] > kMaxVocab)
    fail(Errc::format, f.path(), ": tensor '", tn::token_embd, "' has shape ", shape_str(embd->ne),
         "; expected [d_model, vocab] with vocab <= ", kMaxVocab);
  c.vocab_size = int(embd->ne[1]);
  c.qk_norm = f.find_tensor(tn::blk(0, tn::attn_q_norm)) != nullptr;
  c.tied_embeddings = f.find_tensor(tn::output) == nullptr;

  // Every expected tensor must exist with the shape the config implies.
  const uint64_t d = uint64_t(c.d_model), ff = uint64_t(c.d_ff), V = uint64_t(c.vocab_size);
  const uint64_t q_out = uint64_t(c.n_heads) * c.head_dim;
  const uint64_t kv_out = uint64_t(c.n_kv_heads) * c.head_dim;
  const uint64_t v_out = uint64_t(c.n_kv_heads) * c.head_dim_v;
  const uint64_t o_in = uint64_t(c.n_heads) * c.head_dim_v;
  expect_shape(f, tn::token_embd, {d, V});
  expect_shape(f, tn::output_norm, {d});
  if (!c.tied_embeddings) expect_shape(f, tn::output, {d, V});
  for (int i = 0; i < c.n_layers; ++i) {
    expect_shape(f, tn::blk(i, tn::attn_norm), {d});
    expect_shape(f, tn::blk(i, tn::attn_q), {d, q_out});
    expect_shape(f, tn::blk(i, tn::attn_k), {d, kv_out});
    expect_shape(f, tn::blk(i, tn::attn_v), {d, v_out});
    expect_shape(f, tn::blk(i, tn::attn_output), {o_in, d});
    if (c.qk_norm) {
      expect_shape(f, tn::blk(i, tn::attn_q_norm), {uint64_t(c.head_dim)});
      expect_shape(f, tn::blk(i, tn::attn_k_norm), {uint64_t(c.head_dim)});
    }
    expect_shape(f, tn::blk(i, tn::ffn_norm), {d});
    expect_shape(f, tn::blk(i, tn::ffn_gate), {d, ff});
    expect_shape(f, tn::blk(i, tn::ffn_up), {d, ff});
    expect_shape(f, tn::blk(i, tn::ffn_down), {ff, d});
  }
  return c;
}

}  // namespace kvq
