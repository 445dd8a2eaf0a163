// The NCCL communicator on a real GPU (SKIPPED without one). One GPU allows one
// rank (NCCL refuses two ranks on one device), so most of these check the
// wiring: unique id through the store, stream ordering, dtypes, events,
// results, all_to_all to itself, process groups, the watchdog's clock; the
// dead-peer test needs two GPUs.
#include <catch2/catch.hpp>

#include <future>
#include <memory>
#include <thread>

#include "partition/communicator.h"
#include "partition/process_groups.h"
#include "partition/store.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "tests/runtime/accelerator_comm_contract.h"
#include "tests/runtime/accelerator_contract.h"

using namespace strata;
using namespace strata::partition;

namespace {

// A one-rank job on cuda:0: its rendezvous store, a stream, and communicator
// options with a 10 s timeout (tests set their own key prefix).
struct OneRankJob {
  StoreServer server{"127.0.0.1", 0};
  StoreClient store{"127.0.0.1", server.port(), 0, std::chrono::milliseconds(10000)};
  std::unique_ptr<Accelerator> accelerator = make_cuda_accelerator(0);
  std::unique_ptr<Stream> stream = accelerator->create_stream();
  CommunicatorOptions options = [] {
    CommunicatorOptions o;
    o.timeout = std::chrono::milliseconds(10000);
    return o;
  }();
};

}  // namespace

TEST_CASE("nccl: single-rank collectives through the rendezvous store give exact results") {
  OneRankJob job;
  StoreClient& store = job.store;
  Accelerator* accelerator = job.accelerator.get();
  Stream* stream = job.stream.get();
  CommunicatorOptions& options = job.options;
  auto comm = make_communicator(*accelerator, store, options);
  REQUIRE(comm->backend() == "nccl");
  std::vector<char> id;
  REQUIRE(store.try_get(options.prefix + "/nccl_unique_id", id));

  const size_t numel = 4099;
  std::vector<float> host(numel), out(numel);
  for (size_t i = 0; i < numel; ++i) host[i] = static_cast<float>(i % 97);
  void* a = accelerator->allocate(numel * sizeof(float));
  void* b = accelerator->allocate(numel * sizeof(float));
  auto fetch = [&](void* device) {
    std::fill(out.begin(), out.end(), -1.0f);
    accelerator->copy_async(out.data(), device, numel * sizeof(float), CopyKind::kDeviceToHost, *stream);
    stream->synchronize();
    return out;
  };
  accelerator->copy_async(a, host.data(), numel * sizeof(float), CopyKind::kHostToDevice, *stream);
  comm->allgather(a, b, numel, DType::kF32, *stream)->synchronize();
  REQUIRE(fetch(b) == host);
  accelerator->memset_async(b, 0, numel * sizeof(float), *stream);
  comm->reduce_scatter(a, b, numel, DType::kF32, ReduceOp::kSum, *stream)->synchronize();
  REQUIRE(fetch(b) == host);
  comm->allreduce(a, b, numel, DType::kF32, ReduceOp::kAverage, *stream)->synchronize();
  REQUIRE(fetch(b) == host);
  comm->broadcast(a, numel, DType::kF32, 0, *stream)->synchronize();
  REQUIRE(fetch(a) == host);
  comm->barrier(*stream)->synchronize();
  // bf16 allreduce in place.
  std::vector<BFloat16> bf(numel);
  for (size_t i = 0; i < numel; ++i) bf[i] = float_to_bf16(host[i]);
  accelerator->copy_async(a, bf.data(), numel * 2, CopyKind::kHostToDevice, *stream);
  comm->allreduce(a, a, numel, DType::kBF16, ReduceOp::kSum, *stream)->synchronize();
  std::vector<BFloat16> bf_out(numel);
  accelerator->copy_async(bf_out.data(), a, numel * 2, CopyKind::kDeviceToHost, *stream);
  stream->synchronize();
  for (size_t i = 0; i < numel; ++i) REQUIRE(bf16_to_float(bf_out[i]) == host[i]);
  accelerator->deallocate(a);
  accelerator->deallocate(b);
}

// One rank: all_to_all is a grouped ncclSend/ncclRecv to itself; the block
// lands at its displacement and the rest of recv is untouched.
TEST_CASE("nccl: single-rank all_to_all with a displacement, fp32 and bf16") {
  OneRankJob job;
  StoreClient& store = job.store;
  Accelerator* accelerator = job.accelerator.get();
  Stream* stream = job.stream.get();
  CommunicatorOptions& options = job.options;
  options.prefix = "strata/all_to_all_test";
  auto comm = make_communicator(*accelerator, store, options);
  const size_t numel = 1000, gap = 24;
  AllToAllSplits splits = AllToAllSplits::packed({numel}, {numel});
  splits.send_displs = {gap};
  splits.recv_displs = {2 * gap};
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    INFO(dtype_name(dtype));
    const size_t element = dtype_nbytes(dtype), extent = 2 * gap + numel;
    std::vector<float> send(extent, -3.0f), want(extent, -1.0f);
    for (size_t i = 0; i < numel; ++i) send[gap + i] = want[2 * gap + i] = static_cast<float>(i % 200);
    auto to_bytes = [&](const std::vector<float>& values) {
      std::vector<char> bytes(values.size() * element);
      for (size_t i = 0; i < values.size(); ++i) {
        if (dtype == DType::kBF16) {
          reinterpret_cast<BFloat16*>(bytes.data())[i] = float_to_bf16(values[i]);
        } else {
          reinterpret_cast<float*>(bytes.data())[i] = values[i];
        }
      }
      return bytes;
    };
    const std::vector<char> send_bytes = to_bytes(send), untouched = to_bytes(std::vector<float>(extent, -1.0f));
    void* in = accelerator->allocate(extent * element);
    void* out = accelerator->allocate(extent * element);
    accelerator->copy_async(in, send_bytes.data(), extent * element, CopyKind::kHostToDevice, *stream);
    accelerator->copy_async(out, untouched.data(), extent * element, CopyKind::kHostToDevice, *stream);
    comm->all_to_all(in, out, splits, dtype, *stream)->synchronize();
    std::vector<char> got(extent * element);
    accelerator->copy_async(got.data(), out, extent * element, CopyKind::kDeviceToHost, *stream);
    stream->synchronize();
    REQUIRE(got == to_bytes(want));
    accelerator->deallocate(in);
    accelerator->deallocate(out);
  }
}

// A process group of one rank on NCCL: its own unique id under the group's
// key prefix, and collectives that work.
TEST_CASE("nccl: the process groups of a one-rank job") {
  OneRankJob job;
  StoreClient& store = job.store;
  Accelerator* accelerator = job.accelerator.get();
  Stream* stream = job.stream.get();
  CommunicatorOptions& options = job.options;
  ProcessGroups groups = make_process_groups(*accelerator, store, options, ParallelLayout(1, 1));
  std::vector<char> id;
  REQUIRE(store.try_get("strata/comm/groups/tp/0/nccl_unique_id", id));
  REQUIRE(store.try_get("strata/comm/groups/dp/0/nccl_unique_id", id));
  REQUIRE(groups.tp->backend() == "nccl");
  float host = 5.0f;
  void* data = accelerator->allocate(sizeof(float));
  accelerator->copy_async(data, &host, sizeof(float), CopyKind::kHostToDevice, *stream);
  groups.tp->allreduce(data, data, 1, DType::kF32, ReduceOp::kSum, *stream)->synchronize();
  groups.dp->allreduce(data, data, 1, DType::kF32, ReduceOp::kSum, *stream)->synchronize();
  accelerator->copy_async(&host, data, sizeof(float), CopyKind::kDeviceToHost, *stream);
  stream->synchronize();
  REQUIRE(host == 5.0f);
  accelerator->deallocate(data);
}

TEST_CASE("nccl: a peer that never joins makes initialisation fail within the timeout") {
  StoreServer server("127.0.0.1", 0);
  StoreClient store("127.0.0.1", server.port(), 1, std::chrono::milliseconds(1500));
  auto accelerator = make_cuda_accelerator(0);
  CommunicatorOptions options;
  options.rank = 1;  // rank 0 never publishes the unique id
  options.world_size = 2;
  options.timeout = std::chrono::milliseconds(1500);
  auto start = std::chrono::steady_clock::now();
  REQUIRE_THROWS_WITH(make_communicator(*accelerator, store, options), Catch::Contains("nccl_unique_id"));
  REQUIRE(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}

// (a) The collective's event is an ordinary event of the cuda accelerator:
// another stream waits on it, records it again and frees buffers after it
// (today's NcclEvent would have been static_cast to a CudaEvent: undefined).
TEST_CASE("nccl: a collective's event works in Stream::wait, record and deallocate_after") {
  OneRankJob job;
  StoreClient& store = job.store;
  Accelerator* accelerator = job.accelerator.get();
  CommunicatorOptions& options = job.options;
  options.prefix = "strata/event_test";
  auto comm = make_communicator(*accelerator, store, options);
  REQUIRE_NOTHROW(test::check_collective_event_in_streams(*accelerator, *comm));
}

// (e) The watchdog times a collective from when it starts on the device: one
// queued behind a stream held for several timeouts completes normally, and
// the communicator stays usable.
TEST_CASE("nccl: a collective queued behind a held stream is not timed out by the watchdog") {
  StoreServer server("127.0.0.1", 0);
  StoreClient store("127.0.0.1", server.port(), 0, std::chrono::milliseconds(10000));
  auto accelerator = make_cuda_accelerator(0);
  CommunicatorOptions options;
  options.timeout = std::chrono::milliseconds(1000);
  options.prefix = "strata/queued_test";
  auto comm = make_communicator(*accelerator, store, options);
  auto stream = accelerator->create_stream();
  auto* host = static_cast<float*>(accelerator->allocate_pinned(64 * sizeof(float)));
  for (int i = 0; i < 64; ++i) host[i] = static_cast<float>(i);
  void* data = accelerator->allocate(64 * sizeof(float));
  auto gate = accelerator->create_host_event();
  test::GateGuard guard(*gate);
  accelerator->copy_async(data, host, 64 * sizeof(float), CopyKind::kHostToDevice, *stream);
  stream->wait(*gate);
  auto reduced = comm->allreduce(data, data, 64, DType::kF32, ReduceOp::kSum, *stream);
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // three timeouts while held
  REQUIRE_FALSE(reduced->query());
  REQUIRE_FALSE(guard.open());
  REQUIRE_NOTHROW(reduced->synchronize());
  accelerator->copy_async(host, data, 64 * sizeof(float), CopyKind::kDeviceToHost, *stream);
  stream->synchronize();
  for (int i = 0; i < 64; ++i) REQUIRE(host[i] == static_cast<float>(i));
  REQUIRE_NOTHROW(comm->barrier(*stream)->synchronize());
  accelerator->deallocate(data);
  accelerator->deallocate_pinned(host);
}

// (e) A peer that stops taking part: the watchdog turns the hung collective
// into Error(kCommunication) for a host waiter and for a stream that waited on
// its event, and the communicator refuses later collectives. Needs two GPUs
// (NCCL refuses two ranks on one device); with fewer it only says so.
TEST_CASE("nccl: a peer that stops taking part becomes an error for host and stream waiters") {
  if (cuda_device_count() < 2) {
    WARN("needs 2 CUDA devices; " << cuda_device_count() << " present");
    return;
  }
  constexpr std::chrono::milliseconds kTimeout{2000};
  StoreServer server("127.0.0.1", 0);
  auto options_for = [&](int rank) {
    CommunicatorOptions options;
    options.rank = rank;
    options.world_size = 2;
    options.timeout = kTimeout;
    options.prefix = "strata/watchdog_test";
    return options;
  };
  std::promise<void> rank0_finished;
  std::exception_ptr rank1_error;
  auto accelerator1 = make_cuda_accelerator(1);
  // Rank 1 joins, then never issues the collective; it leaves once rank 0 is done.
  std::thread rank1([&, finished = rank0_finished.get_future()]() mutable {
    try {
      StoreClient store("127.0.0.1", server.port(), 1, std::chrono::milliseconds(30000));
      auto comm = make_communicator(*accelerator1, store, options_for(1));
      finished.wait();
    } catch (...) {
      rank1_error = std::current_exception();
    }
  });
  struct Finish {
    std::promise<void>& promise;
    std::thread& thread;
    ~Finish() {
      promise.set_value();
      thread.join();
    }
  } finish{rank0_finished, rank1};

  StoreClient store("127.0.0.1", server.port(), 0, std::chrono::milliseconds(30000));
  auto accelerator = make_cuda_accelerator(0);
  auto comm = make_communicator(*accelerator, store, options_for(0));
  auto stream = accelerator->create_stream();
  auto waiter = accelerator->create_stream();
  void* data = accelerator->allocate(1024 * sizeof(float));
  accelerator->memset_async(data, 0, 1024 * sizeof(float), *stream);
  auto reduced = comm->allreduce(data, data, 1024, DType::kF32, ReduceOp::kSum, *stream);
  waiter->wait(*reduced);
  auto waiter_done = accelerator->create_event();
  waiter->record(*waiter_done);
  const auto start = std::chrono::steady_clock::now();
  try {
    reduced->synchronize();
    FAIL("a collective without its peer completed");
  } catch (const Error& e) {
    REQUIRE(e.category() == ErrorCategory::kCommunication);
    REQUIRE_THAT(e.what(), Catch::Contains("allreduce") && Catch::Contains("rank 0 of 2") &&
                               Catch::Contains("timeout 2000 ms"));
  }
  REQUIRE(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));  // hang guard only
  REQUIRE_THROWS_WITH(waiter_done->synchronize(), Catch::Contains("allreduce"));
  REQUIRE_THROWS_WITH(waiter->synchronize(), Catch::Contains("allreduce"));
  REQUIRE_THROWS_WITH(stream->synchronize(), Catch::Contains("allreduce"));
  REQUIRE_THROWS_WITH(comm->barrier(*stream), Catch::Contains("aborted"));
  accelerator->deallocate(data);
}
