// make_cuda_ops in builds without CUDA: the cuda Ops cannot exist.
#include "kernels/ops.h"
#include "runtime/core/error.h"

namespace strata::ops {

std::unique_ptr<Ops> make_cuda_ops(Accelerator& /*accelerator*/) {
  raise(ErrorCategory::kCuda, "this build of strata has no CUDA support (cuda Ops requested)");
}

}  // namespace strata::ops
