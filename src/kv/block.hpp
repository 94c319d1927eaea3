// One K or V storage block (bf16, q8, rq8, turboN, tcqN, isoN, rotorN, planarN,
// fp8, and any K block +qjl): how one row (one token's head_dim vector for one
// KV head) is encoded into the packed store, and the attention primitives that
// read the packed store directly.
//
// Every block works in its own orthogonal basis R (identity for bf16/q8/fp8, a
// random-sign Walsh-Hadamard for rq8/turbo/tcq, local quaternion / rotor /
// Givens maps for iso/rotor/planar). R is the same for every token of a
// (layer, kv_head, side), so attention hoists it: q is rotated once per step
// for K (q.k = Rq . Rk), and P.V is accumulated in the rotated basis and
// inverse-rotated once. Nothing here rotates per token at attention time.
//
// Row storage: a code row (code_bytes, 4-byte multiple, 16-byte multiple where
// the budget allows) in one array and a side row (side_bytes: fp16 scales and
// norms) in a separate small array, both token-major per (layer, kv_head).
// Bit order everywhere: LSB-first within little-endian 32-bit words.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kv/family.hpp"

namespace kvq::kv {

enum class Side { k, v };
const char* side_name(Side s);

// A parsed block name: family + bits (+qjl). Names: bf16, q8, rq8, fp8,
// turbo2/3/4, tcq2/3, iso3/4, rotor3/4, planar3/4; any K block may add "+qjl".
struct BlockSpec {
  Family family = Family::bf16;
  int bits = 16;       // bits per code (16 for bf16, 8 for q8/rq8/fp8, N for the N-bit families)
  bool qjl = false;    // +qjl: 1-bit QJL sketch of the residual (K sides only)

  std::string name() const;  // canonical: "turbo3", "rotor3+qjl"
  bool operator==(const BlockSpec&) const = default;
};

// Throws kvq::Error (invalid_argument) listing the valid block names.
BlockSpec parse_block(const std::string& name);
// Every valid base block name (no +qjl), in table order.
const std::vector<std::string>& block_names();

// Budget of the spec in bits per value (including every scale, norm, index).
double block_budget_bits(const BlockSpec& b);

struct RowLayout {
  size_t code_bytes = 0;  // per row, code array (padded; padding counted)
  size_t side_bytes = 0;  // per row, side array (fp16 scales / norms)
  size_t row_bytes() const { return code_bytes + side_bytes; }
};
// Stored bits per value for head_dim D (codes + side, padding included).
double block_bits_per_value(const BlockSpec& b, int head_dim);
RowLayout block_layout(const BlockSpec& b, int head_dim);

// Where rotations / sketches come from: (seed, layer, kv_head, side) -> a
// per-block RNG seed. Identical on CPU and GPU (the GPU uploads the tables the
// CPU code builds from the same seed).
uint64_t derive_seed(uint64_t seed, int layer, int kv_head, Side side, uint64_t purpose);

// Everything a GPU kernel needs besides the packed rows, for one (layer,
// kv_head, side) block: upload these once and decode exactly as the CPU does.
struct BlockTables {
  std::string rotation_kind;          // "identity", "hadamard", "isoclinic", "rotor", "givens"
  std::vector<float> rotation;        // Rotation::table() (format in kv/rotation.hpp)
  std::vector<float> codebook;        // N-bit Lloyd-Max centroids (turbo, iso, rotor, planar), ascending
  std::vector<float> tcq_levels;      // tcq: 2^(N+1) union levels, index 4m + subset
  int tcq_memory = 0;                 // tcq: branch bits of state
  uint32_t tcq_g0 = 0, tcq_g1 = 0;    // tcq: subset generators
  std::vector<float> qjl_projection;  // +qjl: S, m x D row-major (m = D)
};

class Block {
 public:
  virtual ~Block() = default;
  int dim() const { return dim_; }
  const RowLayout& layout() const { return layout_; }
  const BlockSpec& spec() const { return spec_; }

  // Encode one row x[D] (original basis). Non-finite inputs are sanitised
  // first (NaN -> 0, +-Inf and |x| > 65504 -> +-65504), so every stored value
  // is finite; nothing outside this row's code/side bytes is written.
  virtual void encode(const float* x, uint8_t* code, uint8_t* side) const = 0;
  // The reconstruction in the block's rotated basis (D floats).
  virtual void decode_rotated(const uint8_t* code, const uint8_t* side, float* y) const = 0;
  // Basis change y = R x and its inverse x = R^T y (D floats each).
  virtual void rotate(const float* x, float* y) const = 0;
  virtual void unrotate(const float* y, float* x) const = 0;
  // Reconstruction in the original basis: unrotate(decode_rotated(...)).
  void decode(const uint8_t* code, const uint8_t* side, float* x) const;
  // Rotation, codebooks and sketch of this block (for the GPU upload).
  virtual BlockTables tables() const = 0;

  // --- attention primitives (the algorithm the GPU runs) ---
  // K side: from the rotated query q_rot[D] build the per-query state used by
  // dot_rows (q_rot itself, plus e.g. the QJL projection S q_rot).
  virtual void prepare_query(const float* q_rot, std::vector<float>& qstate) const;
  // For nq queries (query j's state at qstate + j*qstride) and n consecutive
  // rows (row t at code + t*code_stride, side + t*side_stride):
  // out[j*n + t] = <q_j, k_hat_t>, each row decoded once for all nq queries
  // (a GQA group shares its KV head). Must equal dot(q_rot, decode_rotated(row))
  // up to float rounding.
  virtual void dot_rows(const float* qstate, size_t qstride, int nq, const uint8_t* code, size_t code_stride,
                        const uint8_t* side, size_t side_stride, int n, float* out) const = 0;
  // V side: acc_rot[j*D + i] += sum_t p[j*pstride + t] * decode_rotated(row t)[i].
  virtual void accumulate_rows(const float* p, size_t pstride, int nq, const uint8_t* code, size_t code_stride,
                               const uint8_t* side, size_t side_stride, int n, float* acc_rot) const = 0;

  // Single-query conveniences.
  void dot_rows(const float* qstate, const uint8_t* code, size_t code_stride, const uint8_t* side,
                size_t side_stride, int n, float* out) const {
    dot_rows(qstate, 0, 1, code, code_stride, side, side_stride, n, out);
  }
  void accumulate_rows(const float* p, const uint8_t* code, size_t code_stride, const uint8_t* side,
                       size_t side_stride, int n, float* acc_rot) const {
    accumulate_rows(p, 0, 1, code, code_stride, side, side_stride, n, acc_rot);
  }

 protected:
  Block(BlockSpec spec, int dim, RowLayout layout)
      : spec_(std::move(spec)), dim_(dim), layout_(layout) {}
  BlockSpec spec_;
  int dim_;
  RowLayout layout_;
};

// Build the block for one (layer, kv_head, side). Throws kvq::Error for an
// unsupported combination (e.g. +qjl on a V side, turbo with a head_dim that
// is not a power of two).
std::unique_ptr<Block> make_block(const BlockSpec& spec, int head_dim, uint64_t seed, int layer,
                                  int kv_head, Side side);

// Sanitise one input value as documented above.
inline float sanitize_value(float x) {
  if (!(x == x)) return 0.0f;  // NaN
  if (x > 65504.0f) return 65504.0f;
  if (x < -65504.0f) return -65504.0f;
  return x;
}

}  // namespace kvq::kv
