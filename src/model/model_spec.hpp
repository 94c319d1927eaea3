// A model named on the command line: a GGUF path, or "synthetic:SHAPE" for a
// synthetic model of a named shape (model/synth.hpp) that needs no file.
#pragma once

#include <memory>
#include <string>

namespace kvq {

class Backend;
class Model;

inline constexpr const char* kSyntheticPrefix = "synthetic:";

// True for "synthetic:SHAPE".
bool is_synthetic_spec(const std::string& spec);

// Opens a GGUF path (Model::open) or builds the synthetic model of
// "synthetic:SHAPE" (weight seed 0): written to a temporary file, mapped,
// and unlinked at once (the mapping keeps it alive; nothing is left behind).
// An unknown shape is an Errc::invalid_argument error listing the known ones.
std::unique_ptr<Model> open_model(const std::string& spec, Backend& backend);

}  // namespace kvq
