// Measurements shared by the tests and `kvq codecs --sqnr`, so the table in
// docs/codecs.md is exactly what the tests measure.
#pragma once

#include <cstdint>
#include <vector>

#include "kv/block.hpp"

namespace kvq::kv {

enum class Fixture {
  gaussian,  // i.i.d. N(0,1) rows
  outliers,  // N(0,1) rows with D/32 fixed channels scaled 20x (channel j*37+3 mod D)
};

// Rows of the fixture: [n_rows][d], deterministic in seed.
std::vector<float> fixture_rows(Fixture f, int d, int n_rows, uint64_t seed);

// SQNR (dB) = 10 log10(sum ||x||^2 / sum ||x - decode(encode(x))||^2) over the
// fixture rows, one block per (layer 0, kv head 0, side K).
double measure_sqnr_db(const BlockSpec& b, int d, Fixture f, int n_rows, uint64_t seed);

// Defaults used by the test and the docs table.
constexpr int kSqnrRows = 2000;
constexpr uint64_t kSqnrSeed = 0x5351524eull;

}  // namespace kvq::kv
