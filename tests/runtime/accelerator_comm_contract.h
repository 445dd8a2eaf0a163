// The accelerator contract for communicators' events, run with Gloo on the cpu
// backend (accelerator_cpu_test.cc) and NCCL on cuda (tests/partition/nccl_test.cc).
// Checks use STRATA_CHECK, not Catch assertions, because they run on rank
// threads; a failed check throws strata::Error.
#pragma once

#include <cstddef>
#include <vector>

#include "partition/communicator.h"
#include "core/accelerator.h"
#include "core/error.h"

namespace strata::test {

// (a) A collective's event is an event of the accelerator: another stream can
// wait on it, record it again, and free the collective's buffer after it.
inline void check_collective_event_in_streams(Accelerator& acc, partition::Communicator& comm) {
  constexpr size_t kNumel = 4099;
  constexpr size_t kNbytes = kNumel * sizeof(float);
  const int world = comm.world_size();
  auto comm_stream = acc.create_stream();
  auto compute = acc.create_stream();
  auto* host = static_cast<float*>(acc.allocate_pinned(kNbytes));
  auto* result = static_cast<float*>(acc.allocate_pinned(kNbytes));
  for (size_t i = 0; i < kNumel; ++i) {
    host[i] = static_cast<float>(comm.rank() + 1) + static_cast<float>(i % 7);
    result[i] = -1.0f;
  }
  void* buffer = acc.allocate(kNbytes);
  acc.copy_async(buffer, host, kNbytes, CopyKind::kHostToDevice, *comm_stream);
  auto reduced = comm.allreduce(buffer, buffer, kNumel, DType::kF32, partition::ReduceOp::kSum, *comm_stream);
  compute->wait(*reduced);
  acc.copy_async(result, buffer, kNbytes, CopyKind::kDeviceToHost, *compute);
  auto copied = acc.create_event();
  compute->record(*copied);
  acc.deallocate_after(buffer, *copied);
  compute->record(*reduced);  // the collective's event can be recorded like any other
  reduced->synchronize();
  compute->synchronize();
  comm_stream->synchronize();
  const float ranks_sum = static_cast<float>(world * (world + 1) / 2);
  for (size_t i = 0; i < kNumel; ++i) {
    const float expected = ranks_sum + static_cast<float>(world) * static_cast<float>(i % 7);
    STRATA_CHECK(result[i] == expected, kInternal, "rank {}: element {} is {}, expected {}", comm.rank(), i,
                 result[i], expected);
  }
  acc.deallocate_pinned(host);
  acc.deallocate_pinned(result);
}

}  // namespace strata::test
