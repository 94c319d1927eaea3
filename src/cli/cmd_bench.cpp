// kvq bench: the codec x context sweep (bench/sweep.hpp), and `list`,
// `compare`, `report` over runs.db. Parses options and calls the library.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstring>

#include "bench/compare.hpp"
#include "bench/report.hpp"
#include "bench/runs_db.hpp"
#include "bench/serve_bench.hpp"
#include "bench/sweep.hpp"
#include "cli/command.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "core/timer.hpp"

namespace kvq::cli {
namespace {

struct BenchArgs {
  ModelOptions model;
  std::string codecs = "all";
  std::string contexts = "4k,8k,16k,32k,64k";
  std::string batches = "1";
  std::string kv_budget;
  std::string batch_fill = "auto";
  int kv_window = CodecRequest::kWindowAuto;
  int gen = 128;
  int reps = 3;
  int warmup = 1;
  int prefill_reps = 1;
  bool prefill_every_run = false;
  uint64_t seed = 1;
  std::string home;
  std::string out;
  bool no_plots = false;
  std::string command_line;
  // list / compare / report
  std::string kind = "bench";
  std::string run_a, run_b;
  double threshold = 0.02;
  bool fail_on_regression = false;
  // serve
  std::string url, api_key, serve_model, concurrency, rate, prompt_len = "512", gen_len = "128", token_range = "100:1000", prompt_format = "ids";
  std::string disconnect = "0";
  int requests = 64;
  int shared_prefix = 0;
  double timeout = 600;
};

// Ctrl-C: the first stops the sweep after the current cell (runs.db stays
// consistent: every cell is one transaction); SA_RESETHAND makes a second
// one kill the process the default way.
std::atomic<bool> g_stop{false};
extern "C" void on_sigint(int) {
  g_stop.store(true);
  const char msg[] = "\nkvq bench: stopping after the current cell (Ctrl-C again to abort now)\n";
  [[maybe_unused]] const ssize_t n = ::write(2, msg, sizeof msg - 1);
}

struct SigintGuard {
  struct sigaction old {};
  SigintGuard() {
    g_stop.store(false);
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;
    sigaction(SIGINT, &sa, &old);
  }
  ~SigintGuard() { sigaction(SIGINT, &old, nullptr); }
};

int run_bench(const BenchArgs& a) {
  bench::SweepConfig cfg;
  cfg.model = resolve_model_path(a.model.model);
  cfg.device = a.model.device;
  cfg.backend = a.model.backend;
  cfg.codecs = bench::parse_codec_list(a.codecs);
  cfg.contexts = bench::parse_context_list(a.contexts);
  cfg.batches = bench::parse_batch_list(a.batches);
  if (!a.kv_budget.empty()) cfg.kv_budget = bench::parse_byte_size(a.kv_budget);
  cfg.window_pages = a.kv_window;
  cfg.batch_fill = a.batch_fill == "copy"      ? bench::SweepConfig::BatchFill::copy
                   : a.batch_fill == "prefill" ? bench::SweepConfig::BatchFill::prefill
                                               : bench::SweepConfig::BatchFill::automatic;
  cfg.gen = a.gen;
  cfg.reps = a.reps;
  cfg.warmup = a.warmup;
  cfg.prefill_reps = a.prefill_reps;
  cfg.prefill_every_run = a.prefill_every_run;
  KVQ_CHECK(a.prefill_reps >= 1, Errc::invalid_argument, "--prefill-reps must be at least 1 (got ", a.prefill_reps,
            "): every cell prefills its prompt at least once");
  cfg.prefill_chunk = a.model.prefill_chunk;
  cfg.threads = a.model.threads;
  cfg.seed = a.seed;
  cfg.home = a.home;
  cfg.out_dir = a.out;
  cfg.plots = !a.no_plots;
  cfg.command_line = a.command_line;
  cfg.should_stop = [] { return g_stop.load(); };

  std::fprintf(stderr,
               "kvq bench: %zu codecs x %zu contexts x %zu batch sizes on %s, model %s, %s, %d warm-up + %d decode runs of %d tokens\n",
               cfg.codecs.size(), cfg.contexts.size(), cfg.batches.size(), cfg.device.c_str(), cfg.model.c_str(),
               cfg.prefill_every_run ? "a prefill per run" : str(cfg.prefill_reps, " prefill(s) per cell").c_str(),
               cfg.warmup, cfg.reps, cfg.gen);
  const bool tty = ::isatty(2);
  Timer since_print;
  int last_cell = -1, last_rep = -1, last_prefill = -2;
  SigintGuard guard;
  const bench::SweepResult res = bench::run_sweep(cfg, [&](const bench::SweepProgress& p) {
    // A terminal gets one line redrawn a few times a second; a log gets a
    // line per repetition.
    const bool new_step = p.cell != last_cell || p.rep != last_rep || p.prefill_rep != last_prefill;
    if (tty) {
      if (!new_step && since_print.seconds() < 0.2) return;
      std::fprintf(stderr, "\r%s\033[K", bench::format_progress(p).c_str());
    } else {
      if (!new_step) return;
      std::fprintf(stderr, "%s\n", bench::format_progress(p).c_str());
    }
    std::fflush(stderr);
    since_print.reset();
    last_cell = p.cell;
    last_rep = p.rep;
    last_prefill = p.prefill_rep;
  });
  if (tty) std::fprintf(stderr, "\r\033[K");

  int ok = 0, flagged = 0, failed = 0;
  std::printf("%-18s %8s %5s  %-11s %12s %10s %10s %9s %8s\n", "codec", "ctx", "batch", "status", "decode tok/s",
              "TTFT s", "ITL p50", "KV MiB", "bits/v");
  for (const auto& c : res.cells) {
    (c.status == "ok" ? ok : c.status == "flagged" ? flagged : failed)++;
    if (c.measured())
      std::printf("%-18s %8d %5d  %-11s %12.2f %10.4f %10.3f %9.2f %8.3f\n", c.codec.c_str(), c.ctx, c.batch,
                  c.status.c_str(),
                  c.decode_tps.median, c.ttft_s.median, c.itl_p50_ms.median, double(c.kv_bytes) / (1 << 20),
                  c.bits_per_value);
    else
      std::printf("%-18s %8d %5d  %-11s %s\n", c.codec.c_str(), c.ctx, c.batch, c.status.c_str(),
                  c.error.substr(0, 100).c_str());
  }
  for (const auto& f : res.fits)
    std::printf("fit %-14s ITL = %.4f ms + %.5f ms per 1k KV tokens (RMS residual %.4f ms, %d points)\n",
                f.codec.c_str(), f.a_ms, f.b_ms_per_1k, f.residual_ms, f.n_points);
  std::fprintf(stderr, "kvq bench: run %lld %s: %zu cells (%d ok, %d flagged, %d failed)\n", (long long)res.run_id,
               res.status.c_str(), res.cells.size(), ok, flagged, failed);
  std::fprintf(stderr, "kvq bench: report %s\nkvq bench: csv    %s\nkvq bench: db     %s\n", res.report_path.c_str(),
               res.csv_path.c_str(), bench::runs_db_path(bench::resolve_home(a.home)).c_str());
  if (!res.plot_note.empty()) std::fprintf(stderr, "kvq bench: %s\n", res.plot_note.c_str());
  return res.status == "interrupted" ? 130 : 0;
}

int run_serve(const BenchArgs& a) {
  bench::ServeBenchConfig cfg;
  cfg.url = a.url;
  cfg.api_key = a.api_key;
  cfg.model = a.serve_model;
  if (!a.rate.empty()) {
    cfg.rates = bench::parse_rate_list(a.rate, "--rate");
    // Rate mode: --concurrency caps the requests in flight (its largest value).
    cfg.concurrency = a.concurrency.empty() ? std::vector<int>{256} : bench::parse_int_list(a.concurrency, "--concurrency");
  } else {
    cfg.concurrency = bench::parse_int_list(a.concurrency.empty() ? "1" : a.concurrency, "--concurrency");
  }
  cfg.requests = a.requests;
  cfg.prompt_len = bench::parse_length_dist(a.prompt_len, "--prompt-len");
  cfg.gen = bench::parse_length_dist(a.gen_len, "--gen");
  cfg.shared_prefix = a.shared_prefix;
  const bench::LengthDist tr = bench::parse_length_dist(a.token_range, "--token-range", 0);
  KVQ_CHECK(tr.lo < tr.hi, Errc::invalid_argument, "--token-range needs LO < HI (got '", a.token_range, "')");
  cfg.token_lo = tr.lo;
  cfg.token_hi = tr.hi;
  cfg.text_prompts = a.prompt_format == "text";
  cfg.seed = a.seed;
  cfg.disconnect = bench::parse_disconnect_fraction(a.disconnect);
  cfg.timeout_s = a.timeout;
  cfg.home = a.home;
  cfg.out_dir = a.out;
  cfg.plots = !a.no_plots;
  cfg.command_line = a.command_line;
  cfg.should_stop = [] { return g_stop.load(); };

  std::fprintf(stderr, "kvq bench serve: %s, %s, %d requests per level, prompt %d shared + %s tokens, output %s tokens\n",
               a.url.c_str(),
               cfg.rates.empty() ? str(cfg.concurrency.size(), " concurrency level(s)").c_str()
                                 : str(cfg.rates.size(), " request rate(s), at most ", cfg.concurrency.back(), " in flight").c_str(),
               cfg.requests, cfg.shared_prefix, cfg.prompt_len.str().c_str(), cfg.gen.str().c_str());
  if (cfg.disconnect > 0)
    std::fprintf(stderr, "kvq bench serve: a fraction %g of the requests (seeded) hang up on purpose mid-stream\n",
                 cfg.disconnect);
  const bool tty = ::isatty(2);
  Timer since_print;
  int last_level = -1, last_done = -1;
  SigintGuard guard;
  const bench::ServeBenchResult res = bench::run_serve_bench(cfg, [&](const bench::ServeProgress& p) {
    // A terminal: one line redrawn; a log: a line per tenth of a level and at its end.
    const int step = std::max(1, p.requests / 10);
    const bool new_level = p.level != last_level;
    if (tty) {
      if (!new_level && !p.level_done && since_print.seconds() < 0.2) return;
      std::fprintf(stderr, "\r%s\033[K%s", bench::format_serve_progress(p).c_str(), p.level_done ? "\n" : "");
    } else {
      const bool crossed = p.done / step != std::max(last_done, 0) / step;
      if (!new_level && !p.level_done && !crossed) return;
      std::fprintf(stderr, "%s\n", bench::format_serve_progress(p).c_str());
    }
    std::fflush(stderr);
    since_print.reset();
    last_level = p.level;
    last_done = p.done;
  });

  std::printf("%-22s %8s %6s %6s %6s %8s %11s %10s %10s %10s %10s %10s %10s\n", "level", "requests", "ok", "failed",
              "disc.", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99");
  bool server_checked = false;
  for (const auto& l : res.levels) server_checked = server_checked || l.server_json != "{}";
  for (const auto& l : res.levels) {
    const std::string label = l.mode == "rate" ? str("rate ", l.rate, " req/s") : str("concurrency ", l.concurrency);
    std::printf("%-22s %8d %6d %6d %6d %8.3f %11.2f %9.4fs %9.4fs %8.2fms %8.2fms %8.2fms %8.2fms\n", label.c_str(),
                l.requests, l.ok, l.failed, l.disconnected, l.req_per_s, l.out_tok_per_s, l.ttft_s.p50, l.ttft_s.p99,
                l.tpot_ms.p50, l.tpot_ms.p99, l.itl_ms.p50, l.itl_ms.p99);
    if (l.errors_json != "{}") std::printf("  failures: %s\n", l.errors_json.c_str());
    if (server_checked) std::printf("  %s\n", bench::server_check_text(l.server_json).c_str());
  }
  if (!server_checked && !res.levels.empty())
    std::printf("%s: the server's /metrics has no kvq_kv_pages_used\n", bench::server_check_text("{}").c_str());
  std::fprintf(stderr, "kvq bench serve: run %lld %s\nkvq bench serve: report %s\nkvq bench serve: csv    %s\n",
               (long long)res.run_id, res.status.c_str(), res.report_path.c_str(), res.csv_path.c_str());
  if (!res.plot_note.empty()) std::fprintf(stderr, "kvq bench serve: %s\n", res.plot_note.c_str());
  return res.status == "interrupted" ? 130 : 0;
}

int run_list(const BenchArgs& a) {
  bench::RunsDb db(bench::runs_db_path(bench::resolve_home(a.home)));
  std::fputs(bench::format_run_list(db, a.kind == "all" ? "" : a.kind).c_str(), stdout);
  return 0;
}

int run_compare(const BenchArgs& a) {
  bench::RunsDb db(bench::runs_db_path(bench::resolve_home(a.home)));
  const int64_t ia = bench::resolve_run_id(db, a.run_a, "bench");
  const int64_t ib = bench::resolve_run_id(db, a.run_b, "bench");
  const auto ca = db.cells(ia), cb = db.cells(ib);
  const bench::Comparison c = bench::compare_cells(ca, cb, a.threshold);
  std::fputs(bench::format_comparison(*db.run(ia), *db.run(ib), c).c_str(), stdout);
  return a.fail_on_regression && c.regressions > 0 ? 1 : 0;
}

int run_report(const BenchArgs& a) {
  const std::string home = bench::resolve_home(a.home);
  bench::RunsDb db(bench::runs_db_path(home));
  // A run id names its own kind; latest / latest~N count runs of --kind.
  const bool numeric = !a.run_a.empty() && std::isdigit(static_cast<unsigned char>(a.run_a[0]));
  const int64_t id = bench::resolve_run_id(db, a.run_a, numeric ? "" : a.kind);
  const bench::RunRow row = *db.run(id);
  const std::string dir = a.out.empty() ? home + "/runs/" + std::to_string(id) : a.out;
  std::string path;
  if (row.meta.kind == "serve") {
    path = bench::write_serve_report(dir, row, db.serve_levels(id), !a.no_plots);
  } else {
    KVQ_CHECK(row.meta.kind == "bench", Errc::invalid_argument, "run ", id, " is a ", row.meta.kind,
              " run; `kvq bench report` writes reports of bench and serve runs");
    path = bench::write_report(dir, row, db.cells(id), db.fits(id), !a.no_plots);
  }
  std::printf("%s\n", path.c_str());
  return 0;
}

// The command line as typed, for the run's metadata (from /proc: main()'s
// argv is not passed to commands).
std::string command_line() {
  FILE* f = std::fopen("/proc/self/cmdline", "rb");
  if (!f) return "";
  std::string s;
  char buf[4096];
  size_t k;
  while ((k = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, k);
  std::fclose(f);
  for (char& ch : s)
    if (ch == '\0') ch = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

KVQ_REGISTER_COMMAND(
    "bench", "Measure codecs x contexts (decode tok/s, TTFT, ITL, KV bytes) into runs.db, CSV and a report",
    [](CLI::App& app) {
      auto a = std::make_shared<BenchArgs>();
      add_model_source_options(app, a->model);
      add_backend_lab_options(app, a->model.backend);
      app.add_option("--codecs", a->codecs,
                     "Codecs: all (the codec table), seeds (the seeds' 25), every (all and the +qjl rows: each "
                     "rotor-family K side with its QJL sketch) or a comma list, e.g. none,k8v4,tsym3")
          ->capture_default_str();
      app.add_option("--contexts", a->contexts, "Prompt lengths in tokens, comma list; k = 1024 (e.g. 512,4k,64k)")
          ->capture_default_str();
      app.add_option("--batch", a->batches,
                     "Sequences decoded together per step, comma list (e.g. 1,8,32,64): each B > 1 cell prefills B "
                     "prompts of the context's length and decodes them one token each per step over one paged KV "
                     "pool; decode tok/s is then their aggregate. max: as many sequences as --kv-budget holds "
                     "(capacity mode, per codec)")
          ->capture_default_str();
      app.add_option("--kv-budget", a->kv_budget,
                     "KV bytes the capacity mode (--batch max) fills, e.g. 120G: each codec admits as many sequences "
                     "of the context + --gen tokens as fit, in 64-token pages");
      app.add_option("--batch-fill", a->batch_fill,
                     "How a batch cell fills its sequences' KV: prefill (each sequence prefills its own prompt), "
                     "copy (sequence 0 prefills, the others get copies of its KV rows in pages of their own: the "
                     "same bytes per step without B - 1 prefills) or auto (copy in capacity mode, else prefill)")
          ->check(CLI::IsMember({"auto", "prefill", "copy"}))
          ->capture_default_str();
      add_kv_window_option(app, a->kv_window);
      app.add_option("--gen", a->gen, "Tokens generated per decode run (decode tok/s counts tokens 2..gen)")
          ->check(CLI::Range(2, 1 << 20))
          ->capture_default_str();
      app.add_option("--reps", a->reps, "Measured decode runs per cell (medians, min, max)")
          ->check(in_range(1, 2147483647.0, false, ""))
          ->capture_default_str();
      app.add_option("--warmup", a->warmup, "Discarded decode runs before them")
          ->check(in_range(0, 2147483647.0, false, ""))
          ->capture_default_str();
      app.add_option("--prefill-reps", a->prefill_reps,
                     "Timed prefills of the prompt per cell (>= 1): TTFT and prefill tok/s are their median, "
                     "min, max; the decode runs then start from the prefilled cache")
          ->capture_default_str();
      app.add_flag("--prefill-every-run", a->prefill_every_run,
                   "The old protocol: every decode run (warm-up included) empties the cache and prefills the "
                   "prompt again; TTFT over the measured runs (--prefill-reps is then unused; several times slower at long "
                   "contexts)");
      app.add_option("--seed", a->seed, "Seed of the random prompt tokens")->capture_default_str();
      auto home_opt = [&](CLI::App& sub) {
        sub.add_option("--home", a->home, "kvq home folder holding runs.db and runs/ (default: $KVQ_HOME or ~/.kvq)");
      };
      home_opt(app);
      app.add_option("--out", a->out, "Report folder (default: <home>/runs/<run id>)");
      app.add_flag("--no-plots", a->no_plots, "Skip the gnuplot plots");

      CLI::App* list = app.add_subcommand("list", "List the runs in runs.db");
      home_opt(*list);
      list->add_option("--kind", a->kind, "Runs to list: bench, serve, eval or all")
          ->check(CLI::IsMember({"bench", "serve", "eval", "all"}))
          ->capture_default_str();
      CLI::App* compare = app.add_subcommand("compare", "Compare two bench runs cell by cell");
      home_opt(*compare);
      compare->add_option("run_a", a->run_a, "Run id (or latest, latest~N): the baseline")->required();
      compare->add_option("run_b", a->run_b, "Run id (or latest, latest~N): compared with the baseline")->required();
      compare->add_option("--threshold", a->threshold,
                          "Median change (fraction) below which a difference is never a regression")
          ->check(CLI::Range(0.0, 1.0))
          ->capture_default_str();
      compare->add_flag("--fail-on-regression", a->fail_on_regression, "Exit with status 1 when a cell regressed");
      CLI::App* report = app.add_subcommand("report", "Write a run's report (Markdown, plots, CSV) again from runs.db");
      home_opt(*report);
      report->add_option("run", a->run_a, "Run id (or latest, latest~N of --kind)")->required();
      report->add_option("--kind", a->kind, "What latest / latest~N count: bench or serve runs")
          ->check(CLI::IsMember({"bench", "serve"}))
          ->capture_default_str();
      report->add_option("--out", a->out, "Report folder (default: <home>/runs/<run id>)");
      report->add_flag("--no-plots", a->no_plots, "Skip the gnuplot plots");
      CLI::App* serve = app.add_subcommand(
          "serve",
          "Measure an OpenAI-compatible server (kvq serve, llama-server, vLLM) over HTTP: TTFT, TPOT, ITL, "
          "request and output tok/s per concurrency or request rate (docs/bench.md, \"kvq bench serve\")");
      serve->add_option("--url", a->url, "Server base URL, e.g. http://127.0.0.1:8080 (a trailing /v1 is allowed)")
          ->required();
      serve->add_option("--concurrency", a->concurrency,
                        "Requests in flight, comma list: one level each (default 1). With --rate: the cap on "
                        "requests in flight (default 256)");
      serve->add_option("--rate", a->rate,
                        "Request rates in req/s, comma list: one level each, Poisson arrivals (seeded) instead of "
                        "fixed concurrency");
      serve->add_option("--requests", a->requests, "Requests per level")
          ->check(in_range(1, 1e7, false, ""))
          ->capture_default_str();
      serve->add_option("--prompt-len", a->prompt_len,
                        "Unique prompt tokens per request: N, or LO:HI sampled uniformly (seeded)")
          ->capture_default_str();
      serve->add_option("--gen", a->gen_len,
                        "Output tokens per request (max_tokens = min_tokens, ignore_eos): N or LO:HI")
          ->capture_default_str();
      serve->add_option("--shared-prefix", a->shared_prefix,
                        "Tokens common to every prompt, before its unique --prompt-len tokens")
          ->check(in_range(0, 1e8, false, ""))
          ->capture_default_str();
      serve->add_option("--token-range", a->token_range,
                        "Random prompt token ids are drawn from LO:HI (HI excluded); keep it inside the vocabulary")
          ->capture_default_str();
      serve->add_option("--prompt-format", a->prompt_format,
                        "ids: token-id prompts (exact lengths); text: random common words, about one token each "
                        "(for servers that take no ids; prompt tokens then come from the server's usage)")
          ->check(CLI::IsMember({"ids", "text"}))
          ->capture_default_str();
      serve->add_option("--api-key", a->api_key, "Sent as Authorization: Bearer KEY");
      serve->add_option("--model", a->serve_model,
                        "The requests' \"model\" (default: the first of GET /v1/models, if the server lists one)");
      serve->add_option("--seed", a->seed, "Seed of prompts, lengths, arrivals and disconnects")->capture_default_str();
      serve->add_option("--disconnect", a->disconnect,
                        "Fraction F (0 <= F < 1) of the requests, seeded, that hang up on purpose after a random "
                        "number of text chunks (a soak: counted as disconnected, not in the latencies)")
          ->capture_default_str();
      serve->add_option("--timeout", a->timeout, "Seconds a request may take")
          ->check(in_range(0.001, 1e6, false, ""))
          ->capture_default_str();
      home_opt(*serve);
      serve->add_option("--out", a->out, "Report folder (default: <home>/runs/<run id>)");
      serve->add_flag("--no-plots", a->no_plots, "Skip the gnuplot plot");
      // After the subcommands: they would inherit it.
      app.footer(
          "Protocol per cell (codec x context L), docs/bench.md:\n"
          "  1. --prefill-reps N times: empty the KV cache, prefill the L-token prompt, choose the first\n"
          "     token; each is timed: TTFT = prefill + first token, prefill tok/s = L / prefill time.\n"
          "     Reported: median, min, max over the N (prefill_n in the CSV and runs.db).\n"
          "  2. --warmup + --reps decode runs, each from the cache holding the prompt: re-feed the last\n"
          "     prompt token at position L-1 (rewriting that row with the same values) to get token 1,\n"
          "     then generate G-1 more (--gen G, greedy, end of generation ignored); the next run\n"
          "     overwrites the rows past L. Decode tok/s = (G-1) / (t_G - t_1) (tokens 2..G), ITL per\n"
          "     token; median, min, max over the measured runs. Every run (warm-up too) must generate\n"
          "     the same tokens (digest), else the cell is flagged.\n"
          "Re-prefilling the identical prompt for every run cost about 75% of a full sweep's time;\n"
          "--prefill-every-run brings that protocol back.");
      app.require_subcommand(0, 1);
      return [a, list, compare, report, serve] {
        if (serve->parsed()) {
          a->command_line = command_line();
          return run_serve(*a);
        }
        if (list->parsed()) return run_list(*a);
        if (compare->parsed()) return run_compare(*a);
        if (report->parsed()) return run_report(*a);
        a->command_line = command_line();
        return run_bench(*a);
      };
    });

}  // namespace
}  // namespace kvq::cli
