// Catch2 main of kernels_avx512_tests: exits 77 (CTest: SKIPPED) with a clear
// line when this CPU has no AVX-512, except when only listing tests. Catch2
// itself is in tests/support/catch_session.cc.
#include <cstdio>
#include <cstring>

#include "kernels/optimizer.h"
#include "core/cpu_features.h"
#include "tests/support/catch_session.h"

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing |= std::strncmp(argv[i], "--list", 6) == 0;
  if (!listing && !strata::kernels::isa_supported(strata::kernels::CpuIsa::kAvx512)) {
    std::printf("SKIPPED: this CPU (%s) has no AVX-512; the avx512 kernels were not run\n",
                strata::cpu_features().model.c_str());
    return 77;
  }
  return strata::test::run_catch_session(argc, argv);
}
