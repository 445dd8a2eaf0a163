// The ZeRO engine driven by hand (as an embedding trainer would): a step whose
// gradient is not finite on one rank changes nothing on any rank; hooks are
// checked; inconsistent options are refused with a message naming the option.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "runtime/engine/zero_engine.h"
#include "tests/engine/zero_rig.h"

namespace {
using namespace strata;
using engine::Engine;
using engine::Phase;

// One parameter "w" of 8 floats, read by one operator.
struct Manual {
  engine::ZeroEngine eng;
  engine::ParamId w;
  engine::OpId op;
  Manual(Accelerator& accelerator, engine::ZeroComms comms, engine::ZeroEngineOptions options)
      : eng(accelerator, comms, options) {
    w = eng.declare_parameter({"w", DType::kF32, {8}, std::nullopt});
    op = eng.declare_operator("op", {w});
    eng.finalize();
    eng.for_each_owned_range(w, Engine::Access::kWrite, [](int64_t first, const TensorView& host) {
      for (int64_t i = 0; i < host.numel(); ++i) host.as<float>()[i] = static_cast<float>(first + i + 1);
    });
  }
  // One backward pass that sets w's gradient to `value` everywhere.
  void backward(float value) {
    eng.pre_op(op, Phase::kBackward);
    TensorView g = eng.grad(w);
    eng.compute_stream().synchronize();
    for (int64_t i = 0; i < g.numel(); ++i) g.as<float>()[i] = value;  // cpu accelerator: host memory
    eng.post_op(op, Phase::kBackward);
  }
  std::vector<float> owned() {
    std::vector<float> values;
    eng.for_each_owned_range(w, Engine::Access::kRead, [&](int64_t, const TensorView& host) {
      values.assign(host.as<float>(), host.as<float>() + host.numel());
    });
    return values;
  }
};

engine::ZeroEngineOptions sgd_like(int stage) {
  engine::ZeroEngineOptions o;
  o.stage = stage;
  o.adam.lr = 0.1f;
  o.persistence_threshold_numel = 0;
  return o;
}

}  // namespace

TEST_CASE("a gradient that is not finite on one rank skips the step on every rank, changing nothing",
          "[engine][zero]") {
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    std::vector<std::vector<float>> before(2), after_skip(2), after_good(2);
    std::vector<engine::StepResult> skipped(2), good(2);
    test::run_zero_ranks(2, [&](int rank, Accelerator& accelerator, engine::ZeroComms comms) {
      Manual m(accelerator, comms, sgd_like(stage));
      before[rank] = m.owned();
      m.backward(rank == 1 ? std::numeric_limits<float>::quiet_NaN() : 1.0f);
      skipped[rank] = m.eng.step(0.1f);
      after_skip[rank] = m.owned();
      m.backward(1.0f);
      good[rank] = m.eng.step(0.1f);
      after_good[rank] = m.owned();
    });
    for (int rank : {0, 1}) {
      CAPTURE(rank);
      CHECK_FALSE(skipped[rank].applied);
      CHECK(skipped[rank].step == 0);
      CHECK(after_skip[rank] == before[rank]);
      CHECK(good[rank].applied);
      CHECK(good[rank].step == 1);
      // The gradient was 2 (1 from each rank, summed); the first Adam step moves by lr.
      REQUIRE(after_good[rank].size() == before[rank].size());
      for (size_t i = 0; i < before[rank].size(); ++i) {
        CHECK(after_good[rank][i] == Approx(before[rank][i] - 0.1f).margin(1e-5));
      }
      CHECK(good[rank].grad_norm == Approx(2.0 * std::sqrt(8.0)));
    }
  }
}

TEST_CASE("hooks are checked: parameters outside their windows, gradients outside backward", "[engine][zero]") {
  test::run_zero_ranks(1, [&](int, Accelerator& accelerator, engine::ZeroComms comms) {
    Manual m(accelerator, comms, sgd_like(3));
    CHECK_THROWS_WITH(m.eng.param(m.w), Catch::Contains("outside a hook window"));
    m.eng.pre_op(m.op, Phase::kForward);
    CHECK_NOTHROW(m.eng.param(m.w));
    CHECK_THROWS_WITH(m.eng.grad(m.w), Catch::Contains("outside a backward window"));
    CHECK_THROWS_WITH(m.eng.post_op(m.op, Phase::kBackward), Catch::Contains("closes no open window"));
    m.eng.post_op(m.op, Phase::kForward);
    CHECK_THROWS_WITH(m.eng.declare_parameter({"late", DType::kF32, {2}, std::nullopt}),
                      Catch::Contains("after finalize"));
  });
}

TEST_CASE("inconsistent ZeRO options are refused, naming the option", "[engine][zero]") {
  test::run_zero_ranks(1, [&](int, Accelerator& accelerator, engine::ZeroComms comms) {
    auto make = [&](engine::ZeroEngineOptions o) { engine::ZeroEngine eng(accelerator, comms, o); };
    engine::ZeroEngineOptions o = sgd_like(2);
    o.param_tier = Tier::kCpu;
    CHECK_THROWS_WITH(make(o), Catch::Contains("offload_param.device cpu needs zero_optimization.stage 3"));
    o = sgd_like(4);
    CHECK_THROWS_WITH(make(o), Catch::Contains("zero_optimization.stage must be 1, 2 or 3"));
    o = sgd_like(3);
    o.optimizer_tier = Tier::kNvme;
    CHECK_THROWS_WITH(make(o), Catch::Contains("nvme_path"));
    o = sgd_like(3);
    o.adam.lr = -1;
    CHECK_THROWS_WITH(make(o), Catch::Contains("lr"));
    engine::ZeroComms same{comms.gather, comms.gather, comms.control};
    CHECK_THROWS_WITH(engine::ZeroEngine(accelerator, same, sgd_like(3)), Catch::Contains("three communicators"));
  });
}

TEST_CASE("fp16 loss scaling: gradients are unscaled, an overflow skips the step and halves the scale on every rank",
          "[engine][zero][fp16]") {
  std::vector<std::vector<float>> after_overflow(2), after_good(2), reference(2);
  std::vector<engine::StepResult> overflow(2), good(2);
  std::vector<double> scale_before(2), scale_after(2);
  std::vector<int> unchanged(2, 0);
  engine::ZeroEngineOptions o = sgd_like(3);
  engine::LossScalerOptions scaling;
  scaling.initial_scale_power = 10;
  scaling.hysteresis = 1;
  o.loss_scaling = scaling;
  test::run_zero_ranks(2, [&](int rank, Accelerator& accelerator, engine::ZeroComms comms) {
    Manual m(accelerator, comms, o);
    const auto before = m.owned();
    scale_before[rank] = m.eng.loss_scale();
    m.backward(rank == 0 ? std::numeric_limits<float>::infinity() : 1.0f);  // an fp16 overflow on rank 0
    overflow[rank] = m.eng.step(0.1f);
    after_overflow[rank] = m.owned();
    unchanged[rank] = after_overflow[rank] == before;  // checked on the main thread: Catch2 is not thread-safe
    scale_after[rank] = m.eng.loss_scale();
    // The gradients carry the loss scale; the update must not.
    m.backward(static_cast<float>(m.eng.loss_scale()));
    good[rank] = m.eng.step(0.1f);
    after_good[rank] = m.owned();
  });
  // The same step with gradients of 1 per rank and no scaling.
  test::run_zero_ranks(2, [&](int rank, Accelerator& accelerator, engine::ZeroComms comms) {
    Manual m(accelerator, comms, sgd_like(3));
    m.backward(1.0f);
    m.eng.step(0.1f);
    reference[rank] = m.owned();
  });
  for (int rank : {0, 1}) {
    CAPTURE(rank);
    CHECK(unchanged[rank]);
    CHECK(scale_before[rank] == 1024.0);
    CHECK_FALSE(overflow[rank].applied);
    CHECK(overflow[rank].loss_scale == 1024.0);
    CHECK(scale_after[rank] == 512.0);
    CHECK(good[rank].applied);
    CHECK(good[rank].step == 1);
    CHECK(good[rank].grad_norm == Approx(2.0 * std::sqrt(8.0)));  // unscaled
    CHECK(after_good[rank] == reference[rank]);
  }
}
