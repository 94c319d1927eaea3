// The Qwen3 / Llama forward pass, written once against the Backend interface.
//
// Per layer (pre-norm residual blocks):
//   h = RMSNorm(x) ; q,k,v = h Wq, h Wk, h Wv
//   qwen3: q,k = per-head RMSNorm(q), RMSNorm(k)
//   q,k = RoPE(q,k)   (NEOX halves for qwen3, adjacent pairs for llama GGUFs)
//   cache <- k,v ; a = causal GQA attention(q, cache) ; x += a Wo
//   h = RMSNorm(x) ; x += (silu(h Wgate) * (h Wup)) Wdown
// then logits = RMSNorm(x) Woutput (Woutput = token_embd when tied).
// Prefill of a chunk and single-token decode are the same call with n >= 1.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "kv/cache.hpp"
#include "model/config.hpp"
#include "model/weights.hpp"

namespace kvq {
namespace gguf { class File; }

// The per-sequence state of running a model: activation scratch and the
// recorded decode step (valid for that scratch and the cache it was recorded
// over). The Model (weights, shared) holds none of it, so sequences that
// share one model each keep their own recorded step. Make one per sequence
// with Model::new_run_state(); use it from one thread at a time.
class RunState {
 public:
  explicit RunState(Backend& backend) : backend_(backend) {}
  // True when a recorded step exists (replayed by the next step over the same cache).
  bool step_graph_recorded() const { return step_graph_ != nullptr; }
  // How many times a decode step was recorded for this state (a replayed
  // step is not recorded again).
  int recordings() const { return recordings_; }
  // Decode steps of several sequences replayed from a recording.
  int batch_replays() const { return batch_replays_; }

 private:
  friend class Model;
  // Recordings refer to the scratch buffers: dropped when one is replaced.
  void drop_recordings() {
    step_graph_.reset();
    batch_graphs_.clear();
    last_batch_shape_ = {};
  }
  Backend& backend_;
  int scratch_tokens_ = 0;
  int logit_rows_ = 0;  // rows of logits_
  std::unique_ptr<Buffer> x_, h_, q_, k_, v_, attn_, gate_, up_, logits_;
  // A step is first run directly once per cache (warm_cache_, a
  // kv::Cache::id), so every lazily sized backend scratch exists before
  // recording.
  std::unique_ptr<StepGraph> step_graph_;
  uint64_t warm_cache_ = 0;
  int recordings_ = 0;
  // Set when recording a step failed: this sequence then runs its steps
  // directly (other sequences of the model keep their recordings).
  bool graphs_failed_ = false;
  // Recorded decode steps of several sequences (Model::batch_step), one per
  // shape: tokens, the longest block table (the attention's work split
  // follows it) and the cache. A shape is recorded the second step in a row
  // it is seen (the first runs directly and sizes the scratch); at most
  // kBatchGraphs are kept, the least recently used dropped first.
  struct BatchGraph {
    int n_tok = 0, stride = 0;
    uint64_t cache = 0, last_used = 0;
    std::unique_ptr<StepGraph> graph;
  };
  static constexpr size_t kBatchGraphs = 8;
  std::vector<BatchGraph> batch_graphs_;
  BatchGraph last_batch_shape_;  // the previous batch step's shape (no graph)
  uint64_t batch_steps_ = 0;
  int batch_replays_ = 0;
  std::vector<float> chosen_value_;  // forward_argmax: each row's winning logit
};

class Model {
 public:
  // Opens a GGUF file (kept mmap'd for the model's lifetime), reads its config
  // and weights. A missing file, an unsupported architecture or weight type is
  // a clear kvq::Error.
  static std::unique_ptr<Model> open(const std::string& path, Backend& backend);
  // From weights whose bytes the caller keeps alive (tests, synthetic models).
  Model(ModelConfig cfg, ModelWeights weights, Backend& backend);
  ~Model();

  const ModelConfig& config() const { return cfg_; }
  Backend& backend() { return backend_; }
  const Backend& backend() const { return backend_; }
  // The GGUF file this model was opened from; nullptr for in-memory models.
  const gguf::File* file() const { return file_.get(); }

  // Shape of a KV cache that can hold max_tokens tokens of this model.
  kv::CacheShape cache_shape(int max_tokens) const;

  // A fresh run state (scratch, recorded step) for one sequence.
  std::unique_ptr<RunState> new_run_state() const { return std::make_unique<RunState>(backend_); }

  // Bytes of weights one single-token decode step reads, in their stored
  // types: every layer matrix and norm, the LM head, one embedding row.
  uint64_t step_weight_bytes() const;

  // Runs tokens ids[0..n) of one sequence at positions pos..pos+n-1 over the
  // cache in page order (its identity block table): writes their K/V into the
  // cache and writes logits to host memory: [n][vocab] when all_logits, else
  // only the last token's [vocab]. Positions beyond the cache capacity are an
  // Errc::out_of_range error. `run` is the sequence's run state; the
  // overloads without one use the model's own (one sequence at a time).
  void forward(const int32_t* ids, int n, int pos, kv::Cache& cache, float* logits, bool all_logits, RunState& run);
  void forward(const int32_t* ids, int n, int pos, kv::Cache& cache, float* logits, bool all_logits) {
    forward(ids, n, pos, cache, logits, all_logits, own_run_);
  }

  // Runs a step of one or more sequences (backend/batch.hpp) over `cache`:
  // writes every token's K/V at its slot and writes the logits of
  // batch.logit_rows, in that order, to host memory: [rows][vocab].
  void forward(const StepBatch& batch, kv::Cache& cache, float* logits, RunState& run);
  // The same step, but only the greedy choice among the first `vocab` logits
  // of each of batch.logit_rows goes to out[i] (host), computed by the
  // backend: the logits never leave it (B x vocab floats a step otherwise).
  // A row whose logits are all NaN or -inf is an Errc::format error.
  void forward_argmax(const StepBatch& batch, kv::Cache& cache, int vocab, int32_t* out, RunState& run);

  // One decode step of token `id` at `pos` that returns the greedy choice:
  // the index of the largest of the first `vocab` logits (NaN never wins,
  // lowest id on ties, as the greedy Sampler), computed by the backend so the
  // logits never leave it. vocab <= config().vocab_size.
  // chosen_logit (optional): receives the winning logit, so that a caller can
  // tell a NaN/inf step (argmax treats NaN as -inf and would return 0).
  int32_t forward_argmax(int32_t id, int pos, kv::Cache& cache, int vocab, RunState& run,
                         float* chosen_logit = nullptr);
  int32_t forward_argmax(int32_t id, int pos, kv::Cache& cache, int vocab) {
    return forward_argmax(id, pos, cache, vocab, own_run_);
  }

  // Single-token steps are recorded once per KV cache and run state, decode
  // steps of several sequences once per shape (batch_step), and replayed
  // (CUDA graphs) when the backend supports it. On by default there
  // (BackendOptions::step_graphs); this setter turns it on or off for this
  // model (off also drops the model's own recording).
  void set_step_graphs(bool on);
  bool step_graphs() const { return step_graphs_; }
  // Whether the model's own run state (the overloads without one) holds a recording.
  bool step_graph_recorded() const { return own_run_.step_graph_recorded(); }

 private:
  void ensure_scratch(RunState& r, int n);
  // The layers for tokens ids[0..n): leaves the final hidden states in r.x_.
  void run_layers(RunState& r, const StepBatch& batch, kv::Cache& cache);
  // Errc::out_of_range (with the --ctx hint) when tokens [pos, pos + n) do not fit.
  void check_fits(const kv::Cache& cache, int pos, int n) const;
  // The LM head over batch.logit_rows in runs of consecutive rows; see forward.cpp.
  template <class F>
  void lm_head_runs(RunState& r, const StepBatch& batch, F&& use);
  // RMSNorm + LM head of hidden row t of r.x_ into r.logits_ row 0.
  void lm_head_row(RunState& r, int t);
  // A decode step of several sequences, or of one over a block table (every
  // run one token, run z at row z, every row's logits wanted, at most
  // kBatchStepRows rows), recorded and replayed per shape when step_graphs_
  // (RunState::BatchGraph): leaves the rows' logits in r.logits_ and returns
  // true. False (nothing run): not such a step, or graphs off; the caller
  // runs it directly.
  bool batch_step(RunState& r, const StepBatch& batch, kv::Cache& cache);
  // A single-token step (recorded/replayed when step_graphs_) that leaves the
  // token's logits in r.logits_ row 0.
  void decode_step(RunState& r, int32_t id, int pos, kv::Cache& cache);
  float* upload_vector(const std::vector<float>& v);

  std::shared_ptr<const gguf::File> file_;  // shared_ptr: the deleter lives where the file is opened
  ModelConfig cfg_;
  ModelWeights w_;
  Backend& backend_;

  // Backend copies of the weights (zero copy on CPU) and fp32 norm vectors.
  struct LayerDev {
    Matrix wq, wk, wv, wo, w_gate, w_up, w_down;
    float *attn_norm = nullptr, *ffn_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  };
  std::vector<LayerDev> layers_;
  Matrix token_embd_, output_;
  float* output_norm_ = nullptr;
  std::vector<std::unique_ptr<Buffer>> owned_;  // norm vectors

  bool step_graphs_ = false;
  RunState own_run_;  // for the overloads without a run state
};

}  // namespace kvq
