// The scalar reference of the CPU optimizer kernels: plain C++ per element,
// the ground truth every SIMD variant is tested against.
#include <cmath>
#include <cstdint>

#include "kernels/cpu/adam_impl.h"

namespace strata::kernels::detail {
namespace {

// The reference update of one element (PyTorch's order of operations; the
// SIMD variants use FMA where this multiplies and adds, hence the tolerances).
void adam_element(const AdamCoefficients& c, float& p, float& m, float& v, float g) {
  g = g * c.grad_scale + c.l2 * p;
  p = p * c.decay;
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * (g * g);
  const float denom = std::sqrt(v) * c.inv_bias2_sqrt + c.eps;
  p = p - c.step_size * (m / denom);
}

}  // namespace

void adam_range_scalar(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    adam_element(c, b.param[i], b.exp_avg[i], b.exp_avg_sq[i], load_as_float(b.grad, b.grad_dtype, i));
    if (b.param16 != nullptr) store_from_float(b.param16, b.param16_dtype, i, b.param[i]);
  }
}

bool stream_param16(const AdamBuffers& b, size_t alignment) {
  return b.param16 != nullptr && b.numel >= kStreamParam16MinNumel &&
         reinterpret_cast<uintptr_t>(b.param16) % alignment == 0;
}

double sum_sq_range_scalar(const void* grad, DType dtype, size_t begin, size_t end, float scale) {
  double sum = 0.0;
  for (size_t i = begin; i < end; ++i) {
    const double x = static_cast<double>(load_as_float(grad, dtype, i) * scale);
    sum += x * x;
  }
  return sum;
}

}  // namespace strata::kernels::detail
