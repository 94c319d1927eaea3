#include "kv/codec_table.hpp"

#include <cctype>

#include "core/error.hpp"

namespace kvq::kv {

const std::vector<CodecInfo>& codec_table() {
  // name, aliases, K, V, notes, seed codec
  static const std::vector<CodecInfo> table = {
      {"none", {"bf16", "f16"}, "bf16", "bf16", "reference", true},
      {"k8v8", {}, "q8", "q8", "", true},
      {"k8v4", {}, "q8", "turbo4", "", true},
      {"k8vturbo3", {}, "q8", "turbo3", "", true},
      {"k8vturbo2", {}, "q8", "turbo2", "", true},
      {"k8vturbo3tcq", {}, "q8", "tcq3", "", true},
      {"k8vturbo2tcq", {}, "q8", "tcq2", "", true},
      {"tsym3", {}, "turbo3", "turbo3", "", true},
      {"tsym4", {}, "turbo4", "turbo4", "", true},
      {"planar", {}, "q8", "planar4", "", true},
      {"planar3", {}, "q8", "planar3", "", true},
      {"planar_k", {}, "planar4", "bf16", "K-only", true},
      {"iso3", {}, "q8", "iso3", "", true},
      {"iso4", {}, "q8", "iso4", "", true},
      {"iso3_sym", {}, "iso3", "iso3", "", true},
      {"iso4_sym", {}, "iso4", "iso4", "", true},
      {"k_iso3", {}, "iso3", "bf16", "K-only", true},
      {"k_iso4", {}, "iso4", "bf16", "K-only", true},
      {"rotor3", {}, "q8", "rotor3", "", true},
      {"rotor4", {}, "q8", "rotor4", "", true},
      {"rotor3_sym", {}, "rotor3", "rotor3", "", true},
      {"rotor4_sym", {}, "rotor4", "rotor4", "", true},
      {"k_rotor3", {}, "rotor3", "bf16", "K-only", true},
      {"k_rotor4", {}, "rotor4", "bf16", "K-only", true},
      {"rot_k_tq4v", {}, "rq8", "turbo4", "", true},
      // kvq extras beyond the seeds
      {"fp8", {"e4m3"}, "fp8", "fp8", "e4m3 K and V (Hopper-native), saturating, no scales", false},
  };
  return table;
}

static std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

const CodecInfo* find_codec(const std::string& name) {
  const std::string n = lower(name);
  for (const auto& c : codec_table()) {
    if (c.name == n) return &c;
    for (const auto& a : c.aliases)
      if (a == n) return &c;
  }
  return nullptr;
}

std::string codec_names_list() {
  std::string s;
  for (const auto& c : codec_table()) s += (s.empty() ? "" : ", ") + c.name;
  return s;
}

ResolvedCodec resolve_codec(const CodecOptions& opts) {
  // "NAME+qjl" is NAME with a QJL sketch on its K side: the rows `kvq codecs`
  // lists as "rotor3_sym+qjl" are accepted as written (= --rotor-qjl on).
  std::string base_name = opts.kv;
  bool named_qjl = false;
  const std::string suffix = "+qjl";
  if (base_name.size() > suffix.size()) {
    std::string tail = base_name.substr(base_name.size() - suffix.size());
    for (auto& c : tail) c = char(std::tolower(static_cast<unsigned char>(c)));
    if (tail == suffix) {
      base_name.resize(base_name.size() - suffix.size());
      named_qjl = true;
    }
  }
  const CodecInfo* info = find_codec(base_name);
  KVQ_CHECK(info, Errc::invalid_argument, "unknown KV codec '", opts.kv, "'; valid codecs: ",
            codec_names_list(), " (aliases: bf16, f16 = none; any codec may add +qjl to its K side, e.g. ",
            "rotor3_sym+qjl; or per side: --ctk BLOCK --ctv BLOCK)");
  ResolvedCodec r;
  r.k = parse_block(info->k_block);
  r.v = parse_block(info->v_block);
  if (named_qjl) {
    KVQ_CHECK(r.k.family != Family::bf16, Errc::invalid_argument, "'", opts.kv,
              "': +qjl sketches the residual of a quantized K side; ", info->name, " keeps K in bf16");
    r.k.qjl = true;
  }
  const bool per_side = !opts.ctk.empty() || !opts.ctv.empty();
  if (!opts.ctk.empty()) r.k = parse_block(opts.ctk);
  if (!opts.ctv.empty()) r.v = parse_block(opts.ctv);
  KVQ_CHECK(!r.v.qjl, Errc::invalid_argument, "+qjl is a K-side option (it makes q.k unbiased); ",
            "remove it from --ctv '", opts.ctv, "'");
  bool qjl_added = named_qjl;
  if (opts.rotor_qjl && r.k.family == Family::rotor && !r.k.qjl) {
    r.k.qjl = true;
    qjl_added = true;
  }
  if (!per_side) {
    r.name = info->name + (qjl_added ? "+qjl" : "");
  } else {
    r.name.clear();
    for (const auto& c : codec_table())  // a per-side pair that is a named codec keeps its name
      if (parse_block(c.k_block) == r.k && parse_block(c.v_block) == r.v) {
        r.name = c.name;
        break;
      }
    if (r.name.empty()) r.name = "ctk=" + r.k.name() + ",ctv=" + r.v.name();
  }
  return r;
}

size_t codec_bytes_per_token_per_head(const ResolvedCodec& c, int head_dim) {
  return block_layout(c.k, head_dim).row_bytes() + block_layout(c.v, head_dim).row_bytes();
}

static SideDescriptor describe_side(const BlockSpec& b, int head_dim) {
  SideDescriptor d;
  d.spec = b;
  const RowLayout l = block_layout(b, head_dim);
  d.code_bytes = uint32_t(l.code_bytes);
  d.side_bytes = uint32_t(l.side_bytes);
  if (b.qjl) {
    BlockSpec base = b;
    base.qjl = false;
    const RowLayout bl = block_layout(base, head_dim);
    d.qjl_code_offset = uint32_t(bl.code_bytes);
    d.qjl_side_offset = uint32_t(bl.side_bytes);
  }
  d.rotation = b.family != Family::bf16 && b.family != Family::q8 && b.family != Family::fp8;
  d.codebook = b.family == Family::turbo || b.family == Family::iso || b.family == Family::rotor ||
               b.family == Family::planar;
  d.trellis = b.family == Family::tcq;
  return d;
}

CodecDescriptor describe_codec(const ResolvedCodec& c, int head_dim) {
  CodecDescriptor d;
  d.name = c.name;
  d.head_dim = head_dim;
  d.k = describe_side(c.k, head_dim);
  d.v = describe_side(c.v, head_dim);
  return d;
}

}  // namespace kvq::kv
