// `kvq tokenize` / `kvq detokenize` end to end through the binary.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <string>

#include "tokenizer_test_util.hpp"

namespace {

struct Result {
  int status;
  std::string out;
};

Result run(const std::string& args) {
  const std::string cmd = std::string(KVQ_BIN) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, ""};
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

const std::string kTok = "--tokenizer-json " + kvq::test::qwen3_json();

}  // namespace

TEST(TokenizerCli, TokenizeAndDetokenize) {
  const Result ids = run("tokenize " + kTok + " --ids 'Hello, world'");
  EXPECT_EQ(ids.status, 0) << ids.out;
  EXPECT_EQ(ids.out, "9707 11 1879\n");
  const Result text = run("detokenize " + kTok + " -n 9707,11,1879");
  EXPECT_EQ(text.status, 0) << text.out;
  EXPECT_EQ(text.out, "Hello, world");
  const Result json = run("tokenize " + kTok + " --json --special '<|im_end|>a'");
  EXPECT_EQ(json.out, "{\"ids\":[151645,64],\"n_tokens\":2,\"pieces\":[\"<|im_end|>\",\"a\"]}\n");
  const Result pieces = run("tokenize " + kTok + " 'a\tb'");
  EXPECT_NE(pieces.out.find("'\\tb'"), std::string::npos) << pieces.out;  // control bytes escaped
}

TEST(TokenizerCli, ChatPromptAndErrors) {
  const Result chat = run("tokenize " + kTok + " --ids --chat --no-think Hi");
  EXPECT_EQ(chat.out, "151644 872 198 13048 151645 198 151644 77091 198 151667 271 151668 271\n");
  const Result both = run("tokenize -m x.gguf " + kTok + " Hi");
  EXPECT_EQ(both.status, 2);
  EXPECT_NE(both.out.find("not both"), std::string::npos) << both.out;
  const Result bad = run("detokenize " + kTok + " 99999999");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("outside the vocabulary"), std::string::npos) << bad.out;
}
