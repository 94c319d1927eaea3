#include "gguf/finite.hpp"

#include <cmath>
#include <vector>

#include "gguf/quant.hpp"

namespace kvq::gguf {

std::optional<NonFinite> find_non_finite(const File& f) {
  std::vector<float> row;
  for (const TensorInfo& t : f.tensors()) {
    if (t.ne.empty() || t.n_elements == 0 || !t.data) continue;
    const TensorTypeInfo& info = tensor_type_info(t.type);
    const uint64_t row_len = t.ne[0];
    if (row_len % info.block_size != 0) continue;
    const uint64_t row_bytes = row_len / info.block_size * info.block_bytes;
    row.resize(row_len);
    for (uint64_t r = 0; r < t.n_elements / row_len; ++r) {
      dequantize_row(t.type, t.data + r * row_bytes, row.data(), int64_t(row_len));
      for (uint64_t i = 0; i < row_len; ++i)
        if (!std::isfinite(row[i])) return NonFinite{t.name, r * row_len + i, row[i]};
    }
  }
  return std::nullopt;
}

}  // namespace kvq::gguf
