// GEMV for K-quant weights (Q2_K..Q6_K), serving gemv() (gemv.hpp) for those
// types with the same request: optional RMSNorm prologue, up to three
// matrices of one type and width, store / residual add / SwiGLU epilogues.
//
// Unlike the Q8_0/Q4_0/Q1_0 kernels, the input is staged in fp32 (not rounded
// to int8) and each weight is dequantized exactly as the CPU reference does
// ((d * sc) * q - dmin * m in fp32, kquant.cuh), so the only difference from
// the CPU is the order of the fp32 sums. A warp takes one row at a time; the
// lanes split each 256-weight super-block, every lane reading its part of the
// record with 16-byte loads:
//   Q4_K, Q5_K, Q6_K: 8 lanes per super-block, 32 weights each (one 16-byte
//     chunk of nibbles, plus Q5_K's high-bit chunk or Q6_K's high-bit and
//     scale chunks); a warp step covers 4 super-blocks;
//   Q2_K, Q3_K: 4 lanes per super-block, 64 weights each; a warp step covers 8.
// Correctness first: no software pipelining beyond two super-blocks per lane
// in flight (docs/perf.md has the measured bandwidth).
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/gemv.hpp"

namespace kvq::cuda {

// gemv() for a K-quant request (req.out[0].w->type is Q2_K..Q6_K); checks the
// request like gemv() does.
void gemv_kquant(const GemvRequest& req, cudaStream_t stream, const DeviceContext& ctx = default_context());

}  // namespace kvq::cuda
