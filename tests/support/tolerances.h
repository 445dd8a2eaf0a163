// The one table of numeric tolerances of the tests, with the reason for each
// bound. Three sections, one per kind of comparison:
//   1. SIMD kernels against their scalar reference (the CPU optimizer);
//   2. the cuda Ops against the exact (double) references of kernels/nn_ops.h;
//   3. strata's model against transformers' (the golden fixtures).
// A new comparison adds its rows to the section it belongs to, or a section.
#pragma once

#include "core/dtype.h"

namespace strata::test {

// ==== 1. SIMD kernels against the scalar reference ==============================
// How far a SIMD variant may drift from the scalar reference (FMA contraction
// and a different summation order are the only sources of difference).

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

// ==== 2. cuda Ops against the exact references ==================================
// The double templates of kernels/nn_ops.h run on the same, already rounded,
// inputs: one row per op output, one column per storage dtype.
//
// A value passes when |got - want| <= abs * max|want| + rel * |want|, where
// max|want| is taken over the whole output tensor (and is at least the size of
// the inputs, O(1) in the tests, for outputs that can cancel to exactly zero,
// like attention's dq and dk at seq 1). The `abs` part is scaled by
// the output's magnitude on purpose: the errors of a reduction (a dot
// product, a softmax-weighted sum, a column sum) scale with the size of its
// terms, not with the (possibly cancelled, near-zero) result, so a purely
// relative bound is wrong near zero and a fixed absolute one is wrong for
// outputs far from 1.
//
// Where the errors come from. The reference sees exactly the values the
// device reads (inputs are rounded to their dtype before both run), so what
// remains is what the device does in finite precision:
//  - rounding a result to its storage dtype: error <= half an ulp, which is
//    <= u |x| with the unit roundoff u = 2^-p for a p-bit significand: 2^-24
//    (fp32), 2^-11 (fp16: 10 stored bits + 1), 2^-8 (bf16: 7 stored bits + 1).
//    (Values just above a power of two see the full u; those just below 2^(e+1)
//    half of it, hence the often quoted 2^-9 for bf16.) One ulp is 2u;
//    tolerances allow 1-2 ulp per rounding.
//  - roundings inside the op: a 16-bit operand fed to a tensor-core product
//    (attention's P and dS, cross-entropy's logits gradient, a parameter cast
//    to the activations' dtype for cuBLAS) adds <= u * sum|terms|, i.e. about
//    u * max|output| for the products here;
//  - fp32 accumulation: <= n 2^-24 sum|terms| in the worst case for n terms
//    (tensor cores: ~2^-23 per add), ~sqrt(n) 2^-24 typically; with the sizes
//    in these tests (n <= ~4096) that is ~1e-6..1e-5 relative to the terms;
//  - fp32 transcendental functions (expf, exp2f, rsqrtf: <= 2 ulp).
// fp32 has no 16-bit step, so its rows are the fp32 accumulation bounds with
// margin (cuBLAS runs fp32 GEMMs without TF32: CUBLAS_COMPUTE_32F).

struct OpTol {
  double abs;  // times max|want| over the tensor
  double rel;  // times |want|
};

struct OpTolRow {
  OpTol f32, f16, bf16;
  const OpTol& of(DType dtype) const {
    return dtype == DType::kBF16 ? bf16 : dtype == DType::kF16 ? f16 : f32;
  }
};

// Unit roundoffs and ulps (relative to |x|, worst case) of the 16-bit types.
inline constexpr double kU16 = 0x1p-11, kUlp16 = 0x1p-10;  // fp16
inline constexpr double kUbf = 0x1p-8, kUlpbf = 0x1p-7;    // bf16

// ---- embedding ----------------------------------------------------------------
// A row copy; a different table dtype is one rounding into the output dtype
// (the column is the OUTPUT's dtype): <= 1 ulp, exact for fp32 out.
inline constexpr OpTolRow kEmbeddingOut{{0, 0}, {0, kUlp16}, {0, kUlpbf}};
// dtable (fp32) += sum of the rows of one id: exact fp32 inputs, a handful of
// fp32 additions per element.
inline constexpr OpTolRow kEmbeddingGrad{{1e-6, 1e-6}, {1e-6, 1e-6}, {1e-6, 1e-6}};

// ---- RMSNorm ------------------------------------------------------------------
// y = x * rstd * w: rstd from an fp32 sum of dim squares (<= ~1e-6 relative at
// dim <= 512) and rsqrtf (2 ulp), then one rounding of y.
inline constexpr OpTolRow kRmsnormY{{1e-6, 1e-5}, {1e-6, kUlp16}, {1e-6, kUlpbf}};
// rstd is fp32 whatever the dtype: the fp32 sum of squares and rsqrtf.
inline constexpr OpTolRow kRmsnormRstd{{0, 1e-5}, {0, 1e-5}, {0, 1e-5}};
// dx = rstd (dy w - x rstd^2 mean(dy w x)): the difference cancels, so the
// fp32 error is relative to the terms (abs), then one rounding (rel); with
// accumulate_dx the fp32 sum dx + update is rounded once as well.
inline constexpr OpTolRow kRmsnormDx{{1e-5, 1e-5}, {1e-5 + kU16, kUlp16}, {1e-5 + kUbf, kUlpbf}};
// dw (fp32) += column sums over rows of dy x rstd: exact products of 16-bit
// values times rstd, fp32 sums over <= 300 rows split into ordered partials.
inline constexpr OpTolRow kRmsnormDw{{1e-5, 1e-5}, {1e-5, 1e-5}, {1e-5, 1e-5}};
// Qwen3's per-head q_norm / k_norm are this op on [rows x heads, head_dim]
// (dim 8..128): shorter sums, so the same rows bound them.
inline constexpr OpTolRow kRmsnormPerHeadY = kRmsnormY, kRmsnormPerHeadDx = kRmsnormDx,
                          kRmsnormPerHeadDw = kRmsnormDw;

// ---- Linear -------------------------------------------------------------------
// y = x W^T (+ b) (+ y0) and dx = dy W: dot products of length <= 64 in fp32
// (16-bit products are exact in fp32), then: one rounding of the GEMM result,
// a second one when the bias is added by its own kernel (the GEMM's beta = 1
// accumulates y0 before that), and - with a weight stored in another dtype - the
// cast of W to the activations' dtype (u per weight, <= u sum|x w| ~ u max|y|).
// Cancellation between x W^T, y0 and b makes the later roundings relative to
// max|y|: 4u of abs covers the three, 1 ulp of rel the final rounding.
inline constexpr OpTolRow kLinearOut{{1e-5, 1e-5}, {4 * kU16, kUlp16}, {4 * kUbf, kUlpbf}};
// dw (fp32) += dy^T x and dbias (fp32) += column sums of dy: exact products,
// fp32 (tensor-core) sums over <= 64 rows.
inline constexpr OpTolRow kLinearParamGrad{{1e-5, 1e-5}, {2e-5, 2e-5}, {2e-5, 2e-5}};

// ---- dropout ------------------------------------------------------------------
// x / (1 - p) in fp32 and one rounding; accumulated, the fp32 sum is rounded
// once as well (the rounding of the addend's inputs is the reference's).
inline constexpr OpTolRow kDropout{{1e-7, 1e-6}, {kU16, kUlp16}, {kUbf, kUlpbf}};

// ---- rotary embedding ---------------------------------------------------------
// x1 c - x2 s with cos/sin from double rounded to fp32, then one rounding; the
// difference can cancel, so the rounding is bounded by u |x| (abs).
inline constexpr OpTolRow kRope{{1e-6, 1e-6}, {kUlp16, kUlp16}, {kUlpbf, kUlpbf}};
// backward(forward(x)) == x: two such steps, each rounded.
inline constexpr OpTolRow kRopeRoundTrip{{2e-6, 2e-6}, {2 * kUlp16, kUlp16}, {2 * kUlpbf, kUlpbf}};
// Scaled frequencies (linear, llama3): the same double angles from another
// inverse frequency (rope_frequencies.h, shared with the reference), so the
// same two rows.
inline constexpr OpTolRow kRopeScaled = kRope, kRopeScaledRoundTrip = kRopeRoundTrip;

// ---- attention ----------------------------------------------------------------
// out = sum_j p_j v_j / l. 16-bit: P is rounded to 16 bits for the P V
// product (<= u sum_j p_j |v_j| / l <= u max|v| ~ u max|out|), plus the output
// rounding, plus fp32 exp2f and the tensor-core fp32 sums (~1e-5 of the scale).
// fp32: sums over up to 4096 keys in fp32 (~sqrt(n) 2^-24 of the terms).
inline constexpr OpTolRow kAttentionOut{{2e-5, 1e-5}, {4 * kU16, kUlp16}, {4 * kUbf, kUlpbf}};
// lse (fp32) = max + log(sum): the scores' fp32 dot products (<= ~5e-6 after
// the 1/sqrt(d) scale at d = 128) and the fp32 running sum.
inline constexpr OpTolRow kAttentionLse{{1e-5, 1e-5}, {2e-5, 2e-5}, {2e-5, 2e-5}};
// dq, dk, dv: recomputed P and dS = P (dP - delta) are rounded to 16 bits
// before the three products, and a key's dK/dV sum over all later queries of
// every head of its group (up to seq x group terms of mixed sign): u per term,
// accumulated, is bounded by ~u sum|terms| ~ a few u max|grad| (8u allowed),
// plus the output rounding. fp32: fp32 sums over up to 4096 x group terms with
// the cancellation in dP - delta (delta summed in another order than the
// reference's): ~1e-5 of the scale, 5e-5 allowed.
inline constexpr OpTolRow kAttentionGrad{{5e-5, 5e-5}, {8 * kU16, kUlp16}, {8 * kUbf, kUlpbf}};
// A sliding window masks keys to exact zeros in P and dS and shortens every
// sum, so the unmasked rows bound it.
inline constexpr OpTolRow kAttentionWindowOut = kAttentionOut, kAttentionWindowLse = kAttentionLse,
                          kAttentionWindowGrad = kAttentionGrad;

// ---- SwiGLU, add, cast ----------------------------------------------------------
// Elementwise in fp32 (expf <= 2 ulp, a few multiplications; 1 + g (1 - s)
// in dgate can cancel, hence the small abs), then one rounding.
inline constexpr OpTolRow kSwiglu{{1e-6, 1e-5}, {1e-6, kUlp16}, {1e-6, kUlpbf}};
// a + b: exact in fp32 for 16-bit inputs of similar size, then one rounding.
inline constexpr OpTolRow kAdd{{0, 2e-7}, {0, kUlp16}, {0, kUlpbf}};
// A conversion: exact when widening, one rounding (<= u) when narrowing; the
// column is the destination dtype.
inline constexpr OpTolRow kCast{{0, 0}, {0, kU16}, {0, kUbf}};

// ---- cross-entropy ------------------------------------------------------------
// lse (fp32): logits from a fp32-accumulated GEMM of exact products (dim <= 64)
// and a fp32 log-sum-exp over the vocabulary (~1e-6 relative).
inline constexpr OpTolRow kCrossEntropyLse{{1e-5, 1e-5}, {2e-5, 2e-5}, {2e-5, 2e-5}};
// stats[0], the summed loss (a scalar, so only rel applies): per-row fp32
// lse - logit (~1e-6 of lse), summed in double; stats[1] is an exact count.
inline constexpr OpTolRow kCrossEntropyLoss{{0, 1e-5}, {0, 2e-5}, {0, 2e-5}};
// dh = G W with G = scale (softmax - onehot): 16-bit G is rounded (u per
// element, <= u sum|G||W| ~ 2u max|dh| as the target term dominates), then dh
// is rounded: 4u abs, 1 ulp rel. fp32: fp32 GEMM over the vocabulary.
inline constexpr OpTolRow kCrossEntropyDh{{2e-5, 2e-5}, {4 * kU16, kUlp16}, {4 * kUbf, kUlpbf}};
// dw (fp32) += G^T h: the same rounded G, exact products, fp32 sums over the
// rows; rounding errors stay relative to each column's terms (2u).
inline constexpr OpTolRow kCrossEntropyDw{{2e-5, 2e-5}, {2 * kU16, kUlp16}, {2 * kUbf, kUlpbf}};

// ==== 3. the model against transformers ===========================================
// The loss and every gradient of a fixture model against what transformers
// computed for it (tests/nn/golden_checks.h).

struct GoldenTolerance {
  double loss_rel;     // |ours - ref| <= loss_rel * |ref|
  double grad_of_max;  // per tensor: max |ours - ref| <= grad_of_max * max |ref|
};

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
