// AVX-512 optimizer kernels against the scalar reference. This binary exits 77
// (CTest: SKIPPED) on CPUs without AVX-512, so a pass means it really ran.
#include <catch2/catch.hpp>

#include "tests/kernels/adam_checks.h"

using strata::kernels::CpuIsa;

TEST_CASE("avx512 Adam matches the scalar reference for every dtype mix and tail", "[kernels][adam][avx512]") {
  REQUIRE(strata::kernels::isa_supported(CpuIsa::kAvx512));
  strata::test::check_isa_against_scalar(CpuIsa::kAvx512);
}

TEST_CASE("avx512 gradient statistics match the scalar reference and find Inf/NaN", "[kernels][grad][avx512]") {
  REQUIRE(strata::kernels::isa_supported(CpuIsa::kAvx512));
  strata::test::check_grad_stats_against_scalar(CpuIsa::kAvx512);
}

TEST_CASE("avx2 and avx512 Adam are bit-identical for every dtype mix, tail and alignment", "[kernels][adam][avx512]") {
  REQUIRE(strata::kernels::isa_supported(CpuIsa::kAvx2));
  for (const size_t offset : {0, 1, 3}) {
    strata::test::check_isas_bit_identical(CpuIsa::kAvx512, CpuIsa::kAvx2, offset);
  }
}

TEST_CASE("updates large enough to stream the 16-bit copy write it right", "[kernels][adam][avx512]") {
  using namespace strata;
  // Just above the size whose copy is stored non-temporally, with a tail; the
  // copy 32-byte aligned (both kernels stream it then) and not.
  const size_t numel = (size_t{1} << 23) + 64 + 19;
  for (const DType copy_dtype : {DType::kBF16, DType::kF16}) {
    test::OptimState a = test::make_state(numel, 5), b = test::make_state(numel, 5);
    const auto grad = test::make_grad(numel, DType::kBF16, 6, 1.0f);
    const auto c = kernels::adam_coefficients({}, 1, 0.5f);
    const auto address = reinterpret_cast<uintptr_t>(a.param16.data());
    const size_t to_aligned = (32 - address % 32) % 32 / 2;
    for (const size_t skip : {to_aligned, to_aligned + 1}) {
      CAPTURE(dtype_name(copy_dtype), skip);
      for (auto [state, isa] : {std::pair{&a, CpuIsa::kAvx512}, std::pair{&b, CpuIsa::kAvx2}}) {
        auto buffers = test::buffers_of(*state, grad.data(), DType::kBF16, true, copy_dtype);
        buffers.param += skip;
        buffers.exp_avg += skip;
        buffers.exp_avg_sq += skip;
        buffers.grad = grad.data() + skip * 2;
        buffers.param16 = state->param16.data() + skip;
        buffers.numel = numel - skip;
        kernels::adam_step(c, buffers, isa);
      }
      // Double parentheses: a failure reports false instead of printing every element.
      REQUIRE((a.param == b.param));
      REQUIRE((a.param16 == b.param16));
      size_t bad = 0;
      for (size_t i = skip; i < numel; ++i) bad += a.param16[i] != test::round16(a.param[i], copy_dtype);
      REQUIRE(bad == 0);
    }
  }
}
