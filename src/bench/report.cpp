#include "bench/report.hpp"

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench/report_text.hpp"
#include "bench/stats.hpp"
#include "core/error.hpp"

namespace kvq::bench {

namespace fs = std::filesystem;

std::string num(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

// Significant digits for a table: 1234, 123.4, 12.34, 1.234, 0.1234.
std::string sig(double v) {
  const double a = std::fabs(v);
  return num(v, a >= 1000 ? 0 : a >= 100 ? 1 : a >= 10 ? 2 : a >= 1 ? 3 : 4);
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string q = "\"";
  for (char ch : s) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return q + "\"";
}

// A Markdown table cell: no pipes or newlines inside.
std::string md(std::string s) {
  for (char& ch : s)
    if (ch == '|' || ch == '\n' || ch == '\r') ch = ch == '|' ? '/' : ' ';
  return s;
}

std::string sh_quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

// Runs a shell command; returns (exit status, combined output).
std::pair<int, std::string> run_command(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::array<char, 4096> buf;
  size_t k;
  while ((k = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), k);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

namespace {

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }


// A gnuplot string literal (single quotes doubled).
std::string gp_str(const std::string& s) {
  std::string q = "'";
  for (char ch : s) q += ch == '\'' ? std::string("''") : std::string(1, ch);
  return q + "'";
}

struct CodecSeries {
  std::string codec;
  std::string data;  // path relative to the report folder
  const ItlFit* fit = nullptr;
};

std::string plot_script(const std::string& terminal, const std::string& ext, const std::vector<CodecSeries>& series,
                        int reps) {
  std::ostringstream g;
  g << "set terminal " << terminal << "\n"
    << "set grid\nset key outside right top noenhanced\nset logscale x 2\nset yrange [0:*]\n"
    << "set offsets graph 0.04, graph 0.04, graph 0.05, 0\n"
    << "set xlabel 'context (prompt tokens)'\n";
  auto plot = [&](const std::string& out, const std::string& title, const std::string& ylabel,
                  const std::string& using_with) {
    g << "set output '" << out << "." << ext << "'\nset title " << gp_str(title) << "\nset ylabel "
      << gp_str(ylabel) << "\nplot ";
    for (size_t i = 0; i < series.size(); ++i)
      g << (i ? ", \\\n     " : "") << gp_str(series[i].data) << " using " << using_with << " lc " << i + 1
        << " title " << gp_str(series[i].codec);
    g << "\n";
  };
  plot("tps_vs_ctx", "Decode tok/s vs context (median; bars: min..max of " + std::to_string(reps) + " reps)",
       "decode tok/s", "1:2:3:4 with yerrorlines pt 7 ps 0.6");
  plot("kv_mib_vs_ctx", "KV cache MiB vs context (counted by the cache)", "KV MiB", "1:5 with linespoints pt 7 ps 0.6");
  // ITL against KV length with each codec's fitted line.
  g << "unset logscale x\nset xlabel 'KV tokens attended per step / 1000'\nset output 'itl_fit." << ext
    << "'\nset title 'Inter-token latency (p50) vs KV length, with fits ITL = a + b * kv/1000'\n"
    << "set ylabel 'ITL p50 (ms)'\nplot ";
  for (size_t i = 0; i < series.size(); ++i) {
    g << (i ? ", \\\n     " : "") << gp_str(series[i].data) << " using 6:7 with points pt 7 ps 0.8 lc " << i + 1
      << " title " << gp_str(series[i].codec);
    if (const ItlFit* f = series[i].fit)
      g << ", \\\n     " << num(f->a_ms, 6) << " + " << num(f->b_ms_per_1k, 6) << " * x with lines dt 2 lc " << i + 1
        << " title " << gp_str(series[i].codec + " fit");
  }
  g << "\n";
  return g.str();
}

}  // namespace

std::string csv_header() {
  return "run_id,codec,ctx,gen,reps,prefill_n,status,flags,decode_tps,decode_tps_min,decode_tps_max,ttft_s,ttft_s_min,"
         "ttft_s_max,prefill_tps,prefill_tps_min,prefill_tps_max,itl_p50_ms,itl_p50_ms_min,itl_p50_ms_max,"
         "itl_p99_ms,itl_p99_ms_min,itl_p99_ms_max,kv_seq,kv_bytes,kv_mib,bits_per_value,kv_capacity_bytes,"
         "device_mem_delta,weight_bytes,step_bytes,achieved_gbs,pct_copy_bw,attn_kernels,kv_host_device_bytes,"
         "digest,digests_agree,batch,capacity,kv_pages,error\n";
}

std::string csv_row(int64_t run_id, const CellResult& c) {
  std::vector<std::string> f = {std::to_string(run_id), csv_field(c.codec), std::to_string(c.ctx),
                                std::to_string(c.gen), std::to_string(c.reps),
                                c.measured() ? std::to_string(c.prefill_n) : std::string(), c.status,
                                csv_field(join(c.flags, ";"))};
  const bool m = c.measured();
  auto val = [&](double v, int decimals) { f.push_back(m ? num(v, decimals) : ""); };
  for (const Spread* s : {&c.decode_tps, &c.ttft_s, &c.prefill_tps, &c.itl_p50_ms, &c.itl_p99_ms}) {
    val(s->median, 6);
    val(s->min, 6);
    val(s->max, 6);
  }
  val(c.kv_seq, 1);
  f.push_back(m ? std::to_string(c.kv_bytes) : "");
  val(mib(double(c.kv_bytes)), 4);
  val(c.bits_per_value, 4);
  f.push_back(m ? std::to_string(c.kv_capacity_bytes) : "");
  f.push_back(m && c.device_mem_delta >= 0 ? std::to_string(c.device_mem_delta) : "");
  f.push_back(m ? std::to_string(c.weight_bytes) : "");
  val(c.step_bytes, 0);
  val(c.achieved_gbs, 4);
  f.push_back(m && c.pct_copy_bw > 0 ? num(c.pct_copy_bw, 3) : "");
  f.push_back(m ? csv_field(dispatch_summary(c.dispatch)) : "");
  f.push_back(m && c.dispatch.counted
                  ? std::to_string(c.dispatch.kv_host_to_device_bytes + c.dispatch.kv_device_to_host_bytes)
                  : "");
  f.push_back(c.digest);
  f.push_back(m ? (c.digests_agree ? "1" : "0") : "");
  f.push_back(std::to_string(c.batch));
  f.push_back(c.capacity ? "1" : "0");
  f.push_back(m && c.kv_pages > 0 ? std::to_string(c.kv_pages) : "");
  f.push_back(csv_field(c.error));
  return join(f, ",") + "\n";
}

namespace {

// Cells of one sequence per step (the codec x context sweep); batch cells
// have their own table and plot.
std::vector<CellResult> one_sequence_cells(const std::vector<CellResult>& cells) {
  std::vector<CellResult> r;
  for (const auto& c : cells)
    if (c.batch <= 1 && !c.capacity) r.push_back(c);
  return r;
}
bool has_batches(const std::vector<CellResult>& cells) {
  return std::any_of(cells.begin(), cells.end(), [](const CellResult& c) { return c.batch > 1 || c.capacity; });
}

Plots write_context_plots(const std::string& dir, const std::vector<CellResult>& cells,
                          const std::vector<ItlFit>& fits) {
  Plots out;
  // One data file per codec with measured cells, rows sorted by context.
  std::vector<std::string> codecs;
  for (const auto& c : cells)
    if (c.measured() && std::find(codecs.begin(), codecs.end(), c.codec) == codecs.end()) codecs.push_back(c.codec);
  if (codecs.empty()) {
    out.note = "no plots: no cell was measured";
    return out;
  }
  const fs::path data_dir = fs::path(dir) / "plots-data";
  fs::create_directories(data_dir);
  std::vector<CodecSeries> series;
  int reps = 0;
  for (size_t i = 0; i < codecs.size(); ++i) {
    std::vector<const CellResult*> rows;
    for (const auto& c : cells)
      if (c.measured() && c.codec == codecs[i]) rows.push_back(&c);
    std::sort(rows.begin(), rows.end(), [](const auto* a, const auto* b) { return a->ctx < b->ctx; });
    const std::string name = "codec" + std::to_string(i) + ".dat";
    std::ofstream d(data_dir / name);
    d << "# " << codecs[i] << ": ctx tps_median tps_min tps_max kv_mib kv_seq/1000 itl_p50_ms\n";
    for (const auto* c : rows) {
      d << c->ctx << " " << c->decode_tps.median << " " << c->decode_tps.min << " " << c->decode_tps.max << " "
        << mib(double(c->kv_bytes)) << " " << c->kv_seq / 1000.0 << " " << c->itl_p50_ms.median << "\n";
      reps = std::max(reps, c->reps);
    }
    CodecSeries s{codecs[i], "plots-data/" + name, nullptr};
    for (const auto& f : fits)
      if (f.codec == codecs[i] && f.n_points >= 2) s.fit = &f;
    series.push_back(s);
  }

  const auto [vrc, vout] = run_command("gnuplot --version");
  if (vrc != 0) {
    out.note = "no plots: gnuplot was not found (install gnuplot-nox: tools/install-deps.sh)";
    return out;
  }
  const char* names[] = {"tps_vs_ctx", "kv_mib_vs_ctx", "itl_fit"};
  struct Format {
    std::string ext;
    std::vector<std::string> terminals;  // tried in order
  };
  const std::vector<Format> formats = {
      {"svg", {"svg size 1100,650 dynamic background '#ffffff' font 'sans,12'"}},
      {"png",
       {"pngcairo size 1100,650 background '#ffffff' font 'sans,11'", "png size 1100,650 background '#ffffff'"}}};
  std::vector<std::string> problems;
  for (const auto& fmt : formats) {
    bool made = false;
    std::string last_error;
    for (const auto& term : fmt.terminals) {
      const fs::path script = data_dir / ("plots_" + fmt.ext + ".gp");
      std::ofstream(script) << plot_script(term, fmt.ext, series, reps);
      // The script path made absolute: gnuplot runs inside `dir`, and a
      // relative --out would otherwise name the script from the wrong folder.
      const auto [rc, text] =
          run_command("cd " + sh_quote(dir) + " && gnuplot " + sh_quote(fs::absolute(script).string()));
      bool all = rc == 0;
      for (const char* n : names) {
        const fs::path f = fs::path(dir) / (std::string(n) + "." + fmt.ext);
        std::error_code ec;
        all = all && fs::exists(f) && fs::file_size(f, ec) > 0;
      }
      if (all) {
        made = true;
        break;
      }
      last_error = text.substr(0, 300);
    }
    if (made)
      for (const char* n : names) out.files.push_back(std::string(n) + "." + fmt.ext);
    else
      problems.push_back(fmt.ext + " plots failed: " + last_error);
  }
  out.note = join(problems, "; ");
  return out;
}

// Aggregate decode tok/s against the batch size, one line per codec (and
// context, when the run has several).
void write_batch_plot(const std::string& dir, const std::vector<CellResult>& cells, Plots& out) {
  std::vector<std::pair<std::string, int>> series;  // (codec, ctx)
  for (const auto& c : cells)
    if (c.measured() && std::find(series.begin(), series.end(), std::make_pair(c.codec, c.ctx)) == series.end())
      series.emplace_back(c.codec, c.ctx);
  bool many_ctx = false;
  for (const auto& s : series) many_ctx = many_ctx || s.second != series.front().second;
  const fs::path data_dir = fs::path(dir) / "plots-data";
  fs::create_directories(data_dir);
  std::vector<std::pair<std::string, std::string>> files;  // (title, data path)
  for (size_t i = 0; i < series.size(); ++i) {
    std::vector<const CellResult*> rows;
    for (const auto& c : cells)
      if (c.measured() && c.codec == series[i].first && c.ctx == series[i].second) rows.push_back(&c);
    std::sort(rows.begin(), rows.end(), [](const auto* a, const auto* b) { return a->batch < b->batch; });
    const std::string name = "batch" + std::to_string(i) + ".dat";
    std::ofstream d(data_dir / name);
    d << "# " << series[i].first << " @ " << series[i].second << ": batch tps_median tps_min tps_max\n";
    for (const auto* c : rows)
      d << c->batch << " " << c->decode_tps.median << " " << c->decode_tps.min << " " << c->decode_tps.max << "\n";
    files.emplace_back(many_ctx ? series[i].first + " @ " + std::to_string(series[i].second) : series[i].first,
                       "plots-data/" + name);
  }
  if (files.empty()) return;
  for (const std::string ext : {"svg", "png"}) {
    const std::string term = ext == "svg" ? "svg size 1100,650 dynamic background '#ffffff' font 'sans,12'"
                                          : "png size 1100,650 background '#ffffff'";
    std::ostringstream g;
    g << "set terminal " << term << "\nset grid\nset key outside right top noenhanced\nset logscale x 2\n"
      << "set yrange [0:*]\nset offsets graph 0.04, graph 0.04, graph 0.05, 0\n"
      << "set xlabel 'sequences per decode step'\nset ylabel 'aggregate decode tok/s'\n"
      << "set title 'Aggregate decode tok/s vs batch (median; bars: min..max)'\n"
      << "set output 'tps_vs_batch." << ext << "'\nplot ";
    for (size_t i = 0; i < files.size(); ++i)
      g << (i ? ", \\\n     " : "") << gp_str(files[i].second) << " using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc "
        << i + 1 << " title " << gp_str(files[i].first);
    g << "\n";
    const fs::path script = data_dir / ("plot_batch_" + ext + ".gp");
    std::ofstream(script) << g.str();
    const auto [rc, text] =
        run_command("cd " + sh_quote(dir) + " && gnuplot " + sh_quote(fs::absolute(script).string()));
    const fs::path f = fs::path(dir) / ("tps_vs_batch." + ext);
    std::error_code ec;
    if (rc == 0 && fs::exists(f) && fs::file_size(f, ec) > 0)
      out.files.push_back("tps_vs_batch." + ext);
    else
      out.note += std::string(out.note.empty() ? "" : "; ") + "batch plot (" + ext + ") failed: " + text.substr(0, 200);
  }
}

}  // namespace

Plots write_plots(const std::string& dir, const std::vector<CellResult>& cells, const std::vector<ItlFit>& fits) {
  const std::vector<CellResult> one = one_sequence_cells(cells);
  Plots out;
  if (!one.empty()) out = write_context_plots(dir, one, fits);
  if (has_batches(cells) && run_command("gnuplot --version").first == 0) write_batch_plot(dir, cells, out);
  if (one.empty() && !has_batches(cells)) out.note = "no plots: no cell was measured";
  return out;
}

namespace {

// The batch cells: aggregate decode tok/s per codec and batch size (one grid
// per context), then every batch cell with its per-step latency and pages.
std::string batch_section(const std::vector<CellResult>& cells) {
  std::ostringstream r;
  std::vector<std::string> codecs;
  std::vector<int> ctxs, batches;
  for (const auto& c : cells) {
    if (std::find(codecs.begin(), codecs.end(), c.codec) == codecs.end()) codecs.push_back(c.codec);
    if (std::find(ctxs.begin(), ctxs.end(), c.ctx) == ctxs.end()) ctxs.push_back(c.ctx);
    if (std::find(batches.begin(), batches.end(), c.batch) == batches.end()) batches.push_back(c.batch);
  }
  std::sort(ctxs.begin(), ctxs.end());
  std::sort(batches.begin(), batches.end());
  for (int ctx : ctxs) {
    r << "## Batched decode: aggregate tok/s at prompt " << ctx << " (B sequences per step; median, min-max)\n\n"
      << "| codec |";
    for (int b : batches) r << " B = " << b << " |";
    r << "\n|---|";
    for (size_t i = 0; i < batches.size(); ++i) r << "---|";
    r << "\n";
    for (const auto& codec : codecs) {
      r << "| " << md(codec) << " |";
      for (int b : batches) {
        const CellResult* c = nullptr;
        for (const auto& x : cells)
          if (x.codec == codec && x.ctx == ctx && x.batch == b) c = &x;
        if (!c)
          r << " |";
        else if (!c->measured())
          r << " " << c->status << " |";
        else
          r << " " << sig(c->decode_tps.median) << " (" << sig(c->decode_tps.min) << "-" << sig(c->decode_tps.max)
            << ")" << (c->status == "flagged" ? " **!**" : "") << " |";
      }
      r << "\n";
    }
    r << "\n";
  }
  for (const auto& c : cells)
    if (c.capacity) {
      r << "Capacity mode (--batch max): each codec ran as many sequences of prompt + generated tokens as the KV "
           "budget holds (`capacity` cells below).\n\n";
      break;
    }
  r << "B = 1 cells are the one-sequence protocol above (recorded steps where the backend has them); B > 1 cells "
       "prefill each sequence (or, with `prefilled` 1 of B, one sequence whose KV rows the others got as copies: "
       "--batch-fill), then decode every sequence one token per step (ITL = one step).\n\n"
       "| codec | ctx | batch | prefilled | status | aggregate tok/s | ITL p50 / p99 ms | KV MiB | KV pages | GB/s | % "
       "copy bw |\n"
       "|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& c : cells) {
    if (c.batch <= 1 && !c.capacity) continue;
    r << "| " << md(c.codec) << " | " << c.ctx << " | " << c.batch << (c.capacity ? " (capacity)" : "") << " | "
      << (c.measured() ? std::to_string(c.prefill_n) : std::string()) << " | " << c.status << " |";
    if (!c.measured()) {
      r << " | | | | | |\n";
      continue;
    }
    r << " " << sig(c.decode_tps.median) << " | " << sig(c.itl_p50_ms.median) << " / " << sig(c.itl_p99_ms.median)
      << " | " << sig(mib(double(c.kv_bytes))) << " | " << c.kv_pages << " | " << sig(c.achieved_gbs) << " | "
      << (c.pct_copy_bw > 0 ? num(c.pct_copy_bw, 1) : std::string("n/a")) << " |\n";
  }
  r << "\n";
  return r.str();
}

}  // namespace

std::string report_markdown(const RunRow& run, const std::vector<CellResult>& all_cells,
                            const std::vector<ItlFit>& fits, const Plots& plots) {
  const std::vector<CellResult> cells = one_sequence_cells(all_cells);
  const RunMeta& m = run.meta;
  nlohmann::json params = nlohmann::json::object();
  try {
    params = nlohmann::json::parse(m.params_json);
  } catch (const nlohmann::json::exception&) {
  }
  std::ostringstream r;
  r << "# kvq bench run " << run.run_id << "\n\n";
  r << "| | |\n|---|---|\n";
  r << "| model | `" << md(m.model) << "` |\n";
  if (params.contains("model_shape")) {
    const auto& s = params["model_shape"];
    r << "| shape | " << s.value("arch", "") << ", " << s.value("layers", 0) << " layers, d_model "
      << s.value("d_model", 0) << ", " << s.value("heads", 0) << " heads / " << s.value("kv_heads", 0)
      << " KV heads, head_dim " << s.value("head_dim", 0) << " |\n";
  }
  if (params.contains("weight_bytes_per_step"))
    r << "| weights read per step | " << num(mib(params["weight_bytes_per_step"].get<double>()), 1) << " MiB |\n";
  r << "| device | " << md(m.device) << ": " << md(m.gpu_name) << " |\n";
  if (!m.driver.empty()) r << "| driver | " << md(m.driver) << " |\n";
  if (!m.clocks.empty()) r << "| clocks | " << md(m.clocks) << " |\n";
  r << "| copy bandwidth (read + write) | " << num(m.copy_bw_gbs, 1) << " GB/s |\n";
  r << "| build | kvq " << md(m.kvq_version) << ", git " << md(m.git_sha) << ", " << md(m.build_type) << " |\n";
  r << "| host | " << md(m.host) << " |\n";
  r << "| started / finished | " << m.started_at << " / " << (run.finished_at.empty() ? "-" : run.finished_at)
    << " (" << run.status << ") |\n";
  if (!params.empty()) {
    // Runs recorded before the prefill-once protocol carry no "protocol".
    const std::string protocol = params.value("protocol", std::string("prefill-every-run"));
    r << "| protocol | prompt of L random tokens, " << params.value("gen", 0) << " generated (greedy), "
      << params.value("warmup", 0) << " warm-up + " << params.value("reps", 0) << " measured decode runs per cell, ";
    if (protocol == "prefill-once")
      r << params.value("prefill_reps", 1)
        << " timed prefill(s) per cell (TTFT, prefill tok/s), every decode run starting from the prefilled cache "
           "(re-feeding the last prompt token), ";
    else
      r << "every run prefilling the prompt (TTFT over the measured runs), ";
    r << "prefill chunk " << params.value("prefill_chunk", 0) << ", " << params.value("threads", 0)
      << " CPU threads |\n";
  }
  if (params.contains("command_line") && !params["command_line"].get<std::string>().empty())
    r << "| command | `" << md(params["command_line"].get<std::string>()) << "` |\n";
  r << "\n";

  // Decode tok/s grid: codecs x contexts.
  std::vector<std::string> codecs;
  std::vector<int> ctxs;
  for (const auto& c : cells) {
    if (std::find(codecs.begin(), codecs.end(), c.codec) == codecs.end()) codecs.push_back(c.codec);
    if (std::find(ctxs.begin(), ctxs.end(), c.ctx) == ctxs.end()) ctxs.push_back(c.ctx);
  }
  std::sort(ctxs.begin(), ctxs.end());
  auto find_cell = [&](const std::string& codec, int ctx) -> const CellResult* {
    for (const auto& c : cells)
      if (c.codec == codec && c.ctx == ctx) return &c;
    return nullptr;
  };
  r << "## Decode tok/s (tokens 2..G; median, min-max)\n\n| codec |";
  for (int x : ctxs) r << " " << x << " |";
  r << "\n|---|";
  for (size_t i = 0; i < ctxs.size(); ++i) r << "---|";
  r << "\n";
  for (const auto& codec : codecs) {
    r << "| " << md(codec) << " |";
    for (int x : ctxs) {
      const CellResult* c = find_cell(codec, x);
      if (!c)
        r << " |";
      else if (!c->measured())
        r << " " << c->status << " |";
      else
        r << " " << sig(c->decode_tps.median) << " (" << sig(c->decode_tps.min) << "-" << sig(c->decode_tps.max)
          << ")" << (c->status == "flagged" ? " **!**" : "") << " |";
    }
    r << "\n";
  }
  r << "\n";

  r << "## Every cell\n\n"
       "| codec | ctx | status | decode tok/s | TTFT s | prefill tok/s | prefills | ITL p50 / p99 ms | KV MiB | "
       "bits/value | device MiB | GB/s | % copy bw | attention kernels | KV host<->device B | digest |\n"
       "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& c : cells) {
    r << "| " << md(c.codec) << " | " << c.ctx << " | " << c.status << (c.flags.empty() ? "" : " (" + join(c.flags, ", ") + ")")
      << " |";
    if (!c.measured()) {
      r << " | | | | | | | | | | | | |\n";
      continue;
    }
    r << " " << sig(c.decode_tps.median) << " (" << sig(c.decode_tps.min) << "-" << sig(c.decode_tps.max) << ") | "
      << sig(c.ttft_s.median) << " | " << sig(c.prefill_tps.median) << " | " << c.prefill_n << " | "
      << sig(c.itl_p50_ms.median) << " / "
      << sig(c.itl_p99_ms.median) << " | " << sig(mib(double(c.kv_bytes))) << " | " << num(c.bits_per_value, 3)
      << " | " << (c.device_mem_delta >= 0 ? sig(mib(double(c.device_mem_delta))) : std::string("n/a")) << " | "
      << sig(c.achieved_gbs) << " | " << (c.pct_copy_bw > 0 ? num(c.pct_copy_bw, 1) : std::string("n/a")) << " | "
      << md(dispatch_summary(c.dispatch)) << " | "
      << (c.dispatch.counted ? std::to_string(c.dispatch.kv_host_to_device_bytes + c.dispatch.kv_device_to_host_bytes)
                             : std::string("n/a"))
      << " | `" << c.digest << "`" << (c.digests_agree ? "" : " (reps differ)") << " |\n";
  }
  r << "\n";

  r << "## ITL fits: ITL p50 = a + b * kv_seq / 1000\n\n";
  if (fits.empty()) {
    r << "No codec has two measured contexts to fit.\n\n";
  } else {
    r << "| codec | a (ms per step) | b (ms per 1k KV tokens) | RMS residual (ms) | points | contexts |\n"
         "|---|---|---|---|---|---|\n";
    for (const auto& f : fits)
      r << "| " << md(f.codec) << " | " << num(f.a_ms, 4) << " | " << num(f.b_ms_per_1k, 5) << " | "
        << num(f.residual_ms, 4) << " | " << f.n_points << " | " << f.ctx_min << "-" << f.ctx_max << " |\n";
    r << "\n";
  }

  if (has_batches(all_cells)) r << batch_section(all_cells);

  std::vector<const CellResult*> problems;
  for (const auto& c : all_cells)
    if (c.status != "ok") problems.push_back(&c);
  r << "## Problems\n\n";
  if (problems.empty()) {
    r << "None: every cell was measured and passed its checks (digests agree, dispatch counts, KV memory).\n\n";
  } else {
    r << "| codec | ctx | batch | status | message |\n|---|---|---|---|---|\n";
    for (const auto* c : problems)
      r << "| " << md(c->codec) << " | " << c->ctx << " | " << c->batch << " | " << c->status
        << (c->flags.empty() ? "" : " (" + join(c->flags, ", ") + ")") << " | " << md(c->error) << " |\n";
    r << "\n";
  }

  r << "## Plots\n\n";
  for (const auto& f : plots.files)
    if (f.size() > 4 && f.compare(f.size() - 4, 4, ".svg") == 0) r << "![" << f << "](" << f << ")\n\n";
  if (!plots.note.empty()) r << plots.note << "\n\n";
  if (!plots.files.empty()) {
    r << "Also as PNG:";
    for (const auto& f : plots.files)
      if (f.size() > 4 && f.compare(f.size() - 4, 4, ".png") == 0) r << " [" << f << "](" << f << ")";
    r << "\n\n";
  }
  r << "How to read this report: docs/bench.md. The numbers are also in `cells.csv` next to this file and in "
       "runs.db (run_id "
    << run.run_id << ").\n";
  return r.str();
}

std::string write_report(const std::string& dir, const RunRow& run, const std::vector<CellResult>& cells,
                         const std::vector<ItlFit>& fits, bool plots, Plots* made) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  KVQ_CHECK(!ec, Errc::io, "cannot create the report folder '", dir, "': ", ec.message());
  {
    std::ofstream csv(fs::path(dir) / "cells.csv");
    KVQ_CHECK(csv.good(), Errc::io, "cannot write '", (fs::path(dir) / "cells.csv").string(), "'");
    csv << csv_header();
    for (const auto& c : cells) csv << csv_row(run.run_id, c);
  }
  Plots p;
  if (plots)
    p = write_plots(dir, cells, fits);
  else
    p.note = "plots were turned off (--no-plots)";
  const fs::path path = fs::path(dir) / "report.md";
  std::ofstream f(path);
  KVQ_CHECK(f.good(), Errc::io, "cannot write '", path.string(), "'");
  f << report_markdown(run, cells, fits, p);
  KVQ_CHECK(f.good(), Errc::io, "short write to '", path.string(), "'");
  if (made) *made = p;
  return path.string();
}

}  // namespace kvq::bench
