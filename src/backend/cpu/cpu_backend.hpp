// The CPU backend: Backend ops on host memory through the reference kernels.
#pragma once

#include <memory>

#include "backend/backend.hpp"

namespace kvq::cpu {

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace kvq::cpu
