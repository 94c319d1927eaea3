// Blocks tcq2 / tcq3: trellis-coded quantization (kv/tcq.hpp) of the same
// rotated unit-row coordinates as turbo: n = ||x|| (double, warp order as
// turbo: kv/warp_sum.hpp), y = H(s * x)/sqrt(D),
// the trellis codes u = sqrt(D) * y / n (~N(0,1)) as levels c; the stored
// scale is a = n * g with g = unbiased_row_gain(u, c) (kv/codebook.hpp, as
// turbo: the reconstruction's projection on the row is the row, capped at
// 0.2 dB of extra squared error); decode y_i = a / sqrt(D) * value_i.
//
// Layout per row:
//   code: the branch plane (1 bit per value: b_i at bit i, D/8 bytes), then
//         the level plane ((N-1) bits per value: tcq2 a 1-bit plane, tcq3 a
//         2-bit plane), LSB-first in little-endian 32-bit words.
//         Bytes per row: tcq2 16/32/64, tcq3 24/48/96 for D = 64/128/256.
//   side: fp16 scale a = n * g (clamped to 65504 like turbo).
// Parallel decode (no scan): value i needs only its level bits and the branch
// bits b_i .. b_{i-5} (window w = b_i | b_{i-1} << 1 | ... | b_{i-5} << 5,
// bits before position 0 are 0): value = levels[4 m_i + subset(w)], with
// subset(w) = 2 parity(w & g1) + parity(w & g0). A GPU lane decoding 32
// values reads its branch word and the previous one.
// Bits per value: N + 16/D.
#include <cmath>

#include "kv/bitpack.hpp"
#include "kv/blocks/rotated_block.hpp"
#include "kv/codebook.hpp"
#include "kv/warp_sum.hpp"
#include "kv/tcq.hpp"

namespace kvq::kv {
namespace {

class TcqBlock final : public RotatedBlock {
 public:
  TcqBlock(const BlockSpec& s, int d, RowLayout l, uint64_t seed)
      : RotatedBlock(s, d, l, make_hadamard_rotation(d, seed)), t_(tcq_trellis(s.bits)) {}

  void encode(const float* x, uint8_t* code, uint8_t* side) const override {
    float y[kMaxHeadDim];
    sanitized_rotate(x, y);
    const double nn = warp_order_sum(dim_, [&](int i) { return double(y[i]) * y[i]; });  // kv/warp_sum.hpp
    const double n = std::sqrt(nn);
    const float to_unit = n > 0 ? float(std::sqrt(double(dim_)) / n) : 0.0f;
    for (int i = 0; i < dim_; ++i) y[i] *= to_unit;
    uint8_t br[kMaxHeadDim], lv[kMaxHeadDim];
    tcq_encode(t_, y, dim_, br, lv);
    float c[kMaxHeadDim];
    tcq_decode(t_, br, lv, dim_, c);
    pack_plane(br, dim_, 1, code);
    pack_codes(lv, dim_, spec_.bits - 1, code + plane_bytes(dim_, 1));
    store_f16(side, float(n * unbiased_row_gain(y, c, dim_, kGainMaxExcess)));
  }
  void decode_rotated(const uint8_t* code, const uint8_t* side, float* y) const override {
    const float s = load_f16(side) / std::sqrt(float(dim_));
    const uint8_t* lv = code + plane_bytes(dim_, 1);
    const uint32_t wmask = (2u << t_.memory) - 1u;
    uint32_t w = 0;
    for (int i = 0; i < dim_; ++i) {
      w = ((w << 1) | plane_get(code, i, 1)) & wmask;
      y[i] = s * tcq_value(t_, w, plane_get(lv, i, spec_.bits - 1));
    }
  }

  void add_tables(BlockTables& t) const override {
    t.tcq_levels = t_.levels;
    t.tcq_memory = t_.memory;
    t.tcq_g0 = t_.g0;
    t.tcq_g1 = t_.g1;
  }

 private:
  const TcqTrellis& t_;
};

}  // namespace

std::unique_ptr<Block> make_tcq_block(const BlockSpec& s, int d, RowLayout l, uint64_t seed) {
  return std::make_unique<TcqBlock>(s, d, l, seed);
}

}  // namespace kvq::kv
