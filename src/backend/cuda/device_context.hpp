// What a kernel launch needs to know beyond its arguments: which device it
// runs on, that device's facts (SM count, properties, the kernels' raised
// shared-memory limits and occupancy), and the backend's kernel settings
// (BackendOptions' kernel fields and the kernel lab's knobs).
//
// Each CudaBackend owns one DeviceContext and passes it to every launch
// helper; nothing about launches is process-wide, so two backends (two
// devices, or one device with different options for an A/B) do not change
// each other. The device facts are the exception by design: they belong to
// the device, not to a backend, and are shared by every context of that
// device (kernel_resources.hpp says why).
//
// Launch helpers take the context as their last argument, defaulting to
// default_context(): the current device with default settings, for callers
// without a backend (tests, the lab's reference runs). It cannot be changed,
// so it is no hidden global knob.
//
// Settings are read when a launch is issued: a recorded step (CUDA graph)
// keeps the values it was recorded with.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/kernel_resources.hpp"

namespace kvq::cuda {

struct KernelSettings {
  // Programmatic dependent launch (dependent_launch.cuh); false launches
  // every kernel normally, for A/B runs (BackendOptions::dependent_launches,
  // the CLI's --no-pdl).
  bool dependent_launches = true;
  // Warps per CTA of the GEMV kernels (dp4a, float and K-quant), 1..16. 16
  // (one or two CTAs per SM) stages the input in fewer CTAs than 8 (three or
  // four per SM): the bonsai-8b GEMVs of a decode step take 1.08 instead of
  // 1.22 ms (docs/perf.md). BackendOptions::gemv_warps.
  int gemv_warps = 16;
  // Tiles per warp whose K and V rows the decode attention kernel asks L2
  // for before waiting for its predecessor (0: none), 0..8.
  // BackendOptions::attn_prefetch_tiles.
  int attn_prefetch_tiles = 1;
  // CTAs the decode split count leaves out of the resident wave for the
  // store's encode running beside a fused-q launch (flash_decode_splits).
  // Kernel lab knob (an A/B of the split count).
  int decode_split_reserve = 8;
  // The prefill attention of head_dim 128 on its Hopper kernel (wgmma, in
  // sm_90a builds on a compute-capability 9.0 device); false: the mma.sync
  // kernel, for A/B runs and tests (BackendOptions::prefill_wgmma, the CLI's
  // --no-wgmma-prefill).
  bool prefill_wgmma = true;
  // Largest thread-block cluster (K slices per m-tile) the tensor-core
  // batched GEMM may use, 1..8. 4 by measurement (H200 lab, bonsai-8b
  // layer, session 13): the O and down launches, which took clusters of 8,
  // ran 3.5-3.8 us faster with 4 at every B; 2 and 1 were slower. Kernel
  // lab knob (KVQ_LAB_MAX_CLUSTER).
  int gemm_tc_max_cluster = 4;
  // Kernel lab timelines (lab_trace.cuh), null: none. decode_trace: 12 device
  // uint64 the decode attention folds its CTAs' global-timer readings into
  // (min/max pairs: CTA start, wait returned, Q fragments built, key loop
  // done, arrival counted, merge done). qk_rope_store_trace: 4 (wait
  // returned, row stored).
  unsigned long long* decode_trace = nullptr;
  unsigned long long* qk_rope_store_trace = nullptr;
};

struct DeviceFacts;  // device_context.cpp: one per device, shared

class DeviceContext {
 public:
  // The context of `device` (a CUDA device id) with `settings`; the device's
  // facts are read on the first context of that device in the process.
  explicit DeviceContext(int device, const KernelSettings& settings = {});

  int device() const { return device_; }
  // Streaming multiprocessors (132 on an H200): kernels size their grids to fill them.
  int sm_count() const;
  const cudaDeviceProp& properties() const;
  // Raised shared-memory limits and occupancy of this device's kernels.
  KernelResources& kernels() const;

  // Makes this context's device current for the calling thread (backend
  // entry points: cudaFuncSetAttribute, allocations and launches apply to
  // the current device). Cheap when it already is.
  void make_current() const;

  KernelSettings settings;

 private:
  int device_;
  DeviceFacts* facts_;
};

// The current device's context with default settings (see the top).
const DeviceContext& default_context();

// The calling thread's current CUDA device.
int current_device();

}  // namespace kvq::cuda
