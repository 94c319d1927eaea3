// Blocks q8 and rq8: symmetric int8 with one fp16 scale per group of 32.
//
// Layout per row (D = head_dim):
//   code: D int8 values (two's complement), value i at byte i
//         (64 / 128 / 256 bytes for D = 64 / 128 / 256);
//   side: ceil(D/32) fp16 scales, little-endian; scale g covers values
//         [32g, 32g + 32). value = scale * int8. Budget 8 + 16/32 = 8.5 bits.
//   scale = absmax(group) / 127 rounded to fp16 (an all-zero group has scale 0).
// rq8 codes the row after the normalised random-sign Walsh-Hadamard rotation
// (kv/rotation.hpp); the query is rotated instead of un-rotating K.
#include <algorithm>
#include <cmath>

#include "kv/blocks/rotated_block.hpp"

namespace kvq::kv {
namespace {

class Q8Block final : public RotatedBlock {
 public:
  Q8Block(const BlockSpec& s, int d, RowLayout l, std::unique_ptr<Rotation> r)
      : RotatedBlock(s, d, l, std::move(r)) {}

  void encode(const float* x, uint8_t* code, uint8_t* side) const override {
    float y[kMaxHeadDim];
    sanitized_rotate(x, y);
    auto* q = reinterpret_cast<int8_t*>(code);
    for (int g0 = 0, g = 0; g0 < dim_; g0 += kScaleGroup, ++g) {
      const int g1 = std::min(dim_, g0 + kScaleGroup);
      float amax = 0;
      for (int i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(y[i]));
      store_f16(side + 2 * g, amax / 127.0f);
      const float s = load_f16(side + 2 * g);
      const float inv = s > 0 ? 1.0f / s : 0.0f;
      for (int i = g0; i < g1; ++i) q[i] = int8_t(std::clamp(std::nearbyint(y[i] * inv), -127.0f, 127.0f));
    }
  }
  void decode_rotated(const uint8_t* code, const uint8_t* side, float* y) const override {
    const auto* q = reinterpret_cast<const int8_t*>(code);
    for (int g0 = 0, g = 0; g0 < dim_; g0 += kScaleGroup, ++g) {
      const float s = load_f16(side + 2 * g);
      const int g1 = std::min(dim_, g0 + kScaleGroup);
      for (int i = g0; i < g1; ++i) y[i] = s * float(q[i]);
    }
  }
};

}  // namespace

std::unique_ptr<Block> make_q8_block(const BlockSpec& s, int d, RowLayout l, uint64_t seed) {
  auto rot = s.family == Family::rq8 ? make_hadamard_rotation(d, seed) : make_identity_rotation(d);
  return std::make_unique<Q8Block>(s, d, l, std::move(rot));
}

}  // namespace kvq::kv
