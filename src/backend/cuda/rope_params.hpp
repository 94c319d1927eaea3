// The RoPE of a decode step as the CUDA kernels take it (qk_rope_store,
// the decode attention's fused q path): plain data, host and device.
#pragma once

namespace kvq::cuda {

struct RopeParams {
  const float* inv_freq = nullptr;  // [head_dim / 2], device
  bool neox = false;                // pairs (i, i + D/2); else (2i, 2i + 1)
  double pos_scale = 1.0;
};

// The fused q path of decode attention: the attention is given q raw (as
// the QKV projection wrote it) and applies RMSNorm (norm_w, eps; none when
// norm_w is null) and RoPE itself, so that the store's encode
// (qk_rope_store with q_in_attention) runs beside it rather than before it.
struct QPrep {
  const float* norm_w = nullptr;
  float eps = 0.0f;
  RopeParams rope;
};

}  // namespace kvq::cuda
