// Backend-independent parts of the accelerator layer and the one place that
// chooses a backend.
#include "core/accelerator.h"

#include <cstdlib>

#include "core/error.h"

namespace strata {

std::string_view backend_name(Backend backend) {
  return backend == Backend::kCuda ? "cuda" : "cpu";
}

Tensor Accelerator::allocate_tensor(DType dtype, Shape shape) {
  TensorDesc desc{dtype, std::move(shape), Tier::kDevice};
  void* data = allocate(desc.nbytes());
  return Tensor(std::move(desc), data, [this](void* p) { deallocate(p); });
}

std::unique_ptr<Accelerator> make_accelerator(std::string_view kind,
                                              const AcceleratorOptions& options) {
  if (kind == "cpu") return make_cpu_accelerator(options);
  const char* local_rank = std::getenv("LOCAL_RANK");
  const int device = local_rank ? std::atoi(local_rank) : 0;
  if (kind == "cuda") return make_cuda_accelerator(device, options);
  if (kind == "auto") {
    return cuda_device_count() > 0 ? make_cuda_accelerator(device % cuda_device_count(), options)
                                   : make_cpu_accelerator(options);
  }
  raise(ErrorCategory::kBadArgument, "unknown accelerator \"{}\" (expected cpu, cuda or auto)", kind);
}

}  // namespace strata
