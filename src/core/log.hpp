// Minimal leveled logging to stderr. stdout is reserved for program output
// (generated text, JSON), so logs never mix with it.
#pragma once

#include <string>

#include "core/error.hpp"

namespace kvq {

enum class LogLevel { debug = 0, info = 1, warn = 2, error = 3, quiet = 4 };

void set_log_level(LogLevel level);
LogLevel log_level();
void log_line(LogLevel level, const std::string& msg);

template <typename... Args>
void log_debug(const Args&... a) { if (log_level() <= LogLevel::debug) log_line(LogLevel::debug, str(a...)); }
template <typename... Args>
void log_info(const Args&... a) { if (log_level() <= LogLevel::info) log_line(LogLevel::info, str(a...)); }
template <typename... Args>
void log_warn(const Args&... a) { if (log_level() <= LogLevel::warn) log_line(LogLevel::warn, str(a...)); }

}  // namespace kvq
