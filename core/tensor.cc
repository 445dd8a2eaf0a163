// Shape helpers and host tensors.
#include "core/tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace strata {

std::string_view tier_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kCpu: return "cpu";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

int64_t shape_numel(const Shape& shape) {
  int64_t numel = 1;
  for (int64_t dim : shape) {
    STRATA_CHECK(dim >= 0, kBadArgument, "negative dimension in shape {}", shape_string(shape));
    numel *= dim;
  }
  return numel;
}

std::string shape_string(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

Tensor Tensor::host(DType dtype, Shape shape) {
  TensorDesc desc{dtype, std::move(shape), Tier::kCpu};
  const size_t nbytes = desc.nbytes();
  // 64-byte alignment so SIMD kernels can use aligned loads on whole tensors.
  void* data = std::aligned_alloc(64, (nbytes + 63) / 64 * 64 + 64);
  if (data == nullptr) raise(ErrorCategory::kOutOfMemory, "host tensor of {} bytes", nbytes);
  std::memset(data, 0, nbytes);
  return Tensor(std::move(desc), data, [](void* p) { std::free(p); });
}

}  // namespace strata
