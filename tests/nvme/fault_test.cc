// Error paths: injected EIO and short completions, EFBIG through
// RLIMIT_FSIZE in a child process, reads past the end of a truncated file.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "nvme/aio_handle.h"
#include "core/error.h"
#include "tests/nvme/test_util.h"
#include "tests/support/temp_dir.h"

using namespace strata::nvme;
using strata::nvme::test::aligned_buffer;
using strata::nvme::test::fill_random;
using strata::nvme::test::kEngines;
using strata::nvme::test::options_for;

namespace {

std::unique_ptr<AioHandle> faulty_handle(EngineKind engine, int threads,
                                         std::shared_ptr<FaultPlan> plan) {
  return std::make_unique<AioHandle>(options_for(engine, threads),
                                     make_fault_backend(make_backend(engine), std::move(plan)));
}

}  // namespace

TEST_CASE("an injected EIO surfaces from wait() with file, offset, length and errno text", "[nvme]") {
  strata::test::TempDir dir("nvme-eio");
  const size_t nbytes = 1 << 20;  // 16 pieces of 64 KiB
  auto buf = aligned_buffer(nbytes);
  for (EngineKind engine : kEngines) {
    INFO("engine " << engine_kind_name(engine));
    auto plan = std::make_shared<FaultPlan>(std::vector<IoFault>{
        IoFault{.nth = 5, .kind = IoFault::Kind::kError, .error = EIO, .op = IoOp::kWrite}});
    auto handle = faulty_handle(engine, 2, plan);
    File file = File::open(dir.file("e"), OpenMode::kTruncate);
    auto ticket = handle->submit_write(file, buf.get(), nbytes, 8192);
    try {
      handle->wait(ticket);
      FAIL("wait() did not report the injected EIO");
    } catch (const strata::Error& e) {
      CHECK(e.category() == strata::ErrorCategory::kIo);
      std::string what = e.what();
      CHECK_THAT(what, Catch::Contains(dir.file("e")) && Catch::Contains("offset 8192") &&
                           Catch::Contains("1048576 bytes") && Catch::Contains("EIO") &&
                           Catch::Contains("Input/output error") && Catch::Contains("write"));
    }
    CHECK(plan->fired() == 1);
    // The handle stays usable: the next request succeeds.
    handle->write(file, buf.get(), nbytes, 0);
  }
}

TEST_CASE("an injected error in one of many requests is reported by waiting for them, wait_all takes no ticket", "[nvme]") {
  strata::test::TempDir dir("nvme-eio-all");
  auto plan = std::make_shared<FaultPlan>(std::vector<IoFault>{
      IoFault{.nth = 7, .kind = IoFault::Kind::kError, .error = ENOSPC, .op = IoOp::kRead}});
  auto handle = faulty_handle(EngineKind::kUring, 3, plan);
  File file = File::open(dir.file("w"), OpenMode::kTruncate);
  const size_t chunk = 128 << 10;
  auto buf = aligned_buffer(8 * chunk);
  handle->write(file, buf.get(), 8 * chunk, 0);
  std::vector<Ticket> tickets;
  for (int i = 0; i < 8; ++i) tickets.push_back(handle->submit_read(file, buf.get() + i * chunk, chunk, i * chunk));
  // Another user of the handle waiting for everything neither consumes these
  // tickets nor takes their error.
  CHECK_NOTHROW(handle->wait_all());
  for (Ticket t : tickets) CHECK(handle->done(t));
  CHECK_THROWS_WITH(handle->wait(std::span<const Ticket>(tickets)), Catch::Contains("ENOSPC") && Catch::Contains("read"));
  // Consumed, every one of them.
  for (Ticket t : tickets) CHECK_THROWS_WITH(handle->wait(t), Catch::Contains("ticket"));
  handle->wait_all();  // nothing left: returns at once
}

TEST_CASE("short completions are resumed and the data is intact", "[nvme]") {
  strata::test::TempDir dir("nvme-short");
  const size_t nbytes = (1 << 20) + 4096;
  for (EngineKind engine : kEngines) {
    INFO("engine " << engine_kind_name(engine));
    // Every 3rd write and 2nd read moves only 4 KiB at first (aligned, so O_DIRECT can resume).
    auto plan = std::make_shared<FaultPlan>(std::vector<IoFault>{
        IoFault{.nth = 3, .kind = IoFault::Kind::kShort, .short_nbytes = 4096,
                .op = IoOp::kWrite, .repeat = true},
        IoFault{.nth = 2, .kind = IoFault::Kind::kShort, .short_nbytes = 12288,
                .op = IoOp::kRead, .repeat = true}});
    auto handle = faulty_handle(engine, 2, plan);
    File file = File::open(dir.file("s"), OpenMode::kTruncate);
    auto out = aligned_buffer(nbytes);
    auto in = aligned_buffer(nbytes);
    fill_random(out.get(), nbytes, 42);
    handle->write(file, out.get(), nbytes, 4096);
    handle->read(file, in.get(), nbytes, 4096);
    CHECK(std::memcmp(out.get(), in.get(), nbytes) == 0);
    CHECK(handle->stats().short_resumed > 10);
    // A fault on a piece with no more than short_nbytes left is a full transfer.
    CHECK(handle->stats().short_resumed <= plan->fired());
  }
}

TEST_CASE("unaligned short completions on a buffered file are resumed", "[nvme]") {
  strata::test::TempDir dir("nvme-short-buffered");
  auto plan = std::make_shared<FaultPlan>(std::vector<IoFault>{
      IoFault{.nth = 1, .kind = IoFault::Kind::kShort, .short_nbytes = 777, .op = std::nullopt, .repeat = true}});
  auto handle = faulty_handle(EngineKind::kUring, 1, plan);
  File file = File::open(dir.file("sb"), OpenMode::kTruncate, /*direct=*/false);
  const size_t nbytes = 300001;
  std::vector<char> out(nbytes), in(nbytes);
  fill_random(out.data(), nbytes, 8);
  handle->write(file, out.data(), nbytes, 5);
  handle->read(file, in.data(), nbytes, 5);
  CHECK(out == in);
}

TEST_CASE("a zero-byte write (no progress) is an error, not a hang", "[nvme]") {
  strata::test::TempDir dir("nvme-zero");
  auto plan = std::make_shared<FaultPlan>(std::vector<IoFault>{
      IoFault{.nth = 2, .kind = IoFault::Kind::kShort, .short_nbytes = 0, .op = std::nullopt, .repeat = false}});
  auto handle = faulty_handle(EngineKind::kAio, 1, plan);
  File file = File::open(dir.file("z"), OpenMode::kTruncate);
  auto buf = aligned_buffer(256 << 10);
  CHECK_THROWS_WITH(handle->write(file, buf.get(), 256 << 10, 0),
                    Catch::Contains("no progress") && Catch::Contains("offset 65536"));
}

TEST_CASE("reading past the end of a truncated file is an error naming the file", "[nvme]") {
  strata::test::TempDir dir("nvme-trunc");
  const size_t nbytes = 1 << 20;
  auto buf = aligned_buffer(nbytes);
  fill_random(buf.get(), nbytes, 4);
  for (EngineKind engine : kEngines) {
    for (bool direct : {true, false}) {
      INFO("engine " << engine_kind_name(engine) << " direct " << direct);
      AioHandle handle(options_for(engine, 2));
      File file = File::open(dir.file("t"), OpenMode::kTruncate, direct);
      handle.write(file, buf.get(), nbytes, 0);
      // Cut the file mid-piece at an unaligned size, as a crash might leave it.
      file.truncate(nbytes / 2 + 100);
      CHECK_THROWS_WITH(handle.read(file, buf.get(), nbytes, 0),
                        Catch::Contains("past end of file") && Catch::Contains(dir.file("t")));
      // Wholly past the end.
      CHECK_THROWS_WITH(handle.read(file, buf.get(), 65536, 4 << 20),
                        Catch::Contains("past end of file") && Catch::Contains("offset 4194304"));
    }
  }
}

TEST_CASE("EFBIG from RLIMIT_FSIZE surfaces from wait()", "[nvme]") {
  strata::test::TempDir dir("nvme-efbig");
  for (EngineKind engine : kEngines) {
    INFO("engine " << engine_kind_name(engine));
    std::string path = dir.file(std::string("big-") + std::string(engine_kind_name(engine)));
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      // Child: limit file size to 1 MiB; writing 2 MiB must fail with EFBIG.
      signal(SIGXFSZ, SIG_IGN);
      rlimit limit{1 << 20, 1 << 20};
      if (setrlimit(RLIMIT_FSIZE, &limit) != 0) _exit(3);
      int code = 1;
      try {
        AioHandle handle(options_for(engine, 2));
        File file = File::open(path, OpenMode::kTruncate);
        auto buf = aligned_buffer(2 << 20);
        handle.write(file, buf.get(), 2 << 20, 0);
        code = 2;  // no error: wrong
      } catch (const strata::Error& e) {
        std::string what = e.what();
        code = what.find("EFBIG") != std::string::npos && what.find(path) != std::string::npos
                   ? 0
                   : 4;
        if (code != 0) std::fprintf(stderr, "unexpected error: %s\n", e.what());
      }
      _exit(code);
    }
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}

TEST_CASE("destroying a handle with requests in flight waits for them", "[nvme]") {
  strata::test::TempDir dir("nvme-dtor");
  const size_t nbytes = 4 << 20;
  auto buf = aligned_buffer(nbytes);
  File file = File::open(dir.file("d"), OpenMode::kTruncate);
  {
    AioHandle handle(options_for(EngineKind::kUring, 2));
    handle.submit_write(file, buf.get(), nbytes, 0);
  }
  CHECK(file.size_nbytes() == nbytes);
}

TEST_CASE("EAGAIN and EINTR completions are retried transparently", "[nvme]") {
  strata::test::TempDir dir("nvme-retry");
  for (EngineKind engine : kEngines) {
    INFO("engine " << engine_kind_name(engine));
    auto plan = std::make_shared<FaultPlan>(std::vector<IoFault>{
        IoFault{.nth = 2, .kind = IoFault::Kind::kError, .error = EAGAIN, .op = IoOp::kWrite},
        IoFault{.nth = 5, .kind = IoFault::Kind::kError, .error = EINTR, .op = IoOp::kRead}});
    auto handle = faulty_handle(engine, 2, plan);
    File file = File::open(dir.file("r"), OpenMode::kTruncate);
    const size_t nbytes = 512 << 10;
    auto out = aligned_buffer(nbytes);
    auto in = aligned_buffer(nbytes);
    fill_random(out.get(), nbytes, 21);
    handle->write(file, out.get(), nbytes, 0);
    handle->read(file, in.get(), nbytes, 0);
    CHECK(std::memcmp(out.get(), in.get(), nbytes) == 0);
    CHECK(plan->fired() == 2);
    CHECK(handle->stats().retried == 2);
  }
}

TEST_CASE("a worker whose queue fails fails its requests instead of hanging", "[nvme]") {
  strata::test::TempDir dir("nvme-broken");
  auto plan = std::make_shared<FaultPlan>(std::vector<IoFault>{
      IoFault{.nth = 3, .kind = IoFault::Kind::kBrokenQueue, .error = EIO, .short_nbytes = 0,
              .op = std::nullopt, .repeat = false}});
  // One worker, depth 1: pieces go one at a time, so the failure hits a known point.
  AioOptions options = options_for(EngineKind::kUring, 1);
  options.queue_depth = 1;
  AioHandle handle(options, make_fault_backend(make_backend(EngineKind::kUring), plan));
  File file = File::open(dir.file("b"), OpenMode::kTruncate);
  auto buf = aligned_buffer(1 << 20);
  CHECK_THROWS_WITH(handle.write(file, buf.get(), 1 << 20, 0),
                    Catch::Contains("injected queue failure") && Catch::Contains(dir.file("b")) &&
                        Catch::Contains("write"));
  // Every later request on the broken worker fails at once with the same error.
  auto ticket = handle.submit_read(file, buf.get(), 65536, 0);
  CHECK_THROWS_WITH(handle.wait(ticket), Catch::Contains("injected queue failure"));
  handle.wait_all();
}

TEST_CASE("a failing queue still reaps the pieces the kernel has, before reporting them", "[nvme]") {
  // psync runs a "submitted" piece only inside wait(), one per call, so when
  // the queue breaks at piece 6 pieces 3, 4 and 5 are provably still pending.
  // They must complete (their buffers are in use until they do) rather than be
  // reported failed at once; only pieces that never reached the queue fail.
  strata::test::TempDir dir("nvme-broken-inflight");
  auto plan = std::make_shared<FaultPlan>(std::vector<IoFault>{
      IoFault{.nth = 6, .kind = IoFault::Kind::kBrokenQueue, .error = EIO, .short_nbytes = 0,
              .op = std::nullopt, .repeat = false}});
  AioHandle handle(options_for(EngineKind::kPsync, 1), make_fault_backend(make_backend(EngineKind::kPsync), plan));
  File file = File::open(dir.file("b"), OpenMode::kTruncate);
  const size_t piece = 64 << 10, nbytes = 16 * piece;
  auto buf = aligned_buffer(nbytes);
  fill_random(buf.get(), nbytes, 7);
  CHECK_THROWS_WITH(handle.write(file, buf.get(), nbytes, 0), Catch::Contains("injected queue failure"));
  const AioStats stats = handle.stats();
  CHECK(stats.pieces == 16);                    // every piece finished exactly once
  CHECK(stats.bytes_written == 5 * piece);      // 1-5 reached the queue and completed
  auto back = aligned_buffer(5 * piece);
  REQUIRE(::pread(file.fd(), back.get(), 5 * piece, 0) == static_cast<ssize_t>(5 * piece));
  CHECK(std::memcmp(back.get(), buf.get(), 5 * piece) == 0);
}
