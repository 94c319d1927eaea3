// kvq run: generate from a prompt, streaming text to stdout and speed to stderr.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/command.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "core/npy.hpp"

namespace kvq::cli {
namespace {

struct RunArgs {
  ModelOptions model;
  SamplingOptions sampling;
  ChatOptions chat_opts;
  std::string prompt;
  std::string prompt_file;
  bool chat = false;
  std::string dump_logits;
};

std::string read_text_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(Errc::io, "cannot read prompt file '", path, "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// FILE.npy -> FILE.tokens.npy (anything else: FILE.tokens.npy appended).
std::string tokens_path(const std::string& logits_path) {
  const std::string ext = ".npy";
  if (logits_path.size() > ext.size() && logits_path.compare(logits_path.size() - ext.size(), ext.size(), ext) == 0)
    return logits_path.substr(0, logits_path.size() - ext.size()) + ".tokens.npy";
  return logits_path + ".tokens.npy";
}

int run(RunArgs& a) {
  KVQ_CHECK(a.prompt.empty() || a.prompt_file.empty(), Errc::invalid_argument, "give the prompt with -p or -f, not both");
  const std::string text = a.prompt_file.empty() ? a.prompt : read_text_file(a.prompt_file);
  KVQ_CHECK(!text.empty(), Errc::invalid_argument, "no prompt: pass -p TEXT or -f FILE");

  Loaded l = load(a.model);
  const Tokenizer& tok = *l.tokenizer;
  std::vector<TokenId> ids;
  if (a.chat) {
    std::vector<ChatMessage> msgs;
    if (!a.chat_opts.system.empty()) msgs.push_back({"system", a.chat_opts.system});
    msgs.push_back({"user", text});
    ids = encode_chat(tok, a.chat_opts, msgs);
  } else {
    ids = encode_prompt(tok, text);
  }
  const int wanted = int(ids.size()) + std::max(a.sampling.n_predict, 0) + 1;
  const int ctx = resolve_ctx(a.model, l.model->config(), wanted);
  auto session = make_session(a.model, l, ctx);

  std::unique_ptr<npy::RowWriter> dump;
  std::vector<int32_t> dumped_ids;
  if (!a.dump_logits.empty()) {
    dump = std::make_unique<npy::RowWriter>(a.dump_logits, uint64_t(l.model->config().vocab_size));
    session->set_logits_sink([&](TokenId id, const float* logits, int) {
      dump->append(logits);
      dumped_ids.push_back(id);
    });
  }

  GenerateOptions g;
  g.n_predict = a.sampling.n_predict;
  g.stop = a.sampling.stop;
  g.sampling = a.sampling.params;
  const GenerateResult r = session->generate(ids, g, [](const std::string& piece) {
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  });
  std::fputc('\n', stdout);
  std::fflush(stdout);

  if (dump) {
    dump->close();
    npy::write_i32(tokens_path(a.dump_logits), dumped_ids.data(), {dumped_ids.size()});
    std::fprintf(stderr, "kvq: wrote logits [%zu, %d] to %s and token ids to %s\n", dumped_ids.size(),
                 l.model->config().vocab_size, a.dump_logits.c_str(), tokens_path(a.dump_logits).c_str());
  }
  std::fprintf(stderr, "kvq: %s\n", speed_line(r).c_str());
  return 0;
}

KVQ_REGISTER_COMMAND(
    "run", "Generate text from a prompt (streams to stdout; speed to stderr)", [](CLI::App& app) {
      auto a = std::make_shared<RunArgs>();
      add_model_options(app, a->model);
      add_sampling_options(app, a->sampling);
      add_chat_options(app, a->chat_opts);
      app.add_option("-p,--prompt", a->prompt, "Prompt text");
      app.add_option("-f,--file", a->prompt_file, "Read the prompt from a file");
      app.add_flag("--chat", a->chat, "Wrap the prompt in the model's chat template as a user message");
      app.add_option("--dump-logits", a->dump_logits,
                     "Write the logits of every prompt position and generated token to FILE.npy "
                     "(float32 [tokens, vocab]) and their token ids to FILE.tokens.npy (int32 [tokens])");
      return [a] { return run(*a); };
    });

}  // namespace
}  // namespace kvq::cli
