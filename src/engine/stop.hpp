// Stop strings for streamed generation.
#pragma once

#include <string>
#include <vector>

namespace kvq {

// Splits streamed text at stop strings: push() returns the text that is safe
// to emit now (no stop string can still begin inside it) and reports whether a
// stop string was completed; the stop string and anything after it are dropped.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  std::string push(const std::string& text, bool* stopped);
  std::string flush();  // what is held back when generation ends for another reason

 private:
  std::vector<std::string> stops_;
  std::string held_;
};

}  // namespace kvq
