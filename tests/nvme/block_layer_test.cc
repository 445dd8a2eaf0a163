// Regression guard (issue 15): the I/O engine's O_DIRECT pieces reach the
// file's block device whole, read from pinned host memory, for io_uring (plain
// and fixed buffers) and libaio. Counted from the device's own statistics
// (/sys/dev/block/M:m/stat), no timing involved. Pinned buffers on 4 KiB pages
// need one scatter-gather segment per page, so a piece larger than
// max_segments pages is split in the block layer; this test catches a change
// that brings that back (or any other split). Exits 77 (CTest: SKIPPED) with
// the reason where the device's statistics cannot be read or transparent huge
// pages are off, and where the device is too busy to attribute requests.
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <sys/ioctl.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "nvme/aio_handle.h"
#include "nvme/block_stats.h"
#include "nvme/file.h"
#include "core/host_memory.h"
#include "tests/nvme/test_util.h"
#include "tests/support/catch_session.h"
#include "tests/support/temp_dir.h"

namespace strata::nvme {
namespace {

constexpr int kSkip = 77;
constexpr int kAttempts = 8;

// Catch2 v2 has no SKIP: prints the reason and exits 77 (CTest: SKIPPED),
// removing what the test made first (no destructor runs after this).
[[noreturn]] void skip(const std::string& why, const std::filesystem::path& made) {
  std::error_code ignored;
  std::filesystem::remove_all(made, ignored);
  std::printf("SKIPPED: %s\n", why.c_str());
  std::fflush(stdout);
  std::_Exit(kSkip);
}

// The piece size under test: as large as one request may be (so merging
// cannot hide a split), at most 4 MiB, a multiple of 4 KiB.
size_t piece_nbytes(const BlockDevice& device) {
  size_t bs = size_t{4} << 20;
  if (device.max_request_nbytes() > 0) bs = std::min<size_t>(bs, device.max_request_nbytes());
  return std::max<size_t>(kDirectIoAlignment, bs / kDirectIoAlignment * kDirectIoAlignment);
}

// Upper bound on the requests one read of [0, nbytes) in `bs` pieces needs
// when no piece is split except at the file's own physical discontinuities:
// the sum over pieces of the extents each piece overlaps (FIEMAP), or the
// piece count where FIEMAP is unsupported.
uint64_t allowed_requests(int fd, uint64_t nbytes, size_t bs) {
  const uint64_t pieces = (nbytes + bs - 1) / bs;
  constexpr unsigned kMaxExtents = 512;
  std::vector<char> storage(sizeof(fiemap) + kMaxExtents * sizeof(fiemap_extent));
  auto* map = reinterpret_cast<fiemap*>(storage.data());
  map->fm_start = 0;
  map->fm_length = nbytes;
  map->fm_flags = FIEMAP_FLAG_SYNC;
  map->fm_extent_count = kMaxExtents;
  if (ioctl(fd, FS_IOC_FIEMAP, map) != 0 || map->fm_mapped_extents == 0 ||
      map->fm_mapped_extents >= kMaxExtents) {
    return pieces;
  }
  uint64_t allowed = 0;
  for (uint64_t p = 0; p < pieces; ++p) {
    const uint64_t lo = p * bs, hi = std::min<uint64_t>(nbytes, lo + bs);
    uint64_t overlapping = 0;
    for (unsigned e = 0; e < map->fm_mapped_extents; ++e) {
      const fiemap_extent& x = map->fm_extents[e];
      if (x.fe_logical < hi && lo < x.fe_logical + x.fe_length) ++overlapping;
    }
    allowed += std::max<uint64_t>(overlapping, 1);
  }
  return allowed;
}

struct Observed {
  uint64_t requests = 0;
  uint64_t sectors = 0;
};

// Runs `io` until the device's counters show exactly our sectors in direction
// `op` (nothing else touched the device meanwhile); nullopt after kAttempts
// busy attempts.
template <typename Io>
std::optional<Observed> clean_attempt(const BlockDevice& device, IoOp op, uint64_t nbytes, Io io) {
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    const BlockCounters before = device.counters();
    io();
    const BlockCounters d = device.counters() - before;
    const uint64_t sectors = op == IoOp::kRead ? d.read_sectors : d.write_sectors;
    const uint64_t requests = op == IoOp::kRead ? d.reads : d.writes;
    if (sectors == nbytes / 512) return Observed{requests, sectors};
  }
  return std::nullopt;
}

struct Variant {
  const char* name;
  EngineKind engine;
  bool fixed;
};

}  // namespace

TEST_CASE("pinned host memory for I/O is backed by huge pages", "[nvme][block]") {
  const size_t nbytes = size_t{16} << 20;
  void* p = allocate_locked_host(nbytes);
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<uintptr_t>(p) % kHugePageNbytes == 0);
  const HostBacking backing = host_backing(p, nbytes);
  INFO("transparent_hugepage: " << transparent_huge_page_mode() << "; " << backing.huge_nbytes
                                << " of " << backing.nbytes << " bytes in huge pages");
  REQUIRE(backing.known);
  CHECK(backing.nbytes == nbytes);
  // At least half: the kernel may fall back to 4 KiB pages for a 2 MiB range
  // when memory is fragmented, never for all of them on a machine with THP on.
  CHECK(backing.huge_nbytes * 2 >= nbytes);
  free_locked_host(p, nbytes);
}

TEST_CASE("O_DIRECT pieces reach the block device whole", "[nvme][block]") {
  ::strata::test::TempDir dir("nvme-block-layer");
  std::string why;
  std::optional<BlockDevice> device = BlockDevice::of(dir.path().string(), &why);
  REQUIRE(device.has_value());  // main() skipped where it is not
  const size_t bs = piece_nbytes(*device);
  const uint64_t nbytes = 16 * static_cast<uint64_t>(bs);
  const std::string path = dir.file("pieces.dat");
  File file = File::open(path, OpenMode::kTruncate, true);
  if (!file.direct()) skip(fmt::format("{} refuses O_DIRECT", dir.path().string()), dir.path());
  file.allocate(nbytes);
  char* buf = static_cast<char*>(allocate_locked_host(nbytes));
  test::fill_random(buf, nbytes, 15);
  {
    AioOptions options;
    options.block_size = bs;
    AioHandle writer(options);
    writer.write(file, buf, nbytes, 0);  // extents written (not unwritten) before reading
    file.sync();
  }
  const uint64_t pieces = nbytes / bs;
  const uint64_t allowed = allowed_requests(file.fd(), nbytes, bs);
  if (allowed >= 2 * pieces) {
    free_locked_host(buf, nbytes);
    skip(fmt::format("the test file is in {} extents for {} pieces: too fragmented to tell a split "
                     "piece from a file discontinuity",
                     allowed, pieces),
         dir.path());
  }
  const Variant variants[] = {{"io_uring", EngineKind::kUring, false},
                              {"io_uring, fixed buffers", EngineKind::kUring, true},
                              {"libaio", EngineKind::kAio, false}};
  for (const Variant& v : variants) {
    AioOptions options;
    options.engine = v.engine;
    options.block_size = bs;
    options.queue_depth = 8;
    AioHandle handle(options);
    if (v.fixed) REQUIRE(handle.register_buffers({iovec{buf, nbytes}}));
    for (IoOp op : {IoOp::kRead, IoOp::kWrite}) {
      const char* op_text = op == IoOp::kRead ? "read" : "write";
      auto observed = clean_attempt(*device, op, nbytes, [&] {
        if (op == IoOp::kRead) {
          handle.read(file, buf, nbytes, 0);
        } else {
          handle.write(file, buf, nbytes, 0);  // O_DIRECT: at the device when it completes
        }
      });
      if (!observed) {
        // Writes share the device with every other process's writeback: a
        // busy device is no failure, but reads must be judged.
        if (op == IoOp::kWrite) {
          WARN(v.name << " " << op_text << ": device " << device->name() << " was never quiet for "
                      << kAttempts << " attempts; not judged");
          continue;
        }
        free_locked_host(buf, nbytes);
        skip(fmt::format("block device {} was busy with other reads in all {} attempts",
                         device->name(), kAttempts),
             dir.path());
      }
      INFO(v.name << " " << op_text << " of " << nbytes << " bytes in " << pieces << " pieces of "
                  << bs << " bytes on " << device->name() << " (max request "
                  << device->max_request_nbytes() << " bytes, " << device->max_segments()
                  << " segments): " << observed->requests << " requests, at most " << allowed
                  << " allowed (file extents); buffer " << host_backing(buf, nbytes).huge_nbytes
                  << " bytes in huge pages");
      CHECK(observed->requests >= 1);
      CHECK(observed->requests <= allowed);
    }
  }
  free_locked_host(buf, nbytes);
}

}  // namespace strata::nvme

#if defined(__SANITIZE_ADDRESS__)
#define STRATA_TEST_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define STRATA_TEST_UNDER_ASAN 1
#endif
#endif

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing |= std::strncmp(argv[i], "--list", 6) == 0;
#ifdef STRATA_TEST_UNDER_ASAN
  // ASan's mlock() does nothing, so pinned buffers are not populated (and not
  // backed by huge pages) when allocated: what these tests check is not there.
  if (!listing) {
    std::printf("SKIPPED: under AddressSanitizer mlock() is a no-op, so huge-page backing "
                "of pinned memory cannot be observed\n");
    return 77;
  }
#endif
  if (!listing) {
    strata::test::TempDir probe("nvme-block-probe");
    std::string why;
    if (!strata::nvme::BlockDevice::of(probe.path().string(), &why)) {
      std::printf(
          "SKIPPED: the block device statistics of the test directory are not readable "
          "(%s); set STRATA_TEST_DIR to a directory on a real disk\n",
          why.c_str());
      return 77;
    }
    const std::string thp = strata::transparent_huge_page_mode();
    if (thp != "always" && thp != "madvise") {
      std::printf(
          "SKIPPED: transparent huge pages are '%s' here, so pinned buffers are on 4 KiB "
          "pages and the block layer may split pieces by design\n",
          thp.c_str());
      return 77;
    }
  }
  return strata::test::run_catch_session(argc, argv);
}
