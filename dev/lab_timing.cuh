// Shared timing helpers for the kernel lab (dev/*.cu): CUDA-event medians
// after warm-up, and the device-to-device copy bandwidth used as the ceiling.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/device_buffer.hpp"

namespace kvq::lab {

inline double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of `iters` timed calls of f() after `warmup` untimed
// ones; before() runs ahead of each call, outside the timed span (an L2 flush
// for cold-cache timings).
template <typename F, typename B>
double time_ms(F&& f, int iters, int warmup, B&& before) {
  cudaEvent_t e0, e1;
  KVQ_CUDA_CHECK(cudaEventCreate(&e0));
  KVQ_CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < warmup; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    before();
    cudaEventRecord(e0);
    f();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    t.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  KVQ_CUDA_CHECK(cudaGetLastError());
  return median(t);
}
template <typename F>
double time_ms(F&& f, int iters, int warmup = 2) {
  return time_ms(f, iters, warmup, [] {});
}

// Evicts L2 (H200: 50 MB) by writing a larger buffer: the state a decode
// step's attention finds its KV rows in, after the other layers and weights.
class L2Flush {
 public:
  explicit L2Flush(size_t bytes = size_t(256) << 20) : buf_(bytes) {}
  void operator()() { KVQ_CUDA_CHECK(cudaMemsetAsync(buf_.data(), ++round_, buf_.size())); }

 private:
  cuda::DeviceBuffer<uint8_t> buf_;
  int round_ = 0;
};

// Device-to-device copy of `bytes`, counting bytes read plus written, in GB/s.
inline double copy_bandwidth_gbs(size_t bytes = size_t(1) << 30) {
  cuda::DeviceBuffer<uint8_t> a(bytes), b(bytes);
  const double ms = time_ms(
      [&] { KVQ_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice)); }, 6);
  return 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
}

}  // namespace kvq::lab
