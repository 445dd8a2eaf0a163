// BucketReducer: pack → reduce-scatter → accumulate, stream-ordered.
#include "offload/bucket_reducer.h"

#include <algorithm>

#include "core/error.h"

namespace strata::offload {
namespace {
// One bucket being reduced while the next fills; more would only hold memory.
constexpr size_t kMaxBucketsInFlight = 2;

}  // namespace

struct BucketReducer::Bucket {
  struct Entry {
    size_t param;
    const float* grad;
    ReleaseFn release;
  };
  std::vector<Entry> entries;
  int64_t block_numel = 0;  // sum of the entries' slice_numel
  std::unique_ptr<Event> done;
};

BucketReducer::BucketReducer(Accelerator& accelerator, ops::Ops& ops, partition::Communicator& comm,
                             const partition::PartitionLayout& layout, int64_t bucket_numel,
                             GradShard& shard, Stream* stream)
    : accelerator_(accelerator), comm_(comm), layout_(layout), bucket_numel_(bucket_numel),
      shard_(shard), own_stream_(stream == nullptr ? accelerator.create_stream() : nullptr),
      stream_(stream != nullptr ? stream : own_stream_.get()), ctx_(ops.make_context(*stream_)) {
  STRATA_CHECK(layout.world_size() == comm.world_size(), kBadArgument,
               "gradient layout is for world size {}, the communicator has {}", layout.world_size(),
               comm.world_size());
  STRATA_CHECK(bucket_numel >= 1, kBadArgument, "reduce_bucket_size must be >= 1, got {}", bucket_numel);
}

BucketReducer::~BucketReducer() {
  // Queued work reads bucket entries and writes the accumulator.
  try {
    stream_->synchronize();
  } catch (...) {
    // Reported (or never to be reported) by synchronize() on the owner's path.
  }
}

void BucketReducer::add(size_t p, const float* grad, Event& ready, ReleaseFn release) {
  STRATA_CHECK(p < layout_.params().size(), kBadArgument, "gradient of parameter index {} outside the layout ({})",
               p, layout_.params().size());
  const partition::ParamSlot& slot = layout_.param(p);
  const int world = layout_.world_size();
  if (open_ != nullptr && (open_->block_numel + slot.slice_numel) * world > bucket_numel_) flush();
  if (open_ == nullptr) open_ = std::make_unique<Bucket>();
  stream_->wait(ready);
  open_->entries.push_back({p, grad, std::move(release)});
  open_->block_numel += slot.slice_numel;
  if (open_->block_numel * world >= bucket_numel_) flush();
}

void BucketReducer::flush() {
  if (open_ == nullptr) return;
  while (in_flight_.size() >= kMaxBucketsInFlight) {
    in_flight_.front()->done->synchronize();
    in_flight_.pop_front();
  }
  std::unique_ptr<Bucket> bucket = std::move(open_);
  const int world = layout_.world_size();
  if (world == 1) {
    flush_alone(std::move(bucket));
    return;
  }
  const size_t block_numel = static_cast<size_t>(bucket->block_numel);
  auto* recv = static_cast<float*>(accelerator_.allocate(block_numel * sizeof(float)));
  // A bucket of one parameter without padding (an embedding, alone in its
  // bucket) is already rank-major — rank r's slice is block r — and the
  // reduce-scatter only reads its input: it is sent from the gradient itself,
  // without a bucket's copy of it (over 100 MB for an embedding).
  const float* send = nullptr;
  float* packed = nullptr;
  if (bucket->entries.size() == 1) {
    const partition::ParamSlot& slot = layout_.param(bucket->entries.front().param);
    bool rank_major = true;
    for (int r = 0; r < world; ++r) rank_major = rank_major && slot.owned_numel(r) == slot.slice_numel;
    if (rank_major) send = bucket->entries.front().grad;
  }
  if (send == nullptr) {
    packed = static_cast<float*>(accelerator_.allocate(block_numel * world * sizeof(float)));
    send = packed;
    // Rank-major blocks: block r holds every entry's slice r, padding zero.
    // Where no slice has padding the copies below write every element: no
    // memset (an embedding's bucket is over 100 MB).
    size_t owned_total = 0;
    for (const auto& entry : bucket->entries) {
      const partition::ParamSlot& slot = layout_.param(entry.param);
      for (int r = 0; r < world; ++r) owned_total += static_cast<size_t>(std::max<int64_t>(0, slot.owned_numel(r)));
    }
    if (owned_total != block_numel * world) {
      accelerator_.memset_async(packed, 0, block_numel * world * sizeof(float), *stream_);
    }
    size_t offset = 0;
    for (const auto& entry : bucket->entries) {
      const partition::ParamSlot& slot = layout_.param(entry.param);
      for (int r = 0; r < world; ++r) {
        const int64_t owned = slot.owned_numel(r);
        if (owned <= 0) continue;
        accelerator_.copy_async(packed + r * block_numel + offset, entry.grad + slot.owned_begin(r),
                                static_cast<size_t>(owned) * sizeof(float), CopyKind::kDeviceToDevice, *stream_);
      }
      offset += static_cast<size_t>(slot.slice_numel);
    }
  }
  comm_.reduce_scatter(send, recv, block_numel, DType::kF32, partition::ReduceOp::kSum, *stream_);
  size_t offset = 0;
  for (const auto& entry : bucket->entries) {
    const partition::ParamSlot& slot = layout_.param(entry.param);
    shard_.accumulate(entry.param, recv + offset, *stream_, *ctx_);
    offset += static_cast<size_t>(slot.slice_numel);
  }
  finish(std::move(bucket), packed, recv);
}

void BucketReducer::flush_alone(std::unique_ptr<Bucket> bucket) {
  // A world of one: the reduce-scatter is the identity, so there is nothing to
  // pack or send — each gradient is added to the shard where backward wrote
  // it (a model's worth of gradients per micro-batch not copied twice: the
  // single-device offload's common case). Only a padded slice (a norm's
  // weight rounded up to the alignment) is copied, into a zeroed block, since
  // the shard adds whole slices. The same adds in the same order: the same bits.
  size_t padded_numel = 0;
  for (const auto& entry : bucket->entries) {
    const partition::ParamSlot& slot = layout_.param(entry.param);
    if (slot.owned_numel(0) != slot.slice_numel) padded_numel += static_cast<size_t>(slot.slice_numel);
  }
  float* padded = nullptr;
  if (padded_numel > 0) {
    padded = static_cast<float*>(accelerator_.allocate(padded_numel * sizeof(float)));
    accelerator_.memset_async(padded, 0, padded_numel * sizeof(float), *stream_);
  }
  size_t offset = 0;
  for (const auto& entry : bucket->entries) {
    const partition::ParamSlot& slot = layout_.param(entry.param);
    if (slot.owned_numel(0) == slot.slice_numel) {
      shard_.accumulate(entry.param, entry.grad, *stream_, *ctx_);
      continue;
    }
    accelerator_.copy_async(padded + offset, entry.grad, static_cast<size_t>(slot.owned_numel(0)) * sizeof(float),
                            CopyKind::kDeviceToDevice, *stream_);
    shard_.accumulate(entry.param, padded + offset, *stream_, *ctx_);
    offset += static_cast<size_t>(slot.slice_numel);
  }
  finish(std::move(bucket), padded, nullptr);
}

void BucketReducer::finish(std::unique_ptr<Bucket> bucket, float* packed, float* recv) {
  if (landed_) {
    std::vector<size_t> params;
    for (const auto& entry : bucket->entries) params.push_back(entry.param);
    stream_->launch_host_func([fn = landed_, params = std::move(params)] { fn(params); });
  }
  bucket->done = accelerator_.create_event();
  stream_->record(*bucket->done);
  if (packed != nullptr) accelerator_.deallocate_after(packed, *bucket->done);
  if (recv != nullptr) accelerator_.deallocate_after(recv, *bucket->done);
  for (auto& entry : bucket->entries) {
    if (entry.release) entry.release(*bucket->done);
  }
  in_flight_.push_back(std::move(bucket));
}

void BucketReducer::synchronize() {
  flush();
  stream_->synchronize();
  in_flight_.clear();
}

}  // namespace strata::offload
