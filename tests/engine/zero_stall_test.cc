// Per-operator stall accounting (PrefetchStats::param_stall_seconds,
// op_stalls): how long the compute stream sat at pre_op's waits for gathered
// parameters, timed on the stream.
//  - prefetch off and NVMe reads slowed down by a delaying I/O backend: every
//    window's gather is still running when compute reaches it, so each op is
//    timed once per window, with a positive stall, under its own name, and
//    the per-op figures add up to the step's;
//  - the same through a 2-rank Llama training step, read right after step()
//    (forward and backward windows both show up);
//  - stages 1/2 gather nothing per op: no stall, no log.
// No timing thresholds: a stall that must exist is checked to be > 0, and
// figures are checked against each other, never against a clock.
#include <catch2/catch.hpp>


#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "nvme/io_backend.h"
#include "core/log.h"
#include "tests/engine/zero_training.h"
#include "tests/support/temp_dir.h"
#include "tests/nvme/hooked_backend.h"

namespace {
using namespace strata;
using namespace strata::test::zero;
using engine::Phase;

// Reads each take at least 20 ms longer: the pieces are held back on the
// worker before they reach the kernel (test::HookedBackend). Writes pass.
void delay_reads(const nvme::IoPiece& piece) {
  if (piece.op == nvme::IoOp::kRead) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

// Slow NVMe reads and no prefetch: every gather is issued at its pre_op and
// waits for its read, so compute is bound to wait for it.
engine::ZeroEngineOptions slow_reads_no_prefetch(const std::filesystem::path& dir) {
  engine::ZeroEngineOptions o = prefetch_off(options_for(3));
  o.param_tier = Tier::kNvme;
  o.nvme_path = dir;
  o.io_backend = [engine = o.aio.engine] {
    return std::make_unique<test::HookedBackend>(nvme::make_backend(engine), delay_reads);
  };
  return o;
}

double sum_seconds(const std::vector<engine::OpStall>& stalls) {
  double s = 0;
  for (const auto& x : stalls) s += x.seconds;
  return s;
}

}  // namespace

TEST_CASE("stall accounting: prefetch off, slow reads: each op's window is timed with a positive stall",
          "[engine][zero][stall]") {
  test::TempDir dir("strata-zero-stall-ops");
  std::vector<engine::PrefetchStats> steps;
  std::vector<std::string> names{"a", "b", "c"};
  test::run_zero_ranks(1, [&](int, Accelerator& accelerator, engine::ZeroComms comms) {
    engine::ZeroEngine eng(accelerator, comms, slow_reads_no_prefetch(dir.path()));
    std::vector<engine::ParamId> p;
    std::vector<engine::OpId> op;
    for (size_t i = 0; i < names.size(); ++i) {
      p.push_back(eng.declare_parameter({fmt::format("p{}", i), DType::kF32, {1024}, std::nullopt}));
      op.push_back(eng.declare_operator(names[i], {p[i]}));
    }
    const engine::OpId marker = eng.declare_operator("marker", {});  // no parameter: nothing to wait for
    eng.finalize();
    for (int step = 0; step < 2; ++step) {
      eng.pre_op(marker, Phase::kForward);
      eng.post_op(marker, Phase::kForward);
      for (size_t i = 0; i < op.size(); ++i) {
        eng.pre_op(op[i], Phase::kForward);
        eng.post_op(op[i], Phase::kForward);
      }
      eng.compute_stream().synchronize();
      eng.step(0.1f);
      steps.push_back(eng.last_step_prefetch());
    }
  });
  REQUIRE(steps.size() == 2);
  for (const engine::PrefetchStats& s : steps) {
    CHECK(s.windows == 4);
    CHECK(s.on_demand == 3);
    CHECK(s.stalled_windows() == 3);  // not the marker: it waits for nothing
    CHECK(s.param_stall_seconds() > 0);
    const std::vector<engine::OpStall> stalls = s.op_stalls();
    REQUIRE(stalls.size() == 3);
    std::set<std::string> seen;
    for (size_t k = 0; k < stalls.size(); ++k) {
      INFO(stalls[k].name);
      seen.insert(stalls[k].name);
      CHECK(stalls[k].phase == Phase::kForward);
      CHECK(stalls[k].windows == 1);
      CHECK(stalls[k].seconds > 0);
      CHECK(names[static_cast<size_t>(stalls[k].op)] == stalls[k].name);
      if (k > 0) CHECK(stalls[k - 1].seconds >= stalls[k].seconds);  // most first
    }
    CHECK(seen == std::set<std::string>(names.begin(), names.end()));
    CHECK(sum_seconds(stalls) == Approx(s.param_stall_seconds()).epsilon(1e-9));
    CHECK(s.read_nbytes == 3 * 1024 * sizeof(float));
  }
}

TEST_CASE("stall accounting through training: 2 ranks, slow reads, per op and phase, final after step()",
          "[engine][zero][stall][nvme]") {
  test::TempDir dir("strata-zero-stall-train");
  TrainSpec spec;
  spec.world = 2;
  spec.steps = 2;
  spec.options = slow_reads_no_prefetch(dir.path());
  const TrainResult r = train_zero(spec);
  REQUIRE(r.prefetch.size() == 2);
  for (const engine::PrefetchStats& s : r.prefetch) {
    // Read as train_zero took it, right after step(): no synchronize in between.
    CHECK(s.param_stall_seconds() > 0);
    CHECK(s.stalled_windows() > 0);
    CHECK(s.stalled_windows() <= s.windows);
    const std::vector<engine::OpStall> stalls = s.op_stalls();
    REQUIRE(!stalls.empty());
    int64_t windows = 0;
    bool forward = false, backward = false;
    for (const auto& x : stalls) {
      CHECK(!x.name.empty());
      CHECK(x.windows >= 1);
      CHECK(x.seconds >= 0);
      windows += x.windows;
      forward = forward || x.phase == Phase::kForward;
      backward = backward || x.phase == Phase::kBackward;
    }
    CHECK(forward);
    CHECK(backward);
    CHECK(windows == s.stalled_windows());
    CHECK(sum_seconds(stalls) == Approx(s.param_stall_seconds()).epsilon(1e-9));
    CHECK(s.read_nbytes > 0);
  }
  for (double loss : r.losses) CHECK(std::isfinite(loss));
}

TEST_CASE("stall accounting: stages 1 and 2 gather nothing per op: no stall", "[engine][zero][stall]") {
  for (int stage : {1, 2}) {
    TrainSpec spec;
    spec.world = 2;
    spec.steps = 2;
    spec.options = options_for(stage);
    const TrainResult r = train_zero(spec);
    REQUIRE(r.prefetch.size() == 2);
    for (const engine::PrefetchStats& s : r.prefetch) {
      CHECK(s.param_stall_seconds() == 0);
      CHECK(s.stalled_windows() == 0);
      CHECK(s.op_stalls().empty());
      CHECK(s.stall_log == nullptr);
    }
  }
}
