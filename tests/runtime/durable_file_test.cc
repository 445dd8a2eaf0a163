// core/durable_file.h and core/directory_lock.h: files that appear whole or
// not at all (with the nvme fault plan failing their writes), and directories
// one run owns (a real second process holding the lock, a stale lock of a
// dead one, a missing directory whose parent is missing too).
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/directory_lock.h"
#include "core/durable_file.h"
#include "core/error.h"
#include "nvme/io_backend.h"
#include "tests/support/temp_dir.h"

using namespace strata;
namespace fs = std::filesystem;

namespace {

std::string contents(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

size_t entries(const fs::path& dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir)) ++n;
  return n;
}

// Installs a file fault plan for one scope.
struct ScopedFaults {
  explicit ScopedFaults(std::shared_ptr<nvme::FaultPlan> plan) { set_file_faults(nvme::file_faults(std::move(plan))); }
  ~ScopedFaults() { set_file_faults(nullptr); }
};

}  // namespace

TEST_CASE("a durable file appears whole at commit, never before and an abandoned one leaves nothing", "[durable]") {
  test::TempDir dir;
  const fs::path path = dir.path() / "state.json";
  write_file_durably(path, "old\n");
  {
    DurableFile file(path);
    file.append("new contents");
    CHECK(contents(path) == "old\n");  // not visible before commit
    CHECK(entries(dir.path()) == 2);   // the old file and the temporary
  }
  CHECK(contents(path) == "old\n");
  CHECK(entries(dir.path()) == 1);  // the abandoned temporary is gone
  DurableFile file(path);
  file.write_at(4, "tail", 4);
  file.write_at(0, "head", 4);
  file.commit();
  CHECK(contents(path) == "headtail");
  CHECK(entries(dir.path()) == 1);
}

TEST_CASE("the fault plan fails durable writes: the error names the file and the errno, the old file stays",
          "[durable]") {
  test::TempDir dir;
  const fs::path path = dir.path() / "manifest.json";
  write_file_durably(path, "committed\n");
  {
    ScopedFaults faults(std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{
        nvme::IoFault{.nth = 2, .kind = nvme::IoFault::Kind::kError, .error = ENOSPC, .op = nvme::IoOp::kWrite}}));
    DurableFile file(path);
    file.append("first piece ");
    try {
      file.append("second piece");
      FAIL("the injected ENOSPC was not reported");
    } catch (const Error& e) {
      CHECK(e.category() == ErrorCategory::kIo);
      CHECK_THAT(e.message(), Catch::Contains(path.string()) && Catch::Contains("No space left on device") &&
                                  Catch::Contains("errno 28"));
    }
  }
  CHECK(contents(path) == "committed\n");
  CHECK(entries(dir.path()) == 1);

  // Short writes are resumed; a write that makes no progress is an error, not a loop.
  {
    ScopedFaults faults(std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{
        nvme::IoFault{.nth = 1, .kind = nvme::IoFault::Kind::kShort, .short_nbytes = 3, .op = nvme::IoOp::kWrite}}));
    write_file_durably(path, "resumed after a short write");
  }
  CHECK(contents(path) == "resumed after a short write");
  {
    ScopedFaults faults(std::make_shared<nvme::FaultPlan>(std::vector<nvme::IoFault>{nvme::IoFault{
        .nth = 1, .kind = nvme::IoFault::Kind::kShort, .short_nbytes = 0, .op = nvme::IoOp::kWrite, .repeat = true}}));
    CHECK_THROWS_WITH(write_file_durably(path, "never"), Catch::Contains(path.string()));
  }
  CHECK(contents(path) == "resumed after a short write");
}

TEST_CASE("a directory lock held by another process refuses a second holder, naming it and a stale one is taken over",
          "[lock]") {
  test::TempDir dir;
  // A real second process takes the lock and holds it until killed.
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(ready[0]);
    try {
      auto lock = DirectoryLock::acquire(dir.path(), rank_lock_file_name(0), "nvme_path");
      (void)!::write(ready[1], "y", 1);
      ::pause();
    } catch (...) {
      (void)!::write(ready[1], "n", 1);
    }
    ::_exit(0);
  }
  ::close(ready[1]);
  char answer = 0;
  REQUIRE(::read(ready[0], &answer, 1) == 1);
  ::close(ready[0]);
  REQUIRE(answer == 'y');
  try {
    DirectoryLock::acquire(dir.path(), rank_lock_file_name(0), "nvme_path");
    FAIL("a second holder was let in");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::kBadArgument);
    CHECK_THAT(e.message(), Catch::Contains("nvme_path " + dir.path().string() + " is in use by another run") &&
                                Catch::Contains("pid " + std::to_string(child)) &&
                                Catch::Contains("strata-rank0.lock"));
  }
  // Another rank's file is free.
  CHECK(DirectoryLock::acquire(dir.path(), rank_lock_file_name(1), "nvme_path") != nullptr);
  // Killed (as kill -9 would), the holder leaves its file behind but not its lock.
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  REQUIRE(fs::exists(dir.path() / "strata-rank0.lock"));
  {
    auto lock = DirectoryLock::acquire(dir.path(), rank_lock_file_name(0), "nvme_path");
    CHECK_THAT(contents(dir.path() / "strata-rank0.lock"), Catch::Contains(std::to_string(::getpid())));
    // Within the process the lock is shared.
    auto again = DirectoryLock::acquire(dir.path(), rank_lock_file_name(0), "nvme_path");
    CHECK(again->path() == lock->path());
  }
  CHECK_FALSE(fs::exists(dir.path() / "strata-rank0.lock"));  // released cleanly: removed
}

TEST_CASE("a run directory is created only when its parent exists", "[lock]") {
  test::TempDir dir;
  ensure_run_directory(dir.path() / "swap", "nvme_path");
  CHECK(fs::is_directory(dir.path() / "swap"));
  ensure_run_directory(dir.path() / "swap/", "nvme_path");  // exists: fine
  CHECK_THROWS_WITH(ensure_run_directory(dir.path() / "typo" / "swap", "nvme_path"),
                    Catch::Contains("does not exist, and neither does its parent") &&
                        Catch::Contains((dir.path() / "typo").string()));
  CHECK_FALSE(fs::exists(dir.path() / "typo"));
  write_file_durably(dir.path() / "file", "x");
  CHECK_THROWS_WITH(ensure_run_directory(dir.path() / "file", "nvme_path"), Catch::Contains("is not a directory"));
}
