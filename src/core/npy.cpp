#include "core/npy.hpp"

#include <cstring>
#include <memory>

#include "core/error.hpp"
#include "core/file_io.hpp"

namespace kvq::npy {

namespace {

constexpr char kMagic[] = "\x93NUMPY";
// Every header we write is padded to this many bytes (magic and length
// included) so RowWriter can rewrite it in place with the final row count.
constexpr size_t kHeaderBytes = 128;

std::string shape_text(const std::vector<uint64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    s += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) s += ",";
    if (i + 1 < shape.size()) s += " ";
  }
  return s + ")";
}

std::string header_bytes(const char* descr, const std::vector<uint64_t>& shape) {
  std::string dict = str("{'descr': '", descr, "', 'fortran_order': False, 'shape': ",
                         shape_text(shape), ", }");
  const size_t prefix = 10;  // magic(6) + version(2) + u16 length
  size_t total = kHeaderBytes;
  while (prefix + dict.size() + 1 > total) total += 64;
  dict.append(total - prefix - dict.size() - 1, ' ');
  dict.push_back('\n');
  std::string out(kMagic, 6);
  out.push_back('\x01');
  out.push_back('\x00');
  const uint16_t len = uint16_t(dict.size());
  out.push_back(char(len & 0xff));
  out.push_back(char(len >> 8));
  return out + dict;
}

struct FileCloser {
  void operator()(std::FILE* f) const { if (f) std::fclose(f); }
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

FilePtr open_or_fail(const std::string& path, const char* mode) {
  FilePtr f(std::fopen(path.c_str(), mode));
  if (!f) fail(Errc::io, "cannot open '", path, "' (", std::strerror(errno), ")");
  return f;
}

void write_array(OutputFile& out, const char* descr, const void* data, size_t bytes,
                 const std::vector<uint64_t>& shape) {
  std::FILE* f = out.stream();
  const std::string h = header_bytes(descr, shape);
  if (std::fwrite(h.data(), 1, h.size(), f) != h.size() || (bytes && std::fwrite(data, 1, bytes, f) != bytes) ||
      std::fflush(f) != 0)
    fail(Errc::io, "short write to '", out.path(), "' (disk full?)");
}

void write_array(const std::string& path, const char* descr, const void* data, size_t bytes,
                 const std::vector<uint64_t>& shape) {
  OutputFile out(path);  // complete or absent: never a truncated array under the name
  write_array(out, descr, data, bytes, shape);
  out.commit();
}

uint64_t product(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

// Extracts the value text of `key` from the header dict ("'key': value").
std::string dict_value(const std::string& dict, const std::string& key, const std::string& path) {
  const std::string k = "'" + key + "'";
  size_t p = dict.find(k);
  if (p == std::string::npos) fail(Errc::format, "'", path, "': .npy header has no ", k);
  p = dict.find(':', p + k.size());
  if (p == std::string::npos) fail(Errc::format, "'", path, "': malformed .npy header");
  ++p;
  while (p < dict.size() && dict[p] == ' ') ++p;
  size_t e = p;
  if (p < dict.size() && dict[p] == '(') {
    e = dict.find(')', p);
    if (e == std::string::npos) fail(Errc::format, "'", path, "': malformed .npy shape");
    return dict.substr(p, e - p + 1);
  }
  while (e < dict.size() && dict[e] != ',' && dict[e] != '}') ++e;
  return dict.substr(p, e - p);
}

}  // namespace

uint64_t Array::size() const { return product(shape); }

void write_f32(const std::string& path, const float* data, const std::vector<uint64_t>& shape) {
  write_array(path, "<f4", data, product(shape) * 4, shape);
}

void write_i32(const std::string& path, const int32_t* data, const std::vector<uint64_t>& shape) {
  write_array(path, "<i4", data, product(shape) * 4, shape);
}

void write_i32(OutputFile& out, const int32_t* data, const std::vector<uint64_t>& shape) {
  write_array(out, "<i4", data, product(shape) * 4, shape);
}

Array read(const std::string& path) {
  FilePtr f = open_or_fail(path, "rb");
  char pre[10];
  if (std::fread(pre, 1, 10, f.get()) != 10 || std::memcmp(pre, kMagic, 6) != 0)
    fail(Errc::format, "'", path, "' is not a .npy file (bad magic)");
  const int major = pre[6];
  size_t hlen = uint8_t(pre[8]) | (size_t(uint8_t(pre[9])) << 8);
  if (major == 2 || major == 3) {  // 4-byte header length
    char more[2];
    if (std::fread(more, 1, 2, f.get()) != 2) fail(Errc::format, "'", path, "': truncated header");
    hlen |= (size_t(uint8_t(more[0])) << 16) | (size_t(uint8_t(more[1])) << 24);
  } else if (major != 1) {
    fail(Errc::format, "'", path, "': unsupported .npy version ", major);
  }
  std::string dict(hlen, '\0');
  if (std::fread(dict.data(), 1, hlen, f.get()) != hlen)
    fail(Errc::format, "'", path, "': truncated .npy header");

  Array a;
  const std::string descr = dict_value(dict, "descr", path);
  if (descr == "'<f4'") a.dtype = Dtype::f32;
  else if (descr == "'<i4'") a.dtype = Dtype::i32;
  else fail(Errc::format, "'", path, "': dtype ", descr, " is not supported (need '<f4' or '<i4')");
  if (dict_value(dict, "fortran_order", path) != "False")
    fail(Errc::format, "'", path, "': Fortran-order arrays are not supported");
  const std::string shape = dict_value(dict, "shape", path);
  for (size_t i = 1; i < shape.size();) {
    while (i < shape.size() && (shape[i] == ' ' || shape[i] == ',')) ++i;
    if (i >= shape.size() || shape[i] == ')') break;
    size_t used = 0;
    a.shape.push_back(std::stoull(shape.substr(i), &used));
    i += used;
  }
  const uint64_t n = a.size();
  const size_t bytes = n * 4;
  void* dst;
  if (a.dtype == Dtype::f32) { a.f32.resize(n); dst = a.f32.data(); }
  else { a.i32.resize(n); dst = a.i32.data(); }
  if (bytes && std::fread(dst, 1, bytes, f.get()) != bytes)
    fail(Errc::format, "'", path, "': data is shorter than the shape ", shape, " needs");
  return a;
}

RowWriter::RowWriter(const std::string& path, uint64_t row_len)
    : path_(path), out_(std::make_unique<OutputFile>(path)), row_len_(row_len) {
  f_ = out_->stream();
  // Largest shape we could rewrite later: reserve its header size now.
  const std::string h = header_bytes("<f4", {~0ull >> 1, row_len});
  const std::string real = header_bytes("<f4", {0, row_len});
  KVQ_ASSERT(h.size() == real.size());
  if (std::fwrite(real.data(), 1, real.size(), f_) != real.size())
    fail(Errc::io, "short write to '", path, "' (disk full?)");
}

RowWriter::~RowWriter() = default;  // an unclosed writer's temporary file is removed by out_

void RowWriter::append(const float* row) {
  KVQ_CHECK(f_, Errc::internal, "npy::RowWriter: append after close");
  if (std::fwrite(row, 4, row_len_, f_) != row_len_)
    fail(Errc::io, "short write to '", path_, "' (disk full?)");
  ++rows_;
}

void RowWriter::finish() {
  if (!f_) return;
  std::FILE* f = f_;
  f_ = nullptr;
  const std::string h = header_bytes("<f4", {rows_, row_len_});
  if (std::fseek(f, 0, SEEK_SET) != 0 || std::fwrite(h.data(), 1, h.size(), f) != h.size() || std::fflush(f) != 0)
    fail(Errc::io, "cannot finish writing '", path_, "' (disk full?)");
}

void RowWriter::commit() {
  KVQ_CHECK(!f_, Errc::internal, "npy::RowWriter::commit before finish");
  out_->commit();
}

void RowWriter::close() {
  if (!f_) return;
  finish();
  commit();
}

}  // namespace kvq::npy
