// `kvq tokenize` / `kvq detokenize` end to end through the binary.
#include <gtest/gtest.h>

#include <string>

#include "cli_test_util.hpp"
#include "tokenizer_test_util.hpp"

namespace {

using kvq::test::kvq_cli;

const std::string kTok = "--tokenizer-json " + kvq::test::qwen3_json();

}  // namespace

TEST(TokenizerCli, TokenizeAndDetokenize) {
  const auto ids = kvq_cli("tokenize " + kTok + " --ids 'Hello, world'");
  EXPECT_EQ(ids.rc, 0) << ids.err;
  EXPECT_EQ(ids.out, "9707 11 1879\n");
  const auto text = kvq_cli("detokenize " + kTok + " -n 9707,11,1879");
  EXPECT_EQ(text.rc, 0) << text.err;
  EXPECT_EQ(text.out, "Hello, world");
  const auto json = kvq_cli("tokenize " + kTok + " --json --special '<|im_end|>a'");
  EXPECT_EQ(json.out, "{\"ids\":[151645,64],\"n_tokens\":2,\"pieces\":[\"<|im_end|>\",\"a\"]}\n");
  const auto pieces = kvq_cli("tokenize " + kTok + " 'a\tb'");
  EXPECT_NE(pieces.out.find("'\\tb'"), std::string::npos) << pieces.out;  // control bytes escaped
}

TEST(TokenizerCli, ChatPromptAndErrors) {
  const auto chat = kvq_cli("tokenize " + kTok + " --ids --chat --no-think Hi");
  EXPECT_EQ(chat.out, "151644 872 198 13048 151645 198 151644 77091 198 151667 271 151668 271\n");
  const auto both = kvq_cli("tokenize -m x.gguf " + kTok + " Hi");
  EXPECT_EQ(both.rc, 2);
  EXPECT_NE(both.err.find("not both"), std::string::npos) << both.err;
  const auto bad = kvq_cli("detokenize " + kTok + " 99999999");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.err.find("outside the vocabulary"), std::string::npos) << bad.err;
}
