// kvq run: generate from a prompt, streaming text to stdout and speed to stderr.
#include <algorithm>
#include <map>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <unistd.h>

#include "bench/measure.hpp"
#include "cli/command.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/file_io.hpp"
#include "core/npy.hpp"
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
  int repeat = 1;         // --repeat R: measure R runs after a warm-up (bench protocol), report the medians
};

// FILE.npy -> FILE.tokens.npy (anything else: FILE.tokens.npy appended).
std::string tokens_path(const std::string& logits_path) {
  const std::string ext = ".npy";
  if (logits_path.size() > ext.size() && logits_path.compare(logits_path.size() - ext.size(), ext.size(), ext) == 0)
    return logits_path.substr(0, logits_path.size() - ext.size()) + ".tokens.npy";
  return logits_path + ".tokens.npy";
}


// One line per (kernel, phase) with the layers it ran on and its calls per
// layer, then the KV bytes between host and device (kvq run --verbose).
void print_dispatch_proof(const DispatchStats& s, const kv::Cache& cache) {
  if (!s.counted) {
    std::fprintf(stderr, "kvq: dispatch: this backend keeps no attention counters\n");
    return;
  }
  struct Row {
    std::string kernel;
    bool decode;
    std::map<uint64_t, int> layers_by_calls;  // calls per layer -> how many layers
  };
  std::vector<Row> rows;
  for (const auto& k : s.attention) {
    auto it = std::find_if(rows.begin(), rows.end(), [&](const Row& r) { return r.kernel == k.kernel && r.decode == k.decode; });
    if (it == rows.end()) it = rows.insert(rows.end(), Row{k.kernel, k.decode, {}});
    ++it->layers_by_calls[k.calls];
  }
  for (const Row& r : rows)
    for (const auto& [calls, layers] : r.layers_by_calls)
      std::fprintf(stderr, "kvq: dispatch: %s attention %s on %d of %d layers, %llu calls each\n",
                   r.decode ? "decode" : "prefill", r.kernel.c_str(), layers, cache.shape().n_layers,
                   static_cast<unsigned long long>(calls));
  std::fprintf(stderr, "kvq: dispatch: KV bytes host->device %llu, device->host %llu\n",
               static_cast<unsigned long long>(s.kv_host_to_device_bytes),
               static_cast<unsigned long long>(s.kv_device_to_host_bytes));
}

int run(RunArgs& a) {
  KVQ_CHECK(a.prompt.empty() || a.prompt_file.empty(), Errc::invalid_argument, "give the prompt with -p or -f, not both");
  KVQ_CHECK(a.random_prompt == 0 || (a.prompt.empty() && a.prompt_file.empty() && !a.chat), Errc::invalid_argument,
            "--random-prompt replaces -p/-f/--chat; give only one of them");
  KVQ_CHECK(a.repeat >= 1, Errc::invalid_argument, "--repeat must be at least 1");
  KVQ_CHECK(a.random_prompt >= 0, Errc::invalid_argument, "--random-prompt takes a token count (0 or more)");
  KVQ_CHECK(a.repeat == 1 || a.dump_logits.empty(), Errc::invalid_argument, "--repeat and --dump-logits exclude each other");
  // The command's inputs, which its outputs (--dump-logits) must never replace.
  if (a.model.model.rfind("synthetic:", 0) != 0) note_input(resolve_model_path(a.model.model), "model");
  note_input(a.prompt_file, "prompt file");
  const std::string text = a.random_prompt > 0 || a.prompt_file.empty() ? a.prompt : read_file_bounded(a.prompt_file, kMaxTextInputBytes, "prompt file");
  KVQ_CHECK(a.random_prompt > 0 || !text.empty(), Errc::invalid_argument,
            "no prompt: pass -p TEXT, -f FILE or --random-prompt N");

  Loaded l = load(a.model);
  const Tokenizer& tok = *l.tokenizer;
  std::vector<TokenId> ids;
  if (a.random_prompt > 0) {
    // Speed runs at a chosen context: ids drawn uniformly from the vocabulary
    // (seeded by --seed); their text is irrelevant to the cost per token.
    const int vocab = std::min(tok.vocab_size(), l.model->config().vocab_size);
    ids = bench::random_prompt(a.random_prompt, vocab, a.sampling.params.seed);
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
    // The bench measurement (bench/measure.hpp) in its prefill-every-run
    // protocol: one warm-up, then R runs on the same cache emptied each time,
    // each with its own prefill (so each run prints its TTFT), exactly n
    // tokens each (end of generation ignored), text discarded.
    KVQ_CHECK(a.sampling.n_predict >= 2, Errc::invalid_argument,
              "--repeat measures decode speed over tokens 2..n: give -n 2 or more");
    bench::MeasureOptions mo;
    mo.gen = a.sampling.n_predict;
    mo.reps = a.repeat;
    mo.warmup = 1;
    mo.prefill_every_run = true;
    mo.prefill_chunk = a.model.prefill_chunk;
    mo.sampling = a.sampling.params;
    if (::isatty(2))  // logs get only the results below
      mo.on_rep = [&](int rep, int) {
        std::fprintf(stderr, "kvq: %s %d/%d...\n", rep < mo.warmup ? "warm-up" : "run",
                     rep < mo.warmup ? rep + 1 : rep - mo.warmup + 1, rep < mo.warmup ? mo.warmup : mo.reps);
      };
    const bench::CellResult c = bench::measure_cell(*l.model, codec_request(a.model), ids, mo);
    for (size_t i = 0; i < c.rep_results.size(); ++i) {
      const bench::RepResult& r = c.rep_results[i];
      std::fprintf(stderr,
                   "kvq: run %zu/%d: prefill %zu tokens at %.1f tok/s, TTFT %.3f s; decode %.1f tok/s (tokens 2..%d), "
                   "ITL p50 %.3f ms, p99 %.3f ms; digest %s\n",
                   i + 1, a.repeat, ids.size(), r.prefill_tps, r.ttft_s, r.decode_tps, r.n_generated, r.itl_p50_ms,
                   r.itl_p99_ms, r.digest.c_str());
    }
    std::fprintf(stderr,
                 "kvq: median of %d runs: prompt %zu tokens, TTFT %.3f s, decode %.1f tok/s (min %.1f, max %.1f), "
                 "KV %s %.2f MiB (%.3f bits/value)%s\n",
                 a.repeat, ids.size(), c.ttft_s.median, c.decode_tps.median, c.decode_tps.min, c.decode_tps.max,
                 c.codec.c_str(), double(c.kv_bytes) / (1 << 20), c.bits_per_value,
                 c.digests_agree ? "" : "; WARNING: the runs generated different tokens");
    return 0;
  }
  auto session = make_session(a.model, l, ctx);

  std::unique_ptr<npy::RowWriter> dump;
  std::unique_ptr<OutputFile> dump_tokens;  // FILE.tokens.npy: written with FILE.npy as a set
  std::vector<int32_t> dumped_ids;
  if (!a.dump_logits.empty()) {
    dump = std::make_unique<npy::RowWriter>(a.dump_logits, uint64_t(l.model->config().vocab_size));
    dump_tokens = std::make_unique<OutputFile>(tokens_path(a.dump_logits));
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
  // --verbose: the dispatch proof (which attention kernel ran on each layer,
  // how often, and the KV bytes that crossed between host and device).
  const bool proof = log_level() <= LogLevel::info;
  if (proof) l.backend->reset_dispatch_stats(session->cache());
  const GenerateResult r = session->generate(ids, g, [](const std::string& piece) {
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  });
  std::fputc('\n', stdout);
  std::fflush(stdout);

  if (dump) {
    // Both files complete before either is renamed into place: a failure
    // leaves both old files as they were.
    npy::write_i32(*dump_tokens, dumped_ids.data(), {dumped_ids.size()});
    dump->finish();
    dump_tokens->commit();
    dump->commit();
    std::fprintf(stderr, "kvq: wrote logits [%zu, %d] to %s and token ids to %s\n", dumped_ids.size(),
                 l.model->config().vocab_size, a.dump_logits.c_str(), tokens_path(a.dump_logits).c_str());
  }
  std::fprintf(stderr, "kvq: %s\n", speed_line(r).c_str());
  if (proof) print_dispatch_proof(l.backend->dispatch_stats(session->cache()), session->cache());
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
                     "Measure R runs after one warm-up, as `kvq bench --prefill-every-run` does (the same KV cache "
                     "emptied and the prompt prefilled each time, exactly -n tokens, end of generation ignored), printing each run's speed and the "
                     "medians (text is not printed)");
      // Chat-only options without --chat would be ignored: say so instead.
      for (const char* chat_only : {"--system", "--no-think", "--chat-template"})
        app.get_option(chat_only)->needs(app.get_option("--chat"));
      app.get_option("--special")->excludes(app.get_option("--chat"));
      return [a] { return run(*a); };
    });

}  // namespace
}  // namespace kvq::cli
