// The rotary embedding's frequencies as Hugging Face transformers computes
// them for each supported rope_type (modeling_rope_utils: the default
// inverse frequencies theta^(-2i/d), "linear" scaling, Llama 3.1's "llama3"
// frequency-dependent scaling, and YaRN's blend of interpolated and
// extrapolated frequencies with its attention factor), in double. Every RoPE
// kernel (cpu reference and fast path, cuda) takes its angles from
// rope_inv_freq and scales cos and sin by rope_attention_scale, so each
// formula exists once.
//
// Header-only and usable in device code (nvcc, C++17). Thread-safety: a value type.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/attention_mask.h"  // STRATA_HOST_DEVICE

namespace strata::ops {

enum class RopeType : int32_t {
  kDefault = 0,  // inv_freq_i = theta^(-2i/head_dim)
  kLinear = 1,   // inv_freq_i / factor (positions interpolated by factor)
  kLlama3 = 2,   // Llama 3.1: low frequencies / factor, high kept, a smooth band between
  kYarn = 3,     // YaRN: low frequencies / factor, high kept, a linear ramp between; cos, sin x attention factor
};

struct Rope {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;              // linear, llama3, yarn
  double low_freq_factor = 1.0;     // llama3
  double high_freq_factor = 4.0;    // llama3
  double original_max_position_embeddings = 8192.0;  // llama3, yarn: the pre-training context
  // YaRN (transformers' names; 0 is "not given", as its `or` defaults read them).
  double beta_fast = 0.0;           // rotations where the ramp starts (extrapolation below); 0: 32
  double beta_slow = 0.0;           // rotations where it ends (interpolation above); 0: 1
  double mscale = 0.0;              // with mscale_all_dim: the attention factor's ratio
  double mscale_all_dim = 0.0;
  double attention_factor = 0.0;    // > 0: given, overriding the mscale formula
  bool truncate = true;             // the ramp's bounds rounded out to whole dimensions
  // The rotated part of each head: dims [rotary_offset, rotary_offset +
  // rotary_dim), the rest passes unchanged (transformers' partial rotary:
  // GLM-4.5's first half; DeepSeek's MLA: the qk_rope_head_dim dims after the
  // qk_nope_head_dim ones). rotary_dim 0: the head from rotary_offset on. The
  // frequencies are those of a rotary_dim-wide head (as transformers computes
  // them for the rotated dims).
  int64_t rotary_offset = 0;
  int64_t rotary_dim = 0;
  // DeepSeek's rope_interleave: pairs (2i, 2i + 1) of the rotated dims turn by
  // frequency i, where rotate_half turns (i, i + rotary_dim / 2). transformers
  // writes the turned pairs de-interleaved ([evens | odds]); in place they
  // stay where they were: a fixed permutation of the same values, applied to
  // q and k alike, so every q.k product -- all attention reads of them -- is
  // the same.
  bool interleaved = false;
};

// The width of the rotated part of a head_dim-wide head.
STRATA_HOST_DEVICE inline int64_t rope_rotary_dim(const Rope& rope, int64_t head_dim) {
  return rope.rotary_dim > 0 ? rope.rotary_dim : head_dim - rope.rotary_offset;
}

// The two dims of a head that rotation pair i (0 <= i < rope_rotary_dim / 2) turns.
STRATA_HOST_DEVICE inline void rope_pair(const Rope& rope, int64_t head_dim, int64_t i, int64_t* first,
                                         int64_t* second) {
  if (rope.interleaved) {
    *first = rope.rotary_offset + 2 * i;
    *second = *first + 1;
  } else {
    *first = rope.rotary_offset + i;
    *second = *first + rope_rotary_dim(rope, head_dim) / 2;
  }
}

// YaRN's get_mscale: 0.1 * mscale * ln(scale) + 1, or 1 when scale <= 1.
STRATA_HOST_DEVICE inline double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

// The factor cos and sin are multiplied by (transformers' attention_scaling):
// YaRN's attention factor, 1 for the other types. Scaling both q and k
// scales the attention logits by its square.
STRATA_HOST_DEVICE inline double rope_attention_scale(const Rope& rope) {
  if (rope.type != RopeType::kYarn) return 1.0;
  if (rope.attention_factor > 0) return rope.attention_factor;
  if (rope.mscale != 0 && rope.mscale_all_dim != 0) {
    return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim);
  }
  return yarn_mscale(rope.factor, 1.0);
}

// YaRN's find_correction_dim: the dimension whose wavelength turns
// `rotations` times over the original context.
STRATA_HOST_DEVICE inline double yarn_correction_dim(double rotations, double dim, double theta,
                                                     double original_context) {
  return dim * log(original_context / (rotations * 2.0 * 3.141592653589793)) / (2.0 * log(theta));
}

// The inverse frequency of rotation pair i (0 <= i < head_dim / 2).
STRATA_HOST_DEVICE inline double rope_inv_freq(const Rope& rope, int64_t i, int64_t head_dim) {
  const double inv = 1.0 / pow(rope.theta, 2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  if (rope.type == RopeType::kLinear) return inv / rope.factor;
  if (rope.type == RopeType::kYarn) {
    // transformers' _compute_yarn_parameters, term for term (beta_fast and
    // beta_slow 0 mean their defaults 32 and 1, as its `or` reads them).
    const double dim = static_cast<double>(head_dim);
    const double beta_fast = rope.beta_fast != 0 ? rope.beta_fast : 32.0;
    const double beta_slow = rope.beta_slow != 0 ? rope.beta_slow : 1.0;
    double low = yarn_correction_dim(beta_fast, dim, rope.theta, rope.original_max_position_embeddings);
    double high = yarn_correction_dim(beta_slow, dim, rope.theta, rope.original_max_position_embeddings);
    if (rope.truncate) {
      low = floor(low);
      high = ceil(high);
    }
    low = low > 0.0 ? low : 0.0;
    high = high < dim - 1.0 ? high : dim - 1.0;
    if (low == high) high += 0.001;  // a one-point ramp
    double ramp = (static_cast<double>(i) - low) / (high - low);
    ramp = ramp < 0.0 ? 0.0 : ramp > 1.0 ? 1.0 : ramp;
    const double extrapolation = 1.0 - ramp;  // transformers' inv_freq_extrapolation_factor
    return inv / rope.factor * (1.0 - extrapolation) + inv * extrapolation;
  }
  if (rope.type != RopeType::kLlama3) return inv;
  // transformers' _compute_llama3_parameters, term for term.
  const double old_context = rope.original_max_position_embeddings;
  const double low_freq_wavelen = old_context / rope.low_freq_factor;
  const double high_freq_wavelen = old_context / rope.high_freq_factor;
  const double wavelen = 2.0 * 3.141592653589793 / inv;
  if (wavelen < high_freq_wavelen) return inv;
  if (wavelen > low_freq_wavelen) return inv / rope.factor;
  const double smooth =
      (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
  return (1.0 - smooth) * inv / rope.factor + smooth * inv;
}

}  // namespace strata::ops
