// libFuzzer target: the GGUF reader and ModelConfig on arbitrary bytes. Any
// outcome other than success or kvq::Error (a crash, a sanitizer report, another
// exception, a timeout, a huge allocation) is a bug.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "gguf/gguf.hpp"
#include "gguf/quant.hpp"
#include "model/config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const kvq::gguf::File f = kvq::gguf::File::parse(data, size, "fuzz.gguf");
    size_t chars = 0;
    for (const auto& kv : f.metadata()) chars += kv.second.to_string().size();
    // Read every tensor's first row through the reference dequantizer: the
    // reader promised the bytes are inside the buffer.
    std::vector<float> row;
    volatile float sink = 0;
    for (const auto& t : f.tensors()) {
      const uint64_t n = t.ne[0] < 4096 ? t.ne[0] : 0;
      if (n == 0) continue;
      row.resize(n);
      kvq::gguf::dequantize_row(t.type, t.data, row.data(), int64_t(n));
      sink = sink + row[0] + float(t.data[t.n_bytes - 1]);
    }
    (void)chars;
    try {
      (void)kvq::ModelConfig::from_gguf(f);
    } catch (const kvq::Error&) {
    }
  } catch (const kvq::Error&) {
  }
  return 0;
}
