// GGUF v2/v3 reader (memory-mapped) and writer.
//
// Format summary (little endian):
//   magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
//   n_kv x { string key | u32 value_type | value }
//   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 type | u64 offset }
//   padding to `general.alignment` (default 32) | tensor data (each offset aligned)
// string = u64 length + bytes (no NUL). array = u32 elem_type + u64 count + elems.
// ne[0] is the fastest-varying dimension (a matrix W[out][in] has ne = {in, out}).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "gguf/types.hpp"

namespace kvq::gguf {

enum class ValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};
const char* value_type_name(ValueType t);

struct Value;
struct Array {
  ValueType elem_type = ValueType::UINT8;
  std::vector<Value> items;
};

// One metadata value. Integers keep their declared type in `type` but are
// stored widened; accessors convert with range checks and throw Errc::format
// naming the key when the stored type does not fit.
struct Value {
  ValueType type = ValueType::UINT8;
  std::variant<uint64_t, int64_t, double, bool, std::string, Array> v;

  static Value u8(uint8_t x) { return {ValueType::UINT8, uint64_t(x)}; }
  static Value u32(uint32_t x) { return {ValueType::UINT32, uint64_t(x)}; }
  static Value i32(int32_t x) { return {ValueType::INT32, int64_t(x)}; }
  static Value u64(uint64_t x) { return {ValueType::UINT64, x}; }
  static Value f32(float x) { return {ValueType::FLOAT32, double(x)}; }
  static Value boolean(bool x) { return {ValueType::BOOL, x}; }
  static Value string(std::string s) { return {ValueType::STRING, std::move(s)}; }
  static Value array(ValueType elem, std::vector<Value> items) {
    return {ValueType::ARRAY, Array{elem, std::move(items)}};
  }
  static Value string_array(const std::vector<std::string>& xs);
  static Value i32_array(const std::vector<int32_t>& xs);
  static Value f32_array(const std::vector<float>& xs);

  bool is_integer() const;
  bool is_number() const;
  uint64_t as_u64() const;   // non-negative integer
  int64_t as_i64() const;    // any integer
  double as_f64() const;     // any number
  bool as_bool() const;
  const std::string& as_string() const;
  const Array& as_array() const;
  std::string to_string(size_t max_items = 8) const;  // human-readable, arrays truncated
};

struct TensorInfo {
  std::string name;
  std::vector<uint64_t> ne;  // ne[0] fastest
  TensorType type = TensorType::F32;
  uint64_t offset = 0;       // relative to the data section
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;
  const uint8_t* data = nullptr;  // into the mapping (reader only)
};

// A GGUF file opened read-only through mmap. Every count, size and offset is
// validated against the file size before use; a malformed file throws
// kvq::Error(Errc::format) with a one-line message naming the problem.
class File {
 public:
  static File open(const std::string& path);
  // Parse from memory (tests, fuzzing). The buffer must outlive the File.
  static File parse(const uint8_t* data, size_t size, std::string name = "<memory>");

  File(File&&) noexcept;
  File& operator=(File&&) noexcept;
  ~File();

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t file_size() const { return size_; }

  // Metadata, in file order.
  const std::vector<std::pair<std::string, Value>>& metadata() const { return kv_; }
  const Value* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }
  // Required accessors: throw Errc::format "missing required key 'K'" / type mismatch naming K.
  const Value& get(std::string_view key) const;
  uint64_t get_u64(std::string_view key) const;
  double get_f64(std::string_view key) const;
  const std::string& get_string(std::string_view key) const;
  // Optional accessors with defaults.
  uint64_t get_u64_or(std::string_view key, uint64_t def) const;
  bool get_bool_or(std::string_view key, bool def) const;
  std::string get_string_or(std::string_view key, std::string def) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;
  const TensorInfo& tensor(std::string_view name) const;  // throws naming the tensor

 private:
  File() = default;
  void parse_all();

  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  void* mapping_ = nullptr;  // non-null when we own an mmap
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::vector<std::pair<std::string, Value>> kv_;
  std::map<std::string, size_t, std::less<>> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

// Streaming writer: metadata and tensor descriptions first, then write() emits
// the header and calls each tensor's fill function into a buffer of exactly its
// size, so multi-GB models are produced without holding them in memory.
class Writer {
 public:
  using Fill = std::function<void(uint8_t* dst, uint64_t n_bytes)>;

  explicit Writer(uint32_t version = 3, uint64_t alignment = 32);
  void set(const std::string& key, Value v);  // replaces an existing key
  const Value* find(const std::string& key) const;  // nullptr when not set
  size_t tensor_count() const { return tensors_.size(); }
  uint64_t data_bytes() const;                       // tensor bytes, without padding
  // The tensors added so far (name, ne, type, n_elements, n_bytes; offset 0, data null).
  std::vector<TensorInfo> tensor_infos() const;
  void add_tensor(const std::string& name, TensorType type, std::vector<uint64_t> ne, Fill fill);
  void add_tensor(const std::string& name, TensorType type, std::vector<uint64_t> ne,
                  std::vector<uint8_t> bytes);
  void write(const std::string& path) const;   // throws Errc::io on failure
  std::vector<uint8_t> to_bytes() const;        // whole file in memory (tests)

 private:
  struct PendingTensor {
    std::string name;
    TensorType type;
    std::vector<uint64_t> ne;
    Fill fill;
    uint64_t n_bytes;
  };
  template <typename Sink>
  void emit(Sink& sink) const;

  uint32_t version_;
  uint64_t alignment_;
  std::vector<std::pair<std::string, Value>> kv_;
  std::vector<PendingTensor> tensors_;
};

}  // namespace kvq::gguf
