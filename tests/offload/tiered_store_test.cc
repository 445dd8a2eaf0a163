// The tiered tensor store over the cpu accelerator (device memory is host
// memory under a budget there), real swap files and real io_uring: homes on
// every tier, residency states, per-shard event ordering across streams, and
// an injected I/O error surfacing from wait() with the shard's key.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <memory>
#include <future>
#include <numeric>
#include <vector>

#include "nvme/aio_handle.h"
#include "nvme/io_backend.h"
#include "offload/pinned_pool.h"
#include "offload/tiered_store.h"
#include "core/error.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace std::chrono_literals;
using offload::Residency;

namespace {

std::vector<float> iota_floats(size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

}  // namespace

TEST_CASE("shards on every home tier round-trip through host buffers", "[offload][store]") {
  test::TempDir dir("strata-store");
  auto acc = make_cpu_accelerator();
  nvme::AioHandle aio(nvme::AioOptions{});
  nvme::SwapSpace swap({dir.path(), "store", 0, true});
  offload::TieredStore store(*acc, &aio, &swap);
  offload::PinnedBufferPool pool({2, 64 << 10, 1000ms});
  auto stream = acc->create_stream();

  const size_t numel = 5000;  // 20,000 bytes: not a multiple of 4096
  for (const Tier tier : {Tier::kDevice, Tier::kCpu, Tier::kNvme}) {
    CAPTURE(tier_name(tier));
    const std::string key = fmt::format("w_{}", tier_name(tier));
    store.add(key, TensorDesc{DType::kF32, {50, 100}, tier});
    CHECK(store.state(key) == (tier == Tier::kNvme ? Residency::kAbsent : Residency::kResident));
    auto src = pool.acquire();
    auto dst = pool.acquire();
    const auto values = iota_floats(numel, static_cast<float>(tier) * 1e4f);
    std::memcpy(src.data(), values.data(), numel * 4);
    std::memset(dst.data(), 0, dst.nbytes());
    store.store_async(key, src.data(), *stream);
    // The fetch is submitted at once; the shard's event orders it after the store.
    store.fetch_async(key, dst.data(), *stream);
    store.wait(key);
    CHECK(store.state(key) == Residency::kResident);
    CHECK(std::memcmp(dst.data(), values.data(), numel * 4) == 0);
    if (tier != Tier::kNvme) {
      CHECK(std::memcmp(store.home_view(key).data, values.data(), numel * 4) == 0);
    } else {
      CHECK_THROWS_WITH(store.home_view(key), Catch::Contains("fetch it"));
      store.release(key);
      CHECK(store.state(key) == Residency::kAbsent);
    }
  }
  CHECK_THROWS_WITH(store.add("w_cpu", TensorDesc{DType::kF32, {4}, Tier::kCpu}), Catch::Contains("already exists"));
  CHECK_THROWS_WITH(store.state("missing"), Catch::Contains("no shard 'missing'"));
}

TEST_CASE("moves of one shard on different streams are ordered by its event", "[offload][store]") {
  test::TempDir dir("strata-store");
  auto acc = make_cpu_accelerator();
  nvme::AioHandle aio(nvme::AioOptions{});
  nvme::SwapSpace swap({dir.path(), "store", 0, true});
  offload::TieredStore store(*acc, &aio, &swap);
  offload::PinnedBufferPool pool({3, 1 << 20, 1000ms});
  auto writer = acc->create_stream();
  auto reader = acc->create_stream();
  const size_t numel = (1 << 20) / 4;
  store.add("big", TensorDesc{DType::kF32, {static_cast<int64_t>(numel)}, Tier::kNvme});
  auto a = pool.acquire();
  auto b = pool.acquire();
  auto out = pool.acquire();
  const auto first = iota_floats(numel, 1.0f), second = iota_floats(numel, -7.0f);
  std::memcpy(a.data(), first.data(), numel * 4);
  std::memcpy(b.data(), second.data(), numel * 4);
  // Hold the writer stream so both stores are queued before either runs.
  auto gate = std::make_shared<std::promise<void>>();
  auto opened = gate->get_future().share();
  writer->launch_host_func([opened] { opened.wait(); });
  store.store_async("big", a.data(), *writer);
  CHECK(store.state("big") == Residency::kInFlight);
  store.store_async("big", b.data(), *reader);  // must wait for the first store
  store.fetch_async("big", out.data(), *reader);
  gate->set_value();
  store.wait("big");
  CHECK(std::memcmp(out.data(), second.data(), numel * 4) == 0);
}

TEST_CASE("a failed nvme move is rethrown by wait() naming the shard", "[offload][store]") {
  test::TempDir dir("strata-store");
  auto acc = make_cpu_accelerator();
  auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{
      nvme::IoFault{1, nvme::IoFault::Kind::kError, 5, 0, nvme::IoOp::kRead, false}});
  nvme::AioOptions options;
  nvme::AioHandle aio(options, nvme::make_fault_backend(nvme::make_backend(options.engine), plan));
  nvme::SwapSpace swap({dir.path(), "store", 0, true});
  offload::TieredStore store(*acc, &aio, &swap);
  offload::PinnedBufferPool pool({1, 8192, 1000ms});
  auto stream = acc->create_stream();
  store.add("opt_m", TensorDesc{DType::kBF16, {1000}, Tier::kNvme});
  auto buf = pool.acquire();
  store.fetch_async("opt_m", buf.data(), *stream);
  try {
    store.wait("opt_m");
    FAIL("wait() returned although the read failed");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::kIo);
    CHECK_THAT(e.what(), Catch::Contains("fetch of shard 'opt_m'"));
  }
  CHECK(store.state("opt_m") == Residency::kAbsent);  // never became resident
  CHECK(plan->fired() == 1);
}

namespace {

// The cpu backend always; cuda too where a device is present.
std::vector<std::unique_ptr<Accelerator>> every_backend() {
  std::vector<std::unique_ptr<Accelerator>> out;
  out.push_back(make_cpu_accelerator());
  if (cuda_device_count() > 0) out.push_back(make_cuda_accelerator(0));
  return out;
}

}  // namespace

TEST_CASE("a failed nvme read reaches wait(), the move's event and streams that waited on it, on every backend",
          "[offload][store]") {
  for (auto& acc : every_backend()) {
    CAPTURE(acc->name());
    test::TempDir dir("strata-store");
    auto plan = std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{
        nvme::IoFault{1, nvme::IoFault::Kind::kError, 5, 0, nvme::IoOp::kRead, false}});
    nvme::AioOptions options;
    nvme::AioHandle aio(options, nvme::make_fault_backend(nvme::make_backend(options.engine), plan));
    nvme::SwapSpace swap({dir.path(), "store", 0, true});
    offload::TieredStore store(*acc, &aio, &swap);
    offload::PinnedBufferPool pool({1, 8192, 1000ms}, acc.get());
    auto stream = acc->create_stream();
    auto waiter = acc->create_stream();
    store.add("opt_m", TensorDesc{DType::kBF16, {1000}, Tier::kNvme});
    auto buf = pool.acquire();
    Event& fetched = store.fetch_async("opt_m", buf.data(), *stream);
    bool waiter_ran = false;
    waiter->wait(fetched);
    waiter->launch_host_func([&] { waiter_ran = true; });
    REQUIRE_THROWS_WITH(waiter->synchronize(), Catch::Contains("fetch of shard 'opt_m'"));
    REQUIRE_FALSE(waiter_ran);
    REQUIRE_THROWS_WITH(fetched.synchronize(), Catch::Contains("fetch of shard 'opt_m'"));
    CHECK(store.state("opt_m") != Residency::kResident);  // complete but failed: not resident
    try {
      store.wait("opt_m");
      FAIL("wait() returned although the read failed");
    } catch (const Error& e) {
      CHECK(e.category() == ErrorCategory::kIo);
      CHECK_THAT(e.what(), Catch::Contains("fetch of shard 'opt_m'"));
    }
    CHECK(store.state("opt_m") == Residency::kAbsent);
    CHECK(plan->fired() == 1);
  }
}

TEST_CASE("a fetch queued after an error on its stream reports it and leaves the shard absent, on every backend",
          "[offload][store]") {
  for (auto& acc : every_backend()) {
    CAPTURE(acc->name());
    test::TempDir dir("strata-store");
    nvme::AioHandle aio(nvme::AioOptions{});
    nvme::SwapSpace swap({dir.path(), "store", 0, true});
    offload::TieredStore store(*acc, &aio, &swap);
    offload::PinnedBufferPool pool({2, 8192, 1000ms}, acc.get());
    auto writer = acc->create_stream();
    auto stream = acc->create_stream();
    store.add("w", TensorDesc{DType::kF32, {1024}, Tier::kNvme});
    auto src = pool.acquire();
    auto dst = pool.acquire();
    const auto values = iota_floats(1024, 3.0f);
    std::memcpy(src.data(), values.data(), values.size() * 4);
    store.store_async("w", src.data(), *writer);
    store.wait("w");
    REQUIRE(store.state("w") == Residency::kAbsent);
    // Earlier work on the fetch's stream fails: the read never runs, so the
    // buffer holds no copy of the shard, and the store must say so.
    stream->launch_host_func([] { raise(ErrorCategory::kIo, "earlier transfer failed"); });
    Event& fetched = store.fetch_async("w", dst.data(), *stream);
    REQUIRE_THROWS_WITH(fetched.synchronize(), Catch::Contains("earlier transfer failed"));
    CHECK(store.state("w") != Residency::kResident);
    REQUIRE_THROWS_WITH(store.wait("w"), Catch::Contains("earlier transfer failed"));
    CHECK(store.state("w") == Residency::kAbsent);
    // The store still works on a healthy stream.
    store.fetch_async("w", dst.data(), *writer);
    store.wait("w");
    CHECK(store.state("w") == Residency::kResident);
    CHECK(std::memcmp(dst.data(), values.data(), values.size() * 4) == 0);
    store.release("w");
  }
}
