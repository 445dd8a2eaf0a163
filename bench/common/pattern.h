// Deterministic test data for the bench tools: a value per element index with
// no RNG state, so threads can fill (and checks can recompute) any range.
#pragma once

#include <cstdint>

namespace strata::bench {

// A value in [-1, 1) for element i; `salt` picks an independent sequence.
inline float pseudo(uint64_t i, uint64_t salt) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ salt;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<double>(x >> 40) / static_cast<double>(1ull << 23) - 1.0);
}

}  // namespace strata::bench
