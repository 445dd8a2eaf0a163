// Checks on parsing config.json (runtime/nn/decoder_config.h) and reading a
// checkpoint directory's (runtime/train/hf_model.h), shared by the tests.
#pragma once

#include <catch2/catch.hpp>
#include <filesystem>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/train/hf_model.h"

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

// train::load_hf_config(dir) must fail the same way: a checkpoint directory
// refused before any weight is read.
inline void expect_checkpoint_refused(const std::filesystem::path& dir, std::initializer_list<std::string> needles) {
  try {
    train::load_hf_config(dir);
    FAIL("accepted " << dir.string());
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.category() == ErrorCategory::kBadArgument);
    for (const std::string& n : needles) CHECK_THAT(e.what(), Catch::Contains(n));
  }
}

}  // namespace strata::test
