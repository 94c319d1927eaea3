// Block bf16 (codec `none`): the reference.
// Layout per row: code = D bf16 values, little-endian, value i at bytes
// [2i, 2i+2) (2*D bytes; 128/256/512 for D = 64/128/256); no side information.
// Basis: identity. Inputs are sanitised (NaN -> 0, clamp to +-65504) like every
// block, so `none` and the quantized codecs see the same values.
#include <algorithm>

#include "core/half.hpp"
#include "kv/blocks/rotated_block.hpp"

namespace kvq::kv {
namespace {

class Bf16Block final : public RotatedBlock {
 public:
  Bf16Block(const BlockSpec& s, int d, RowLayout l) : RotatedBlock(s, d, l, make_identity_rotation(d)) {}

  void encode(const float* x, uint8_t* code, uint8_t*) const override {
    auto* out = reinterpret_cast<uint16_t*>(code);
    for (int i = 0; i < dim_; ++i) out[i] = f32_to_bf16(sanitize_value(x[i]));
  }
  void decode_rotated(const uint8_t* code, const uint8_t*, float* y) const override {
    const auto* in = reinterpret_cast<const uint16_t*>(code);
    for (int i = 0; i < dim_; ++i) y[i] = bf16_to_f32(in[i]);
  }
};

}  // namespace

std::unique_ptr<Block> make_bf16_block(const BlockSpec& s, int d, RowLayout l) {
  return std::make_unique<Bf16Block>(s, d, l);
}

}  // namespace kvq::kv
