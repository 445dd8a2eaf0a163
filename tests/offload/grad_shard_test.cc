// GradShard's nvme home (offload/grad_shard.h): blocks written, added on
// accumulation, unwritten slices read as zeros, a failed write reaching the
// stream — and its disk I/O kept off the host-function thread. The cpu
// accelerator runs with one host-function thread shared by all streams
// (AcceleratorOptions::cpu_shared_host_thread), as CUDA's driver does, so a
// bucket write inside a host function would be seen holding up every other
// stream's host functions. Real O_DIRECT files and real io_uring; the slow and
// failing writes come from the fault backend wrapped around it.
#include "offload/grad_shard.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "core/error.h"
#include "nvme/aio_handle.h"
#include "nvme/io_backend.h"
#include "nvme/swap_space.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using Clock = std::chrono::steady_clock;

namespace {

// Three bf16 parameters (slices aligned to 2048 elements): a spans two
// alignments, b is short, c is exactly one.
partition::PartitionLayout three_params() {
  return partition::PartitionLayout(
      {{"a", {3000}, DType::kBF16}, {"b", {100}, DType::kBF16}, {"c", {2048}, DType::kBF16}},
      partition::LayoutOptions{});
}

AcceleratorOptions cuda_like() {
  AcceleratorOptions options;
  options.cpu_shared_host_thread = true;
  return options;
}

// A block of accelerator memory holding slice p filled with value + i.
float* block(Accelerator& acc, const partition::PartitionLayout& layout, size_t p, float value) {
  const size_t numel = static_cast<size_t>(layout.param(p).slice_numel);
  auto* data = static_cast<float*>(acc.allocate(numel * sizeof(float)));
  for (size_t i = 0; i < numel; ++i) data[i] = value + static_cast<float>(i % 7);
  return data;
}

struct Rig {
  explicit Rig(std::shared_ptr<nvme::FaultPlan> plan = nullptr)
      : acc(make_cpu_accelerator(cuda_like())),
        ops(ops::make_ops(*acc)),
        stream(acc->create_stream()),
        ctx(ops->make_context(*stream)),
        aio(nvme::AioOptions{}, plan ? nvme::make_fault_backend(nvme::make_backend(nvme::EngineKind::kUring), plan)
                                     : nullptr),
        swap(nvme::SwapSpaceOptions{dir.path(), "grad", 0}),
        shard(*acc, *ops, layout, aio, swap, "fp32") {}
  ~Rig() {
    try {
      stream->synchronize();
    } catch (const Error&) {
      // A test that failed the stream has checked its error already.
    }
    for (float* b : blocks) acc->deallocate(b);
  }
  float* add_block(size_t p, float value) {
    blocks.push_back(block(*acc, layout, p, value));
    return blocks.back();
  }
  // The slice of parameter p in the whole shard as read() shows it.
  std::vector<float> slice(size_t p) {
    const float* all = shard.read(0, static_cast<size_t>(layout.shard_numel()), *stream);
    const auto& slot = layout.param(p);
    return std::vector<float>(all + slot.shard_offset_numel, all + slot.shard_offset_numel + slot.slice_numel);
  }

  test::TempDir dir{"grad-shard"};
  partition::PartitionLayout layout = three_params();
  std::unique_ptr<Accelerator> acc;
  std::unique_ptr<ops::Ops> ops;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<ops::ComputeContext> ctx;
  nvme::AioHandle aio;
  nvme::SwapSpace swap;
  offload::GradShard shard;
  std::vector<float*> blocks;
};

void require_slice(const std::vector<float>& slice, float value) {
  for (size_t i = 0; i < slice.size(); ++i) {
    INFO("element " << i);
    REQUIRE(slice[i] == (value == 0 ? 0.0f : value + static_cast<float>(i % 7)));
  }
}

}  // namespace

TEST_CASE("grad shard on nvme: blocks written and added, unwritten slices zeros, across zero()", "[grad_shard]") {
  Rig rig;
  REQUIRE(rig.shard.on_nvme());
  // Parameter a twice (accumulation adds what is on disk), b once, c never.
  rig.shard.accumulate(0, rig.add_block(0, 1), *rig.stream, *rig.ctx);
  rig.shard.accumulate(1, rig.add_block(1, 5), *rig.stream, *rig.ctx);
  rig.shard.accumulate(0, rig.add_block(0, 10), *rig.stream, *rig.ctx);
  rig.stream->synchronize();
  const auto a = rig.slice(0);
  for (size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == 11.0f + 2.0f * static_cast<float>(i % 7));
  require_slice(rig.slice(1), 5);
  require_slice(rig.slice(2), 0);
  // After zero() only what is written again counts; a's old bytes read as zeros.
  rig.shard.zero(*rig.stream);
  rig.shard.accumulate(2, rig.add_block(2, 3), *rig.stream, *rig.ctx);
  rig.stream->synchronize();
  require_slice(rig.slice(0), 0);
  require_slice(rig.slice(1), 0);
  require_slice(rig.slice(2), 3);
}

TEST_CASE("grad shard on nvme: a failed write is the stream's error, and later blocks still end", "[grad_shard]") {
  auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{
      nvme::IoFault{.nth = 1, .kind = nvme::IoFault::Kind::kError, .error = 5, .op = nvme::IoOp::kWrite}});
  Rig rig(plan);
  rig.shard.accumulate(0, rig.add_block(0, 1), *rig.stream, *rig.ctx);
  REQUIRE_THROWS_AS(rig.stream->synchronize(), Error);
  REQUIRE(plan->fired() == 1);
  // The stream has failed: the next block's notice is skipped, and its I/O
  // job must still end (with the stream's error) rather than wait for ever.
  rig.shard.accumulate(1, rig.add_block(1, 2), *rig.stream, *rig.ctx);
  REQUIRE_THROWS_AS(rig.stream->synchronize(), Error);
}

TEST_CASE("grad shard on nvme: a slow bucket write does not delay another stream's host function",
          "[grad_shard][accelerator]") {
  // The write was a synchronous read-add-write inside launch_host_func: on
  // cuda's one callback thread (modelled here) every other stream's host
  // functions waited for the disk.
  constexpr auto kSlow = std::chrono::milliseconds(800);
  auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{nvme::IoFault{
      .nth = 1, .kind = nvme::IoFault::Kind::kSlow, .op = nvme::IoOp::kWrite, .delay = kSlow}});
  Rig rig(plan);
  auto other = rig.acc->create_stream();
  const auto start = Clock::now();
  rig.shard.accumulate(0, rig.add_block(0, 1), *rig.stream, *rig.ctx);
  // The bucket's write is under way (held by the disk) before the other
  // stream's host function is launched.
  while (plan->fired() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::atomic<int64_t> ran_after_ms{-1};
  const auto launched = Clock::now();
  other->launch_host_func([&] {
    ran_after_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - launched).count();
  });
  other->synchronize();
  rig.stream->synchronize();
  const auto bucket_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  INFO("other stream's host function ran " << ran_after_ms << " ms after its launch; the bucket took " << bucket_ms
                                           << " ms");
  REQUIRE(bucket_ms >= kSlow.count());  // the write really was slow
  REQUIRE(ran_after_ms >= 0);
  REQUIRE(ran_after_ms < 300);
  require_slice(rig.slice(0), 1);  // and the block still reached the disk
}

TEST_CASE("grad shard on nvme: read_async gives read()'s values, unwritten slices zeros", "[grad_shard]") {
  Rig rig;
  rig.shard.accumulate(0, rig.add_block(0, 1), *rig.stream, *rig.ctx);
  rig.shard.accumulate(1, rig.add_block(1, 5), *rig.stream, *rig.ctx);
  rig.stream->synchronize();
  const size_t n = static_cast<size_t>(rig.layout.shard_numel());
  auto* dst = static_cast<float*>(rig.acc->allocate_pinned(n * sizeof(float)));
  std::fill(dst, dst + n, -1.0f);  // c's slice must come back zero, not stale
  std::function<void()> complete = rig.shard.read_async(0, n, dst);
  complete();
  const float* expect = rig.shard.read(0, n, *rig.stream);
  const bool same = std::memcmp(dst, expect, n * sizeof(float)) == 0;
  rig.acc->deallocate_pinned(dst);
  REQUIRE(same);
  require_slice(rig.slice(2), 0);
}

TEST_CASE("grad shard on nvme: reading a landed slice does not wait for another slice's block",
          "[grad_shard]") {
  // The optimizer thread reads each sub-group as soon as its slices have
  // landed, during backward, while other blocks are still on their way; it
  // waited for every queued block before, so it read nothing until backward
  // ended. Here a's block is queued behind 800 ms of other work on the stream.
  constexpr auto kSlow = std::chrono::milliseconds(800);
  Rig rig;
  std::atomic<bool> b_on_disk{false};
  rig.shard.accumulate(1, rig.add_block(1, 5), *rig.stream, *rig.ctx);  // b
  rig.stream->launch_host_func([&] {  // runs once b's block is written (the stream waits for it)
    b_on_disk = true;
    std::this_thread::sleep_for(kSlow);
  });
  rig.shard.accumulate(0, rig.add_block(0, 1), *rig.stream, *rig.ctx);  // a: lands after the sleep
  while (!b_on_disk) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto& b = rig.layout.param(1);
  const size_t align = rig.layout.alignment_nbytes() / dtype_nbytes(DType::kBF16);
  const auto start = Clock::now();
  const float* got = rig.shard.read(static_cast<size_t>(b.shard_offset_numel), align, *rig.stream);
  const auto read_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  std::vector<float> slice(got, got + b.slice_numel);
  rig.stream->synchronize();
  INFO("the read of b took " << read_ms << " ms; a's block was held " << kSlow.count() << " ms");
  REQUIRE(read_ms < 300);
  require_slice(slice, 5);
  require_slice(rig.slice(0), 1);
}

TEST_CASE("grad shard on nvme: the block landed last is read from the scratch, not back from the disk, until the "
          "next block's copy or zero()",
          "[grad_shard]") {
  const auto range_of = [](const partition::ParamSlot& slot) {
    return std::pair{static_cast<size_t>(slot.shard_offset_numel), static_cast<size_t>(slot.slice_numel)};
  };
  SECTION("every disk read fails: only the last block's slice reads") {
    auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{nvme::IoFault{
        .nth = 1, .kind = nvme::IoFault::Kind::kError, .error = 5, .op = nvme::IoOp::kRead, .repeat = true}});
    Rig rig(plan);
    rig.shard.accumulate(1, rig.add_block(1, 5), *rig.stream, *rig.ctx);
    rig.shard.accumulate(2, rig.add_block(2, 3), *rig.stream, *rig.ctx);
    rig.stream->synchronize();
    const auto [c_first, c_numel] = range_of(rig.layout.param(2));
    const float* c = rig.shard.read(c_first, c_numel, *rig.stream);
    require_slice(std::vector<float>(c, c + c_numel), 3);
    CHECK(plan->fired() == 0);
    const auto [b_first, b_numel] = range_of(rig.layout.param(1));
    CHECK_THROWS_AS(rig.shard.read(b_first, 2048, *rig.stream), Error);  // b is on the disk only
    CHECK(plan->fired() == 1);
    // a lands (its first block since zero(): nothing read to add to), so c's
    // block is no longer in the scratch: c is read from the disk, which fails.
    rig.shard.accumulate(0, rig.add_block(0, 1), *rig.stream, *rig.ctx);
    rig.stream->synchronize();
    CHECK_THROWS_AS(rig.shard.read(c_first, c_numel, *rig.stream), Error);
  }
  SECTION("a range across the last block and others; an accumulated last block; zero()") {
    Rig rig;
    rig.shard.accumulate(1, rig.add_block(1, 5), *rig.stream, *rig.ctx);
    rig.shard.accumulate(0, rig.add_block(0, 1), *rig.stream, *rig.ctx);
    rig.shard.accumulate(0, rig.add_block(0, 10), *rig.stream, *rig.ctx);  // a's sum is the last block
    rig.stream->synchronize();
    const auto a = rig.slice(0);  // the whole shard: a from the scratch, b and c from the disk
    for (size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == 11.0f + 2.0f * static_cast<float>(i % 7));
    require_slice(rig.slice(1), 5);
    require_slice(rig.slice(2), 0);
    const size_t n = static_cast<size_t>(rig.layout.shard_numel());
    auto* dst = static_cast<float*>(rig.acc->allocate_pinned(n * sizeof(float)));
    std::fill(dst, dst + n, -1.0f);
    rig.shard.read_async(0, n, dst)();
    const float* expect = rig.shard.read(0, n, *rig.stream);
    const bool same = std::memcmp(dst, expect, n * sizeof(float)) == 0;
    rig.acc->deallocate_pinned(dst);
    CHECK(same);
    // After zero() the scratch's block is an old step's: zeros again.
    rig.shard.zero(*rig.stream);
    require_slice(rig.slice(0), 0);
    rig.shard.accumulate(2, rig.add_block(2, 3), *rig.stream, *rig.ctx);
    rig.stream->synchronize();
    require_slice(rig.slice(0), 0);
    require_slice(rig.slice(2), 3);
  }
}

TEST_CASE("grad shard on nvme: blocks held in memory (hold_blocks) give the written blocks' bits with one write per "
          "slice, and a slice read before its last block is written first",
          "[grad_shard]") {
  // The same blocks into a shard that writes each and one that holds 3 per parameter
  // (layer-major's 3 backwards of each layer in a row), values whose sums round.
  Rig written, held;
  held.shard.hold_blocks(3);
  const float values[] = {0.1f, 1e-3f, 7.3f};
  for (Rig* rig : {&written, &held}) {
    for (size_t p : {size_t{0}, size_t{1}}) {
      for (float v : values) rig->shard.accumulate(p, rig->add_block(p, v * static_cast<float>(p + 1)), *rig->stream, *rig->ctx);
    }
    // Parameter c gets 2 of its 3 blocks: its sum is still held when read.
    rig->shard.accumulate(2, rig->add_block(2, 0.3f), *rig->stream, *rig->ctx);
    rig->shard.accumulate(2, rig->add_block(2, 0.6f), *rig->stream, *rig->ctx);
    rig->stream->synchronize();
  }
  const size_t a = static_cast<size_t>(written.layout.param(0).slice_numel) * sizeof(float);
  const size_t b = static_cast<size_t>(written.layout.param(1).slice_numel) * sizeof(float);
  const size_t c = static_cast<size_t>(written.layout.param(2).slice_numel) * sizeof(float);
  // The blocks' disk traffic (the handle's counters: nothing else has read or written yet).
  const auto disk = [](const Rig& rig) { return rig.aio.stats().bytes_read + rig.aio.stats().bytes_written; };
  // Written: each parameter's first block written, each later one read back, added and written.
  CHECK(disk(written) == 5 * a + 5 * b + 3 * c);
  // Held: a's and b's three blocks written once; c's two not yet.
  CHECK(disk(held) == a + b);
  const uint64_t held_written = held.aio.stats().bytes_written;
  for (size_t p = 0; p < 3; ++p) {
    INFO("parameter " << p);
    const std::vector<float> want = written.slice(p), got = held.slice(p);
    REQUIRE(got.size() == want.size());
    CHECK(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
  }
  // The read wrote c's held sum before reading it.
  CHECK(held.aio.stats().bytes_written == held_written + c);
  // After zero() nothing is held over: a fresh step's blocks alone.
  held.shard.zero(*held.stream);
  for (float v : values) held.shard.accumulate(1, held.add_block(1, v), *held.stream, *held.ctx);
  held.stream->synchronize();
  const std::vector<float> again = held.slice(1);
  written.shard.zero(*written.stream);
  for (float v : values) written.shard.accumulate(1, written.add_block(1, v), *written.stream, *written.ctx);
  written.stream->synchronize();
  const std::vector<float> want = written.slice(1);
  CHECK(std::memcmp(again.data(), want.data(), want.size() * sizeof(float)) == 0);
  require_slice(held.slice(0), 0);
}
