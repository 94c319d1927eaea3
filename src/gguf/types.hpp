// GGML tensor types that kvq understands, with their block geometry in ONE table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kvq::gguf {

// Numeric values are the GGUF/ggml type ids.
enum class TensorType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q8_0 = 8,
  // K-quants: super-blocks of 256 weights with per-sub-block scales (gguf/quant.hpp has the layouts).
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  BF16 = 30,
  Q1_0 = 41,  // per 128 weights: fp16 scale d, then 128 sign bits LSB-first; w = bit ? +d : -d
};

struct TensorTypeInfo {
  TensorType type;
  const char* name;      // "F32", "Q1_0", ...
  uint32_t block_size;   // weights per block
  uint32_t block_bytes;  // bytes per block
};

// nullptr for an id kvq does not know.
const TensorTypeInfo* tensor_type_info(uint32_t type_id);
const TensorTypeInfo& tensor_type_info(TensorType t);
// Case-insensitive lookup by name ("q8_0", "bf16"); nullopt when unknown.
std::optional<TensorType> tensor_type_from_name(std::string_view name);
const char* tensor_type_name(TensorType t);
// Name of any ggml type id that exists upstream, supported here or not ("Q4_K"
// for 12); nullptr for an id nobody defines. Used to say "unsupported tensor
// type Q4_K (id 12)" instead of only a number.
const char* ggml_type_id_name(uint32_t type_id);
// "F32, F16, ...": every type kvq supports, for messages and help text.
std::string tensor_type_names();
// True for the K-quant types (256-weight super-blocks).
bool is_k_quant(TensorType t);
// Bytes for a row of n weights; throws Errc::format if n is not a multiple of the block size.
uint64_t tensor_row_bytes(TensorType t, uint64_t n);

}  // namespace kvq::gguf
