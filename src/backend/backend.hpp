// The small interface every compute backend implements (design.md): allocate,
// upload, forward ops, attention over a cache. The forward pass
// (model/forward.cpp) is written against this interface only, so the CUDA
// backend plugs in without touching the model code.
//
// Conventions: every float* passed to an op points into the backend's own
// memory (host memory for the CPU backend, device memory for CUDA) and was
// obtained from alloc(); activations are row-major [tokens][features] fp32.
// Weights stay in their stored GGUF type (Matrix) and are dequantized inside
// the ops; upload() makes a Matrix visible to the backend (zero copy on CPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/batch.hpp"
#include "backend/dispatch_stats.hpp"
#include "gguf/types.hpp"

namespace kvq {
namespace kv {
struct BlockSpec;
class LayerCache;
class Cache;
struct CacheShape;
struct CodecOptions;
}  // namespace kv

// A weight matrix W[rows][cols] in its stored type: rows = output features,
// cols = input features (GGUF ne = {cols, rows}). Each row is row_bytes long.
struct Matrix {
  gguf::TensorType type = gguf::TensorType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  const uint8_t* data = nullptr;
  size_t row_bytes = 0;
  // What upload() made of it when the backend keeps its own representation
  // (e.g. the CUDA backend's re-laid-out codes and scales); null on the CPU,
  // which computes straight from `data`.
  const void* handle = nullptr;
  const uint8_t* row(int64_t r) const { return data + size_t(r) * row_bytes; }
};

// Rotary position embedding as the architecture defines it. inv_freq has
// head_dim/2 entries (already divided by any llama3 / rope_freqs factors);
// the angle of pair i at position p is (p * pos_scale) * inv_freq[i].
struct Rope {
  std::vector<float> inv_freq;
  bool neox = true;        // true: rotate (i, i + d/2) (qwen3); false: (2i, 2i+1) (llama GGUF)
  double pos_scale = 1.0;  // 1/factor for linear scaling
};

// A recorded decode step that the backend can replay (CUDA graph); see
// Backend::record_begin.
class StepGraph {
 public:
  virtual ~StepGraph() = default;
};

// What a backend says about the device it runs on (benchmark metadata).
struct DeviceInfo {
  std::string name;    // GPU name; the CPU model on the CPU backend
  std::string driver;  // driver / runtime versions; empty on the CPU
  std::string clocks;  // clocks as the device reports them; empty when unknown
};

// Backend-owned float storage.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual float* data() = 0;
  virtual size_t size() const = 0;  // in floats
};

// Experiment knobs of the backends, declared once: the CLI sets them
// (cli/options.cpp), nothing reads them from the environment. Backends
// ignore the ones that do not concern them.
struct BackendOptions {
  bool step_graphs = true;         // record decode steps once per shape and replay them (CUDA graphs)
  bool dependent_launches = true;  // CUDA: programmatic dependent launches between the step's kernels
  int gemv_warps = 16;             // CUDA: warps per GEMV CTA (1..16)
  int attn_prefetch_tiles = 1;     // CUDA: K/V tiles per warp the decode kernel asks L2 for before its wait
  bool attn_fused_q = true;        // CUDA: decode attention norms/rotates q itself, beside the store's encode
  bool prefill_wgmma = true;       // CUDA (sm_90a builds on Hopper): prefill attention on wgmma, else mma.sync
  // CUDA: a decode step of at least this many sequences runs the weight
  // products of types that have one on the tensor-core GEMM (gemm_tc);
  // smaller steps and other types use the batched GEMV. 0: never.
  int batch_gemm_rows = 8;
  // CUDA: gemm_tc quantizes x once per launch into a workspace instead of
  // in every CTA (H200, session 12: 6,080 against 3,470 tok/s at B = 64;
  // docs/perf.md). false keeps the in-CTA path for A/B runs.
  bool gemm_tc_prestage = true;
  // One-sequence caches (Session: run, chat, one-sequence bench and eval)
  // as a single page of the whole context, the contiguous [head][token]
  // layout of before the paged store, instead of 64-token pages: an A/B of
  // what paging costs a lone sequence.
  bool session_one_page = false;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  const BackendOptions& options() const { return options_; }
  // Tokens per prefill forward call when the user gives none (--prefill-chunk).
  virtual int default_prefill_chunk() const { return 512; }
  // The same for one sequence that wants only its last token's logits (run,
  // chat, the one-sequence bench): no chunk of all logits to hold, no step
  // budget shared with other sequences.
  virtual int default_session_prefill_chunk() const { return default_prefill_chunk(); }

  // --- memory
  virtual std::unique_ptr<Buffer> alloc(size_t n_floats) = 0;
  // Makes a weight matrix usable by the ops. The backend owns whatever it
  // creates (device copies, re-layouts) for its own lifetime and refers to it
  // through the returned Matrix (data and/or handle).
  virtual Matrix upload(const Matrix& host) = 0;
  virtual void upload(const float* host, float* dst, size_t n) = 0;
  virtual void download(const float* src, float* host, size_t n) = 0;

  // --- forward ops
  // Called by the forward pass before the layers of every step, with the
  // step it is about to run: a backend may choose its kernels by the step's
  // shape (the CUDA backend runs the weight products of a decode step of
  // several sequences, every run one token, through its batched GEMV; a
  // prefill chunk of as many rows stays on its GEMM). No effect by default.
  virtual void prepare_step(const StepBatch& batch) {}
  // out[t] = row ids[t] of `table` (dequantized); ids are host memory.
  virtual void embed(const Matrix& table, const int32_t* ids, int n, float* out) = 0;
  // y[t][r] = sum_c W[r][c] * x[t][c] for t < n.
  virtual void matmul(const Matrix& w, const float* x, int n, float* y) = 0;
  // RMSNorm of n rows of length dim, scaled by weight (dim floats). In place allowed.
  virtual void rms_norm(const float* x, const float* weight, int n, int dim, float eps, float* y) = 0;
  // Rotates x [n][n_heads][head_dim] in place; token t has position pos + t.
  virtual void rope(float* x, int n, int n_heads, int head_dim, int pos, const Rope& rope) = 0;
  // out = silu(gate) * up, elementwise over n values. In place (out == gate) allowed.
  virtual void swiglu(const float* gate, const float* up, float* out, size_t n) = 0;
  // x += y over n values.
  virtual void add(float* x, const float* y, size_t n) = 0;
  // K/V of the batch's tokens (k, v: [n_tok][n_kv_heads][head_dim]) into
  // the layer's store at each token's slot.
  virtual void write_kv(kv::LayerCache& layer, const StepBatch& batch, const float* k, const float* v) = 0;
  // Causal GQA attention of the batch's tokens over the cache layer (after
  // their K/V were written): each sequence's run sees its own rows only.
  virtual void attention(const kv::LayerCache& layer, const StepBatch& batch, const float* q, int n_heads,
                         float scale, float* out) = 0;

  // --- fused forms of the forward pass's op sequences. The defaults run the
  // plain ops above in order (every backend has them, with exactly the plain
  // ops' results); a backend may fuse them into fewer launches (the CUDA
  // backend does for single-token steps).
  // ys[i] = W_i RMSNorm(x) * norm_w for i < count (1..3): n rows of dim floats;
  // h: [n][dim] scratch.
  virtual void norm_matmul(const float* x, const float* norm_w, int n, int dim, float eps, float* h,
                           const Matrix* const* ws, float* const* ys, int count);
  // x += W a for n rows; tmp: [n][w.rows] scratch.
  virtual void matmul_add(const Matrix& w, const float* a, int n, float* x, float* tmp);
  // out = silu(W_gate u) * (W_up u) with u = RMSNorm(x) * norm_w; h: [n][dim]
  // and up: [n][w_up.rows] scratch.
  virtual void norm_swiglu(const float* x, const float* norm_w, int n, int dim, float eps, float* h,
                           const Matrix& w_gate, const Matrix& w_up, float* up, float* out);
  // The MLP block: x += W_down (silu(W_gate u) * (W_up u)), u = RMSNorm(x) *
  // norm_w, for n rows; h: [n][dim], up and gate: [n][w_up.rows] scratch.
  // Default: norm_swiglu, then matmul_add.
  virtual void mlp_residual(float* x, const float* norm_w, int n, int dim, float eps, float* h, const Matrix& w_gate,
                            const Matrix& w_up, const Matrix& w_down, float* up, float* gate);
  // Per-head RMSNorm of q and k (each only when its weight is non-null), RoPE
  // of both at each token's position (in place), then write_kv(layer, batch, k, v).
  virtual void qk_rope_write_kv(kv::LayerCache& layer, const StepBatch& batch, float* q, float* k, const float* v,
                                int n_heads, int n_kv_heads, int head_dim, const float* q_norm,
                                const float* k_norm, float eps, const Rope& rope);

  // --- KV cache
  // A cache this backend's write_kv/attention can use, for shape.max_tokens
  // tokens in pages of shape.page_tokens (the backend may choose another
  // page size: the returned cache's shape() says). Default: the CPU packed cache (kv::make_cpu_cache); the
  // CUDA backend returns a device-resident one (and rejects codecs it has no
  // GPU kernels for with Errc::unsupported).
  virtual std::unique_ptr<kv::Cache> make_cache(const kv::CodecOptions& opts, const kv::CacheShape& shape);

  // --- greedy decoding without the logits round trip
  // Index of the largest of x[0..n) (x: backend memory); NaN never wins
  // unless all are NaN/-inf (then 0), lowest index on ties: the same choice
  // as the greedy Sampler. Default: download and scan on the host.
  virtual int32_t argmax(const float* x, size_t n);
  // The same for `rows` rows (row r at x + r * stride) into out[0..rows)
  // and each chosen value into value[0..rows) (host memory; NaN and -inf
  // rows give -inf, so a caller can tell a broken row). Default: a download
  // and host scan per row.
  virtual void argmax_rows(const float* x, int rows, size_t n, size_t stride, int32_t* out, float* value);

  // --- recorded decode steps (optional; the CUDA backend uses CUDA graphs)
  // Launching ~1000 small kernels per token costs more than their work, so a
  // backend may record the ops of one single-token step once and replay the
  // recording for later tokens. The per-step inputs then live in backend
  // memory: between begin_step(batch) and end_step(), embed() reads the
  // token and rope/write_kv/attention read the position from there (their
  // ids/batch arguments must equal the ones given to begin_step), and
  // attention's work split does not depend on pos. Ops issued between
  // record_begin() and record_end() are recorded, not run; replay() runs a
  // recording with the current begin_step inputs, and returns false (running
  // nothing) when it was recorded over another KV cache than `cache`.
  // A decode step of several sequences (every run one token, run z at row
  // z) may be recorded too: begin_step copies its token ids, positions,
  // slots and block tables to backend memory and its ops read them there;
  // a recording then serves any later step with the same number of tokens
  // and the same longest block table (Model::batch_step keys them so).
  // The defaults say "unsupported" (the CPU backend runs ops directly).
  virtual bool supports_step_graphs() const { return false; }
  virtual void begin_step(const StepBatch& batch);
  virtual void end_step() {}
  virtual void record_begin();
  virtual std::unique_ptr<StepGraph> record_end();
  virtual void record_abort() {}  // after an error between record_begin and record_end
  virtual bool replay(const StepGraph& graph, kv::Cache& cache);

  // --- measurement (kvq bench)
  virtual DeviceInfo device_info();
  // Device memory in use now, in bytes (all processes); -1 when the backend
  // has no device memory to count (CPU).
  virtual int64_t device_memory_used() { return -1; }
  // Measures the copy bandwidth of the backend's memory now: bytes read plus
  // bytes written per second by a large buffer copy (the floor a decode step
  // is compared against). Default: a host memcpy probe.
  virtual double measure_copy_bandwidth();
  // Dispatch counters for `cache` (see dispatch_stats.hpp), since the last
  // reset_dispatch_stats(cache). Default: not counted.
  virtual void reset_dispatch_stats(kv::Cache& cache) {}
  virtual DispatchStats dispatch_stats(kv::Cache& cache) { return {}; }

 protected:
  BackendOptions options_;
};

// What the CUDA backend's kernels do for a codec (K and V blocks) at a model
// shape, answered without a GPU from the one kernel-selection function
// (cuda::choose_attention); `kvq codecs` prints it as its GPU column and the
// CUDA cache asks the same question before allocating. Builds without CUDA
// answer "unsupported: built without CUDA".
struct GpuCodecSupport {
  bool supported = false;
  std::string decode_kernel;   // e.g. "flash_decode_tc<128,q8,q8>"
  std::string prefill_kernel;  // e.g. "dequant_bf16+prefill_tc<128>"
  std::string why;             // when unsupported
};
GpuCodecSupport gpu_codec_support(const kv::BlockSpec& k, const kv::BlockSpec& v, int head_dim, int n_heads,
                                  int n_kv_heads);

// The backend for a --device name: "cpu" always; "cuda" in builds with CUDA
// (KVQ_HAVE_CUDA) on a machine with a GPU, else a clear Errc::unsupported error. Unknown names throw
// invalid_argument listing the valid ones.
std::unique_ptr<Backend> make_backend(const std::string& device, const BackendOptions& options = {});

}  // namespace kvq
