// `kvq run` end to end, as a user runs it: determinism for a fixed seed,
// --dump-logits files, clear errors.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "core/npy.hpp"
#include "model/synth.hpp"

using namespace kvq;
namespace fs = std::filesystem;

namespace {

struct Out {
  int rc;
  std::string out, err;
};

Out sh(const std::string& args) {
  static int n = 0;
  const fs::path errf = fs::temp_directory_path() / ("kvq_cli_err_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
  const std::string cmd = std::string(KVQ_BIN) + " " + args + " 2>" + errf.string();
  Out o{};
  FILE* p = popen(cmd.c_str(), "r");
  std::array<char, 4096> buf;
  size_t k;
  while ((k = fread(buf.data(), 1, buf.size(), p)) > 0) o.out.append(buf.data(), k);
  const int st = pclose(p);
  o.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  FILE* e = fopen(errf.c_str(), "r");
  while (e && (k = fread(buf.data(), 1, buf.size(), e)) > 0) o.err.append(buf.data(), k);
  if (e) fclose(e);
  fs::remove(errf);
  return o;
}

const std::string& tiny_path(const std::string& shape) {
  static std::map<std::string, std::string> paths;
  auto& p = paths[shape];
  if (p.empty()) {
    p = (fs::temp_directory_path() / ("kvq_cli_" + shape + "_" + std::to_string(::getpid()) + ".gguf")).string();
    SynthOptions so;
    so.shape = shape;
    so.seed = 3;
    write_synthetic(so, p);
  }
  return p;
}

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
