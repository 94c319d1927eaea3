// The CUDA backend: Backend ops on device memory (H200, sm_90).
//
// Weights are uploaded once in their stored type (gpu_layout.hpp packing);
// the Matrix returned by upload() has data = the device codes and handle =
// the backend-owned GpuMatrix. Decode (n == 1) uses the GEMV
// kernels; prefill (n > 1) dequantizes row blocks into a bounded bf16 tile and
// calls cuBLAS (bf16 x bf16, fp32 accumulate). Activations are fp32 device
// buffers; every op runs on the backend's own stream (created blocking, so it
// also stays ordered with the legacy-stream copies of DeviceBuffer::upload),
// so ops are ordered and the only host synchronisation is download() (the
// logits), argmax() and the host-input copies.
#pragma once

#include <memory>

#include "backend/backend.hpp"

namespace kvq::cuda {

// Throws Errc::unsupported when no CUDA device is visible. device: the CUDA
// device id the backend runs on (-1: the calling thread's current device).
// The options' kernel fields go to the backend's own device context
// (device_context.hpp): backends in one process do not change each other.
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options = {}, int device = -1);

}  // namespace kvq::cuda
