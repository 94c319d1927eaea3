// .npy reading and writing (logit dumps, golden data).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"
#include "core/npy.hpp"

using namespace kvq;

namespace {
std::string tmp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kvq_npy_" + std::to_string(::getpid()) + "_" + name)).string();
}
std::string read_all(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
}  // namespace

TEST(Npy, F32RoundTripAndHeaderIsStandard) {
  const std::string p = tmp_path("a.npy");
  const std::vector<float> v = {1.5f, -2, 3, 4, 5, 6};
  npy::write_f32(p, v.data(), {2, 3});
  const std::string bytes = read_all(p);
  ASSERT_EQ(bytes.size(), 128u + 24u);
  EXPECT_EQ(bytes.substr(0, 6), "\x93NUMPY");
  EXPECT_EQ(bytes[6], 1);
  EXPECT_EQ(bytes[7], 0);
  EXPECT_NE(bytes.find("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"), std::string::npos);
  EXPECT_EQ(bytes[127], '\n');
  const npy::Array a = npy::read(p);
  EXPECT_EQ(a.dtype, npy::Dtype::f32);
  EXPECT_EQ(a.shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(a.f32, v);
  std::remove(p.c_str());
}

TEST(Npy, I32OneDimensionalShapeHasTrailingComma) {
  const std::string p = tmp_path("b.npy");
  const std::vector<int32_t> v = {7, -1, 151935};
  npy::write_i32(p, v.data(), {3});
  EXPECT_NE(read_all(p).find("'shape': (3,), }"), std::string::npos);
  const npy::Array a = npy::read(p);
  EXPECT_EQ(a.dtype, npy::Dtype::i32);
  EXPECT_EQ(a.shape, (std::vector<uint64_t>{3}));
  EXPECT_EQ(a.i32, v);
  std::remove(p.c_str());
}

TEST(Npy, RowWriterRewritesTheShape) {
  const std::string p = tmp_path("c.npy");
  {
    npy::RowWriter w(p, 4);
    for (int r = 0; r < 3; ++r) {
      const float row[4] = {float(r), 1, 2, 3};
      w.append(row);
    }
    w.close();
  }
  const npy::Array a = npy::read(p);
  EXPECT_EQ(a.shape, (std::vector<uint64_t>{3, 4}));
  EXPECT_EQ(a.f32[8], 2.0f);
  std::remove(p.c_str());
}

TEST(Npy, BadFilesAreClearErrors) {
  EXPECT_THROW(npy::read(tmp_path("missing.npy")), Error);
  const std::string p = tmp_path("bad.npy");
  std::ofstream(p) << "not numpy at all";
  try {
    npy::read(p);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::format);
  }
  std::remove(p.c_str());
}
