// Writes a seed corpus of small valid GGUF files for fuzz_gguf: every value
// type, nested arrays, v2 and v3, several alignments and tensor types, and
// small complete qwen3/llama models that pass ModelConfig::from_gguf.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "gguf/gguf.hpp"
#include "gguf/quant.hpp"
#include "model/tensor_names.hpp"

using namespace kvq::gguf;

namespace {

Writer::Fill ramp(TensorType t, uint64_t n) {
  return [t, n](uint8_t* dst, uint64_t) {
    std::vector<float> x(n);
    for (uint64_t i = 0; i < n; ++i) x[i] = float(int(i % 17) - 8) * 0.125f;
    quantize_row(t, x.data(), dst, int64_t(n));
  };
}

void model(Writer& w, const std::string& arch, TensorType mt, bool qk_norm, bool tied) {
  const uint64_t d = 128, ff = 256, heads = 4, kv = 2, hd = 32, vocab = 16;
  w.set("general.architecture", Value::string(arch));
  w.set("general.name", Value::string("fuzz seed"));
  w.set(arch + ".block_count", Value::u32(1));
  w.set(arch + ".context_length", Value::u32(256));
  w.set(arch + ".embedding_length", Value::u32(uint32_t(d)));
  w.set(arch + ".feed_forward_length", Value::u32(uint32_t(ff)));
  w.set(arch + ".attention.head_count", Value::u32(uint32_t(heads)));
  w.set(arch + ".attention.head_count_kv", Value::u32(uint32_t(kv)));
  w.set(arch + ".attention.key_length", Value::u32(uint32_t(hd)));
  w.set(arch + ".attention.layer_norm_rms_epsilon", Value::f32(1e-6f));
  w.set(arch + ".rope.freq_base", Value::f32(10000.0f));
  w.set(arch + ".rope.scaling.type", Value::string("yarn"));
  w.set(arch + ".rope.scaling.factor", Value::f32(2.0f));
  w.set(arch + ".rope.scaling.original_context_length", Value::u32(128));
  w.set("tokenizer.ggml.model", Value::string("gpt2"));
  w.set("tokenizer.ggml.tokens", Value::string_array({"a", "b", "ab", "<|x|>"}));
  w.set("tokenizer.ggml.merges", Value::string_array({"a b"}));
  w.set("tokenizer.ggml.bos_token_id", Value::u32(3));
  namespace tn = kvq::tensor_names;
  auto mat = [&](const std::string& name, uint64_t in, uint64_t out) {
    w.add_tensor(name, mt, {in, out}, ramp(mt, in * out));
  };
  auto vec = [&](const std::string& name, uint64_t n) {
    w.add_tensor(name, TensorType::F32, {n}, ramp(TensorType::F32, n));
  };
  mat(tn::token_embd, d, vocab);
  vec(tn::blk(0, tn::attn_norm), d);
  mat(tn::blk(0, tn::attn_q), d, heads * hd);
  mat(tn::blk(0, tn::attn_k), d, kv * hd);
  mat(tn::blk(0, tn::attn_v), d, kv * hd);
  mat(tn::blk(0, tn::attn_output), heads * hd, d);
  if (qk_norm) {
    vec(tn::blk(0, tn::attn_q_norm), hd);
    vec(tn::blk(0, tn::attn_k_norm), hd);
  }
  vec(tn::blk(0, tn::ffn_norm), d);
  mat(tn::blk(0, tn::ffn_gate), d, ff);
  mat(tn::blk(0, tn::ffn_up), d, ff);
  mat(tn::blk(0, tn::ffn_down), ff, d);
  vec(tn::output_norm, d);
  if (!tied) mat(tn::output, d, vocab);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_corpus DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  try {
    {
      Writer w(3, 32);
      w.set("u8", Value::u8(1));
      w.set("i8", {ValueType::INT8, int64_t(-1)});
      w.set("u16", {ValueType::UINT16, uint64_t(2)});
      w.set("i16", {ValueType::INT16, int64_t(-2)});
      w.set("u32", Value::u32(3));
      w.set("i32", Value::i32(-3));
      w.set("u64", Value::u64(4));
      w.set("i64", {ValueType::INT64, int64_t(-4)});
      w.set("f32", Value::f32(0.5f));
      w.set("f64", {ValueType::FLOAT64, 0.25});
      w.set("bool", Value::boolean(true));
      w.set("str", Value::string("text"));
      w.set("strs", Value::string_array({"x", "yy"}));
      w.set("nested", Value::array(ValueType::ARRAY, {Value::i32_array({1, 2}), Value::i32_array({3})}));
      w.write(dir + "/values.gguf");
    }
    struct T { const char* name; TensorType t; uint64_t n; };
    const T types[] = {{"f32", TensorType::F32, 8},    {"f16", TensorType::F16, 8},   {"bf16", TensorType::BF16, 8},
                       {"q8_0", TensorType::Q8_0, 64}, {"q4_0", TensorType::Q4_0, 32}, {"q1_0", TensorType::Q1_0, 128},
                       {"q2_k", TensorType::Q2_K, 256}, {"q3_k", TensorType::Q3_K, 256}, {"q4_k", TensorType::Q4_K, 256},
                       {"q5_k", TensorType::Q5_K, 256}, {"q6_k", TensorType::Q6_K, 256}};
    for (uint32_t version : {2u, 3u}) {
      for (uint64_t align : {1u, 32u, 64u}) {
        Writer w(version, align);
        w.set("general.name", Value::string("tensors"));
        for (const T& t : types) w.add_tensor(t.name, t.t, {t.n}, ramp(t.t, t.n));
        w.add_tensor("m", TensorType::F32, {4, 2, 2, 1}, ramp(TensorType::F32, 16));
        w.write(dir + "/tensors_v" + std::to_string(version) + "_a" + std::to_string(align) + ".gguf");
      }
    }
    {
      Writer w;
      model(w, "qwen3", TensorType::Q8_0, true, false);
      w.write(dir + "/qwen3_q8_0.gguf");
    }
    {
      Writer w;
      model(w, "llama", TensorType::Q1_0, false, true);
      w.write(dir + "/llama_q1_0.gguf");
    }
    {
      Writer w;
      model(w, "qwen3", TensorType::Q4_0, true, true);
      w.write(dir + "/qwen3_q4_0.gguf");
    }
  } catch (const kvq::Error& e) {
    std::fprintf(stderr, "make_corpus: %s\n", e.what());
    return 1;
  }
  return 0;
}
