#include "bench/run_meta.hpp"

#include <unistd.h>

#include <array>
#include <cstdio>
#include <ctime>

#include "backend/backend.hpp"
#include "kvq_build_info.hpp"  // generated at build time (cmake/build_info.cmake)

namespace kvq::bench {

std::string git_sha() { return KVQ_GIT_SHA; }

std::string build_type() { return KVQ_BUILD_TYPE; }

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::array<char, 32> buf{};
  std::strftime(buf.data(), buf.size(), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf.data();
}

RunMeta collect_run_meta(Backend& backend, bool measure_bandwidth) {
  RunMeta m;
  m.device = backend.name();
  m.git_sha = git_sha();
  m.build_type = build_type();
  m.kvq_version = KVQ_VERSION;
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) == 0) m.host = host.data();
  const DeviceInfo d = backend.device_info();
  m.gpu_name = d.name;
  m.driver = d.driver;
  m.clocks = d.clocks;
  if (measure_bandwidth) m.copy_bw_gbs = backend.measure_copy_bandwidth() / 1e9;
  m.started_at = utc_now();
  return m;
}

}  // namespace kvq::bench
