// Synthetic models: shapes, determinism, weight scale, built-in vocabulary, and
// the `kvq synth` -> `kvq info` round trip through the binary.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "cli_test_util.hpp"
#include "core/error.hpp"
#include "gguf/gguf.hpp"
#include "gguf/quant.hpp"
#include "model/config.hpp"
#include "model/synth.hpp"
#include "model/tensor_names.hpp"
#include "tokenizer/tokenizer.hpp"

using namespace kvq;
using namespace kvq::gguf;

namespace {

std::vector<uint8_t> synth_bytes(const std::string& shape, std::optional<TensorType> weights = {},
                                 uint64_t seed = 0) {
  SynthOptions o;
  o.shape = shape;
  o.weights = weights;
  o.seed = seed;
  Writer w;
  build_synthetic(o, w);
  return w.to_bytes();
}

bool is_matrix(const TensorInfo& t) { return t.ne.size() == 2; }

}  // namespace

TEST(Synth, TinyShapesLoadAsModels) {
  struct Want { const char* shape; Arch arch; int heads, kv, hd; bool qk, tied, neox; double theta; };
  for (const Want& w : {Want{"tiny", Arch::qwen3, 8, 2, 128, true, false, true, 1e6},
                        Want{"tiny-llama", Arch::llama, 8, 4, 64, false, true, false, 500000.0}}) {
    const auto bytes = synth_bytes(w.shape);
    EXPECT_LT(bytes.size(), 5u * 1000 * 1000) << w.shape;
    File f = File::parse(bytes.data(), bytes.size(), w.shape);
    const ModelConfig c = ModelConfig::from_gguf(f);
    EXPECT_EQ(c.arch, w.arch);
    EXPECT_EQ(c.d_model, 256);
    EXPECT_EQ(c.n_heads, w.heads);
    EXPECT_EQ(c.n_kv_heads, w.kv);
    EXPECT_EQ(c.head_dim, w.hd);
    EXPECT_EQ(c.qk_norm, w.qk);
    EXPECT_EQ(c.tied_embeddings, w.tied);
    EXPECT_EQ(c.rope.neox, w.neox);
    EXPECT_EQ(c.rope.theta, w.theta);
    EXPECT_EQ(c.vocab_size, builtin_vocab_size());
    EXPECT_EQ(c.name, std::string("kvq synthetic ") + w.shape);
    EXPECT_EQ(f.get_u64("kvq.synthetic.seed"), 0u);
    EXPECT_EQ(f.get_u64("general.alignment"), 32u);
    EXPECT_EQ(f.get("tokenizer.ggml.tokens").as_array().items.size(), size_t(c.vocab_size));
  }
  const SynthShape& t = synth_shape("tiny");
  EXPECT_EQ(t.n_heads / t.n_kv_heads, 4);
  EXPECT_THROW(synth_shape("huge"), Error);
}

TEST(Synth, DeterministicPerSeed) {
  EXPECT_EQ(synth_bytes("tiny", {}, 5), synth_bytes("tiny", {}, 5));
  const auto a = synth_bytes("tiny", TensorType::Q1_0, 1), b = synth_bytes("tiny", TensorType::Q1_0, 2);
  ASSERT_EQ(a.size(), b.size());
  File fa = File::parse(a.data(), a.size()), fb = File::parse(b.data(), b.size());
  const TensorInfo& qa = fa.tensor("blk.0.attn_q.weight");
  const TensorInfo& qb = fb.tensor("blk.0.attn_q.weight");
  EXPECT_NE(std::memcmp(qa.data, qb.data, qa.n_bytes), 0);
  // Different tensors of one model get different streams.
  const TensorInfo& up = fa.tensor("blk.0.ffn_up.weight");
  const TensorInfo& gate = fa.tensor("blk.0.ffn_gate.weight");
  EXPECT_NE(std::memcmp(up.data, gate.data, up.n_bytes), 0);
}

TEST(Synth, EveryWeightTypeHasTheIntendedScale) {
  for (TensorType t : {TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q8_0,
                       TensorType::Q4_0, TensorType::Q1_0}) {
    const auto bytes = synth_bytes("tiny", t, 3);
    File f = File::parse(bytes.data(), bytes.size());
    ModelConfig::from_gguf(f);  // loads
    for (const auto& ti : f.tensors()) {
      if (!is_matrix(ti)) {
        EXPECT_EQ(ti.type, TensorType::F32) << ti.name;
        std::vector<float> v(ti.n_elements);
        dequantize_row(ti.type, ti.data, v.data(), int64_t(v.size()));
        for (float x : v) ASSERT_EQ(x, 1.0f) << ti.name;
        continue;
      }
      EXPECT_EQ(ti.type, t) << ti.name;
      std::vector<float> v(ti.n_elements);
      dequantize_row(ti.type, ti.data, v.data(), int64_t(v.size()));
      double ss = 0, sum = 0;
      for (float x : v) {
        ASSERT_TRUE(std::isfinite(x)) << ti.name;
        ss += double(x) * x;
        sum += x;
      }
      const double n = double(v.size());
      const double std_dev = std::sqrt(ss / n);
      const double want = (ti.name == tensor_names::token_embd || ti.name == tensor_names::output)
                              ? 1.0 / std::sqrt(256.0)
                              : 1.0 / std::sqrt(double(ti.ne[0]));
      // Q4_0 rounds to 16 levels and Q1_0's per-block scale has mean-square 1.02 s^2: 8% slack.
      EXPECT_NEAR(std_dev, want, want * 0.08) << ti.name << " " << tensor_type_name(t);
      EXPECT_LT(std::fabs(sum / n), want * 0.05) << ti.name;
    }
  }
}

TEST(Synth, EightBShapesPlannedExactly) {
  SynthOptions o;
  o.shape = "bonsai-8b";
  Writer w;
  build_synthetic(o, w);  // plans tensors; nothing is generated until write
  uint64_t matrix_bytes = 0, n_matrices = 0;
  for (const auto& t : w.tensor_infos()) {
    if (t.ne.size() == 2) {
      EXPECT_EQ(t.type, TensorType::Q1_0) << t.name;
      ++n_matrices;
      matrix_bytes += t.n_bytes;
    } else {
      EXPECT_EQ(t.type, TensorType::F32) << t.name;
    }
  }
  EXPECT_EQ(n_matrices, 36u * 7 + 2);
  EXPECT_EQ(w.tensor_count(), 36u * 11 + 3);
  // 36 x 193M + 2 x 151936 x 4096 weights at 18 bytes per 128.
  const uint64_t per_layer = 4096ull * 4096 * 2 + 4096ull * 1024 * 2 + 4096ull * 12288 * 3;
  EXPECT_EQ(matrix_bytes, (36 * per_layer + 2ull * 151936 * 4096) / 128 * 18);
  EXPECT_NEAR(double(w.data_bytes()) / 1e9, 1.15, 0.01);
  EXPECT_EQ(w.find("tokenizer.ggml.tokens")->as_array().items.size(), 151936u);
  EXPECT_EQ(w.find("tokenizer.ggml.tokens")->as_array().items[151645].as_string(), "<|im_end|>");

  Writer w16;
  o.shape = "qwen3-8b";
  build_synthetic(o, w16);
  for (const auto& t : w16.tensor_infos())
    EXPECT_EQ(t.type, t.ne.size() == 2 ? TensorType::BF16 : TensorType::F32) << t.name;
  EXPECT_NEAR(double(w16.data_bytes()) / 1e9, 16.38, 0.05);
}

TEST(Synth, BuiltinVocabularyIsConsistent) {
  Writer w;
  const int n = add_builtin_vocab(w);
  EXPECT_EQ(n, builtin_vocab_size());
  const auto& tokens = w.find("tokenizer.ggml.tokens")->as_array().items;
  const auto& types = w.find("tokenizer.ggml.token_type")->as_array().items;
  const auto& merges = w.find("tokenizer.ggml.merges")->as_array().items;
  ASSERT_EQ(tokens.size(), size_t(n));
  ASSERT_EQ(types.size(), size_t(n));
  EXPECT_GE(merges.size(), 200u);
  EXPECT_EQ(w.find("tokenizer.ggml.model")->as_string(), "gpt2");
  EXPECT_EQ(w.find("tokenizer.ggml.pre")->as_string(), "qwen2");
  std::set<std::string> seen;
  for (const auto& t : tokens) EXPECT_TRUE(seen.insert(t.as_string()).second) << "duplicate " << t.as_string();
  EXPECT_EQ(tokens[0].as_string(), "!");           // GPT-2 byte order starts at '!'
  EXPECT_TRUE(seen.count("\xc4\xa0"));             // U+0120 'Ġ' = byte 0x20 (space)
  EXPECT_TRUE(seen.count("\xc4\x8a"));             // U+010A 'Ċ' = byte 0x0A (newline)
  for (const auto& m : merges) {
    const std::string s = m.as_string();
    const size_t sp = s.find(' ');
    ASSERT_NE(sp, std::string::npos);
    EXPECT_TRUE(seen.count(s.substr(0, sp))) << s;
    EXPECT_TRUE(seen.count(s.substr(sp + 1))) << s;
    EXPECT_TRUE(seen.count(s.substr(0, sp) + s.substr(sp + 1))) << s;
  }
  const int64_t bos = w.find("tokenizer.ggml.bos_token_id")->as_i64();
  const int64_t eos = w.find("tokenizer.ggml.eos_token_id")->as_i64();
  EXPECT_EQ(tokens[size_t(bos)].as_string(), "<|endoftext|>");
  EXPECT_EQ(tokens[size_t(eos)].as_string(), "<|im_end|>");
  EXPECT_EQ(types[size_t(eos)].as_i64(), 3);
  EXPECT_EQ(types[0].as_i64(), 1);

  Writer padded;
  EXPECT_EQ(add_builtin_vocab(padded, 151936), 151936);
  const auto& pt = padded.find("tokenizer.ggml.tokens")->as_array().items;
  const auto& ptypes = padded.find("tokenizer.ggml.token_type")->as_array().items;
  EXPECT_EQ(pt[151643].as_string(), "<|endoftext|>");
  EXPECT_EQ(pt[151644].as_string(), "<|im_start|>");
  EXPECT_EQ(pt[1000].as_string(), "[SYN1000]");  // filler: a normal token with visible text
  EXPECT_EQ(ptypes[1000].as_i64(), 1);
  // What a served stream shows: filler decodes to its text, control tokens to
  // nothing unless asked for.
  const auto bytes = padded.to_bytes();
  const Tokenizer tok = Tokenizer::from_gguf(File::parse(bytes.data(), bytes.size()));
  EXPECT_EQ(tok.decode({1000, 151000}), "[SYN1000][SYN151000]");
  EXPECT_EQ(tok.decode({151645}), "");
  EXPECT_EQ(tok.decode({151645}, true), "<|im_end|>");
  Writer small;
  EXPECT_THROW(add_builtin_vocab(small, 10), Error);
}

TEST(Synth, CliSynthThenInfoRoundTrips) {
  using kvq::test::kvq_cli;
  const std::string path =
      (std::filesystem::temp_directory_path() / ("kvq_synth_" + std::to_string(getpid()) + ".gguf")).string();
  const auto made = kvq_cli("synth --shape tiny --weights q8_0 --seed 9 -o " + path);
  ASSERT_EQ(made.rc, 0) << made.out << made.err;
  const auto info = kvq_cli("info -m " + path + " --json");
  ASSERT_EQ(info.rc, 0) << info.out << info.err;
  const auto j = nlohmann::json::parse(info.out);
  EXPECT_EQ(j["architecture"], "qwen3");
  EXPECT_EQ(j["version"], 3);
  EXPECT_EQ(j["config"]["n_layers"], 2);
  EXPECT_EQ(j["config"]["head_dim"], 128);
  EXPECT_EQ(j["config"]["gqa_ratio"], 4);
  EXPECT_EQ(j["config"]["vocab_size"], builtin_vocab_size());
  EXPECT_EQ(j["config"]["rope"]["style"], "neox");
  EXPECT_EQ(j["tensors"]["count"], 25);
  EXPECT_EQ(j["tensors"]["by_type"]["Q8_0"]["count"], 16);
  EXPECT_EQ(j["tensors"]["by_type"]["F32"]["count"], 9);
  EXPECT_EQ(j["tokenizer"]["model"], "gpt2");
  EXPECT_EQ(j["tokenizer"]["eos"]["piece"], "<|im_end|>");
  EXPECT_EQ(j["file_size"], std::filesystem::file_size(path));
  // The same file read in-process agrees with the CLI.
  File f = File::open(path);
  EXPECT_EQ(f.get_u64("kvq.synthetic.seed"), 9u);
  const auto text = kvq_cli("info -m " + path);
  ASSERT_EQ(text.rc, 0) << text.err;
  EXPECT_NE(text.out.find("architecture:  qwen3"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("Q8_0"), std::string::npos) << text.out;
  std::filesystem::remove(path);
  const auto shape = kvq_cli("synth --shape nope -o " + path);
  EXPECT_EQ(shape.rc, 2);
  EXPECT_NE(shape.err.find("unknown synthetic shape 'nope'"), std::string::npos) << shape.err;
  const auto weights = kvq_cli("synth --shape tiny --weights q5_0 -o " + path);
  EXPECT_NE(weights.rc, 0);
  EXPECT_NE(weights.err.find("--weights 'q5_0'"), std::string::npos) << weights.err;
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(Synth, VocabFromHuggingFaceTokenizerJson) {
  const std::string json = std::string(KVQ_SOURCE_DIR) + "/models/tokenizers/qwen3/tokenizer.json";
  ASSERT_TRUE(std::filesystem::exists(json)) << json;
  auto embd_rows = [](const Writer& w) {
    for (const auto& t : w.tensor_infos())
      if (t.name == tensor_names::token_embd) return t.ne[1];
    return uint64_t(0);
  };
  SynthOptions o;
  o.shape = "tiny";
  o.vocab_json = json;
  Writer tiny;
  build_synthetic(o, tiny);
  // A tiny shape takes the tokenizer's own count (151643 + 26 added tokens).
  EXPECT_EQ(embd_rows(tiny), 151669u);
  EXPECT_EQ(tiny.find("tokenizer.ggml.tokens")->as_array().items.size(), 151669u);
  EXPECT_EQ(tiny.find("tokenizer.ggml.pre")->as_string(), "qwen2");
  EXPECT_EQ(tiny.find("tokenizer.ggml.merges")->as_array().items.size(), 151387u);
  // The 8B shapes pad it to the real embedding size.
  o.shape = "bonsai-8b";
  Writer big;
  build_synthetic(o, big);
  EXPECT_EQ(embd_rows(big), 151936u);
  EXPECT_EQ(big.find("tokenizer.ggml.tokens")->as_array().items.size(), 151936u);
  o.vocab_json = "/nonexistent/tokenizer.json";
  Writer bad;
  EXPECT_THROW(build_synthetic(o, bad), Error);
}
