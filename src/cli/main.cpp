// kvq: one binary over libkvq. The only place that exits.
#include <cstdio>
#include <exception>
#include <memory>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace kvq::cli {
std::vector<Command>& registry() {
  static std::vector<Command> commands;
  return commands;
}
}  // namespace kvq::cli

int main(int argc, char** argv) {
  using namespace kvq;
  CLI::App app{"kvq: long-context LLM inference with compressed KV caches"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("kvq ") + KVQ_VERSION);
  int verbose = 0;
  app.add_flag("-v,--verbose", verbose, "More log output (repeat for debug)");

  std::function<int()> action;
  for (auto& cmd : cli::registry()) {
    CLI::App* sub = app.add_subcommand(cmd.name, cmd.help);
    auto act = std::make_shared<std::function<int()>>(cmd.setup(*sub));
    sub->callback([act, &action] { action = *act; });
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  set_log_level(verbose >= 2 ? LogLevel::debug : verbose == 1 ? LogLevel::info : LogLevel::warn);
  try {
    return action ? action() : 0;
  } catch (const Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return e.code() == Errc::invalid_argument ? 2 : 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 1;
  }
}
