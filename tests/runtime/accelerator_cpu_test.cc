// The accelerator contract on the cpu backend, and the Gloo communicator's
// events under it (real TCP over loopback).
#include "tests/runtime/accelerator_contract.h"

#include <cstring>
#include <future>
#include <thread>

#include "partition/communicator.h"
#include "partition/store.h"
#include "tests/partition/thread_ranks.h"
#include "tests/runtime/accelerator_comm_contract.h"

STRATA_ACCELERATOR_CONTRACT_TESTS("cpu", strata::make_cpu_accelerator)

// The same contract with every stream's host functions on one shared thread,
// as CUDA runs them (AcceleratorOptions::cpu_shared_host_thread).
namespace {
std::unique_ptr<strata::Accelerator> make_cpu_shared_host_thread(strata::AcceleratorOptions options) {
  options.cpu_shared_host_thread = true;
  return strata::make_cpu_accelerator(options);
}
}  // namespace
STRATA_ACCELERATOR_CONTRACT_TESTS("cpu with one host-function thread", make_cpu_shared_host_thread)

TEST_CASE("cpu with one host-function thread: a host function that blocks holds up other streams' host functions",
          "[accelerator][issue26]") {
  // What the option models, shown both ways: the same two streams, a host
  // function on one that sleeps, a host function on the other launched while
  // it sleeps. The copies and waits of a stream are not host functions and
  // are not held up (on cuda they are the device's).
  using Clock = std::chrono::steady_clock;
  for (const bool shared : {false, true}) {
    INFO("cpu_shared_host_thread " << shared);
    strata::AcceleratorOptions options;
    options.cpu_shared_host_thread = shared;
    auto acc = strata::make_cpu_accelerator(options);
    auto a = acc->create_stream();
    auto b = acc->create_stream();
    std::promise<void> started;
    a->launch_host_func([&] {
      started.set_value();
      std::this_thread::sleep_for(std::chrono::milliseconds(600));
    });
    started.get_future().wait();
    int src = 7, dst = 0;
    const auto launched = Clock::now();
    acc->copy_async(&dst, &src, sizeof(int), strata::CopyKind::kHostToHost, *b);
    b->synchronize();
    const auto copy_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - launched).count();
    CHECK(dst == 7);
    CHECK(copy_ms < 300);
    b->launch_host_func([] {});
    b->synchronize();
    const auto host_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - launched).count();
    if (shared) {
      CHECK(host_ms >= 500);
    } else {
      CHECK(host_ms < 300);
    }
    a->synchronize();
  }
}

TEST_CASE("make_accelerator picks a backend by name", "[accelerator]") {
  REQUIRE(strata::make_accelerator("cpu")->backend() == strata::Backend::kCpu);
  REQUIRE_THROWS_WITH(strata::make_accelerator("tpu"), Catch::Contains("unknown accelerator \"tpu\""));
  if (strata::cuda_device_count() == 0) {
    REQUIRE(strata::make_accelerator("auto")->backend() == strata::Backend::kCpu);
    REQUIRE_THROWS_AS(strata::make_cuda_accelerator(0), strata::Error);
  }
}

TEST_CASE("cpu: a Gloo collective's event works in Stream::wait, record and deallocate_after",
          "[accelerator][gloo]") {
  for (int world : {1, 2, 3}) {
    INFO("world size " << world);
    REQUIRE_NOTHROW(strata::test::run_thread_ranks(
        world, [](int, strata::partition::Communicator& comm, strata::Accelerator& acc, strata::Stream&) {
          strata::test::check_collective_event_in_streams(acc, comm);
        }));
  }
}

// (e) on Gloo: a collective whose peer is gone fails on the stream's thread
// within the timeout, and the failure reaches a stream that waited on it.
TEST_CASE("cpu: a failed Gloo collective reaches the streams that waited on its event", "[accelerator][gloo]") {
  using namespace strata;
  constexpr std::chrono::milliseconds kTimeout{2000};
  partition::StoreServer server("127.0.0.1", 0);
  auto acc = make_cpu_accelerator();
  auto options_for = [&](int rank) {
    partition::CommunicatorOptions options;
    options.rank = rank;
    options.world_size = 2;
    options.timeout = kTimeout;
    return options;
  };
  std::promise<void> rank0_connected;
  std::exception_ptr rank1_error;
  // Rank 1 connects, then leaves without taking part in the collective.
  std::thread rank1([&, connected = rank0_connected.get_future()]() mutable {
    try {
      partition::StoreClient store("127.0.0.1", server.port(), 1, kTimeout);
      auto comm = partition::make_gloo_communicator(*acc, store, options_for(1));
      connected.wait();
    } catch (...) {
      rank1_error = std::current_exception();
    }
  });
  std::unique_ptr<partition::Communicator> comm;
  {
    partition::StoreClient store("127.0.0.1", server.port(), 0, kTimeout);
    try {
      comm = partition::make_gloo_communicator(*acc, store, options_for(0));
    } catch (...) {
      rank0_connected.set_value();
      rank1.join();
      throw;
    }
    rank0_connected.set_value();
    rank1.join();
    REQUIRE_FALSE(rank1_error);

    auto stream = acc->create_stream();
    auto waiter = acc->create_stream();
    std::vector<float> data(16, 1.0f);
    auto reduced = comm->allreduce(data.data(), data.data(), data.size(), DType::kF32,
                                   partition::ReduceOp::kSum, *stream);
    bool waiter_ran = false;
    waiter->wait(*reduced);
    waiter->launch_host_func([&] { waiter_ran = true; });
    auto waiter_done = acc->create_event();
    waiter->record(*waiter_done);
    try {
      waiter_done->synchronize();
      FAIL("a stream that waited on a failed collective reported success");
    } catch (const Error& e) {
      REQUIRE(e.category() == ErrorCategory::kCommunication);
      REQUIRE_THAT(e.what(), Catch::Contains("allreduce") && Catch::Contains("rank 0 of 2") &&
                                 Catch::Contains("timeout 2000 ms"));
    }
    REQUIRE_FALSE(waiter_ran);
    REQUIRE_THROWS_WITH(waiter->synchronize(), Catch::Contains("allreduce"));
    REQUIRE_THROWS_WITH(reduced->synchronize(), Catch::Contains("allreduce"));
    REQUIRE_THROWS_WITH(stream->synchronize(), Catch::Contains("allreduce"));
    comm.reset();
  }
}

TEST_CASE("cpu: a freed block of >= 128 KiB serves the next request of its size, and the cache stays within the peak",
          "[accelerator]") {
  auto acc = strata::make_cpu_accelerator({size_t{64} << 20});
  const size_t big = size_t{3} << 20, other = size_t{5} << 20;
  void* a = acc->allocate(big);
  std::memset(a, 0x5a, big);
  acc->deallocate(a);
  CHECK(acc->memory_stats().cached_nbytes == big);
  void* again = acc->allocate(big);  // the same mapping: no page faults, not zeroed
  CHECK(again == a);
  CHECK(static_cast<unsigned char*>(again)[big - 1] == 0x5a);
  CHECK(acc->memory_stats().cached_nbytes == 0);
  // Another size does not take it; and in use + cached never exceeds the peak
  // in use: caching the freed `other` beside `big` would, so the least
  // recently cached (`big`) goes back to the system to make room.
  acc->deallocate(again);
  void* b = acc->allocate(other);
  CHECK(b != a);
  acc->deallocate(b);
  const strata::MemoryStats stats = acc->memory_stats();
  CHECK(stats.in_use_nbytes == 0);
  CHECK(stats.peak_nbytes == other);
  CHECK(stats.cached_nbytes == other);
  // Small blocks come from malloc and are never cached.
  void* small = acc->allocate(4096);
  acc->deallocate(small);
  CHECK(acc->memory_stats().cached_nbytes == stats.cached_nbytes);
  // From 128 KiB (an expert's copy in a small mixture of experts) a block is
  // a mapping of its own, cached like the large ones.
  const size_t medium = size_t{128} << 10;
  void* m = acc->allocate(medium);
  acc->deallocate(m);
  CHECK(acc->memory_stats().cached_nbytes == medium);  // `other` made room, within the peak
  CHECK(acc->allocate(medium) == m);
  acc->deallocate(m);
}
