#include "model/synth.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "gguf/gguf.hpp"
#include "gguf/quant.hpp"
#include "model/tensor_names.hpp"
#include "tokenizer/hf_import.hpp"


namespace kvq {

using gguf::TensorType;
using gguf::Value;

// ---------------------------------------------------------------------------
// Shapes
// ---------------------------------------------------------------------------

const std::vector<SynthShape>& synth_shapes() {
  // context 65536 for the 8B shapes so that the benchmark's 64k cell is within
  // context_length (Qwen3-8B itself says 40960; speed does not depend on it).
  static const std::vector<SynthShape> shapes = {
      {"tiny", "qwen3", 2, 256, 512, 8, 2, 128, 0, 4096, 1e6, true, false, TensorType::BF16,
       "qwen3, 2 layers, d 256, 8 heads / 2 KV heads (GQA 4), head_dim 128, BF16, built-in vocab"},
      {"tiny-llama", "llama", 2, 256, 512, 8, 4, 64, 0, 4096, 500000.0, false, true, TensorType::BF16,
       "llama, 2 layers, d 256, 8 heads / 4 KV heads (GQA 2), head_dim 64, tied embeddings, BF16"},
      {"bonsai-8b", "qwen3", 36, 4096, 12288, 32, 8, 128, 151936, 65536, 1e6, true, false,
       TensorType::Q1_0, "Qwen3-8B shape, every matrix Q1_0 (Bonsai-8B), ~1.15 GB"},
      {"qwen3-8b", "qwen3", 36, 4096, 12288, 32, 8, 128, 151936, 65536, 1e6, true, false,
       TensorType::BF16, "Qwen3-8B shape, BF16 matrices, ~16.4 GB"},
  };
  return shapes;
}

const SynthShape& synth_shape(const std::string& name) {
  std::string names;
  for (const auto& s : synth_shapes()) {
    if (s.name == name) return s;
    names += (names.empty() ? "" : ", ") + s.name;
  }
  fail(Errc::invalid_argument, "unknown synthetic shape '", name, "' (known: ", names, ")");
}

// ---------------------------------------------------------------------------
// Built-in vocabulary
// ---------------------------------------------------------------------------

namespace {

// Training text for the built-in merges, written for kvq (English prose plus a
// little code, so that common words and keywords become single tokens).
const char* kMergeCorpus =
    "The model reads the prompt, turns it into tokens and then writes one token at a time. "
    "Each new token looks back at every token before it through attention, and the keys and "
    "values of those tokens are kept in a cache so that they are not computed again. "
    "When the context is long, the cache is larger than the weights of the model, and the "
    "time of each step is the time it takes to read the cache from memory. "
    "That is why we compress the cache: fewer bytes to read means a faster step, as long as "
    "the kernel that reads the compressed cache is as fast as the one that reads the plain one. "
    "A good test of an engine is that it gives the same answer for the same input, every time, "
    "and that the answer does not change when the cache is compressed a little. "
    "This is a small text for a small vocabulary. It has the words that people use most: "
    "the, of, and, to, in, is, that, for, it, with, as, on, be, at, by, this, from, or, an, "
    "are, not, but, have, was, one, all, can, will, there, their, what, which, when, where, "
    "there is a time for every thing, and the time for this thing is now. "
    "def main():\n    return 0\n\n"
    "def add(a, b):\n    return a + b\n\n"
    "def read_file(path):\n    with open(path) as f:\n        return f.read()\n\n"
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n    else:\n        continue\n\n"
    "class Model:\n    def __init__(self, name):\n        self.name = name\n        self.layers = []\n\n"
    "    def forward(self, x):\n        for layer in self.layers:\n            x = layer(x)\n"
    "        return x\n\n"
    "int main(int argc, char** argv) {\n  for (int i = 0; i < argc; ++i) {\n"
    "    printf(\"%s\\n\", argv[i]);\n  }\n  return 0;\n}\n"
    "The quick answer is often the right one, but the right answer is not always quick. "
    "We test the reader with files that are wrong in every way we can think of, and then we "
    "let a fuzzer think of the ways we did not. The writer makes files that the reader "
    "accepts, and the reader accepts only files that make sense. "
    "Hello, world! How are you today? I am fine, thank you. What are you working on? "
    "I am writing a program that reads a model from a file and generates text with it. "
    "import numpy as np\nimport torch\n\nx = np.zeros((4, 4))\ny = torch.tensor(x)\n"
    "print(\"hello world\")\nprint(\"the answer is\", 42)\n"
    "Once upon a time there was a little program that wanted to be fast. It read its weights "
    "from a file, and every time it wrote a word it had to look back at all the words it had "
    "written before. The longer the story, the slower it became, until one day it learned to "
    "keep its memory small. Then it could tell stories that were very long, and it was still "
    "fast at the end. The other programs asked how it did that, and it said: read less, and "
    "read it once. The lesson is simple, but the work is hard, because every number that is "
    "smaller is also a little less exact, and the story must still make sense. "
    "Questions people often ask: How long is the context? How many tokens per second? How much "
    "memory does the cache need? Which format should I use? The answers depend on the model, "
    "the length of the prompt, and the number of tokens that are generated after it. "
    "if (x == nullptr) {\n    return false;\n}\nwhile (n > 0) {\n    n = n - 1;\n}\n"
    "const value = items.filter((item) => item.length > 0).map((item) => item.trim());\n"
    "SELECT name, value FROM settings WHERE name = 'model' ORDER BY name;\n";

// GPT-2 byte-to-unicode: printable bytes map to themselves, the rest to U+0100+n.
// Returns, in vocabulary order (printable ranges first, then the others), the
// byte and its UTF-8 form.
std::vector<std::pair<uint8_t, std::string>> byte_tokens() {
  auto utf8 = [](uint32_t cp) {
    std::string s;
    if (cp < 0x80) {
      s += char(cp);
    } else {
      s += char(0xC0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3F));
    }
    return s;
  };
  std::vector<std::pair<uint8_t, std::string>> out;
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  for (int b = 0; b < 256; ++b)
    if (printable[b]) out.emplace_back(uint8_t(b), utf8(uint32_t(b)));
  int n = 0;
  for (int b = 0; b < 256; ++b)
    if (!printable[b]) out.emplace_back(uint8_t(b), utf8(uint32_t(256 + n++)));
  return out;
}

// Split text roughly as byte-level BPE pre-tokenizers do: an optional leading
// space followed by a run of letters, a single digit, a run of punctuation,
// or whitespace. Merges never cross these pieces.
std::vector<std::string> pretokenize(const std::string& text) {
  auto cls = [](unsigned char c) {
    if (std::isalpha(c) || c == '_') return 1;
    if (std::isdigit(c)) return 2;
    if (c == ' ' || c == '\n' || c == '\t') return 3;
    return 4;
  };
  std::vector<std::string> out;
  size_t i = 0;
  while (i < text.size()) {
    size_t j = i;
    if (text[j] == ' ' && j + 1 < text.size() && cls((unsigned char)text[j + 1]) != 3) ++j;
    const int c = cls((unsigned char)text[j]);
    ++j;
    if (c != 2)
      while (j < text.size() && cls((unsigned char)text[j]) == c) ++j;
    out.push_back(text.substr(i, j - i));
    i = j;
  }
  return out;
}

struct BuiltinVocab {
  std::vector<std::string> tokens;  // byte tokens then merged tokens (no specials)
  std::vector<std::string> merges;  // "left right"
};

// Classic BPE training over the built-in text: merge the most frequent adjacent
// pair (ties: smallest pair lexicographically) until kMaxMerges or no pair
// occurs twice. Deterministic.
const BuiltinVocab& builtin_vocab() {
  static const BuiltinVocab vocab = [] {
    constexpr int kMaxMerges = 320;
    BuiltinVocab v;
    std::array<std::string, 256> byte_str;
    for (const auto& [b, s] : byte_tokens()) {
      byte_str[b] = s;
      v.tokens.push_back(s);
    }
    std::map<std::string, int> word_count;
    for (const auto& w : pretokenize(kMergeCorpus)) word_count[w]++;
    std::vector<std::pair<std::vector<std::string>, int>> words;
    for (const auto& [w, n] : word_count) {
      std::vector<std::string> syms;
      for (unsigned char c : w) syms.push_back(byte_str[c]);
      words.emplace_back(std::move(syms), n);
    }
    for (int m = 0; m < kMaxMerges; ++m) {
      std::map<std::pair<std::string, std::string>, int> pairs;
      for (const auto& [syms, n] : words)
        for (size_t i = 0; i + 1 < syms.size(); ++i) pairs[{syms[i], syms[i + 1]}] += n;
      const std::pair<std::string, std::string>* best = nullptr;
      int best_n = 1;
      for (const auto& [p, n] : pairs)
        if (n > best_n) {
          best = &p;
          best_n = n;
        }
      if (!best) break;
      const auto [l, r] = *best;
      v.merges.push_back(l + " " + r);
      v.tokens.push_back(l + r);
      for (auto& [syms, n] : words) {
        std::vector<std::string> out;
        for (size_t i = 0; i < syms.size(); ++i) {
          if (i + 1 < syms.size() && syms[i] == l && syms[i + 1] == r) {
            out.push_back(l + r);
            ++i;
          } else {
            out.push_back(syms[i]);
          }
        }
        syms = std::move(out);
      }
    }
    return v;
  }();
  return vocab;
}

constexpr int32_t kTokenNormal = 1, kTokenControl = 3;
constexpr int kQwenVocab = 151936, kQwenEndOfText = 151643;

// A minimal ChatML template (the format Qwen models are trained on).
const char* kChatMlTemplate =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}";

}  // namespace

int builtin_vocab_size() { return int(builtin_vocab().tokens.size()) + 3; }

int add_builtin_vocab(gguf::Writer& w, int pad_to) {
  const BuiltinVocab& bv = builtin_vocab();
  const int natural = builtin_vocab_size();
  if (pad_to != 0 && pad_to < natural)
    fail(Errc::invalid_argument, "built-in vocabulary has ", natural, " tokens; cannot pad to ", pad_to);
  const int n = pad_to ? pad_to : natural;
  std::vector<std::string> tokens(static_cast<size_t>(n));
  std::vector<int32_t> types(size_t(n), kTokenNormal);  // all but the three control tokens
  for (size_t i = 0; i < bv.tokens.size(); ++i) tokens[i] = bv.tokens[i];
  // Control tokens at Qwen's ids when the vocabulary has Qwen's size, else right after the merges.
  const int special = (n == kQwenVocab) ? kQwenEndOfText : int(bv.tokens.size());
  const char* specials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  for (int k = 0; k < 3; ++k) {
    tokens[size_t(special + k)] = specials[k];
    types[size_t(special + k)] = kTokenControl;
  }
  // Filler up to the embedding rows: normal tokens with visible text. A
  // random synthetic model samples them far more often than the few hundred
  // real ones; as unused entries ("[PADn]", no text) a whole streamed answer
  // was empty and a serving benchmark could time no token (H200, session 13:
  // 109 of 128 streams carried no text).
  // Printable ASCII: a filler token's byte-level form is its text.
  for (int i = 0; i < n; ++i)
    if (tokens[size_t(i)].empty()) tokens[size_t(i)] = "[SYN" + std::to_string(i) + "]";
  w.set("tokenizer.ggml.model", Value::string("gpt2"));
  w.set("tokenizer.ggml.pre", Value::string("qwen2"));
  w.set("tokenizer.ggml.tokens", Value::string_array(tokens));
  w.set("tokenizer.ggml.token_type", Value::i32_array(types));
  w.set("tokenizer.ggml.merges", Value::string_array(bv.merges));
  w.set("tokenizer.ggml.bos_token_id", Value::u32(uint32_t(special)));
  w.set("tokenizer.ggml.eos_token_id", Value::u32(uint32_t(special + 2)));
  w.set("tokenizer.ggml.padding_token_id", Value::u32(uint32_t(special)));
  w.set("tokenizer.ggml.add_bos_token", Value::boolean(false));
  w.set("tokenizer.chat_template", Value::string(kChatMlTemplate));
  return n;
}

// ---------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------

namespace {

uint64_t hash_name(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull ^ seed;  // FNV-1a, then mixed
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return splitmix64(h);
}

// Irwin-Hall(4) from one u64: four 16-bit uniforms, centred, scaled to unit variance.
inline float approx_normal(uint64_t r) {
  const uint32_t s = uint32_t(r & 0xffff) + uint32_t((r >> 16) & 0xffff) + uint32_t((r >> 32) & 0xffff) +
                     uint32_t(r >> 48);
  return (float(s) * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;
}

// Fill a [rows x row_len] tensor of `type` with std `scale`, one RNG stream per row.
gguf::Writer::Fill random_fill(TensorType type, uint64_t row_len, uint64_t rows, float scale,
                               uint64_t tensor_seed) {
  return [=](uint8_t* dst, uint64_t n_bytes) {
    const uint64_t row_bytes = gguf::tensor_row_bytes(type, row_len);
    KVQ_ASSERT(row_bytes * rows == n_bytes);
#pragma omp parallel if (rows * row_len >= (uint64_t(1) << 22))
    {
      std::vector<float> buf(type == TensorType::Q1_0 ? 0 : row_len);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < int64_t(rows); ++r) {
        uint64_t s = tensor_seed + uint64_t(r) * 0x9e3779b97f4a7c15ull;
        Rng rng(splitmix64(s));
        uint8_t* out = dst + uint64_t(r) * row_bytes;
        if (type == TensorType::Q1_0) {
          // Random signs and a per-block scale around `scale` directly: no floats needed.
          for (uint64_t b = 0; b < row_len / 128; ++b) {
            uint8_t* blk = out + b * 18;
            const uint16_t d = f32_to_f16(scale * (0.75f + 0.5f * rng.uniformf()));
            blk[0] = uint8_t(d & 0xff);
            blk[1] = uint8_t(d >> 8);
            const uint64_t lo = rng.next_u64(), hi = rng.next_u64();
            std::memcpy(blk + 2, &lo, 8);
            std::memcpy(blk + 10, &hi, 8);
          }
        } else {
          for (uint64_t i = 0; i < row_len; ++i) buf[i] = approx_normal(rng.next_u64()) * scale;
          gguf::quantize_row(type, buf.data(), out, int64_t(row_len));
        }
      }
    }
  };
}

gguf::Writer::Fill ones_f32() {
  return [](uint8_t* dst, uint64_t n_bytes) {
    const float one = 1.0f;
    for (uint64_t i = 0; i < n_bytes; i += 4) std::memcpy(dst + i, &one, 4);
  };
}

}  // namespace

void build_synthetic(const SynthOptions& opt, gguf::Writer& w) {
  const SynthShape& s = synth_shape(opt.shape);
  KVQ_CHECK(w.tensor_count() == 0, Errc::invalid_argument, "build_synthetic: the writer must be empty");
  const TensorType mt = opt.weights.value_or(s.matrix_type);
  const auto& info = gguf::tensor_type_info(mt);
  for (int dim : {s.d_model, s.d_ff, s.n_heads * s.head_dim})
    if (dim % int(info.block_size) != 0)
      fail(Errc::invalid_argument, "--weights ", info.name, ": shape '", s.name, "' has a row length ",
           dim, " that is not a multiple of the ", info.name, " block size ", info.block_size);

  const std::string a = s.arch;
  w.set("general.architecture", Value::string(a));
  w.set("general.name", Value::string("kvq synthetic " + s.name));
  w.set("general.alignment", Value::u32(32));
  w.set(a + ".block_count", Value::u32(uint32_t(s.n_layers)));
  w.set(a + ".context_length", Value::u32(uint32_t(s.context_length)));
  w.set(a + ".embedding_length", Value::u32(uint32_t(s.d_model)));
  w.set(a + ".feed_forward_length", Value::u32(uint32_t(s.d_ff)));
  w.set(a + ".attention.head_count", Value::u32(uint32_t(s.n_heads)));
  w.set(a + ".attention.head_count_kv", Value::u32(uint32_t(s.n_kv_heads)));
  w.set(a + ".attention.key_length", Value::u32(uint32_t(s.head_dim)));
  w.set(a + ".attention.value_length", Value::u32(uint32_t(s.head_dim)));
  w.set(a + ".attention.layer_norm_rms_epsilon", Value::f32(1e-6f));
  w.set(a + ".rope.freq_base", Value::f32(float(s.rope_base)));
  if (a == "llama") w.set(a + ".rope.dimension_count", Value::u32(uint32_t(s.head_dim)));
  w.set("kvq.synthetic.shape", Value::string(s.name));
  w.set("kvq.synthetic.seed", Value::u64(opt.seed));

  int vocab = 0;
  if (!opt.vocab_json.empty()) {
    // Fixed-vocabulary shapes (the 8B ones) pad a smaller tokenizer with unused
    // tokens to the real embedding size (Qwen3: 151669 tokens, 151936 rows);
    // a larger tokenizer, or a tiny shape, uses the imported token count.
    const TokenizerData td = load_hf_tokenizer(opt.vocab_json);
    if (s.vocab_size > 0 && int(td.tokens.size()) < s.vocab_size)
      import_hf_tokenizer(opt.vocab_json, w, s.vocab_size);
    else
      import_hf_tokenizer(opt.vocab_json, w);
    const Value* toks = w.find("tokenizer.ggml.tokens");
    KVQ_CHECK(toks != nullptr, Errc::internal, "import_hf_tokenizer wrote no tokenizer.ggml.tokens");
    vocab = int(toks->as_array().items.size());
  } else {
    vocab = add_builtin_vocab(w, s.vocab_size);
  }

  namespace tn = tensor_names;
  const uint64_t d = uint64_t(s.d_model), ff = uint64_t(s.d_ff), V = uint64_t(vocab);
  const uint64_t q_out = uint64_t(s.n_heads) * s.head_dim, kv_out = uint64_t(s.n_kv_heads) * s.head_dim;
  auto matrix = [&](const std::string& name, uint64_t in, uint64_t out, float scale) {
    w.add_tensor(name, mt, {in, out}, random_fill(mt, in, out, scale, hash_name(opt.seed, name)));
  };
  auto norm = [&](const std::string& name, uint64_t n) {
    w.add_tensor(name, TensorType::F32, {n}, ones_f32());
  };
  const float embd_scale = 1.0f / std::sqrt(float(d));
  matrix(tn::token_embd, d, V, embd_scale);
  for (int i = 0; i < s.n_layers; ++i) {
    norm(tn::blk(i, tn::attn_norm), d);
    matrix(tn::blk(i, tn::attn_q), d, q_out, 1.0f / std::sqrt(float(d)));
    matrix(tn::blk(i, tn::attn_k), d, kv_out, 1.0f / std::sqrt(float(d)));
    matrix(tn::blk(i, tn::attn_v), d, kv_out, 1.0f / std::sqrt(float(d)));
    matrix(tn::blk(i, tn::attn_output), q_out, d, 1.0f / std::sqrt(float(q_out)));
    if (s.qk_norm) {
      norm(tn::blk(i, tn::attn_q_norm), uint64_t(s.head_dim));
      norm(tn::blk(i, tn::attn_k_norm), uint64_t(s.head_dim));
    }
    norm(tn::blk(i, tn::ffn_norm), d);
    matrix(tn::blk(i, tn::ffn_gate), d, ff, 1.0f / std::sqrt(float(d)));
    matrix(tn::blk(i, tn::ffn_up), d, ff, 1.0f / std::sqrt(float(d)));
    matrix(tn::blk(i, tn::ffn_down), ff, d, 1.0f / std::sqrt(float(ff)));
  }
  norm(tn::output_norm, d);
  if (!s.tied_embeddings) matrix(tn::output, d, V, embd_scale);
}

void write_synthetic(const SynthOptions& opt, const std::string& path) {
  gguf::Writer w(3, 32);
  build_synthetic(opt, w);
  w.write(path);
}

}  // namespace kvq
