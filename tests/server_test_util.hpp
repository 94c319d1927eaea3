// The in-process server fixture the server tests share: the embedded tiny
// model, a Server on a free loopback port, and small HTTP helpers.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include "backend/cpu/cpu_backend.hpp"
#include "engine/session.hpp"
#include "gguf/gguf.hpp"
#include "kv/page.hpp"
#include "model/forward.hpp"
#include "server/server.hpp"
#include "tokenizer/tokenizer.hpp"

namespace kvq::server::testing {

using namespace std::chrono_literals;

inline const std::string kModel = std::string(KVQ_SOURCE_DIR) + "/models/kvq-tiny-code.gguf";
inline const char* const kJson = "application/json";

// One compute thread, here and on the engine thread: ctest runs other suites
// beside this one, and OpenMP teams on a shared core mostly wait.
inline void one_thread() { omp_set_num_threads(1); }

struct Model_ {
  Model_() { one_thread(); }
  std::unique_ptr<Backend> backend = cpu::make_cpu_backend();
  std::unique_ptr<Model> model = Model::open(kModel, *backend);
  Tokenizer tok = Tokenizer::from_gguf(*model->file());
  int vocab() const { return std::min(tok.vocab_size(), model->config().vocab_size); }
};

inline Model_& tiny() {
  static Model_ m;
  return m;
}

// A server over the tiny model on a free loopback port, serving on a thread.
struct Served {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Server> server;
  std::thread thread;
  int port = 0;

  // max_seqs sequences run together over a pool of max_seqs x ctx tokens
  // (codec none, or `codec` with an exact window of `window` pages per
  // sequence); max_queue more may wait.
  explicit Served(ServerOptions o = {}, int max_queue = 4, int ctx = 256, int max_seqs = 4,
                  const std::string& codec = "none", int window = 0) {
    Model_& m = tiny();
    EngineSetup setup;
    setup.model = m.model.get();
    const int page = kv::kDefaultPageTokens;
    kv::CacheShape shape = m.model->cache_shape(max_seqs * kv::pages_for(ctx, page) * page);
    shape.window_pages = window;
    shape.exact_pages = max_seqs * window;
    kv::CodecOptions c;
    c.kv = codec;
    setup.store = m.backend->make_cache(c, shape);
    setup.scheduler.max_running = max_seqs;
    setup.scheduler.max_seq_tokens = ctx;
    setup.max_waiting = max_queue;
    setup.thread_init = one_thread;
    engine = std::make_unique<Engine>(m.tok, m.vocab(), std::move(setup));
    o.port = 0;
    o.model_id = "tiny";
    o.default_codec = engine->codec();
    o.ctx = ctx;
    o.chat_template = ChatTemplate::chatml;
    server = std::make_unique<Server>(*engine, o);
    port = server->bind();
    thread = std::thread([this] { server->listen(); });
  }
  ~Served() {
    server->stop(0.0);
    thread.join();
  }
  httplib::Client client(const std::string& key = "") const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(120, 0);
    if (!key.empty()) c.set_bearer_token_auth(key.c_str());
    return c;
  }
  httplib::Result post(const std::string& path, const std::string& body, const std::string& key = "") const {
    return client(key).Post(path.c_str(), body, kJson);
  }
  json post_json(const std::string& path, const json& body, int want_status = 200) const {
    auto r = post(path, body.dump());
    EXPECT_TRUE(r) << path;
    if (!r) return json();
    EXPECT_EQ(r->status, want_status) << r->body;
    return json::parse(r->body);
  }
  // Polls GET /metrics until `pred` holds on its text (bounded: a stuck server fails the test).
  bool metrics_until(const std::function<bool(const std::string&)>& pred) const {
    for (int i = 0; i < 600; ++i) {
      auto r = client().Get("/metrics");
      if (r && pred(r->body)) return true;
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }
};

// The value of an un-labelled metric line "name value".
inline double metric(const std::string& text, const std::string& name) {
  const size_t at = text.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + name.size() + 2));
}

}  // namespace kvq::server::testing
