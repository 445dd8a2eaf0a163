// `strata run` given values a hostile or careless user gives: limits on the
// rank count, rank arithmetic that must not overflow, and grace periods too
// long for the clock, each checked against the behaviour that was wrong.
#include "runtime/launcher/launcher.h"

#include "core/accelerator.h"

#include <catch2/catch.hpp>
#include <algorithm>
#include <string>
#include <thread>

#include "core/error.h"
#include "tests/support/finetune_files.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"

using strata::test::run_command;
using strata::test::strata_binary;

namespace {
std::string strata_run(const std::string& args) {
  return "timeout -k 5 60 " + strata_binary() + " run " + args + " 2>&1";
}
}  // namespace

TEST_CASE("launch: the rank count is bounded before anything is started", "[launcher][issue16]") {
  // -n had no upper bound: it forked until pipe2 hit EMFILE.
  strata::launcher::LaunchOptions options;
  options.command = {"true"};
  options.nproc_per_node = strata::launcher::kMaxLocalRanks + 1;
  REQUIRE_THROWS_WITH(strata::launcher::launch(options),
                      Catch::Contains("-n (ranks on this node) must be in [1, 1024]"));
  options.nproc_per_node = 0;
  REQUIRE_THROWS_WITH(strata::launcher::launch(options), Catch::Contains("got 0"));

  auto result = run_command(strata_run("-n 1025 -- true"));
  REQUIRE(result.exit_code != 0);
  REQUIRE_THAT(result.output, Catch::Contains("[1, 1024]"));
}

TEST_CASE("launch: an open-file limit too low for -n is said up front", "[launcher][issue16]") {
  // It failed halfway with "pipe for rank output: Too many open files".
  const auto result =
      run_command("sh -c 'ulimit -n 64 && exec " + strata_run("-n 100 -- true") + "'");
  REQUIRE(result.exit_code == 1);
  REQUIRE_THAT(result.output, Catch::Contains("-n 100 needs about 232 open files") &&
                                  Catch::Contains("ulimit -n"));
}

TEST_CASE("launch: nnodes x nproc and global ranks do not overflow int", "[launcher][issue16]") {
  // 1.5e9 nodes x 2 ranks: WORLD_SIZE used to wrap to -1294967296.
  strata::launcher::LaunchOptions options;
  options.command = {"true"};
  options.nproc_per_node = 2;
  options.nnodes = 1500000000;
  REQUIRE_THROWS_WITH(strata::launcher::launch(options),
                      Catch::Contains("3000000000 ranks") && Catch::Contains("32-bit int"));
  auto result = run_command(strata_run("--nnodes 1500000000 -n 2 -- sh -c 'echo W=$WORLD_SIZE'"));
  REQUIRE(result.exit_code == 1);
  REQUIRE_THAT(result.output, Catch::Contains("32-bit int") && !Catch::Contains("W="));
  // The largest job that fits: the last node's ranks are exact.
  result = run_command(strata_run(
      "--nnodes 1073741823 -n 2 --node-rank 1073741822 -- sh -c 'echo R=$RANK W=$WORLD_SIZE'"));
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  REQUIRE_THAT(result.output, Catch::Contains("R=2147483644 W=2147483646") &&
                                  Catch::Contains("R=2147483645 W=2147483646"));
}

TEST_CASE("strata run: the local ranks share the cores' OpenMP threads unless OMP_NUM_THREADS is given",
          "[launcher]") {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto result = run_command("env -u OMP_NUM_THREADS " + strata_run("-n 2 -- sh -c 'echo T=$OMP_NUM_THREADS'"));
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  CHECK_THAT(result.output, Catch::Contains("T=" + std::to_string(std::max(1, cores / 2))));
  result = run_command("env OMP_NUM_THREADS=3 " + strata_run("-n 2 -- sh -c 'echo T=$OMP_NUM_THREADS'"));
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  CHECK_THAT(result.output, Catch::Contains("T=3") && !Catch::Contains("T=1\n"));
}

TEST_CASE("strata run: a failure grace too long for the clock means wait, not kill at once",
          "[launcher][issue16]") {
  // 1e10 s overflowed the nanosecond cast: the survivor was killed after ~0.1 s.
  for (const char* grace : {"1e10", "inf"}) {
    INFO("--failure-grace " << grace);
    const auto result = run_command(
        strata_run(std::string("-n 2 --failure-grace ") + grace +
                   " -- sh -c 'if [ $RANK = 0 ]; then exit 5; fi; sleep 1; echo survived'"));
    INFO(result.output);
    REQUIRE(result.exit_code == 5);
    REQUIRE_THAT(result.output,
                 Catch::Contains("[rank 1] survived") && !Catch::Contains("stopped by strata run"));
    // It says what it will do: for inf, not "stopping the other ranks".
    if (std::string(grace) == "inf") {
      REQUIRE_THAT(result.output, Catch::Contains("may finish on their own") && !Catch::Contains("stopping"));
    } else {
      REQUIRE_THAT(result.output, Catch::Contains("stopping the other ranks in 1e+10 s unless they end first"));
    }
  }
}

TEST_CASE("strata run: a kill delay too long for the clock means no SIGKILL",
          "[launcher][issue16]") {
  // Rank 1 handles SIGTERM slowly; with --kill-delay 1e10 it must get to
  // finish (it was SIGKILLed at once). Rank 0 fails only after rank 1 has
  // installed its handler (the file handshake), so no timing is assumed.
  strata::test::TempDir dir("launcher-kill-delay");
  const std::string ready = dir.file("ready");
  const auto result = run_command(strata_run(
      "-n 2 --failure-grace 0 --kill-delay 1e10 -- sh -c 'if [ $RANK = 0 ]; then while [ ! -e " +
      ready +
      " ]; do sleep 0.05; done; exit 5; fi; trap \"sleep 1; echo after-term; exit 0\" TERM; "
      "touch " +
      ready + "; while :; do sleep 0.1; done'"));
  INFO(result.output);
  REQUIRE(result.exit_code == 5);
  REQUIRE_THAT(result.output, Catch::Contains("[rank 1] after-term"));
}

TEST_CASE("strata run: more local ranks than GPUs is refused in every rank before a GPU or a peer is touched",
          "[launcher][issue26]") {
  // Two ranks on a one-GPU machine both took cuda:0 (LOCAL_RANK % devices) and
  // NCCL refused the duplicate GPU with an unexplained "invalid usage". The
  // GPU count is faked (STRATA_TEST_CUDA_DEVICE_COUNT, core/accelerator.h).
  strata::test::TempDir dir("launcher-gpus");
  const std::string swap = dir.file("swap");
  auto config = [&](const std::string& accelerator) {
    return strata::test::write_file(dir, "ds-" + accelerator + ".json", R"({
      "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
      "zero_optimization": {"stage": 2}, "strata": {"accelerator": ")" + accelerator + R"("}})");
  };
  auto finetune = [&](const std::string& n, const std::string& accelerator,
                      const std::string& visible = "env -u CUDA_VISIBLE_DEVICES ") {
    return run_command("cd " + dir.path().string() + " && STRATA_TEST_CUDA_DEVICE_COUNT=1 " + visible +
                       strata_run("-n " + n + " -- " + strata_binary() + " finetune --config " +
                                  config(accelerator) + " --init " + strata::test::small_model(dir) + " --data " +
                                  strata::test::kFinetuneExamples + "/data/gpl-3.0.txt --data-format text --steps 1 "
                                  "--seq 16 --out " + dir.file("out-" + accelerator + n + std::to_string(visible.size()))));
  };
  for (const std::string accelerator : {"auto", "cuda"}) {
    INFO("strata.accelerator " << accelerator);
    const auto result = finetune("2", accelerator);
    INFO(result.output);
    REQUIRE(result.exit_code == 1);
    // Each rank says it (and the launcher names the first).
    const std::string said = "2 local ranks (strata run -n 2) but this machine has 1 GPU:";
    size_t times = 0;
    for (size_t at = result.output.find(said); at != std::string::npos; at = result.output.find(said, at + 1)) ++times;
    REQUIRE(times == 2);
    REQUIRE_THAT(result.output, Catch::Contains("Run with -n 1 (one rank per GPU)") &&
                                    Catch::Contains(R"(or set "strata": {"accelerator": "cpu"} in the config)"));
    // Refused before the rendezvous: no rank waited for or blamed a peer.
    REQUIRE_THAT(result.output, !Catch::Contains("peer") && !Catch::Contains("rendezvous") &&
                                    !Catch::Contains("invalid usage"));
  }
  // One GPU per process through CUDA_VISIBLE_DEVICES (a launcher's choice, as
  // SLURM's --gpus-per-task=1 makes it) is not refused: each rank takes the GPU
  // it sees (and fails here only because this machine has none).
  const auto per_rank = finetune("2", "cuda", "CUDA_VISIBLE_DEVICES=0 ");
  INFO(per_rank.output);
  REQUIRE(per_rank.exit_code != 0);
  REQUIRE_THAT(per_rank.output, !Catch::Contains("local ranks") && Catch::Contains("CUDA"));
  // The way out on the CPU: the same two ranks train.
  const auto cpu = finetune("2", "cpu");
  INFO(cpu.output);
  REQUIRE(cpu.exit_code == 0);
}

TEST_CASE("rank_device: one local rank per GPU", "[accelerator][issue26]") {
  REQUIRE(strata::rank_device(0, 1, 1) == 0);
  REQUIRE(strata::rank_device(3, 4, 8) == 3);
  REQUIRE_THROWS_WITH(strata::rank_device(1, 2, 1),
                      Catch::Contains("2 local ranks (strata run -n 2) but this machine has 1 GPU:") &&
                          Catch::Contains("-n 1"));
  REQUIRE_THROWS_WITH(strata::rank_device(0, 8, 4), Catch::Contains("has 4 GPUs") && Catch::Contains("-n 4"));
  REQUIRE_THROWS_WITH(strata::rank_device(2, 2, 4), Catch::Contains("LOCAL_RANK 2 is outside"));
}
