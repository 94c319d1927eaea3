// kvq synth: write a synthetic model of a named shape (seeded random weights).
#include <cstdio>
#include <filesystem>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/file_io.hpp"
#include "core/timer.hpp"
#include "gguf/types.hpp"
#include "model/synth.hpp"

namespace {

std::function<int()> setup(CLI::App& sub) {
  auto opt = std::make_shared<kvq::SynthOptions>();
  auto out = std::make_shared<std::string>();
  auto weights = std::make_shared<std::string>();
  auto list = std::make_shared<bool>(false);
  std::string shapes;
  for (const auto& s : kvq::synth_shapes()) shapes += (shapes.empty() ? "" : ", ") + s.name;
  sub.add_option("--shape", opt->shape, "Model shape: " + shapes)->capture_default_str();
  sub.add_option("--weights", *weights, "Matrix type: " + kvq::gguf::tensor_type_names() + " (default: the shape's)");
  sub.add_option("--vocab", opt->vocab_json, "Hugging Face tokenizer.json to store (default: built-in vocabulary)");
  sub.add_option("--seed", opt->seed, "Weight seed")->capture_default_str();
  sub.add_option("-o,--output", *out, "Output .gguf path");
  sub.add_flag("--list", *list, "List the shapes and exit");
  return [opt, out, weights, list]() {
    if (*list) {
      for (const auto& s : kvq::synth_shapes()) std::printf("%-12s %s\n", s.name.c_str(), s.description.c_str());
      return 0;
    }
    if (out->empty()) kvq::fail(kvq::Errc::invalid_argument, "kvq synth: -o FILE.gguf is required");
    if (!weights->empty()) {
      opt->weights = kvq::gguf::tensor_type_from_name(*weights);
      if (!opt->weights)
        kvq::fail(kvq::Errc::invalid_argument, "--weights '", *weights,
                  "' is not a supported type (", kvq::gguf::tensor_type_names(), ")");
    }
    kvq::note_input(opt->vocab_json, "vocabulary");  // -o must not replace it
    kvq::Timer t;
    kvq::write_synthetic(*opt, *out);
    const auto bytes = std::filesystem::file_size(*out);
    std::printf("wrote %s: synthetic %s, %llu bytes (%.3f GB) in %.1f s\n", out->c_str(), opt->shape.c_str(),
                (unsigned long long)bytes, double(bytes) / 1e9, t.seconds());
    return 0;
  };
}

}  // namespace

KVQ_REGISTER_COMMAND("synth", "Write a synthetic model of a named shape (seeded random weights)", setup);
