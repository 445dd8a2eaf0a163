// gpt-oss's clamped SwiGLU written out from transformers'
// GptOssExperts._apply_gate, in double, independently of kernels/glu.h: the
// reference the cpu and cuda ops tests hold the kernels to.
#pragma once

#include <algorithm>
#include <cmath>

namespace strata::test {

// out = (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha g'), g' = min(g, limit);
// dg, du: d out times d, zero where torch.clamp passes no gradient.
inline void clamped_swiglu_reference(double g, double u, double d, double alpha, double limit, double* out,
                                     double* dg, double* du) {
  const double gc = std::min(g, limit), uc = std::clamp(u, -limit, limit);
  const double sig = 1.0 / (1.0 + std::exp(-alpha * gc));
  *out = (uc + 1) * gc * sig;
  *dg = g <= limit ? d * (uc + 1) * (sig + gc * alpha * sig * (1 - sig)) : 0.0;
  *du = u >= -limit && u <= limit ? d * gc * sig : 0.0;
}

}  // namespace strata::test
