// The behaviour every Accelerator must show, written once and run against each
// backend (cpu in accelerator_cpu_test.cc, cuda in accelerator_cuda_test.cc).
#pragma once

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include "runtime/core/accelerator.h"
#include "runtime/core/error.h"

namespace strata::test {

// Copies through device memory on one stream in order: H2D, D2D, D2H.
inline void check_stream_order(Accelerator& acc) {
  constexpr size_t kNumel = 1 << 20;
  auto stream = acc.create_stream();
  std::vector<int32_t> host(kNumel), result(kNumel, -1);
  std::iota(host.begin(), host.end(), 0);
  void* a = acc.allocate(kNumel * 4);
  void* b = acc.allocate(kNumel * 4);
  std::vector<int> order;
  acc.copy_async(a, host.data(), kNumel * 4, CopyKind::kHostToDevice, *stream);
  stream->launch_host_func([&] { order.push_back(1); });
  acc.copy_async(b, a, kNumel * 4, CopyKind::kDeviceToDevice, *stream);
  stream->launch_host_func([&] { order.push_back(2); });
  acc.copy_async(result.data(), b, kNumel * 4, CopyKind::kDeviceToHost, *stream);
  stream->launch_host_func([&] { order.push_back(3); });
  stream->synchronize();
  REQUIRE(result == host);
  REQUIRE(order == std::vector<int>{1, 2, 3});
  acc.deallocate(a);
  acc.deallocate(b);
}

// Stream B waits on an event recorded on stream A after slow work.
inline void check_cross_stream_event(Accelerator& acc) {
  auto a = acc.create_stream();
  auto b = acc.create_stream();
  auto event = acc.create_event();
  REQUIRE(event->query());  // never recorded: complete
  std::atomic<int> value{0};
  int seen_by_b = -1;
  a->launch_host_func([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    value = 42;
  });
  a->record(*event);
  b->wait(*event);
  b->launch_host_func([&] { seen_by_b = value.load(); });
  b->synchronize();
  REQUIRE(seen_by_b == 42);
  event->synchronize();
  REQUIRE(event->query());
  a->synchronize();
}

// Allocations beyond the budget fail with an error naming the numbers.
inline void check_budget(Accelerator& acc, size_t budget) {
  void* first = acc.allocate(budget / 2);
  REQUIRE(acc.memory_stats().in_use_nbytes >= budget / 2);
  try {
    acc.allocate(budget);
    FAIL("allocation beyond the budget succeeded");
  } catch (const Error& e) {
    REQUIRE(e.category() == ErrorCategory::kOutOfMemory);
    const std::string what = e.what();
    REQUIRE_THAT(what, Catch::Contains(fmt::format("requested {} bytes", budget)));
    REQUIRE_THAT(what, Catch::Contains(fmt::format("capacity {}", budget)));
    REQUIRE_THAT(what, Catch::Contains("in use"));
  }
  acc.deallocate(first);
  REQUIRE(acc.memory_stats().in_use_nbytes == 0);
  void* whole = acc.allocate(budget);  // freed memory is usable again
  acc.deallocate(whole);
  REQUIRE(acc.memory_stats().peak_nbytes >= budget);
}

// An exception thrown by work on a stream reaches synchronize() and event
// waiters, and later work on that stream is skipped.
inline void check_stream_error_reaches_waiter(Accelerator& acc) {
  auto stream = acc.create_stream();
  auto other = acc.create_stream();
  auto event = acc.create_event();
  bool later_ran = false;
  stream->launch_host_func([] { raise(ErrorCategory::kIo, "disk on fire"); });
  stream->launch_host_func([&] { later_ran = true; });
  stream->record(*event);
  REQUIRE_THROWS_WITH(stream->synchronize(), Catch::Contains("disk on fire"));
  REQUIRE_FALSE(later_ran);
  if (acc.backend() == Backend::kCpu) {
    // On the cpu backend the failure also propagates through events to other streams.
    REQUIRE_THROWS_WITH(event->synchronize(), Catch::Contains("disk on fire"));
    other->wait(*event);
    REQUIRE_THROWS_WITH(other->synchronize(), Catch::Contains("disk on fire"));
  }
}

inline void check_pinned_memory(Accelerator& acc) {
  constexpr size_t kNbytes = 3 * 4096 + 17;
  auto* pinned = static_cast<unsigned char*>(acc.allocate_pinned(kNbytes));
  REQUIRE(reinterpret_cast<uintptr_t>(pinned) % 4096 == 0);
  for (size_t i = 0; i < kNbytes; ++i) pinned[i] = static_cast<unsigned char>(i);
  void* device = acc.allocate(kNbytes);
  std::vector<unsigned char> back(kNbytes);
  auto stream = acc.create_stream();
  acc.copy_async(device, pinned, kNbytes, CopyKind::kHostToDevice, *stream);
  acc.memset_async(pinned, 0, kNbytes, *stream);
  acc.copy_async(back.data(), device, kNbytes, CopyKind::kDeviceToHost, *stream);
  stream->synchronize();
  for (size_t i = 0; i < kNbytes; ++i) REQUIRE(back[i] == static_cast<unsigned char>(i));
  REQUIRE(pinned[100] == 0);
  acc.deallocate(device);
  acc.deallocate_pinned(pinned);
}

}  // namespace strata::test

// Defines the contract's test cases for one backend.
#define STRATA_ACCELERATOR_CONTRACT_TESTS(TAG, MAKE)                                        \
  TEST_CASE(TAG ": stream order", "[accelerator]") {                                      \
    auto acc = MAKE(strata::AcceleratorOptions{});                                        \
    strata::test::check_stream_order(*acc);                                               \
  }                                                                                       \
  TEST_CASE(TAG ": cross-stream event wait", "[accelerator]") {                           \
    auto acc = MAKE(strata::AcceleratorOptions{});                                        \
    strata::test::check_cross_stream_event(*acc);                                         \
  }                                                                                       \
  TEST_CASE(TAG ": budget enforcement", "[accelerator]") {                                \
    constexpr size_t kBudget = 64u << 20;                                                 \
    auto acc = MAKE(strata::AcceleratorOptions{kBudget});                                 \
    strata::test::check_budget(*acc, kBudget);                                            \
  }                                                                                       \
  TEST_CASE(TAG ": stream error reaches the waiter", "[accelerator]") {                   \
    auto acc = MAKE(strata::AcceleratorOptions{});                                        \
    strata::test::check_stream_error_reaches_waiter(*acc);                                \
  }                                                                                       \
  TEST_CASE(TAG ": pinned memory and memset", "[accelerator]") {                          \
    auto acc = MAKE(strata::AcceleratorOptions{});                                        \
    strata::test::check_pinned_memory(*acc);                                              \
  }
