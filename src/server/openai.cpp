#include "server/openai.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "tokenizer/tokenizer.hpp"

namespace kvq::server {
namespace {

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a number";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    default: return "an unsupported value";
  }
}

// A field of the request object; null counts as absent (clients send null
// for "not set").
const json* field(const json& o, const char* name) {
  auto it = o.find(name);
  return it == o.end() || it->is_null() ? nullptr : &*it;
}

bool get_bool(const json& o, const char* name, bool dflt) {
  const json* v = field(o, name);
  if (!v) return dflt;
  if (!v->is_boolean()) bad_request(name, "'", name, "' must be a boolean, not ", type_name(*v));
  return v->get<bool>();
}

// Entries of one request's logit_bias (OpenAI documents no limit; this
// bounds the work per sampled token).
constexpr size_t kMaxLogitBias = 1024;

int64_t get_int(const json& o, const char* name, int64_t dflt, int64_t lo, int64_t hi) {
  const json* v = field(o, name);
  if (!v) return dflt;
  int64_t x;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    x = u > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(u);
  } else if (v->is_number_integer()) {
    x = v->get<int64_t>();
  } else if (v->is_number_float() && std::isfinite(v->get<double>()) && v->get<double>() == std::floor(v->get<double>()) &&
             std::fabs(v->get<double>()) < 9e15) {
    x = int64_t(v->get<double>());  // 16.0 from a client that only has doubles
  } else {
    bad_request(name, "'", name, "' must be an integer, not ", type_name(*v));
  }
  if (x < lo || x > hi) bad_request(name, "'", name, "' is ", x, "; it must be between ", lo, " and ", hi);
  return x;
}

float get_float(const json& o, const char* name, float dflt, double lo, double hi, bool lo_open = false) {
  const json* v = field(o, name);
  if (!v) return dflt;
  if (!v->is_number()) bad_request(name, "'", name, "' must be a number, not ", type_name(*v));
  const double x = v->get<double>();
  if (!(lo_open ? x > lo : x >= lo) || !(x <= hi))
    bad_request(name, "'", name, "' is ", x, "; it must be in ", lo_open ? "(" : "[", lo, ", ", hi, "]");
  return float(x);
}

std::string get_string(const json& o, const char* name, const std::string& dflt) {
  const json* v = field(o, name);
  if (!v) return dflt;
  if (!v->is_string()) bad_request(name, "'", name, "' must be a string, not ", type_name(*v));
  return v->get<std::string>();
}

[[noreturn]] void unsupported(const char* name, const char* why) {
  throw ApiError(400, "invalid_request_error", "unsupported_parameter", name,
                 str("'", name, "' is not supported by kvq: ", why));
}

// A message's content: a string, or an array of {"type": "text", "text": ...} parts.
std::string message_content(const json& c, const std::string& where) {
  // Moved out of the request's JSON (parse_request's own, read once).
  if (c.is_string()) return std::move(const_cast<json&>(c).get_ref<std::string&>());
  if (!c.is_array()) bad_request(where, "'", where, "' must be a string or an array of text parts, not ", type_name(c));
  std::string out;
  for (size_t i = 0; i < c.size(); ++i) {
    const json& part = c[i];
    const std::string at = where + "[" + std::to_string(i) + "]";
    if (!part.is_object()) bad_request(at, "'", at, "' must be an object, not ", type_name(part));
    const std::string type = get_string(part, "type", "");
    if (type != "text")
      throw ApiError(400, "invalid_request_error", "unsupported_content", at,
                     str("'", at, ".type' is '", type, "'; kvq serves a text model and takes only \"text\" parts"));
    const json* t = field(part, "text");
    if (!t || !t->is_string()) bad_request(at + ".text", "'", at, ".text' must be a string");
    out += t->get<std::string>();
  }
  return out;
}

void parse_messages(const json& body, ApiRequest& r, const Defaults& d) {
  const json* m = field(body, "messages");
  if (!m) bad_request("messages", "'messages' is required: an array of {\"role\", \"content\"} objects");
  if (!m->is_array()) bad_request("messages", "'messages' must be an array, not ", type_name(*m));
  if (m->empty()) bad_request("messages", "'messages' is empty; send at least one message");
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!msg.is_object()) bad_request(at, "'", at, "' must be an object, not ", type_name(msg));
    const json* role = field(msg, "role");
    if (!role || !role->is_string()) bad_request(at + ".role", "'", at, ".role' must be a string");
    std::string rs = role->get<std::string>();
    if (rs == "developer") rs = "system";  // OpenAI's newer name for system instructions
    if (rs != "system" && rs != "user" && rs != "assistant" && rs != "tool")
      bad_request(at + ".role", "'", at, ".role' is '", rs, "'; use system, developer, user, assistant or tool");
    if (field(msg, "tool_calls")) unsupported("tool_calls", "tool calling is not implemented");
    const json* c = field(msg, "content");
    std::string content;
    if (c)
      content = message_content(*c, at + ".content");
    else if (rs != "assistant")
      bad_request(at + ".content", "'", at, ".content' is required for role '", rs, "'");
    r.messages.push_back({rs, std::move(content)});
  }
  if (!d.system.empty() && r.messages.front().role != "system")
    r.messages.insert(r.messages.begin(), ChatMessage{"system", d.system});
}

void parse_prompt(const json& body, ApiRequest& r) {
  const json* p = field(body, "prompt");
  if (!p) bad_request("prompt", "'prompt' is required: a string or an array of token ids");
  auto ids_of = [&](const json& a) {
    std::vector<TokenId> ids;
    for (const json& v : a) {
      if (!v.is_number_integer()) bad_request("prompt", "'prompt' as an array must hold only integer token ids");
      const int64_t id = v.get<int64_t>();
      if (id < 0 || id > INT32_MAX) bad_request("prompt", "'prompt' holds the token id ", id, ", which is out of range");
      ids.push_back(TokenId(id));
    }
    return ids;
  };
  auto one = [&](const json& v) {
    ApiRequest::Prompt out;
    if (v.is_string()) {
      // Moved out of the request's JSON (parse_request's own, read once): a
      // prompt of megabytes is not copied.
      out.text = std::move(const_cast<json&>(v).get_ref<std::string&>());
    } else if (v.is_array()) {
      out.ids = ids_of(v);
      out.is_ids = true;
    } else {
      bad_request("prompt", "a prompt of a batch must be a string or an array of token ids, not ", type_name(v));
    }
    return out;
  };
  std::vector<ApiRequest::Prompt> all;
  if (p->is_string()) {
    all.push_back(one(*p));
  } else if (p->is_array() && !p->empty() && (*p)[0].is_number()) {
    all.push_back(one(*p));
  } else if (p->is_array() && !p->empty()) {
    // A batch: each prompt gets its own choice (index = its position).
    if (p->size() > ApiRequest::kMaxPrompts)
      bad_request("prompt", "'prompt' has ", p->size(), " prompts; at most ", ApiRequest::kMaxPrompts,
                  " per request");
    for (const json& v : *p) all.push_back(one(v));
  } else {
    bad_request("prompt", "'prompt' must be a string, an array of token ids or an array of prompts, not ", type_name(*p));
  }
  r.prompt = std::move(all[0].text);
  r.prompt_ids = std::move(all[0].ids);
  r.prompt_is_ids = all[0].is_ids;
  r.more_prompts.assign(all.begin() + 1, all.end());
}

std::vector<std::string> parse_stop(const json& body, const std::vector<std::string>& dflt) {
  const json* s = field(body, "stop");
  if (!s) return dflt;
  std::vector<std::string> out;
  if (s->is_string()) {
    out.push_back(s->get<std::string>());
  } else if (s->is_array()) {
    for (const json& v : *s) {
      if (!v.is_string()) bad_request("stop", "'stop' must be a string or an array of strings");
      out.push_back(v.get<std::string>());
    }
  } else {
    bad_request("stop", "'stop' must be a string or an array of strings, not ", type_name(*s));
  }
  if (out.size() > 16) bad_request("stop", "'stop' has ", out.size(), " strings; at most 16 are allowed");
  for (const std::string& x : out)
    if (x.empty()) bad_request("stop", "'stop' holds an empty string, which would stop before the first token");
  return out;
}

}  // namespace

json error_json(const ApiError& e) {
  json err = {{"message", e.what()}, {"type", e.type()}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param().empty()) err["param"] = e.param();
  if (!e.code().empty()) err["code"] = e.code();
  return json{{"error", err}};
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

ApiRequest parse_request(Endpoint e, std::string_view body, const Defaults& d) {
  json b;
  try {
    b = json::parse(body.begin(), body.end());
  } catch (const json::exception& pe) {
    // nlohmann's message names the byte offset and what it expected (invalid
    // UTF-8 in a string is reported here too; a number beyond a double's
    // range, 1e309, is an out_of_range error, also the client's fault).
    throw ApiError(400, "invalid_request_error", "invalid_json", "",
                   str("the request body is not valid JSON: ", pe.what()));
  }
  if (!b.is_object()) bad_request("", "the request body must be a JSON object, not ", type_name(b));

  ApiRequest r;
  r.endpoint = e;
  r.model = get_string(b, "model", "");
  if (e == Endpoint::chat)
    parse_messages(b, r, d);
  else
    parse_prompt(b, r);

  // Options kvq does not implement: refused rather than silently ignored.
  r.n = int(get_int(b, "n", 1, 1, ApiRequest::kMaxChoices));
  if (int(1 + r.more_prompts.size()) * r.n > ApiRequest::kMaxSequences)
    bad_request("n", "'n' = ", r.n, " for ", 1 + r.more_prompts.size(), " prompts asks for ",
                int(1 + r.more_prompts.size()) * r.n, " sequences; at most ", ApiRequest::kMaxSequences);
  // Fields that would change the answer are served or refused, never ignored.
  for (const char* name : {"grammar", "json_schema", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                           "guided_decoding_backend", "structured_outputs", "regex"})
    if (field(b, name)) unsupported(name, "structured output (grammars, schemas) is not implemented");
  if (const json* t = field(b, "tools")) {
    if (!t->is_array()) bad_request("tools", "'tools' must be an array, not ", type_name(*t));
    if (!t->empty()) unsupported("tools", "tool calling is not implemented");
  }
  if (const json* tc = field(b, "tool_choice")) {
    if (!tc->is_string() || (tc->get<std::string>() != "none" && tc->get<std::string>() != "auto"))
      unsupported("tool_choice", "tool calling is not implemented (only \"none\" and \"auto\", which mean no tool)");
  }
  if (field(b, "functions")) unsupported("functions", "function calling is not implemented");
  if (field(b, "function_call")) unsupported("function_call", "function calling is not implemented");
  if (const json* rf = field(b, "response_format")) {
    if (!rf->is_object() || get_string(*rf, "type", "text") != "text")
      unsupported("response_format", "only {\"type\": \"text\"} (no JSON mode or schemas)");
  }
  std::vector<std::pair<TokenId, float>> logit_bias;
  if (const json* lb = field(b, "logit_bias")) {
    if (!lb->is_object()) bad_request("logit_bias", "'logit_bias' must be an object of token id -> bias, not ", type_name(*lb));
    if (lb->size() > kMaxLogitBias)
      bad_request("logit_bias", "'logit_bias' has ", lb->size(), " entries; at most ", kMaxLogitBias);
    for (const auto& [key, value] : lb->items()) {
      // Keys are decimal token ids ("50256"), as OpenAI's API takes them.
      const bool digits = !key.empty() && key.size() <= 10 &&
                          std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (!digits || std::stoll(key) > INT32_MAX)
        bad_request("logit_bias", "'logit_bias' keys must be token ids (decimal strings), not '", key, "'");
      if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() < -100.0 ||
          value.get<double>() > 100.0)
        bad_request("logit_bias", "'logit_bias' values must be numbers between -100 and 100 (token ", key, ")");
      logit_bias.emplace_back(TokenId(std::stoll(key)), float(value.get<double>()));
    }
  }
  const int min_tokens = int(get_int(b, "min_tokens", 0, 0, INT32_MAX));
  r.ignore_eos = get_bool(b, "ignore_eos", false);
  r.cache_prompt = get_bool(b, "cache_prompt", true);
  if (const json* st = field(b, "stop_token_ids")) {
    if (!st->is_array()) bad_request("stop_token_ids", "'stop_token_ids' must be an array of token ids");
    if (st->size() > 64) bad_request("stop_token_ids", "'stop_token_ids' has ", st->size(), " ids; at most 64");
    for (const json& v : *st) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
        bad_request("stop_token_ids", "'stop_token_ids' must hold only non-negative integer token ids");
      r.stop_token_ids.push_back(TokenId(v.get<int64_t>()));
    }
  }
  if (e == Endpoint::completion) {
    r.echo = get_bool(b, "echo", false);
    if (get_int(b, "best_of", 1, 1, 128) != 1) unsupported("best_of", "one candidate per request");
    if (!get_string(b, "suffix", "").empty()) unsupported("suffix", "no fill-in-the-middle");
  }

  r.sampling = d.sampling;
  SamplingParams& s = r.sampling;
  s.logit_bias = std::move(logit_bias);  // token ids are checked against the vocabulary by the server
  s.min_tokens = min_tokens;             // the server lists what it suppresses (min_tokens_suppress)
  s.temperature = get_float(b, "temperature", s.temperature, 0.0, 2.0);
  s.top_p = get_float(b, "top_p", s.top_p, 0.0, 1.0, /*lo_open=*/true);
  s.top_k = int(get_int(b, "top_k", s.top_k, -1, INT32_MAX));
  s.min_p = get_float(b, "min_p", s.min_p, 0.0, 1.0);
  s.presence_penalty = get_float(b, "presence_penalty", s.presence_penalty, -2.0, 2.0);
  s.frequency_penalty = get_float(b, "frequency_penalty", s.frequency_penalty, -2.0, 2.0);
  s.repeat_penalty = get_float(b, "repetition_penalty", s.repeat_penalty, 0.0, 10.0, /*lo_open=*/true);
  if (field(b, "seed")) {
    s.seed = uint64_t(get_int(b, "seed", 0, INT64_MIN, INT64_MAX));
    r.seed_given = true;
  }

  // Length and stops.
  r.max_tokens = d.max_tokens;
  if (field(b, "max_completion_tokens"))
    r.max_tokens = int(get_int(b, "max_completion_tokens", -1, 1, INT32_MAX));
  else if (field(b, "max_tokens"))
    r.max_tokens = int(get_int(b, "max_tokens", -1, 1, INT32_MAX));
  r.stop = parse_stop(b, d.stop);

  // Streaming.
  r.stream = get_bool(b, "stream", false);
  if (const json* so = field(b, "stream_options")) {
    if (!so->is_object()) bad_request("stream_options", "'stream_options' must be an object, not ", type_name(*so));
    if (!r.stream) bad_request("stream_options", "'stream_options' is only allowed with \"stream\": true");
    r.include_usage = get_bool(*so, "include_usage", false);
  }

  // Log-probabilities: chat {"logprobs": true, "top_logprobs": k}; completion {"logprobs": k}.
  if (e == Endpoint::chat) {
    const bool on = get_bool(b, "logprobs", false);
    const int top = int(get_int(b, "top_logprobs", 0, 0, 20));
    if (!on && field(b, "top_logprobs")) bad_request("top_logprobs", "'top_logprobs' needs \"logprobs\": true");
    r.logprobs = on ? top : -1;
  } else {
    r.logprobs = int(get_int(b, "logprobs", -1, 0, 20));
  }

  r.kv_codec = get_string(b, "kv_codec", "");
  r.enable_thinking = d.enable_thinking;
  if (const json* k = field(b, "chat_template_kwargs")) {
    if (!k->is_object()) bad_request("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    r.enable_thinking = get_bool(*k, "enable_thinking", r.enable_thinking);
  }
  return r;
}

std::vector<TokenId> prompt_tokens(const ApiRequest& r, const Tokenizer& tok, ChatTemplate t, int vocab) {
  std::vector<TokenId> ids;
  if (r.endpoint == Endpoint::chat) {
    try {
      ids = encode_chat(tok, t, r.messages, /*add_generation_prompt=*/true, r.enable_thinking);
    } catch (const Error& e) {
      bad_request("messages", e.what());  // a role the template cannot render
    }
  } else if (r.prompt_is_ids) {
    for (TokenId id : r.prompt_ids)
      if (id >= vocab) bad_request("prompt", "token id ", id, " is out of range; the vocabulary has ", vocab, " tokens");
    ids = r.prompt_ids;
  } else {
    if (tok.add_bos() && tok.bos() >= 0) ids.push_back(tok.bos());
    const auto body = tok.encode(r.prompt, /*parse_special=*/false);
    ids.insert(ids.end(), body.begin(), body.end());
  }
  if (ids.empty()) bad_request(r.endpoint == Endpoint::chat ? "messages" : "prompt", "the prompt is empty");
  return ids;
}

const char* finish_reason(StopReason stop_reason) {
  return stop_reason == StopReason::max_tokens || stop_reason == StopReason::context_full ? "length" : "stop";
}

TokenLogprob token_logprob(const float* logits, int vocab, TokenId id, int top_n) {
  float m = -INFINITY;
  for (int i = 0; i < vocab; ++i)
    if (logits[i] > m) m = logits[i];
  double sum = 0;
  for (int i = 0; i < vocab; ++i)
    if (std::isfinite(logits[i])) sum += std::exp(double(logits[i]) - m);
  const double lse = double(m) + std::log(sum);
  auto lp = [&](TokenId t) {
    const float l = logits[t];
    return std::isfinite(l) ? float(double(l) - lse) : -INFINITY;
  };
  TokenLogprob out;
  out.id = id;
  out.logprob = lp(id);
  if (top_n > 0) {
    std::vector<TokenId> order(static_cast<size_t>(vocab));
    for (int i = 0; i < vocab; ++i) order[i] = i;
    const int k = std::min(top_n, vocab);
    auto key = [&](TokenId t) { return std::isnan(logits[t]) ? -INFINITY : logits[t]; };
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](TokenId a, TokenId b) { return key(a) > key(b) || (key(a) == key(b) && a < b); });
    for (int i = 0; i < k; ++i) out.top.emplace_back(order[i], lp(order[i]));
  }
  return out;
}

json logprobs_json(Endpoint e, const Tokenizer& tok, const std::vector<TokenLogprob>& lps, size_t text_offset) {
  auto bytes = [&](TokenId id) {
    json b = json::array();
    for (unsigned char c : tok.bytes_of(id)) b.push_back(int(c));
    return b;
  };
  // Token logprobs can be -inf (a token the sampler was forced to); JSON has no infinity.
  auto finite = [](float v) { return std::isfinite(v) ? double(v) : -9999.0; };
  if (e == Endpoint::chat) {
    json content = json::array();
    for (const TokenLogprob& t : lps) {
      json top = json::array();
      for (const auto& [id, lp] : t.top)
        top.push_back({{"token", tok.bytes_of(id)}, {"logprob", finite(lp)}, {"bytes", bytes(id)}});
      content.push_back(
          {{"token", tok.bytes_of(t.id)}, {"logprob", finite(t.logprob)}, {"bytes", bytes(t.id)}, {"top_logprobs", top}});
    }
    return json{{"content", content}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
  size_t off = text_offset;
  for (const TokenLogprob& t : lps) {
    tokens.push_back(tok.bytes_of(t.id));
    token_logprobs.push_back(finite(t.logprob));
    json alt = json::object();
    for (const auto& [id, lp] : t.top) alt[tok.bytes_of(id)] = finite(lp);
    top.push_back(alt);
    offsets.push_back(off);
    off += tok.bytes_of(t.id).size();
  }
  return json{{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

json usage_json(const Usage& u) {
  return json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

ResponseId new_response_id(Endpoint e, const std::string& model) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  char hex[40];
  std::snprintf(hex, sizeof hex, "%012llx%012llx", (unsigned long long)(salt & 0xffffffffffffull),
                (unsigned long long)(counter++ & 0xffffffffffffull));
  ResponseId r;
  r.id = std::string(e == Endpoint::chat ? "chatcmpl-" : "cmpl-") + hex;
  r.created = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  r.model = model;
  return r;
}

json response_json(Endpoint e, const ResponseId& rid, const std::string& text, const char* finish, const Usage& usage,
                   const json& logprobs) {
  json choice = {{"index", 0}, {"logprobs", logprobs}, {"finish_reason", finish}};
  if (e == Endpoint::chat)
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  else
    choice["text"] = text;
  return json{{"id", rid.id},
              {"object", e == Endpoint::chat ? "chat.completion" : "text_completion"},
              {"created", rid.created},
              {"model", rid.model},
              {"system_fingerprint", "kvq-" KVQ_VERSION},
              {"choices", json::array({choice})},
              {"usage", usage_json(usage)}};
}

json chunk_json(Endpoint e, const ResponseId& rid, const std::string& text, bool first, const char* finish,
                const json& logprobs, bool usage_null) {
  json choice = {{"index", 0}, {"logprobs", logprobs}, {"finish_reason", finish ? json(finish) : json(nullptr)}};
  if (e == Endpoint::chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || first) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  json c = {{"id", rid.id},
            {"object", e == Endpoint::chat ? "chat.completion.chunk" : "text_completion"},
            {"created", rid.created},
            {"model", rid.model},
            {"system_fingerprint", "kvq-" KVQ_VERSION},
            {"choices", json::array({choice})}};
  if (usage_null) c["usage"] = nullptr;
  return c;
}

json usage_chunk_json(Endpoint e, const ResponseId& rid, const Usage& usage) {
  return json{{"id", rid.id},
              {"object", e == Endpoint::chat ? "chat.completion.chunk" : "text_completion"},
              {"created", rid.created},
              {"model", rid.model},
              {"system_fingerprint", "kvq-" KVQ_VERSION},
              {"choices", json::array()},
              {"usage", usage_json(usage)}};
}

}  // namespace kvq::server
