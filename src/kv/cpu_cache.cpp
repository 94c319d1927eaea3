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
// Exact rows (bf16), two forms:
//  - the serving window (CacheShape::window_pages / exact_pages): a second
//    store of exact_pages pages of bf16 rows (exact_k / exact_v, rows by
//    PageGeometry::row(page - n_pages, head, entry)); a sequence's table
//    ends in its exact pages, and its tokens in them are read from there.
//    pack_pages encodes an exact page's rows into a packed page. Such a
//    store encodes the bf16 values of K and V on every path (write_slots
//    into a packed page too), so a row's codes are the same whether it was
//    written packed or packed when it left a window.
//  - the evaluation form (CodecOptions::exact_window_pages = W > 0): every
//    row is kept as bf16 too (exact_k / exact_v by the packed row index), and
//    a query at position p reads tokens [exact_window_start(p, W), p] from
//    them.
// Either way a query's exact tokens are a suffix [w0, p] of what it sees:
// scored from the bf16 rows (<q, k> in the original basis, equal to <R q,
// R k>), the older ones from the packed rows, one softmax over both; the
// packed rows' probabilities are accumulated in the rotated basis and
// un-rotated, the exact rows' added to the output in the original basis.
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

void Cache::pack_pages(const int32_t*, const int32_t*, int) {
  fail(Errc::unsupported, "this KV store has no exact window to pack pages from");
}

uint64_t Cache::capacity_bytes() const {
  return bytes_for_tokens(shape().max_tokens) + uint64_t(shape().exact_pages) * exact_page_bytes();
}

uint64_t Cache::bytes_for_sequence(int n_tokens) const {
  const CacheShape& s = shape();
  if (s.window_pages <= 0 || n_tokens <= 0) return bytes_for_tokens(n_tokens);
  const int first = window_first_page(n_tokens, s.page_tokens, s.window_pages);
  const int exact = pages_for(n_tokens, s.page_tokens) - first;
  return bytes_for_tokens(first * s.page_tokens) + uint64_t(exact) * exact_page_bytes();
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

constexpr int kMaxHeadDim = 512;  // a row staged on the stack (bf16 rounding before an encode)

struct SideStore {
  std::vector<std::unique_ptr<Block>> blocks;  // per KV head
  std::vector<uint8_t> codes;  // rows x code_bytes, rows by PageGeometry::row
  std::vector<uint8_t> sides;  // rows x side_bytes
  size_t code_bytes = 0, side_bytes = 0;
};

class CpuLayerCache final : public LayerCache {
 public:
  CpuLayerCache(const ResolvedCodec& codec, const CacheShape& shape, uint64_t seed, int layer, int eval_window)
      : shape_(shape),
        geo_(shape.geometry()),
        written_(size_t(shape.total_pages()) * shape.page_tokens, 0),
        eval_window_(eval_window),
        packed_pages_(shape.n_pages()) {
    // The exact rows: a store of bf16 rows (2 D bytes, no side array); empty
    // without a window.
    if (eval_window > 0 || shape.exact_pages > 0) exact_k_.code_bytes = exact_v_.code_bytes = 2 * size_t(shape.head_dim);
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
    // Packed slots [0, max_tokens), then the exact pages' slots.
    const int32_t exact_slots = int32_t(size_t(packed_pages_) * geo_.page_tokens);
    for (int i = 0; i < n; ++i)
      KVQ_CHECK(slots[i] >= 0 && (slots[i] < shape_.max_tokens ||
                                  (slots[i] >= exact_slots && size_t(slots[i]) < written_.size())),
                Errc::out_of_range, "KV write at slot ", slots[i], " is outside the store of ", shape_.max_tokens,
                " tokens", shape_.exact_pages > 0 ? " and its window pages" : "", " (raise the context size)");
    if (n == 0) return;
    int max_packed = -1, max_exact = -1;
    for (int i = 0; i < n; ++i) {
      const int page = slots[i] / geo_.page_tokens;
      if (page < packed_pages_) max_packed = std::max(max_packed, page);
      else max_exact = std::max(max_exact, page - packed_pages_);
    }
    reserve_packed(max_packed + 1);
    reserve_exact(max_exact + 1);
    const int H = shape_.n_kv_heads, D = shape_.head_dim;
    const int jobs = n * H;
#pragma omp parallel for schedule(dynamic, 4) if (jobs >= 8)
    for (int j = 0; j < jobs; ++j) {
      const int t = j / H, h = j % H;
      const size_t off = (size_t(t) * H + h) * D;
      const int page = slots[t] / geo_.page_tokens, entry = slots[t] % geo_.page_tokens;
      if (page >= packed_pages_) {  // a window page: the bf16 rows only
        const size_t row = geo_.row(page - packed_pages_, h, entry);
        store_exact(row, k + off, v + off);
        continue;
      }
      const size_t row = geo_.row(page, h, entry);
      if (shape_.exact_pages > 0) {
        // A store with a window encodes the bf16 values, as pack_pages does:
        // a row's codes do not depend on whether it was written packed or
        // packed when it left a window (a recompute, a cached prefix).
        float kx[kMaxHeadDim], vx[kMaxHeadDim];
        for (int d = 0; d < D; ++d) {
          kx[d] = bf16_to_f32(f32_to_bf16(sanitize_value(k[off + d])));
          vx[d] = bf16_to_f32(f32_to_bf16(sanitize_value(v[off + d])));
        }
        encode_row(k_, h, row, kx);
        encode_row(v_, h, row, vx);
        continue;
      }
      encode_row(k_, h, row, k + off);
      encode_row(v_, h, row, v + off);
      if (eval_window_ > 0) store_exact(row, k + off, v + off);
    }
    for (int i = 0; i < n; ++i) written_[size_t(slots[i])] = 1;
  }

  void attend_runs(const QueryRun* runs, int n_runs, const float* q, int n_heads, float scale,
                   float* out) const override {
    const int H = shape_.n_kv_heads, D = shape_.head_dim;
    KVQ_CHECK(n_heads > 0 && n_heads % H == 0, Errc::invalid_argument, "attention: ", n_heads,
              " query heads is not a multiple of ", H, " KV heads");
    std::vector<int> packed_tokens(static_cast<size_t>(n_runs));
    for (int r = 0; r < n_runs; ++r) packed_tokens[size_t(r)] = check_run(runs[r]);
    const int group = n_heads / H;
    const bool exact = eval_window_ > 0 || shape_.exact_pages > 0;
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
      std::vector<float> q_rot(D), one, qstates, scores, packed_scores, acc, packed_p;
      std::vector<uint8_t> kc, ksd, vc, vsd;  // a sequence's rows gathered through its block table
      std::vector<uint8_t> ek, ev;            // its exact rows (row i: token i)
#pragma omp for schedule(dynamic, 1)
      for (int j = 0; j < n_jobs; ++j) {
        const Job& job = jobs[size_t(j)];
        const QueryRun& run = runs[job.run];
        const int h = job.head, t0 = job.t0, t1 = job.t1;
        const int nq = (t1 - t0) * group;
        const int T = run.pos + t1;  // rows any query of the job may see
        // Tokens [0, Tp) have packed rows; with the serving window the rest are
        // exact rows only.
        const int Tp = std::min(T, packed_tokens[size_t(job.run)]);
        // The first exact token of a query that sees tokens [0, visible).
        auto exact_from = [&](int visible) {
          return eval_window_ > 0 ? exact_window_start(visible - 1, eval_window_) : std::min(visible, Tp);
        };
        const Block& kb = *k_.blocks[size_t(h)];
        const Block& vb = *v_.blocks[size_t(h)];
        gather(k_, run.pages, h, Tp, kc, ksd);
        gather(v_, run.pages, h, Tp, vc, vsd);
        if (exact) {
          gather_exact(exact_k_, run.pages, h, T, ek);
          gather_exact(exact_v_, run.pages, h, T, ev);
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
        if (Tp == T) {
          kb.dot_rows(qstates.data(), qs, nq, kc.data(), k_.code_bytes, ksd.data(), k_.side_bytes, T, scores.data());
        } else if (Tp > 0) {  // scores of the packed rows, [nq][Tp], into rows of T
          packed_scores.resize(size_t(nq) * Tp);
          kb.dot_rows(qstates.data(), qs, nq, kc.data(), k_.code_bytes, ksd.data(), k_.side_bytes, Tp,
                      packed_scores.data());
          for (int qi = 0; qi < nq; ++qi)
            std::copy_n(&packed_scores[size_t(qi) * Tp], Tp, &scores[size_t(qi) * T]);
        }
        for (int qi = 0; qi < nq; ++qi) {
          const int visible = run.pos + t0 + qi / group + 1;  // causal: rows [0, pos + t]
          float* sc = &scores[size_t(qi) * T];
          if (exact) {  // the window's scores from the exact rows
            const int t = run.first + t0 + qi / group, g = qi % group;
            const float* qv = q + (size_t(t) * n_heads + size_t(h) * group + g) * D;
            for (int i = exact_from(visible); i < visible; ++i) {
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
        if (exact) {  // the packed rows' probabilities only
          packed_p = scores;
          for (int qi = 0; qi < nq; ++qi) {
            const int visible = run.pos + t0 + qi / group + 1;
            const int w0 = exact_from(visible);
            std::fill(packed_p.begin() + ptrdiff_t(size_t(qi) * T + w0), packed_p.begin() + ptrdiff_t(size_t(qi) * T + visible),
                      0.0f);
          }
          p = packed_p.data();
        }
        acc.assign(size_t(nq) * D, 0.0f);
        if (Tp > 0)
          vb.accumulate_rows(p, size_t(T), nq, vc.data(), v_.code_bytes, vsd.data(), v_.side_bytes, Tp, acc.data());
        for (int qi = 0; qi < nq; ++qi) {
          const int t = run.first + t0 + qi / group, g = qi % group;
          float* o = out + (size_t(t) * n_heads + size_t(h) * group + g) * D;
          vb.unrotate(&acc[size_t(qi) * D], o);
          if (exact) {
            const int visible = run.pos + t0 + qi / group + 1;
            const float* sc = &scores[size_t(qi) * T];
            for (int i = exact_from(visible); i < visible; ++i) {
              const uint16_t* vr = exact_row(ev, i);
              for (int d = 0; d < D; ++d) o[d] += sc[i] * bf16_to_f32(vr[d]);
            }
          }
        }
      }
    }
  }

  // CpuCache::copy_pages for this layer (checked there: both pages of a pair
  // in the same store).
  void copy_pages(const int32_t* src, const int32_t* dst, int n) {
    int max_packed = -1, max_exact = -1;
    for (int i = 0; i < n; ++i) {
      if (src[i] < packed_pages_) max_packed = std::max({max_packed, src[i], dst[i]});
      else max_exact = std::max({max_exact, src[i] - packed_pages_, dst[i] - packed_pages_});
    }
    reserve_packed(max_packed + 1);
    reserve_exact(max_exact + 1);
    const size_t rows = geo_.rows_per_page();
    for (int i = 0; i < n; ++i) {
      const bool in_exact = src[i] >= packed_pages_;
      const int base = in_exact ? packed_pages_ : 0;
      const size_t from = geo_.row(src[i] - base, 0, 0), to = geo_.row(dst[i] - base, 0, 0);
      std::vector<SideStore*> stores;
      if (in_exact) stores = {&exact_k_, &exact_v_};
      else if (eval_window_ > 0) stores = {&k_, &v_, &exact_k_, &exact_v_};
      else stores = {&k_, &v_};
      for (SideStore* s : stores) {
        std::copy_n(s->codes.begin() + ptrdiff_t(from * s->code_bytes), rows * s->code_bytes,
                    s->codes.begin() + ptrdiff_t(to * s->code_bytes));
        std::copy_n(s->sides.begin() + ptrdiff_t(from * s->side_bytes), rows * s->side_bytes,
                    s->sides.begin() + ptrdiff_t(to * s->side_bytes));
      }
      const size_t P = size_t(geo_.page_tokens);
      std::copy_n(written_.begin() + ptrdiff_t(size_t(src[i]) * P), P, written_.begin() + ptrdiff_t(size_t(dst[i]) * P));
    }
  }
  // CpuCache::pack_pages for this layer (checked there).
  void pack_pages(const int32_t* exact, const int32_t* packed, int n) {
    int max_packed = -1;
    for (int i = 0; i < n; ++i) max_packed = std::max(max_packed, packed[i]);
    reserve_packed(max_packed + 1);
    const int H = shape_.n_kv_heads, D = shape_.head_dim, P = geo_.page_tokens;
    std::vector<float> kx(static_cast<size_t>(D)), vx(static_cast<size_t>(D));
    for (int i = 0; i < n; ++i)
      for (int e = 0; e < P; ++e) {
        const size_t from_slot = size_t(exact[i]) * P + e, to_slot = size_t(packed[i]) * P + e;
        written_[to_slot] = written_[from_slot];
        if (!written_[from_slot]) continue;
        written_[from_slot] = 0;
        for (int h = 0; h < H; ++h) {
          const size_t from = geo_.row(exact[i] - packed_pages_, h, e), to = geo_.row(packed[i], h, e);
          const uint16_t* kr = exact_row(exact_k_, from);
          const uint16_t* vr = exact_row(exact_v_, from);
          for (int d = 0; d < D; ++d) {
            kx[size_t(d)] = bf16_to_f32(kr[d]);
            vx[size_t(d)] = bf16_to_f32(vr[d]);
          }
          encode_row(k_, h, to, kx.data());
          encode_row(v_, h, to, vx.data());
        }
      }
  }
  void read_row(int32_t slot, int head, bool v_side, uint8_t* code, uint8_t* side) const override {
    KVQ_CHECK(slot >= 0 && size_t(slot) < written_.size() && head >= 0 && head < shape_.n_kv_heads,
              Errc::out_of_range, "read_row: slot ", slot, ", head ", head);
    KVQ_CHECK(written_[size_t(slot)], Errc::invalid_argument, "read_row: slot ", slot, " was never written");
    const int page = slot / geo_.page_tokens;
    if (page >= packed_pages_) {  // an exact row: D bf16 values, no side bytes
      const SideStore& s = v_side ? exact_v_ : exact_k_;
      const size_t row = geo_.row(page - packed_pages_, head, slot % geo_.page_tokens);
      std::memcpy(code, s.codes.data() + row * s.code_bytes, s.code_bytes);
      return;
    }
    const SideStore& s = v_side ? v_ : k_;
    const size_t row = geo_.slot_row(slot, head);
    std::memcpy(code, s.codes.data() + row * s.code_bytes, s.code_bytes);
    if (s.side_bytes) std::memcpy(side, s.sides.data() + row * s.side_bytes, s.side_bytes);
  }

 protected:
  int store_page_tokens() const override { return geo_.page_tokens; }

 private:
  // Checks a run's block table and rows; returns how many of its first
  // tokens have packed rows (the rest are in exact pages, which end a table).
  int check_run(const QueryRun& run) const {
    const int P = geo_.page_tokens;
    KVQ_CHECK(run.pos >= 0 && run.n >= 0 && run.first >= 0, Errc::invalid_argument, "attention run at position ",
              run.pos, " with ", run.n, " queries");
    const int T = run.pos + run.n;
    KVQ_CHECK(pages_for(T, P) <= run.n_pages, Errc::invalid_argument, "attention over ", T,
              " tokens through a block table of ", run.n_pages, " pages of ", P);
    int packed = T;
    for (int t = 0; t < T; ++t) {
      const int32_t page = run.pages[t / P];
      KVQ_CHECK(page >= 0 && page < shape_.total_pages(), Errc::out_of_range, "block table names KV page ", page,
                " of a store of ", shape_.total_pages());
      if (page >= packed_pages_) packed = std::min(packed, t);
      KVQ_CHECK(page >= packed_pages_ || packed == T, Errc::invalid_argument, "block table entry ", t / P,
                " is a packed page after an exact (window) page: a window ends the table");
      KVQ_CHECK(written_[size_t(geo_.slot_of(run.pages, t))], Errc::invalid_argument, "attention over tokens [0, ",
                T, ") but token ", t, " was never written (write K/V before attending)");
    }
    return packed;
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
  // The exact rows of head h of tokens [0, T) into run row t (tokens without
  // exact rows, packed ones under the serving window, are left as they are).
  void gather_exact(const SideStore& s, const int32_t* pages, int h, int T, std::vector<uint8_t>& run) const {
    const int P = geo_.page_tokens;
    run.resize(size_t(T) * s.code_bytes);
    for (int t0 = 0; t0 < T; t0 += P) {
      int page = pages[t0 / P];
      if (eval_window_ == 0) {
        if (page < packed_pages_) continue;
        page -= packed_pages_;
      }
      const size_t row = geo_.row(page, h, 0);
      std::memcpy(run.data() + size_t(t0) * s.code_bytes, s.codes.data() + row * s.code_bytes,
                  size_t(std::min(P, T - t0)) * s.code_bytes);
    }
  }
  // Row `row` of an exact (bf16) store, or of its gathered run.
  uint16_t* exact_row(SideStore& s, size_t row) const {
    return reinterpret_cast<uint16_t*>(s.codes.data() + row * s.code_bytes);
  }
  const uint16_t* exact_row(const SideStore& s, size_t row) const {
    return reinterpret_cast<const uint16_t*>(s.codes.data() + row * s.code_bytes);
  }
  const uint16_t* exact_row(const std::vector<uint8_t>& run, int i) const {
    return reinterpret_cast<const uint16_t*>(run.data() + size_t(i) * 2 * shape_.head_dim);
  }
  void store_exact(size_t row, const float* k, const float* v) {
    uint16_t* kr = exact_row(exact_k_, row);
    uint16_t* vr = exact_row(exact_v_, row);
    for (int d = 0; d < shape_.head_dim; ++d) {
      kr[d] = f32_to_bf16(sanitize_value(k[d]));  // as the blocks' encode
      vr[d] = f32_to_bf16(sanitize_value(v[d]));
    }
  }
  void encode_row(SideStore& s, int h, size_t row, const float* x) const {
    s.blocks[size_t(h)]->encode(x, s.codes.data() + row * s.code_bytes, s.sides.data() + row * s.side_bytes);
  }
  // Grows the arrays to hold packed pages [0, pages) (memory follows the
  // pages used; the evaluation form's exact rows follow the packed ones).
  void reserve_packed(int pages) {
    if (pages <= packed_held_) return;
    packed_held_ = std::min(packed_pages_, std::max(pages, packed_held_ * 2));
    const size_t rows = size_t(packed_held_) * geo_.rows_per_page();
    for (SideStore* s : {&k_, &v_}) {
      s->codes.resize(rows * s->code_bytes);
      s->sides.resize(rows * s->side_bytes);
    }
    if (eval_window_ > 0)
      for (SideStore* s : {&exact_k_, &exact_v_}) s->codes.resize(rows * s->code_bytes);
  }
  // The same for exact pages [0, pages) of the serving window's store.
  void reserve_exact(int pages) {
    if (pages <= exact_held_) return;
    exact_held_ = std::min(shape_.exact_pages, std::max(pages, exact_held_ * 2));
    for (SideStore* s : {&exact_k_, &exact_v_}) s->codes.resize(size_t(exact_held_) * geo_.rows_per_page() * s->code_bytes);
  }

  CacheShape shape_;
  PageGeometry geo_;
  SideStore k_, v_;
  std::vector<uint8_t> written_;  // per slot (exact pages' slots after the packed ones): 1 once written
  int eval_window_ = 0;           // CodecOptions::exact_window_pages
  int packed_pages_ = 0;          // shape_.n_pages(): page ids from here on are exact pages
  int packed_held_ = 0, exact_held_ = 0;
  SideStore exact_k_, exact_v_;  // bf16 rows (see the top of this file)
};

class CpuCache final : public Cache {
 public:
  CpuCache(const CodecOptions& opts, const CacheShape& shape)
      : shape_(shape), codec_(resolve_codec(opts)), window_pages_(opts.exact_window_pages) {
    KVQ_CHECK(window_pages_ >= 0 && shape.window_pages >= 0 && shape.exact_pages >= 0, Errc::invalid_argument,
              "the exact window is ", std::max(window_pages_, shape.window_pages), " pages in a pool of ",
              shape.exact_pages, " (0: none, else >= 1)");
    KVQ_CHECK((shape.window_pages > 0) == (shape.exact_pages > 0), Errc::invalid_argument, "an exact window of ",
              shape.window_pages, " pages per sequence needs a pool of exact pages (", shape.exact_pages,
              "), and a pool a window");
    KVQ_CHECK(window_pages_ == 0 || shape.window_pages == 0, Errc::invalid_argument,
              "the evaluation form of the exact window (", window_pages_,
              " pages) and a store with a window pool are exclusive");
    KVQ_CHECK(shape.exact_pages == 0 || shape.head_dim <= kMaxHeadDim, Errc::invalid_argument,
              "an exact window over head_dim ", shape.head_dim, " (at most ", kMaxHeadDim, ")");
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
    return codec_.name + exact_window_suffix(std::max(window_pages_, shape_.window_pages));
  }
  LayerCache& layer(int i) override {
    KVQ_CHECK(i >= 0 && i < shape_.n_layers, Errc::out_of_range, "KV layer ", i, " out of range [0, ",
              shape_.n_layers, ")");
    return *layers_[size_t(i)];
  }
  void copy_pages(const int32_t* src, const int32_t* dst, int n) override {
    check_page_copy(src, dst, n, shape_.total_pages());
    for (int i = 0; i < n; ++i)
      KVQ_CHECK(shape_.is_exact_page(src[i]) == shape_.is_exact_page(dst[i]), Errc::invalid_argument,
                "a copy of KV page ", src[i], " to page ", dst[i],
                " crosses between the packed and the exact store (pack_pages moves rows there)");
    for (auto& l : layers_) l->copy_pages(src, dst, n);
  }
  void pack_pages(const int32_t* exact, const int32_t* packed, int n) override {
    KVQ_CHECK(shape_.exact_pages > 0, Errc::unsupported, "this KV store has no exact window to pack pages from");
    check_page_copy(exact, packed, n, shape_.total_pages());
    for (int i = 0; i < n; ++i)
      KVQ_CHECK(shape_.is_exact_page(exact[i]) && !shape_.is_exact_page(packed[i]), Errc::invalid_argument,
                "pack_pages from page ", exact[i], " to page ", packed[i], ": the first must be an exact page (>= ",
                shape_.n_pages(), "), the second a packed one");
    for (auto& l : layers_) l->pack_pages(exact, packed, n);
  }
  uint64_t bytes_for_tokens(int n_tokens) const override {
    // With the evaluation form of the window, the bf16 rows this store keeps
    // for every token (K and V).
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
