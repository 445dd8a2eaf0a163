// CPU Linear (y = scale * x W^T + b) forward and backward over cblas GEMMs, with row
// strides so TiledLinear can address column blocks of its input and output.
#include "kernels/cpu/nn_gemm.h"
#include "kernels/nn_ops.h"
#include "core/error.h"

namespace strata::nn::cpu {

template <typename T>
void linear_forward(const T* x, int64_t ldx, const T* w, const T* bias, int64_t rows, int64_t in,
                    int64_t out, T* y, int64_t ldy, bool accumulate, T scale) {
  STRATA_CHECK(rows >= 0 && in > 0 && out > 0 && ldx >= in && ldy >= out, kBadArgument,
               "linear: bad shape rows={} in={} out={} ldx={} ldy={}", rows, in, out, ldx, ldy);
  if (rows == 0) return;
  detail::gemm<T>(false, true, rows, out, in, scale, x, ldx, w, in, accumulate ? T(1) : T(0), y,
                  ldy);
  if (bias != nullptr) {
#pragma omp parallel for schedule(static) if (rows * out >= detail::kMinParallelWork)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < out; ++c) y[r * ldy + c] += bias[c];
    }
  }
}

template <typename T>
void linear_backward(const T* dy, int64_t ldy, const T* x, int64_t ldx, const T* w, int64_t rows,
                     int64_t in, int64_t out, T* dx, int64_t lddx, bool accumulate_dx, T* dw,
                     T* dbias, T scale) {
  STRATA_CHECK(
      rows >= 0 && in > 0 && out > 0 && ldx >= in && ldy >= out && (dx == nullptr || lddx >= in),
      kBadArgument, "linear backward: bad shape rows={} in={} out={} ldx={} ldy={} lddx={}", rows,
      in, out, ldx, ldy, lddx);
  if (rows == 0) return;
  if (dx != nullptr) {
    detail::gemm<T>(false, false, rows, in, out, scale, dy, ldy, w, in, accumulate_dx ? T(1) : T(0),
                    dx, lddx);
  }
  if (dw != nullptr)
    detail::gemm<T>(true, false, out, in, rows, scale, dy, ldy, x, ldx, T(1), dw, in);
  if (dbias != nullptr) {
#pragma omp parallel for schedule(static) if (rows * out >= detail::kMinParallelWork)
    for (int64_t c = 0; c < out; ++c) {
      T acc = 0;
      for (int64_t r = 0; r < rows; ++r) acc += dy[r * ldy + c];
      dbias[c] += acc;
    }
  }
}

template void linear_forward<float>(const float*, int64_t, const float*, const float*, int64_t,
                                    int64_t, int64_t, float*, int64_t, bool, float);
template void linear_forward<double>(const double*, int64_t, const double*, const double*, int64_t,
                                     int64_t, int64_t, double*, int64_t, bool, double);
template void linear_backward<float>(const float*, int64_t, const float*, int64_t, const float*,
                                     int64_t, int64_t, int64_t, float*, int64_t, bool, float*,
                                     float*, float);
template void linear_backward<double>(const double*, int64_t, const double*, int64_t, const double*,
                                      int64_t, int64_t, int64_t, double*, int64_t, bool, double*,
                                      double*, double);

}  // namespace strata::nn::cpu
