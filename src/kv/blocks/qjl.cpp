// +qjl (K sides only): a 1-bit QJL sketch of the residual that makes q.k
// unbiased.
//
// In the base block's rotated basis: r = R x - y_hat (x minus its base
// reconstruction); store sign(S r) (m = D projections; S an m x D matrix of
// i.i.d. N(0,1) entries seeded per (layer, kv_head)) and ||r|| (fp16). Then
//   q.r ~= sqrt(pi/2) / m * ||r|| * sum_i sign(S r)_i (S q_rot)_i,
// an unbiased estimator over S (E[sign(s.r) s] = sqrt(2/pi) r / ||r|| for a
// Gaussian row s). S q_rot is computed once per query per step
// (prepare_query); the inner loop only adds or subtracts its entries.
//
// Layout per row (appended to the base block's row):
//   code: the base code bytes, then a 1-bit plane of m = D sign bits (bit i = 1
//         when (S r)_i >= 0), LSB-first in little-endian 32-bit words (D/8 bytes).
//   side: the base side bytes, then the fp16 residual norm ||r|| (2 bytes;
//         |r|^2 summed in double in warp order, kv/warp_sum.hpp, as the GPU).
// Adds 1 + 16/D bits per value (1.125 at D = 128, 1.25 at D = 64).
// decode_rotated() returns y_hat + sqrt(pi/2)/m ||r|| S^T sign(S r): exactly the
// vector whose dot product with q_rot the estimator computes.
#include <cmath>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "kv/bitpack.hpp"
#include "kv/blocks/rotated_block.hpp"
#include "kv/warp_sum.hpp"

namespace kvq::kv {
namespace {

constexpr double kSqrtHalfPi = 1.2533141373155002512;

class QjlBlock final : public Block {
 public:
  QjlBlock(const BlockSpec& s, RowLayout l, std::unique_ptr<Block> base, uint64_t seed)
      : Block(s, base->dim(), l), base_(std::move(base)), m_(base_->dim()), proj_(size_t(m_) * dim_) {
    Rng rng(seed);
    for (auto& v : proj_) v = float(rng.normal());
    sketch_off_ = base_->layout().code_bytes;
    norm_off_ = base_->layout().side_bytes;
  }

  void rotate(const float* x, float* y) const override { base_->rotate(x, y); }
  void unrotate(const float* y, float* x) const override { base_->unrotate(y, x); }

  void encode(const float* x, uint8_t* code, uint8_t* side) const override {
    base_->encode(x, code, side);
    float xs[kMaxHeadDim], xr[kMaxHeadDim], yh[kMaxHeadDim];
    for (int i = 0; i < dim_; ++i) xs[i] = sanitize_value(x[i]);
    base_->rotate(xs, xr);
    base_->decode_rotated(code, side, yh);
    for (int i = 0; i < dim_; ++i) xr[i] -= yh[i];
    const double rn = warp_order_sum(dim_, [&](int i) { return double(xr[i]) * xr[i]; });  // kv/warp_sum.hpp
    uint8_t bits[kMaxHeadDim];
    for (int j = 0; j < m_; ++j) {
      const float* s = &proj_[size_t(j) * dim_];
      // warp order (kv/warp_sum.hpp), as every bit-exact sum of the encoders
      const double p = warp_order_sum(dim_, [&](int i) { return double(s[i]) * xr[i]; });
      bits[j] = p >= 0 ? 1 : 0;
    }
    pack_plane(bits, m_, 1, code + sketch_off_);
    store_f16(side + norm_off_, float(std::sqrt(rn)));
  }

  void decode_rotated(const uint8_t* code, const uint8_t* side, float* y) const override {
    base_->decode_rotated(code, side, y);
    const float c = float(kSqrtHalfPi / m_) * load_f16(side + norm_off_);
    for (int j = 0; j < m_; ++j) {
      const float sj = plane_get(code + sketch_off_, j, 1) ? c : -c;
      const float* s = &proj_[size_t(j) * dim_];
      for (int i = 0; i < dim_; ++i) y[i] += sj * s[i];
    }
  }

  void prepare_query(const float* q_rot, std::vector<float>& qstate) const override {
    base_->prepare_query(q_rot, qstate);
    KVQ_ASSERT(qstate.size() == base_qstate_size());
    for (int j = 0; j < m_; ++j) {
      const float* s = &proj_[size_t(j) * dim_];
      float p = 0;
      for (int i = 0; i < dim_; ++i) p += s[i] * q_rot[i];
      qstate.push_back(p);
    }
  }

  using Block::accumulate_rows;
  using Block::dot_rows;
  void dot_rows(const float* qstate, size_t qstride, int nq, const uint8_t* code, size_t cs, const uint8_t* side,
                size_t ss, int n, float* out) const override {
    base_->dot_rows(qstate, qstride, nq, code, cs, side, ss, n, out);
    const float c0 = float(kSqrtHalfPi / m_);
    for (int t = 0; t < n; ++t) {
      const uint8_t* bits = code + size_t(t) * cs + sketch_off_;
      const float rn = c0 * load_f16(side + size_t(t) * ss + norm_off_);
      for (int j = 0; j < nq; ++j) {
        const float* sq = qstate + size_t(j) * qstride + base_qstate_size();
        float acc = 0;
        for (int i = 0; i < m_; ++i) acc += plane_get(bits, i, 1) ? sq[i] : -sq[i];
        out[size_t(j) * n + t] += rn * acc;
      }
    }
  }

  void accumulate_rows(const float*, size_t, int, const uint8_t*, size_t, const uint8_t*, size_t, int,
                       float*) const override {
    fail(Errc::internal, "+qjl blocks are K-side only; accumulate_rows must not be called");
  }

  BlockTables tables() const override {
    BlockTables t = base_->tables();
    t.qjl_projection = proj_;
    return t;
  }

 private:
  // The base block's query state is its rotated query (D floats) for every
  // base block kvq has; the QJL part follows it.
  size_t base_qstate_size() const { return size_t(dim_); }

  std::unique_ptr<Block> base_;
  int m_;
  std::vector<float> proj_;
  size_t sketch_off_ = 0, norm_off_ = 0;
};

}  // namespace

std::unique_ptr<Block> make_qjl_block(const BlockSpec& s, RowLayout l, std::unique_ptr<Block> base, uint64_t seed,
                                      int layer, int kv_head) {
  return std::make_unique<QjlBlock>(s, l, std::move(base), derive_seed(seed, layer, kv_head, Side::k, 2));
}

}  // namespace kvq::kv
