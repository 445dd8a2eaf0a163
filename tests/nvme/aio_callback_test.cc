// Completion callbacks of AioHandle (submit_read/submit_write with on_done):
// many requests in flight with no thread waiting on them, each callback called
// exactly once after its last piece, errors delivered to the callback (not to
// wait_all), wait_all and the destructor waiting for callbacks to return.
// Real files in a temporary directory, every backend.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "nvme/aio_handle.h"
#include "core/error.h"
#include "tests/nvme/hooked_backend.h"
#include "tests/nvme/test_util.h"
#include "tests/support/temp_dir.h"

using namespace strata::nvme;
using strata::nvme::test::aligned_buffer;
using strata::nvme::test::fill_random;
using strata::nvme::test::kEngines;
using strata::nvme::test::options_for;

namespace {

// Collects the outcome of each callback by index; counts calls.
struct Outcomes {
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<int> calls;
  std::vector<std::exception_ptr> errors;
  size_t finished = 0;

  explicit Outcomes(size_t n) : calls(n, 0), errors(n) {}
  AioHandle::DoneFn callback(size_t i) {
    return [this, i](std::exception_ptr error) {
      std::lock_guard lock(mutex);
      ++calls[i];
      errors[i] = std::move(error);
      ++finished;
      cv.notify_all();
    };
  }
  // Waits (bounded, so a lost callback fails the test instead of hanging it).
  bool wait_for(size_t n) {
    std::unique_lock lock(mutex);
    return cv.wait_for(lock, std::chrono::seconds(30), [&] { return finished >= n; });
  }
};

}  // namespace

TEST_CASE("read callbacks: many requests in flight, each called once after its data landed", "[nvme]") {
  strata::test::TempDir dir("nvme-callback");
  constexpr size_t kRequests = 24, kChunk = (256 << 10) + 4096;  // 5 pieces each
  auto data = aligned_buffer(kRequests * kChunk);
  fill_random(data.get(), kRequests * kChunk, 11);
  for (EngineKind engine : kEngines) {
    INFO("engine " << engine_kind_name(engine));
    AioHandle handle(options_for(engine, 3));
    File file = File::open(dir.file("data.bin"), OpenMode::kTruncate);
    handle.write(file, data.get(), kRequests * kChunk, 0);
    auto out = aligned_buffer(kRequests * kChunk);
    Outcomes outcomes(kRequests);
    // In reverse file order, all submitted before any is waited for.
    for (size_t i = kRequests; i-- > 0;) {
      handle.submit_read(file, out.get() + i * kChunk, kChunk, i * kChunk, outcomes.callback(i));
    }
    REQUIRE(outcomes.wait_for(kRequests));
    for (size_t i = 0; i < kRequests; ++i) {
      CAPTURE(i);
      CHECK(outcomes.calls[i] == 1);
      CHECK(outcomes.errors[i] == nullptr);
    }
    CHECK(std::memcmp(out.get(), data.get(), kRequests * kChunk) == 0);
    CHECK(handle.stats().bytes_read == kRequests * kChunk);
    CHECK_NOTHROW(handle.wait_all());  // nothing left, nothing consumed twice
  }
}

TEST_CASE("an injected EIO reaches the callback with file and offset, wait_all neither waits forever nor rethrows it",
          "[nvme]") {
  strata::test::TempDir dir("nvme-callback-eio");
  constexpr size_t kRequests = 6, kChunk = 128 << 10;  // 2 pieces each
  auto data = aligned_buffer(kRequests * kChunk);
  fill_random(data.get(), kRequests * kChunk, 5);
  for (EngineKind engine : kEngines) {
    INFO("engine " << engine_kind_name(engine));
    // The 5th read piece fails: one piece of request 2 (pieces are taken in submission order per worker).
    auto plan = std::make_shared<FaultPlan>(
        std::vector<IoFault>{IoFault{.nth = 5, .kind = IoFault::Kind::kError, .error = EIO, .op = IoOp::kRead}});
    AioHandle handle(options_for(engine, 1), make_fault_backend(make_backend(engine), plan));
    File file = File::open(dir.file("data.bin"), OpenMode::kTruncate);
    handle.write(file, data.get(), kRequests * kChunk, 0);
    auto out = aligned_buffer(kRequests * kChunk);
    Outcomes outcomes(kRequests);
    for (size_t i = 0; i < kRequests; ++i) {
      handle.submit_read(file, out.get() + i * kChunk, kChunk, i * kChunk, outcomes.callback(i));
    }
    CHECK_NOTHROW(handle.wait_all());  // waits for the callbacks; the error went to one of them
    REQUIRE(outcomes.finished == kRequests);
    CHECK(plan->fired() == 1);
    size_t failed = 0;
    for (size_t i = 0; i < kRequests; ++i) {
      CAPTURE(i);
      CHECK(outcomes.calls[i] == 1);
      if (outcomes.errors[i] == nullptr) {
        CHECK(std::memcmp(out.get() + i * kChunk, data.get() + i * kChunk, kChunk) == 0);
        continue;
      }
      ++failed;
      try {
        std::rethrow_exception(outcomes.errors[i]);
      } catch (const strata::Error& e) {
        CHECK(e.category() == strata::ErrorCategory::kIo);
        CHECK_THAT(std::string(e.what()), Catch::Contains(dir.file("data.bin")) &&
                                              Catch::Contains("offset " + std::to_string(i * kChunk)) &&
                                              Catch::Contains("EIO") && Catch::Contains("read"));
      }
    }
    CHECK(failed == 1);
    // The handle stays usable, and ticketed requests still report their own errors.
    handle.read(file, out.get(), kChunk, 0);
    CHECK(std::memcmp(out.get(), data.get(), kChunk) == 0);
  }
}

TEST_CASE("callbacks: an empty request completes at once, wait_all and the destructor wait for running callbacks",
          "[nvme]") {
  strata::test::TempDir dir("nvme-callback-wait");
  File file = File::open(dir.file("data.bin"), OpenMode::kTruncate);
  const size_t nbytes = 64 << 10;
  auto buf = aligned_buffer(nbytes);
  {
    AioHandle handle(options_for(EngineKind::kUring, 1));
    handle.write(file, buf.get(), nbytes, 0);
    bool called = false;
    std::exception_ptr error;
    handle.submit_read(file, buf.get(), 0, 0, [&](std::exception_ptr e) {
      called = true;
      error = e;
    });
    CHECK(called);  // on this thread, before submit_read returned
    CHECK(error == nullptr);
    CHECK_THROWS_WITH(handle.submit_read(file, buf.get(), nbytes, 0, AioHandle::DoneFn{}),
                      Catch::Contains("empty completion callback"));
    // Misaligned O_DIRECT arguments throw before anything is queued: no callback.
    std::atomic<int> misaligned_calls{0};
    CHECK_THROWS_AS(handle.submit_read(file, buf.get() + 1, nbytes, 0, [&](std::exception_ptr) { ++misaligned_calls; }),
                    strata::Error);
    handle.wait_all();
    CHECK(misaligned_calls == 0);

    // A slow callback: wait_all returns only after it has returned.
    std::atomic<bool> returned{false};
    handle.submit_read(file, buf.get(), nbytes, 0, [&](std::exception_ptr) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      returned = true;
    });
    handle.wait_all();
    CHECK(returned);
  }
  std::atomic<int> calls{0};
  {
    AioHandle handle(options_for(EngineKind::kUring, 2));
    for (int i = 0; i < 8; ++i) {
      handle.submit_read(file, buf.get(), nbytes, 0, [&](std::exception_ptr) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        ++calls;
      });
    }
  }  // destruction waits for every callback
  CHECK(calls == 8);
}

TEST_CASE("an urgent request goes ahead of the normal pieces waiting, behind urgent ones queued before it",
          "[nvme]") {
  strata::test::TempDir dir("nvme-urgent");
  constexpr size_t kChunk = 64 << 10;  // one piece
  constexpr size_t kNormal = 32;
  auto data = aligned_buffer((kNormal + 3) * kChunk);
  fill_random(data.get(), (kNormal + 3) * kChunk, 3);
  for (EngineKind engine : kEngines) {
    INFO("engine " << engine_kind_name(engine));
    // The worker is held inside the first piece's preparation until every
    // other request is queued, then the order pieces reach the kernel is recorded.
    std::mutex mutex;
    std::condition_variable cv;
    bool entered = false, released = false;
    std::vector<uint64_t> order;  // offsets, in preparation order
    auto hook = [&](const IoPiece& piece) {
      std::unique_lock lock(mutex);
      order.push_back(piece.offset);
      if (order.size() == 1) {
        entered = true;
        cv.notify_all();
        cv.wait(lock, [&] { return released; });
      }
    };
    AioOptions options = options_for(engine, 1);
    options.queue_depth = 2;
    AioHandle handle(options, std::make_unique<strata::test::HookedBackend>(make_backend(engine), hook));
    File file = File::open(dir.file("data.bin"), OpenMode::kTruncate);
    std::vector<Ticket> tickets;
    tickets.push_back(handle.submit_write(file, data.get(), kChunk, 0));  // the gate
    {
      std::unique_lock lock(mutex);
      REQUIRE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return entered; }));
    }
    for (size_t i = 1; i <= kNormal; ++i) {
      tickets.push_back(handle.submit_write(file, data.get() + i * kChunk, kChunk, i * kChunk));
    }
    const uint64_t first_urgent = (kNormal + 1) * kChunk, second_urgent = (kNormal + 2) * kChunk;
    tickets.push_back(
        handle.submit_write(file, data.get() + first_urgent, kChunk, first_urgent, IoPriority::kUrgent));
    tickets.push_back(
        handle.submit_write(file, data.get() + second_urgent, kChunk, second_urgent, IoPriority::kUrgent));
    {
      std::lock_guard lock(mutex);
      released = true;
    }
    cv.notify_all();
    handle.wait(tickets);
    REQUIRE(order.size() == kNormal + 3);
    // Taken before the gate was prepared: at most a queue depth of normal
    // pieces; then the two urgent ones, in the order they were submitted.
    const auto at = [&](uint64_t offset) { return std::find(order.begin(), order.end(), offset) - order.begin(); };
    CHECK(at(first_urgent) <= static_cast<long>(options.queue_depth));
    CHECK(at(second_urgent) == at(first_urgent) + 1);
    // Every byte landed where it belongs.
    auto back = aligned_buffer((kNormal + 3) * kChunk);
    handle.read(file, back.get(), (kNormal + 3) * kChunk, 0);
    CHECK(std::memcmp(back.get(), data.get(), (kNormal + 3) * kChunk) == 0);
  }
}
