// make_cuda_ops and measure_bf16_gemm_tflops in builds without CUDA.
#include "kernels/cuda_peak.h"
#include "kernels/ops.h"
#include "core/error.h"

namespace strata::ops {

std::unique_ptr<Ops> make_cuda_ops(Accelerator& /*accelerator*/) {
  raise(ErrorCategory::kCuda, "this build of strata has no CUDA support (cuda Ops requested)");
}

double measure_bf16_gemm_tflops(Accelerator& /*accelerator*/, int64_t /*m*/, int64_t /*n*/,
                                int64_t /*k*/, int /*iters*/) {
  raise(ErrorCategory::kCuda,
        "measure_bf16_gemm_tflops: this build of strata has no CUDA support");
}

}  // namespace strata::ops
