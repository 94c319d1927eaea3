// Shared base of the blocks that quantize in a rotated basis: owns the
// Rotation and provides the generic attention primitives (decode the row in
// the rotated basis, then dot / axpy). Families override them where a faster
// path exists; either way the result equals the decoded-row arithmetic.
#pragma once

#include <cmath>

#include "kv/blocks/families.hpp"
#include "kv/rotation.hpp"

namespace kvq::kv {

// Dot product with 8 independent partial sums (vectorises without -ffast-math).
inline float dot_f32(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

class RotatedBlock : public Block {
 public:
  void rotate(const float* x, float* y) const override { rot_->apply(x, y); }
  void unrotate(const float* y, float* x) const override { rot_->apply_inverse(y, x); }
  const Rotation& rotation() const { return *rot_; }
  BlockTables tables() const override {
    BlockTables t;
    t.rotation_kind = rot_->kind();
    t.rotation = rot_->table();
    add_tables(t);
    return t;
  }
  // Families add their codebooks.
  virtual void add_tables(BlockTables&) const {}

  using Block::accumulate_rows;
  using Block::dot_rows;
  void dot_rows(const float* q, size_t qstride, int nq, const uint8_t* code, size_t cs, const uint8_t* side,
                size_t ss, int n, float* out) const override {
    float y[kMaxHeadDim];
    for (int t = 0; t < n; ++t) {
      decode_rotated(code + size_t(t) * cs, side + size_t(t) * ss, y);
      for (int j = 0; j < nq; ++j) {
        const float* qj = q + size_t(j) * qstride;
        out[size_t(j) * n + t] = dot_f32(qj, y, dim_);
      }
    }
  }
  void accumulate_rows(const float* p, size_t pstride, int nq, const uint8_t* code, size_t cs,
                       const uint8_t* side, size_t ss, int n, float* acc) const override {
    float y[kMaxHeadDim];
    for (int t = 0; t < n; ++t) {
      decode_rotated(code + size_t(t) * cs, side + size_t(t) * ss, y);
      for (int j = 0; j < nq; ++j) {
        const float w = p[size_t(j) * pstride + t];
        float* a = acc + size_t(j) * dim_;
        for (int i = 0; i < dim_; ++i) a[i] += w * y[i];
      }
    }
  }

 protected:
  RotatedBlock(const BlockSpec& s, int d, RowLayout l, std::unique_ptr<Rotation> rot)
      : Block(s, d, l), rot_(std::move(rot)) {}
  // y = R sanitize(x)
  void sanitized_rotate(const float* x, float* y) const {
    float xs[kMaxHeadDim];
    for (int i = 0; i < dim_; ++i) xs[i] = sanitize_value(x[i]);
    rot_->apply(xs, y);
  }
  std::unique_ptr<Rotation> rot_;
};

// fp16 with the overflow clamped to the largest finite fp16 (65504): side
// information is always finite.
inline uint16_t f32_to_f16_clamped(float x);

}  // namespace kvq::kv

#include "core/half.hpp"

namespace kvq::kv {
inline uint16_t f32_to_f16_clamped(float x) {
  if (!(x == x)) x = 0;
  if (x > 65504.0f) x = 65504.0f;
  if (x < -65504.0f) x = -65504.0f;
  return f32_to_f16(x);
}
inline void store_f16(uint8_t* p, float x) {
  const uint16_t h = f32_to_f16_clamped(x);
  p[0] = uint8_t(h & 0xff);
  p[1] = uint8_t(h >> 8);
}
inline float load_f16(const uint8_t* p) { return f16_to_f32(uint16_t(p[0] | (p[1] << 8))); }
}  // namespace kvq::kv
