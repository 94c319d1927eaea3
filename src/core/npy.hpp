// NumPy .npy files (format version 1.0): float32 and int32 arrays, little
// endian, C order. Used for logit dumps (`kvq run --dump-logits`) and golden
// comparisons, so any independent implementation can be compared with kvq.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace kvq {
class OutputFile;
}

namespace kvq::npy {

enum class Dtype { f32, i32 };

struct Array {
  Dtype dtype = Dtype::f32;
  std::vector<uint64_t> shape;
  std::vector<float> f32;    // filled when dtype == f32
  std::vector<int32_t> i32;  // filled when dtype == i32
  uint64_t size() const;
};

void write_f32(const std::string& path, const float* data, const std::vector<uint64_t>& shape);
void write_i32(const std::string& path, const int32_t* data, const std::vector<uint64_t>& shape);
// The same into an open OutputFile, which the caller commits (outputs written as a set).
void write_i32(OutputFile& out, const int32_t* data, const std::vector<uint64_t>& shape);
// Reads '<f4' / '<i4' C-order arrays; anything else is a clear Errc::format error.
Array read(const std::string& path);

// Appends rows of a 2-D float32 array whose row count is not known in advance
// (logits streamed during generation). The header is written with room for
// any row count and rewritten with the final shape by close().
// The rows go to a temporary file beside `path`, renamed into place by
// close(): a failed write (full disk) or a writer destroyed without close()
// leaves no truncated .npy under the name.
class RowWriter {
 public:
  RowWriter(const std::string& path, uint64_t row_len);
  RowWriter(const RowWriter&) = delete;
  RowWriter& operator=(const RowWriter&) = delete;
  ~RowWriter();  // without close(): discards what was written
  void append(const float* row);
  void close();  // finish() then commit()
  // Rewrites the header with the final shape and flushes, without renaming:
  // outputs written as a set are all finished before any is committed.
  void finish();
  void commit();  // renames the finished file into place
  uint64_t rows() const { return rows_; }

 private:
  std::string path_;
  std::unique_ptr<OutputFile> out_;
  std::FILE* f_ = nullptr;
  uint64_t row_len_ = 0;
  uint64_t rows_ = 0;
};

}  // namespace kvq::npy
