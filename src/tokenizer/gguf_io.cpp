// tokenizer.ggml.* <-> TokenizerData through the GGUF reader and writer.
#include "core/error.hpp"
#include "gguf/gguf.hpp"
#include "tokenizer/hf_import.hpp"
#include "tokenizer/tokenizer.hpp"
#include "tokenizer/vocab.hpp"

namespace kvq {
namespace {

namespace keys = tokenizer_keys;

std::vector<std::string> string_array(const gguf::File& f, const char* key) {
  const gguf::Array& a = f.get(key).as_array();
  KVQ_CHECK(a.elem_type == gguf::ValueType::STRING, Errc::format, "'", f.path(), "': ", key,
            " must be an array of strings, not of ", gguf::value_type_name(a.elem_type));
  std::vector<std::string> out;
  out.reserve(a.items.size());
  for (const auto& v : a.items) out.push_back(v.as_string());
  return out;
}

int32_t optional_id(const gguf::File& f, const char* key) {
  const gguf::Value* v = f.find(key);
  if (!v) return -1;
  const int64_t id = v->as_i64();
  KVQ_CHECK(id >= -1 && id < INT32_MAX, Errc::format, "'", f.path(), "': ", key, " = ", id, " is not a token id");
  return int32_t(id);
}

}  // namespace

TokenizerData read_tokenizer_data(const gguf::File& f) {
  TokenizerData d;
  if (!f.has(keys::model))
    fail(Errc::format, "'", f.path(), "' has no tokenizer (missing required key '", keys::model,
         "'); use a GGUF converted with its tokenizer, or pass --tokenizer-json");
  d.model = f.get_string(keys::model);
  KVQ_CHECK(d.model == "gpt2", Errc::unsupported, "'", f.path(), "': ", keys::model, " = '", d.model,
            "' is not supported; kvq supports byte-level BPE ('gpt2')");
  if (!f.has(keys::pre))
    fail(Errc::format, "'", f.path(), "': missing required key '", keys::pre,
         "' (the pre-tokenizer: 'qwen2' or 'llama-bpe'); reconvert the model with a current converter");
  d.pre = f.get_string(keys::pre);
  d.tokens = string_array(f, keys::tokens);
  if (const gguf::Value* v = f.find(keys::token_type)) {
    const gguf::Array& a = v->as_array();
    d.types.reserve(a.items.size());
    for (const auto& t : a.items) d.types.push_back(int32_t(t.as_i64()));
  }
  d.merges = string_array(f, keys::merges);
  d.bos = optional_id(f, keys::bos_id);
  d.eos = optional_id(f, keys::eos_id);
  d.eot = optional_id(f, keys::eot_id);
  d.pad = optional_id(f, keys::pad_id);
  d.add_bos = f.get_bool_or(keys::add_bos, d.pre == "llama-bpe");
  d.chat_template = f.get_string_or(keys::chat_template, "");
  d.normalizer = f.get_string_or(keys::normalizer, "");
  return d;
}

void write_tokenizer_data(const TokenizerData& d, gguf::Writer& w) {
  w.set(keys::model, gguf::Value::string(d.model));
  w.set(keys::pre, gguf::Value::string(d.pre));
  w.set(keys::tokens, gguf::Value::string_array(d.tokens));
  std::vector<int32_t> types = d.types;
  if (types.empty()) types.assign(d.tokens.size(), int32_t(TokenType::normal));
  w.set(keys::token_type, gguf::Value::i32_array(types));
  w.set(keys::merges, gguf::Value::string_array(d.merges));
  if (d.bos >= 0) w.set(keys::bos_id, gguf::Value::u32(uint32_t(d.bos)));
  if (d.eos >= 0) w.set(keys::eos_id, gguf::Value::u32(uint32_t(d.eos)));
  if (d.eot >= 0) w.set(keys::eot_id, gguf::Value::u32(uint32_t(d.eot)));
  if (d.pad >= 0) w.set(keys::pad_id, gguf::Value::u32(uint32_t(d.pad)));
  w.set(keys::add_bos, gguf::Value::boolean(d.add_bos));
  if (!d.chat_template.empty()) w.set(keys::chat_template, gguf::Value::string(d.chat_template));
  if (!d.normalizer.empty()) w.set(keys::normalizer, gguf::Value::string(d.normalizer));
}

namespace {

// A model written from a tokenizer.json must be able to run: the tokenizer is
// built once (merges naming unknown tokens, missing byte tokens, ... fail
// here) before anything is written.
void check_builds(const TokenizerData& d, const std::string& path) {
  try {
    (void)Tokenizer::from_data(d);
  } catch (const Error& e) {
    fail(Errc::format, "'", path, "' does not make a working tokenizer: ", e.what());
  }
}

}  // namespace

void import_hf_tokenizer(const std::string& path, gguf::Writer& w) {
  const TokenizerData d = load_hf_tokenizer(path);
  check_builds(d, path);
  write_tokenizer_data(d, w);
}

void import_hf_tokenizer(const std::string& path, gguf::Writer& w, int vocab_size) {
  TokenizerData d = load_hf_tokenizer(path);
  pad_vocab(d, vocab_size);
  check_builds(d, path);
  write_tokenizer_data(d, w);
}

Tokenizer Tokenizer::from_gguf(const gguf::File& f) { return from_data(read_tokenizer_data(f)); }

// One loading path: a tokenizer.json goes through the same GGUF keys a model
// file carries, so what tests check here is what `kvq synth --vocab` stores.
Tokenizer Tokenizer::from_hf_json(const std::string& path) {
  gguf::Writer w;
  write_tokenizer_data(load_hf_tokenizer(path), w);
  const std::vector<uint8_t> bytes = w.to_bytes();
  const gguf::File f = gguf::File::parse(bytes.data(), bytes.size(), path);
  return from_gguf(f);
}

}  // namespace kvq
