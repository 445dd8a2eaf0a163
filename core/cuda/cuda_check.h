// Result checks for the CUDA runtime, cuBLAS and NCCL: each throws
// strata::Error(kCuda) with the library's own error text and `what` was being done.
// Only compiled into CUDA builds.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string_view>

namespace strata {

void check_cuda(cudaError_t result, std::string_view what);
void check_cublas(cublasStatus_t result, std::string_view what);
void check_nccl(ncclResult_t result, std::string_view what);

}  // namespace strata

#define STRATA_CUDA_CHECK(expr) ::strata::check_cuda((expr), #expr)
#define STRATA_CUBLAS_CHECK(expr) ::strata::check_cublas((expr), #expr)
#define STRATA_NCCL_CHECK(expr) ::strata::check_nccl((expr), #expr)
