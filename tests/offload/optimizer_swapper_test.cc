// The optimizer swapper: NVMe-resident state (real O_DIRECT files, real
// io_uring) gives bit-identical results to CPU-resident state over several
// steps; a failed write makes step() raise and leaves the committed state on
// disk intact and loadable; the pipeline never holds more than the pool.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "nvme/aio_handle.h"
#include "nvme/io_backend.h"
#include "offload/optimizer_swapper.h"
#include "offload/pinned_pool.h"
#include "core/durable_file.h"
#include "core/error.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace std::chrono_literals;

namespace {

// 47,011 elements in sub-groups of 10,000: four full and one ragged sub-group;
// each record (120,000 bytes, 120 KiB on disk) is one I/O piece.
constexpr size_t kNumel = 47011;
constexpr size_t kSubGroup = 10000;

std::vector<float> random_floats(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

std::vector<BFloat16> grad_for_step(int step) {
  const auto g = random_floats(kNumel, 1000u + static_cast<uint32_t>(step), 2.0f);
  std::vector<BFloat16> out(kNumel);
  convert(g.data(), DType::kF32, out.data(), DType::kBF16, kNumel);
  return out;
}

offload::OptimizerSwapperOptions options_for(Tier tier, const std::filesystem::path& dir) {
  offload::OptimizerSwapperOptions o;
  o.numel = kNumel;
  o.sub_group_numel = kSubGroup;
  o.state_tier = tier;
  o.adam.lr = 1e-2f;
  o.adam.weight_decay = 0.01f;
  o.nvme_path = dir;
  return o;
}

struct State {
  std::vector<float> p, m, v;
  std::vector<BFloat16> p16;
};

State load(offload::OptimizerSwapper& s) {
  State st{std::vector<float>(kNumel), std::vector<float>(kNumel), std::vector<float>(kNumel), {}};
  s.load_state(st.p.data(), st.m.data(), st.v.data());
  return st;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Master weights and both moments are bit-identical.
void check_same_state(const State& got, const State& expect) {
  CHECK(same_bits(got.p, expect.p));
  CHECK(same_bits(got.m, expect.m));
  CHECK(same_bits(got.v, expect.v));
}

offload::StepInputs inputs(const std::vector<BFloat16>& grad, std::vector<BFloat16>& p16) {
  offload::StepInputs in;
  in.grad = grad.data();
  in.grad_dtype = DType::kBF16;
  in.grad_scale = 0.5f;
  in.param16 = p16.data();
  in.param16_dtype = DType::kBF16;
  return in;
}

// Steps every swapper through steps first..last with the same gradients.
void step_all(std::initializer_list<offload::OptimizerSwapper*> swappers, int first, int last,
              std::vector<BFloat16>& p16) {
  for (int step = first; step <= last; ++step) {
    const auto grad = grad_for_step(step);
    for (auto* swapper : swappers) swapper->step(inputs(grad, p16));
  }
}

}  // namespace

TEST_CASE("nvme-resident optimizer state is bit-identical to cpu-resident state", "[offload][swapper]") {
  test::TempDir dir("strata-swap");
  offload::PinnedBufferPool pool({3, offload::OptimizerSwapper::record_nbytes(kSubGroup), 10000ms});
  nvme::AioHandle aio(nvme::AioOptions{});
  offload::OptimizerSwapper cpu(options_for(Tier::kCpu, {}), nullptr, nullptr);
  offload::OptimizerSwapper disk(options_for(Tier::kNvme, dir.path()), &pool, &aio);
  REQUIRE(disk.sub_group_count() == 5);
  const auto master = random_floats(kNumel, 1, 1.0f);
  cpu.initialize(master.data());
  disk.initialize(master.data());
  CHECK(same_bits(load(disk).p, master));

  std::vector<BFloat16> p16_cpu(kNumel), p16_disk(kNumel);
  for (int step = 1; step <= 4; ++step) {
    const auto grad = grad_for_step(step);
    cpu.step(inputs(grad, p16_cpu));
    disk.step(inputs(grad, p16_disk));
    CAPTURE(step);
    REQUIRE(disk.step_count() == step);
    const State a = load(cpu), b = load(disk);
    REQUIRE(same_bits(a.p, b.p));
    REQUIRE(same_bits(a.m, b.m));
    REQUIRE(same_bits(a.v, b.v));
    REQUIRE(std::memcmp(p16_cpu.data(), p16_disk.data(), kNumel * 2) == 0);
    // The 16-bit copy was written in the same pass from the new master.
    REQUIRE(p16_disk[kNumel - 1].bits == float_to_bf16(b.p[kNumel - 1]).bits);
    REQUIRE_FALSE(same_bits(a.p, master));
    const auto& t = disk.last_timings();
    CHECK(t.sub_groups == 5);
    CHECK(t.bytes_read == 4 * offload::OptimizerSwapper::record_nbytes(kSubGroup) + offload::OptimizerSwapper::record_nbytes(kNumel - 4 * kSubGroup));
    CHECK(t.bytes_written == t.bytes_read);
  }
  // Read k+1, update k, write k-1: three buffers, never more.
  CHECK(pool.stats().peak_in_use == 3);
  CHECK(pool.stats().in_use == 0);
  CHECK(pool.stats().timeouts == 0);
}

TEST_CASE("the pipeline works with only two pool buffers (less overlap, same result)", "[offload][swapper]") {
  test::TempDir dir("strata-swap");
  offload::PinnedBufferPool pool({2, offload::OptimizerSwapper::record_nbytes(kSubGroup), 10000ms});
  nvme::AioHandle aio(nvme::AioOptions{});
  offload::OptimizerSwapper cpu(options_for(Tier::kCpu, {}), nullptr, nullptr);
  offload::OptimizerSwapper disk(options_for(Tier::kNvme, dir.path()), &pool, &aio);
  const auto master = random_floats(kNumel, 2, 1.0f);
  cpu.initialize(master.data());
  disk.initialize(master.data());
  std::vector<BFloat16> p16(kNumel);
  step_all({&cpu, &disk}, 1, 2, p16);
  REQUIRE(same_bits(load(cpu).p, load(disk).p));
  CHECK(pool.stats().peak_in_use == 2);
}

TEST_CASE("a failed nvme write makes step() raise and keeps the previous state loadable", "[offload][swapper]") {
  test::TempDir dir("strata-swap");
  offload::PinnedBufferPool pool({3, offload::OptimizerSwapper::record_nbytes(kSubGroup), 10000ms});
  // Writes: 5 (initialize) + 5 + 5 (two good steps); the 2nd write of step 3 fails with EIO.
  auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{
      nvme::IoFault{17, nvme::IoFault::Kind::kError, 5, 0, nvme::IoOp::kWrite, false}});
  nvme::AioOptions aio_options;
  nvme::AioHandle faulty(aio_options, nvme::make_fault_backend(nvme::make_backend(aio_options.engine), plan));

  offload::OptimizerSwapper cpu(options_for(Tier::kCpu, {}), nullptr, nullptr);
  auto disk_options = options_for(Tier::kNvme, dir.path());
  disk_options.keep_files = true;
  offload::OptimizerSwapper disk(disk_options, &pool, &faulty);
  const auto master = random_floats(kNumel, 3, 1.0f);
  cpu.initialize(master.data());
  disk.initialize(master.data());
  std::vector<BFloat16> p16(kNumel);
  step_all({&cpu, &disk}, 1, 2, p16);
  const State after_two = load(cpu);

  const auto grad3 = grad_for_step(3);
  try {
    disk.step(inputs(grad3, p16));
    FAIL("step() returned although a write failed");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::kIo);
    CHECK_THAT(e.what(), Catch::Contains("slot"));  // names the file
  }
  CHECK(plan->fired() == 1);
  CHECK(disk.step_count() == 2);
  CHECK(pool.stats().in_use == 0);  // every buffer came back after the failure
  {
    const State now = load(disk);
    check_same_state(now, after_two);
  }

  // A new process-like swapper over the same files resumes at step 2 and
  // continues exactly like the cpu-resident run.
  nvme::AioHandle aio(nvme::AioOptions{});
  auto resume_options = options_for(Tier::kNvme, dir.path());
  resume_options.resume = true;
  offload::OptimizerSwapper resumed(resume_options, &pool, &aio);
  REQUIRE(resumed.step_count() == 2);
  const State loaded = load(resumed);
  check_same_state(loaded, after_two);
  std::vector<BFloat16> p16_cpu(kNumel);
  cpu.step(inputs(grad3, p16_cpu));
  resumed.step(inputs(grad3, p16));
  CHECK(same_bits(load(resumed).p, load(cpu).p));
}

TEST_CASE("a batch's state writes go on after update_sub_groups returns: a later call, commit_step or abort_step "
          "waits for them, and a failed one fails the step with the committed state kept",
          "[offload][swapper]") {
  test::TempDir dir("strata-swap");
  offload::PinnedBufferPool pool({3, offload::OptimizerSwapper::record_nbytes(kSubGroup), 10000ms});
  // Writes: 5 (initialize), 5 (step 1), 1 and 3 (step 2 abandoned twice),
  // then step 2 again. The first write of step 1 and of the first abandoned
  // step is held a second before it reaches the disk; the third of step 2
  // again fails.
  auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{
      nvme::IoFault{6, nvme::IoFault::Kind::kSlow, 0, 0, nvme::IoOp::kWrite, false, 1000ms},
      nvme::IoFault{11, nvme::IoFault::Kind::kSlow, 0, 0, nvme::IoOp::kWrite, false, 1000ms},
      nvme::IoFault{17, nvme::IoFault::Kind::kError, 5, 0, nvme::IoOp::kWrite, false}});
  nvme::AioOptions aio_options;
  nvme::AioHandle aio(aio_options, nvme::make_fault_backend(nvme::make_backend(aio_options.engine), plan));
  offload::OptimizerSwapper whole(options_for(Tier::kCpu, {}), nullptr, nullptr);
  offload::OptimizerSwapper parts(options_for(Tier::kNvme, dir.path()), &pool, &aio);
  const auto master = random_floats(kNumel, 4, 1.0f);
  whole.initialize(master.data());
  parts.initialize(master.data());
  std::vector<BFloat16> p16_whole(kNumel), p16_parts(kNumel);

  // Step 1: the first batch returns with its (held) write in flight, its
  // buffer still taken; the later batches and the commit wait for it.
  const auto grad1 = grad_for_step(1);
  whole.step(inputs(grad1, p16_whole));
  parts.begin_step(inputs(grad1, p16_parts), /*revocable=*/false);
  parts.update_sub_groups(std::vector<size_t>{4});
  CHECK(pool.stats().in_use == 1);  // the update waited for its new values only, not for the held write
  parts.update_sub_groups(std::vector<size_t>{3, 2, 1, 0});
  parts.commit_step();
  CHECK(pool.stats().in_use == 0);
  REQUIRE(parts.step_count() == 1);
  check_same_state(load(parts), load(whole));
  REQUIRE(std::memcmp(p16_whole.data(), p16_parts.data(), kNumel * 2) == 0);

  // Step 2, abandoned with its write in flight: abort waits for it, every
  // buffer comes back, the committed state is step 1's.
  const State after_one = load(parts);
  const auto grad2 = grad_for_step(2);
  parts.begin_step(inputs(grad2, p16_parts), /*revocable=*/false);
  parts.update_sub_groups(std::vector<size_t>{4});
  CHECK(pool.stats().in_use == 1);
  parts.abort_step();
  CHECK(pool.stats().in_use == 0);
  check_same_state(load(parts), after_one);

  // finish_writes gives the buffers back with the step still open (another
  // swapper sharing the pool needs them).
  parts.begin_step(inputs(grad2, p16_parts), /*revocable=*/false);
  parts.update_sub_groups(std::vector<size_t>{4, 3, 2});
  parts.finish_writes();
  CHECK(pool.stats().in_use == 0);
  CHECK(parts.step_open());
  parts.abort_step();
  check_same_state(load(parts), after_one);

  // Step 2 again; its third write fails: the step raises it (from the batch
  // that met it or from the commit) and keeps step 1's state.
  parts.begin_step(inputs(grad2, p16_parts), /*revocable=*/false);
  try {
    parts.update_sub_groups(std::vector<size_t>{4, 3});
    parts.update_sub_groups(std::vector<size_t>{2, 1, 0});
    parts.commit_step();
    FAIL("the step committed although a state write failed");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::kIo);
    CHECK_THAT(e.what(), Catch::Contains("slot"));
  }
  parts.abort_step();  // closes it where the batch raised; a no-op where the commit did
  CHECK(plan->fired() == 3);
  CHECK(pool.stats().in_use == 0);
  CHECK(parts.step_count() == 1);
  check_same_state(load(parts), after_one);
}

TEST_CASE("a new run's failed initialize leaves an earlier run's committed state resumable", "[offload][swapper]") {
  test::TempDir dir("strata-swap");
  offload::PinnedBufferPool pool({3, offload::OptimizerSwapper::record_nbytes(kSubGroup), 10000ms});
  offload::OptimizerSwapper cpu(options_for(Tier::kCpu, {}), nullptr, nullptr);
  const auto master = random_floats(kNumel, 3, 1.0f);
  cpu.initialize(master.data());
  std::vector<BFloat16> p16(kNumel);
  {
    // Run 1: initialize + 2 steps = generation 3, so slot 1 is committed — the
    // slot a fresh initialize (generation 0 -> 1) would naively write.
    nvme::AioHandle aio(nvme::AioOptions{});
    auto options = options_for(Tier::kNvme, dir.path());
    options.keep_files = true;
    offload::OptimizerSwapper run1(options, &pool, &aio);
    run1.initialize(master.data());
    step_all({&cpu, &run1}, 1, 2, p16);
  }
  const State after_two = load(cpu);
  {
    // Run 2 forgets resume and initializes other weights; its 2nd write fails.
    auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{
        nvme::IoFault{2, nvme::IoFault::Kind::kError, 5, 0, nvme::IoOp::kWrite, false}});
    nvme::AioOptions aio_options;
    nvme::AioHandle faulty(aio_options, nvme::make_fault_backend(nvme::make_backend(aio_options.engine), plan));
    auto options = options_for(Tier::kNvme, dir.path());
    options.keep_files = true;
    offload::OptimizerSwapper run2(options, &pool, &faulty);
    const auto other = random_floats(kNumel, 4, 1.0f);
    CHECK_THROWS_AS(run2.initialize(other.data()), Error);
    CHECK(plan->fired() == 1);
  }
  // Run 3 resumes run 1's state, untouched.
  nvme::AioHandle aio(nvme::AioOptions{});
  auto resume_options = options_for(Tier::kNvme, dir.path());
  resume_options.resume = true;
  offload::OptimizerSwapper run3(resume_options, &pool, &aio);
  REQUIRE(run3.step_count() == 2);
  const State loaded = load(run3);
  check_same_state(loaded, after_two);
}

TEST_CASE("swapper rejects a pool whose buffers cannot hold a sub-group", "[offload][swapper]") {
  test::TempDir dir("strata-swap");
  offload::PinnedBufferPool small({3, 4096, 100ms});
  nvme::AioHandle aio(nvme::AioOptions{});
  CHECK_THROWS_WITH(offload::OptimizerSwapper(options_for(Tier::kNvme, dir.path()), &small, &aio),
                    Catch::Contains("lower sub_group_size"));
  offload::PinnedBufferPool one({1, offload::OptimizerSwapper::record_nbytes(kSubGroup), 100ms});
  CHECK_THROWS_WITH(offload::OptimizerSwapper(options_for(Tier::kNvme, dir.path()), &one, &aio),
                    Catch::Contains("at least 2 pool buffers"));
  offload::OptimizerSwapper cpu(options_for(Tier::kCpu, {}), nullptr, nullptr);
  std::vector<BFloat16> grad(kNumel);
  CHECK_THROWS_WITH(cpu.step(inputs(grad, grad)), Catch::Contains("before initialize"));
}

TEST_CASE("resume without a committed state is an error naming the manifest", "[offload][swapper]") {
  test::TempDir dir("strata-swap");
  offload::PinnedBufferPool pool({2, offload::OptimizerSwapper::record_nbytes(kSubGroup), 100ms});
  nvme::AioHandle aio(nvme::AioOptions{});
  auto o = options_for(Tier::kNvme, dir.path());
  o.resume = true;
  CHECK_THROWS_WITH(offload::OptimizerSwapper(o, &pool, &aio), Catch::Contains("manifest.json"));
}

TEST_CASE("restore() of a saved state continues exactly like the swapper it was saved from", "[offload][swapper]") {
  for (Tier tier : {Tier::kCpu, Tier::kNvme}) {
    CAPTURE(tier_name(tier));
    test::TempDir dir("strata-swap");
    offload::PinnedBufferPool pool({3, offload::OptimizerSwapper::record_nbytes(kSubGroup), 10000ms});
    nvme::AioHandle aio(nvme::AioOptions{});
    const bool nvme = tier == Tier::kNvme;
    auto options = options_for(tier, dir.path());
    offload::OptimizerSwapper original(options, nvme ? &pool : nullptr, nvme ? &aio : nullptr);
    original.initialize(random_floats(kNumel, 2, 1.0f).data());
    std::vector<BFloat16> p16_a(kNumel), p16_b(kNumel);
    step_all({&original}, 1, 3, p16_a);
    const State saved = load(original);  // what a checkpoint keeps

    options.group = "restored";
    offload::OptimizerSwapper restored(options, nvme ? &pool : nullptr, nvme ? &aio : nullptr);
    restored.restore(
        [&](size_t first, size_t numel, float* p, float* m, float* v) {
          std::copy_n(saved.p.begin() + static_cast<std::ptrdiff_t>(first), numel, p);
          std::copy_n(saved.m.begin() + static_cast<std::ptrdiff_t>(first), numel, m);
          std::copy_n(saved.v.begin() + static_cast<std::ptrdiff_t>(first), numel, v);
        },
        original.step_count());
    CHECK(restored.step_count() == 3);
    check_same_state(load(restored), saved);
    step_all({&original}, 4, 6, p16_a);
    step_all({&restored}, 4, 6, p16_b);  // the bias corrections need the right step count
    check_same_state(load(restored), load(original));
    CHECK(std::memcmp(p16_a.data(), p16_b.data(), kNumel * 2) == 0);
  }
}

TEST_CASE("a step in parts (any order, batches) equals step(), abort restores the state exactly", "[offload][swapper]") {
  test::TempDir dir("strata-swap");
  const Tier tier = GENERATE(Tier::kCpu, Tier::kNvme);
  CAPTURE(tier_name(tier));
  offload::PinnedBufferPool pool({3, offload::OptimizerSwapper::record_nbytes(kSubGroup), 10000ms});
  nvme::AioHandle aio(nvme::AioOptions{});
  offload::OptimizerSwapper whole(options_for(Tier::kCpu, {}), nullptr, nullptr);
  offload::OptimizerSwapper parts(options_for(tier, dir.path()), tier == Tier::kNvme ? &pool : nullptr,
                                  tier == Tier::kNvme ? &aio : nullptr);
  const auto master = random_floats(kNumel, 1, 1.0f);
  whole.initialize(master.data());
  parts.initialize(master.data());
  std::vector<BFloat16> p16_whole(kNumel), p16_parts(kNumel);
  // Backward finishes the last sub-groups first, in batches.
  const std::vector<std::vector<size_t>> batches = {{4}, {3, 2}, {0, 1}};
  for (int step = 1; step <= 3; ++step) {
    CAPTURE(step);
    const auto grad = grad_for_step(step);
    whole.step(inputs(grad, p16_whole));
    // A revocable step updated in part, then aborted: the state is as before.
    const State before = load(parts);
    const auto other_grad = grad_for_step(100 + step);
    parts.begin_step(inputs(other_grad, p16_parts), /*revocable=*/true);
    parts.update_sub_groups(batches[0]);
    parts.update_sub_groups(batches[1]);
    CHECK(parts.updated(2));
    CHECK_FALSE(parts.updated(0));
    CHECK_THROWS_WITH(parts.update_sub_groups(std::vector<size_t>{3}), Catch::Contains("already updated"));
    CHECK_THROWS_WITH(parts.commit_step(), Catch::Contains("3 of 5 sub-groups"));
    parts.abort_step();
    CHECK_FALSE(parts.step_open());
    check_same_state(load(parts), before);
    CHECK(parts.step_count() == step - 1);
    // The real step, in parts.
    parts.begin_step(inputs(grad, p16_parts), /*revocable=*/true);
    for (const auto& batch : batches) parts.update_sub_groups(batch);
    parts.commit_step();
    REQUIRE(parts.step_count() == step);
    check_same_state(load(parts), load(whole));
    REQUIRE(std::memcmp(p16_whole.data(), p16_parts.data(), kNumel * 2) == 0);
  }
  // Misuse is refused, naming what was wrong.
  CHECK_THROWS_WITH(parts.update_sub_groups(std::vector<size_t>{0}), Catch::Contains("without begin_step"));
  std::vector<BFloat16> p16(kNumel);
  const auto grad = grad_for_step(9);
  parts.begin_step(inputs(grad, p16), false);
  CHECK_THROWS_WITH(parts.begin_step(inputs(grad, p16), false), Catch::Contains("already open"));
  CHECK_THROWS_WITH(parts.update_sub_groups(std::vector<size_t>{5}), Catch::Contains("out of range"));
  parts.abort_step();  // nothing updated: nothing to restore
}

TEST_CASE("state read ahead before the gradient scale is known, then updated with it, equals step(), and abort "
          "returns the buffers read into",
          "[offload][swapper]") {
  test::TempDir dir("strata-swap");
  offload::PinnedBufferPool pool({3, offload::OptimizerSwapper::record_nbytes(kSubGroup), 10000ms});
  nvme::AioHandle aio(nvme::AioOptions{});
  offload::OptimizerSwapper whole(options_for(Tier::kCpu, {}), nullptr, nullptr);
  offload::OptimizerSwapper parts(options_for(Tier::kNvme, dir.path()), &pool, &aio);
  const auto master = random_floats(kNumel, 2, 1.0f);
  whole.initialize(master.data());
  parts.initialize(master.data());
  std::vector<BFloat16> p16_whole(kNumel), p16_parts(kNumel);
  for (int step = 1; step <= 3; ++step) {
    CAPTURE(step);
    const auto grad = grad_for_step(step);
    offload::StepInputs clipped = inputs(grad, p16_whole);
    clipped.grad_scale = 0.125f * static_cast<float>(step);  // what the norm says, known only at the boundary
    whole.step(clipped);
    // A step read ahead and abandoned: every buffer back, nothing changed.
    const State before = load(parts);
    parts.begin_step(inputs(grad, p16_parts), /*revocable=*/false);
    CHECK_FALSE(parts.prefetch(4, /*keep_free=*/3));  // would leave fewer than 3 buffers free
    CHECK(parts.prefetch(4, /*keep_free=*/2));
    CHECK(parts.prefetched(4));
    CHECK_FALSE(parts.prefetched(1));
    CHECK_FALSE(parts.prefetch(4));  // once
    CHECK_FALSE(parts.prefetch(1, /*keep_free=*/2));
    CHECK(parts.prefetch(1));
    parts.abort_step();
    CHECK(pool.available() == 3);
    check_same_state(load(parts), before);
    // The real step: opened with the unclipped scale, sub-groups read ahead as
    // "backward" finishes them until the pool is empty, then the scale set.
    parts.begin_step(inputs(grad, p16_parts), /*revocable=*/false);
    CHECK(parts.prefetch(4));
    CHECK(parts.prefetch(3));
    CHECK(parts.prefetch(2));
    CHECK_FALSE(parts.prefetch(0));  // no buffer free: left to the pipeline
    CHECK(parts.prefetched() == std::vector<size_t>{2, 3, 4});
    offload::StepInputs real = inputs(grad, p16_parts);
    real.grad_scale = clipped.grad_scale;
    parts.set_step_inputs(real);
    parts.update_sub_groups(std::vector<size_t>{0, 2, 4, 1, 3});  // read-ahead ones first, whatever the order given
    CHECK(parts.prefetched().empty());
    CHECK_THROWS_WITH(parts.set_step_inputs(real), Catch::Contains("after 5 sub-group(s)"));
    parts.commit_step();
    CHECK(pool.available() == 3);
    REQUIRE(parts.step_count() == step);
    check_same_state(load(parts), load(whole));
    REQUIRE(std::memcmp(p16_whole.data(), p16_parts.data(), kNumel * 2) == 0);
  }
  // cpu state has nothing to read ahead.
  offload::OptimizerSwapper cpu(options_for(Tier::kCpu, {}), nullptr, nullptr);
  cpu.initialize(master.data());
  CHECK_THROWS_WITH(cpu.prefetch(0), Catch::Contains("without begin_step"));
  const auto grad = grad_for_step(1);
  cpu.begin_step(inputs(grad, p16_whole), false);
  CHECK_FALSE(cpu.prefetch(0));
  cpu.abort_step();
}

TEST_CASE("a full disk when the optimizer's manifest is committed is an error naming the file and the errno",
          "[offload][swapper]") {
  // The manifest goes through core/durable_file.h, so the fault plan fails it
  // as a disk would (it was "cannot write optimizer manifest ...", no errno).
  test::TempDir dir("strata-swap");
  offload::PinnedBufferPool pool({3, offload::OptimizerSwapper::record_nbytes(kSubGroup), 10000ms});
  nvme::AioHandle aio(nvme::AioOptions{});
  auto options = options_for(Tier::kNvme, dir.path());
  options.keep_files = true;
  offload::OptimizerSwapper swapper(options, &pool, &aio);
  const auto master = random_floats(kNumel, 3, 1.0f);
  swapper.initialize(master.data());
  set_file_faults(nvme::file_faults(std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{
      nvme::IoFault{1, nvme::IoFault::Kind::kError, ENOSPC, 0, nvme::IoOp::kWrite, false}})));
  std::vector<BFloat16> p16(kNumel);
  const auto grad = grad_for_step(1);
  try {
    swapper.step(inputs(grad, p16));
    set_file_faults(nullptr);
    FAIL("step() returned although its manifest could not be written");
  } catch (const Error& e) {
    set_file_faults(nullptr);
    CHECK(e.category() == ErrorCategory::kIo);
    CHECK_THAT(e.message(), Catch::Contains("manifest.json") && Catch::Contains("No space left on device (errno 28)"));
  }
  CHECK(swapper.step_count() == 0);
  // The committed state is the initial one, whole.
  nvme::AioHandle again(nvme::AioOptions{});
  options.resume = true;
  offload::OptimizerSwapper resumed(options, &pool, &again);
  CHECK(resumed.step_count() == 0);
  CHECK(same_bits(load(resumed).p, master));
}

TEST_CASE("the gradient read beside the state (grad_read) gives grad_source's bits", "[offload][swapper]") {
  // The pipeline reads each sub-group's gradient into its pool buffer with
  // the state, when the buffers have room; the update then uses it instead of
  // asking grad_source. Same values, so the same bits; a pool without room
  // keeps grad_source.
  test::TempDir dir("strata-swap");
  offload::PinnedBufferPool roomy({3, offload::OptimizerSwapper::buffer_nbytes(kSubGroup, true), 10000ms});
  offload::PinnedBufferPool tight({3, offload::OptimizerSwapper::buffer_nbytes(kSubGroup, false), 10000ms});
  nvme::AioHandle aio(nvme::AioOptions{});
  offload::OptimizerSwapper cpu(options_for(Tier::kCpu, {}), nullptr, nullptr);
  offload::OptimizerSwapper with_room(options_for(Tier::kNvme, dir.path() / "a"), &roomy, &aio);
  offload::OptimizerSwapper without(options_for(Tier::kNvme, dir.path() / "b"), &tight, &aio);
  const auto master = random_floats(kNumel, 4, 1.0f);
  for (auto* s : {&cpu, &with_room, &without}) s->initialize(master.data());
  for (int step = 1; step <= 3; ++step) {
    const auto grad = random_floats(kNumel, 2000u + static_cast<uint32_t>(step), 2.0f);
    int sourced = 0, started = 0, completed = 0;
    offload::StepInputs in;
    in.grad_source = [&](size_t first, size_t) -> const void* {
      ++sourced;
      return grad.data() + first;
    };
    in.grad_read = [&](size_t first, size_t numel, float* dst) -> offload::StepInputs::GradCompletion {
      ++started;
      std::fill(dst, dst + numel, -7.0f);  // not yet read
      return [&, first, numel, dst]() -> const void* {
        ++completed;
        std::copy_n(grad.data() + first, numel, dst);
        return dst;
      };
    };
    in.grad_dtype = DType::kF32;
    in.grad_scale = 0.5f;
    in.param16_dtype = DType::kF32;
    std::vector<float> sink(kNumel);
    in.param_sink = [&](size_t first, size_t numel, const void* v) {
      std::memcpy(sink.data() + first, v, numel * sizeof(float));
    };
    offload::StepInputs plain = in;
    plain.grad_read = nullptr;
    cpu.step(plain);
    const State expect = load(cpu);
    sourced = 0;
    with_room.step(in);
    CAPTURE(step);
    CHECK(started == 5);
    CHECK(completed == 5);
    CHECK(sourced == 0);
    check_same_state(load(with_room), expect);
    CHECK(same_bits(sink, expect.p));
    started = completed = 0;
    without.step(in);
    CHECK(started == 0);
    CHECK(sourced == 5);
    check_same_state(load(without), expect);
  }
  CHECK(roomy.stats().in_use == 0);
}

// The same shard on cpu and on NVMe, from the same master weights, the NVMe
// one with a pool whose buffers have room for the gradient (grad_read).
struct CpuAndNvme {
  test::TempDir dir{"strata-swap"};
  offload::PinnedBufferPool pool{{3, offload::OptimizerSwapper::buffer_nbytes(kSubGroup, true), 10000ms}};
  nvme::AioHandle aio{nvme::AioOptions{}};
  offload::OptimizerSwapper cpu{options_for(Tier::kCpu, {}), nullptr, nullptr};
  offload::OptimizerSwapper nvme{options_for(Tier::kNvme, dir.path()), &pool, &aio};

  explicit CpuAndNvme(uint32_t seed) {
    const auto master = random_floats(kNumel, seed, 1.0f);
    cpu.initialize(master.data());
    nvme.initialize(master.data());
  }
};

// Inputs streaming the fp32 gradient `grad`: grad_source and grad_read (the
// pipeline's read into a pool buffer), each call counted per sub-group. The
// inputs point into this object: it must outlive the step they are given to.
struct Fp32Grad {
  const std::vector<float>& grad;
  std::vector<int> sourced = std::vector<int>(5, 0), read = std::vector<int>(5, 0);

  offload::StepInputs inputs(DType param_dtype) {
    offload::StepInputs in;
    in.grad_source = [this](size_t first, size_t) -> const void* {
      ++sourced[first / kSubGroup];
      return grad.data() + first;
    };
    in.grad_read = [this](size_t first, size_t numel, float* dst) -> offload::StepInputs::GradCompletion {
      ++read[first / kSubGroup];
      return [this, first, numel, dst]() -> const void* {
        std::copy_n(grad.data() + first, numel, dst);
        return dst;
      };
    };
    in.grad_dtype = DType::kF32;
    in.grad_scale = 0.5f;
    in.param16_dtype = param_dtype;
    return in;
  }
  int total(const std::vector<int>& counts) const { return std::accumulate(counts.begin(), counts.end(), 0); }
};

TEST_CASE("new values written from the pool buffer (param_write), fp32 and bf16, are param_sink's, the hook fires after each write, "
          "a failed write fails the step",
          "[offload][swapper]") {
  // Parameters on NVMe: the pipeline hands each sub-group's new values to
  // param_write from its buffer (fp32: the master weights; bf16: the copy
  // behind the record) and goes on; the updated hook fires from the write's
  // completion. Sub-groups read ahead (prefetch) get their gradients read
  // into their buffers too (grad_read, not grad_source).
  CpuAndNvme swappers(6);
  offload::OptimizerSwapper& cpu = swappers.cpu;
  offload::OptimizerSwapper& nvme = swappers.nvme;
  offload::PinnedBufferPool& pool = swappers.pool;
  for (int step = 1; step <= 6; ++step) {
    const DType dtype = step <= 3 ? DType::kF32 : DType::kBF16;
    const size_t esize = dtype_nbytes(dtype);
    CAPTURE(step, dtype_name(dtype));
    const auto grad = random_floats(kNumel, 3000u + static_cast<uint32_t>(step), 2.0f);
    std::vector<char> expect_values(kNumel * esize), values(kNumel * esize, 0x7f);
    Fp32Grad reference_grad{grad};  // outlives the step: the inputs point into it
    offload::StepInputs reference = reference_grad.inputs(dtype);
    reference.grad_read = nullptr;
    reference.param_sink = [&](size_t first, size_t numel, const void* v) {
      std::memcpy(expect_values.data() + first * esize, v, numel * esize);
    };
    cpu.step(reference);
    Fp32Grad counted{grad};
    offload::StepInputs in = counted.inputs(dtype);
    // Each write ends on another thread a little later, as an I/O completion does.
    std::mutex mutex;
    std::vector<std::thread> writers;
    std::vector<size_t> hooked;
    bool hooked_before_written = false;
    in.param_sink = [&](size_t, size_t, const void*) { FAIL("param_sink used although param_write is given"); };
    in.param_write = [&](size_t first, size_t numel, const void* v, offload::StepInputs::WriteDone done) {
      std::lock_guard lock(mutex);
      writers.emplace_back([&, first, numel, v, done = std::move(done)] {
        std::this_thread::sleep_for(2ms);
        {
          std::lock_guard inner(mutex);
          std::memcpy(values.data() + first * esize, v, numel * esize);
        }
        done(nullptr);
      });
    };
    nvme.set_updated_hook([&](size_t k) {
      std::lock_guard lock(mutex);
      const auto [first, numel] = nvme.sub_group_range(k);
      hooked_before_written |=
          std::memcmp(values.data() + first * esize, expect_values.data() + first * esize, numel * esize) != 0;
      hooked.push_back(k);
    });
    nvme.begin_step(in, /*revocable=*/false);
    CHECK(nvme.prefetch(0));
    CHECK(nvme.prefetch(1));
    nvme.update_sub_groups(std::vector<size_t>{0, 1, 2, 3, 4});
    nvme.commit_step();
    for (auto& t : writers) t.join();
    CHECK(counted.total(counted.read) == 5);  // the two read ahead included
    CHECK(counted.total(counted.sourced) == 0);
    std::sort(hooked.begin(), hooked.end());
    CHECK(hooked == std::vector<size_t>{0, 1, 2, 3, 4});
    CHECK_FALSE(hooked_before_written);
    CHECK(values == expect_values);
    check_same_state(load(nvme), load(cpu));
  }
  // A failed write: the step raises it, the hook never fires for that
  // sub-group, and the committed state stays the last step's.
  const State before = load(nvme);
  const auto grad = random_floats(kNumel, 4000, 2.0f);
  offload::StepInputs in;
  in.grad = grad.data();
  in.grad_dtype = DType::kF32;
  in.grad_scale = 0.5f;
  in.param16_dtype = DType::kF32;
  in.param_sink = [](size_t, size_t, const void*) {};
  in.param_write = [](size_t first, size_t, const void*, offload::StepInputs::WriteDone done) {
    done(first == 2 * kSubGroup ? std::make_exception_ptr(Error(ErrorCategory::kIo, "home write of sub-group 2 failed"))
                                : nullptr);
  };
  std::vector<size_t> hooked;
  nvme.set_updated_hook([&](size_t k) { hooked.push_back(k); });
  nvme.begin_step(in, /*revocable=*/false);
  CHECK_THROWS_WITH(nvme.update_sub_groups(std::vector<size_t>{0, 1, 2, 3, 4}),
                    Catch::Contains("home write of sub-group 2 failed"));
  nvme.abort_step();
  CHECK(std::find(hooked.begin(), hooked.end(), size_t{2}) == hooked.end());
  CHECK(pool.stats().in_use == 0);
  CHECK(nvme.step_count() == 6);
  check_same_state(load(nvme), before);
}

TEST_CASE("a gradient read ahead into its record's buffer (read_grad_ahead) is the one the update uses, once, and "
          "dropped is read again",
          "[offload][swapper]") {
  CpuAndNvme swappers(8);
  offload::OptimizerSwapper& cpu = swappers.cpu;
  offload::OptimizerSwapper& nvme = swappers.nvme;
  offload::PinnedBufferPool& pool = swappers.pool;
  for (bool drop : {false, true}) {
    CAPTURE(drop);
    const auto grad = random_floats(kNumel, drop ? 5001 : 5000, 2.0f);
    Fp32Grad reference_grad{grad};  // outlives the step: the inputs point into it
    offload::StepInputs reference = reference_grad.inputs(DType::kF32);
    reference.grad_read = nullptr;
    reference.param_sink = [](size_t, size_t, const void*) {};
    cpu.step(reference);
    Fp32Grad counted{grad};
    offload::StepInputs in = counted.inputs(DType::kF32);
    in.param_sink = [](size_t, size_t, const void*) {};
    nvme.begin_step(in, /*revocable=*/false);
    CHECK(nvme.read_grad_ahead(0) == nullptr);  // not read ahead
    CHECK(nvme.prefetch(0));
    CHECK(nvme.prefetch(3));
    const float* g0 = nvme.read_grad_ahead(0);
    REQUIRE(g0 != nullptr);
    CHECK(std::memcmp(g0, grad.data(), kSubGroup * sizeof(float)) == 0);
    CHECK(nvme.read_grad_ahead(0) == g0);  // once
    CHECK(counted.read[0] == 1);
    if (drop) nvme.drop_grads_read_ahead();
    nvme.update_sub_groups(std::vector<size_t>{0, 1, 2, 3, 4});
    nvme.commit_step();
    CHECK(counted.read == std::vector<int>{drop ? 2 : 1, 1, 1, 1, 1});
    check_same_state(load(nvme), load(cpu));
  }
  CHECK(pool.stats().in_use == 0);
}
