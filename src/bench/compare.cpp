#include "bench/compare.hpp"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "bench/report_text.hpp"
#include "core/error.hpp"

namespace kvq::bench {

namespace {

// Ranges entirely apart (beyond the repetitions' noise) and medians apart by
// more than min_change. higher_is_better: tok/s; lower: TTFT.
int judge(const Spread& a, const Spread& b, bool higher_is_better, double min_change) {
  if (a.median <= 0 || b.median <= 0) return 0;
  const double ratio = b.median / a.median;
  const bool above = b.min > a.max && ratio > 1 + min_change;
  const bool below = b.max < a.min && ratio < 1 - min_change;
  if (!above && !below) return 0;
  return (above == higher_is_better) ? +1 : -1;  // +1 better, -1 worse
}

}  // namespace

Comparison compare_cells(const std::vector<CellResult>& a, const std::vector<CellResult>& b, double min_change) {
  Comparison cmp;
  // A cell is (codec, context, batch size).
  auto find = [](const std::vector<CellResult>& v, const CellResult& like) -> const CellResult* {
    for (const auto& c : v)
      if (c.codec == like.codec && c.ctx == like.ctx && c.batch == like.batch) return &c;
    return nullptr;
  };
  auto add = [&](const CellResult* ca, const CellResult* cb) {
    CellDelta d;
    d.codec = ca ? ca->codec : cb->codec;
    d.ctx = ca ? ca->ctx : cb->ctx;
    d.batch = ca ? ca->batch : cb->batch;
    d.a = ca;
    d.b = cb;
    if (!ca) {
      d.verdict = "only in B";
    } else if (!cb) {
      d.verdict = "only in A";
    } else if (ca->measured() && cb->measured()) {
      d.tps_ratio = ca->decode_tps.median > 0 ? cb->decode_tps.median / ca->decode_tps.median : 0;
      d.ttft_ratio = ca->ttft_s.median > 0 ? cb->ttft_s.median / ca->ttft_s.median : 0;
      d.itl_ratio = ca->itl_p50_ms.median > 0 ? cb->itl_p50_ms.median / ca->itl_p50_ms.median : 0;
      const int tps = judge(ca->decode_tps, cb->decode_tps, true, min_change);
      const int ttft = judge(ca->ttft_s, cb->ttft_s, false, min_change);
      std::vector<std::string> worse, better;
      (tps < 0 ? worse : better).push_back("decode");
      if (tps == 0) better.pop_back();
      (ttft < 0 ? worse : better).push_back("ttft");
      if (ttft == 0) better.pop_back();
      if (!worse.empty()) {
        d.regression = true;
        d.verdict = "REGRESSION: " + worse[0] + (worse.size() > 1 ? ", " + worse[1] : "");
      } else if (!better.empty()) {
        d.improvement = true;
        d.verdict = "faster: " + better[0] + (better.size() > 1 ? ", " + better[1] : "");
      } else {
        d.verdict = "same (within noise)";
      }
      if (cb->status == "flagged" && ca->status == "ok") {
        d.regression = true;
        d.verdict += "; REGRESSION: now flagged";
      }
    } else if (ca->measured()) {
      d.regression = true;
      d.verdict = "REGRESSION: now " + cb->status;
    } else if (cb->measured()) {
      d.improvement = true;
      d.verdict = "fixed (was " + ca->status + ")";
    } else {
      d.verdict = ca->status == cb->status ? "both " + ca->status : ca->status + " -> " + cb->status;
    }
    cmp.regressions += d.regression;
    cmp.improvements += d.improvement;
    cmp.rows.push_back(d);
  };
  for (const auto& ca : a) add(&ca, find(b, ca));
  for (const auto& cb : b)
    if (!find(a, cb)) add(nullptr, &cb);
  return cmp;
}

std::string format_comparison(const RunRow& a, const RunRow& b, const Comparison& c) {
  std::ostringstream o;
  auto describe = [&](const char* tag, const RunRow& r) {
    o << "- " << tag << ": run " << r.run_id << ", " << r.meta.started_at << ", " << r.meta.model << " on "
      << r.meta.device << " (" << r.meta.gpu_name << "), git " << r.meta.git_sha << ", " << r.meta.build_type
      << ", copy bw " << num(r.meta.copy_bw_gbs, 1) << " GB/s, " << r.status << "\n";
  };
  describe("A", a);
  describe("B", b);
  if (a.meta.device != b.meta.device || a.meta.gpu_name != b.meta.gpu_name)
    o << "- note: the runs used different devices; ratios compare machines, not code\n";
  o << "\n| codec | ctx | A tok/s (min-max) | B tok/s (min-max) | B/A tok/s | B/A TTFT | B/A ITL p50 | verdict |\n"
       "|---|---|---|---|---|---|---|---|\n";
  auto tps = [](const CellResult* x) -> std::string {
    if (!x) return "-";
    if (!x->measured()) return x->status;
    return num(x->decode_tps.median, 1) + " (" + num(x->decode_tps.min, 1) + "-" + num(x->decode_tps.max, 1) + ")";
  };
  auto ratio = [](double r) { return r > 0 ? num(r, 3) : std::string("-"); };
  for (const auto& d : c.rows)
    o << "| " << d.codec << " | " << d.ctx << (d.batch > 1 ? " x" + std::to_string(d.batch) : std::string()) << " | "
      << tps(d.a) << " | " << tps(d.b) << " | " << ratio(d.tps_ratio)
      << " | " << ratio(d.ttft_ratio) << " | " << ratio(d.itl_ratio) << " | " << d.verdict << " |\n";
  o << "\n" << c.regressions << " regression(s), " << c.improvements << " improvement(s) in " << c.rows.size()
    << " cells (beyond noise: min-max ranges apart and medians more than the threshold apart).\n";
  return o.str();
}

std::string format_run_list(const RunsDb& db, const std::string& kind) {
  std::ostringstream o;
  const auto runs = db.runs(kind);
  if (runs.empty()) {
    o << "no runs in " << db.path() << "\n";
    return o.str();
  }
  char line[512];
  std::snprintf(line, sizeof line, "%-5s %-20s %-6s %-11s %-6s %-16s %-20s %s\n", "id", "started (UTC)", "kind",
                "status", "device", "git", "cells ok/all", "model");
  o << line;
  for (const auto& r : runs) {
    std::string cells = "-";
    if (r.meta.kind == "bench") {
      const auto cs = db.cells(r.run_id);
      const auto ok = std::count_if(cs.begin(), cs.end(), [](const CellResult& c) { return c.status == "ok"; });
      cells = std::to_string(ok) + "/" + std::to_string(cs.size());
    } else if (r.meta.kind == "serve") {
      cells = std::to_string(db.serve_levels(r.run_id).size()) + " levels";
    } else {
      cells = std::to_string(db.eval_results(r.run_id).size()) + " results";
    }
    std::snprintf(line, sizeof line, "%-5lld %-20s %-6s %-11s %-6s %-16s %-20s %s\n", (long long)r.run_id,
                  r.meta.started_at.c_str(), r.meta.kind.c_str(), r.status.c_str(), r.meta.device.c_str(),
                  r.meta.git_sha.c_str(), cells.c_str(), r.meta.model.c_str());
    o << line;
  }
  return o.str();
}

int64_t resolve_run_id(const RunsDb& db, const std::string& ref, const std::string& kind) {
  const std::string latest = "latest";
  if (ref.rfind(latest, 0) == 0) {
    int back = 0;
    if (ref.size() > latest.size()) {
      KVQ_CHECK(ref[latest.size()] == '~', Errc::invalid_argument, "run '", ref,
                "' is not a run id, latest or latest~N");
      try {
        back = std::stoi(ref.substr(latest.size() + 1));
      } catch (const std::exception&) {
        fail(Errc::invalid_argument, "run '", ref, "' is not a run id, latest or latest~N");
      }
    }
    const auto runs = db.runs(kind);
    KVQ_CHECK(back >= 0 && back < int(runs.size()), Errc::invalid_argument, "there is no run '", ref, "' in ",
              db.path(), " (", runs.size(), " ", kind.empty() ? "" : kind + " ", "runs)");
    return runs[runs.size() - 1 - size_t(back)].run_id;
  }
  size_t used = 0;
  long long id = 0;
  try {
    id = std::stoll(ref, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  KVQ_CHECK(used == ref.size() && !ref.empty(), Errc::invalid_argument, "run '", ref,
            "' is not a run id, latest or latest~N (see `kvq bench list`)");
  const auto row = db.run(id);
  KVQ_CHECK(row.has_value(), Errc::invalid_argument, "there is no run ", id, " in ", db.path(),
            " (see `kvq bench list`)");
  KVQ_CHECK(kind.empty() || row->meta.kind == kind, Errc::invalid_argument, "run ", id, " is a ", row->meta.kind,
            " run, not a ", kind, " run");
  return id;
}

}  // namespace kvq::bench
