#include "kv/tcq.hpp"

#include <bit>
#include <cmath>
#include <limits>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "kv/codebook.hpp"

namespace kvq::kv {

int TcqTrellis::subset(uint32_t w) const {
  return 2 * (std::popcount(w & g1) & 1) + (std::popcount(w & g0) & 1);
}

double tcq_encode(const TcqTrellis& t, const float* x, int n, uint8_t* branch, uint8_t* level) {
  const int S = t.states(), k = t.memory, per_subset = 1 << (t.bits - 1);
  const uint32_t wmask = (2u << k) - 1u;
  thread_local std::vector<uint8_t> back;   // [n][S]: the dropped oldest bit of the best predecessor
  thread_local std::vector<uint8_t> best_m;  // [n][4]: best level of each subset at position i
  thread_local std::vector<float> cur, nxt;
  thread_local std::vector<int8_t> sub;
  back.resize(size_t(n) * S);
  best_m.resize(size_t(n) * 4);
  cur.assign(size_t(S), std::numeric_limits<float>::infinity());
  nxt.resize(size_t(S));
  sub.resize(size_t(wmask) + 1);
  for (uint32_t w = 0; w <= wmask; ++w) sub[w] = int8_t(t.subset(w));
  cur[0] = 0;
  for (int i = 0; i < n; ++i) {
    float err[4];
    for (int j = 0; j < 4; ++j) {
      float be = std::numeric_limits<float>::infinity();
      int bm = 0;
      for (int m = 0; m < per_subset; ++m) {
        const float d = x[i] - t.levels[size_t(4 * m + j)];
        if (d * d < be) be = d * d, bm = m;
      }
      err[j] = be;
      best_m[size_t(i) * 4 + j] = uint8_t(bm);
    }
    uint8_t* bp = &back[size_t(i) * S];
    for (int s2 = 0; s2 < S; ++s2) {
      // predecessors: s = (s2 >> 1) | h << (k-1); window w = s2 | h << k
      const uint32_t w0 = uint32_t(s2), w1 = uint32_t(s2) | (1u << k);
      const int p0 = s2 >> 1, p1 = p0 | (S >> 1);
      const float c0 = cur[size_t(p0)] + err[sub[w0]];
      const float c1 = cur[size_t(p1)] + err[sub[w1]];
      if (c1 < c0) nxt[size_t(s2)] = c1, bp[s2] = 1;
      else nxt[size_t(s2)] = c0, bp[s2] = 0;
    }
    std::swap(cur, nxt);
  }
  int s = 0;
  for (int s2 = 1; s2 < S; ++s2)
    if (cur[size_t(s2)] < cur[size_t(s)]) s = s2;
  const double total = cur[size_t(s)];
  for (int i = n - 1; i >= 0; --i) {
    const int h = back[size_t(i) * S + s];
    const uint32_t w = uint32_t(s) | (uint32_t(h) << k);
    branch[i] = uint8_t(s & 1);
    level[i] = best_m[size_t(i) * 4 + sub[w]];
    s = (s >> 1) | (h << (k - 1));
  }
  return total;
}

void tcq_decode(const TcqTrellis& t, const uint8_t* branch, const uint8_t* level, int n, float* out) {
  const uint32_t wmask = (2u << t.memory) - 1u;
  uint32_t w = 0;
  for (int i = 0; i < n; ++i) {
    w = ((w << 1) | branch[i]) & wmask;
    out[i] = tcq_value(t, w, level[i]);
  }
}

double TcqDesignResult::sqnr_db() const { return -10.0 * std::log10(mse); }

TcqTrellis tcq_initial(int bits, int memory, uint32_t g0, uint32_t g1) {
  TcqTrellis t;
  t.bits = bits;
  t.memory = memory;
  t.g0 = g0;
  t.g1 = g1;
  for (double c : lloyd_max_gaussian(bits + 1).centroids) t.levels.push_back(float(c));  // ascending: subset = index mod 4
  return t;
}

TcqDesignResult design_tcq(TcqTrellis t, int n_rows, int row_len, int iterations, uint64_t seed) {
  std::vector<float> data(size_t(n_rows) * row_len);
  Rng rng(seed);
  for (auto& v : data) v = float(rng.normal());
  std::vector<uint8_t> br(static_cast<size_t>(row_len)), lv(static_cast<size_t>(row_len));
  TcqDesignResult res;
  const size_t L = t.levels.size();
  for (int it = 0; it <= iterations; ++it) {
    std::vector<double> sum(L, 0.0), cnt(L, 0.0);
    double err = 0;
    for (int r = 0; r < n_rows; ++r) {
      const float* x = &data[size_t(r) * row_len];
      err += tcq_encode(t, x, row_len, br.data(), lv.data());
      uint32_t w = 0;
      const uint32_t wmask = (2u << t.memory) - 1u;
      for (int i = 0; i < row_len; ++i) {
        w = ((w << 1) | br[size_t(i)]) & wmask;
        const size_t u = size_t(4 * lv[size_t(i)] + t.subset(w));
        sum[u] += x[i];
        cnt[u] += 1;
      }
    }
    res.mse = err / (double(n_rows) * row_len);
    if (it == iterations) break;
    for (size_t u = 0; u < L; ++u)
      if (cnt[u] > 0) t.levels[u] = float(sum[u] / cnt[u]);
  }
  res.trellis = t;
  return res;
}

// The tabulated trellises: 32 states (memory 5: one warp lane per state for a
// GPU Viterbi), generators chosen by an exhaustive search over Ungerboeck-style
// taps (g0 without bits 0 and 5, g1 with both: the two branches leaving or
// entering a state use the two subsets of one family), union codebook from
// design_tcq(tcq_initial(N, 5, g0, g1), 4000 rows x 128, 25 iterations,
// seed 0x7463712d64657369). Training SQNR: 10.758 dB (N=2), 16.365 dB (N=3);
// on fresh rows 10.761 / 16.387 dB (Lloyd-Max: 9.300 / 14.616 dB).
// Regenerate with `kvq codecs --design-tcq`.
// Both tables tap the oldest window bit (bit 5) in g1 and not in g0, so the
// two branches into a state use subsets j and j ^ 2 (one family); the GPU
// encoder's error exchange (kv_codec_hooks.cuh, EncodeHooks<tcq>) relies on it.
static_assert((0x3b & 0x20) && !(0x0a & 0x20) && (0x3d & 0x20) && !(0x12 & 0x20));
static TcqTrellis rounded(TcqTrellis t) {
  for (auto& l : t.levels) l = round_to_f16(l);
  return t;
}

const TcqTrellis& tcq_trellis(int bits) {
  KVQ_CHECK(bits == 2 || bits == 3, Errc::invalid_argument, "tcq blocks exist for 2 and 3 bits, not ", bits);
  static const TcqTrellis t2{2, 5, 0xa, 0x3b,
                             {-1.86840379f, -1.06435275f, -0.587393045f, -0.185682312f, 0.189680099f,
                              0.583408475f, 1.06712973f, 1.87039328f}};
  static const TcqTrellis t3{3, 5, 0x12, 0x3d,
                             {-2.52789521f, -1.83483982f, -1.38564742f, -1.05456936f, -0.785395205f,
                              -0.546914399f, -0.321961612f, -0.109508075f, 0.100305066f, 0.318424374f,
                              0.539596856f, 0.78507489f, 1.05668175f, 1.39416564f, 1.84653163f,
                              2.54352641f}};
  // The blocks use the levels rounded to fp16 (as the Lloyd-Max codebooks,
  // kv/codebook.hpp): the tensor cores read them exactly.
  static const TcqTrellis r2 = rounded(t2), r3 = rounded(t3);
  return bits == 2 ? r2 : r3;
}

TcqDesignResult design_tcq_default(int bits) {
  const uint32_t g0 = bits == 2 ? 0xa : 0x12, g1 = bits == 2 ? 0x3b : 0x3d;
  return design_tcq(tcq_initial(bits, 5, g0, g1), 4000, 128, 25, 0x7463712d64657369ull);
}

}  // namespace kvq::kv
