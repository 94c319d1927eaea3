// Helpers shared by the KV-cache tests: Gaussian rows and a plain fp64
// causal GQA attention over explicit K/V rows, the reference the packed-store
// attention is compared with.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/rng.hpp"

namespace kvq::test {

inline std::vector<float> gaussian(Rng& rng, size_t n, float sigma = 1.0f) {
  std::vector<float> v(n);
  for (auto& x : v) x = float(rng.normal()) * sigma;
  return v;
}

// Causal GQA attention in fp64 over K/V rows laid out [T][H][D]; query token
// t (position pos + t) sees rows 0 .. pos + t. q: [n][n_heads][D].
inline void naive_attention(const std::vector<float>& k, const std::vector<float>& v, int H, int D, int pos, int n,
                            const float* q, int n_heads, float scale, std::vector<double>& out) {
  const int group = n_heads / H;
  out.assign(size_t(n) * n_heads * D, 0.0);
  for (int t = 0; t < n; ++t)
    for (int hq = 0; hq < n_heads; ++hq) {
      const int h = hq / group, T = pos + t + 1;
      const float* qv = q + (size_t(t) * n_heads + hq) * D;
      std::vector<double> s(T);
      double m = -1e300;
      for (int j = 0; j < T; ++j) {
        double d = 0;
        for (int i = 0; i < D; ++i) d += double(qv[i]) * k[(size_t(j) * H + h) * D + i];
        s[j] = d * scale;
        m = std::max(m, s[j]);
      }
      double l = 0;
      for (auto& x : s) l += (x = std::exp(x - m));
      for (int j = 0; j < T; ++j)
        for (int i = 0; i < D; ++i)
          out[(size_t(t) * n_heads + hq) * D + i] += s[j] / l * v[(size_t(j) * H + h) * D + i];
    }
}

}  // namespace kvq::test
