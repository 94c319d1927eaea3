// The CUDA backend: Backend ops on device memory (H200, sm_90).
//
// Weights are uploaded once in their stored type (gpu_layout.hpp packing);
// the Matrix returned by upload() has data = the device codes and handle =
// the backend-owned GpuMatrix. Decode (n == 1) uses the GEMV
// kernels; prefill (n > 1) dequantizes row blocks into a bounded bf16 tile and
// calls cuBLAS (bf16 x bf16, fp32 accumulate). Activations are fp32 device
// buffers; every op runs on the default stream, so ops are ordered and the
// only host synchronisation is download() (the logits).
#pragma once

#include <memory>

#include "backend/backend.hpp"

namespace kvq::cuda {

// Throws Errc::unsupported when no CUDA device is visible. The options are
// applied to the process-wide kernel settings (dependent launches, GEMV
// warps, attention prefetch): the last backend made sets them.
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options = {});

}  // namespace kvq::cuda
