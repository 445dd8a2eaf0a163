// Merging the attention of one key block into the result so far (context
// parallelism: ring attention's partial outputs), by their log-sum-exps:
//   lse' = max + log1p(exp(min - max))  (max, min of lse and part_lse),
//   out' = out * exp(lse - lse') + part * exp(part_lse - lse').
// The one formula Ops::attention_merge's cpu and cuda kernels run, in fp32.
// A side whose lse is -inf (a row that saw no key there) weighs 0 exactly.
//
// Header-only and usable in device code (nvcc, C++17). Thread-safety: pure functions.
#pragma once

#include <math.h>

#include "kernels/attention_mask.h"  // STRATA_HOST_DEVICE

namespace strata::ops {

struct MergeWeights {
  float keep, take;  // the factors of out and of part
  float lse;         // the merged log-sum-exp
};

STRATA_HOST_DEVICE inline MergeWeights merge_weights(float lse, float part_lse) {
  if (part_lse == -INFINITY) return {1.0f, 0.0f, lse};
  if (lse == -INFINITY) return {0.0f, 1.0f, part_lse};
  const float hi = lse > part_lse ? lse : part_lse, lo = lse > part_lse ? part_lse : lse;
  const float merged = hi + log1pf(expf(lo - hi));
  return {expf(lse - merged), expf(part_lse - merged), merged};
}

}  // namespace strata::ops
