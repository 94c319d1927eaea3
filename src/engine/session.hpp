// A generation session: the tokens in the KV cache, chunked prefill, the
// decode loop, sampling and stop conditions. One Session is one sequence;
// its cache persists across generate() calls, so a chat keeps its context and
// only the new suffix of a conversation is prefilled.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/sampler.hpp"
#include "engine/stop.hpp"
#include "engine/token_healing.hpp"
#include "backend/batch.hpp"
#include "kv/cache.hpp"
#include "kv/page_pool.hpp"
#include "model/forward.hpp"

namespace kvq {

class Tokenizer;

struct SessionOptions {
  int ctx = 4096;            // KV capacity in tokens (prompt + generated)
  int prefill_chunk = 512;   // tokens per forward call during prefill
  // Called after each prefill chunk with (tokens done, tokens total); for progress display.
  std::function<void(int, int)> on_prefill_progress;
};

struct GenerateOptions {
  int n_predict = 128;                // max tokens to generate; 0: prefill only; <0: until stop/context end
  std::vector<std::string> stop;      // stop strings (matched on the generated text, excluded from output)
  bool stop_at_eog = true;            // stop at the tokenizer's end-of-generation tokens
  std::vector<TokenId> stop_tokens;   // more tokens that end generation (a chat's turn-start marker), kept
                                      // in tokens but not streamed (StopReason::eog)
  SamplingParams sampling;
  // From heal_prompt_end(): the first sampled token must be one of
  // healing.first_allowed, and the healed prefix (already part of the
  // user's prompt text) is not streamed again.
  TokenHealing healing;
  // Called with each sampled token before its text is emitted; returning
  // false ends generation with StopReason::cancelled (a server whose client
  // went away). `logits` is the row the token was sampled from when
  // token_logits is set (which keeps the logits on the host every step),
  // else nullptr.
  std::function<bool(TokenId id, const float* logits)> on_token;
  bool token_logits = false;
};

// Why generation ended.
enum class StopReason {
  eog,          // an end-of-generation token (or one of GenerateOptions::stop_tokens)
  stop_string,  // a stop string matched
  max_tokens,   // n_predict tokens were generated
  context_full, // the KV context is full
  cancelled,    // on_token returned false
};
// "eog", "stop string", "max tokens", "context full", "cancelled": for logs and messages.
const char* to_string(StopReason r);

// Receives every logits row the model produces for this session, in order:
// row i belongs to token tokens()[i] (the logits that predict the next token).
using LogitsSink = std::function<void(TokenId token, const float* logits, int vocab)>;

struct GenerateResult {
  std::vector<TokenId> tokens;  // generated tokens, the stop token included when it ended generation
  std::string text;             // streamed text (stop string removed)
  StopReason stop_reason = StopReason::max_tokens;
  int n_prompt = 0;             // tokens prefilled by this call
  int n_decoded = 0;            // single-token forward steps
  double prefill_s = 0;         // wall time of the prefill (forward passes over the new prompt tokens)
  double decode_s = 0;          // wall time of the decode steps, sampling included
  // token_s[i]: seconds from the end of the prefill until tokens[i] was
  // chosen (token 0 comes from the prefill's logits, token i from decode
  // step i); for inter-token latencies (kvq bench).
  std::vector<double> token_s;
  double prefill_tps() const { return prefill_s > 0 ? n_prompt / prefill_s : 0; }
  double decode_tps() const { return decode_s > 0 ? n_decoded / decode_s : 0; }
};

class Session {
 public:
  // The cache must be shaped for the model (model.cache_shape(opts.ctx)); the
  // tokenizer may be null for id-only use (no text, no EOG detection).
  Session(Model& model, std::unique_ptr<kv::Cache> cache, const Tokenizer* tok, SessionOptions opts = {});

  Model& model() { return model_; }
  kv::Cache& cache() { return *cache_; }
  // This sequence's scratch and recorded decode step (the model is shared).
  const RunState& run_state() const { return *run_; }
  const std::vector<TokenId>& tokens() const { return tokens_; }  // tokens whose K/V are in the cache
  int n_ctx() const { return opts_.ctx; }

  // Logits of every token fed from now on go to `sink` (nullptr: none). With
  // a sink set, prefill asks the model for all positions' logits.
  void set_logits_sink(LogitsSink sink) { sink_ = std::move(sink); }

  // Drops cached tokens after the first n (a later prefix that diverges).
  // The cache rows past n stay as they are until the next tokens fed
  // overwrite them at their positions (each row is encoded on its own, so a
  // row rewritten with the same K/V holds the same codes). kvq bench decodes
  // repeatedly from one prefilled prompt this way: truncate(L - 1), then
  // generate(prompt) re-feeds only the last prompt token at position L - 1.
  // With an exact window (a cache shaped with CacheShape::window_pages) the
  // cut moves back to the start of the window the next token would see when
  // pages of it were packed meanwhile (their exact rows are gone): tokens()
  // says what is kept, and those tokens are fed again.
  void truncate(int n);
  // Feeds tokens after the cached ones (chunked); returns the last token's
  // logits. Non-finite logits (a model with NaN weights) are an Errc::format
  // error that names the first non-finite tensor of the model file.
  const std::vector<float>& feed(const std::vector<TokenId>& ids);
  // Feeds one token and returns the greedy choice among the first `vocab`
  // logits of its step, computed by the backend (the logits are not
  // downloaded, and feed()'s last logits are not updated).
  TokenId feed_greedy(TokenId id, int vocab);

  // Makes the cache hold exactly `prompt` (reusing the longest common prefix
  // with what it holds), then samples up to n_predict tokens, calling on_text
  // with each complete piece of text. A prompt that does not fit the context
  // is an Errc::out_of_range error.
  GenerateResult generate(const std::vector<TokenId>& prompt, const GenerateOptions& gopts,
                          const std::function<void(const std::string&)>& on_text = {});

  // Tokenizes text (BOS per the tokenizer, special tokens parsed when
  // parse_special) into ids; needs a tokenizer.
  std::vector<TokenId> tokenize(const std::string& text, bool add_bos, bool parse_special) const;

 private:
  [[noreturn]] void fail_non_finite(int pos, int64_t index, float value) const;

  // With an exact window: the step of tokens [pos, pos + n) of ids over the
  // window's table (reserved here, the pages leaving it packed). Without
  // one, Model::forward's one-sequence form runs over the identity table.
  const StepBatch& step_batch(const TokenId* ids, int n, int pos, StepBatch::Logits logits);
  // Pages for `tokens` tokens in the window's table; the pages that leave
  // the window are packed before anything is written.
  void reserve_window(int tokens);

  Model& model_;
  std::unique_ptr<kv::Cache> cache_;
  // An exact window's pages (null without one): a pool of the store's packed
  // pages, one of its exact pages, and this sequence's table over both.
  std::unique_ptr<kv::PagePool> pool_, exact_pool_;
  std::unique_ptr<kv::BlockTable> table_;
  std::vector<kv::PageMove> moves_;
  StepBatch batch_;
  std::unique_ptr<RunState> run_;
  const Tokenizer* tok_;
  SessionOptions opts_;
  LogitsSink sink_;
  std::vector<TokenId> tokens_;
  std::vector<float> last_logits_;
  std::vector<float> all_logits_;
};

}  // namespace kvq
