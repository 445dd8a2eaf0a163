// strata-io: sequential NVMe bandwidth of strata's I/O engine, swept over block
// size, queue depth, thread count and engine, checked byte for byte, optionally
// side by side with fio; `strata-io tune` picks the `aio` config block.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "bench/strata-io/io_bench.h"
#include "runtime/config/size.h"
#include "runtime/core/error.h"
#include "runtime/core/log.h"

namespace sb = strata::bench;
namespace nvme = strata::nvme;

namespace {

struct Flags {
  std::string file, dir, size = "1GiB", json;
  std::vector<std::string> rw{"both"}, bs{"1M"}, engine{"uring"};
  std::vector<int> qd{32}, threads{1};
  int iters = 3, warmup = 1;
  bool check = true, vs_fio = false, buffered = false, keep = false;
  // tune
  std::string tune_dir, tune_size = "256MiB", tune_engine = "uring";
  double tune_budget_s = 40;
};

std::vector<std::string> split_list(const std::vector<std::string>& items) {
  std::vector<std::string> out;
  for (const auto& item : items) {
    size_t start = 0;
    while (start <= item.size()) {
      size_t comma = item.find(',', start);
      std::string part = item.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (!part.empty()) out.push_back(part);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return out;
}

// The test data path: --file as given, or <dir>/strata-io.<pid>.dat (temporary).
std::string data_path(const std::string& file, const std::string& dir, bool* owned) {
  if (!file.empty()) {
    *owned = false;
    return file;
  }
  STRATA_CHECK(!dir.empty(), kBadArgument, "give --file PATH or --dir DIR");
  *owned = true;
  return (std::filesystem::path(dir) / fmt::format("strata-io.{}.dat", ::getpid())).string();
}

// Removes the temporary data file on every exit path (errors included).
struct RemoveOnExit {
  std::string path;
  bool active;
  ~RemoveOnExit() {
    std::error_code ignored;
    if (active) std::filesystem::remove(path, ignored);
  }
};

std::string fmt_bs(size_t bs) {
  if (bs % (1 << 20) == 0) return fmt::format("{}M", bs >> 20);
  if (bs % (1 << 10) == 0) return fmt::format("{}K", bs >> 10);
  return std::to_string(bs);
}

void print_header(bool fio) {
  std::printf("%-6s %-5s %6s %4s %7s %8s %10s %9s %9s %7s%s\n", "engine", "rw", "bs", "qd",
              "threads", "GB/s", "IOPS", "p50(us)", "p99(us)", "#wrong",
              fio ? "  fio GB/s  vs fio" : "");
}

void print_row(const sb::IoResult& r, bool fio) {
  std::string wrong = r.wrong ? std::to_string(*r.wrong) : "-";
  std::printf("%-6s %-5s %6s %4d %7d %8.3f %10.0f %9.1f %9.1f %7s",
              std::string(nvme::engine_kind_name(r.c.engine)).c_str(),
              r.c.rw == nvme::IoOp::kRead ? "read" : "write", fmt_bs(r.c.bs).c_str(), r.c.qd,
              r.c.threads, r.gbps_median, r.iops, r.lat_p50_us, r.lat_p99_us, wrong.c_str());
  if (fio) {
    std::printf("  %8.3f  %6.3f", r.fio_gbps_median,
                r.fio_gbps_median > 0 ? r.gbps_median / r.fio_gbps_median : 0.0);
  }
  std::printf("\n");
  std::fflush(stdout);
}

nlohmann::json to_json(const sb::IoResult& r, bool fio) {
  nlohmann::json j = {
      {"engine", nvme::engine_kind_name(r.c.engine)},
      {"rw", r.c.rw == nvme::IoOp::kRead ? "read" : "write"},
      {"bs", r.c.bs},
      {"qd", r.c.qd},
      {"threads", r.c.threads},
      {"size_bytes", r.size_nbytes},
      {"gbps", r.gbps_median},
      {"gbps_iters", r.gbps},
      {"iops", r.iops},
      {"lat_p50_us", r.lat_p50_us},
      {"lat_p99_us", r.lat_p99_us},
      {"wrong", r.wrong ? nlohmann::json(*r.wrong) : nlohmann::json(nullptr)},
  };
  if (fio) {
    j["fio_gbps"] = r.fio_gbps_median;
    j["fio_gbps_iters"] = r.fio_gbps;
    j["vs_fio"] = r.fio_gbps_median > 0 ? r.gbps_median / r.fio_gbps_median : 0.0;
  }
  return j;
}

int run_sweep(const Flags& f) {
  uint64_t size = strata::parse_size_or_throw(f.size, "--size");
  std::vector<nvme::IoOp> ops;
  for (const auto& rw : split_list(f.rw)) {
    if (rw == "write" || rw == "both") ops.push_back(nvme::IoOp::kWrite);
    if (rw == "read" || rw == "both") ops.push_back(nvme::IoOp::kRead);
    STRATA_CHECK(rw == "read" || rw == "write" || rw == "both", kBadArgument,
                 "--rw {}: accepted values are read, write, both", rw);
  }
  std::vector<size_t> bss;
  for (const auto& bs : split_list(f.bs)) bss.push_back(strata::parse_size_or_throw(bs, "--bs"));
  std::vector<nvme::EngineKind> engines;
  for (const auto& e : split_list(f.engine)) engines.push_back(nvme::parse_engine_kind(e));

  bool owned = false;
  std::string path = data_path(f.file, f.dir, &owned);
  RemoveOnExit remove_file{path, owned && !f.keep};
  sb::IoRunner runner(path, size, f.buffered);
  std::printf("# strata-io: file %s, size %s, %s, iters %d (median), warmup %d%s\n", path.c_str(),
              strata::format_size(size).c_str(), f.buffered ? "buffered" : "O_DIRECT", f.iters,
              f.warmup, f.vs_fio ? ", fio run before each timed pass (alternating)" : "");
  print_header(f.vs_fio);
  nlohmann::json rows = nlohmann::json::array();
  uint64_t total_wrong = 0;
  for (auto engine : engines) {
    for (size_t bs : bss) {
      for (int qd : f.qd) {
        for (int threads : f.threads) {
          for (auto op : ops) {
            sb::IoCase c{engine, op, bs, qd, threads};
            std::vector<double> fio;
            auto run_fio = [&](int) {
              fio.push_back(sb::run_fio(c, path, size, f.buffered));
              if (op == nvme::IoOp::kWrite) runner.invalidate_pattern();
            };
            sb::IoResult r = f.vs_fio ? runner.run(c, f.iters, f.warmup, f.check, run_fio)
                                      : runner.run(c, f.iters, f.warmup, f.check);
            r.fio_gbps = fio;
            r.fio_gbps_median = sb::median(fio);
            total_wrong += r.wrong.value_or(0);
            print_row(r, f.vs_fio);
            rows.push_back(to_json(r, f.vs_fio));
          }
        }
      }
    }
  }
  if (!f.json.empty()) {
    nlohmann::json doc = {{"tool", "strata-io"},   {"version", 1},        {"file", path},
                          {"size_bytes", size},     {"direct", !f.buffered}, {"iters", f.iters},
                          {"warmup", f.warmup},     {"results", rows}};
    if (f.json == "-") {
      std::cout << doc.dump(2) << "\n";
    } else {
      std::ofstream(f.json) << doc.dump(2) << "\n";
    }
  }
  if (total_wrong > 0) {
    std::fprintf(stderr, "strata-io: %llu blocks read back wrong\n",
                 static_cast<unsigned long long>(total_wrong));
    return 2;
  }
  return 0;
}

int run_tune(const Flags& f) {
  uint64_t size = strata::parse_size_or_throw(f.tune_size, "--size");
  nvme::EngineKind engine = nvme::parse_engine_kind(f.tune_engine);
  bool owned = false;
  std::string path = data_path("", f.tune_dir, &owned);
  RemoveOnExit remove_file{path, owned};
  sb::IoRunner runner(path, size, false);
  auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  std::printf("# strata-io tune: %s, %s per pass, budget %.0f s; score = harmonic mean of read "
              "and write GB/s\n",
              path.c_str(), strata::format_size(size).c_str(), f.tune_budget_s);
  std::printf("%6s %4s %7s %10s %10s %8s\n", "bs", "qd", "threads", "read GB/s", "write GB/s",
              "score");
  sb::IoCase best{engine, nvme::IoOp::kRead, 1 << 20, 8, 1};
  double best_score = -1;
  uint64_t wrong = 0;
  auto measure = [&](size_t bs, int qd, int threads) {
    if (elapsed() > f.tune_budget_s || size % bs != 0) return;
    sb::IoCase c{engine, nvme::IoOp::kWrite, bs, qd, threads};
    sb::IoResult w = runner.run(c, 2, 0, false);
    c.rw = nvme::IoOp::kRead;
    sb::IoResult r = runner.run(c, 2, 0, true);
    wrong += r.wrong.value_or(0);
    double score = 2.0 / (1.0 / r.gbps_median + 1.0 / w.gbps_median);
    std::printf("%6s %4d %7d %10.3f %10.3f %8.3f\n", fmt_bs(bs).c_str(), qd, threads,
                r.gbps_median, w.gbps_median, score);
    std::fflush(stdout);
    // Prefer the smaller configuration unless the bigger one is 2% better.
    if (score > best_score * 1.02) {
      best_score = score;
      best = {engine, nvme::IoOp::kRead, bs, qd, threads};
    }
  };
  // Coordinate search: block size, then queue depth, then threads.
  for (size_t bs : {128u << 10, 256u << 10, 512u << 10, 1u << 20, 2u << 20, 4u << 20}) {
    measure(bs, 8, 1);
  }
  for (int qd : {4, 16, 32, 64}) measure(best.bs, qd, 1);
  for (int threads : {2, 4}) measure(best.bs, best.qd, threads);
  std::printf("# best: bs %s, qd %d, threads %d (%.3f GB/s score) in %.1f s\n",
              fmt_bs(best.bs).c_str(), best.qd, best.threads, best_score, elapsed());
  std::printf("# paste into the config:\n");
  nlohmann::json block = {{"aio",
                           {{"block_size", best.bs},
                            {"queue_depth", best.qd},
                            {"thread_count", best.threads},
                            {"single_submit", false},
                            {"overlap_events", true}}},
                          {"strata", {{"io_engine", nvme::engine_kind_name(engine)}}}};
  std::printf("%s\n", block.dump(2).c_str());
  if (wrong > 0) {
    std::fprintf(stderr, "strata-io tune: %llu blocks read back wrong\n",
                 static_cast<unsigned long long>(wrong));
    return 2;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "strata-io: sequential bandwidth of strata's NVMe I/O engine (O_DIRECT by default).\n"
      "Each list flag (--rw, --bs, --qd, --threads, --engine) takes comma-separated values;\n"
      "every combination is one row. GB/s is the median of --iters timed passes over the\n"
      "whole file (1 GB = 1e9 bytes); IOPS = GB/s / bs; p50/p99 are per-bs-piece latencies\n"
      "over all timed passes; #wrong counts 4 KiB blocks read back with other content than\n"
      "written (-: --no-check). --vs-fio runs fio with the same file and parameters before\n"
      "each timed pass (alternating) and prints the ratio. See bench/PERFORMANCE.md."};
  app.add_option("--file", f.file, "Test file (created if missing; overwritten)");
  app.add_option("--dir", f.dir, "Directory for a temporary test file (removed at the end)");
  app.add_option("--size", f.size, "Bytes per pass, e.g. 4GiB (a multiple of every --bs)")
      ->capture_default_str();
  app.add_option("--rw", f.rw, "read | write | both")->delimiter(',')->capture_default_str();
  app.add_option("--bs", f.bs, "Block size(s), e.g. 1M,4M")->delimiter(',')->capture_default_str();
  app.add_option("--qd", f.qd, "Queue depth(s) per worker thread")->delimiter(',')->capture_default_str();
  app.add_option("--threads", f.threads, "Worker thread count(s)")->delimiter(',')->capture_default_str();
  app.add_option("--engine", f.engine, "uring | aio | psync")->delimiter(',')->capture_default_str();
  app.add_option("--iters", f.iters, "Timed passes per row")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--warmup", f.warmup, "Untimed passes before them")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_flag("--check,!--no-check", f.check, "Verify what is read is what was written (default on)");
  app.add_option("--json", f.json, "Write results as JSON to this path ('-' = stdout)");
  app.add_flag("--vs-fio", f.vs_fio, "Also run fio (same engine, file, bs, qd, threads) --iters times");
  app.add_flag("--buffered", f.buffered, "Use the page cache instead of O_DIRECT");
  app.add_flag("--keep", f.keep, "Keep the --dir test file");
  CLI::App* tune = app.add_subcommand(
      "tune", "Find block size, queue depth and thread count for the aio config block (< 1 min)");
  tune->add_option("--dir", f.tune_dir, "Directory on the drive to tune for")->required();
  tune->add_option("--size", f.tune_size, "Bytes per pass")->capture_default_str();
  tune->add_option("--engine", f.tune_engine, "uring | aio | psync")->capture_default_str();
  tune->add_option("--budget", f.tune_budget_s, "Seconds after which no new configuration starts")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    return tune->parsed() ? run_tune(f) : run_sweep(f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata-io: %s\n", e.what());
    return 1;
  }
}
