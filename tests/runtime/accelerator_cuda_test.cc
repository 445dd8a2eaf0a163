// The accelerator contract on the cuda backend (device 0). SKIPPED without a GPU.
#include "tests/runtime/accelerator_contract.h"

namespace {
std::unique_ptr<strata::Accelerator> make_cuda0(const strata::AcceleratorOptions& options) {
  return strata::make_cuda_accelerator(0, options);
}
}  // namespace

STRATA_ACCELERATOR_CONTRACT_TESTS("cuda", make_cuda0)
