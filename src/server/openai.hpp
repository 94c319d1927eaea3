// The OpenAI API surface: request parsing and checking, error envelopes,
// response and stream-chunk JSON. No HTTP and no model here (testable alone).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "engine/sampler.hpp"
#include "engine/session.hpp"
#include "tokenizer/chat.hpp"

namespace kvq {
class Tokenizer;
}

namespace kvq::server {

using json = nlohmann::json;

// An error answered with an HTTP status and OpenAI's envelope:
// {"error": {"message", "type", "param", "code"}}.
class ApiError : public Error {
 public:
  ApiError(int status, std::string type, std::string code, std::string param, const std::string& message)
      : Error(status >= 500 ? Errc::internal : Errc::invalid_argument, message), status_(status),
        type_(std::move(type)), code_(std::move(code)), param_(std::move(param)) {}
  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& code() const { return code_; }    // empty: null
  const std::string& param() const { return param_; }  // empty: null

 private:
  int status_;
  std::string type_, code_, param_;
};

// 400 invalid_request_error about `param`.
template <typename... Args>
[[noreturn]] void bad_request(const std::string& param, const Args&... msg) {
  throw ApiError(400, "invalid_request_error", "", param, str(msg...));
}

json error_json(const ApiError& e);
// JSON text; bytes that are not UTF-8 (token pieces can be partial
// characters) become U+FFFD instead of failing.
std::string dump(const json& j);

enum class Endpoint { chat, completion };

// Server-side defaults for fields a request leaves out (from the CLI options).
struct Defaults {
  SamplingParams sampling;
  int max_tokens = -1;            // -1: until a stop or the end of the context
  std::vector<std::string> stop;
  std::string system;             // prepended as a system message when the chat has none
  bool enable_thinking = true;
};

struct ApiRequest {
  Endpoint endpoint = Endpoint::chat;
  std::string model;                  // empty: not given (the served model)
  std::vector<ChatMessage> messages;  // chat
  std::string prompt;                 // completion, as text
  std::vector<TokenId> prompt_ids;    // completion, as token ids (prompt_is_ids)
  bool prompt_is_ids = false;
  int max_tokens = -1;                // -1: until a stop or the end of the context
  SamplingParams sampling;
  bool seed_given = false;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;         // stream_options.include_usage
  int logprobs = -1;                  // -1: none; else alternatives listed per token
  std::string kv_codec;               // empty: the server's --kv
  bool enable_thinking = true;        // chat_template_kwargs.enable_thinking
  bool ignore_eos = false;            // generate past end-of-generation tokens
  std::vector<TokenId> stop_token_ids;  // more tokens that end generation
  bool echo = false;                  // completions: the prompt text starts the answer
  bool cache_prompt = true;           // use and feed the server's prefix cache (llama.cpp's field)
  int n = 1;                          // choices per prompt (each its own sequence and seed)
  // Completions with a batch of prompts: prompts 2..n (prompt / prompt_ids
  // hold the first); each is generated in turn and answered as its own choice.
  struct Prompt {
    std::string text;
    std::vector<TokenId> ids;
    bool is_ids = false;
  };
  static constexpr size_t kMaxPrompts = 16;
  static constexpr int kMaxChoices = 16;    // n at most
  static constexpr int kMaxSequences = 64;  // prompts x n at most
  std::vector<Prompt> more_prompts;
};

// Parses and checks a request body. Malformed JSON (invalid UTF-8 included),
// wrong types, values out of range and options kvq does not implement are
// ApiError 400 naming the field.
ApiRequest parse_request(Endpoint e, std::string_view body, const Defaults& d);

// The prompt's token ids. Chat: the template renders the messages, whose text
// is never read as control tokens. Completion text is tokenized as text too
// (send token ids to feed control tokens); ids must be below `vocab`.
std::vector<TokenId> prompt_tokens(const ApiRequest& r, const Tokenizer& tok, ChatTemplate t, int vocab);

// "stop" (end of generation or a stop string) or "length".
const char* finish_reason(StopReason stop_reason);

// Log-probability (log-softmax at temperature 1) of `id` and of the top_n
// most likely tokens, over logits[0..vocab).
struct TokenLogprob {
  TokenId id = 0;
  float logprob = 0;
  std::vector<std::pair<TokenId, float>> top;
};
TokenLogprob token_logprob(const float* logits, int vocab, TokenId id, int top_n);

// OpenAI logprobs objects: chat {"content": [...]}, completion {"tokens", ...}.
// text_offset is the completion text length before the first token.
json logprobs_json(Endpoint e, const Tokenizer& tok, const std::vector<TokenLogprob>& lps, size_t text_offset = 0);

struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
};
json usage_json(const Usage& u);

// Identity of one response: "chatcmpl-..." / "cmpl-..." id, creation time, model.
struct ResponseId {
  std::string id;
  int64_t created = 0;
  std::string model;
};
ResponseId new_response_id(Endpoint e, const std::string& model);

// A complete (non-streamed) response.
json response_json(Endpoint e, const ResponseId& rid, const std::string& text, const char* finish,
                   const Usage& usage, const json& logprobs);
// One streamed chunk of choice 0: `text` appended; role set in the first chat
// chunk; finish non-null in the last. usage_null: "usage": null, as OpenAI
// sends on every chunk but the usage chunk when stream_options.include_usage
// is set (without it, chunks have no usage key).
json chunk_json(Endpoint e, const ResponseId& rid, const std::string& text, bool first, const char* finish,
                const json& logprobs, bool usage_null = false);
// The chunk stream_options.include_usage asks for: no choices, usage only.
json usage_chunk_json(Endpoint e, const ResponseId& rid, const Usage& usage);

}  // namespace kvq::server
