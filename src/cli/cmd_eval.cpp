// kvq eval: KV-codec quality through the real cache (src/eval).
//   kvq eval ppl    sliding-window perplexity of a text, per codec
//   kvq eval kl     teacher-forced KL(p_ref || p_codec), p99 KL, top-1 agreement and
//                   perplexity per codec against one reference pass (none, or f32)
//   kvq eval needle retrieval of a planted fact at several depths, per codec
// Text tables by default (the tables of docs/quality.md), --json for machines.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unistd.h>

#include "bench/run_meta.hpp"
#include "bench/runs_db.hpp"
#include "cli/command.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "core/file_io.hpp"
#include "core/log.hpp"
#include "eval/needle.hpp"
#include "eval/text_eval.hpp"

namespace kvq::cli {
namespace {

using nlohmann::ordered_json;

struct EvalArgs {
  ModelOptions model;
  std::string codecs = "all";
  int ctx = 0;  // 0: the model's trained context
  std::string file;
  int stride = 0;
  int max_windows = 0;
  std::string ref = "none";
  int kv_window = CodecRequest::kWindowAuto;  // --kv-window: exact window pages for every codec entry
  bool json = false;
  std::string home;        // runs.db location (--home)
  bool no_record = false;  // --no-record
  bool quiet = !::isatty(2);  // progress only where someone watches it
  // needle
  std::string depths = "0.1,0.3,0.5,0.7,0.9";
  int trials = 2;
  uint64_t seed = 1;
};

constexpr double kIntMaxD = 2147483647.0;

// --codecs, each entry but f32 with --kv-window's exact window (by default
// the codec's own, CodecRequest::window_for). The evaluation form of the
// window is the CPU store's: on another backend the default is no window, and
// an explicit --kv-window fails there as unsupported.
std::vector<eval::EvalCodec> eval_codecs(const EvalArgs& a, const Backend& backend) {
  std::vector<eval::EvalCodec> codecs = eval::parse_eval_codecs(a.codecs);
  const bool cpu = std::string(backend.name()) == "cpu";
  bool dropped = false;
  for (eval::EvalCodec& c : codecs) {
    if (c.f32) continue;
    const int w = c.window_for(a.kv_window);
    if (a.kv_window == CodecRequest::kWindowAuto && !cpu) {
      dropped = dropped || w > 0;
      continue;
    }
    c.codec.exact_window_pages = w;
  }
  if (dropped)
    log_warn("kvq eval on ", backend.name(), " measures the codecs without their default exact window (its ",
             "evaluation form runs on the CPU backend: --device cpu)");
  return codecs;
}

// Bounded like every text input (64 MiB; /dev/zero is a clear error, a
// directory too).
std::string read_file(const std::string& path) { return read_file_bounded(path, kMaxTextInputBytes, "--file"); }

// The text as the model sees it: BOS when the tokenizer asks for one, then
// the plain tokens (special-token text in the file is not parsed).
std::vector<int32_t> text_tokens(const Tokenizer& tok, const std::string& path) {
  KVQ_CHECK(!path.empty(), Errc::invalid_argument, "--file TEXT is required: the text to evaluate on");
  std::vector<int32_t> ids;
  if (tok.add_bos() && tok.bos() >= 0) ids.push_back(tok.bos());
  const auto body = tok.encode(read_file(path));
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

int default_ctx(const EvalArgs& a, const ModelConfig& cfg) {
  if (a.ctx > 0) return a.ctx;
  return cfg.context_length ? int(cfg.context_length) : 4096;
}

std::string model_line(const EvalArgs& a, const Loaded& l) {
  const ModelConfig& c = l.model->config();
  return str("model ", resolve_model_path(a.model.model), " (", c.n_layers, " layers, ", c.n_kv_heads,
             " KV heads, head_dim ", c.head_dim, "), device ", l.backend->name());
}

std::string bits(const eval::CodecQuality& q) {
  if (q.codec.f32) return "32 / 32";
  char b[64];
  std::snprintf(b, sizeof b, "%.3f / %.3f", q.k_bits, q.v_bits);
  return b;
}

ordered_json codec_json(const eval::CodecQuality& q) {
  ordered_json j = {{"codec", q.codec.label()}};
  if (const auto r = eval::resolve(q.codec)) {
    j["k_block"] = r->k.name();
    j["v_block"] = r->v.name();
    j["k_bits"] = q.k_bits;
    j["v_bits"] = q.v_bits;
  } else {
    j["k_block"] = j["v_block"] = "f32";
  }
  if (!q.error.empty()) {
    j["status"] = q.unsupported ? "unsupported" : "error";
    j["error"] = q.error;
    return j;
  }
  j["status"] = "ok";
  j["positions"] = q.positions;
  if (q.has_kl) {
    j["mean_kl"] = q.mean_kl;
    j["p99_kl"] = q.p99_kl;
    j["max_kl"] = q.max_kl;
    j["top1_pct"] = q.top1_pct;
  }
  j["mean_nll"] = q.mean_nll;
  j["ppl"] = q.ppl;
  if (q.has_kl)
    if (const auto f = eval::quality_floor(q.codec)) {
      j["class"] = f->name;
      j["floor_met"] = eval::floor_verdict(*f, q.mean_kl, q.top1_pct) == "yes";
      j["floor"] = eval::floor_verdict(*f, q.mean_kl, q.top1_pct);
    }
  return j;
}

// One quality number per runs.db row (eval_results), beside the bench rows:
// the run carries the model, device, build and the command's parameters; the
// rows the codec, metric, context and value. Codecs the backend could not run
// are listed in the run's summary.
struct Recorder {
  struct Item {
    std::string codec, metric;
    std::optional<int64_t> ctx;
    double value;
    ordered_json detail;
  };
  std::vector<Item> items;
  ordered_json skipped = ordered_json::array();
  void add(const std::string& codec, const std::string& metric, std::optional<int64_t> ctx, double value,
           ordered_json detail = ordered_json::object()) {
    items.push_back({codec, metric, ctx, value, std::move(detail)});
  }
};

void record_results(const EvalArgs& a, Loaded& l, const ordered_json& params, const Recorder& rec) {
  if (a.no_record) return;
  bench::RunMeta meta = bench::collect_run_meta(*l.backend, /*measure_bandwidth=*/false);
  meta.kind = "eval";
  meta.model = resolve_model_path(a.model.model);
  meta.device = l.backend->name();
  meta.params_json = params.dump();
  bench::RunsDb db(bench::runs_db_path(bench::resolve_home(a.home)));
  const int64_t run = db.begin_run(meta);
  db.transaction([&] {
    for (const auto& it : rec.items)
      db.add_eval_result({run, it.codec, it.metric, it.ctx, it.value, it.detail.dump(), ""});
  });
  db.end_run(run, "ok", ordered_json{{"results", rec.items.size()}, {"skipped", rec.skipped}}.dump());
  if (!a.quiet) std::fprintf(stderr, "kvq eval: recorded run %lld in %s\n", (long long)run, db.path().c_str());
}

int run_text(EvalArgs& a, bool kl) {
  Loaded l = load(a.model);
  Model& m = *l.model;
  const auto tokens = text_tokens(*l.tokenizer, a.file);
  eval::TextEvalOptions o;
  o.ctx = default_ctx(a, m.config());
  // ppl: overlapping windows by default (half a window of fresh tokens each)
  const int window = std::min<int>(o.ctx, int(tokens.size()));
  o.stride = a.stride > 0 ? a.stride : kl ? 0 : std::max(1, window / 2);
  o.max_windows = a.max_windows;
  o.prefill_chunk = a.model.prefill_chunk > 0 ? a.model.prefill_chunk : l.backend->default_prefill_chunk();
  if (kl) {
    KVQ_CHECK(a.ref == "none" || a.ref == "f32", Errc::invalid_argument, "--ref is none or f32, not '", a.ref, "'");
    o.ref = eval::parse_eval_codec(a.ref);
  }
  if (!a.quiet)
    o.on_pass = [](const std::string& label, int w, int nw) {
      std::fprintf(stderr, "\rkvq eval: window %d/%d: %-24s", w + 1, nw, label.c_str());
      std::fflush(stderr);
    };
  const auto codecs = eval_codecs(a, *l.backend);
  const auto rep = eval::evaluate_text(m, tokens, codecs, o);
  if (!a.quiet) std::fprintf(stderr, "\r%60s\r", "");

  const int win = rep.windows.front().len, stride = o.stride > 0 ? o.stride : win;
  int64_t positions = 0;
  for (const auto& w : rep.windows) positions += w.len - w.first_target;
  ordered_json doc = {{"command", kl ? "kl" : "ppl"},
                      {"model", resolve_model_path(a.model.model)},
                      {"device", l.backend->name()},
                      {"text", a.file},
                      {"text_tokens", rep.n_tokens},
                      {"ctx", win},
                      {"stride", stride},
                      {"windows", rep.windows.size()},
                      {"positions", positions}};
  if (rep.ref) doc["reference"] = {{"codec", rep.ref->codec.label()}, {"ppl", rep.ref->ppl}};
  ordered_json rows = ordered_json::array();
  for (const auto& q : rep.rows) rows.push_back(codec_json(q));
  doc["results"] = rows;
  {
    ordered_json params = doc;
    params.erase("results");
    params["codecs"] = a.codecs;
    Recorder rec;
    for (const auto& q : rep.rows) {
      if (!q.error.empty()) {
        rec.skipped.push_back({{"codec", q.codec.label()}, {"error", q.error}});
        continue;
      }
      const ordered_json detail = {{"text", a.file}, {"positions", q.positions}, {"k_bits", q.k_bits},
                                   {"v_bits", q.v_bits}, {"reference", rep.ref ? rep.ref->codec.label() : ""}};
      if (q.has_kl) {
        rec.add(q.codec.label(), "kl_mean", win, q.mean_kl, detail);
        rec.add(q.codec.label(), "kl_p99", win, q.p99_kl, detail);
        rec.add(q.codec.label(), "kl_max", win, q.max_kl, detail);
        rec.add(q.codec.label(), "top1_pct", win, q.top1_pct, detail);
      }
      rec.add(q.codec.label(), "ppl", win, q.ppl, detail);
    }
    record_results(a, l, params, rec);
  }
  if (a.json) {
    std::printf("%s\n", doc.dump(2).c_str());
    return 0;
  }
  std::printf("kvq eval %s: %s\n", kl ? "kl" : "ppl", model_line(a, l).c_str());
  std::printf("text %s: %d tokens; %zu window(s) of %d tokens, stride %d; %lld scored positions", a.file.c_str(),
              rep.n_tokens, rep.windows.size(), win, stride, (long long)positions);
  if (rep.ref) std::printf("; reference %s (ppl %.4f)", rep.ref->codec.label().c_str(), rep.ref->ppl);
  std::printf("\n\n");
  if (kl)
    std::printf("| codec | K/V bits | mean KL | p99 KL | max KL | top-1 %% | ppl | class | floor met |\n"
                "|---|---|---|---|---|---|---|---|---|\n");
  else
    std::printf("| codec | K/V bits | ppl | mean NLL (nats) |\n|---|---|---|---|\n");
  for (const auto& q : rep.rows) {
    if (!q.error.empty()) {
      std::printf("| %s | %s | %s: %s |\n", q.codec.label().c_str(), bits(q).c_str(),
                  q.unsupported ? "unsupported" : "error", q.error.c_str());
      continue;
    }
    if (!kl) {
      std::printf("| %s | %s | %.4f | %.5f |\n", q.codec.label().c_str(), bits(q).c_str(), q.ppl, q.mean_nll);
      continue;
    }
    const auto f = eval::quality_floor(q.codec);
    std::printf("| %s | %s | %.5f | %.4f | %.4f | %.1f | %.4f | %s | %s |\n", q.codec.label().c_str(),
                bits(q).c_str(), q.mean_kl, q.p99_kl, q.max_kl, q.top1_pct, q.ppl, f ? f->name.c_str() : "-",
                f ? eval::floor_verdict(*f, q.mean_kl, q.top1_pct).c_str() : "-");
  }
  return 0;
}

std::vector<double> parse_depths(const std::string& s) {
  std::vector<double> d;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) {
    double v = -1;
    try {
      v = std::stod(x);
    } catch (const std::exception&) {
    }
    KVQ_CHECK(v >= 0 && v <= 1, Errc::invalid_argument, "--depths takes fractions in [0, 1], e.g. 0.1,0.5,0.9; got '",
              x, "'");
    d.push_back(v);
  }
  KVQ_CHECK(!d.empty(), Errc::invalid_argument, "--depths is empty");
  return d;
}

int run_needle(EvalArgs& a) {
  Loaded l = load(a.model);
  Model& m = *l.model;
  eval::NeedleOptions o;
  o.ctx = default_ctx(a, m.config());
  o.depths = parse_depths(a.depths);
  o.trials = a.trials;
  o.seed = a.seed;
  o.prefill_chunk = a.model.prefill_chunk > 0 ? a.model.prefill_chunk : l.backend->default_prefill_chunk();
  if (!a.file.empty()) o.haystack = read_file(a.file);
  if (!a.quiet)
    o.on_pass = [](const std::string& label, int i, int n) {
      std::fprintf(stderr, "\rkvq eval needle: %-24s case %d/%d", label.c_str(), i + 1, n);
      std::fflush(stderr);
    };
  const auto codecs = eval_codecs(a, *l.backend);
  const auto rep = eval::run_needle(m, *l.tokenizer, codecs, o);
  if (!a.quiet) std::fprintf(stderr, "\r%60s\r", "");

  ordered_json doc = {{"command", "needle"},
                      {"model", resolve_model_path(a.model.model)},
                      {"device", l.backend->name()},
                      {"ctx", o.ctx},
                      {"haystack", a.file.empty() ? "built-in" : a.file},
                      {"depths", o.depths},
                      {"trials", o.trials},
                      {"seed", o.seed}};
  ordered_json rows = ordered_json::array();
  for (const auto& r : rep.rows) {
    ordered_json j = {{"codec", r.codec.label()}};
    if (!r.error.empty()) {
      j["status"] = r.unsupported ? "unsupported" : "error";
      j["error"] = r.error;
    } else {
      j["status"] = "ok";
      j["found"] = r.found;
      j["cases"] = r.cases;
      j["accuracy_pct"] = r.accuracy_pct();
      j["mean_answer_logprob"] = r.mean_logprob();
      ordered_json per = ordered_json::array();
      for (size_t i = 0; i < o.depths.size(); ++i)
        per.push_back({{"depth", o.depths[i]}, {"found", r.found_at[i]}, {"cases", o.trials}});
      j["per_depth"] = per;
    }
    rows.push_back(j);
  }
  doc["results"] = rows;
  {
    ordered_json params = doc;
    params.erase("results");
    params["codecs"] = a.codecs;
    Recorder rec;
    for (const auto& r : rep.rows) {
      if (!r.error.empty()) {
        rec.skipped.push_back({{"codec", r.codec.label()}, {"error", r.error}});
        continue;
      }
      ordered_json per = ordered_json::object();
      for (size_t i = 0; i < o.depths.size(); ++i) per[str(o.depths[i])] = r.found_at[i];
      const ordered_json detail = {{"cases", r.cases}, {"found", r.found}, {"found_per_depth", per},
                                   {"trials", o.trials}, {"haystack", a.file.empty() ? "built-in" : a.file}};
      rec.add(r.codec.label(), "needle_acc", o.ctx, r.accuracy_pct(), detail);
      rec.add(r.codec.label(), "needle_logprob", o.ctx, r.mean_logprob(), detail);
    }
    record_results(a, l, params, rec);
  }
  if (a.json) {
    std::printf("%s\n", doc.dump(2).c_str());
    return 0;
  }
  std::printf("kvq eval needle: %s\n", model_line(a, l).c_str());
  std::printf("context %d tokens, haystack %s, %d trial(s) per depth; a case is found when greedy decoding "
              "reproduces the planted value exactly\n\n| codec | found |",
              o.ctx, a.file.empty() ? "built-in" : a.file.c_str(), o.trials);
  for (double d : o.depths) std::printf(" depth %.2f |", d);
  std::printf(" mean log p(answer) |\n|---|---|");
  for (size_t i = 0; i < o.depths.size(); ++i) std::printf("---|");
  std::printf("---|\n");
  for (const auto& r : rep.rows) {
    if (!r.error.empty()) {
      std::printf("| %s | %s: %s |\n", r.codec.label().c_str(), r.unsupported ? "unsupported" : "error",
                  r.error.c_str());
      continue;
    }
    std::printf("| %s | %d/%d |", r.codec.label().c_str(), r.found, r.cases);
    for (int f : r.found_at) std::printf(" %d/%d |", f, o.trials);
    std::printf(" %.3f |\n", r.mean_logprob());
  }
  return 0;
}

void add_common(CLI::App& s, EvalArgs& a) {
  add_model_source_options(s, a.model);
  s.add_option("--codecs", a.codecs,
               "Comma-separated: codec names, NAME+qjl (rotor --rotor-qjl on), K/V block pairs (turbo3/bf16), "
               "f32 (exact fp32 cache, CPU), or all")
      ->capture_default_str();
  s.add_option("--ctx", a.ctx, "Context (window) length in tokens (default: the model's trained context)")
      ->check(in_range(1, kIntMaxD, false, " tokens"));
  add_kv_window_option(s, a.kv_window,
                       "Exact recent window for every codec entry but f32: a query reads its newest W 64-token pages "
                       "as exact bf16 rows, older tokens through the codec (rows labelled NAME+winW; it measures "
                       "quality and saves no memory; CPU backend only: elsewhere auto means 0)");
  s.add_flag("--json", a.json, "Machine-readable output");
  s.add_flag("-q,--quiet", a.quiet, "No progress on standard error (default when it is not a terminal)");
  s.add_option("--home", a.home, "kvq home folder holding runs.db (default: $KVQ_HOME or ~/.kvq)");
  s.add_flag("--no-record", a.no_record, "Do not record the results in runs.db");
}

}  // namespace

KVQ_REGISTER_COMMAND("eval", "KV-codec quality: perplexity, KL vs a reference, needle retrieval",
                     [](CLI::App& app) -> std::function<int()> {
                       app.require_subcommand(1);
                       auto a = std::make_shared<EvalArgs>();
                       auto which = std::make_shared<std::string>();
                       CLI::App* ppl = app.add_subcommand("ppl", "Sliding-window perplexity of --file per codec");
                       CLI::App* kl = app.add_subcommand(
                           "kl", "Teacher-forced KL(ref || codec), p99 KL, top-1 agreement and perplexity per codec");
                       CLI::App* needle =
                           app.add_subcommand("needle", "Retrieval of a planted value at several depths per codec");
                       for (CLI::App* s : {ppl, kl, needle}) {
                         add_common(*s, *a);
                         s->callback([which, s] { *which = s->get_name(); });
                       }
                       for (CLI::App* s : {ppl, kl}) {
                         s->add_option("-f,--file", a->file, "Text file to evaluate on")->required();
                         s->add_option("--max-windows", a->max_windows, "Evaluate at most this many windows (0: all)")
                             ->check(in_range(0, kIntMaxD, false, " (0: all)"));
                       }
                       ppl->add_option("--stride", a->stride, "Tokens between window starts (default: ctx/2)")
                           ->check(in_range(1, kIntMaxD, false, " tokens"));
                       kl->add_option("--stride", a->stride, "Tokens between window starts (default: ctx, disjoint)")
                           ->check(in_range(1, kIntMaxD, false, " tokens"));
                       kl->add_option("--ref", a->ref, "Reference cache: none (bf16) or f32 (exact, CPU only)")
                           ->capture_default_str();
                       needle->add_option("-f,--file", a->file, "Haystack text (default: a built-in code haystack)");
                       needle->add_option("--depths", a->depths, "Needle depths as fractions of the context")
                           ->capture_default_str();
                       needle->add_option("--trials", a->trials, "Needles (different values) per depth")
                           ->check(in_range(1, kIntMaxD, false, ""))
                           ->capture_default_str();
                       needle->add_option("--seed", a->seed, "Seed of the planted values")->capture_default_str();
                       return [a, which] {
                         if (*which == "needle") return run_needle(*a);
                         return run_text(*a, *which == "kl");
                       };
                     });

}  // namespace kvq::cli
