// all_to_all on Gloo with ranks as threads of one process (real TCP over
// loopback): counts per peer with zeros, scattered displacements, fp32, bf16
// and f64, the checks made at submission, and a peer that leaves mid-job.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "tests/partition/all_to_all_checks.h"
#include "tests/partition/thread_ranks.h"

using namespace strata;
using partition::AllToAllSplits;

TEST_CASE("gloo all_to_all, ranks as threads: 1, 2, 3 and 4 ranks, uneven and zero counts, exact") {
  for (int world : {1, 2, 3, 4}) {
    INFO("world size " << world);
    REQUIRE_NOTHROW(test::run_thread_ranks(world, [](int, partition::Communicator& comm, Accelerator&,
                                                     Stream& stream) { test::run_all_to_all_checks(comm, stream); }));
  }
}

TEST_CASE("AllToAllSplits: even and packed give rank-ordered, prefix-summed blocks") {
  const AllToAllSplits even = AllToAllSplits::even(3, 4);
  REQUIRE(even.send_counts == std::vector<size_t>{4, 4, 4});
  REQUIRE(even.send_displs == std::vector<size_t>{0, 4, 8});
  REQUIRE(even.recv_displs == std::vector<size_t>{0, 4, 8});
  const AllToAllSplits packed = AllToAllSplits::packed({2, 0, 5}, {1, 3, 0});
  REQUIRE(packed.send_displs == std::vector<size_t>{0, 2, 2});
  REQUIRE(packed.recv_displs == std::vector<size_t>{0, 1, 4});
  REQUIRE(packed.send_total() == 7);
  REQUIRE(packed.recv_total() == 4);
}

TEST_CASE("gloo all_to_all: what one rank can check is refused at submission, naming it") {
  // Each rank records the messages of its refused calls; the communicator stays usable.
  std::mutex mutex;
  std::vector<std::string> refused;
  test::run_thread_ranks(2, [&](int rank, partition::Communicator& comm, Accelerator&, Stream& stream) {
    std::vector<float> send(16, 1.0f), recv(16, 0.0f);
    auto refuse = [&](const AllToAllSplits& splits, const void* in, void* out) {
      try {
        comm.all_to_all(in, out, splits, DType::kF32, stream);
      } catch (const Error& e) {
        STRATA_CHECK(e.category() == ErrorCategory::kBadArgument, kInternal, "wrong category: {}", e.what());
        std::lock_guard lock(mutex);
        refused.push_back(fmt::format("rank {}: {}", rank, e.message()));
        return;
      }
      raise(ErrorCategory::kInternal, "rank {}: a bad all_to_all was accepted", rank);
    };
    AllToAllSplits three = AllToAllSplits::even(3, 2);
    refuse(three, send.data(), recv.data());
    AllToAllSplits self = AllToAllSplits::packed({2, 2}, {2, 2});
    self.recv_counts[static_cast<size_t>(rank)] = 1;
    refuse(self, send.data(), recv.data());
    AllToAllSplits overlapping = AllToAllSplits::even(2, 4);
    overlapping.recv_displs = {0, 3};
    refuse(overlapping, send.data(), recv.data());
    refuse(AllToAllSplits::even(2, 4), send.data(), send.data() + 4);  // in place: send and recv overlap
    // Still usable: a real one after the refusals.
    test::check_all_to_all_case(comm, stream, DType::kF32, test::uneven_count, true, "after refusals");
  });
  REQUIRE(refused.size() == 8);
  auto has = [&](const std::string& text) {
    return std::count_if(refused.begin(), refused.end(),
                         [&](const std::string& m) { return m.find(text) != std::string::npos; });
  };
  REQUIRE(has("send_counts has 3 entries, one per rank (2) is needed") == 2);
  REQUIRE(has("the block this rank sends itself has 2 elements") == 2);
  REQUIRE(has("receive blocks overlap (elements [0, 4) and [3, 7) of recv)") == 2);
  REQUIRE(has("overlap; it does not run in place") == 2);
  REQUIRE(has("all_to_all on rank 1 of 2") == 4);
}

TEST_CASE("gloo all_to_all: a peer that leaves is reported within the timeout, naming the operation") {
  constexpr auto kTimeout = std::chrono::milliseconds(1500);
  std::mutex mutex;
  std::vector<std::string> errors;
  const auto start = std::chrono::steady_clock::now();
  test::run_rank_threads(3, kTimeout, [&](int rank, partition::StoreClient& store, Accelerator& accelerator) {
    partition::CommunicatorOptions options;
    options.rank = rank;
    options.world_size = 3;
    options.timeout = kTimeout;
    auto comm = partition::make_gloo_communicator(accelerator, store, options);
    auto stream = accelerator.create_stream();
    comm->barrier(*stream)->synchronize();
    if (rank == 2) return;  // leaves: its communicator closes its sockets
    std::vector<float> send(3 * 1000, 1.0f), recv(send.size());
    try {
      comm->all_to_all(send.data(), recv.data(), AllToAllSplits::even(3, 1000), DType::kF32, *stream)->synchronize();
    } catch (const Error& e) {
      STRATA_CHECK(e.category() == ErrorCategory::kCommunication, kInternal, "wrong category: {}", e.what());
      std::lock_guard lock(mutex);
      errors.push_back(e.message());
      return;
    }
    raise(ErrorCategory::kInternal, "rank {}: all_to_all completed although rank 2 had left", rank);
  });
  INFO((errors.empty() ? std::string() : errors[0] + "\n" + errors.back()));
  REQUIRE(errors.size() == 2);
  for (const std::string& message : errors) {
    REQUIRE_THAT(message, Catch::Contains("all_to_all #2 (3000 x fp32) failed on rank ") &&
                              Catch::Contains(" of 3") && Catch::Contains("(timeout 1500 ms)"));
  }
  // Within the timeout (plus the second the survivors wait for each other's report).
  REQUIRE(std::chrono::steady_clock::now() - start < std::chrono::seconds(6));
}
TEST_CASE("gloo all_to_all: counts the two sides disagree on fail on both, naming them, instead of aborting") {
  // Rank 0 sends rank 1 five elements; rank 1 expects three (and Gloo alone
  // would abort the process on the longer message).
  std::mutex mutex;
  std::vector<std::string> errors(2);
  constexpr auto kTimeout = std::chrono::milliseconds(2000);
  test::run_rank_threads(2, kTimeout, [&](int rank, partition::StoreClient& store, Accelerator& accelerator) {
    partition::CommunicatorOptions options;
    options.rank = rank;
    options.world_size = 2;
    options.timeout = kTimeout;
    auto comm = partition::make_gloo_communicator(accelerator, store, options);
    auto stream = accelerator.create_stream();  // failed by the collective, and left so
    std::vector<float> send(10, 1.0f), recv(10, 0.0f);
    const AllToAllSplits splits =
        rank == 0 ? AllToAllSplits::packed({1, 5}, {1, 1}) : AllToAllSplits::packed({1, 1}, {3, 1});
    try {
      comm->all_to_all(send.data(), recv.data(), splits, DType::kF32, *stream)->synchronize();
    } catch (const Error& e) {
      std::lock_guard lock(mutex);
      errors[static_cast<size_t>(rank)] = e.message();
    }
  });
  INFO(errors[0] << "\n" << errors[1]);
  REQUIRE_THAT(errors[0], Catch::Contains("all_to_all #1 (6 x fp32) failed on rank 0 of 2") &&
                              Catch::Contains("the counts of the two sides must agree") &&
                              Catch::Contains("rank 1 sends 1 elements to this rank, which expects 1 (recv_counts[1]), "
                                              "and expects 3 from it, which sends 5 (send_counts[1])"));
  REQUIRE_THAT(errors[1], Catch::Contains("failed on rank 1 of 2") &&
                              Catch::Contains("rank 0 sends 5 elements to this rank, which expects 3 (recv_counts[0])"));
}
