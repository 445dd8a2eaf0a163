// Checks on parsing config.json (runtime/nn/decoder_config.h) shared by the
// families' and the real configs' tests.
#pragma once

#include <catch2/catch.hpp>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "runtime/nn/decoder_config.h"

namespace strata::test {

// parse_decoder_config(j) must fail with kBadArgument and a message holding every needle.
inline void expect_refused(const nlohmann::json& j, std::initializer_list<std::string> needles) {
  try {
    nn::parse_decoder_config(j);
    FAIL("accepted: " << j.dump());
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.category() == ErrorCategory::kBadArgument);
    for (const std::string& n : needles) CHECK_THAT(e.what(), Catch::Contains(n));
  }
}

}  // namespace strata::test
