// dtype conversions, exhaustively over all 65536 16-bit patterns: exact
// widening, identity round trips, NaN/Inf kept, ties rounded to even.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"

using namespace strata;

namespace {

bool is_nan_bf16(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }
bool is_nan_half(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

// Reference rounding: the representable 16-bit value nearest to x (in double),
// ties to the even bit pattern. `values` holds every finite pattern's value.
template <typename ToFloat>
uint16_t reference_round(double x, ToFloat to_float, uint16_t lower_bits, uint16_t upper_bits) {
  const double lo = to_float(lower_bits), hi = to_float(upper_bits);
  const double dlo = std::fabs(x - lo), dhi = std::fabs(hi - x);
  if (dlo < dhi) return lower_bits;
  if (dhi < dlo) return upper_bits;
  return (lower_bits & 1) == 0 ? lower_bits : upper_bits;
}

}  // namespace

TEST_CASE("bf16: every pattern widens exactly and round-trips", "[dtype]") {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const uint16_t b = static_cast<uint16_t>(bits);
    const float f = bf16_to_float(BFloat16{b});
    const uint16_t back = float_to_bf16(f).bits;
    if (is_nan_bf16(b)) {
      REQUIRE(std::isnan(f));
      REQUIRE(is_nan_bf16(back));
      REQUIRE((back & 0x8000) == (b & 0x8000));  // sign kept
    } else {
      REQUIRE(back == b);
    }
  }
}

TEST_CASE("fp16: every pattern widens exactly and round-trips", "[dtype]") {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = half_to_float(Half{h});
    const uint16_t back = float_to_half(f).bits;
    if (is_nan_half(h)) {
      REQUIRE(std::isnan(f));
      REQUIRE(is_nan_half(back));
      REQUIRE((back & 0x8000) == (h & 0x8000));
    } else {
      REQUIRE(back == h);
      if ((h & 0x7c00) == 0x7c00) REQUIRE(std::isinf(f));
    }
  }
}

TEST_CASE("bf16: midpoints and quarter points round to nearest even", "[dtype]") {
  auto to_float = [](uint16_t b) { return static_cast<double>(bf16_to_float(BFloat16{b})); };
  // Consecutive finite positive and negative patterns: b and b+1 are neighbours in magnitude.
  for (uint32_t sign : {0u, 0x8000u}) {
    for (uint32_t m = 0; m < 0x7f80; ++m) {
      const uint16_t lo = static_cast<uint16_t>(sign | m), hi = static_cast<uint16_t>(sign | (m + 1));
      for (double t : {0.25, 0.5, 0.75}) {
        const double x = to_float(lo) + t * (to_float(hi) - to_float(lo));
        const float xf = static_cast<float>(x);
        REQUIRE(static_cast<double>(xf) == x);  // representable in fp32
        REQUIRE(float_to_bf16(xf).bits == reference_round(x, to_float, lo, hi));
      }
    }
  }
}

TEST_CASE("fp16: midpoints and quarter points round to nearest even", "[dtype]") {
  auto to_float = [](uint16_t h) { return static_cast<double>(half_to_float(Half{h})); };
  for (uint32_t sign : {0u, 0x8000u}) {
    for (uint32_t m = 0; m < 0x7c00; ++m) {
      const uint16_t lo = static_cast<uint16_t>(sign | m), hi = static_cast<uint16_t>(sign | (m + 1));
      for (double t : {0.25, 0.5, 0.75}) {
        const double x = to_float(lo) + t * (to_float(hi) - to_float(lo));
        const float xf = static_cast<float>(x);
        REQUIRE(static_cast<double>(xf) == x);
        const uint16_t expected = (m + 1 == 0x7c00 && t == 0.5)
                                      ? static_cast<uint16_t>(sign | 0x7c00)  // 65520 ties to Inf
                                      : reference_round(x, to_float, lo, hi);
        REQUIRE(float_to_half(xf).bits == expected);
      }
    }
  }
}

TEST_CASE("overflow, infinities and NaN from fp32", "[dtype]") {
  REQUIRE(float_to_half(65504.0f).bits == 0x7bff);
  REQUIRE(float_to_half(65519.99f).bits == 0x7bff);
  REQUIRE(float_to_half(65520.0f).bits == 0x7c00);
  REQUIRE(float_to_half(-1e10f).bits == 0xfc00);
  REQUIRE(float_to_half(INFINITY).bits == 0x7c00);
  REQUIRE(is_nan_half(float_to_half(NAN).bits));
  REQUIRE(float_to_bf16(3.4e38f).bits == 0x7f80);  // rounds up past the largest bf16
  REQUIRE(float_to_bf16(-INFINITY).bits == 0xff80);
  REQUIRE(is_nan_bf16(float_to_bf16(std::bit_cast<float>(0x7f800001u)).bits));  // low-payload sNaN stays NaN
  REQUIRE(float_to_half(1e-8f).bits == 0x0000);   // below half the smallest subnormal
  REQUIRE(float_to_half(6e-8f).bits == 0x0001);   // nearest the smallest subnormal 5.96e-8
}

TEST_CASE("bulk convert matches the scalar conversions", "[dtype]") {
  std::vector<float> src(1000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = std::sin(static_cast<float>(i)) * 1000.0f;
  std::vector<BFloat16> bf(src.size());
  std::vector<Half> hf(src.size());
  convert(src.data(), DType::kF32, bf.data(), DType::kBF16, src.size());
  convert(bf.data(), DType::kBF16, hf.data(), DType::kF16, src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    REQUIRE(bf[i].bits == float_to_bf16(src[i]).bits);
    REQUIRE(hf[i].bits == float_to_half(bf16_to_float(bf[i])).bits);
  }
  REQUIRE(parse_dtype("bfloat16") == DType::kBF16);
  REQUIRE_THROWS_WITH(parse_dtype("int8"), Catch::Contains("unknown dtype \"int8\""));
}
