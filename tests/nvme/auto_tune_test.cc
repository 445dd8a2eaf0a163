// aio.auto_tune (nvme/online_tuner.h): the data is the same with it on as off,
// the tuner settles after its budget on one of its candidates, picks the
// faster one when a candidate is made slower (a backend that delays its
// pieces), keeps each candidate's queue depth, and a shared handle stays
// correct under concurrent users. Real O_DIRECT files in a temporary directory.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
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

namespace {

constexpr size_t kKiB = 1024;

// Tuning on a few MiB with small candidates, so a test's traffic covers the
// budget many times over. Configured setting: 64 KiB x 4.
AioOptions tuned_options(EngineKind engine, int threads, std::vector<IoSetting> candidates,
                         uint64_t budget_nbytes = 4 << 20) {
  AioOptions o;
  o.engine = engine;
  o.thread_count = threads;
  o.block_size = 64 * kKiB;
  o.queue_depth = 4;
  o.auto_tune = true;
  o.auto_tune_nbytes = budget_nbytes;
  o.auto_tune_candidates = std::move(candidates);
  return o;
}

bool is_candidate(const AioOptions& o, const IoSetting& s) {
  auto all = o.tune_candidates();
  return std::find(all.begin(), all.end(), s) != all.end();
}

// Writes `data` to the file in requests of the given sizes (cycled), then
// reads it back in requests of other sizes; both through `handle`.
void write_in_requests(AioHandle& handle, const File& file, const char* data, size_t nbytes,
                       const std::vector<size_t>& sizes) {
  std::vector<Ticket> tickets;
  size_t at = 0;
  for (size_t i = 0; at < nbytes; ++i) {
    const size_t n = std::min(sizes[i % sizes.size()], nbytes - at);
    tickets.push_back(handle.submit_write(file, data + at, n, at));
    at += n;
  }
  handle.wait(tickets);
}

void read_in_requests(AioHandle& handle, const File& file, char* out, size_t nbytes,
                      const std::vector<size_t>& sizes) {
  std::vector<Ticket> tickets;
  size_t at = 0;
  for (size_t i = 0; at < nbytes; ++i) {
    const size_t n = std::min(sizes[i % sizes.size()], nbytes - at);
    tickets.push_back(handle.submit_read(file, out + at, n, at));
    at += n;
  }
  handle.wait(tickets);
}

}  // namespace

TEST_CASE("auto_tune options: candidates, ring depth and what cannot combine", "[nvme][auto_tune]") {
  AioOptions o;
  CHECK(o.tune_candidates() == std::vector<IoSetting>{{o.block_size, o.queue_depth}});
  CHECK(o.max_queue_depth() == o.queue_depth);
  o.auto_tune = true;
  // The configured setting first, then the defaults without repeating it.
  auto all = o.tune_candidates();
  REQUIRE(all.size() == std::size(kDefaultTuneCandidates));
  CHECK(all[0] == IoSetting{o.block_size, o.queue_depth});
  CHECK(o.max_queue_depth() == 32);
  o.validate();

  AioOptions psync = o;
  psync.engine = EngineKind::kPsync;
  CHECK_THROWS_WITH(psync.validate(), Catch::Contains("aio.auto_tune") && Catch::Contains("psync"));
  AioOptions bad = o;
  bad.auto_tune_candidates = {{64 * kKiB, 4}, {1000, 4}};
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("candidate 1") && Catch::Contains("block_size = 1000"));
  bad.auto_tune_candidates = {{64 * kKiB, 0}};
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("candidate 0") && Catch::Contains("queue_depth = 0"));
  bad = o;
  bad.auto_tune_nbytes = 0;
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("auto_tune_nbytes"));
  // The handle refuses what validate() refuses, before making anything.
  CHECK_THROWS_WITH(AioHandle(psync), Catch::Contains("psync"));
}

TEST_CASE("auto_tune off: the handle reports nothing to tune", "[nvme][auto_tune]") {
  AioHandle handle(AioOptions{});
  TuneReport r = handle.auto_tune_report(IoOp::kRead);
  CHECK_FALSE(r.enabled);
  CHECK_FALSE(r.settled);
  CHECK(r.chosen == IoSetting{AioOptions{}.block_size, AioOptions{}.queue_depth});
}

TEST_CASE("auto_tune: data written and read with tuning on equals tuning off", "[nvme][auto_tune]") {
  strata::test::TempDir dir("nvme-autotune-data");
  // 12 MiB + 20 KiB: odd requests, pieces cut across slice boundaries.
  const size_t nbytes = (size_t{12} << 20) + 20 * kKiB;
  auto data = aligned_buffer(nbytes);
  fill_random(data.get(), nbytes, 14);
  const std::vector<size_t> write_sizes = {(1 << 20) + 4 * kKiB, 4 * kKiB, 300 * kKiB, 2 << 20};
  const std::vector<size_t> read_sizes = {(3 << 20) + 12 * kKiB, 64 * kKiB, 8 * kKiB};
  for (EngineKind engine : {EngineKind::kUring, EngineKind::kAio}) {
    for (int threads : {1, 3}) {
      INFO("engine " << engine_kind_name(engine) << ", threads " << threads);
      AioOptions tuned = tuned_options(engine, threads, {{16 * kKiB, 2}, {256 * kKiB, 8}, {64 * kKiB, 16}});
      AioOptions plain = tuned;
      plain.auto_tune = false;
      File tuned_file = File::open(dir.file("tuned.bin"), OpenMode::kTruncate);
      File plain_file = File::open(dir.file("plain.bin"), OpenMode::kTruncate);
      REQUIRE(tuned_file.direct());
      {
        AioHandle handle(tuned);
        write_in_requests(handle, tuned_file, data.get(), nbytes, write_sizes);
        CHECK(handle.auto_tune_report(IoOp::kWrite).settled);
        CHECK(handle.stats().bytes_written == nbytes);
      }
      {
        AioHandle handle(plain);
        write_in_requests(handle, plain_file, data.get(), nbytes, write_sizes);
      }
      auto from_tuned = aligned_buffer(nbytes);
      auto from_plain = aligned_buffer(nbytes);
      {
        // Tuned reads of the file written untuned, and the other way round.
        AioHandle tuned_handle(tuned);
        AioHandle plain_handle(plain);
        read_in_requests(tuned_handle, plain_file, from_tuned.get(), nbytes, read_sizes);
        read_in_requests(plain_handle, tuned_file, from_plain.get(), nbytes, read_sizes);
        CHECK(tuned_handle.auto_tune_report(IoOp::kRead).settled);
      }
      CHECK(std::memcmp(from_tuned.get(), data.get(), nbytes) == 0);
      CHECK(std::memcmp(from_plain.get(), data.get(), nbytes) == 0);
    }
  }
}

TEST_CASE("auto_tune settles after its budget on one of its candidates", "[nvme][auto_tune]") {
  strata::test::TempDir dir("nvme-autotune-settle");
  const uint64_t budget = 4 << 20;
  AioOptions o = tuned_options(EngineKind::kUring, 1, {{16 * kKiB, 2}, {256 * kKiB, 8}}, budget);
  // Record every piece's length as the backend sees it.
  std::mutex mutex;
  std::vector<size_t> lengths;
  auto hook = [&](const IoPiece& piece) {
    std::lock_guard lock(mutex);
    lengths.push_back(piece.nbytes);
  };
  AioHandle handle(o, std::make_unique<strata::test::HookedBackend>(make_backend(o.engine), hook));
  File file = File::open(dir.file("data.bin"), OpenMode::kTruncate);
  const size_t request = 1 << 20;  // a multiple of every candidate's block size
  auto buf = aligned_buffer(request);
  fill_random(buf.get(), request, 3);
  CHECK_FALSE(handle.auto_tune_report(IoOp::kWrite).settled);
  uint64_t written = 0;
  while (!handle.auto_tune_report(IoOp::kWrite).settled) {
    REQUIRE(written < 4 * budget);  // settles once the budget's pieces have finished
    handle.write(file, buf.get(), request, written);
    written += request;
  }
  CHECK(written >= budget);
  CHECK_FALSE(handle.auto_tune_report(IoOp::kRead).settled);  // reads tune on their own traffic
  TuneReport r = handle.auto_tune_report(IoOp::kWrite);
  CHECK(r.enabled);
  CHECK(is_candidate(o, r.chosen));
  REQUIRE(r.candidates.size() == 3);
  for (const TuneMeasurement& m : r.candidates) {
    INFO(m.setting.block_size << " x" << m.setting.queue_depth);
    // Each candidate had budget / 3 (its two slices) of the traffic.
    CHECK(m.nbytes >= budget / 3 - 256 * kKiB);
    CHECK(m.busy_s > 0);
    CHECK(m.gbps() > 0);
  }
  CHECK_THAT(r.summary, Catch::Contains("writes use block_size") && Catch::Contains("queue_depth"));
  // From now on every piece is cut with the choice.
  {
    std::lock_guard lock(mutex);
    lengths.clear();
  }
  for (int i = 0; i < 4; ++i) handle.write(file, buf.get(), request, written + i * request);
  std::lock_guard lock(mutex);
  REQUIRE(lengths.size() == 4 * request / r.chosen.block_size);
  for (size_t n : lengths) CHECK(n == r.chosen.block_size);
}

TEST_CASE("auto_tune picks the faster candidate when one is made slower", "[nvme][auto_tune]") {
  strata::test::TempDir dir("nvme-autotune-choice");
  const size_t slow_nbytes = GENERATE(size_t{64} * 1024, size_t{256} * 1024);
  const IoOp op = GENERATE(IoOp::kWrite, IoOp::kRead);
  INFO("pieces of " << slow_nbytes << " bytes delayed, " << (op == IoOp::kRead ? "reads" : "writes"));
  // Configured 64 KiB x 4, the other candidate 256 KiB x 4: the same depth,
  // so the block size is the only difference besides the delay.
  AioOptions o = tuned_options(EngineKind::kUring, 1, {{256 * kKiB, 4}}, 4 << 20);
  std::atomic<bool> delaying{false};
  auto hook = [&](const IoPiece& piece) {
    // 60 ms per delayed piece (its worker sleeps before handing it over):
    // 1.1 MB/s at 64 KiB, 4.4 MB/s at 256 KiB, a fraction of what either
    // moves undelayed even on a slow virtual disk (64 KiB O_DIRECT writes:
    // about 60 MB/s on this project's virtio test machine, 18 MB/s once
    // under AddressSanitizer beside another test's I/O, which 20 ms, 13 MB/s
    // at 256 KiB, did not leave twice behind).
    if (delaying.load() && piece.op == op && piece.nbytes == slow_nbytes) {
      std::this_thread::sleep_for(std::chrono::milliseconds(60));
    }
  };
  AioHandle handle(o, std::make_unique<strata::test::HookedBackend>(make_backend(o.engine), hook));
  File file = File::open(dir.file("data.bin"), OpenMode::kTruncate);
  const size_t nbytes = 8 << 20;
  auto data = aligned_buffer(nbytes);
  fill_random(data.get(), nbytes, 5);
  // Written whole first (by an untuned handle: this is not tuning traffic),
  // so the measured writes overwrite allocated blocks (extending a file costs
  // more per request than the delay tells apart).
  AioOptions plain = o;
  plain.auto_tune = false;
  AioHandle(plain).write(file, data.get(), nbytes, 0);
  delaying = true;
  auto out = aligned_buffer(nbytes);
  for (uint64_t at = 0; !handle.auto_tune_report(op).settled; at = (at + (1 << 20)) % nbytes) {
    if (op == IoOp::kRead) {
      handle.read(file, out.get() + at, 1 << 20, at);
      REQUIRE(std::memcmp(out.get() + at, data.get() + at, 1 << 20) == 0);
    } else {
      handle.write(file, data.get() + at, 1 << 20, at);
    }
  }
  TuneReport r = handle.auto_tune_report(op);
  INFO(r.summary);
  CHECK(r.chosen.block_size != slow_nbytes);
  CHECK(r.chosen.block_size == (slow_nbytes == 64 * kKiB ? 256 * kKiB : 64 * kKiB));
  REQUIRE(r.candidates.size() == 2);
  const TuneMeasurement& slow = r.candidates[slow_nbytes == 64 * kKiB ? 0 : 1];
  const TuneMeasurement& fast = r.candidates[slow_nbytes == 64 * kKiB ? 1 : 0];
  CHECK(fast.gbps() > 2 * slow.gbps());
}

// A forwarding queue that counts pieces in flight and checks, at each
// prepare, that the worker let no more than the piece's own queue depth be
// in flight (candidates tell apart by block size here).
class DepthCheckingQueue final : public IoQueue {
 public:
  DepthCheckingQueue(std::unique_ptr<IoQueue> inner, std::map<size_t, int> depth_of_size,
                     std::atomic<int>* violations, std::atomic<int>* deepest)
      : inner_(std::move(inner)), depth_of_size_(std::move(depth_of_size)), violations_(violations), deepest_(deepest) {}
  size_t capacity() const override { return inner_->capacity(); }
  void prepare(const IoPiece& piece) override {
    ++in_flight_;
    auto it = depth_of_size_.find(piece.nbytes);
    if (it != depth_of_size_.end() && in_flight_ > it->second) ++*violations_;
    *deepest_ = std::max(deepest_->load(), in_flight_);
    inner_->prepare(piece);
  }
  void submit() override { inner_->submit(); }
  void wait(std::vector<IoCompletion>& out, size_t min_count) override {
    const size_t before = out.size();
    inner_->wait(out, min_count);
    in_flight_ -= static_cast<int>(out.size() - before);
  }
  void submit_and_wait(std::vector<IoCompletion>& out, size_t min_count) override {
    const size_t before = out.size();
    inner_->submit_and_wait(out, min_count);
    in_flight_ -= static_cast<int>(out.size() - before);
  }
  void take_unsubmitted(std::vector<uint64_t>& user_data) override { inner_->take_unsubmitted(user_data); }

 private:
  std::unique_ptr<IoQueue> inner_;
  std::map<size_t, int> depth_of_size_;
  std::atomic<int>* violations_;
  std::atomic<int>* deepest_;
  int in_flight_ = 0;
};

class DepthCheckingBackend final : public IoBackend {
 public:
  DepthCheckingBackend(std::map<size_t, int> depth_of_size, std::atomic<int>* violations, std::atomic<int>* deepest)
      : inner_(make_backend(EngineKind::kUring)), depth_of_size_(std::move(depth_of_size)),
        violations_(violations), deepest_(deepest) {}
  std::string_view name() const override { return inner_->name(); }
  std::unique_ptr<IoQueue> create_queue(size_t depth) override {
    created_depth = depth;
    return std::make_unique<DepthCheckingQueue>(inner_->create_queue(depth), depth_of_size_, violations_, deepest_);
  }
  size_t created_depth = 0;

 private:
  std::unique_ptr<IoBackend> inner_;
  std::map<size_t, int> depth_of_size_;
  std::atomic<int>* violations_;
  std::atomic<int>* deepest_;
};

TEST_CASE("auto_tune: each candidate runs at its own queue depth, the ring fits the deepest",
          "[nvme][auto_tune]") {
  strata::test::TempDir dir("nvme-autotune-depth");
  // Distinct block sizes, so the backend can tell which candidate a piece is.
  AioOptions o = tuned_options(EngineKind::kUring, 1, {{16 * kKiB, 24}, {128 * kKiB, 2}}, 6 << 20);
  std::atomic<int> violations{0}, deepest{0};
  auto backend = std::make_unique<DepthCheckingBackend>(
      std::map<size_t, int>{{64 * kKiB, 4}, {16 * kKiB, 24}, {128 * kKiB, 2}}, &violations, &deepest);
  DepthCheckingBackend* raw = backend.get();
  AioHandle handle(o, std::move(backend));
  CHECK(raw->created_depth == 24);
  File file = File::open(dir.file("data.bin"), OpenMode::kTruncate);
  const size_t nbytes = 16 << 20;
  auto data = aligned_buffer(nbytes);
  fill_random(data.get(), nbytes, 9);
  // Large requests: the inbox always holds the next slice's pieces, so the
  // switches between depths happen with a backlog.
  handle.write(file, data.get(), nbytes, 0);
  auto out = aligned_buffer(nbytes);
  handle.read(file, out.get(), nbytes, 0);
  CHECK(std::memcmp(out.get(), data.get(), nbytes) == 0);
  CHECK(handle.auto_tune_report(IoOp::kWrite).settled);
  CHECK(handle.auto_tune_report(IoOp::kRead).settled);
  CHECK(violations.load() == 0);
  CHECK(deepest.load() > 4);  // the deep candidate really went deeper than the configured 4
}

TEST_CASE("auto_tune: a shared handle under concurrent users", "[nvme][auto_tune]") {
  strata::test::TempDir dir("nvme-autotune-shared");
  AioOptions o = tuned_options(EngineKind::kUring, 2, {{16 * kKiB, 8}, {256 * kKiB, 4}}, 6 << 20);
  AioHandle handle(o);
  File file = File::open(dir.file("data.bin"), OpenMode::kTruncate);
  constexpr int kUsers = 4;
  const size_t region = 6 << 20;  // per user
  auto data = aligned_buffer(region * kUsers);
  fill_random(data.get(), region * kUsers, 21);
  auto out = aligned_buffer(region * kUsers);
  std::vector<std::thread> users;
  std::atomic<int> failures{0};
  for (int u = 0; u < kUsers; ++u) {
    users.emplace_back([&, u] {
      try {
        const uint64_t base = static_cast<uint64_t>(u) * region;
        // Writes as tickets, in 192 KiB requests; reads with completion callbacks.
        std::vector<Ticket> tickets;
        for (size_t at = 0; at < region; at += 192 * kKiB) {
          tickets.push_back(handle.submit_write(file, data.get() + base + at, 192 * kKiB, base + at));
        }
        handle.wait(tickets);
        std::atomic<int> pending{0};
        for (size_t at = 0; at < region; at += 512 * kKiB) {
          ++pending;
          handle.submit_read(file, out.get() + base + at, 512 * kKiB, base + at, [&](std::exception_ptr e) {
            if (e) ++failures;
            --pending;
          });
        }
        while (pending.load() != 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      } catch (...) {
        ++failures;
      }
    });
  }
  for (auto& t : users) t.join();
  handle.wait_all();
  CHECK(failures.load() == 0);
  CHECK(std::memcmp(out.get(), data.get(), region * kUsers) == 0);
  for (IoOp op : {IoOp::kRead, IoOp::kWrite}) {
    TuneReport r = handle.auto_tune_report(op);
    CHECK(r.settled);
    CHECK(is_candidate(o, r.chosen));
  }
}
