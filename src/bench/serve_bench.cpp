#include "bench/serve_bench.hpp"

#include <httplib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include "bench/report_text.hpp"
#include "bench/run_meta.hpp"
#include "bench/stats.hpp"
#include "core/error.hpp"
#include "core/text.hpp"

namespace kvq::bench {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(trim_space(item));
  return out;
}

// SplitMix64: per-request seeds from (seed, stream, index).
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
uint64_t seed_of(uint64_t seed, uint64_t stream, uint64_t index) { return mix(mix(mix(seed) ^ stream) ^ index); }
constexpr uint64_t kHangUpStream = 0x68616e67;  // "hang"

int sample(const LengthDist& d, std::mt19937_64& rng) {
  if (d.fixed()) return d.lo;
  return std::uniform_int_distribution<int>(d.lo, d.hi)(rng);
}


Percentiles pcts(const std::vector<double>& v, double scale) {
  if (v.empty()) return {};
  return {percentile(v, 50) * scale, percentile(v, 90) * scale, percentile(v, 99) * scale};
}

std::string level_label(const ServeLevel& l) {
  char rate[32];
  std::snprintf(rate, sizeof rate, "%g", l.rate);
  return l.mode == "rate" ? "rate " + std::string(rate) + " req/s" : "concurrency " + std::to_string(l.concurrency);
}

// The error text of a non-200 answer: OpenAI's {"error": {"message"}} when it is one.
std::string http_error(int status, const std::string& body) {
  std::string msg = trim_space(body);
  try {
    const json j = json::parse(body);
    if (j.contains("error")) {
      const json& e = j["error"];
      if (e.is_object() && e.contains("message") && e["message"].is_string())
        msg = e["message"].get<std::string>();
      else if (e.is_string())
        msg = e.get<std::string>();
    }
  } catch (const json::exception&) {
  }
  if (msg.size() > 160) msg = msg.substr(0, 160) + "...";
  return "HTTP " + std::to_string(status) + (msg.empty() ? "" : ": " + msg);
}

}  // namespace

std::string LengthDist::str() const { return fixed() ? std::to_string(lo) : std::to_string(lo) + ":" + std::to_string(hi); }

LengthDist parse_length_dist(const std::string& s, const char* what, int min) {
  static const std::regex re(R"(\s*(\d{1,9})\s*(?::\s*(\d{1,9})\s*)?)");
  std::smatch m;
  KVQ_CHECK(std::regex_match(s, m, re), Errc::invalid_argument, what, " must be a token count N or a range LO:HI ",
            "(uniform), got '", s, "'");
  LengthDist d;
  d.lo = std::stoi(m[1]);
  d.hi = m[2].matched ? std::stoi(m[2]) : d.lo;
  KVQ_CHECK(d.lo >= min && d.lo <= d.hi, Errc::invalid_argument, what, " '", s, "': need ", min,
            " <= LO <= HI");
  return d;
}

std::vector<int> parse_int_list(const std::string& s, const char* what) {
  std::vector<int> out;
  for (const auto& item : split_commas(s)) {
    static const std::regex re(R"(\d{1,7})");
    KVQ_CHECK(std::regex_match(item, re) && std::stoi(item) >= 1, Errc::invalid_argument, what,
              " must be a comma list of positive integers (e.g. 1,8,64), got '", s, "'");
    out.push_back(std::stoi(item));
  }
  KVQ_CHECK(!out.empty(), Errc::invalid_argument, what, " is empty");
  return out;
}

std::vector<double> parse_rate_list(const std::string& s, const char* what) {
  std::vector<double> out;
  for (const auto& item : split_commas(s)) {
    static const std::regex re(R"((\d+\.?\d*|\.\d+))");
    KVQ_CHECK(std::regex_match(item, re), Errc::invalid_argument, what,
              " must be a comma list of request rates in req/s (e.g. 1,4,16 or 0.5), got '", s, "'");
    const double r = std::stod(item);
    KVQ_CHECK(r > 0 && std::isfinite(r), Errc::invalid_argument, what, ": a rate must be above 0, got '", item, "'");
    out.push_back(r);
  }
  KVQ_CHECK(!out.empty(), Errc::invalid_argument, what, " is empty");
  return out;
}

double parse_disconnect_fraction(const std::string& s) {
  static const std::regex re(R"(\s*(\d+\.?\d*|\.\d+)\s*)");
  const bool number = std::regex_match(s, re);
  const double f = number ? std::stod(s) : -1;
  KVQ_CHECK(number && f < 1, Errc::invalid_argument,
            "--disconnect must be a fraction of the requests, 0 <= F < 1 (e.g. 0.1), got '", s, "'");
  return f;
}

int hang_up_point(uint64_t seed, int index, int gen, double fraction) {
  if (!(fraction > 0)) return -1;
  // Its own stream, apart from the prefix (1), lengths (2), prompts (3 + level)
  // and arrivals (1000 + level): adding --disconnect changes nothing else.
  std::mt19937_64 rng(seed_of(seed, kHangUpStream, uint64_t(index)));
  if (std::uniform_real_distribution<double>(0, 1)(rng) >= fraction) return -1;
  if (gen <= 1) return 0;
  return std::uniform_int_distribution<int>(1, gen - 1)(rng);
}

Endpoint parse_endpoint(const std::string& url) {
  static const std::regex re(R"((https?)://([^/:?#\s]+|\[[0-9A-Fa-f:.]+\])(?::(\d{1,5}))?(/[^?#\s]*)?)");
  std::smatch m;
  KVQ_CHECK(std::regex_match(url, m, re), Errc::invalid_argument, "--url must look like http://HOST:PORT (optionally ",
            "with a path prefix, e.g. http://127.0.0.1:8080 or http://gpu:8000/v1), got '", url, "'");
  if (m[3].matched) {
    const int port = std::stoi(m[3]);
    KVQ_CHECK(port >= 1 && port <= 65535, Errc::invalid_argument, "--url '", url, "': port ", port,
              " is out of range");
  }
  Endpoint ep;
  ep.scheme_host_port = m[1].str() + "://" + m[2].str() + (m[3].matched ? ":" + m[3].str() : "");
  std::string prefix = m[4].matched ? m[4].str() : "";
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  if (prefix.size() >= 3 && prefix.compare(prefix.size() - 3, 3, "/v1") == 0) prefix.resize(prefix.size() - 3);
  ep.path = prefix + "/v1/completions";
  return ep;
}

namespace {

RequestResult send_json_prompt(const Endpoint& ep, const std::string& api_key, const std::string& model,
                               json prompt, int sent_tokens, int gen, double timeout_s, int hang_up_after) {
  RequestResult r;
  r.prompt_tokens = sent_tokens;
  r.gen = gen;
  json body = {{"prompt", std::move(prompt)},
               {"max_tokens", gen},
               {"min_tokens", gen},
               {"ignore_eos", true},
               {"temperature", 0},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  if (!model.empty()) body["model"] = model;

  httplib::Client cli(ep.scheme_host_port);
  cli.set_connection_timeout(10, 0);
  const auto to = std::chrono::duration<double>(timeout_s);
  cli.set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(to));
  cli.set_write_timeout(30, 0);

  httplib::Request req;
  req.method = "POST";
  req.path = ep.path;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.set_header("Accept", "text/event-stream");
  if (!api_key.empty()) req.set_header("Authorization", "Bearer " + api_key);

  int status = 0;
  std::string err_body, buf, stream_error;
  bool done = false;
  bool generation_over = false;  // an event said so: a finish_reason, or the usage
  bool hung_up = false;          // we closed the connection on purpose (hang_up_after)
  int usage_tokens = -1, usage_prompt = -1;
  std::vector<Clock::time_point> chunk_times;
  Clock::time_point end_time{};
  // One SSE line (the event's "data:" payload; other fields are ignored).
  auto on_line = [&](const std::string& raw) {
    std::string line = raw;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.rfind("data:", 0) != 0) return;
    const std::string payload = trim_space(line.substr(5));
    if (payload.empty()) return;
    if (payload == "[DONE]") {
      done = true;
      end_time = Clock::now();
      return;
    }
    const auto now = Clock::now();
    json j;
    try {
      j = json::parse(payload);
    } catch (const json::exception&) {
      if (stream_error.empty()) stream_error = "bad SSE event (not JSON): " + payload.substr(0, 80);
      return;
    }
    if (j.contains("error") && !j["error"].is_null()) {
      if (stream_error.empty()) stream_error = "error event: " + http_error(200, payload).substr(9);
      return;
    }
    if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
      const json& c = j["choices"][0];
      if (c.contains("text") && c["text"].is_string() && !c["text"].get_ref<const std::string&>().empty())
        chunk_times.push_back(now);
      if (c.contains("finish_reason") && c["finish_reason"].is_string()) generation_over = true;
    }
    if (j.contains("usage") && j["usage"].is_object()) generation_over = true;
    if (j.contains("usage") && j["usage"].is_object() && j["usage"].contains("completion_tokens") &&
        j["usage"]["completion_tokens"].is_number_integer())
      usage_tokens = j["usage"]["completion_tokens"].get<int>();
    if (j.contains("usage") && j["usage"].is_object() && j["usage"].contains("prompt_tokens") &&
        j["usage"]["prompt_tokens"].is_number_integer())
      usage_prompt = j["usage"]["prompt_tokens"].get<int>();
  };
  req.response_handler = [&](const httplib::Response& res) {
    status = res.status;
    if (status == 200 && hang_up_after == 0) {  // gen 1: hang up before the first chunk
      hung_up = true;
      return false;
    }
    return true;
  };
  // A request picked to hang up does so at its k-th text chunk, or at the
  // end of the generation when fewer chunks come (a server that sends
  // several tokens in one), so every pick hangs up (docs/bench.md).
  auto hang_up_now = [&] {
    return hang_up_after >= 0 &&
           (int(chunk_times.size()) >= hang_up_after || generation_over || done || !stream_error.empty());
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (status != 200) {
      if (err_body.size() < 4096) err_body.append(data, std::min(n, 4096 - err_body.size()));
      return true;
    }
    buf.append(data, n);
    size_t start = 0, nl;
    while ((nl = buf.find('\n', start)) != std::string::npos) {
      on_line(buf.substr(start, nl - start));
      start = nl + 1;
      if (hang_up_now()) {
        hung_up = true;
        return false;  // cpp-httplib closes the connection
      }
    }
    buf.erase(0, start);
    return true;
  };

  const auto t0 = Clock::now();
  const httplib::Result res = cli.send(req);
  const auto t_end = Clock::now();
  if (!buf.empty() && !hung_up) on_line(buf);
  if (!done) end_time = t_end;
  r.chunks = int(chunk_times.size());
  r.tokens = usage_tokens >= 0 ? usage_tokens : r.chunks;
  if (usage_prompt >= 0) r.prompt_tokens = usage_prompt;

  if (hung_up) {
    // An error event before the hang-up is still an answer gone wrong.
    r.disconnected = stream_error.empty();
    r.error = stream_error;
    return r;
  }
  if (!res) {
    r.error = "connection: " + httplib::to_string(res.error());
    if (status == 200 && !chunk_times.empty()) r.error += " (after " + std::to_string(r.chunks) + " chunks)";
    return r;
  }
  if (res->status != 200) {
    r.error = http_error(res->status, err_body.empty() ? res->body : err_body);
    return r;
  }
  if (!stream_error.empty()) {
    r.error = stream_error;
    return r;
  }
  if (!done) {
    r.error = "stream ended without [DONE]";
    return r;
  }
  if (chunk_times.empty()) {
    r.error = "no tokens in the stream";
    return r;
  }
  // Asked for exactly gen (max_tokens = min_tokens, ignore_eos): anything
  // else is a wrong answer. Without a usage the text chunks are all there is
  // to count, and they need not be one a token, so no check.
  if (usage_tokens >= 0 && usage_tokens != gen) {
    r.error = "wrong length: " + std::to_string(usage_tokens) + " of " + std::to_string(gen) + " tokens";
    return r;
  }
  r.ok = true;
  r.ttft_s = secs(chunk_times.front() - t0);
  r.e2e_s = secs(end_time - t0);
  for (size_t i = 1; i < chunk_times.size(); ++i) r.itl_s.push_back(secs(chunk_times[i] - chunk_times[i - 1]));
  if (r.tokens >= 2) r.tpot_s = secs(end_time - chunk_times.front()) / (r.tokens - 1);
  return r;
}

}  // namespace

RequestResult send_completion(const Endpoint& ep, const std::string& api_key, const std::string& model,
                              const std::vector<int32_t>& prompt, int gen, double timeout_s, int hang_up_after) {
  return send_json_prompt(ep, api_key, model, json(prompt), int(prompt.size()), gen, timeout_s, hang_up_after);
}

RequestResult send_completion_text(const Endpoint& ep, const std::string& api_key, const std::string& model,
                                   const std::string& prompt, int gen, double timeout_s, int hang_up_after) {
  return send_json_prompt(ep, api_key, model, json(prompt), 0, gen, timeout_s, hang_up_after);
}

std::string random_words(int n, uint64_t seed) {
  static const char* const kWords[] = {
      "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
      "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were",
      "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would",
      "who", "so", "no", "time", "people", "year", "way", "day", "man", "thing", "woman", "life", "child", "world",
      "school", "state", "family", "group", "country"};
  constexpr int kN = int(sizeof kWords / sizeof kWords[0]);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick(0, kN - 1);
  std::string s;
  for (int i = 0; i < n; ++i) {
    s += ' ';
    s += kWords[pick(rng)];
  }
  return s;
}

ServeLevel summarize_level(const std::vector<RequestResult>& reqs, double duration_s) {
  ServeLevel l;
  l.requests = int(reqs.size());
  l.duration_s = duration_s;
  std::vector<double> ttft, tpot, itl, e2e;
  std::map<std::string, int> errors;
  double ttft_sum = 0;
  for (const auto& r : reqs) {
    if (r.disconnected) {
      ++l.disconnected;
      continue;
    }
    if (!r.ok) {
      ++errors[r.error.empty() ? "unknown" : r.error];
      continue;
    }
    ++l.ok;
    l.prompt_tokens += r.prompt_tokens;
    l.output_tokens += r.tokens;
    ttft.push_back(r.ttft_s);
    ttft_sum += r.ttft_s;
    e2e.push_back(r.e2e_s);
    if (r.tokens >= 2) tpot.push_back(r.tpot_s);
    itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
  }
  l.failed = l.requests - l.ok - l.disconnected;
  if (duration_s > 0) {
    l.req_per_s = l.ok / duration_s;
    l.out_tok_per_s = double(l.output_tokens) / duration_s;
    l.in_tok_per_s = double(l.prompt_tokens) / duration_s;
  }
  if (l.ok > 0) {
    l.ttft_mean_s = ttft_sum / l.ok;
    l.ttft_s = pcts(ttft, 1);
    l.e2e_s = pcts(e2e, 1);
  }
  l.has_tpot = !tpot.empty();
  l.tpot_ms = pcts(tpot, 1000);
  l.has_itl = !itl.empty();
  l.itl_ms = pcts(itl, 1000);
  json e = json::object();
  for (const auto& [k, v] : errors) e[k] = v;
  l.errors_json = e.dump();
  return l;
}

std::string format_serve_progress(const ServeProgress& p) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "[%d/%d] %s: %d/%d done, %d failed, %d disconnected, %d in flight | %.1f s",
                p.level + 1, p.levels, p.label.c_str(), p.done, p.requests, p.failed, p.disconnected, p.in_flight,
                p.elapsed_s);
  return p.server.empty() ? std::string(buf) : std::string(buf) + " | " + p.server;
}

namespace {

// ServeLevel::server_json, parsed; {} (not checked) for anything unreadable.
json server_check_json(const std::string& server_json) {
  try {
    json j = json::parse(server_json);
    if (j.is_object()) return j;
  } catch (const json::exception&) {
  }
  return json::object();
}

int64_t int_of(const json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<int64_t>() : -1;
}

std::string mib(int64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", double(bytes) / (1024.0 * 1024.0));
  return b;
}

}  // namespace

std::string server_check_text(const std::string& server_json) {
  const json j = server_check_json(server_json);
  if (j.contains("error") && j["error"].is_string()) return "server check failed: " + j["error"].get<std::string>();
  if (!j.contains("pages_used_after")) return "server not checked (no kvq metrics)";
  const int64_t pages = int_of(j, "pages_used_after"), running = int_of(j, "sequences_running_after");
  std::string t = pages == 0 && running <= 0 ? "server idle: " : "server NOT idle after 30 s: ";
  t += std::to_string(pages) + " KV pages used";
  if (running > 0) t += ", " + std::to_string(running) + " sequences running";
  const int64_t before = int_of(j, "rss_before"), after = int_of(j, "rss_after");
  if (after >= 0) t += ", RSS " + (before >= 0 ? mib(before) + " -> " : std::string()) + mib(after) + " MiB";
  return t;
}

std::string serve_csv_header() {
  return "run_id,level,mode,concurrency,rate,requests,ok,failed,disconnected,duration_s,req_per_s,out_tok_per_s,"
         "in_tok_per_s,prompt_tokens,output_tokens,ttft_mean_s,ttft_p50_s,ttft_p90_s,ttft_p99_s,tpot_p50_ms,"
         "tpot_p90_ms,tpot_p99_ms,itl_p50_ms,itl_p90_ms,itl_p99_ms,e2e_p50_s,e2e_p99_s,errors,pages_used_after,"
         "sequences_running_after,rss_before,rss_after\n";
}

std::string serve_csv_row(int64_t run_id, const ServeLevel& l) {
  const bool m = l.ok > 0;
  std::vector<std::string> f = {std::to_string(run_id), std::to_string(l.level), l.mode, std::to_string(l.concurrency),
                                l.mode == "rate" ? num(l.rate, 4) : "", std::to_string(l.requests),
                                std::to_string(l.ok), std::to_string(l.failed), std::to_string(l.disconnected),
                                num(l.duration_s, 4), num(l.req_per_s, 4), num(l.out_tok_per_s, 3),
                                num(l.in_tok_per_s, 3),
                                std::to_string(l.prompt_tokens), std::to_string(l.output_tokens)};
  auto val = [&](bool present, double v, int d) { f.push_back(present ? num(v, d) : ""); };
  val(m, l.ttft_mean_s, 6);
  for (double v : {l.ttft_s.p50, l.ttft_s.p90, l.ttft_s.p99}) val(m, v, 6);
  for (double v : {l.tpot_ms.p50, l.tpot_ms.p90, l.tpot_ms.p99}) val(m && l.has_tpot, v, 4);
  for (double v : {l.itl_ms.p50, l.itl_ms.p90, l.itl_ms.p99}) val(m && l.has_itl, v, 4);
  val(m, l.e2e_s.p50, 6);
  val(m, l.e2e_s.p99, 6);
  f.push_back(csv_field(l.errors_json == "{}" ? "" : l.errors_json));
  // The server check, empty where it was not made (or is not exported).
  const json server = server_check_json(l.server_json);
  for (const char* k : {"pages_used_after", "sequences_running_after", "rss_before", "rss_after"}) {
    const int64_t v = int_of(server, k);
    f.push_back(v >= 0 ? std::to_string(v) : "");
  }
  std::string s;
  for (size_t i = 0; i < f.size(); ++i) s += (i ? "," : "") + f[i];
  return s + "\n";
}

std::string serve_report_markdown(const RunRow& run, const std::vector<ServeLevel>& levels,
                                  const std::vector<std::string>& plot_files, const std::string& plot_note) {
  std::ostringstream r;
  json p = json::object();
  try {
    p = json::parse(run.meta.params_json);
  } catch (const json::exception&) {
  }
  auto param = [&](const char* k) { return p.contains(k) ? (p[k].is_string() ? p[k].get<std::string>() : p[k].dump()) : std::string("?"); };
  r << "# kvq bench serve: run " << run.run_id << "\n\n"
    << "| | |\n|---|---|\n"
    << "| started | " << run.meta.started_at << " |\n"
    << "| status | " << run.status << " |\n"
    << "| server | " << md(param("url")) << " |\n"
    << "| model | " << md(param("model")) << " |\n"
    << "| prompt | " << md(param("shared_prefix")) << " shared + " << md(param("prompt_len"))
    << (param("prompt_format") == "text" ? " unique words (random common words, about a token each" : " unique tokens (random ids")
    << ", seed " << md(param("seed")) << ") |\n"
    << "| output | " << md(param("gen")) << " tokens (max_tokens = min_tokens, ignore_eos; any other "
    << "usage.completion_tokens fails the request) |\n"
    << "| requests per level | " << md(param("requests")) << " |\n"
    << "| disconnects | "
    << (p.contains("disconnect") && p["disconnect"].is_number() && p["disconnect"].get<double>() > 0
            ? "a fraction " + md(param("disconnect")) +
                  " of the requests (seeded) hang up on purpose after a random number of text chunks"
            : std::string("none"))
    << " |\n"
    << "| kvq | " << run.meta.kvq_version << " (" << run.meta.git_sha << ", " << run.meta.build_type << ") on "
    << md(run.meta.host) << " |\n"
    << "| command | `" << md(param("command_line")) << "` |\n\n";

  r << "## Levels\n\n"
    << "| level | requests | ok | failed | disconnected | req/s | output tok/s | TTFT mean s | "
       "TTFT p50 / p90 / p99 s | TPOT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | E2E p50 / p99 s |\n"
    << "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|\n";
  for (const auto& l : levels) {
    const bool m = l.ok > 0;
    auto three = [](const Percentiles& q) { return sig(q.p50) + " / " + sig(q.p90) + " / " + sig(q.p99); };
    r << "| " << level_label(l) << " | " << l.requests << " | " << l.ok << " | " << (l.failed ? "**" : "") << l.failed
      << (l.failed ? "**" : "") << " | " << l.disconnected << " | " << sig(l.req_per_s) << " | "
      << sig(l.out_tok_per_s) << " | " << (m ? sig(l.ttft_mean_s) : "-") << " | " << (m ? three(l.ttft_s) : "-") << " | "
      << (m && l.has_tpot ? three(l.tpot_ms) : "-") << " | " << (m && l.has_itl ? three(l.itl_ms) : "-") << " | "
      << (m ? sig(l.e2e_s.p50) + " / " + sig(l.e2e_s.p99) : "-") << " |\n";
  }
  r << "\n";

  bool any_failed = false;
  for (const auto& l : levels) any_failed = any_failed || l.failed > 0;
  if (any_failed) {
    r << "## Failed requests\n\n| level | reason | requests |\n|---|---|---:|\n";
    for (const auto& l : levels) {
      json e = json::object();
      try {
        e = json::parse(l.errors_json);
      } catch (const json::exception&) {
      }
      for (auto it = e.begin(); it != e.end(); ++it)
        r << "| " << level_label(l) << " | " << md(it.key()) << " | " << it.value().dump() << " |\n";
    }
    r << "\n";
  }

  r << "## Server state after each level\n\n";
  bool checked = false;
  for (const auto& l : levels) checked = checked || server_check_json(l.server_json) != json::object();
  if (!checked) {
    r << "Not checked: the server's `/metrics` has no `kvq_kv_pages_used` (it is not kvq serve, or does not "
         "export its metrics), so whether it let go of every request's KV pages, and its memory, are unknown.\n\n";
  } else {
    r << "| level | KV pages used after | sequences running after | RSS before -> after MiB | RSS change MiB |\n"
      << "|---|---:|---:|---|---:|\n";
    for (const auto& l : levels) {
      const json j = server_check_json(l.server_json);
      if (j.contains("error")) {
        r << "| " << level_label(l) << " | **" << md(server_check_text(l.server_json)) << "** | | | |\n";
        continue;
      }
      const int64_t pages = int_of(j, "pages_used_after"), running = int_of(j, "sequences_running_after");
      const int64_t before = int_of(j, "rss_before"), after = int_of(j, "rss_after");
      auto flag = [](int64_t v) { return v > 0 ? "**" + std::to_string(v) + "**" : v == 0 ? "0" : "-"; };
      r << "| " << level_label(l) << " | " << flag(pages) << " | " << flag(running) << " | "
        << (before >= 0 && after >= 0 ? mib(before) + " -> " + mib(after) : after >= 0 ? mib(after) : "-") << " | "
        << (before >= 0 && after >= 0 ? (after >= before ? "+" : "") + mib(after - before) : "-") << " |\n";
    }
    r << "\nAfter each level the client polled the server's `/metrics` (every 100 ms, at most 30 s) until no "
         "sequence ran and no KV page was held (`kvq_kv_pages_used`; pages only the prefix cache keeps are not "
         "held), then read its resident memory (`process_resident_memory_bytes`); RSS before is read as the level "
         "starts. A level that leaves pages held, or memory that keeps growing level after level, is a leak.\n\n";
  }

  r << "## Plot\n\n";
  for (const auto& f : plot_files)
    if (f.size() > 4 && f.compare(f.size() - 4, 4, ".svg") == 0) r << "![" << f << "](" << f << ")\n\n";
  if (!plot_note.empty()) r << plot_note << "\n\n";
  r << "TTFT: request sent until the first text chunk. ITL: every gap between text chunks. TPOT: (end - first "
       "chunk) / (tokens - 1) per request. Throughput counts the requests answered in full, over the level's wall "
       "time (first request sent to last answer); requests that hung up on purpose (`--disconnect`) are counted "
       "apart and left out of every latency and throughput number. How to read this: docs/bench.md, \"kvq bench "
       "serve\". The numbers are also in `serve_levels.csv` and in runs.db (table serve_levels, run_id "
    << run.run_id << ").\n";
  return r.str();
}

namespace {

// The value of an unlabelled Prometheus sample "name value"; -1 when absent.
double prom_value(const std::string& text, const std::string& name) {
  for (size_t at = text.find(name); at != std::string::npos; at = text.find(name, at + 1)) {
    if ((at > 0 && text[at - 1] != '\n') || at + name.size() >= text.size() || text[at + name.size()] != ' ')
      continue;
    try {
      return std::stod(text.substr(at + name.size() + 1));
    } catch (const std::exception&) {
      return -1;
    }
  }
  return -1;
}

// What a kvq server's /metrics says about its state (the server check).
struct ServerState {
  bool kvq = false;  // the text has kvq_kv_pages_used
  std::string error;  // why it could not be read
  double pages_used = -1, sequences_running = -1, rss = -1;  // -1: not exported
  bool idle() const { return kvq && pages_used == 0 && sequences_running <= 0; }
};

ServerState read_server_state(const Endpoint& ep, const std::string& api_key) {
  ServerState s;
  httplib::Client cli(ep.scheme_host_port);
  cli.set_connection_timeout(5, 0);
  cli.set_read_timeout(10, 0);
  httplib::Headers h;
  if (!api_key.empty()) h.emplace("Authorization", "Bearer " + api_key);
  // /metrics sits beside /v1 (under the URL's path prefix, if any).
  const std::string path = ep.path.substr(0, ep.path.size() - std::string("/v1/completions").size()) + "/metrics";
  const auto res = cli.Get(path.c_str(), h);
  if (!res) {
    s.error = "GET " + path + ": " + httplib::to_string(res.error());
    return s;
  }
  if (res->status != 200) {
    s.error = "GET " + path + ": HTTP " + std::to_string(res->status);
    return s;
  }
  s.pages_used = prom_value(res->body, "kvq_kv_pages_used");
  s.kvq = s.pages_used >= 0;
  if (!s.kvq) s.error = "GET " + path + ": no kvq_kv_pages_used";
  s.sequences_running = prom_value(res->body, "kvq_sequences_running");
  s.rss = prom_value(res->body, "process_resident_memory_bytes");
  return s;
}

// After a level: polls until the server holds no KV page and runs no
// sequence (it may still be cancelling the requests that hung up), at most
// kSettle, then records its state with `before`'s RSS.
json settle_server(const Endpoint& ep, const std::string& api_key, const ServerState& before,
                   const std::function<void(const std::string&)>& waiting) {
  constexpr auto kSettle = std::chrono::seconds(30);
  const auto deadline = Clock::now() + kSettle;
  ServerState s;
  for (;;) {
    s = read_server_state(ep, api_key);
    if (s.idle() || Clock::now() >= deadline) break;
    if (waiting)
      waiting(s.kvq ? "waiting for the server to go idle: " + std::to_string(int64_t(s.pages_used)) +
                          " KV pages used, " + std::to_string(int64_t(std::max(0.0, s.sequences_running))) +
                          " sequences running"
                    : "waiting for the server's /metrics: " + s.error);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!s.kvq) return json{{"error", s.error}};
  json j = {{"pages_used_after", int64_t(s.pages_used)},
            {"sequences_running_after", int64_t(std::max(0.0, s.sequences_running))}};
  if (before.rss >= 0) j["rss_before"] = int64_t(before.rss);
  if (s.rss >= 0) j["rss_after"] = int64_t(s.rss);
  return j;
}

// Output tok/s (left axis) and TTFT p99 (right axis) against concurrency or rate.
std::vector<std::string> write_serve_plot(const std::string& dir, const std::vector<ServeLevel>& levels,
                                          std::string& note) {
  std::vector<std::string> files;
  std::vector<const ServeLevel*> rows;
  for (const auto& l : levels)
    if (l.ok > 0) rows.push_back(&l);
  if (rows.empty()) {
    note = "no plot: no level had a successful request";
    return files;
  }
  if (run_command("gnuplot --version").first != 0) {
    note = "no plot: gnuplot was not found (install gnuplot-nox: tools/install-deps.sh)";
    return files;
  }
  const bool rate = rows.front()->mode == "rate";
  auto x_of = [&](const ServeLevel* l) { return rate ? l->rate : double(l->concurrency); };
  std::sort(rows.begin(), rows.end(), [&](const auto* a, const auto* b) { return x_of(a) < x_of(b); });
  const fs::path data_dir = fs::path(dir) / "plots-data";
  fs::create_directories(data_dir);
  {
    std::ofstream d(data_dir / "serve.dat");
    d << "# " << (rate ? "rate_req_per_s" : "concurrency") << " out_tok_per_s ttft_p99_s\n";
    for (const auto* l : rows) d << x_of(l) << " " << l->out_tok_per_s << " " << l->ttft_s.p99 << "\n";
  }
  for (const std::string ext : {"svg", "png"}) {
    const std::string term = ext == "svg" ? "svg size 1100,650 dynamic background '#ffffff' font 'sans,12'"
                                          : "png size 1100,650 background '#ffffff'";
    std::ostringstream g;
    g << "set terminal " << term << "\nset grid\nset key outside right top noenhanced\n"
      << (rate ? "" : "set logscale x 2\n") << "set yrange [0:*]\nset y2range [0:*]\nset ytics nomirror\nset y2tics\n"
      << "set offsets graph 0.04, graph 0.04, graph 0.05, 0\n"
      << "set xlabel '" << (rate ? "request rate (req/s, Poisson arrivals)" : "concurrent requests") << "'\n"
      << "set ylabel 'output tok/s'\nset y2label 'TTFT p99 (s)'\n"
      << "set title 'Serving: output tok/s and TTFT p99 against " << (rate ? "rate" : "concurrency") << "'\n"
      << "set output 'serve_vs_" << (rate ? "rate" : "concurrency") << "." << ext << "'\n"
      << "plot 'plots-data/serve.dat' using 1:2 with linespoints pt 7 ps 0.7 lc 1 axes x1y1 title 'output tok/s', \\\n"
      << "     'plots-data/serve.dat' using 1:3 with linespoints pt 5 ps 0.7 lc 2 axes x1y2 title 'TTFT p99 (s)'\n";
    const fs::path script = data_dir / ("plot_serve_" + ext + ".gp");
    std::ofstream(script) << g.str();
    const auto [rc, text] =
        run_command("cd " + sh_quote(dir) + " && gnuplot " + sh_quote(fs::absolute(script).string()));
    const std::string name = std::string("serve_vs_") + (rate ? "rate" : "concurrency") + "." + ext;
    std::error_code ec;
    if (rc == 0 && fs::exists(fs::path(dir) / name) && fs::file_size(fs::path(dir) / name, ec) > 0)
      files.push_back(name);
    else
      note += std::string(note.empty() ? "" : "; ") + "plot (" + ext + ") failed: " + text.substr(0, 200);
  }
  return files;
}

void write_csv(const fs::path& path, int64_t run_id, const std::vector<ServeLevel>& levels) {
  std::ofstream csv(path);
  KVQ_CHECK(csv.good(), Errc::io, "cannot write '", path.string(), "'");
  csv << serve_csv_header();
  for (const auto& l : levels) csv << serve_csv_row(run_id, l);
}

}  // namespace

std::string write_serve_report(const std::string& dir, const RunRow& run, const std::vector<ServeLevel>& levels,
                               bool plots, std::string* plot_note) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  KVQ_CHECK(!ec, Errc::io, "cannot create the report folder '", dir, "': ", ec.message());
  write_csv(fs::path(dir) / "serve_levels.csv", run.run_id, levels);
  std::string note;
  std::vector<std::string> files;
  if (plots)
    files = write_serve_plot(dir, levels, note);
  else
    note = "plots were turned off (--no-plots)";
  const fs::path path = fs::path(dir) / "report.md";
  std::ofstream f(path);
  KVQ_CHECK(f.good(), Errc::io, "cannot write '", path.string(), "'");
  f << serve_report_markdown(run, levels, files, note);
  KVQ_CHECK(f.good(), Errc::io, "short write to '", path.string(), "'");
  if (plot_note) *plot_note = note;
  return path.string();
}

ServeBenchResult run_serve_bench(const ServeBenchConfig& cfg, const std::function<void(const ServeProgress&)>& progress) {
  // Everything is checked before anything is recorded.
  const Endpoint ep = parse_endpoint(cfg.url);
  KVQ_CHECK(cfg.requests >= 1, Errc::invalid_argument, "--requests must be at least 1 (got ", cfg.requests, ")");
  KVQ_CHECK(!cfg.concurrency.empty(), Errc::invalid_argument, "--concurrency is empty");
  for (int c : cfg.concurrency)
    KVQ_CHECK(c >= 1 && c <= 4096, Errc::invalid_argument, "--concurrency ", c, " is out of range 1..4096");
  for (double r : cfg.rates)
    KVQ_CHECK(r > 0 && std::isfinite(r), Errc::invalid_argument, "--rate ", r, " must be above 0");
  KVQ_CHECK(cfg.prompt_len.lo >= 1 && cfg.prompt_len.lo <= cfg.prompt_len.hi, Errc::invalid_argument,
            "--prompt-len must be at least 1");
  KVQ_CHECK(cfg.gen.lo >= 1 && cfg.gen.lo <= cfg.gen.hi, Errc::invalid_argument, "--gen must be at least 1");
  KVQ_CHECK(cfg.shared_prefix >= 0, Errc::invalid_argument, "--shared-prefix must be 0 or more (got ",
            cfg.shared_prefix, ")");
  KVQ_CHECK(cfg.token_lo >= 0 && cfg.token_lo < cfg.token_hi, Errc::invalid_argument,
            "--token-range needs 0 <= LO < HI (got ", cfg.token_lo, ":", cfg.token_hi, ")");
  KVQ_CHECK(cfg.timeout_s > 0, Errc::invalid_argument, "--timeout must be above 0");
  KVQ_CHECK(cfg.disconnect >= 0 && cfg.disconnect < 1, Errc::invalid_argument,
            "--disconnect must be a fraction of the requests, 0 <= F < 1 (got ", cfg.disconnect, ")");
  const std::string home = resolve_home(cfg.home);

  // The model name: given, else the server's first (vLLM needs one; kvq and llama-server take any).
  std::string model = cfg.model;
  if (model.empty()) {
    httplib::Client cli(ep.scheme_host_port);
    cli.set_connection_timeout(5, 0);
    cli.set_read_timeout(10, 0);
    httplib::Headers h;
    if (!cfg.api_key.empty()) h.emplace("Authorization", "Bearer " + cfg.api_key);
    const std::string models = ep.path.substr(0, ep.path.size() - std::string("/completions").size()) + "/models";
    if (auto res = cli.Get(models.c_str(), h); res && res->status == 200) {
      try {
        const json j = json::parse(res->body);
        if (j.contains("data") && j["data"].is_array() && !j["data"].empty() && j["data"][0].contains("id"))
          model = j["data"][0]["id"].get<std::string>();
      } catch (const json::exception&) {
      }
    }
  }

  struct Level {
    std::string mode;
    int concurrency;
    double rate;
  };
  std::vector<Level> plan;
  if (cfg.rates.empty()) {
    for (int c : cfg.concurrency) plan.push_back({"concurrency", c, 0});
  } else {
    const int cap = *std::max_element(cfg.concurrency.begin(), cfg.concurrency.end());
    for (double r : cfg.rates) plan.push_back({"rate", cap, r});
  }

  RunsDb db(runs_db_path(home));
  RunMeta meta;
  meta.kind = "serve";
  meta.model = (model.empty() ? std::string("(server default)") : model) + " @ " + cfg.url;
  meta.device = "http";
  meta.git_sha = git_sha();
  meta.build_type = build_type();
  meta.kvq_version = KVQ_VERSION;
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) == 0) meta.host = host.data();
  meta.gpu_name = "";
  json levels_json = json::array();
  for (const auto& l : plan)
    levels_json.push_back(l.mode == "rate" ? json{{"rate", l.rate}, {"max_in_flight", l.concurrency}}
                                           : json{{"concurrency", l.concurrency}});
  meta.params_json = json{{"url", cfg.url},
                          {"endpoint", ep.scheme_host_port + ep.path},
                          {"model", model},
                          {"mode", cfg.rates.empty() ? "concurrency" : "rate"},
                          {"levels", levels_json},
                          {"requests", cfg.requests},
                          {"prompt_len", cfg.prompt_len.str()},
                          {"gen", cfg.gen.str()},
                          {"shared_prefix", cfg.shared_prefix},
                          {"token_range", std::to_string(cfg.token_lo) + ":" + std::to_string(cfg.token_hi)},
                          {"prompt_format", cfg.text_prompts ? "text" : "ids"},
                          {"seed", cfg.seed},
                          {"disconnect", cfg.disconnect},
                          {"timeout_s", cfg.timeout_s},
                          {"api_key", !cfg.api_key.empty()},
                          {"command_line", cfg.command_line}}
                         .dump();
  meta.started_at = utc_now();
  ServeBenchResult out;
  out.run_id = db.begin_run(meta);
  const std::string dir = cfg.out_dir.empty() ? home + "/runs/" + std::to_string(out.run_id) : cfg.out_dir;
  fs::create_directories(dir);
  out.csv_path = (fs::path(dir) / "serve_levels.csv").string();

  // The shared prefix: the same ids in every request of every level.
  std::vector<int32_t> prefix(static_cast<size_t>(cfg.shared_prefix));
  {
    std::mt19937_64 rng(seed_of(cfg.seed, 1, 0));
    std::uniform_int_distribution<int32_t> tok(cfg.token_lo, cfg.token_hi - 1);
    for (auto& t : prefix) t = tok(rng);
  }
  const std::string prefix_text = cfg.text_prompts ? random_words(cfg.shared_prefix, seed_of(cfg.seed, 1, 0)) : "";
  // The server check (kvq serve only: its /metrics has kvq_kv_pages_used);
  // any other server is measured without one, and the report says so.
  ServerState server_before = read_server_state(ep, cfg.api_key);
  const bool check_server = server_before.kvq;
  const auto run_start = Clock::now();
  bool stopped = false;
  for (size_t li = 0; li < plan.size() && !stopped; ++li) {
    const Level& lv = plan[li];
    const int n = cfg.requests;
    // Request i has the same lengths at every level (so levels compare) but
    // its own unique tokens per level (so no level's prompts are cached by
    // an earlier one; only the shared prefix is common).
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(n));
    std::vector<std::string> texts(cfg.text_prompts ? static_cast<size_t>(n) : 0);
    std::vector<int> gens(static_cast<size_t>(n)), hang_up(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      std::mt19937_64 len_rng(seed_of(cfg.seed, 2, uint64_t(i)));
      const int p = sample(cfg.prompt_len, len_rng);
      gens[size_t(i)] = sample(cfg.gen, len_rng);
      hang_up[size_t(i)] = hang_up_point(cfg.seed, i, gens[size_t(i)], cfg.disconnect);
      std::mt19937_64 rng(seed_of(cfg.seed, 3 + li, uint64_t(i)));
      std::uniform_int_distribution<int32_t> tok(cfg.token_lo, cfg.token_hi - 1);
      if (cfg.text_prompts) {
        texts[size_t(i)] = prefix_text + random_words(p, seed_of(cfg.seed, 3 + li, uint64_t(i)));
        continue;
      }
      auto& v = prompts[size_t(i)];
      v = prefix;
      for (int k = 0; k < p; ++k) v.push_back(tok(rng));
    }
    // Rate mode: seeded exponential gaps (a Poisson process of rate R).
    std::vector<double> arrival(static_cast<size_t>(n), 0.0);
    if (lv.mode == "rate") {
      std::mt19937_64 rng(seed_of(cfg.seed, 1000 + li, 0));
      std::exponential_distribution<double> gap(lv.rate);
      double t = 0;
      for (int i = 0; i < n; ++i) {
        arrival[size_t(i)] = t;
        t += gap(rng);
      }
    }

    std::vector<RequestResult> results(static_cast<size_t>(n));
    std::vector<char> sent(static_cast<size_t>(n), 0);
    std::atomic<int> next{0}, finished{0}, done{0}, failed{0}, disconnected{0}, in_flight{0};
    std::atomic<bool> stop{false};
    const auto t0 = Clock::now();
    std::atomic<int64_t> last_end_ns{0};
    auto worker = [&] {
      for (;;) {
        const int i = next.fetch_add(1);
        if (i >= n) return;
        if (lv.mode == "rate") {
          const auto at = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrival[size_t(i)]));
          while (Clock::now() < at && !stop.load())
            std::this_thread::sleep_until(std::min(at, Clock::now() + std::chrono::milliseconds(50)));
        }
        if (stop.load()) {
          finished.fetch_add(1);
          continue;
        }
        in_flight.fetch_add(1);
        results[size_t(i)] = cfg.text_prompts ? send_completion_text(ep, cfg.api_key, model, texts[size_t(i)],
                                                                     gens[size_t(i)], cfg.timeout_s, hang_up[size_t(i)])
                                              : send_completion(ep, cfg.api_key, model, prompts[size_t(i)],
                                                                gens[size_t(i)], cfg.timeout_s, hang_up[size_t(i)]);
        sent[size_t(i)] = 1;
        const int64_t end_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
        int64_t prev = last_end_ns.load();
        while (end_ns > prev && !last_end_ns.compare_exchange_weak(prev, end_ns)) {
        }
        in_flight.fetch_sub(1);
        if (results[size_t(i)].disconnected)
          disconnected.fetch_add(1);
        else if (!results[size_t(i)].ok)
          failed.fetch_add(1);
        done.fetch_add(1);
        finished.fetch_add(1);
      }
    };
    std::vector<std::thread> threads;
    const int nthreads = std::min(lv.concurrency, n);
    threads.reserve(size_t(nthreads));
    for (int k = 0; k < nthreads; ++k) threads.emplace_back(worker);
    ServeProgress pg;
    pg.level = int(li);
    pg.levels = int(plan.size());
    pg.requests = n;
    ServeLevel label_of;
    label_of.mode = lv.mode;
    label_of.concurrency = lv.concurrency;
    label_of.rate = lv.rate;
    pg.label = level_label(label_of);
    while (finished.load() < n) {
      if (cfg.should_stop && cfg.should_stop()) stop.store(true);
      pg.done = done.load();
      pg.failed = failed.load();
      pg.disconnected = disconnected.load();
      pg.in_flight = in_flight.load();
      pg.elapsed_s = secs(Clock::now() - t0);
      if (progress) progress(pg);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    for (auto& t : threads) t.join();
    pg.done = done.load();
    pg.failed = failed.load();
    pg.disconnected = disconnected.load();
    pg.in_flight = 0;
    pg.elapsed_s = secs(Clock::now() - t0);
    // The server check waits for the server to let go of every request (the
    // ones that hung up included) before the next level starts.
    std::string server_json = "{}";
    if (check_server && done.load() > 0) {
      server_json = settle_server(ep, cfg.api_key, server_before, [&](const std::string& what) {
                      pg.server = what;
                      if (progress) progress(pg);
                    }).dump();
      pg.server = server_check_text(server_json);
    } else {
      pg.server = check_server ? "" : server_check_text("{}");
    }
    pg.level_done = true;
    if (progress) progress(pg);

    std::vector<RequestResult> got;
    for (int i = 0; i < n; ++i)
      if (sent[size_t(i)]) got.push_back(std::move(results[size_t(i)]));
    ServeLevel l = summarize_level(got, double(last_end_ns.load()) / 1e9);
    l.level = int(li);
    l.mode = lv.mode;
    l.concurrency = lv.concurrency;
    l.rate = lv.rate;
    l.server_json = server_json;
    if (stop.load()) stopped = true;
    if (l.requests == 0) break;  // stopped before this level sent anything
    db.add_serve_level(out.run_id, l);
    out.levels.push_back(l);
    write_csv(out.csv_path, out.run_id, out.levels);
    if (check_server && li + 1 < plan.size() && !stopped) server_before = read_server_state(ep, cfg.api_key);
  }

  out.status = stopped ? "interrupted" : "ok";
  int ok = 0, failed = 0, disconnected = 0;
  for (const auto& l : out.levels) {
    ok += l.ok;
    failed += l.failed;
    disconnected += l.disconnected;
  }
  db.end_run(out.run_id, out.status,
             json{{"levels", out.levels.size()},
                  {"levels_planned", plan.size()},
                  {"requests_ok", ok},
                  {"requests_failed", failed},
                  {"requests_disconnected", disconnected},
                  {"seconds", secs(Clock::now() - run_start)},
                  {"out_dir", dir}}
                 .dump());
  out.report_path = write_serve_report(dir, *db.run(out.run_id), out.levels, cfg.plots, &out.plot_note);
  return out;
}

}  // namespace kvq::bench
