// kvq bench serve (bench/serve_bench.hpp): option parsing, the level
// summary, and whole runs over loopback HTTP against an in-process
// `kvq serve` on the tiny model: fixed concurrency, a Poisson rate, a shared
// prefix with sampled lengths, a wrong URL and a server that refuses (401),
// results in runs.db, the CSV and the report; the CLI's errors and progress.
// The soak's parts: seeded hang-ups (--disconnect) against kvq serve, which
// must let go of every KV page (the server check), and a fake server whose
// answers have the wrong length.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sqlite3.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench/serve_bench.hpp"
#include "cli_test_util.hpp"
#include "core/error.hpp"
#include "server_test_util.hpp"

namespace fs = std::filesystem;
using namespace kvq;
using namespace kvq::bench;
using kvq::server::testing::Served;

namespace {

struct TempHome {
  fs::path p;
  TempHome() {
    static int n = 0;
    p = fs::temp_directory_path() / ("kvq_bench_serve_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::remove_all(p);
  }
  ~TempHome() { fs::remove_all(p); }
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

int lines(const std::string& s) { return int(std::count(s.begin(), s.end(), '\n')); }

std::string query_text(sqlite3* db, const std::string& sql) {
  sqlite3_stmt* st = nullptr;
  EXPECT_EQ(sqlite3_prepare_v2(db, sql.c_str(), -1, &st, nullptr), SQLITE_OK) << sql;
  std::string out;
  if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_text(st, 0))
    out = reinterpret_cast<const char*>(sqlite3_column_text(st, 0));
  sqlite3_finalize(st);
  return out;
}

void expect_ordered(const Percentiles& p, const char* what) {
  EXPECT_GT(p.p50, 0) << what;
  EXPECT_LE(p.p50, p.p90) << what;
  EXPECT_LE(p.p90, p.p99) << what;
}

ServeBenchConfig small(const Served& s, const TempHome& h) {
  ServeBenchConfig c;
  c.url = "http://127.0.0.1:" + std::to_string(s.port);
  c.concurrency = {1, 4};
  c.requests = 8;
  c.prompt_len = {32, 32};
  c.gen = {8, 8};
  c.home = h.p.string();
  c.plots = false;
  c.timeout_s = 120;
  return c;
}

// A loopback port with nothing listening: bound (so nobody else takes it), never listened on.
struct DeadPort {
  int fd = -1;
  int port = 0;
  DeadPort() {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
  }
  ~DeadPort() { ::close(fd); }
};

// An OpenAI-like server that is not kvq (no /metrics): every completion
// streams `chunks` text events, a finish event and a usage saying
// `completion_tokens`, whatever was asked for.
struct FakeServer {
  httplib::Server http;
  std::thread thread;
  int port = 0;
  FakeServer(int chunks, int completion_tokens) {
    http.Post("/v1/completions", [=](const httplib::Request&, httplib::Response& res) {
      std::string body;
      for (int i = 0; i < chunks; ++i)
        body += R"(data: {"choices":[{"index":0,"text":" tok","finish_reason":null}]})" "\n\n";
      body += R"(data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]})" "\n\n";
      body += R"(data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":)" +
              std::to_string(completion_tokens) + "}}\n\n";
      body += "data: [DONE]\n\n";
      res.set_content(body, "text/event-stream");
    });
    port = http.bind_to_any_port("127.0.0.1");
    thread = std::thread([this] { http.listen_after_bind(); });
    // Bound and listening already; wait for the accept loop so stop() cannot come before it (bounded).
    for (int i = 0; i < 500 && !http.is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ~FakeServer() {
    http.stop();
    thread.join();
  }
};

// How many of requests 0..n-1 hang up under --disconnect f (what the bench must count).
int planned_hang_ups(uint64_t seed, int n, int gen, double f) {
  int k = 0;
  for (int i = 0; i < n; ++i) k += hang_up_point(seed, i, gen, f) >= 0;
  return k;
}

}  // namespace

TEST(BenchServe, ParsesLengthsListsAndUrls) {
  EXPECT_EQ(parse_length_dist("512", "--prompt-len").lo, 512);
  EXPECT_TRUE(parse_length_dist("512", "--prompt-len").fixed());
  const LengthDist d = parse_length_dist("256:1024", "--prompt-len");
  EXPECT_EQ(d.lo, 256);
  EXPECT_EQ(d.hi, 1024);
  EXPECT_EQ(d.str(), "256:1024");
  for (const char* bad : {"0", "10:5", "abc", "5:", ":5", "-3", "1.5", ""})
    EXPECT_THROW(parse_length_dist(bad, "--prompt-len"), Error) << bad;
  try {
    parse_length_dist("10:5", "--gen");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--gen"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_int_list("1,8,64", "--concurrency"), (std::vector<int>{1, 8, 64}));
  for (const char* bad : {"0", "1,,2", "x", "", "-1", "2.5"})
    EXPECT_THROW(parse_int_list(bad, "--concurrency"), Error) << bad;
  EXPECT_EQ(parse_rate_list("0.5,2,16", "--rate"), (std::vector<double>{0.5, 2, 16}));
  for (const char* bad : {"0", "-1", "fast", "", "1,0"}) EXPECT_THROW(parse_rate_list(bad, "--rate"), Error) << bad;

  Endpoint e = parse_endpoint("http://127.0.0.1:8080");
  EXPECT_EQ(e.scheme_host_port, "http://127.0.0.1:8080");
  EXPECT_EQ(e.path, "/v1/completions");
  EXPECT_EQ(parse_endpoint("http://gpu:8000/v1/").path, "/v1/completions");
  EXPECT_EQ(parse_endpoint("https://api.example.com/proxy/v1").path, "/proxy/v1/completions");
  EXPECT_EQ(parse_endpoint("http://[::1]:9000").scheme_host_port, "http://[::1]:9000");
  for (const char* bad : {"localhost:8080", "ftp://x", "http://", "http://h:99999", "nope"})
    EXPECT_THROW(parse_endpoint(bad), Error) << bad;
}

TEST(BenchServe, LevelSummaryCountsOkRequestsOnly) {
  std::vector<RequestResult> rs;
  for (int i = 0; i < 10; ++i) {
    RequestResult r;
    r.ok = true;
    r.prompt_tokens = 32;
    r.tokens = 8;
    r.ttft_s = 0.01 * (i + 1);
    r.e2e_s = r.ttft_s + 0.07;
    r.tpot_s = 0.01;
    r.itl_s.assign(7, 0.001 * (i + 1));
    rs.push_back(r);
  }
  RequestResult bad;
  bad.error = "HTTP 500: boom";
  rs.push_back(bad);
  rs.push_back(bad);
  const ServeLevel l = summarize_level(rs, 2.0);
  EXPECT_EQ(l.requests, 12);
  EXPECT_EQ(l.ok, 10);
  EXPECT_EQ(l.failed, 2);
  EXPECT_EQ(l.output_tokens, 80);
  EXPECT_EQ(l.prompt_tokens, 320);
  EXPECT_DOUBLE_EQ(l.req_per_s, 5.0);
  EXPECT_DOUBLE_EQ(l.out_tok_per_s, 40.0);
  EXPECT_NEAR(l.ttft_mean_s, 0.055, 1e-12);
  EXPECT_DOUBLE_EQ(l.ttft_s.p50, 0.05);  // nearest rank
  EXPECT_DOUBLE_EQ(l.ttft_s.p90, 0.09);
  EXPECT_DOUBLE_EQ(l.ttft_s.p99, 0.10);
  EXPECT_NEAR(l.tpot_ms.p50, 10.0, 1e-9);
  EXPECT_NEAR(l.itl_ms.p99, 10.0, 1e-9);
  EXPECT_EQ(l.errors_json, R"({"HTTP 500: boom":2})");
  const ServeLevel none = summarize_level({bad}, 1.0);
  EXPECT_EQ(none.ok, 0);
  EXPECT_FALSE(none.has_tpot);
  EXPECT_FALSE(none.has_itl);
}

TEST(BenchServe, DisconnectedRequestsAreCountedApart) {
  std::vector<RequestResult> rs(4);
  for (auto& r : rs) {
    r.ok = true;
    r.prompt_tokens = 16;
    r.tokens = 8;
    r.ttft_s = 0.02;
    r.e2e_s = 0.1;
  }
  RequestResult gone;  // hung up on purpose after 3 chunks, very early: must not pull the latencies down
  gone.disconnected = true;
  gone.tokens = 3;
  gone.ttft_s = 0.001;
  rs.push_back(gone);
  rs.push_back(gone);
  RequestResult wrong;
  wrong.error = "wrong length: 7 of 8 tokens";
  rs.push_back(wrong);
  const ServeLevel l = summarize_level(rs, 1.0);
  EXPECT_EQ(l.requests, 7);
  EXPECT_EQ(l.ok, 4);
  EXPECT_EQ(l.disconnected, 2);
  EXPECT_EQ(l.failed, 1);
  EXPECT_EQ(l.output_tokens, 32);
  EXPECT_EQ(l.prompt_tokens, 64);
  EXPECT_DOUBLE_EQ(l.req_per_s, 4.0);
  EXPECT_DOUBLE_EQ(l.ttft_s.p50, 0.02);
  EXPECT_DOUBLE_EQ(l.ttft_mean_s, 0.02);
  EXPECT_EQ(l.errors_json, R"({"wrong length: 7 of 8 tokens":1})");
}

TEST(BenchServe, HangUpPointsAreSeededPerRequest) {
  for (int i = 0; i < 100; ++i) EXPECT_EQ(hang_up_point(1, i, 8, 0.0), -1);
  int picked = 0;
  for (int i = 0; i < 2000; ++i) {
    const int k = hang_up_point(7, i, 8, 0.1);
    EXPECT_EQ(k, hang_up_point(7, i, 8, 0.1));  // a function of (seed, index)
    if (k < 0) continue;
    ++picked;
    EXPECT_GE(k, 1);
    EXPECT_LE(k, 7);
    EXPECT_EQ(hang_up_point(7, i, 1, 0.1), 0);  // one token: before the first chunk
  }
  EXPECT_GT(picked, 150);  // 10 % of 2,000, give or take
  EXPECT_LT(picked, 250);
  int differ = 0;
  for (int i = 0; i < 64; ++i) differ += hang_up_point(1, i, 8, 0.5) != hang_up_point(2, i, 8, 0.5);
  EXPECT_GT(differ, 0);  // another seed, other picks

  EXPECT_DOUBLE_EQ(parse_disconnect_fraction("0.1"), 0.1);
  EXPECT_DOUBLE_EQ(parse_disconnect_fraction("0"), 0);
  EXPECT_DOUBLE_EQ(parse_disconnect_fraction(".25"), 0.25);
  for (const char* bad : {"1", "1.0", "1.5", "-0.1", "abc", "", "nan", "inf", "0.1,0.2", "10%"}) {
    try {
      parse_disconnect_fraction(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find("--disconnect"), std::string::npos) << w;
      EXPECT_EQ(w.find('\n'), std::string::npos) << w;
    }
  }
}

TEST(BenchServe, OneStreamingRequestIsTimed) {
  Served s;
  const Endpoint ep = parse_endpoint("http://127.0.0.1:" + std::to_string(s.port));
  std::vector<int32_t> prompt;
  for (int i = 0; i < 20; ++i) prompt.push_back(100 + 7 * i);
  const RequestResult r = send_completion(ep, "", "", prompt, 12, 60);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.tokens, 12);  // usage.completion_tokens: min_tokens + ignore_eos hold it to exactly 12
  EXPECT_EQ(r.prompt_tokens, 20);  // usage.prompt_tokens: the ids as sent
  EXPECT_GE(r.chunks, 1);
  EXPECT_LE(r.chunks, 12);
  EXPECT_EQ(int(r.itl_s.size()), r.chunks - 1);
  EXPECT_GT(r.ttft_s, 0);
  EXPECT_GE(r.e2e_s, r.ttft_s);
  EXPECT_GT(r.tpot_s, 0);
}

TEST(BenchServe, ConcurrencyLevelsAgainstKvqServe) {
  Served s;
  TempHome h;
  ServeBenchConfig c = small(s, h);
  std::vector<ServeProgress> seen;
  const ServeBenchResult res = run_serve_bench(c, [&](const ServeProgress& p) { seen.push_back(p); });
  EXPECT_EQ(res.status, "ok");
  ASSERT_EQ(res.levels.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const ServeLevel& l = res.levels[i];
    SCOPED_TRACE(i);
    EXPECT_EQ(l.mode, "concurrency");
    EXPECT_EQ(l.concurrency, i == 0 ? 1 : 4);
    EXPECT_EQ(l.requests, 8);
    EXPECT_EQ(l.ok, 8);
    EXPECT_EQ(l.failed, 0) << l.errors_json;
    EXPECT_EQ(l.output_tokens, 64);
    EXPECT_EQ(l.prompt_tokens, 256);
    EXPECT_GT(l.req_per_s, 0);
    EXPECT_NEAR(l.out_tok_per_s, 64 / l.duration_s, 1e-6);
    expect_ordered(l.ttft_s, "ttft");
    expect_ordered(l.tpot_ms, "tpot");
    expect_ordered(l.itl_ms, "itl");
    EXPECT_LE(l.ttft_s.p99, l.e2e_s.p99);
    EXPECT_EQ(l.errors_json, "{}");
  }
  // Progress came for both levels and ended each with its totals.
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back().level, 1);
  EXPECT_TRUE(seen.back().level_done);
  EXPECT_EQ(seen.back().done, 8);

  RunsDb db(runs_db_path(h.p.string()));
  const auto run = db.run(res.run_id);
  ASSERT_TRUE(run);
  EXPECT_EQ(run->meta.kind, "serve");
  EXPECT_EQ(run->status, "ok");
  EXPECT_EQ(db.serve_levels(res.run_id).size(), 2u);
  EXPECT_EQ(query_text(db.handle(), "SELECT sum(ok) FROM serve_levels WHERE run_id = " + std::to_string(res.run_id)),
            "16");
  const std::string csv = slurp(res.csv_path);
  EXPECT_EQ(lines(csv), 3) << csv;
  EXPECT_EQ(csv.rfind(serve_csv_header(), 0), 0u);
  const std::string report = slurp(res.report_path);
  EXPECT_NE(report.find("## Levels"), std::string::npos);
  EXPECT_NE(report.find("| concurrency 4 | 8 | 8 | 0 |"), std::string::npos) << report;
  EXPECT_EQ(report.find("## Failed requests"), std::string::npos);
}

TEST(BenchServe, PoissonRateAndSharedPrefixWithSampledLengths) {
  Served s;
  TempHome h;
  ServeBenchConfig c = small(s, h);
  c.rates = {50};
  c.concurrency = {4};  // the cap on requests in flight
  c.requests = 6;
  c.prompt_len = {8, 24};
  c.gen = {2, 6};
  c.shared_prefix = 16;
  c.plots = true;  // a plot when gnuplot is there, a note when not; never a failure
  const ServeBenchResult res = run_serve_bench(c);
  ASSERT_EQ(res.levels.size(), 1u);
  const ServeLevel& l = res.levels[0];
  EXPECT_EQ(l.mode, "rate");
  EXPECT_DOUBLE_EQ(l.rate, 50);
  EXPECT_EQ(l.ok, 6) << l.errors_json;
  EXPECT_GE(l.output_tokens, 6 * 2);
  EXPECT_LE(l.output_tokens, 6 * 6);
  EXPECT_GE(l.prompt_tokens, 6 * (16 + 8));
  EXPECT_LE(l.prompt_tokens, 6 * (16 + 24));
  // The same seed gives the same lengths: a second run sends as many tokens.
  const ServeBenchResult again = run_serve_bench(c);
  ASSERT_EQ(again.levels.size(), 1u);
  EXPECT_EQ(again.levels[0].prompt_tokens, l.prompt_tokens);
  EXPECT_EQ(again.levels[0].output_tokens, l.output_tokens);
  const std::string report = slurp(res.report_path);
  EXPECT_NE(report.find("rate 50 req/s"), std::string::npos) << report;
  if (std::system("gnuplot --version >/dev/null 2>&1") == 0)
    EXPECT_TRUE(fs::exists(fs::path(res.report_path).parent_path() / "serve_vs_rate.svg")) << res.plot_note;
}

TEST(BenchServe, TextPromptsCountWhatTheServerTokenized) {
  Served s;
  TempHome h;
  ServeBenchConfig c = small(s, h);
  c.concurrency = {2};
  c.requests = 4;
  c.prompt_len = {16, 16};
  c.shared_prefix = 8;
  c.text_prompts = true;
  const ServeBenchResult res = run_serve_bench(c);
  ASSERT_EQ(res.levels.size(), 1u);
  const ServeLevel& l = res.levels[0];
  EXPECT_EQ(l.ok, 4) << l.errors_json;
  EXPECT_EQ(l.output_tokens, 32);
  // 24 words a prompt: the server's usage counts its own tokens (at least one a word).
  EXPECT_GE(l.prompt_tokens, 4 * 24);
  EXPECT_LE(l.prompt_tokens, 4 * 24 * 3);
  EXPECT_EQ(random_words(5, 7), random_words(5, 7));
  EXPECT_NE(random_words(5, 7), random_words(5, 8));
  const std::string words = random_words(5, 7);
  EXPECT_EQ(std::count(words.begin(), words.end(), ' '), 5);
}

// A stop request (Ctrl-C in the CLI) ends the run after the requests in
// flight: what was measured is recorded and the run ends `interrupted`.
TEST(BenchServe, StopRequestEndsAfterTheRequestsInFlight) {
  Served s;
  TempHome h;
  ServeBenchConfig c = small(s, h);
  c.requests = 64;  // far more than one poll interval (100 ms) can finish
  std::atomic<int> polls{0};
  c.should_stop = [&] { return polls.fetch_add(1) >= 1; };
  const ServeBenchResult res = run_serve_bench(c);
  EXPECT_EQ(res.status, "interrupted");
  ASSERT_EQ(res.levels.size(), 1u);
  EXPECT_GE(res.levels[0].requests, 1);
  EXPECT_LT(res.levels[0].requests, 64);
  EXPECT_EQ(res.levels[0].failed, 0) << res.levels[0].errors_json;
  RunsDb db(runs_db_path(h.p.string()));
  EXPECT_EQ(db.run(res.run_id)->status, "interrupted");
  EXPECT_EQ(db.serve_levels(res.run_id).size(), 1u);
}

// The soak against kvq serve: half the requests (seeded) hang up mid-stream.
// Exactly those are counted disconnected, every other one gets its 8 tokens,
// and after the level the server holds no KV page and runs no sequence.
TEST(BenchServe, DisconnectsAgainstKvqServeLeaveNoPageHeld) {
  Served s;
  TempHome h;
  ServeBenchConfig c = small(s, h);
  c.concurrency = {2};
  c.requests = 8;
  c.prompt_len = {16, 16};
  c.disconnect = 0.5;
  const int planned = planned_hang_ups(c.seed, 8, 8, 0.5);
  ASSERT_GT(planned, 0);  // the seed must pick some, and leave some
  ASSERT_LT(planned, 8);
  std::vector<ServeProgress> seen;
  const ServeBenchResult res = run_serve_bench(c, [&](const ServeProgress& p) { seen.push_back(p); });
  ASSERT_EQ(res.levels.size(), 1u);
  const ServeLevel& l = res.levels[0];
  EXPECT_EQ(l.requests, 8);
  EXPECT_EQ(l.disconnected, planned);
  EXPECT_EQ(l.failed, 0) << l.errors_json;
  EXPECT_EQ(l.ok, 8 - planned);
  EXPECT_EQ(l.output_tokens, 8 * (8 - planned));  // held to its length: usage.completion_tokens == gen
  const auto server = nlohmann::json::parse(l.server_json);
  EXPECT_EQ(server.value("pages_used_after", -1), 0) << l.server_json;
  EXPECT_EQ(server.value("sequences_running_after", -1), 0) << l.server_json;
  EXPECT_GT(server.value("rss_before", int64_t(0)), 0) << l.server_json;
  EXPECT_GT(server.value("rss_after", int64_t(0)), 0) << l.server_json;
  ASSERT_FALSE(seen.empty());
  EXPECT_TRUE(seen.back().level_done);
  EXPECT_EQ(seen.back().disconnected, planned);
  EXPECT_EQ(seen.back().server.rfind("server idle: 0 KV pages used, RSS ", 0), 0u) << seen.back().server;
  EXPECT_NE(format_serve_progress(seen.back()).find(std::to_string(planned) + " disconnected"), std::string::npos);

  // runs.db, the CSV and the report carry both.
  RunsDb db(runs_db_path(h.p.string()));
  const auto rows = db.serve_levels(res.run_id);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].disconnected, planned);
  EXPECT_EQ(rows[0].server_json, l.server_json);
  EXPECT_NE(db.run(res.run_id)->meta.params_json.find("\"disconnect\":0.5"), std::string::npos);
  const std::string csv = slurp(res.csv_path);
  const std::string row = csv.substr(csv.find('\n') + 1);
  EXPECT_NE(row.find(",8," + std::to_string(8 - planned) + ",0," + std::to_string(planned) + ","), std::string::npos)
      << csv;
  // The server check's columns close the row: pages used, sequences running, RSS before and after.
  EXPECT_NE(row.find(",0,0," + std::to_string(server["rss_before"].get<int64_t>()) + "," +
                     std::to_string(server["rss_after"].get<int64_t>()) + "\n"),
            std::string::npos)
      << csv;
  const std::string report = slurp(res.report_path);
  EXPECT_NE(report.find("| concurrency 2 | 8 | " + std::to_string(8 - planned) + " | 0 | " +
                        std::to_string(planned) + " |"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("## Server state after each level"), std::string::npos);
  EXPECT_NE(report.find("| concurrency 2 | 0 | 0 | "), std::string::npos) << report;
  EXPECT_EQ(report.find("Not checked"), std::string::npos);

  // One token each: the picked requests hang up as the answer's headers arrive.
  c.gen = {1, 1};
  c.requests = 6;
  const int planned1 = planned_hang_ups(c.seed, 6, 1, 0.5);
  const ServeBenchResult one = run_serve_bench(c);
  ASSERT_EQ(one.levels.size(), 1u);
  EXPECT_EQ(one.levels[0].disconnected, planned1);
  EXPECT_EQ(one.levels[0].failed, 0) << one.levels[0].errors_json;
  EXPECT_EQ(one.levels[0].output_tokens, 6 - planned1);
  EXPECT_EQ(nlohmann::json::parse(one.levels[0].server_json).value("pages_used_after", -1), 0);
}

// A server that is not kvq: answers with fewer tokens than asked for are
// failures, never ok; the hang-ups still happen (at the finish event when
// the pick's chunk count is beyond the chunks sent); nothing is said about
// the server's state beyond "not checked".
TEST(BenchServe, WrongLengthFailsAndOtherServersAreNotChecked) {
  TempHome h;
  FakeServer fake(/*chunks=*/3, /*completion_tokens=*/3);
  ServeBenchConfig c;
  c.url = "http://127.0.0.1:" + std::to_string(fake.port);
  c.concurrency = {2};
  c.requests = 6;
  c.prompt_len = {8, 8};
  c.gen = {5, 5};
  c.home = h.p.string();
  c.plots = false;
  c.timeout_s = 60;
  const ServeBenchResult wrong = run_serve_bench(c);
  ASSERT_EQ(wrong.levels.size(), 1u);
  EXPECT_EQ(wrong.levels[0].ok, 0);
  EXPECT_EQ(wrong.levels[0].failed, 6);
  EXPECT_EQ(wrong.levels[0].errors_json, R"({"wrong length: 3 of 5 tokens":6})");
  EXPECT_EQ(wrong.levels[0].server_json, "{}");
  const std::string report = slurp(wrong.report_path);
  EXPECT_NE(report.find("wrong length: 3 of 5 tokens"), std::string::npos) << report;
  EXPECT_NE(report.find("Not checked: the server's `/metrics` has no `kvq_kv_pages_used`"), std::string::npos);

  // Hang-ups picked at chunk 1..4 of a 3-chunk stream: every pick hangs up,
  // the rest still fail on their length.
  c.disconnect = 0.5;
  const int planned = planned_hang_ups(c.seed, 6, 5, 0.5);
  const ServeBenchResult gone = run_serve_bench(c);
  EXPECT_EQ(gone.levels[0].disconnected, planned);
  EXPECT_EQ(gone.levels[0].failed, 6 - planned);
  EXPECT_EQ(gone.levels[0].ok, 0);

  // The right length is ok.
  c.disconnect = 0;
  c.gen = {3, 3};
  const ServeBenchResult right = run_serve_bench(c);
  EXPECT_EQ(right.levels[0].ok, 6) << right.levels[0].errors_json;
  EXPECT_EQ(right.levels[0].output_tokens, 18);
}

TEST(BenchServe, WrongUrlAndRefusingServerAreCountedFailures) {
  TempHome h;
  {
    DeadPort dead;
    ServeBenchConfig c;
    c.url = "http://127.0.0.1:" + std::to_string(dead.port);
    c.concurrency = {2};
    c.requests = 3;
    c.prompt_len = {8, 8};
    c.gen = {2, 2};
    c.home = h.p.string();
    c.plots = false;
    const ServeBenchResult res = run_serve_bench(c);
    ASSERT_EQ(res.levels.size(), 1u);
    EXPECT_EQ(res.levels[0].ok, 0);
    EXPECT_EQ(res.levels[0].failed, 3);
    EXPECT_NE(res.levels[0].errors_json.find("connection"), std::string::npos) << res.levels[0].errors_json;
    EXPECT_NE(slurp(res.report_path).find("## Failed requests"), std::string::npos);
    RunsDb db(runs_db_path(h.p.string()));
    EXPECT_EQ(query_text(db.handle(), "SELECT typeof(ttft_p99_s) FROM serve_levels WHERE run_id = " +
                                          std::to_string(res.run_id)),
              "null");
  }
  {
    server::ServerOptions o;
    o.api_key = "secret";
    Served s(o);
    ServeBenchConfig c = small(s, h);
    c.concurrency = {2};
    c.requests = 3;
    const ServeBenchResult refused = run_serve_bench(c);
    ASSERT_EQ(refused.levels.size(), 1u);
    EXPECT_EQ(refused.levels[0].failed, 3);
    EXPECT_NE(refused.levels[0].errors_json.find("HTTP 401"), std::string::npos) << refused.levels[0].errors_json;
    c.api_key = "secret";
    const ServeBenchResult ok = run_serve_bench(c);
    EXPECT_EQ(ok.levels[0].ok, 3) << ok.levels[0].errors_json;
  }
}

TEST(BenchServeCli, BadOptionsAreClearErrors) {
  TempHome h;
  const std::string home = " --home " + h.p.string();
  struct Case {
    std::string args, says;
  } cases[] = {
      {"bench serve" + home, "--url"},
      {"bench serve --url localhost:8080" + home, "--url"},
      {"bench serve --url http://127.0.0.1:9 --concurrency 0" + home, "--concurrency"},
      {"bench serve --url http://127.0.0.1:9 --concurrency 1,x" + home, "--concurrency"},
      {"bench serve --url http://127.0.0.1:9 --prompt-len 10:5" + home, "--prompt-len"},
      {"bench serve --url http://127.0.0.1:9 --gen 0" + home, "--gen"},
      {"bench serve --url http://127.0.0.1:9 --rate 0" + home, "--rate"},
      {"bench serve --url http://127.0.0.1:9 --requests 0" + home, "--requests"},
      {"bench serve --url http://127.0.0.1:9 --token-range 5:5" + home, "--token-range"},
      {"bench serve --url http://127.0.0.1:9 --disconnect 1" + home, "--disconnect"},
      {"bench serve --url http://127.0.0.1:9 --disconnect 1.5" + home, "--disconnect"},
      {"bench serve --url http://127.0.0.1:9 --disconnect -0.1" + home, "--disconnect"},
      {"bench serve --url http://127.0.0.1:9 --disconnect ten" + home, "--disconnect"},
      {"bench serve --url http://127.0.0.1:9 --disconnect nan" + home, "--disconnect"},
  };
  for (const auto& c : cases) {
    const auto o = kvq::test::kvq_cli(c.args);
    EXPECT_NE(o.rc, 0) << c.args;
    EXPECT_NE(o.rc, -1) << c.args;
    EXPECT_NE(o.err.find(c.says), std::string::npos) << c.args << "\n" << o.err;
    if (c.says == "--disconnect") EXPECT_EQ(lines(o.err), 1) << c.args << "\n" << o.err;  // one line, no usage dump
  }
  // Nothing was recorded for refused options.
  EXPECT_FALSE(fs::exists(h.p / "runs.db"));
}

TEST(BenchServeCli, RunsAgainstAServerAndReportsProgress) {
  Served s;
  TempHome h;
  const auto o = kvq::test::kvq_cli("bench serve --url http://127.0.0.1:" + std::to_string(s.port) +
                                    " --concurrency 1,2 --requests 3 --prompt-len 8 --gen 4 --no-plots --home " +
                                    h.p.string());
  ASSERT_EQ(o.rc, 0) << o.err;
  EXPECT_NE(o.out.find("concurrency 2"), std::string::npos) << o.out;
  EXPECT_NE(o.err.find("[1/2] concurrency 1"), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("[2/2] concurrency 2: 3/3 done, 0 failed, 0 disconnected"), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("server idle: 0 KV pages used"), std::string::npos) << o.err;  // the server check
  EXPECT_NE(o.err.find("report "), std::string::npos) << o.err;
  const auto list = kvq::test::kvq_cli("bench list --kind all --home " + h.p.string());
  EXPECT_NE(list.out.find("2 levels"), std::string::npos) << list.out;
  // The report is written again from runs.db, by id or as the latest serve run.
  const fs::path again = h.p / "again";
  const auto rep = kvq::test::kvq_cli("bench report latest --kind serve --no-plots --out " + again.string() +
                                      " --home " + h.p.string());
  ASSERT_EQ(rep.rc, 0) << rep.err;
  EXPECT_NE(slurp(again / "report.md").find("| concurrency 2 | 3 | 3 | 0 |"), std::string::npos);
  EXPECT_EQ(lines(slurp(again / "serve_levels.csv")), 3);
  const auto by_id = kvq::test::kvq_cli("bench report 1 --no-plots --out " + (h.p / "by_id").string() + " --home " +
                                        h.p.string());
  EXPECT_EQ(by_id.rc, 0) << by_id.err;
  EXPECT_TRUE(fs::exists(h.p / "by_id" / "serve_levels.csv"));
}
