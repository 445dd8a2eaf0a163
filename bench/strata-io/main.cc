// strata-io: sequential NVMe bandwidth of strata's I/O engine, swept over block
// size, queue depth, thread count and engine, checked byte for byte, optionally
// side by side with fio (io_uring and libaio) and DeepSpeed's aio_handle in
// alternating rounds; `strata-io tune` picks the `aio` config block and the engine.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "bench/common/json_output.h"
#include "bench/strata-io/deepspeed_bench.h"
#include "bench/strata-io/io_bench.h"
#include "runtime/config/size.h"
#include "core/error.h"
#include "core/log.h"

namespace sb = strata::bench;
namespace nvme = strata::nvme;
using strata::ErrorCategory;

namespace {

std::string default_python() {
  const char* env = std::getenv("STRATA_PYTHON");
  return env != nullptr && *env != '\0' ? env : "python3";
}

struct Flags {
  std::string file, dir, size = "1GiB", json;
  std::vector<std::string> rw{"both"}, bs{"1M"}, engine{"uring"};
  std::vector<int> qd{32}, threads{1};
  int iters = 3, warmup = 1;
  bool check = true, vs_fio = false, vs_deepspeed = false, buffered = false, keep = false;
  bool auto_tune = false;
  std::string auto_tune_nbytes = "512MiB";
  std::string python = default_python();
  std::string ds_overlap = "on";
  // tune
  std::string tune_dir, tune_size = "256MiB", tune_engine = "auto";
  double tune_budget_s = 40;
};

std::vector<std::string> split_list(const std::vector<std::string>& items) {
  std::vector<std::string> out;
  for (const auto& item : items) {
    size_t start = 0;
    while (start <= item.size()) {
      size_t comma = item.find(',', start);
      std::string part =
          item.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (!part.empty()) out.push_back(part);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return out;
}

// --- flag validation: before any file is created, naming the flag ---------

// Throws Error(kBadArgument) with just the message (no source location: these
// are the user's mistakes, not the program's).
template <typename... Args>
void require(bool ok, fmt::format_string<Args...> format, Args&&... args) {
  if (!ok) strata::raise(ErrorCategory::kBadArgument, format, std::forward<Args>(args)...);
}

void check_bs(size_t bs, const std::string& text) {
  require(bs > 0 && bs % nvme::kDirectIoAlignment == 0 && bs <= nvme::kMaxBlockNbytes,
          "--bs {}: a block size must be a positive multiple of {} bytes and at most 1GiB", text,
          nvme::kDirectIoAlignment);
}

void check_qd(int qd) {
  require(qd >= 1 && qd <= nvme::kMaxQueueDepth, "--qd {}: a queue depth must be in [1, {}]", qd,
          nvme::kMaxQueueDepth);
}

void check_threads(int threads) {
  require(threads >= 1 && threads <= nvme::kMaxThreadCount,
          "--threads {}: a thread count must be in [1, {}]", threads, nvme::kMaxThreadCount);
}

struct Sweep {
  uint64_t size = 0;
  uint64_t auto_tune_nbytes = 0;
  std::vector<nvme::IoOp> ops;
  std::vector<size_t> bss;
  std::vector<nvme::EngineKind> engines;
};

Sweep validate_sweep(const Flags& f) {
  Sweep s;
  s.size = strata::parse_size_or_throw(f.size, "--size");
  require(s.size > 0 && s.size % nvme::kDirectIoAlignment == 0,
          "--size {}: must be a positive multiple of {} bytes", f.size, nvme::kDirectIoAlignment);
  for (const auto& rw : split_list(f.rw)) {
    require(rw == "read" || rw == "write" || rw == "both",
            "--rw {}: accepted values are read, write, both", rw);
    if (rw == "write" || rw == "both") s.ops.push_back(nvme::IoOp::kWrite);
    if (rw == "read" || rw == "both") s.ops.push_back(nvme::IoOp::kRead);
  }
  require(!s.ops.empty(), "--rw: give read, write or both");
  for (const auto& text : split_list(f.bs)) {
    const size_t bs = strata::parse_size_or_throw(text, "--bs");
    check_bs(bs, text);
    require(s.size % bs == 0, "--size {} must be a multiple of --bs {}", s.size, bs);
    s.bss.push_back(bs);
  }
  require(!s.bss.empty(), "--bs: give at least one block size");
  for (int qd : f.qd) check_qd(qd);
  for (int threads : f.threads) check_threads(threads);
  require(!f.qd.empty() && !f.threads.empty(), "--qd and --threads need a value");
  for (const auto& e : split_list(f.engine)) s.engines.push_back(nvme::parse_engine_kind(e));
  require(!s.engines.empty(), "--engine: give uring, aio or psync");
  s.auto_tune_nbytes = strata::parse_size_or_throw(f.auto_tune_nbytes, "--auto-tune-nbytes");
  require(s.auto_tune_nbytes > 0, "--auto-tune-nbytes {}: the tuner needs some traffic",
          f.auto_tune_nbytes);
  for (auto e : s.engines) {
    require(!f.auto_tune || e != nvme::EngineKind::kPsync,
            "--auto-tune with --engine psync: psync moves one piece at a time, so there is no "
            "queue depth to tune; use uring or aio");
  }
  require(f.ds_overlap == "on" || f.ds_overlap == "off",
          "--ds-overlap-events {}: accepted values are on, off", f.ds_overlap);
  return s;
}

// --- the temporary data file: removed on every exit path ------------------

// The signal handler's copy of the path (a handler can use nothing else).
char g_temp_path[4096];
volatile sig_atomic_t g_temp_armed = 0;

extern "C" void remove_temp_and_reraise(int sig) {
  if (g_temp_armed) ::unlink(g_temp_path);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Removes the temporary data file on return, exception, Ctrl-C, kill or crash.
class TempFile {
 public:
  TempFile(std::string path, bool active) : path_(std::move(path)), active_(active) {
    if (!active_ || path_.size() >= sizeof(g_temp_path)) return;
    std::memcpy(g_temp_path, path_.c_str(), path_.size() + 1);
    g_temp_armed = 1;
    struct sigaction sa {};
    sa.sa_handler = remove_temp_and_reraise;
    sigemptyset(&sa.sa_mask);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGFPE, SIGSEGV, SIGBUS, SIGABRT}) {
      ::sigaction(sig, &sa, nullptr);
    }
  }
  ~TempFile() {
    g_temp_armed = 0;
    std::error_code ignored;
    if (active_) std::filesystem::remove(path_, ignored);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

 private:
  std::string path_;
  bool active_;
};

// The test data path: --file as given, or <dir>/strata-io.<pid>.dat (temporary).
std::string data_path(const std::string& file, const std::string& dir, bool* owned) {
  if (!file.empty()) {
    *owned = false;
    return file;
  }
  require(!dir.empty(), "give --file PATH or --dir DIR");
  *owned = true;
  return (std::filesystem::path(dir) / fmt::format("strata-io.{}.dat", ::getpid())).string();
}

// --- output ---------------------------------------------------------------

std::string fmt_bs(size_t bs) {
  if (bs % (1 << 20) == 0) return fmt::format("{}M", bs >> 20);
  if (bs % (1 << 10) == 0) return fmt::format("{}K", bs >> 10);
  return std::to_string(bs);
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  in >> one;
  return one.empty() ? "?" : one;
}

const char* kFioUring = "fio-io_uring";
const char* kFioLibaio = "fio-libaio";
const char* kDeepSpeed = "deepspeed";

const sb::AnchorResult* find_anchor(const sb::IoResult& r, const std::string& name) {
  for (const auto& a : r.anchors) {
    if (a.name == name && !a.gbps.empty()) return &a;
  }
  return nullptr;
}

// The faster fio engine's median (0 when fio did not run).
double best_fio(const sb::IoResult& r) {
  double best = 0;
  for (const char* name : {kFioUring, kFioLibaio}) {
    if (const auto* a = find_anchor(r, name)) best = std::max(best, a->gbps_median);
  }
  return best;
}

double ratio(double a, double b) {
  return b > 0 ? a / b : 0.0;
}

void print_header(bool fio, bool ds) {
  std::printf("%-6s %-5s %6s %4s %7s %8s %10s %9s %9s %7s %8s", "engine", "rw", "bs", "qd",
              "threads", "GB/s", "IOPS", "p50(us)", "p99(us)", "#wrong", "req(KiB)");
  if (fio) std::printf(" %12s %10s %7s", "fio-io_uring", "fio-libaio", "vs fio");
  if (ds) std::printf(" %9s %7s", "deepspeed", "vs DS");
  std::printf("\n");
}

std::string fmt_opt(std::optional<double> v, const char* spec = "{:.0f}") {
  return v ? fmt::format(fmt::runtime(spec), *v) : std::string("-");
}

void print_row(const sb::IoResult& r, bool fio, bool ds) {
  std::string wrong = r.wrong ? std::to_string(*r.wrong) : "-";
  std::optional<double> req;
  if (!r.req_kib.empty()) req = sb::median(r.req_kib);
  std::printf("%-6s %-5s %6s %4d %7d %8.3f %10.0f %9.1f %9.1f %7s %8s",
              std::string(nvme::engine_kind_name(r.c.engine)).c_str(),
              r.c.rw == nvme::IoOp::kRead ? "read" : "write", fmt_bs(r.c.bs).c_str(), r.c.qd,
              r.c.threads, r.gbps_median, r.iops, r.lat_p50_us, r.lat_p99_us, wrong.c_str(),
              fmt_opt(req).c_str());
  auto gbps_of = [&](const char* name) {
    const auto* a = find_anchor(r, name);
    return a ? fmt::format("{:.3f}", a->gbps_median) : std::string("-");
  };
  if (fio) {
    const double best = best_fio(r);
    std::printf(" %12s %10s %7s", gbps_of(kFioUring).c_str(), gbps_of(kFioLibaio).c_str(),
                best > 0 ? fmt::format("{:.3f}", ratio(r.gbps_median, best)).c_str() : "-");
  }
  if (ds) {
    const auto* a = find_anchor(r, kDeepSpeed);
    std::printf(" %9s %7s", gbps_of(kDeepSpeed).c_str(),
                a ? fmt::format("{:.3f}", ratio(r.gbps_median, a->gbps_median)).c_str() : "-");
  }
  std::printf("\n");
  std::fflush(stdout);
}

// One line per round: every tool's GB/s and mean request size at the block layer.
void print_rounds(const sb::IoResult& r, const std::vector<std::string>& loads) {
  for (size_t i = 0; i < r.gbps.size(); ++i) {
    std::string line =
        fmt::format("    round {}: load {}", i + 1, i < loads.size() ? loads[i] : "?");
    for (const auto& a : r.anchors) {
      if (i < a.gbps.size()) {
        line += fmt::format(" | {} {:.3f}", a.name, a.gbps[i]);
        if (i < a.req_kib.size()) line += fmt::format(" ({:.0f} KiB/req)", a.req_kib[i]);
      }
    }
    line += fmt::format(" | strata {:.3f}", r.gbps[i]);
    if (i < r.req_kib.size()) line += fmt::format(" ({:.0f} KiB/req)", r.req_kib[i]);
    std::printf("%s\n", line.c_str());
  }
  for (const auto& a : r.anchors) {
    if (!a.error.empty()) std::printf("    %s: %s\n", a.name.c_str(), a.error.c_str());
  }
  std::fflush(stdout);
}

nlohmann::json to_json(const sb::IoResult& r, const std::vector<std::string>& loads) {
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
      {"req_kib_iters", r.req_kib},
      {"huge_page_share", r.huge_share ? nlohmann::json(*r.huge_share) : nlohmann::json(nullptr)},
  };
  if (!loads.empty()) j["load_iters"] = loads;
  if (r.tune) {
    nlohmann::json candidates = nlohmann::json::array();
    for (const auto& m : r.tune->candidates) {
      candidates.push_back({{"bs", m.setting.block_size},
                            {"qd", m.setting.queue_depth},
                            {"bytes", m.nbytes},
                            {"busy_s", m.busy_s},
                            {"gbps", m.gbps()}});
    }
    j["auto_tune"] = {{"chosen_bs", r.tune->chosen.block_size},
                      {"chosen_qd", r.tune->chosen.queue_depth},
                      {"tuning_gbps_passes", r.tuning_gbps},
                      {"candidates", candidates},
                      {"summary", r.tune->summary}};
  }
  if (!r.anchors.empty()) {
    nlohmann::json anchors = nlohmann::json::array();
    for (const auto& a : r.anchors) {
      anchors.push_back(
          {{"name", a.name},
           {"gbps", a.gbps_median},
           {"gbps_iters", a.gbps},
           {"req_kib_iters", a.req_kib},
           {"error", a.error.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.error)}});
    }
    j["anchors"] = anchors;
  }
  if (find_anchor(r, kFioUring) || find_anchor(r, kFioLibaio)) {
    const double best = best_fio(r);
    j["fio_gbps"] = best;
    j["vs_fio"] = ratio(r.gbps_median, best);
    // fio_gbps_iters: the faster engine's rounds.
    for (const char* name : {kFioUring, kFioLibaio}) {
      if (const auto* a = find_anchor(r, name); a && a->gbps_median == best)
        j["fio_gbps_iters"] = a->gbps;
    }
  }
  if (const auto* a = find_anchor(r, kDeepSpeed)) {
    j["deepspeed_gbps"] = a->gbps_median;
    j["vs_deepspeed"] = ratio(r.gbps_median, a->gbps_median);
  }
  return j;
}

// --- the sweep --------------------------------------------------------------

int run_sweep(const Flags& f) {
  const Sweep sweep = validate_sweep(f);  // before any file exists
  bool owned = false;
  std::string path = data_path(f.file, f.dir, &owned);
  TempFile temp(path, owned && !f.keep);

  std::unique_ptr<sb::DeepSpeedAio> ds;
  if (f.vs_deepspeed) {
    std::printf(
        "# --vs-deepspeed: starting DeepSpeed's aio op with Python '%s' (a first run may "
        "compile it)\n",
        f.python.c_str());
    std::fflush(stdout);
    ds = std::make_unique<sb::DeepSpeedAio>(f.python);
    if (ds->available()) {
      std::printf(
          "# --vs-deepspeed: %s; aio_handle(block_size=bs, queue_depth=qd, "
          "intra_op_parallelism=threads, single_submit=False, overlap_events=%s)\n",
          ds->versions().c_str(), f.ds_overlap == "on" ? "True" : "False");
    } else {
      std::printf(
          "# --vs-deepspeed: DeepSpeed is not available, its columns stay empty: %s\n"
          "#   (install deepspeed for that interpreter, or name another with --python PATH "
          "or STRATA_PYTHON)\n",
          ds->why().c_str());
    }
  }
  const bool ds_on = ds && ds->available();

  sb::IoRunner runner(path, sweep.size, f.buffered);
  std::printf(
      "# strata-io: file %s, size %s, %s, iters %d (median), warmup %d%s\n", path.c_str(),
      strata::format_size(sweep.size).c_str(), f.buffered ? "buffered" : "O_DIRECT", f.iters,
      f.warmup,
      f.vs_fio || ds_on ? ", other tools run before each timed pass (alternating rounds)" : "");
  if (runner.device()) {
    std::printf(
        "# block device %s: max request %s, max %llu segments; req(KiB) = mean request size "
        "there during the timed passes\n",
        runner.device()->name().c_str(),
        strata::format_size(runner.device()->max_request_nbytes()).c_str(),
        static_cast<unsigned long long>(runner.device()->max_segments()));
  } else {
    std::printf("# block device statistics not readable (%s): req(KiB) is '-'\n",
                runner.device_why().c_str());
  }
  print_header(f.vs_fio, ds_on);
  nlohmann::json rows = nlohmann::json::array();
  uint64_t total_wrong = 0;
  const bool rounds = f.vs_fio || ds_on;
  for (auto engine : sweep.engines) {
    for (size_t bs : sweep.bss) {
      for (int qd : f.qd) {
        for (int threads : f.threads) {
          for (auto op : sweep.ops) {
            sb::IoCase c{engine, op, bs, qd, threads, f.auto_tune, sweep.auto_tune_nbytes};
            std::vector<sb::AnchorResult> anchors;
            if (f.vs_fio) {
              anchors.push_back({kFioUring, {}, {}, 0, ""});
              anchors.push_back({kFioLibaio, {}, {}, 0, ""});
            }
            if (ds_on) anchors.push_back({kDeepSpeed, {}, {}, 0, ""});
            std::vector<std::string> loads;
            auto other_tools = [&](int round) {
              loads.push_back(load_average());
              for (auto& a : anchors) {
                if (!a.error.empty()) continue;  // failed once: not retried in this row
                const auto before = runner.counters();
                try {
                  double gbps;
                  if (a.name == kDeepSpeed) {
                    const uint64_t buffer = std::min<uint64_t>(sweep.size, uint64_t{1} << 30);
                    gbps = ds->pass(c, path, sweep.size, f.ds_overlap == "on", buffer,
                                    round == 0 ? f.warmup : 0);
                  } else {
                    gbps = sb::run_fio(c, a.name == kFioUring ? "io_uring" : "libaio", path,
                                       sweep.size, f.buffered);
                  }
                  a.gbps.push_back(gbps);
                  if (auto kib = sb::IoRunner::request_kib(before, runner.counters(), op)) {
                    a.req_kib.push_back(*kib);
                  }
                } catch (const std::exception& e) {
                  a.error = e.what();
                }
                // The other tool wrote its own bytes: the pattern must be rewritten before a read.
                if (op == nvme::IoOp::kWrite) runner.invalidate_pattern();
              }
            };
            sb::IoResult r = rounds ? runner.run(c, f.iters, f.warmup, f.check, other_tools)
                                    : runner.run(c, f.iters, f.warmup, f.check);
            for (auto& a : anchors) a.gbps_median = sb::median(a.gbps);
            r.anchors = anchors;
            total_wrong += r.wrong.value_or(0);
            print_row(r, f.vs_fio, ds_on);
            if (r.tune) {
              std::string passes;
              for (double g : r.tuning_gbps) passes += fmt::format(" {:.3f}", g);
              if (passes.empty()) passes = " none (settled within --warmup)";
              std::printf("    auto_tune: timed passes used bs %s qd %d; untimed tuning passes GB/s:%s\n    %s\n",
                          fmt_bs(r.tune->chosen.block_size).c_str(), r.tune->chosen.queue_depth,
                          passes.c_str(), r.tune->summary.c_str());
              std::fflush(stdout);
            }
            if (rounds) print_rounds(r, loads);
            rows.push_back(to_json(r, loads));
          }
        }
      }
    }
  }
  if (!f.json.empty()) {
    nlohmann::json doc = {{"tool", "strata-io"},      {"version", 2},          {"file", path},
                          {"size_bytes", sweep.size}, {"direct", !f.buffered}, {"iters", f.iters},
                          {"warmup", f.warmup},       {"results", rows}};
    if (runner.device()) doc["block_device"] = runner.device()->name();
    if (ds) {
      doc["deepspeed"] = ds->available() ? nlohmann::json(ds->versions()) : nlohmann::json(nullptr);
      if (!ds->available()) doc["deepspeed_unavailable"] = ds->why();
    }
    strata::bench::write_json_output(f.json, doc);
  }
  if (total_wrong > 0) {
    std::fprintf(stderr, "strata-io: %llu blocks read back wrong\n",
                 static_cast<unsigned long long>(total_wrong));
    return 2;
  }
  return 0;
}

// --- tune -------------------------------------------------------------------

int run_tune(const Flags& f) {
  const uint64_t size = strata::parse_size_or_throw(f.tune_size, "--size");
  require(size >= (uint64_t{1} << 20) && size % (uint64_t{1} << 20) == 0,
          "--size {}: tune needs a positive multiple of 1MiB", f.tune_size);
  const bool choose_engine = f.tune_engine == "auto";
  const nvme::EngineKind first =
      choose_engine ? nvme::EngineKind::kUring : nvme::parse_engine_kind(f.tune_engine);
  bool owned = false;
  std::string path = data_path("", f.tune_dir, &owned);
  TempFile temp(path, owned);
  sb::IoRunner runner(path, size, false);
  auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  std::printf(
      "# strata-io tune: %s, %s per pass, budget %.0f s; score = harmonic mean of read "
      "and write GB/s\n",
      path.c_str(), strata::format_size(size).c_str(), f.tune_budget_s);
  std::printf("%-6s %6s %4s %7s %10s %10s %8s\n", "engine", "bs", "qd", "threads", "read GB/s",
              "write GB/s", "score");
  uint64_t wrong = 0;
  auto score_of = [&](const sb::IoCase& base) {
    sb::IoCase c = base;
    c.rw = nvme::IoOp::kWrite;
    sb::IoResult w = runner.run(c, 2, 0, false);
    c.rw = nvme::IoOp::kRead;
    sb::IoResult r = runner.run(c, 2, 0, true);
    wrong += r.wrong.value_or(0);
    double score = 2.0 / (1.0 / r.gbps_median + 1.0 / w.gbps_median);
    std::printf("%-6s %6s %4d %7d %10.3f %10.3f %8.3f\n",
                std::string(nvme::engine_kind_name(c.engine)).c_str(), fmt_bs(c.bs).c_str(), c.qd,
                c.threads, r.gbps_median, w.gbps_median, score);
    std::fflush(stdout);
    return score;
  };
  sb::IoCase best{first, nvme::IoOp::kRead, 1 << 20, 8, 1};
  double best_score = -1;
  auto measure = [&](size_t bs, int qd, int threads) {
    if (elapsed() > f.tune_budget_s || size % bs != 0) return;
    sb::IoCase c{first, nvme::IoOp::kRead, bs, qd, threads};
    double score = score_of(c);
    // Prefer the smaller configuration unless the bigger one is 2% better.
    if (score > best_score * 1.02) {
      best_score = score;
      best = c;
    }
  };
  // Coordinate search: block size, then queue depth, then threads.
  for (size_t bs : {128u << 10, 256u << 10, 512u << 10, 1u << 20, 2u << 20, 4u << 20}) {
    measure(bs, 8, 1);
  }
  for (int qd : {4, 16, 32, 64}) measure(best.bs, qd, 1);
  for (int threads : {2, 4}) measure(best.bs, best.qd, threads);

  // The engine: io_uring and libaio alternately at the best configuration
  // (two rounds each, the median of the two scores), even past the budget.
  std::string engine_why;
  nvme::EngineKind engine = first;
  if (choose_engine) {
    std::vector<double> uring_scores, aio_scores;
    std::string aio_error;
    for (int round = 0; round < 2 && aio_error.empty(); ++round) {
      sb::IoCase c = best;
      c.engine = nvme::EngineKind::kAio;
      try {
        aio_scores.push_back(score_of(c));
      } catch (const strata::Error& e) {
        if (e.category() != ErrorCategory::kIo) throw;
        aio_error = e.what();
        break;
      }
      c.engine = nvme::EngineKind::kUring;
      uring_scores.push_back(score_of(c));
    }
    const double uring = sb::median(uring_scores), aio = sb::median(aio_scores);
    if (!aio_error.empty()) {
      engine = nvme::EngineKind::kUring;
      engine_why = fmt::format("libaio could not run here ({})", aio_error);
    } else if (aio > uring * 1.02) {
      engine = nvme::EngineKind::kAio;
      engine_why = fmt::format(
          "libaio scored {:.3f} GB/s vs {:.3f} for io_uring (+{:.1f}%, above the "
          "2% margin)",
          aio, uring, 100 * (aio / uring - 1));
    } else if (uring > aio * 1.02) {
      engine = nvme::EngineKind::kUring;
      engine_why = fmt::format("io_uring scored {:.3f} GB/s vs {:.3f} for libaio (+{:.1f}%)", uring,
                               aio, 100 * (uring / aio - 1));
    } else {
      engine = nvme::EngineKind::kUring;
      engine_why = fmt::format(
          "io_uring {:.3f} and libaio {:.3f} GB/s are within 2%: io_uring kept "
          "(one system call submits and reaps; registered buffers)",
          uring, aio);
    }
    best_score = engine == nvme::EngineKind::kAio ? aio : uring;
  } else {
    engine_why = fmt::format("given with --engine {}", f.tune_engine);
  }
  std::printf("# best: bs %s, qd %d, threads %d (%.3f GB/s score) in %.1f s\n",
              fmt_bs(best.bs).c_str(), best.qd, best.threads, best_score, elapsed());
  std::printf("# engine: %s — %s\n", std::string(nvme::engine_kind_name(engine)).c_str(),
              engine_why.c_str());
  std::printf("# paste into the config:\n");
  nlohmann::json block = {{"aio",
                           {{"engine", nvme::engine_kind_name(engine)},
                            {"block_size", best.bs},
                            {"queue_depth", best.qd},
                            {"thread_count", best.threads},
                            {"single_submit", false},
                            {"overlap_events", true}}}};
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
      "written (-: --no-check); req(KiB) is the mean request size at the file's block device.\n"
      "--vs-fio (fio with io_uring and with libaio) and --vs-deepspeed (DeepSpeed's\n"
      "aio_handle, through Python) run on the same file and parameters before each timed\n"
      "pass (alternating rounds); the ratios are strata / the faster fio and strata /\n"
      "DeepSpeed. --auto-tune times the handle after aio.auto_tune has chosen.\n"
      "See bench/strata-io/PERFORMANCE.md."};
  app.add_option("--file", f.file, "Test file (created if missing; overwritten)");
  app.add_option("--dir", f.dir, "Directory for a temporary test file (removed at the end)");
  app.add_option("--size", f.size, "Bytes per pass, e.g. 4GiB (a multiple of every --bs)")
      ->capture_default_str();
  app.add_option("--rw", f.rw, "read | write | both")->delimiter(',')->capture_default_str();
  app.add_option("--bs", f.bs, "Block size(s), e.g. 1M,4M")->delimiter(',')->capture_default_str();
  app.add_option("--qd", f.qd, "Queue depth(s) per worker thread")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--threads", f.threads, "Worker thread count(s)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--engine", f.engine, "uring | aio | psync")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--iters", f.iters, "Timed passes (rounds) per row")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", f.warmup, "Untimed passes before them")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--check,!--no-check", f.check,
               "Verify what is read is what was written (default on)");
  app.add_option("--json", f.json, "Write results as JSON to this path ('-' = stdout)");
  app.add_flag(
      "--vs-fio", f.vs_fio,
      "Also run fio with io_uring and with libaio (same file, bs, qd, threads) each round");
  app.add_flag("--vs-deepspeed", f.vs_deepspeed,
               "Also time DeepSpeed's aio_handle (same file, bs, qd, threads) each round; needs a "
               "Python that imports torch and deepspeed, else says so and runs the rest");
  app.add_option("--python", f.python,
                 "Python interpreter for --vs-deepspeed (default: $STRATA_PYTHON or python3)")
      ->capture_default_str();
  app.add_option("--ds-overlap-events", f.ds_overlap,
                 "DeepSpeed aio_handle overlap_events: on (the ZeRO-Infinity `aio` default) | off")
      ->capture_default_str();
  app.add_flag("--auto-tune", f.auto_tune,
               "aio.auto_tune: --bs/--qd are where tuning starts; untimed passes carry the "
               "tuning traffic until the tuner settles, the timed passes use its choice (shown "
               "below the row)");
  app.add_option("--auto-tune-nbytes", f.auto_tune_nbytes,
                 "With --auto-tune: traffic per direction the tuner spends on its candidates")
      ->capture_default_str();
  app.add_flag("--buffered", f.buffered, "Use the page cache instead of O_DIRECT");
  app.add_flag("--keep", f.keep, "Keep the --dir test file");
  CLI::App* tune = app.add_subcommand(
      "tune",
      "Find block size, queue depth, thread count and engine for the aio config block (< 1 min)");
  tune->add_option("--dir", f.tune_dir, "Directory on the drive to tune for")->required();
  tune->add_option("--size", f.tune_size, "Bytes per pass")->capture_default_str();
  tune->add_option("--engine", f.tune_engine,
                   "auto (measure io_uring and libaio, keep the faster) | uring | aio | psync")
      ->capture_default_str();
  tune->add_option("--budget", f.tune_budget_s, "Seconds after which no new configuration starts")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  ::signal(SIGPIPE, SIG_IGN);  // a dead coprocess must be an error, not a kill
  try {
    strata::bench::check_json_path(f.json);
    return tune->parsed() ? run_tune(f) : run_sweep(f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata-io: %s\n", e.what());
    return 1;
  }
}
