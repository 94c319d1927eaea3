#include "cli/options.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <limits>

#include "core/error.hpp"
#include "core/log.hpp"
#include "model/model_spec.hpp"
#include "core/threads.hpp"

namespace kvq::cli {

namespace fs = std::filesystem;

namespace {

std::string number_text(double v) {
  if (v == std::numeric_limits<double>::infinity()) return "inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace

CLI::Validator in_range(double lo, double hi, bool lo_open, const std::string& note) {
  // CLI11's own range check prints its bounds in full (a 309-digit maximum
  // for "non-negative"); this one prints the range as a user would write it.
  const std::string range = hi == std::numeric_limits<double>::infinity()
                                ? (lo_open ? "greater than " : "at least ") + number_text(lo)
                                : (lo_open ? "in (" : "in [") + number_text(lo) + ", " + number_text(hi) + "]";
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || end == s.c_str() || *end != '\0' || std::isnan(v))
          return "'" + s + "' is not a number; it must be " + range + note;
        if (v < lo || v > hi || (lo_open && v == lo)) return s + " is out of range: it must be " + range + note;
        return std::string();
      },
      range);
}

void add_model_source_options(CLI::App& app, ModelOptions& o) {
  constexpr double kIntMax = double(std::numeric_limits<int>::max());
  app.add_option("-m,--model", o.model,
                 "GGUF model file, or synthetic:SHAPE (see `kvq synth --list`) (default: $KVQ_MODEL or the embedded "
                 "models/kvq-tiny-code.gguf)");
  app.add_option("-t,--threads", o.threads,
                 "CPU threads (default: the usable cores that other processes are not keeping busy; 0: the default)")
      ->check(in_range(0, 1024, false, " (0: the default)"));
  app.add_option("--device", o.device, "Compute device: cpu or cuda")->capture_default_str();
  app.add_option("--prefill-chunk", o.prefill_chunk,
                 "Prompt tokens per forward pass during prefill (default: 512 on cpu; on cuda 8192 for one sequence, "
                 "2048 for the server and eval)")
      ->check(in_range(1, kIntMax, false, ""));
}

void add_model_options(CLI::App& app, ModelOptions& o) {
  constexpr double kIntMax = double(std::numeric_limits<int>::max());
  add_model_source_options(app, o);
  app.add_option("--ctx", o.ctx, "Context size in tokens (default: min(model context, max(4096, prompt + n)))")
      ->check(in_range(1, kIntMax, false, " tokens (leave --ctx out for the default)"));
  app.add_option("--kv", o.codec.kv, "KV cache codec (see `kvq codecs`)")->capture_default_str();
  app.add_option("--ctk", o.codec.ctk, "K-side block, overriding the codec's");
  app.add_option("--ctv", o.codec.ctv, "V-side block, overriding the codec's");
  app.add_option("--rotor-qjl", o.rotor_qjl, "Add a 1-bit QJL residual sketch to rotor K sides: on|off")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  auto* f32 = app.add_flag("--f32-kv", o.f32_kv,
                           "Keep K/V in exact fp32 (the reference cache, no codec): for logit comparisons with fp32 "
                           "references");
  for (const char* codec_flag : {"--kv", "--ctk", "--ctv", "--rotor-qjl"}) f32->excludes(app.get_option(codec_flag));
  add_kv_window_option(app, o.kv_window);
  f32->excludes(app.get_option("--kv-window"));
  add_backend_lab_options(app, o.backend);
}

void add_kv_window_option(CLI::App& app, int& pages, const std::string& description) {
  pages = CodecRequest::kWindowAuto;
  app.add_option_function<std::string>(
         "--kv-window",
         [&pages](const std::string& v) {
           pages = v == "auto" ? CodecRequest::kWindowAuto : std::stoi(v);
         },
         (description.empty()
              ? "Exact recent window: each sequence's newest W 64-token pages (the partial one included) stay bf16 "
                "beside the codec's pages and are attended exactly; a page is encoded when it leaves (rows named "
                "NAME+winW)"
              : description) +
             ". 0: none; auto: " + std::to_string(CodecRequest::kDefaultWindowPages) +
             " page for a K side under 8 bits or a V side of 3 bits or fewer, else 0 (docs/quality.md)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            if (v == "auto") return {};
            if (v.empty() || v.size() > 6 || v.find_first_not_of("0123456789") != std::string::npos)
              return "'" + v + "' is not a number of pages (0, 1, 2, ...) or auto";
            return in_range(0, 1 << 16, false, " pages")(v);
          },
          "W|auto"))
      ->default_str("auto");
}

void add_backend_lab_options(CLI::App& app, BackendOptions& b) {
  // Experiment knobs (A/B measurements on the GPU), grouped in --help.
  const char* lab = "Experiment knobs";
  app.add_flag_callback("--no-step-graphs", [&b] { b.step_graphs = false; },
                        "Run every decode step's kernels directly instead of replaying a recorded step (CUDA graph)")
      ->group(lab);
  app.add_flag_callback("--kv-one-page", [&b] { b.session_one_page = true; },
                        "A one-sequence KV cache as one page of the whole context (the contiguous layout of before "
                        "paging) instead of 64-token pages")
      ->group(lab);
  app.add_flag_callback("--no-pdl", [&b] { b.dependent_launches = false; },
                        "CUDA: launch the step's kernels without programmatic dependent launches")
      ->group(lab);
  app.add_flag_callback("--no-fused-q", [&b] { b.attn_fused_q = false; },
                        "CUDA: the store's encode norms and rotates q before the decode attention starts "
                        "(instead of the attention doing it beside the encode)")
      ->group(lab);
  app.add_flag_callback("--no-wgmma-prefill", [&b] { b.prefill_wgmma = false; },
                        "CUDA: the prefill attention on its mma.sync kernel instead of the Hopper (wgmma) one")
      ->group(lab);
  app.add_option("--gemv-warps", b.gemv_warps, "CUDA: warps per decode GEMV CTA")
      ->check(CLI::Range(1, 16))
      ->capture_default_str()
      ->group(lab);
  app.add_option("--batch-gemm-rows", b.batch_gemm_rows,
                 "CUDA: sequences in a decode step from which quantized weight products run on tensor cores "
                 "(0: never)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str()
      ->group(lab);
  app.add_flag("--gemm-tc-prestage,!--no-gemm-tc-prestage", b.gemm_tc_prestage,
               "CUDA: the tensor-core batched GEMM quantizes its input once per launch (default; --no-... stages "
               "it in every CTA, for A/B runs)")
      ->group(lab);
  app.add_option("--attn-prefetch", b.attn_prefetch_tiles,
                 "CUDA: K/V tiles per warp the decode attention asks L2 for before waiting for its predecessor")
      ->check(CLI::Range(0, 8))
      ->capture_default_str()
      ->group(lab);
}

void add_sampling_options(CLI::App& app, SamplingOptions& o) {
  constexpr double kIntMax = double(std::numeric_limits<int>::max());
  constexpr double kInf = std::numeric_limits<double>::infinity();
  SamplingParams& p = o.params;
  app.add_option("-n,--n-predict", o.n_predict, "Tokens to generate (-1: until end of generation or context)")
      ->check(in_range(-1, kIntMax, false, " (-1: until the end of generation)"))
      ->capture_default_str();
  app.add_option("--temp", p.temperature, "Sampling temperature (0: greedy)")
      ->check(in_range(0, 1e6, false, " (0: greedy)"))
      ->capture_default_str();
  app.add_option("--top-k", p.top_k, "Keep the k most likely tokens (0: off)")
      ->check(in_range(0, kIntMax, false, " (0: off)"))
      ->capture_default_str();
  app.add_option("--top-p", p.top_p, "Nucleus sampling threshold (1: off)")
      ->check(in_range(0, 1, true, " (1: off)"))
      ->capture_default_str();
  app.add_option("--min-p", p.min_p, "Drop tokens below min-p x the top probability (0: off)")
      ->check(in_range(0, 1, false, " (0: off)"))
      ->capture_default_str();
  app.add_option("--repeat-penalty", p.repeat_penalty, "Repetition penalty (1: off)")
      ->check(in_range(0, kInf, true, " (1: off)"))
      ->capture_default_str();
  app.add_option("--repeat-last-n", p.repeat_last_n, "Tokens the repetition penalty looks back over (0: off)")
      ->check(in_range(0, kIntMax, false, " (0: off)"))
      ->capture_default_str();
  app.add_option("-s,--seed", p.seed, "Sampling seed (same seed, same output)")
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            const bool digits = !s.empty() && s.size() <= 20 && s.find_first_not_of("0123456789") == std::string::npos;
            if (digits && (s.size() < 20 || s <= "18446744073709551615")) return std::string();
            return "'" + s + "' is not a valid seed: it must be an integer in [0, 18446744073709551615]";
          },
          "UINT64"))
      ->capture_default_str();
  app.add_option("--stop", o.stop, "Stop when the generated text contains this string (repeatable)");
}

void add_chat_options(CLI::App& app, ChatOptions& o) {
  app.add_option("--system", o.system, "System message for the chat template");
  app.add_flag("--no-think", o.no_think, "Qwen3: answer without a reasoning block");
  app.add_option("--chat-template", o.chat_template, "Override the model's chat template: chatml, llama3 or none");
}

std::vector<TokenId> encode_prompt(const Tokenizer& tok, const std::string& text, bool parse_special) {
  std::vector<TokenId> ids;
  if (tok.add_bos() && tok.bos() >= 0) ids.push_back(tok.bos());
  const auto body = tok.encode(text, parse_special);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

std::vector<TokenId> encode_chat(const Tokenizer& tok, const ChatOptions& o, const std::vector<ChatMessage>& messages) {
  const ChatTemplate t = resolve_chat_template(o.chat_template, tok.chat_template());
  return kvq::encode_chat(tok, t, messages, /*add_generation_prompt=*/true, /*enable_thinking=*/!o.no_think);
}

std::vector<TokenId> chat_stop_tokens(const Tokenizer& tok, const ChatOptions& o) {
  std::vector<TokenId> ids;
  for (const std::string& text : chat_turn_openers(resolve_chat_template(o.chat_template, tok.chat_template()))) {
    const TokenId id = tok.find_token(text);
    if (id >= 0 && tok.is_control(id)) ids.push_back(id);
  }
  return ids;
}

std::string resolve_model_path(const std::string& flag) {
  if (is_synthetic_spec(flag)) return flag;  // built by open_model, no file
  if (!flag.empty()) {
    if (!fs::exists(flag)) fail(Errc::io, "model file '", flag, "' does not exist");
    return flag;
  }
  if (const char* env = std::getenv("KVQ_MODEL"); env && *env) {
    if (is_synthetic_spec(env)) return env;
    if (!fs::exists(env)) fail(Errc::io, "$KVQ_MODEL points to '", env, "', which does not exist");
    return env;
  }
  const fs::path rel = fs::path("models") / "kvq-tiny-code.gguf";
  std::vector<fs::path> candidates;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(exe.parent_path() / rel);
    candidates.push_back(exe.parent_path().parent_path() / rel);
  }
#ifdef KVQ_SOURCE_DIR
  candidates.push_back(fs::path(KVQ_SOURCE_DIR) / rel);
#endif
  std::string looked;
  for (const fs::path& c : candidates) {
    if (fs::exists(c)) return c.string();
    looked += (looked.empty() ? "" : ", ") + c.string();
  }
  fail(Errc::io, "no model given and the default model ", rel.string(), " was not found (looked in ", looked,
       "); pass -m FILE.gguf or set $KVQ_MODEL");
}

Loaded load(const ModelOptions& o) {
  const int threads = set_thread_count(o.threads);
  log_info("CPU threads: ", threads, o.threads > 0 ? " (--threads)" : " (default: idle usable cores)");
  // The backend before the model is touched: --device cuda fails fast.
  std::unique_ptr<Backend> backend = make_backend(o.device, o.backend);
  const std::string path = resolve_model_path(o.model);
  Loaded l{Runtime::open(std::move(backend), path), nullptr};
  l.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_gguf(*l.model->file()));
  KVQ_CHECK(l.tokenizer->vocab_size() <= l.model->config().vocab_size, Errc::format, "'", path, "': the tokenizer has ",
            l.tokenizer->vocab_size(), " tokens but the embedding only ", l.model->config().vocab_size);
  return l;
}

int resolve_ctx(const ModelOptions& o, const ModelConfig& cfg, int wanted) {
  const uint64_t model_ctx = cfg.context_length ? cfg.context_length : 4096;
  if (o.ctx > 0) {
    if (uint64_t(o.ctx) > model_ctx)
      log_warn("--ctx ", o.ctx, " exceeds the model's trained context of ", model_ctx, " tokens");
    return o.ctx;
  }
  return int(std::min<uint64_t>(model_ctx, std::max(4096, wanted)));
}

CodecRequest codec_request(const ModelOptions& o) {
  CodecRequest r = CodecRequest::from_flags(o.codec, o.rotor_qjl, o.f32_kv);
  r.set_window(o.kv_window);
  return r;
}

SessionOptions session_options(const ModelOptions& o, Model& m, int ctx) {
  SessionOptions so;
  so.ctx = ctx;
  so.prefill_chunk = o.prefill_chunk > 0 ? o.prefill_chunk : m.backend().default_session_prefill_chunk();
  return so;
}

std::unique_ptr<Session> make_session(const ModelOptions& o, Loaded& l, int ctx) {
  SessionOptions so = session_options(o, *l.model, ctx);
  // Progress only where someone watches it: a terminal, or a prompt long
  // enough that silence would look like a hang.
  const bool tty = ::isatty(2);
  so.on_prefill_progress = [tty](int done, int total) {
    if (!(tty || total >= 4096) || total < 256) return;
    std::fprintf(stderr, "\rprefill %d/%d tokens (%d%%)%s", done, total, int(100.0 * done / total),
                 done == total ? "\n" : "");
    std::fflush(stderr);
  };
  return std::make_unique<Session>(*l.model, l.session_cache(codec_request(o), ctx), l.tokenizer.get(), std::move(so));
}

std::string speed_line(const GenerateResult& r) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "prefill %d tokens at %.1f tok/s (%.3f s); decode %d tokens at %.1f tok/s (%.3f s); generated %zu, stop: %s",
                r.n_prompt, r.prefill_tps(), r.prefill_s, r.n_decoded, r.decode_tps(), r.decode_s, r.tokens.size(),
                to_string(r.stop_reason));
  return buf;
}

}  // namespace kvq::cli
