#include "eval/codecs.hpp"

#include <algorithm>
#include <cctype>
#include <sstream>

#include "core/error.hpp"
#include "core/text.hpp"

namespace kvq::eval {

EvalCodec parse_eval_codec(const std::string& item) { return CodecRequest::parse(item, "--codecs"); }

std::vector<EvalCodec> all_eval_codecs() {
  std::vector<EvalCodec> out;
  for (const auto& info : kv::codec_table()) out.push_back(parse_eval_codec(info.name));
  for (const auto& info : kv::codec_table()) {  // the --rotor-qjl on forms, as `kvq codecs` lists them
    kv::CodecOptions o;
    o.kv = info.name;
    o.rotor_qjl = true;
    if (kv::resolve_codec(o).k.qjl) out.push_back(parse_eval_codec(info.name + "+qjl"));
  }
  return out;
}

std::vector<EvalCodec> parse_eval_codecs(const std::string& list) {
  std::vector<EvalCodec> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    std::vector<EvalCodec> add;
    if (ascii_lower(trim_space(item)) == "all") add = all_eval_codecs();
    else add.push_back(parse_eval_codec(item));
    for (auto& c : add)
      if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(std::move(c));
  }
  KVQ_CHECK(!out.empty(), Errc::invalid_argument, "--codecs is empty; give e.g. --codecs none,k8v4 or all");
  return out;
}

std::optional<kv::ResolvedCodec> resolve(const EvalCodec& c) { return c.resolve(); }

std::optional<QualityFloor> quality_floor(const EvalCodec& c) {
  const auto r = resolve(c);
  if (!r) return std::nullopt;
  const int bits = std::min(r->k.bits, r->v.bits);  // base bits: bf16 16, q8/rq8/fp8 8, else N
  if (bits >= 16) return std::nullopt;
  if (bits >= 8) return QualityFloor{"8-bit", 0.002, 99.0};
  if (bits >= 4) return QualityFloor{"4-bit", 0.02, 95.0};
  if (bits == 3) return QualityFloor{"3-bit", 0.06, 90.0};
  return QualityFloor{"2-bit", 0.15, 85.0};
}

std::string floor_verdict(const QualityFloor& f, double mean_kl, double top1_pct) {
  const bool kl_ok = mean_kl <= f.max_mean_kl, top1_ok = top1_pct >= f.min_top1_pct;
  if (kl_ok && top1_ok) return "yes";
  if (!kl_ok && !top1_ok) return "no (KL, top-1)";
  return kl_ok ? "no (top-1)" : "no (KL)";
}

}  // namespace kvq::eval
