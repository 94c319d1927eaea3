// kvq chat: an interactive conversation on stdin with the model's chat
// template. The KV cache persists across turns: each turn renders the whole
// conversation and prefills only what differs from the cached tokens.
#include <unistd.h>

#include <cstdio>

#include "cli/command.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "core/file_io.hpp"

namespace kvq::cli {
namespace {

constexpr int kChatTurnTokens = 512;

struct ChatArgs {
  ModelOptions model;
  SamplingOptions sampling;
  ChatOptions chat_opts;
  bool verbose_speed = false;
};

int chat(ChatArgs& a) {
  Loaded l = load(a.model);
  const int ctx = resolve_ctx(a.model, l.model->config(), 4096);
  auto session = make_session(a.model, l, ctx);
  const bool tty = ::isatty(0);
  std::vector<ChatMessage> history;
  if (!a.chat_opts.system.empty()) history.push_back({"system", a.chat_opts.system});
  if (tty) std::fprintf(stderr, "kvq chat: context %d tokens. /reset clears the conversation, /exit or Ctrl-D quits.\n", ctx);

  GenerateOptions g;
  g.n_predict = a.sampling.n_predict;
  g.stop = a.sampling.stop;
  g.sampling = a.sampling.params;
  g.stop_tokens = chat_stop_tokens(*l.tokenizer, a.chat_opts);
  std::string line;
  while (true) {
    if (tty) {
      std::fprintf(stderr, "> ");
      std::fflush(stderr);
    }
    if (!read_line_bounded(stdin, line, kMaxTextInputBytes, "a chat message")) break;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      history.resize(a.chat_opts.system.empty() ? 0 : 1);
      session->truncate(0);
      continue;
    }
    if (line.empty()) continue;
    history.push_back({"user", line});
    const std::vector<TokenId> ids = encode_chat(*l.tokenizer, a.chat_opts, history);
    if (int(ids.size()) >= ctx) {
      std::fprintf(stderr, "kvq: the conversation (%zu tokens) no longer fits the context of %d; /reset or raise --ctx\n",
                   ids.size(), ctx);
      history.pop_back();
      continue;
    }
    const GenerateResult r = session->generate(ids, g, [](const std::string& piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    });
    std::fputc('\n', stdout);
    std::fflush(stdout);
    history.push_back({"assistant", r.text});
    if (r.stop_reason == StopReason::max_tokens && g.n_predict > 0)
      std::fprintf(stderr, "kvq: (reply cut at %d tokens; -n N sets the limit per turn, -n -1 removes it)\n",
                   g.n_predict);
    if (a.verbose_speed) std::fprintf(stderr, "kvq: %s\n", speed_line(r).c_str());
  }
  return 0;
}

KVQ_REGISTER_COMMAND("chat", "Interactive chat on stdin using the model's chat template", [](CLI::App& app) {
  auto a = std::make_shared<ChatArgs>();
  // A turn ends at the model's end-of-turn token; the cap keeps a model that
  // never says it (the embedded code model rarely does) from filling the
  // whole context in one turn. -n -1 lifts it.
  a->sampling.n_predict = kChatTurnTokens;
  add_model_options(app, a->model);
  add_sampling_options(app, a->sampling);
  add_chat_options(app, a->chat_opts);
  app.add_flag("--speed", a->verbose_speed, "Print prefill/decode speed after each turn");
  return [a] { return chat(*a); };
});

}  // namespace
}  // namespace kvq::cli
