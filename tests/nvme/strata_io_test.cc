// The strata-io tool end to end on a small file: every engine and a sweep,
// the #wrong column, the documented JSON fields, fio comparison and tune.
#include <catch2/catch.hpp>

#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"

namespace {

std::string strata_io() { return std::string(STRATA_BUILD_DIR) + "/bin/strata-io"; }

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

TEST_CASE("strata-io --vs-fio runs fio on the same file and prints the ratio", "[nvme][tool]") {
  strata::test::TempDir dir("nvme-strata-io-fio");
  auto result = strata::test::run_command(
      strata_io() + " --file " + dir.file("f.dat") +
      " --size 4MiB --bs 1M --qd 4 --iters 1 --warmup 0 --vs-fio --json - 2>&1");
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  auto doc = nlohmann::json::parse(result.output.substr(result.output.find("{\n")));
  REQUIRE(doc["results"].size() == 2);
  for (const auto& row : doc["results"]) {
    CHECK(row["fio_gbps"].get<double>() > 0);
    CHECK(row["vs_fio"].get<double>() > 0);
  }
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
  CHECK_THAT(help.output, Catch::Contains("--vs-fio") && Catch::Contains("tune"));
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
  CHECK(doc["strata"]["io_engine"] == "uring");
}
