// A backend that forwards every op to an inner backend (the CPU one unless
// given), for tests that change one or two behaviours (which codecs a cache
// accepts, a backend name, a copy bandwidth) without writing out the rest.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.hpp"
#include "backend/cpu/cpu_backend.hpp"

namespace kvq::testutil {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner = cpu::make_cpu_backend()) : inner_(std::move(inner)) {}
  const char* name() const override { return inner_->name(); }
  std::unique_ptr<Buffer> alloc(size_t n) override { return inner_->alloc(n); }
  Matrix upload(const Matrix& m) override { return inner_->upload(m); }
  void upload(const float* h, float* d, size_t n) override { inner_->upload(h, d, n); }
  void download(const float* s, float* h, size_t n) override { inner_->download(s, h, n); }
  void prepare_step(const StepBatch& b) override { inner_->prepare_step(b); }
  void embed(const Matrix& t, const int32_t* ids, int n, float* out) override { inner_->embed(t, ids, n, out); }
  void matmul(const Matrix& w, const float* x, int n, float* y) override { inner_->matmul(w, x, n, y); }
  void rms_norm(const float* x, const float* w, int n, int dim, float eps, float* y) override {
    inner_->rms_norm(x, w, n, dim, eps, y);
  }
  void rope(float* x, int n, int h, int d, int pos, const Rope& r) override { inner_->rope(x, n, h, d, pos, r); }
  void swiglu(const float* g, const float* u, float* o, size_t n) override { inner_->swiglu(g, u, o, n); }
  void add(float* x, const float* y, size_t n) override { inner_->add(x, y, n); }
  void write_kv(kv::LayerCache& l, const StepBatch& b, const float* k, const float* v) override {
    inner_->write_kv(l, b, k, v);
  }
  void attention(const kv::LayerCache& l, const StepBatch& b, const float* q, int h, float s, float* o) override {
    inner_->attention(l, b, q, h, s, o);
  }
  std::unique_ptr<kv::Cache> make_cache(const kv::CodecOptions& o, const kv::CacheShape& shape) override {
    return inner_->make_cache(o, shape);
  }
  void reset_dispatch_stats(kv::Cache& c) override { inner_->reset_dispatch_stats(c); }
  DispatchStats dispatch_stats(kv::Cache& c) override { return inner_->dispatch_stats(c); }

 protected:
  Backend& inner() { return *inner_; }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace kvq::testutil
