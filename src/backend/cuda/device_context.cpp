#include "backend/cuda/device_context.hpp"

#include <memory>

#include "backend/cuda/cuda_check.hpp"

namespace kvq::cuda {

struct DeviceFacts {
  int sm_count = 0;
  cudaDeviceProp properties{};
  KernelResources kernels;
};

namespace {

PerDevice<DeviceFacts>& all_facts() {
  static PerDevice<DeviceFacts> facts;
  return facts;
}

std::unique_ptr<DeviceFacts> read_facts(int device) {
  auto f = std::make_unique<DeviceFacts>();
  KVQ_CUDA_CHECK(cudaGetDeviceProperties(&f->properties, device));
  KVQ_CUDA_CHECK(cudaDeviceGetAttribute(&f->sm_count, cudaDevAttrMultiProcessorCount, device));
  return f;
}

}  // namespace

DeviceContext::DeviceContext(int device, const KernelSettings& s)
    : settings(s), device_(device), facts_(&all_facts().at(device, read_facts)) {}

int DeviceContext::sm_count() const { return facts_->sm_count; }
const cudaDeviceProp& DeviceContext::properties() const { return facts_->properties; }
KernelResources& DeviceContext::kernels() const { return facts_->kernels; }

void DeviceContext::make_current() const {
  int now = -1;
  KVQ_CUDA_CHECK(cudaGetDevice(&now));
  if (now != device_) KVQ_CUDA_CHECK(cudaSetDevice(device_));
}

int current_device() {
  int dev = 0;
  KVQ_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

const DeviceContext& default_context() {
  static PerDevice<DeviceContext> defaults;
  return defaults.at(current_device(), [](int device) { return std::make_unique<DeviceContext>(device); });
}

}  // namespace kvq::cuda
