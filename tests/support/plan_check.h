// Reading `strata plan --check --json`: a tier's row held to its measurement.
#pragma once

#include <catch2/catch.hpp>
#include <string>

#include <nlohmann/json.hpp>

namespace strata::test {

// The check `j` has the tier `name`, measured, and predicted exactly what was measured.
inline void check_tier_exact(const nlohmann::json& j, const std::string& name) {
  CAPTURE(name);
  int found = 0;
  for (const auto& tier : j["tiers"]) {
    if (tier["tier"] != name) continue;
    ++found;
    REQUIRE(!tier["measured_bytes"].is_null());
    CHECK(tier["predicted_bytes"] == tier["measured_bytes"]);
  }
  CHECK(found == 1);
}

}  // namespace strata::test
