// Running the `kvq` binary from tests, as a user runs it.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

#include "model/synth.hpp"

namespace kvq::test {

struct CliOut {
  int rc;
  std::string out, err;
};

// Runs `kvq ARGS` through bash (so ARGS may use shell quoting and a prefix
// such as `ulimit -f 8;` via `shell_prefix`), with `input` on stdin; captures
// stdout, stderr and the exit status (-1 when killed by a signal).
inline CliOut kvq_cli(const std::string& args, const std::string& input = "", const std::string& shell_prefix = "") {
  namespace fs = std::filesystem;
  static int n = 0;
  const std::string tag = std::to_string(::getpid()) + "_" + std::to_string(n++);
  const fs::path errf = fs::temp_directory_path() / ("kvq_cli_err_" + tag);
  const fs::path inf = fs::temp_directory_path() / ("kvq_cli_in_" + tag);
  const fs::path script = fs::temp_directory_path() / ("kvq_cli_sh_" + tag);
  {
    FILE* f = fopen(inf.c_str(), "w");
    fwrite(input.data(), 1, input.size(), f);
    fclose(f);
    FILE* s = fopen(script.c_str(), "w");
    const std::string body = shell_prefix + "\nexec " + std::string(KVQ_BIN) + " " + args + "\n";
    fwrite(body.data(), 1, body.size(), s);
    fclose(s);
  }
  const std::string cmd = "bash " + script.string() + " <" + inf.string() + " 2>" + errf.string();
  CliOut o{};
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
  fs::remove(inf);
  fs::remove(script);
  return o;
}

// A synthetic model of `shape` (seed 3), written once per test process.
inline const std::string& synth_model_path(const std::string& shape) {
  namespace fs = std::filesystem;
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

}  // namespace kvq::test
