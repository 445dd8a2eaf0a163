// The measured tensor-core peak that model FLOP utilisation is reported
// against: the bench tools time a large cuBLAS bf16 GEMM in the same run as
// the model, so MFU compares like with like (same GPU, clocks and cuBLAS).
#pragma once

#include <cstdint>

#include "core/accelerator.h"

namespace strata::ops {

// TFLOP/s of C[m, n] = A[m, k] B[k, n] in bf16 with fp32 accumulation
// (cublasGemmEx, CUBLAS_COMPUTE_32F) on `accelerator`'s device, on random
// operands (as a model's are; constant ones overstate the peak): the median
// of `iters` timed runs (CUDA events) after two untimed ones. Blocks until done.
// Scratch comes from the accelerator (2 (mk + kn + mn) bytes). Error(kCuda) in
// builds without CUDA or on a non-cuda accelerator; Error(kBadArgument) for
// non-positive sizes or iters.
double measure_bf16_gemm_tflops(Accelerator& accelerator, int64_t m, int64_t n, int64_t k,
                                int iters);

}  // namespace strata::ops
