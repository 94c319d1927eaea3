// Hand-made bad GGUF files. Each must give kvq::Error (format, or io for
// missing/empty/directory) with a message naming the problem, both from
// File::parse/File::open and from the `kvq info` binary (non-zero exit, one
// line on stderr, no crash signal). Files are built in code, not committed.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "gguf/gguf.hpp"

using namespace kvq;
using namespace kvq::gguf;

namespace {

// Little-endian GGUF byte builder.
struct G {
  std::vector<uint8_t> b;
  G& raw(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    b.insert(b.end(), c, c + n);
    return *this;
  }
  G& u8(uint8_t v) { return raw(&v, 1); }
  G& u32(uint32_t v) { return raw(&v, 4); }
  G& u64(uint64_t v) { return raw(&v, 8); }
  G& str(const std::string& s) { return u64(s.size()).raw(s.data(), s.size()); }
  G& header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    return raw("GGUF", 4).u32(version).u64(n_tensors).u64(n_kv);
  }
  G& kv_u32(const std::string& k, uint32_t v) { return str(k).u32(4).u32(v); }
  G& kv_str(const std::string& k, const std::string& v) { return str(k).u32(8).str(v); }
  G& tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
    str(name).u32(uint32_t(ne.size()));
    for (auto d : ne) u64(d);
    return u32(type).u64(offset);
  }
  G& pad(size_t align = 32) {
    while (b.size() % align) b.push_back(0);
    return *this;
  }
  G& zeros(size_t n) {
    b.resize(b.size() + n, 0);
    return *this;
  }
};

// One valid file (two F32 tensors) that several cases cut or patch.
std::vector<uint8_t> valid_file() {
  G g;
  g.header(2, 2).kv_str("general.name", "not a model").kv_u32("x.count", 3);
  g.tensor("a", {8}, 0, 0).tensor("b", {4, 2}, 0, 32);
  g.pad().zeros(64);
  return g.b;
}

std::string temp_file(const std::vector<uint8_t>& bytes) {
  static int counter = 0;
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kvq_bad_" + std::to_string(getpid()) + "_" + std::to_string(counter++) + ".gguf"))
                               .string();
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  return path;
}

struct CliResult {
  int status = -1;  // exit code, or 128 + signal
  std::string err;
};

CliResult run_info(const std::string& path) {
  const std::string errfile =
      (std::filesystem::temp_directory_path() / ("kvq_bad_" + std::to_string(getpid()) + ".stderr")).string();
  const std::string cmd = std::string(KVQ_BIN) + " info -m '" + path + "' >/dev/null 2>'" + errfile + "'";
  const int st = std::system(cmd.c_str());
  CliResult r;
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  std::ifstream in(errfile);
  r.err.assign(std::istreambuf_iterator<char>(in), {});
  std::filesystem::remove(errfile);
  return r;
}

// The file must fail in-process with Errc::format and `fragment`, and `kvq info`
// must exit 1 with exactly one stderr line containing `fragment`.
void expect_bad(const std::string& label, const std::vector<uint8_t>& bytes, const std::string& fragment,
                Errc code = Errc::format) {
  SCOPED_TRACE(label);
  try {
    File::parse(bytes.data(), bytes.size(), "bad.gguf");
    ADD_FAILURE() << "parse accepted a bad file; expected: " << fragment;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message: " << e.what() << "\nexpected fragment: " << fragment;
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
  const std::string path = temp_file(bytes);
  const CliResult r = run_info(path);
  std::filesystem::remove(path);
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_EQ(r.err.rfind("kvq: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

constexpr uint64_t kHuge = uint64_t(1) << 62;

}  // namespace

TEST(GgufBad, ValidBaseFileIsAccepted) {
  const auto bytes = valid_file();
  File f = File::parse(bytes.data(), bytes.size());
  EXPECT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensor("b").offset, 32u);
  const std::string path = temp_file(bytes);
  EXPECT_EQ(run_info(path).status, 0);  // a non-model file: prints what it can, succeeds
  std::filesystem::remove(path);
}

TEST(GgufBad, MissingEmptyDirectory) {
  for (const auto& [label, path, fragment] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"missing", "/nonexistent/kvq/model.gguf", "cannot open: No such file"},
           {"directory", std::filesystem::temp_directory_path().string(), "is a directory"}}) {
    SCOPED_TRACE(label);
    try {
      File::open(path);
      ADD_FAILURE() << "opened";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::io);
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
    const CliResult r = run_info(path);
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
  }
  {
    // A FIFO is refused at once, never waited on.
    const std::string fifo = (std::filesystem::temp_directory_path() / ("kvq_fifo_" + std::to_string(getpid()))).string();
    ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
    try {
      File::open(fifo);
      ADD_FAILURE() << "opened a fifo";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::io);
      EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
    }
    std::filesystem::remove(fifo);
  }
  const std::string empty = temp_file({});
  try {
    File::open(empty);
    ADD_FAILURE() << "opened";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::io);
    EXPECT_NE(std::string(e.what()).find("file is empty"), std::string::npos) << e.what();
  }
  const CliResult r = run_info(empty);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("file is empty"), std::string::npos) << r.err;
  std::filesystem::remove(empty);
  // In memory, an empty buffer is a format error.
  EXPECT_THROW(File::parse(nullptr, 0), Error);
}

TEST(GgufBad, HeaderMagicVersion) {
  expect_bad("3 bytes", {'G', 'G', 'U'}, "too small for a GGUF header");
  expect_bad("short header", G().raw("GGUF", 4).u32(3).u64(0).b, "too small for a GGUF header");
  expect_bad("wrong magic", G().raw("GGML", 4).u32(3).u64(0).u64(0).b, "not a GGUF file (magic is 'GGML'");
  expect_bad("binary magic", G().u32(0).u32(3).u64(0).u64(0).b, "not a GGUF file");
  expect_bad("version 1", G().header(0, 0, 1).b, "GGUF version 1 is not supported");
  expect_bad("version 99", G().header(0, 0, 99).b, "unsupported GGUF version 99");
  expect_bad("big endian", G().header(0, 0, 0x03000000).b, "big-endian GGUF is not supported");
}

TEST(GgufBad, Truncated) {
  const auto full = valid_file();
  // Cut right after the header: the counts cannot fit in what is left.
  expect_bad("after header", std::vector<uint8_t>(full.begin(), full.begin() + 30),
             "metadata count 2 is impossible: the file has only 6 bytes after the header");
  // In the kv section: the first key string is cut short.
  expect_bad("in key", G().header(0, 1).u64(20).raw("general.arch", 12).b,
             "metadata key at offset 24 has length 20, more than the 12 bytes left in the file");
  // In the tensor infos: find where tensor "b" is described and cut there.
  G g;
  g.header(2, 2).kv_str("general.name", "not a model").kv_u32("x.count", 3).tensor("a", {8}, 0, 0);
  const size_t cut = g.b.size() + 10;
  expect_bad("in tensor infos", std::vector<uint8_t>(full.begin(), full.begin() + long(cut)), "truncated");
  // In the data: drop the last 8 bytes; tensor b no longer fits.
  expect_bad("in data", std::vector<uint8_t>(full.begin(), full.end() - 8),
             "tensor 'b' data [");
  expect_bad("in data (message)", std::vector<uint8_t>(full.begin(), full.end() - 8), "extends past end of file (size");
  // Header complete but the data section is missing entirely.
  G nodata;
  nodata.header(1, 0).tensor("t", {8}, 0, 0);
  expect_bad("no data section", nodata.b, "truncated: tensor data section would start at");
  // Truncated in the middle of a value.
  expect_bad("in value", G().header(0, 1).str("k").u32(4).u8(1).b, "truncated: u32 value needs 4 bytes");
}

TEST(GgufBad, AbsurdCountsAndLengths) {
  expect_bad("n_kv", G().header(0, kHuge).zeros(64).b, "metadata count 4611686018427387904 is impossible");
  expect_bad("n_tensors", G().header(uint64_t(-1), 0).zeros(64).b, "tensor count 18446744073709551615 is impossible");
  expect_bad("key length", G().header(0, 1).u64(kHuge).zeros(32).b, "metadata key at offset 24 has length");
  expect_bad("string value length", G().header(0, 1).str("k").u32(8).u64(kHuge).zeros(8).b,
             "string value at offset");
  expect_bad("array count", G().header(0, 1).str("k").u32(9).u32(4).u64(kHuge).zeros(64).b,
             "key 'k': array of 4611686018427387904 u32");
  expect_bad("array of strings count", G().header(0, 1).str("k").u32(9).u32(8).u64(100).zeros(64).b,
             "array of 100 string");
  expect_bad("tensor name length", G().header(1, 0).u64(kHuge).zeros(64).b, "tensor name at offset 24 has length");
}

TEST(GgufBad, ValueTypes) {
  expect_bad("bad value type", G().header(0, 1).str("k").u32(13).zeros(16).b, "key 'k': unknown value type 13");
  expect_bad("bad value type ff", G().header(0, 1).str("k").u32(0xffffffff).zeros(16).b,
             "unknown value type 4294967295");
  expect_bad("bad array elem type", G().header(0, 1).str("k").u32(9).u32(77).u64(1).zeros(16).b,
             "array at offset 37 has unknown element type 77");
  expect_bad("bool 2", G().header(0, 1).str("flag").u32(7).u8(2).b, "key 'flag': bool value at offset 40 is 2, not 0 or 1");
  // Arrays nested 5 deep (limit 4).
  G deep;
  deep.header(0, 1).str("k").u32(9);
  for (int i = 0; i < 5; ++i) deep.u32(9).u64(1);
  deep.u32(4).u64(0).zeros(32);
  expect_bad("nested too deep", deep.b, "arrays nested more than 4 deep");
  expect_bad("empty key", G().header(0, 1).str("").u32(4).u32(1).b, "metadata key #0 is empty");
  // A key with a control character is printed escaped, keeping the message one line.
  expect_bad("escaped key", G().header(0, 1).str("a\nb").u32(13).zeros(8).b, "key 'a\\x0ab'");
}

TEST(GgufBad, DuplicatesAndAlignment) {
  expect_bad("dup key", G().header(0, 2).kv_u32("k", 1).kv_u32("k", 2).b, "duplicate metadata key 'k'");
  G dup;
  dup.header(2, 0).tensor("w", {8}, 0, 0).tensor("w", {8}, 0, 32).pad().zeros(64);
  expect_bad("dup tensor", dup.b, "duplicate tensor name 'w'");
  for (uint32_t a : {0u, 48u, 1u << 30}) {
    G g;
    g.header(0, 1).kv_u32("general.alignment", a);
    expect_bad("alignment " + std::to_string(a), g.b, "general.alignment " + std::to_string(a) + " is not a power of two");
  }
  expect_bad("alignment negative", G().header(0, 1).str("general.alignment").u32(5).u32(uint32_t(-32)).b,
             "general.alignment -32 is not a power of two");
  expect_bad("alignment string", G().header(0, 1).kv_str("general.alignment", "32").b,
             "general.alignment has type string, expected an integer");
}

TEST(GgufBad, TensorInfos) {
  auto one = [](std::vector<uint64_t> ne, uint32_t type, uint64_t offset, size_t data = 64) {
    G g;
    g.header(1, 0).tensor("blk.3.attn_q.weight", std::move(ne), type, offset).pad().zeros(data);
    return g.b;
  };
  expect_bad("n_dims 0", one({}, 0, 0), "tensor 'blk.3.attn_q.weight' has n_dims 0; ggml tensors have 1 to 4");
  expect_bad("n_dims 5", one({1, 1, 1, 1, 1}, 0, 0), "has n_dims 5; ggml tensors have 1 to 4 dimensions");
  {
    G g;  // n_dims huge: must not try to read or allocate 2^32 dims
    g.header(1, 0).str("t").u32(0xffffffffu).zeros(64);
    expect_bad("n_dims huge", g.b, "has n_dims 4294967295");
  }
  expect_bad("ne zero", one({8, 0}, 0, 0), "has a zero dimension [8, 0]");
  expect_bad("ne overflow", one({uint64_t(1) << 40, uint64_t(1) << 40}, 0, 0), "overflows 64-bit element count");
  expect_bad("ne max", one({uint64_t(-1)}, 0, 0), "overflows 64-bit element count");
  expect_bad("unsupported type", one({256}, 6, 0), "unsupported tensor type Q5_0 (id 6) for 'blk.3.attn_q.weight'");
  expect_bad("unknown type", one({256}, 200, 0), "unknown tensor type id 200 for 'blk.3.attn_q.weight'");
  expect_bad("unknown type 40", one({256}, 40, 0), "unknown tensor type id 40");
  expect_bad("block size", one({33}, 8, 0), "(Q8_0) has row length 33, not a multiple of the block size 32");
  expect_bad("misaligned", one({8}, 0, 4), "offset 4 is not a multiple of the alignment 32");
  expect_bad("past EOF", one({1024}, 0, 0), "tensor 'blk.3.attn_q.weight' data [");
  expect_bad("offset past EOF", one({8}, 0, uint64_t(1) << 40), "extends past end of file");
  expect_bad("offset wraps", one({8}, 0, uint64_t(-32)), "extends past end of file");
  expect_bad("huge bytes", one({uint64_t(1) << 61}, 0, 0), "extends past end of file");
  G ov;
  ov.header(2, 0).tensor("x", {16}, 0, 0).tensor("y", {8}, 0, 32).pad().zeros(128);
  expect_bad("overlap", ov.b, "tensors 'x' [0, 64) and 'y' [32, 64) overlap");
  G empty_name;
  empty_name.header(1, 0).tensor("", {8}, 0, 0).pad().zeros(32);
  expect_bad("empty name", empty_name.b, "tensor #0 has an empty name");
}

TEST(GgufBad, MetadataElementCap) {
  // 4M+1 u8 elements: allowed by the file size but refused by the element cap
  // (each parsed element is a ~48-byte Value), instead of a ~200 MB allocation.
  G g;
  const uint64_t n = (uint64_t(1) << 22) + 1;
  g.header(0, 1).str("k").u32(9).u32(0).u64(n).zeros(size_t(n));
  expect_bad("element cap", g.b, "metadata arrays hold more than 4194304 elements");
}

TEST(GgufBad, ConfigErrorsInInfoExitNonZero) {
  // A file that claims an architecture but lacks its keys: info prints what it can and exits 1.
  G g;
  g.header(0, 1).kv_str("general.architecture", "qwen3");
  const std::string path = temp_file(g.b);
  const CliResult r = run_info(path);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("missing required key 'qwen3.block_count'"), std::string::npos) << r.err;
  std::filesystem::remove(path);
  G h;
  h.header(0, 1).kv_str("general.architecture", "mamba");
  const std::string p2 = temp_file(h.b);
  const CliResult r2 = run_info(p2);
  EXPECT_EQ(r2.status, 1);
  EXPECT_NE(r2.err.find("general.architecture 'mamba' is not supported"), std::string::npos) << r2.err;
  std::filesystem::remove(p2);
}
