#include "wgmma_test_kernels.hpp"

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/ptx.cuh"
#include "backend/cuda/wgmma.cuh"
#include "core/error.hpp"

namespace kvq::gputest {
namespace {

using cuda::ptx::smem_u32;

// Every loop that touches an accumulator is unrolled: the accumulators must
// stay in registers while a wgmma writes them asynchronously.

// Element offset of (row, 16-byte chunk) of a [64][128] bf16 tile stored as
// two [64][64] blocks of 128-byte rows, chunk c & 7 at (c & 7) ^ (row & 7).
__device__ int sw128(int row, int chunk) {
  return (chunk >> 3) * (64 * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// A row-major [64][128] bf16 tile from global memory into that layout.
__device__ void stage_tile(const uint16_t* src, uint16_t* dst) {
  for (int e = int(threadIdx.x); e < 64 * 16; e += 128) {
    const int r = e / 16, c = e % 16;
    *reinterpret_cast<uint4*>(dst + sw128(r, c)) = *reinterpret_cast<const uint4*>(src + r * 128 + c * 8);
  }
}

__global__ void probe_kernel(int* built) {
#if defined(KVQ_WGMMA_DEVICE)
  *built = 1;
#else
  *built = 0;
#endif
}

__global__ void __launch_bounds__(128) qk_kernel(const uint16_t* a, const uint16_t* b, float* c) {
#if defined(KVQ_WGMMA_DEVICE)
  __shared__ __align__(1024) uint16_t sa[64 * 128];
  __shared__ __align__(1024) uint16_t sb[64 * 128];
  stage_tile(a, sa);
  stage_tile(b, sb);
  cuda::wgmma::fence_proxy_async();
  __syncthreads();
  float d[32];
  cuda::wgmma::fence();
#pragma unroll
  for (int kc = 0; kc < 8; ++kc) {
    const uint32_t off = (kc >> 2) * 8192 + (kc & 3) * 32;
    cuda::wgmma::mma_m64n64k16_ss(d, cuda::wgmma::desc_sw128(smem_u32(sa) + off, 16, 1024),
                                  cuda::wgmma::desc_sw128(smem_u32(sb) + off, 16, 1024), kc > 0);
  }
  cuda::wgmma::commit();
  cuda::wgmma::wait<0>();
  cuda::wgmma::fence_operands(d);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, gid = lane / 4, tig = lane % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[(16 * warp + gid + 8 * (e / 2)) * 64 + 8 * j + 2 * tig + e % 2] = d[4 * j + e];
#endif
}

__global__ void __launch_bounds__(128) pv_kernel(const uint16_t* p, const uint16_t* v, float* c) {
#if defined(KVQ_WGMMA_DEVICE)
  __shared__ __align__(1024) uint16_t sv[64 * 128];
  stage_tile(v, sv);
  cuda::wgmma::fence_proxy_async();
  __syncthreads();
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, gid = lane / 4, tig = lane % 4;
  const int lo = 16 * warp + gid, hi = lo + 8;
  // Two bf16 of row r from column k: the lower column in the low half.
  auto pair = [p](int r, int k) { return uint32_t(p[r * 64 + k]) | (uint32_t(p[r * 64 + k + 1]) << 16); };
  float d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.0f;
  uint32_t frag[4][4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int k = 16 * s + 2 * tig;
    frag[s][0] = pair(lo, k);
    frag[s][1] = pair(hi, k);
    frag[s][2] = pair(lo, k + 8);
    frag[s][3] = pair(hi, k + 8);
  }
  cuda::wgmma::fence();  // after every register the products read is written
#pragma unroll
  for (int s = 0; s < 4; ++s)
    cuda::wgmma::mma_m64n128k16_rs_nmajor(d, frag[s], cuda::wgmma::desc_sw128(smem_u32(sv) + s * 2048, 8192, 1024));
  cuda::wgmma::commit();
  cuda::wgmma::wait<0>();
  cuda::wgmma::fence_operands(d);
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[(lo + 8 * (e / 2)) * 128 + 8 * j + 2 * tig + e % 2] = d[4 * j + e];
#endif
}

}  // namespace

bool wgmma_device_code() {
  int device = 0, major = 0, minor = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&device));
  KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0) return false;  // sm_90a code runs on 9.0 only
  int* built = nullptr;
  KVQ_CUDA_CHECK(cudaMallocManaged(&built, sizeof(int)));
  *built = 0;
  probe_kernel<<<1, 1>>>(built);
  KVQ_CUDA_CHECK_LAUNCH();
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
  const bool yes = *built == 1;
  KVQ_CUDA_CHECK(cudaFree(built));
  return yes;
}

void wgmma_qk_product(const uint16_t* a, const uint16_t* b, float* c) {
  qk_kernel<<<1, 128>>>(a, b, c);
  KVQ_CUDA_CHECK_LAUNCH();
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
}

void wgmma_pv_product(const uint16_t* p, const uint16_t* v, float* c) {
  pv_kernel<<<1, 128>>>(p, v, c);
  KVQ_CUDA_CHECK_LAUNCH();
  KVQ_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace kvq::gputest
