// Internal to kernels/cpu: row-major GEMM for float (cblas_sgemm) and double
// (cblas_dgemm) through OpenBLAS as strata loads it (blas.h), and the helpers
// the nn_* operator files share. Not a public header: it includes cblas.h,
// whose include path is private.
#pragma once

#include "kernels/cpu/blas.h"

#include <cstdint>

namespace strata::nn::cpu::detail {

// Below this many elements of work a loop runs on the calling thread: waking
// the OpenMP team costs more than the loop itself.
inline constexpr int64_t kMinParallelWork = int64_t{1} << 14;

// C[m, n] = alpha * op(A) op(B) + beta * C, row-major, op = transpose when the flag is set.
template <typename T>
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                 int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  if constexpr (sizeof(T) == sizeof(float)) {
    blas::api().sgemm(CblasRowMajor, ta, tb, static_cast<blasint>(m), static_cast<blasint>(n),
                static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
                static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
  } else {
    blas::api().dgemm(CblasRowMajor, ta, tb, static_cast<blasint>(m), static_cast<blasint>(n),
                static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
                static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
  }
}

}  // namespace strata::nn::cpu::detail
