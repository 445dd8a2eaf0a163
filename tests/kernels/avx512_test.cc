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
