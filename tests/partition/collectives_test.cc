// Gloo collectives with ranks as threads of one process (real TCP over loopback).
#include <catch2/catch.hpp>

#include "tests/partition/collective_checks.h"
#include "tests/partition/thread_ranks.h"

using namespace strata;

TEST_CASE("gloo collectives, ranks as threads: 1, 2, 3, 4 and 8 ranks, integer data, exact") {
  for (int world : {1, 2, 3, 4, 8}) {
    INFO("world size " << world);
    // 1000 elements: several Gloo segments are not needed for correctness; 4099
    // (odd, not a multiple of anything) exercises uneven splits in the ring.
    for (size_t numel : {size_t{1}, size_t{1000}, size_t{4099}}) {
      REQUIRE_NOTHROW(test::run_thread_ranks(world, [numel](int, partition::Communicator& comm, Accelerator&,
                                                                Stream& stream) {
        test::run_collective_checks(comm, stream, numel);
      }));
    }
  }
}

TEST_CASE("gloo collectives are asynchronous on the stream and ordered with other stream work") {
  test::run_thread_ranks(3, [](int rank, partition::Communicator& comm, Accelerator&, Stream& stream) {
    std::vector<float> data(512, 0.0f);
    // Work queued before the collective on the same stream runs first.
    stream.launch_host_func([&] { std::fill(data.begin(), data.end(), static_cast<float>(rank + 1)); });
    auto event = comm.allreduce(data.data(), data.data(), data.size(), DType::kF32, partition::ReduceOp::kSum,
                                stream);
    event->synchronize();
    for (float v : data) STRATA_CHECK(v == 6.0f, kInternal, "rank {} got {}", rank, v);
  });
}

TEST_CASE("gloo: a rank that never joins makes connecting fail within the timeout") {
  partition::StoreServer server("127.0.0.1", 0);
  partition::StoreClient store("127.0.0.1", server.port(), 0, std::chrono::milliseconds(500));
  auto accelerator = make_cpu_accelerator();
  partition::CommunicatorOptions options;
  options.rank = 0;
  options.world_size = 2;
  options.timeout = std::chrono::milliseconds(500);
  auto start = std::chrono::steady_clock::now();
  REQUIRE_THROWS_WITH(partition::make_gloo_communicator(*accelerator, store, options),
                      Catch::Contains("rank 0 of 2") && Catch::Contains("timed out"));
  REQUIRE(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
}
