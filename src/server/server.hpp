// `kvq serve`'s HTTP side: OpenAI-compatible routes over GNU libmicrohttpd.
//
//   POST /v1/chat/completions, /v1/completions   (stream: true -> server-sent events, then [DONE])
//   POST /tokenize, /detokenize                  (token ids of a text, text of token ids)
//   GET  /v1/models, /health, /metrics           (metrics: Prometheus text)
//
// One event-loop thread (epoll) owns every connection: an idle or slow
// connection costs a file descriptor and a bounded memory pool
// (--max-header-bytes), never a thread. Each connection's request head must
// arrive within --head-timeout and its body within --body-timeout; idle keep-alive connections close after
// --idle-timeout; at most --max-connections are open. Request bodies are
// bounded one by one (--max-body) and together (2 x --max-body in flight);
// parsing and tokenizing run on a small fixed pool, never on the event loop.
//
// Every prompt of a completion is a sequence of the engine's continuous-
// batching scheduler (Engine): many decode together, one token each per
// step. The engine thread pushes token ids into each sequence's Stream; the
// request's own thread drains it (detokenizing, stop strings, logprobs) into
// a per-request channel (Exchange) that the event loop drains into the
// socket: the engine never writes to sockets or waits for a client. Beyond
// --max-seqs running and --max-queue waiting, requests get 429. A client
// that goes away (seen through the socket, whatever the response's encoding)
// cancels its sequences. Every error is a 4xx/5xx with OpenAI's error envelope.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "server/engine.hpp"
#include "server/openai.hpp"
#include "tokenizer/chat.hpp"

namespace kvq::server {

struct ServerOptions {
  std::string host = "127.0.0.1";  // loopback unless asked otherwise
  int port = 8080;                 // 0: any free port (see Server::port())
  std::string api_key;             // non-empty: /v1/* need "Authorization: Bearer <key>"
  size_t max_body = 8u << 20;      // larger request bodies get 413
  int ctx = 4096;                  // tokens a request may use, prompt + completion
  std::string model_id;            // the name /v1/models lists and requests use
  std::string default_codec;       // --kv (the pool's codec), reported by /v1/models
  ChatTemplate chat_template = ChatTemplate::chatml;
  Defaults defaults;               // sampling and length when a request leaves them out

  // Limits on what a client can hold (see the comment at the top).
  double head_timeout_s = 10;      // a request head (line + headers) must arrive within this
  double body_timeout_s = 60;      // a request body must arrive within this (from the end of its head)
  int idle_timeout_s = 60;         // a connection with no traffic for this long is closed
  int max_connections = 1024;      // open connections; more are closed at accept
  int max_headers = 100;           // request header lines; more get 431
  size_t max_header_bytes = 32u << 10;  // request head size; more get 431
  int parse_threads = 2;           // threads that parse and tokenize requests
  int backlog = 0;                 // listen backlog; 0: 4 x (max queue) + 512, capped at 4096
  std::string cors_origin;         // non-empty: CORS headers for this origin (--cors), preflight answered
  double drain_timeout_s = 30;     // stop(): in-flight requests may finish for this long
};

// Lines `kvq serve` prints at start about risky options (a public bind
// without an API key); empty when there is nothing to say.
std::string startup_warnings(const ServerOptions& o);

class Server {
 public:
  Server(Engine& engine, ServerOptions opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds host:port (port 0 picks a free one), starts accepting and returns
  // the port; a port in use or a bad host is a kvq::Error.
  int bind();
  // Blocks until stop() has finished; call bind() first.
  void listen();
  // Stops accepting new connections at once; /health answers 503 and new
  // completions 503 on connections still open; in-flight requests may finish
  // for drain_timeout_s (default: the options'), then are cancelled; then
  // every connection closes and listen() returns. Safe from any thread; a
  // second call while the first drains cancels at once.
  void stop();
  void stop(double drain_timeout_s);
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq::server
