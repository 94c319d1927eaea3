// kvq's one error vocabulary. The library reports failures by throwing
// kvq::Error (never exit/abort); only the `kvq` binary turns them into an exit
// status. Messages are one line, say what is wrong and, where possible, how to
// fix it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kvq {

enum class Errc {
  invalid_argument,  // bad user input: flag, name, value
  io,                // file missing, unreadable, short write
  format,            // malformed file contents (GGUF, JSON, ...)
  unsupported,       // valid but not implemented / not supported by this build
  out_of_range,      // index, size or context limit exceeded
  cuda,              // CUDA runtime / cuBLAS failure
  internal,          // a broken invariant: a bug in kvq
};

const char* errc_name(Errc c);

class Error : public std::runtime_error {
 public:
  Error(Errc code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  Errc code() const { return code_; }

 private:
  Errc code_;
};

// Concatenate anything streamable into a string: str("layer ", i, " of ", n).
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <typename... Args>
[[noreturn]] void fail(Errc code, const Args&... args) {
  throw Error(code, str(args...));
}

}  // namespace kvq

// KVQ_CHECK(cond, errc, msg...): throw kvq::Error naming the failed condition
// when cond is false. For invariants (bugs), the file and line are appended.
#define KVQ_CHECK(cond, errc, ...)                    \
  do {                                                \
    if (!(cond)) ::kvq::fail((errc), __VA_ARGS__);    \
  } while (0)

#define KVQ_ASSERT(cond)                                                                   \
  do {                                                                                     \
    if (!(cond))                                                                           \
      ::kvq::fail(::kvq::Errc::internal, "internal error: ", #cond, " (", __FILE__, ":", \
                  __LINE__, ")");                                                          \
  } while (0)
