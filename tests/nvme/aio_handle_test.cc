// Round trips through every backend over a matrix of sizes, offsets and
// thread counts; alignment errors; several handles at once; fixed buffers.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstring>
#include <thread>

#include "nvme/aio_handle.h"
#include "core/error.h"
#include "tests/nvme/test_util.h"
#include "tests/support/temp_dir.h"

using namespace strata::nvme;
using strata::nvme::test::aligned_buffer;
using strata::nvme::test::fill_random;

namespace {

AioOptions small_options(EngineKind engine, int threads, int depth = 4) {
  AioOptions options;
  options.engine = engine;
  options.thread_count = threads;
  options.queue_depth = depth;
  options.block_size = 64 << 10;  // small blocks so small files still split into many pieces
  return options;
}

}  // namespace

TEST_CASE("engine names parse and print", "[nvme]") {
  for (EngineKind kind : {EngineKind::kUring, EngineKind::kAio, EngineKind::kPsync}) {
    CHECK(parse_engine_kind(engine_kind_name(kind)) == kind);
  }
  CHECK(parse_engine_kind("io_uring") == EngineKind::kUring);
  CHECK(parse_engine_kind("libaio") == EngineKind::kAio);
  CHECK_THROWS_WITH(parse_engine_kind("spdk"), Catch::Contains("uring, aio, psync"));
  AioOptions bad;
  bad.block_size = 1000;
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("aio.block_size"));
  bad = AioOptions{};
  bad.queue_depth = 0;
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("aio.queue_depth"));
}

TEST_CASE("O_DIRECT round trips over engines, sizes, offsets and threads", "[nvme]") {
  strata::test::TempDir dir("nvme-roundtrip");
  const size_t kSizes[] = {4096, 64 << 10, (64 << 10) + 4096, (1 << 20) + 12288, (3 << 20) + 4096};
  const uint64_t kOffsets[] = {0, 8192, (5 << 20) + 4096};
  uint64_t seed = 1;
  for (EngineKind engine : {EngineKind::kUring, EngineKind::kAio, EngineKind::kPsync}) {
    for (int threads : {1, 3}) {
      for (int depth : {1, 8}) {
        AioHandle handle(small_options(engine, threads, depth));
        File file = File::open(dir.file("data.bin"), OpenMode::kTruncate);
        REQUIRE(file.direct());
        for (size_t nbytes : kSizes) {
          for (uint64_t offset : kOffsets) {
            INFO("engine " << engine_kind_name(engine) << " threads " << threads << " depth "
                           << depth << " nbytes " << nbytes << " offset " << offset);
            auto out = aligned_buffer(nbytes);
            auto in = aligned_buffer(nbytes);
            fill_random(out.get(), nbytes, seed++);
            handle.write(file, out.get(), nbytes, offset);
            handle.read(file, in.get(), nbytes, offset);
            REQUIRE(std::memcmp(out.get(), in.get(), nbytes) == 0);
          }
        }
        AioStats stats = handle.stats();
        CHECK(stats.bytes_read == stats.bytes_written);
        CHECK(stats.short_resumed == 0);
      }
    }
  }
}

TEST_CASE("the data really reaches the file (checked with pread)", "[nvme]") {
  strata::test::TempDir dir("nvme-pread");
  const size_t nbytes = (2 << 20) + 8192;
  auto out = aligned_buffer(nbytes);
  fill_random(out.get(), nbytes, 99);
  {
    AioHandle handle(small_options(EngineKind::kUring, 2));
    File file = File::open(dir.file("x"), OpenMode::kTruncate);
    handle.write(file, out.get(), nbytes, 4096);
  }
  File plain = File::open(dir.file("x"), OpenMode::kRead, /*direct=*/false);
  CHECK(plain.size_nbytes() == nbytes + 4096);
  std::vector<char> back(nbytes);
  REQUIRE(::pread(plain.fd(), back.data(), nbytes, 4096) == static_cast<ssize_t>(nbytes));
  CHECK(std::memcmp(back.data(), out.get(), nbytes) == 0);
}

TEST_CASE("buffered files accept unaligned buffers, offsets and lengths", "[nvme]") {
  strata::test::TempDir dir("nvme-buffered");
  for (EngineKind engine : {EngineKind::kUring, EngineKind::kAio, EngineKind::kPsync}) {
    INFO("engine " << engine_kind_name(engine));
    AioHandle handle(small_options(engine, 2));
    File file = File::open(dir.file("b"), OpenMode::kTruncate, /*direct=*/false);
    REQUIRE_FALSE(file.direct());
    const size_t nbytes = 1000003;
    std::vector<char> out(nbytes + 7), in(nbytes + 7);
    fill_random(out.data() + 3, nbytes, 5);
    handle.write(file, out.data() + 3, nbytes, 13);
    handle.read(file, in.data() + 5, nbytes, 13);
    CHECK(std::memcmp(out.data() + 3, in.data() + 5, nbytes) == 0);
  }
}

TEST_CASE("misaligned O_DIRECT requests are refused with the requirement", "[nvme]") {
  strata::test::TempDir dir("nvme-align");
  AioHandle handle(small_options(EngineKind::kUring, 1));
  File file = File::open(dir.file("a"), OpenMode::kTruncate);
  auto buf = aligned_buffer(3 * 4096);
  CHECK_THROWS_WITH(handle.submit_write(file, buf.get() + 512, 4096, 0),
                    Catch::Contains("multiple of 4096") && Catch::Contains("buffer") &&
                        Catch::Contains(dir.file("a")));
  CHECK_THROWS_WITH(handle.submit_write(file, buf.get(), 4096, 100),
                    Catch::Contains("multiple of 4096") && Catch::Contains("offset"));
  CHECK_THROWS_WITH(handle.submit_read(file, buf.get(), 4000, 0),
                    Catch::Contains("multiple of 4096") && Catch::Contains("length"));
  try {
    handle.submit_read(file, buf.get(), 4000, 0);
  } catch (const strata::Error& e) {
    CHECK(e.category() == strata::ErrorCategory::kBadArgument);
  }
  // Zero-length requests are fine and complete at once.
  auto ticket = handle.submit_write(file, buf.get(), 0, 0);
  CHECK(handle.done(ticket));
  handle.wait(ticket);
  CHECK_THROWS_WITH(handle.wait(ticket), Catch::Contains("unknown or was already waited"));
}

TEST_CASE("many requests in flight, waited out of order, all at once, and with wait_all", "[nvme]") {
  strata::test::TempDir dir("nvme-many");
  for (EngineKind engine : {EngineKind::kUring, EngineKind::kAio}) {
    INFO("engine " << engine_kind_name(engine));
    AioOptions options = small_options(engine, 3, 8);
    options.single_submit = engine == EngineKind::kAio;
    options.overlap_events = engine == EngineKind::kUring;
    AioHandle handle(options);
    File file = File::open(dir.file("m"), OpenMode::kTruncate);
    const size_t chunk = 256 << 10;
    const int count = 24;
    auto out = aligned_buffer(chunk * count);
    auto in = aligned_buffer(chunk * count);
    fill_random(out.get(), chunk * count, 11);
    std::vector<Ticket> tickets;
    for (int i = 0; i < count; ++i) {
      tickets.push_back(handle.submit_write(file, out.get() + i * chunk, chunk, i * chunk));
    }
    for (int i = count - 1; i >= 0; --i) handle.wait(tickets[i]);
    tickets.clear();
    for (int i = 0; i < count; ++i) tickets.push_back(handle.submit_read(file, in.get() + i * chunk, chunk, i * chunk));
    handle.wait_all();  // waits without consuming: the tickets are still ours to wait for
    handle.wait(std::span<const Ticket>(tickets));
    CHECK(std::memcmp(out.get(), in.get(), chunk * count) == 0);
  }
}

TEST_CASE("several handles work at once on separate and shared files", "[nvme]") {
  strata::test::TempDir dir("nvme-handles");
  const size_t nbytes = (1 << 20) + 4096;
  const int kHandles = 4;
  File shared = File::open(dir.file("shared"), OpenMode::kTruncate);
  std::vector<std::thread> threads;
  std::vector<int> ok(kHandles, 0);
  for (int h = 0; h < kHandles; ++h) {
    threads.emplace_back([&, h] {
      EngineKind engine = h % 2 == 0 ? EngineKind::kUring : EngineKind::kAio;
      AioHandle handle(small_options(engine, 2));
      File own = File::open(dir.file("own" + std::to_string(h)), OpenMode::kTruncate);
      auto out = aligned_buffer(nbytes);
      auto in = aligned_buffer(nbytes);
      fill_random(out.get(), nbytes, 100 + h);
      int good = 0;
      for (int round = 0; round < 3; ++round) {
        auto t1 = handle.submit_write(own, out.get(), nbytes, 0);
        auto t2 = handle.submit_write(shared, out.get(), nbytes, h * nbytes);
        handle.wait(t1);
        handle.wait(t2);
        handle.read(own, in.get(), nbytes, 0);
        good += std::memcmp(out.get(), in.get(), nbytes) == 0;
        handle.read(shared, in.get(), nbytes, h * nbytes);
        good += std::memcmp(out.get(), in.get(), nbytes) == 0;
      }
      ok[h] = good;
    });
  }
  for (auto& t : threads) t.join();
  for (int h = 0; h < kHandles; ++h) CHECK(ok[h] == 6);
}

TEST_CASE("registered (fixed) buffers are used by io_uring and move the right bytes", "[nvme]") {
  strata::test::TempDir dir("nvme-fixed");
  const size_t nbytes = 1 << 20;
  auto pool = aligned_buffer(2 * nbytes);
  AioHandle handle(small_options(EngineKind::kUring, 2));
  bool registered = handle.register_buffers({iovec{pool.get(), 2 * nbytes}});
  if (!registered) {
    WARN("io_uring refused buffer registration here (memlock limit); fixed path not exercised");
  }
  File file = File::open(dir.file("f"), OpenMode::kTruncate);
  fill_random(pool.get(), nbytes, 3);
  handle.write(file, pool.get(), nbytes, 0);
  handle.read(file, pool.get() + nbytes, nbytes, 0);
  CHECK(std::memcmp(pool.get(), pool.get() + nbytes, nbytes) == 0);
  if (registered) CHECK(handle.stats().fixed_pieces == handle.stats().pieces);
  // A buffer outside the registration still works, unfixed.
  auto other = aligned_buffer(nbytes);
  handle.read(file, other.get(), nbytes, 0);
  CHECK(std::memcmp(pool.get(), other.get(), nbytes) == 0);
  handle.unregister_buffers();
  // Other backends report that they do not register.
  AioHandle aio(small_options(EngineKind::kAio, 1));
  CHECK_FALSE(aio.register_buffers({iovec{pool.get(), nbytes}}));
}
