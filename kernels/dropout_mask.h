// The dropout mask as a pure function of (seed, element index): the same on
// the cpu and in cuda kernels, so backward (and an activation-checkpointing
// recompute) regenerates the mask its forward used instead of storing it.
// Element `index` of a [rows, cols] matrix is r * cols + c (not its address:
// a strided view gets the mask of its logical shape).
// Header-only and usable in device code (nvcc, C++17).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define STRATA_DROPOUT_HD __host__ __device__
#else
#define STRATA_DROPOUT_HD
#endif

namespace strata::ops {

// splitmix64's finaliser: a bijective mix of all 64 bits.
STRATA_DROPOUT_HD inline uint64_t dropout_mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Whether element `index` survives dropout with probability p of dropping: a
// uniform in [0, 1) of 24 bits (exact in float) at or above p.
STRATA_DROPOUT_HD inline bool dropout_keep(uint64_t seed, uint64_t index, float p) {
  const uint64_t r = dropout_mix(seed ^ dropout_mix(index));
  return static_cast<float>(r >> 40) * (1.0f / 16777216.0f) >= p;
}

}  // namespace strata::ops
