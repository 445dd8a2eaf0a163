// Swap space: stable names, preallocation, free-space check, keep vs remove.
#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <cstring>
#include <thread>

#include "nvme/aio_handle.h"
#include "nvme/swap_space.h"
#include "core/error.h"
#include "tests/nvme/test_util.h"
#include "tests/support/temp_dir.h"

using namespace strata::nvme;
namespace fs = std::filesystem;

TEST_CASE("swap files have stable names per group and rank and are preallocated", "[nvme]") {
  strata::test::TempDir dir("nvme-swap");
  fs::path path;
  {
    SwapSpace swap({.root = dir.path(), .group = "optimizer", .rank = 3});
    CHECK(swap.directory() == dir.path() / "optimizer" / "rank3");
    swap.create({{"group0.exp_avg", 1 << 20}, {"group0.exp_avg_sq", 3 << 20}});
    path = swap.path_for("group0.exp_avg_sq");
    CHECK(path == dir.path() / "optimizer" / "rank3" / "group0.exp_avg_sq.swp");
    CHECK(fs::file_size(path) == (3u << 20));
    CHECK(swap.total_nbytes() == (4u << 20));
    // Preallocated: the blocks exist (no sparse file).
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    CHECK(static_cast<uint64_t>(st.st_blocks) * 512 >= (3u << 20));
    CHECK_THROWS_WITH(swap.file("nope"), Catch::Contains("no swap file with key 'nope'"));
    CHECK_THROWS_WITH(swap.create({.key = "../escape", .nbytes = 4096}),
                      Catch::Contains("may contain only"));
  }
  CHECK_FALSE(fs::exists(path));
  CHECK_FALSE(fs::exists(dir.path() / "optimizer" / "rank3"));
}

TEST_CASE("kept swap files survive and are reopened with their data", "[nvme]") {
  strata::test::TempDir dir("nvme-swap-keep");
  const size_t nbytes = 1 << 20;
  auto out = test::aligned_buffer(nbytes);
  auto in = test::aligned_buffer(nbytes);
  test::fill_random(out.get(), nbytes, 77);
  AioHandle handle(AioOptions{});
  {
    SwapSpace swap({.root = dir.path(), .group = "param", .rank = 0});
    File& file = swap.create({.key = "w", .nbytes = nbytes});
    handle.write(file, out.get(), nbytes, 0);
    swap.keep();
  }
  SwapSpace again({.root = dir.path(), .group = "param", .rank = 0});
  File& file = again.create({.key = "w", .nbytes = nbytes});
  handle.read(file, in.get(), nbytes, 0);
  CHECK(std::memcmp(out.get(), in.get(), nbytes) == 0);
}

TEST_CASE("a swap space larger than the free space fails up front with a clear error", "[nvme]") {
  strata::test::TempDir dir("nvme-swap-big");
  SwapSpace swap({.root = dir.path(), .group = "optimizer", .rank = 1});
  uint64_t free_nbytes = free_space_nbytes(dir.path());
  uint64_t huge = free_nbytes + (uint64_t{1} << 40);
  try {
    swap.create({{"a", 1 << 20}, {"b", huge}});
    FAIL("no error for a swap space larger than the filesystem");
  } catch (const strata::Error& e) {
    CHECK(e.category() == strata::ErrorCategory::kIo);
    CHECK_THAT(std::string(e.what()), Catch::Contains("rank 1") &&
                                          Catch::Contains("bytes free") &&
                                          Catch::Contains(swap.directory().string()));
  }
  // Nothing was created: the check comes before any file.
  CHECK_FALSE(fs::exists(swap.path_for("a")));
}

TEST_CASE("ranks that share a group directory create and remove their spaces at once", "[nvme]") {
  // Each space removes the group directory when it is left empty; a peer creating its own
  // rank directory at that moment must still succeed (the CI race of a refused resume).
  strata::test::TempDir dir("nvme-swap-race");
  std::exception_ptr errors[2];
  auto churn = [&](int rank) {
    try {
      for (int i = 0; i < 300; ++i) {
        SwapSpace swap({.root = dir.path(), .group = "optimizer", .rank = rank});
        swap.create({.key = "m", .nbytes = 4096});
      }
    } catch (...) {
      errors[rank] = std::current_exception();
    }
  };
  std::thread peer(churn, 1);
  churn(0);
  peer.join();
  for (const auto& error : errors) {
    if (error) CHECK_NOTHROW(std::rethrow_exception(error));
  }
  CHECK_FALSE(fs::exists(dir.path() / "optimizer"));
}
