// CPU residual add (out = a + b); its backward is the identity, so the
// modules pass the gradient through to both branches without a kernel.
#include "kernels/cpu/nn_gemm.h"
#include "kernels/nn_ops.h"

namespace strata::nn::cpu {

template <typename T>
void add(const T* a, const T* b, int64_t numel, T* out) {
#pragma omp parallel for schedule(static) if (numel >= detail::kMinParallelWork)
  for (int64_t i = 0; i < numel; ++i) out[i] = a[i] + b[i];
}

template void add<float>(const float*, const float*, int64_t, float*);
template void add<double>(const double*, const double*, int64_t, double*);

}  // namespace strata::nn::cpu
