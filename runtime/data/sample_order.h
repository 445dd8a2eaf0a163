// The order samples are visited in, shared by every loader: each epoch visits
// every sample once, in a permutation fixed by (seed, epoch), so the order does
// not depend on the world size and a cursor (samples consumed) is the whole
// state to checkpoint. Header-only; pure functions.
#pragma once

#include <bit>
#include <cstdint>

namespace strata::data {

inline uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A bijection of [0, n) keyed by `key`: a 4-round Feistel network on the
// smallest even number of bits covering n, cycle-walking until the value is
// back in range (at most ~4 walks on average since the domain is < 4n).
inline uint64_t permute(uint64_t i, uint64_t n, uint64_t key) {
  if (n <= 1) return 0;
  const int bits = std::bit_width(n - 1);
  const int half = (bits + 1) / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t x = i;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = mix(right ^ key ^ (round * 0x9e3779b97f4a7c15ull)) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= n);
  return x;
}

// The window the `sample`-th sample (counting over epochs) reads, of `windows`.
inline int64_t window_of_sample(uint64_t sample, int64_t windows, uint64_t seed) {
  const auto w = static_cast<uint64_t>(windows);
  const uint64_t epoch = sample / w;
  return static_cast<int64_t>(permute(sample % w, w, mix(seed ^ mix(epoch + 1))));
}

}  // namespace strata::data
