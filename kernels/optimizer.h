// CPU optimizer kernels: Adam/AdamW with fp32 master weights and moments, the
// 16-bit parameter copy written in the same pass, and the gradient statistics
// (squared norm + inf/NaN) the step needs. One binary picks scalar, AVX2 or
// AVX-512 at run time from CPUID and, between AVX2 and AVX-512, by timing (see
// default_isa); STRATA_ISA=scalar|avx2|avx512 forces one.
//
// Thread-safety: every function is reentrant; concurrent calls on disjoint
// buffers are fine. Kernels parallelise internally with OpenMP.
// Ownership: all pointers belong to the caller and are only used during the call.
// Errors: Error(kBadArgument) for invalid hyper-parameters, dtypes or an ISA the
// CPU lacks; nothing else throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace strata::kernels {

enum class CpuIsa : uint8_t { kScalar, kAvx2, kAvx512 };

std::string_view isa_name(CpuIsa isa);  // "scalar", "avx2", "avx512"
// Accepts "scalar", "avx2", "avx512"; throws Error(kBadArgument) otherwise.
CpuIsa parse_isa(std::string_view text);
// Whether this CPU (and OS) can run `isa`.
bool isa_supported(CpuIsa isa);
// ISAs this CPU can run, scalar first.
std::vector<CpuIsa> supported_isas();
// The ISA adam_step uses when none is asked for: STRATA_ISA if set (throws
// Error(kBadArgument) when it names an unknown or unsupported ISA); else, on a
// CPU that runs both AVX2 and AVX-512, the faster of the two for this process's
// updates: the first six adam_step calls of >= 2^20 elements that ask for no
// ISA are run alternately with each and timed, and the lower median time per
// element wins (AVX2 only by more than 3%). Until then it is AVX-512; after,
// it never changes. Else the widest the CPU supports. Only speed depends on
// this choice: the AVX2 and AVX-512 updates are bit-identical.
CpuIsa default_isa();

// How default_isa() was decided, for tools that report it.
struct DefaultIsaInfo {
  CpuIsa isa = CpuIsa::kScalar;
  std::string_view basis;  // "STRATA_ISA", "widest supported", "calibrating", "calibrated"
  int trials = 0;          // timed updates so far
  double avx512_ns_per_param = 0, avx2_ns_per_param = 0;  // medians, once calibrated
};
DefaultIsaInfo default_isa_info();

// Hyper-parameters of one Adam/AdamW step, with PyTorch's meaning.
struct AdamConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool adamw = true;  // true: decoupled decay p *= 1 - lr*wd; false: L2, g += wd*p

  // Throws Error(kBadArgument) naming the field when out of range.
  void validate() const;
};

// Per-step scalars derived once from AdamConfig and the step number, so that
// every ISA and every chunk uses the same rounded constants.
struct AdamCoefficients {
  float lr = 0, beta1 = 0, beta2 = 0, one_minus_beta1 = 0, one_minus_beta2 = 0, eps = 0;
  float step_size = 0;          // lr / (1 - beta1^step)
  float inv_bias2_sqrt = 0;     // 1 / sqrt(1 - beta2^step)
  float decay = 1;              // AdamW: 1 - lr*wd; Adam: 1
  float l2 = 0;                 // Adam: wd; AdamW: 0
  float grad_scale = 1;         // gradients are multiplied by this first (unscale, clip)
};

// step is 1-based (the first update is step 1). grad_scale folds loss-scale
// unscaling and clipping into the update (see combined_grad_scale).
AdamCoefficients adam_coefficients(const AdamConfig& config, int64_t step, float grad_scale = 1.0f);

// The buffers of one update over numel elements.
struct AdamBuffers {
  float* param = nullptr;          // [numel] fp32 master, updated in place
  float* exp_avg = nullptr;        // [numel] first moment, updated in place
  float* exp_avg_sq = nullptr;     // [numel] second moment, updated in place
  const void* grad = nullptr;      // [numel] of grad_dtype
  DType grad_dtype = DType::kF32;
  void* param16 = nullptr;         // [numel] of param16_dtype, or nullptr for no copy
  DType param16_dtype = DType::kBF16;  // kF16 or kBF16
  size_t numel = 0;
};

// One Adam/AdamW update in a single pass over memory:
//   g = grad*grad_scale (+ l2*p);  p *= decay;  m = b1*m + (1-b1)*g;
//   v = b2*v + (1-b2)*g*g;  p -= step_size * m / (sqrt(v)*inv_bias2_sqrt + eps);
//   param16 = round_to_nearest_even(p).
// isa nullopt: default_isa() (such a call may be one of its timed trials).
// threads 0: OpenMP's default. Results do not depend on the thread count, nor
// on the ISA among AVX2 and AVX-512 (scalar rounds without FMA). The 16-bit copy
// of an update of >= 2^23 elements is stored non-temporally (it would not stay
// in cache for its reader anyway); smaller ones use normal stores. Throws Error(kBadArgument) for an unsupported
// ISA or dtype, or null buffers with numel > 0.
void adam_step(const AdamCoefficients& coeffs, const AdamBuffers& buffers,
               std::optional<CpuIsa> isa = std::nullopt, int threads = 0);

// Sum of squares of a gradient (accumulated in double) and whether every
// element is finite — one read of the gradient gives both the clipping norm
// and fp16 overflow detection. `scale` multiplies each element first. isa
// nullopt: STRATA_ISA, else the widest supported — never a timed choice, since
// the sum's rounding depends on the ISA.
struct GradStats {
  double sum_sq = 0;
  bool finite = true;
  double norm() const;
};
GradStats grad_stats(const void* grad, DType grad_dtype, size_t numel, float scale = 1.0f,
                     std::optional<CpuIsa> isa = std::nullopt, int threads = 0);
// Merges stats of several shards (or ranks, after an allreduce of sum_sq).
GradStats merge(const GradStats& a, const GradStats& b);

// The factor to pass as grad_scale: 1/loss_scale, times max_norm/norm when the
// unscaled norm exceeds max_norm (max_norm <= 0 disables clipping). Uses
// PyTorch's clip_grad_norm_ rule: coef = max_norm / (norm + 1e-6), capped at 1.
// `stats` are of the scaled gradients (as stored); returns 0 when not finite.
float combined_grad_scale(const GradStats& stats, float loss_scale, float max_norm);

// In-place grad *= factor (when the gradient must be unscaled on its own, e.g.
// before accumulation). Prefer folding the factor into adam_step.
void scale_inplace(void* grad, DType grad_dtype, size_t numel, float factor, int threads = 0);

}  // namespace strata::kernels
