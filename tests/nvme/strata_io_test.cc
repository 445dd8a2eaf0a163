// The strata-io tool end to end on a small file: every engine and a sweep,
// the #wrong column, the documented JSON fields, fio comparison and tune.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

namespace {

std::string strata_io() { return strata::test::build_dir() + "/bin/strata-io"; }

}  // namespace

TEST_CASE("strata-io sweeps engines and sizes and reports no wrong block", "[nvme][tool]") {
  strata::test::TempDir dir("nvme-strata-io");
  std::string json = dir.file("r.json");
  auto result = strata::test::run_command(
      strata_io() + " --dir " + dir.path().string() +
      " --size 8MiB --bs 256K,1M --qd 4 --threads 1,2 --engine uring,aio,psync --iters 2 "
      "--warmup 0 --json " + json + " 2>&1");
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  CHECK_THAT(result.output, Catch::Contains("#wrong") && Catch::Contains("p99(us)"));
  std::ifstream in(json);
  nlohmann::json doc = nlohmann::json::parse(in);
  CHECK(doc["tool"] == "strata-io");
  CHECK(doc["direct"] == true);
  REQUIRE(doc["results"].size() == 3 * 2 * 2 * 2);  // engines x bs x threads x (write, read)
  for (const auto& row : doc["results"]) {
    for (const char* field : {"engine", "rw", "bs", "qd", "threads", "size_bytes", "gbps",
                              "gbps_iters", "iops", "lat_p50_us", "lat_p99_us", "wrong"}) {
      CHECK(row.contains(field));
    }
    CHECK(row["wrong"] == 0);
    CHECK(row["gbps"].get<double>() > 0);
    CHECK(row["gbps_iters"].size() == 2);
    CHECK(row["lat_p99_us"].get<double>() >= row["lat_p50_us"].get<double>());
  }
  // The temporary data file is removed: only the JSON is left.
  int entries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    CHECK(entry.path().filename() == "r.json");
    ++entries;
  }
  CHECK(entries == 1);
}

TEST_CASE("strata-io --vs-fio runs fio with io_uring and libaio and prints the ratio", "[nvme][tool]") {
  strata::test::TempDir dir("nvme-strata-io-fio");
  auto result = strata::test::run_command(
      strata_io() + " --file " + dir.file("f.dat") +
      " --size 4MiB --bs 1M --qd 4 --iters 2 --warmup 0 --vs-fio --json - 2>&1");
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  CHECK_THAT(result.output, Catch::Contains("fio-io_uring") && Catch::Contains("fio-libaio") &&
                                Catch::Contains("round 2:"));
  auto doc = nlohmann::json::parse(result.output.substr(result.output.find("{\n")));
  REQUIRE(doc["results"].size() == 2);
  for (const auto& row : doc["results"]) {
    CHECK(row["fio_gbps"].get<double>() > 0);
    CHECK(row["vs_fio"].get<double>() > 0);
    REQUIRE(row["anchors"].size() == 2);
    CHECK(row["anchors"][0]["name"] == "fio-io_uring");
    CHECK(row["anchors"][1]["name"] == "fio-libaio");
    for (const auto& anchor : row["anchors"]) {
      CHECK(anchor["error"].is_null());
      CHECK(anchor["gbps_iters"].size() == 2);  // one per round, alternating with strata's passes
    }
    CHECK(row["load_iters"].size() == 2);
  }
}

namespace {

// A stand-in for torch and deepspeed with the few calls strata-io's
// coprocess makes, reading and writing with os.pread/os.pwrite: tests the
// --vs-deepspeed plumbing where DeepSpeed itself is not installed.
void write_fake_deepspeed(const std::filesystem::path& root) {
  std::filesystem::create_directories(root / "torch");
  std::filesystem::create_directories(root / "deepspeed" / "ops" / "op_builder");
  std::ofstream(root / "torch" / "__init__.py") << R"PY(
__version__ = "0-stand-in"
uint8 = "uint8"
class Tensor:
    def __init__(self, buf):
        self.buf = memoryview(buf)
    def numel(self):
        return len(self.buf)
    def __getitem__(self, s):
        return Tensor(self.buf[s])
def empty(n, dtype=None):
    return Tensor(bytearray(n))
)PY";
  std::ofstream(root / "deepspeed" / "__init__.py") << "__version__ = \"0-stand-in\"\n";
  std::ofstream(root / "deepspeed" / "ops" / "__init__.py") << "";
  std::ofstream(root / "deepspeed" / "ops" / "op_builder" / "__init__.py") << R"PY(
import os, torch
class _Handle:
    def __init__(self, block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism):
        assert block_size > 0 and queue_depth > 0 and intra_op_parallelism > 0
    def new_cpu_locked_tensor(self, n, example):
        return torch.empty(n)
    def free_cpu_locked_tensor(self, t):
        pass
    def sync_pread(self, t, path, offset):
        fd = os.open(path, os.O_RDONLY)
        done = 0
        while done < t.numel():
            n = os.preadv(fd, [t.buf[done:]], offset + done)
            assert n > 0
            done += n
        os.close(fd)
        return 1
    def sync_pwrite(self, t, path, offset):
        fd = os.open(path, os.O_WRONLY)
        done = 0
        while done < t.numel():
            done += os.pwrite(fd, t.buf[done:], offset + done)
        os.close(fd)
        return 1
class _Op:
    aio_handle = _Handle
class AsyncIOBuilder:
    def is_compatible(self, verbose=False):
        return True
    def load(self, verbose=False):
        return _Op
)PY";
}

bool have_python3() {
  return strata::test::run_command("command -v python3 >/dev/null 2>&1").exit_code == 0;
}

}  // namespace

TEST_CASE("strata-io --vs-deepspeed times aio_handle in alternation and prints the ratio",
          "[nvme][tool]") {
  if (!have_python3()) {
    WARN("no python3 here: the --vs-deepspeed plumbing is not exercised");
    return;
  }
  strata::test::TempDir dir("nvme-strata-io-ds");
  write_fake_deepspeed(dir.path() / "py");
  auto result = strata::test::run_command(
      "PYTHONPATH=" + (dir.path() / "py").string() + " " + strata_io() + " --file " +
      dir.file("f.dat") +
      " --size 4MiB --bs 1M --qd 4 --threads 2 --iters 2 --warmup 0 --vs-deepspeed --python python3 "
      "--json - 2>&1");
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  CHECK_THAT(result.output, Catch::Contains("deepspeed 0-stand-in") && Catch::Contains("vs DS") &&
                                Catch::Contains("| deepspeed "));
  auto doc = nlohmann::json::parse(result.output.substr(result.output.find("{\n")));
  REQUIRE(doc["results"].size() == 2);
  for (const auto& row : doc["results"]) {
    CHECK(row["wrong"] == 0);  // strata's read after DeepSpeed's write still checks out
    CHECK(row["deepspeed_gbps"].get<double>() > 0);
    CHECK(row["vs_deepspeed"].get<double>() > 0);
    REQUIRE(row["anchors"].size() == 1);
    CHECK(row["anchors"][0]["gbps_iters"].size() == 2);
  }
}

TEST_CASE("strata-io --vs-deepspeed says which Python could not import deepspeed and goes on",
          "[nvme][tool]") {
  strata::test::TempDir dir("nvme-strata-io-nods");
  auto missing = strata::test::run_command(
      strata_io() + " --file " + dir.file("f.dat") +
      " --size 2MiB --bs 1M --qd 2 --iters 1 --warmup 0 --vs-deepspeed --python "
      "/nonexistent/python3 --json - 2>&1");
  INFO(missing.output);
  REQUIRE(missing.exit_code == 0);
  CHECK_THAT(missing.output, Catch::Contains("DeepSpeed is not available") &&
                                 Catch::Contains("/nonexistent/python3"));
  auto doc = nlohmann::json::parse(missing.output.substr(missing.output.find("{\n")));
  CHECK(doc["results"].size() == 2);  // the rest still ran
  CHECK_THAT(doc["deepspeed_unavailable"].get<std::string>(), Catch::Contains("/nonexistent/python3"));
  if (!have_python3()) return;
  // An interpreter that runs but cannot import: the import error and the
  // interpreter's own path are named (STRATA_PYTHON picks it).
  std::filesystem::create_directories(dir.path() / "py" / "torch");
  std::ofstream(dir.path() / "py" / "torch" / "__init__.py")
      << "raise ImportError('stand-in: torch is not installed here')\n";
  auto broken = strata::test::run_command(
      "PYTHONPATH=" + (dir.path() / "py").string() + " STRATA_PYTHON=python3 " + strata_io() +
      " --file " + dir.file("f.dat") +
      " --size 2MiB --bs 1M --qd 2 --iters 1 --warmup 0 --vs-deepspeed 2>&1");
  INFO(broken.output);
  REQUIRE(broken.exit_code == 0);
  CHECK_THAT(broken.output, Catch::Contains("stand-in: torch is not installed here") &&
                                Catch::Contains("Python 'python3' (/"));
  CHECK_THAT(broken.output, Catch::Contains("uring  read"));
}

TEST_CASE("strata-io rejects bad flags with a clear message", "[nvme][tool]") {
  strata::test::TempDir dir("nvme-strata-io-bad");
  auto bad_engine = strata::test::run_command(strata_io() + " --dir " + dir.path().string() +
                                              " --size 1MiB --engine spdk 2>&1");
  CHECK(bad_engine.exit_code != 0);
  CHECK_THAT(bad_engine.output, Catch::Contains("uring, aio, psync"));
  auto bad_size = strata::test::run_command(strata_io() + " --dir " + dir.path().string() +
                                            " --size 1MiB --bs 768K 2>&1");
  CHECK(bad_size.exit_code != 0);
  CHECK_THAT(bad_size.output, Catch::Contains("multiple of --bs"));
  auto help = strata::test::run_command(strata_io() + " --help 2>&1");
  CHECK(help.exit_code == 0);
  CHECK_THAT(help.output, Catch::Contains("--vs-fio") && Catch::Contains("tune") &&
                              Catch::Contains("--vs-deepspeed") && Catch::Contains("--python"));
}

// Issue 16: `--bs 0` divided by zero (SIGFPE) and left the 1 GiB temp file.
TEST_CASE("strata-io --bs 0 is refused naming the flag, without a crash or a leftover file",
          "[nvme][tool]") {
  strata::test::TempDir dir("nvme-strata-io-bs0");
  auto result = strata::test::run_command(strata_io() + " --dir " + dir.path().string() +
                                          " --size 8MiB --bs 0 2>&1");
  INFO(result.output);
  CHECK(result.exit_code == 1);  // an error, not a signal
  CHECK_THAT(result.output, Catch::Contains("--bs 0"));
  CHECK(std::filesystem::is_empty(dir.path()));
}

// Issue 16: bad --qd / --threads / --bs were reported under their config names
// (aio.queue_depth) after the test file was already preallocated.
TEST_CASE("strata-io names the flag of an out-of-range value and creates no file first",
          "[nvme][tool]") {
  strata::test::TempDir dir("nvme-strata-io-flags");
  const std::string file = dir.file("never.dat");
  struct Case {
    const char* args;
    const char* flag;
  };
  for (const Case& c : {Case{"--qd 0", "--qd 0"}, Case{"--qd 5000", "--qd 5000"},
                        Case{"--threads 0", "--threads 0"}, Case{"--threads 1,300", "--threads 300"},
                        Case{"--bs 1000", "--bs 1000"}, Case{"--bs 2G", "--bs 2G"}}) {
    auto result = strata::test::run_command(strata_io() + " --file " + file + " --size 8MiB " +
                                            c.args + " 2>&1");
    INFO(c.args << ": " << result.output);
    CHECK(result.exit_code == 1);
    CHECK_THAT(result.output, Catch::Contains(c.flag));
    CHECK_THAT(result.output, !Catch::Contains("aio."));
    CHECK_FALSE(std::filesystem::exists(file));
  }
  auto tune = strata::test::run_command(strata_io() + " tune --dir " + dir.path().string() +
                                        " --size 0 2>&1");
  CHECK(tune.exit_code == 1);
  CHECK_THAT(tune.output, Catch::Contains("--size 0"));
  CHECK(std::filesystem::is_empty(dir.path()));
}

TEST_CASE("strata-io tune prints an aio block within its budget", "[nvme][tool]") {
  strata::test::TempDir dir("nvme-strata-io-tune");
  auto result = strata::test::run_command(strata_io() + " tune --dir " + dir.path().string() +
                                          " --size 8MiB --budget 10 2>&1");
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  auto doc = nlohmann::json::parse(result.output.substr(result.output.find("{\n")));
  CHECK(doc["aio"]["block_size"].get<uint64_t>() % 4096 == 0);
  CHECK(doc["aio"]["queue_depth"].get<int>() >= 1);
  CHECK(doc["aio"]["thread_count"].get<int>() >= 1);
  // The engine is measured too (both engines' rows are printed) and the choice explained.
  const std::string engine = doc["aio"]["engine"];
  CHECK((engine == "uring" || engine == "aio"));
  CHECK_THAT(result.output, Catch::Contains("aio   ") && Catch::Contains("uring ") &&
                                Catch::Contains("# engine: " + engine + " — "));
  CHECK(std::filesystem::is_empty(dir.path()));
  auto given = strata::test::run_command(strata_io() + " tune --dir " + dir.path().string() +
                                         " --size 4MiB --budget 2 --engine aio 2>&1");
  INFO(given.output);
  REQUIRE(given.exit_code == 0);
  CHECK_THAT(given.output, Catch::Contains("# engine: aio — given with --engine aio"));
}

TEST_CASE("strata-io --auto-tune times the handle after aio.auto_tune has chosen", "[nvme][tool][auto_tune]") {
  strata::test::TempDir dir("nvme-strata-io-autotune");
  std::string json = dir.file("r.json");
  auto result = strata::test::run_command(
      strata_io() + " --dir " + dir.path().string() +
      " --size 16MiB --bs 1M --qd 8 --rw both --iters 2 --warmup 0 --auto-tune "
      "--auto-tune-nbytes 32MiB --json " + json + " 2>&1");
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  CHECK_THAT(result.output, Catch::Contains("auto_tune: timed passes used bs") &&
                                Catch::Contains("writes use block_size") &&
                                Catch::Contains("reads use block_size"));
  std::ifstream in(json);
  nlohmann::json doc = nlohmann::json::parse(in);
  REQUIRE(doc["results"].size() == 2);
  for (const auto& row : doc["results"]) {
    CHECK(row["wrong"] == 0);
    REQUIRE(row.contains("auto_tune"));
    const auto& tune = row["auto_tune"];
    // 32 MiB of tuning traffic in passes of 16 MiB: at least two untimed passes.
    CHECK(tune["tuning_gbps_passes"].size() >= 2);
    bool chosen_is_candidate = false;
    REQUIRE(tune["candidates"].size() == 4);  // 1M x8 and the three other defaults
    for (const auto& c : tune["candidates"]) {
      CHECK(c["bytes"].get<uint64_t>() > 0);
      chosen_is_candidate |= c["bs"] == tune["chosen_bs"] && c["qd"] == tune["chosen_qd"];
    }
    CHECK(chosen_is_candidate);
  }
  auto psync = strata::test::run_command(strata_io() + " --dir " + dir.path().string() +
                                         " --size 8MiB --engine psync --auto-tune 2>&1");
  CHECK(psync.exit_code == 1);
  CHECK_THAT(psync.output, Catch::Contains("--auto-tune with --engine psync"));
}
