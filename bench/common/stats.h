// Summary statistics shared by the bench tools. Every tool reports medians
// (these machines are noisy; a best-of hides the noise a user will see).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace strata::bench {

// Median of `values` (the mean of the middle two for an even count); 0 for none.
inline double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Index of the median element of `values` (the lower middle for an even count),
// for tools that report the other fields of the median run; 0 for none.
inline size_t median_index(const std::vector<double>& values) {
  if (values.empty()) return 0;
  std::vector<size_t> order(values.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return values[a] < values[b]; });
  return order[(order.size() - 1) / 2];
}

}  // namespace strata::bench
