// Finding non-finite weights: a model whose file holds NaN or infinite values
// produces NaN logits, and the tensor to blame is the useful part of the error.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "gguf/gguf.hpp"

namespace kvq::gguf {

struct NonFinite {
  std::string tensor;  // its name
  uint64_t index = 0;  // flat element index (ne[0] fastest)
  float value = 0.0f;  // the NaN or infinity found there
};

// The first tensor, in file order, with a NaN or infinite element once
// dequantized (a NaN or infinite block scale counts), or nullopt. Reads every
// tensor: seconds for a multi-GB model, so use it to explain a failure, not
// on every load. Tensors of types kvq cannot dequantize are skipped.
std::optional<NonFinite> find_non_finite(const File& f);

}  // namespace kvq::gguf
