// The server's parts without HTTP: OpenAI request parsing and checking,
// Prometheus text, log-probabilities.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <mutex>
#include <thread>

#include "server/metrics.hpp"
#include "server/openai.hpp"
#include "server/server.hpp"

using namespace kvq;
using namespace kvq::server;
using namespace std::chrono_literals;

namespace {

Defaults defaults() {
  Defaults d;
  d.sampling.temperature = 0.6f;
  d.sampling.top_k = 40;
  d.max_tokens = -1;
  return d;
}

// The ApiError a body raises, or a failure when it parses.
ApiError error_of(Endpoint e, const std::string& body, const Defaults& d = defaults()) {
  try {
    parse_request(e, body, d);
  } catch (const ApiError& err) {
    return err;
  }
  ADD_FAILURE() << "no error for " << body;
  return ApiError(0, "", "", "", "");
}

}  // namespace

TEST(ServerApi, ParsesChatFieldsAndAppliesDefaults) {
  const ApiRequest r = parse_request(Endpoint::chat, R"({
      "model": "m", "messages": [{"role": "developer", "content": "Be brief."},
                                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                 {"role": "assistant", "content": null}],
      "max_tokens": 16, "temperature": 0, "top_p": 0.5, "min_p": 0.1, "seed": 42, "stop": "\n",
      "presence_penalty": 0.5, "frequency_penalty": -0.25, "stream": true, "stream_options": {"include_usage": true},
      "logprobs": true, "top_logprobs": 3, "kv_codec": "k8v4", "user": "ignored", "n": 1,
      "chat_template_kwargs": {"enable_thinking": false}})",
                                     defaults());
  EXPECT_EQ(r.model, "m");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[0].role, "system");  // developer is OpenAI's newer name for it
  EXPECT_EQ(r.messages[1].content, "ab");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(r.max_tokens, 16);
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_EQ(r.sampling.top_p, 0.5f);
  EXPECT_EQ(r.sampling.top_k, 40);  // the server default
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.1f);
  EXPECT_EQ(r.sampling.seed, 42u);
  EXPECT_TRUE(r.seed_given);
  EXPECT_EQ(r.stop, std::vector<std::string>{"\n"});
  EXPECT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_EQ(r.sampling.frequency_penalty, -0.25f);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.logprobs, 3);
  EXPECT_EQ(r.kv_codec, "k8v4");
  EXPECT_FALSE(r.enable_thinking);

  const ApiRequest d = parse_request(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}]})", defaults());
  EXPECT_EQ(d.max_tokens, -1);
  EXPECT_EQ(d.sampling.temperature, 0.6f);
  EXPECT_FALSE(d.seed_given);
  EXPECT_FALSE(d.stream);
  EXPECT_EQ(d.logprobs, -1);
  // max_completion_tokens is the newer name of max_tokens; null means "not set".
  EXPECT_EQ(parse_request(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7,
                                             "temperature": null})", defaults()).max_tokens, 7);
  // A default system message goes first unless the chat has one.
  Defaults sys = defaults();
  sys.system = "S";
  const ApiRequest s = parse_request(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}]})", sys);
  ASSERT_EQ(s.messages.size(), 2u);
  EXPECT_EQ(s.messages[0].content, "S");
}

TEST(ServerApi, ParsesCompletionPrompts) {
  const Defaults d = defaults();
  EXPECT_EQ(parse_request(Endpoint::completion, R"({"prompt": "def f():"})", d).prompt, "def f():");
  EXPECT_EQ(parse_request(Endpoint::completion, R"({"prompt": ["one"]})", d).prompt, "one");
  const ApiRequest ids = parse_request(Endpoint::completion, R"({"prompt": [1, 2, 3], "logprobs": 2})", d);
  EXPECT_TRUE(ids.prompt_is_ids);
  EXPECT_EQ(ids.prompt_ids, (std::vector<TokenId>{1, 2, 3}));
  EXPECT_EQ(ids.logprobs, 2);
  EXPECT_EQ(parse_request(Endpoint::completion, R"({"prompt": [[4, 5]]})", d).prompt_ids, (std::vector<TokenId>{4, 5}));
}

TEST(ServerApi, BadRequestsNameTheField) {
  struct Case {
    Endpoint e;
    std::string body;
    int status;
    const char* param;  // "" when none
    const char* code;   // "" when none
  };
  const Endpoint C = Endpoint::chat, P = Endpoint::completion;
  const std::string m = R"("messages": [{"role": "user", "content": "x"}])";
  const Case cases[] = {
      {C, "{", 400, "", "invalid_json"},
      {C, "", 400, "", "invalid_json"},
      {C, "[1]", 400, "", ""},
      {C, "{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\"}]}", 400, "", "invalid_json"},  // invalid UTF-8
      {C, R"({"messages": [{"role": "user", "content": "\udc00"}]})", 400, "", "invalid_json"},        // lone surrogate
      {C, R"({})", 400, "messages", ""},
      {C, R"({"messages": "hi"})", 400, "messages", ""},
      {C, R"({"messages": []})", 400, "messages", ""},
      {C, R"({"messages": [{"role": "narrator", "content": "x"}]})", 400, "messages[0].role", ""},
      {C, R"({"messages": [{"role": "user"}]})", 400, "messages[0].content", ""},
      {C, R"({"messages": [{"role": "user", "content": 5}]})", 400, "messages[0].content", ""},
      {C, R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", 400, "messages[0].content[0]",
       "unsupported_content"},
      {C, ("{" + m + R"(, "max_tokens": "ten"})"), 400, "max_tokens", ""},
      {C, ("{" + m + R"(, "max_tokens": 0})"), 400, "max_tokens", ""},
      {C, ("{" + m + R"(, "max_tokens": 1.5})"), 400, "max_tokens", ""},
      {C, ("{" + m + R"(, "temperature": 2.5})"), 400, "temperature", ""},
      {C, ("{" + m + R"(, "temperature": "hot"})"), 400, "temperature", ""},
      {C, ("{" + m + R"(, "top_p": 0})"), 400, "top_p", ""},
      {C, ("{" + m + R"(, "presence_penalty": 3})"), 400, "presence_penalty", ""},
      {C, ("{" + m + R"(, "stop": [""]})"), 400, "stop", ""},
      {C, ("{" + m + R"(, "stop": [1]})"), 400, "stop", ""},
      {C, ("{" + m + R"(, "stream": "yes"})"), 400, "stream", ""},
      {C, ("{" + m + R"(, "stream_options": {"include_usage": true}})"), 400, "stream_options", ""},
      {C, ("{" + m + R"(, "n": 0})"), 400, "n", ""},
      {C, ("{" + m + R"(, "n": 17})"), 400, "n", ""},
      {C, ("{" + m + R"(, "n": "two"})"), 400, "n", ""},
      {C, ("{" + m + R"(, "cache_prompt": 1})"), 400, "cache_prompt", ""},
      {Endpoint::completion, R"({"prompt": ["a", "b", "c", "d", "e"], "n": 16})", 400, "n", ""},
      {C, ("{" + m + R"(, "tools": [{"type": "function"}]})"), 400, "tools", "unsupported_parameter"},
      {C, ("{" + m + R"(, "logit_bias": {"1": 101}})"), 400, "logit_bias", ""},
      {C, ("{" + m + R"(, "logit_bias": {"1": "up"}})"), 400, "logit_bias", ""},
      {C, ("{" + m + R"(, "logit_bias": {"-1": 5}})"), 400, "logit_bias", ""},
      {C, ("{" + m + R"(, "logit_bias": {"a7": 5}})"), 400, "logit_bias", ""},
      {C, ("{" + m + R"(, "logit_bias": {"99999999999": 5}})"), 400, "logit_bias", ""},
      {C, ("{" + m + R"(, "min_tokens": -1})"), 400, "min_tokens", ""},
      {C, ("{" + m + R"(, "top_logprobs": 2})"), 400, "top_logprobs", ""},
      {C, ("{" + m + R"(, "top_logprobs": 21, "logprobs": true})"), 400, "top_logprobs", ""},
      {C, ("{" + m + R"(, "model": 7})"), 400, "model", ""},
      {C, ("{" + m + R"(, "kv_codec": ["none"]})"), 400, "kv_codec", ""},
      {P, R"({})", 400, "prompt", ""},
      {P, R"({"prompt": 5})", 400, "prompt", ""},
      {P, R"({"prompt": [1, "a"]})", 400, "prompt", ""},
      {P, R"({"prompt": [-1]})", 400, "prompt", ""},
      {P, R"({"prompt": ["a", 5]})", 400, "prompt", ""},
      {P, R"({"prompt": ["a", "a", "a", "a", "a", "a", "a", "a", "a", "a", "a", "a", "a", "a", "a", "a", "a"]})", 400,
       "prompt", ""},  // 17 prompts: at most 16
      {P, R"({"prompt": "x", "echo": 1})", 400, "echo", ""},
      // Numbers beyond a double's range are the client's malformed JSON, not a 500.
      {C, ("{" + m + R"(, "temperature": 1e309})"), 400, "", "invalid_json"},
      {P, R"({"prompt": "x", "max_tokens": -1e400})", 400, "", "invalid_json"},
      // Fields that would change the answer: served, or refused naming the field (never ignored).
      {C, ("{" + m + R"(, "grammar": "root ::= \"a\""})"), 400, "grammar", "unsupported_parameter"},
      {C, ("{" + m + R"(, "json_schema": {"type": "object"}})"), 400, "json_schema", "unsupported_parameter"},
      {C, ("{" + m + R"(, "guided_json": {"type": "object"}})"), 400, "guided_json", "unsupported_parameter"},
      {C, ("{" + m + R"(, "guided_regex": "a+"})"), 400, "guided_regex", "unsupported_parameter"},
      {C, ("{" + m + R"(, "tool_choice": "required"})"), 400, "tool_choice", "unsupported_parameter"},
      {C, ("{" + m + R"(, "tools": {}})"), 400, "tools", ""},
      {C, ("{" + m + R"(, "logit_bias": []})"), 400, "logit_bias", ""},
      {C, ("{" + m + R"(, "ignore_eos": "yes"})"), 400, "ignore_eos", ""},
      {C, ("{" + m + R"(, "stop_token_ids": [-1]})"), 400, "stop_token_ids", ""},
      {C, ("{" + m + R"(, "stop_token_ids": 5})"), 400, "stop_token_ids", ""},
      {C, ("{" + m + R"(, "response_format": {"type": "json_object"}})"), 400, "response_format", "unsupported_parameter"},
      {P, R"({"prompt": "x", "logprobs": 50})", 400, "logprobs", ""},
  };
  for (const Case& c : cases) {
    const ApiError e = error_of(c.e, c.body);
    EXPECT_EQ(e.status(), c.status) << c.body;
    EXPECT_EQ(e.param(), c.param) << c.body << ": " << e.what();
    EXPECT_EQ(e.code(), c.code) << c.body << ": " << e.what();
    EXPECT_EQ(e.type(), "invalid_request_error") << c.body;
    EXPECT_FALSE(std::string(e.what()).empty());
  }
}

TEST(ServerApi, ErrorEnvelopeAndResponseShapes) {
  const json err = error_json(ApiError(404, "invalid_request_error", "model_not_found", "model", "no such model"));
  EXPECT_EQ(err, json::parse(R"({"error": {"message": "no such model", "type": "invalid_request_error",
                                           "param": "model", "code": "model_not_found"}})"));
  EXPECT_TRUE(error_json(ApiError(400, "invalid_request_error", "", "", "x"))["error"]["param"].is_null());

  const ResponseId rid = new_response_id(Endpoint::chat, "m");
  EXPECT_EQ(rid.id.rfind("chatcmpl-", 0), 0u);
  EXPECT_NE(new_response_id(Endpoint::chat, "m").id, rid.id);
  const json r = response_json(Endpoint::chat, rid, "hi", "stop", Usage{5, 2}, nullptr);
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["choices"][0]["message"]["content"], "hi");
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r["usage"]["total_tokens"], 7);
  const json first = chunk_json(Endpoint::chat, rid, "", true, nullptr, nullptr);
  EXPECT_EQ(first["choices"][0]["delta"], json::parse(R"({"role": "assistant", "content": ""})"));
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  const json last = chunk_json(Endpoint::chat, rid, "", false, "length", nullptr);
  EXPECT_EQ(last["choices"][0]["delta"], json::object());
  // Usage only in the usage chunk: no key without stream_options.include_usage, null with it.
  EXPECT_FALSE(first.contains("usage"));
  EXPECT_FALSE(last.contains("usage"));
  const json last_u = chunk_json(Endpoint::chat, rid, "", false, "length", nullptr, /*usage_null=*/true);
  EXPECT_TRUE(last_u.contains("usage") && last_u["usage"].is_null());
  const json text = chunk_json(Endpoint::completion, new_response_id(Endpoint::completion, "m"), "x", false, nullptr,
                               nullptr);
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["choices"][0]["text"], "x");
  EXPECT_EQ(usage_chunk_json(Endpoint::chat, rid, Usage{1, 1})["choices"], json::array());
  EXPECT_STREQ(finish_reason(StopReason::eog), "stop");
  EXPECT_STREQ(finish_reason(StopReason::stop_string), "stop");
  EXPECT_STREQ(finish_reason(StopReason::max_tokens), "length");
  EXPECT_STREQ(finish_reason(StopReason::context_full), "length");
  // Token pieces can be partial UTF-8: dumped as U+FFFD, never an exception.
  EXPECT_EQ(dump(json("a\xe2\x82")), "\"a\xef\xbf\xbd\"");
}

TEST(ServerApi, TokenLogprobIsTheLogSoftmax) {
  const std::vector<float> l = {1.0f, 3.0f, -INFINITY, 2.0f, NAN};
  const TokenLogprob t = token_logprob(l.data(), 5, 3, 3);
  const double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0);
  EXPECT_NEAR(t.logprob, 2.0 - std::log(z), 1e-6);
  ASSERT_EQ(t.top.size(), 3u);
  EXPECT_EQ(t.top[0].first, 1);
  EXPECT_EQ(t.top[1].first, 3);
  EXPECT_EQ(t.top[2].first, 0);
  EXPECT_NEAR(t.top[0].second, 3.0 - std::log(z), 1e-6);
  EXPECT_TRUE(token_logprob(l.data(), 5, 2, 0).top.empty());
  EXPECT_EQ(token_logprob(l.data(), 5, 2, 0).logprob, -INFINITY);  // sent as -9999 in JSON
}

TEST(Metrics, PrometheusTextHasCumulativeBucketsCountersAndGauges) {
  Metrics m;
  m.request("/v1/completions", 200);
  m.request("/v1/completions", 200);
  m.request("/v1/completions", 429);
  m.request("/secret/../path", 404);  // unknown routes are not labels
  m.tokens(10, 3);
  m.ttft().observe(0.003);
  m.ttft().observe(0.3);
  m.ttft().observe(100);
  m.cancelled();
  Gauges g;
  g.queue_depth = 2;
  g.running = 1;
  g.kv_bytes = 12345;
  g.kv_pool_bytes = 99999;
  g.sched.running = 1;
  g.sched.waiting = 2;
  g.sched.preempted = 1;
  g.sched.pages_total = 10;
  g.sched.pages_used = 3;
  g.sched.pages_free = 7;
  g.sched.step_sequences = 4;
  g.sched.steps = 17;
  g.sched.preemptions = 5;
  g.sched.step_sequences_hist[0] = 2;  // two steps of 1 sequence
  g.sched.step_sequences_hist[3] = 1;  // one step of 5..8
  g.sched.step_sequences_hist[9] = 1;  // one step above 256
  g.sched.step_sequences_sum = 2 + 7 + 300;
  m.e2e().observe(0.7);
  const std::string t = m.render(g);
  auto has = [&](const std::string& line) { return t.find("\n" + line + "\n") != std::string::npos; };
  EXPECT_TRUE(has("kvq_requests_total{route=\"/v1/completions\",status=\"200\"} 2")) << t;
  EXPECT_TRUE(has("kvq_requests_total{route=\"/v1/completions\",status=\"429\"} 1"));
  EXPECT_TRUE(has("kvq_requests_total{route=\"other\",status=\"404\"} 1"));
  EXPECT_EQ(t.find("secret"), std::string::npos);
  EXPECT_TRUE(has("kvq_prompt_tokens_total 10"));
  EXPECT_TRUE(has("kvq_generation_tokens_total 3"));
  EXPECT_TRUE(has("kvq_requests_cancelled_total 1"));
  EXPECT_TRUE(has("# TYPE kvq_time_to_first_token_seconds histogram"));
  EXPECT_TRUE(has("kvq_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
  EXPECT_TRUE(has("kvq_time_to_first_token_seconds_bucket{le=\"0.25\"} 1"));
  EXPECT_TRUE(has("kvq_time_to_first_token_seconds_bucket{le=\"0.5\"} 2"));
  EXPECT_TRUE(has("kvq_time_to_first_token_seconds_bucket{le=\"60\"} 2"));
  EXPECT_TRUE(has("kvq_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3"));
  EXPECT_TRUE(has("# TYPE kvq_step_batch_sequences histogram"));
  EXPECT_TRUE(has("kvq_step_batch_sequences_bucket{le=\"1\"} 2"));
  EXPECT_TRUE(has("kvq_step_batch_sequences_bucket{le=\"4\"} 2"));
  EXPECT_TRUE(has("kvq_step_batch_sequences_bucket{le=\"8\"} 3"));
  EXPECT_TRUE(has("kvq_step_batch_sequences_bucket{le=\"256\"} 3"));
  EXPECT_TRUE(has("kvq_step_batch_sequences_bucket{le=\"+Inf\"} 4"));
  EXPECT_TRUE(has("kvq_step_batch_sequences_sum 309"));
  EXPECT_TRUE(has("kvq_step_batch_sequences_count 4"));
  EXPECT_TRUE(has("kvq_request_duration_seconds_bucket{le=\"0.5\"} 0"));
  EXPECT_TRUE(has("kvq_request_duration_seconds_bucket{le=\"1\"} 1"));
  EXPECT_TRUE(has("kvq_request_duration_seconds_count 1"));
  EXPECT_TRUE(has("kvq_time_to_first_token_seconds_count 3"));
  EXPECT_TRUE(has("kvq_time_to_first_token_seconds_sum 100.303"));
  EXPECT_TRUE(has("kvq_inter_token_latency_seconds_count 0"));
  EXPECT_TRUE(has("kvq_queue_depth 2"));
  EXPECT_TRUE(has("kvq_requests_running 1"));
  EXPECT_TRUE(has("kvq_kv_cache_bytes 12345"));
  EXPECT_TRUE(has("kvq_kv_pool_bytes 99999"));
  EXPECT_TRUE(has("kvq_sequences_running 1"));
  EXPECT_TRUE(has("kvq_sequences_waiting 2"));
  EXPECT_TRUE(has("kvq_sequences_preempted 1"));
  EXPECT_TRUE(has("kvq_kv_pages_total 10"));
  EXPECT_TRUE(has("kvq_kv_pages_used 3"));
  EXPECT_TRUE(has("kvq_kv_pages_free 7"));
  EXPECT_TRUE(has("kvq_step_sequences 4"));
  EXPECT_TRUE(has("# TYPE kvq_steps_total counter"));
  EXPECT_TRUE(has("kvq_steps_total 17"));
  EXPECT_TRUE(has("kvq_preemptions_total 5"));
  // The process's resident memory under the standard Prometheus name: what
  // the kernel's own VmRSS line says (read a moment apart, so near, not equal).
  EXPECT_TRUE(has("# TYPE process_resident_memory_bytes gauge"));
  const std::string rss_name = "\nprocess_resident_memory_bytes ";
  const size_t at = t.find(rss_name);
  ASSERT_NE(at, std::string::npos) << t;
  const double rss = std::stod(t.substr(at + rss_name.size()));
  std::ifstream status("/proc/self/status");
  double vm_rss_kib = -1;
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) vm_rss_kib = std::stod(line.substr(6));
  ASSERT_GT(vm_rss_kib, 0);
  EXPECT_NEAR(rss, vm_rss_kib * 1024, 16.0 * 1024 * 1024);
  EXPECT_GT(process_resident_bytes(), 0u);
  EXPECT_EQ(t.back(), '\n');
}

TEST(ServerApi, CheapFieldsAreServed) {
  const Defaults d;
  const ApiRequest r = parse_request(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}],
      "ignore_eos": true, "stop_token_ids": [3, 7], "min_tokens": 0, "logit_bias": {}, "tools": [],
      "tool_choice": "none"})", d);
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_EQ(r.n, 1);
  EXPECT_TRUE(r.cache_prompt);
  EXPECT_EQ(r.stop_token_ids, (std::vector<TokenId>{3, 7}));
  const ApiRequest many = parse_request(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}],
      "n": 3, "cache_prompt": false})", d);
  EXPECT_EQ(many.n, 3);
  EXPECT_FALSE(many.cache_prompt);
  EXPECT_TRUE(r.sampling.logit_bias.empty());
  EXPECT_EQ(r.sampling.min_tokens, 0);
  const ApiRequest biased = parse_request(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}],
      "min_tokens": 4, "logit_bias": {"12": -100, "7": 2.5}, "temperature": 0})", d);
  EXPECT_EQ(biased.sampling.min_tokens, 4);
  auto bias = biased.sampling.logit_bias;
  std::sort(bias.begin(), bias.end());
  EXPECT_EQ(bias, (std::vector<std::pair<TokenId, float>>{{7, 2.5f}, {12, -100.0f}}));
  EXPECT_FALSE(biased.sampling.plain_greedy());  // the backend's argmax cannot apply a bias
  const ApiRequest p = parse_request(Endpoint::completion, R"({"prompt": "x", "echo": true})", d);
  EXPECT_TRUE(p.echo);
  const ApiRequest b = parse_request(Endpoint::completion, R"({"prompt": ["a", [5, 6], "c"]})", d);
  EXPECT_EQ(b.prompt, "a");
  EXPECT_FALSE(b.prompt_is_ids);
  ASSERT_EQ(b.more_prompts.size(), 2u);
  EXPECT_EQ(b.more_prompts[0].ids, (std::vector<TokenId>{5, 6}));
  EXPECT_TRUE(b.more_prompts[0].is_ids);
  EXPECT_EQ(b.more_prompts[1].text, "c");
}

TEST(ServerApi, APublicBindWithoutAKeyIsWarnedAbout) {
  ServerOptions o;
  o.host = "0.0.0.0";
  EXPECT_NE(startup_warnings(o).find("--api-key"), std::string::npos);
  o.api_key = "k";
  EXPECT_EQ(startup_warnings(o), "");
  o.api_key.clear();
  for (const char* h : {"127.0.0.1", "localhost", "::1"}) {
    o.host = h;
    EXPECT_EQ(startup_warnings(o), "") << h;
  }
}
