// Element types and conversions between them. Parameters, gradients and
// activations are stored as fp32, fp16 or bf16 (the "float" types); int32
// (token ids, targets, positions) and fp64 (loss sums, token counts, norms) are
// for indices and accumulators only; fp8 e4m3 (torch's float8_e4m3fn) and
// uint8 are the bytes of quantized checkpoints (FP8 weights, MXFP4 blocks and
// scales), read by runtime/nn/checkpoint_quant.h, never computed with. Float conversions
// to 16 bits round to nearest, ties to even, keep Inf, and keep NaN a NaN
// (signalling NaNs come back quiet). Header-only scalar versions so hot loops
// in kernels/ can inline them; bulk conversion lives in dtype.cc.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace strata {

enum class DType : uint8_t { kF32, kF16, kBF16, kI32, kF64, kF8E4M3, kU8 };

// Bytes per element.
constexpr size_t dtype_nbytes(DType dtype) {
  switch (dtype) {
    case DType::kF8E4M3:
    case DType::kU8: return 1;
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

std::string_view dtype_name(DType dtype);  // "fp32", "fp16", "bf16", "int32", "fp64", "fp8_e4m3", "uint8"
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

// torch's float8_e4m3fn (no infinities; S.1111.111 is NaN; max 448), as its
// bit pattern: every value widens to float exactly.
inline float fp8_e4m3_to_float(uint8_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80u) << 24;
  const uint32_t exponent = (bits >> 3) & 0xfu;
  const uint32_t mantissa = bits & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return std::bit_cast<float>(sign | 0x7fc00000u);
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-9 is exact in float.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-9f;
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(magnitude));
  }
  return std::bit_cast<float>(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// Rounds to nearest even as torch's float -> float8_e4m3fn does (torch
// 2.15, checked code for code by tests/nn/nn_quant_test.cc): magnitudes from
// 448 up, infinities included, saturate to +-448; NaN stays NaN.
inline uint8_t float_to_fp8_e4m3(float value) {
  uint32_t x = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);  // NaN
  if (x >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // >= 448, Inf: saturate
  if (x < 0x3c800000u) {
    // Below 2^-6 the result is subnormal (steps of 2^-9): adding 2^14, whose
    // float ulp is 2^-9, lets the FPU's round-to-nearest-even do the rounding.
    const float shifted = std::bit_cast<float>(x) + 0x1p14f;
    return static_cast<uint8_t>(sign | (std::bit_cast<uint32_t>(shifted) - 0x46800000u));
  }
  // Normal: rebias the exponent (127 -> 7) and round the 20 dropped bits to even.
  x += 0xc407ffffu + ((x >> 20) & 1u);
  return static_cast<uint8_t>(sign | ((x >> 20) & 0x7fu));
}

// Element i of src (of `dtype`) as a float; bf16, fp16 and fp8 widen exactly.
inline float load_as_float(const void* src, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(src)[i];
    case DType::kF16: return half_to_float(static_cast<const Half*>(src)[i]);
    case DType::kBF16: return bf16_to_float(static_cast<const BFloat16*>(src)[i]);
    case DType::kI32: return static_cast<float>(static_cast<const int32_t*>(src)[i]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(src)[i]);
    case DType::kF8E4M3: return fp8_e4m3_to_float(static_cast<const uint8_t*>(src)[i]);
    case DType::kU8: return static_cast<float>(static_cast<const uint8_t*>(src)[i]);
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
    case DType::kF8E4M3: static_cast<uint8_t*>(dst)[i] = float_to_fp8_e4m3(value); break;
    case DType::kU8: {
      // Saturates (and NaN is 0): a float outside [0, 255] has no uint8 value.
      const float clamped = value >= 255.0f ? 255.0f : value > 0.0f ? value : 0.0f;
      static_cast<uint8_t*>(dst)[i] = static_cast<uint8_t>(clamped + 0.5f);
      break;
    }
  }
}

// Converts numel elements from src (of src_dtype) to dst (of dst_dtype).
// Same dtype is a copy. Between different dtypes both must be float storage
// types (Error(kBadArgument) otherwise). src and dst must not overlap.
void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t numel);

}  // namespace strata
