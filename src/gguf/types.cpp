// The ONE tensor type table: block geometry of every type kvq understands.
#include "gguf/types.hpp"

#include <cctype>

#include "core/error.hpp"

namespace kvq::gguf {
namespace {

// block_bytes for the quantized types:
//   Q8_0: fp16 d + 32 x int8                        = 34
//   Q4_0: fp16 d + 16 bytes of nibbles               = 18
//   Q1_0: fp16 d + 128 sign bits (16 bytes)          = 18
//   K-quants, per 256 weights (layouts in gguf/quant.hpp):
//   Q2_K: 16 scale/min bytes + 64 bytes of 2-bit q + fp16 d, dmin               = 84
//   Q3_K: 32 high-bit bytes + 64 bytes of low 2 bits + 12 scale bytes + fp16 d   = 110
//   Q4_K: fp16 d, dmin + 12 scale/min bytes + 128 bytes of nibbles              = 144
//   Q5_K: fp16 d, dmin + 12 scale/min bytes + 32 high-bit bytes + 128 nibbles   = 176
//   Q6_K: 128 bytes of low nibbles + 64 bytes of high 2 bits + 16 int8 scales + fp16 d = 210
constexpr TensorTypeInfo kTable[] = {
    {TensorType::F32, "F32", 1, 4},
    {TensorType::F16, "F16", 1, 2},
    {TensorType::Q4_0, "Q4_0", 32, 18},
    {TensorType::Q8_0, "Q8_0", 32, 34},
    {TensorType::Q2_K, "Q2_K", 256, 84},
    {TensorType::Q3_K, "Q3_K", 256, 110},
    {TensorType::Q4_K, "Q4_K", 256, 144},
    {TensorType::Q5_K, "Q5_K", 256, 176},
    {TensorType::Q6_K, "Q6_K", 256, 210},
    {TensorType::BF16, "BF16", 1, 2},
    {TensorType::Q1_0, "Q1_0", 128, 18},
};

// ggml type ids that exist upstream (llama.cpp's ggml.h), so that an
// unsupported-but-real type is named in errors. Removed ids keep their old names.
const char* const kGgmlNames[] = {
    "F32",      "F16",      "Q4_0",     "Q4_1",     "Q4_2",     "Q4_3",    "Q5_0",
    "Q5_1",     "Q8_0",     "Q8_1",     "Q2_K",     "Q3_K",     "Q4_K",    "Q5_K",
    "Q6_K",     "Q8_K",     "IQ2_XXS",  "IQ2_XS",   "IQ3_XXS",  "IQ1_S",   "IQ4_NL",
    "IQ3_S",    "IQ2_S",    "IQ4_XS",   "I8",       "I16",      "I32",     "I64",
    "F64",      "IQ1_M",    "BF16",     "Q4_0_4_4", "Q4_0_4_8", "Q4_0_8_8", "TQ1_0",
    "TQ2_0",    "IQ4_NL_4_4", "IQ4_NL_4_8", "IQ4_NL_8_8", "MXFP4",  nullptr, "Q1_0",
};

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower((unsigned char)a[i]) != std::tolower((unsigned char)b[i])) return false;
  return true;
}

}  // namespace

const TensorTypeInfo* tensor_type_info(uint32_t type_id) {
  for (const auto& t : kTable)
    if (uint32_t(t.type) == type_id) return &t;
  return nullptr;
}

const TensorTypeInfo& tensor_type_info(TensorType t) {
  const TensorTypeInfo* info = tensor_type_info(uint32_t(t));
  if (!info) fail(Errc::internal, "internal error: tensor type id ", uint32_t(t), " is not in the type table");
  return *info;
}

std::string tensor_type_names() {
  std::string s;
  for (const auto& t : kTable) s += (s.empty() ? "" : ", ") + std::string(t.name);
  return s;
}

std::optional<TensorType> tensor_type_from_name(std::string_view name) {
  for (const auto& t : kTable)
    if (iequals(name, t.name)) return t.type;
  return std::nullopt;
}

const char* tensor_type_name(TensorType t) {
  const TensorTypeInfo* info = tensor_type_info(uint32_t(t));
  return info ? info->name : "?";
}

const char* ggml_type_id_name(uint32_t type_id) {
  if (type_id < sizeof(kGgmlNames) / sizeof(kGgmlNames[0])) return kGgmlNames[type_id];
  return nullptr;
}

bool is_k_quant(TensorType t) {
  switch (t) {
    case TensorType::Q2_K:
    case TensorType::Q3_K:
    case TensorType::Q4_K:
    case TensorType::Q5_K:
    case TensorType::Q6_K: return true;
    default: return false;
  }
}

uint64_t tensor_row_bytes(TensorType t, uint64_t n) {
  const TensorTypeInfo& info = tensor_type_info(t);
  if (n % info.block_size != 0)
    fail(Errc::format, "row of ", n, " weights is not a multiple of the ", info.name, " block size ",
         info.block_size);
  return n / info.block_size * info.block_bytes;
}

}  // namespace kvq::gguf
