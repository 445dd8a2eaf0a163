// Which keys each query of causal self-attention sees: the one description of
// the mask that every attention kernel (the cpu reference and blocked kernels,
// the cuda flash kernels, forward and backward) asks, so that a new kind of
// mask is added here and in no kernel's conditionals.
//
// Causal always: query i sees keys j <= i. On top of that the visible keys of
// a query are one contiguous range [first_visible_key(i), i], and the queries
// that see a key j one contiguous range [j, last_seeing_query(j)]; a kernel
// skips whole tiles outside those ranges and masks elementwise inside.
//  - window > 0 (sliding-window attention, transformers' sliding_window: a key
//    is visible iff kv_idx > q_idx - window): query i sees keys
//    (i - window, i], its `window` most recent tokens, itself included.
//
// Header-only and usable in device code (nvcc, C++17). Thread-safety: a value type.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define STRATA_HOST_DEVICE __host__ __device__
#else
#define STRATA_HOST_DEVICE
#endif

namespace strata::ops {

struct AttentionMask {
  int64_t window = 0;  // 0: no sliding window (plain causal)
};

// The first key query `query` sees (keys [first, query] are visible).
STRATA_HOST_DEVICE inline int64_t first_visible_key(const AttentionMask& mask, int64_t query) {
  if (mask.window <= 0) return 0;
  const int64_t first = query - mask.window + 1;
  return first > 0 ? first : 0;
}

// The last query that sees key `key` (queries [key, last] see it), before
// clipping to the sequence: a caller takes min(last, seq - 1).
STRATA_HOST_DEVICE inline int64_t last_seeing_query(const AttentionMask& mask, int64_t key) {
  return mask.window <= 0 ? INT64_MAX : key + mask.window - 1;
}

STRATA_HOST_DEVICE inline bool is_visible(const AttentionMask& mask, int64_t query, int64_t key) {
  return key <= query && key >= first_visible_key(mask, query);
}

}  // namespace strata::ops
