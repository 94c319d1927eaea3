// The CPU packed KV store and the attention that reads it directly.
//
// Store: per (layer, kv_head, side) one token-major code array (row stride =
// the block's code_bytes) and one token-major side array (stride side_bytes).
// Nothing else is kept: no fp32/bf16 mirror of a quantized codec.
//
// Attention (per query token, per query head; GQA maps query head h to KV
// head h / (n_heads / n_kv_heads)):
//   q_rot = R_k q                 once per (query head, step)
//   s_t   = scale * <q_rot, k_hat_t>  from the packed K rows (rotated basis)
//   p     = softmax(s)            (max-subtracted, fp32)
//   o_rot = sum_t p_t v_hat_t     from the packed V rows (rotated basis)
//   out   = R_v^T o_rot           once
// This is the algorithm the GPU decode kernels run; the CPU version is the
// oracle they are tested against.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.hpp"
#include "kv/block.hpp"
#include <atomic>

#include "kv/cache.hpp"
#include "kv/codec_table.hpp"

namespace kvq::kv {

Cache::Cache() {
  static std::atomic<uint64_t> next{1};
  id_ = next.fetch_add(1, std::memory_order_relaxed);
}

namespace {

struct SideStore {
  std::unique_ptr<Block> block;
  std::vector<uint8_t> codes;  // [capacity][code_bytes]
  std::vector<uint8_t> sides;  // [capacity][side_bytes]
};

class CpuLayerCache final : public LayerCache {
 public:
  CpuLayerCache(const ResolvedCodec& codec, const CacheShape& shape, uint64_t seed, int layer)
      : shape_(shape) {
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      k_.push_back({make_block(codec.k, shape.head_dim, seed, layer, h, Side::k), {}, {}});
      v_.push_back({make_block(codec.v, shape.head_dim, seed, layer, h, Side::v), {}, {}});
    }
  }

  void write(int pos, int n, const float* k, const float* v) override {
    KVQ_CHECK(pos >= 0 && n >= 0, Errc::invalid_argument, "KV write: bad position ", pos, " / count ", n);
    KVQ_CHECK(pos + n <= shape_.max_tokens, Errc::out_of_range, "KV write of tokens [", pos, ", ", pos + n,
              ") exceeds the cache capacity of ", shape_.max_tokens, " tokens (raise the context size)");
    KVQ_CHECK(pos <= filled_, Errc::invalid_argument, "KV write at position ", pos,
              " would leave a gap: only ", filled_, " tokens are filled");
    if (n == 0) return;
    reserve(pos + n);
    const int H = shape_.n_kv_heads, D = shape_.head_dim;
    const int jobs = n * H;
#pragma omp parallel for schedule(dynamic, 4) if (jobs >= 8)
    for (int j = 0; j < jobs; ++j) {
      const int t = j / H, h = j % H;
      const size_t off = (size_t(t) * H + h) * D;
      encode_row(k_[h], pos + t, k + off);
      encode_row(v_[h], pos + t, v + off);
    }
    filled_ = std::max(filled_, pos + n);
  }

  void attend(int pos, int n, const float* q, int n_heads, float scale, float* out) const override {
    const int H = shape_.n_kv_heads, D = shape_.head_dim;
    KVQ_CHECK(n_heads > 0 && n_heads % H == 0, Errc::invalid_argument, "attention: ", n_heads,
              " query heads is not a multiple of ", H, " KV heads");
    KVQ_CHECK(pos >= 0 && n >= 0 && pos + n <= filled_, Errc::invalid_argument, "attention over tokens [0, ",
              pos + n, ") but only ", filled_, " are written (write K/V before attending)");
    const int group = n_heads / H;
    // One job per (KV head, chunk of up to kQueryChunk query tokens): all the
    // queries of the job (its tokens x the GQA group) share each decoded row,
    // so a prefill chunk decodes the store once, not once per token. Rows past
    // a query's causal limit get probability 0.
    constexpr int kQueryChunk = 32;
    const int n_chunks = (n + kQueryChunk - 1) / kQueryChunk;
    const int jobs = H * n_chunks;
#pragma omp parallel if (jobs >= 2 && size_t(n) * n_heads * (pos + n) >= 4096)
    {
      std::vector<float> q_rot(D), one, qstates, scores, acc;
#pragma omp for schedule(dynamic, 1)
      for (int j = 0; j < jobs; ++j) {
        const int h = j % H, c = j / H;
        const int t0 = c * kQueryChunk, t1 = std::min(n, t0 + kQueryChunk);
        const int nq = (t1 - t0) * group;
        const int T = pos + t1;  // rows any query of the chunk may see
        const SideStore& ks = k_[h];
        const SideStore& vs = v_[h];
        const RowLayout& kl = ks.block->layout();
        const RowLayout& vl = vs.block->layout();
        // rotate each query once, build its state; query index qi = (t - t0) * group + g
        size_t qs = 0;
        for (int qi = 0; qi < nq; ++qi) {
          const int t = t0 + qi / group, g = qi % group;
          const float* qv = q + (size_t(t) * n_heads + size_t(h) * group + g) * D;
          ks.block->rotate(qv, q_rot.data());
          ks.block->prepare_query(q_rot.data(), one);
          if (qi == 0) {
            qs = one.size();
            qstates.resize(qs * nq);
          }
          std::copy(one.begin(), one.end(), qstates.begin() + ptrdiff_t(qs * qi));
        }
        scores.resize(size_t(nq) * T);
        ks.block->dot_rows(qstates.data(), qs, nq, ks.codes.data(), kl.code_bytes, ks.sides.data(),
                           kl.side_bytes, T, scores.data());
        for (int qi = 0; qi < nq; ++qi) {
          const int visible = pos + t0 + qi / group + 1;  // causal: rows [0, pos + t]
          float* sc = &scores[size_t(qi) * T];
          float m = -std::numeric_limits<float>::infinity();
          for (int i = 0; i < visible; ++i) m = std::max(m, sc[i] *= scale);
          double l = 0;
          for (int i = 0; i < visible; ++i) l += (sc[i] = std::exp(sc[i] - m));
          const float inv_l = float(1.0 / l);
          for (int i = 0; i < visible; ++i) sc[i] *= inv_l;
          std::fill(sc + visible, sc + T, 0.0f);
        }
        acc.assign(size_t(nq) * D, 0.0f);
        vs.block->accumulate_rows(scores.data(), size_t(T), nq, vs.codes.data(), vl.code_bytes, vs.sides.data(),
                                  vl.side_bytes, T, acc.data());
        for (int qi = 0; qi < nq; ++qi) {
          const int t = t0 + qi / group, g = qi % group;
          vs.block->unrotate(&acc[size_t(qi) * D], out + (size_t(t) * n_heads + size_t(h) * group + g) * D);
        }
      }
    }
  }

  size_t row_bytes_k() const { return k_.empty() ? 0 : k_[0].block->layout().row_bytes(); }
  size_t row_bytes_v() const { return v_.empty() ? 0 : v_[0].block->layout().row_bytes(); }

 private:
  void encode_row(SideStore& s, int token, const float* x) const {
    const RowLayout& l = s.block->layout();
    s.block->encode(x, s.codes.data() + size_t(token) * l.code_bytes, s.sides.data() + size_t(token) * l.side_bytes);
  }
  // Grow the stores in chunks (capacity is max_tokens; memory follows use).
  void reserve(int tokens) {
    if (tokens <= capacity_) return;
    const int chunk = 256;
    capacity_ = std::min(shape_.max_tokens, (tokens + chunk - 1) / chunk * chunk);
    for (auto* sides : {&k_, &v_})
      for (auto& s : *sides) {
        s.codes.resize(size_t(capacity_) * s.block->layout().code_bytes);
        s.sides.resize(size_t(capacity_) * s.block->layout().side_bytes);
      }
  }

  CacheShape shape_;
  std::vector<SideStore> k_, v_;
  int capacity_ = 0;
  int filled_ = 0;
};

class CpuCache final : public Cache {
 public:
  CpuCache(const CodecOptions& opts, const CacheShape& shape) : shape_(shape), codec_(resolve_codec(opts)) {
    KVQ_CHECK(shape.n_layers > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0 && shape.max_tokens > 0,
              Errc::invalid_argument, "KV cache shape must be positive (layers ", shape.n_layers, ", kv heads ",
              shape.n_kv_heads, ", head_dim ", shape.head_dim, ", max tokens ", shape.max_tokens, ")");
    for (int l = 0; l < shape.n_layers; ++l)
      layers_.push_back(std::make_unique<CpuLayerCache>(codec_, shape, opts.seed, l));
  }
  const CacheShape& shape() const override { return shape_; }
  std::string codec_name() const override { return codec_.name; }
  LayerCache& layer(int i) override {
    KVQ_CHECK(i >= 0 && i < shape_.n_layers, Errc::out_of_range, "KV layer ", i, " out of range [0, ",
              shape_.n_layers, ")");
    return *layers_[size_t(i)];
  }
  uint64_t bytes_for_tokens(int n_tokens) const override {
    return uint64_t(n_tokens) * shape_.n_layers * shape_.n_kv_heads *
           codec_bytes_per_token_per_head(codec_, shape_.head_dim);
  }

 private:
  CacheShape shape_;
  ResolvedCodec codec_;
  std::vector<std::unique_ptr<CpuLayerCache>> layers_;
};

}  // namespace

std::unique_ptr<Cache> make_cpu_cache(const CodecOptions& opts, const CacheShape& shape) {
  return std::make_unique<CpuCache>(opts, shape);
}

}  // namespace kvq::kv
