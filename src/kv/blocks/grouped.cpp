// Blocks iso3/4, rotor3/4, planar3/4: a local orthogonal rotation (quaternion
// isoclinic 4-blocks, Cl(3,0) rotor 3-blocks, Givens pairs; kv/rotation.hpp),
// then scalar N-bit Lloyd-Max codes with one fp16 scale per group of 32
// rotated coordinates.
//
// Encode per group g (coordinates [32g, 32g+32) of y = R x): the scale s_g
// starts at the group RMS and is refined by two least-squares steps
// (s = <y, c> / <c, c> over the chosen centroids c), keeping the best; it is
// rounded to fp16 and the codes are chosen again against the stored scale.
// Decode: y_i = s_g * centroid[code_i]. An all-zero group stores s_g = 0.
// Every double sum over a group (its energy; the fit's squared error, <y, c>
// and <c, c>) is in warp order (kv/warp_sum.hpp: term i of the group is lane
// i's, the 32 lanes combined by an xor butterfly), the GPU encoder's order.
//
// Layout per row:
//   code: N-bit indices as for turbo (N=3: 2-bit low plane, then 1-bit high
//         plane; N=4: one 4-bit plane), LSB-first in little-endian 32-bit
//         words. Bytes per row: 3 bits 24/48/96, 4 bits 32/64/128 (D = 64/128/256).
//   side: ceil(D/32) fp16 scales (little-endian), scale g for group g.
// Bits per value: N + 0.5.
#include <algorithm>
#include <cmath>

#include "kv/bitpack.hpp"
#include "kv/blocks/rotated_block.hpp"
#include "kv/codebook.hpp"
#include "kv/warp_sum.hpp"

namespace kvq::kv {
namespace {

class GroupedBlock final : public RotatedBlock {
 public:
  GroupedBlock(const BlockSpec& s, int d, RowLayout l, std::unique_ptr<Rotation> r)
      : RotatedBlock(s, d, l, std::move(r)), cb_(lloyd_max_gaussian(s.bits)) {}

  void encode(const float* x, uint8_t* code, uint8_t* side) const override {
    float y[kMaxHeadDim];
    sanitized_rotate(x, y);
    uint8_t idx[kMaxHeadDim];
    for (int g0 = 0, g = 0; g0 < dim_; g0 += kScaleGroup, ++g) {
      const int g1 = std::min(dim_, g0 + kScaleGroup);
      const double e = warp_order_sum(g1 - g0, [&](int i) { return double(y[g0 + i]) * y[g0 + i]; });
      float best_s = 0;
      if (e > 0) {
        float s = float(std::sqrt(e / (g1 - g0)));
        double best_err = INFINITY;
        for (int step = 0; step < 3; ++step) {
          double yc = 0, cc = 0;
          const double err = fit(y, g0, g1, s, idx, yc, cc);
          if (err < best_err) best_err = err, best_s = s;
          if (cc <= 0) break;
          s = float(yc / cc);
        }
      }
      store_f16(side + 2 * g, best_s);
      const float s = load_f16(side + 2 * g);
      double yc, cc;
      fit(y, g0, g1, s, idx, yc, cc);
    }
    pack_codes(idx, dim_, spec_.bits, code);
  }
  void decode_rotated(const uint8_t* code, const uint8_t* side, float* y) const override {
    uint8_t idx[kMaxHeadDim];
    unpack_codes(code, dim_, spec_.bits, idx);
    for (int g0 = 0, g = 0; g0 < dim_; g0 += kScaleGroup, ++g) {
      const float s = load_f16(side + 2 * g);
      const int g1 = std::min(dim_, g0 + kScaleGroup);
      for (int i = g0; i < g1; ++i) y[i] = s * cb_.centroids_f[idx[i]];
    }
  }

  void add_tables(BlockTables& t) const override { t.codebook = cb_.centroids_f; }

 private:
  // Codes of y[g0, g1) at scale s; returns the squared error; yc = <y, c>, cc = <c, c>.
  // The three sums run over the group's (at most 32) terms in warp order
  // (kv/warp_sum.hpp): term i of the group is lane i's, then the butterfly.
  double fit(const float* y, int g0, int g1, float s, uint8_t* idx, double& yc, double& cc) const {
    const int levels = 1 << spec_.bits;
    const float inv = s > 0 ? 1.0f / s : 0.0f;
    double t_err[kScaleGroup], t_yc[kScaleGroup], t_cc[kScaleGroup];
    for (int i = g0; i < g1; ++i) {
      idx[i] = uint8_t(nearest_index(cb_.thresholds_f.data(), levels, y[i] * inv));
      const double c = cb_.centroids_f[idx[i]];
      const double d = y[i] - s * c;
      t_err[i - g0] = d * d;
      t_yc[i - g0] = y[i] * c;
      t_cc[i - g0] = c * c;
    }
    yc = warp_order_sum(t_yc, g1 - g0);
    cc = warp_order_sum(t_cc, g1 - g0);
    return warp_order_sum(t_err, g1 - g0);
  }
  const LloydMax& cb_;
};

}  // namespace

std::unique_ptr<Block> make_grouped_block(const BlockSpec& s, int d, RowLayout l, uint64_t seed) {
  std::unique_ptr<Rotation> r;
  if (s.family == Family::iso) r = make_isoclinic_rotation(d, seed);
  else if (s.family == Family::rotor) r = make_rotor_rotation(d, seed);
  else r = make_givens_rotation(d, seed);
  return std::make_unique<GroupedBlock>(s, d, l, std::move(r));
}

}  // namespace kvq::kv
