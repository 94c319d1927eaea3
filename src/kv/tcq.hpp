// Trellis-coded quantization (TCQ) for the tcq2 / tcq3 blocks.
//
// The trellis is a shift register ("bitshift" trellis): the state before
// position i is the last `memory` branch bits (b_{i-1} .. b_{i-memory}), so a
// decoder finds the state of any position from the packed branch bits near it,
// with no sequential scan: decode is fully parallel on the GPU.
//
// Per position i the encoder emits N bits: one branch bit b_i and N-1 level
// bits m_i. The union codebook has 2^(N+1) levels split into 4 subsets
// (Ungerboeck-style set partitioning: level index u = 4 m + j belongs to
// subset j). The subset used at position i is a rate-1/2 convolutional code of
// the window w_i = b_i | b_{i-1} << 1 | ... | b_{i-memory} << memory
// (b_{<0} = 0): j = 2 parity(w & g1) + parity(w & g0). The value is
// levels[4 m_i + j]. Viterbi encode over the row finds the minimum squared
// error path (starting in state 0, free end).
//
// The union codebook was optimised (Lloyd iterations on Viterbi-encoded
// Gaussian training rows, deterministic seed; design_tcq() below) and is
// tabulated in tcq.cpp; a test checks the table is a fixed point of that
// iteration.
#pragma once

#include <cstdint>
#include <vector>

namespace kvq::kv {

struct TcqTrellis {
  int bits = 0;    // N: bits per value
  int memory = 0;  // branch bits of state; 2^memory states
  uint32_t g0 = 0, g1 = 0;  // generator taps over the (memory+1)-bit window
  std::vector<float> levels;  // 2^(N+1) union levels for a unit-variance source, index 4m + subset
  int subset(uint32_t window) const;
  int states() const { return 1 << memory; }
};

// The tabulated trellis for tcq2 / tcq3. In both, bit 5 of the window is a
// tap of g1 and not of g0: subset(w | 32) = subset(w) ^ 2 for w < 32 (the GPU
// encoder relies on it and traps otherwise).
const TcqTrellis& tcq_trellis(int bits);

// Viterbi encode of x[n] (unit-variance scale). branch[i] in {0,1}, level[i]
// in [0, 2^(N-1)). Returns the squared error of the chosen path.
double tcq_encode(const TcqTrellis& t, const float* x, int n, uint8_t* branch, uint8_t* level);
// Decode one position from its window of branch bits (the GPU's formula).
inline float tcq_value(const TcqTrellis& t, uint32_t window, unsigned level) {
  return t.levels[4 * level + unsigned(t.subset(window))];
}
void tcq_decode(const TcqTrellis& t, const uint8_t* branch, const uint8_t* level, int n, float* out);

struct TcqDesignResult {
  TcqTrellis trellis;
  double mse = 0;  // per value on the training rows after the last iteration
  double sqnr_db() const;
};
// Lloyd-style optimisation of the union codebook: Viterbi-encode n_rows
// Gaussian rows of length row_len (kvq::Rng(seed)), move every level to the
// mean of the samples coded to it, repeat `iterations` times.
TcqDesignResult design_tcq(TcqTrellis start, int n_rows, int row_len, int iterations, uint64_t seed);
// The classic starting point: the (N+1)-bit Lloyd-Max codebook as union codebook.
TcqTrellis tcq_initial(int bits, int memory, uint32_t g0, uint32_t g1);
// The run that produced the tabulated trellis (a few seconds).
TcqDesignResult design_tcq_default(int bits);

}  // namespace kvq::kv
