#include "rotation_test_kernels.hpp"

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/kv_rotation.cuh"

namespace kvq::gputest {
namespace {

__global__ void rotate_rows_kernel(cuda::RotationKind kind, const float* table, const float* x, float* y, int D,
                                   bool inverse, bool via_shared) {
  __shared__ float buf[256];
  const int lane = int(threadIdx.x), row = int(blockIdx.x);
  const float* xr = x + size_t(row) * D;
  float* yr = y + size_t(row) * D;
  if (via_shared) {
    for (int d = lane; d < D; d += 32) buf[d] = xr[d];
    cuda::warp_rotate_row(kind, table, buf, buf, D, lane, inverse);
    for (int d = lane; d < D; d += 32) yr[d] = buf[d];
  } else {
    cuda::warp_rotate_row(kind, table, xr, yr, D, lane, inverse);
  }
}

}  // namespace

void rotate_rows_on_gpu(cuda::RotationKind kind, const float* table, const float* x, float* y, int n, int D,
                        bool inverse, bool via_shared) {
  KVQ_CHECK(D > 0 && D <= 256, Errc::internal, "rotate_rows_on_gpu: D ", D);
  rotate_rows_kernel<<<n, 32>>>(kind, table, x, y, D, inverse, via_shared);
  KVQ_CUDA_CHECK_LAUNCH();
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace kvq::gputest
