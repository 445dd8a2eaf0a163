// The process-wide spdlog logger with a rank-aware prefix.
#include "core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

namespace strata {
namespace {

std::string prefix(int rank, int world_size) {
  if (world_size <= 1) return "[strata] [%^%l%$] %v";
  return fmt::format("[strata r{}/{}] [%^%l%$] %v", rank, world_size);
}

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  return std::atoi(value);
}

std::shared_ptr<spdlog::logger> make_logger() {
  auto logger = spdlog::stderr_color_mt("strata");
  logger->set_pattern(prefix(env_int("RANK", 0), env_int("WORLD_SIZE", 1)));
  const char* level = std::getenv("STRATA_LOG_LEVEL");
  logger->set_level(level ? spdlog::level::from_str(level) : spdlog::level::info);
  return logger;
}

}  // namespace

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = make_logger();
  return *instance;
}

void set_log_rank(int rank, int world_size) { logger().set_pattern(prefix(rank, world_size)); }

void set_log_level(std::string_view level) {
  logger().set_level(spdlog::level::from_str(std::string(level)));
}

void warn_once(std::string_view key, std::string_view message) {
  static std::mutex mutex;
  static std::set<std::string, std::less<>> seen;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!seen.emplace(key).second) return;
  }
  logger().warn("{}", message);
}

}  // namespace strata
