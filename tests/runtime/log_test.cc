// Logging: the rank prefix and warn_once.
#include <catch2/catch.hpp>

#include <spdlog/sinks/ostream_sink.h>

#include <sstream>

#include "core/log.h"

TEST_CASE("log lines carry the rank, warn_once warns once", "[log]") {
  std::ostringstream captured;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(captured);
  auto& logger = strata::logger();
  const auto saved = logger.sinks();
  logger.sinks() = {sink};
  strata::set_log_rank(3, 8);
  logger.info("hello");
  strata::warn_once("test-key", "first");
  strata::warn_once("test-key", "second");
  strata::set_log_rank(0, 1);
  logger.info("single");
  logger.sinks() = saved;
  const std::string text = captured.str();
  REQUIRE_THAT(text, Catch::Contains("[strata r3/8]") && Catch::Contains("hello"));
  REQUIRE_THAT(text, Catch::Contains("first") && !Catch::Contains("second"));
  REQUIRE_THAT(text, Catch::Contains("[strata] [info] single"));
}
