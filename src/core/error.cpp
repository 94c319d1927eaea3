#include "core/error.hpp"

namespace kvq {

const char* errc_name(Errc c) {
  switch (c) {
    case Errc::invalid_argument: return "invalid argument";
    case Errc::io: return "I/O error";
    case Errc::format: return "format error";
    case Errc::unsupported: return "unsupported";
    case Errc::out_of_range: return "out of range";
    case Errc::cuda: return "CUDA error";
    case Errc::internal: return "internal error";
  }
  return "error";
}

}  // namespace kvq
