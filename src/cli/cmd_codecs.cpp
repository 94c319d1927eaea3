// kvq codecs: every KV codec of the codec table with its K/V blocks, bits per
// value (against the spec's budgets), bytes per token per layer and whether a
// fused GPU decode exists. --sqnr measures the blocks' round-trip SQNR (the
// numbers of docs/codecs.md, same code as the tests); --design-tcq reruns the
// TCQ codebook design that kv/tcq.cpp tabulates. Quality on a model (KL,
// top-1, perplexity, needle) is `kvq eval` (src/eval).
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "backend/backend.hpp"
#include "cli/command.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "gguf/gguf.hpp"
#include "kv/block.hpp"
#include "kv/codebook.hpp"
#include "kv/codec_table.hpp"
#include "kv/quality.hpp"
#include "model/config.hpp"
#include "kv/tcq.hpp"

namespace kvq::cli {
namespace {

struct CodecsArgs {
  int head_dim = 128;
  int kv_heads = 0;  // 0: report per KV head
  int n_heads = 0;   // query heads (from -m); the GPU column assumes Qwen3-8B's 32 / 8 without a model
  int gpu_kv_heads() const { return kv_heads > 0 ? kv_heads : 8; }
  int gpu_heads() const { return n_heads > 0 ? n_heads : gpu_kv_heads() * 4; }
  bool json = false;
  bool sqnr = false;
  bool design_tcq = false;
  std::string model;  // -m: GGUF (head_dim and KV heads from it)
};

nlohmann::ordered_json block_json(const kv::BlockSpec& b, int d) {
  const kv::RowLayout l = kv::block_layout(b, d);
  const double bits = kv::block_bits_per_value(b, d);
  return {{"name", b.name()},
          {"bits_per_value", bits},
          {"budget_bits", kv::block_budget_bits(b)},
          {"within_budget", bits <= kv::block_budget_bits(b) + 1e-9},
          {"code_bytes_per_row", l.code_bytes},
          {"side_bytes_per_row", l.side_bytes},
          {"k_only", b.qjl}};
}

nlohmann::ordered_json codec_json(const kv::CodecInfo& info, const kv::ResolvedCodec& rc, const std::string& form,
                          const CodecsArgs& a) {
  const int d = a.head_dim;
  const double kb = kv::block_bits_per_value(rc.k, d), vb = kv::block_bits_per_value(rc.v, d);
  const size_t per_head = kv::codec_bytes_per_token_per_head(rc, d);
  nlohmann::ordered_json j = {{"name", rc.name},
                      {"form", form},
                      {"aliases", form == "named" ? info.aliases : std::vector<std::string>{}},
                      {"seed_codec", info.seed_codec},
                      {"k_block", rc.k.name()},
                      {"v_block", rc.v.name()},
                      {"k_bits", kb},
                      {"v_bits", vb},
                      {"avg_bits", 0.5 * (kb + vb)},
                      {"k_budget_bits", kv::block_budget_bits(rc.k)},
                      {"v_budget_bits", kv::block_budget_bits(rc.v)},
                      {"within_budget", kb <= kv::block_budget_bits(rc.k) + 1e-9 &&
                                            vb <= kv::block_budget_bits(rc.v) + 1e-9},
                      {"bytes_per_token_per_layer", per_head * size_t(a.kv_heads > 0 ? a.kv_heads : 1)},
                      {"notes", info.notes}};
  // The CUDA kernel selector's answer at this shape (no GPU needed).
  const GpuCodecSupport gpu = gpu_codec_support(rc.k, rc.v, d, a.gpu_heads(), a.gpu_kv_heads());
  j["gpu_fused_decode"] = gpu.supported;
  j["gpu_decode_kernel"] = gpu.decode_kernel;
  j["gpu_prefill_kernel"] = gpu.prefill_kernel;
  if (!gpu.supported) j["gpu_why"] = gpu.why;
  if (form == "rotor_qjl") j["options"] = "--kv " + info.name + " --rotor-qjl on";
  return j;
}

int run_codecs(CodecsArgs a) {
  if (!a.model.empty()) {  // geometry from the model
    const ModelConfig cfg = ModelConfig::from_gguf(gguf::File::open(a.model));
    a.head_dim = cfg.head_dim;
    a.kv_heads = cfg.n_kv_heads;
    a.n_heads = cfg.n_heads;
  }
  KVQ_CHECK(a.head_dim > 0, Errc::invalid_argument, "--head-dim must be positive");
  if (a.design_tcq) {
    for (int bits : {2, 3}) {
      const auto r = kv::design_tcq_default(bits);
      std::printf("tcq%d: memory %d (%d states), g0 %#x, g1 %#x, training SQNR %.4f dB (Lloyd-Max %.4f dB)\n  levels {",
                  bits, r.trellis.memory, r.trellis.states(), r.trellis.g0, r.trellis.g1, r.sqnr_db(),
                  kv::lloyd_max_gaussian(bits).sqnr_db());
      for (float l : r.trellis.levels) std::printf("%.9gf, ", l);
      std::printf("}\n");
    }
    return 0;
  }
  if (a.sqnr) {
    nlohmann::ordered_json rows = nlohmann::ordered_json::array();
    if (!a.json)
      std::printf("Round-trip SQNR (dB), %d rows, seed %#llx; outliers: D/32 channels x20\n"
                  "| block | bits/value | Gaussian D=64 | D=128 | D=256 | outliers D=%d | Lloyd-Max |\n"
                  "|---|---|---|---|---|---|---|\n",
                  kv::kSqnrRows, (unsigned long long)kv::kSqnrSeed, a.head_dim);
    for (const auto& n : kv::block_names()) {
      const kv::BlockSpec b = kv::parse_block(n);
      auto sq = [&](int d, kv::Fixture f) { return kv::measure_sqnr_db(b, d, f, kv::kSqnrRows, kv::kSqnrSeed); };
      const double g64 = sq(64, kv::Fixture::gaussian), g128 = sq(128, kv::Fixture::gaussian),
                   g256 = sq(256, kv::Fixture::gaussian), out = sq(a.head_dim, kv::Fixture::outliers);
      const bool lm = b.bits <= 4;
      const double lm_db = lm ? kv::lloyd_max_gaussian(b.bits).sqnr_db() : 0;
      if (a.json) {
        rows.push_back({{"block", n}, {"bits_per_value", kv::block_bits_per_value(b, a.head_dim)},
                        {"gaussian_d64", g64}, {"gaussian_d128", g128}, {"gaussian_d256", g256},
                        {"outliers", out}, {"lloyd_max_db", lm ? nlohmann::ordered_json(lm_db) : nlohmann::ordered_json()}});
      } else {
        char lm_buf[32] = "-";
        if (lm) std::snprintf(lm_buf, sizeof lm_buf, "%.2f", lm_db);
        const std::string lm_s = lm_buf;
        std::printf("| %s | %.3f | %.2f | %.2f | %.2f | %.2f | %s |\n", n.c_str(),
                    kv::block_bits_per_value(b, a.head_dim), g64, g128, g256, out,
                    lm_s.c_str());
      }
    }
    if (a.json) std::printf("%s\n", nlohmann::ordered_json{{"head_dim", a.head_dim}, {"sqnr", rows}}.dump(2).c_str());
    return 0;
  }

  nlohmann::ordered_json codecs = nlohmann::ordered_json::array();
  for (const auto& info : kv::codec_table()) {
    kv::CodecOptions o;
    o.kv = info.name;
    codecs.push_back(codec_json(info, kv::resolve_codec(o), "named", a));
  }
  for (const auto& info : kv::codec_table()) {  // --rotor-qjl on: +qjl on rotor K sides
    kv::CodecOptions o;
    o.kv = info.name;
    o.rotor_qjl = true;
    const auto rc = kv::resolve_codec(o);
    if (rc.k.qjl) codecs.push_back(codec_json(info, rc, "rotor_qjl", a));
  }
  nlohmann::ordered_json blocks = nlohmann::ordered_json::array();
  for (const auto& n : kv::block_names()) {
    kv::BlockSpec b = kv::parse_block(n);
    blocks.push_back(block_json(b, a.head_dim));
    b.qjl = true;
    blocks.push_back(block_json(b, a.head_dim));
  }
  if (a.json) {
    nlohmann::ordered_json doc = {
        {"head_dim", a.head_dim},
        {"kv_heads", a.kv_heads > 0 ? a.kv_heads : 1},
        {"bytes_per_token_per_layer_counts", a.kv_heads > 0 ? "all KV heads, K and V" : "one KV head, K and V"},
        {"codecs", codecs},
        {"blocks", blocks},
        {"per_side", "--ctk BLOCK --ctv BLOCK composes any K block (optionally +qjl) with any V block"}};
    std::printf("%s\n", doc.dump(2).c_str());
    return 0;
  }
  std::printf("KV codecs at head_dim %d; bytes per token per layer %s\n", a.head_dim,
              a.kv_heads > 0 ? str("for ", a.kv_heads, " KV heads (K+V)").c_str() : "per KV head (K+V)");
  std::printf("%-16s %-12s %-8s %6s %6s %6s %8s %4s  %s\n", "codec", "K", "V", "K bpv", "V bpv", "avg", "bytes/tok",
              "gpu", "notes");
  for (const auto& c : codecs) {
    std::string notes = c["notes"].get<std::string>();
    if (!c["aliases"].empty()) {
      std::string al;
      for (const auto& x : c["aliases"]) al += (al.empty() ? "" : ", ") + x.get<std::string>();
      notes = "aliases: " + al + (notes.empty() ? "" : "; " + notes);
    }
    if (c.contains("options")) notes = c["options"].get<std::string>();
    if (!c["within_budget"].get<bool>()) notes += " OVER BUDGET";
    std::printf("%-16s %-12s %-8s %6.3f %6.3f %6.3f %8zu %4s  %s\n", c["name"].get<std::string>().c_str(),
                c["k_block"].get<std::string>().c_str(), c["v_block"].get<std::string>().c_str(),
                c["k_bits"].get<double>(), c["v_bits"].get<double>(), c["avg_bits"].get<double>(),
                c["bytes_per_token_per_layer"].get<size_t>(), c["gpu_fused_decode"].get<bool>() ? "yes" : "no",
                notes.c_str());
  }
  std::printf("\nPer side: --ctk BLOCK --ctv BLOCK (names are case-insensitive; any K block may add +qjl)\n");
  std::printf("%-12s %6s %7s %6s %6s\n", "block", "bpv", "budget", "code", "side");
  for (const auto& b : blocks)
    std::printf("%-12s %6.3f %7.3f %6zu %6zu\n", b["name"].get<std::string>().c_str(), b["bits_per_value"].get<double>(),
                b["budget_bits"].get<double>(), b["code_bytes_per_row"].get<size_t>(),
                b["side_bytes_per_row"].get<size_t>());
  return 0;
}

}  // namespace

KVQ_REGISTER_COMMAND("codecs", "List the KV codecs: blocks, bits per value, bytes per token, GPU decode",
                     [](CLI::App& sub) -> std::function<int()> {
                       auto a = std::make_shared<CodecsArgs>();
                       sub.add_option("--head-dim", a->head_dim, "Head dimension D (default 128)");
                       sub.add_option("--kv-heads", a->kv_heads,
                                      "KV heads per layer; bytes per token are then for all of them")
                           ->check(in_range(0, 4096, false, " (0: per KV head)"));
                       sub.add_flag("--json", a->json, "Machine-readable output");
                       sub.add_option("-m,--model", a->model, "GGUF model: head_dim and KV heads from it");
                       sub.add_flag("--sqnr", a->sqnr, "Measure every block's round-trip SQNR (as the tests do)");
                       sub.add_flag("--design-tcq", a->design_tcq,
                                    "Rerun the TCQ union-codebook design (prints the table kv/tcq.cpp holds)");
                       return [a] { return run_codecs(*a); };
                     });

}  // namespace kvq::cli
