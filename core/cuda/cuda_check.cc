// CUDA, cuBLAS and NCCL result checks.
#include "core/cuda/cuda_check.h"

#include "core/cuda/nccl_api.h"
#include "core/error.h"

namespace strata {

void check_cuda(cudaError_t result, std::string_view what) {
  if (result == cudaSuccess) return;
  raise(ErrorCategory::kCuda, "{}: {} ({})", what, cudaGetErrorString(result),
        cudaGetErrorName(result));
}

void check_cublas(cublasStatus_t result, std::string_view what) {
  if (result == CUBLAS_STATUS_SUCCESS) return;
  raise(ErrorCategory::kCuda, "{}: cuBLAS {} ({})", what, cublasGetStatusString(result),
        cublasGetStatusName(result));
}

void check_nccl(ncclResult_t result, std::string_view what) {
  if (result == ncclSuccess) return;
  raise(ErrorCategory::kCuda, "{}: NCCL {} (code {})", what, nccl::api().GetErrorString(result),
        static_cast<int>(result));
}

}  // namespace strata
