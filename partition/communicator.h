// Collectives for data, tensor and expert parallelism (DESIGN.md §5):
// allgather into a flat buffer, reduce-scatter, allreduce, broadcast, barrier
// and all-to-all with counts per peer — and point-to-point sends and receives
// for pipeline parallelism (exchange) —, each enqueued on an accelerator
// stream and returning an event that completes with it. Gloo (TCP) serves the cpu
// accelerator, NCCL the cuda one; make_communicator chooses. A communicator
// spans the whole job or one process group of it (process_groups.h).
//
// Every rank must issue the same collectives in the same order; a
// point-to-point exchange involves only the ranks it names (see exchange).
// Buffers must stay valid until the returned event completes.
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
// operation, this rank, the timeout, the group (CommunicatorOptions::group)
// and, when the rendezvous store knows it, the rank that died. Ranks in
// errors are the job's ranks (CommunicatorOptions::members), not a group's. A peer's death is reported within
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
#include <span>
#include <string>
#include <string_view>
#include <vector>

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
  // A communicator over some of the job's ranks (make_group_communicator sets
  // both): what errors call the group, e.g. "tp group 1 (ranks 2,3)", and the
  // job rank of each member (members[i] is this communicator's rank i), so that
  // errors name ranks as the job knows them. Empty: the whole job.
  std::string group;
  std::vector<int> members;
  // What errors call member i in place of "rank <job rank>" when it is a
  // peer of a point-to-point transfer, e.g. "pp stage 1 (ranks 2,3)" (a
  // pipeline group names its members by their stages). Empty: ranks.
  std::vector<std::string> member_names;
};

// One side of a point-to-point transfer (Communicator::exchange). The sender
// names what it sends, the receiver what it expects: the same dtype, shape
// and tag (the caller's meaning of the transfer: which activation or
// gradient); `what` says it in words for errors ("activation of micro-batch
// 3 for virtual stage 2"; at most 95 bytes are carried to the peer).
struct P2POp {
  enum class Kind : uint8_t { kSend, kRecv };
  Kind kind = Kind::kSend;
  int peer = 0;           // the other side: a rank of this communicator, not this one
  void* data = nullptr;   // kSend: read from; kRecv: written (shape_numel(shape) elements)
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t tag = 0;
  std::string what;

  static P2POp send(int peer, const void* data, DType dtype, Shape shape, uint64_t tag, std::string what) {
    return {Kind::kSend, peer, const_cast<void*>(data), dtype, std::move(shape), tag, std::move(what)};
  }
  static P2POp recv(int peer, void* data, DType dtype, Shape shape, uint64_t tag, std::string what) {
    return {Kind::kRecv, peer, data, dtype, std::move(shape), tag, std::move(what)};
  }
  size_t numel() const { return static_cast<size_t>(shape_numel(shape)); }
};

// The blocks of an all_to_all, in elements of its one dtype (MPI's
// alltoallv): this rank sends send_counts[p] elements starting at element
// send_displs[p] of `send` to rank p, and receives recv_counts[p] elements from
// rank p into `recv` starting at element recv_displs[p]. Each vector has one
// entry per rank of the communicator.
//
// Counts are known to both sides: rank q's send_counts[p] must equal rank p's
// recv_counts[q] for every pair. The caller agrees them beforehand (e.g. an
// all_to_all or allgather of the counts). Gloo checks it (each pair swaps its
// counts before the blocks move) and fails the collective on both ranks of a
// pair that disagrees, naming the counts; NCCL cannot without making the host
// wait for the device, and there a mismatch is undefined (a hang until the
// watchdog's timeout, or wrong bytes). What one rank can check is
// checked when the collective is submitted (Error(kBadArgument), thrown there):
// one entry per rank, send_counts[me] == recv_counts[me], receive blocks that
// do not overlap, and send and receive extents that do not overlap (no in-place).
// Zero counts are allowed anywhere (a rank may send or receive nothing).
struct AllToAllSplits {
  std::vector<size_t> send_counts, send_displs;
  std::vector<size_t> recv_counts, recv_displs;

  // `numel` elements to and from every rank, blocks in rank order: block p of
  // `send` goes to rank p, block p of `recv` comes from rank p (MPI_Alltoall).
  static AllToAllSplits even(int world_size, size_t numel);
  // The given counts with blocks packed in rank order (each displacement is the
  // sum of the counts before it), as a permutation by destination lays them out.
  static AllToAllSplits packed(std::vector<size_t> send_counts, std::vector<size_t> recv_counts);
  // The way back: what was sent is received and what was received is sent,
  // block for block (an exchange's answer).
  AllToAllSplits reversed() const { return {recv_counts, recv_displs, send_counts, send_displs}; }
  size_t send_total() const;  // elements sent, the own block included
  size_t recv_total() const;
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
  // Rank p's block for this rank (splits, above) lands in this rank's block
  // from p; the own block is copied. The splits are copied at submission.
  // Even blocks: all_to_all(send, recv, AllToAllSplits::even(world_size(), n), dtype, stream).
  virtual std::unique_ptr<Event> all_to_all(const void* send, void* recv, const AllToAllSplits& splits,
                                            DType dtype, Stream& stream) = 0;
  // Point-to-point (pipeline parallelism): the sends and receives of `ops`,
  // posted together and complete together (NCCL's group; Megatron's
  // batch_isend_irecv), ordered on `stream` like a collective. Only the
  // peers named take part. Pairing: this rank's n-th send to rank q is rank
  // q's n-th receive from this rank, counted over every exchange in
  // submission order (ops of one call in their order), whatever stream each
  // runs on. An exchange waits until its peers have posted the matching
  // sides, so two ranks that both send first and receive in a later call on
  // the same stream deadlock: put a pair's crossing transfers in one call, or
  // send from another stream (runtime/pipeline/executor.h). Refused when submitted (Error(kBadArgument)): a
  // peer outside the communicator or this rank itself, a null buffer of a
  // non-empty shape, an empty ops list. Gloo checks that the two sides agree
  // (dtype, shape, tag) before any data moves — each side sends the other its
  // description — and fails the exchange on both ranks of a pair that
  // disagrees, naming both descriptions and the peer (CommunicatorOptions::
  // member_names); NCCL cannot without a host wait, and there a mismatch is
  // undefined (as all_to_all's counts). A dead peer fails it within the
  // timeout, naming the peer. Progress: a send completes once its receiver
  // has posted the matching receive, a receive once its sender has posted
  // the send (both backends: NCCL's group, Gloo's rendezvous); on Gloo the
  // sends of one exchange move in the order given.
  virtual std::unique_ptr<Event> exchange(std::span<const P2POp> ops, Stream& stream) = 0;
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
