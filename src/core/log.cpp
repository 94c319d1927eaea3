#include "core/log.hpp"

#include "core/text.hpp"

#include <atomic>
#include <cstdio>
#include <mutex>

namespace kvq {

namespace {
std::atomic<int> g_level{int(LogLevel::warn)};
std::mutex g_mutex;
}  // namespace

void set_log_level(LogLevel level) { g_level = int(level); }
LogLevel log_level() { return LogLevel(g_level.load()); }

void log_line(LogLevel level, const std::string& msg) {
  static const char* names[] = {"debug", "info", "warn", "error", ""};
  std::lock_guard<std::mutex> lock(g_mutex);
  // Log lines quote file contents (metadata, paths): control bytes escaped.
  std::fprintf(stderr, "kvq %s: %s\n", names[int(level)], printable(msg, true).c_str());
}

}  // namespace kvq
