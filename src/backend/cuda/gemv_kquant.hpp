// GEMV for K-quant weights (Q2_K..Q6_K), serving gemv() (gemv.hpp) for those
// types with the same request: optional RMSNorm prologue, up to three
// matrices of one type and width, store / residual add / SwiGLU epilogues.
//
// Like the Q8_0/Q4_0/Q1_0 kernels (gemv.cu), the input is staged as int8 per
// 32 values (gemv_stage.cuh; code sums per 16), so each result differs from
// the CPU reference by the rounding of u (at most half a step per element)
// and the order of the fp32 sums. Each run of 16 weights (one scale, one min
// or offset) is a dp4a sum of its codes as bytes, scaled once in fp32
// (gemv_kquant.cu). A task is one row (SwiGLU: the same row of gate and of
// up); the lanes split each 256-weight super-block, every lane reading its
// part of the record with 16-byte loads:
//   Q4_K, Q5_K, Q6_K: 8 lanes per super-block, 32 weights each (one 16-byte
//     chunk of nibbles, plus Q5_K's high-bit chunk or Q6_K's high-bit and
//     scale chunks); a warp step covers 4 super-blocks per record held;
//   Q2_K, Q3_K: 4 lanes per super-block, 64 weights each; a warp step covers
//     8 per record held.
// A lane holds 1-4 records per matrix and step and loads the next step (of
// its task or its next task) before computing the current one; the first
// step is loaded before the kernel waits for the producer of x
// (dependent_launch.cuh), as in gemv.cu.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/gemv.hpp"

namespace kvq::cuda {

// gemv() for a K-quant request (req.out[0].w->type is Q2_K..Q6_K); checks the
// request like gemv() does.
void gemv_kquant(const GemvRequest& req, cudaStream_t stream, const DeviceContext& ctx = default_context());

}  // namespace kvq::cuda
