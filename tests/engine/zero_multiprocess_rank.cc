// The rank program of the multi-process ZeRO-3 tests (zero_multiprocess_test.cc),
// one process per rank under `strata run`: joins the rendezvous from the
// launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), builds
// its communicators as `strata finetune` does (train::make_zero_communicators),
// trains the thread tests' tiny Llama with ZeRO-3 (zero_multiprocess.h: params
// on NVMe, prefetch, TiledLinear) on its share of each step's batch, and
// writes OUT/rank<R>.txt (format in zero_multiprocess.h).
//
//   engine_zero_rank --out DIR --nvme DIR [--steps N] [--timeout-ms MS]
//                    [--kill-rank R --kill-after-step S]
//
// --kill-rank: rank R SIGKILLs itself at its second NVMe read after step S
// (0-based) has finished, i.e. inside the coordinator's fetch of the first
// operators of the next step's forward: the read feeds an allgather its peers
// are about to wait in. ZeroEngine is final, so the hook is its I/O backend
// factory (ZeroEngineOptions::io_backend), reached without touching the engine.
//
// Exit codes: 0 trained and wrote the file, 2 bad arguments, 3 an error was
// raised (printed as "zero rank program failed: <what>").
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <span>
#include <string>

#include "kernels/ops.h"
#include "nvme/io_backend.h"
#include "partition/rendezvous.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/train/zero_config.h"
#include "tests/engine/zero_multiprocess.h"
#include "tests/nvme/hooked_backend.h"
#include "tests/engine/zero_training.h"

namespace {
using namespace strata;
namespace zero = strata::test::zero;
namespace zero_mp = strata::test::zero_mp;

struct Args {
  std::filesystem::path out, nvme;
  int steps = zero_mp::kSteps;
  int timeout_ms = 30000;
  int kill_rank = -1, kill_after_step = -1;
};

// Set by the training thread once the victim's trigger step has finished;
// read by whichever thread prepares NVMe reads.
std::atomic<bool> armed{false};
std::atomic<int> reads_since_armed{0};
constexpr int kKillAtRead = 2;  // the second read: the first operator's fetch has begun

// Kills the process when the kKillAtRead-th read after arming is prepared
// (every piece still goes to the real backend).
void kill_at_read(const nvme::IoPiece& piece) {
  if (piece.op == nvme::IoOp::kRead && armed.load() && reads_since_armed.fetch_add(1) + 1 == kKillAtRead) {
    std::fprintf(stderr, "zero rank program: killing myself (SIGKILL) at an NVMe read of the next step\n");
    std::fflush(stderr);
    ::raise(SIGKILL);
  }
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    STRATA_CHECK(i + 1 < argc, kBadArgument, "{} needs a value", flag);
    const std::string value = argv[++i];
    if (flag == "--out") {
      a.out = value;
    } else if (flag == "--nvme") {
      a.nvme = value;
    } else if (flag == "--steps") {
      a.steps = std::stoi(value);
    } else if (flag == "--timeout-ms") {
      a.timeout_ms = std::stoi(value);
    } else if (flag == "--kill-rank") {
      a.kill_rank = std::stoi(value);
    } else if (flag == "--kill-after-step") {
      a.kill_after_step = std::stoi(value);
    } else {
      strata::raise(ErrorCategory::kBadArgument, "unknown flag {}", flag);
    }
  }
  STRATA_CHECK(!a.out.empty() && !a.nvme.empty(), kBadArgument, "--out and --nvme are required");
  STRATA_CHECK(a.steps >= 1 && a.timeout_ms >= 1, kBadArgument, "--steps and --timeout-ms must be >= 1");
  return a;
}

int run(const Args& args) {
  const partition::RankInfo info = partition::RankInfo::from_env();
  STRATA_CHECK(zero::kSequences % info.world_size == 0, kBadArgument, "world size {} does not divide the {} sequences",
               info.world_size, zero::kSequences);
  ops::set_cpu_threads(1);  // 4 ranks on 2 cores; the kernels give the same bits with any thread count
  const std::chrono::milliseconds timeout(args.timeout_ms);
  partition::Rendezvous rendezvous(info, timeout);
  auto accelerator = make_cpu_accelerator();
  const train::ZeroCommunicators comms = train::make_zero_communicators(
      *accelerator, rendezvous.store(), info.rank, info.world_size, timeout, "test/zero_multiprocess");

  engine::ZeroEngineOptions options = zero_mp::engine_options(args.nvme);
  const bool victim = info.rank == args.kill_rank;
  if (victim) {
    options.io_backend = [engine = options.aio.engine] {
      return std::make_unique<test::HookedBackend>(nvme::make_backend(engine), kill_at_read);
    };
  }
  engine::ZeroEngine eng(*accelerator, comms.comms(), options);
  const nn::DecoderConfig config = zero::model_config(zero_mp::kTied);
  nn::DecoderModel model(eng, config, zero_mp::model_options());
  eng.finalize();
  nn::initialize_parameters(eng, model.parameters(), zero_mp::kInitSeed);

  // This rank's rows of each step's global batch: the combined batch over
  // ranks is the one-rank batch (as zero::train_zero splits it).
  const int64_t per_rank = zero::kSequences / info.world_size;
  const auto first = static_cast<size_t>(info.rank * per_rank * zero::kSeq);
  const auto count = static_cast<size_t>(per_rank * zero::kSeq);
  zero_mp::RankOutput out;
  out.rank = info.rank;
  out.world = info.world_size;
  for (int step = 0; step < args.steps; ++step) {
    const zero::Batch batch = zero::corpus(step, config.vocab_size);
    const auto ids = std::span<const int32_t>(batch.ids).subspan(first, count);
    const auto targets = std::span<const int32_t>(batch.targets).subspan(first, count);
    // The loss is normalised by the global count of predicted tokens, so the
    // summed gradients are those of the combined batch's mean loss.
    const double global_count = eng.global_sum(zero::counted(targets));
    nn::ForwardOptions forward;
    forward.normalizer = global_count;
    model.forward(ids, targets, per_rank, zero::kSeq, forward);
    model.backward();
    const double loss = eng.global_sum(model.loss_stats().sum) / global_count;
    eng.step(zero::kLr);
    const engine::PrefetchStats p = eng.last_step_prefetch();
    out.steps.push_back({loss, p.prefetched(), p.fetches(), p.trace_followed});
    std::printf("zero rank program: step %d done, loss %.9f; %lld windows, fetches: %lld prefetched, %lld on demand, "
                "%lld reused; trace %s; %lld NVMe reads (%lld ahead)\n",
                step, loss, static_cast<long long>(p.windows), static_cast<long long>(p.prefetched()),
                static_cast<long long>(p.on_demand), static_cast<long long>(p.reused),
                p.trace_followed ? "followed" : p.trace_dropped ? "dropped" : "recorded",
                static_cast<long long>(p.reads), static_cast<long long>(p.reads_ahead));
    std::fflush(stdout);
    if (victim && step == args.kill_after_step) {
      std::printf("zero rank program: armed, dying at an NVMe read of step %d\n", step + 1);
      std::fflush(stdout);
      armed = true;
    }
  }
  out.nvme_read = eng.nvme_bytes_read();
  for (engine::ParamId id = 0; id < eng.parameter_count(); ++id) {
    out.params.emplace_back(eng.param_info(id).name, eng.param_info(id).numel());
  }
  for (engine::ParamId id = 0; id < eng.parameter_count(); ++id) {
    eng.for_each_owned_range(id, engine::Engine::Access::kRead, [&](int64_t at, const TensorView& host) {
      out.ranges.push_back({id, at, std::vector<float>(host.as<float>(), host.as<float>() + host.numel())});
    });
  }
  std::filesystem::create_directories(args.out);
  zero_mp::write_output(args.out / ("rank" + std::to_string(info.rank) + ".txt"), out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero rank program: %s\n", e.what());
    return 2;
  }
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero rank program failed: %s\n", e.what());
    return 3;
  }
}
