// The one table of tolerances for the golden checks against transformers
// (golden_checks.h), with the reason for each.
#pragma once

#include "tests/nn/golden_checks.h"

namespace strata::test {

// fp32 storage and compute on both sides. The only differences are summation
// order (GEMM blocking, attention and softmax accumulation) and our vectorised
// exp (<= 2 ulp): relative ~1e-7 per operation, grown through two layers and
// the loss to well below these bounds (the fp32 targets).
inline constexpr GoldenTolerance kGoldenF32{1e-5, 1e-4};

// cuBLAS with CUBLAS_COMPUTE_32F and our fp32 kernels: as above, but device
// reductions (warp shuffles, split-K) reorder sums more; same targets.
inline constexpr GoldenTolerance kGoldenF32Cuda{1e-5, 1e-4};

// bf16 weights; transformers computes in bf16 throughout (every activation,
// every GEMM output and every gradient — torch keeps .grad in bf16 — rounded
// to 8 significant bits: unit roundoff 2^-9 = 2e-3), strata's cpu in fp32 (or
// with bf16 activations but fp32 accumulation, fp32 softmax/norm statistics
// and fp32 gradients). The sides round at different points, so they differ by
// bf16 roundings accumulated over ~30 sequential ops (two layers) and, in the
// reference gradients, over the bf16 sums of the batch's contributions.
// Measured (4 cases x {fp32, bf16} activations): loss <= 7.1e-4 relative;
// gradients <= 6.9% of the tensor's max (small tensors, whose max is near the
// rounding noise, are the worst; most are 1-3%). Bounds: loss 4x, gradients
// about 2x the measured worst.
inline constexpr GoldenTolerance kGoldenBf16VsTorchBf16{3e-3, 0.15};

}  // namespace strata::test
