// The CUDA backend entry points for builds without CUDA (STRATA_CUDA=OFF or no
// toolkit): they report the absence instead of failing to link.
#include "core/accelerator.h"
#include "core/error.h"

namespace strata {

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }

CudaInfo cuda_info() {
  CudaInfo info;
  info.error = "built without CUDA";
  return info;
}

std::unique_ptr<Accelerator> make_cuda_accelerator(int device_index, const AcceleratorOptions&) {
  raise(ErrorCategory::kCuda,
        "cuda:{} requested but this strata build has no CUDA backend (configure with "
        "-DSTRATA_CUDA=ON and the toolkit at /usr/local/cuda)",
        device_index);
}

}  // namespace strata
