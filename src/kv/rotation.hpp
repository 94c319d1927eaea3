// Orthogonal per-(layer, kv_head, side) rotations used by the KV blocks. All
// are seeded (kv::derive_seed -> kvq::Rng) so CPU and GPU build the same maps
// from the same seed; table() exports the parameters the GPU uploads.
//
//  hadamard  y = H (s * x) / sqrt(D), H the Sylvester Walsh-Hadamard matrix
//            (natural order), s a random +-1 diagonal. D a power of two.
//            table(): D signs (+1/-1).
//  isoclinic each 4-block x (as quaternion x0 + x1 i + x2 j + x3 k) maps to
//            y = a * x * b with unit quaternions a (left-isoclinic part) and
//            b (right-isoclinic part), independent per block; a tail of
//            D mod 4 coordinates is left unrotated.
//            table(): per block a0..a3, b0..b3.
//  rotor     each 3-block is rotated by the Cl(3,0) rotor sandwich R x R~ of
//            a random unit rotor R = w + xy e12 + yz e23 + zx e31, i.e. the
//            3x3 rotation matrix of the unit quaternion (w, yz, zx, xy).
//            A tail of 2 coordinates is padded to a 3-block with a zero, and
//            its rotor is restricted to the plane of the two real coordinates
//            (bivector e12 only) so the padding stays zero and is never stored;
//            a tail of 1 coordinate is left unrotated.
//            table(): per 3-block the row-major 3x3 matrix (9 floats); the
//            2-tail appends cos, sin.
//  givens    each pair (2i, 2i+1) is rotated by a random angle theta_i:
//            y0 = c x0 - s x1, y1 = s x0 + c x1. An odd tail is unrotated.
//            table(): per pair cos, sin.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvq::kv {

class Rotation {
 public:
  virtual ~Rotation() = default;
  virtual void apply(const float* x, float* y) const = 0;          // y = R x
  virtual void apply_inverse(const float* y, float* x) const = 0;  // x = R^T y
  virtual std::vector<float> table() const = 0;
  virtual const char* kind() const = 0;
  int dim() const { return dim_; }

 protected:
  explicit Rotation(int d) : dim_(d) {}
  int dim_;
};

std::unique_ptr<Rotation> make_identity_rotation(int d);
std::unique_ptr<Rotation> make_hadamard_rotation(int d, uint64_t seed);
std::unique_ptr<Rotation> make_isoclinic_rotation(int d, uint64_t seed);
std::unique_ptr<Rotation> make_rotor_rotation(int d, uint64_t seed);
std::unique_ptr<Rotation> make_givens_rotation(int d, uint64_t seed);

// In-place normalised fast Walsh-Hadamard transform (orthonormal, its own inverse).
void fwht_normalized(float* x, int d);

}  // namespace kvq::kv
