#include "kv/quality.hpp"

#include <cmath>

#include "core/rng.hpp"

namespace kvq::kv {

std::vector<float> fixture_rows(Fixture f, int d, int n_rows, uint64_t seed) {
  std::vector<float> rows(size_t(n_rows) * d);
  Rng rng(seed);
  for (auto& x : rows) x = float(rng.normal());
  if (f == Fixture::outliers) {
    const int n_out = std::max(1, d / 32);
    for (int r = 0; r < n_rows; ++r)
      for (int j = 0; j < n_out; ++j) rows[size_t(r) * d + size_t((j * 37 + 3) % d)] *= 20.0f;
  }
  return rows;
}

double measure_sqnr_db(const BlockSpec& b, int d, Fixture f, int n_rows, uint64_t seed) {
  auto block = make_block(b, d, seed, 0, 0, Side::k);
  const auto rows = fixture_rows(f, d, n_rows, seed);
  std::vector<uint8_t> code(block->layout().code_bytes), side(block->layout().side_bytes + 1);
  std::vector<float> y(static_cast<size_t>(d));
  double sig = 0, err = 0;
  for (int r = 0; r < n_rows; ++r) {
    const float* x = &rows[size_t(r) * d];
    block->encode(x, code.data(), side.data());
    block->decode(code.data(), side.data(), y.data());
    for (int i = 0; i < d; ++i) {
      sig += double(x[i]) * x[i];
      err += (double(x[i]) - y[size_t(i)]) * (double(x[i]) - y[size_t(i)]);
    }
  }
  return 10.0 * std::log10(sig / err);
}

}  // namespace kvq::kv
