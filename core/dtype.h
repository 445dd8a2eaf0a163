// Element types and conversions between them. Parameters, gradients and
// activations are stored as fp32, fp16 or bf16 (the "float" types); int32
// (token ids, targets, positions) and fp64 (loss sums, token counts, norms) are
// for indices and accumulators only. Float conversions
// to 16 bits round to nearest, ties to even, keep Inf, and keep NaN a NaN
// (signalling NaNs come back quiet). Header-only scalar versions so hot loops
// in kernels/ can inline them; bulk conversion lives in dtype.cc.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace strata {

enum class DType : uint8_t { kF32, kF16, kBF16, kI32, kF64 };

// Bytes per element.
constexpr size_t dtype_nbytes(DType dtype) {
  switch (dtype) {
    case DType::kF16:
    case DType::kBF16: return 2;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kF64: return 8;
  }
  return 0;
}
// fp32, fp16 or bf16: a type parameters and activations may be stored in.
constexpr bool is_float_storage(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

std::string_view dtype_name(DType dtype);  // "fp32", "fp16", "bf16", "int32", "fp64"
// Parses the float storage types "fp32"/"float32", "fp16"/"float16",
// "bf16"/"bfloat16"; throws Error(kBadArgument) for anything else.
DType parse_dtype(std::string_view name);

// IEEE binary16 and bfloat16, stored as their bit patterns.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float bf16_to_float(BFloat16 value) {
  return std::bit_cast<float>(static_cast<uint32_t>(value.bits) << 16);
}

inline BFloat16 float_to_bf16(float value) {
  uint32_t x = std::bit_cast<uint32_t>(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return BFloat16{static_cast<uint16_t>((x >> 16) | 0x40u)};  // NaN: keep sign/payload, make quiet
  }
  x += 0x7fffu + ((x >> 16) & 1u);  // round to nearest even; overflow carries into Inf
  return BFloat16{static_cast<uint16_t>(x >> 16)};
}

inline float half_to_float(Half value) {
  const uint32_t sign = static_cast<uint32_t>(value.bits & 0x8000u) << 16;
  const uint32_t exponent = (value.bits >> 10) & 0x1fu;
  const uint32_t mantissa = value.bits & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in float.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(magnitude));
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline Half float_to_half(float value) {
  uint32_t x = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {  // Inf or NaN
    if (x > 0x7f800000u) return Half{static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu))};
    return Half{static_cast<uint16_t>(sign | 0x7c00u)};
  }
  if (x >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520 rounds to Inf
  if (x < 0x38800000u) {
    // Below 2^-14 the result is subnormal: adding 0.5f puts the half ulp (2^-24)
    // at the float ulp, so the FPU's own round-to-nearest-even does the rounding.
    const float shifted = std::bit_cast<float>(x) + 0.5f;
    return Half{static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(shifted) - 0x3f000000u))};
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to even.
  x += 0xc8000fffu + ((x >> 13) & 1u);
  return Half{static_cast<uint16_t>(sign | (x >> 13))};
}

// Element i of src (of `dtype`) as a float; bf16 and fp16 widen exactly.
inline float load_as_float(const void* src, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(src)[i];
    case DType::kF16: return half_to_float(static_cast<const Half*>(src)[i]);
    case DType::kBF16: return bf16_to_float(static_cast<const BFloat16*>(src)[i]);
    case DType::kI32: return static_cast<float>(static_cast<const int32_t*>(src)[i]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(src)[i]);
  }
  return 0.0f;
}
// Stores value as element i of dst (of `dtype`), rounding to nearest even.
inline void store_from_float(void* dst, DType dtype, size_t i, float value) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(dst)[i] = value; break;
    case DType::kF16: static_cast<Half*>(dst)[i] = float_to_half(value); break;
    case DType::kBF16: static_cast<BFloat16*>(dst)[i] = float_to_bf16(value); break;
    case DType::kI32: static_cast<int32_t*>(dst)[i] = static_cast<int32_t>(value); break;
    case DType::kF64: static_cast<double*>(dst)[i] = value; break;
  }
}

// Converts numel elements from src (of src_dtype) to dst (of dst_dtype).
// Same dtype is a copy. Between different dtypes both must be float storage
// types (Error(kBadArgument) otherwise). src and dst must not overlap.
void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t numel);

}  // namespace strata
