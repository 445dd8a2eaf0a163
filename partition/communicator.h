// Collectives for data parallelism (DESIGN.md §5): allgather into a flat
// buffer, reduce-scatter, allreduce, broadcast and barrier, each enqueued on an
// accelerator stream and returning an event that completes with it. Gloo (TCP)
// serves the cpu accelerator, NCCL the cuda one; make_communicator chooses.
//
// Every rank must issue the same collectives in the same order. Buffers must
// stay valid until the returned event completes.
//
// Events: the returned event is an ordinary Event of the accelerator, recorded
// on `stream` after the collective: Stream::wait / record of that accelerator's
// streams accept it, and Accelerator::deallocate_after may free buffers after it.
//
// Ownership: a Communicator borrows the Accelerator and the Rendezvous store,
// which must outlive it.
// Thread-safety: submit collectives from one thread at a time.
// Errors: a failed collective (a dead peer, a timeout) becomes the stream's
// error at the collective (see Stream in accelerator.h): the returned event's
// synchronize, the stream's later events and synchronize, and streams that
// waited on those events throw strata::Error(kCommunication) naming the
// operation, this rank, the timeout and, when the rendezvous store knows it,
// the rank that died. A peer's death is reported within
// CommunicatorOptions::timeout whether a host thread or a stream waits: Gloo
// runs each collective on the stream's thread with that timeout; NCCL has a
// watchdog thread per communicator that polls for asynchronous errors and for
// collectives running longer than the timeout on the device (counted from when
// the collective starts there), marks the collectives in flight failed and
// aborts the communicator so that their kernels end. The communicator is
// unusable afterwards: NCCL's later collectives throw Error(kCommunication) at
// once; Gloo's fail like the first (on the failed stream they are skipped and
// report its error).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "partition/store.h"
#include "core/accelerator.h"
#include "core/dtype.h"

namespace strata::partition {

enum class ReduceOp { kSum, kAverage };
std::string_view reduce_op_name(ReduceOp op);

struct CommunicatorOptions {
  int rank = 0;
  int world_size = 1;
  // Bound on every collective and on connecting; a dead peer is reported within it.
  std::chrono::milliseconds timeout{30'000};
  // Store keys of this communicator start with it (several communicators may share a store).
  std::string prefix = "strata/comm";
  // Address other ranks use to reach this one over TCP (Gloo). Empty: 127.0.0.1
  // when the store is on a loopback address, else this host's name.
  std::string hostname;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string_view backend() const = 0;  // "gloo" or "nccl"

  // recv[r * numel + i] = rank r's send[i]; recv holds world_size * numel elements.
  virtual std::unique_ptr<Event> allgather(const void* send, void* recv, size_t numel, DType dtype,
                                           Stream& stream) = 0;
  // send holds world_size * numel elements; recv (numel) gets the reduction of
  // every rank's block `rank()`.
  virtual std::unique_ptr<Event> reduce_scatter(const void* send, void* recv, size_t numel, DType dtype,
                                                ReduceOp op, Stream& stream) = 0;
  // recv (numel) = reduction of every rank's send; send == recv is allowed.
  virtual std::unique_ptr<Event> allreduce(const void* send, void* recv, size_t numel, DType dtype,
                                           ReduceOp op, Stream& stream) = 0;
  // data (numel) on every rank becomes root's data.
  virtual std::unique_ptr<Event> broadcast(void* data, size_t numel, DType dtype, int root,
                                           Stream& stream) = 0;
  virtual std::unique_ptr<Event> barrier(Stream& stream) = 0;
};

// Gloo over TCP; buffers must be host memory. Connects to all peers (full mesh)
// through `store` before returning.
std::unique_ptr<Communicator> make_gloo_communicator(Accelerator& accelerator, StoreClient& store,
                                                     const CommunicatorOptions& options);
// NCCL; buffers must be device memory of `accelerator` (cuda). Rank 0 publishes
// the NCCL unique id through `store`. Throws Error(kCuda) in builds without CUDA.
std::unique_ptr<Communicator> make_nccl_communicator(Accelerator& accelerator, StoreClient& store,
                                                     const CommunicatorOptions& options);
// NCCL for a cuda accelerator, Gloo for cpu.
std::unique_ptr<Communicator> make_communicator(Accelerator& accelerator, StoreClient& store,
                                                const CommunicatorOptions& options);

}  // namespace strata::partition
