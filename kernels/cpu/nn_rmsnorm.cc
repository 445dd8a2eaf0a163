// CPU RMSNorm forward and backward; statistics accumulate in double.
#include <omp.h>

#include <cmath>
#include <vector>

#include "kernels/cpu/nn_gemm.h"
#include "kernels/nn_ops.h"

namespace strata::nn::cpu {

template <typename T>
void rmsnorm_forward(const T* x, const T* w, int64_t rows, int64_t dim, double eps, T* y, T* rstd) {
#pragma omp parallel for schedule(static) if (rows * dim >= detail::kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    double sum_sq = 0;
    for (int64_t c = 0; c < dim; ++c) sum_sq += static_cast<double>(xr[c]) * xr[c];
    const T s = static_cast<T>(1.0 / std::sqrt(sum_sq / static_cast<double>(dim) + eps));
    rstd[r] = s;
    T* yr = y + r * dim;
    for (int64_t c = 0; c < dim; ++c) yr[c] = xr[c] * s * w[c];
  }
}

template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const T* rstd, int64_t rows, int64_t dim,
                      T* dx, T* dw) {
  // dx = s * (g - x * s^2 * mean(g * x)), g = dy * w.
#pragma omp parallel for schedule(static) if (rows * dim >= detail::kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T* dyr = dy + r * dim;
    const double s = rstd[r];
    double dot = 0;
    for (int64_t c = 0; c < dim; ++c) dot += static_cast<double>(dyr[c]) * w[c] * xr[c];
    const double coef = s * s * dot / static_cast<double>(dim);
    T* dxr = dx + r * dim;
    for (int64_t c = 0; c < dim; ++c) {
      dxr[c] = static_cast<T>(s * (static_cast<double>(dyr[c]) * w[c] - xr[c] * coef));
    }
  }
  if (dw == nullptr) return;  // a frozen weight: no gradient wanted
  // Weight gradient: a column reduction. Each thread sums a block of rows
  // (reading rows contiguously, not columns with a stride of dim) into its own
  // partial, then the partials are added in thread order (deterministic).
  const int threads = rows * dim >= detail::kMinParallelWork ? omp_get_max_threads() : 1;
  std::vector<double> partial(static_cast<size_t>(threads * dim), 0.0);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    double* acc = partial.data() + static_cast<int64_t>(t) * dim;
    for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; ++r) {
      const double s = rstd[r];
      for (int64_t c = 0; c < dim; ++c)
        acc[c] += static_cast<double>(dy[r * dim + c]) * x[r * dim + c] * s;
    }
  }
  for (int64_t c = 0; c < dim; ++c) {
    double sum = 0;
    for (int t = 0; t < threads; ++t) sum += partial[static_cast<size_t>(t * dim + c)];
    dw[c] += static_cast<T>(sum);
  }
}

template void rmsnorm_forward<float>(const float*, const float*, int64_t, int64_t, double, float*,
                                     float*);
template void rmsnorm_forward<double>(const double*, const double*, int64_t, int64_t, double,
                                      double*, double*);
template void rmsnorm_backward<float>(const float*, const float*, const float*, const float*,
                                      int64_t, int64_t, float*, float*);
template void rmsnorm_backward<double>(const double*, const double*, const double*, const double*,
                                       int64_t, int64_t, double*, double*);

}  // namespace strata::nn::cpu
