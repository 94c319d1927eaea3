#include "core/file_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <limits.h>
#include <signal.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/error.hpp"

namespace kvq {
namespace {

std::string mib(size_t bytes) {
  return bytes % (size_t(1) << 20) == 0 ? str(bytes >> 20, " MiB") : str(bytes, " bytes");
}

const char* kind_of(mode_t m) {
  if (S_ISREG(m)) return "regular file";
  if (S_ISDIR(m)) return "directory";
  if (S_ISCHR(m)) return "character device";
  if (S_ISBLK(m)) return "block device";
  if (S_ISFIFO(m)) return "FIFO";
  if (S_ISSOCK(m)) return "socket";
  if (S_ISLNK(m)) return "symbolic link";
  return "special file";
}

std::string dir_of(const std::string& p) {
  const size_t slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}

// Follows symlinks in the last component of `path` (a dangling link resolves
// to the path it names, which is then created).
std::string resolve_links(const std::string& path) {
  std::string p = path;
  for (int hops = 0; hops < 40; ++hops) {
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return p;
    std::vector<char> buf(size_t(st.st_size > 0 ? st.st_size : 255) + 1);
    const ssize_t n = ::readlink(p.c_str(), buf.data(), buf.size());
    if (n < 0) fail(Errc::io, "'", path, "': cannot read the symbolic link: ", std::strerror(errno));
    const std::string link(buf.data(), size_t(n));
    p = link.empty() || link[0] == '/' ? link : dir_of(p) + "/" + link;
  }
  fail(Errc::io, "'", path, "': too many levels of symbolic links");
}

struct NotedInput {
  dev_t dev;
  ino_t ino;
  std::string path, what;
};
std::mutex inputs_mu;
std::vector<NotedInput>& inputs() {
  static std::vector<NotedInput> v;
  return v;
}

// Temporaries that a fatal signal must not leave behind. Fixed slots so that
// the handler only reads memory and calls unlink (async-signal-safe).
constexpr int kTempSlots = 64;
struct TempSlot {
  std::atomic<bool> used{false};
  char path[PATH_MAX];
};
TempSlot temp_slots[kTempSlots];
constexpr int kCleanupSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE};

extern "C" void remove_temporaries_and_die(int sig) {
  for (auto& slot : temp_slots)
    if (slot.used.load()) ::unlink(slot.path);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void install_cleanup_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int sig : kCleanupSignals) {
      struct sigaction old {};
      if (::sigaction(sig, nullptr, &old) != 0 || old.sa_handler != SIG_DFL || (old.sa_flags & SA_SIGINFO)) continue;
      struct sigaction sa {};
      sa.sa_handler = remove_temporaries_and_die;
      sigemptyset(&sa.sa_mask);
      ::sigaction(sig, &sa, nullptr);
    }
  });
}

int register_temporary(const std::string& path) {
  if (path.size() >= PATH_MAX) return -1;
  install_cleanup_handlers();
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < kTempSlots; ++i) {
    if (temp_slots[i].used.load()) continue;
    std::memcpy(temp_slots[i].path, path.c_str(), path.size() + 1);
    temp_slots[i].used.store(true);
    return i;
  }
  return -1;  // more than 64 outputs open at once: not cleaned on a signal
}

void unregister_temporary(int slot) {
  if (slot >= 0) temp_slots[slot].used.store(false);
}

}  // namespace

void note_input(const std::string& path, std::string_view what) {
  struct stat st;
  if (path.empty() || path == "-" || ::stat(path.c_str(), &st) != 0) return;
  std::lock_guard<std::mutex> lock(inputs_mu);
  inputs().push_back({st.st_dev, st.st_ino, path, std::string(what)});
}

void clear_inputs() {
  std::lock_guard<std::mutex> lock(inputs_mu);
  inputs().clear();
}

std::string file_kind(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return "";
  return kind_of(st.st_mode);
}

std::string read_stream_bounded(std::FILE* f, const std::string& name, size_t max_bytes, std::string_view what) {
  std::string out;
  std::vector<char> buf(size_t(1) << 16);
  while (true) {
    const size_t n = std::fread(buf.data(), 1, buf.size(), f);
    if (n > 0) {
      if (out.size() + n > max_bytes)
        fail(Errc::invalid_argument, what, " '", name, "' is larger than ", mib(max_bytes),
             ", the limit for it (is it the file you meant?)");
      out.append(buf.data(), n);
    }
    if (n < buf.size()) {
      if (std::ferror(f)) fail(Errc::io, "cannot read ", what, " '", name, "': ", std::strerror(errno));
      return out;
    }
  }
}

bool read_line_bounded(std::FILE* f, std::string& line, size_t max_bytes, std::string_view what) {
  line.clear();
  int c;
  bool any = false;
  while ((c = std::getc(f)) != EOF) {
    any = true;
    if (c == '\n') return true;
    if (line.size() >= max_bytes)
      fail(Errc::invalid_argument, what, " is longer than ", mib(max_bytes), ", the limit for one line");
    line.push_back(char(c));
  }
  if (std::ferror(f)) fail(Errc::io, "cannot read ", what, ": ", std::strerror(errno));
  return any;
}

std::string read_file_bounded(const std::string& path, size_t max_bytes, std::string_view what) {
  if (path == "-") return read_stream_bounded(stdin, "<stdin>", max_bytes, what);
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    fail(Errc::io, what, " '", path, "' is a directory, not a file");
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fail(Errc::io, "cannot read ", what, " '", path, "': ", std::strerror(errno));
  try {
    std::string s = read_stream_bounded(f, path, max_bytes, what);
    std::fclose(f);
    return s;
  } catch (...) {
    std::fclose(f);
    throw;
  }
}

OutputFile::OutputFile(const std::string& path) : path_(path) {
  KVQ_CHECK(!path.empty(), Errc::invalid_argument, "empty output path");
  target_ = resolve_links(path);
  struct stat st;
  if (::stat(target_.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    fail(Errc::invalid_argument, "'", path, "'", target_ != path ? str(" (-> '", target_, "')") : std::string(),
         " is a ", kind_of(st.st_mode),
         ", not a regular file; kvq writes its output to a new file and renames it into place, "
         "which would replace it: give a regular file path");
  }
  mode_t mode = 0644;  // before the umask, as open() applies it
  bool keep_mode = false;
  if (::stat(target_.c_str(), &st) == 0) {
    std::lock_guard<std::mutex> lock(inputs_mu);
    for (const NotedInput& in : inputs())
      if (in.dev == st.st_dev && in.ino == st.st_ino)
        fail(Errc::invalid_argument, "output '", path, "' is the ", in.what, " '", in.path,
             "' of this command; writing it would destroy the input: give another output path");
    mode = st.st_mode & 07777;
    keep_mode = true;
  }
  static std::atomic<unsigned> counter{0};
  for (int attempt = 0; attempt < 100 && fd_ < 0; ++attempt) {
    temp_ = str(target_, ".tmp.", ::getpid(), ".", counter++);
    fd_ = ::open(temp_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, keep_mode ? 0600 : 0644);
    if (fd_ < 0 && errno != EEXIST)
      fail(Errc::io, "'", path, "': cannot create '", temp_, "': ", std::strerror(errno));
  }
  if (fd_ < 0) fail(Errc::io, "'", path, "': cannot create a temporary file beside it");
  slot_ = register_temporary(temp_);
  // A replaced file keeps its permissions (0600 stays 0600, not 0644).
  if (keep_mode && ::fchmod(fd_, mode) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    ::unlink(temp_.c_str());
    unregister_temporary(slot_);
    slot_ = -1;
    fail(Errc::io, "'", path, "': cannot give the new file the mode of the old one: ", std::strerror(err));
  }
}

OutputFile::~OutputFile() {
  if (stream_) std::fclose(stream_);
  else if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
  unregister_temporary(slot_);
}

std::FILE* OutputFile::stream() {
  KVQ_CHECK(fd_ >= 0 || stream_, Errc::internal, "OutputFile::stream after commit");
  if (!stream_) {
    stream_ = ::fdopen(fd_, "w+b");
    if (!stream_) fail(Errc::io, "'", path_, "': fdopen failed: ", std::strerror(errno));
  }
  return stream_;
}

void OutputFile::commit() {
  KVQ_CHECK(!committed_ && (fd_ >= 0 || stream_), Errc::internal, "OutputFile::commit twice");
  bool ok = true;
  int err = 0;
  if (stream_) {
    ok = std::fflush(stream_) == 0;
    if (!ok) err = errno;
    if (std::fclose(stream_) != 0 && ok) {
      ok = false;
      err = errno;
    }
    stream_ = nullptr;
  } else if (::close(fd_) != 0) {
    ok = false;
    err = errno;
  }
  fd_ = -1;
  if (!ok) fail(Errc::io, "cannot finish writing '", path_, "': ", std::strerror(err), " (disk full?)");
  if (std::rename(temp_.c_str(), target_.c_str()) != 0)
    fail(Errc::io, "'", path_, "': cannot rename '", temp_, "' into place: ", std::strerror(errno));
  committed_ = true;
  unregister_temporary(slot_);
  slot_ = -1;
}

}  // namespace kvq
