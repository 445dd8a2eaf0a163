// The rank program the multi-process tests start under `strata run`: joins the
// rendezvous from the environment, builds a Gloo communicator and runs one
// scenario. Exit codes: 0 passed, 1 a check failed, 3 a collective raised.
//   rank_program collectives NUMEL         every collective (all_to_all too), checked for equality
//   rank_program die RANK TIMEOUT_MS [OP]  RANK kills itself (SIGKILL) while the
//                                          others are inside OP: allreduce (the
//                                          default) or all_to_all
//   rank_program stall RANK TIMEOUT_MS     RANK stops itself (SIGSTOP) instead
//   rank_program env                       prints the rank environment it parsed
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "partition/communicator.h"
#include "partition/rendezvous.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "tests/partition/all_to_all_checks.h"
#include "tests/partition/collective_checks.h"

namespace {
using namespace strata;
using namespace strata::partition;

int run(int argc, char** argv) {
  std::string scenario = argc > 1 ? argv[1] : "";
  RankInfo info = RankInfo::from_env();
  if (scenario == "env") {
    const char* master_port = std::getenv("MASTER_PORT");
    std::printf("rank=%d world=%d local_rank=%d local_world=%d master=%s:%s store_port=%d (%s)\n", info.rank,
                info.world_size, info.local_rank, info.local_world_size, info.master_addr.c_str(),
                master_port != nullptr ? master_port : "-", info.master_port, info.port_source.c_str());
    return 0;
  }
  std::chrono::milliseconds timeout(argc > 3 ? std::atoi(argv[3]) : 5000);
  Rendezvous rendezvous(info, timeout);
  auto accelerator = make_cpu_accelerator();
  auto stream = accelerator->create_stream();
  CommunicatorOptions options;
  options.rank = info.rank;
  options.world_size = info.world_size;
  options.timeout = timeout;
  auto comm = make_gloo_communicator(*accelerator, rendezvous.store(), options);

  if (scenario == "collectives") {
    size_t numel = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 1000;
    test::run_collective_checks(*comm, *stream, numel);
    test::run_all_to_all_checks(*comm, *stream);
    std::printf("collectives ok on rank %d of %d\n", info.rank, info.world_size);
    return 0;
  }
  if (scenario == "die" || scenario == "stall") {
    // die: the victim is killed; stall: it stops (SIGSTOP), alive but silent.
    int victim = argc > 2 ? std::atoi(argv[2]) : 1;
    int signal_number = scenario == "die" ? SIGKILL : SIGSTOP;
    comm->barrier(*stream)->synchronize();
    if (info.rank == victim) {
      // Die from another thread while this rank is inside allreduces, so peers
      // are mid-collective when the sockets drop.
      std::thread([signal_number] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        raise(signal_number);
      }).detach();
    }
    const std::string op = argc > 4 ? argv[4] : "allreduce";
    if (op != "allreduce" && op != "all_to_all") {
      std::fprintf(stderr, "unknown operation '%s'\n", op.c_str());
      return 2;
    }
    std::vector<float> data(1 << 20, 1.0f), received(data.size());
    const size_t block = data.size() / static_cast<size_t>(info.world_size);
    try {
      for (int i = 0; i < 100000; ++i) {
        if (op == "allreduce") {
          comm->allreduce(data.data(), data.data(), data.size(), DType::kF32, ReduceOp::kAverage, *stream)
              ->synchronize();
        } else {
          comm->all_to_all(data.data(), received.data(), AllToAllSplits::even(info.world_size, block), DType::kF32,
                           *stream)
              ->synchronize();
        }
      }
    } catch (const Error& e) {
      std::fprintf(stderr, "collective failed: %s\n", e.what());
      return 3;
    }
    std::fprintf(stderr, "no error although rank %d died\n", victim);
    return 1;
  }
  std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
  return 2;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const strata::Error& e) {
    std::fprintf(stderr, "rank_program: %s\n", e.what());
    return e.category() == strata::ErrorCategory::kCommunication ? 3 : 1;
  }
}
