// The caches behind a launch's sizing, one set per device: a kernel's raised
// dynamic shared-memory limit (cudaFuncAttributeMaxDynamicSharedMemorySize)
// and its resident CTAs per SM. Both are facts of (device, kernel): the
// attribute is set on the current device only, and a second GPU may differ.
// So each device has one KernelResources (device_context.hpp), shared by
// every backend on that device: two caches for one device could each set the
// limit and one could LOWER what the other relies on (a later launch that
// needs the larger limit then fails).
//
// Pure logic over the CUDA calls it is given (set a limit, query occupancy),
// without CUDA headers, so it is tested on the CPU
// (tests/test_kernel_resources.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>

namespace kvq::cuda {

class KernelResources {
 public:
  // Raises the kernel's dynamic shared-memory limit to `smem` bytes with
  // set_limit(smem), unless an earlier call raised it at least that far: the
  // limit only ever grows.
  template <typename SetLimit>
  void raise_limit(const void* kernel, size_t smem, SetLimit&& set_limit) {
    std::lock_guard<std::mutex> lock(mu_);
    raise_locked(kernel, smem, set_limit);
  }

  // Resident CTAs per SM of `kernel` at `threads` per CTA and `smem` bytes,
  // with the limit raised first; cached per (kernel, threads) for the largest
  // smem asked so far, so a smaller request gets the (no larger) count of the
  // larger one and a grid sized by it still fits one wave. Raised at least
  // once even below 48 KiB: static shared memory counts against the default
  // limit too. query(smem) returns the CUDA occupancy answer.
  template <typename SetLimit, typename Query>
  int resident_ctas_for_largest(const void* kernel, size_t smem, int threads, SetLimit&& set_limit, Query&& query) {
    std::lock_guard<std::mutex> lock(mu_);
    Grown& e = grown_[{kernel, threads}];
    if (smem > e.smem) {
      raise_locked(kernel, smem, set_limit);
      e.ctas = std::max(1, int(query(smem)));
      e.smem = smem;
    }
    return e.ctas;
  }

  // Resident CTAs per SM of `kernel` at exactly (threads, smem), queried once
  // (at least 1). The caller raises the limit first where smem needs it.
  template <typename Query>
  int resident_ctas(const void* kernel, int threads, size_t smem, Query&& query) {
    std::lock_guard<std::mutex> lock(mu_);
    int& n = exact_[{kernel, threads, smem}];
    if (n == 0) n = std::max(1, int(query()));
    return n;
  }

  // The limit raised so far for a kernel (0: never raised).
  size_t limit(const void* kernel) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = limit_.find(kernel);
    return it == limit_.end() ? 0 : it->second;
  }

 private:
  struct Grown {
    size_t smem = 0;
    int ctas = 1;
  };
  template <typename SetLimit>
  void raise_locked(const void* kernel, size_t smem, SetLimit& set_limit) {
    size_t& raised = limit_[kernel];
    if (smem > raised) {
      set_limit(smem);
      raised = smem;
    }
  }

  mutable std::mutex mu_;
  std::map<const void*, size_t> limit_;
  std::map<std::pair<const void*, int>, Grown> grown_;
  std::map<std::tuple<const void*, int, size_t>, int> exact_;
};

// One T per device id, made by make(device) on first use and never moved or
// freed while the process runs (references stay valid; a device's kernel
// facts outlive any backend on it).
template <typename T>
class PerDevice {
 public:
  template <typename Make>
  T& at(int device, Make&& make) {
    std::lock_guard<std::mutex> lock(mu_);
    std::unique_ptr<T>& p = by_device_[device];
    if (!p) p = make(device);
    return *p;
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return by_device_.size();
  }

 private:
  mutable std::mutex mu_;
  std::map<int, std::unique_ptr<T>> by_device_;
};

}  // namespace kvq::cuda
