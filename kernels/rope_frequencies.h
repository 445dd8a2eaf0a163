// The rotary embedding's frequencies as Hugging Face transformers computes
// them for each supported rope_type (modeling_rope_utils: the default
// inverse frequencies theta^(-2i/d), "linear" scaling, and Llama 3.1's
// "llama3" frequency-dependent scaling), in double. Every RoPE kernel (cpu
// reference and fast path, cuda) takes its angles from rope_inv_freq, so the
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
};

struct Rope {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;              // linear, llama3
  double low_freq_factor = 1.0;     // llama3
  double high_freq_factor = 4.0;    // llama3
  double original_max_position_embeddings = 8192.0;  // llama3: the pre-training context
};

// The inverse frequency of rotation pair i (0 <= i < head_dim / 2).
STRATA_HOST_DEVICE inline double rope_inv_freq(const Rope& rope, int64_t i, int64_t head_dim) {
  const double inv = 1.0 / pow(rope.theta, 2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  if (rope.type == RopeType::kLinear) return inv / rope.factor;
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
