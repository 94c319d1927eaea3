// Many sequences decoding together over one paged KV store: the step batch
// as the engine sees it (docs/architecture.md, "The step batch"). Each
// sequence is prefilled on its own (chunked), then every step feeds one
// token of every live sequence in one forward pass, so the weights are read
// once per step for all of them. Sequences may join and leave between steps;
// their pages come from one PagePool and go back to it when they leave.
//
// This is the engine core that kvq bench --batch measures and that the
// serving scheduler (issue 26) will drive; it has no text, stop strings or
// streaming of its own (Session has those for one sequence).
#pragma once

#include <memory>
#include <vector>

#include "engine/sampler.hpp"
#include "kv/cache.hpp"
#include "kv/page_pool.hpp"
#include "model/forward.hpp"

namespace kvq {

// Samples the next token of a sequence from one logits row (vocab floats)
// with its sampler and records it there (Sampler::accept). A non-finite
// logit is an Errc::format error naming the row's position `pos`.
TokenId sample_row(Sampler& sampler, const float* logits, int vocab, int pos);

// What forward_and_sample leaves behind for one step.
struct StepSample {
  std::vector<int32_t> chosen;  // [rows] the token of each of batch.logit_rows, in order
  std::vector<float> logits;    // [rows][model vocab_size] the rows sampled from; empty when the backend chose
};

// Runs one step (Model::forward of `batch` over `store`) and picks a token
// among the first `vocab` ids (<= the model's vocab_size; embedding tables
// are often padded past the tokenizer) for each of batch.logit_rows with
// samplers[r], recording it there. When
// `backend_greedy` is set and every sampler is greedy without penalties,
// the backend picks (Model::forward_argmax: the logits stay where they
// are). BatchDecoder and the Scheduler (engine/scheduler.hpp) both step
// through this.
void forward_and_sample(Model& model, kv::Cache& store, RunState& run, const StepBatch& batch,
                        Sampler* const* samplers, int vocab, bool backend_greedy, StepSample& out);

class BatchDecoder {
 public:
  // `store` must be shaped for the model (model.cache_shape(...), any page
  // size); its pages are handed out by this decoder's pool. A store with an
  // exact window (CacheShape::window_pages) gets a second pool for its exact
  // pages: each sequence's newest window_pages pages are exact, and a page
  // leaving a window is packed (Cache::pack_pages) before the step that
  // needs it attends.
  BatchDecoder(Model& model, std::unique_ptr<kv::Cache> store, int prefill_chunk = 512);

  // Prefills `prompt` as a new sequence and samples its first token from the
  // prompt's last logits. Returns the sequence's handle. A prompt that does
  // not fit the free pages is an Errc::out_of_range error and leaves nothing
  // behind.
  int add(const std::vector<TokenId>& prompt, const SamplingParams& sampling);
  // A new sequence whose tokens and KV rows are copies of live sequence
  // `seq`'s: fresh pages from the pool, filled by Cache::copy_pages (no
  // prefill), and a sampler of its own (`sampling`) that has seen those
  // tokens. Its next step computes what `seq`'s would. kvq bench's capacity
  // mode fills a pool this way. When the pool cannot hold the copy this
  // throws Errc::out_of_range and leaves nothing behind.
  int add_copy(int seq, const SamplingParams& sampling);
  // Feeds every live sequence's newest token in one step and samples the
  // next. When the pool cannot hold one more token of every sequence this
  // throws Errc::out_of_range before running anything (remove a sequence
  // and step again).
  void step();
  // Ends a sequence and gives its pages back.
  void remove(int seq);
  // Takes a sequence back to the moment its first `n` tokens were in the
  // store and token n had just been sampled (n >= its prompt length): later
  // tokens are dropped, pages past them go back to the pool, and the
  // sampler restarts from its seed with tokens 0..n in its history. kvq
  // bench decodes repeatedly from one prefill this way. With an exact
  // window, window pages that were packed meanwhile are filled again: the
  // tokens from the window's first page to n are prefilled anew (what they
  // were after the first prefill when n is the prompt's length).
  void rewind(int seq, int n);

  int live() const;
  std::vector<int> live_sequences() const;
  // Tokens of a sequence: its prompt, then every sampled token (the newest
  // one is sampled but not yet in the KV store).
  const std::vector<TokenId>& tokens(int seq) const;
  // Logits the newest token of a sequence was sampled from (vocab floats).
  const std::vector<float>& last_logits(int seq) const;
  // Tokens of a sequence in the KV store.
  int cached(int seq) const;

  // With keep_logits off, a step whose every sequence samples greedily
  // without penalties lets the backend choose the tokens (the logits stay on
  // the device; last_logits() is then empty). On by default.
  void set_keep_logits(bool keep) { keep_logits_ = keep; }

  kv::PagePool& pool() { return pool_; }
  // The exact window's pool (null without a window).
  kv::PagePool* exact_pool() { return exact_pool_.get(); }
  // A sequence's block table.
  const kv::BlockTable& table(int seq) const { return get(seq).table; }
  kv::Cache& store() { return *store_; }
  Model& model() { return model_; }
  int steps() const { return steps_; }
  // Steps replayed from a recording (Model::batch_step; CUDA graphs).
  int batch_replays() const { return run_->batch_replays(); }

 private:
  struct Sequence {
    kv::BlockTable table;
    std::vector<TokenId> tokens;
    int cached = 0;  // tokens whose K/V are in the store
    Sampler sampler;
    std::vector<float> logits;
    bool live = true;
  };
  Sequence& get(int seq);
  const Sequence& get(int seq) const;
  kv::BlockTable new_table();
  // Prefills tokens [from, to) of s.tokens (s.table holds their pages);
  // the last row's logits into `logits` when not null.
  void prefill(Sequence& s, int from, int to, float* logits);

  Model& model_;
  std::unique_ptr<kv::Cache> store_;
  kv::PagePool pool_;
  std::unique_ptr<kv::PagePool> exact_pool_;  // the window's pages (CacheShape::exact_pages)
  std::vector<kv::PageMove> moves_;           // a step's pages leaving windows
  std::unique_ptr<RunState> run_;
  int prefill_chunk_;
  int vocab_;
  std::vector<std::unique_ptr<Sequence>> seqs_;
  StepBatch batch_;
  StepSample sampled_;
  std::vector<Sampler*> samplers_;
  bool keep_logits_ = true;
  int steps_ = 0;
};

}  // namespace kvq
