// Names and bulk conversion for strata::DType.
#include "core/dtype.h"

#include <cstring>

#include "core/error.h"

namespace strata {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "fp32";
    case DType::kF16: return "fp16";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "int32";
    case DType::kF64: return "fp64";
    case DType::kF8E4M3: return "fp8_e4m3";
    case DType::kU8: return "uint8";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  if (name == "fp32" || name == "float32" || name == "float") return DType::kF32;
  if (name == "fp16" || name == "float16" || name == "half") return DType::kF16;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  raise(ErrorCategory::kBadArgument, "unknown dtype \"{}\" (expected fp32, fp16 or bf16)", name);
}

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t numel) {
  if (numel == 0) return;  // src and dst may be null then (memcpy would not allow it)
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, numel * dtype_nbytes(src_dtype));
    return;
  }
  STRATA_CHECK(is_float_storage(src_dtype) && is_float_storage(dst_dtype), kBadArgument,
               "convert: {} -> {} is not a conversion between float storage types",
               dtype_name(src_dtype), dtype_name(dst_dtype));
  for (size_t i = 0; i < numel; ++i) store_from_float(dst, dst_dtype, i, load_as_float(src, src_dtype, i));
}

}  // namespace strata
