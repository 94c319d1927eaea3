// Opening a model from a GGUF file. Kept apart from the forward pass so that
// code building models in memory (tests) does not link the GGUF reader.
#include <filesystem>

#include "core/error.hpp"
#include "gguf/gguf.hpp"
#include "model/forward.hpp"

namespace kvq {

ModelWeights load_weights(const ModelConfig& cfg, const gguf::File& file) {
  return load_weights(cfg, [&](const std::string& name) { return file.find_tensor(name); });
}

std::unique_ptr<Model> Model::open(const std::string& path, Backend& backend) {
  if (!std::filesystem::exists(path)) fail(Errc::io, "model file '", path, "' does not exist; pass -m FILE.gguf");
  auto file = std::make_shared<const gguf::File>(gguf::File::open(path));
  ModelConfig cfg = ModelConfig::from_gguf(*file);
  ModelWeights w = load_weights(cfg, *file);
  auto m = std::make_unique<Model>(std::move(cfg), std::move(w), backend);
  m->file_ = std::move(file);
  return m;
}

}  // namespace kvq
