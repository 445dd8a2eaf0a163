// make_nccl_communicator in builds without CUDA: the one place that says so.
#include "partition/communicator.h"
#include "core/error.h"

namespace strata::partition {
std::unique_ptr<Communicator> make_nccl_communicator(Accelerator&, StoreClient&, const CommunicatorOptions&) {
  raise(ErrorCategory::kCuda, "NCCL communicator requested, but strata was built without CUDA");
}
}  // namespace strata::partition
