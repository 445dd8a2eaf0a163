// The NCCL communicator on a real GPU (SKIPPED without one). One GPU allows one
// rank (NCCL refuses two ranks on one device), so these check the wiring:
// unique id through the store, stream ordering, dtypes, events, results.
#include <catch2/catch.hpp>

#include "partition/communicator.h"
#include "partition/store.h"
#include "runtime/core/accelerator.h"

using namespace strata;
using namespace strata::partition;

TEST_CASE("nccl: single-rank collectives through the rendezvous store give exact results") {
  StoreServer server("127.0.0.1", 0);
  StoreClient store("127.0.0.1", server.port(), 0, std::chrono::milliseconds(10000));
  auto accelerator = make_cuda_accelerator(0);
  auto stream = accelerator->create_stream();
  CommunicatorOptions options;
  options.timeout = std::chrono::milliseconds(10000);
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
