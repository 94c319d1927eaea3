// Blocks turbo2 / turbo3 / turbo4 (TurboQuant-MSE).
//
// Encode: n = ||x|| (the sum of squares in double, in warp order:
// kv/warp_sum.hpp, the GPU encoder's order); y = H(s * x)/sqrt(D) (random-sign normalised
// Walsh-Hadamard, so every coordinate of u = sqrt(D) y / n is ~N(0, 1));
// code_i = the nearest centroid c_i of
// the N-bit Lloyd-Max codebook for N(0,1) to u_i; stored scale
// a = n * g, g = unbiased_row_gain(u, c) (kv/codebook.hpp): the gain that
// makes the reconstruction's projection on the row equal the row (so q.k and
// the attention output are not shrunk by the codebook's 1 - mse), capped at
// 0.2 dB of extra squared error over the row's least-squares gain.
// Decode (rotated basis): y_i = a / sqrt(D) * centroid[code_i].
//
// Layout per row:
//   code: N-bit indices, LSB-first in little-endian 32-bit words (kv/bitpack.hpp):
//         N=2: one 2-bit plane (D/4 bytes); N=4: one 4-bit plane (D/2 bytes);
//         N=3: a 2-bit plane of the low bits (D/4 bytes) then a 1-bit plane
//         of the high bits (D/8 bytes). Index order = ascending centroid.
//         Bytes per row: turbo2 16/32/64, turbo3 24/48/96, turbo4 32/64/128
//         for D = 64/128/256.
//   side: fp16 scale a = n * g (2 bytes), clamped to 65504 (rows with a
//         larger scale keep their direction and are stored with 65504).
// Bits per value: N + 16/D (N + 0.125 at D = 128).
#include "kv/bitpack.hpp"
#include "kv/blocks/rotated_block.hpp"
#include "kv/codebook.hpp"
#include "kv/warp_sum.hpp"

namespace kvq::kv {
namespace {

class TurboBlock final : public RotatedBlock {
 public:
  TurboBlock(const BlockSpec& s, int d, RowLayout l, uint64_t seed)
      : RotatedBlock(s, d, l, make_hadamard_rotation(d, seed)), cb_(lloyd_max_gaussian(s.bits)) {}

  void encode(const float* x, uint8_t* code, uint8_t* side) const override {
    float y[kMaxHeadDim];
    sanitized_rotate(x, y);  // rotating first is the same as normalising first: R is orthogonal
    const double nn = warp_order_sum(dim_, [&](int i) { return double(y[i]) * y[i]; });  // kv/warp_sum.hpp
    const double n = std::sqrt(nn);
    const float to_unit = n > 0 ? float(std::sqrt(double(dim_)) / n) : 0.0f;
    uint8_t idx[kMaxHeadDim];
    float c[kMaxHeadDim];
    const int levels = 1 << spec_.bits;
    for (int i = 0; i < dim_; ++i) {
      y[i] *= to_unit;
      idx[i] = uint8_t(nearest_index(cb_.thresholds_f.data(), levels, y[i]));
      c[i] = cb_.centroids_f[idx[i]];
    }
    pack_codes(idx, dim_, spec_.bits, code);
    store_f16(side, float(n * unbiased_row_gain(y, c, dim_, kGainMaxExcess)));
  }
  void decode_rotated(const uint8_t* code, const uint8_t* side, float* y) const override {
    uint8_t idx[kMaxHeadDim];
    unpack_codes(code, dim_, spec_.bits, idx);
    const float s = load_f16(side) / std::sqrt(float(dim_));
    for (int i = 0; i < dim_; ++i) y[i] = s * cb_.centroids_f[idx[i]];
  }

  void add_tables(BlockTables& t) const override { t.codebook = cb_.centroids_f; }

 private:
  const LloydMax& cb_;
};

}  // namespace

std::unique_ptr<Block> make_turbo_block(const BlockSpec& s, int d, RowLayout l, uint64_t seed) {
  return std::make_unique<TurboBlock>(s, d, l, seed);
}

}  // namespace kvq::kv
