// One benchmark cell: a codec at a prompt length, measured on a model that
// is already loaded. Used by the sweep (bench/sweep.hpp) and `kvq run --repeat`.
//
// Protocol (docs/bench.md): one KV cache is allocated for the cell (its
// device memory is read before and after, through the backend), then each
// repetition empties it and generates G tokens greedily after the L-token
// prompt, end-of-generation ignored: the first repetition is a warm-up
// (recorded steps, lazily sized buffers) and is not in the numbers, only in
// the digest check. Decode tok/s counts tokens 2..G.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/results.hpp"
#include "engine/sampler.hpp"
#include "kv/cache.hpp"

namespace kvq {
class Model;
}

namespace kvq::bench {

struct MeasureOptions {
  int gen = 128;             // G: tokens generated per repetition (>= 2)
  int reps = 3;              // measured repetitions (>= 1)
  int warmup = 1;            // discarded repetitions before them (>= 0)
  int prefill_chunk = 0;     // tokens per prefill forward call; 0: the device's default
  double copy_bw = 0;        // measured copy bandwidth in bytes/s; 0: no % of copy bandwidth
  SamplingParams sampling = greedy();  // the bench decodes greedily; `kvq run --repeat` passes its own
  static SamplingParams greedy() {
    SamplingParams p;
    p.temperature = 0;
    return p;
  }
  // The cell's KV cache; empty: model.backend().make_cache(codec, shape).
  // (`kvq run --repeat` passes its own, e.g. the fp32 reference cache.)
  std::function<std::unique_ptr<kv::Cache>(const kv::CacheShape&)> make_cache;
  // Called before each repetition with (index, total), warm-ups included;
  // and during prefill with (tokens done, total).
  std::function<void(int rep, int total)> on_rep;
  std::function<void(int done, int total)> on_prefill;
};

// The prefill chunk a device wants when none is given: 2048 on CUDA (every
// chunk dequantizes all weights into GEMM tiles, so larger chunks amortize
// that), 512 elsewhere.
int default_prefill_chunk(const std::string& device);

// `n` token ids drawn uniformly from [0, vocab) by a seeded generator: a
// prompt of exactly n tokens whose text does not matter to the cost per token.
std::vector<int32_t> random_prompt(int n, int vocab, uint64_t seed);

// Measures `prompt` + G tokens with one codec; the result's codec is the
// codec's canonical name and its status "ok" or "flagged". Errors (unknown
// or unsupported codec, out of memory) propagate as kvq::Error /
// std::bad_alloc: the sweep turns them into failed cells.
CellResult measure_cell(Model& model, const kv::CodecOptions& codec, const std::vector<int32_t>& prompt,
                        const MeasureOptions& opts);

}  // namespace kvq::bench
