#include "backend/gpu_layout.hpp"

#include <cstring>

#include "core/error.hpp"

namespace kvq {

using gguf::TensorType;

namespace {

// Bytes of codes per block after the fp16 scale is split off.
uint32_t codes_per_block(TensorType t) {
  const auto& info = gguf::tensor_type_info(t);
  switch (t) {
    case TensorType::Q8_0:
    case TensorType::Q4_0:
    case TensorType::Q1_0: return info.block_bytes - 2;
    default: return info.block_bytes;
  }
}

bool has_scales(TensorType t) {
  return t == TensorType::Q8_0 || t == TensorType::Q4_0 || t == TensorType::Q1_0;
}

// Byte offset of the trailing fp16 super-scales in a GGUF K-quant block (== bytes kept in codes).
uint32_t kquant_scales_offset(TensorType t) {
  switch (t) {
    case TensorType::Q6_K: return 208;
    case TensorType::Q2_K: return 80;
    case TensorType::Q3_K: return 108;
    default: return gguf::tensor_type_info(t).block_bytes;  // Q4_K, Q5_K: kept whole
  }
}

}  // namespace

GpuKQuantRecord gpu_kquant_record(TensorType t) {
  KVQ_CHECK(gguf::is_k_quant(t), Errc::internal, "gpu_kquant_record: ", gguf::tensor_type_name(t),
            " is not a K-quant");
  const uint32_t kept = kquant_scales_offset(t);
  const uint32_t scales = (gguf::tensor_type_info(t).block_bytes - kept) / 2;
  return {(kept + 15) / 16 * 16, scales};
}

uint32_t q1_transpose_word(uint32_t w) {
  uint32_t out = 0;
  for (int j = 0; j < 32; ++j) out |= ((w >> j) & 1u) << (8 * (j % 4) + j / 4);
  return out;
}

uint32_t q1_untranspose_word(uint32_t w) {
  uint32_t out = 0;
  for (int j = 0; j < 32; ++j) out |= ((w >> (8 * (j % 4) + j / 4)) & 1u) << j;
  return out;
}

namespace {
// Applies f to every 32-bit word of a Q1_0 code array (little-endian words).
template <typename F>
void for_each_q1_word(std::vector<uint8_t>& codes, F f) {
  for (size_t i = 0; i + 4 <= codes.size(); i += 4) {
    uint32_t w;
    std::memcpy(&w, codes.data() + i, 4);
    w = f(w);
    std::memcpy(codes.data() + i, &w, 4);
  }
}
}  // namespace

bool gpu_gemv_supported(TensorType type, int64_t cols) {
  switch (type) {
    case TensorType::F32:
    case TensorType::F16:
    case TensorType::BF16: return cols > 0 && cols % 8 == 0;
    case TensorType::Q8_0:
    case TensorType::Q4_0:
    case TensorType::Q1_0:
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K: return cols > 0 && cols % 256 == 0;
  }
  return false;
}

GpuMatrixLayout pack_matrix_for_gpu(TensorType type, int64_t rows, int64_t cols, const uint8_t* data) {
  KVQ_CHECK(rows > 0 && gpu_gemv_supported(type, cols), Errc::unsupported,
            "the GPU GEMV does not support ", gguf::tensor_type_name(type), " matrices with ", cols,
            " columns (quantized types need a multiple of 256, float types a multiple of 8)");
  const auto& info = gguf::tensor_type_info(type);
  const int64_t blocks_per_row = cols / info.block_size;
  GpuMatrixLayout m;
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  if (gguf::is_k_quant(type)) {
    const GpuKQuantRecord rec = gpu_kquant_record(type);
    const uint32_t kept = kquant_scales_offset(type);
    const size_t n_blocks = size_t(rows) * blocks_per_row;
    m.codes.assign(n_blocks * rec.code_bytes, 0);
    m.scales.resize(n_blocks * rec.scales);
    for (size_t b = 0; b < n_blocks; ++b) {
      const uint8_t* src = data + b * info.block_bytes;
      std::memcpy(m.codes.data() + b * rec.code_bytes, src, kept);
      if (rec.scales) std::memcpy(m.scales.data() + b * rec.scales, src + kept, 2 * rec.scales);
    }
    return m;
  }
  const uint32_t cpb = codes_per_block(type);
  m.codes.resize(size_t(rows) * blocks_per_row * cpb);
  if (!has_scales(type)) {
    std::memcpy(m.codes.data(), data, m.codes.size());
    return m;
  }
  m.scales.resize(size_t(rows) * blocks_per_row);
  const size_t n_blocks = size_t(rows) * blocks_per_row;
  for (size_t b = 0; b < n_blocks; ++b) {
    const uint8_t* src = data + b * info.block_bytes;
    std::memcpy(&m.scales[b], src, 2);
    std::memcpy(m.codes.data() + b * cpb, src + 2, cpb);
  }
  if (type == TensorType::Q1_0) for_each_q1_word(m.codes, q1_transpose_word);
  return m;
}

std::vector<uint8_t> unpack_matrix_from_gpu(const GpuMatrixLayout& m) {
  const auto& info = gguf::tensor_type_info(m.type);
  const size_t n_blocks = size_t(m.rows) * (m.cols / info.block_size);
  std::vector<uint8_t> out(n_blocks * info.block_bytes);
  if (gguf::is_k_quant(m.type)) {
    const GpuKQuantRecord rec = gpu_kquant_record(m.type);
    const uint32_t kept = kquant_scales_offset(m.type);
    for (size_t b = 0; b < n_blocks; ++b) {
      uint8_t* dst = out.data() + b * info.block_bytes;
      std::memcpy(dst, m.codes.data() + b * rec.code_bytes, kept);
      if (rec.scales) std::memcpy(dst + kept, m.scales.data() + b * rec.scales, 2 * rec.scales);
    }
    return out;
  }
  if (!has_scales(m.type)) {
    std::memcpy(out.data(), m.codes.data(), out.size());
    return out;
  }
  const uint32_t cpb = codes_per_block(m.type);
  std::vector<uint8_t> codes = m.codes;
  if (m.type == TensorType::Q1_0) for_each_q1_word(codes, q1_untranspose_word);
  for (size_t b = 0; b < n_blocks; ++b) {
    uint8_t* dst = out.data() + b * info.block_bytes;
    std::memcpy(dst, &m.scales[b], 2);
    std::memcpy(dst + 2, codes.data() + b * cpb, cpb);
  }
  return out;
}

}  // namespace kvq
