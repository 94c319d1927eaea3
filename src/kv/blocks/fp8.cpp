// Block fp8 (kvq extra): OCP e4m3 (1 sign, 4 exponent bits with bias 7, 3
// mantissa bits; largest finite 448; 0x7f/0xff are NaN and never produced).
// Layout per row: code = D bytes, value i at byte i; no side information.
// Round to nearest, ties to even; saturating: |x| > 448 stores +-448.
#include <algorithm>
#include <array>
#include <cmath>

#include "kv/blocks/rotated_block.hpp"

namespace kvq::kv {
namespace {

float e4m3_to_f32(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
  float v = exp == 0 ? std::ldexp(float(man), -9) : std::ldexp(1.0f + man / 8.0f, exp - 7);
  return sign ? -v : v;
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int i = 0; i < 256; ++i) a[size_t(i)] = e4m3_to_f32(uint8_t(i));
    return a;
  }();
  return t;
}

uint8_t f32_to_e4m3(float x) {
  const auto& t = e4m3_table();
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::min(std::fabs(x), 448.0f);
  // magnitudes 0x00..0x7e are ascending; binary search the nearest
  int lo = 0, hi = 0x7e;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (t[size_t(mid)] <= a) lo = mid;
    else hi = mid;
  }
  const float dl = a - t[size_t(lo)], dh = t[size_t(hi)] - a;
  const int m = dl < dh ? lo : dh < dl ? hi : ((lo & 1) ? hi : lo);
  return uint8_t(sign | m);
}

class Fp8Block final : public RotatedBlock {
 public:
  Fp8Block(const BlockSpec& s, int d, RowLayout l) : RotatedBlock(s, d, l, make_identity_rotation(d)) {}
  void encode(const float* x, uint8_t* code, uint8_t*) const override {
    for (int i = 0; i < dim_; ++i) code[i] = f32_to_e4m3(sanitize_value(x[i]));
  }
  void decode_rotated(const uint8_t* code, const uint8_t*, float* y) const override {
    const auto& t = e4m3_table();
    for (int i = 0; i < dim_; ++i) y[i] = t[code[i]];
  }
};

}  // namespace

std::unique_ptr<Block> make_fp8_block(const BlockSpec& s, int d, RowLayout l) {
  return std::make_unique<Fp8Block>(s, d, l);
}

}  // namespace kvq::kv
