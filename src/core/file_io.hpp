// Files as inputs and outputs of the command line, done safely:
//   - inputs are read with a size limit, so `-f /dev/zero` or an endless pipe
//     is a clear error instead of exhausting memory;
//   - outputs appear under their name only when complete (a temporary file
//     beside the target, renamed over it on commit), and only regular files
//     are ever replaced: a symlink is followed to its target, and a device,
//     FIFO or directory is refused rather than replaced by a regular file.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>

namespace kvq {

// Prompts and texts to tokenize: 64 MiB is ~16M tokens, far beyond any context.
inline constexpr size_t kMaxTextInputBytes = size_t(64) << 20;

// The whole file at `path` ("-": standard input). More than max_bytes is an
// Errc::invalid_argument error naming `what` and the limit; reading stops
// right after the limit. A missing or unreadable file is Errc::io.
std::string read_file_bounded(const std::string& path, size_t max_bytes, std::string_view what);
// The rest of an open stream, with the same limit.
std::string read_stream_bounded(std::FILE* f, const std::string& name, size_t max_bytes, std::string_view what);
// One line of `f` (without its '\n') into `line`; false at end of input with
// nothing read. A line longer than max_bytes is an Errc::invalid_argument
// error naming `what` (an endless line, such as /dev/zero, cannot exhaust memory).
bool read_line_bounded(std::FILE* f, std::string& line, size_t max_bytes, std::string_view what);

// Inputs of the running command (the model, the prompt file, a vocabulary)
// that no OutputFile may replace: `kvq run -m M.gguf --dump-logits M.gguf`
// is an error naming both, not a destroyed model. Files are compared by
// device and inode (links and other spellings of the same file count);
// a path that does not exist is ignored. `what` names it in the message.
void note_input(const std::string& path, std::string_view what);
// Forgets every noted input (tests that run several commands in one process).
void clear_inputs();

// A file written under a temporary name beside its target and renamed over
// the target by commit(). The temporary gets the mode of the file it will
// replace (a 0600 file stays 0600), and is removed when the process is
// ended by SIGINT, SIGTERM, SIGHUP or SIGPIPE (handlers are installed only
// where the signal's disposition is still the default). Until then (and when commit() is never reached,
// e.g. on a write error or a full disk) the target keeps its old contents,
// or does not exist, and the destructor removes the temporary.
class OutputFile {
 public:
  // Resolves `path`: symlinks are followed (the link stays and its target is
  // replaced); an existing target that is not a regular file, or that is a
  // noted input (note_input), is an Errc::invalid_argument error naming what
  // it is. Creates the temporary
  // (mode 0644 less the umask) or throws Errc::io.
  explicit OutputFile(const std::string& path);
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();

  const std::string& path() const { return path_; }          // as given, for messages
  const std::string& target() const { return target_; }      // the file replaced on commit
  const std::string& temp_path() const { return temp_; }
  int fd() const { return fd_; }  // open read-write on the temporary
  // A stdio stream over fd() (opened on first use; commit() flushes and closes it).
  std::FILE* stream();
  // Flushes and closes the temporary and renames it over the target. Any
  // failure (a short write surfacing at close, a failed rename) is Errc::io
  // and leaves the target untouched.
  void commit();

 private:
  std::string path_, target_, temp_;
  int fd_ = -1;
  std::FILE* stream_ = nullptr;
  bool committed_ = false;
  int slot_ = -1;  // signal-cleanup slot of the temporary
};

// What kind of file system object `path` is, for messages: "regular file",
// "directory", "character device", "block device", "FIFO", "socket",
// "symbolic link", or "" when it does not exist.
std::string file_kind(const std::string& path);

}  // namespace kvq
