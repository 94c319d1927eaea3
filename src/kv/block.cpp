// Block names, budgets, row layouts and the factory. The per-family code lives
// in blocks/*.cpp; this file is the one place that says how many bytes a row
// of each block takes.
#include "kv/block.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "kv/bitpack.hpp"
#include "kv/blocks/families.hpp"

namespace kvq::kv {

const char* side_name(Side s) { return s == Side::k ? "K" : "V"; }

const char* family_name(Family f) {
  switch (f) {
    case Family::bf16: return "bf16";
    case Family::q8: return "q8";
    case Family::rq8: return "rq8";
    case Family::fp8: return "fp8";
    case Family::turbo: return "turbo";
    case Family::tcq: return "tcq";
    case Family::iso: return "iso";
    case Family::rotor: return "rotor";
    case Family::planar: return "planar";
  }
  return "?";
}

static Family family_from_name(const std::string& n) {
  for (Family f : {Family::bf16, Family::q8, Family::rq8, Family::fp8, Family::turbo, Family::tcq, Family::iso,
                   Family::rotor, Family::planar})
    if (n == family_name(f)) return f;
  fail(Errc::internal, "no KV block family '", n, "'");
}

std::string BlockSpec::name() const {
  std::string n = family_name(family);
  if (family_has_bits(family)) n += std::to_string(bits);
  if (qjl) n += "+qjl";
  return n;
}

const std::vector<std::string>& block_names() {
  static const std::vector<std::string> names = {
      "bf16",   "q8",     "rq8",    "fp8",    "turbo2", "turbo3", "turbo4",  "tcq2",
      "tcq3",   "iso3",   "iso4",   "rotor3", "rotor4", "planar3", "planar4"};
  return names;
}

static std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

BlockSpec parse_block(const std::string& name_in) {
  std::string name = lower(name_in);
  BlockSpec spec;
  const std::string suffix = "+qjl";
  if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    spec.qjl = true;
    name.resize(name.size() - suffix.size());
  }
  if (name == "f16") name = "bf16";  // the seeds' alias for the raw 16-bit block
  bool found = std::find(block_names().begin(), block_names().end(), name) != block_names().end();
  if (!found) {
    std::string valid;
    for (auto& n : block_names()) valid += (valid.empty() ? "" : ", ") + n;
    fail(Errc::invalid_argument, "unknown KV block '", name_in, "'; valid blocks: ", valid,
         " (any K block may add +qjl, e.g. rotor3+qjl)");
  }
  if (name == "bf16" || name == "q8" || name == "rq8" || name == "fp8") {
    spec.family = family_from_name(name);
    spec.bits = name == "bf16" ? 16 : 8;
  } else {
    size_t p = name.find_first_of("0123456789");
    spec.family = family_from_name(name.substr(0, p));
    spec.bits = std::stoi(name.substr(p));
  }
  return spec;
}

double block_budget_bits(const BlockSpec& b) {
  double base = 0;
  switch (b.family) {
    case Family::bf16: base = 16; break;
    case Family::q8:
    case Family::rq8: base = 8.5; break;
    case Family::fp8: base = 8; break;
    case Family::turbo:
    case Family::tcq: base = b.bits + 0.25; break;
    case Family::iso:
    case Family::rotor:
    case Family::planar: base = b.bits + 0.75; break;
  }
  return base + (b.qjl ? 1.25 : 0.0);
}

// Unpadded code bytes and side bytes of the base block (without +qjl).
static RowLayout base_layout(const BlockSpec& b, int d) {
  const size_t groups = (size_t(d) + kScaleGroup - 1) / kScaleGroup;
  RowLayout l;
  switch (b.family) {
    case Family::bf16: l.code_bytes = round_up(size_t(d) * 2, 4); break;
    case Family::fp8: l.code_bytes = round_up(size_t(d), 4); break;
    case Family::q8:
    case Family::rq8:
      l.code_bytes = round_up(size_t(d), 4);
      l.side_bytes = 2 * groups;  // fp16 scale per group of 32
      break;
    case Family::turbo:
      l.code_bytes = code_bytes(d, b.bits);
      l.side_bytes = 2;  // fp16 row norm
      break;
    case Family::tcq:
      l.code_bytes = plane_bytes(d, 1) + code_bytes(d, b.bits - 1);  // branch plane + level plane
      l.side_bytes = 2;                                               // fp16 row norm
      break;
    case Family::iso:
    case Family::rotor:
    case Family::planar:
      l.code_bytes = code_bytes(d, b.bits);
      l.side_bytes = 2 * groups;  // fp16 scale per group of 32
      break;
  }
  return l;
}

RowLayout block_layout(const BlockSpec& b, int d) {
  KVQ_CHECK(d > 0 && d <= kMaxHeadDim, Errc::unsupported, "head_dim ", d,
            " is not supported by the KV blocks (1..", kMaxHeadDim, ")");
  RowLayout l;
  if (b.qjl) {  // the base row as stored on its own, then the sketch and its norm
    BlockSpec base = b;
    base.qjl = false;
    l = block_layout(base, d);
    l.code_bytes += plane_bytes(d, 1);  // sign sketch, D projections
    l.side_bytes += 2;                  // fp16 residual norm
  } else {
    l = base_layout(b, d);
  }
  // Pad the code row to 16 bytes (one vector load per lane on the GPU) where
  // the budget allows; otherwise to 8, else 4 (e.g. 3-bit rows at D=64 are 24 bytes).
  const double budget = block_budget_bits(b);
  for (size_t align : {size_t(16), size_t(8), size_t(4)}) {
    const size_t c = round_up(l.code_bytes, align);
    if (align == 4 || double(c + l.side_bytes) * 8.0 / d <= budget + 1e-9) {
      l.code_bytes = c;
      break;
    }
  }
  return l;
}

double block_bits_per_value(const BlockSpec& b, int d) {
  return double(block_layout(b, d).row_bytes()) * 8.0 / d;
}

uint64_t derive_seed(uint64_t seed, int layer, int kv_head, Side side, uint64_t purpose) {
  uint64_t x = seed;
  uint64_t h = splitmix64(x);
  x = h ^ (uint64_t(uint32_t(layer)) * 0x100000001b3ull);
  h = splitmix64(x);
  x = h ^ (uint64_t(uint32_t(kv_head)) * 0xc2b2ae3d27d4eb4full);
  h = splitmix64(x);
  x = h ^ (side == Side::k ? 0x4b4b4b4bull : 0x56565656ull);
  h = splitmix64(x);
  x = h ^ (purpose * 0x9e3779b97f4a7c15ull);
  return splitmix64(x);
}

void Block::decode(const uint8_t* code, const uint8_t* side, float* x) const {
  std::vector<float> y(static_cast<size_t>(dim_));
  decode_rotated(code, side, y.data());
  unrotate(y.data(), x);
}

void Block::prepare_query(const float* q_rot, std::vector<float>& qstate) const {
  qstate.assign(q_rot, q_rot + dim_);
}

std::unique_ptr<Block> make_block(const BlockSpec& spec, int d, uint64_t seed, int layer,
                                  int kv_head, Side side) {
  const RowLayout layout = block_layout(spec, d);
  if (spec.qjl) {
    KVQ_CHECK(side == Side::k, Errc::invalid_argument, "+qjl is a K-side option (it makes q.k unbiased); ",
              "remove it from the V block '", spec.name(), "'");
    BlockSpec base = spec;
    base.qjl = false;
    return make_qjl_block(spec, layout, make_block(base, d, seed, layer, kv_head, side), seed, layer,
                          kv_head);
  }
  const uint64_t s = derive_seed(seed, layer, kv_head, side, 1);
  switch (spec.family) {
    case Family::bf16: return make_bf16_block(spec, d, layout);
    case Family::fp8: return make_fp8_block(spec, d, layout);
    case Family::q8:
    case Family::rq8: return make_q8_block(spec, d, layout, s);
    case Family::turbo: return make_turbo_block(spec, d, layout, s);
    case Family::tcq: return make_tcq_block(spec, d, layout, s);
    case Family::iso:
    case Family::rotor:
    case Family::planar: return make_grouped_block(spec, d, layout, s);
  }
  fail(Errc::internal, "make_block: unknown family");
}

}  // namespace kvq::kv
