// Default implementations of Backend's optional capabilities (backend.hpp).
#include "backend/backend.hpp"

#include <cmath>
#include <vector>

#include "core/error.hpp"

namespace kvq {

int32_t Backend::argmax(const float* x, size_t n) {
  KVQ_CHECK(n > 0, Errc::internal, "argmax over an empty vector");
  std::vector<float> host(n);
  download(x, host.data(), n);
  // The greedy Sampler's rule: NaN counts as -inf, the lowest index wins ties.
  auto value = [&](size_t i) { return std::isnan(host[i]) ? -INFINITY : host[i]; };
  size_t best = 0;
  for (size_t i = 1; i < n; ++i)
    if (value(i) > value(best)) best = i;
  return int32_t(best);
}

namespace {
[[noreturn]] void no_step_graphs(const char* backend) {
  fail(Errc::unsupported, "the ", backend, " backend cannot record decode steps (check supports_step_graphs() first)");
}
}  // namespace

void Backend::begin_step(int32_t, int) { no_step_graphs(name()); }
void Backend::record_begin() { no_step_graphs(name()); }
std::unique_ptr<StepGraph> Backend::record_end() { no_step_graphs(name()); }
bool Backend::replay(const StepGraph&, kv::Cache&) { no_step_graphs(name()); }

}  // namespace kvq
