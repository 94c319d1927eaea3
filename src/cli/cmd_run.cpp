// kvq run: generate from a prompt, streaming text to stdout and speed to stderr.
#include <algorithm>
#include <cstdio>

#include "cli/command.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "core/file_io.hpp"
#include "core/npy.hpp"
#include "core/rng.hpp"
#include "engine/token_healing.hpp"

namespace kvq::cli {
namespace {

struct RunArgs {
  ModelOptions model;
  SamplingOptions sampling;
  ChatOptions chat_opts;
  std::string prompt;
  std::string prompt_file;
  bool chat = false;
  bool no_heal = false;
  bool special = false;   // --special: control tokens written in -p/-f text are recognised
  std::string dump_logits;
  int random_prompt = 0;  // --random-prompt N: N pseudo-random token ids instead of text
  int repeat = 1;         // --repeat R: generate R times on a fresh cache, report the medians
};

// FILE.npy -> FILE.tokens.npy (anything else: FILE.tokens.npy appended).
std::string tokens_path(const std::string& logits_path) {
  const std::string ext = ".npy";
  if (logits_path.size() > ext.size() && logits_path.compare(logits_path.size() - ext.size(), ext.size(), ext) == 0)
    return logits_path.substr(0, logits_path.size() - ext.size()) + ".tokens.npy";
  return logits_path + ".tokens.npy";
}

// Median of a small sample (upper middle for even sizes).
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run(RunArgs& a) {
  KVQ_CHECK(a.prompt.empty() || a.prompt_file.empty(), Errc::invalid_argument, "give the prompt with -p or -f, not both");
  KVQ_CHECK(a.random_prompt == 0 || (a.prompt.empty() && a.prompt_file.empty() && !a.chat), Errc::invalid_argument,
            "--random-prompt replaces -p/-f/--chat; give only one of them");
  KVQ_CHECK(a.repeat >= 1, Errc::invalid_argument, "--repeat must be at least 1");
  KVQ_CHECK(a.random_prompt >= 0, Errc::invalid_argument, "--random-prompt takes a token count (0 or more)");
  KVQ_CHECK(a.repeat == 1 || a.dump_logits.empty(), Errc::invalid_argument, "--repeat and --dump-logits exclude each other");
  const std::string text = a.random_prompt > 0 || a.prompt_file.empty() ? a.prompt : read_file_bounded(a.prompt_file, kMaxTextInputBytes, "prompt file");
  KVQ_CHECK(a.random_prompt > 0 || !text.empty(), Errc::invalid_argument,
            "no prompt: pass -p TEXT, -f FILE or --random-prompt N");

  Loaded l = load(a.model);
  const Tokenizer& tok = *l.tokenizer;
  std::vector<TokenId> ids;
  if (a.random_prompt > 0) {
    // Speed runs at a chosen context: ids drawn uniformly from the vocabulary
    // (seeded by --seed); their text is irrelevant to the cost per token.
    Rng rng(a.sampling.params.seed ^ 0x9e3779b97f4a7c15ull);
    const int vocab = std::min(tok.vocab_size(), l.model->config().vocab_size);
    for (int i = 0; i < a.random_prompt; ++i) ids.push_back(TokenId(rng.next_u64() % uint64_t(vocab)));
  } else if (a.chat) {
    std::vector<ChatMessage> msgs;
    if (!a.chat_opts.system.empty()) msgs.push_back({"system", a.chat_opts.system});
    msgs.push_back({"user", text});
    ids = encode_chat(tok, a.chat_opts, msgs);
  } else {
    ids = encode_prompt(tok, text, a.special);
  }
  // Raw prompts end wherever the user stopped typing, often inside what would
  // be one token ("def " ends in a lone space token); heal that boundary.
  TokenHealing healing;
  if (!a.chat && !a.no_heal && a.random_prompt == 0) healing = heal_prompt_end(tok, ids);
  const int wanted = int(ids.size()) + std::max(a.sampling.n_predict, 0) + 1;
  const int ctx = resolve_ctx(a.model, l.model->config(), wanted);
  if (a.repeat > 1) {
    // Each run on a fresh cache (nothing reused from the previous run), text discarded.
    std::vector<double> prefill_s, decode_tps;
    for (int rep = 0; rep < a.repeat; ++rep) {
      auto session = make_session(a.model, l, ctx);
      GenerateOptions g;
      g.n_predict = a.sampling.n_predict;
      g.stop = a.sampling.stop;
      g.sampling = a.sampling.params;
      g.healing = healing;
      if (a.chat) g.stop_tokens = chat_stop_tokens(tok, a.chat_opts);
      const GenerateResult r = session->generate(ids, g, {});
      std::fprintf(stderr, "kvq: run %d/%d: %s\n", rep + 1, a.repeat, speed_line(r).c_str());
      prefill_s.push_back(r.prefill_s);
      decode_tps.push_back(r.decode_tps());
    }
    std::fprintf(stderr, "kvq: median of %d runs: prompt %zu tokens, TTFT %.3f s, decode %.1f tok/s\n", a.repeat,
                 ids.size(), median(prefill_s), median(decode_tps));
    return 0;
  }
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
  g.healing = healing;
  if (a.chat) g.stop_tokens = chat_stop_tokens(tok, a.chat_opts);
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
      app.add_flag("--special", a->special,
                   "Raw prompts only: recognise control tokens written in the text (<|im_start|>, ...); "
                   "by default the prompt is plain text");
      app.add_flag("--no-heal", a->no_heal,
                   "Keep the prompt's last token as typed (default: token healing lets the first generated "
                   "token re-choose it, e.g. a trailing space becomes part of the next word)");
      app.add_option("--dump-logits", a->dump_logits,
                     "Write the logits of every prompt position and generated token to FILE.npy "
                     "(float32 [tokens, vocab]) and their token ids to FILE.tokens.npy (int32 [tokens])");
      app.add_option("--random-prompt", a->random_prompt,
                     "Use N pseudo-random token ids (seeded by --seed) as the prompt: speed runs at an exact context");
      app.add_option("--repeat", a->repeat,
                     "Generate R times, each on a fresh KV cache, printing each run's speed and the medians "
                     "(text is not printed)");
      // Chat-only options without --chat would be ignored: say so instead.
      for (const char* chat_only : {"--system", "--no-think", "--chat-template"})
        app.get_option(chat_only)->needs(app.get_option("--chat"));
      app.get_option("--special")->excludes(app.get_option("--chat"));
      return [a] { return run(*a); };
    });

}  // namespace
}  // namespace kvq::cli
