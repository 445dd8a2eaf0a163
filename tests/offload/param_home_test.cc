// The parameter homes (offload/param_home.h), each tier against the same
// contract: a new home reads as zeros (an nvme file that held an earlier
// run's bytes included), a range written through host_range/store_host_range
// reads back, read_async and write_async copy the bytes asked for and call
// `done`, and the shared window serves the largest range announced. Real O_DIRECT files and
// real io_uring for nvme; the cpu accelerator for device.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <future>
#include <vector>

#include "core/accelerator.h"
#include "core/error.h"
#include "nvme/aio_handle.h"
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
