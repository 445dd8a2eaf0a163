// The optimizer overlapping backward (ZeroEngine::prepare_step): sub-groups
// updated during backward as their gradients become final must give the step
// taken entirely in step(), bit for bit — when the speculation holds, and when
// it is rolled back (clipping fires, a gradient is not finite, another lr, a
// step abandoned); and so must the read-ahead the optimizer takes while
// clipping fires (statistics and NVMe state read during backward), whichever
// mode each step chose. Ranks are threads over real Gloo; NVMe tiers are real
// O_DIRECT files.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "nvme/io_backend.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/decoder_model.h"
#include "tests/engine/zero_training.h"
#include "tests/support/temp_dir.h"

using namespace strata;

namespace {

using test::zero::TrainResult;
using test::zero::TrainSpec;
using test::zero::train_zero;
using test::zero::use_io_faults;

// A different lr each step, so a step() given prepare_step's lr is checked.
float lr_of(int step) { return test::zero::kLr * (1.0f + 0.1f * static_cast<float>(step)); }

TrainSpec spec_for(const engine::ZeroEngineOptions& options, DType dtype) {
  TrainSpec spec;
  spec.world = 2;
  spec.steps = 4;
  spec.dtype = dtype;
  spec.options = options;
  spec.prepare_step = true;
  spec.lr = lr_of;
  return spec;
}

engine::ZeroEngineOptions options(int stage, Tier param, Tier optimizer, Tier grad, const std::filesystem::path& dir) {
  engine::ZeroEngineOptions o = test::zero::options_for(stage);
  o.param_tier = param;
  o.optimizer_tier = optimizer;
  o.grad_tier = grad;
  o.nvme_path = dir;
  o.sub_group_numel = 2048;  // several sub-groups per shard, final at different points of backward
  return o;
}

// The overlapped run equals the one with the optimizer in step() only, bit
// for bit, in losses, norms and every parameter (bf16 ones widened exactly).
void check_same(const TrainResult& overlapped, const TrainResult& plain) {
  REQUIRE(overlapped.params.size() == plain.params.size());
  for (size_t p = 0; p < plain.params.size(); ++p) {
    CAPTURE(plain.names[p]);
    REQUIRE(overlapped.params[p].size() == plain.params[p].size());
    REQUIRE(std::memcmp(overlapped.params[p].data(), plain.params[p].data(), plain.params[p].size() * sizeof(float)) == 0);
  }
  REQUIRE(overlapped.losses.size() == plain.losses.size());
  for (size_t s = 0; s < plain.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::memcmp(&overlapped.losses[s], &plain.losses[s], sizeof(double)) == 0);
    CHECK(overlapped.steps[s].applied == plain.steps[s].applied);
    CHECK(overlapped.steps[s].grad_norm == plain.steps[s].grad_norm);
  }
}

// Every file two runs' save_state wrote (parameters, fp32 master weights,
// both moments, the engine's state), byte for byte.
void check_same_files(const std::filesystem::path& a, const std::filesystem::path& b) {
  std::set<std::string> names_a, names_b;
  for (const auto& e : std::filesystem::recursive_directory_iterator(a)) {
    if (e.is_regular_file()) names_a.insert(std::filesystem::relative(e.path(), a).string());
  }
  for (const auto& e : std::filesystem::recursive_directory_iterator(b)) {
    if (e.is_regular_file()) names_b.insert(std::filesystem::relative(e.path(), b).string());
  }
  REQUIRE(names_a == names_b);
  bool optimizer_state = false;
  for (const std::string& name : names_a) {
    CAPTURE(name);
    std::ifstream fa(a / name, std::ios::binary), fb(b / name, std::ios::binary);
    const std::string bytes_a((std::istreambuf_iterator<char>(fa)), std::istreambuf_iterator<char>());
    const std::string bytes_b((std::istreambuf_iterator<char>(fb)), std::istreambuf_iterator<char>());
    CHECK(bytes_a.size() == bytes_b.size());
    CHECK(bytes_a == bytes_b);
    optimizer_state = optimizer_state || name.find("exp_avg_sq") != std::string::npos;
  }
  CHECK(optimizer_state);  // the moments were among them
}

int64_t overlapped_sub_groups(const TrainResult& r) {
  int64_t n = 0;
  for (const auto& s : r.steps) n += s.sub_groups_overlapped;
  return n;
}

}  // namespace

TEST_CASE("optimizer overlapping backward: bit for bit the step taken in step(), every tier, stages 2 and 3",
          "[engine][zero][overlap]") {
  test::TempDir dir("strata-overlap");
  struct Case {
    int stage;
    Tier param, optimizer, grad;
    DType dtype;
  };
  const Case c = GENERATE(Case{2, Tier::kDevice, Tier::kCpu, Tier::kDevice, DType::kF32},
                          Case{3, Tier::kDevice, Tier::kCpu, Tier::kDevice, DType::kBF16},
                          Case{3, Tier::kCpu, Tier::kNvme, Tier::kNvme, DType::kF32},
                          Case{3, Tier::kNvme, Tier::kNvme, Tier::kNvme, DType::kBF16},
                          Case{2, Tier::kDevice, Tier::kNvme, Tier::kDevice, DType::kBF16});
  CAPTURE(c.stage, tier_name(c.param), tier_name(c.optimizer), tier_name(c.grad), dtype_name(c.dtype));
  TrainSpec spec = spec_for(options(c.stage, c.param, c.optimizer, c.grad, dir.path()), c.dtype);
  spec.options.gradient_clipping = 1e9;  // on, never firing: the norm is computed and speculation holds
  spec.options.overlap_optimizer = false;
  const TrainResult plain = train_zero(spec);
  spec.options.overlap_optimizer = true;
  const TrainResult overlapped = train_zero(spec);
  check_same(overlapped, plain);
  // The optimizer thread did update sub-groups during backward, and kept them.
  CHECK(overlapped_sub_groups(overlapped) > 0);
  for (const auto& s : overlapped.steps) CHECK_FALSE(s.rolled_back);
  for (const auto& s : plain.steps) CHECK(s.sub_groups_overlapped == 0);
  CHECK(overlapped.steps.back().optimizer_overlapped_seconds > 0);
}

TEST_CASE("optimizer_not_hidden_fraction: what the training thread waited for over the optimizer's own time",
          "[engine][zero][overlap]") {
  engine::StepResult r;
  CHECK(r.optimizer_not_hidden_fraction() == 1.0);  // no optimizer time at all: nothing hidden
  // step() took 0.2 s, 0.05 s of it draining the thread, which had worked 0.5 s during backward.
  r.optimizer_seconds = 0.2;
  r.optimizer_drain_seconds = 0.05;
  r.optimizer_overlapped_seconds = 0.5;
  CHECK(r.optimizer_not_hidden_fraction() == Approx(0.2 / 0.65));
  // The last step's update ran 0.4 s behind this forward, which waited 0.1 s for it.
  r.previous_update_seconds = 0.4;
  r.previous_update_wait_seconds = 0.1;
  CHECK(r.optimizer_not_hidden_fraction() == Approx(0.3 / 1.05));
  // Waiting longer than the work (a stalled drive) is all of it, not more.
  r.previous_update_wait_seconds = 2.0;
  CHECK(r.optimizer_not_hidden_fraction() == 1.0);
}

TEST_CASE("optimizer overlapping backward: clipping that fires, a non-finite gradient, another lr and an abandoned "
          "step roll back exactly",
          "[engine][zero][overlap]") {
  test::TempDir dir("strata-overlap");
  const Tier optimizer = GENERATE(Tier::kCpu, Tier::kNvme);
  CAPTURE(tier_name(optimizer));
  TrainSpec spec = spec_for(
      options(3, Tier::kDevice, optimizer, optimizer == Tier::kNvme ? Tier::kNvme : Tier::kDevice, dir.path()),
      DType::kBF16);
  spec.steps = 5;
  spec.micro_steps = 2;
  spec.options.gradient_clipping = 0.5;  // fires at step 0 (checked below)
  spec.prepare_lr = [](int step) { return step == 2 ? 2 * lr_of(step) : lr_of(step); };
  spec.grad_scale = [](int rank, int step) {
    return rank == 0 && step == 3 ? std::numeric_limits<float>::infinity() : 1.0f;
  };
  spec.abandoned_step = 4;
  spec.options.overlap_optimizer = false;
  const TrainResult plain = train_zero(spec);
  spec.options.overlap_optimizer = true;
  spec.overlap_policy = offload::OverlapPolicy::kSpeculate;  // kAuto would read ahead after a step that clipped
  const TrainResult overlapped = train_zero(spec);
  check_same(overlapped, plain);
  REQUIRE(plain.steps.size() == 5);
  CHECK(plain.steps[0].grad_norm > 0.5);       // clipping fired at step 0
  CHECK(overlapped.steps[0].rolled_back);
  CHECK(overlapped.steps[2].rolled_back);      // another lr
  CHECK_FALSE(overlapped.steps[3].applied);    // not finite: skipped, nothing changed
  CHECK(overlapped.steps[3].rolled_back);
  CHECK(overlapped.steps[4].applied);
}

// Every NVMe write of a run held `delay` before it reaches the disk: the
// optimizer's write-back then outlasts the next forward's first windows, so
// that forward's gathers must wait for the updates (the same bits either way).
void slow_writes(TrainSpec& spec, std::chrono::milliseconds delay) {
  auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{nvme::IoFault{
      .nth = 1, .kind = nvme::IoFault::Kind::kSlow, .op = nvme::IoOp::kWrite, .repeat = true, .delay = delay}});
  use_io_faults(spec, plan);
}

TEST_CASE("the update overlapping the next forward: bit for bit the step taken in step(), clipping firing or not, "
          "every stage-3 tier, with an evaluation, micro-steps and a checkpoint between steps",
          "[engine][zero][overlap][forward]") {
  test::TempDir dir("strata-overlap-forward");
  struct Case {
    Tier param, optimizer, grad;
    DType dtype;
    double clipping;
    offload::OverlapPolicy policy;
    int micro_steps;
  };
  const auto auto_policy = offload::OverlapPolicy::kAuto;
  const Case c = GENERATE_COPY(
      Case{Tier::kDevice, Tier::kCpu, Tier::kDevice, DType::kBF16, 1e-3, auto_policy, 1},  // clipping always fires
      Case{Tier::kCpu, Tier::kNvme, Tier::kNvme, DType::kF32, 1e-3, auto_policy, 1},
      Case{Tier::kNvme, Tier::kNvme, Tier::kNvme, DType::kBF16, 1e-3, auto_policy, 2},
      Case{Tier::kNvme, Tier::kNvme, Tier::kNvme, DType::kBF16, 1e9, auto_policy, 1},  // never fires: speculation
      Case{Tier::kNvme, Tier::kCpu, Tier::kDevice, DType::kF32, 0.5, offload::OverlapPolicy::kSpeculate, 2});
  // Prepared before the forward, the arming waits for the join; after it, the join is prepare_step.
  const bool before = GENERATE(true, false);
  CAPTURE(tier_name(c.param), tier_name(c.optimizer), tier_name(c.grad), dtype_name(c.dtype), c.clipping,
          c.micro_steps, before);
  TrainSpec spec = spec_for(options(3, c.param, c.optimizer, c.grad, dir.path()), c.dtype);
  spec.prepare_before_forward = before;
  spec.steps = 4;
  spec.micro_steps = c.micro_steps;
  spec.options.gradient_clipping = c.clipping;
  spec.overlap_policy = c.policy;
  spec.eval_before = {2};  // an evaluation's forward between steps gathers behind the update too
  spec.eval_marked = true;
  spec.save_after_step = 1;  // a checkpoint joins the update first
  const bool nvme = c.param == Tier::kNvme || c.optimizer == Tier::kNvme || c.grad == Tier::kNvme;
  if (nvme) slow_writes(spec, std::chrono::milliseconds(4));
  spec.options.overlap_optimizer = false;
  spec.save_dir = dir.path() / "plain";
  const TrainResult plain = train_zero(spec);
  spec.options.overlap_optimizer = true;
  spec.save_dir = dir.path() / "overlapped";
  const TrainResult overlapped = train_zero(spec);
  check_same(overlapped, plain);
  check_same_files(dir.path() / "overlapped", dir.path() / "plain");
  if (c.clipping == 1e-3) {
    for (const auto& s : plain.steps) CHECK(s.grad_norm > 1e-3);  // clipping fired at every step
  }
  REQUIRE(overlapped.steps.size() == 4);
  int64_t ordered = 0;
  for (size_t s = 0; s < overlapped.steps.size(); ++s) {
    CAPTURE(s);
    CHECK(overlapped.steps[s].update_overlaps_forward);
    CHECK_FALSE(plain.steps[s].update_overlaps_forward);
    // The previous step's update ran on the optimizer thread (step 2's was joined by the checkpoint after step 1).
    if (s > 0) CHECK(overlapped.steps[s].previous_update_seconds > 0);
    ordered += overlapped.prefetch[s].gathers_after_update;
    CHECK(plain.prefetch[s].gathers_after_update == 0);
  }
  // With the write-back slowed, the next forward found updates still running and waited for them per range.
  if (nvme) CHECK(ordered > 0);
  // Turned off, the step ends in step() (and gives the same bits).
  spec.options.overlap_next_forward = false;
  spec.save_dir = dir.path() / "in_step";
  const TrainResult in_step = train_zero(spec);
  check_same(in_step, plain);
  for (const auto& s : in_step.steps) CHECK_FALSE(s.update_overlaps_forward);
}

TEST_CASE("the update overlapping the next forward: a write that fails is reported at the join before the next "
          "backward, naming the file",
          "[engine][zero][overlap][forward]") {
  // One rank, gradients in memory, parameters in pinned memory, optimizer
  // state on NVMe: after initialisation every NVMe write is the optimizer's
  // write-back. Every write from step 1's on fails.
  test::TempDir dir("strata-overlap-forward-fault");
  TrainSpec spec = spec_for(options(3, Tier::kCpu, Tier::kNvme, Tier::kDevice, dir.path()), DType::kF32);
  spec.world = 1;
  spec.steps = 3;
  spec.timeout = std::chrono::milliseconds(5000);
  // Read ahead: nothing is written during backward (speculation would write there, and fail in step()).
  spec.overlap_policy = offload::OverlapPolicy::kReadAhead;
  // How many writes initialisation and one step take: clean runs of 1 and 2
  // steps, every write counted (a fault that passes them through at once).
  const auto writes_in = [&](int steps) {
    TrainSpec counted = spec;
    counted.steps = steps;
    auto counter = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{nvme::IoFault{
        .nth = 1, .kind = nvme::IoFault::Kind::kSlow, .op = nvme::IoOp::kWrite, .repeat = true}});
    use_io_faults(counted, counter);
    train_zero(counted);
    return counter->fired();
  };
  const uint64_t one = writes_in(1), per_step = writes_in(2) - one;
  REQUIRE(per_step > 2);
  auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{nvme::IoFault{
      .nth = one + 2, .kind = nvme::IoFault::Kind::kError, .error = EIO, .op = nvme::IoOp::kWrite, .repeat = true}});
  use_io_faults(spec, plan);
  spec.collect_errors = true;
  const TrainResult r = train_zero(spec);
  CHECK(plan->fired() >= 1);
  REQUIRE(r.errors[0] != nullptr);
  // Step 1's update fails on the optimizer thread; step 2 meets it before its backward.
  CHECK(r.failed_step[0] == 2);
  try {
    std::rethrow_exception(r.errors[0]);
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.category() == ErrorCategory::kIo);
    CHECK_THAT(std::string(e.what()), Catch::Contains("optimizer") && Catch::Contains("slot") &&
                                          Catch::Contains("EIO"));
  }
}

TEST_CASE("prepare_step misuse is refused, naming the call", "[engine][zero][overlap]") {
  test::run_zero_ranks(1, [&](int, Accelerator& accelerator, engine::ZeroComms comms) {
    engine::ZeroEngine eng(accelerator, comms, test::zero::options_for(3));
    nn::DecoderModel model(eng, test::zero::model_config(false), nn::model_options(DType::kF32, 16));
    CHECK_THROWS_WITH(eng.prepare_step(0.1f), Catch::Contains("before finalize"));
    eng.finalize();
    CHECK_THROWS_WITH(eng.prepare_step(-1.0f), Catch::Contains("lr"));
    eng.prepare_step(0.1f);
    CHECK_THROWS_WITH(eng.prepare_step(0.1f), Catch::Contains("twice"));
    CHECK_THROWS_WITH(eng.for_each_owned_range(0, engine::Engine::Access::kRead, [](int64_t, const TensorView&) {}),
                      Catch::Contains("between prepare_step() and step()"));
    eng.zero_grad();  // abandons the prepared step
    eng.for_each_owned_range(0, engine::Engine::Access::kRead, [](int64_t, const TensorView&) {});
  });
}

TEST_CASE("the optimizer on the accelerator takes prepared steps without overlapping, bit for bit the CPU "
          "optimizer, through clipping, a non-finite gradient, another lr and an abandoned step",
          "[engine][zero][overlap]") {
  test::TempDir dir("strata-overlap");
  const int stage = GENERATE(2, 3);
  CAPTURE(stage);
  TrainSpec spec = spec_for(options(stage, Tier::kDevice, Tier::kCpu, Tier::kDevice, dir.path()), DType::kBF16);
  spec.steps = 5;
  spec.micro_steps = 2;
  spec.options.gradient_clipping = 0.5;
  spec.prepare_lr = [](int step) { return step == 2 ? 2 * lr_of(step) : lr_of(step); };
  spec.grad_scale = [](int rank, int step) {
    return rank == 0 && step == 3 ? std::numeric_limits<float>::infinity() : 1.0f;
  };
  spec.abandoned_step = 4;
  spec.options.overlap_optimizer = false;
  const TrainResult cpu = train_zero(spec);
  spec.options.optimizer_tier = Tier::kDevice;
  spec.options.overlap_optimizer = true;  // asked for, and not done: nothing to hide on the accelerator
  const TrainResult device = train_zero(spec);
  check_same(device, cpu);
  REQUIRE(device.steps.size() == 5);
  CHECK(device.steps[0].grad_norm > 0.5);
  CHECK_FALSE(device.steps[3].applied);
  CHECK(device.steps[4].applied);
  for (const auto& s : device.steps) {
    CHECK(s.sub_groups_overlapped == 0);
    CHECK_FALSE(s.rolled_back);
  }
  CHECK(overlapped_sub_groups(device) == 0);
}

TEST_CASE("the optimizer on the accelerator needs the trained parameters and the gradient shard there",
          "[engine][zero][overlap]") {
  test::run_zero_ranks(1, [&](int, Accelerator& accelerator, engine::ZeroComms comms) {
    engine::ZeroEngineOptions o = test::zero::options_for(3);
    o.optimizer_tier = Tier::kDevice;
    o.param_tier = Tier::kCpu;
    // Parameters offloaded with the optimizer on the accelerator: only frozen
    // ones may be (the trained ones stay beside their optimizer state), so
    // finalize, which knows what is frozen, decides.
    for (const bool freeze : {false, true}) {
      INFO("a frozen parameter: " << freeze);
      engine::ZeroEngine e(accelerator, comms, o);
      engine::ParamInfo trained, frozen;
      trained.name = "trained";
      trained.shape = {64};
      frozen.name = "frozen";
      frozen.shape = {64};
      const engine::ParamId a = e.declare_parameter(trained), b = e.declare_parameter(frozen);
      e.declare_operator("op", {a, b});
      if (freeze) e.freeze(b);
      if (freeze) {
        e.finalize();
      } else {
        CHECK_THROWS_WITH(e.finalize(), Catch::Contains("offload_optimizer.device none") &&
                                            Catch::Contains("offload_param.device is cpu") &&
                                            Catch::Contains("no parameter is frozen"));
      }
    }
    o.param_tier = Tier::kDevice;
    o.grad_tier = Tier::kNvme;
    o.nvme_path = "/tmp/unused";
    CHECK_THROWS_WITH(engine::ZeroEngine(accelerator, comms, o), Catch::Contains("grad tier nvme is not device"));
  });
}

namespace {

// When gradient clipping (at kClip) fires: every step, never, or on even
// steps only. A gradient scaled by kLarge clips; one of scale 1 does not
// (both checked on the run without overlap).
enum class Clipping { kEveryStep, kNever, kAlternating };
constexpr double kClip = 50;
constexpr float kLarge = 1000;

const char* clipping_name(Clipping c) {
  return c == Clipping::kEveryStep ? "every step" : c == Clipping::kNever ? "never" : "alternating";
}

bool clips(Clipping c, int step) {
  return c == Clipping::kEveryStep || (c == Clipping::kAlternating && step % 2 == 0);
}

struct ClipRun {
  TrainResult result;
  std::filesystem::path saved;  // save_state after the last step
};

// 5 steps of stage 3 (bf16, parameters on the device) with the optimizer
// state on `optimizer` (gradient shard on NVMe with it), saved after the last.
ClipRun train_clipping(const std::filesystem::path& dir, const std::string& name, int world, Tier optimizer,
                       Clipping clipping, bool overlap, offload::OverlapPolicy policy, size_t buffers = 3,
                       bool forward = true) {
  engine::ZeroEngineOptions o =
      options(3, Tier::kDevice, optimizer, optimizer == Tier::kNvme ? Tier::kNvme : Tier::kDevice, dir / (name + "-swap"));
  o.gradient_clipping = kClip;
  o.overlap_optimizer = overlap;
  o.overlap_next_forward = forward;
  o.optimizer_buffer_count = buffers;
  TrainSpec spec = spec_for(o, DType::kBF16);
  spec.world = world;
  spec.steps = 5;
  spec.overlap_policy = policy;
  spec.grad_scale = [clipping](int, int step) { return clips(clipping, step) ? kLarge : 1.0f; };
  spec.save_dir = dir / (name + "-saved");
  spec.save_after_step = spec.steps - 1;
  ClipRun run{train_zero(spec), spec.save_dir};
  return run;
}

}  // namespace

TEST_CASE("an overlap that survives clipping: every step as the unoverlapped one, bit for bit in the parameters "
          "and the optimizer state, with clipping firing every step, never and on alternate steps",
          "[engine][zero][overlap][clipping]") {
  test::TempDir dir("strata-clip-overlap");
  const int world = GENERATE(1, 2);
  const Tier optimizer = GENERATE(Tier::kCpu, Tier::kNvme);
  const Clipping clipping = GENERATE(Clipping::kEveryStep, Clipping::kNever, Clipping::kAlternating);
  // With and without the update overlapping the next forward (the same choices).
  const bool forward = GENERATE(false, true);
  CAPTURE(world, tier_name(optimizer), clipping_name(clipping), forward);
  const ClipRun plain = train_clipping(dir.path(), "plain", world, optimizer, clipping, false, offload::OverlapPolicy::kAuto);
  const ClipRun overlapped = train_clipping(dir.path(), "overlapped", world, optimizer, clipping, true,
                                            offload::OverlapPolicy::kAuto, 3, forward);
  check_same(overlapped.result, plain.result);
  check_same_files(overlapped.saved, plain.saved);
  REQUIRE(plain.result.steps.size() == 5);
  // kAuto: read ahead at first (clipping is on) and after a step that
  // clipped, speculate after one that did not. What the thread got done
  // before the boundary depends on timing: each step may show none, the
  // run as a whole must show some.
  std::optional<bool> clipped_before;
  int64_t read_ahead = 0, kept = 0, rolled_back = 0;
  double read_ahead_seconds = 0;
  int read_ahead_steps = 0, clipped_speculations = 0, kept_speculations = 0;
  for (int s = 0; s < 5; ++s) {
    CAPTURE(s);
    const engine::StepResult& p = plain.result.steps[static_cast<size_t>(s)];
    const engine::StepResult& r = overlapped.result.steps[static_cast<size_t>(s)];
    CHECK((p.grad_norm > kClip) == clips(clipping, s));
    CHECK_FALSE(p.overlap_mode.has_value());
    CHECK(p.applied);
    const bool speculated = clipped_before.has_value() && !*clipped_before;
    CHECK(r.update_overlaps_forward == forward);
    REQUIRE(r.overlap_mode.has_value());
    CHECK(*r.overlap_mode == (speculated ? offload::OverlapMode::kSpeculate : offload::OverlapMode::kReadAhead));
    if (r.rolled_back) CHECK((speculated && clips(clipping, s)));
    rolled_back += r.rolled_back;
    if (!speculated) {
      ++read_ahead_steps;
      CHECK(r.sub_groups_overlapped == 0);
      read_ahead_seconds += r.optimizer_overlapped_seconds;  // statistics (and reads) taken during backward
      read_ahead += r.sub_groups_read_ahead;
      if (optimizer == Tier::kCpu) CHECK(r.sub_groups_read_ahead == 0);  // nothing to read
    } else if (!clips(clipping, s)) {
      ++kept_speculations;
      kept += r.sub_groups_overlapped;
    } else {
      ++clipped_speculations;
      CHECK(r.sub_groups_overlapped == 0);
    }
    clipped_before = clips(clipping, s);
  }
  // Every step: read ahead (it always clipped); never: read ahead once, then
  // speculate; alternating: both modes, each right and wrong once at least.
  CHECK(read_ahead_steps == (clipping == Clipping::kEveryStep ? 5 : clipping == Clipping::kNever ? 1 : 3));
  // One read-ahead step (clipping never fires: only the first) may get
  // nothing done before its boundary on a loaded machine (CI once saw it);
  // over three or five, the thread must have done some.
  if (read_ahead_steps > 1) {
    CHECK(read_ahead_seconds > 0);
    if (optimizer == Tier::kNvme) CHECK(read_ahead > 0);
  }
  if (kept_speculations > 0) CHECK(kept > 0);
  if (clipped_speculations > 0) CHECK(rolled_back > 0);
  if (clipping == Clipping::kAlternating) CHECK(clipped_speculations == 2);
}

TEST_CASE("speculating or reading ahead on every step gives the same bits, whether clipping fires or not, with a "
          "pipeline of a few buffers and one that holds every sub-group",
          "[engine][zero][overlap][clipping]") {
  test::TempDir dir("strata-clip-overlap");
  const offload::OverlapPolicy policy = GENERATE(offload::OverlapPolicy::kSpeculate, offload::OverlapPolicy::kReadAhead);
  const size_t buffers = GENERATE(size_t{2}, size_t{64});
  CAPTURE(static_cast<int>(policy), buffers);
  const ClipRun plain =
      train_clipping(dir.path(), "plain", 2, Tier::kNvme, Clipping::kAlternating, false, policy, buffers);
  const ClipRun overlapped =
      train_clipping(dir.path(), "overlapped", 2, Tier::kNvme, Clipping::kAlternating, true, policy, buffers);
  check_same(overlapped.result, plain.result);
  check_same_files(overlapped.saved, plain.saved);
  int64_t read_ahead = 0, rolled_back = 0, prefetched = 0;
  for (size_t s = 0; s < overlapped.result.steps.size(); ++s) {
    CAPTURE(s);
    const engine::StepResult& r = overlapped.result.steps[s];
    REQUIRE(r.overlap_mode.has_value());
    read_ahead += r.sub_groups_read_ahead;
    rolled_back += r.rolled_back;
    prefetched += r.sub_groups_prefetched;
    // Speculating, the state of the sub-groups the previous backward
    // finalized last is read ahead of their gradients (none before a first
    // backward, none where a rolled-back step's count is not kept), in the
    // buffers the pipeline's two leave.
    CHECK(r.sub_groups_prefetched <= (r.rolled_back ? 0 : static_cast<int64_t>(buffers) - 2));
    if (s == 0) CHECK(r.sub_groups_prefetched == 0);
    if (policy == offload::OverlapPolicy::kReadAhead) {
      CHECK(*r.overlap_mode == offload::OverlapMode::kReadAhead);
      CHECK_FALSE(r.rolled_back);
      CHECK(r.sub_groups_overlapped == 0);
      CHECK(r.sub_groups_read_ahead <= static_cast<int64_t>(buffers));  // at most what the pipeline holds
    } else {
      CHECK(*r.overlap_mode == offload::OverlapMode::kSpeculate);
      CHECK(r.sub_groups_read_ahead == 0);
      if (r.rolled_back) CHECK(clips(Clipping::kAlternating, static_cast<int>(s)));
    }
  }
  if (policy == offload::OverlapPolicy::kReadAhead) {
    CHECK(read_ahead > 0);
    if (buffers == 64) CHECK(read_ahead > 2 * 5);  // more than 2 buffers could hold in 5 steps
    CHECK(prefetched == 0);
  } else {
    CHECK(rolled_back > 0);
    CHECK((prefetched > 0) == (buffers > 2));
  }
}

// (Speculating at stage 3, an update during the first backward lands in the
// home the next micro-step's forward gathers from, which no rollback undoes:
// there prepare_step must precede the last micro-step. Stage 2's forward reads
// the full copies, refreshed only by step().)
TEST_CASE("more than one backward after prepare_step: the statistics taken during the first are retaken, the step "
          "is bit for bit the unoverlapped one (reading ahead, and speculating at stage 2)",
          "[engine][zero][overlap][clipping]") {
  test::TempDir dir("strata-clip-overlap");
  const Tier optimizer = GENERATE(Tier::kCpu, Tier::kNvme);
  const offload::OverlapPolicy policy = GENERATE(offload::OverlapPolicy::kSpeculate, offload::OverlapPolicy::kReadAhead);
  const int stage = policy == offload::OverlapPolicy::kSpeculate ? 2 : 3;
  CAPTURE(tier_name(optimizer), static_cast<int>(policy), stage);
  TrainSpec spec = spec_for(
      options(stage, Tier::kDevice, optimizer, optimizer == Tier::kNvme && stage == 3 ? Tier::kNvme : Tier::kDevice,
              dir.path()),
      DType::kBF16);
  spec.micro_steps = 2;
  spec.prepare_micro = 0;  // two backwards follow it
  spec.options.gradient_clipping = 1e9;
  spec.overlap_policy = policy;
  spec.options.overlap_optimizer = false;
  const TrainResult plain = train_zero(spec);
  spec.options.overlap_optimizer = true;
  const TrainResult overlapped = train_zero(spec);
  check_same(overlapped, plain);
}
