// Scalar versions of the vec_math helpers and the dispatch to AVX2.
#include "kernels/cpu/vec_math.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/cpu_features.h"

namespace strata::ops::vec {
namespace {

bool use_avx2() {
  static const bool avx2 = [] {
    const char* isa = std::getenv("STRATA_ISA");
    if (isa != nullptr && std::strcmp(isa, "scalar") == 0) return false;
    return cpu_features().avx2;
  }();
  return avx2;
}

}  // namespace

float max(const float* x, int64_t n) {
  if (use_avx2()) return detail::max_avx2(x, n);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

double exp_shifted(const float* x, int64_t n, float shift, float* out) {
  if (use_avx2()) return detail::exp_shifted_avx2(x, n, shift, out);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(x[i] - shift);
    if (out != nullptr) out[i] = e;
    sum += e;
  }
  return sum;
}

void scale(float* x, int64_t n, float f) {
  if (use_avx2()) return detail::scale_avx2(x, n, f);
  for (int64_t i = 0; i < n; ++i) x[i] *= f;
}

void axpy(float* y, const float* x, int64_t n, float a) {
  if (use_avx2()) return detail::axpy_avx2(y, x, n, a);
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  if (use_avx2()) return detail::swiglu_avx2(gate, up, n, out);
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void swiglu_backward(const float* dout, const float* gate, const float* up, int64_t n,
                     float* dgate, float* dup) {
  if (use_avx2()) return detail::swiglu_backward_avx2(dout, gate, up, n, dgate, dup);
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i], s = 1.0f / (1.0f + std::exp(-g));
    dgate[i] = dout[i] * up[i] * s * (1.0f + g * (1.0f - s));
    dup[i] = dout[i] * g * s;
  }
}

}  // namespace strata::ops::vec
