// The fp16 loss scaler against trajectories of DeepSpeed's DynamicLossScaler
// (tests/data/golden/loss_scale.json, written by scripts/make-golden-loss-scale).
#include <catch2/catch.hpp>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "runtime/engine/loss_scaler.h"
#include "tests/support/test_paths.h"

using strata::engine::LossScaler;
using strata::engine::LossScalerOptions;

TEST_CASE("the dynamic loss scale follows DeepSpeed's, step for step, and gives up at the minimum",
          "[engine][fp16]") {
  std::ifstream in(strata::test::source_dir() + "/tests/data/golden/loss_scale.json");
  REQUIRE(in.good());
  const auto golden = nlohmann::json::parse(in);
  REQUIRE(golden["cases"].size() >= 5);
  int raised = 0;
  for (const auto& c : golden["cases"]) {
    LossScalerOptions o;
    o.initial_scale_power = c["initial_scale_power"];
    o.window = c["loss_scale_window"];
    o.hysteresis = c["hysteresis"];
    o.min_scale = c["min_loss_scale"];
    o.consecutive_hysteresis = c["consecutive_hysteresis"];
    LossScaler scaler(o);
    const auto& flags = c["overflow"];
    const auto& scales = c["scale_after"];
    CAPTURE(o.initial_scale_power, o.window, o.hysteresis, o.min_scale);
    for (size_t step = 0; step < scales.size(); ++step) {
      CAPTURE(step);
      scaler.update(flags[step].get<bool>());
      REQUIRE(scaler.scale() == scales[step].get<double>());
    }
    if (!c["raises_at"].is_null()) {
      ++raised;
      CHECK_THROWS_WITH(scaler.update(flags[scales.size()].get<bool>()), Catch::Contains("minimum loss scale"));
    }
  }
  CHECK(raised >= 1);  // the fixture reaches the minimum at least once
}

TEST_CASE("loss scaler: static scale, state round trip, bad options", "[engine][fp16]") {
  LossScaler fixed(LossScalerOptions{false, 128.0});
  fixed.update(true);
  fixed.update(false);
  CHECK(fixed.scale() == 128.0);

  LossScalerOptions o;
  o.initial_scale_power = 4;
  o.window = 2;
  LossScaler a(o);
  for (bool overflow : {false, true, true, false, false, false}) a.update(overflow);
  LossScaler b(o);
  b.restore(a.state());
  for (bool overflow : {false, false, true, false, false, false, false}) {
    a.update(overflow);
    b.update(overflow);
    CHECK(a.scale() == b.scale());
  }
  o.window = 0;
  CHECK_THROWS_WITH(LossScaler(o), Catch::Contains("fp16.loss_scale_window"));
  CHECK_THROWS_AS(LossScaler(LossScalerOptions{false, 0.0}), strata::Error);
}
