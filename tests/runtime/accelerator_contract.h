// The behaviour every Accelerator must show, written once and run against each
// backend (cpu in accelerator_cpu_test.cc, cuda in accelerator_cuda_test.cc).
//
// Host buffers that a gated stream copies to or from are pinned: on cuda a
// copy to or from pageable memory may block the caller until the stream
// reaches it, which would deadlock the thread that is to open the gate.
#pragma once

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "core/accelerator.h"
#include "core/error.h"

namespace strata::test {

// A hang guard for tests that hold a stream with a host event: signals the
// event after a generous deadline unless the test opened it first, and says
// whether it had to. A broken implementation then fails the test instead of
// hanging it; a correct one never comes near the deadline.
class GateGuard {
 public:
  explicit GateGuard(HostEvent& gate, std::chrono::seconds deadline = std::chrono::seconds(20))
      : gate_(gate), thread_([this, deadline] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (!changed_.wait_for(lock, deadline, [&] { return opened_; })) {
            fired_ = true;
            gate_.signal();
          }
        }) {}
  ~GateGuard() { open(); }
  GateGuard(const GateGuard&) = delete;
  GateGuard& operator=(const GateGuard&) = delete;

  // Opens the gate (signal) unless the deadline did; returns whether the deadline had fired.
  bool open() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      opened_ = true;
    }
    changed_.notify_all();
    if (thread_.joinable()) thread_.join();
    gate_.signal();  // no effect when the deadline signalled it
    return fired_;
  }
  bool fired() {
    std::lock_guard<std::mutex> lock(mutex_);
    return fired_;
  }

 private:
  HostEvent& gate_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool opened_ = false;
  bool fired_ = false;
  std::thread thread_;
};

// An Event of no backend: streams must refuse it, not reinterpret it.
class ForeignEvent final : public Event {
 public:
  void synchronize() override {}
  bool query() override { return true; }
};

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

// (a) Streams accept every event the accelerator hands out, keep the point a
// wait saw when the event is recorded again, and refuse foreign events and
// recording a host event with Error(kBadArgument) instead of misreading them.
inline void check_event_kinds(Accelerator& acc) {
  auto a = acc.create_stream();
  auto b = acc.create_stream();
  auto event = acc.create_event();
  auto first_gate = acc.create_host_event();
  auto second_gate = acc.create_host_event();
  GateGuard first(*first_gate);
  GateGuard second(*second_gate);
  std::atomic<bool> b_ran{false};

  a->wait(*first_gate);
  a->record(*event);
  b->wait(*event);  // waits for the first gate only
  a->wait(*second_gate);
  a->record(*event);  // moves the event; b's wait keeps the old point
  b->launch_host_func([&] { b_ran = true; });
  auto b_done = acc.create_event();
  b->record(*b_done);
  REQUIRE_FALSE(first.open());
  b_done->synchronize();  // returns while the second gate is closed (else the guard fires)
  REQUIRE_FALSE(second.fired());
  REQUIRE(b_ran.load());
  REQUIRE_FALSE(event->query());  // the moved point is behind the second gate
  REQUIRE_FALSE(second.open());
  event->synchronize();
  b->synchronize();

  ForeignEvent foreign;
  REQUIRE_THROWS_AS(a->wait(foreign), Error);
  REQUIRE_THROWS_AS(a->record(foreign), Error);
  try {
    a->record(*first_gate);
    FAIL("recording a host event succeeded");
  } catch (const Error& e) {
    REQUIRE(e.category() == ErrorCategory::kBadArgument);
  }
  void* block = acc.allocate(4096);
  REQUIRE_THROWS_AS(acc.deallocate_after(block, foreign), Error);
  acc.deallocate(block);
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
    REQUIRE_THAT(what, Catch::Contains("cached"));
  }
  acc.deallocate(first);
  REQUIRE(acc.memory_stats().in_use_nbytes == 0);
  void* whole = acc.allocate(budget);  // freed memory is usable again
  acc.deallocate(whole);
  REQUIRE(acc.memory_stats().peak_nbytes >= budget);
}

// (c) Cached bytes count against the budget: a request that fits only without
// the cache drops it; in use + cached never exceeds the capacity.
inline void check_cache_counts_against_budget(Accelerator& acc, size_t budget) {
  auto within_budget = [&] {
    const MemoryStats stats = acc.memory_stats();
    INFO("in use " << stats.in_use_nbytes << ", cached " << stats.cached_nbytes << ", capacity "
                   << stats.capacity_nbytes);
    REQUIRE(stats.capacity_nbytes == budget);
    REQUIRE(stats.in_use_nbytes + stats.cached_nbytes <= stats.capacity_nbytes);
  };
  void* half = acc.allocate(budget / 2);
  acc.deallocate(half);  // cached (cpu: a block this large is its own mapping)
  within_budget();
  REQUIRE(acc.memory_stats().in_use_nbytes == 0);
  void* most = acc.allocate(budget / 4 * 3);  // fits only if the cached half is dropped
  within_budget();
  REQUIRE(acc.memory_stats().in_use_nbytes >= budget / 4 * 3);
  try {
    acc.allocate(budget / 2);
    FAIL("allocation beyond the budget succeeded");
  } catch (const Error& e) {
    REQUIRE(e.category() == ErrorCategory::kOutOfMemory);
    REQUIRE_THAT(e.what(), Catch::Contains("cached") && Catch::Contains("in use"));
  }
  within_budget();
  acc.deallocate(most);
  within_budget();
}

// allocate never waits for the device: with a stream parked on a host event
// that this thread signals only later, an allocation that must drop cached
// blocks still returns (on cuda a cudaFree there waited for the whole device,
// the parked stream included: a deadlock, here caught by the guard's deadline).
inline void check_allocate_while_a_stream_is_parked(Accelerator& acc, size_t budget) {
  auto stream = acc.create_stream();
  void* scratch = acc.allocate(4096);
  auto gate = acc.create_host_event();
  GateGuard guard(*gate, std::chrono::seconds(10));
  stream->wait(*gate);
  acc.memset_async(scratch, 0, 4096, *stream);  // queued behind the gate
  void* half = acc.allocate(budget / 2);
  acc.deallocate(half);                          // cached
  void* most = acc.allocate(budget / 4 * 3);     // fits only once the cached half is dropped
  const bool returned_while_parked = !guard.fired() && !gate->query();
  REQUIRE_FALSE(guard.open());
  REQUIRE(returned_while_parked);
  stream->synchronize();
  acc.deallocate(most);
  acc.deallocate(scratch);
}

// (c) deallocate_after: never blocks, the block stays in use (and is not handed
// out again) until the event completes, then it is free.
inline void check_stream_ordered_free(Accelerator& acc, size_t budget) {
  auto stream = acc.create_stream();
  auto gate = acc.create_host_event();
  GateGuard guard(*gate);
  const size_t half = budget / 2;
  auto* first = static_cast<char*>(acc.allocate(half));
  stream->wait(*gate);
  acc.memset_async(first, 7, half, *stream);  // queued work that uses the block
  auto used = acc.create_event();
  stream->record(*used);

  acc.deallocate_after(first, *used);  // returns at once (a blocking free would wait for the guard)
  REQUIRE_FALSE(guard.fired());
  MemoryStats stats = acc.memory_stats();
  REQUIRE(stats.pending_free_nbytes >= half);
  REQUIRE(stats.in_use_nbytes >= half);
  // Not handed to another allocation before the event completes: a request of
  // the same size gets other memory (the budget holds exactly both).
  auto* other = static_cast<char*>(acc.allocate(half));
  REQUIRE((other + half <= first || other >= first + half));
  // And still counted against the budget.
  REQUIRE_THROWS_WITH(acc.allocate(1 << 20),
                      Catch::Contains("in use") && Catch::Contains("cached") && Catch::Contains("capacity"));
  REQUIRE_THROWS_AS(acc.deallocate(first), Error);  // already freed (pending)

  // A host event works as the completion too.
  auto held = acc.create_host_event();
  acc.deallocate_after(other, *held);
  REQUIRE(acc.memory_stats().pending_free_nbytes >= 2 * half);

  REQUIRE_FALSE(guard.open());
  used->synchronize();
  held->signal();
  stats = acc.memory_stats();
  REQUIRE(stats.pending_free_nbytes == 0);
  REQUIRE(stats.in_use_nbytes == 0);
  void* again = acc.allocate(half + budget / 4);  // the freed bytes are usable again
  acc.deallocate(again);

  // An event never recorded is complete: the block is free at once.
  auto never = acc.create_event();
  void* quick = acc.allocate(4096);
  acc.deallocate_after(quick, *never);
  REQUIRE(acc.memory_stats().in_use_nbytes == 0);
  acc.deallocate_after(nullptr, *never);
  int not_ours = 0;
  REQUIRE_THROWS_AS(acc.deallocate_after(&not_ours, *never), Error);
  stream->synchronize();
}

// (b) An exception thrown by work on a stream reaches every event recorded
// after it (not those before), synchronize(), and, through waits, other
// streams' later events; later host functions on a failed stream are skipped.
inline void check_stream_error_reaches_waiter(Accelerator& acc) {
  auto stream = acc.create_stream();
  auto before = acc.create_event();
  auto after = acc.create_event();
  auto later = acc.create_event();
  bool later_ran = false;
  stream->record(*before);
  stream->launch_host_func([] { raise(ErrorCategory::kIo, "disk on fire"); });
  stream->record(*after);
  stream->launch_host_func([&] { later_ran = true; });
  stream->record(*later);
  REQUIRE_THROWS_WITH(stream->synchronize(), Catch::Contains("disk on fire"));
  REQUIRE_FALSE(later_ran);
  REQUIRE_NOTHROW(before->synchronize());
  REQUIRE_THROWS_WITH(after->synchronize(), Catch::Contains("disk on fire"));
  REQUIRE_THROWS_WITH(later->synchronize(), Catch::Contains("disk on fire"));
  REQUIRE(later->query());  // complete, and query does not throw

  // Through a wait: events of the waiting stream before the wait are clean,
  // the ones after it and its synchronize() report the error, and its later
  // host functions are skipped. A third stream inherits it in turn.
  auto other = acc.create_stream();
  auto other_before = acc.create_event();
  auto other_after = acc.create_event();
  bool other_ran = false;
  other->record(*other_before);
  other->wait(*later);
  other->launch_host_func([&] { other_ran = true; });
  other->record(*other_after);
  REQUIRE_THROWS_WITH(other->synchronize(), Catch::Contains("disk on fire"));
  REQUIRE_NOTHROW(other_before->synchronize());
  REQUIRE_THROWS_WITH(other_after->synchronize(), Catch::Contains("disk on fire"));
  REQUIRE_FALSE(other_ran);
  auto third = acc.create_stream();
  third->wait(*other_after);
  REQUIRE_THROWS_WITH(third->synchronize(), Catch::Contains("disk on fire"));

  // Waiting on the point before the failure brings no error.
  auto clean = acc.create_stream();
  clean->wait(*before);
  REQUIRE_NOTHROW(clean->synchronize());
}

// (b) The failure happens after the other stream already waited: the error
// still crosses the wait (its later events report it once the device is there).
inline void check_error_after_wait_crosses(Accelerator& acc) {
  auto a = acc.create_stream();
  auto b = acc.create_stream();
  auto gate = acc.create_host_event();
  GateGuard guard(*gate);
  auto a_done = acc.create_event();
  auto b_done = acc.create_event();
  a->wait(*gate);
  a->launch_host_func([] { raise(ErrorCategory::kIo, "late failure"); });
  a->record(*a_done);
  b->wait(*a_done);
  b->record(*b_done);
  REQUIRE_FALSE(b_done->query());  // held behind the gate
  REQUIRE_FALSE(guard.open());
  REQUIRE_THROWS_WITH(b_done->synchronize(), Catch::Contains("late failure"));
  REQUIRE_THROWS_WITH(b->synchronize(), Catch::Contains("late failure"));
  REQUIRE_THROWS_WITH(a->synchronize(), Catch::Contains("late failure"));
}

// (d) A stream waiting on a host event is held until signal(); signalling
// before the wait works too; a host thread can synchronize on it.
inline void check_host_event_signal(Accelerator& acc) {
  auto stream = acc.create_stream();
  // Signal before the wait.
  auto early = acc.create_host_event();
  REQUIRE_FALSE(early->query());
  early->signal();
  REQUIRE(early->query());
  REQUIRE_NOTHROW(early->synchronize());
  bool ran = false;
  stream->wait(*early);
  stream->launch_host_func([&] { ran = true; });
  stream->synchronize();
  REQUIRE(ran);

  // Wait before the signal: the stream's later work sees that signal() ran.
  auto late = acc.create_host_event();
  std::atomic<bool> signalled{false};
  std::atomic<int> seen{-1};
  stream->wait(*late);
  stream->launch_host_func([&] { seen = signalled.load() ? 1 : 0; });
  auto after = acc.create_event();
  stream->record(*after);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // room for a stream that does not wait to run
  REQUIRE_FALSE(after->query());
  REQUIRE(seen.load() == -1);
  // A host thread blocked on the event wakes with it.
  std::atomic<bool> host_woke{false};
  std::thread host_waiter([&] {
    late->synchronize();
    host_woke = true;
  });
  std::thread signaller([&] {
    signalled = true;
    late->signal();
  });
  signaller.join();
  host_waiter.join();
  stream->synchronize();
  REQUIRE(host_woke.load());
  REQUIRE(seen.load() == 1);
  REQUIRE(after->query());
  late->signal();  // single-use: a second signal has no effect
  REQUIRE_NOTHROW(late->synchronize());
}

// (d) Many host events in flight at once, each signalled by its own thread
// (I/O completions) in an order unrelated to the waits.
inline void check_many_host_events(Accelerator& acc) {
  constexpr int kCount = 32;
  auto stream = acc.create_stream();
  std::vector<std::unique_ptr<HostEvent>> events;
  for (int i = 0; i < kCount; ++i) events.push_back(acc.create_host_event());
  std::atomic<int> signalled{0};
  int seen = -1;
  for (auto& event : events) stream->wait(*event);
  stream->launch_host_func([&] { seen = signalled.load(); });
  std::vector<std::thread> completions;
  for (int i = kCount - 1; i >= 0; --i) {
    completions.emplace_back([&, i] {
      ++signalled;
      events[static_cast<size_t>(i)]->signal();
    });
  }
  for (auto& thread : completions) thread.join();
  stream->synchronize();
  REQUIRE(seen == kCount);
}

// (d) fail(): synchronize rethrows, waiting streams get the error; a host event
// destroyed before completing releases its waiters with an error.
inline void check_host_event_fail(Accelerator& acc) {
  auto stream = acc.create_stream();
  auto failing = acc.create_host_event();
  auto after = acc.create_event();
  bool ran = false;
  stream->wait(*failing);
  stream->launch_host_func([&] { ran = true; });
  stream->record(*after);
  failing->fail(std::make_exception_ptr(Error(ErrorCategory::kIo, "read of block 7 failed")));
  failing->signal();  // no effect: the first completion wins
  REQUIRE(failing->query());
  REQUIRE_THROWS_WITH(failing->synchronize(), Catch::Contains("read of block 7 failed"));
  REQUIRE_THROWS_WITH(after->synchronize(), Catch::Contains("read of block 7 failed"));
  REQUIRE_THROWS_WITH(stream->synchronize(), Catch::Contains("read of block 7 failed"));
  REQUIRE_FALSE(ran);

  auto abandoned_stream = acc.create_stream();
  auto abandoned = acc.create_host_event();
  abandoned_stream->wait(*abandoned);
  abandoned.reset();
  try {
    abandoned_stream->synchronize();
    FAIL("a stream that waited on a destroyed host event reported success");
  } catch (const Error& e) {
    REQUIRE(e.category() == ErrorCategory::kInternal);
    REQUIRE_THAT(e.what(), Catch::Contains("destroyed before"));
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
  TEST_CASE(TAG ": streams accept every event of the accelerator", "[accelerator]") {     \
    auto acc = MAKE(strata::AcceleratorOptions{});                                        \
    strata::test::check_event_kinds(*acc);                                                \
  }                                                                                       \
  TEST_CASE(TAG ": budget enforcement", "[accelerator]") {                                \
    constexpr size_t kBudget = 64u << 20;                                                 \
    auto acc = MAKE(strata::AcceleratorOptions{kBudget});                                 \
    strata::test::check_budget(*acc, kBudget);                                            \
  }                                                                                       \
  TEST_CASE(TAG ": cached bytes count against the budget", "[accelerator]") {             \
    constexpr size_t kBudget = 64u << 20;                                                 \
    auto acc = MAKE(strata::AcceleratorOptions{kBudget});                                 \
    strata::test::check_cache_counts_against_budget(*acc, kBudget);                       \
  }                                                                                       \
  TEST_CASE(TAG ": allocate does not wait for a stream parked on a host event", "[accelerator]") { \
    constexpr size_t kBudget = 64u << 20;                                                 \
    auto acc = MAKE(strata::AcceleratorOptions{kBudget});                                 \
    strata::test::check_allocate_while_a_stream_is_parked(*acc, kBudget);                \
  }                                                                                       \
  TEST_CASE(TAG ": stream-ordered free", "[accelerator]") {                               \
    constexpr size_t kBudget = 64u << 20;                                                 \
    auto acc = MAKE(strata::AcceleratorOptions{kBudget});                                 \
    strata::test::check_stream_ordered_free(*acc, kBudget);                               \
  }                                                                                       \
  TEST_CASE(TAG ": stream error reaches the waiter", "[accelerator]") {                   \
    auto acc = MAKE(strata::AcceleratorOptions{});                                        \
    strata::test::check_stream_error_reaches_waiter(*acc);                                \
  }                                                                                       \
  TEST_CASE(TAG ": an error raised after a wait still crosses it", "[accelerator]") {     \
    auto acc = MAKE(strata::AcceleratorOptions{});                                        \
    strata::test::check_error_after_wait_crosses(*acc);                                   \
  }                                                                                       \
  TEST_CASE(TAG ": host event signal before and after the wait", "[accelerator]") {       \
    auto acc = MAKE(strata::AcceleratorOptions{});                                        \
    strata::test::check_host_event_signal(*acc);                                          \
  }                                                                                       \
  TEST_CASE(TAG ": many host events signalled by other threads", "[accelerator]") {       \
    auto acc = MAKE(strata::AcceleratorOptions{});                                        \
    strata::test::check_many_host_events(*acc);                                           \
  }                                                                                       \
  TEST_CASE(TAG ": host event failure reaches waiting streams", "[accelerator]") {        \
    auto acc = MAKE(strata::AcceleratorOptions{});                                        \
    strata::test::check_host_event_fail(*acc);                                            \
  }                                                                                       \
  TEST_CASE(TAG ": pinned memory and memset", "[accelerator]") {                          \
    auto acc = MAKE(strata::AcceleratorOptions{});                                        \
    strata::test::check_pinned_memory(*acc);                                              \
  }
