#include "server/server.hpp"

#include <microhttpd.h>
#include <malloc.h>
#include <netdb.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/log.hpp"
#include "core/text.hpp"
#include "engine/stop.hpp"
#include "server/metrics.hpp"
#include "tokenizer/tokenizer.hpp"

namespace kvq::server {
namespace {

using Clock = std::chrono::steady_clock;
// How often the watcher looks for late request heads and departed clients.
constexpr auto kWatchEvery = std::chrono::milliseconds(100);

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Compares without an early exit, so response time does not reveal how much
// of a guessed key was right.
bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= (unsigned char)(a[i] ^ (i < b.size() ? b[i] : 0));
  return diff == 0;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

std::string error_body(const ApiError& e) { return dump(error_json(e)) + "\n"; }

enum class Route { chat, completion, tokenize, detokenize, models, model, health, metrics, none };

const char* route_name(Route r) {
  switch (r) {
    case Route::chat: return "/v1/chat/completions";
    case Route::completion: return "/v1/completions";
    case Route::tokenize: return "/tokenize";
    case Route::detokenize: return "/detokenize";
    case Route::models: return "/v1/models";
    case Route::model: return "/v1/models/{id}";
    case Route::health: return "/health";
    case Route::metrics: return "/metrics";
    default: return "other";
  }
}

// The route of a path and the one method it takes ("GET" or "POST").
Route route_of(const std::string& path, const char** method) {
  *method = "POST";
  if (path == "/v1/chat/completions") return Route::chat;
  if (path == "/v1/completions") return Route::completion;
  if (path == "/tokenize") return Route::tokenize;
  if (path == "/detokenize") return Route::detokenize;
  *method = "GET";
  if (path == "/v1/models") return Route::models;
  if (path.rfind("/v1/models/", 0) == 0 && path.size() > 11) return Route::model;
  if (path == "/health") return Route::health;
  if (path == "/metrics") return Route::metrics;
  return Route::none;
}

// A request's channel between the thread that produces its answer and the
// event loop that sends it. The event loop suspends the connection while
// there is nothing to send; the producer resumes it.
struct Exchange {
  std::mutex mu;
  MHD_Connection* conn = nullptr;
  int fd = -1;
  bool suspended = false;  // MHD is not processing the connection
  bool closed = false;     // MHD is done with the request: never resume
  std::atomic<bool> gone{false};  // the client left
  bool ready = false;      // status and kind known: a response may be queued
  bool stream = false;
  int status = 200;
  std::string content_type;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string out;         // body bytes not yet handed to MHD
  bool done = false;       // no more bytes will come

  // Under mu.
  void wake() {
    if (suspended && !closed) {
      suspended = false;
      MHD_resume_connection(conn);
    }
  }
  void respond(int st, std::string body, const char* ctype, std::vector<std::pair<std::string, std::string>> h = {}) {
    std::lock_guard<std::mutex> lock(mu);
    ready = true;
    status = st;
    content_type = ctype;
    headers = std::move(h);
    out = std::move(body);
    done = true;
    wake();
  }
  void respond_error(const ApiError& e, std::vector<std::pair<std::string, std::string>> h = {}) {
    respond(e.status(), error_body(e), "application/json", std::move(h));
  }
  void start_stream() {
    std::lock_guard<std::mutex> lock(mu);
    ready = true;
    stream = true;
    content_type = "text/event-stream";
    headers = {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}};
    wake();
  }
  void push(const std::string& data) {
    std::lock_guard<std::mutex> lock(mu);
    out += data;
    wake();
  }
  void finish() {
    std::lock_guard<std::mutex> lock(mu);
    done = true;
    wake();
  }
};

// A fixed pool of threads with a bounded queue: a full queue refuses work.
class WorkPool {
 public:
  WorkPool(int threads, size_t cap) : cap_(cap) {
    for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { loop(); });
  }
  ~WorkPool() { stop(); }
  bool submit(std::function<void()> f) {
    std::lock_guard<std::mutex> lock(mu_);
    if (quit_ || q_.size() >= cap_) return false;
    q_.push_back(std::move(f));
    cv_.notify_one();
    return true;
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (quit_ && threads_.empty()) return;
      quit_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return quit_ || !q_.empty(); });
      if (q_.empty()) return;
      auto f = std::move(q_.front());
      q_.pop_front();
      lock.unlock();
      f();
      f = nullptr;
      lock.lock();
    }
  }
  size_t cap_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool quit_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

std::string startup_warnings(const ServerOptions& o) {
  if (!o.api_key.empty() || is_loopback(o.host)) return "";
  return str("kvq serve: warning: listening on ", o.host,
             " (not loopback) without --api-key: anyone who can reach this port can use the model; set --api-key "
             "or $KVQ_API_KEY, or bind 127.0.0.1\n");
}

struct Server::Impl {
  Engine& engine;
  ServerOptions o;
  Metrics metrics;
  MHD_Daemon* daemon = nullptr;
  int listen_fd = -1;
  int port = -1;
  int64_t started = 0;
  size_t max_piece_bytes = 1;  // the longest token's text: a bound on bytes per token
  size_t body_budget = 0;      // request body bytes that may be held at once
  // Memory a request body holds while it arrives and is parsed, counted
  // against body_budget as kBodyCopies times its size: the body itself, the
  // JSON lexer's buffer and the parsed strings (the prompt) live at once on
  // the parse thread. Released when the request has been dispatched.
  static constexpr size_t kBodyCopies = 3;
  std::atomic<size_t> body_bytes{0};
  std::atomic<uint64_t> requests_without_seed{0};

  std::atomic<bool> stopping{false};    // no new work; /health 503
  std::atomic<bool> cancel_all{false};  // running work gives up
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopped = false;

  // Work in flight (parse tasks and generation threads), for draining.
  std::mutex work_mu;
  std::condition_variable work_cv;
  int work = 0;

  std::unique_ptr<WorkPool> parse_pool;

  // Open connections: when the current request head started waiting.
  struct Conn {
    int fd = -1;
    Clock::time_point since;
    bool in_head = true;
    bool in_body = false;  // a request body is arriving (since `since`)
    bool cut = false;
  };
  std::mutex conns_mu;
  std::unordered_map<MHD_Connection*, Conn> conns;
  // Exchanges of requests still being worked on (watched for departed clients).
  std::mutex ex_mu;
  std::vector<std::weak_ptr<Exchange>> exchanges;

  std::thread watcher;
  std::atomic<bool> watcher_quit{false};

  Impl(Engine& e, ServerOptions opts) : engine(e), o(std::move(opts)) {}

  // Per-request state MHD keeps for us (con_cls).
  struct Request {
    Route route = Route::none;
    std::string method, url;
    std::string body;
    size_t reserved = 0;               // bytes of body_budget held
    size_t discarded = 0;              // body bytes read and dropped (after an error)
    bool preflight = false;            // a CORS OPTIONS request
    std::unique_ptr<ApiError> error;   // answer this once the body is in
    std::vector<std::pair<std::string, std::string>> error_headers;
    std::shared_ptr<Exchange> ex;
    int status = 0;
  };

  void work_begin() {
    std::lock_guard<std::mutex> lock(work_mu);
    ++work;
  }
  void work_end() {
    std::lock_guard<std::mutex> lock(work_mu);
    --work;
    work_cv.notify_all();
  }
  bool wait_work(double secs) {
    std::unique_lock<std::mutex> lock(work_mu);
    return work_cv.wait_for(lock, std::chrono::duration<double>(std::max(0.0, secs)), [&] { return work == 0; });
  }
  void release(size_t& reserved) {
    body_bytes -= reserved;
    reserved = 0;
  }
  bool reserve(size_t& reserved, size_t n) {
    size_t cur = body_bytes.load();
    do {
      if (cur + n > body_budget) return false;
    } while (!body_bytes.compare_exchange_weak(cur, cur + n));
    reserved += n;
    return true;
  }

  void add_common_headers(MHD_Response* r) const {
    if (!o.cors_origin.empty()) {
      MHD_add_response_header(r, "Access-Control-Allow-Origin", o.cors_origin.c_str());
      if (o.cors_origin != "*") MHD_add_response_header(r, "Vary", "Origin");
    }
  }
  MHD_Result queue(MHD_Connection* c, Request* rq, int status, const std::string& body, const char* ctype,
                   const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    MHD_Response* r = MHD_create_response_from_buffer(body.size(), (void*)body.data(), MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", ctype);
    for (const auto& [k, v] : headers) MHD_add_response_header(r, k.c_str(), v.c_str());
    add_common_headers(r);
    const MHD_Result ok = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    if (rq) rq->status = status;
    return ok;
  }
  MHD_Result queue_error(MHD_Connection* c, Request* rq, const ApiError& e,
                         const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    return queue(c, rq, e.status(), error_body(e), "application/json", headers);
  }
  // Body bytes read and dropped after an early error before the connection is cut.
  size_t discard_limit() const { return o.max_body + (1u << 20); }
  ApiError too_large() const {
    return ApiError(413, "invalid_request_error", "request_too_large", "",
                    str("the request body is larger than the server's limit of ", o.max_body, " bytes (--max-body)"));
  }
  ApiError busy(const char* what) const {
    return ApiError(429, "rate_limit_error", "queue_full", "", str("the server is busy: ", what, "; retry later"));
  }
  ApiError shutting_down() const {
    return ApiError(503, "server_error", "shutting_down", "", "the server is shutting down");
  }

  void check_auth(MHD_Connection* c) const;
  json model_json() const;
  MHD_Result handle(MHD_Connection* c, const char* url, const char* method, const char* upload, size_t* upload_size,
                    void** con_cls);
  MHD_Result answer_get(MHD_Connection* c, Request* rq);
  void dispatch(Request& rq);  // on a parse thread
  void completion(std::shared_ptr<Exchange> ex, Route route, std::string body);
  void tokenize(Exchange& ex, Route route, const std::string& body);
  void generate(std::shared_ptr<Exchange> ex, Endpoint ep, ApiRequest req, std::vector<int> n_prompt,
                ResponseId rid, Clock::time_point arrival, std::vector<std::shared_ptr<Stream>> streams);
  void watch();
  void shut(double drain_s);

  static ssize_t read_stream(void* cls, uint64_t, char* buf, size_t max);
};

void Server::Impl::check_auth(MHD_Connection* c) const {
  if (o.api_key.empty()) return;
  const char* hv = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
  const std::string h = hv ? hv : "";
  // RFC 9110: the scheme is case-insensitive ("bearer" works), one or more spaces before the token.
  const size_t sp = h.find(' ');
  if (sp != std::string::npos && ascii_lower(h.substr(0, sp)) == "bearer") {
    const size_t t = h.find_first_not_of(' ', sp);
    const size_t e = h.find_last_not_of(' ');
    if (t != std::string::npos && same_secret(h.substr(t, e + 1 - t), o.api_key)) return;
  }
  throw ApiError(401, "invalid_request_error", "invalid_api_key", "",
                 h.empty() ? "no API key: send the header \"Authorization: Bearer <key>\" (the server's --api-key)"
                           : "incorrect API key in the Authorization header");
}

json Server::Impl::model_json() const {
  return json{{"id", o.model_id},
              {"object", "model"},
              {"created", started},
              {"owned_by", "kvq"},
              {"context_length", o.ctx},
              {"kv_codec", o.default_codec}};
}

MHD_Result Server::Impl::answer_get(MHD_Connection* c, Request* rq) {
  switch (rq->route) {
    case Route::health: {
      const bool up = !stopping;
      return queue(c, rq, up ? 200 : 503,
                   dump(json{{"status", up ? "ok" : "shutting down"},
                             {"queue_depth", engine.waiting()},
                             {"running", engine.running()}}) + "\n",
                   "application/json");
    }
    case Route::metrics: {
      Gauges g;
      g.sched = engine.metrics();
      g.queue_depth = g.sched.waiting;
      g.running = g.sched.running;
      g.kv_bytes = uint64_t(g.sched.pages_used) * engine.page_bytes();
      g.kv_pool_bytes = engine.pool_bytes();
      return queue(c, rq, 200, metrics.render(g), "text/plain; version=0.0.4; charset=utf-8");
    }
    case Route::models:
      check_auth(c);
      return queue(c, rq, 200, dump(json{{"object", "list"}, {"data", json::array({model_json()})}}) + "\n",
                   "application/json");
    case Route::model: {
      check_auth(c);
      const std::string id = rq->url.substr(11);
      if (id != o.model_id)
        throw ApiError(404, "invalid_request_error", "model_not_found", "model",
                       str("the model '", id, "' does not exist; this server serves '", o.model_id, "'"));
      return queue(c, rq, 200, dump(model_json()) + "\n", "application/json");
    }
    default: return MHD_NO;
  }
}

// MHD's access handler: called when a request's head is in (first call), for
// each piece of its body, once with no data when the body is complete, and
// again after every resume.
MHD_Result Server::Impl::handle(MHD_Connection* c, const char* url, const char* method, const char* upload,
                                size_t* upload_size, void** con_cls) {
  auto* rq = static_cast<Request*>(*con_cls);
  if (!rq) {
    // The head is in: its deadline no longer applies.
    {
      std::lock_guard<std::mutex> lock(conns_mu);
      auto it = conns.find(c);
      if (it != conns.end()) it->second.in_head = false;
    }
    rq = new Request;
    *con_cls = rq;
    rq->method = method;
    rq->url = url;
    const char* want = nullptr;
    rq->route = route_of(rq->url, &want);
    try {
      const int n_headers = MHD_get_connection_values(c, MHD_HEADER_KIND, nullptr, nullptr);
      if (n_headers > o.max_headers)
        throw ApiError(431, "invalid_request_error", "too_many_headers", "",
                       str("the request has ", n_headers, " header lines; the server takes at most ", o.max_headers));
      if (rq->method == "OPTIONS" && !o.cors_origin.empty()) {
        rq->preflight = true;  // answered once the request is in
        return MHD_YES;
      }
      if (rq->route == Route::none)
        throw ApiError(404, "invalid_request_error", "unknown_url", "",
                       str("unknown route ", rq->method, " ", rq->url,
                           "; kvq serves POST /v1/chat/completions, POST /v1/completions, POST /tokenize, "
                           "POST /detokenize, GET /v1/models, GET /health, GET /metrics"));
      const bool get_ok = std::string(want) == "GET" && rq->method == "HEAD";
      if (rq->method != want && !get_ok) {
        rq->error_headers = {{"Allow", want}};
        throw ApiError(405, "invalid_request_error", "method_not_allowed", "",
                       str(rq->method, " is not allowed on ", rq->url, "; use ", want));
      }
      // Answered once the whole request is in: a response queued earlier
      // makes libmicrohttpd close the connection (no keep-alive, no pipelining).
      if (std::string(want) == "GET") return MHD_YES;
      // A POST: its body comes next.
      if (rq->route == Route::chat || rq->route == Route::completion) check_auth(c);
      if (stopping) throw shutting_down();
      const char* cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
      if (cl) {
        const unsigned long long n = std::strtoull(cl, nullptr, 10);
        if (n > o.max_body) throw too_large();
        if (body_bytes.load() + kBodyCopies * n > body_budget)
          throw busy("too many request bodies are being received");
        // Budget is taken as bytes arrive (a client that announces a body and
        // sends nothing holds none of it); the body's deadline bounds the wait.
      }
      {
        std::lock_guard<std::mutex> lock(conns_mu);
        auto it = conns.find(c);
        if (it != conns.end()) {
          it->second.in_body = true;
          it->second.since = Clock::now();
        }
      }
    } catch (const ApiError& e) {
      // A request with a large body is answered now, and the connection
      // closes after the answer (the body is not read). Others are answered
      // once the request is in (a small body is read and dropped), so that
      // the connection stays open and a client still sending does not lose
      // the answer to a reset.
      const char* cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
      const bool chunked = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Transfer-Encoding") != nullptr;
      const bool has_body = chunked || (cl && std::strtoull(cl, nullptr, 10) > 0);
      if (!has_body || chunked || std::strtoull(cl, nullptr, 10) <= discard_limit()) {
        rq->error = std::make_unique<ApiError>(e);
        return MHD_YES;
      }
      auto h = rq->error_headers;
      if (e.status() == 429) h.emplace_back("Retry-After", "1");
      if (has_body) h.emplace_back("Connection", "close");
      return queue_error(c, rq, e, h);
    }
    return MHD_YES;
  }

  if (*upload_size > 0) {  // a piece of the body
    if (rq->error) {
      rq->discarded += *upload_size;
      if (rq->discarded > discard_limit()) return MHD_NO;  // enough: close the connection
    } else {
      const size_t n = *upload_size;
      const size_t need = kBodyCopies * (rq->body.size() + n);  // the body and what parsing it makes
      const size_t extra = need > rq->reserved ? need - rq->reserved : 0;
      if (rq->body.size() + n > o.max_body) {
        rq->error = std::make_unique<ApiError>(too_large());
      } else if (extra > 0 && !reserve(rq->reserved, extra)) {
        rq->error = std::make_unique<ApiError>(busy("too many request bodies are being received"));
      } else {
        rq->body.append(upload, n);
      }
      if (rq->error) {
        std::string().swap(rq->body);
        release(rq->reserved);
      }
    }
    *upload_size = 0;
    return MHD_YES;
  }

  if (rq->error) {  // body read (or discarded): answer the error
    auto h = rq->error_headers;
    if (rq->error->status() == 429) h.emplace_back("Retry-After", "1");
    const MHD_Result r = queue_error(c, rq, *rq->error, h);
    rq->error.reset();
    return r;
  }

  if (rq->preflight)
    return queue(c, rq, 204, "", "text/plain",
                 {{"Access-Control-Allow-Methods", "GET, POST, OPTIONS"},
                  {"Access-Control-Allow-Headers", "Authorization, Content-Type"},
                  {"Access-Control-Max-Age", "600"}});
  if (rq->method == "GET" || rq->method == "HEAD") {
    try {
      return answer_get(c, rq);
    } catch (const ApiError& e) {
      return queue_error(c, rq, e);
    }
  }

  if (!rq->ex) {  // the body is complete: parse it off the event loop
    {
      std::lock_guard<std::mutex> lock(conns_mu);
      auto it = conns.find(c);
      if (it != conns.end()) it->second.in_body = false;
    }
    auto ex = std::make_shared<Exchange>();
    ex->conn = c;
    const MHD_ConnectionInfo* ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    ex->fd = ci ? ci->connect_fd : -1;
    rq->ex = ex;
    {
      std::lock_guard<std::mutex> lock(ex_mu);
      exchanges.push_back(ex);
    }
    work_begin();
    auto task = std::make_shared<Request>();  // body and budget move to the task
    task->route = rq->route;
    task->body.swap(rq->body);
    task->reserved = rq->reserved;
    rq->reserved = 0;
    task->ex = ex;
    std::lock_guard<std::mutex> lock(ex->mu);
    ex->suspended = true;
    MHD_suspend_connection(c);
    if (!parse_pool->submit([this, task] {
          dispatch(*task);
          work_end();
        })) {
      release(task->reserved);
      work_end();
      ex->ready = true;
      ex->done = true;
      ex->status = 429;
      ex->content_type = "application/json";
      ex->headers = {{"Retry-After", "1"}};
      ex->out = error_body(busy("too many requests are being parsed"));
      ex->wake();
    }
    return MHD_YES;
  }

  // Resumed: is there something to send?
  Exchange& ex = *rq->ex;
  std::lock_guard<std::mutex> lock(ex.mu);
  if (!ex.ready) {
    if (ex.done) return MHD_NO;  // nothing to say (the client left): close the connection
    ex.suspended = true;
    MHD_suspend_connection(c);
    return MHD_YES;
  }
  if (!ex.stream) {
    const std::string body = std::move(ex.out);
    ex.out.clear();
    return queue(c, rq, ex.status, body, ex.content_type.c_str(), ex.headers);
  }
  auto* keep = new std::shared_ptr<Exchange>(rq->ex);
  MHD_Response* r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, &Impl::read_stream, keep,
                                                      [](void* p) { delete static_cast<std::shared_ptr<Exchange>*>(p); });
  if (!r) {
    delete keep;
    return MHD_NO;
  }
  MHD_add_response_header(r, "Content-Type", ex.content_type.c_str());
  for (const auto& [k, v] : ex.headers) MHD_add_response_header(r, k.c_str(), v.c_str());
  add_common_headers(r);
  const MHD_Result ok = MHD_queue_response(c, (unsigned)ex.status, r);
  MHD_destroy_response(r);
  rq->status = ex.status;
  return ok;
}

// MHD asks for more of a streamed body (on the event loop).
ssize_t Server::Impl::read_stream(void* cls, uint64_t, char* buf, size_t max) {
  Exchange& ex = **static_cast<std::shared_ptr<Exchange>*>(cls);
  std::lock_guard<std::mutex> lock(ex.mu);
  if (!ex.out.empty()) {
    const size_t n = std::min(max, ex.out.size());
    std::memcpy(buf, ex.out.data(), n);
    ex.out.erase(0, n);
    return ssize_t(n);
  }
  if (ex.done) return MHD_CONTENT_READER_END_OF_STREAM;
  ex.suspended = true;  // nothing yet: the producer resumes the connection
  MHD_suspend_connection(ex.conn);
  return 0;
}

// On a parse thread: route a POST body.
void Server::Impl::dispatch(Request& rq) {
  Exchange& ex = *rq.ex;
  try {
    if (rq.route == Route::tokenize || rq.route == Route::detokenize) {
      tokenize(ex, rq.route, rq.body);
    } else {
      completion(rq.ex, rq.route, std::move(rq.body));
    }
  } catch (const ApiError& e) {
    ex.respond_error(e, e.status() == 429 ? std::vector<std::pair<std::string, std::string>>{{"Retry-After", "1"}}
                                          : std::vector<std::pair<std::string, std::string>>{});
  } catch (const Error& e) {
    const bool user = e.code() == Errc::invalid_argument || e.code() == Errc::out_of_range;
    ex.respond_error(ApiError(user ? 400 : 500, user ? "invalid_request_error" : "server_error", "", "", e.what()));
  } catch (const std::exception& e) {
    log_warn("serve: ", route_name(rq.route), ": ", e.what());
    ex.respond_error(ApiError(500, "server_error", "", "", str("internal error: ", e.what())));
  }
  std::string().swap(rq.body);
  const bool big = rq.reserved > (1u << 20);
  release(rq.reserved);
  // Large bodies and their parsed copies leave glibc's arenas fragmented:
  // give the pages back so a burst of big prompts does not stay resident.
  if (big) malloc_trim(0);
}

void Server::Impl::tokenize(Exchange& ex, Route route, const std::string& body) {
  json b;
  try {
    b = json::parse(body);
  } catch (const json::exception& e) {
    throw ApiError(400, "invalid_request_error", "invalid_json", "", str("the request body is not valid JSON: ", e.what()));
  }
  if (!b.is_object()) bad_request("", "the request body must be a JSON object");
  const Tokenizer& tok = engine.tokenizer();
  if (route == Route::tokenize) {
    // vLLM sends "prompt", llama.cpp "content".
    const char* key = b.contains("prompt") ? "prompt" : "content";
    if (!b.contains(key) || !b[key].is_string()) bad_request("prompt", "'prompt' must be a string");
    const std::string& text = b[key].get_ref<const std::string&>();
    if (text.size() > size_t(o.ctx) * max_piece_bytes * 4)
      bad_request("prompt", "'prompt' is ", text.size(), " bytes, far beyond the context of ", o.ctx, " tokens");
    bool add_special = true;
    if (b.contains("add_special_tokens")) {
      if (!b["add_special_tokens"].is_boolean()) bad_request("add_special_tokens", "'add_special_tokens' must be a boolean");
      add_special = b["add_special_tokens"].get<bool>();
    }
    std::vector<TokenId> ids;
    if (add_special && tok.add_bos() && tok.bos() >= 0) ids.push_back(tok.bos());
    const auto body_ids = tok.encode(text, /*parse_special=*/false);
    ids.insert(ids.end(), body_ids.begin(), body_ids.end());
    ex.respond(200,
               dump(json{{"tokens", ids}, {"count", ids.size()}, {"max_model_len", o.ctx}}) + "\n",
               "application/json");
  } else {
    if (!b.contains("tokens") || !b["tokens"].is_array()) bad_request("tokens", "'tokens' must be an array of token ids");
    std::vector<TokenId> ids;
    for (const json& v : b["tokens"]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= engine.vocab())
        bad_request("tokens", "'tokens' must hold token ids in [0, ", engine.vocab(), ")");
      ids.push_back(TokenId(v.get<int64_t>()));
    }
    const std::string text = tok.decode(ids);
    ex.respond(200, dump(json{{"prompt", text}, {"content", text}}) + "\n", "application/json");
  }
}

// On a parse thread: checks, tokenizes and queues a completion; a thread
// then waits for the model and generates.
void Server::Impl::completion(std::shared_ptr<Exchange> ex, Route route, std::string body) {
  const auto arrival = Clock::now();
  const Endpoint ep = route == Route::chat ? Endpoint::chat : Endpoint::completion;
  ApiRequest r = parse_request(ep, body, o.defaults);
  std::string().swap(body);
  if (!r.model.empty() && r.model != o.model_id)
    throw ApiError(404, "invalid_request_error", "model_not_found", "model",
                   str("the model '", r.model, "' does not exist; this server serves '", o.model_id,
                       "' (GET /v1/models)"));
  if (!r.kv_codec.empty()) {
    try {
      engine.check_codec(r.kv_codec);
    } catch (const Error& e) {
      bad_request("kv_codec", "'kv_codec': ", e.what());
    }
  }
  for (TokenId id : r.stop_token_ids)
    if (id >= engine.vocab())
      bad_request("stop_token_ids", "token id ", id, " is out of range; the vocabulary has ", engine.vocab(), " tokens");
  for (const auto& [id, bias] : r.sampling.logit_bias)
    if (id >= engine.vocab())
      bad_request("logit_bias", "token id ", id, " is out of range; the vocabulary has ", engine.vocab(), " tokens");
  // min_tokens: until that many tokens are out, nothing that would end the
  // answer may be sampled (the stop token ids, and end-of-generation tokens
  // unless ignore_eos).
  if (r.sampling.min_tokens > 0) {
    std::vector<TokenId>& suppress = r.sampling.min_tokens_suppress;
    suppress = r.stop_token_ids;
    if (!r.ignore_eos)
      for (TokenId id : engine.tokenizer().eog_ids()) suppress.push_back(id);
  }
  if (!r.seed_given) r.sampling.seed = o.defaults.sampling.seed + requests_without_seed++;
  try {
    r.sampling.validate();
  } catch (const Error& e) {
    bad_request("", e.what());
  }

  const char* prompt_param = ep == Endpoint::chat ? "messages" : "prompt";
  // No token holds more than max_piece_bytes bytes of text, so a prompt of
  // more than ctx * max_piece_bytes bytes cannot fit: refused before the
  // tokenizer (or a copy) spends time and memory on it.
  auto check_bytes = [&](size_t text_bytes) {
    if (text_bytes > size_t(o.ctx) * max_piece_bytes)
      throw ApiError(400, "invalid_request_error", "context_length_exceeded", prompt_param,
                     str("this model's maximum context length is ", o.ctx, " tokens (--ctx), but the prompt has ",
                         text_bytes, " bytes of text, more than that many tokens can hold; shorten the prompt"));
  };
  {
    size_t chat_bytes = 0;
    for (const ChatMessage& m : r.messages) chat_bytes += m.content.size();
    check_bytes(chat_bytes);
    check_bytes(r.prompt.size());
    for (const ApiRequest::Prompt& in : r.more_prompts) check_bytes(in.text.size());
  }
  // The prompts: one, or a completions batch (each its own choice).
  // (Copied only when echo needs them again; else moved: a prompt can be megabytes.)
  std::vector<ApiRequest::Prompt> inputs;
  if (r.echo) {
    inputs.push_back({r.prompt, r.prompt_ids, r.prompt_is_ids});
    inputs.insert(inputs.end(), r.more_prompts.begin(), r.more_prompts.end());
  } else {
    inputs.push_back({std::move(r.prompt), std::move(r.prompt_ids), r.prompt_is_ids});
    for (ApiRequest::Prompt& in : r.more_prompts) inputs.push_back(std::move(in));
    r.more_prompts.clear();
  }
  std::vector<Job> jobs;
  std::vector<int> n_prompt;
  for (ApiRequest::Prompt& in : inputs) {
    ApiRequest one;  // what prompt_tokens reads
    one.endpoint = r.endpoint;
    one.messages = std::move(r.messages);  // chat: one prompt; generate() does not read them
    one.enable_thinking = r.enable_thinking;
    one.prompt = std::move(in.text);
    one.prompt_ids = std::move(in.ids);
    one.prompt_is_ids = in.is_ids;

    std::vector<TokenId> prompt = prompt_tokens(one, engine.tokenizer(), o.chat_template, engine.vocab());
    const int n = int(prompt.size());
    if (n >= o.ctx)
      throw ApiError(400, "invalid_request_error", "context_length_exceeded", prompt_param,
                     str("this model's maximum context length is ", o.ctx, " tokens (--ctx), but the prompt has ", n,
                         " tokens, leaving no room for a completion; shorten the prompt"));
    if (r.max_tokens > 0 && int64_t(n) + r.max_tokens > o.ctx)
      throw ApiError(400, "invalid_request_error", "context_length_exceeded", "max_tokens",
                     str("this model's maximum context length is ", o.ctx, " tokens (--ctx), but ",
                         int64_t(n) + r.max_tokens, " were requested (", n, " in the prompt, ", r.max_tokens,
                         " for the completion); lower max_tokens or shorten the prompt"));
    Job job;
    job.prompt = std::move(prompt);
    job.sampling = r.sampling;
    job.max_tokens = r.max_tokens;  // -1: until a stop or the end of the context
    job.stop_at_eog = !r.ignore_eos;
    job.stop_tokens = r.stop_token_ids;
    job.logprobs = r.logprobs;
    job.cache_prompt = r.cache_prompt;
    // n choices: n sequences of the prompt, each with its own seed (the
    // scheduler prefills the prompt once and the others adopt its pages).
    for (int c = 0; c < r.n; ++c) {
      Job choice = c + 1 < r.n ? job : std::move(job);
      choice.sampling.seed += uint64_t(c);
      n_prompt.push_back(n);
      jobs.push_back(std::move(choice));
    }
  }
  // Every prompt becomes a sequence of the scheduler now (all or none: 429).
  const size_t n_jobs = jobs.size();
  std::vector<std::shared_ptr<Stream>> streams = engine.submit(std::move(jobs));
  if (streams.empty())
    throw ApiError(429, "rate_limit_error", "queue_full", "",
                   str("the server is busy: ", engine.max_running(), " sequences may run (--max-seqs) and ",
                       engine.max_waiting(), " more wait (--max-queue), and they are taken",
                       n_jobs > 1 ? str(" (this batch needs ", n_jobs, " places)") : std::string(), "; retry later"));
  // One thread per admitted request (at most --max-seqs + --max-queue): it
  // drains the request's streams into the exchange.
  work_begin();
  std::thread([this, ex, ep, n_prompt = std::move(n_prompt), r = std::move(r), arrival,
               streams = std::move(streams)]() mutable {
    generate(ex, ep, std::move(r), std::move(n_prompt), new_response_id(ep, o.model_id), arrival, std::move(streams));
    work_end();
  }).detach();
}

// On the request's thread: drains each prompt's stream (tokens from the
// engine thread), detokenizes, cuts stop strings, and writes the answer or
// its events into the exchange. A client that left, a stop string or the
// end of service cancels the sequence; the scheduler frees its pages at its
// next step.
void Server::Impl::generate(std::shared_ptr<Exchange> exp, Endpoint ep, ApiRequest req, std::vector<int> n_prompt,
                            ResponseId rid, Clock::time_point arrival, std::vector<std::shared_ptr<Stream>> streams) {
  Exchange& ex = *exp;
  const Tokenizer& tok = engine.tokenizer();
  const bool sse = req.stream;
  // However this returns, no sequence of this request runs on.
  struct CancelRest {
    Engine& e;
    const std::vector<std::shared_ptr<Stream>>& s;
    ~CancelRest() {
      for (const auto& st : s) e.cancel(*st);
    }
  } cancel_rest{engine, streams};
  auto send_event = [&](const json& j) { ex.push("data: " + dump(j) + "\n\n"); };
  auto abandon = [&] { return cancel_all.load() || engine.stopping() || ex.gone.load(); };
  auto fail = [&](const ApiError& err) {
    if (sse) {
      send_event(error_json(err));
      ex.push("data: [DONE]\n\n");
      ex.finish();
    } else {
      ex.respond_error(err);
    }
  };
  // A chunk of choice `index`.
  auto chunk = [&](size_t index, const std::string& text, bool first, const char* finish, const json& lp) {
    json c = chunk_json(ep, rid, text, first, finish, lp, req.include_usage);
    c["choices"][0]["index"] = index;
    return c;
  };
  if (sse) ex.start_stream();

  json choices = json::array();
  Usage usage;
  for (size_t k = 0; k < streams.size(); ++k) {
    Stream& st = *streams[k];
    std::string text;
    if (req.echo) {
      const size_t p = k / size_t(req.n);  // choices are prompt-major: prompt p's n choices in a row
      const ApiRequest::Prompt in = p == 0 ? ApiRequest::Prompt{req.prompt, req.prompt_ids, req.prompt_is_ids}
                                           : req.more_prompts[p - 1];
      text = in.is_ids ? tok.decode(in.ids) : in.text;
    }
    if (sse) {
      // Chat streams open with the assistant role, as OpenAI's do.
      if (ep == Endpoint::chat) send_event(chunk(k, "", true, nullptr, nullptr));
      if (!text.empty()) send_event(chunk(k, text, false, nullptr, nullptr));
    }
    std::vector<TokenLogprob> lps;    // all of them (non-streamed) or those not yet sent (streamed)
    size_t lps_offset = text.size();  // completion text length before lps[0]
    auto on_text = [&](const std::string& piece) {
      if (piece.empty()) return;
      if (sse) {
        const json lp = req.logprobs >= 0 ? logprobs_json(ep, tok, lps, lps_offset) : json(nullptr);
        send_event(chunk(k, piece, false, nullptr, lp));
        lps.clear();
        lps_offset = text.size() + piece.size();
      }
      text += piece;
    };

    // What Session::generate does with each token, on this thread.
    StreamDecoder detok(tok);
    StopMatcher stops(req.stop);
    int n_tokens = 0;
    Clock::time_point prev;
    bool ended = false, cancelled = false;
    StopReason reason = StopReason::max_tokens;
    std::vector<Stream::Token> got;
    while (!ended) {
      got.clear();
      const bool stream_ended = st.wait(got, std::chrono::milliseconds(50));
      for (const Stream::Token& t : got) {
        if (n_tokens++ == 0)
          metrics.ttft().observe(seconds(t.time - arrival));
        else
          metrics.itl().observe(seconds(t.time - prev));
        prev = t.time;
        const bool stop_token = (!req.ignore_eos && tok.is_eog(t.id)) ||
                                std::find(req.stop_token_ids.begin(), req.stop_token_ids.end(), t.id) !=
                                    req.stop_token_ids.end();
        if (t.has_logprob && !tok.is_eog(t.id)) lps.push_back(t.logprob);
        if (stop_token) {  // the scheduler ends the sequence on it; its text is not streamed
          reason = StopReason::eog;
          ended = true;
          break;
        }
        bool stopped = false;
        on_text(stops.push(detok.push(t.id), &stopped));
        if (stopped) {
          reason = StopReason::stop_string;
          ended = true;
          engine.cancel(st);  // the scheduler may run one more step for it; its tokens are dropped
          break;
        }
      }
      if (ended) break;
      if (stream_ended) {
        const std::string err = st.error();
        if (!err.empty()) {
          log_warn("serve: ", rid.id, ": ", err);
          fail(ApiError(500, "server_error", "", "", str("generation failed: ", err)));
          return;
        }
        reason = st.reason();
        cancelled = reason == StopReason::cancelled;
        ended = true;
      } else if (abandon()) {
        engine.cancel(st);
        cancelled = true;
        ended = true;
      }
    }
    if (cancelled) {
      if (ex.gone) {
        metrics.cancelled();
        ex.finish();
        return;
      }
      fail(shutting_down());  // the server is stopping: say so to a client that is still there
      return;
    }
    if (reason != StopReason::stop_string) {
      bool stopped = false;
      on_text(stops.push(detok.flush(), &stopped));
      if (!stopped) on_text(stops.flush());
    }
    const int prompt_tokens = k % size_t(req.n) == 0 ? n_prompt[k] : 0;  // a prompt counts once for its n choices
    usage.prompt_tokens += prompt_tokens;
    usage.completion_tokens += n_tokens;
    metrics.tokens(prompt_tokens, n_tokens);
    const char* finish = finish_reason(reason);
    if (sse) {
      const json lp = req.logprobs >= 0 && !lps.empty() ? logprobs_json(ep, tok, lps, lps_offset) : json(nullptr);
      send_event(chunk(k, "", false, finish, lp));
    } else {
      const json lp = req.logprobs >= 0 ? logprobs_json(ep, tok, lps, 0) : json(nullptr);
      json one = response_json(ep, rid, text, finish, Usage{}, lp)["choices"][0];
      one["index"] = k;
      choices.push_back(std::move(one));
    }
  }
  metrics.e2e().observe(seconds(Clock::now() - arrival));
  if (sse) {
    if (req.include_usage) send_event(usage_chunk_json(ep, rid, usage));
    ex.push("data: [DONE]\n\n");
    ex.finish();
  } else {
    json resp = response_json(ep, rid, "", "stop", usage, nullptr);
    resp["choices"] = std::move(choices);
    ex.respond(200, dump(resp) + "\n", "application/json");
  }
}

// Every kWatchEvery: closes connections whose request head or body is late, and
// marks requests whose client hung up (the kernel knows, whatever the
// response's framing or encoding; nothing is written to find out).
void Server::Impl::watch() {
  while (!watcher_quit) {
    std::this_thread::sleep_for(kWatchEvery);
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(conns_mu);
      for (auto& [c, k] : conns)
        if (!k.cut && ((k.in_head && seconds(now - k.since) > o.head_timeout_s) ||
                       (k.in_body && seconds(now - k.since) > o.body_timeout_s))) {
          k.cut = true;  // MHD sees the shut socket and closes the connection
          ::shutdown(k.fd, SHUT_RDWR);
        }
    }
    std::vector<std::shared_ptr<Exchange>> live;
    {
      std::lock_guard<std::mutex> lock(ex_mu);
      std::erase_if(exchanges, [](const std::weak_ptr<Exchange>& w) { return w.expired(); });
      for (auto& w : exchanges)
        if (auto p = w.lock()) live.push_back(std::move(p));
    }
    for (auto& ex : live) {
      std::lock_guard<std::mutex> lock(ex->mu);  // the fd stays open while closed is false
      if (ex->closed || ex->gone || ex->fd < 0) continue;
      pollfd p{ex->fd, POLLRDHUP, 0};
      if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) ex->gone = true;
    }
  }
}

void Server::Impl::shut(double drain_s) {
  if (stopping.exchange(true)) {
    // A second stop while the first drains: cancel now.
    cancel_all = true;
    engine.shut_down();
    std::unique_lock<std::mutex> lock(stop_mu);
    stop_cv.wait(lock, [&] { return stopped; });
    return;
  }
  if (daemon) {
    // Stop accepting: the listening socket closes; open connections stay.
    const MHD_socket fd = MHD_quiesce_daemon(daemon);
    if (fd != MHD_INVALID_SOCKET) ::close(fd);
  } else if (listen_fd >= 0) {
    ::close(listen_fd);
  }
  listen_fd = -1;
  wait_work(drain_s);
  cancel_all = true;
  engine.shut_down();
  wait_work(30);
  if (parse_pool) parse_pool->stop();
  // Let the last answers go out (bounded), then close everything.
  for (int i = 0; i < 20; ++i) {
    bool pending = false;
    std::lock_guard<std::mutex> lock(ex_mu);
    for (auto& w : exchanges)
      if (auto p = w.lock()) {
        std::lock_guard<std::mutex> l2(p->mu);
        if (!p->closed && (!p->out.empty() || !p->done)) pending = true;
      }
    if (!pending) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  {
    // MHD must not be stopped with suspended connections.
    std::lock_guard<std::mutex> lock(ex_mu);
    for (auto& w : exchanges)
      if (auto p = w.lock()) {
        std::lock_guard<std::mutex> l2(p->mu);
        if (!p->ready) {
          p->ready = true;
          p->status = 503;
          p->content_type = "application/json";
          p->out = error_body(shutting_down());
        }
        p->done = true;
        p->wake();
      }
  }
  if (daemon) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    MHD_stop_daemon(daemon);
    daemon = nullptr;
  }
  watcher_quit = true;
  if (watcher.joinable()) watcher.join();
  std::lock_guard<std::mutex> lock(stop_mu);
  stopped = true;
  stop_cv.notify_all();
}

Server::Server(Engine& engine, ServerOptions opts) : impl_(std::make_unique<Impl>(engine, std::move(opts))) {
  Impl& m = *impl_;
  KVQ_CHECK(!m.o.model_id.empty(), Errc::internal, "Server needs a model id");
  KVQ_CHECK(m.o.ctx > 1, Errc::invalid_argument, "--ctx must be at least 2 tokens to serve");
  m.started = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  const Tokenizer& tok = engine.tokenizer();
  for (int i = 0; i < tok.vocab_size(); ++i) m.max_piece_bytes = std::max(m.max_piece_bytes, tok.bytes_of(i).size());
  // One body of --max-body with its parse copies always fits; a flood of
  // large ones is answered 429 rather than held in memory.
  m.body_budget = std::max<size_t>(Impl::kBodyCopies * m.o.max_body, 1u << 20);
  // Request bodies and prompts are large, short-lived blocks allocated on
  // one thread and freed on another. glibc raises its mmap threshold after
  // each large free (up to 32 MiB), after which such blocks come from the
  // arenas and stay resident when freed; a fixed threshold keeps every block
  // of 1 MiB or more in its own mapping, returned to the system on free.
  // (Process-wide; the engine's large buffers are unaffected: they are mapped
  // either way.)
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
}

Server::~Server() { stop(0); }

int Server::bind() {
  Impl& m = *impl_;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string host = m.o.host;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const int gai = ::getaddrinfo(host.c_str(), std::to_string(m.o.port).c_str(), &hints, &res);
  KVQ_CHECK(gai == 0 && res, Errc::io, "cannot listen on ", m.o.host, ":", m.o.port, ": ", gai_strerror(gai),
            " (pick another --host)");
  int fd = -1;
  int err = 0;
  for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    // SO_REUSEADDR allows a quick restart; no SO_REUSEPORT, which would let a
    // second server share the port and silently take half its connections.
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    const int backlog = m.o.backlog > 0 ? m.o.backlog : std::min(4096, 4 * m.engine.max_waiting() + 512);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, backlog) != 0) {
      err = errno;
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  KVQ_CHECK(fd >= 0, Errc::io, "cannot listen on ", m.o.host, ":", m.o.port, ": ", std::strerror(err),
            " (address in use or not local? pick another --port or --host)");
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  m.port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  m.listen_fd = fd;
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);

  m.parse_pool = std::make_unique<WorkPool>(m.o.parse_threads, size_t(m.engine.max_waiting()) + 8);
  auto access = [](void* cls, MHD_Connection* c, const char* url, const char* method, const char*,
                   const char* upload, size_t* upload_size, void** con_cls) -> MHD_Result {
    Impl& s = *static_cast<Impl*>(cls);
    auto* rq = static_cast<Impl::Request*>(*con_cls);
    try {
      return s.handle(c, url, method, upload, upload_size, con_cls);
    } catch (const ApiError& e) {
      return s.queue_error(c, static_cast<Impl::Request*>(*con_cls), e, rq ? rq->error_headers : decltype(rq->error_headers){});
    } catch (const std::exception& e) {
      log_warn("serve: ", method, " ", url, ": ", e.what());
      return s.queue_error(c, static_cast<Impl::Request*>(*con_cls),
                           ApiError(500, "server_error", "", "", "internal error"));
    }
  };
  auto completed = [](void* cls, MHD_Connection* c, void** con_cls, MHD_RequestTerminationCode toe) {
    Impl& s = *static_cast<Impl*>(cls);
    auto* rq = static_cast<Impl::Request*>(*con_cls);
    {
      std::lock_guard<std::mutex> lock(s.conns_mu);  // the next request's head starts waiting
      auto it = s.conns.find(c);
      if (it != s.conns.end()) {
        it->second.in_head = true;
        it->second.in_body = false;
        it->second.since = Clock::now();
      }
    }
    if (!rq) return;
    if (rq->ex) {
      std::lock_guard<std::mutex> lock(rq->ex->mu);
      rq->ex->closed = true;
      if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) rq->ex->gone = true;
    }
    s.release(rq->reserved);
    if (rq->status > 0) {
      s.metrics.request(route_name(rq->route), rq->status);
      log_info("serve: ", rq->method, " ", rq->url, " ", rq->status);
    }
    delete rq;
    *con_cls = nullptr;
  };
  auto notify = [](void* cls, MHD_Connection* c, void** socket_context, MHD_ConnectionNotificationCode code) {
    Impl& s = *static_cast<Impl*>(cls);
    std::lock_guard<std::mutex> lock(s.conns_mu);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
      const MHD_ConnectionInfo* ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
      Impl::Conn k;
      k.fd = ci ? ci->connect_fd : -1;
      k.since = Clock::now();
      if (k.fd >= 0) s.conns[c] = k;
    } else {
      s.conns.erase(c);
    }
  };
  const unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ITC;
  m.daemon = MHD_start_daemon(
      flags, 0, nullptr, nullptr, +access, &m,                                        //
      MHD_OPTION_LISTEN_SOCKET, (MHD_socket)fd,                                       //
      MHD_OPTION_CONNECTION_LIMIT, (unsigned)std::max(1, m.o.max_connections),        //
      MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)std::max(1, m.o.idle_timeout_s),       //
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)std::max<size_t>(m.o.max_header_bytes, 8u << 10),  //
      MHD_OPTION_NOTIFY_COMPLETED, +completed, &m,                                    //
      MHD_OPTION_NOTIFY_CONNECTION, +notify, &m,                                      //
      MHD_OPTION_END);
  if (!m.daemon) {
    ::close(fd);
    m.listen_fd = -1;
    KVQ_CHECK(false, Errc::io, "cannot start the HTTP server on ", m.o.host, ":", m.port);
  }
  m.watcher = std::thread([&m] { m.watch(); });
  return m.port;
}

void Server::listen() {
  Impl& m = *impl_;
  KVQ_CHECK(m.port > 0, Errc::internal, "Server::listen before bind");
  std::unique_lock<std::mutex> lock(m.stop_mu);
  m.stop_cv.wait(lock, [&] { return m.stopped; });
}

void Server::stop() { impl_->shut(impl_->o.drain_timeout_s); }
void Server::stop(double drain_timeout_s) { impl_->shut(drain_timeout_s); }

int Server::port() const { return impl_->port; }

}  // namespace kvq::server
