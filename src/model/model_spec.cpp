#include "model/model_spec.hpp"

#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "core/error.hpp"
#include "model/forward.hpp"
#include "model/synth.hpp"

namespace kvq {

namespace fs = std::filesystem;

bool is_synthetic_spec(const std::string& spec) { return spec.rfind(kSyntheticPrefix, 0) == 0; }

std::unique_ptr<Model> open_model(const std::string& spec, Backend& backend) {
  if (!is_synthetic_spec(spec)) return Model::open(spec, backend);
  SynthOptions so;
  so.shape = spec.substr(std::string(kSyntheticPrefix).size());
  synth_shape(so.shape);  // unknown shapes fail here, listing the known ones
  static std::atomic<int> serial{0};
  const fs::path tmp =
      fs::temp_directory_path() / str("kvq-", so.shape, "-", ::getpid(), "-", serial++, ".gguf");
  struct Unlink {
    fs::path p;
    ~Unlink() {
      std::error_code ec;
      fs::remove(p, ec);
    }
  } unlink{tmp};
  write_synthetic(so, tmp.string());
  return Model::open(tmp.string(), backend);  // mapped: removing the file is safe
}

}  // namespace kvq
