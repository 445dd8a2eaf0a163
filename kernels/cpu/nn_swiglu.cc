// CPU SwiGLU gate (silu(gate) * up) forward and backward.
#include <cmath>

#include "kernels/cpu/nn_gemm.h"
#include "kernels/nn_ops.h"

namespace strata::nn::cpu {

template <typename T>
void swiglu_forward(const T* gate, const T* up, int64_t numel, T* out) {
#pragma omp parallel for schedule(static) if (numel >= detail::kMinParallelWork)
  for (int64_t i = 0; i < numel; ++i) {
    const T g = gate[i];
    const T sig = T(1) / (T(1) + std::exp(-g));
    out[i] = g * sig * up[i];
  }
}

template <typename T>
void swiglu_backward(const T* dout, const T* gate, const T* up, int64_t numel, T* dgate, T* dup) {
  // d silu(g)/dg = s * (1 + g * (1 - s)), s = sigmoid(g).
#pragma omp parallel for schedule(static) if (numel >= detail::kMinParallelWork)
  for (int64_t i = 0; i < numel; ++i) {
    const T g = gate[i];
    const T sig = T(1) / (T(1) + std::exp(-g));
    const T silu = g * sig;
    dgate[i] = dout[i] * up[i] * sig * (T(1) + g * (T(1) - sig));
    dup[i] = dout[i] * silu;
  }
}

template void swiglu_forward<float>(const float*, const float*, int64_t, float*);
template void swiglu_forward<double>(const double*, const double*, int64_t, double*);
template void swiglu_backward<float>(const float*, const float*, const float*, int64_t, float*,
                                     float*);
template void swiglu_backward<double>(const double*, const double*, const double*, int64_t, double*,
                                      double*);

}  // namespace strata::nn::cpu
