// `kvq run` end to end, as a user runs it: determinism for a fixed seed,
// --dump-logits files, clear errors.
#include <gtest/gtest.h>

#include <array>
#include <cctype>
#include <map>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli_test_util.hpp"
#include "core/npy.hpp"
#include "model/synth.hpp"

using namespace kvq;
namespace fs = std::filesystem;

namespace {

using Out = kvq::test::CliOut;

Out sh(const std::string& args, const std::string& input = "") { return kvq::test::kvq_cli(args, input); }
const std::string& tiny_path(const std::string& shape) { return kvq::test::synth_model_path(shape); }

}  // namespace

TEST(EngineCli, RunIsDeterministicForAFixedSeed) {
  for (const char* shape : {"tiny", "tiny-llama"}) {
    const std::string args = "run -m " + tiny_path(shape) + " -p 'def main():' -n 24 --temp 0.9 --seed 5 -t 2";
    const Out a = sh(args), b = sh(args);
    ASSERT_EQ(a.rc, 0) << a.err;
    EXPECT_FALSE(a.out.empty());
    EXPECT_EQ(a.out, b.out) << shape;
    EXPECT_NE(a.err.find("prefill"), std::string::npos) << a.err;
    EXPECT_NE(a.err.find("decode"), std::string::npos) << a.err;
    const Out c = sh("run -m " + tiny_path(shape) + " -p 'def main():' -n 24 --temp 0.9 --seed 6 -t 1");
    ASSERT_EQ(c.rc, 0) << c.err;
  }
}

TEST(EngineCli, DumpLogitsWritesRowsForEveryToken) {
  const fs::path dump = fs::temp_directory_path() / ("kvq_cli_dump_" + std::to_string(::getpid()) + ".npy");
  const Out o = sh("run -m " + tiny_path("tiny") + " -p 'hello there' -n 6 --temp 0 --dump-logits " + dump.string());
  ASSERT_EQ(o.rc, 0) << o.err;
  const fs::path toks = fs::path(dump).replace_extension("").string() + ".tokens.npy";
  const npy::Array l = npy::read(dump.string());
  const npy::Array t = npy::read(toks.string());
  ASSERT_EQ(l.shape.size(), 2u);
  ASSERT_EQ(t.shape.size(), 1u);
  EXPECT_EQ(l.shape[0], t.shape[0]);
  EXPECT_GE(t.shape[0], 7u);  // at least BOS-less prompt of 1+ token plus 6 generated
  // Greedy: every generated token is the argmax of the previous row.
  const uint64_t V = l.shape[1];
  const uint64_t n = t.shape[0];
  for (uint64_t i = n - 6; i < n; ++i) {
    const float* row = l.f32.data() + (i - 1) * V;
    EXPECT_EQ(int32_t(std::max_element(row, row + V) - row), t.i32[i]) << i;
  }
  fs::remove(dump);
  fs::remove(toks);
}

TEST(EngineCli, ClearErrors) {
  Out o = sh("run -m /nonexistent/model.gguf -p hi");
  EXPECT_NE(o.rc, 0);
  EXPECT_NE(o.err.find("does not exist"), std::string::npos) << o.err;
  o = sh("run -m " + tiny_path("tiny") + " -p hi --device cuda");
  EXPECT_NE(o.rc, 0);
  EXPECT_NE(o.err.find("CUDA backend is not available"), std::string::npos) << o.err;
  o = sh("run -m " + tiny_path("tiny") + " -p 'a b c d e f g h i j k l m n o p' --ctx 4");
  EXPECT_NE(o.rc, 0);
  EXPECT_NE(o.err.find("--ctx"), std::string::npos) << o.err;
  o = sh("run -m " + tiny_path("tiny") + " -p hi --kv nonsense-codec");
  EXPECT_NE(o.rc, 0);
  EXPECT_NE(o.err.find("nonsense-codec"), std::string::npos) << o.err;
}

TEST(EngineCli, PromptFileStopStringAndChatLoop) {
  const fs::path pf = fs::temp_directory_path() / ("kvq_cli_prompt_" + std::to_string(::getpid()) + ".txt");
  { FILE* f = fopen(pf.c_str(), "w"); fputs("def main():", f); fclose(f); }
  const Out a = sh("run -m " + tiny_path("tiny") + " -f " + pf.string() + " -n 16 --temp 0");
  const Out b = sh("run -m " + tiny_path("tiny") + " -p 'def main():' -n 16 --temp 0");
  ASSERT_EQ(a.rc, 0) << a.err;
  EXPECT_EQ(a.out, b.out) << "-f and -p with the same text must generate the same";
  fs::remove(pf);
  // Stop at a piece of the greedy output: the output ends right before it.
  ASSERT_GE(b.out.size(), 5u);
  // (a window of plain ASCII letters, so the shell quoting below is trivial)
  std::string stop;
  for (size_t p = 1; p + 2 <= b.out.size() && stop.empty(); ++p)
    if (std::isalpha(uint8_t(b.out[p])) && std::isalpha(uint8_t(b.out[p + 1]))) stop = b.out.substr(p, 2);
  ASSERT_FALSE(stop.empty()) << "no two-letter window in the greedy output: " << b.out;
  const Out c = sh("run -m " + tiny_path("tiny") + " -p 'def main():' -n 16 --temp 0 --stop '" + stop + "'");
  ASSERT_EQ(c.rc, 0) << c.err;
  EXPECT_EQ(c.out, b.out.substr(0, b.out.find(stop)) + "\n");
  EXPECT_NE(c.err.find("stop: stop string"), std::string::npos) << c.err;
  // Two chat turns and a reset on stdin; each turn prints one reply line ending.
  const Out d = sh("chat -m " + tiny_path("tiny") + " --chat-template chatml -n 4 --temp 0 --speed", "hello\n/reset\nagain\n");
  EXPECT_EQ(d.rc, 0) << d.err;
  size_t turns = 0;
  for (size_t p = d.err.find("prefill"); p != std::string::npos; p = d.err.find("prefill", p + 1)) ++turns;
  EXPECT_EQ(turns, 2u) << d.err;
}

namespace {

// The speed-run flags: an exact-length random prompt, repeated runs on fresh
// caches with medians, and the combinations they refuse.
TEST(EngineCli, RandomPromptAndRepeat) {
  const std::string m = "run -m " + tiny_path("tiny") + " -n 4 --temp 0 -t 1";
  const Out o = sh(m + " --random-prompt 37 --repeat 3");
  ASSERT_EQ(o.rc, 0) << o.err;
  EXPECT_EQ(o.out, "") << "--repeat prints speed, not text";
  for (const char* run : {"run 1/3: prefill 37 tokens", "run 2/3: prefill 37 tokens", "run 3/3: prefill 37 tokens"})
    EXPECT_NE(o.err.find(run), std::string::npos) << "missing '" << run << "' in: " << o.err;
  EXPECT_NE(o.err.find("median of 3 runs: prompt 37 tokens"), std::string::npos) << o.err;
  // The same seed draws the same prompt, hence (greedy) the same text.
  const Out a = sh(m + " --random-prompt 21 --seed 4"), b = sh(m + " --random-prompt 21 --seed 4");
  ASSERT_EQ(a.rc, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_NE(a.err.find("prefill 21 tokens"), std::string::npos) << a.err;
  // Refusals: a clear one-line usage error (exit 2).
  for (const std::string bad : {" --random-prompt 5 -p hi", " -p hi --repeat 0", " -p hi --random-prompt -3",
                                " -p hi --repeat 2 --dump-logits /tmp/x.npy"}) {
    const Out e = sh(m + bad);
    EXPECT_EQ(e.rc, 2) << bad << ": " << e.err;
    EXPECT_NE(e.err.find("kvq: error"), std::string::npos) << bad << ": " << e.err;
  }
}

}  // namespace
