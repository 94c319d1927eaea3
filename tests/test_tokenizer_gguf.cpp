// tokenizer.ggml.* through the GGUF writer and reader.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "gguf/gguf.hpp"
#include "tokenizer/hf_import.hpp"
#include "tokenizer/tokenizer.hpp"
#include "tokenizer/vocab.hpp"
#include "tokenizer_test_util.hpp"

using namespace kvq;

namespace {
gguf::File parse(const std::vector<uint8_t>& bytes) { return gguf::File::parse(bytes.data(), bytes.size()); }
}  // namespace

TEST(TokenizerGguf, HfImportRoundTripsThroughGguf) {
  const TokenizerData d = load_hf_tokenizer(kvq::test::qwen3_json());
  gguf::Writer w;
  import_hf_tokenizer(kvq::test::qwen3_json(), w, 151936);
  const auto bytes = w.to_bytes();
  const gguf::File f = parse(bytes);
  EXPECT_EQ(f.get_string(tokenizer_keys::model), "gpt2");
  EXPECT_EQ(f.get_string(tokenizer_keys::pre), "qwen2");
  EXPECT_EQ(f.get_u64(tokenizer_keys::eos_id), 151645u);
  const TokenizerData r = read_tokenizer_data(f);
  ASSERT_EQ(r.tokens.size(), 151936u);
  EXPECT_TRUE(std::equal(d.tokens.begin(), d.tokens.end(), r.tokens.begin()));
  EXPECT_TRUE(std::equal(d.types.begin(), d.types.end(), r.types.begin()));
  EXPECT_EQ(r.types[151900], int32_t(TokenType::unused));
  EXPECT_EQ(r.merges, d.merges);
  EXPECT_EQ(r.bos, d.bos);
  EXPECT_EQ(r.eot, d.eot);
  EXPECT_EQ(r.pad, d.pad);
  EXPECT_EQ(r.add_bos, d.add_bos);
  EXPECT_EQ(r.chat_template, d.chat_template);
  // A tokenizer built from the GGUF tokenizes like the reference one.
  const Tokenizer t = Tokenizer::from_gguf(f);
  EXPECT_EQ(t.encode("Hello, world! 你好 12345 <|im_end|>", true),
            kvq::test::qwen3().encode("Hello, world! 你好 12345 <|im_end|>", true));
}

TEST(TokenizerGguf, MissingOrUnsupportedKeysNameTheKey) {
  auto expect_error = [](const gguf::Writer& w, const std::string& needle) {
    const auto bytes = w.to_bytes();
    const gguf::File f = parse(bytes);
    try {
      (void)Tokenizer::from_gguf(f);
      FAIL() << "expected an error naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  gguf::Writer empty;
  expect_error(empty, "tokenizer.ggml.model");
  gguf::Writer spm;
  spm.set(tokenizer_keys::model, gguf::Value::string("llama"));
  expect_error(spm, "tokenizer.ggml.model");
  gguf::Writer no_pre;
  no_pre.set(tokenizer_keys::model, gguf::Value::string("gpt2"));
  expect_error(no_pre, "tokenizer.ggml.pre");
  gguf::Writer bad_pre;
  bad_pre.set(tokenizer_keys::model, gguf::Value::string("gpt2"));
  bad_pre.set(tokenizer_keys::pre, gguf::Value::string("deepseek-llm"));
  bad_pre.set(tokenizer_keys::tokens, gguf::Value::string_array({"a"}));
  bad_pre.set(tokenizer_keys::merges, gguf::Value::string_array({}));
  expect_error(bad_pre, "deepseek-llm");
}
