// Block bf16 (codec `none`): the reference.
// Layout per row: code = D bf16 values, little-endian, value i at bytes
// [2i, 2i+2) (2*D bytes; 128/256/512 for D = 64/128/256); no side information.
// Basis: identity. Inputs are sanitised (NaN -> 0, clamp to +-65504) like every
// block, so `none` and the quantized codecs see the same values.
#include <algorithm>

#include "core/half.hpp"
#include "kv/blocks/families.hpp"

namespace kvq::kv {
namespace {

class Bf16Block final : public Block {
 public:
  Bf16Block(const BlockSpec& s, int d, RowLayout l) : Block(s, d, l) {}

  void encode(const float* x, uint8_t* code, uint8_t*) const override {
    auto* out = reinterpret_cast<uint16_t*>(code);
    for (int i = 0; i < dim_; ++i) out[i] = f32_to_bf16(sanitize_value(x[i]));
  }
  void decode_rotated(const uint8_t* code, const uint8_t*, float* y) const override {
    const auto* in = reinterpret_cast<const uint16_t*>(code);
    for (int i = 0; i < dim_; ++i) y[i] = bf16_to_f32(in[i]);
  }
  void rotate(const float* x, float* y) const override { std::copy(x, x + dim_, y); }
  void unrotate(const float* y, float* x) const override { std::copy(y, y + dim_, x); }

  void dot_rows(const float* q, const uint8_t* code, size_t cs, const uint8_t*, size_t, int n,
                float* out) const override {
    for (int t = 0; t < n; ++t) {
      const auto* r = reinterpret_cast<const uint16_t*>(code + size_t(t) * cs);
      float s = 0;
      for (int i = 0; i < dim_; ++i) s += q[i] * bf16_to_f32(r[i]);
      out[t] = s;
    }
  }
  void accumulate_rows(const float* p, const uint8_t* code, size_t cs, const uint8_t*, size_t, int n,
                       float* acc) const override {
    for (int t = 0; t < n; ++t) {
      const auto* r = reinterpret_cast<const uint16_t*>(code + size_t(t) * cs);
      const float w = p[t];
      for (int i = 0; i < dim_; ++i) acc[i] += w * bf16_to_f32(r[i]);
    }
  }
};

}  // namespace

std::unique_ptr<Block> make_bf16_block(const BlockSpec& s, int d, RowLayout l) {
  return std::make_unique<Bf16Block>(s, d, l);
}

}  // namespace kvq::kv
