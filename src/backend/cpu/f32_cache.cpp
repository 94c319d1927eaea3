#include "backend/cpu/f32_cache.hpp"

#include <algorithm>
#include <vector>

#include "backend/cpu/kernels.hpp"
#include "core/error.hpp"

namespace kvq::cpu {

namespace {

class F32Layer final : public kv::LayerCache {
 public:
  explicit F32Layer(const kv::CacheShape& s)
      : s_(s), row_(size_t(s.n_kv_heads) * s.head_dim), k_(row_ * s.max_tokens), v_(row_ * s.max_tokens) {}

  void write(int pos, int n, const float* k, const float* v) override {
    KVQ_CHECK(pos >= 0 && n >= 0 && pos + n <= s_.max_tokens, Errc::out_of_range, "KV cache write of tokens [",
              pos, ", ", pos + n, ") exceeds its capacity of ", s_.max_tokens, " tokens");
    std::copy_n(k, row_ * n, k_.data() + row_ * pos);
    std::copy_n(v, row_ * n, v_.data() + row_ * pos);
  }
  void attend(int pos, int n, const float* q, int n_heads, float scale, float* out) const override {
    KVQ_CHECK(pos >= 0 && pos + n <= s_.max_tokens, Errc::out_of_range, "attention over ", pos + n,
              " tokens exceeds the cache capacity of ", s_.max_tokens);
    attention_f32(q, k_.data(), v_.data(), pos, n, n_heads, s_.n_kv_heads, s_.head_dim, scale, out);
  }

 private:
  kv::CacheShape s_;
  size_t row_;
  std::vector<float> k_, v_;
};

class F32Cache final : public kv::Cache {
 public:
  explicit F32Cache(const kv::CacheShape& s) : s_(s) {
    for (int i = 0; i < s.n_layers; ++i) layers_.push_back(std::make_unique<F32Layer>(s));
  }
  const kv::CacheShape& shape() const override { return s_; }
  std::string codec_name() const override { return "f32"; }
  kv::LayerCache& layer(int i) override { return *layers_.at(i); }
  uint64_t bytes_for_tokens(int n) const override {
    return uint64_t(n) * s_.n_layers * s_.n_kv_heads * s_.head_dim * 2 * 4;
  }

 private:
  kv::CacheShape s_;
  std::vector<std::unique_ptr<F32Layer>> layers_;
};

}  // namespace

std::unique_ptr<kv::Cache> make_f32_cache(const kv::CacheShape& shape) {
  KVQ_CHECK(shape.n_layers > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0 && shape.max_tokens > 0,
            Errc::invalid_argument, "KV cache shape must be positive (layers ", shape.n_layers, ", kv heads ",
            shape.n_kv_heads, ", head_dim ", shape.head_dim, ", tokens ", shape.max_tokens, ")");
  return std::make_unique<F32Cache>(shape);
}

}  // namespace kvq::cpu
