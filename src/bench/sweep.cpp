#include "bench/sweep.hpp"

#include <omp.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <sstream>

#include "backend/backend.hpp"
#include "engine/runtime.hpp"
#include "bench/measure.hpp"
#include "bench/report.hpp"
#include "bench/run_meta.hpp"
#include "bench/runs_db.hpp"
#include "bench/stats.hpp"
#include "core/error.hpp"
#include "core/text.hpp"
#include "core/timer.hpp"
#include "kv/codec_table.hpp"
#include "kv/page.hpp"
#include "model/forward.hpp"
#include "model/model_spec.hpp"

namespace kvq::bench {

namespace fs = std::filesystem;

namespace {

std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');)
    if (!trim_space(item).empty()) out.push_back(trim_space(item));
  return out;
}

// "rotor3_sym+qjl" -> --kv rotor3_sym --rotor-qjl on; anything else is --kv NAME.
kv::CodecOptions codec_options(const std::string& name) {
  kv::CodecOptions o;
  const std::string suffix = "+qjl";
  if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    o.kv = name.substr(0, name.size() - suffix.size());
    o.rotor_qjl = true;
  } else {
    o.kv = name;
  }
  return o;
}

std::string fmt_duration(double s) {
  if (s < 0) return "?";
  const long t = long(std::lround(s));
  if (t < 60) return str(t, "s");
  if (t < 3600) return str(t / 60, "m", (t % 60 < 10 ? "0" : ""), t % 60, "s");
  return str(t / 3600, "h", (t % 3600) / 60 < 10 ? "0" : "", (t % 3600) / 60, "m");
}

// A failed cell: the status says why (out of memory, no kernels for the
// codec on this device, anything else).
CellResult failed_cell(const std::string& codec, int ctx, int gen, const std::string& status,
                       const std::string& message) {
  CellResult c;
  c.codec = codec;
  c.ctx = ctx;
  c.gen = gen;
  c.status = status;
  c.error = message;
  return c;
}

std::string classify(const Error& e) {
  std::string msg = e.what();
  std::transform(msg.begin(), msg.end(), msg.begin(), [](unsigned char ch) { return char(std::tolower(ch)); });
  const bool memory = msg.find("out of memory") != std::string::npos ||
                      (msg.find("memory") != std::string::npos && msg.find("free") != std::string::npos);
  if ((e.code() == Errc::cuda || e.code() == Errc::out_of_range) && memory) return "oom";
  if (e.code() == Errc::unsupported) return "unsupported";
  return "failed";
}

// Estimated work of a cell in "decode-step units": `prefills` prefills of
// ctx tokens (each token costing `prefill_ratio` decode steps) and `runs`
// decode runs of gen single-token steps (prefill-once: the re-fed last
// prompt token and G-1 decode steps; prefill-every-run: prefills == runs,
// the first token from the prefill and G-1 steps, about the same).
double cell_weight(int ctx, int gen, int prefills, int runs, double prefill_ratio) {
  return double(prefills) * ctx * prefill_ratio + double(runs) * gen;
}

}  // namespace

std::string format_progress(const SweepProgress& p) {
  std::string s = str("[", p.cell + 1, "/", p.cells, "] ", p.codec, " @ ", p.ctx,
                      p.batch > 1 ? str(" x ", p.batch, " sequences") : std::string(), ": ");
  if (p.prefill_rep >= 0) {
    s += str("prefill ", p.prefill_rep + 1, "/", p.prefill_reps);
    if (p.prefill_total > 0 && p.prefill_done < p.prefill_total) s += str(", ", p.prefill_done, "/", p.prefill_total);
  } else {
    s += p.rep < p.warmup ? str("warm-up ", p.rep + 1, "/", p.warmup)
                          : str("rep ", p.rep - p.warmup + 1, "/", p.reps - p.warmup);
    if (p.prefill_total > 0 && p.prefill_done < p.prefill_total)
      s += str(", prefill ", p.prefill_done, "/", p.prefill_total);
  }
  s += str(" | ", fmt_duration(p.elapsed_s), " elapsed, ETA ", p.eta_s < 0 ? std::string("?") : fmt_duration(p.eta_s));
  return s;
}

std::vector<std::string> parse_codec_list(const std::string& list) {
  std::vector<std::string> names;
  const std::string l = trim_space(list);
  if (l == "all" || l == "seeds" || l == "every") {
    for (const auto& c : kv::codec_table())
      if (l != "seeds" || c.seed_codec) names.push_back(c.name);
    // every: also the +qjl rows, the codecs whose K side --rotor-qjl
    // sketches (a rotor-family K: rotor3_sym, rotor4_sym, k_rotor3, k_rotor4).
    if (l == "every")
      for (const auto& c : kv::codec_table())
        if (kv::resolve_codec(codec_options(c.name)).k.family == kv::Family::rotor) names.push_back(c.name + "+qjl");
    return names;
  }
  for (const auto& item : split_list(l)) {
    const std::string canon = kv::resolve_codec(codec_options(item)).name;  // throws listing the valid names
    if (std::find(names.begin(), names.end(), canon) == names.end()) names.push_back(canon);
  }
  KVQ_CHECK(!names.empty(), Errc::invalid_argument,
            "--codecs is empty; give all, seeds, every or a list like none,k8v4");
  return names;
}

std::vector<int> parse_context_list(const std::string& list) {
  std::vector<int> out;
  std::vector<std::string> items;
  {
    // Strict: an empty item (4k,,8k or a trailing comma) is a typo, not nothing.
    std::stringstream ss(list);
    for (std::string item; std::getline(ss, item, ',');) items.push_back(trim_space(item));
    if (!list.empty() && list.back() == ',') items.push_back("");
    for (const auto& item : items)
      KVQ_CHECK(!item.empty() || trim_space(list).empty(), Errc::invalid_argument, "--contexts '", list,
                "' has an empty item; give a list like 4k,8k,16k");
  }
  for (const auto& item : items) {
    if (item.empty()) continue;
    std::string num = item;
    long mult = 1;
    if (!num.empty() && (num.back() == 'k' || num.back() == 'K')) {
      mult = 1024;
      num.pop_back();
    }
    size_t used = 0;
    long v = 0;
    try {
      v = std::stol(num, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    KVQ_CHECK(used == num.size() && !num.empty() && v > 0 && v <= (1L << 30), Errc::invalid_argument,
              "--contexts: '", item, "' is not a positive token count (like 512, 4k or 64k)");
    KVQ_CHECK(v * mult <= kMaxBenchContext, Errc::invalid_argument, "--contexts: '", item, "' (", v * mult,
              " tokens) is above ", kMaxBenchContext / 1024, "k, the longest context kvq bench measures");
    const int ctx = int(v * mult);
    if (std::find(out.begin(), out.end(), ctx) == out.end()) out.push_back(ctx);
  }
  KVQ_CHECK(!out.empty(), Errc::invalid_argument, "--contexts is empty; give a list like 4k,8k,16k");
  return out;
}

std::vector<int> parse_batch_list(const std::string& list) {
  std::vector<int> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = list.find(',', start);
    const std::string item = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    start = comma == std::string::npos ? list.size() + 1 : comma + 1;
    char* end = nullptr;
    errno = 0;
    const long v = item == "max" ? kBatchMax : item.empty() ? -1 : std::strtol(item.c_str(), &end, 10);
    KVQ_CHECK(item == "max" || (!item.empty() && end && *end == '\0' && errno == 0 && v >= 1 && v <= 4096),
              Errc::invalid_argument, "--batch: '", item,
              "' is not a sequence count from 1 to 4096 or max (give a list like 1,8,32,64,max)");
    KVQ_CHECK(std::find(out.begin(), out.end(), int(v)) == out.end(), Errc::invalid_argument, "--batch: ", v,
              " is listed twice");
    out.push_back(int(v));
  }
  return out;
}

uint64_t parse_byte_size(const std::string& text) {
  std::string num = text;
  uint64_t mult = 1;
  if (!num.empty()) {
    const char u = char(std::toupper(static_cast<unsigned char>(num.back())));
    if (u == 'K' || u == 'M' || u == 'G' || u == 'T') {
      mult = u == 'K' ? 1ull << 10 : u == 'M' ? 1ull << 20 : u == 'G' ? 1ull << 30 : 1ull << 40;
      num.pop_back();
    }
  }
  char* end = nullptr;
  errno = 0;
  const double v = num.empty() ? -1 : std::strtod(num.c_str(), &end);
  KVQ_CHECK(!num.empty() && end && *end == '\0' && errno == 0 && v > 0 && v * double(mult) < 1e18,
            Errc::invalid_argument, "'", text, "' is not a size in bytes (like 120G, 512M or 4096)");
  return uint64_t(v * double(mult));
}

int sequences_in_budget(const std::string& codec, int tokens, int n_layers, int n_kv_heads, int head_dim,
                        uint64_t budget, int window_pages) {
  const kv::ResolvedCodec rc = kv::resolve_codec(codec_options(codec));
  const uint64_t rows = uint64_t(kv::kDefaultPageTokens) * uint64_t(n_layers) * uint64_t(n_kv_heads);
  const uint64_t page_bytes = rows * kv::codec_bytes_per_token_per_head(rc, head_dim);
  const uint64_t exact_page_bytes = kv::exact_page_bytes(kv::CacheShape{n_layers, n_kv_heads, head_dim, 1});
  const int pages = kv::pages_for(tokens, kv::kDefaultPageTokens), exact = std::min(pages, window_pages);
  const uint64_t per_seq = uint64_t(pages - exact) * page_bytes + uint64_t(exact) * exact_page_bytes;
  return int(std::min<uint64_t>(budget / per_seq, 1u << 20));
}

SweepResult run_sweep(const SweepConfig& cfg, const std::function<void(const SweepProgress&)>& on_progress) {
  KVQ_CHECK(!cfg.codecs.empty(), Errc::invalid_argument, "no codecs to measure");
  KVQ_CHECK(!cfg.contexts.empty(), Errc::invalid_argument, "no contexts to measure");
  KVQ_CHECK(!cfg.batches.empty(), Errc::invalid_argument, "no batch sizes to measure");
  const bool capacity = std::find(cfg.batches.begin(), cfg.batches.end(), kBatchMax) != cfg.batches.end();
  KVQ_CHECK(!capacity || cfg.kv_budget > 0, Errc::invalid_argument,
            "--batch max needs --kv-budget SIZE (the KV bytes to fill, e.g. 120G)");
  KVQ_CHECK(cfg.gen >= 2, Errc::invalid_argument, "--gen must be at least 2 (decode speed counts tokens 2..G)");
  KVQ_CHECK(cfg.reps >= 1, Errc::invalid_argument, "--reps must be at least 1");
  KVQ_CHECK(cfg.warmup >= 0, Errc::invalid_argument, "--warmup cannot be negative");
  KVQ_CHECK(cfg.prefill_reps >= 1, Errc::invalid_argument, "--prefill-reps must be at least 1 (got ",
            cfg.prefill_reps, "): every cell prefills its prompt at least once");
  for (const auto& c : cfg.codecs) kv::resolve_codec(codec_options(c));  // unknown names fail before anything runs
  KVQ_CHECK(cfg.window_pages >= CodecRequest::kWindowAuto, Errc::invalid_argument, "--kv-window ", cfg.window_pages,
            " pages (0: none)");
  // A codec's request with its window: --kv-window, or by default the
  // codec's own (CodecRequest::window_for).
  auto request_of = [&](const std::string& codec) {
    CodecRequest r{codec_options(codec)};
    r.set_window(cfg.window_pages);
    return r;
  };
  if (cfg.threads > 0) omp_set_num_threads(cfg.threads);
  const std::string home = resolve_home(cfg.home);
  RunsDb db(runs_db_path(home));  // an unusable home fails before the model loads

  Timer total;
  std::unique_ptr<Backend> made = cfg.make_backend ? cfg.make_backend(cfg.device) : make_backend(cfg.device, cfg.backend);
  const double copy_bw = made->measure_copy_bandwidth();  // before the model takes memory
  const Runtime rt = Runtime::open(std::move(made), cfg.model);
  Backend* backend = rt.backend.get();
  Model* model = rt.model.get();
  const ModelConfig& mc = model->config();
  // Before any cell runs: a context the model cannot hold is refused, not
  // measured for minutes and reported.
  for (int ctx : cfg.contexts)
    KVQ_CHECK(mc.context_length == 0 || uint64_t(ctx) <= mc.context_length, Errc::invalid_argument, "--contexts: ", ctx,
              " tokens is above the model's context of ", mc.context_length,
              " tokens (context_length); give contexts up to that");

  RunMeta meta = collect_run_meta(*backend, /*measure_bandwidth=*/false);
  meta.kind = "bench";
  meta.model = cfg.model;
  meta.copy_bw_gbs = copy_bw / 1e9;
  nlohmann::ordered_json params = {
      {"codecs", cfg.codecs},
      {"contexts", cfg.contexts},
      {"batches", cfg.batches},
      {"kv_budget", cfg.kv_budget},
      {"kv_window", cfg.window_pages == CodecRequest::kWindowAuto ? nlohmann::ordered_json("auto")
                                                                  : nlohmann::ordered_json(cfg.window_pages)},
      {"batch_fill", cfg.batch_fill == SweepConfig::BatchFill::copy      ? "copy"
                     : cfg.batch_fill == SweepConfig::BatchFill::prefill ? "prefill"
                                                                         : "auto"},
      {"gen", cfg.gen},
      {"reps", cfg.reps},
      {"warmup", cfg.warmup},
      {"protocol", cfg.prefill_every_run ? "prefill-every-run" : "prefill-once"},
      {"prefill_reps", cfg.prefill_every_run ? cfg.reps : cfg.prefill_reps},
      {"prefill_chunk", cfg.prefill_chunk > 0 ? cfg.prefill_chunk : backend->default_session_prefill_chunk()},
      {"batch_prefill_chunk", cfg.prefill_chunk > 0 ? cfg.prefill_chunk : backend->default_prefill_chunk()},
      {"threads", cfg.threads > 0 ? cfg.threads : omp_get_max_threads()},
      {"seed", cfg.seed},
      {"model_shape",
       {{"arch", arch_name(mc.arch)}, {"layers", mc.n_layers}, {"d_model", mc.d_model}, {"heads", mc.n_heads},
        {"kv_heads", mc.n_kv_heads}, {"head_dim", mc.head_dim}, {"vocab", mc.vocab_size}}},
      {"weight_bytes_per_step", model->step_weight_bytes()},
      {"command_line", cfg.command_line}};
  meta.params_json = params.dump();

  SweepResult res;
  res.run_id = db.begin_run(meta);
  res.out_dir = cfg.out_dir.empty() ? (fs::path(home) / "runs" / std::to_string(res.run_id)).string() : cfg.out_dir;
  std::error_code ec;
  fs::create_directories(res.out_dir, ec);
  KVQ_CHECK(!ec, Errc::io, "cannot create the report folder '", res.out_dir, "': ", ec.message());
  res.csv_path = (fs::path(res.out_dir) / "cells.csv").string();
  std::ofstream csv(res.csv_path);
  KVQ_CHECK(csv.good(), Errc::io, "cannot write '", res.csv_path, "'");
  csv << csv_header() << std::flush;

  // Cells in codec-major order (each codec's contexts together, as its fit uses them).
  struct Cell {
    std::string codec;
    int ctx;
    int batch;
    bool capacity;  // batch is what the KV budget admits
  };
  std::vector<Cell> plan;
  for (const auto& c : cfg.codecs)
    for (int ctx : cfg.contexts)
      for (int b : cfg.batches) {
        // Capacity mode: the codec's sequences of ctx + gen tokens that the budget holds.
        const int admitted = b != kBatchMax ? b
                                            : sequences_in_budget(c, ctx + cfg.gen, mc.n_layers, mc.n_kv_heads,
                                                                  mc.head_dim, cfg.kv_budget, request_of(c).window_pages);
        plan.push_back({c, ctx, admitted, b == kBatchMax});
      }
  std::vector<std::vector<int32_t>> prompts;  // one per context, the same for every codec
  for (int ctx : cfg.contexts) prompts.push_back(random_prompt(ctx, mc.vocab_size, cfg.seed + uint64_t(ctx)));

  // ETA: elapsed time over the weight of the cells done, times the weight
  // left; the prefill/decode cost ratio is learnt from measured cells.
  double prefill_ratio = 0.05, done_weight = 0, measured_time = 0;
  std::vector<double> ratios;
  const int reps_total = cfg.warmup + cfg.reps;
  const int prefills = cfg.prefill_every_run ? reps_total : cfg.prefill_reps;
  auto weight_of = [&](int ctx) { return cell_weight(ctx, cfg.gen, prefills, reps_total, prefill_ratio); };
  auto weight_left = [&](size_t from) {
    double w = 0;
    for (size_t i = from; i < plan.size(); ++i) w += weight_of(plan[i].ctx) * plan[i].batch;
    return w;
  };

  SweepProgress p;
  p.cells = int(plan.size());
  p.reps = reps_total;
  p.warmup = cfg.warmup;
  p.prefill_reps = cfg.prefill_every_run ? 0 : cfg.prefill_reps;
  res.status = "ok";
  for (size_t i = 0; i < plan.size(); ++i) {
    if (cfg.should_stop && cfg.should_stop()) {
      res.status = "interrupted";
      break;
    }
    const Cell& cell = plan[i];
    p.cell = int(i);
    p.codec = cell.codec;
    p.ctx = cell.ctx;
    p.batch = cell.batch;
    p.rep = 0;
    p.prefill_rep = cfg.prefill_every_run ? -1 : 0;
    p.prefill_done = p.prefill_total = 0;
    Timer t_cell;
    auto report = [&] {
      p.elapsed_s = total.seconds();
      const double w_done = done_weight + 0.0;
      p.eta_s = w_done > 0 ? measured_time / w_done * weight_left(i) - t_cell.seconds() : -1;
      if (p.eta_s < 0 && w_done > 0) p.eta_s = 0;
      if (on_progress) on_progress(p);
    };
    MeasureOptions mo;
    mo.gen = cfg.gen;
    mo.reps = cfg.reps;
    mo.warmup = cfg.warmup;
    mo.prefill_reps = cfg.prefill_reps;
    mo.prefill_every_run = cfg.prefill_every_run;
    mo.prefill_chunk = cfg.prefill_chunk;
    mo.copy_bw = copy_bw;
    p.prefill_reps = cfg.prefill_every_run ? 0 : cfg.prefill_reps;
    mo.on_prefill_rep = [&](int j, int total) {
      p.prefill_rep = j;
      p.prefill_reps = total;  // a batch cell prefills each of its sequences once
      p.prefill_done = p.prefill_total = 0;
      report();
    };
    mo.on_rep = [&](int rep, int) {
      p.prefill_rep = -1;
      p.rep = rep;
      p.prefill_done = p.prefill_total = 0;
      report();
    };
    mo.on_prefill = [&](int done, int all) {
      p.prefill_done = done;
      p.prefill_total = all;
      report();
    };
    const std::vector<int32_t>& prompt =
        prompts[size_t(std::find(cfg.contexts.begin(), cfg.contexts.end(), cell.ctx) - cfg.contexts.begin())];
    CellResult r;
    try {
      KVQ_CHECK(cell.batch >= 1, Errc::out_of_range, "--kv-budget ", cfg.kv_budget, " bytes holds no sequence of ",
                cell.ctx + cfg.gen, " tokens with ", cell.codec);
      const CodecRequest request = request_of(cell.codec);
      if (cell.batch == 1 && !cell.capacity) {
        r = measure_cell(*model, request, prompt, mo);
      } else {
        // Sequence 0 has the one-sequence cells' prompt; the others their
        // own, or copies of its KV.
        mo.copy_batch_kv = cfg.batch_fill == SweepConfig::BatchFill::copy ||
                           (cfg.batch_fill == SweepConfig::BatchFill::automatic && cell.capacity);
        std::vector<std::vector<int32_t>> batch_prompts = {prompt};
        for (int b = 1; b < cell.batch; ++b)
          batch_prompts.push_back(mo.copy_batch_kv ? prompt
                                                   : random_prompt(cell.ctx, mc.vocab_size,
                                                                   cfg.seed + uint64_t(cell.ctx) + 7919u * b));
        r = measure_batch_cell(*model, request, batch_prompts, mo);
      }
    } catch (const std::bad_alloc&) {
      r = failed_cell(cell.codec, cell.ctx, cfg.gen, "oom", "out of host memory (std::bad_alloc)");
    } catch (const Error& e) {
      r = failed_cell(cell.codec, cell.ctx, cfg.gen, classify(e), e.what());
    } catch (const std::exception& e) {
      r = failed_cell(cell.codec, cell.ctx, cfg.gen, "failed", e.what());
    }
    // The sweep's name ("+qjl" forms included, equal to the canonical one)
    // and its window, measured or not.
    const CodecRequest named = request_of(cell.codec);
    const bool one_sequence = cell.batch == 1 && !cell.capacity;
    r.codec = cell.codec + kv::exact_window_suffix(one_sequence ? session_window_pages(*model, named, cell.ctx + cfg.gen)
                                                                : named.window_pages);
    r.batch = cell.batch;
    r.capacity = cell.capacity;
    db.add_cell(res.run_id, r);  // one transaction: the cell is in runs.db whole or not at all
    csv << csv_row(res.run_id, r) << std::flush;
    if (r.measured()) {
      ratios.push_back(r.decode_tps.median / std::max(r.prefill_tps.median, 1e-9));
      prefill_ratio = spread(ratios).median;
      measured_time += t_cell.seconds();
      done_weight += weight_of(cell.ctx) * cell.batch;
    }
    res.cells.push_back(std::move(r));
  }

  std::vector<CellResult> one_sequence;  // the ITL fit is over one-sequence steps
  for (const auto& c : res.cells)
    if (c.batch == 1 && !c.capacity) one_sequence.push_back(c);
  for (const auto& codec : cfg.codecs) {
    const ItlFit f = fit_itl(codec, one_sequence);
    if (f.n_points < 2) continue;
    db.add_fit(res.run_id, f);
    res.fits.push_back(f);
  }
  int n_ok = 0, n_flagged = 0, n_failed = 0;
  for (const auto& c : res.cells) (c.status == "ok" ? n_ok : c.status == "flagged" ? n_flagged : n_failed)++;
  const nlohmann::ordered_json summary = {{"cells_planned", plan.size()}, {"cells_run", res.cells.size()},
                                          {"ok", n_ok},  {"flagged", n_flagged},
                                          {"failed", n_failed}, {"seconds", total.seconds()},
                                          {"out_dir", res.out_dir}};
  db.end_run(res.run_id, res.status, summary.dump());

  const std::optional<RunRow> row = db.run(res.run_id);
  Plots plots;
  res.report_path = write_report(res.out_dir, *row, res.cells, res.fits, cfg.plots, &plots);
  for (const auto& f : plots.files) res.plot_paths.push_back((fs::path(res.out_dir) / f).string());
  res.plot_note = plots.note;
  return res;
}

}  // namespace kvq::bench
