// The ZeRO-3 coordinator with ranks as real processes (issue 11, "done when"):
//  - 4 ranks under `strata run -n 4` (Gloo over loopback), parameters on NVMe,
//    prefetch and TiledLinear on, train the thread tests' tiny Llama 4 steps
//    and give the losses and final parameters of ONE rank with everything
//    resident (ResidentEngine) on the combined batch;
//  - the same as 2 nodes x 2 ranks, each node in its own network namespace
//    joined by a veth pair (skipped, with the reason, where namespaces cannot
//    be made: not root, no `ip`);
//  - a rank SIGKILLed inside a step's forward (at an NVMe read feeding a
//    gather) under `--failure-grace inf`: the survivors fail on their own with
//    a communication error, well within a bound, and nothing hangs.
// The rank program is zero_multiprocess_rank.cc; the shared options and its
// output format are in zero_multiprocess.h.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/ops.h"
#include "tests/engine/zero_multiprocess.h"
#include "tests/engine/zero_training.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"

namespace {
using namespace strata;
namespace zero = strata::test::zero;
namespace zero_mp = strata::test::zero_mp;

const std::string kStrata = test::strata_binary();
const std::string kRankProgram = STRATA_ZERO_RANK_PROGRAM;
constexpr int kWorld = 4;

using Command = test::CommandResult;
using test::run_with_limit;

std::string rank_program(const test::TempDir& dir, const std::string& nvme, const std::string& extra = "") {
  return kRankProgram + " --out " + dir.file("out") + " --nvme " + nvme + " --steps " +
         std::to_string(zero_mp::kSteps) + extra;
}

// What the ranks' files say, assembled: the global losses (every rank must
// report the same) and every parameter from the ranks' owned ranges.
struct Assembled {
  std::vector<double> losses;
  std::vector<std::string> names;
  std::vector<std::vector<float>> params;
  std::vector<zero_mp::RankOutput> ranks;
};

Assembled assemble(const test::TempDir& dir, int world) {
  Assembled a;
  std::vector<std::vector<int>> covered;
  for (int rank = 0; rank < world; ++rank) {
    CAPTURE(rank);
    zero_mp::RankOutput r = zero_mp::read_output(dir.file("out") + "/rank" + std::to_string(rank) + ".txt");
    REQUIRE(r.rank == rank);
    REQUIRE(r.world == world);
    REQUIRE(r.steps.size() == static_cast<size_t>(zero_mp::kSteps));
    if (rank == 0) {
      for (const auto& s : r.steps) a.losses.push_back(s.loss);
      for (const auto& [name, numel] : r.params) {
        a.names.push_back(name);
        a.params.emplace_back(static_cast<size_t>(numel), std::nanf(""));
        covered.emplace_back(static_cast<size_t>(numel), 0);
      }
    }
    for (size_t s = 0; s < r.steps.size(); ++s) CHECK(r.steps[s].loss == a.losses[s]);  // a global value
    REQUIRE(r.params.size() == a.params.size());
    for (const auto& range : r.ranges) {
      REQUIRE(range.param >= 0);
      REQUIRE(static_cast<size_t>(range.param) < a.params.size());
      auto& param = a.params[static_cast<size_t>(range.param)];
      REQUIRE(range.first >= 0);
      REQUIRE(static_cast<size_t>(range.first) + range.values.size() <= param.size());
      std::copy(range.values.begin(), range.values.end(), param.begin() + range.first);
      for (size_t i = 0; i < range.values.size(); ++i) covered[static_cast<size_t>(range.param)][range.first + i]++;
    }
    a.ranks.push_back(std::move(r));
  }
  // The ranks' shards tile every parameter exactly once.
  for (size_t p = 0; p < covered.size(); ++p) {
    CAPTURE(a.names[p]);
    CHECK(std::all_of(covered[p].begin(), covered[p].end(), [](int n) { return n == 1; }));
  }
  return a;
}

// The reference: ONE rank with everything resident on the combined batch
// (zero::train_resident), the same model (tiling included), seed and Adam.
zero::TrainResult train_resident() {
  ops::set_cpu_threads(1);
  zero::ResidentSpec spec;
  spec.steps = zero_mp::kSteps;
  spec.tied = zero_mp::kTied;
  spec.model = zero_mp::model_options();
  spec.init_seed = zero_mp::kInitSeed;
  spec.adam = zero_mp::adam();
  return zero::train_resident(spec);
}

// Tolerances, from fp32 reduction order alone. Not bit-identical: each rank
// sums its gradient over its own sequence and the reduce-scatter adds the 4
// partial sums in ring order, where the resident rank sums all 4 sequences in
// one pass — the same terms in another order, so a gradient differs by a few
// fp32 ulps of its terms. With Adam's eps = 1 (zero_multiprocess.h) a weight
// moves by about lr x gradient, so that difference enters the weights scaled
// by lr = 1e-2; what can remain is the rounding of the updated weight itself:
// its last bit may flip at each of the 4 steps, and those flips feed the next
// steps' gradients. For the largest weights (norms, ~1.0; ulp 1.2e-7) that is
// at most a few ulps; 2e-6 (16 ulps of 1.0) bounds it with room, as in the
// thread tests' 2-ranks-equal-1-rank case. Measured here: 3.7e-9 (see the WARN
// line), while training moves weights by ~4e-3, so the bound still catches a
// lost or double-counted rank contribution (checked below: 100x margin). The
// loss: per-token fp32 losses from weights that agree to that level, summed in
// f64 per rank and over ranks instead of once: relative 1e-6 (measured 1.7e-9).
constexpr double kParamTolerance = 2e-6;
constexpr double kLossRelTolerance = 1e-6;

void check_equals_resident(const Assembled& zero3, const zero::TrainResult& reference) {
  REQUIRE(zero3.names == reference.names);
  REQUIRE(zero3.losses.size() == reference.losses.size());
  for (size_t s = 0; s < reference.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(zero3.losses[s] == Approx(reference.losses[s]).epsilon(kLossRelTolerance));
  }
  // Training moved the model (random tokens: the loss need not fall in 4 steps).
  CHECK(reference.losses[1] != reference.losses[0]);
  double max_abs = 0, max_ref = 0, moved = 0;
  bool identical = true;
  for (size_t p = 0; p < reference.params.size(); ++p) {
    CAPTURE(reference.names[p]);
    REQUIRE(zero3.params[p].size() == reference.params[p].size());
    for (size_t i = 0; i < reference.params[p].size(); ++i) {
      const float x = zero3.params[p][i], y = reference.params[p][i];
      REQUIRE(std::isfinite(x));
      identical = identical && std::memcmp(&x, &y, sizeof(float)) == 0;
      max_abs = std::max(max_abs, static_cast<double>(std::fabs(x - y)));
      max_ref = std::max(max_ref, static_cast<double>(std::fabs(y)));
      moved = std::max(moved, static_cast<double>(std::fabs(y - reference.initial_params[p][i])));
    }
  }
  double max_loss_rel = 0;
  for (size_t s = 0; s < reference.losses.size(); ++s) {
    max_loss_rel = std::max(max_loss_rel, std::fabs(zero3.losses[s] - reference.losses[s]) / reference.losses[s]);
  }
  WARN("4 ZeRO-3 ranks vs 1 resident rank after " << zero_mp::kSteps << " steps: parameters "
                                                 << (identical ? "bit-identical" : "differ") << ", max |difference| "
                                                 << max_abs << " (largest weight " << max_ref
                                                 << ", largest change by training " << moved
                                                 << "); losses: max relative difference " << max_loss_rel);
  CHECK(max_abs <= kParamTolerance);
  // The bound is far below what training changed, so a real error (a rank's
  // contribution lost or counted twice, a stale or misplaced shard) shows.
  CHECK(moved > 100 * kParamTolerance);
}

// Prefetch really happened: the first step records the operator trace, every
// later step follows it and issues fetches ahead; and parameters came from NVMe.
void check_prefetch_and_nvme(const Assembled& zero3) {
  for (const auto& r : zero3.ranks) {
    CAPTURE(r.rank);
    CHECK(r.nvme_read > 0);
    CHECK(r.steps[0].prefetched == 0);  // recording the trace
    for (size_t s = 1; s < r.steps.size(); ++s) {
      CAPTURE(s);
      CHECK(r.steps[s].trace_followed);
      CHECK(r.steps[s].prefetched > 0);
    }
  }
}

// ---- two nodes as network namespaces ------------------------------------------------------

// Two network namespaces joined by a veth pair, each end with an address on a
// /30 that exists only between them, `lo` up in both; removed (namespaces,
// links) on destruction, also when a check failed. The
// namespaces, and so the addresses and ports, are private to this run: two
// runs at once cannot collide, so a fixed address pair and master port do.
class NodePair {
 public:
  static constexpr const char* kAddr[2] = {"10.213.0.1", "10.213.0.2"};

  NodePair() {
    const std::string id = std::to_string(::getpid());
    for (int n = 0; n < 2; ++n) {
      ns_[n] = "strata-zmp-" + id + "-" + std::to_string(n);
      veth_[n] = "zmp" + id + (n == 0 ? "a" : "b");  // interface names: at most 15 characters
    }
    remove_leftovers();  // of an earlier run with this pid that was killed before cleaning up
    if (!sh("ip netns add " + ns_[0]) || !sh("ip netns add " + ns_[1]) ||
        !sh("ip link add " + veth_[0] + " type veth peer name " + veth_[1])) {
      return;
    }
    for (int n = 0; n < 2; ++n) {
      if (!sh("ip link set " + veth_[n] + " netns " + ns_[n]) ||
          !sh("ip -n " + ns_[n] + " addr add " + kAddr[n] + "/30 dev " + veth_[n]) ||
          !sh("ip -n " + ns_[n] + " link set " + veth_[n] + " up") || !sh("ip -n " + ns_[n] + " link set lo up")) {
        return;
      }
      // No /etc/hosts help: with the store off loopback each rank's Gloo
      // device advertises the local address of its route to the master
      // (partition/gloo_communicator.cc), here its own veth address.
    }
    ok_ = true;
  }
  ~NodePair() { remove_leftovers(); }
  NodePair(const NodePair&) = delete;
  NodePair& operator=(const NodePair&) = delete;

  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  const std::string& ns(int n) const { return ns_[n]; }
  // Bytes the node's veth end sent and received.
  uint64_t veth_bytes(int n, const char* direction) const {
    const Command c = run_with_limit("ip netns exec " + ns_[n] + " cat /sys/class/net/" + veth_[n] +
                                         "/statistics/" + direction + "_bytes",
                                     10);
    return c.exit_code == 0 ? std::stoull(c.output) : 0;
  }

 private:
  // Runs a setup or cleanup command; on failure remembers why (the first one).
  bool sh(const std::string& command) {
    const Command c = run_with_limit(command, 10);
    if (c.exit_code == 0) return true;
    if (error_.empty()) error_ = "'" + command + "' failed (exit " + std::to_string(c.exit_code) + "): " + c.output;
    return false;
  }
  // Deleting a namespace takes its veth end, and so the pair, with it; the
  // link is deleted on its own in case it never moved. Errors are ignored:
  // some of these never existed.
  void remove_leftovers() {
    for (int n = 0; n < 2; ++n) {
      run_with_limit("ip netns del " + ns_[n], 10);
    }
    run_with_limit("ip link del " + veth_[0], 10);
  }

  std::string ns_[2], veth_[2];
  bool ok_ = false;
  std::string error_;
};

}  // namespace

TEST_CASE("ZeRO-3 processes: 4 ranks (params on NVMe, prefetch, tiling) equal 1 resident rank in losses and parameters",
          "[engine][zero][multiprocess]") {
  test::TempDir dir("strata-zero-mp");
  const Command r = run_with_limit(kStrata + " run -n 4 -- " + rank_program(dir, dir.file("nvme")), 120);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const Assembled zero3 = assemble(dir, kWorld);
  check_prefetch_and_nvme(zero3);
  check_equals_resident(zero3, train_resident());
}

TEST_CASE("ZeRO-3 processes: 2 nodes x 2 ranks, each node in its own network namespace, equal 1 resident rank",
          "[engine][zero][multiprocess][netns]") {
  NodePair nodes;
  if (!nodes.ok()) {
    // Catch2 v2 has no skip: the reason is printed, and this marker makes
    // CTest report the test as skipped (SKIP_REGULAR_EXPRESSION, tests/engine/CMakeLists.txt).
    WARN("SKIPPED (no network namespaces): " << nodes.error());
    return;
  }
  test::TempDir dir("strata-zero-mp");
  // Both nodes' launchers at once, each in its namespace; the master port is
  // fixed (required with 2 nodes) and free, since the namespace is new.
  Command node[2];
  std::thread threads[2];
  for (int n = 0; n < 2; ++n) {
    threads[n] = std::thread([&, n] {
      node[n] = run_with_limit("ip netns exec " + nodes.ns(n) + " " + kStrata + " run --nnodes 2 --node-rank " +
                                   std::to_string(n) + " --master-addr " + NodePair::kAddr[0] +
                                   " --master-port 29500 -n 2 -- " +
                                   rank_program(dir, dir.file("nvme" + std::to_string(n))),
                               120);
    });
  }
  for (auto& t : threads) t.join();
  for (int n = 0; n < 2; ++n) {
    INFO("node " << n << ":\n" << node[n].output);
    REQUIRE(node[n].exit_code == 0);
  }
  const Assembled zero3 = assemble(dir, kWorld);
  check_prefetch_and_nvme(zero3);
  check_equals_resident(zero3, train_resident());
  // The collectives crossed the veth pair: every step node 1's ranks gather
  // node 0's half of every parameter (forward and backward) and the other way
  // round, far more than all the parameters' bytes over 4 steps.
  size_t param_nbytes = 0;
  for (const auto& p : zero3.params) param_nbytes += p.size() * sizeof(float);
  for (int n = 0; n < 2; ++n) {
    const uint64_t tx = nodes.veth_bytes(n, "tx"), rx = nodes.veth_bytes(n, "rx");
    WARN("node " << n << "'s veth: " << tx << " B sent, " << rx << " B received (parameters: " << param_nbytes
                 << " B)");
    CHECK(tx > param_nbytes);
    CHECK(rx > param_nbytes);
  }
}

TEST_CASE("ZeRO-3 processes: a rank SIGKILLed in a gather, the others fail with a communication error, nothing hangs",
          "[engine][zero][multiprocess]") {
  test::TempDir dir("strata-zero-mp");
  // --failure-grace inf: strata run never stops the survivors; they must fail
  // on their own, within the 5 s communicator timeout (or sooner, when the
  // store sees the dead rank). 60 s is the bound; `timeout` kills at 90 s.
  const Command r = run_with_limit(kStrata + " run -n 4 --failure-grace inf -- " +
                                       rank_program(dir, dir.file("nvme"),
                                                    " --timeout-ms 5000 --kill-rank 2 --kill-after-step 0"),
                                   90);
  INFO(r.output << "\n(" << r.seconds << " s)");
  REQUIRE(r.exit_code == 128 + 9);  // the first rank to fail: rank 2, killed by SIGKILL
  CHECK_THAT(r.output, Catch::Contains("strata run: rank 2 (pid") && Catch::Contains("killed by signal 9"));
  CHECK_THAT(r.output, !Catch::Contains("stopped by strata run"));  // nobody was stopped by the launcher
  // It died where it was meant to: after step 0, in step 1's forward.
  CHECK_THAT(r.output, Catch::Contains("[rank 2] zero rank program: armed, dying at an NVMe read of step 1"));
  CHECK_THAT(r.output, Catch::Contains("killing myself (SIGKILL)"));
  CHECK_THAT(r.output, !Catch::Contains("step 1 done"));
  for (int rank : {0, 1, 3}) {
    CAPTURE(rank);
    const std::string prefix = "[rank " + std::to_string(rank) + "] zero rank program failed: ";
    const size_t at = r.output.find(prefix);
    REQUIRE(at != std::string::npos);
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    INFO(line);
    // An allgather failed (#78 here: the first of step 1, after step 0's 77), naming the dead rank.
    CHECK_THAT(line, Catch::Contains("communication error: allgather #") && Catch::Contains("rank 2 died"));
  }
  CHECK(r.seconds < 60.0);
  CHECK_FALSE(std::filesystem::exists(dir.file("out")));  // no rank finished
}
