// ModelConfig::from_gguf: every field from metadata, and errors naming the key/tensor.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "gguf/gguf.hpp"
#include "model/config.hpp"
#include "model/tensor_names.hpp"

using namespace kvq;
using namespace kvq::gguf;

namespace {

struct Shape {
  std::string arch = "qwen3";
  int layers = 2, d = 64, ff = 96, heads = 4, kv_heads = 2, head_dim = 32, vocab = 50;
  bool qk_norm = true, tied = false;
};

// A metadata-complete model with zero-filled F32 tensors; `edit` may change the
// writer before tensors are added (drop or alter keys), `skip` omits a tensor.
std::vector<uint8_t> make_model(const Shape& s, const std::function<void(Writer&)>& edit = {},
                                const std::string& skip = "", const std::string& bad_shape = "") {
  Writer w;
  const std::string a = s.arch;
  w.set("general.architecture", Value::string(a));
  w.set("general.name", Value::string("cfg test"));
  w.set(a + ".block_count", Value::u32(s.layers));
  w.set(a + ".embedding_length", Value::u32(s.d));
  w.set(a + ".feed_forward_length", Value::u32(s.ff));
  w.set(a + ".attention.head_count", Value::u32(s.heads));
  w.set(a + ".attention.head_count_kv", Value::u32(s.kv_heads));
  w.set(a + ".attention.key_length", Value::u32(s.head_dim));
  w.set(a + ".attention.value_length", Value::u32(s.head_dim));
  w.set(a + ".context_length", Value::u32(4096));
  w.set(a + ".attention.layer_norm_rms_epsilon", Value::f32(1e-6f));
  w.set(a + ".rope.freq_base", Value::f32(1000000.0f));
  if (edit) edit(w);
  auto add = [&](const std::string& name, std::vector<uint64_t> ne) {
    if (name == skip) return;
    if (name == bad_shape) ne[0] += 1;
    w.add_tensor(name, TensorType::F32, ne, [](uint8_t* p, uint64_t n) { std::fill(p, p + n, 0); });
  };
  namespace tn = tensor_names;
  const uint64_t d = s.d, hd = s.head_dim;
  add(tn::token_embd, {d, uint64_t(s.vocab)});
  add(tn::output_norm, {d});
  if (!s.tied) add(tn::output, {d, uint64_t(s.vocab)});
  for (int i = 0; i < s.layers; ++i) {
    add(tn::blk(i, tn::attn_norm), {d});
    add(tn::blk(i, tn::attn_q), {d, s.heads * hd});
    add(tn::blk(i, tn::attn_k), {d, s.kv_heads * hd});
    add(tn::blk(i, tn::attn_v), {d, s.kv_heads * hd});
    add(tn::blk(i, tn::attn_output), {s.heads * hd, d});
    if (s.qk_norm) {
      add(tn::blk(i, tn::attn_q_norm), {hd});
      add(tn::blk(i, tn::attn_k_norm), {hd});
    }
    add(tn::blk(i, tn::ffn_norm), {d});
    add(tn::blk(i, tn::ffn_gate), {d, uint64_t(s.ff)});
    add(tn::blk(i, tn::ffn_up), {d, uint64_t(s.ff)});
    add(tn::blk(i, tn::ffn_down), {uint64_t(s.ff), d});
  }
  return w.to_bytes();
}

// Expect from_gguf to throw with `fragment` in the message.
void expect_config_error(const std::vector<uint8_t>& bytes, const std::string& fragment) {
  File f = File::parse(bytes.data(), bytes.size(), "m.gguf");
  try {
    ModelConfig::from_gguf(f);
    ADD_FAILURE() << "no error; expected one mentioning: " << fragment;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message: " << e.what() << "\nexpected fragment: " << fragment;
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "not one line: " << e.what();
  }
}

}  // namespace

TEST(Config, Qwen3FieldsFromMetadata) {
  const auto bytes = make_model(Shape{}, [](Writer& w) {
    w.set("qwen3.rope.scaling.type", Value::string("yarn"));
    w.set("qwen3.rope.scaling.factor", Value::f32(4.0f));
    w.set("qwen3.rope.scaling.original_context_length", Value::u32(32768));
  });
  File f = File::parse(bytes.data(), bytes.size());
  const ModelConfig c = ModelConfig::from_gguf(f);
  EXPECT_EQ(c.arch, Arch::qwen3);
  EXPECT_STREQ(arch_name(c.arch), "qwen3");
  EXPECT_EQ(c.name, "cfg test");
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.d_model, 64);
  EXPECT_EQ(c.d_ff, 96);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.gqa_ratio(), 2);
  EXPECT_EQ(c.head_dim, 32);  // from key_length, not d_model / n_heads (= 16)
  EXPECT_EQ(c.head_dim_v, 32);
  EXPECT_EQ(c.vocab_size, 50);
  EXPECT_EQ(c.context_length, 4096u);
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-6f);
  EXPECT_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rope.scaling, RopeScaling::yarn);
  EXPECT_EQ(c.rope.factor, 4.0);
  EXPECT_EQ(c.rope.original_context, 32768u);
  EXPECT_TRUE(c.rope.neox);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_EQ(c.kv_bytes_per_token_bf16(), 2u * 2 * (32 + 32) * 2);
}

TEST(Config, LlamaTiedNoQkNormDefaults) {
  Shape s;
  s.arch = "llama";
  s.qk_norm = false;
  s.tied = true;
  s.head_dim = 16;  // = d / heads, so key_length may be omitted
  const auto bytes = make_model(s);
  File f = File::parse(bytes.data(), bytes.size());
  const ModelConfig c = ModelConfig::from_gguf(f);
  EXPECT_EQ(c.arch, Arch::llama);
  EXPECT_FALSE(c.rope.neox);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_EQ(c.rope.scaling, RopeScaling::none);
  EXPECT_EQ(c.head_dim, 16);
}

TEST(Config, OptionalKeysDefault) {
  // Without head_count_kv / key_length / value_length / freq_base the defaults apply.
  Shape s;
  s.kv_heads = 4;
  s.head_dim = 16;
  std::vector<uint8_t> bytes = make_model(s);
  // Re-write without optional keys by copying all metadata but those.
  File full = File::parse(bytes.data(), bytes.size());
  Writer w;
  for (const auto& [k, v] : full.metadata())
    if (k != "qwen3.attention.head_count_kv" && k != "qwen3.attention.key_length" &&
        k != "qwen3.attention.value_length" && k != "qwen3.rope.freq_base")
      w.set(k, v);
  for (const auto& t : full.tensors())
    w.add_tensor(t.name, t.type, t.ne, std::vector<uint8_t>(t.data, t.data + t.n_bytes));
  const auto bytes2 = w.to_bytes();
  File f = File::parse(bytes2.data(), bytes2.size());
  const ModelConfig c = ModelConfig::from_gguf(f);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.head_dim_v, 16);
  EXPECT_EQ(c.rope.theta, 10000.0);
}

TEST(Config, MissingAndBadKeysAreNamed) {
  for (const char* key : {"qwen3.block_count", "qwen3.embedding_length", "qwen3.feed_forward_length",
                          "qwen3.attention.head_count", "qwen3.context_length",
                          "qwen3.attention.layer_norm_rms_epsilon", "general.architecture"}) {
    const auto full = make_model(Shape{});
    File f0 = File::parse(full.data(), full.size());
    Writer w;
    for (const auto& [k, v] : f0.metadata())
      if (k != key) w.set(k, v);
    for (const auto& t : f0.tensors())
      w.add_tensor(t.name, t.type, t.ne, std::vector<uint8_t>(t.data, t.data + t.n_bytes));
    expect_config_error(w.to_bytes(), std::string("missing required key '") + key + "'");
  }
  expect_config_error(make_model(Shape{}, [](Writer& w) { w.set("general.architecture", Value::string("gpt2")); }),
                      "general.architecture 'gpt2' is not supported");
  expect_config_error(make_model(Shape{}, [](Writer& w) { w.set("qwen3.attention.head_count_kv", Value::u32(3)); }),
                      "qwen3.attention.head_count_kv");
  expect_config_error(make_model(Shape{}, [](Writer& w) { w.set("qwen3.attention.key_length", Value::u32(31)); }),
                      "qwen3.attention.key_length' = 31 must be even");
  expect_config_error(make_model(Shape{}, [](Writer& w) { w.set("qwen3.block_count", Value::u32(0)); }),
                      "qwen3.block_count' = 0 is out of range");
  expect_config_error(make_model(Shape{}, [](Writer& w) { w.set("qwen3.block_count", Value::string("2")); }),
                      "qwen3.block_count");
  expect_config_error(make_model(Shape{}, [](Writer& w) { w.set("qwen3.rope.scaling.type", Value::string("ntk")); }),
                      "qwen3.rope.scaling.type' = 'ntk' is not supported");
  expect_config_error(make_model(Shape{}, [](Writer& w) {
                        w.set("qwen3.rope.scaling.type", Value::string("linear"));
                      }),
                      "missing required key 'qwen3.rope.scaling.factor'");
  expect_config_error(make_model(Shape{}, [](Writer& w) {
                        w.set("qwen3.attention.head_count_kv", Value::i32_array({2, 2}));
                      }),
                      "per-layer array");
  expect_config_error(make_model(Shape{}, [](Writer& w) {
                        w.set("qwen3.attention.layer_norm_rms_epsilon", Value::f32(-1.0f));
                      }),
                      "layer_norm_rms_epsilon' = -1 must be a positive");
  expect_config_error(make_model(Shape{}, [](Writer& w) { w.set("qwen3.rope.dimension_count", Value::u32(16)); }),
                      "qwen3.rope.dimension_count' = 16 differs from head_dim 32 (partial RoPE is not supported)");
}

TEST(Config, TensorShapesAreChecked) {
  expect_config_error(make_model(Shape{}, {}, "blk.1.ffn_down.weight"), "missing tensor 'blk.1.ffn_down.weight'");
  expect_config_error(make_model(Shape{}, {}, "token_embd.weight"), "missing tensor 'token_embd.weight'");
  expect_config_error(make_model(Shape{}, {}, "", "blk.0.attn_k.weight"),
                      "tensor 'blk.0.attn_k.weight' has shape [65, 64] but the config implies [64, 64]");
  expect_config_error(make_model(Shape{}, {}, "", "blk.1.attn_k_norm.weight"),
                      "tensor 'blk.1.attn_k_norm.weight' has shape [33]");
  expect_config_error(make_model(Shape{}, {}, "", "output.weight"), "tensor 'output.weight' has shape [65, 50]");
}
