// What `kvq eval` compares: a list of caches to run the model with. An entry
// is a named codec (`k8v4`, aliases allowed), a rotor codec with the QJL
// sketch (`rotor3_sym+qjl`, i.e. --kv rotor3_sym --rotor-qjl on), a per-side
// K/V block pair (`turbo3/bf16` = --ctk turbo3 --ctv bf16), or `f32`, the
// exact fp32 reference cache of the CPU backend (no codec at all).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/runtime.hpp"
#include "kv/cache.hpp"
#include "kv/codec_table.hpp"

namespace kvq {
class Model;
}

namespace kvq::eval {

// An entry is a CodecRequest (engine/runtime.hpp); label() is its canonical
// spelling: "k8v4", "turbo3/bf16", "f32".
using EvalCodec = CodecRequest;

// One entry (see above): CodecRequest::parse. Throws kvq::Error
// (invalid_argument) listing the valid forms for an unknown name.
EvalCodec parse_eval_codec(const std::string& item);
// A comma-separated list; "all" expands to every codec of the table plus the
// rotor +qjl forms (what `kvq codecs` lists). Duplicates are dropped.
std::vector<EvalCodec> parse_eval_codecs(const std::string& list);
std::vector<EvalCodec> all_eval_codecs();

// Blocks of a codec entry; nullopt for f32.
std::optional<kv::ResolvedCodec> resolve(const EvalCodec& c);


// The spec's quality class of a codec (../shared/spec/codecs.md, property 5):
// by the weaker side's base bits (a +qjl sketch does not change the class).
struct QualityFloor {
  std::string name;     // "8-bit", "4-bit", "3-bit", "2-bit"
  double max_mean_kl;   // 0.002 / 0.02 / 0.06 / 0.15
  double min_top1_pct;  // 99 / 95 / 90 / 85
};
// nullopt for the 16-bit reference (bf16 on both sides) and for f32.
std::optional<QualityFloor> quality_floor(const EvalCodec& c);
// "yes", or "no (KL)", "no (top-1)", "no (KL, top-1)".
std::string floor_verdict(const QualityFloor& f, double mean_kl, double top1_pct);

}  // namespace kvq::eval
