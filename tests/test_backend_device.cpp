// --device wiring: make_backend("cuda") is a working backend only in a CUDA
// build on a machine with a GPU, and otherwise a clear Errc::unsupported
// error; Backend::make_cache gives each backend its own KV cache.
#include <gtest/gtest.h>

#include <string>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "kv/cache.hpp"
#ifdef KVQ_HAVE_CUDA
#include "backend/cuda/cuda_check.hpp"
#endif

using namespace kvq;

namespace {

bool gpu_present() {
#ifdef KVQ_HAVE_CUDA
  return cuda::device_available();
#else
  return false;
#endif
}

TEST(BackendDevice, CudaIsRealOrAClearError) {
  if (gpu_present()) {
    auto be = make_backend("cuda");
    EXPECT_STREQ(be->name(), "cuda");
    return;
  }
  try {
    make_backend("cuda");
    FAIL() << "--device cuda without a GPU must fail";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported);
    EXPECT_NE(std::string(e.what()).find("CUDA backend is not available"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--device cpu"), std::string::npos) << e.what();
  }
}

TEST(BackendDevice, UnknownDeviceListsTheValidOnes) {
  try {
    make_backend("tpu");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("cpu, cuda"), std::string::npos) << e.what();
  }
}

TEST(BackendDevice, CpuBackendMakesTheCpuCache) {
  auto be = make_backend("cpu");
  kv::CodecOptions o;
  o.kv = "k8v4";
  auto cache = be->make_cache(o, kv::CacheShape{2, 2, 64, 8});
  EXPECT_EQ(cache->codec_name(), "k8v4");
  EXPECT_EQ(cache->shape().max_tokens, 8);
}

}  // namespace
