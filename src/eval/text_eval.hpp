// Teacher-forced quality of KV codecs on a token sequence: every codec runs
// the model over the same windows of the text through the real cache
// (Session -> Model::forward -> Backend -> the codec's packed store), and
// each scored position is compared with the reference pass (computed once per
// window) and with the text's next token.
//
// Windows: length L = min(ctx, tokens); starts 0, stride, 2 stride, ... while
// the window fits. Window 0 scores every next-token prediction inside it
// (targets 1 .. L-1); a later window scores only the targets past the end of
// the previous one (its last `stride` positions), so every target is scored
// at most once and, when stride < L, with at least L - stride tokens of
// context (sliding-window perplexity). stride = L gives disjoint windows,
// each scoring its targets 1 .. L-1 (a window's first token is not predicted).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "eval/codecs.hpp"
#include "eval/metrics.hpp"

namespace kvq {
class Model;
}

namespace kvq::eval {

struct Window {
  int start = 0;        // first token of the text in the window
  int len = 0;          // tokens in the window
  int first_target = 1; // window-relative index of the first scored target (predicted by row first_target - 1)
};
// Throws invalid_argument for fewer than 2 tokens or a stride outside [1, ctx].
std::vector<Window> plan_windows(int n_tokens, int ctx, int stride, int max_windows);

struct TextEvalOptions {
  int ctx = 2048;        // window length (KV capacity)
  int stride = 0;        // 0: ctx (disjoint windows)
  int max_windows = 0;   // 0: all that fit
  int prefill_chunk = 512;
  std::optional<EvalCodec> ref;  // KL / top-1 reference; nullopt: perplexity only
  // Called before each pass: (codec label, window index, windows).
  std::function<void(const std::string&, int, int)> on_pass;
};

struct CodecQuality {
  EvalCodec codec;
  std::string error;        // empty: measured; else why not (e.g. the backend has no kernels for it)
  bool unsupported = false; // the error is Errc::unsupported (reported and skipped)
  double k_bits = 0, v_bits = 0;  // stored bits per value (0 for f32: not a codec)
  int64_t positions = 0;    // scored positions
  bool has_kl = false;
  double mean_kl = 0, p99_kl = 0, max_kl = 0, top1_pct = 0;
  double mean_nll = 0, ppl = 0;
};

struct TextEvalReport {
  int n_tokens = 0;
  TextEvalOptions opts;
  std::vector<Window> windows;
  std::optional<CodecQuality> ref;  // the reference pass's own perplexity
  std::vector<CodecQuality> rows;   // one per requested codec, in order
};

TextEvalReport evaluate_text(Model& model, const std::vector<int32_t>& tokens, const std::vector<EvalCodec>& codecs,
                             const TextEvalOptions& opts);

}  // namespace kvq::eval
