// The input staging and the cross-task pipeline step that the batch-1
// decode GEMVs share (gemv.cu: float, Q8_0, Q4_0, Q1_0; gemv_kquant.cu:
// Q2_K..Q6_K). Internal to those two files.
//
// Staging: every CTA reads x (fp32, from L2), multiplies it by the norm
// weight when the request has a norm, and writes u into shared memory either
// as fp32 (float types) or rounded to int8 per group of 32 values
// (stage_int8.cuh's rounding, shared with the batched kernels), with the sum
// of the codes per
// kSumSpan values (32, or 16 for the K-quants whose scales and offsets
// change every 16 weights). Shared memory from 0, bytes:
//   int8  uq[cols] in 16-byte units, unit i stored at Swizzle::at(i)
//         (each kernel picks the permutation under which the 8 lanes of a
//         shared-memory phase read distinct banks);
//   float us[cols / 32]          scale of each 32 values;
//   int   usum[cols / kSumSpan]  code sum of each kSumSpan values;
// or float uf[cols]; then, with a norm, float g[cols] (the norm weight, copied
// by cp.async before the kernel waits for its predecessor).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/gemv_args.cuh"
#include "backend/cuda/stage_int8.cuh"

namespace kvq::cuda::gemv_detail {

// The staged input, as the per-type dot products read it.
struct Staged {
  const float* uf;   // float types
  const int4* uq;    // int8: 16-byte units (swizzled)
  const float* us;   // int8: scale per 32 values
  const int* usum;   // int8: code sum per kSumSpan values
};

__host__ __device__ constexpr size_t staged_input_bytes(bool int8, int sum_span, int cols) {
  return int8 ? size_t(cols) + size_t(cols / 32) * 4 + size_t(cols / sum_span) * 4 : size_t(cols) * 4;
}

__device__ __forceinline__ Staged staged_view(const unsigned char* smem, int cols) {
  Staged s;
  s.uf = reinterpret_cast<const float*>(smem);
  s.uq = reinterpret_cast<const int4*>(smem);
  s.us = reinterpret_cast<const float*>(smem + cols);
  s.usum = reinterpret_cast<const int*>(smem + cols + (cols / 32) * 4);
  return s;
}

// Staging reads x as float4s, kStageBatch independent loads per thread at a
// time (4096 columns: one batch per 256 threads), so it costs about one L2
// round trip per batch.
constexpr int kStageBatch = 4;

// The norm weight is a model weight (nothing in flight writes it): each
// thread copies the float4s it will use into shared memory (cp.async, no
// registers held) before the kernel waits for its predecessor.
__device__ __forceinline__ void prefetch_norm(const KernelArgs& a, float4* smem_g) {
  if (!a.norm) return;
  const float4* g4 = reinterpret_cast<const float4*>(a.norm);
  for (int i = threadIdx.x; i < a.cols / 4; i += blockDim.x) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_g + i));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(g4 + i) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Stages u = x (* norm) into shared memory; returns 1/rms (1 without a norm).
// smem_g holds the norm weight (prefetch_norm; each thread reads back only
// what it copied itself, so waiting for its own copies is enough). For int8
// the 8 lanes holding one group of 32 values find its amax by shuffles and
// the 8 (kSumSpan 32) or 4 (16) lanes of a code-sum span their sum.
// Swizzle: a type with static int at(int unit). cols is a multiple of 256.
template <bool kInt8, class Swizzle, int kSumSpan = 32>
__device__ float stage_input(const KernelArgs& a, unsigned char* smem, const float4* smem_g) {
  static_assert(kSumSpan == 16 || kSumSpan == 32, "code sums per 16 or 32 values");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int threads = blockDim.x;
  const int n4 = a.cols / 4;
  const float4* x4 = reinterpret_cast<const float4*>(a.x);
  if (a.norm) asm volatile("cp.async.wait_all;" ::: "memory");
  float ss = 0.0f;
  for (int base = 0; base < n4; base += threads * kStageBatch) {
    float4 v[kStageBatch];
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int i = base + b * threads + tid;
      v[b] = i < n4 ? x4[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int i = base + b * threads + tid;
      const float4 g = a.norm && i < n4 ? smem_g[i] : make_float4(1.f, 1.f, 1.f, 1.f);
      ss += v[b].x * v[b].x + v[b].y * v[b].y + v[b].z * v[b].z + v[b].w * v[b].w;
      const float4 u = make_float4(v[b].x * g.x, v[b].y * g.y, v[b].z * g.z, v[b].w * g.w);
      if constexpr (kInt8) {
        // cols is a multiple of 256, so all lanes of a warp are in range or none.
        if (base + b * threads + (tid & ~31) >= n4) continue;
        float scale;
        int q[4];
        quantize4_int8(u, scale, q);
        // Values 4i..4i+3: word (i % 4) of 16-byte unit i / 4.
        int* uq = reinterpret_cast<int*>(smem);
        uq[Swizzle::at(i >> 2) * 4 + (i & 3)] = pack_int8x4(q);
        int sum = q[0] + q[1] + q[2] + q[3];
#pragma unroll
        for (int o = kSumSpan / 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if ((lane & 7) == 0) reinterpret_cast<float*>(smem + a.cols)[i >> 3] = scale;
        if ((lane & (kSumSpan / 4 - 1)) == 0)
          reinterpret_cast<int*>(smem + a.cols + (a.cols / 32) * 4)[i / (kSumSpan / 4)] = sum;
      } else {
        if (i < n4) reinterpret_cast<float4*>(smem)[i] = u;
      }
    }
  }
  const float inv_rms = cta_inv_rms(ss, a, lane, warp, threads / 32);
  __syncthreads();
  return inv_rms;
}

// A warp's pipeline walks (task, step within the task), its tasks strided by
// the grid's warp count: the position after (task, step).
struct PipelineStep {
  int task, step;
};
__device__ __forceinline__ PipelineStep next_pipeline_step(int task, int step, int steps_per_task, int stride) {
  return step + 1 == steps_per_task ? PipelineStep{task + stride, 0} : PipelineStep{task, step + 1};
}

// The output segment (matrix of a multi-output request) that owns a task
// (task < a.n_tasks = the last segment's task_end).
__device__ __forceinline__ int segment_of(const KernelArgs& a, int task) {
  int seg = 0;
  while (task >= a.task_end[seg]) ++seg;
  return seg;
}

// The epilogue of a finished task's row: warp sums of the per-lane partial
// dot products, times 1/rms; lane 0 stores (or adds, or for a SwiGLU pair
// writes silu(gate) * up).
template <bool kPair>
__device__ __forceinline__ void finish_row(const KernelArgs& a, int seg, int row, float acc_gate, float acc_up,
                                           float inv_rms, int lane) {
  const float v0 = warp_sum(acc_gate) * inv_rms;
  if constexpr (kPair) {
    const float v1 = warp_sum(acc_up) * inv_rms;
    if (lane == 0 && row < a.rows[0]) a.y[0][row] = v0 / (1.0f + expf(-v0)) * v1;
  } else {
    if (lane == 0 && row < a.rows[seg]) {
      float* y = a.y[seg] + row;
      *y = a.epilogue == GemvEpilogue::add ? *y + v0 : v0;
    }
  }
}

}  // namespace kvq::cuda::gemv_detail
