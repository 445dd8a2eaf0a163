// The parameter homes (offload/param_home.h), each tier against the same
// contract: a new home reads as zeros (an nvme file that held an earlier
// run's bytes included), a range written through host_range/store_host_range
// reads back, read_async and write_async copy the bytes asked for and call
// `done`, and the shared window serves the largest range announced. Real O_DIRECT files and
// real io_uring for nvme; the cpu accelerator for device.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <vector>

#include "core/accelerator.h"
#include "core/error.h"
#include "nvme/aio_handle.h"
#include "nvme/io_backend.h"
#include "offload/param_home.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using strata::test::TempDir;

namespace {

constexpr size_t kChunk = 4096;                 // bf16: 8 KiB
constexpr size_t kNumel = 2 * kChunk + 2048;  // two full chunks and a short one (a shard is 4 KiB-aligned)

offload::ParamHomeOptions options_for(Tier tier, const std::filesystem::path& dir) {
  offload::ParamHomeOptions o;
  o.tier = tier;
  o.dtype = DType::kBF16;
  o.numel = kNumel;
  o.chunk_numel = kChunk;
  o.max_range_numel = 2 * kChunk;
  o.nvme_path = dir;
  o.rank = 3;
  return o;
}

std::vector<uint16_t> read_all(offload::ParamHome& home) {
  std::vector<uint16_t> out(home.numel());
  home.for_each_chunk([&](size_t first, size_t numel) {
    std::memcpy(out.data() + first, home.host_range(first, numel, /*load=*/true), numel * sizeof(uint16_t));
  });
  return out;
}

}  // namespace

TEST_CASE("param homes: zeros, ranges written and read back, read_async and write_async, on every tier") {
  TempDir dir("strata-param-home");
  auto acc = make_cpu_accelerator();
  auto stream = acc->create_stream();
  nvme::AioHandle aio(nvme::AioOptions{});
  for (Tier tier : {Tier::kDevice, Tier::kCpu, Tier::kNvme}) {
    DYNAMIC_SECTION("tier " << tier_name(tier)) {
      if (tier == Tier::kNvme) {
        // An earlier run's file with other bytes: the new home still reads as zeros.
        const auto stale = dir.path() / "param" / "rank3";
        std::filesystem::create_directories(stale);
        std::ofstream(stale / "bf16.swp", std::ios::binary) << std::string(kNumel * 2, '\x7f');
      }
      offload::HostWindow window(*acc);
      auto home = offload::make_param_home(options_for(tier, dir.path()), *acc, *stream, window, &aio);
      CHECK(home->tier() == tier);
      CHECK(home->nbytes() == kNumel * 2);
      CHECK((home->memory() == nullptr) == (tier == Tier::kNvme));
      CHECK(home->host_addressable() == (tier != Tier::kNvme));  // the cpu accelerator's memory is host memory
      for (uint16_t v : read_all(*home)) REQUIRE(v == 0);

      // A range of two chunks (the largest announced), then a short last one.
      std::vector<uint16_t> expected(kNumel, 0);
      const auto write = [&](size_t first, size_t numel, uint16_t base) {
        auto* view = static_cast<uint16_t*>(home->host_range(first, numel, /*load=*/false));
        for (size_t i = 0; i < numel; ++i) view[i] = expected[first + i] = static_cast<uint16_t>(base + i);
        home->store_host_range(first, numel);
      };
      write(0, 2 * kChunk, 100);
      write(2 * kChunk, 2048, 7);
      CHECK(read_all(*home) == expected);
      if (!home->host_addressable()) CHECK(window.nbytes() >= 2 * kChunk * 2);

      // read_async: bytes [offset, offset + n) of the shard into pinned memory.
      void* pinned = acc->allocate_pinned(8192);
      std::promise<std::exception_ptr> done;
      home->read_async(pinned, 8192, kChunk * 2, [&](std::exception_ptr e) { done.set_value(e); });
      CHECK(done.get_future().get() == nullptr);
      CHECK(std::memcmp(pinned, expected.data() + kChunk, 8192) == 0);

      // write_async: the other way, then read back through every path.
      auto* values = static_cast<uint16_t*>(pinned);
      for (size_t i = 0; i < 4096; ++i) values[i] = expected[kChunk + i] = static_cast<uint16_t>(9000 + 3 * i);
      std::promise<std::exception_ptr> written;
      home->write_async(pinned, 8192, kChunk * 2, [&](std::exception_ptr e) { written.set_value(e); });
      CHECK(written.get_future().get() == nullptr);
      CHECK(read_all(*home) == expected);
      acc->deallocate_pinned(pinned);

      // A range outside the shard or above the largest announced is a bug, said so.
      CHECK_THROWS_AS(home->host_range(kNumel - 2048, 4096, true), Error);
      CHECK_THROWS_AS(home->host_range(0, 3 * kChunk, true), Error);
    }
  }
}

TEST_CASE("param homes: the nvme file is removed with its home") {
  TempDir dir("strata-param-home");
  auto acc = make_cpu_accelerator();
  auto stream = acc->create_stream();
  nvme::AioHandle aio(nvme::AioOptions{});
  offload::HostWindow window(*acc);
  const auto file = dir.path() / "param" / "rank3" / "bf16.swp";
  {
    auto home = offload::make_param_home(options_for(Tier::kNvme, dir.path()), *acc, *stream, window, &aio);
    CHECK(std::filesystem::file_size(file) >= kNumel * 2);
  }
  CHECK_FALSE(std::filesystem::exists(file));
}

TEST_CASE("an nvme home keeping its last writes (cached_writes): reading them back is a copy, across two of them, "
          "the oldest is reused but never one whose write is in flight, and a write through the window or a failed "
          "one leaves nothing stale") {
  using namespace std::chrono_literals;
  TempDir dir("strata-param-home");
  auto acc = make_cpu_accelerator();
  auto stream = acc->create_stream();
  // Every read from the drive fails: what reads was copied from the cache.
  // Writes: 3 zero the new file (one per chunk); the 7th is held a second;
  // the 11th fails.
  auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{
      nvme::IoFault{.nth = 1, .kind = nvme::IoFault::Kind::kError, .error = 5, .op = nvme::IoOp::kRead, .repeat = true},
      nvme::IoFault{.nth = 7, .kind = nvme::IoFault::Kind::kSlow, .op = nvme::IoOp::kWrite, .delay = 1000ms},
      nvme::IoFault{.nth = 11, .kind = nvme::IoFault::Kind::kError, .error = 5, .op = nvme::IoOp::kWrite}});
  nvme::AioOptions aio_options;
  nvme::AioHandle aio(aio_options, nvme::make_fault_backend(nvme::make_backend(aio_options.engine), plan));
  offload::HostWindow window(*acc);
  offload::ParamHomeOptions options = options_for(Tier::kNvme, dir.path());
  options.cached_writes = 2;
  auto home = offload::make_param_home(options, *acc, *stream, window, &aio);

  auto* values = static_cast<uint16_t*>(acc->allocate_pinned(2 * kChunk * 2));
  auto* got = static_cast<uint16_t*>(acc->allocate_pinned(2 * kChunk * 2));
  const auto fill = [&](size_t numel, uint16_t base) {
    for (size_t i = 0; i < numel; ++i) values[i] = static_cast<uint16_t>(base + i);
  };
  // Starts writing chunk k (numel elements) from `values`; the future is its done's error.
  const auto write = [&](size_t k, size_t numel) {
    auto result = std::make_shared<std::promise<std::exception_ptr>>();
    home->write_async(values, numel * 2, k * kChunk * 2, [result](std::exception_ptr e) { result->set_value(e); });
    return result->get_future();
  };
  // Reads elements [first, first + numel) into `got`: whether it succeeded.
  const auto read = [&](size_t first, size_t numel) {
    std::promise<std::exception_ptr> result;
    std::fill(got, got + numel, uint16_t{0xffff});
    home->read_async(got, numel * 2, first * 2, [&](std::exception_ptr e) { result.set_value(e); });
    return result.get_future().get() == nullptr;
  };
  const auto holds = [&](size_t at, size_t numel, uint16_t base) {
    for (size_t i = 0; i < numel; ++i) {
      if (got[at + i] != static_cast<uint16_t>(base + i)) return false;
    }
    return true;
  };

  // Chunks 0 and 1 written: a range across both reads, with no drive read.
  fill(kChunk, 100);
  CHECK(write(0, kChunk).get() == nullptr);
  fill(kChunk, 2000);
  CHECK(write(1, kChunk).get() == nullptr);
  REQUIRE(read(kChunk / 2, kChunk));  // the second half of chunk 0, the first of chunk 1
  CHECK(holds(0, kChunk / 2, 100 + kChunk / 2));
  CHECK(holds(kChunk / 2, kChunk / 2, 2000));
  CHECK(plan->fired() == 0);

  // Chunk 2 takes the oldest slot (chunk 0's): chunk 0 is on the drive only.
  fill(2048, 7000);
  CHECK(write(2, 2048).get() == nullptr);
  CHECK(read(2 * kChunk, 2048));
  CHECK(holds(0, 2048, 7000));
  CHECK_FALSE(read(0, kChunk));  // the drive's read fails
  CHECK(plan->fired() == 1);

  // Chunk 0 again, its write held (and chunk 1's, queued behind it): they
  // take the two slots, and chunk 2, with no slot whose write has ended, is
  // written around the cache — never into a slot the drive reads from. The
  // slots in flight serve reads.
  fill(kChunk, 300);
  auto held = write(0, kChunk);
  fill(kChunk, 400);
  auto behind = write(1, kChunk);
  fill(2048, 800);
  auto around = write(2, 2048);
  CHECK(read(0, kChunk));
  CHECK(holds(0, kChunk, 300));
  CHECK(read(kChunk, kChunk));
  CHECK(holds(0, kChunk, 400));
  CHECK_FALSE(read(2 * kChunk, 2048));
  CHECK(held.get() == nullptr);
  CHECK(behind.get() == nullptr);
  CHECK(around.get() == nullptr);

  // Chunk 0 written through the window: its cached values are not served.
  auto* view = static_cast<uint16_t*>(home->host_range(0, kChunk, /*load=*/false));
  for (size_t i = 0; i < kChunk; ++i) view[i] = static_cast<uint16_t>(500 + i);
  home->store_host_range(0, kChunk);
  CHECK_FALSE(read(0, kChunk));
  CHECK(read(kChunk, kChunk));  // chunk 1's still are

  // A failed write caches nothing (and drops chunk 1's older values).
  fill(kChunk, 600);
  CHECK(write(1, kChunk).get() != nullptr);
  CHECK_FALSE(read(kChunk, kChunk));

  acc->deallocate_pinned(values);
  acc->deallocate_pinned(got);
}
