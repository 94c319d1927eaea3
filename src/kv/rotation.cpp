#include "kv/rotation.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace kvq::kv {
namespace {

class IdentityRotation final : public Rotation {
 public:
  explicit IdentityRotation(int d) : Rotation(d) {}
  void apply(const float* x, float* y) const override { std::copy(x, x + dim_, y); }
  void apply_inverse(const float* y, float* x) const override { std::copy(y, y + dim_, x); }
  std::vector<float> table() const override { return {}; }
  const char* kind() const override { return "identity"; }
};

class HadamardRotation final : public Rotation {
 public:
  HadamardRotation(int d, uint64_t seed) : Rotation(d), signs_(size_t(d)) {
    Rng rng(seed);
    for (auto& s : signs_) s = (rng.next_u64() >> 63) ? -1.0f : 1.0f;
  }
  void apply(const float* x, float* y) const override {
    for (int i = 0; i < dim_; ++i) y[i] = signs_[i] * x[i];
    fwht_normalized(y, dim_);
  }
  void apply_inverse(const float* y, float* x) const override {
    std::copy(y, y + dim_, x);
    fwht_normalized(x, dim_);
    for (int i = 0; i < dim_; ++i) x[i] *= signs_[i];
  }
  std::vector<float> table() const override { return signs_; }
  const char* kind() const override { return "hadamard"; }

 private:
  std::vector<float> signs_;
};

struct Quat {
  float w, x, y, z;
};
Quat qmul(const Quat& a, const Quat& b) {
  return {a.w * b.w - a.x * b.x - a.y * b.y - a.z * b.z, a.w * b.x + a.x * b.w + a.y * b.z - a.z * b.y,
          a.w * b.y - a.x * b.z + a.y * b.w + a.z * b.x, a.w * b.z + a.x * b.y - a.y * b.x + a.z * b.w};
}
Quat qconj(const Quat& a) { return {a.w, -a.x, -a.y, -a.z}; }
Quat random_unit_quat(Rng& rng) {
  double v[4], n = 0;
  do {
    n = 0;
    for (auto& c : v) {
      c = rng.normal();
      n += c * c;
    }
  } while (n < 1e-12);
  n = std::sqrt(n);
  return {float(v[0] / n), float(v[1] / n), float(v[2] / n), float(v[3] / n)};
}

class IsoclinicRotation final : public Rotation {
 public:
  IsoclinicRotation(int d, uint64_t seed) : Rotation(d) {
    Rng rng(seed);
    for (int b = 0; b < d / 4; ++b) {
      left_.push_back(random_unit_quat(rng));
      right_.push_back(random_unit_quat(rng));
    }
  }
  void apply(const float* x, float* y) const override {
    std::copy(x, x + dim_, y);
    for (size_t b = 0; b < left_.size(); ++b) {
      const Quat v{x[4 * b], x[4 * b + 1], x[4 * b + 2], x[4 * b + 3]};
      const Quat r = qmul(qmul(left_[b], v), right_[b]);
      y[4 * b] = r.w, y[4 * b + 1] = r.x, y[4 * b + 2] = r.y, y[4 * b + 3] = r.z;
    }
  }
  void apply_inverse(const float* y, float* x) const override {
    std::copy(y, y + dim_, x);
    for (size_t b = 0; b < left_.size(); ++b) {
      const Quat v{y[4 * b], y[4 * b + 1], y[4 * b + 2], y[4 * b + 3]};
      const Quat r = qmul(qmul(qconj(left_[b]), v), qconj(right_[b]));
      x[4 * b] = r.w, x[4 * b + 1] = r.x, x[4 * b + 2] = r.y, x[4 * b + 3] = r.z;
    }
  }
  std::vector<float> table() const override {
    std::vector<float> t;
    for (size_t b = 0; b < left_.size(); ++b)
      for (const Quat* q : {&left_[b], &right_[b]}) t.insert(t.end(), {q->w, q->x, q->y, q->z});
    return t;
  }
  const char* kind() const override { return "isoclinic"; }

 private:
  std::vector<Quat> left_, right_;
};

class RotorRotation final : public Rotation {
 public:
  RotorRotation(int d, uint64_t seed) : Rotation(d) {
    Rng rng(seed);
    for (int b = 0; b < d / 3; ++b) {
      // Rotor R = w + xy e12 + yz e23 + zx e31 <-> unit quaternion (w, yz, zx, xy);
      // the sandwich R v R~ is the quaternion rotation matrix below.
      const Quat q = random_unit_quat(rng);
      const float w = q.w, i = q.x, j = q.y, k = q.z;
      const float m[9] = {1 - 2 * (j * j + k * k), 2 * (i * j - w * k),     2 * (i * k + w * j),
                          2 * (i * j + w * k),     1 - 2 * (i * i + k * k), 2 * (j * k - w * i),
                          2 * (i * k - w * j),     2 * (j * k + w * i),     1 - 2 * (i * i + j * j)};
      mats_.insert(mats_.end(), m, m + 9);
    }
    if (d % 3 == 2) {  // rotor exp(-theta/2 e12) acting on the two present coordinates
      const double theta = 6.283185307179586 * rng.uniform();
      tail_c_ = float(std::cos(theta));
      tail_s_ = float(std::sin(theta));
    }
  }
  void apply(const float* x, float* y) const override {
    const int nb = dim_ / 3;
    for (int b = 0; b < nb; ++b) {
      const float* m = &mats_[size_t(b) * 9];
      const float* v = x + 3 * b;
      for (int r = 0; r < 3; ++r) y[3 * b + r] = m[3 * r] * v[0] + m[3 * r + 1] * v[1] + m[3 * r + 2] * v[2];
    }
    tail(x, y, false);
  }
  void apply_inverse(const float* y, float* x) const override {
    const int nb = dim_ / 3;
    for (int b = 0; b < nb; ++b) {
      const float* m = &mats_[size_t(b) * 9];
      const float* v = y + 3 * b;
      for (int c = 0; c < 3; ++c) x[3 * b + c] = m[c] * v[0] + m[3 + c] * v[1] + m[6 + c] * v[2];
    }
    tail(y, x, true);
  }
  std::vector<float> table() const override {
    auto t = mats_;
    if (dim_ % 3 == 2) t.insert(t.end(), {tail_c_, tail_s_});
    return t;
  }
  const char* kind() const override { return "rotor"; }

 private:
  void tail(const float* in, float* out, bool inverse) const {
    const int t0 = dim_ / 3 * 3;
    if (dim_ % 3 == 1) out[t0] = in[t0];
    if (dim_ % 3 == 2) {
      const float s = inverse ? -tail_s_ : tail_s_;
      out[t0] = tail_c_ * in[t0] - s * in[t0 + 1];
      out[t0 + 1] = s * in[t0] + tail_c_ * in[t0 + 1];
    }
  }
  std::vector<float> mats_;
  float tail_c_ = 1, tail_s_ = 0;
};

class GivensRotation final : public Rotation {
 public:
  GivensRotation(int d, uint64_t seed) : Rotation(d) {
    Rng rng(seed);
    for (int p = 0; p < d / 2; ++p) {
      const double theta = 6.283185307179586 * rng.uniform();
      cs_.push_back(float(std::cos(theta)));
      cs_.push_back(float(std::sin(theta)));
    }
  }
  void apply(const float* x, float* y) const override { run(x, y, 1.0f); }
  void apply_inverse(const float* y, float* x) const override { run(y, x, -1.0f); }
  std::vector<float> table() const override { return cs_; }
  const char* kind() const override { return "givens"; }

 private:
  void run(const float* in, float* out, float sign) const {
    const int np = dim_ / 2;
    for (int p = 0; p < np; ++p) {
      const float c = cs_[2 * p], s = sign * cs_[2 * p + 1];
      const float a = in[2 * p], b = in[2 * p + 1];
      out[2 * p] = c * a - s * b;
      out[2 * p + 1] = s * a + c * b;
    }
    if (dim_ & 1) out[dim_ - 1] = in[dim_ - 1];
  }
  std::vector<float> cs_;
};

}  // namespace

void fwht_normalized(float* x, int d) {
  for (int h = 1; h < d; h <<= 1)
    for (int i = 0; i < d; i += h << 1)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float s = 1.0f / std::sqrt(float(d));
  for (int i = 0; i < d; ++i) x[i] *= s;
}

std::unique_ptr<Rotation> make_identity_rotation(int d) { return std::make_unique<IdentityRotation>(d); }
std::unique_ptr<Rotation> make_hadamard_rotation(int d, uint64_t seed) {
  KVQ_CHECK(d > 0 && (d & (d - 1)) == 0, Errc::unsupported, "the Walsh-Hadamard rotation (rq8, turbo, tcq) needs ",
            "head_dim a power of two, got ", d, "; use q8 or iso/rotor/planar blocks for this model");
  return std::make_unique<HadamardRotation>(d, seed);
}
std::unique_ptr<Rotation> make_isoclinic_rotation(int d, uint64_t seed) {
  return std::make_unique<IsoclinicRotation>(d, seed);
}
std::unique_ptr<Rotation> make_rotor_rotation(int d, uint64_t seed) { return std::make_unique<RotorRotation>(d, seed); }
std::unique_ptr<Rotation> make_givens_rotation(int d, uint64_t seed) {
  return std::make_unique<GivensRotation>(d, seed);
}

}  // namespace kvq::kv
