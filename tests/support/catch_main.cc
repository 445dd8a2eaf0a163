// Shared Catch2 main (Catch2 itself is in catch_session.cc). Binaries built
// with STRATA_TEST_REQUIRES_GPU exit 77 (reported by CTest as SKIPPED) when no
// CUDA device is present, except when asked only to list their tests.
#include <cstdio>
#include <cstring>

#include "core/accelerator.h"
#include "tests/support/catch_session.h"

int main(int argc, char** argv) {
#ifdef STRATA_TEST_REQUIRES_GPU
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing |= std::strncmp(argv[i], "--list", 6) == 0;
  if (!listing && strata::cuda_device_count() == 0) {
    std::printf("SKIPPED: no CUDA device present (%s)\n",
                strata::cuda_built() ? "CUDA backend built" : "built without CUDA");
    return 77;
  }
#endif
  return strata::test::run_catch_session(argc, argv);
}
