// kvq: one binary over libkvq. The only place that exits.
#include <cstdio>
#include <exception>
#include <memory>
#include <new>
#include <typeinfo>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/text.hpp"

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
  app.footer("Run `kvq COMMAND --help` for a command's options.");
  app.set_version_flag("--version", std::string("kvq ") + KVQ_VERSION);
  int verbose = 0;
  app.add_flag("-v,--verbose", verbose, "More log output (repeat for debug)");

  std::function<int()> action;
  for (auto& cmd : cli::registry()) {
    CLI::App* sub = app.add_subcommand(cmd.name, cmd.help);
    auto act = std::make_shared<std::function<int()>>(cmd.setup(*sub));
    sub->callback([act, &action] { action = *act; });
  }
  // CLI11 reports a misspelt command as "A subcommand is required": name it,
  // and the commands there are, instead. Top-level options take no values, so
  // the first argument that is not an option is the command.
  std::string commands;
  for (const auto& cmd : cli::registry()) commands += (commands.empty() ? "" : ", ") + cmd.name;
  bool have_command = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help" || a == "--version") have_command = true;  // CLI11 answers these
    if (a.empty() || a[0] != '-') {
      have_command = true;
      bool known = false;
      for (const auto& cmd : cli::registry()) known = known || cmd.name == a;
      if (!known) {
        std::fprintf(stderr, "kvq: error: unknown command '%s'; the commands are: %s (kvq --help)\n", a.c_str(),
                     commands.c_str());
        return 2;
      }
      break;
    }
    if (a == "--") break;
  }
  if (!have_command) {
    std::fprintf(stderr, "kvq: error: no command given; the commands are: %s (kvq --help)\n", commands.c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    // One line, like every other kvq error, and the usage-error status 2.
    std::fprintf(stderr, "kvq: error: %s (--help lists the options)\n", printable(e.what()).c_str());
    return 2;
  }
  set_log_level(verbose >= 2 ? LogLevel::debug : verbose == 1 ? LogLevel::info : LogLevel::warn);
  try {
    return action ? action() : 0;
  } catch (const Error& e) {
    // Messages quote file contents and arguments: one line, control bytes escaped.
    std::fflush(stdout);
    std::fprintf(stderr, "kvq: error: %s\n", printable(e.what()).c_str());
    return e.code() == Errc::invalid_argument ? 2 : 1;
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr,
                 "kvq: error: out of memory; the input, model or --ctx is too large for this machine "
                 "(try a smaller --ctx or input)\n");
    return 1;
  } catch (const std::exception& e) {
    // A library's own exception text is not a kvq message; say what it was
    // and what to do, on one line.
    std::fflush(stdout);
    std::fprintf(stderr, "kvq: error: unexpected failure: %s; this is a bug in kvq, please report it\n",
                 printable(e.what()).c_str());
    return 1;
  }
}
