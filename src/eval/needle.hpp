// Needle retrieval: a line assigning a random 5-digit value to a variable is
// planted at a chosen depth of a haystack that fills the context; the prompt
// ends by restating the assignment's left-hand side, and the model must
// continue with the value. A case is found when every answer token is the
// argmax of its teacher-forced prediction (exactly what greedy decoding would
// produce); the answer's log-probability is reported too. Each case is one
// fresh cache filled with ctx tokens, so late needles are read back from the
// codec's packed store across the whole context.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "eval/codecs.hpp"

namespace kvq {
class Model;
class Tokenizer;
}  // namespace kvq

namespace kvq::eval {

struct NeedleOptions {
  int ctx = 2048;                                          // tokens per case: prompt + answer
  std::vector<double> depths = {0.1, 0.3, 0.5, 0.7, 0.9};  // needle position / haystack length
  int trials = 2;                                          // cases (values) per depth
  uint64_t seed = 1;
  int prefill_chunk = 512;
  std::string haystack;  // text; empty: built-in generated code (repeated as needed)
  std::function<void(const std::string&, int, int)> on_pass;  // (codec label, case index, cases)
};

struct NeedleCase {
  double depth = 0;
  int trial = 0;
  std::string value;            // the planted digits
  std::vector<int32_t> prompt;  // haystack with the needle, then the query
  std::vector<int32_t> answer;  // tokens of the value
  int needle_at = 0;            // token index where the needle starts
};
std::vector<NeedleCase> build_needle_cases(const Tokenizer& tok, const NeedleOptions& o);
// The built-in haystack: deterministic code-like text of at least `min_bytes` bytes.
std::string builtin_haystack(size_t min_bytes);

struct NeedleResult {
  EvalCodec codec;
  std::string error;  // empty: measured
  bool unsupported = false;
  int found = 0, cases = 0;
  std::vector<int> found_at;  // per depth
  double logprob_sum = 0;     // sum over cases of log p(answer), nats
  double accuracy_pct() const { return cases ? 100.0 * found / cases : 0; }
  double mean_logprob() const { return cases ? logprob_sum / cases : 0; }
};

struct NeedleReport {
  std::vector<NeedleCase> cases;
  std::vector<NeedleResult> rows;
};

NeedleReport run_needle(Model& model, const Tokenizer& tok, const std::vector<EvalCodec>& codecs,
                        const NeedleOptions& o);

}  // namespace kvq::eval
