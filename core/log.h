// Logging through spdlog with a rank-aware prefix ("[strata r3/8] ...").
// The logger is the library's one global. Thread-safe.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace strata {

// The process-wide logger; created on first use with level from STRATA_LOG_LEVEL
// (trace, debug, info, warn, error, off; default info) and rank from RANK/WORLD_SIZE.
spdlog::logger& logger();

// Sets the rank shown in every line. world_size <= 1 hides the rank.
void set_log_rank(int rank, int world_size);
void set_log_level(std::string_view level);

// Logs `message` as a warning the first time `key` is seen in this process only.
void warn_once(std::string_view key, std::string_view message);

}  // namespace strata
