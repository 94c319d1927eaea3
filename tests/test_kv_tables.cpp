// The tables a GPU kernel uploads (Block::tables()) plus the documented row
// layout are enough to decode a row exactly as the CPU does: a decoder written
// here from docs/codecs.md alone, position by position (no sequential scan for
// tcq), must reproduce Block::decode_rotated / decode.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <vector>

#include "core/half.hpp"
#include "core/rng.hpp"
#include "kv/block.hpp"

using namespace kvq;
using namespace kvq::kv;

namespace {

unsigned bits_at(const uint8_t* plane, int i, int b) {  // LSB-first, little-endian
  const uint32_t* w = reinterpret_cast<const uint32_t*>(plane);
  const size_t bit = size_t(i) * b;
  return (w[bit / 32] >> (bit % 32)) & ((1u << b) - 1u);
}
unsigned code_at(const uint8_t* code, int i, int n, int bits) {  // N-bit code split in planes
  if (bits != 3) return bits_at(code, i, bits);
  const size_t lo_bytes = ((size_t(n) * 2 + 7) / 8 + 3) / 4 * 4;
  return bits_at(code, i, 2) | (bits_at(code + lo_bytes, i, 1) << 2);
}
float f16_at(const uint8_t* p) { return f16_to_f32(uint16_t(p[0] | p[1] << 8)); }

struct Row {
  std::vector<uint8_t> code, side;
};
Row encode(const Block& b, const std::vector<float>& x) {
  Row r{std::vector<uint8_t>(b.layout().code_bytes), std::vector<uint8_t>(b.layout().side_bytes + 2)};
  b.encode(x.data(), r.code.data(), r.side.data());
  return r;
}

}  // namespace

TEST(KvTables, TurboAndTcqDecodeFromTablesInParallelForm) {
  const int D = 128;
  Rng rng(5);
  std::vector<float> x(D);
  for (auto& v : x) v = float(rng.normal()) * 3.0f;
  for (const char* name : {"turbo2", "turbo3", "turbo4", "tcq2", "tcq3"}) {
    auto blk = make_block(parse_block(name), D, 42, 3, 1, Side::v);
    const BlockTables t = blk->tables();
    EXPECT_EQ(t.rotation_kind, "hadamard");
    ASSERT_EQ(t.rotation.size(), size_t(D));
    const Row r = encode(*blk, x);
    const float norm = f16_at(r.side.data());
    std::vector<float> ref(D), mine(D);
    blk->decode_rotated(r.code.data(), r.side.data(), ref.data());
    const int N = blk->spec().bits;
    for (int i = 0; i < D; ++i) {
      float c;
      if (blk->spec().family == kv::Family::turbo) {
        c = t.codebook[code_at(r.code.data(), i, D, N)];
      } else {  // window from the branch bits at i-memory .. i, read directly
        uint32_t w = 0;
        for (int j = 0; j <= t.tcq_memory; ++j)
          if (i - j >= 0) w |= bits_at(r.code.data(), i - j, 1) << j;
        const int subset = 2 * (std::popcount(w & t.tcq_g1) & 1) + (std::popcount(w & t.tcq_g0) & 1);
        const unsigned m = code_at(r.code.data() + D / 8, i, D, N - 1);
        c = t.tcq_levels[4 * m + unsigned(subset)];
      }
      mine[i] = norm / std::sqrt(float(D)) * c;
    }
    for (int i = 0; i < D; ++i) ASSERT_FLOAT_EQ(mine[i], ref[i]) << name << " i=" << i;
    // inverse rotation from the sign table: x = s * H y / sqrt(D)
    std::vector<float> xr(D), full(D);
    for (int i = 0; i < D; ++i) {
      double acc = 0;
      for (int j = 0; j < D; ++j) acc += ((std::popcount(unsigned(i & j)) & 1) ? -1.0 : 1.0) * mine[j];
      xr[i] = float(acc / std::sqrt(double(D))) * t.rotation[i];
    }
    blk->decode(r.code.data(), r.side.data(), full.data());
    for (int i = 0; i < D; ++i) ASSERT_NEAR(xr[i], full[i], 1e-4 * (1 + std::fabs(full[i]))) << name;
  }
}

TEST(KvTables, GroupedBlocksAndQjlFromTables) {
  const int D = 64;
  Rng rng(6);
  std::vector<float> x(D), q(D);
  for (auto& v : x) v = float(rng.normal());
  for (auto& v : q) v = float(rng.normal());
  for (const char* name : {"iso3", "rotor4", "planar3", "rotor3+qjl"}) {
    auto blk = make_block(parse_block(name), D, 43, 0, 0, Side::k);
    const BlockTables t = blk->tables();
    const Row r = encode(*blk, x);
    std::vector<float> y(D), ref(D);
    for (int i = 0; i < D; ++i)
      y[i] = f16_at(&r.side[2 * (i / 32)]) * t.codebook[code_at(r.code.data(), i, D, blk->spec().bits)];
    if (blk->spec().qjl) {  // sketch after the base code row; norm after the base side
      ASSERT_EQ(t.qjl_projection.size(), size_t(D) * D);
      const size_t sketch = blk->layout().code_bytes - size_t(D) / 8;
      const size_t norm = blk->layout().side_bytes - 2;
      const float c = float(std::sqrt(M_PI / 2) / D) * f16_at(&r.side[norm]);
      for (int j = 0; j < D; ++j) {
        const float sj = bits_at(r.code.data() + sketch, j, 1) ? c : -c;
        for (int i = 0; i < D; ++i) y[i] += sj * t.qjl_projection[size_t(j) * D + i];
      }
    }
    blk->decode_rotated(r.code.data(), r.side.data(), ref.data());
    for (int i = 0; i < D; ++i) ASSERT_NEAR(y[i], ref[i], 1e-5 * (1 + std::fabs(ref[i]))) << name << " i=" << i;
    if (std::string(name) == "rotor4") {  // rotation from the 3x3 table: y_b = M x_b
      std::vector<float> rx(D);
      blk->rotate(x.data(), rx.data());
      for (int b = 0; b < D / 3; ++b)
        for (int row = 0; row < 3; ++row) {
          float s = 0;
          for (int col = 0; col < 3; ++col) s += t.rotation[size_t(b) * 9 + row * 3 + col] * x[3 * b + col];
          ASSERT_NEAR(s, rx[3 * b + row], 1e-5);
        }
      EXPECT_EQ(t.rotation.size(), size_t(D / 3) * 9);  // 64 = 21 * 3 + 1: the 1-tail is unrotated
    }
  }
}
