// The CPU packed KV store and the attention that reads it directly.
//
// Store: per (layer, side) one code array and one side array holding every
// KV head's rows, paged (kv/page.hpp: row(page, head, entry)); row stride =
// the block's code_bytes / side_bytes. Nothing else is kept: no fp32/bf16
// mirror of a quantized codec.
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
//
// With an exact window (CodecOptions::exact_window_pages = W > 0) the store
// also keeps every row as bf16 (exact_k / exact_v, by the same row index),
// and a query at position p scores tokens [exact_window_start(p, W), p] from
// those rows (<q, k> in the original basis, equal to <R q, R k>), the older
// ones from the packed rows; one softmax over both; the packed rows'
// probabilities are accumulated in the rotated basis and un-rotated, the
// window's added to the output in the original basis.
//
// A sequence's rows are first gathered through its block table into one
// run, so its result does not depend on where its pages are or on what else
// is in the step.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.hpp"
#include "core/half.hpp"
#include "kv/block.hpp"
#include "kv/cache.hpp"
#include "kv/codec_table.hpp"

namespace kvq::kv {

Cache::Cache() {
  static std::atomic<uint64_t> next{1};
  id_ = next.fetch_add(1, std::memory_order_relaxed);
}

std::vector<int32_t> identity_pages(int n_pages) {
  std::vector<int32_t> p(size_t(std::max(n_pages, 0)));
  for (size_t i = 0; i < p.size(); ++i) p[i] = int32_t(i);
  return p;
}

void LayerCache::write(int pos, int n, const float* k, const float* v) {
  KVQ_CHECK(pos >= 0 && n >= 0, Errc::invalid_argument, "KV write: bad position ", pos, " / count ", n);
  std::vector<int32_t> slots(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) slots[size_t(i)] = pos + i;  // identity table: slot = position
  write_slots(slots.data(), n, k, v);
}

void LayerCache::attend(int pos, int n, const float* q, int n_heads, float scale, float* out) const {
  KVQ_CHECK(pos >= 0 && n >= 0, Errc::invalid_argument, "attention: bad position ", pos, " / count ", n);
  const std::vector<int32_t> pages = identity_pages(pages_for(pos + n, store_page_tokens()));
  const QueryRun run{pages.data(), int(pages.size()), 0, n, pos};
  attend_runs(&run, 1, q, n_heads, scale, out);
}

void LayerCache::read_row(int32_t, int, bool, uint8_t*, uint8_t*) const {
  fail(Errc::unsupported, "this KV store cannot read rows back");
}

void Cache::copy_pages(const int32_t*, const int32_t*, int) {
  fail(Errc::unsupported, "this KV store cannot copy pages");
}

void check_page_copy(const int32_t* src, const int32_t* dst, int n, int n_pages) {
  KVQ_CHECK(n >= 0, Errc::invalid_argument, "a copy of ", n, " KV pages");
  std::vector<uint8_t> role(size_t(std::max(n_pages, 0)), 0);  // 1: a source, 2: a destination
  for (int i = 0; i < n; ++i) {
    KVQ_CHECK(src[i] >= 0 && src[i] < n_pages && dst[i] >= 0 && dst[i] < n_pages, Errc::out_of_range,
              "a copy of KV page ", src[i], " to page ", dst[i], " in a store of ", n_pages, " pages");
    role[size_t(src[i])] |= 1;
  }
  for (int i = 0; i < n; ++i) {
    KVQ_CHECK(role[size_t(dst[i])] == 0, Errc::invalid_argument, "KV page ", dst[i],
              " is the destination of two copies, or also a source");
    role[size_t(dst[i])] = 2;
  }
}

namespace {

struct SideStore {
  std::vector<std::unique_ptr<Block>> blocks;  // per KV head
  std::vector<uint8_t> codes;  // rows x code_bytes, rows by PageGeometry::row
  std::vector<uint8_t> sides;  // rows x side_bytes
  size_t code_bytes = 0, side_bytes = 0;
};

class CpuLayerCache final : public LayerCache {
 public:
  CpuLayerCache(const ResolvedCodec& codec, const CacheShape& shape, uint64_t seed, int layer, int window_pages)
      : shape_(shape),
        geo_(shape.geometry()),
        written_(size_t(shape.n_pages()) * shape.page_tokens, 0),
        window_pages_(window_pages) {
    // The exact rows: a store of bf16 rows (2 D bytes, no side array); empty
    // without a window.
    if (window_pages > 0) exact_k_.code_bytes = exact_v_.code_bytes = 2 * size_t(shape.head_dim);
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      k_.blocks.push_back(make_block(codec.k, shape.head_dim, seed, layer, h, Side::k));
      v_.blocks.push_back(make_block(codec.v, shape.head_dim, seed, layer, h, Side::v));
    }
    for (SideStore* s : {&k_, &v_}) {
      s->code_bytes = s->blocks[0]->layout().code_bytes;
      s->side_bytes = s->blocks[0]->layout().side_bytes;
    }
  }

  void write_slots(const int32_t* slots, int n, const float* k, const float* v) override {
    KVQ_CHECK(n >= 0, Errc::invalid_argument, "KV write of ", n, " rows");
    const int32_t n_slots = shape_.max_tokens;
    for (int i = 0; i < n; ++i)
      KVQ_CHECK(slots[i] >= 0 && slots[i] < n_slots, Errc::out_of_range, "KV write at slot ", slots[i],
                " is outside the store of ", n_slots, " tokens (raise the context size)");
    if (n == 0) return;
    int max_page = 0;
    for (int i = 0; i < n; ++i) max_page = std::max(max_page, slots[i] / geo_.page_tokens);
    reserve_pages(max_page + 1);
    const int H = shape_.n_kv_heads, D = shape_.head_dim;
    const int jobs = n * H;
#pragma omp parallel for schedule(dynamic, 4) if (jobs >= 8)
    for (int j = 0; j < jobs; ++j) {
      const int t = j / H, h = j % H;
      const size_t off = (size_t(t) * H + h) * D;
      const size_t row = geo_.slot_row(slots[t], h);
      encode_row(k_, h, row, k + off);
      encode_row(v_, h, row, v + off);
      if (window_pages_ > 0)
        for (int d = 0; d < D; ++d) {
          exact_row(exact_k_, row)[d] = f32_to_bf16(sanitize_value(k[off + d]));  // as the blocks' encode
          exact_row(exact_v_, row)[d] = f32_to_bf16(sanitize_value(v[off + d]));
        }
    }
    for (int i = 0; i < n; ++i) written_[size_t(slots[i])] = 1;
  }

  void attend_runs(const QueryRun* runs, int n_runs, const float* q, int n_heads, float scale,
                   float* out) const override {
    const int H = shape_.n_kv_heads, D = shape_.head_dim;
    KVQ_CHECK(n_heads > 0 && n_heads % H == 0, Errc::invalid_argument, "attention: ", n_heads,
              " query heads is not a multiple of ", H, " KV heads");
    for (int r = 0; r < n_runs; ++r) check_run(runs[r]);
    const int group = n_heads / H;
    // One job per (run, KV head, chunk of up to kQueryChunk query tokens): all
    // the queries of the job (its tokens x the GQA group) share each decoded
    // row, so a prefill chunk decodes the store once, not once per token.
    // Rows past a query's causal limit get probability 0.
    constexpr int kQueryChunk = 32;
    struct Job {
      int run, head, t0, t1;
    };
    std::vector<Job> jobs;
    size_t work = 0;
    for (int r = 0; r < n_runs; ++r)
      for (int t0 = 0; t0 < runs[r].n; t0 += kQueryChunk) {
        for (int h = 0; h < H; ++h) jobs.push_back({r, h, t0, std::min(runs[r].n, t0 + kQueryChunk)});
        work += size_t(std::min(runs[r].n - t0, kQueryChunk)) * n_heads * size_t(runs[r].pos + runs[r].n);
      }
    const int n_jobs = int(jobs.size());
#pragma omp parallel if (n_jobs >= 2 && work >= 4096)
    {
      std::vector<float> q_rot(D), one, qstates, scores, acc, packed_p;
      std::vector<uint8_t> kc, ksd, vc, vsd;  // a sequence's rows gathered through its block table
      std::vector<uint8_t> ek, ev, no_side;   // its exact rows (window)
#pragma omp for schedule(dynamic, 1)
      for (int j = 0; j < n_jobs; ++j) {
        const Job& job = jobs[size_t(j)];
        const QueryRun& run = runs[job.run];
        const int h = job.head, t0 = job.t0, t1 = job.t1;
        const int nq = (t1 - t0) * group;
        const int T = run.pos + t1;  // rows any query of the job may see
        const Block& kb = *k_.blocks[size_t(h)];
        const Block& vb = *v_.blocks[size_t(h)];
        gather(k_, run.pages, h, T, kc, ksd);
        gather(v_, run.pages, h, T, vc, vsd);
        if (window_pages_ > 0) {
          gather(exact_k_, run.pages, h, T, ek, no_side);
          gather(exact_v_, run.pages, h, T, ev, no_side);
        }
        // rotate each query once, build its state; query index qi = (t - t0) * group + g
        size_t qs = 0;
        for (int qi = 0; qi < nq; ++qi) {
          const int t = run.first + t0 + qi / group, g = qi % group;
          const float* qv = q + (size_t(t) * n_heads + size_t(h) * group + g) * D;
          kb.rotate(qv, q_rot.data());
          kb.prepare_query(q_rot.data(), one);
          if (qi == 0) {
            qs = one.size();
            qstates.resize(qs * nq);
          }
          std::copy(one.begin(), one.end(), qstates.begin() + ptrdiff_t(qs * qi));
        }
        scores.resize(size_t(nq) * T);
        kb.dot_rows(qstates.data(), qs, nq, kc.data(), k_.code_bytes, ksd.data(), k_.side_bytes, T, scores.data());
        for (int qi = 0; qi < nq; ++qi) {
          const int visible = run.pos + t0 + qi / group + 1;  // causal: rows [0, pos + t]
          float* sc = &scores[size_t(qi) * T];
          if (window_pages_ > 0) {  // the window's scores from the exact rows
            const int t = run.first + t0 + qi / group, g = qi % group;
            const float* qv = q + (size_t(t) * n_heads + size_t(h) * group + g) * D;
            for (int i = exact_window_start(visible - 1, window_pages_); i < visible; ++i) {
              float s = 0.0f;
              const uint16_t* kr = exact_row(ek, i);
              for (int d = 0; d < D; ++d) s += qv[d] * bf16_to_f32(kr[d]);
              sc[i] = s;
            }
          }
          float m = -std::numeric_limits<float>::infinity();
          for (int i = 0; i < visible; ++i) m = std::max(m, sc[i] *= scale);
          double l = 0;
          for (int i = 0; i < visible; ++i) l += (sc[i] = std::exp(sc[i] - m));
          const float inv_l = float(1.0 / l);
          for (int i = 0; i < visible; ++i) sc[i] *= inv_l;
          std::fill(sc + visible, sc + T, 0.0f);
        }
        const float* p = scores.data();
        if (window_pages_ > 0) {  // the packed rows' probabilities only
          packed_p = scores;
          for (int qi = 0; qi < nq; ++qi) {
            const int visible = run.pos + t0 + qi / group + 1;
            const int w0 = exact_window_start(visible - 1, window_pages_);
            std::fill(packed_p.begin() + ptrdiff_t(size_t(qi) * T + w0), packed_p.begin() + ptrdiff_t(size_t(qi) * T + visible),
                      0.0f);
          }
          p = packed_p.data();
        }
        acc.assign(size_t(nq) * D, 0.0f);
        vb.accumulate_rows(p, size_t(T), nq, vc.data(), v_.code_bytes, vsd.data(), v_.side_bytes, T, acc.data());
        for (int qi = 0; qi < nq; ++qi) {
          const int t = run.first + t0 + qi / group, g = qi % group;
          float* o = out + (size_t(t) * n_heads + size_t(h) * group + g) * D;
          vb.unrotate(&acc[size_t(qi) * D], o);
          if (window_pages_ > 0) {
            const int visible = run.pos + t0 + qi / group + 1;
            const float* sc = &scores[size_t(qi) * T];
            for (int i = exact_window_start(visible - 1, window_pages_); i < visible; ++i) {
              const uint16_t* vr = exact_row(ev, i);
              for (int d = 0; d < D; ++d) o[d] += sc[i] * bf16_to_f32(vr[d]);
            }
          }
        }
      }
    }
  }

  // CpuCache::copy_pages for this layer (checked there).
  void copy_pages(const int32_t* src, const int32_t* dst, int n) {
    int max_page = -1;
    for (int i = 0; i < n; ++i) max_page = std::max({max_page, src[i], dst[i]});
    reserve_pages(max_page + 1);
    const size_t rows = geo_.rows_per_page();
    for (int i = 0; i < n; ++i) {
      const size_t from = geo_.row(src[i], 0, 0), to = geo_.row(dst[i], 0, 0);
      for (SideStore* s : {&k_, &v_, &exact_k_, &exact_v_}) {
        std::copy_n(s->codes.begin() + ptrdiff_t(from * s->code_bytes), rows * s->code_bytes,
                    s->codes.begin() + ptrdiff_t(to * s->code_bytes));
        std::copy_n(s->sides.begin() + ptrdiff_t(from * s->side_bytes), rows * s->side_bytes,
                    s->sides.begin() + ptrdiff_t(to * s->side_bytes));
      }
      const size_t P = size_t(geo_.page_tokens);
      std::copy_n(written_.begin() + ptrdiff_t(size_t(src[i]) * P), P, written_.begin() + ptrdiff_t(size_t(dst[i]) * P));
    }
  }
  void read_row(int32_t slot, int head, bool v_side, uint8_t* code, uint8_t* side) const override {
    KVQ_CHECK(slot >= 0 && slot < shape_.max_tokens && head >= 0 && head < shape_.n_kv_heads, Errc::out_of_range,
              "read_row: slot ", slot, ", head ", head);
    KVQ_CHECK(written_[size_t(slot)], Errc::invalid_argument, "read_row: slot ", slot, " was never written");
    const SideStore& s = v_side ? v_ : k_;
    const size_t row = geo_.slot_row(slot, head);
    std::memcpy(code, s.codes.data() + row * s.code_bytes, s.code_bytes);
    if (s.side_bytes) std::memcpy(side, s.sides.data() + row * s.side_bytes, s.side_bytes);
  }

 protected:
  int store_page_tokens() const override { return geo_.page_tokens; }

 private:
  void check_run(const QueryRun& run) const {
    const int P = geo_.page_tokens;
    KVQ_CHECK(run.pos >= 0 && run.n >= 0 && run.first >= 0, Errc::invalid_argument, "attention run at position ",
              run.pos, " with ", run.n, " queries");
    const int T = run.pos + run.n;
    KVQ_CHECK(pages_for(T, P) <= run.n_pages, Errc::invalid_argument, "attention over ", T,
              " tokens through a block table of ", run.n_pages, " pages of ", P);
    for (int t = 0; t < T; ++t) {
      const int32_t page = run.pages[t / P];
      KVQ_CHECK(page >= 0 && page < shape_.n_pages(), Errc::out_of_range, "block table names KV page ", page,
                " of a store of ", shape_.n_pages());
      KVQ_CHECK(written_[size_t(geo_.slot_of(run.pages, t))], Errc::invalid_argument, "attention over tokens [0, ",
                T, ") but token ", t, " was never written (write K/V before attending)");
    }
  }
  // Copies head h's rows of tokens [0, T) of a sequence into one run.
  void gather(const SideStore& s, const int32_t* pages, int h, int T, std::vector<uint8_t>& code,
              std::vector<uint8_t>& side) const {
    const int P = geo_.page_tokens;
    code.resize(size_t(T) * s.code_bytes);
    side.resize(size_t(T) * s.side_bytes);
    for (int t0 = 0; t0 < T; t0 += P) {
      const int rows = std::min(P, T - t0);
      const size_t row = geo_.row(pages[t0 / P], h, 0);
      std::memcpy(code.data() + size_t(t0) * s.code_bytes, s.codes.data() + row * s.code_bytes,
                  size_t(rows) * s.code_bytes);
      if (s.side_bytes)
        std::memcpy(side.data() + size_t(t0) * s.side_bytes, s.sides.data() + row * s.side_bytes,
                    size_t(rows) * s.side_bytes);
    }
  }
  // Row `row` of an exact (bf16) store, or of its gathered run.
  uint16_t* exact_row(SideStore& s, size_t row) const {
    return reinterpret_cast<uint16_t*>(s.codes.data() + row * s.code_bytes);
  }
  const uint16_t* exact_row(const std::vector<uint8_t>& run, int i) const {
    return reinterpret_cast<const uint16_t*>(run.data() + size_t(i) * 2 * shape_.head_dim);
  }
  void encode_row(SideStore& s, int h, size_t row, const float* x) const {
    s.blocks[size_t(h)]->encode(x, s.codes.data() + row * s.code_bytes, s.sides.data() + row * s.side_bytes);
  }
  // Grows the arrays to hold pages [0, pages) (memory follows the pages used).
  void reserve_pages(int pages) {
    if (pages <= pages_held_) return;
    pages_held_ = std::min(shape_.n_pages(), std::max(pages, pages_held_ * 2));
    const size_t rows = size_t(pages_held_) * geo_.rows_per_page();
    for (SideStore* s : {&k_, &v_, &exact_k_, &exact_v_}) {
      s->codes.resize(rows * s->code_bytes);
      s->sides.resize(rows * s->side_bytes);
    }
  }

  CacheShape shape_;
  PageGeometry geo_;
  SideStore k_, v_;
  std::vector<uint8_t> written_;  // per slot: 1 once a row was written there
  int pages_held_ = 0;
  int window_pages_ = 0;
  SideStore exact_k_, exact_v_;  // bf16 rows by row index, filled when window_pages_ > 0
};

class CpuCache final : public Cache {
 public:
  CpuCache(const CodecOptions& opts, const CacheShape& shape)
      : shape_(shape), codec_(resolve_codec(opts)), window_pages_(opts.exact_window_pages) {
    KVQ_CHECK(window_pages_ >= 0, Errc::invalid_argument, "the exact window is ", window_pages_,
              " pages (0: none, else >= 1)");
    KVQ_CHECK(shape.n_layers > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0 && shape.max_tokens > 0 &&
                  shape.page_tokens > 0,
              Errc::invalid_argument, "KV cache shape must be positive (layers ", shape.n_layers, ", kv heads ",
              shape.n_kv_heads, ", head_dim ", shape.head_dim, ", max tokens ", shape.max_tokens, ", page ",
              shape.page_tokens, ")");
    for (int l = 0; l < shape.n_layers; ++l)
      layers_.push_back(std::make_unique<CpuLayerCache>(codec_, shape, opts.seed, l, window_pages_));
  }
  const CacheShape& shape() const override { return shape_; }
  std::string codec_name() const override {
    return codec_.name + exact_window_suffix(window_pages_);
  }
  LayerCache& layer(int i) override {
    KVQ_CHECK(i >= 0 && i < shape_.n_layers, Errc::out_of_range, "KV layer ", i, " out of range [0, ",
              shape_.n_layers, ")");
    return *layers_[size_t(i)];
  }
  void copy_pages(const int32_t* src, const int32_t* dst, int n) override {
    check_page_copy(src, dst, n, shape_.n_pages());
    for (auto& l : layers_) l->copy_pages(src, dst, n);
  }
  uint64_t bytes_for_tokens(int n_tokens) const override {
    // With a window, the bf16 rows this store keeps for every token (K and V).
    const uint64_t exact = window_pages_ > 0 ? uint64_t(4) * shape_.head_dim : 0;
    return uint64_t(n_tokens) * shape_.n_layers * shape_.n_kv_heads *
           (codec_bytes_per_token_per_head(codec_, shape_.head_dim) + exact);
  }

 private:
  CacheShape shape_;
  ResolvedCodec codec_;
  int window_pages_ = 0;
  std::vector<std::unique_ptr<CpuLayerCache>> layers_;
};

}  // namespace

std::unique_ptr<Cache> make_cpu_cache(const CodecOptions& opts, const CacheShape& shape) {
  return std::make_unique<CpuCache>(opts, shape);
}

}  // namespace kvq::kv
