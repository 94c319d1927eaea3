// GGUF reader and writer. The reader never trusts a number from the file: every
// count, length and offset is checked against the bytes that remain BEFORE it
// is used to allocate or index, so a corrupt file gives a one-line
// Errc::format error, never a crash, a hang or a huge allocation.
#include "gguf/gguf.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

#include "core/error.hpp"
#include "core/file_io.hpp"

namespace kvq::gguf {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as little-endian u32
constexpr uint64_t kHeaderBytes = 4 + 4 + 8 + 8;
// ggml tensors have at most 4 dimensions (GGML_MAX_DIMS).
constexpr uint32_t kMaxDims = 4;
// Arrays may nest (an array of arrays), but never deeper than this.
constexpr int kMaxArrayDepth = 4;
// Upper bound on metadata array elements in one file. Each parsed element is a
// Value (~48 bytes), so without a cap a 1 GB file of u8 arrays would need
// ~48 GB; with the cap the worst case is ~200 MB. Real tokenizers hold ~4
// arrays of <= 262k entries.
constexpr uint64_t kMaxTotalArrayElements = uint64_t(1) << 22;
// general.alignment must be a power of two no larger than this.
constexpr uint64_t kMaxAlignment = uint64_t(1) << 20;

const char* kValueTypeNames[] = {"u8",  "i8",     "u16",    "i16",  "u32", "i32", "f32",
                                 "bool", "string", "array", "u64",  "i64", "f64"};

// Smallest encoded size of one value of a type (for count-vs-remaining checks).
uint64_t min_value_bytes(ValueType t) {
  switch (t) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::BOOL: return 1;
    case ValueType::UINT16: case ValueType::INT16: return 2;
    case ValueType::UINT32: case ValueType::INT32: case ValueType::FLOAT32: return 4;
    case ValueType::UINT64: case ValueType::INT64: case ValueType::FLOAT64: return 8;
    case ValueType::STRING: return 8;
    case ValueType::ARRAY: return 12;
  }
  return 1;
}

bool valid_value_type(uint32_t t) { return t <= uint32_t(ValueType::FLOAT64); }

std::string quoted(std::string_view s) {
  // Keys and names come from the file: keep error lines one line and printable.
  std::string out = "'";
  const size_t n = std::min<size_t>(s.size(), 80);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = (unsigned char)s[i];
    if (c >= 0x20 && c < 0x7f) {
      out += char(c);
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (s.size() > n) out += "...";
  return out + "'";
}

// Bounds-checked cursor over the file bytes.
class Reader {
 public:
  Reader(const uint8_t* base, uint64_t size, const std::string& name)
      : base_(base), size_(size), name_(name) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }

  template <typename... Args>
  [[noreturn]] void error(const Args&... a) const {
    fail(Errc::format, name_, ": ", a...);
  }

  void need(uint64_t n, const char* what) const {
    if (n > remaining())
      error("truncated: ", what, " needs ", n, " bytes at offset ", pos_, " but the file ends at ",
            size_);
  }
  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string read_string(const char* what) {
    const uint64_t at = pos_;
    const uint64_t len = read<uint64_t>(what);
    if (len > remaining())
      error(what, " at offset ", at, " has length ", len, ", more than the ", remaining(),
            " bytes left in the file");
    std::string s(reinterpret_cast<const char*>(base_ + pos_), size_t(len));
    pos_ += len;
    return s;
  }

 private:
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
  const std::string& name_;
};

struct ParseState {
  uint64_t array_elements = 0;
};

Value read_value(Reader& r, ValueType type, const std::string& key, int depth, ParseState& st) {
  switch (type) {
    case ValueType::UINT8: return {type, uint64_t(r.read<uint8_t>("u8 value"))};
    case ValueType::INT8: return {type, int64_t(r.read<int8_t>("i8 value"))};
    case ValueType::UINT16: return {type, uint64_t(r.read<uint16_t>("u16 value"))};
    case ValueType::INT16: return {type, int64_t(r.read<int16_t>("i16 value"))};
    case ValueType::UINT32: return {type, uint64_t(r.read<uint32_t>("u32 value"))};
    case ValueType::INT32: return {type, int64_t(r.read<int32_t>("i32 value"))};
    case ValueType::UINT64: return {type, r.read<uint64_t>("u64 value")};
    case ValueType::INT64: return {type, r.read<int64_t>("i64 value")};
    case ValueType::FLOAT32: return {type, double(r.read<float>("f32 value"))};
    case ValueType::FLOAT64: return {type, r.read<double>("f64 value")};
    case ValueType::BOOL: {
      const uint64_t at = r.pos();
      const uint8_t b = r.read<uint8_t>("bool value");
      // A bool byte other than 0/1 means the reader is out of step with the writer.
      if (b > 1) r.error("key ", quoted(key), ": bool value at offset ", at, " is ", int(b), ", not 0 or 1");
      return {type, b == 1};
    }
    case ValueType::STRING: return {type, r.read_string("string value")};
    case ValueType::ARRAY: {
      if (depth >= kMaxArrayDepth)
        r.error("key ", quoted(key), ": arrays nested more than ", kMaxArrayDepth, " deep");
      const uint64_t at = r.pos();
      const uint32_t et = r.read<uint32_t>("array element type");
      if (!valid_value_type(et))
        r.error("key ", quoted(key), ": array at offset ", at, " has unknown element type ", et);
      const uint64_t count = r.read<uint64_t>("array count");
      const ValueType elem = ValueType(et);
      if (count > r.remaining() / min_value_bytes(elem))
        r.error("key ", quoted(key), ": array of ", count, " ", kValueTypeNames[et],
                " at offset ", at, " needs more than the ", r.remaining(), " bytes left in the file");
      st.array_elements += count;
      if (st.array_elements > kMaxTotalArrayElements)
        r.error("key ", quoted(key), ": metadata arrays hold more than ", kMaxTotalArrayElements,
                " elements in total (refusing: no real model needs that many)");
      Array a;
      a.elem_type = elem;
      a.items.reserve(size_t(count));
      for (uint64_t i = 0; i < count; ++i) a.items.push_back(read_value(r, elem, key, depth + 1, st));
      return {type, std::move(a)};
    }
  }
  r.error("key ", quoted(key), ": unknown value type ", uint32_t(type));
}

// For messages only: a + b, or "2^64+" when it overflows.
std::string sat_add(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::string("2^64+") : std::to_string(a + b);
}
std::string sat_add(const std::string& a, uint64_t b) {
  if (a == "2^64+") return a;
  return sat_add(std::stoull(a), b);
}

std::string describe_ne(const std::vector<uint64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

}  // namespace

// ---------------------------------------------------------------------------
// Value
// ---------------------------------------------------------------------------

const char* value_type_name(ValueType t) {
  return valid_value_type(uint32_t(t)) ? kValueTypeNames[uint32_t(t)] : "?";
}

Value Value::string_array(const std::vector<std::string>& xs) {
  std::vector<Value> items;
  items.reserve(xs.size());
  for (const auto& x : xs) items.push_back(string(x));
  return array(ValueType::STRING, std::move(items));
}
Value Value::i32_array(const std::vector<int32_t>& xs) {
  std::vector<Value> items;
  items.reserve(xs.size());
  for (auto x : xs) items.push_back(i32(x));
  return array(ValueType::INT32, std::move(items));
}
Value Value::f32_array(const std::vector<float>& xs) {
  std::vector<Value> items;
  items.reserve(xs.size());
  for (auto x : xs) items.push_back(f32(x));
  return array(ValueType::FLOAT32, std::move(items));
}

bool Value::is_integer() const {
  return std::holds_alternative<uint64_t>(v) || std::holds_alternative<int64_t>(v);
}
bool Value::is_number() const { return is_integer() || std::holds_alternative<double>(v); }

uint64_t Value::as_u64() const {
  if (auto* u = std::get_if<uint64_t>(&v)) return *u;
  if (auto* i = std::get_if<int64_t>(&v)) {
    if (*i < 0) fail(Errc::format, "value ", *i, " is negative where a non-negative integer is required");
    return uint64_t(*i);
  }
  fail(Errc::format, "value of type ", value_type_name(type), " is not an integer");
}
int64_t Value::as_i64() const {
  if (auto* i = std::get_if<int64_t>(&v)) return *i;
  if (auto* u = std::get_if<uint64_t>(&v)) {
    if (*u > uint64_t(std::numeric_limits<int64_t>::max()))
      fail(Errc::format, "value ", *u, " does not fit in a signed 64-bit integer");
    return int64_t(*u);
  }
  fail(Errc::format, "value of type ", value_type_name(type), " is not an integer");
}
double Value::as_f64() const {
  if (auto* d = std::get_if<double>(&v)) return *d;
  if (auto* u = std::get_if<uint64_t>(&v)) return double(*u);
  if (auto* i = std::get_if<int64_t>(&v)) return double(*i);
  fail(Errc::format, "value of type ", value_type_name(type), " is not a number");
}
bool Value::as_bool() const {
  if (auto* b = std::get_if<bool>(&v)) return *b;
  fail(Errc::format, "value of type ", value_type_name(type), " is not a bool");
}
const std::string& Value::as_string() const {
  if (auto* s = std::get_if<std::string>(&v)) return *s;
  fail(Errc::format, "value of type ", value_type_name(type), " is not a string");
}
const Array& Value::as_array() const {
  if (auto* a = std::get_if<Array>(&v)) return *a;
  fail(Errc::format, "value of type ", value_type_name(type), " is not an array");
}

std::string Value::to_string(size_t max_items) const {
  if (auto* u = std::get_if<uint64_t>(&v)) return std::to_string(*u);
  if (auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (auto* d = std::get_if<double>(&v)) return str(*d);
  if (auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (auto* s = std::get_if<std::string>(&v)) {
    std::string out = "\"";
    const size_t n = std::min<size_t>(s->size(), 120);
    for (size_t k = 0; k < n; ++k) {
      const char c = (*s)[k];
      if (c == '\n') out += "\\n";
      else if (c == '"') out += "\\\"";
      else if ((unsigned char)c < 0x20) out += "?";
      else out += c;
    }
    if (s->size() > n) out += "...";
    return out + "\"";
  }
  const Array& a = std::get<Array>(v);
  std::string out = str(value_type_name(a.elem_type), "[", a.items.size(), "] [");
  for (size_t k = 0; k < a.items.size() && k < max_items; ++k)
    out += (k ? ", " : "") + a.items[k].to_string(max_items);
  if (a.items.size() > max_items) out += ", ...";
  return out + "]";
}

// ---------------------------------------------------------------------------
// File
// ---------------------------------------------------------------------------

File::File(File&& o) noexcept { *this = std::move(o); }

File& File::operator=(File&& o) noexcept {
  if (this == &o) return *this;
  if (mapping_) munmap(mapping_, size_);
  path_ = std::move(o.path_);
  base_ = o.base_;
  size_ = o.size_;
  mapping_ = o.mapping_;
  version_ = o.version_;
  alignment_ = o.alignment_;
  kv_ = std::move(o.kv_);
  kv_index_ = std::move(o.kv_index_);
  tensors_ = std::move(o.tensors_);
  tensor_index_ = std::move(o.tensor_index_);
  o.mapping_ = nullptr;
  o.base_ = nullptr;
  o.size_ = 0;
  return *this;
}

File::~File() {
  if (mapping_) munmap(mapping_, size_);
}

File File::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(Errc::io, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail(Errc::io, path, ": cannot stat: ", std::strerror(e));
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    fail(Errc::io, path, ": is a directory, not a GGUF file");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(Errc::io, path, ": not a regular file");
  }
  if (st.st_size == 0) {
    ::close(fd);
    fail(Errc::io, path, ": file is empty (0 bytes), not a GGUF file");
  }
  void* m = mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int e = errno;
  ::close(fd);
  if (m == MAP_FAILED) fail(Errc::io, path, ": cannot mmap ", st.st_size, " bytes: ", std::strerror(e));
  File f;
  f.path_ = path;
  f.mapping_ = m;
  f.base_ = static_cast<const uint8_t*>(m);
  f.size_ = size_t(st.st_size);
  f.parse_all();  // on throw, ~File unmaps
  return f;
}

File File::parse(const uint8_t* data, size_t size, std::string name) {
  File f;
  f.path_ = std::move(name);
  f.base_ = data;
  f.size_ = size;
  f.parse_all();
  return f;
}

void File::parse_all() {
  Reader r(base_, size_, path_);
  if (size_ < kHeaderBytes) {
    if (size_ >= 4 && std::memcmp(base_, "GGUF", 4) != 0)
      r.error("not a GGUF file (bad magic; file is only ", size_, " bytes)");
    r.error("file is ", size_, " bytes, too small for a GGUF header (", kHeaderBytes, " bytes)");
  }
  const uint32_t magic = r.read<uint32_t>("magic");
  if (magic != kMagic) {
    std::string got;
    for (int i = 0; i < 4; ++i) {
      const unsigned char c = base_[i];
      got += (c >= 0x20 && c < 0x7f) ? std::string(1, char(c)) : str("\\x", int(c));
    }
    r.error("not a GGUF file (magic is '", got, "', expected 'GGUF')");
  }
  version_ = r.read<uint32_t>("version");
  if (version_ == 1)
    r.error("GGUF version 1 is not supported (only 2 and 3); re-convert the model with a current llama.cpp");
  if (version_ != 2 && version_ != 3) {
    if (version_ == 0x02000000u || version_ == 0x03000000u)
      r.error("big-endian GGUF is not supported (version field reads ", version_, ")");
    r.error("unsupported GGUF version ", version_, " (only 2 and 3 are supported)");
  }
  const uint64_t n_tensors = r.read<uint64_t>("tensor count");
  const uint64_t n_kv = r.read<uint64_t>("metadata count");
  // Smallest encodings: a kv is key length (8) + type (4) + a 1-byte value;
  // a tensor info is name length (8) + n_dims (4) + one ne (8) + type (4) + offset (8).
  if (n_kv > r.remaining() / 13)
    r.error("metadata count ", n_kv, " is impossible: the file has only ", r.remaining(),
            " bytes after the header");
  if (n_tensors > r.remaining() / 32)
    r.error("tensor count ", n_tensors, " is impossible: the file has only ", r.remaining(),
            " bytes after the header");

  ParseState st;
  kv_.reserve(size_t(n_kv));
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = r.read_string("metadata key");
    if (key.empty()) r.error("metadata key #", i, " is empty");
    const uint64_t at = r.pos();
    const uint32_t t = r.read<uint32_t>("metadata value type");
    if (!valid_value_type(t))
      r.error("key ", quoted(key), ": unknown value type ", t, " at offset ", at);
    Value v = read_value(r, ValueType(t), key, 0, st);
    if (kv_index_.count(key)) r.error("duplicate metadata key ", quoted(key));
    kv_index_.emplace(key, kv_.size());
    kv_.emplace_back(std::move(key), std::move(v));
  }

  alignment_ = 32;
  if (const Value* a = find("general.alignment")) {
    if (!a->is_integer()) r.error("general.alignment has type ", value_type_name(a->type), ", expected an integer");
    const bool negative = std::holds_alternative<int64_t>(a->v) && std::get<int64_t>(a->v) < 0;
    const uint64_t al = negative ? 0 : a->as_u64();
    if (al == 0 || (al & (al - 1)) != 0 || al > kMaxAlignment)
      r.error("general.alignment ", a->to_string(), " is not a power of two between 1 and ", kMaxAlignment);
    alignment_ = al;
  }

  tensors_.reserve(size_t(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo ti;
    ti.name = r.read_string("tensor name");
    if (ti.name.empty()) r.error("tensor #", i, " has an empty name");
    const uint32_t n_dims = r.read<uint32_t>("tensor n_dims");
    if (n_dims == 0 || n_dims > kMaxDims)
      r.error("tensor ", quoted(ti.name), " has n_dims ", n_dims, "; ggml tensors have 1 to ", kMaxDims,
              " dimensions");
    ti.ne.resize(n_dims);
    for (auto& d : ti.ne) d = r.read<uint64_t>("tensor dimension");
    const uint32_t type_id = r.read<uint32_t>("tensor type");
    ti.offset = r.read<uint64_t>("tensor offset");

    const TensorTypeInfo* info = tensor_type_info(type_id);
    if (!info) {
      if (const char* known = ggml_type_id_name(type_id))
        r.error("unsupported tensor type ", known, " (id ", type_id, ") for ", quoted(ti.name),
                "; kvq reads ", tensor_type_names());
      r.error("unknown tensor type id ", type_id, " for ", quoted(ti.name));
    }
    ti.type = info->type;
    // Element count must fit in int64 (ggml's int64_t ne) without overflow.
    uint64_t n = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      if (ti.ne[d] == 0)
        r.error("tensor ", quoted(ti.name), " has a zero dimension ", describe_ne(ti.ne));
      if (ti.ne[d] > uint64_t(std::numeric_limits<int64_t>::max()) / n)
        r.error("tensor ", quoted(ti.name), " shape ", describe_ne(ti.ne), " overflows 64-bit element count");
      n *= ti.ne[d];
    }
    ti.n_elements = n;
    if (ti.ne[0] % info->block_size != 0)
      r.error("tensor ", quoted(ti.name), " (", info->name, ") has row length ", ti.ne[0],
              ", not a multiple of the block size ", info->block_size);
    // n / block_size * block_bytes <= n * 4 (max bytes per element is 4), so no overflow
    // once n <= INT64_MAX... except 4 * n may exceed 2^64: divide first.
    const uint64_t blocks = n / info->block_size;
    if (blocks > std::numeric_limits<uint64_t>::max() / info->block_bytes)
      r.error("tensor ", quoted(ti.name), " byte size overflows");
    ti.n_bytes = blocks * info->block_bytes;
    if (ti.offset % alignment_ != 0)
      r.error("tensor ", quoted(ti.name), " offset ", ti.offset, " is not a multiple of the alignment ",
              alignment_);
    if (tensor_index_.count(ti.name)) r.error("duplicate tensor name ", quoted(ti.name));
    tensor_index_.emplace(ti.name, tensors_.size());
    tensors_.push_back(std::move(ti));
  }

  // Data section starts at the next multiple of the alignment.
  const uint64_t header_end = r.pos();
  const uint64_t data_start = (header_end + alignment_ - 1) / alignment_ * alignment_;
  if (!tensors_.empty() && data_start > size_)
    r.error("truncated: tensor data section would start at ", data_start, " but the file ends at ", size_);
  const uint64_t data_size = data_start <= size_ ? size_ - data_start : 0;
  for (auto& ti : tensors_) {
    if (ti.offset > data_size || ti.n_bytes > data_size - ti.offset)
      r.error("tensor ", quoted(ti.name), " data [", sat_add(data_start, ti.offset), ", ",
              sat_add(sat_add(data_start, ti.offset), ti.n_bytes), ") extends past end of file (size ",
              size_, ")");
    ti.data = base_ + data_start + ti.offset;
  }
  // Overlap check: sort by offset, each must end before the next begins.
  std::vector<const TensorInfo*> by_off;
  by_off.reserve(tensors_.size());
  for (const auto& ti : tensors_) by_off.push_back(&ti);
  std::sort(by_off.begin(), by_off.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_off.size(); ++i) {
    const TensorInfo* a = by_off[i - 1];
    const TensorInfo* b = by_off[i];
    if (a->offset + a->n_bytes > b->offset)
      r.error("tensors ", quoted(a->name), " [", a->offset, ", ", a->offset + a->n_bytes, ") and ",
              quoted(b->name), " [", b->offset, ", ", b->offset + b->n_bytes, ") overlap");
  }
}

const Value* File::find(std::string_view key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const Value& File::get(std::string_view key) const {
  const Value* v = find(key);
  if (!v) fail(Errc::format, path_, ": missing required key '", key, "'");
  return *v;
}

namespace {
template <typename F>
auto with_key(const std::string& path, std::string_view key, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    fail(Errc::format, path, ": key '", key, "': ", e.what());
  }
}
}  // namespace

uint64_t File::get_u64(std::string_view key) const {
  const Value& v = get(key);
  return with_key(path_, key, [&] { return v.as_u64(); });
}
double File::get_f64(std::string_view key) const {
  const Value& v = get(key);
  return with_key(path_, key, [&] { return v.as_f64(); });
}
const std::string& File::get_string(std::string_view key) const {
  const Value& v = get(key);
  return with_key(path_, key, [&]() -> const std::string& { return v.as_string(); });
}
uint64_t File::get_u64_or(std::string_view key, uint64_t def) const {
  const Value* v = find(key);
  return v ? with_key(path_, key, [&] { return v->as_u64(); }) : def;
}
bool File::get_bool_or(std::string_view key, bool def) const {
  const Value* v = find(key);
  return v ? with_key(path_, key, [&] { return v->as_bool(); }) : def;
}
std::string File::get_string_or(std::string_view key, std::string def) const {
  const Value* v = find(key);
  return v ? with_key(path_, key, [&] { return v->as_string(); }) : def;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& File::tensor(std::string_view name) const {
  const TensorInfo* t = find_tensor(name);
  if (!t) fail(Errc::format, path_, ": missing tensor '", name, "'");
  return *t;
}

// ---------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------

namespace {

void put_bytes(std::vector<uint8_t>& out, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  out.insert(out.end(), b, b + n);
}
template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  put_bytes(out, &v, sizeof(T));
}
void put_string(std::vector<uint8_t>& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  put_bytes(out, s.data(), s.size());
}

template <typename T>
T checked_int(const Value& v, const std::string& key) {
  if constexpr (std::is_signed_v<T>) {
    const int64_t x = v.as_i64();
    if (x < int64_t(std::numeric_limits<T>::min()) || x > int64_t(std::numeric_limits<T>::max()))
      fail(Errc::invalid_argument, "gguf writer: key '", key, "': value ", x, " does not fit in ",
           value_type_name(v.type));
    return T(x);
  } else {
    const uint64_t x = v.as_u64();
    if (x > uint64_t(std::numeric_limits<T>::max()))
      fail(Errc::invalid_argument, "gguf writer: key '", key, "': value ", x, " does not fit in ",
           value_type_name(v.type));
    return T(x);
  }
}

void put_value(std::vector<uint8_t>& out, const Value& v, const std::string& key) {
  switch (v.type) {
    case ValueType::UINT8: put(out, checked_int<uint8_t>(v, key)); return;
    case ValueType::INT8: put(out, checked_int<int8_t>(v, key)); return;
    case ValueType::UINT16: put(out, checked_int<uint16_t>(v, key)); return;
    case ValueType::INT16: put(out, checked_int<int16_t>(v, key)); return;
    case ValueType::UINT32: put(out, checked_int<uint32_t>(v, key)); return;
    case ValueType::INT32: put(out, checked_int<int32_t>(v, key)); return;
    case ValueType::UINT64: put(out, checked_int<uint64_t>(v, key)); return;
    case ValueType::INT64: put(out, checked_int<int64_t>(v, key)); return;
    case ValueType::FLOAT32: put(out, float(v.as_f64())); return;
    case ValueType::FLOAT64: put(out, v.as_f64()); return;
    case ValueType::BOOL: put<uint8_t>(out, v.as_bool() ? 1 : 0); return;
    case ValueType::STRING: put_string(out, v.as_string()); return;
    case ValueType::ARRAY: {
      const Array& a = v.as_array();
      put<uint32_t>(out, uint32_t(a.elem_type));
      put<uint64_t>(out, a.items.size());
      for (const Value& item : a.items) {
        if (item.type != a.elem_type)
          fail(Errc::invalid_argument, "gguf writer: key '", key, "': array of ",
               value_type_name(a.elem_type), " holds an element of type ", value_type_name(item.type));
        put_value(out, item, key);
      }
      return;
    }
  }
  fail(Errc::invalid_argument, "gguf writer: key '", key, "': unknown value type ", uint32_t(v.type));
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

Writer::Writer(uint32_t version, uint64_t alignment) : version_(version), alignment_(alignment) {
  if (version != 2 && version != 3)
    fail(Errc::invalid_argument, "gguf writer: version ", version, " not supported (use 2 or 3)");
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > kMaxAlignment)
    fail(Errc::invalid_argument, "gguf writer: alignment ", alignment, " is not a power of two <= ",
         kMaxAlignment);
  if (alignment != 32) set("general.alignment", Value::u32(uint32_t(alignment)));
}

void Writer::set(const std::string& key, Value v) {
  for (auto& kv : kv_) {
    if (kv.first == key) {
      kv.second = std::move(v);
      return;
    }
  }
  kv_.emplace_back(key, std::move(v));
}

const Value* Writer::find(const std::string& key) const {
  for (const auto& kv : kv_)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

std::vector<TensorInfo> Writer::tensor_infos() const {
  std::vector<TensorInfo> out;
  for (const auto& t : tensors_) {
    TensorInfo ti;
    ti.name = t.name;
    ti.ne = t.ne;
    ti.type = t.type;
    ti.n_elements = t.n_bytes / tensor_type_info(t.type).block_bytes * tensor_type_info(t.type).block_size;
    ti.n_bytes = t.n_bytes;
    out.push_back(std::move(ti));
  }
  return out;
}

uint64_t Writer::data_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors_) n += t.n_bytes;
  return n;
}

void Writer::add_tensor(const std::string& name, TensorType type, std::vector<uint64_t> ne, Fill fill) {
  if (name.empty()) fail(Errc::invalid_argument, "gguf writer: empty tensor name");
  for (const auto& t : tensors_)
    if (t.name == name) fail(Errc::invalid_argument, "gguf writer: duplicate tensor '", name, "'");
  if (ne.empty() || ne.size() > kMaxDims)
    fail(Errc::invalid_argument, "gguf writer: tensor '", name, "' has ", ne.size(),
         " dimensions (1 to 4 allowed)");
  const TensorTypeInfo& info = tensor_type_info(type);
  uint64_t n = 1;
  for (uint64_t d : ne) {
    if (d == 0 || d > uint64_t(std::numeric_limits<int64_t>::max()) / n)
      fail(Errc::invalid_argument, "gguf writer: tensor '", name, "' has a bad shape ", describe_ne(ne));
    n *= d;
  }
  if (ne[0] % info.block_size != 0)
    fail(Errc::invalid_argument, "gguf writer: tensor '", name, "' row length ", ne[0],
         " is not a multiple of the ", info.name, " block size ", info.block_size);
  const uint64_t n_bytes = n / info.block_size * info.block_bytes;
  tensors_.push_back({name, type, std::move(ne), std::move(fill), n_bytes});
}

void Writer::add_tensor(const std::string& name, TensorType type, std::vector<uint64_t> ne,
                        std::vector<uint8_t> bytes) {
  auto data = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  add_tensor(name, type, std::move(ne), [data, name](uint8_t* dst, uint64_t n) {
    if (n != data->size())
      fail(Errc::invalid_argument, "gguf writer: tensor '", name, "' needs ", n, " bytes but ",
           data->size(), " were given");
    std::memcpy(dst, data->data(), n);
  });
  if (data->size() != tensors_.back().n_bytes) {
    const uint64_t want = tensors_.back().n_bytes;
    tensors_.pop_back();
    fail(Errc::invalid_argument, "gguf writer: tensor '", name, "' needs ", want, " bytes but ",
         data->size(), " were given");
  }
}

// The sink sees the header bytes once, then one fill per tensor at its absolute file offset.
// Sink: void begin(uint64_t total, const std::vector<uint8_t>& header); uint8_t* at(uint64_t off, uint64_t n).
template <typename Sink>
void Writer::emit(Sink& sink) const {
  for (const auto& kv : kv_) {
    if (kv.first == "general.alignment" && (!kv.second.is_integer() || kv.second.as_u64() != alignment_))
      fail(Errc::invalid_argument, "gguf writer: general.alignment ", kv.second.to_string(),
           " differs from the writer's alignment ", alignment_, " (pass it to the Writer constructor)");
  }
  std::vector<uint8_t> h;
  put<uint32_t>(h, kMagic);
  put<uint32_t>(h, version_);
  put<uint64_t>(h, tensors_.size());
  put<uint64_t>(h, kv_.size());
  for (const auto& [key, value] : kv_) {
    put_string(h, key);
    put<uint32_t>(h, uint32_t(value.type));
    put_value(h, value, key);
  }
  std::vector<uint64_t> offsets;
  uint64_t off = 0;
  for (const auto& t : tensors_) {
    put_string(h, t.name);
    put<uint32_t>(h, uint32_t(t.ne.size()));
    for (uint64_t d : t.ne) put<uint64_t>(h, d);
    put<uint32_t>(h, uint32_t(t.type));
    put<uint64_t>(h, off);
    offsets.push_back(off);
    off = align_up(off + t.n_bytes, alignment_);
  }
  const uint64_t data_start = align_up(h.size(), alignment_);
  h.resize(size_t(data_start), 0);
  sink.begin(data_start + off, h);
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const auto& t = tensors_[i];
    uint8_t* dst = sink.at(data_start + offsets[i], t.n_bytes);
    t.fill(dst, t.n_bytes);
    sink.done(data_start + offsets[i], t.n_bytes);
  }
}

namespace {

struct MemorySink {
  std::vector<uint8_t> bytes;
  void begin(uint64_t total, const std::vector<uint8_t>& header) {
    bytes.assign(size_t(total), 0);
    std::memcpy(bytes.data(), header.data(), header.size());
  }
  uint8_t* at(uint64_t off, uint64_t) { return bytes.data() + off; }
  void done(uint64_t, uint64_t) {}
};

// Writes through a shared writable mapping of a preallocated file: each tensor's
// fill writes straight into the page cache, so a 16 GB model needs no 16 GB
// (or even one-tensor-sized) buffer. posix_fallocate reserves the space first so
// a full disk is an error here rather than SIGBUS during a fill.
struct FileSink {
  std::string display;  // the path the user asked for, for messages
  int fd = -1;          // the temporary file written (owned by an OutputFile)
  uint8_t* map = nullptr;
  uint64_t total = 0;

  ~FileSink() {
    if (map) munmap(map, total);
  }
  void begin(uint64_t total_bytes, const std::vector<uint8_t>& header) {
    total = total_bytes;
    if (const int e = posix_fallocate(fd, 0, off_t(total)); e != 0)
      fail(Errc::io, display, ": cannot reserve ", total, " bytes: ", std::strerror(e));
    void* m = mmap(nullptr, size_t(total), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) fail(Errc::io, display, ": cannot mmap for writing: ", std::strerror(errno));
    map = static_cast<uint8_t*>(m);
    std::memcpy(map, header.data(), header.size());
  }
  uint8_t* at(uint64_t off, uint64_t) { return map + off; }
  void done(uint64_t off, uint64_t n) {
    // Start writeback of what was just filled, and drop it from this process's
    // mapping (the data stays in the page cache), so neither dirty pages nor
    // resident memory grow with the model size.
    if (n == 0) return;
    const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
    const uint64_t lo = off / page * page;
    sync_file_range(fd, off64_t(lo), off64_t(off + n - lo), SYNC_FILE_RANGE_WRITE);
    madvise(map + lo, size_t(off + n - lo), MADV_DONTNEED);
  }
  void finish() {
    if (munmap(map, total) != 0) fail(Errc::io, display, ": munmap failed: ", std::strerror(errno));
    map = nullptr;
  }
};

}  // namespace

void Writer::write(const std::string& path) const {
  // Written to a temporary file renamed into place (core/file_io.hpp), so a
  // failed or interrupted write never leaves a truncated file under the final
  // name, and a device or FIFO given as the path is refused, never replaced.
  OutputFile out(path);
  FileSink sink;
  sink.display = path;
  sink.fd = out.fd();
  emit(sink);
  sink.finish();
  out.commit();
}

std::vector<uint8_t> Writer::to_bytes() const {
  MemorySink sink;
  emit(sink);
  return std::move(sink.bytes);
}

}  // namespace kvq::gguf
