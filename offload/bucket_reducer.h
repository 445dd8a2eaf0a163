// BucketReducer: the gradient path of the ZeRO engine (docs/DESIGN.md §5.2). Full
// fp32 gradients of whole parameters are packed into buckets of about
// `bucket_numel` elements as they become complete, each bucket is
// reduce-scattered (summed in fp32) on the reducer's own stream and
// communicator, and this rank's block is added into its fp32 gradient shard
// accumulator — while backward goes on. In a world of one, where the
// reduce-scatter is the identity, each gradient is added to the accumulator
// where it lies (no pack, no collective; a padded slice alone is copied into
// a zeroed block): the same adds, the same bits.
//
// Works on any accelerator: packing is stream-ordered copies, accumulation is
// GradShard::accumulate on the reducer's stream; nothing waits on the host except
// synchronize() (and add() when kMaxBucketsInFlight buckets are still in flight).
//
// Ownership: borrows the accelerator, the Ops, the communicator, the layout and
// the gradient shard (and a given stream), which must outlive it. It owns its
// bucket buffers and, when none is given, its stream.
// Thread-safety: one thread drives it.
// Errors: kBadArgument for misuse; a failed collective or copy surfaces from
// synchronize() (and from every later bucket's event) as the stream's error.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "kernels/ops.h"
#include "partition/communicator.h"
#include "partition/layout.h"
#include "offload/grad_shard.h"

namespace strata::offload {

class BucketReducer {
 public:
  // `stream`: where its copies, collectives and accumulation run — borrowed,
  // to be shared by every reducer over the same communicator (the collectives
  // of one communicator must run on one stream, in the order they were
  // submitted, on every rank); null: a stream of its own.
  BucketReducer(Accelerator& accelerator, ops::Ops& ops, partition::Communicator& comm,
                const partition::PartitionLayout& layout, int64_t bucket_numel, GradShard& shard,
                Stream* stream = nullptr);
  ~BucketReducer();
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  // Called with the event after which a handed-over gradient is no longer read.
  using ReleaseFn = std::function<void(Event& consumed)>;
  // Hands over parameter p's full fp32 gradient (layout.param(p).numel
  // elements, accelerator memory), final once `ready` completes (the reducer's
  // stream waits on it; the caller may re-record `ready` afterwards). `release`
  // (may be empty) is called once the bucket holding p is enqueued, with an
  // event after which `grad` is no longer read. Buckets fill in call order and
  // are reduced when full.
  void add(size_t p, const float* grad, Event& ready, ReleaseFn release = {});
  // Called on a host thread (a host function on the reducer's stream) once a
  // bucket's blocks are added into the shard, with the layout indexes of its
  // parameters; buckets in order. Not called for a bucket whose work failed.
  // The function must not block on this reducer's stream. Set before add().
  using LandedFn = std::function<void(const std::vector<size_t>& params)>;
  void set_landed_callback(LandedFn fn) { landed_ = std::move(fn); }
  // Reduces the open bucket (if any) without waiting.
  void flush();
  // flush(), then waits until every bucket has been added into the shard; rethrows the first failure.
  void synchronize();

  Stream& stream() { return *stream_; }

 private:
  struct Bucket;
  // flush() in a world of one: each gradient added to the shard in place.
  void flush_alone(std::unique_ptr<Bucket> bucket);
  // After the accumulation is queued: the landed callback, the bucket's event,
  // the releases (packed and recv may be nullptr); the bucket joins in_flight_.
  void finish(std::unique_ptr<Bucket> bucket, float* packed, float* recv);
  Accelerator& accelerator_;
  partition::Communicator& comm_;
  const partition::PartitionLayout& layout_;
  int64_t bucket_numel_;
  GradShard& shard_;
  std::unique_ptr<Stream> own_stream_;  // when no stream was given
  Stream* stream_;
  std::unique_ptr<ops::ComputeContext> ctx_;
  std::unique_ptr<Bucket> open_;
  std::deque<std::unique_ptr<Bucket>> in_flight_;
  LandedFn landed_;
};

}  // namespace strata::offload
