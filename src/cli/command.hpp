// Subcommand registry for the `kvq` binary. Each cmd_<name>.cpp defines its
// options and handler and registers itself with KVQ_REGISTER_COMMAND, so adding
// a command touches no shared file. Handlers throw kvq::Error; main() maps it
// to a one-line message and a non-zero exit status.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace kvq::cli {

struct Command {
  std::string name;
  std::string help;
  // Adds options to `sub` and returns the action to run after parsing.
  std::function<std::function<int()>(CLI::App& sub)> setup;
};

std::vector<Command>& registry();

struct Registrar {
  explicit Registrar(Command c) { registry().push_back(std::move(c)); }
};

}  // namespace kvq::cli

#define KVQ_CAT2(a, b) a##b
#define KVQ_CAT(a, b) KVQ_CAT2(a, b)
#define KVQ_REGISTER_COMMAND(...) \
  static ::kvq::cli::Registrar KVQ_CAT(kvq_cmd_registrar_, __LINE__)(::kvq::cli::Command{__VA_ARGS__})
