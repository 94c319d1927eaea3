#include "backend/cuda/attention_plan.hpp"

#include "backend/cuda/attention.hpp"
#include "backend/cuda/attention_decode.hpp"
#include "backend/cuda/attention_prefill.hpp"
#include "kv/block.hpp"

namespace kvq::cuda {

AttentionCase AttentionCase::of(const kv::BlockSpec& k, const kv::BlockSpec& v, int head_dim, int n_heads,
                                int n_kv_heads, bool decode) {
  AttentionCase c;
  c.head_dim = head_dim;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.k = k.family;
  c.v = v.family;
  c.k_bits = k.bits;
  c.v_bits = v.bits;
  c.k_qjl = k.qjl;
  c.v_qjl = v.qjl;
  c.decode = decode;
  return c;
}

AttentionCase AttentionCase::of(const GpuKvLayer& store, int n_heads, bool decode) {
  AttentionCase c;
  c.head_dim = store.head_dim;
  c.n_heads = n_heads;
  c.n_kv_heads = store.n_kv_heads;
  c.k = store.k.family;
  c.v = store.v.family;
  c.k_bits = store.k.bits;
  c.v_bits = store.v.bits;
  c.k_qjl = store.k.has_qjl;
  c.v_qjl = store.v.has_qjl;
  c.decode = decode;
  return c;
}

namespace {

const char* rotation_name(RotationKind k) {
  switch (k) {
    case RotationKind::hadamard: return "hadamard";
    case RotationKind::isoclinic: return "isoclinic";
    case RotationKind::rotor: return "rotor";
    case RotationKind::givens: return "givens";
    default: return "identity";
  }
}

// The storage format a decode instance reads: "q8", "turbo3", "iso4" (rotor
// and planar rows are iso rows), "fp8".
std::string format_name(kv::Family f, int bits) {
  const kv::Family s = storage_family(f);
  return std::string(kv::family_name(s)) + (kv::family_has_bits(s) ? std::to_string(bits) : "");
}

bool is_decode_instance(AttentionKernel k) { return k == AttentionKernel::decode_tc || k == AttentionKernel::decode_km; }

}  // namespace

AttentionPlan choose_attention(const AttentionCase& c) {
  AttentionPlan p;
  p.of = c;
  const char* why = nullptr;
  if (!flash_attention_supported(c.n_heads, c.n_kv_heads, c.head_dim, &why)) {
    p.why = why;
    return p;
  }
  const bool bf16 = c.k == kv::Family::bf16 && c.v == kv::Family::bf16;
  if (!bf16 && !kv_encode_supported(c.k, c.v, c.head_dim)) {
    p.why = "no GPU encode hooks for K " + std::string(kv::family_name(c.k)) + " / V " + kv::family_name(c.v) +
            " at head_dim " + std::to_string(c.head_dim);
    return p;
  }
  const int G = c.n_heads / c.n_kv_heads;
  if (c.decode) {
    // The shapes the tensor-core decode kernel takes (flash_decode_supported,
    // less the pointer alignment it asserts).
    const bool tc_shape = G >= 1 && G <= 16 && (c.head_dim == 64 || c.head_dim == 128 || c.head_dim == 256);
    const DecodeInstance inst =
        tc_shape ? find_decode_instance(c.head_dim, c.k, c.k_bits, c.k_qjl, c.v, c.v_bits, G) : DecodeInstance{};
    if (inst.index >= 0) {
      p.kernel = inst.keys_major ? AttentionKernel::decode_km : AttentionKernel::decode_tc;
      p.instance = inst.index;
      p.fused_q = !(bf16 && !c.k_qjl && !c.v_qjl);
    } else if (bf16) {
      p.kernel = AttentionKernel::cuda_core;
    } else {
      p.why = "no fused decode kernel for K " + std::string(kv::family_name(c.k)) + " / V " + kv::family_name(c.v) +
              " at head_dim " + std::to_string(c.head_dim) + ", GQA group " + std::to_string(G) +
              (tc_shape ? " (not among the compiled instances; see -DKVQ_ALL_KERNEL_INSTANCES)" : "");
    }
    return p;
  }
  p.kernel = flash_attention_prefill_supported(c.n_heads, c.n_kv_heads, c.head_dim) ? AttentionKernel::prefill_tc
                                                                                     : AttentionKernel::cuda_core;
  p.dequant_prefix = !bf16;
  return p;
}

std::string AttentionPlan::name() const {
  const AttentionCase& c = of;
  std::string n;
  if (is_decode_instance(kernel)) {
    // Rotated sides run their storage format's instance, which rotates q
    // and un-rotates o itself (DecodeParams: q_rot / o_rot).
    n = (is_rotated(c.k) ? std::string(rotation_name(rotation_kind(c.k))) + "(q)+" : std::string()) +
        (kernel == AttentionKernel::decode_km ? "flash_decode_km<" : "flash_decode_tc<") +
        std::to_string(c.head_dim) + "," + format_name(c.k, c.k_bits) + (c.k_qjl ? "+qjl" : "") + "," +
        format_name(c.v, c.v_bits) + ">" +
        (is_rotated(c.v) ? std::string("+") + rotation_name(rotation_kind(c.v)) + "^T(o)" : "");
  } else if (kernel == AttentionKernel::cuda_core) {
    n = c.decode ? "flash_cuda_core<bf16,bf16>" : "flash_cuda_core";
  } else if (kernel == AttentionKernel::prefill_tc) {
    n = "prefill_tc<" + std::to_string(c.head_dim) + ">";
  }
  if (dequant_prefix) n = "dequant_bf16+" + n;
  return n;
}

AttentionChoice attention_support(const AttentionCase& c) {
  const AttentionPlan p = choose_attention(c);
  return AttentionChoice{p.supported(), p.name(), p.why};
}

}  // namespace kvq::cuda
