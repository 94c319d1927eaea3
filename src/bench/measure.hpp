// One benchmark cell: a codec at a prompt length, measured on a model that
// is already loaded. Used by the sweep (bench/sweep.hpp) and `kvq run --repeat`.
//
// Protocol (docs/bench.md): one KV cache is allocated for the cell (its
// device memory is read before and after, through the backend).
//
// Prefill-once (the default): the cell prefills the L-token prompt
// `prefill_reps` times into the emptied cache, each timed (TTFT = prefill +
// choosing the first token; prefill tok/s = L / prefill time). Then every
// decode run (warm-up runs + reps) starts from the cache holding the prompt:
// it re-feeds the last prompt token at position L-1 (rewriting that row with
// the values it already holds) to get token 1, then generates G-1 more,
// greedily, end-of-generation ignored. The rows a run wrote past L are
// overwritten by the next run. Re-prefilling an identical prompt for every
// run cost about 75% of a full sweep's time.
//
// Prefill-every-run (prefill_every_run): each decode run empties the cache
// and prefills the prompt itself, as kvq did before; TTFT is then over the
// measured runs.
//
// Either way the warm-up runs (recorded steps, lazily sized buffers) are not
// in the numbers, only in the digest check; decode tok/s counts tokens 2..G.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/results.hpp"
#include "engine/runtime.hpp"
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
  int prefill_reps = 1;      // timed prefills of the prompt per cell (>= 1), prefill-once protocol
  bool prefill_every_run = false;  // the old protocol: every decode run prefills (prefill_reps unused)
  int prefill_chunk = 0;     // tokens per prefill forward call; 0: the device's default
  double copy_bw = 0;        // measured copy bandwidth in bytes/s; 0: no % of copy bandwidth
  // Batch cells: prefill sequence 0 only and give sequences 1..B-1 copies of
  // its KV rows (BatchDecoder::add_copy) instead of prefilling prompts[1..].
  // A step reads the same bytes either way; the copies save B - 1 prefills
  // (the capacity mode at 32k would prefill over a hundred sequences).
  bool copy_batch_kv = false;
  SamplingParams sampling = greedy();  // the bench decodes greedily; `kvq run --repeat` passes its own
  static SamplingParams greedy() {
    SamplingParams p;
    p.temperature = 0;
    return p;
  }
  // Called before each decode run with (index, total), warm-ups included;
  // before each of the cell's prefills (prefill-once protocol) with (index,
  // prefill_reps); and during a prefill with (tokens done, total).
  std::function<void(int rep, int total)> on_rep;
  std::function<void(int index, int total)> on_prefill_rep;
  std::function<void(int done, int total)> on_prefill;
};

// `n` token ids drawn uniformly from [0, vocab) by a seeded generator: a
// prompt of exactly n tokens whose text does not matter to the cost per token.
std::vector<int32_t> random_prompt(int n, int vocab, uint64_t seed);

// Measures `prompt` + G tokens with one codec; the result's codec is the
// codec's canonical name and its status "ok" or "flagged". Errors (unknown
// or unsupported codec, out of memory) propagate as kvq::Error /
// std::bad_alloc: the sweep turns them into failed cells.
CellResult measure_cell(Model& model, const CodecRequest& codec, const std::vector<int32_t>& prompt,
                        const MeasureOptions& opts);

// Measures B sequences decoding together (docs/bench.md, "--batch"): one
// KV pool for all of them, each prompt (prompts[b], L tokens each)
// prefilled on its own, then warm-up + reps decode runs in which every step
// feeds one token of every sequence (BatchDecoder); each run starts from the
// prefilled prompts (BatchDecoder::rewind); with opts.copy_batch_kv only
// prompts[0] is prefilled and the others are its copies. decode_tps is the aggregate
// B * (G-1) / decode time; ITL is the time of one step (every sequence gets
// a token per step); TTFT is the mean prefill of one sequence. The result's
// batch is B and kv_pages the pool pages the sequences hold at the end.
// A backend whose KV store is not paged (the CUDA one, for now) cannot run
// B > 1: an Errc::unsupported error.
CellResult measure_batch_cell(Model& model, const CodecRequest& codec,
                              const std::vector<std::vector<int32_t>>& prompts, const MeasureOptions& opts);

}  // namespace kvq::bench
