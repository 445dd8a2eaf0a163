// Test helpers for tests/nn: seeded random fills and a central finite-difference
// gradient check in double precision.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace strata::test {

inline std::vector<double> random_vector(size_t numel, uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-scale, scale);
  std::vector<double> v(numel);
  for (auto& x : v) x = dist(gen);
  return v;
}

inline std::vector<float> to_float(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

// Compares analytic[i] with (loss(x + h e_i) - loss(x - h e_i)) / 2h for every i.
// `loss` must read x. Tolerance is relative to max(1, |numeric|).
inline void check_gradient(const std::string& what, std::vector<double>& x,
                           const std::vector<double>& analytic, const std::function<double()>& loss,
                           double tol = 1e-6, double h = 1e-5) {
  REQUIRE(x.size() == analytic.size());
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double up = loss();
    x[i] = saved - h;
    const double down = loss();
    x[i] = saved;
    const double numeric = (up - down) / (2 * h);
    const double err = std::abs(numeric - analytic[i]) / std::max(1.0, std::abs(numeric));
    if (err > worst) {
      worst = err;
      worst_i = i;
    }
  }
  INFO(what << ": worst relative error " << worst << " at element " << worst_i);
  CHECK(worst <= tol);
}

inline double weighted_sum(const std::vector<double>& out, const std::vector<double>& weights) {
  double s = 0;
  for (size_t i = 0; i < out.size(); ++i) s += out[i] * weights[i];
  return s;
}

}  // namespace strata::test
