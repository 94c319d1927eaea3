// The online-softmax state (m, l, o) and its merge, written once for every
// attention kernel (split-KV decode, prefill key chunks, the CUDA-core
// fallback). Scores are in log2 units everywhere (q pre-multiplied by
// scale * log2 e), so probabilities are exp2(s - m).
//
// A partial state of one query row over a key range: m = max score, l = sum
// of exp2(s - m), o = sum of exp2(s - m) v (unnormalised). States merge as
//   M = max_c m_c,  w_c = exp2(m_c - M) (0 for an empty range, m_c = -inf),
//   L = sum_c w_c l_c,  o = sum_c w_c o_c / L.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace kvq::cuda {

// Weight of a partial state with maximum m in a merge whose maximum is M.
__device__ __forceinline__ float merge_weight_log2(float m, float M) { return m == -INFINITY ? 0.0f : exp2f(m - M); }

// Merge of N states held by one thread: set m[], call finish_max(), then
// weight(i) for each state.
template <int N>
struct SoftmaxMerge {
  float m[N];
  float M = -INFINITY;
  __device__ __forceinline__ void finish_max() {
#pragma unroll
    for (int i = 0; i < N; ++i) M = fmaxf(M, m[i]);
  }
  __device__ __forceinline__ float weight(int i) const { return merge_weight_log2(m[i], M); }
};

// out[r][:] = the merge of the n_chunks partial states of row r, for rows
// r < rows. Layout: part_m, part_l [rows][n_chunks]; part_o
// [rows][n_chunks][D]. One launch on `stream`.
void merge_partial_states(const float* part_m, const float* part_l, const float* part_o, int rows, int n_chunks,
                          int D, float* out, cudaStream_t stream);

}  // namespace kvq::cuda
