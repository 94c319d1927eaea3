// Programmatic dependent launch (Hopper): a decode step is a chain of ~250
// small kernels, each of which would otherwise wait for its predecessor to
// drain completely before its own CTAs are even scheduled (~1-2 us per link,
// a large share of a step). A kernel launched with launch_dependent() may
// start while its predecessor is still running; it must call
// wait_for_predecessor() before it reads anything the predecessor (or any
// earlier kernel) wrote, or writes anything they read. Work that depends on
// nothing in flight — loading weights — goes before the wait and so overlaps
// the predecessor's tail. Every such kernel also calls allow_dependents()
// early so that its own successor can be scheduled as soon as SMs free up.
//
// Safety of the chain: wait_for_predecessor() returns only once the
// predecessor grid has completed and its writes are visible; the predecessor
// itself completed only after its own wait returned, so the guarantee is
// transitive back to every earlier kernel. In a kernel launched normally both
// calls are no-ops. KernelSettings::dependent_launches = false
// (BackendOptions, the CLI's --no-pdl) launches everything normally, for A/B
// measurements.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/device_context.hpp"

namespace kvq::cuda {

__device__ __forceinline__ void wait_for_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream
// serialization allowed (see above) when ctx's settings allow it; checks the
// launch.
template <typename... Params, typename... Args>
void launch_dependent(const DeviceContext& ctx, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = ctx.settings.dependent_launches ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  KVQ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace kvq::cuda
