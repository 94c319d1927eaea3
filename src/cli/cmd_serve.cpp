// kvq serve: an OpenAI-compatible HTTP server over one model (src/server/).
// Prints "kvq serve: listening on http://HOST:PORT" on stderr once it accepts
// requests. SIGINT/SIGTERM stop it gracefully: no new connections, /health
// 503, running requests finish within --drain-timeout and are then cancelled.
// A second signal exits at once.
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "bench/sweep.hpp"  // parse_byte_size
#include "cli/command.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "kv/codec_table.hpp"
#include "kv/page.hpp"
#include "server/server.hpp"

namespace kvq::cli {
namespace {

struct ServeArgs {
  ModelOptions model;
  SamplingOptions sampling;
  ChatOptions chat_opts;
  server::ServerOptions server;
  std::string model_name;
  double max_body_mib = 8;
  int max_queue = 32;
  int max_seqs = 8;
  bool prefix_cache = true;
  int kv_pages = 0;       // 0: see --kv-budget, else max_seqs sequences of --ctx
  std::string kv_budget;  // bytes of KV for the pool
};

int serve(ServeArgs& a) {
  KVQ_CHECK(a.max_queue >= 0, Errc::invalid_argument, "--max-queue must be >= 0");
  KVQ_CHECK(a.max_seqs >= 1, Errc::invalid_argument, "--max-seqs must be >= 1");
  KVQ_CHECK(a.kv_pages >= 0, Errc::invalid_argument, "--kv-pages must be >= 0");
  KVQ_CHECK(a.kv_pages == 0 || a.kv_budget.empty(), Errc::invalid_argument,
            "give --kv-pages or --kv-budget, not both");
  const uint64_t kv_budget = a.kv_budget.empty() ? 0 : bench::parse_byte_size(a.kv_budget);
  KVQ_CHECK(a.max_body_mib > 0, Errc::invalid_argument, "--max-body must be positive");
  a.sampling.params.validate();
  const CodecRequest pool_codec = codec_request(a.model);  // fails at start, not on the first request

  // Connections cost a descriptor each: allow as many as the hard limit does.
  {
    rlimit r{};
    if (getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
      r.rlim_cur = r.rlim_max;
      setrlimit(RLIMIT_NOFILE, &r);
    }
  }
  // SIGINT/SIGTERM are taken by a waiting thread (blocked here before any
  // other thread exists, so every thread inherits the mask).
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);  // a client that hangs up is a failed write, not a dead server

  Loaded l = load(a.model);
  Model& model = *l.model;
  const int ctx = resolve_ctx(a.model, model.config(), 4096);
  const int vocab = std::min(l.tokenizer->vocab_size(), model.config().vocab_size);

  // One page pool for every request, in the server's codec (--kv, --ctk,
  // --ctv, --rotor-qjl, --f32-kv): --kv-pages pages, or as many as
  // --kv-budget bytes hold, or by default --max-seqs sequences of --ctx.
  // With --kv-window each of --max-seqs sequences also has its window's
  // bf16 pages, which the budget pays for first.
  const int page = kv::kDefaultPageTokens;
  int pages = a.kv_pages;
  if (kv_budget > 0) {
    const uint64_t page_bytes = measured_page_bytes(model, pool_codec, page);
    const uint64_t window_bytes = pool_codec.f32 ? 0
                                                 : uint64_t(a.max_seqs) * uint64_t(pool_codec.window_pages) *
                                                       kv::exact_page_bytes(pool_shape(model, 1, page));
    KVQ_CHECK(kv_budget > window_bytes, Errc::invalid_argument, "--kv-budget ", a.kv_budget, " does not hold the ",
              a.max_seqs, " exact windows of ", pool_codec.window_pages, " page(s) (", window_bytes >> 20,
              " MiB; --kv-window ", pool_codec.window_auto ? "auto, the default" : "as given",
              "; --kv-window 0: none)");
    pages = int(std::min<uint64_t>((kv_budget - window_bytes) / page_bytes, uint64_t(1) << 24));
    KVQ_CHECK(pages >= 1, Errc::invalid_argument, "--kv-budget ", a.kv_budget, " is less than one page of ", page,
              " tokens (", page_bytes, " bytes in this codec)");
  } else if (pages == 0) {
    pages = a.max_seqs * kv::pages_for(ctx, page);
  }
  KVQ_CHECK(int64_t(pages) * page >= ctx, Errc::invalid_argument, "the KV pool of ", pages, " pages holds ",
            int64_t(pages) * page, " tokens, fewer than one request's context of ", ctx,
            " (--ctx); raise --kv-pages / --kv-budget or lower --ctx");
  KVQ_CHECK(int64_t(pages) * page <= INT32_MAX, Errc::invalid_argument, "the KV pool of ", pages,
            " pages is more tokens than kvq can address; lower --kv-pages / --kv-budget");
  server::EngineSetup setup;
  setup.model = &model;
  setup.store = make_paged_pool(model, pool_codec, pages, page, a.max_seqs);
  setup.scheduler.max_running = a.max_seqs;
  setup.scheduler.max_step_tokens =
      a.model.prefill_chunk > 0 ? a.model.prefill_chunk : model.backend().default_prefill_chunk();
  KVQ_CHECK(a.max_seqs <= setup.scheduler.max_step_tokens, Errc::invalid_argument, "--max-seqs ", a.max_seqs,
            " is more than the ", setup.scheduler.max_step_tokens,
            " tokens of a step (--prefill-chunk): every running sequence decodes one token per step");
  setup.scheduler.max_seq_tokens = ctx;
  setup.scheduler.prefix_cache = a.prefix_cache;
  const int threads = a.model.threads;
  setup.thread_init = [threads] {
    if (threads > 0) omp_set_num_threads(threads);  // load() set it for this thread only
  };
  setup.max_waiting = a.max_queue;
  const uint64_t pool_bytes = setup.store->capacity_bytes();
  const int step_tokens = setup.scheduler.max_step_tokens;
  server::Engine engine(*l.tokenizer, vocab, std::move(setup));

  server::ServerOptions& so = a.server;
  so.ctx = ctx;
  so.max_body = size_t(a.max_body_mib * 1024 * 1024);
  so.model_id = !a.model_name.empty() ? a.model_name
                                      : std::filesystem::path(resolve_model_path(a.model.model)).stem().string();
  so.default_codec = engine.codec();  // the pool's, the one codec requests may name
  so.chat_template = resolve_chat_template(a.chat_opts.chat_template, l.tokenizer->chat_template());
  so.defaults.sampling = a.sampling.params;
  so.defaults.max_tokens = a.sampling.n_predict > 0 ? a.sampling.n_predict : -1;
  so.defaults.stop = a.sampling.stop;
  so.defaults.system = a.chat_opts.system;
  so.defaults.enable_thinking = !a.chat_opts.no_think;
  server::Server srv(engine, so);
  const int port = srv.bind();

  std::fprintf(stderr, "kvq serve: model '%s', context %d tokens, kv %s, chat template %s, max queue %d\n",
               so.model_id.c_str(), ctx, so.default_codec.c_str(), chat_template_name(so.chat_template), a.max_queue);
  std::fprintf(stderr,
               "kvq serve: KV pool %d pages of %d tokens (%lld tokens, %.1f MiB), up to %d sequences per step, "
               "%d tokens per step, prefix cache %s\n",
               pages, page, (long long)pages * page, double(pool_bytes) / (1 << 20), a.max_seqs,
               step_tokens, a.prefix_cache ? "on" : "off");
  if (!so.api_key.empty()) std::fprintf(stderr, "kvq serve: /v1/* require the API key (Authorization: Bearer ...)\n");
  std::fputs(server::startup_warnings(so).c_str(), stderr);
  std::fprintf(stderr, "kvq serve: listening on http://%s:%d\n", so.host.c_str(), port);
  std::fflush(stderr);

  // The server runs on its own threads; this one waits for the signals.
  int sig = 0;
  sigwait(&stop_signals, &sig);
  std::fprintf(stderr, "kvq serve: stopping (signal %d): draining for up to %g s; a second signal exits now\n", sig,
               so.drain_timeout_s);
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    srv.stop();
    stopped = true;
  });
  const timespec tick{0, 100 * 1000 * 1000};
  while (!stopped) {
    siginfo_t info;
    if (sigtimedwait(&stop_signals, &info, &tick) > 0) {
      std::fprintf(stderr, "kvq serve: second signal (%d): exiting now\n", info.si_signo);
      std::fflush(stderr);
      std::_Exit(128 + info.si_signo);
    }
  }
  stopper.join();
  std::fprintf(stderr, "kvq serve: stopped\n");
  return 0;
}

KVQ_REGISTER_COMMAND("serve", "OpenAI-compatible HTTP server (chat/completions, completions, streaming)",
                     [](CLI::App& app) {
                       auto a = std::make_shared<ServeArgs>();
                       a->sampling.n_predict = -1;  // a request without max_tokens runs to a stop or the context end
                       add_model_options(app, a->model);
                       add_sampling_options(app, a->sampling);
                       add_chat_options(app, a->chat_opts);
                       app.add_option("--host", a->server.host,
                                      "Address to listen on (0.0.0.0: every interface; mind --api-key)")
                           ->capture_default_str();
                       app.add_option("--port", a->server.port, "TCP port (0: any free port, printed at start)")
                           ->capture_default_str()
                           ->check(CLI::Range(0, 65535));
                       app.add_option("--api-key", a->server.api_key,
                                      "Require \"Authorization: Bearer KEY\" on /v1/* (or set $KVQ_API_KEY)")
                           ->envname("KVQ_API_KEY");
                       app.add_option("--max-queue", a->max_queue,
                                      "Sequences (prompts) that may wait beyond the --max-seqs running ones; more "
                                      "get HTTP 429")
                           ->capture_default_str();
                       app.add_option("--max-seqs,--parallel", a->max_seqs,
                                      "Sequences that run (decode) together, one token each per step")
                           ->capture_default_str()
                           ->check(CLI::Range(1, 4096));
                       app.add_flag("--prefix-cache,!--no-prefix-cache", a->prefix_cache,
                                    "Keep full KV pages after their requests end and reuse them for later prompts "
                                    "that start the same way (default on; a request may opt out with "
                                    "\"cache_prompt\": false)");
                       app.add_option("--kv-pages", a->kv_pages,
                                      "Pages of 64 tokens in the KV pool all requests share (default: enough for "
                                      "--max-seqs sequences of --ctx tokens)");
                       app.add_option("--kv-budget", a->kv_budget,
                                      "KV pool size in bytes instead of --kv-pages (like 8G or 512M)");
                       app.add_option("--max-body", a->max_body_mib, "Largest request body in MiB; larger get HTTP 413")
                           ->capture_default_str();
                       auto& o = a->server;
                       app.add_option("--cors", o.cors_origin,
                                      "Allow browsers from this origin (e.g. https://app.example or *): CORS headers "
                                      "and preflight answers");
                       app.add_option("--drain-timeout", o.drain_timeout_s,
                                      "Seconds running requests may finish after SIGTERM/SIGINT before they are cancelled")
                           ->capture_default_str()
                           ->check(CLI::Range(0.0, 3600.0));
                       app.add_option("--head-timeout", o.head_timeout_s,
                                      "Seconds a connection has to send a request head (line and headers)")
                           ->capture_default_str()
                           ->check(CLI::Range(0.1, 3600.0));
                       app.add_option("--body-timeout", o.body_timeout_s,
                                      "Seconds a request body has to arrive after its head")
                           ->capture_default_str()
                           ->check(CLI::Range(0.1, 3600.0));
                       app.add_option("--idle-timeout", o.idle_timeout_s,
                                      "Seconds without traffic after which a connection is closed")
                           ->capture_default_str()
                           ->check(CLI::Range(1, 86400));
                       app.add_option("--max-connections", o.max_connections,
                                      "Open connections; more are closed at once")
                           ->capture_default_str()
                           ->check(CLI::Range(1, 1000000));
                       app.add_option("--max-headers", o.max_headers, "Request header lines; more get HTTP 431")
                           ->capture_default_str()
                           ->check(CLI::Range(1, 10000));
                       app.add_option("--max-header-bytes", o.max_header_bytes,
                                      "Bytes of a request head; more get HTTP 431")
                           ->capture_default_str()
                           ->check(CLI::Range(size_t(8) << 10, size_t(16) << 20));
                       app.add_option("--parse-threads", o.parse_threads,
                                      "Threads that parse and tokenize requests (bounds their memory)")
                           ->capture_default_str()
                           ->check(CLI::Range(1, 256));
                       app.add_option("--model-name", a->model_name,
                                      "Model id clients use and /v1/models lists (default: the file name without .gguf)");
                       return [a] { return serve(*a); };
                     });

}  // namespace
}  // namespace kvq::cli
