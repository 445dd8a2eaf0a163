// Pinned buffer pool: fixed buffers, exhaustion with a useful error,
// backpressure between threads, statistics.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "offload/pinned_pool.h"
#include "core/accelerator.h"
#include "core/error.h"

using namespace strata;
using namespace std::chrono_literals;

TEST_CASE("pool hands out distinct aligned buffers of the configured size", "[offload][pool]") {
  offload::PinnedBufferPool pool({3, 10000, 1000ms, "test pool"});
  CHECK(pool.buffer_nbytes() == 12288);  // rounded to pages
  std::vector<offload::PinnedBuffer> leases;
  std::set<void*> seen;
  for (int i = 0; i < 3; ++i) {
    leases.push_back(pool.acquire());
    CHECK(reinterpret_cast<uintptr_t>(leases.back().data()) % 4096 == 0);
    std::memset(leases.back().data(), i, leases.back().nbytes());  // really writable
    seen.insert(leases.back().data());
  }
  CHECK(seen.size() == 3);
  CHECK(pool.available() == 0);
  CHECK_FALSE(pool.try_acquire().has_value());
  leases.pop_back();
  CHECK(pool.available() == 1);
  auto again = pool.try_acquire();
  REQUIRE(again.has_value());
  const auto stats = pool.stats();
  CHECK(stats.acquires == 4);
  CHECK(stats.in_use == 3);
  CHECK(stats.peak_in_use == 3);
  // One region per buffer (io_uring registers each as a fixed buffer), in order.
  const auto regions = pool.regions();
  REQUIRE(regions.size() == 3);
  for (size_t i = 0; i < regions.size(); ++i) {
    CHECK(regions[i].iov_len == 12288);
    CHECK(static_cast<char*>(regions[i].iov_base) == static_cast<char*>(regions[0].iov_base) + i * 12288);
  }
}

TEST_CASE("an exhausted pool fails after its timeout saying by how much it is too small", "[offload][pool]") {
  offload::PinnedBufferPool pool({2, 4096, 50ms, "optimizer pool"});
  auto a = pool.acquire();
  auto b = pool.acquire();
  try {
    (void)pool.acquire();
    FAIL("acquire on an exhausted pool returned");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::kOutOfMemory);
    CHECK_THAT(e.what(), Catch::Contains("optimizer pool exhausted"));
    CHECK_THAT(e.what(), Catch::Contains("too small by at least 1 buffer"));
    CHECK_THAT(e.what(), Catch::Contains("buffer_count to 3"));
  }
  CHECK(pool.stats().timeouts == 1);
}

TEST_CASE("acquire blocks until another thread returns a buffer (backpressure)", "[offload][pool]") {
  offload::PinnedBufferPool pool({1, 4096, 10000ms, "bp pool"});
  auto held = pool.acquire();
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    auto lease = pool.acquire();  // blocks until `held` is released
    got = true;
  });
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(got.load());
  held.release();
  waiter.join();
  CHECK(got.load());
  const auto stats = pool.stats();
  CHECK(stats.waited == 1);
  CHECK(stats.wait_seconds >= 0.05);
  CHECK(stats.in_use == 0);
}

TEST_CASE("many threads share a small pool without exceeding it", "[offload][pool]") {
  offload::PinnedBufferPool pool({3, 4096, 10000ms, "shared pool"});
  std::atomic<int> inside{0}, most{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        auto lease = pool.acquire();
        const int now = ++inside;
        int seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {}
        std::this_thread::yield();
        --inside;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(most.load() <= 3);
  CHECK(pool.stats().acquires == 400);
  CHECK(pool.stats().peak_in_use <= 3);
}

TEST_CASE("pool memory can come from an accelerator's pinned allocator", "[offload][pool]") {
  auto cpu = make_cpu_accelerator();
  offload::PinnedBufferPool pool({2, 8192, 1000ms, "acc pool"}, cpu.get());
  auto lease = pool.acquire();
  std::memset(lease.data(), 0xab, lease.nbytes());
  CHECK(static_cast<unsigned char*>(lease.data())[8191] == 0xab);
}

TEST_CASE("pool rejects a zero size or count", "[offload][pool]") {
  CHECK_THROWS_AS(offload::PinnedBufferPool({0, 4096}), Error);
  CHECK_THROWS_AS(offload::PinnedBufferPool({1, 0}), Error);
}

// (f) Destroying the pool while buffers are leased must not free memory the
// leases still use. Before the fix the destructor unmapped the memory, so the
// writes below faulted (SIGSEGV: the test crashes, observably) and release()
// then touched the destroyed pool's mutex; now the memory lives until the last
// lease is released.
TEST_CASE("a pool destroyed with leases outstanding keeps their memory until the last is released",
          "[offload][pool]") {
  SECTION("host memory") {
    auto pool = std::make_unique<offload::PinnedBufferPool>(offload::PinnedPoolOptions{2, 8192, 1000ms, "early pool"});
    auto first = pool->acquire();
    auto second = pool->acquire();
    std::memset(first.data(), 0x11, first.nbytes());
    pool.reset();
    std::memset(first.data(), 0x5a, first.nbytes());
    std::memset(second.data(), 0xa5, second.nbytes());
    CHECK(first.as<unsigned char>()[8191] == 0x5a);
    CHECK(second.as<unsigned char>()[0] == 0xa5);
    first.release();
    CHECK_FALSE(first.valid());
    std::memset(second.data(), 0x3c, second.nbytes());  // still ours after the other lease went
    CHECK(second.as<unsigned char>()[4096] == 0x3c);
    second.release();
  }
  SECTION("accelerator memory") {
    auto cpu = make_cpu_accelerator();
    offload::PinnedBuffer lease;
    {
      offload::PinnedBufferPool pool({1, 4096, 1000ms, "acc pool"}, cpu.get());
      lease = pool.acquire();
    }
    std::memset(lease.data(), 0x77, lease.nbytes());
    CHECK(lease.as<unsigned char>()[4095] == 0x77);
    lease.release();  // frees through the accelerator, which outlives it
  }
}
