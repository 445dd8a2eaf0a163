// Shared by the optimizer ops' tests of both backends (ops_cpu_test.cc,
// ops_cuda_optimizer_test.cc): their inputs and their argument checks.
#pragma once

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "core/error.h"

namespace strata::test {

// n fp32 values from N(0, scale); every 13th is an exact zero when `zeros`
// (a gradient of 0 keeps v at 0 there: the eps path of the denominator).
inline std::vector<float> normal_floats(size_t n, uint32_t seed, float scale, bool zeros = false) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = zeros && i % 13 == 0 ? 0.0f : d(gen);
  return v;
}

// call() throws Error(kBadArgument) whose message contains `message`.
template <typename Call>
void expect_bad_argument(Call&& call, const char* message) {
  try {
    call();
    FAIL("no error: expected one containing \"" << message << "\"");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::kBadArgument);
    CHECK_THAT(e.message(), Catch::Contains(message));
  }
}

}  // namespace strata::test
