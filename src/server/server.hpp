// `kvq serve`'s HTTP side: OpenAI-compatible routes over cpp-httplib.
//
//   POST /v1/chat/completions, /v1/completions   (stream: true -> server-sent events, then [DONE])
//   GET  /v1/models, /health, /metrics           (metrics: Prometheus text)
//
// Requests wait for the model in a fair FIFO (Engine); beyond --max-queue
// waiting they get 429. A client that goes away stops its generation (its
// KV cache is freed). Every error is a 4xx/5xx with OpenAI's error envelope.
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
  std::string default_codec;       // --kv, reported by /v1/models
  ChatTemplate chat_template = ChatTemplate::chatml;
  Defaults defaults;               // sampling and length when a request leaves them out
  int http_threads = 0;            // 0: enough for --max-queue waiting + running + spare
};

class Server {
 public:
  Server(Engine& engine, ServerOptions opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds host:port (port 0 picks a free one) and returns the port; a port in
  // use or a bad host is a kvq::Error.
  int bind();
  // Serves until stop(); call bind() first.
  void listen();
  // Stops accepting, makes waiting requests give up and running ones stop;
  // listen() returns. Safe from any thread.
  void stop();
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq::server
