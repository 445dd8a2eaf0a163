// The ZeRO stage rules (DESIGN.md §5) as operations over a Communicator and a
// PartitionLayout, independent of the engine:
//   stage 1: optimizer state sharded; full gradients are kept per rank and
//            allreduced (in reduce_bucket_numel buckets) at the accumulation
//            boundary, then each rank keeps its shard; updated parameters are allgathered.
//   stage 2: gradients reduce-scattered in reduce_bucket_numel buckets as backward
//            produces them; each rank accumulates only its shard.
//   stage 3: stage 2, plus parameters gathered on demand and released after use.
// Gradients are summed in fp32 and divided once by world_size * micro_steps at
// the boundary, so the result equals the gradient of one rank over the combined batch.
//
// Memory: these helpers run their host-side work (bucket packing, fp32
// accumulation) on the communicator stream's host thread, so buffers must be
// host-visible: the cpu accelerator. The cuda engine replaces them with kernels.
// Ownership: objects borrow the Communicator, Accelerator, Stream and layout.
// Thread-safety: one thread drives an object.
// Throws: strata::Error (kBadArgument for misuse, kCommunication from collectives).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "partition/communicator.h"
#include "partition/layout.h"

namespace strata::partition {

enum class ZeroStage { kStage1 = 1, kStage2 = 2, kStage3 = 3 };

// DeepSpeed's reduce_bucket_size default (elements).
inline constexpr int64_t kDefaultReduceBucketNumel = 500'000'000;

class GradientReducer {
 public:
  GradientReducer(Communicator& comm, Accelerator& accelerator, Stream& stream, const PartitionLayout& layout,
                  ZeroStage stage, int64_t reduce_bucket_numel = kDefaultReduceBucketNumel);
  ~GradientReducer();

  // Hands over the whole gradient of parameter p (numel elements of its dtype),
  // as produced by this rank's backward; copied before returning. Stage 2/3:
  // when the open bucket would exceed reduce_bucket_numel it is reduce-scattered
  // asynchronously on the stream while backward goes on.
  void add(size_t p, const void* grad);
  // Accumulation boundary after `micro_steps` backward passes: reduces what is
  // left, waits, and makes gradient_shard() the average over ranks and micro-steps.
  void finish(int micro_steps);
  // This rank's averaged gradient shard: layout.shard_numel() fp32 values (padding is 0).
  const std::vector<float>& gradient_shard() const { return shard_; }
  // Starts a new accumulation window.
  void zero();
  // Number of collectives issued so far (for tests and traces).
  int64_t collectives_issued() const { return collectives_; }

 private:
  struct Bucket;
  void flush();
  void reduce_full_gradients();

  Communicator& comm_;
  Accelerator& accelerator_;
  Stream& stream_;
  const PartitionLayout& layout_;
  ZeroStage stage_;
  int64_t reduce_bucket_numel_;
  std::vector<float> shard_;
  std::vector<std::vector<float>> full_;  // stage 1: this rank's summed full gradients
  std::unique_ptr<Bucket> open_;
  std::deque<std::unique_ptr<Bucket>> in_flight_;
  int64_t collectives_ = 0;
};

// Allgathers parameters from their shards: all of them after the optimizer
// step (stages 1 and 2), or one at a time on demand (stage 3).
class ParameterGatherer {
 public:
  ParameterGatherer(Communicator& comm, Accelerator& accelerator, Stream& stream, const PartitionLayout& layout);
  ~ParameterGatherer();

  // Stage 3: gathers parameter p from `shard` (this rank's shard, shard_nbytes)
  // into a buffer from the accelerator holding its numel elements (then padding)
  // and returns it; waits for the allgather. A second fetch before release
  // returns the same buffer.
  const void* fetch(size_t p, const void* shard);
  // Frees the gathered buffer of p.
  void release(size_t p);
  // Bytes of gathered parameters currently held.
  size_t live_nbytes() const { return live_nbytes_; }

  // Stages 1/2: gathers every parameter into params[p] (numel elements each).
  void gather_all(const void* shard, const std::vector<void*>& params);

 private:
  Communicator& comm_;
  Accelerator& accelerator_;
  Stream& stream_;
  const PartitionLayout& layout_;
  std::vector<void*> gathered_;
  size_t live_nbytes_ = 0;
};

}  // namespace strata::partition
