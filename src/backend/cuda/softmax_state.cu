#include "backend/cuda/softmax_state.cuh"

#include <algorithm>

#include "backend/cuda/cuda_check.hpp"

namespace kvq::cuda {

namespace {

// One block per row.
__global__ void merge_kernel(const float* __restrict__ part_m, const float* __restrict__ part_l,
                             const float* __restrict__ part_o, int n_chunks, int D, float* __restrict__ out) {
  const size_t base = size_t(blockIdx.x) * n_chunks;
  float M = -INFINITY;
  for (int c = 0; c < n_chunks; ++c) M = fmaxf(M, part_m[base + c]);
  float L = 0.0f;
  for (int c = 0; c < n_chunks; ++c) L += part_l[base + c] * merge_weight_log2(part_m[base + c], M);
  const float inv_L = L > 0.0f ? 1.0f / L : 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int c = 0; c < n_chunks; ++c) {
      const float w = merge_weight_log2(part_m[base + c], M);
      if (w != 0.0f) acc += part_o[(base + c) * D + d] * w;
    }
    out[size_t(blockIdx.x) * D + d] = acc * inv_L;
  }
}

}  // namespace

void merge_partial_states(const float* part_m, const float* part_l, const float* part_o, int rows, int n_chunks,
                          int D, float* out, cudaStream_t stream) {
  if (rows <= 0) return;
  merge_kernel<<<unsigned(rows), std::min(D, 128), 0, stream>>>(part_m, part_l, part_o, n_chunks, D, out);
  KVQ_CUDA_CHECK_LAUNCH();
}

}  // namespace kvq::cuda
