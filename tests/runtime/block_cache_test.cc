// core/block_cache.h on its own: the bookkeeping both accelerators share,
// with fake addresses (a BlockCache never touches memory).
#include <catch2/catch.hpp>

#include <cstdint>

#include "core/block_cache.h"
#include "core/error.h"

using strata::BlockCache;

namespace {

void* address(uintptr_t n) { return reinterpret_cast<void*>(n * 4096); }

}  // namespace

TEST_CASE("block cache: the budget counts cached bytes, drops the largest first and names what is held",
          "[accelerator][block_cache]") {
  BlockCache cache({1000, 0, /*cache_within_peak=*/false, "test:0"});
  BlockCache::Freed freed;
  REQUIRE(cache.reserve(300, 300, freed) == nullptr);
  cache.commit(address(1), 300);
  REQUIRE(cache.reserve(200, 200, freed) == nullptr);
  cache.commit(address(2), 200);
  cache.free(address(1), freed, "deallocate");
  cache.free(address(2), freed, "deallocate");
  CHECK(freed.empty());  // this policy keeps every block
  CHECK(cache.stats().cached_nbytes == 500);
  CHECK(cache.stats().in_use_nbytes == 0);
  // The same size comes from the cache, live again.
  CHECK(cache.reserve(200, 200, freed) == address(2));
  CHECK(cache.stats().cached_nbytes == 300);
  // 750 fits only without the cached 300.
  REQUIRE(cache.reserve(750, 750, freed) == nullptr);
  REQUIRE(freed.size() == 1);
  CHECK(freed[0] == std::pair<void*, size_t>{address(1), 300});
  cache.commit(address(3), 750);
  const strata::MemoryStats s = cache.stats();
  CHECK(s.in_use_nbytes == 950);
  CHECK(s.peak_nbytes == 950);
  CHECK(s.cached_nbytes == 0);
  try {
    cache.reserve(100, 128, freed);
    FAIL("no error");
  } catch (const strata::Error& e) {
    CHECK(e.category() == strata::ErrorCategory::kOutOfMemory);
    CHECK_THAT(e.what(), Catch::Contains("test:0 device memory: requested 100 bytes (a block of 128), 950 in use") &&
                             Catch::Contains("capacity 1000 (50 free)"));
  }
  // A failed system allocation gives its reservation back.
  REQUIRE(cache.reserve(50, 50, freed) == nullptr);
  cache.cancel(50);
  CHECK(cache.stats().in_use_nbytes == 950);
}

TEST_CASE("block cache: a block freed after work stays in use until the work is seen done",
          "[accelerator][block_cache]") {
  BlockCache cache({1000, 0, false, "test:0"});
  BlockCache::Freed freed;
  REQUIRE(cache.reserve(400, 400, freed) == nullptr);
  cache.commit(address(1), 400);
  bool done = false;
  cache.free_after(address(1), [&] { return done; }, freed, "deallocate_after");
  CHECK(cache.stats().in_use_nbytes == 400);
  CHECK(cache.stats().pending_free_nbytes == 400);
  CHECK_THROWS_WITH(cache.free(address(1), freed, "deallocate"),
                    Catch::Contains("deallocate of unknown or already freed pointer"));
  done = true;
  cache.reap(freed);
  CHECK(cache.stats().in_use_nbytes == 0);
  CHECK(cache.stats().pending_free_nbytes == 0);
  CHECK(cache.stats().cached_nbytes == 400);
  CHECK(cache.all_blocks().size() == 1);
  CHECK(cache.drop_cached().size() == 1);
  CHECK(cache.all_blocks().empty());
}

TEST_CASE("block cache: the cpu policy keeps only large blocks, within the peak", "[accelerator][block_cache]") {
  BlockCache cache({1 << 30, 1 << 20, /*cache_within_peak=*/true, "cpu"});
  BlockCache::Freed freed;
  const size_t big = 4 << 20, small = 1000;
  REQUIRE(cache.reserve(big, big, freed) == nullptr);
  cache.commit(address(1), big);
  REQUIRE(cache.reserve(small, small, freed) == nullptr);
  cache.commit(address(2), small);
  cache.free(address(2), freed, "deallocate");
  REQUIRE(freed.size() == 1);  // small: back to the system
  cache.free(address(1), freed, "deallocate");
  CHECK(freed.size() == 1);  // large and within the peak: kept
  CHECK(cache.stats().cached_nbytes == big);
  // Another size is allocated fresh; caching it beside the first would exceed
  // the peak: the least recently cached block goes back to make room.
  REQUIRE(cache.reserve(2 * big, 2 * big, freed) == nullptr);
  cache.commit(address(3), 2 * big);
  cache.free(address(3), freed, "deallocate");
  REQUIRE(freed.size() == 2);
  CHECK(freed.back() == std::make_pair(address(1), big));
  const strata::MemoryStats s = cache.stats();
  CHECK(s.cached_nbytes == 2 * big);
  CHECK(s.in_use_nbytes + s.cached_nbytes <= s.peak_nbytes);
}

TEST_CASE("block cache: within the peak, a freed block evicts the least recently cached ones, oldest first",
          "[accelerator][block_cache]") {
  // A step's transient sizes come back every micro-batch; a block used once
  // per step must not hold the room they need (each miss is a fresh mapping:
  // page faults and zeroing).
  BlockCache cache({1 << 30, 1 << 20, /*cache_within_peak=*/true, "cpu"});
  BlockCache::Freed freed;
  const size_t mib = 1 << 20;
  // Peak 6 MiB: blocks of 1, 2 and 3 MiB live at once.
  for (int i = 1; i <= 3; ++i) {
    REQUIRE(cache.reserve(i * mib, i * mib, freed) == nullptr);
    cache.commit(address(i), i * mib);
  }
  for (int i = 1; i <= 3; ++i) cache.free(address(i), freed, "deallocate");
  REQUIRE(freed.empty());  // all three cached: 6 MiB, the peak
  // 1.5 MiB live (a size not cached), then freed: the oldest cached (1 MiB,
  // then 2 MiB) make room; the 3 MiB one, cached last, stays.
  const size_t odd = 3 * mib / 2;
  REQUIRE(cache.reserve(odd, odd, freed) == nullptr);
  REQUIRE(freed.empty());  // within the budget: nothing dropped to allocate
  cache.commit(address(4), odd);
  cache.free(address(4), freed, "deallocate");
  REQUIRE(freed.size() == 2);
  CHECK(freed[0] == std::make_pair(address(1), mib));
  CHECK(freed[1] == std::make_pair(address(2), 2 * mib));
  CHECK(cache.stats().cached_nbytes == 3 * mib + odd);
  CHECK(cache.stats().peak_nbytes == 6 * mib);
  CHECK(cache.reserve(3 * mib, 3 * mib, freed) == address(3));
  CHECK(cache.reserve(odd, odd, freed) == address(4));
}
