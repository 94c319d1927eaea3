#include "server/server.hpp"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/log.hpp"
#include "server/metrics.hpp"
#include "tokenizer/tokenizer.hpp"

namespace kvq::server {
namespace {

using Clock = std::chrono::steady_clock;
// A client that hung up is only noticed by writing to it: a request that has
// written nothing for this long writes a no-op (an SSE comment, or a space
// before the JSON body) to find out.
constexpr auto kProbeEvery = std::chrono::seconds(1);

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Compares without an early exit, so response time does not reveal how much
// of a guessed key was right.
bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= (unsigned char)(a[i] ^ (i < b.size() ? b[i] : 0));
  return diff == 0;
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status();
  res.set_content(dump(error_json(e)) + "\n", "application/json");
}

}  // namespace

struct Server::Impl {
  Engine& engine;
  ServerOptions o;
  httplib::Server http;
  Metrics metrics;
  std::atomic<bool> stopping{false};
  std::atomic<uint64_t> requests_without_seed{0};
  int64_t started = 0;
  int port = -1;

  Impl(Engine& e, ServerOptions opts) : engine(e), o(std::move(opts)) {}

  void setup();
  void check_auth(const httplib::Request& req) const;
  void completion(Endpoint ep, const httplib::Request& req, const std::string& body, httplib::Response& res);
  json model_json() const;

  // One admitted completion request, owned by its response's content provider.
  struct Pending {
    Endpoint ep;
    ApiRequest req;
    Job job;
    ResponseId rid;
    Clock::time_point arrival;
    std::unique_ptr<FairQueue::Ticket> ticket;
  };
  bool serve(Pending& p, httplib::DataSink& sink);

  // Runs a route handler, turning exceptions into OpenAI error responses.
  template <typename F>
  httplib::Server::Handler guarded(F f) {
    return [this, f](const httplib::Request& req, httplib::Response& res) {
      try {
        f(req, res);
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const Error& e) {
        const bool user = e.code() == Errc::invalid_argument || e.code() == Errc::out_of_range;
        send_error(res, ApiError(user ? 400 : 500, user ? "invalid_request_error" : "server_error", "", "", e.what()));
      } catch (const std::exception& e) {
        log_warn("serve: ", req.method, " ", req.path, ": ", e.what());
        send_error(res, ApiError(500, "server_error", "", "", str("internal error: ", e.what())));
      }
    };
  }
};

void Server::Impl::check_auth(const httplib::Request& req) const {
  if (o.api_key.empty()) return;
  const std::string h = req.get_header_value("Authorization");
  const std::string prefix = "Bearer ";
  if (h.size() > prefix.size() && h.compare(0, prefix.size(), prefix) == 0 &&
      same_secret(h.substr(prefix.size()), o.api_key))
    return;
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

void Server::Impl::setup() {
  started = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  // Threads: the running request, the waiting ones, and spare for /health,
  // /metrics, 429 answers and idle keep-alive connections.
  const size_t threads = o.http_threads > 0 ? size_t(o.http_threads) : size_t(engine.max_waiting()) + 64;
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http.set_payload_max_length(o.max_body);
  // httplib's default sets SO_REUSEPORT, which lets a second server bind the
  // same port and silently take half its connections; a port in use must be
  // an error. SO_REUSEADDR alone still allows a quick restart.
  http.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });

  // POST bodies are read through a content reader: httplib's own reading
  // would parse a form-encoded body (curl -d's default Content-Type) and cap
  // it at 8 KiB; the API is JSON whatever the header says.
  auto post = [this](Endpoint ep) {
    return [this, ep](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
      guarded([&](const httplib::Request& rq, httplib::Response& rs) {
        std::string body;
        bool too_large = false;
        const bool ok = reader([&](const char* data, size_t n) {
          // httplib bounds bodies with a Content-Length, not chunked ones.
          too_large = body.size() + n > o.max_body;
          if (!too_large) body.append(data, n);
          return !too_large;
        });
        if (too_large) rs.set_header("Connection", "close");  // the rest of the body is not read
        if (!ok && (too_large || rs.status == 413))
          throw ApiError(413, "invalid_request_error", "request_too_large", "",
                         str("the request body is larger than the server's limit of ", o.max_body,
                             " bytes (--max-body)"));
        if (!ok) throw ApiError(400, "invalid_request_error", "", "", "could not read the request body");
        completion(ep, rq, body, rs);
      })(req, res);
    };
  };
  http.Post("/v1/chat/completions", post(Endpoint::chat));
  http.Post("/v1/completions", post(Endpoint::completion));
  http.Get("/v1/models", guarded([this](const auto& req, auto& res) {
             check_auth(req);
             res.set_content(dump(json{{"object", "list"}, {"data", json::array({model_json()})}}) + "\n",
                             "application/json");
           }));
  http.Get("/v1/models/(.+)", guarded([this](const httplib::Request& req, httplib::Response& res) {
             check_auth(req);
             if (req.matches[1] != o.model_id)
               throw ApiError(404, "invalid_request_error", "model_not_found", "model",
                              str("the model '", std::string(req.matches[1]), "' does not exist; this server serves '",
                                  o.model_id, "'"));
             res.set_content(dump(model_json()) + "\n", "application/json");
           }));
  http.Get("/health", guarded([this](const auto&, auto& res) {
             const bool up = !stopping;
             res.status = up ? 200 : 503;
             res.set_content(dump(json{{"status", up ? "ok" : "shutting down"},
                                       {"queue_depth", engine.waiting()},
                                       {"running", engine.running()}}) +
                                 "\n",
                             "application/json");
           }));
  http.Get("/metrics", guarded([this](const auto&, auto& res) {
             Gauges g;
             g.queue_depth = engine.waiting();
             g.running = engine.running();
             g.kv_bytes = engine.kv_bytes();
             res.set_content(metrics.render(g), "text/plain; version=0.0.4; charset=utf-8");
           }));

  // Errors httplib answers itself (unknown route, body too large, malformed
  // HTTP) get the same envelope as ours.
  http.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req,
                                                                      httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    ApiError e(res.status, "invalid_request_error", "", "", str("HTTP ", res.status));
    if (res.status == 404)
      e = ApiError(404, "invalid_request_error", "unknown_url", "",
                   str("unknown route ", req.method, " ", req.path,
                       "; kvq serves POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, "
                       "GET /metrics"));
    else if (res.status == 413)
      e = ApiError(413, "invalid_request_error", "request_too_large", "",
                   str("the request body is larger than the server's limit of ", o.max_body, " bytes (--max-body)"));
    else if (res.status == 400)
      e = ApiError(400, "invalid_request_error", "", "", "malformed HTTP request");
    else if (res.status >= 500)
      e = ApiError(res.status, "server_error", "", "", str("HTTP ", res.status));
    send_error(res, e);
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    send_error(res, ApiError(500, "server_error", "", "", "internal error"));
  });
  http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    metrics.request(req.path, res.status);
    log_info("serve: ", req.method, " ", req.path, " ", res.status);
  });
}

void Server::Impl::completion(Endpoint ep, const httplib::Request& req, const std::string& body,
                              httplib::Response& res) {
  const auto arrival = Clock::now();
  check_auth(req);
  if (stopping) throw ApiError(503, "server_error", "shutting_down", "", "the server is shutting down");
  ApiRequest r = parse_request(ep, body, o.defaults);
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
  if (!r.seed_given) r.sampling.seed = o.defaults.sampling.seed + requests_without_seed++;
  try {
    r.sampling.validate();
  } catch (const Error& e) {
    bad_request("", e.what());
  }

  const std::vector<TokenId> prompt = prompt_tokens(r, engine.tokenizer(), o.chat_template, engine.vocab());
  const int n = int(prompt.size());
  const char* prompt_param = ep == Endpoint::chat ? "messages" : "prompt";
  if (n >= o.ctx)
    throw ApiError(400, "invalid_request_error", "context_length_exceeded", prompt_param,
                   str("this model's maximum context length is ", o.ctx, " tokens (--ctx), but the prompt has ", n,
                       " tokens, leaving no room for a completion; shorten the prompt"));
  if (r.max_tokens > 0 && int64_t(n) + r.max_tokens > o.ctx)
    throw ApiError(400, "invalid_request_error", "context_length_exceeded", "max_tokens",
                   str("this model's maximum context length is ", o.ctx, " tokens (--ctx), but ", int64_t(n) + r.max_tokens,
                       " were requested (", n, " in the prompt, ", r.max_tokens,
                       " for the completion); lower max_tokens or shorten the prompt"));

  auto p = std::make_shared<Pending>();
  p->ep = ep;
  p->arrival = arrival;
  p->job.prompt = prompt;
  p->job.kv_codec = r.kv_codec;
  // The cache holds what this request can use: prompt + max_tokens, or the
  // whole context when it may run to the end.
  p->job.ctx = r.max_tokens > 0 ? n + r.max_tokens : o.ctx;
  p->job.gen.n_predict = r.max_tokens;
  p->job.gen.stop = r.stop;
  p->job.gen.sampling = r.sampling;
  p->job.gen.token_logits = r.logprobs >= 0;
  p->rid = new_response_id(ep, o.model_id);
  p->req = std::move(r);
  p->ticket = engine.enter();
  if (!p->ticket) {
    res.set_header("Retry-After", "1");
    throw ApiError(429, "rate_limit_error", "queue_full", "",
                   str("the server is busy: ", engine.max_waiting(), " requests are already waiting (--max-queue); retry later"));
  }
  if (p->req.stream) {
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
  }
  res.set_chunked_content_provider(p->req.stream ? "text/event-stream" : "application/json",
                                   [this, p](size_t, httplib::DataSink& sink) { return serve(*p, sink); });
}

bool Server::Impl::serve(Pending& p, httplib::DataSink& sink) {
  // The place in the queue is given up when this returns, however it returns.
  const std::unique_ptr<FairQueue::Ticket> ticket = std::move(p.ticket);
  if (!ticket) return false;  // served already (httplib calls a provider until it is done)
  const Tokenizer& tok = engine.tokenizer();
  const bool sse = p.req.stream;
  bool gone = false;
  auto last_write = Clock::now();
  auto write = [&](const std::string& data) {
    if (!gone && !sink.write(data.data(), data.size())) gone = true;
    last_write = Clock::now();
    return !gone;
  };
  auto send_event = [&](const json& j) { return write("data: " + dump(j) + "\n\n"); };
  auto abandon = [&] {
    if (stopping) return true;
    if (!gone && Clock::now() - last_write >= kProbeEvery) write(sse ? ": waiting\n\n" : " ");
    return gone;
  };

  // Chat streams open with the assistant role, as OpenAI's do.
  if (sse && p.ep == Endpoint::chat) send_event(chunk_json(p.ep, p.rid, "", true, nullptr, nullptr, nullptr));

  std::string text;
  std::vector<TokenLogprob> lps;  // all of them (non-streamed) or those not yet sent (streamed)
  size_t lps_offset = 0;          // completion text length before lps[0]
  int n_tokens = 0;
  Clock::time_point prev;
  GenerateOptions& g = p.job.gen;
  g.on_token = [&](TokenId id, const float* logits) {
    const auto now = Clock::now();
    if (n_tokens++ == 0)
      metrics.ttft().observe(seconds(now - p.arrival));
    else
      metrics.itl().observe(seconds(now - prev));
    prev = now;
    if (logits && !tok.is_eog(id)) lps.push_back(token_logprob(logits, engine.vocab(), id, p.req.logprobs));
    return !abandon();
  };
  auto on_text = [&](const std::string& piece) {
    if (sse) {
      const json lp = p.req.logprobs >= 0 ? logprobs_json(p.ep, tok, lps, lps_offset) : json(nullptr);
      send_event(chunk_json(p.ep, p.rid, piece, false, nullptr, lp, nullptr));
      lps.clear();
      lps_offset = text.size() + piece.size();
    }
    text += piece;
  };

  std::optional<GenerateResult> r;
  try {
    r = engine.run(*ticket, p.job, on_text, abandon);
  } catch (const std::exception& e) {
    // The status line is out already: the error goes in the body.
    log_warn("serve: ", p.rid.id, ": ", e.what());
    const ApiError err(500, "server_error", "", "", str("generation failed: ", e.what()));
    if (sse) {
      send_event(error_json(err));
      write("data: [DONE]\n\n");
    } else {
      write(dump(error_json(err)) + "\n");
    }
    sink.done();
    return !gone;
  }
  if (!r || r->stop_reason == StopReason::cancelled) {
    if (gone) {
      metrics.cancelled();
      return false;  // the client left: close the connection
    }
    // The server is stopping: say so to a client that is still there.
    const ApiError err(503, "server_error", "shutting_down", "", "the server is shutting down");
    if (sse) {
      send_event(error_json(err));
      write("data: [DONE]\n\n");
    } else {
      write(dump(error_json(err)) + "\n");
    }
    if (gone) return false;
    sink.done();
    return true;
  }

  const Usage usage{int(p.job.prompt.size()), int(r->tokens.size())};
  metrics.tokens(usage.prompt_tokens, usage.completion_tokens);
  const char* finish = finish_reason(r->stop_reason);
  if (sse) {
    const json lp = p.req.logprobs >= 0 && !lps.empty() ? logprobs_json(p.ep, tok, lps, lps_offset) : json(nullptr);
    send_event(chunk_json(p.ep, p.rid, "", false, finish, lp, &usage));
    if (p.req.include_usage) send_event(usage_chunk_json(p.ep, p.rid, usage));
    write("data: [DONE]\n\n");
  } else {
    const json lp = p.req.logprobs >= 0 ? logprobs_json(p.ep, tok, lps, 0) : json(nullptr);
    write(dump(response_json(p.ep, p.rid, text, finish, usage, lp)) + "\n");
  }
  if (gone) return false;
  sink.done();
  return true;
}

Server::Server(Engine& engine, ServerOptions opts) : impl_(std::make_unique<Impl>(engine, std::move(opts))) {
  KVQ_CHECK(!impl_->o.model_id.empty(), Errc::internal, "Server needs a model id");
  KVQ_CHECK(impl_->o.ctx > 1, Errc::invalid_argument, "--ctx must be at least 2 tokens to serve");
  impl_->setup();
}

Server::~Server() { stop(); }

int Server::bind() {
  Impl& m = *impl_;
  const int port = m.o.port == 0 ? m.http.bind_to_any_port(m.o.host) : m.http.bind_to_port(m.o.host, m.o.port) ? m.o.port : -1;
  KVQ_CHECK(port > 0, Errc::io, "cannot listen on ", m.o.host, ":", m.o.port,
            " (address in use or not local? pick another --port or --host)");
  m.port = port;
  return port;
}

void Server::listen() {
  KVQ_CHECK(impl_->port > 0, Errc::internal, "Server::listen before bind");
  impl_->http.listen_after_bind();
}

void Server::stop() {
  impl_->stopping = true;
  impl_->engine.shut_down();
  impl_->http.stop();
}

int Server::port() const { return impl_->port; }

}  // namespace kvq::server
