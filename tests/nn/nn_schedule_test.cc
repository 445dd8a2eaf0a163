// LrSchedule against DeepSpeed's own schedulers (fixture from
// scripts/make-golden-lr), and its config errors.
#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "runtime/engine/lr_schedule.h"
#include "tests/support/test_paths.h"

using namespace strata;
using strata::engine::LrSchedule;

TEST_CASE("lr schedules give DeepSpeed's rate for every update", "[engine][lr]") {
  std::ifstream in(strata::test::source_dir() + "/tests/data/golden/lr_schedules.json");
  REQUIRE(in.good());
  const auto golden = nlohmann::json::parse(in);
  const double base = golden.at("base_lr").get<double>();
  REQUIRE(golden.at("cases").size() >= 6);
  for (const auto& c : golden.at("cases")) {
    const LrSchedule s =
        LrSchedule::from_json({{"type", c.at("type")}, {"params", c.at("params")}}, base);
    const auto want = c.at("lr").get<std::vector<double>>();
    for (size_t k = 0; k < want.size(); ++k) {
      INFO(c.at("type").get<std::string>() << " " << c.at("params").dump() << " update " << k);
      CHECK(s.lr(static_cast<int64_t>(k)) == Approx(want[k]).epsilon(1e-12).margin(1e-15));
    }
  }
  CHECK(LrSchedule::from_json(nullptr, 0.01).lr(1000) == 0.01);
}

TEST_CASE("lr schedule config errors name the key", "[engine][lr]") {
  using J = nlohmann::json;
  REQUIRE_THROWS_WITH(LrSchedule::from_json(J{{"type", "OneCycle"}}, 1e-3),
                      Catch::Contains("scheduler.type") && Catch::Contains("OneCycle"));
  REQUIRE_THROWS_WITH(LrSchedule::from_json(J{{"type", "WarmupCosineLR"}}, 1e-3),
                      Catch::Contains("total_num_steps: required"));
  REQUIRE_THROWS_WITH(
      LrSchedule::from_json(J{{"type", "WarmupLR"}, {"params", {{"warmup_steps", 5}}}}, 1e-3),
      Catch::Contains("unknown key \"warmup_steps\""));
  REQUIRE_THROWS_WITH(
      LrSchedule::from_json(J{{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 0}}}}, 1e-3),
      Catch::Contains("warmup_num_steps: must be an integer >= 1"));
  REQUIRE_THROWS_WITH(
      LrSchedule::from_json(J{{"type", "WarmupLR"}, {"params", {{"warmup_type", "cubic"}}}}, 1e-3),
      Catch::Contains("warmup_type"));
}
