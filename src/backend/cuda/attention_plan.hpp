// Kernel selection for GPU attention: the one function that says which
// kernel runs a case (choose_attention), and the plan it returns. Pure logic
// (no GPU needed): `kvq codecs` asks it for its GPU column (through
// gpu_codec_support), the KV cache asks it before allocating, and attention
// launches the kernel the plan names (attention.cu, flash_decode) without
// deciding again. C++17-clean: included by .cu files.
#pragma once

#include <string>

#include "backend/cuda/kv_store.hpp"

namespace kvq::kv {
struct BlockSpec;
}

namespace kvq::cuda {

// The question: a store's K and V blocks at a model shape, decode or prefill.
// q and out alignment is not part of it: the kernels that need 16-byte
// aligned q and out (the tensor-core decode kernel) check it as an invariant
// (the model's buffers and the tests' are cudaMalloc'd rows of whole heads).
struct AttentionCase {
  int head_dim = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  kv::Family k = kv::Family::bf16, v = kv::Family::bf16;
  int k_bits = 16, v_bits = 16;  // the blocks' bits (turbo3: 3)
  bool k_qjl = false;            // K side +qjl
  bool v_qjl = false;            // V side +qjl (no block has one today; the store can say so)
  bool decode = true;            // n == 1 (false: prefill, n > 1)

  // The case of a codec's blocks (`kvq codecs`, the cache) ...
  static AttentionCase of(const kv::BlockSpec& k, const kv::BlockSpec& v, int head_dim, int n_heads, int n_kv_heads,
                          bool decode);
  // ... and of a store being attended (the launch).
  static AttentionCase of(const GpuKvLayer& store, int n_heads, bool decode);
};

enum class AttentionKernel {
  unsupported,
  // Decode over the packed store: the tensor-core split-KV kernel
  // (attention_decode.cu), queries-major, or its keys-major form (low-bit
  // staged V sides, GQA group <= 8). Rotated sides rotate q and un-rotate o
  // inside the kernel.
  decode_tc,
  decode_km,
  // The CUDA-core split-KV kernel over bf16 rows (attention.cu): decode of a
  // bf16 store the tensor-core kernel does not cover, prefill of shapes
  // prefill_tc does not cover.
  cuda_core,
  // Prefill over bf16 rows: the tensor-core flash kernel (attention_prefill.cu).
  prefill_tc,
};

struct AttentionPlan {
  AttentionCase of;  // the case it answers
  AttentionKernel kernel = AttentionKernel::unsupported;
  int instance = -1;            // decode_tc / decode_km: the compiled instance (attention_decode.cu)
  bool dequant_prefix = false;  // prefill of a quantized store: its prefix [0, pos + n) is first
                                // dequantized into bf16 scratch (AttentionScratch), which the kernel reads
  // decode_tc / decode_km of a store that is encoded (not plain bf16): the
  // step's q may be left raw for the attention to norm and rotate (QPrep), so
  // the store's encode (qk_rope_store) runs beside the attention instead of
  // before it. A bf16 store's copy is shorter than what the fused path adds:
  // measured slower (docs/perf.md).
  bool fused_q = false;
  std::string why;  // when unsupported: the reason

  bool supported() const { return kernel != AttentionKernel::unsupported; }
  // Display name: "flash_decode_tc<128,q8,q8>", "hadamard(q)+flash_decode_km<128,turbo3,turbo3>+hadamard^T(o)",
  // "flash_cuda_core<bf16,bf16>", "prefill_tc<128>", "dequant_bf16+prefill_tc<128>", "flash_cuda_core"
  // (empty when unsupported). `kvq codecs`, dispatch stats and docs print it.
  std::string name() const;
};

AttentionPlan choose_attention(const AttentionCase& c);

// The plan's verdict as text (supported, name, why): the form tests and
// displays compare.
struct AttentionChoice {
  bool supported = false;
  std::string kernel;  // AttentionPlan::name()
  std::string why;     // when unsupported: the reason
};
AttentionChoice attention_support(const AttentionCase& c);

}  // namespace kvq::cuda
