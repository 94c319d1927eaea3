#include "backend/cuda/cuda_backend.hpp"

#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cuda/attention.hpp"
#include "backend/cuda/attention_decode.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/cuda_kv_cache.hpp"
#include "backend/cuda/device_buffer.hpp"
#include "backend/cuda/device_context.hpp"
#include "backend/cuda/gemv.hpp"
#include "backend/cuda/gemm_tc.hpp"
#include "backend/cuda/gemv_batch.hpp"
#include "backend/cuda/ops.hpp"
#include "backend/gpu_layout.hpp"
#include "core/error.hpp"
#include "kv/cache.hpp"

#define KVQ_CUBLAS_CHECK(call)                                                                          \
  do {                                                                                                  \
    const cublasStatus_t kvq_st_ = (call);                                                              \
    if (kvq_st_ != CUBLAS_STATUS_SUCCESS)                                                               \
      ::kvq::fail(::kvq::Errc::cuda, #call, " failed: cuBLAS status ", int(kvq_st_), " (", __FILE__, ":", \
                  __LINE__, ")");                                                                       \
  } while (0)

namespace kvq::cuda {

namespace {

// The bf16 weight tile of a prefill GEMM holds at most this many elements
// (64 Mi x 2 bytes = 128 MiB); larger matrices are multiplied in row blocks.
constexpr size_t kTileElems = size_t(64) << 20;

class DeviceFloatBuffer final : public Buffer {
 public:
  explicit DeviceFloatBuffer(size_t n) : b_(n) {
    if (n) KVQ_CUDA_CHECK(cudaMemset(b_.data(), 0, b_.bytes()));
  }
  float* data() override { return b_.data(); }
  size_t size() const override { return b_.size(); }

 private:
  DeviceBuffer<float> b_;
};

// A recorded decode step: the instantiated CUDA graph and the device
// addresses baked into it that can change behind the model's back (the KV
// cache's buffers and the lazily grown scratch), checked before each replay.
class CudaStepGraph final : public StepGraph {
 public:
  CudaStepGraph(cudaGraphExec_t exec, std::vector<const void*> addresses, std::vector<const CudaLayerCache*> attended)
      : exec_(exec), addresses_(std::move(addresses)), attended_(std::move(attended)) {}
  ~CudaStepGraph() override {
    if (exec_) cudaGraphExecDestroy(exec_);
  }
  cudaGraphExec_t exec() const { return exec_; }
  const std::vector<const void*>& addresses() const { return addresses_; }
  // The layers whose attention one replay runs (dispatch counters).
  const std::vector<const CudaLayerCache*>& attended() const { return attended_; }

 private:
  cudaGraphExec_t exec_;
  std::vector<const void*> addresses_;
  std::vector<const CudaLayerCache*> attended_;
};

// The kernel settings of a backend's options (checked: the CLI passes user input).
KernelSettings kernel_settings(const BackendOptions& o) {
  KVQ_CHECK(o.gemv_warps >= 1 && o.gemv_warps <= 16, Errc::invalid_argument, "GEMV warps per CTA must be 1..16, not ",
            o.gemv_warps);
  KVQ_CHECK(o.attn_prefetch_tiles >= 0 && o.attn_prefetch_tiles <= 8, Errc::invalid_argument,
            "attention prefetch tiles must be 0..8, not ", o.attn_prefetch_tiles);
  KVQ_CHECK(o.batch_gemm_rows >= 0, Errc::invalid_argument, "batch GEMM rows must be >= 0, not ", o.batch_gemm_rows);
  KernelSettings s;
  s.dependent_launches = o.dependent_launches;
  s.gemv_warps = o.gemv_warps;
  s.attn_prefetch_tiles = o.attn_prefetch_tiles;
  s.prefill_wgmma = o.prefill_wgmma;
  return s;
}

// Every public entry point first makes the backend's device current
// (ctx_.make_current()): the caller's thread may have another device current
// (a second backend), and allocations, kernel attributes and launches apply
// to the current device.
class CudaBackend final : public Backend {
 public:
  CudaBackend(const BackendOptions& o, int device) : ctx_(device, kernel_settings(o)) {
    options_ = o;
    ctx_.make_current();
    // A stream of our own (not the legacy default stream, which cannot be
    // captured into a graph); created blocking, so it stays ordered with the
    // legacy-stream copies of DeviceBuffer::upload.
    KVQ_CUDA_CHECK(cudaStreamCreate(&stream_));
    KVQ_CUBLAS_CHECK(cublasCreate(&cublas_));
    KVQ_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
    step_dev_.resize(2);
    argmax_dev_.resize(1);
    argmax_work_.resize(2);
    KVQ_CUDA_CHECK(cudaMemset(argmax_work_.data(), 0, argmax_work_.bytes()));
  }
  ~CudaBackend() override {
    cudaSetDevice(ctx_.device());  // best effort: a destructor does not throw
    if (recording_) record_abort();
    if (cublas_) cublasDestroy(cublas_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  const char* name() const override { return "cuda"; }
  // Every prefill chunk dequantizes all weights into GEMM tiles: larger
  // chunks amortize that.
  int default_prefill_chunk() const override { return 2048; }
  // One sequence's chunk (run, chat, the one-sequence bench): fewer chunks
  // mean fewer passes over the weights' dequantization and, for quantized
  // stores, over the prefix's (every chunk dequantizes the whole prefix).
  // H200, 64k prompt (docs/perf.md, sessions 15 and 21): 2048 -> 8192 took
  // `none` from 7.02 to 6.74 s; 8192 -> 16384 leaves `none` at 4.95-4.97 s
  // and takes rotor3_sym+qjl 5.82 -> 5.66, k_rotor4+qjl 5.66 -> 5.42,
  // iso4_sym 5.36 -> 5.15 s, for ~1.5 GB more activations. 32768 and 65536
  // gain nothing more in steady state (session 22: rotor3_sym+qjl 5.35 /
  // 5.32 / 5.28 s, `none` 4.76 / 4.79 / 4.81). The scheduler and `kvq eval`
  // (all logits of a chunk: 5 GB at 8192) keep 2048.
  int default_session_prefill_chunk() const override { return 16384; }

  std::unique_ptr<Buffer> alloc(size_t n) override {
    ctx_.make_current();
    return std::make_unique<DeviceFloatBuffer>(n);
  }

  Matrix upload(const Matrix& host) override {
    ctx_.make_current();
    // Tied embeddings upload the same host tensor twice: keep one copy. The key
    // includes type and shape because a caller's freed buffer can be reused at
    // the same address for another matrix (host weights must not change while
    // the backend lives; mmap'd model files never do).
    const HostKey key{host.data, host.type, host.rows, host.cols};
    if (auto it = by_host_.find(key); it != by_host_.end()) return it->second;
    KVQ_CHECK(gpu_gemv_supported(host.type, host.cols), Errc::unsupported, "the CUDA backend does not support ",
              gguf::tensor_type_name(host.type), " weights with ", host.cols,
              " columns (quantized types need a multiple of 256 columns, float types a multiple of 8)");
    auto gm = std::make_unique<GpuMatrix>(
        GpuMatrix::upload(pack_matrix_for_gpu(host.type, host.rows, host.cols, host.data)));
    Matrix dev = host;
    dev.data = gm->codes.data();  // device address: only this backend dereferences it
    dev.handle = gm.get();
    owned_.push_back(std::move(gm));
    by_host_[key] = dev;
    return dev;
  }
  void upload(const float* host, float* dst, size_t n) override {
    ctx_.make_current();
    if (!n) return;
    KVQ_CUDA_CHECK(cudaMemcpyAsync(dst, host, n * sizeof(float), cudaMemcpyHostToDevice, stream_));
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void download(const float* src, float* host, size_t n) override {
    ctx_.make_current();
    if (!n) return;
    KVQ_CUDA_CHECK(cudaMemcpyAsync(host, src, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void embed(const Matrix& table, const int32_t* ids, int n, float* out) override {
    ctx_.make_current();
    const GpuMatrix& t = find(table);
    for (int i = 0; i < n; ++i)
      KVQ_CHECK(ids[i] >= 0 && ids[i] < table.rows, Errc::out_of_range, "token id ", ids[i],
                " is outside the model's vocabulary of ", table.rows, " tokens");
    if (in_step_) {
      KVQ_CHECK(n == 1 && ids[0] == step_host_[0], Errc::internal,
                "embed inside a decode step must use the step's token (begin_step)");
      embed_rows(t, step_dev_.data(), 1, out, stream_);  // the token id as begin_step stored it
      return;
    }
    if (in_batch_step_) {
      KVQ_CHECK(n == batch_step_tokens_, Errc::internal, "embed of ", n, " tokens inside a decode step of ",
                batch_step_tokens_, " (begin_step)");
      embed_rows(t, step_ids_.data(), n, out, stream_);  // the ids as begin_step uploaded them
      return;
    }
    if (ids_.size() < size_t(n)) ids_.resize(size_t(n));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(ids_.data(), ids, size_t(n) * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    embed_rows(t, ids_.data(), n, out, stream_);
    // The host ids may be freed once we return, so the copy must be done.
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void prepare_step(const StepBatch& batch) override {
    // A decode step of several sequences: every run is one token.
    bool decode = batch.n_seq() > 1;
    for (const kv::QueryRun& r : batch.runs) decode = decode && r.n == 1;
    decode_rows_ = decode ? batch.n_tok() : 0;
  }

  void matmul(const Matrix& w, const float* x, int n, float* y) override {
    ctx_.make_current();
    const GpuMatrix& m = find(w);
    if (n == 1) {
      GemvRequest req = step_gemv(x);
      req.out[0] = {&m, y};
      gemv(req, stream_, ctx_);
      return;
    }
    if (n <= 0) return;
    if (batched_decode(n)) {
      GemvBatchRequest req = batch_gemv(x, n);
      req.out[0] = {&m, y};
      batch_product(req);
      return;
    }
    f32_to_bf16(x, prefill_input(size_t(n) * m.cols), size_t(n) * m.cols, stream_);
    prefill_gemm(m, n, y, false);
  }

  // The bf16 input of prefill GEMMs (n x cols), grown as needed.
  uint16_t* prefill_input(size_t elems) {
    if (xbf_.size() < elems) xbf_.resize(elems);
    return xbf_.data();
  }
  // Prefill: y^T (rows x n, column-major) = W (rows x cols) * x^T (+ y^T when
  // accumulate) from the bf16 x in xbf_, with W read as the column-major
  // cols x rows matrix it is in memory (op T), dequantized to bf16 in tiles.
  void prefill_gemm(const GpuMatrix& m, int n, float* y, bool accumulate) {
    const int64_t block_rows = std::max<int64_t>(1, int64_t(kTileElems / size_t(m.cols)));
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    for (int64_t r0 = 0; r0 < m.rows; r0 += block_rows) {
      const int64_t rows = std::min(block_rows, m.rows - r0);
      const void* a = nullptr;
      if (m.type == gguf::TensorType::BF16) {
        a = m.codes.data() + size_t(r0) * m.cols * 2;  // already bf16: no copy
      } else {
        if (tile_.size() < size_t(rows) * m.cols) tile_.resize(size_t(std::min(block_rows, m.rows)) * m.cols);
        dequantize_rows_bf16(m, r0, rows, tile_.data(), stream_);
        a = tile_.data();
      }
      KVQ_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(rows), n, int(m.cols), &alpha, a,
                                    CUDA_R_16BF, int(m.cols), xbf_.data(), CUDA_R_16BF, int(m.cols), &beta,
                                    y + r0, CUDA_R_32F, int(m.rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
  }

  void rms_norm(const float* x, const float* weight, int n, int dim, float eps, float* y) override {
    ctx_.make_current();
    cuda::rms_norm(x, weight, n, dim, eps, y, stream_);
  }
  void rope(float* x, int n, int n_heads, int head_dim, int pos, const Rope& r) override {
    ctx_.make_current();
    set_rope_table(r, head_dim);
    if (in_step_) {
      check_step_pos(n, pos, "rope");
      cuda::rope_at(x, 1, n_heads, head_dim, step_dev_.data() + 1, inv_freq_.data(), r.neox, r.pos_scale, stream_);
      return;
    }
    cuda::rope(x, n, n_heads, head_dim, pos, inv_freq_.data(), r.neox, r.pos_scale, stream_);
  }
  void swiglu(const float* gate, const float* up, float* out, size_t n) override {
    ctx_.make_current();
    cuda::swiglu(gate, up, out, n, stream_);
  }
  void add(float* x, const float* y, size_t n) override {
    ctx_.make_current();
    cuda::add(x, y, n, stream_);
  }

  // --- fused single-token forms (multi-token calls run the plain ops)
  void norm_matmul(const float* x, const float* norm_w, int n, int dim, float eps, float* h, const Matrix* const* ws,
                   float* const* ys, int count) override {
    ctx_.make_current();
    if (n > 1 && !batched_decode(n)) {
      // Prefill: the norm writes the GEMMs' bf16 input once for all of them
      // (the same bits as rms_norm, then f32_to_bf16 per matrix).
      for (int i = 0; i < count; ++i) check_width(*ws[i], dim, "norm_matmul");
      rms_norm_bf16(x, norm_w, n, dim, eps, prefill_input(size_t(n) * dim), stream_);
      for (int i = 0; i < count; ++i) prefill_gemm(find(*ws[i]), n, ys[i], false);
      return;
    }
    if (count >= 1 && count <= 3 && same_kind(ws, count) && batched_decode(n)) {
      check_width(*ws[0], dim, "norm_matmul");
      GemvBatchRequest req = batch_gemv(x, n, norm_w, eps);
      req.n_out = count;
      for (int i = 0; i < count; ++i) req.out[i] = {&find(*ws[i]), ys[i]};
      batch_product(req);
      return;
    }
    if (n != 1 || count < 1 || count > 3 || !same_kind(ws, count)) {
      Backend::norm_matmul(x, norm_w, n, dim, eps, h, ws, ys, count);
      return;
    }
    check_width(*ws[0], dim, "norm_matmul");
    GemvRequest req = step_gemv(x, norm_w, eps);
    req.n_out = count;
    for (int i = 0; i < count; ++i) req.out[i] = {&find(*ws[i]), ys[i]};
    gemv(req, stream_, ctx_);
  }
  void matmul_add(const Matrix& w, const float* a, int n, float* x, float* tmp) override {
    ctx_.make_current();
    if (n > 1 && !batched_decode(n)) {
      // Prefill: the GEMM adds into x (beta = 1): no product to scratch, no
      // add kernel.
      const GpuMatrix& m = find(w);
      f32_to_bf16(a, prefill_input(size_t(n) * m.cols), size_t(n) * m.cols, stream_);
      prefill_gemm(m, n, x, true);
      return;
    }
    if (batched_decode(n)) {
      GemvBatchRequest req = batch_gemv(a, n);
      req.out[0] = {&find(w), x};
      req.epilogue = GemvEpilogue::add;
      batch_product(req);
      return;
    }
    if (n != 1) {
      Backend::matmul_add(w, a, n, x, tmp);
      return;
    }
    GemvRequest req = step_gemv(a);
    req.out[0] = {&find(w), x};
    req.epilogue = GemvEpilogue::add;
    gemv(req, stream_, ctx_);
  }
  void norm_swiglu(const float* x, const float* norm_w, int n, int dim, float eps, float* h, const Matrix& w_gate,
                   const Matrix& w_up, float* up, float* out) override {
    ctx_.make_current();
    const Matrix* pair[2] = {&w_gate, &w_up};
    if (batched_decode(n) && same_kind(pair, 2) && w_gate.rows == w_up.rows) {
      check_width(w_gate, dim, "norm_swiglu");
      GemvBatchRequest req = batch_gemv(x, n, norm_w, eps);
      req.n_out = 2;
      req.out[0] = {&find(w_gate), out};
      req.out[1] = {&find(w_up), nullptr};
      req.epilogue = GemvEpilogue::swiglu;
      batch_product(req);
      return;
    }
    if (n > 1 && !batched_decode(n)) {
      prefill_gate_up(x, norm_w, n, dim, eps, w_gate, w_up, out, up);
      swiglu(out, up, out, size_t(n) * size_t(w_gate.rows));
      return;
    }
    if (n != 1 || !same_kind(pair, 2) || w_gate.rows != w_up.rows) {
      Backend::norm_swiglu(x, norm_w, n, dim, eps, h, w_gate, w_up, up, out);
      return;
    }
    check_width(w_gate, dim, "norm_swiglu");
    GemvRequest req = step_gemv(x, norm_w, eps);
    req.n_out = 2;
    req.out[0] = {&find(w_gate), out};
    req.out[1] = {&find(w_up), nullptr};
    req.epilogue = GemvEpilogue::swiglu;
    gemv(req, stream_, ctx_);
  }
  void mlp_residual(float* x, const float* norm_w, int n, int dim, float eps, float* h, const Matrix& w_gate,
                    const Matrix& w_up, const Matrix& w_down, float* up, float* gate) override {
    ctx_.make_current();
    if (n <= 1 || batched_decode(n)) {
      Backend::mlp_residual(x, norm_w, n, dim, eps, h, w_gate, w_up, w_down, up, gate);
      return;
    }
    // Prefill: SwiGLU writes the down GEMM's bf16 input, and the down GEMM
    // adds into x (the same bits as norm_swiglu + matmul_add: test).
    const GpuMatrix& down = find(w_down);
    KVQ_CHECK(down.cols == w_gate.rows, Errc::internal, "mlp_residual: down has ", down.cols, " columns for ",
              w_gate.rows, " gate rows");
    prefill_gate_up(x, norm_w, n, dim, eps, w_gate, w_up, gate, up);
    // The GEMMs above are queued before SwiGLU overwrites their input.
    const size_t ff = size_t(n) * size_t(w_gate.rows);
    swiglu_bf16(gate, up, prefill_input(ff), ff, stream_);
    prefill_gemm(down, n, x, true);
  }
  // Prefill of gate and up (n rows): the norm writes their bf16 input once.
  void prefill_gate_up(const float* x, const float* norm_w, int n, int dim, float eps, const Matrix& w_gate,
                       const Matrix& w_up, float* gate, float* up) {
    check_width(w_gate, dim, "gate/up");
    check_width(w_up, dim, "gate/up");
    KVQ_CHECK(w_up.rows == w_gate.rows, Errc::internal, "gate/up: ", w_gate.rows, " gate rows and ", w_up.rows,
              " up rows");
    rms_norm_bf16(x, norm_w, n, dim, eps, prefill_input(size_t(n) * dim), stream_);
    prefill_gemm(find(w_gate), n, gate, false);
    prefill_gemm(find(w_up), n, up, false);
  }
  void qk_rope_write_kv(kv::LayerCache& layer, const StepBatch& batch, float* q, float* k, const float* v,
                        int n_heads, int n_kv_heads, int head_dim, const float* q_norm, const float* k_norm, float eps,
                        const Rope& r) override {
    ctx_.make_current();
    // A store with an exact window always takes the paged path: its block
    // tables say where the window is (an identity table names packed pages only).
    if (!batch.is_one_contiguous_sequence() || gpu_layer(layer).view().has_window()) {
      qk_rope_write_kv_paged(layer, batch, q, k, v, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, r);
      return;
    }
    const auto [pos, n] = one_sequence(batch, "qk_rope_write_kv");
    if (n > 1 && !in_step_) {
      // A prefill chunk: the fused kernel over the tokens' slots, as for
      // several sequences (the unfused ops ran a 256-thread block per
      // 128-value head row: ~190 us per 2,048-token layer on the H200).
      qk_rope_write_kv_paged(layer, batch, q, k, v, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, r);
      return;
    }
    if (n != 1 || !qk_rope_store_supported(head_dim)) {
      Backend::qk_rope_write_kv(layer, batch, q, k, v, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, r);
      return;
    }
    const CudaLayerCache& g = gpu_layer(layer);
    KVQ_CHECK(g.view().n_kv_heads == n_kv_heads, Errc::internal, "qk_rope_write_kv: cache has ", g.view().n_kv_heads,
              " KV heads, the call ", n_kv_heads);
    KVQ_CHECK(pos >= 0 && pos < g.view().max_tokens, Errc::out_of_range, "GPU KV cache: position ", pos,
              " is past its capacity of ", g.view().max_tokens, " tokens");
    set_rope_table(r, head_dim);
    const int* pos_dev = nullptr;
    if (in_step_) {
      check_step_pos(n, pos, "qk_rope_write_kv");
      pos_dev = step_dev_.data() + 1;
      note_recorded_cache(g);
    }
    // In a step whose attention plan takes q raw (AttentionPlan::fused_q), q
    // is left to it (QPrep): the store's encode then runs beside the
    // attention instead of before it.
    const bool q_in_attention = in_step_ && options().attn_fused_q &&
                                choose_attention(AttentionCase::of(g.view(), n_heads, true)).fused_q;
    qk_rope_store(q, k, v, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, pos, pos_dev, inv_freq_.data(), r.neox,
                  r.pos_scale, g.view(), stream_, q_in_attention, ctx_);
    pending_q_ = {};
    if (q_in_attention) pending_q_ = {q, &g, QPrep{q_norm, eps, RopeParams{inv_freq_.data(), r.neox, r.pos_scale}}};
  }

  void write_kv(kv::LayerCache& layer, const StepBatch& batch, const float* k, const float* v) override {
    ctx_.make_current();
    const CudaLayerCache& g = gpu_layer(layer);
    if (!batch.is_one_contiguous_sequence() || g.view().has_window()) {
      const BatchMirror m = mirror(batch, g.view(), "write_kv");
      cuda::write_kv_slots(g.view(), m.slot, batch.n_tok(), k, v, stream_);
      return;
    }
    const auto [pos, n] = one_sequence(batch, "write_kv");
    if (in_step_) {
      check_step_pos(n, pos, "write_kv");
      KVQ_CHECK(pos < g.view().max_tokens, Errc::out_of_range, "GPU KV cache: position ", pos,
                " is past its capacity of ", g.view().max_tokens, " tokens");
      note_recorded_cache(g);
      cuda::write_kv_at(g.view(), step_dev_.data() + 1, k, v, stream_);
      return;
    }
    cuda::write_kv(g.view(), pos, n, k, v, stream_);
  }
  void attention(const kv::LayerCache& layer, const StepBatch& batch, const float* q, int n_heads, float scale,
                 float* out) override {
    ctx_.make_current();
    const CudaLayerCache& g = gpu_layer(layer);
    if (!batch.is_one_contiguous_sequence() || g.view().has_window()) {
      attention_paged(g, batch, q, n_heads, scale, out);
      return;
    }
    const auto [pos, n] = one_sequence(batch, "attention");
    if (in_step_) {
      check_step_pos(n, pos, "attention");
      // The q of this layer's qk_rope_write_kv, left raw for this call.
      const bool raw_q = pending_q_.q != nullptr;
      KVQ_CHECK(!raw_q || (pending_q_.q == q && pending_q_.layer == &g), Errc::internal,
                "attention: q was left raw for another call");
      const QPrep prep = pending_q_.prep;
      pending_q_ = {};
      flash_attention_decode_at(g.view(), step_dev_.data() + 1, q, n_heads, scale, out, g.scratch(), stream_,
                                raw_q ? &prep : nullptr, ctx_);
      note_recorded_cache(g);
      if (recording_) recorded_attention_.push_back(&g);
      else count_attention(g, true);
      return;
    }
    flash_attention(g.view(), pos, n, q, n_heads, scale, out, g.scratch(), stream_, ctx_);
    count_attention(g, n == 1);
  }

  int32_t argmax(const float* x, size_t n) override {
    ctx_.make_current();
    KVQ_CHECK(n > 0 && n <= size_t(INT32_MAX), Errc::internal, "argmax over ", n, " values");
    cuda::argmax(x, int(n), argmax_dev_.data(), argmax_work_.data(), stream_, ctx_);
    int32_t best = 0;
    KVQ_CUDA_CHECK(cudaMemcpyAsync(&best, argmax_dev_.data(), sizeof best, cudaMemcpyDeviceToHost, stream_));
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return best;
  }

  void argmax_rows(const float* x, int rows, size_t n, size_t stride, int32_t* out, float* value) override {
    ctx_.make_current();
    KVQ_CHECK(rows > 0 && n > 0 && n <= size_t(INT32_MAX), Errc::internal, "argmax over ", rows, " rows of ", n);
    if (rows_work_rows_ < rows) {
      rows_out_.resize(size_t(rows));
      rows_value_.resize(size_t(rows));
      rows_work_.resize(2 * size_t(rows));
      KVQ_CUDA_CHECK(cudaMemset(rows_work_.data(), 0, rows_work_.bytes()));
      rows_work_rows_ = rows;
    }
    cuda::argmax_rows(x, rows, int(n), stride, rows_out_.data(), rows_value_.data(), rows_work_.data(), stream_, ctx_);
    KVQ_CUDA_CHECK(cudaMemcpyAsync(out, rows_out_.data(), size_t(rows) * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                   stream_));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(value, rows_value_.data(), size_t(rows) * sizeof(float), cudaMemcpyDeviceToHost,
                                   stream_));
    KVQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  // --- recorded decode steps: CUDA graphs captured on stream_
  bool supports_step_graphs() const override { return true; }
  void begin_step(const StepBatch& batch) override {
    ctx_.make_current();
    KVQ_CHECK(!recording_ && !in_step_ && !in_batch_step_, Errc::internal,
              "begin_step while a step is being recorded or inside another");
    if (!batch.is_one_contiguous_sequence()) {
      begin_batch_step(batch);
      return;
    }
    const auto [pos, n] = one_sequence(batch, "begin_step");
    KVQ_CHECK(n == 1, Errc::internal, "a recorded decode step runs one token, not ", n);
    const int32_t token = batch.token[0];
    step_host_[0] = token;
    step_host_[1] = pos;
    pending_q_ = {};
    // Pageable source: the call returns once the 8 bytes are staged, so
    // step_host_ may change afterwards; stream order puts the copy before the
    // step's kernels (or graph launch).
    KVQ_CUDA_CHECK(cudaMemcpyAsync(step_dev_.data(), step_host_, sizeof step_host_, cudaMemcpyHostToDevice, stream_));
    in_step_ = true;
  }
  void end_step() override {
    in_step_ = in_batch_step_ = false;
    batch_step_ = nullptr;
    pending_q_ = {};
  }
  // A decode step of several sequences (every run one token, run z at row
  // z): the token ids and the batch mirror (positions, slots, block tables)
  // go to device buffers now, and the step's ops read them from there
  // (embed, mirror()), so a recording of the step replays for any later
  // step of the same shape (Model::batch_step): the number of tokens and
  // the longest block table, which sets the attention's work split.
  void begin_batch_step(const StepBatch& batch) {
    const int n = batch.n_tok();
    KVQ_CHECK(n >= 1 && batch.n_seq() == n, Errc::unsupported,
              "a recorded CUDA step of several sequences is a decode step (one token each), not ", n, " tokens of ",
              batch.n_seq(), " sequences");
    KVQ_CHECK(is_decode_step(batch), Errc::unsupported,
              "a recorded CUDA step of several sequences is a decode step (one token each)");
    if (step_ids_.size() < size_t(n)) step_ids_.resize(size_t(n));
    // Pageable source: staged before the call returns (batch may change afterwards).
    KVQ_CUDA_CHECK(cudaMemcpyAsync(step_ids_.data(), batch.token.data(), size_t(n) * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream_));
    int stride = 1;
    for (const kv::QueryRun& r : batch.runs) stride = std::max(stride, r.n_pages);
    batch_step_mirror_ = upload_mirror(batch, stride);
    batch_step_tokens_ = n;
    batch_step_ = &batch;  // valid until end_step: replay() checks it against the cache
    pending_q_ = {};
    in_batch_step_ = true;
  }
  void record_begin() override {
    ctx_.make_current();
    KVQ_CHECK((in_step_ || in_batch_step_) && !recording_, Errc::internal,
              "record_begin outside begin_step/end_step or twice");
    recorded_cache_ = nullptr;
    recorded_attention_.clear();
    KVQ_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    recording_ = true;
  }
  std::unique_ptr<StepGraph> record_end() override {
    ctx_.make_current();
    KVQ_CHECK(recording_, Errc::internal, "record_end without record_begin");
    recording_ = false;
    cudaGraph_t graph = nullptr;
    KVQ_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    KVQ_CUDA_CHECK(err);
    // The addresses baked in: the cache's (its stores and attention scratch,
    // whose sizes were settled by the warm step) and this backend's scratch.
    std::vector<const void*> addresses;
    if (recorded_cache_) addresses = recorded_cache_->graph_addresses();
    recorded_cache_ = nullptr;
    append_backend_addresses(addresses);
    return std::make_unique<CudaStepGraph>(exec, std::move(addresses), std::move(recorded_attention_));
  }
  void record_abort() override {
    if (!recording_) return;
    recording_ = false;
    cudaGraph_t graph = nullptr;
    if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
    cudaGetLastError();  // clear the (non-sticky) error the broken capture left behind
  }
  bool replay(const StepGraph& graph, kv::Cache& cache) override {
    ctx_.make_current();
    KVQ_CHECK((in_step_ || in_batch_step_) && !recording_, Errc::internal, "replay outside begin_step/end_step");
    const auto* g = dynamic_cast<const CudaStepGraph*>(&graph);
    KVQ_CHECK(g, Errc::internal, "the CUDA backend was asked to replay another backend's recording");
    // The addresses the recording baked in, recomputed for this cache now.
    const auto* gc = dynamic_cast<const CudaKvCache*>(&cache);
    KVQ_CHECK(gc, Errc::unsupported, "the CUDA backend needs its own KV cache (Backend::make_cache)");
    std::vector<const void*> now = gc->graph_addresses();
    append_backend_addresses(now);
    if (now != g->addresses()) return false;
    // The ops of a replayed step check nothing: the begun batch is checked
    // against this cache's store here (every layer's is shaped alike).
    if (in_batch_step_) check_mirror(*batch_step_, gpu_layer(cache.layer(0)).view(), "a replayed decode step");
    KVQ_CUDA_CHECK(cudaGraphLaunch(g->exec(), stream_));
    for (const CudaLayerCache* l : g->attended()) count_attention(*l, true);
    return true;
  }

  std::unique_ptr<kv::Cache> make_cache(const kv::CodecOptions& opts, const kv::CacheShape& shape) override {
    ctx_.make_current();
    // The serving form of the window (shape.window_pages) is the store's;
    // the evaluation form keeps every row twice and is the CPU store's.
    KVQ_CHECK(opts.exact_window_pages == 0, Errc::unsupported,
              "the evaluation form of the exact window (kvq eval --kv-window) runs on the CPU backend only: use "
              "--device cpu");
    return make_cuda_kv_cache(opts, shape);
  }

  // --- measurement (kvq bench)
  DeviceInfo device_info() override {
    ctx_.make_current();
    DeviceInfo d;
    const int dev = ctx_.device();
    const cudaDeviceProp& p = ctx_.properties();
    d.name = p.name;
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    d.driver = str("CUDA driver API ", drv / 1000, ".", (drv % 1000) / 10, ", runtime ", rt / 1000, ".",
                   (rt % 1000) / 10, "; sm_", p.major, p.minor, ", ", p.multiProcessorCount, " SMs, ",
                   p.totalGlobalMem >> 20, " MiB");
    int sm_khz = 0, mem_khz = 0;
    cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, dev);
    cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev);
    d.clocks = str("peak SM ", sm_khz / 1000, " MHz, peak memory ", mem_khz / 1000, " MHz");
    // The driver version and current clocks only nvidia-smi knows (NVML is
    // not linked); absent on machines without it.
    char bus[32] = {0};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, dev) == cudaSuccess) {
      const std::string cmd = std::string("nvidia-smi --id=") + bus +
                              " --query-gpu=driver_version,clocks.sm,clocks.mem,clocks.max.sm"
                              " --format=csv,noheader 2>/dev/null";
      if (FILE* f = popen(cmd.c_str(), "r")) {
        char line[256] = {0};
        const bool got = std::fgets(line, sizeof line, f) != nullptr;
        pclose(f);
        std::string l = got ? line : "";
        while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
        if (!l.empty()) d.clocks += "; nvidia-smi driver, SM, memory, max SM: " + l;
      }
    }
    return d;
  }
  int64_t device_memory_used() override {
    ctx_.make_current();
    size_t free_b = 0, total_b = 0;
    KVQ_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return int64_t(total_b - free_b);
  }
  double measure_copy_bandwidth() override {
    ctx_.make_current();
    // Device-to-device copies of a buffer far larger than L2 (50 MB on an
    // H200), timed with events; the best of a few after one warm-up copy.
    size_t free_b = 0, total_b = 0;
    KVQ_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    size_t bytes = size_t(1) << 30;
    while (bytes > (size_t(64) << 20) && 2 * bytes + (size_t(256) << 20) > free_b) bytes /= 2;
    DeviceBuffer<uint8_t> src(bytes), dst(bytes);
    KVQ_CUDA_CHECK(cudaMemsetAsync(src.data(), 1, bytes, stream_));
    cudaEvent_t t0 = nullptr, t1 = nullptr;
    KVQ_CUDA_CHECK(cudaEventCreate(&t0));
    KVQ_CUDA_CHECK(cudaEventCreate(&t1));
    float best_ms = 1e30f;
    for (int rep = 0; rep < 6; ++rep) {
      KVQ_CUDA_CHECK(cudaEventRecord(t0, stream_));
      KVQ_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, stream_));
      KVQ_CUDA_CHECK(cudaEventRecord(t1, stream_));
      KVQ_CUDA_CHECK(cudaEventSynchronize(t1));
      float ms = 0;
      KVQ_CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
      if (rep > 0) best_ms = std::min(best_ms, ms);
    }
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    return 2.0 * double(bytes) / (double(best_ms) * 1e-3);  // read + write
  }

 private:
  const GpuMatrix& find(const Matrix& w) const {
    const auto* gm = static_cast<const GpuMatrix*>(w.handle);
    KVQ_CHECK(gm && w.data == gm->codes.data(), Errc::internal,
              "CUDA backend: a matrix was used that this backend did not upload (call Backend::upload first)");
    return *gm;
  }
  static CudaLayerCache& gpu_layer(kv::LayerCache& layer) {
    auto* g = dynamic_cast<CudaLayerCache*>(&layer);
    KVQ_CHECK(g, Errc::unsupported,
              "the CUDA backend needs its own KV cache (Backend::make_cache); a CPU cache was passed");
    return *g;
  }
  static const CudaLayerCache& gpu_layer(const kv::LayerCache& layer) {
    auto* g = dynamic_cast<const CudaLayerCache*>(&layer);
    KVQ_CHECK(g, Errc::unsupported,
              "the CUDA backend needs its own KV cache (Backend::make_cache); a CPU cache was passed");
    return *g;
  }

  // The RoPE frequency table is uploaded once and again only if a different one is passed.
  void set_rope_table(const Rope& r, int head_dim) {
    KVQ_CHECK(int(r.inv_freq.size()) == head_dim / 2, Errc::internal, "rope: ", r.inv_freq.size(),
              " frequencies for head_dim ", head_dim);
    if (inv_freq_host_ != r.inv_freq) {
      KVQ_CHECK(!recording_, Errc::internal, "the RoPE table changed while recording a decode step");
      inv_freq_host_ = r.inv_freq;
      inv_freq_.upload(inv_freq_host_);
    }
  }
  // A single-token GEMV launch over input x (RMSNorm(x) * norm_w when norm_w
  // is set), with this backend's scratch; the caller adds the outputs.
  GemvRequest step_gemv(const float* x, const float* norm_w = nullptr, float eps = 0.0f) {
    GemvRequest req;
    req.x = x;
    req.norm_weight = norm_w;
    req.norm_eps = eps;
    return req;
  }
  // Weight products of n > 1 rows inside a decode step of several sequences
  // (prepare_step) go through gemv_batch: each weight is read once per
  // launch for all of them, with gemv()'s arithmetic per row, so every
  // sequence gets what it would get decoding alone up to the order of fp32
  // sums. Prefill chunks keep the cuBLAS GEMM (their rows would otherwise be
  // staged to int8 where the GEMM takes bf16: docs/perf.md, session 10).
  bool batched_decode(int n) const { return n > 1 && n <= decode_rows_; }
  GemvBatchRequest batch_gemv(const float* x, int n, const float* norm_w = nullptr, float eps = 0.0f) const {
    GemvBatchRequest req;
    req.x = x;
    req.batch = n;
    req.norm_weight = norm_w;
    req.norm_eps = eps;
    return req;
  }
  // From options().batch_gemm_rows rows on, types with a tensor-core GEMM
  // (Q8_0/Q4_0/Q1_0: the same int8 staging and exact block sums as
  // gemv_batch) take it; the others stay on gemv_batch. gemm_tc quantizes
  // x once per launch into gemm_ws_ (grown here, outside any graph
  // recording: batch steps are not recorded).
  void batch_product(const GemvBatchRequest& req) {
    const int from = options().batch_gemm_rows;
    if (from > 0 && req.batch >= from && gemm_tc_supported(req.out[0].w->type)) {
      if (!options().gemm_tc_prestage) {
        gemm_tc(req, {}, stream_, ctx_);  // null workspace: each CTA stages its own slice of x
        return;
      }
      const size_t need = gemm_tc_workspace_bytes(req.batch, req.out[0].w->cols);
      if (gemm_ws_.bytes() < need) {
        KVQ_CHECK(!recording_, Errc::internal, "gemm_tc workspace grown while a step is being recorded");
        gemm_ws_.resize(need);  // cudaFree of the old buffer waits for the kernels using it
      }
      gemm_tc(req, {gemm_ws_.data(), gemm_ws_.bytes()}, stream_, ctx_);
    } else {
      gemv_batch(req, stream_, ctx_);
    }
  }
  // A fused norm + GEMV normalizes `dim` inputs: the matrix must take that many.
  void check_width(const Matrix& w, int dim, const char* op) const {
    KVQ_CHECK(find(w).cols == dim, Errc::internal, op, ": ", dim, " inputs for a matrix of ", find(w).cols,
              " columns");
  }
  // Matrices one fused launch can take: the same type and width.
  bool same_kind(const Matrix* const* ws, int count) const {
    for (int i = 1; i < count; ++i)
      if (ws[i]->type != ws[0]->type || ws[i]->cols != ws[0]->cols) return false;
    return true;
  }
  // The (position, count) of a one-sequence batch whose slots are its
  // positions (a Session's identity table): the path of the fused
  // single-token ops and of recorded steps. Other batches take the paged
  // path (mirror(), attention_paged()).
  static std::pair<int, int> one_sequence(const StepBatch& b, const char* op) {
    KVQ_CHECK(b.is_one_contiguous_sequence(), Errc::unsupported, op,
              ": a recorded CUDA decode step runs one sequence over its identity block table, not a step of ",
              b.n_seq(), " sequences");
    return {b.pos[0], b.n_tok()};
  }

  // ---- paged steps (any StepBatch): the batch's positions, slots and block
  // tables mirrored to device memory, one copy per step (a layer's ops see
  // the same batch: the copy is skipped when nothing changed).
  struct BatchMirror {
    const int32_t* pos = nullptr;      // [n_tok] each token's position
    const int32_t* slot = nullptr;     // [n_tok] each token's slot
    const int32_t* run_pos = nullptr;  // [n_seq] each run's first position
    const int32_t* pages = nullptr;    // [n_seq][stride] block tables, padded with page 0 (never read)
    int stride = 1;
  };
  BatchMirror mirror(const StepBatch& b, const GpuKvLayer& store, const char* op) {
    KVQ_CHECK(!in_step_, Errc::unsupported, op,
              ": a recorded CUDA decode step of one sequence runs over its identity block table");
    if (in_batch_step_) {
      // begin_batch_step mirrored this step's batch; its ops read that copy.
      KVQ_CHECK(b.n_tok() == batch_step_tokens_ && b.n_seq() == batch_step_tokens_, Errc::internal, op, ": ",
                b.n_tok(), " tokens inside a decode step of ", batch_step_tokens_, " (begin_step)");
      check_mirror(b, store, op);
      return batch_step_mirror_;
    }
    KVQ_CHECK(!recording_, Errc::unsupported, op, ": a step being recorded must begin with begin_step");
    return upload_mirror(b, check_mirror(b, store, op));
  }
  // The checks upload_mirror makes of a batch against a store (without the copy).
  int check_mirror(const StepBatch& b, const GpuKvLayer& store, const char* op) const {
    const int n_tok = b.n_tok();
    KVQ_CHECK(n_tok > 0 && b.n_seq() > 0 && int(b.pos.size()) == n_tok && int(b.slot.size()) == n_tok,
              Errc::internal, op, ": a step batch of ", n_tok, " tokens with ", b.pos.size(), " positions and ",
              b.slot.size(), " slots");
    // Page ids: the packed pages, then (a store with an exact window) its exact ones.
    const int all_pages = store.n_pages + store.n_exact_pages;
    const int64_t n_slots = int64_t(all_pages) * store.page_tokens;
    int stride = 1;
    for (const kv::QueryRun& r : b.runs) {
      KVQ_CHECK(r.n >= 1 && r.pos >= 0 && r.first >= 0 && r.first + r.n <= n_tok &&
                    kv::pages_for(r.pos + r.n, store.page_tokens) <= r.n_pages,
                Errc::out_of_range, op, ": a run of ", r.n, " tokens at position ", r.pos, " over ", r.n_pages,
                " pages of ", store.page_tokens, " tokens");
      for (int i = 0; i < r.n_pages; ++i)
        KVQ_CHECK(r.pages[i] >= 0 && r.pages[i] < all_pages, Errc::out_of_range, op, ": page ", r.pages[i],
                  " of a block table outside the GPU KV store's ", all_pages, " pages");
      if (store.has_window()) check_window_table(store, r.pages, kv::pages_for(r.pos + r.n, store.page_tokens));
      stride = std::max(stride, r.n_pages);
    }
    KVQ_CHECK(stride <= all_pages, Errc::out_of_range, op, ": a block table of ", stride, " pages over a store of ",
              all_pages);
    for (int t = 0; t < n_tok; ++t)
      KVQ_CHECK(b.slot[size_t(t)] >= 0 && b.slot[size_t(t)] < n_slots, Errc::out_of_range, op, ": slot ",
                b.slot[size_t(t)], " outside the GPU KV store's ", n_slots, " slots");
    return stride;
  }
  // The batch's positions, slots, first positions and block tables (padded
  // to `stride` pages) in batch_dev_; the copy is skipped when they did not
  // change since the last one (a layer's ops see the same batch).
  BatchMirror upload_mirror(const StepBatch& b, int stride) {
    const int n_tok = b.n_tok(), n_seq = b.n_seq();
    std::vector<int32_t>& h = batch_next_;
    h.assign(size_t(2) * n_tok + n_seq + size_t(n_seq) * stride, 0);
    std::copy(b.pos.begin(), b.pos.end(), h.begin());
    std::copy(b.slot.begin(), b.slot.end(), h.begin() + n_tok);
    for (int z = 0; z < n_seq; ++z) {
      const kv::QueryRun& r = b.runs[size_t(z)];
      h[size_t(2) * n_tok + z] = r.pos;
      std::copy(r.pages, r.pages + r.n_pages, h.begin() + 2 * n_tok + n_seq + size_t(z) * stride);
    }
    if (h != batch_host_) {
      if (batch_dev_.size() < h.size()) batch_dev_.resize(h.size());
      // Pageable source: staged before the call returns; stream order puts
      // the copy after the kernels that read the previous contents.
      KVQ_CUDA_CHECK(cudaMemcpyAsync(batch_dev_.data(), h.data(), h.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                     stream_));
      batch_host_.swap(h);
    }
    BatchMirror m;
    m.pos = batch_dev_.data();
    m.slot = m.pos + n_tok;
    m.run_pos = m.slot + n_tok;
    m.pages = m.run_pos + n_seq;
    m.stride = stride;
    return m;
  }

  // Norm, RoPE at each token's position and the store's encode at each
  // token's slot, one launch for the batch (qk_rope_store over n_tok rows).
  void qk_rope_write_kv_paged(kv::LayerCache& layer, const StepBatch& batch, float* q, float* k, const float* v,
                              int n_heads, int n_kv_heads, int head_dim, const float* q_norm, const float* k_norm,
                              float eps, const Rope& r) {
    const CudaLayerCache& g = gpu_layer(layer);
    KVQ_CHECK(g.view().n_kv_heads == n_kv_heads, Errc::internal, "qk_rope_write_kv: cache has ", g.view().n_kv_heads,
              " KV heads, the call ", n_kv_heads);
    if (!qk_rope_store_supported(head_dim) || batch.n_tok() > 65535) {
      // The unfused ops take each token's position from the host.
      KVQ_CHECK(!recording_, Errc::unsupported, "qk_rope_write_kv: head_dim ", head_dim,
                " has no fused kernel, so decode steps of several sequences are not recorded");
      Backend::qk_rope_write_kv(layer, batch, q, k, v, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, r);
      return;
    }
    const BatchMirror m = mirror(batch, g.view(), "qk_rope_write_kv");
    set_rope_table(r, head_dim);
    pending_q_ = {};
    // A decode step over an exact window writes only window rows, which the
    // attention's window CTA reads after waiting for this kernel: q can be
    // left raw to the attention (as for one sequence without a window), and
    // the packed CTAs start without waiting for this store.
    const bool q_in_attention = (in_step_ || in_batch_step_) && options().attn_fused_q && g.view().has_window() &&
                                is_decode_step(batch) &&
                                choose_attention(AttentionCase::of(g.view(), n_heads, true)).fused_q;
    qk_rope_store(q, k, v, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, 0, m.pos, inv_freq_.data(), r.neox,
                  r.pos_scale, g.view(), stream_, q_in_attention, ctx_, batch.n_tok(), m.slot);
    if (q_in_attention) pending_q_ = {q, &g, QPrep{q_norm, eps, RopeParams{inv_freq_.data(), r.neox, r.pos_scale}}};
  }
  // Every run one token, run z at row z.
  static bool is_decode_step(const StepBatch& batch) {
    for (int z = 0; z < batch.n_seq(); ++z)
      if (batch.runs[size_t(z)].n != 1 || batch.runs[size_t(z)].first != z) return false;
    return true;
  }

  // One batched decode launch when every run is one token and run z is row
  // z (a decode step); otherwise each run over its block table (a prefill
  // chunk, or a mixed step).
  void attention_paged(const CudaLayerCache& g, const StepBatch& batch, const float* q, int n_heads, float scale,
                       float* out) {
    const BatchMirror m = mirror(batch, g.view(), "attention");
    const int n_seq = batch.n_seq();
    const bool decode = is_decode_step(batch);
    // The q of this layer's qk_rope_write_kv_paged, left raw for this call.
    const bool raw_q = pending_q_.q != nullptr;
    KVQ_CHECK(!raw_q || (pending_q_.q == q && pending_q_.layer == &g), Errc::internal,
              "attention: q was left raw for another call");
    const QPrep prep = pending_q_.prep;
    pending_q_ = {};
    const AttentionPlan plan = choose_attention(AttentionCase::of(g.view(), n_heads, true));
    const bool tensor_core = plan.kernel == AttentionKernel::decode_tc || plan.kernel == AttentionKernel::decode_km;
    if (decode && n_seq <= 65535 && tensor_core && flash_decode_supported(n_heads, g.view().n_kv_heads,
                                                                          g.view().head_dim, q, out)) {
      DecodeBatch b;
      b.n_seq = n_seq;
      b.pos_dev = m.run_pos;
      b.pages = m.pages;
      b.table_stride = m.stride;
      flash_decode_batch(plan, g.view(), b, q, n_heads, scale, out, g.scratch(), stream_, raw_q ? &prep : nullptr, ctx_);
      note_recorded_cache(g);
      if (recording_) recorded_attention_.push_back(&g);
      else count_attention(g, true);
      return;
    }
    KVQ_CHECK(!raw_q, Errc::internal, "attention: q left raw for a per-run attention");
    // Per-run launches take each run's position from the host: they cannot
    // be replayed for another step.
    KVQ_CHECK(!recording_, Errc::unsupported, "the ", plan.name(),
              " decode attention of this codec runs per sequence with host positions: such steps are not recorded");
    const size_t row = size_t(n_heads) * g.view().head_dim;
    for (int z = 0; z < n_seq; ++z) {
      const kv::QueryRun& r = batch.runs[size_t(z)];
      flash_attention(g.view(), r.pos, r.n, q + r.first * row, n_heads, scale, out + r.first * row, g.scratch(),
                      stream_, ctx_, m.pages + size_t(z) * m.stride);
      count_attention(g, r.n == 1);
    }
  }
  void check_step_pos(int n, int pos, const char* op) const {
    KVQ_CHECK(n == 1 && pos == step_host_[1], Errc::internal, op,
              " inside a decode step must be one token at the step's position (begin_step)");
  }
  // Dispatch proof: attention calls per (layer, phase) of the caches passed to
  // reset_dispatch_stats, counted where they are launched (a replayed step
  // counts the attention launches it recorded). The kernel is the one the
  // selector chose for the cache. KV bytes never cross between host and
  // device here: the store is written only by encode kernels from device
  // buffers and read only by attention kernels, so those counters stay 0 by
  // construction (no copy path exists to count).
  void reset_dispatch_stats(kv::Cache& cache) override {
    for (int l = 0; l < cache.shape().n_layers; ++l) attention_calls_[&gpu_layer(cache.layer(l))] = {0, 0};
  }
  DispatchStats dispatch_stats(kv::Cache& cache) override {
    DispatchStats s;
    s.counted = true;
    const auto* gc = dynamic_cast<const CudaKvCache*>(&cache);
    KVQ_CHECK(gc, Errc::unsupported, "the CUDA backend needs its own KV cache (Backend::make_cache)");
    for (int l = 0; l < cache.shape().n_layers; ++l) {
      const auto it = attention_calls_.find(&gpu_layer(cache.layer(l)));
      if (it == attention_calls_.end()) continue;
      if (it->second[0]) s.attention.push_back({l, gc->prefill_kernel(), false, it->second[0]});
      if (it->second[1]) s.attention.push_back({l, gc->decode_kernel(), true, it->second[1]});
    }
    return s;
  }
  void count_attention(const CudaLayerCache& g, bool decode) {
    if (auto it = attention_calls_.find(&g); it != attention_calls_.end()) ++it->second[decode ? 1 : 0];
  }

  // A step being recorded reads and writes this layer's cache (one cache per step).
  void note_recorded_cache(const CudaLayerCache& g) {
    if (!recording_) return;
    KVQ_CHECK(!recorded_cache_ || recorded_cache_ == &g.cache(), Errc::internal,
              "a recorded decode step used two KV caches");
    recorded_cache_ = &g.cache();
  }
  // Backend scratch a recorded step reads or writes.
  void append_backend_addresses(std::vector<const void*>& a) const {
    a.push_back(inv_freq_.data());
    a.push_back(gemm_ws_.data());
    a.push_back(step_ids_.data());
    a.push_back(batch_dev_.data());
  }

  DeviceContext ctx_;  // first member: the others are made on its device
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  // Decode-step inputs: [0] token id, [1] position (device copy + host mirror).
  DeviceBuffer<int32_t> step_dev_, argmax_dev_;
  DeviceBuffer<unsigned long long> argmax_work_;  // cuda::argmax's cross-CTA state (zero between calls)
  // argmax_rows: results and cross-CTA state for up to rows_work_rows_ rows.
  DeviceBuffer<int32_t> rows_out_;
  DeviceBuffer<float> rows_value_;
  DeviceBuffer<unsigned long long> rows_work_;
  int rows_work_rows_ = 0;
  int32_t step_host_[2] = {0, 0};
  bool in_step_ = false, recording_ = false;
  // Inside a decode step of several sequences (begin_batch_step): its token
  // ids in step_ids_, its batch mirrored in batch_step_mirror_.
  bool in_batch_step_ = false;
  int batch_step_tokens_ = 0;
  const StepBatch* batch_step_ = nullptr;
  BatchMirror batch_step_mirror_;
  DeviceBuffer<int32_t> step_ids_;
  int decode_rows_ = 0;  // rows of the current step when it is a decode step of several sequences, else 0
  // A step's q left raw by qk_rope_write_kv for the attention of the same
  // layer (the fused q path); consumed by that call, dropped at end_step.
  struct PendingQ {
    const float* q = nullptr;
    const CudaLayerCache* layer = nullptr;
    QPrep prep;
  };
  PendingQ pending_q_;
  const CudaKvCache* recorded_cache_ = nullptr;  // the cache of the step being recorded
  std::vector<const CudaLayerCache*> recorded_attention_;  // its attention launches, in order
  std::map<const CudaLayerCache*, std::array<uint64_t, 2>> attention_calls_;  // [prefill, decode]
  std::vector<std::unique_ptr<GpuMatrix>> owned_;      // Matrix::handle points at these
  using HostKey = std::tuple<const uint8_t*, gguf::TensorType, int64_t, int64_t>;
  std::map<HostKey, Matrix> by_host_;  // host tensor -> upload (tied embeddings share one)
  DeviceBuffer<int32_t> ids_;
  // The paged step's device mirror (BatchMirror) and the host values it holds.
  DeviceBuffer<int32_t> batch_dev_;
  std::vector<int32_t> batch_host_, batch_next_;
  DeviceBuffer<uint16_t> xbf_, tile_;
  DeviceBuffer<float> inv_freq_;
  DeviceBuffer<uint8_t> gemm_ws_;  // gemm_tc's prestaged x (batch_product)
  std::vector<float> inv_freq_host_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options, int device) {
  KVQ_CHECK(device_available(), Errc::unsupported,
            "the CUDA backend is not available: no CUDA device is visible (check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES); use --device cpu");
  int count = 0;
  KVQ_CUDA_CHECK(cudaGetDeviceCount(&count));
  KVQ_CHECK(device < count, Errc::invalid_argument, "CUDA device ", device, " does not exist (", count, " visible)");
  return std::make_unique<CudaBackend>(options, device < 0 ? current_device() : device);
}

}  // namespace kvq::cuda
