// Element-wise comparison for the op checks shared by the cpu and cuda test
// fixtures (moe_op_checks.h, vocab_parallel_checks.h).
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

namespace strata::test {

// |got - want| within tol times the largest |want| (at least 1e-3), element by element.
inline void expect_near(const std::vector<double>& got, const std::vector<double>& want, double tol,
                        const char* what) {
  REQUIRE(got.size() == want.size());
  double scale = 1e-3;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(what << "[" << i << "] got " << got[i] << " want " << want[i]);
    REQUIRE(std::abs(got[i] - want[i]) <= tol * scale);
  }
}

}  // namespace strata::test
