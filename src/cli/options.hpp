// Options shared by every command that loads a model (run, chat, bench,
// eval, serve): declared once here, parsed by CLI11.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "engine/runtime.hpp"
#include "engine/sampler.hpp"
#include "engine/session.hpp"
#include "kv/cache.hpp"
#include "model/forward.hpp"
#include "tokenizer/chat.hpp"
#include "tokenizer/tokenizer.hpp"

namespace kvq::cli {

// A numeric option's check with a one-line message naming the valid range:
// "--top-p: 2 is out of range: it must be in (0, 1] (1: off)". lo_open: lo
// itself is not allowed; hi = infinity: no upper bound.
CLI::Validator in_range(double lo, double hi, bool lo_open, const std::string& note);

struct ModelOptions {
  std::string model;          // -m; empty: the embedded default model
  int ctx = 0;                // --ctx; 0: min(model context, max(4096, prompt + n_predict))
  int threads = 0;            // --threads; 0: default_thread_count() (core/threads.hpp)
  std::string device = "cpu"; // --device cpu|cuda
  int prefill_chunk = 0;      // --prefill-chunk; 0: the device's default
  kv::CodecOptions codec;     // --kv, --ctk, --ctv, --rotor-qjl
  std::string rotor_qjl = "off";
  bool f32_kv = false;        // --f32-kv: exact fp32 reference cache instead of a codec
  int kv_window = CodecRequest::kWindowAuto;  // --kv-window: exact recent window, pages per sequence (auto: per codec)
  BackendOptions backend;     // experiment knobs: --no-step-graphs, --no-pdl, --gemv-warps, --batch-gemm-rows, --attn-prefetch
};
// -m, -t, --device, --prefill-chunk: a model on a device (run, chat, bench).
void add_model_source_options(CLI::App& app, ModelOptions& o);
// --kv-window (the serving form of the exact window) into `pages`.
// --kv-window W|auto into `pages` (auto: CodecRequest::kWindowAuto, which
// CodecRequest::window_for resolves per codec).
void add_kv_window_option(CLI::App& app, int& pages, const std::string& description = {});
// The above plus --ctx and the KV cache options (run, chat).
void add_model_options(CLI::App& app, ModelOptions& o);
// The backends' experiment knobs (--no-step-graphs, --gemv-warps, ...), for
// commands that take them without the rest of add_model_options (bench).
void add_backend_lab_options(CLI::App& app, BackendOptions& b);

struct SamplingOptions {
  SamplingParams params;
  int n_predict = 128;
  std::vector<std::string> stop;
};
void add_sampling_options(CLI::App& app, SamplingOptions& o);

struct ChatOptions {
  std::string system;         // --system
  bool no_think = false;      // --no-think (Qwen3: skip the reasoning block)
  std::string chat_template;  // --chat-template chatml|llama3|none (default: from the GGUF)
};
void add_chat_options(CLI::App& app, ChatOptions& o);

// Token ids of a raw prompt: BOS as the tokenizer wants; control tokens
// written in the text (<|im_start|>, ...) are recognised only with
// parse_special (`kvq run --special`), else they are plain text.
std::vector<TokenId> encode_prompt(const Tokenizer& tok, const std::string& text, bool parse_special);
// Token ids of a conversation rendered with the chat template (the model's,
// or --chat-template), ending with an open assistant turn. Control tokens
// come only from the template's markup: message text that spells one
// ("<|im_end|>") is tokenized as text, so a message cannot open another role.
std::vector<TokenId> encode_chat(const Tokenizer& tok, const ChatOptions& o, const std::vector<ChatMessage>& messages);

// Token ids that end a chat reply besides end-of-generation: the template's
// turn openers that exist in the vocabulary as control tokens.
std::vector<TokenId> chat_stop_tokens(const Tokenizer& tok, const ChatOptions& o);

// The model to use: -m if given (a file, or synthetic:SHAPE as is), else
// $KVQ_MODEL, else the embedded default model models/kvq-tiny-code.gguf next
// to the executable or in the source tree. Throws a clear error when none exists.
std::string resolve_model_path(const std::string& flag);

// Backend and model (the Runtime, engine/runtime.hpp) and the tokenizer,
// loaded per the options (threads applied).
struct Loaded : Runtime {
  std::unique_ptr<Tokenizer> tokenizer;
};
Loaded load(const ModelOptions& o);

// The context to allocate: --ctx if given (capped by nothing but memory; a
// value above the model's trained context is allowed with a warning), else
// min(model context, max(4096, wanted)).
int resolve_ctx(const ModelOptions& o, const ModelConfig& cfg, int wanted);
// What --kv/--ctk/--ctv/--rotor-qjl/--f32-kv ask for: a fresh value per call
// (caches come from the Runtime, engine/runtime.hpp).
CodecRequest codec_request(const ModelOptions& o);
// Session options for the device: the context and --prefill-chunk (or the
// device's default); no progress callback.
SessionOptions session_options(const ModelOptions& o, Model& m, int ctx);
// A Session over a fresh cache, with a prefill progress indicator on stderr
// for long prompts.
std::unique_ptr<Session> make_session(const ModelOptions& o, Loaded& l, int ctx);

// "prefill 512 tokens at 123.4 tok/s (0.42 s), decode 63 tokens at 45.6 tok/s"
std::string speed_line(const GenerateResult& r);

}  // namespace kvq::cli
