// Tests on a real, deliberately tiny filesystem (an 8 MiB tmpfs mounted for
// the test): ENOSPC from the engine and from swap-space creation. Its own main
// exits 77 (CTest: SKIPPED) with the reason when mounting is not permitted.
// Also: O_DIRECT fallback on a ramfs mount.
#include <catch2/catch.hpp>

#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "nvme/aio_handle.h"
#include "nvme/swap_space.h"
#include "core/error.h"
#include "tests/nvme/test_util.h"
#include "tests/support/catch_session.h"
#include "tests/support/temp_dir.h"

using namespace strata::nvme;

namespace {

// An 8 MiB tmpfs mounted on a fresh temporary directory; unmounted at scope end.
class SmallFs {
 public:
  SmallFs() : dir_("nvme-smallfs") {
    mounted_ = ::mount("strata-test", dir_.path().c_str(), "tmpfs", 0, "size=8M") == 0;
    error_ = mounted_ ? 0 : errno;
  }
  ~SmallFs() {
    if (mounted_) ::umount2(dir_.path().c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  int error() const { return error_; }
  const std::filesystem::path& path() const { return dir_.path(); }

 private:
  strata::test::TempDir dir_;
  bool mounted_ = false;
  int error_ = 0;
};

}  // namespace

TEST_CASE("ENOSPC on a full filesystem surfaces from wait() with context", "[nvme][smallfs]") {
  SmallFs fs;
  REQUIRE(fs.mounted());
  const size_t nbytes = 16 << 20;
  auto buf = test::aligned_buffer(nbytes);
  for (EngineKind engine : {EngineKind::kUring, EngineKind::kAio, EngineKind::kPsync}) {
    INFO("engine " << engine_kind_name(engine));
    AioOptions options;
    options.engine = engine;
    options.thread_count = 2;
    std::string path = (fs.path() / "full.bin").string();
    {
      AioHandle handle(options);
      File file = File::open(path, OpenMode::kTruncate);
      try {
        handle.write(file, buf.get(), nbytes, 0);
        FAIL("16 MiB fitted on an 8 MiB filesystem");
      } catch (const strata::Error& e) {
        CHECK(e.category() == strata::ErrorCategory::kIo);
        CHECK_THAT(std::string(e.what()), Catch::Contains("ENOSPC") && Catch::Contains(path) &&
                                              Catch::Contains("No space left"));
      }
    }
    std::filesystem::remove(path);
  }
}

TEST_CASE("swap space on a too-small filesystem fails before creating files", "[nvme][smallfs]") {
  SmallFs fs;
  REQUIRE(fs.mounted());
  SwapSpace swap({.root = fs.path(), .group = "optimizer", .rank = 0});
  CHECK_THROWS_WITH(swap.create({{"m", 6 << 20}, {"v", 6 << 20}}),
                    Catch::Contains("bytes free") && Catch::Contains("optimizer"));
  CHECK_FALSE(std::filesystem::exists(swap.path_for("m")));
  // What fits is created and preallocated.
  swap.create({{"m", 2 << 20}, {"v", 2 << 20}});
  CHECK(swap.file("v").size_nbytes() == (2u << 20));
}

TEST_CASE("a filesystem that refuses O_DIRECT falls back to buffered I/O", "[nvme][smallfs]") {
  // ramfs has no direct-I/O support (tmpfs has it since Linux 6.6).
  strata::test::TempDir dir("nvme-ramfs");
  REQUIRE(::mount("strata-test", dir.path().c_str(), "ramfs", 0, nullptr) == 0);
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{dir.path().string()};
  File file = File::open(dir.file("ram.bin"), OpenMode::kTruncate, /*direct=*/true);
  CHECK_FALSE(file.direct());
  CHECK(file.alignment() == 1);
  for (EngineKind engine : {EngineKind::kUring, EngineKind::kAio, EngineKind::kPsync}) {
    INFO("engine " << engine_kind_name(engine));
    AioOptions options;
    options.engine = engine;
    options.block_size = 64 << 10;
    AioHandle handle(options);
    const size_t nbytes = 300000;  // not aligned: fine without O_DIRECT
    std::vector<char> out(nbytes), in(nbytes);
    test::fill_random(out.data(), nbytes, 17);
    handle.write(file, out.data(), nbytes, 3);
    handle.read(file, in.data(), nbytes, 3);
    CHECK(out == in);
  }
}

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing |= std::strncmp(argv[i], "--list", 6) == 0;
  if (!listing) {
    SmallFs probe;
    if (!probe.mounted()) {
      std::printf("SKIPPED: cannot mount a size-limited tmpfs for the ENOSPC tests (%s); run as "
                  "root or with CAP_SYS_ADMIN\n",
                  std::strerror(probe.error()));
      return 77;
    }
  }
  return strata::test::run_catch_session(argc, argv);
}
