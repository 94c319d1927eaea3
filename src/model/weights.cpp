#include "model/weights.hpp"

#include <cmath>

#include "backend/cpu/kernels.hpp"
#include "core/error.hpp"
#include "model/tensor_names.hpp"

namespace kvq {

namespace {

// llama.cpp stores llama3-style per-frequency divisors in this optional tensor.
constexpr const char* kRopeFreqs = "rope_freqs.weight";

std::string shape_str(const std::vector<uint64_t>& ne) {
  std::string s = "{";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "}";
}

const gguf::TensorInfo& require(const TensorLookup& find, const std::string& name) {
  const gguf::TensorInfo* t = find(name);
  if (!t) fail(Errc::format, "model has no tensor '", name, "' (required for this architecture)");
  return *t;
}

void check_shape(const gguf::TensorInfo& t, const std::vector<uint64_t>& want) {
  // GGUF may store trailing 1-dims; compare after dropping them.
  std::vector<uint64_t> ne = t.ne;
  while (ne.size() > want.size() && ne.back() == 1) ne.pop_back();
  if (ne != want)
    fail(Errc::format, "tensor '", t.name, "' has shape ", shape_str(t.ne), " but the model config needs ",
         shape_str(want));
}

Matrix matrix(const TensorLookup& find, const std::string& name, int64_t rows, int64_t cols) {
  const gguf::TensorInfo& t = require(find, name);
  check_shape(t, {uint64_t(cols), uint64_t(rows)});
  if (!cpu::supports_weight_type(t.type))
    fail(Errc::unsupported, "tensor '", name, "' has weight type id ", uint32_t(t.type),
         ", which kvq does not support (supported: ", cpu::supported_weight_types(), ")");
  KVQ_CHECK(t.data, Errc::internal, "tensor '", name, "' has no data");
  Matrix m;
  m.type = t.type;
  m.rows = rows;
  m.cols = cols;
  m.data = t.data;
  m.row_bytes = cpu::row_bytes(t.type, cols);
  return m;
}

std::vector<float> vector_f32(const gguf::TensorInfo& t, int64_t n) {
  check_shape(t, {uint64_t(n)});
  if (!cpu::supports_weight_type(t.type) || cpu::block_size(t.type) != 1)
    fail(Errc::unsupported, "vector tensor '", t.name, "' has type id ", uint32_t(t.type),
         " (need F32, F16 or BF16)");
  std::vector<float> v(n);
  cpu::dequantize_row(t.type, t.data, v.data(), n);
  return v;
}

std::vector<float> vector_f32(const TensorLookup& find, const std::string& name, int64_t n) {
  return vector_f32(require(find, name), n);
}

}  // namespace

Rope make_rope(const ModelConfig& cfg, const std::vector<float>& freq_factors) {
  const int half = cfg.head_dim / 2;
  Rope r;
  r.neox = cfg.rope.neox;
  r.inv_freq.resize(half);
  const auto& rc = cfg.rope;
  if (rc.scaling == RopeScaling::yarn)
    fail(Errc::unsupported, "YaRN rope scaling is not supported yet; use a GGUF without rope.scaling.type=yarn");
  for (int i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(rc.theta, double(2 * i) / cfg.head_dim);
    if (!freq_factors.empty()) {
      f /= freq_factors[i];
    } else if (rc.scaling == RopeScaling::llama3) {
      KVQ_CHECK(rc.original_context > 0 && rc.high_freq_factor != rc.low_freq_factor, Errc::format,
                "llama3 rope scaling needs rope.scaling.original_context_length and distinct low/high factors");
      const double old_ctx = double(rc.original_context);
      const double low_wavelen = old_ctx / rc.low_freq_factor;
      const double high_wavelen = old_ctx / rc.high_freq_factor;
      const double wavelen = 2.0 * M_PI / f;
      if (wavelen > low_wavelen) {
        f /= rc.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (old_ctx / wavelen - rc.low_freq_factor) / (rc.high_freq_factor - rc.low_freq_factor);
        f = (1.0 - smooth) * f / rc.factor + smooth * f;
      }
    }
    r.inv_freq[i] = float(f);
  }
  if (rc.scaling == RopeScaling::linear && rc.factor > 0) r.pos_scale = 1.0 / rc.factor;
  return r;
}

ModelWeights load_weights(const ModelConfig& cfg, const TensorLookup& find) {
  namespace tn = tensor_names;
  KVQ_CHECK(cfg.head_dim % 2 == 0, Errc::unsupported, "head_dim ", cfg.head_dim, " is odd; RoPE needs an even head_dim");
  KVQ_CHECK(cfg.head_dim_v == 0 || cfg.head_dim_v == cfg.head_dim, Errc::unsupported,
            "attention.value_length ", cfg.head_dim_v, " differs from key_length ", cfg.head_dim,
            "; kvq supports equal K and V head sizes only");
  KVQ_CHECK(cfg.n_kv_heads > 0 && cfg.n_heads % cfg.n_kv_heads == 0, Errc::unsupported, "head_count ",
            cfg.n_heads, " is not a multiple of head_count_kv ", cfg.n_kv_heads);
  const int64_t d = cfg.d_model, hd = cfg.head_dim, q_dim = int64_t(cfg.n_heads) * hd,
                kv_dim = int64_t(cfg.n_kv_heads) * hd, ff = cfg.d_ff, vocab = cfg.vocab_size;

  ModelWeights w;
  w.token_embd = matrix(find, tn::token_embd, vocab, d);
  w.output_norm = vector_f32(find, tn::output_norm, d);
  if (find(tn::output)) {
    w.output = matrix(find, tn::output, vocab, d);
  } else {
    w.output = w.token_embd;  // tied embeddings
  }
  for (int l = 0; l < cfg.n_layers; ++l) {
    LayerWeights L;
    L.attn_norm = vector_f32(find, tn::blk(l, tn::attn_norm), d);
    L.wq = matrix(find, tn::blk(l, tn::attn_q), q_dim, d);
    L.wk = matrix(find, tn::blk(l, tn::attn_k), kv_dim, d);
    L.wv = matrix(find, tn::blk(l, tn::attn_v), kv_dim, d);
    L.wo = matrix(find, tn::blk(l, tn::attn_output), d, q_dim);
    if (cfg.qk_norm) {
      L.q_norm = vector_f32(find, tn::blk(l, tn::attn_q_norm), hd);
      L.k_norm = vector_f32(find, tn::blk(l, tn::attn_k_norm), hd);
    }
    L.ffn_norm = vector_f32(find, tn::blk(l, tn::ffn_norm), d);
    L.w_gate = matrix(find, tn::blk(l, tn::ffn_gate), ff, d);
    L.w_up = matrix(find, tn::blk(l, tn::ffn_up), ff, d);
    L.w_down = matrix(find, tn::blk(l, tn::ffn_down), d, ff);
    w.layers.push_back(std::move(L));
  }
  std::vector<float> factors;
  if (const gguf::TensorInfo* rf = find(kRopeFreqs)) factors = vector_f32(*rf, hd / 2);
  w.rope = make_rope(cfg, factors);
  return w;
}

}  // namespace kvq
