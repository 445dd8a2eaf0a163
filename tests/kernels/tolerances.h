// The one table of numeric tolerances for CPU optimizer kernels: how far a SIMD
// variant may drift from the scalar reference (FMA contraction and a different
// summation order are the only sources of difference).
#pragma once

namespace strata::test {

struct Tolerance {
  double rel;  // |a - b| <= abs + rel * |b|
  double abs;
};

// fp32 master weight after kAdamSteps steps of Adam/AdamW.
constexpr Tolerance kAdamParamTol{2e-6, 1e-7};
// First moment: an average of gradients of both signs, so it passes near zero
// where only an absolute bound makes sense (gradients here are O(1)).
constexpr Tolerance kAdamExpAvgTol{1e-6, 2e-6};
// Second moment.
constexpr Tolerance kAdamExpAvgSqTol{1e-6, 1e-12};
// Squared gradient norm: summation order differs (double accumulators).
constexpr Tolerance kGradSumSqTol{1e-12, 0.0};
// Steps run by the multi-step comparison (exercises the bias correction).
constexpr int kAdamSteps = 25;

inline bool within(double a, double b, const Tolerance& tol) {
  const double diff = a > b ? a - b : b - a;
  return diff <= tol.abs + tol.rel * (b < 0 ? -b : b);
}

// |a - b| as a fraction of what the tolerance allows (<= 1 passes).
inline double excess(double a, double b, const Tolerance& tol) {
  const double diff = a > b ? a - b : b - a;
  return diff / (tol.abs + tol.rel * (b < 0 ? -b : b));
}

}  // namespace strata::test
