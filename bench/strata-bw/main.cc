// strata-bw: collective bandwidth (allgather, reduce-scatter, allreduce) over a
// size sweep, reported as nccl-tests does (algbw, busbw), with a correctness
// column; and pinned host<->device copy bandwidth where a GPU exists.
// Ranks are the processes of `strata run -n N -- strata-bw` (WORLD_SIZE set),
// or N threads of this process (--ranks N). See PERFORMANCE.md for the formulas.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

#include "bench/common/json_output.h"
#include "partition/communicator.h"
#include "partition/rendezvous.h"
#include "runtime/config/size.h"
#include "core/accelerator.h"
#include "core/error.h"

namespace {
using namespace strata;
using namespace strata::partition;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// Ranks as threads of one process: each holds a socket to every other.
constexpr int kMaxThreadRanks = 64;

struct Options {
  std::string ops = "allgather,reduce_scatter,allreduce";
  std::string min_size = "1KiB", max_size = "64MiB";
  double factor = 4;
  int iters = 20, warmup = 3;
  int ranks = 2;
  std::string accelerator = "cpu";
  std::string dtype = "fp32";
  int timeout_ms = 60'000;
  bool copies = true;
  std::string json_path;
};

struct Row {
  std::string op;
  size_t size_bytes = 0, count = 0;
  double time_us = 0, algbw = 0, busbw = 0;
  bool correct = false;
};

struct CopyRow {
  std::string direction;
  size_t size_bytes = 0;
  double time_us = 0, bandwidth = 0;
  bool correct = false;
};

// Integer-valued input (exact in every dtype's sums for <= 16 ranks).
float value(int rank, size_t i) { return static_cast<float>((rank + 1) + static_cast<int>(i % 7)); }

void fill_host(std::vector<char>& host, DType dtype, int rank, size_t numel, size_t offset = 0) {
  std::vector<float> f(numel);
  for (size_t i = 0; i < numel; ++i) f[i] = value(rank, offset + i);
  host.resize(numel * dtype_nbytes(dtype));
  convert(f.data(), DType::kF32, host.data(), dtype, numel);
}

std::vector<float> to_float(const std::vector<char>& host, DType dtype) {
  size_t numel = host.size() / dtype_nbytes(dtype);
  std::vector<float> f(numel);
  convert(host.data(), dtype, f.data(), DType::kF32, numel);
  return f;
}

// One rank's part of the sweep. Rank 0 returns the rows; timings are the
// maximum over ranks (the slowest rank bounds a collective).
std::vector<Row> run_collectives(const Options& options, Communicator& comm, Accelerator& accelerator, Stream& stream) {
  DType dtype = parse_dtype(options.dtype);
  size_t element_nbytes = dtype_nbytes(dtype);
  int world = comm.world_size(), me = comm.rank();
  size_t min_nbytes = parse_size_or_throw(options.min_size, "--min-bytes");
  size_t max_nbytes = parse_size_or_throw(options.max_size, "--max-bytes");
  std::vector<std::string> ops;
  std::stringstream list(options.ops);
  for (std::string op; std::getline(list, op, ',');) {
    STRATA_CHECK(op == "allgather" || op == "reduce_scatter" || op == "allreduce", kBadArgument,
                 "--ops: unknown collective '{}' (allgather, reduce_scatter, allreduce)", op);
    ops.push_back(op);
  }
  void* scalar_in = accelerator.allocate(sizeof(float) * 1);
  void* scalar_out = accelerator.allocate(sizeof(float) * static_cast<size_t>(world));
  auto max_over_ranks = [&](float local) {
    accelerator.copy_async(scalar_in, &local, sizeof(float), CopyKind::kHostToDevice, stream);
    comm.allgather(scalar_in, scalar_out, 1, DType::kF32, stream)->synchronize();
    std::vector<float> all(static_cast<size_t>(world));
    accelerator.copy_async(all.data(), scalar_out, all.size() * sizeof(float), CopyKind::kDeviceToHost, stream);
    stream.synchronize();
    return *std::max_element(all.begin(), all.end());
  };

  std::vector<Row> rows;
  for (const std::string& op : ops) {
    for (double size = static_cast<double>(min_nbytes); size <= static_cast<double>(max_nbytes); size *= options.factor) {
      // nccl-tests convention: `size` is the full buffer (allgather output,
      // reduce-scatter input, allreduce buffer); count is its elements.
      size_t count = std::max<size_t>(static_cast<size_t>(size) / element_nbytes / world * world, world);
      size_t per_rank = count / world;
      size_t in_numel = op == "allgather" ? per_rank : count;
      size_t out_numel = op == "reduce_scatter" ? per_rank : count;
      void* in = accelerator.allocate(in_numel * element_nbytes);
      void* out = accelerator.allocate(out_numel * element_nbytes);
      std::vector<char> host;
      fill_host(host, dtype, me, in_numel);
      accelerator.copy_async(in, host.data(), host.size(), CopyKind::kHostToDevice, stream);
      auto issue = [&] {
        if (op == "allgather") return comm.allgather(in, out, per_rank, dtype, stream);
        if (op == "reduce_scatter") return comm.reduce_scatter(in, out, per_rank, dtype, ReduceOp::kSum, stream);
        return comm.allreduce(in, out, count, dtype, ReduceOp::kSum, stream);
      };
      // Correctness first, on the untouched input.
      issue()->synchronize();
      std::vector<char> result(out_numel * element_nbytes);
      accelerator.copy_async(result.data(), out, result.size(), CopyKind::kDeviceToHost, stream);
      stream.synchronize();
      std::vector<float> got = to_float(result, dtype);
      size_t wrong = 0;
      for (size_t i = 0; i < out_numel; ++i) {
        float want = 0;
        if (op == "allgather") {
          want = value(static_cast<int>(i / per_rank), i % per_rank);
        } else {
          size_t index = op == "reduce_scatter" ? me * per_rank + i : i;
          for (int r = 0; r < world; ++r) want += value(r, index);
        }
        wrong += got[i] != want;
      }
      for (int i = 0; i < options.warmup; ++i) issue()->synchronize();
      comm.barrier(stream)->synchronize();
      auto start = Clock::now();
      std::unique_ptr<Event> last;
      for (int i = 0; i < options.iters; ++i) last = issue();
      last->synchronize();
      double seconds = std::chrono::duration<double>(Clock::now() - start).count() / options.iters;
      float slowest = max_over_ranks(static_cast<float>(seconds));
      float any_wrong = max_over_ranks(static_cast<float>(wrong));
      accelerator.deallocate(in);
      accelerator.deallocate(out);
      Row row;
      row.op = op;
      row.count = count;
      row.size_bytes = count * element_nbytes;
      row.time_us = slowest * 1e6;
      row.algbw = static_cast<double>(row.size_bytes) / slowest / 1e9;
      double factor = op == "allreduce" ? 2.0 * (world - 1) / world : static_cast<double>(world - 1) / world;
      row.busbw = row.algbw * factor;
      row.correct = any_wrong == 0;
      rows.push_back(row);
      if (me == 0) {
        std::printf("%16s %14zu %12zu %12.1f %12.3f %12.3f %8s\n", row.op.c_str(), row.size_bytes, row.count,
                    row.time_us, row.algbw, row.busbw, row.correct ? "ok" : "WRONG");
        std::fflush(stdout);
      }
    }
  }
  accelerator.deallocate(scalar_in);
  accelerator.deallocate(scalar_out);
  return rows;
}

// Pinned host <-> device copies on GPU `device`, checked by a round trip.
std::vector<CopyRow> run_copies(const Options& options, int device) {
  auto accelerator = make_cuda_accelerator(device);
  auto stream = accelerator->create_stream();
  size_t min_nbytes = parse_size_or_throw(options.min_size, "--min-bytes");
  size_t max_nbytes = parse_size_or_throw(options.max_size, "--max-bytes");
  std::vector<CopyRow> rows;
  for (double size = static_cast<double>(min_nbytes); size <= static_cast<double>(max_nbytes); size *= options.factor) {
    size_t nbytes = static_cast<size_t>(size);
    auto* host = static_cast<unsigned char*>(accelerator->allocate_pinned(nbytes));
    auto* back = static_cast<unsigned char*>(accelerator->allocate_pinned(nbytes));
    void* dev = accelerator->allocate(nbytes);
    for (size_t i = 0; i < nbytes; ++i) host[i] = static_cast<unsigned char>(i * 31 + 7);
    std::memset(back, 0, nbytes);
    for (CopyKind kind : {CopyKind::kHostToDevice, CopyKind::kDeviceToHost}) {
      bool h2d = kind == CopyKind::kHostToDevice;
      auto copy = [&] {
        if (h2d) accelerator->copy_async(dev, host, nbytes, kind, *stream);
        else accelerator->copy_async(back, dev, nbytes, kind, *stream);
      };
      for (int i = 0; i < options.warmup + 1; ++i) copy();
      stream->synchronize();
      auto start = Clock::now();
      for (int i = 0; i < options.iters; ++i) copy();
      stream->synchronize();
      double seconds = std::chrono::duration<double>(Clock::now() - start).count() / options.iters;
      CopyRow row{h2d ? "h2d" : "d2h", nbytes, seconds * 1e6, static_cast<double>(nbytes) / seconds / 1e9,
                  h2d || std::memcmp(host, back, nbytes) == 0};
      rows.push_back(row);
    }
    rows[rows.size() - 2].correct = rows.back().correct;  // the round trip checks both directions
    for (size_t i = rows.size() - 2; i < rows.size(); ++i) {
      std::printf("%16s %14zu %12s %12.1f %12.3f %12s %8s\n", rows[i].direction.c_str(), rows[i].size_bytes, "-",
                  rows[i].time_us, rows[i].bandwidth, "-", rows[i].correct ? "ok" : "WRONG");
    }
    accelerator->deallocate(dev);
    accelerator->deallocate_pinned(host);
    accelerator->deallocate_pinned(back);
  }
  return rows;
}

// Every flag checked before any rank starts: a sweep that would never end
// (--min-bytes 0, --factor nan), be empty (--min-bytes above --max-bytes) or
// start more threads than a process can (--ranks 100000) is refused, naming it.
void validate(const Options& options) {
  if (!std::isfinite(options.factor) || options.factor < 1.01 || options.factor > 1024) {
    raise(ErrorCategory::kBadArgument, "--factor {} must be a number in [1.01, 1024] (the size multiplier between rows)",
          options.factor);
  }
  const size_t min_nbytes = parse_size_or_throw(options.min_size, "--min-bytes");
  const size_t max_nbytes = parse_size_or_throw(options.max_size, "--max-bytes");
  if (min_nbytes < 1) raise(ErrorCategory::kBadArgument, "--min-bytes must be at least 1 byte, got {}", options.min_size);
  if (min_nbytes > max_nbytes) {
    raise(ErrorCategory::kBadArgument, "--min-bytes {} is above --max-bytes {}: the sweep would be empty",
          options.min_size, options.max_size);
  }
  if (options.ranks < 1 || options.ranks > kMaxThreadRanks) {
    raise(ErrorCategory::kBadArgument,
          "--ranks {} must be in [1, {}] (ranks as threads of this process; more: `strata run -n N -- strata-bw`)",
          options.ranks, kMaxThreadRanks);
  }
  if (options.timeout_ms < 1) raise(ErrorCategory::kBadArgument, "--timeout-ms must be >= 1, got {}", options.timeout_ms);
  (void)parse_dtype(options.dtype);
  strata::bench::check_json_path(options.json_path);
}

int run(const Options& options) {
  validate(options);
  bool processes = std::getenv("WORLD_SIZE") != nullptr || std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  RankInfo info = processes ? RankInfo::from_env() : RankInfo{};
  int world = processes ? info.world_size : options.ranks;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (!processes && world > cores) {
    std::fprintf(stderr,
                 "strata-bw: note: %d ranks as threads on %d CPU cores share them: the times include waiting for a "
                 "core, not only the transport\n",
                 world, cores);
  }
  std::chrono::milliseconds timeout(options.timeout_ms);
  bool header = !processes || info.rank == 0;
  std::string backend_label;
  std::vector<Row> rows;
  std::mutex rows_mutex;

  auto rank_body = [&](int rank, StoreClient& store, int local_rank) {
    auto accelerator = options.accelerator == "cpu" ? make_cpu_accelerator()
                                                    : make_cuda_accelerator(local_rank);
    auto stream = accelerator->create_stream();
    CommunicatorOptions comm_options;
    comm_options.rank = rank;
    comm_options.world_size = world;
    comm_options.timeout = timeout;
    comm_options.prefix = "strata-bw";
    auto comm = make_communicator(*accelerator, store, comm_options);
    if (rank == 0) {
      std::printf("# strata-bw: backend %s, %d ranks (%s), dtype %s, iters %d, warmup %d\n",
                  std::string(comm->backend()).c_str(), world, processes ? "processes" : "threads",
                  options.dtype.c_str(), options.iters, options.warmup);
      std::printf("# %14s %14s %12s %12s %12s %12s %8s\n", "op", "size(B)", "count", "time(us)", "algbw(GB/s)",
                  "busbw(GB/s)", "correct");
      std::fflush(stdout);
    }
    auto mine = run_collectives(options, *comm, *accelerator, *stream);
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(rows_mutex);
      rows = std::move(mine);
      backend_label = comm->backend();
    }
  };

  if (processes) {
    Rendezvous rendezvous(info, timeout);
    rank_body(info.rank, rendezvous.store(), info.local_rank);
  } else {
    StoreServer server("127.0.0.1", 0);
    std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
    std::vector<std::thread> threads;
    for (int rank = 0; rank < world; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          StoreClient store("127.0.0.1", server.port(), rank, timeout);
          rank_body(rank, store, rank);
        } catch (...) {
          errors[static_cast<size_t>(rank)] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }

  std::vector<CopyRow> copies;
  if (header && options.copies && cuda_device_count() > 0) {
    std::printf("# pinned host<->device copies on cuda:%d\n# %14s %14s %12s %12s %12s %12s %8s\n", info.local_rank,
                "direction", "size(B)", "", "time(us)", "GB/s", "", "correct");
    copies = run_copies(options, info.local_rank);
  } else if (header && options.copies) {
    std::printf("# pinned host<->device copies: skipped (no CUDA device)\n");
  }

  bool all_correct = true;
  for (const auto& r : rows) all_correct &= r.correct;
  for (const auto& c : copies) all_correct &= c.correct;
  if (header && !options.json_path.empty()) {
    json doc;
    doc["tool"] = "strata-bw";
    doc["backend"] = backend_label;
    doc["world_size"] = world;
    doc["mode"] = processes ? "processes" : "threads";
    doc["dtype"] = options.dtype;
    doc["iters"] = options.iters;
    doc["warmup"] = options.warmup;
    doc["collectives"] = json::array();
    for (const auto& r : rows) {
      doc["collectives"].push_back({{"op", r.op}, {"size_bytes", r.size_bytes}, {"count", r.count},
                                    {"time_us", r.time_us}, {"algbw_gbps", r.algbw}, {"busbw_gbps", r.busbw},
                                    {"correct", r.correct}});
    }
    doc["copies"] = json::array();
    for (const auto& c : copies) {
      doc["copies"].push_back({{"direction", c.direction}, {"size_bytes", c.size_bytes}, {"time_us", c.time_us},
                               {"bandwidth_gbps", c.bandwidth}, {"correct", c.correct}});
    }
    doc["all_correct"] = all_correct;
    strata::bench::write_json_output(options.json_path, doc);
  }
  if (header) std::printf("# %s\n", all_correct ? "all results correct" : "SOME RESULTS WRONG");
  return all_correct ? 0 : 1;
}
}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{
      "strata-bw: collective and host<->device copy bandwidth.\n"
      "Ranks: `strata run -n N -- strata-bw ...` (one process per rank), or N threads with --ranks N.\n"
      "size = bytes of the full buffer (allgather output, reduce-scatter input, allreduce buffer);\n"
      "time = slowest rank's mean time per op over --iters back-to-back ops; algbw = size / time;\n"
      "busbw = algbw * (n-1)/n (allgather, reduce_scatter) or algbw * 2(n-1)/n (allreduce).\n"
      "correct: one op on integer-valued data compared for equality on every rank. Exit 1 if any is wrong.",
      "strata-bw"};
  app.add_option("--ops", options.ops, "Comma-separated collectives: allgather,reduce_scatter,allreduce")
      ->capture_default_str();
  app.add_option("--min-bytes", options.min_size, "Smallest size (e.g. 1KiB)")->capture_default_str();
  app.add_option("--max-bytes", options.max_size, "Largest size (e.g. 64MiB)")->capture_default_str();
  app.add_option("--factor", options.factor, "Size multiplier between steps")->capture_default_str();
  app.add_option("--iters", options.iters, "Timed iterations per size")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--warmup", options.warmup, "Untimed iterations per size")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--ranks", options.ranks, "Ranks as threads when not started by strata run")->capture_default_str();
  app.add_option("--accelerator", options.accelerator, "cpu (Gloo) or cuda (NCCL)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", options.dtype, "fp32, fp16 or bf16")->capture_default_str();
  app.add_option("--timeout-ms", options.timeout_ms, "Communicator timeout")->capture_default_str();
  app.add_flag("!--no-copies", options.copies, "Skip the pinned host<->device copy sweep");
  app.add_option("--json", options.json_path, "Write results as JSON to this file ('-' for stdout)");
  try {
    app.parse(argc, argv);
    return run(options);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const strata::Error& e) {
    std::fprintf(stderr, "strata-bw: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    // Not a strata::Error (a thread the system refused): still a message and an exit code, never an abort.
    std::fprintf(stderr, "strata-bw: %s\n", e.what());
    return 2;
  }
}
