// CUDA error checking in kvq's error vocabulary: a failing runtime/cuBLAS call
// or kernel launch throws kvq::Error(Errc::cuda) naming the call, file and line.
#pragma once

#include <cuda_runtime.h>

#include "core/error.hpp"

#define KVQ_CUDA_CHECK(call)                                                                  \
  do {                                                                                        \
    const cudaError_t kvq_err_ = (call);                                                      \
    if (kvq_err_ != cudaSuccess)                                                              \
      ::kvq::fail(::kvq::Errc::cuda, #call, " failed: ", cudaGetErrorString(kvq_err_), " (", \
                  __FILE__, ":", __LINE__, ")");                                              \
  } while (0)

// After a kernel launch: launch-configuration errors surface here.
#define KVQ_CUDA_CHECK_LAUNCH() KVQ_CUDA_CHECK(cudaGetLastError())

namespace kvq::cuda {

// True when a CUDA device is present and usable (GPU tests skip otherwise).
inline bool device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace kvq::cuda
