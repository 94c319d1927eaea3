#include "bench/stats.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.hpp"

namespace kvq::bench {

Spread spread(std::vector<double> v) {
  Spread s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  s.min = v.front();
  s.max = v.back();
  return s;
}

double percentile(std::vector<double> v, double p) {
  KVQ_CHECK(!v.empty(), Errc::internal, "percentile of an empty sample");
  KVQ_CHECK(p >= 0 && p <= 100, Errc::internal, "percentile ", p, " outside [0, 100]");
  std::sort(v.begin(), v.end());
  const size_t rank = size_t(std::ceil(p / 100.0 * double(v.size())));
  return v[rank == 0 ? 0 : rank - 1];
}

LineFit fit_line(const std::vector<double>& x, const std::vector<double>& y) {
  KVQ_CHECK(x.size() == y.size(), Errc::internal, "fit_line: ", x.size(), " x for ", y.size(), " y");
  const size_t n = x.size();
  double mx = 0, my = 0;
  for (size_t i = 0; i < n; ++i) {
    mx += x[i];
    my += y[i];
  }
  KVQ_CHECK(n >= 2, Errc::invalid_argument, "a line fit needs at least two points, got ", n);
  mx /= double(n);
  my /= double(n);
  double sxx = 0, sxy = 0;
  for (size_t i = 0; i < n; ++i) {
    sxx += (x[i] - mx) * (x[i] - mx);
    sxy += (x[i] - mx) * (y[i] - my);
  }
  KVQ_CHECK(sxx > 0, Errc::invalid_argument, "a line fit needs two distinct x values");
  LineFit f;
  f.b = sxy / sxx;
  f.a = my - f.b * mx;
  double ss = 0;
  for (size_t i = 0; i < n; ++i) {
    const double r = y[i] - (f.a + f.b * x[i]);
    ss += r * r;
  }
  f.rms_residual = std::sqrt(ss / double(n));
  return f;
}

ItlFit fit_itl(const std::string& codec, const std::vector<CellResult>& cells) {
  constexpr int kLongContext = 8192;
  std::vector<const CellResult*> all, long_ctx;
  for (const auto& c : cells) {
    if (c.codec != codec || !c.measured()) continue;
    all.push_back(&c);
    if (c.ctx >= kLongContext) long_ctx.push_back(&c);
  }
  auto distinct = [](const std::vector<const CellResult*>& v) {
    for (const auto* c : v)
      if (c->kv_seq != v.front()->kv_seq) return true;
    return false;
  };
  const auto& use = long_ctx.size() >= 2 && distinct(long_ctx) ? long_ctx : all;
  ItlFit f;
  f.codec = codec;
  if (use.size() < 2 || !distinct(use)) return f;
  std::vector<double> x, y;
  f.ctx_min = use.front()->ctx;
  f.ctx_max = use.front()->ctx;
  for (const auto* c : use) {
    x.push_back(c->kv_seq / 1000.0);
    y.push_back(c->itl_p50_ms.median);
    f.ctx_min = std::min(f.ctx_min, c->ctx);
    f.ctx_max = std::max(f.ctx_max, c->ctx);
  }
  const LineFit lf = fit_line(x, y);
  f.a_ms = lf.a;
  f.b_ms_per_1k = lf.b;
  f.residual_ms = lf.rms_residual;
  f.n_points = int(use.size());
  return f;
}

std::string dispatch_summary(const DispatchStats& d) {
  if (!d.counted) return "not counted";
  std::vector<std::pair<std::string, std::vector<int>>> by_kernel;
  for (const auto& k : d.attention) {
    if (!k.decode) continue;
    auto it = std::find_if(by_kernel.begin(), by_kernel.end(), [&](const auto& p) { return p.first == k.kernel; });
    if (it == by_kernel.end()) it = by_kernel.insert(by_kernel.end(), {k.kernel, {}});
    if (std::find(it->second.begin(), it->second.end(), k.layer) == it->second.end()) it->second.push_back(k.layer);
  }
  if (by_kernel.empty()) return "none";
  std::string s;
  for (const auto& [name, layers] : by_kernel) {
    if (!s.empty()) s += ", ";
    s += name + " (" + std::to_string(layers.size()) + (layers.size() == 1 ? " layer)" : " layers)");
  }
  return s;
}

std::string token_digest(const std::vector<int32_t>& tokens) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t t : tokens) {
    const uint32_t u = uint32_t(t);
    for (int b = 0; b < 4; ++b) {
      h ^= (u >> (8 * b)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)h);
  return buf;
}

}  // namespace kvq::bench
