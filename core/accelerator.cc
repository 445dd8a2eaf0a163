// Backend-independent parts of the accelerator layer and the one place that
// chooses a backend.
#include "core/accelerator.h"

#include <algorithm>
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

std::unique_ptr<Stream> Accelerator::borrow_stream(void* /*native*/) {
  raise(ErrorCategory::kBadArgument,
        "the {} accelerator has no native streams to borrow (its streams are strata's own threads); pass no stream",
        backend_name(backend()));
}

namespace {

// An integer environment variable, or `fallback` when unset; anything but a
// whole number >= 0 is refused, naming the variable.
int env_count(const char* name, int fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr) return fallback;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  STRATA_CHECK(*text != '\0' && *end == '\0' && value >= 0 && value <= 1 << 20, kBadArgument,
               "{}=\"{}\" is not a whole number >= 0", name, text);
  return static_cast<int>(value);
}

}  // namespace

int rank_device(int local_rank, int local_world_size, int device_count) {
  if (local_world_size > device_count) {
    raise(ErrorCategory::kBadArgument,
          "{} local ranks (strata run -n {}) but this machine has {} GPU{}: a GPU accelerator (strata.accelerator "
          "auto or cuda) puts one rank on each GPU, and two ranks cannot share one. Run with -n {} (one rank per "
          "GPU), or set \"strata\": {{\"accelerator\": \"cpu\"}} in the config to run {} ranks on the CPU",
          local_world_size, local_world_size, device_count, device_count == 1 ? "" : "s", device_count,
          local_world_size);
  }
  STRATA_CHECK(local_rank >= 0 && local_rank < local_world_size, kBadArgument,
               "LOCAL_RANK {} is outside [0, LOCAL_WORLD_SIZE {})", local_rank, local_world_size);
  return local_rank;
}

std::unique_ptr<Accelerator> make_accelerator(std::string_view kind,
                                              const AcceleratorOptions& options) {
  if (kind == "cpu") return make_cpu_accelerator(options);
  if (kind != "cuda" && kind != "auto") {
    raise(ErrorCategory::kBadArgument, "unknown accelerator \"{}\" (expected cpu, cuda or auto)", kind);
  }
  // The same variables as partition::RankInfo::from_env: torchrun's when RANK
  // is set, else mpirun's; a process alone is local rank 0 of 1.
  const bool torchrun_style = std::getenv("RANK") != nullptr;
  const int rank = env_count(torchrun_style ? "RANK" : "OMPI_COMM_WORLD_RANK", 0);
  const int world_size = env_count(torchrun_style ? "WORLD_SIZE" : "OMPI_COMM_WORLD_SIZE", rank + 1);
  const int local_rank = env_count(torchrun_style ? "LOCAL_RANK" : "OMPI_COMM_WORLD_LOCAL_RANK", rank);
  const int local_world_size = env_count(torchrun_style ? "LOCAL_WORLD_SIZE" : "OMPI_COMM_WORLD_LOCAL_SIZE",
                                         std::max(world_size, local_rank + 1));
  const int device_count = env_count("STRATA_TEST_CUDA_DEVICE_COUNT", cuda_device_count());
  if (kind == "auto" && device_count == 0) return make_cpu_accelerator(options);
  if (device_count == 0) return make_cuda_accelerator(local_rank, options);  // says why there is no device
  // A launcher that gives each rank its own GPU through CUDA_VISIBLE_DEVICES
  // (SLURM's --gpus-per-task=1) leaves each process one GPU: that one is its.
  if (device_count == 1 && std::getenv("CUDA_VISIBLE_DEVICES") != nullptr) return make_cuda_accelerator(0, options);
  return make_cuda_accelerator(rank_device(local_rank, local_world_size, device_count), options);
}

}  // namespace strata
