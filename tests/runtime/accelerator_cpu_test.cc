// The accelerator contract on the cpu backend.
#include "tests/runtime/accelerator_contract.h"

STRATA_ACCELERATOR_CONTRACT_TESTS("cpu", strata::make_cpu_accelerator)

TEST_CASE("make_accelerator picks a backend by name", "[accelerator]") {
  REQUIRE(strata::make_accelerator("cpu")->backend() == strata::Backend::kCpu);
  REQUIRE_THROWS_WITH(strata::make_accelerator("tpu"), Catch::Contains("unknown accelerator \"tpu\""));
  if (strata::cuda_device_count() == 0) {
    REQUIRE(strata::make_accelerator("auto")->backend() == strata::Backend::kCpu);
    REQUIRE_THROWS_AS(strata::make_cuda_accelerator(0), strata::Error);
  }
}
