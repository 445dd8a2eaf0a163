// ds_config → ZeroEngineOptions (runtime/train/zero_config.cc): where each
// offload_optimizer.device puts the optimizer, and the combination that
// cannot work is refused naming the file and the keys.
#include <catch2/catch.hpp>

#include <string>

#include "runtime/config/config.h"
#include "core/error.h"
#include "runtime/train/zero_config.h"

using namespace strata;

namespace {

engine::ZeroEngineOptions options_of(const std::string& param, const std::string& optimizer) {
  const std::string text = R"({"zero_optimization": {"stage": 3, "offload_param": {"device": ")" + param +
                           R"(", "nvme_path": "/tmp/swap"}, "offload_optimizer": {"device": ")" + optimizer +
                           R"(", "nvme_path": "/tmp/swap"}}})";
  return train::zero_engine_options(parse_config_text(text, "ds.json"), "ds.json");
}

}  // namespace

TEST_CASE("offload_optimizer.device none keeps the optimizer on the accelerator, cpu and nvme offload it",
          "[train][config]") {
  const auto none = options_of("none", "none");
  CHECK(none.optimizer_tier == Tier::kDevice);
  CHECK(none.grad_tier == Tier::kDevice);
  const auto cpu = options_of("cpu", "cpu");
  CHECK(cpu.optimizer_tier == Tier::kCpu);
  CHECK(cpu.grad_tier == Tier::kDevice);
  const auto nvme = options_of("nvme", "nvme");
  CHECK(nvme.optimizer_tier == Tier::kNvme);
  CHECK(nvme.grad_tier == Tier::kNvme);
  CHECK(options_of("none", "cpu").optimizer_tier == Tier::kCpu);
}

TEST_CASE("offloaded parameters with the optimizer on the accelerator are refused naming the file and keys",
          "[train][config]") {
  for (const std::string param : {"cpu", "nvme"}) {
    CAPTURE(param);
    CHECK_THROWS_WITH(options_of(param, "none"),
                      Catch::Contains("ds.json") && Catch::Contains("offload_param.device is \"" + param + "\"") &&
                          Catch::Contains("offload_optimizer.device \"cpu\" or \"nvme\""));
  }
}
