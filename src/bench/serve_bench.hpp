// kvq bench serve: a serving benchmark over HTTP. It speaks the OpenAI API
// (streaming POST /v1/completions with token-id prompts, so the prompt length
// is exact), so it measures `kvq serve`, llama-server or vLLM alike.
//
// A run is a list of load levels: fixed concurrencies (each level sends N
// requests with at most C in flight) or request rates (N requests arriving
// as a seeded Poisson process at R req/s, at most C in flight). Every
// request is timed (TTFT, every inter-chunk gap, TPOT, end to end) and held
// to its length (usage.completion_tokens must be the tokens asked for); a
// level reports their percentiles, request/s, output tok/s and its failures.
// For a soak, a seeded fraction of the requests hang up on purpose mid-stream
// (--disconnect), and against kvq serve the server's /metrics is read after
// every level: no KV page may stay held, and its resident memory is recorded
// before and after. The results go to runs.db (a `serve` run with one serve_levels row per level),
// a CSV and a Markdown report with a plot (docs/bench.md, "kvq bench serve").
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench/runs_db.hpp"

namespace kvq::bench {

// A length: fixed ("512") or uniform over [lo, hi] ("256:1024").
struct LengthDist {
  int lo = 0, hi = 0;
  bool fixed() const { return lo == hi; }
  std::string str() const;
};
// Throws Errc::invalid_argument naming `what` for anything but N or LO:HI
// with min <= LO <= HI.
LengthDist parse_length_dist(const std::string& s, const char* what, int min = 1);
// "1,8,64": positive integers. "0.5,2,8": positive reals (request rates).
std::vector<int> parse_int_list(const std::string& s, const char* what);
std::vector<double> parse_rate_list(const std::string& s, const char* what);
// --disconnect: a fraction 0 <= F < 1 ("0.1", "0", ".25"); anything else
// throws Errc::invalid_argument with a one-line message.
double parse_disconnect_fraction(const std::string& s);

// Whether request `index` hangs up on purpose under --disconnect `fraction`,
// and when: -1 when it stays to the end, else the number k of text chunks
// after which it closes the connection, uniform in [1, gen - 1] (0 for gen 1:
// as soon as the answer's headers arrive). Seeded by (seed, index) alone, so
// request i does the same at every level, like its lengths.
int hang_up_point(uint64_t seed, int index, int gen, double fraction);

struct ServeBenchConfig {
  std::string url;                     // http://host:port[/prefix]; "/v1" at the end is allowed
  std::string api_key;                 // sent as a bearer token when not empty
  std::string model;                   // the request's "model"; empty: the first of GET /v1/models, else none
  std::vector<int> concurrency{1};     // the levels (fixed concurrency), or the in-flight cap in rate mode (max)
  std::vector<double> rates;           // not empty: rate mode, one level per rate
  int requests = 64;                   // per level
  LengthDist prompt_len{512, 512};     // unique prompt tokens per request
  LengthDist gen{128, 128};            // output tokens per request (max_tokens = min_tokens, ignore_eos)
  int shared_prefix = 0;               // tokens common to every prompt, before its unique part
  int token_lo = 100, token_hi = 1000; // random prompt token ids are drawn from [token_lo, token_hi)
  bool text_prompts = false;           // send text (random common words, about one token each) instead of ids
  uint64_t seed = 1;
  double disconnect = 0;               // 0 <= F < 1: the fraction of requests that hang up on purpose (hang_up_point)
  double timeout_s = 600;              // per request (connect 10 s)
  std::string home;
  std::string out_dir;                 // default <home>/runs/<run id>
  bool plots = true;
  std::string command_line;
  std::function<bool()> should_stop;   // polled between requests: true stops the run after the level's in-flight requests
};

// One request as the client saw it.
struct RequestResult {
  bool ok = false;                     // answered in full with the tokens asked for
  bool disconnected = false;           // hung up on purpose (hang_up_after): neither ok nor failed
  std::string error;                   // why it failed
  int prompt_tokens = 0;               // usage.prompt_tokens when the server sends it, else the ids sent
  int gen = 0;                         // asked for
  int tokens = 0;                      // received: usage.completion_tokens, else the token chunks
  int chunks = 0;                      // SSE events that carried text
  double ttft_s = 0;                   // sent .. first text chunk
  double e2e_s = 0;                    // sent .. stream end
  double tpot_s = 0;                   // (end - first chunk) / (tokens - 1); 0 with < 2 tokens
  std::vector<double> itl_s;           // gaps between text chunks
};

// One level's numbers from its requests (ok ones only for latencies and
// throughput; disconnected ones are only counted).
ServeLevel summarize_level(const std::vector<RequestResult>& reqs, double duration_s);

// Sends one streaming completion and times it. Never throws for network or
// server errors: they come back as ok = false with the reason. A request
// that completes with a usage.completion_tokens other than `gen` fails
// ("wrong length: X of G tokens"). hang_up_after >= 0 (hang_up_point) closes
// the connection on purpose after that many text chunks, or at the event
// that ends the generation (finish_reason, usage, [DONE]) when the server
// sends fewer chunks than that (several tokens in one), so a request picked
// to hang up always does unless it fails first; it comes back disconnected.
struct Endpoint {
  std::string scheme_host_port;  // "http://127.0.0.1:8080"
  std::string path;              // "/v1/completions"
};
Endpoint parse_endpoint(const std::string& url);  // throws Errc::invalid_argument for a bad URL
RequestResult send_completion(const Endpoint& ep, const std::string& api_key, const std::string& model,
                              const std::vector<int32_t>& prompt, int gen, double timeout_s, int hang_up_after = -1);
// The same with a text prompt (for servers that take no token ids); its
// length in tokens is what the server's usage says (0 when it says nothing).
RequestResult send_completion_text(const Endpoint& ep, const std::string& api_key, const std::string& model,
                                   const std::string& prompt, int gen, double timeout_s, int hang_up_after = -1);
// `n` words drawn from a list of common English words (each one token in
// the usual BPE vocabularies, with its leading space).
std::string random_words(int n, uint64_t seed);

struct ServeProgress {
  int level = 0, levels = 0;
  std::string label;     // "concurrency 8" or "rate 4 req/s"
  int done = 0, failed = 0, disconnected = 0, in_flight = 0, requests = 0;
  double elapsed_s = 0;  // in this level
  std::string server;    // the server check after the level: waiting for it, then its outcome (server_check_text)
  bool level_done = false;  // the level's last report
};
std::string format_serve_progress(const ServeProgress& p);
// ServeLevel::server_json in words: "server idle: 0 KV pages used, RSS 96.1 ->
// 97.0 MiB", "server NOT idle after 30 s: ...", "server not checked (no kvq
// metrics)".
std::string server_check_text(const std::string& server_json);

struct ServeBenchResult {
  int64_t run_id = 0;
  std::string status;  // "ok" or "interrupted"
  std::vector<ServeLevel> levels;
  std::string report_path, csv_path, plot_note;
};

// Validates the config (Errc::invalid_argument), records a `serve` run in
// runs.db, runs the levels and writes the CSV and the report.
ServeBenchResult run_serve_bench(const ServeBenchConfig& cfg,
                                 const std::function<void(const ServeProgress&)>& progress = {});

// serve_levels.csv and report.md (with the plot when gnuplot is there) for a serve run.
std::string serve_csv_header();
std::string serve_csv_row(int64_t run_id, const ServeLevel& l);
std::string serve_report_markdown(const RunRow& run, const std::vector<ServeLevel>& levels,
                                  const std::vector<std::string>& plot_files, const std::string& plot_note);
// Writes serve_levels.csv, the plot and report.md into dir; returns the report path.
std::string write_serve_report(const std::string& dir, const RunRow& run, const std::vector<ServeLevel>& levels,
                               bool plots, std::string* plot_note = nullptr);

}  // namespace kvq::bench
