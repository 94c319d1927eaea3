#include "backend/cpu/f32_cache.hpp"

#include <algorithm>
#include <vector>

#include "backend/cpu/kernels.hpp"
#include "core/error.hpp"

namespace kvq::cpu {

namespace {

// Rows of head_dim floats per side, placed by kv::PageGeometry like every
// other store; attention gathers a sequence's rows into [token][head][dim]
// and runs the plain attention_f32.
class F32Layer final : public kv::LayerCache {
 public:
  explicit F32Layer(const kv::CacheShape& s)
      : s_(s),
        geo_(s.geometry()),
        rows_(size_t(s.n_pages()) * geo_.rows_per_page()),
        k_(rows_ * s.head_dim),
        v_(rows_ * s.head_dim),
        written_(size_t(s.n_pages()) * s.page_tokens, 0) {}

  void write_slots(const int32_t* slots, int n, const float* k, const float* v) override {
    const int H = s_.n_kv_heads, D = s_.head_dim;
    for (int i = 0; i < n; ++i)
      KVQ_CHECK(slots[i] >= 0 && slots[i] < s_.max_tokens, Errc::out_of_range, "KV cache write at slot ", slots[i],
                " exceeds its capacity of ", s_.max_tokens, " tokens");
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < H; ++h) {
        const size_t row = geo_.slot_row(slots[i], h);
        std::copy_n(k + (size_t(i) * H + h) * D, D, k_.data() + row * D);
        std::copy_n(v + (size_t(i) * H + h) * D, D, v_.data() + row * D);
      }
      written_[size_t(slots[i])] = 1;
    }
  }
  void attend_runs(const kv::QueryRun* runs, int n_runs, const float* q, int n_heads, float scale,
                   float* out) const override {
    const int H = s_.n_kv_heads, D = s_.head_dim;
    std::vector<float> k, v;
    for (int r = 0; r < n_runs; ++r) {
      const kv::QueryRun& run = runs[r];
      const int T = run.pos + run.n;
      KVQ_CHECK(run.pos >= 0 && run.n >= 0 && kv::pages_for(T, s_.page_tokens) <= run.n_pages,
                Errc::invalid_argument, "attention over ", T, " tokens through a block table of ", run.n_pages,
                " pages");
      k.resize(size_t(T) * H * D);
      v.resize(size_t(T) * H * D);
      for (int t = 0; t < T; ++t) {
        const int32_t page = run.pages[t / s_.page_tokens];
        KVQ_CHECK(page >= 0 && page < s_.n_pages(), Errc::out_of_range, "block table names KV page ", page,
                  " of a store of ", s_.n_pages());
        KVQ_CHECK(written_[size_t(geo_.slot_of(run.pages, t))], Errc::invalid_argument,
                  "attention over a token that was never written (token ", t, ")");
        for (int h = 0; h < H; ++h) {
          const size_t row = geo_.token_row(run.pages, t, h);
          std::copy_n(k_.data() + row * D, D, k.data() + (size_t(t) * H + h) * D);
          std::copy_n(v_.data() + row * D, D, v.data() + (size_t(t) * H + h) * D);
        }
      }
      const size_t q_off = size_t(run.first) * n_heads * D;
      attention_f32(q + q_off, k.data(), v.data(), run.pos, run.n, n_heads, H, D, scale, out + q_off);
    }
  }

 protected:
  int store_page_tokens() const override { return s_.page_tokens; }

 private:
  kv::CacheShape s_;
  kv::PageGeometry geo_;
  size_t rows_;
  std::vector<float> k_, v_;
  std::vector<uint8_t> written_;
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
  KVQ_CHECK(shape.window_pages == 0 && shape.exact_pages == 0, Errc::unsupported,
            "the f32 reference store has no exact window (every row is exact already): use --kv-window 0");
  KVQ_CHECK(shape.n_layers > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0 && shape.max_tokens > 0 &&
                shape.page_tokens > 0,
            Errc::invalid_argument, "KV cache shape must be positive (layers ", shape.n_layers, ", kv heads ",
            shape.n_kv_heads, ", head_dim ", shape.head_dim, ", tokens ", shape.max_tokens, ")");
  return std::make_unique<F32Cache>(shape);
}

}  // namespace kvq::cpu
