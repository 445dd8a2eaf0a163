// The engine as an autograd engine drives it (the C API 0.3 that strata.torch
// uses): windows closed in any order, not only the innermost -- autograd
// finishes a module's backward when its inputs' gradients are done, not
// nested -- give the nested order's result bit for bit, at every stage, on
// two ranks; and ZeroEngine::clip_grad_norm ahead of step() (torch's
// clip_grad_norm_ in a loop) returns the step's norm and steps as
// gradient_clipping at that maximum does, bit for bit.
#include <catch2/catch.hpp>

#include <vector>

#include "runtime/engine/zero_engine.h"
#include "tests/engine/zero_rig.h"
#include "tests/engine/zero_training.h"

namespace {
using namespace strata;
using engine::Engine;
using engine::Phase;

// Three parameters: a's "wa", b's "wb", and "shared" listed by both.
struct Three {
  engine::ZeroEngine eng;
  engine::ParamId wa, wb, shared;
  engine::OpId a, b;
  Three(Accelerator& accelerator, engine::ZeroComms comms, engine::ZeroEngineOptions options)
      : eng(accelerator, comms, options) {
    wa = eng.declare_parameter({"wa", DType::kF32, {40}, std::nullopt});
    wb = eng.declare_parameter({"wb", DType::kF32, {24}, std::nullopt});
    shared = eng.declare_parameter({"shared", DType::kF32, {16}, std::nullopt});
    a = eng.declare_operator("a", {wa, shared});
    b = eng.declare_operator("b", {wb, shared});
    eng.finalize();
    for (engine::ParamId id : {wa, wb, shared}) {
      eng.for_each_owned_range(id, Engine::Access::kWrite, [&](int64_t first, const TensorView& host) {
        for (int64_t i = 0; i < host.numel(); ++i) host.as<float>()[i] = 0.01f * static_cast<float>(id + first + i);
      });
    }
  }
  // The parameter's gathered values, checked against what was written.
  float sum(engine::ParamId id) {
    const TensorView v = eng.param(id);
    eng.compute_stream().synchronize();
    float s = 0;
    for (int64_t i = 0; i < v.numel(); ++i) s += v.as<float>()[i];
    return s;
  }
  void add_grad(engine::ParamId id, float value) {
    TensorView g = eng.grad(id);
    eng.compute_stream().synchronize();
    for (int64_t i = 0; i < g.numel(); ++i) g.as<float>()[i] += value * static_cast<float>(i + 1);
  }
  // One training step; `nested`: every window closed innermost first, else
  // in the order they were opened. The gradients depend on the values read.
  engine::StepResult step(bool nested, int rank) {
    eng.pre_op(a, Phase::kForward);
    eng.pre_op(b, Phase::kForward);
    const float sa = sum(wa), sb = sum(wb), ss = sum(shared);
    if (nested) {
      eng.post_op(b, Phase::kForward);
      eng.post_op(a, Phase::kForward);
    } else {
      eng.post_op(a, Phase::kForward);
      eng.post_op(b, Phase::kForward);
    }
    eng.pre_op(b, Phase::kBackward);
    eng.pre_op(a, Phase::kBackward);
    add_grad(wb, sb + static_cast<float>(rank));
    add_grad(shared, ss);
    add_grad(wa, sa - static_cast<float>(rank));
    add_grad(shared, 0.5f * ss);
    if (nested) {
      eng.post_op(a, Phase::kBackward);
      eng.post_op(b, Phase::kBackward);
    } else {
      eng.post_op(b, Phase::kBackward);
      eng.post_op(a, Phase::kBackward);
    }
    return eng.step(0.05f);
  }
  std::vector<float> values() {
    std::vector<float> out;
    for (engine::ParamId id : {wa, wb, shared}) {
      std::vector<float> whole(static_cast<size_t>(eng.param_info(id).numel()), 0.0f);
      eng.for_each_owned_range(id, Engine::Access::kRead, [&](int64_t first, const TensorView& host) {
        std::copy_n(host.as<float>(), host.numel(), whole.begin() + first);
      });
      out.insert(out.end(), whole.begin(), whole.end());
    }
    return out;
  }
};

}  // namespace

TEST_CASE("windows closed in the order they opened give the nested order's result, bit for bit",
          "[engine][zero][autograd]") {
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    std::vector<std::vector<float>> result(4);
    std::vector<double> norms(4);
    for (bool nested : {true, false}) {
      test::run_zero_ranks(2, [&](int rank, Accelerator& accelerator, engine::ZeroComms comms) {
        engine::ZeroEngineOptions o;
        o.stage = stage;
        o.adam.lr = 0.05f;
        o.persistence_threshold_numel = 0;
        o.reduce_bucket_numel = 32;  // buckets land between the windows' releases
        Three t(accelerator, comms, o);
        engine::StepResult r;
        for (int s = 0; s < 3; ++s) r = t.step(nested, rank);
        CHECK(r.applied);
        std::vector<float> v = t.values();  // every rank reads the same whole values (they are summed)
        const size_t slot = static_cast<size_t>(2 * (nested ? 0 : 1) + rank);
        result[slot] = v;
        norms[slot] = r.grad_norm;
      });
    }
    // Each rank holds its owned elements; the rest are 0: the ranks' sum is the whole.
    std::vector<float> nested_whole(result[0].size()), any_whole(result[0].size());
    for (size_t i = 0; i < nested_whole.size(); ++i) {
      nested_whole[i] = result[0][i] + result[1][i];
      any_whole[i] = result[2][i] + result[3][i];
    }
    CHECK(nested_whole == any_whole);
    CHECK(norms[0] == norms[2]);
    CHECK(norms[0] > 0);
  }
}

TEST_CASE("clip_grad_norm before step returns the step's norm and clips as gradient_clipping does, bit for bit",
          "[engine][zero][autograd]") {
  using namespace strata::test::zero;
  ops::set_cpu_threads(1);
  for (int stage : {2, 3}) {
    CAPTURE(stage);
    TrainSpec configured;
    configured.world = 2;
    configured.options = options_for(stage);
    configured.options.gradient_clipping = 0.05;  // fires every step
    TrainSpec called = configured;
    called.options.gradient_clipping = 0;
    called.clip_grad_norm = 0.05;  // train_zero checks its norm against the step's
    const TrainResult want = train_zero(configured), got = train_zero(called);
    CHECK(compare(got, want).identical);
    CHECK(got.grad_norms == want.grad_norms);
    CHECK(got.grad_norms.front() > 0.05);
  }
}
