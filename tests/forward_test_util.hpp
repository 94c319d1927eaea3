// Helpers shared by the forward-pass tests: a plain scalar dequantizer written
// straight from the block layouts (independent of backend/cpu/kernels.cpp),
// simple quantizers to produce test weights, and an in-memory tiny model.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/half.hpp"
#include "core/rng.hpp"
#include "gguf/gguf.hpp"
#include "gguf/quant.hpp"
#include "model/config.hpp"
#include "model/tensor_names.hpp"
#include "model/weights.hpp"

namespace kvq::testutil {

using gguf::TensorType;

inline int block_of(TensorType t) {
  return int(gguf::tensor_type_info(t).block_size);
}

// Quantizes n floats (a multiple of the block size) into type t.
inline std::vector<uint8_t> quantize(TensorType t, const float* x, int64_t n) {
  std::vector<uint8_t> out;
  if (gguf::is_k_quant(t)) {  // the library's quantizer: only the dequantized values matter here
    out.resize(gguf::tensor_row_bytes(t, uint64_t(n)));
    gguf::quantize_row(t, x, out.data(), n);
    return out;
  }
  auto put16 = [&](uint16_t h) { out.push_back(uint8_t(h & 0xff)); out.push_back(uint8_t(h >> 8)); };
  switch (t) {
    case TensorType::F32:
      out.resize(n * 4);
      std::memcpy(out.data(), x, n * 4);
      break;
    case TensorType::F16:
      for (int64_t i = 0; i < n; ++i) put16(f32_to_f16(x[i]));
      break;
    case TensorType::BF16:
      for (int64_t i = 0; i < n; ++i) put16(f32_to_bf16(x[i]));
      break;
    case TensorType::Q8_0:
      for (int64_t b = 0; b < n; b += 32) {
        float amax = 0;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b + i]));
        const uint16_t dh = f32_to_f16(amax / 127.0f);
        const float d = f16_to_f32(dh);
        put16(dh);
        for (int i = 0; i < 32; ++i) {
          int q = d ? int(std::lround(x[b + i] / d)) : 0;
          q = std::max(-127, std::min(127, q));
          out.push_back(uint8_t(int8_t(q)));
        }
      }
      break;
    case TensorType::Q4_0:
      for (int64_t b = 0; b < n; b += 32) {
        float amax = 0, mx = 0;
        for (int i = 0; i < 32; ++i)
          if (std::fabs(x[b + i]) > amax) { amax = std::fabs(x[b + i]); mx = x[b + i]; }
        const uint16_t dh = f32_to_f16(mx / -8.0f);
        const float d = f16_to_f32(dh);
        put16(dh);
        auto code = [&](float v) { return d ? std::max(0, std::min(15, int(std::lround(v / d)) + 8)) : 8; };
        for (int j = 0; j < 16; ++j) out.push_back(uint8_t(code(x[b + j]) | (code(x[b + j + 16]) << 4)));
      }
      break;
    case TensorType::Q1_0:
      for (int64_t b = 0; b < n; b += 128) {
        double s = 0;
        for (int i = 0; i < 128; ++i) s += std::fabs(x[b + i]);
        put16(f32_to_f16(float(s / 128)));
        for (int j = 0; j < 16; ++j) {
          uint8_t byte = 0;
          for (int k = 0; k < 8; ++k)
            if (x[b + 8 * j + k] >= 0) byte |= uint8_t(1u << k);
          out.push_back(byte);
        }
      }
      break;
  }
  return out;
}

// Scalar dequantizer straight from the layouts, one weight at a time.
inline float weight_at(TensorType t, const uint8_t* row, int64_t i) {
  auto f16 = [](const uint8_t* p) { return f16_to_f32(uint16_t(p[0] | (p[1] << 8))); };
  switch (t) {
    case TensorType::F32: { float f; std::memcpy(&f, row + 4 * i, 4); return f; }
    case TensorType::F16: return f16(row + 2 * i);
    case TensorType::BF16: return bf16_to_f32(uint16_t(row[2 * i] | (row[2 * i + 1] << 8)));
    case TensorType::Q8_0: {
      const uint8_t* b = row + 34 * (i / 32);
      return f16(b) * float(int8_t(b[2 + i % 32]));
    }
    case TensorType::Q4_0: {
      const uint8_t* b = row + 18 * (i / 32);
      const int j = int(i % 32);
      const int q = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
      return f16(b) * float(q - 8);
    }
    case TensorType::Q1_0: {
      const uint8_t* b = row + 18 * (i / 128);
      const int j = int(i % 128);
      return ((b[2 + j / 8] >> (j % 8)) & 1) ? f16(b) : -f16(b);
    }
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K: {
      // gguf/quant.cpp's per-weight reference (checked against the Python
      // decoder's fixtures in test_kquant.cpp), not backend/cpu's kernels.
      float block[256];
      const uint32_t bb = gguf::tensor_type_info(t).block_bytes;
      gguf::dequantize_row(t, row + bb * (i / 256), block, 256);
      return block[i % 256];
    }
  }
  return NAN;
}

// Tensors held in memory with the GGUF naming and ne conventions.
struct MemTensors {
  std::map<std::string, std::vector<uint8_t>> bytes;
  std::map<std::string, gguf::TensorInfo> info;

  void add(const std::string& name, TensorType t, std::vector<uint64_t> ne, const std::vector<float>& values) {
    bytes[name] = quantize(t, values.data(), int64_t(values.size()));
    gguf::TensorInfo ti;
    ti.name = name;
    ti.ne = std::move(ne);
    ti.type = t;
    ti.n_elements = values.size();
    ti.n_bytes = bytes[name].size();
    ti.data = bytes[name].data();
    info[name] = ti;
  }
  TensorLookup lookup() const {
    return [this](const std::string& n) -> const gguf::TensorInfo* {
      auto it = info.find(n);
      return it == info.end() ? nullptr : &it->second;
    };
  }
  // The stored weights dequantized, row-major [ne1][ne0].
  std::vector<float> dequantized(const std::string& name) const {
    const gguf::TensorInfo& t = info.at(name);
    const int64_t cols = int64_t(t.ne[0]);
    const int64_t rows = t.ne.size() > 1 ? int64_t(t.ne[1]) : 1;
    const size_t rb = bytes.at(name).size() / rows;
    std::vector<float> out(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      if (gguf::is_k_quant(t.type)) {  // weight_at would decode a whole super-block per weight
        gguf::dequantize_row(t.type, t.data + r * rb, out.data() + r * cols, cols);
        continue;
      }
      for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = weight_at(t.type, t.data + r * rb, c);
    }
    return out;
  }
};

inline std::vector<float> randn(Rng& rng, size_t n, float scale) {
  std::vector<float> v(n);
  for (float& x : v) x = float(rng.normal()) * scale;
  return v;
}

// A tiny random model of the given architecture, every matrix in `wtype`
// (token_embd in `embd_type` when given, as llama-quantize stores it in Q6_K).
struct TinyModel {
  ModelConfig cfg;
  MemTensors t;
};

inline std::unique_ptr<TinyModel> make_tiny(Arch arch, TensorType wtype, uint64_t seed, bool tied = false,
                                            std::optional<TensorType> embd_type = std::nullopt) {
  auto m = std::make_unique<TinyModel>();
  ModelConfig& c = m->cfg;
  // K-quants need rows of 256 weights: a wider model for them.
  const bool wide = block_of(wtype) > 128 || (embd_type && block_of(*embd_type) > 128);
  c.arch = arch;
  c.n_layers = 2;
  c.d_model = wide ? 256 : 128;
  c.d_ff = wide ? 512 : 256;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = wide ? 64 : 32;
  c.head_dim_v = c.head_dim;
  c.vocab_size = 96;
  c.context_length = 256;
  c.norm_eps = 1e-6f;
  c.rope.theta = arch == Arch::qwen3 ? 1e6 : 5e5;
  c.rope.neox = arch == Arch::qwen3;
  c.qk_norm = arch == Arch::qwen3;
  c.tied_embeddings = tied;
  Rng rng(seed);
  namespace tn = tensor_names;
  const uint64_t d = c.d_model, ff = c.d_ff, qd = uint64_t(c.n_heads) * c.head_dim,
                 kvd = uint64_t(c.n_kv_heads) * c.head_dim, V = c.vocab_size, hd = c.head_dim;
  auto ones_ish = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = 1.0f + 0.1f * float(rng.normal());
    return v;
  };
  m->t.add(tn::token_embd, embd_type.value_or(wtype), {d, V}, randn(rng, d * V, 1.0f));
  if (!tied) m->t.add(tn::output, wtype, {d, V}, randn(rng, d * V, 1.0f / std::sqrt(float(d))));
  m->t.add(tn::output_norm, TensorType::F32, {d}, ones_ish(d));
  for (int l = 0; l < c.n_layers; ++l) {
    const float s = 1.0f / std::sqrt(float(d));
    m->t.add(tn::blk(l, tn::attn_norm), TensorType::F32, {d}, ones_ish(d));
    m->t.add(tn::blk(l, tn::attn_q), wtype, {d, qd}, randn(rng, d * qd, s * 2));
    m->t.add(tn::blk(l, tn::attn_k), wtype, {d, kvd}, randn(rng, d * kvd, s * 2));
    m->t.add(tn::blk(l, tn::attn_v), wtype, {d, kvd}, randn(rng, d * kvd, s));
    m->t.add(tn::blk(l, tn::attn_output), wtype, {qd, d}, randn(rng, qd * d, 1.0f / std::sqrt(float(qd))));
    if (c.qk_norm) {
      m->t.add(tn::blk(l, tn::attn_q_norm), TensorType::F32, {hd}, ones_ish(hd));
      m->t.add(tn::blk(l, tn::attn_k_norm), TensorType::F32, {hd}, ones_ish(hd));
    }
    m->t.add(tn::blk(l, tn::ffn_norm), TensorType::F32, {d}, ones_ish(d));
    m->t.add(tn::blk(l, tn::ffn_gate), wtype, {d, ff}, randn(rng, d * ff, s));
    m->t.add(tn::blk(l, tn::ffn_up), wtype, {d, ff}, randn(rng, d * ff, s));
    m->t.add(tn::blk(l, tn::ffn_down), wtype, {ff, d}, randn(rng, ff * d, 1.0f / std::sqrt(float(ff))));
  }
  return m;
}

}  // namespace kvq::testutil
