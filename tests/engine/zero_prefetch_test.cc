// The stage-3 parameter coordinator (operator trace and nc/cg/gg prefetch):
//  - OperatorTrace on its own: recording, following, next uses and reuse
//    distances, and the three ways a step diverges;
//  - prefetch changes when bytes move, never the result: bit-identical to
//    prefetch off for device, cpu and nvme homes (2 ranks, 3 steps), also with
//    tight budgets and little staging;
//  - after the first step most fetches were issued ahead, and the gathered
//    bytes never exceed stage3_max_live_parameters;
//  - a step with another operator sequence drops the trace with one log line
//    per engine and still gives the same result;
//  - an NVMe read error during prefetch is the failing rank's step error
//    (naming the file), and its peer fails within the timeout: no hang.
#include <catch2/catch.hpp>

#include <spdlog/sinks/ostream_sink.h>


#include <cerrno>
#include <chrono>
#include <filesystem>
#include <sstream>
#include <thread>
#include <string>
#include <vector>

#include "nvme/io_backend.h"
#include "core/error.h"
#include "core/log.h"
#include "offload/operator_trace.h"
#include "tests/engine/zero_training.h"
#include "tests/support/temp_dir.h"

namespace {
using namespace strata;
using namespace strata::test::zero;
using offload::OperatorTrace;
using engine::Phase;

// Captures the process logger's lines while alive (info level).
struct LogCapture {
  std::ostringstream out;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  spdlog::level::level_enum level = logger().level();
  LogCapture() {
    logger().set_level(spdlog::level::info);
    logger().sinks().push_back(sink);
  }
  ~LogCapture() {
    auto& sinks = logger().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink), sinks.end());
    logger().set_level(level);
  }
  int count(const std::string& needle) {
    std::istringstream lines(out.str());
    int n = 0;
    for (std::string line; std::getline(lines, line);) n += line.find(needle) != std::string::npos;
    return n;
  }
};

int64_t sum(const std::vector<engine::PrefetchStats>& steps, int64_t (engine::PrefetchStats::*f)() const, size_t from) {
  int64_t n = 0;
  for (size_t s = from; s < steps.size(); ++s) n += (steps[s].*f)();
  return n;
}

}  // namespace

TEST_CASE("operator trace: records a step, follows it, knows next uses, drops on any divergence", "[engine][zero]") {
  // Ops 0..3 with parameters {0}, {1, 2}, {0}, {} and sizes 10, 20, 30.
  const std::vector<std::vector<engine::ParamId>> params{{0}, {1, 2}, {0}, {}};
  OperatorTrace trace([&](engine::OpId op) -> const std::vector<engine::ParamId>& { return params[op]; },
                      [](engine::ParamId p) { return int64_t{10} * (p + 1); });
  const std::vector<OperatorTrace::Entry> step{
      {0, Phase::kForward}, {1, Phase::kForward}, {2, Phase::kBackward}, {1, Phase::kRecompute}, {3, Phase::kBackward}};
  CHECK(trace.state() == OperatorTrace::State::kRecording);
  for (const auto& e : step) CHECK(trace.advance(e.op, e.phase).position == OperatorTrace::npos);
  CHECK_FALSE(trace.end_step());
  REQUIRE(trace.following());
  REQUIRE(trace.size() == step.size());
  // Passes: forward (0, 1), backward (2, 3 recompute counts as backward's, 4).
  CHECK(trace.pass_of(1) == 0);
  CHECK(trace.pass_of(2) == 1);
  CHECK(trace.pass_of(4) == 1);
  CHECK(trace.backward_pass(3));
  // Param 0 (op 0 at entry 0) is used next at entry 2; in between entry 1 fetches 20 + 30.
  CHECK(trace.next_use(0, 0) == 2);
  CHECK(trace.numel_between(0, 2) == 50);
  CHECK(trace.next_use(1, 0) == 3);  // param 1: entries 1 and 3
  CHECK(trace.next_use(2, 0) == OperatorTrace::npos);
  for (size_t i = 0; i < step.size(); ++i) CHECK(trace.advance(step[i].op, step[i].phase).position == i);
  CHECK_FALSE(trace.end_step());
  CHECK(trace.following());

  // Another phase at entry 2: dropped there, nothing followed until the next step records.
  trace.advance(0, Phase::kForward);
  trace.advance(1, Phase::kForward);
  const auto diverged = trace.advance(2, Phase::kForward);
  CHECK(diverged.dropped);
  CHECK(diverged.at == 2);
  REQUIRE(diverged.expected);
  CHECK(*diverged.expected == step[2]);
  CHECK(diverged.backward_pass);
  CHECK(diverged.trace_size == step.size());
  CHECK(trace.drops() == 1);
  CHECK(trace.advance(1, Phase::kRecompute).position == OperatorTrace::npos);
  CHECK_FALSE(trace.advance(3, Phase::kBackward).dropped);  // once per step
  CHECK_FALSE(trace.end_step());
  CHECK(trace.state() == OperatorTrace::State::kRecording);
  // The next step records the shorter sequence; a step that ends early diverges at the boundary.
  trace.advance(0, Phase::kForward);
  trace.advance(1, Phase::kForward);
  CHECK_FALSE(trace.end_step());
  REQUIRE(trace.following());
  trace.advance(0, Phase::kForward);
  CHECK(trace.end_step());
  CHECK(trace.ended_early().at == 1);
  CHECK(trace.drops() == 2);
  CHECK(trace.state() == OperatorTrace::State::kRecording);
  // Past the end.
  trace.advance(0, Phase::kForward);
  CHECK_FALSE(trace.end_step());
  const auto past = trace.advance(0, Phase::kForward);
  CHECK_FALSE(past.dropped);
  const auto beyond = trace.advance(1, Phase::kForward);
  CHECK(beyond.dropped);
  CHECK_FALSE(beyond.expected);
}

TEST_CASE("prefetch changes when bytes move, not the result: device, cpu and nvme homes, 2 ranks, 3 steps",
          "[engine][zero][nvme]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-zero-prefetch");
  for (Tier tier : {Tier::kDevice, Tier::kCpu, Tier::kNvme}) {
    for (bool tied : {false, true}) {
      CAPTURE(tier_name(tier), tied);
      TrainSpec on;
      on.world = 2;
      on.tied = tied;
      on.options = options_for(3);
      on.options.param_tier = tier;
      on.options.nvme_path = dir.path();
      TrainSpec off = on;
      off.options = prefetch_off(on.options);
      const TrainResult a = train_zero(off), b = train_zero(on);
      CHECK(compare(b, a).identical);
      CHECK(b.losses == a.losses);
      // Prefetch really ran: the steps after the first followed the trace and
      // fetched ahead; with it off every fetch was on demand.
      REQUIRE(b.prefetch.size() == 3);
      CHECK_FALSE(b.prefetch[0].trace_followed);
      CHECK(b.prefetch[1].trace_followed);
      CHECK(b.prefetch[2].trace_followed);
      CHECK(b.prefetch[1].prefetched() > 0);
      CHECK(sum(a.prefetch, &engine::PrefetchStats::prefetched, 0) == 0);
      if (tier == Tier::kNvme) {
        // The default bucket covers this whole model: gg issues every gather
        // at the first window, their reads queue for the five staging buffers
        // and the host never waits for one.
        CHECK(b.prefetch[1].reads > 0);
        CHECK(b.prefetch[1].reads_deferred > 0);
        CHECK(b.prefetch[1].blocked_waits == 0);
        CHECK(a.prefetch[1].reads_ahead == 0);
      } else {
        CHECK(b.prefetch[1].reads == 0);
      }
    }
  }
  // Tight budgets (a prefetch bucket of two gathered parameters, little live
  // room, no reuse), activation checkpointing (recompute windows), and an nvme
  // home with two staging buffers (gathers wait for buffers; nc stops early).
  TrainSpec tight;
  tight.world = 2;
  tight.tied = true;
  tight.checkpoint_activations = true;
  tight.options = options_for(3);
  tight.options.param_tier = Tier::kNvme;
  tight.options.nvme_path = dir.path();
  tight.options.prefetch_bucket_numel = 2 * 2048;
  tight.options.max_live_parameters_numel = 5 * 2048;
  tight.options.max_reuse_distance_numel = 0;
  tight.options.param_buffer_count = 2;
  TrainSpec tight_off = tight;
  tight_off.options = prefetch_off(tight.options);
  const TrainResult a = train_zero(tight_off), b = train_zero(tight);
  CHECK(compare(b, a).identical);
  CHECK(b.losses == a.losses);
  CHECK(b.prefetch[2].trace_followed);
  CHECK(b.prefetch[2].prefetched() > 0);
  CHECK(b.peak_gathered_nbytes <= 5 * 2048 * sizeof(float));
}

TEST_CASE("after the first step most fetches are prefetched, gathered bytes stay within max_live_parameters",
          "[engine][zero][nvme]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-zero-prefetch-stats");
  for (Tier tier : {Tier::kCpu, Tier::kNvme}) {
    CAPTURE(tier_name(tier));
    // Every parameter of this model gathers to 2048 elements on 2 ranks (one
    // 4 KiB-aligned slice per rank); no operator lists more than one.
    constexpr int64_t kGathered = 2048;
    TrainSpec spec;
    spec.world = 2;
    spec.steps = 4;
    spec.tied = true;
    spec.options = options_for(3);
    spec.options.param_tier = tier;
    spec.options.nvme_path = dir.path();
    spec.options.max_live_parameters_numel = 4 * kGathered;
    const TrainResult r = train_zero(spec);
    for (size_t s = 0; s < r.prefetch.size(); ++s) {
      const engine::PrefetchStats& p = r.prefetch[s];
      INFO("step " << s << ": " << p.windows << " windows, fetches " << p.fetches() << " (ready "
                   << p.prefetched_ready << ", in flight " << p.prefetched_in_flight << ", on demand " << p.on_demand
                   << "), reused " << p.reused << ", gathers " << p.gathers << ", reads " << p.reads << " (ahead "
                   << p.reads_ahead << "), blocked " << p.blocked_waits << " times / " << p.blocked_seconds
                   << " s, peak " << p.peak_gathered_nbytes << " B");
      CHECK(p.peak_gathered_nbytes <= static_cast<size_t>(4 * kGathered) * sizeof(float));
      CHECK(p.windows > 0);
      if (s == 0) {
        CHECK(p.prefetched() == 0);  // recording
        CHECK(p.on_demand == p.fetches());
        continue;
      }
      CHECK(p.trace_followed);
      // Only the step's first operator cannot be fetched ahead (nothing
      // prefetches across the optimizer step, which changes every shard).
      CHECK(p.on_demand <= 1);
      CHECK(p.prefetched() >= 9 * p.fetches() / 10);
      if (tier == Tier::kNvme) {
        CHECK(p.reads_ahead > 0);  // nc ran ahead of gg (whose bucket is bounded by max_live here)
        CHECK(p.blocked_waits == 0);
      }
    }
    CHECK(r.peak_gathered_nbytes <= static_cast<size_t>(4 * kGathered) * sizeof(float));
    CHECK(r.peak_gathered_nbytes > static_cast<size_t>(kGathered) * sizeof(float));  // it did run ahead

    // The default budget holds far more at once (everything is kept for reuse
    // in this tiny model): the limit above really bound.
    TrainSpec loose = spec;
    loose.options.max_live_parameters_numel = 1'000'000'000;
    const TrainResult l = train_zero(loose);
    CHECK(l.peak_gathered_nbytes > r.peak_gathered_nbytes);
    CHECK(compare(l, r).identical);
  }
}

TEST_CASE("a step with another operator sequence drops the trace with one log line and the same result",
          "[engine][zero][nvme]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-zero-prefetch-diverge");
  // Tight: gg two parameters ahead, nc filling two staging buffers beyond it,
  // so the diverging window finds buffers held by reads for the lost future.
  for (auto [tier, tight] : {std::pair{Tier::kDevice, false}, std::pair{Tier::kNvme, false},
                             std::pair{Tier::kNvme, true}}) {
    CAPTURE(tier_name(tier), tight);
    TrainSpec spec;
    spec.world = 2;
    spec.steps = 4;
    spec.options = options_for(3);
    spec.options.param_tier = tier;
    spec.options.nvme_path = dir.path();
    if (tight) {
      spec.options.max_live_parameters_numel = 3 * 2048;
      spec.options.param_buffer_count = 2;
    }
    spec.eval_before = {1};  // step 1 starts with an evaluation forward (lm_head forward, no loss backward)
    TrainSpec off = spec;
    off.options = prefetch_off(spec.options);
    const TrainResult a = train_zero(off);
    LogCapture log;
    const TrainResult b = train_zero(spec);
    CHECK(compare(b, a).identical);
    CHECK(b.losses == a.losses);
    INFO(log.out.str());
    CHECK(log.count("operator trace:") == 2);  // one line per engine (2 ranks)
    CHECK(log.count("diverged at window") == 2);
    CHECK(b.trace_drops == 1);
    REQUIRE(b.prefetch.size() == 4);
    const engine::PrefetchStats& dropped = b.prefetch[1];
    INFO("diverged step: " << dropped.windows << " windows, fetches " << dropped.fetches() << " (prefetched "
                           << dropped.prefetched() << ", on demand " << dropped.on_demand << "), reads "
                           << dropped.reads << " (ahead " << dropped.reads_ahead << ", deferred "
                           << dropped.reads_deferred << "), blocked " << dropped.blocked_waits << " times");
    CHECK(b.prefetch[1].trace_dropped);
    CHECK_FALSE(b.prefetch[1].trace_followed);
    CHECK_FALSE(b.prefetch[2].trace_followed);  // records afresh
    CHECK(b.prefetch[3].trace_followed);
    CHECK(b.prefetch[3].prefetched() > 0);
  }
}

TEST_CASE("an evaluation pass between steps leaves the trace alone: no divergence, the next steps follow it",
          "[engine][zero][prefetch]") {
  ops::set_cpu_threads(1);
  for (Tier tier : {Tier::kDevice, Tier::kNvme}) {
    CAPTURE(tier_name(tier));
    test::TempDir dir("strata-zero-eval");
    TrainSpec spec;
    spec.world = 2;
    spec.steps = 4;
    spec.options = options_for(3);
    spec.options.param_tier = tier;
    spec.options.nvme_path = dir.path();
    spec.eval_before = {1, 2};
    spec.eval_marked = true;
    TrainSpec off = spec;
    off.options = prefetch_off(spec.options);
    const TrainResult a = train_zero(off);
    LogCapture log;
    const TrainResult b = train_zero(spec);
    CHECK(compare(b, a).identical);
    CHECK(b.losses == a.losses);
    INFO(log.out.str());
    CHECK(log.count("operator trace:") == 0);
    CHECK(b.trace_drops == 0);
    REQUIRE(b.prefetch.size() == 4);
    for (size_t s = 1; s < 4; ++s) {
      CAPTURE(s);
      CHECK(b.prefetch[s].trace_followed);
      CHECK(b.prefetch[s].prefetched() > 0);
    }
  }
}

TEST_CASE("an NVMe read error during prefetch is that rank's step error, and its peer fails in time, not a hang",
          "[engine][zero][nvme]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-zero-prefetch-eio");
  TrainSpec spec;
  spec.world = 2;
  spec.steps = 3;
  spec.options = options_for(3);
  spec.options.param_tier = Tier::kNvme;
  spec.options.nvme_path = dir.path();
  spec.timeout = std::chrono::milliseconds(5000);
  // Rank 0's reads through step 0 (its on-demand reads, then the optimizer's
  // read of the shard at the step): the fault starts a few reads into step 1,
  // which follows the trace, so it hits a prefetch read.
  const TrainResult clean = train_zero(spec);
  REQUIRE(clean.prefetch.size() == 3);
  REQUIRE(clean.prefetch[1].reads > 5);
  // Reads before step 1: initialize_parameters' read-modify-write of each
  // owned slice, step 0's reads, the optimizer's read of the shard.
  const uint64_t step0_reads = clean.params.size() + static_cast<uint64_t>(clean.prefetch[0].reads) + 1;
  auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{nvme::IoFault{
      .nth = step0_reads + 4, .kind = nvme::IoFault::Kind::kError, .error = EIO, .op = nvme::IoOp::kRead,
      .repeat = true}});
  test::zero::use_io_faults(spec, plan, /*only=*/0);
  spec.collect_errors = true;
  const auto start = std::chrono::steady_clock::now();
  const TrainResult r = train_zero(spec);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(plan->fired() >= 1);
  REQUIRE(r.errors[0] != nullptr);
  CHECK(r.failed_step[0] == 1);
  try {
    std::rethrow_exception(r.errors[0]);
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.category() == ErrorCategory::kIo);
    CHECK_THAT(std::string(e.what()), Catch::Contains("param") && Catch::Contains(".swp") &&
                                          Catch::Contains("offset") && Catch::Contains("EIO"));
  }
  // The peer is left waiting in an allgather: it fails within the timeout.
  REQUIRE(r.errors[1] != nullptr);
  CHECK(r.failed_step[1] == 1);
  try {
    std::rethrow_exception(r.errors[1]);
  } catch (const Error& e) {
    INFO(e.what());
    CHECK((e.category() == ErrorCategory::kCommunication || e.category() == ErrorCategory::kIo));
  }
  CHECK(seconds < 30);
}

TEST_CASE("staging held by reads for a future that does not come: a diverging window takes a buffer back, right values",
          "[engine][zero][nvme]") {
  // One rank, ops {p0}, {p0}, {p1}, {p2}, {p3}; live room for one parameter
  // (gg never runs ahead), two staging buffers. Step 2 follows the trace with
  // pauses (the streams catch up, so nc finds its buffers free): at op 1 p0 is
  // reused, nc holds both buffers for p1 and p2 — then the step diverges to
  // op 4, whose read needs a buffer: one staged read is given up.
  test::TempDir dir("strata-zero-prefetch-evict");
  engine::PrefetchStats before, after;
  int64_t drops = 0;
  std::vector<std::string> wrong;  // values a window saw that were not the parameter's
  test::run_zero_ranks(1, [&](int, Accelerator& accelerator, engine::ZeroComms comms) {
    engine::ZeroEngineOptions o = options_for(3);
    o.adam.weight_decay = 0;  // zero gradients: the step leaves every value as it was
    o.param_tier = Tier::kNvme;
    o.nvme_path = dir.path();
    o.max_live_parameters_numel = 1024;  // one 1024-element parameter
    o.param_buffer_count = 2;
    engine::ZeroEngine eng(accelerator, comms, o);
    std::vector<engine::ParamId> p;
    for (int i = 0; i < 4; ++i) p.push_back(eng.declare_parameter({fmt::format("p{}", i), DType::kF32, {1024}, std::nullopt}));
    const std::vector<engine::OpId> op{eng.declare_operator("a", {p[0]}), eng.declare_operator("a_again", {p[0]}),
                                       eng.declare_operator("b", {p[1]}), eng.declare_operator("c", {p[2]}),
                                       eng.declare_operator("d", {p[3]})};
    eng.finalize();
    for (int i = 0; i < 4; ++i) {
      eng.for_each_owned_range(p[i], engine::Engine::Access::kWrite, [&](int64_t first, const TensorView& host) {
        for (int64_t k = 0; k < host.numel(); ++k) host.as<float>()[k] = static_cast<float>(1000 * i + first + k);
      });
    }
    const auto run = [&](int o_index, int param_index) {
      eng.pre_op(op[o_index], Phase::kForward);
      const TensorView full = eng.param(p[param_index]);
      eng.compute_stream().synchronize();
      for (int64_t k = 0; k < full.numel(); ++k) {
        if (full.as<float>()[k] != static_cast<float>(1000 * param_index + k)) {
          wrong.push_back(fmt::format("op {} sees element {} of p{} = {}", o_index, k, param_index, full.as<float>()[k]));
          break;
        }
      }
      eng.post_op(op[o_index], Phase::kForward);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    };
    for (auto [o_index, param_index] : {std::pair{0, 0}, {1, 0}, {2, 1}, {3, 2}}) run(o_index, param_index);
    eng.step(0.1f);
    run(0, 0);
    run(1, 0);
    before = eng.current_prefetch();
    run(4, 3);  // diverges: every buffer holds a staged read
    after = eng.current_prefetch();
    run(2, 1);  // on demand now (one of them was given up), still the right values
    run(3, 2);
    eng.step(0.1f);
    drops = eng.trace_drops();
  });
  std::string what;
  for (const auto& w : wrong) what += w + "\n";
  INFO(what);
  CHECK(wrong.empty());
  CHECK(before.reads_ahead == 2);  // p1 and p2, into both buffers
  CHECK(before.reused == 1);
  CHECK(after.trace_dropped);
  CHECK(after.blocked_waits == 1);
  CHECK(drops == 1);
}
