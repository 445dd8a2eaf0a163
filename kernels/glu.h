// The activations of a gated MLP (Ops::swiglu_forward): which one, and the
// one formula of gpt-oss's clamped SwiGLU that the cpu and cuda kernels
// compute (silu and gelu-tanh live with their kernels).
//
// Header-only and usable in device code (nvcc, C++17). Thread-safety: value types.
#pragma once

#include <cmath>

#include "kernels/attention_mask.h"  // STRATA_HOST_DEVICE

namespace strata::ops {

// silu (SwiGLU), gelu's tanh approximation (GeGLU, transformers'
// gelu_pytorch_tanh) or gpt-oss's clamped SwiGLU (GluClamp).
enum class GluActivation { kSilu, kGeluTanh, kClampedSwiglu };

// gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate):
// g = min(gate, limit), u = clamp(up, -limit, limit), out = (u + 1) g
// sigmoid(alpha g). Its gradient passes the clamps where torch.clamp's does
// (gate <= limit; -limit <= up <= limit), zero elsewhere.
struct GluClamp {
  float alpha = 1.702f;  // swiglu_alpha
  float limit = 7.0f;    // swiglu_limit
};

STRATA_HOST_DEVICE inline float clamped_swiglu(float gate, float up, const GluClamp& c) {
  const float g = gate > c.limit ? c.limit : gate;
  const float u = up > c.limit ? c.limit : (up < -c.limit ? -c.limit : up);
  return (u + 1.0f) * g / (1.0f + expf(-c.alpha * g));
}

// d out / d gate and d out / d up, times d.
STRATA_HOST_DEVICE inline void clamped_swiglu_backward(float d, float gate, float up, const GluClamp& c,
                                                       float* dgate, float* dup) {
  const float g = gate > c.limit ? c.limit : gate;
  const float u = up > c.limit ? c.limit : (up < -c.limit ? -c.limit : up);
  const float s = 1.0f / (1.0f + expf(-c.alpha * g));
  *dgate = gate <= c.limit ? d * (u + 1.0f) * s * (1.0f + c.alpha * g * (1.0f - s)) : 0.0f;
  *dup = up >= -c.limit && up <= c.limit ? d * g * s : 0.0f;
}

}  // namespace strata::ops
