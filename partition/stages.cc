// Gradient reduction and parameter gathering for ZeRO stages 1, 2 and 3.
#include "partition/stages.h"

#include <algorithm>
#include <cstring>

#include "runtime/core/error.h"

namespace strata::partition {
namespace {
constexpr size_t kMaxBucketsInFlight = 2;  // one being reduced while the next fills

void accumulate_as_float(const void* src, DType dtype, float* dst, int64_t numel) {
  for (int64_t i = 0; i < numel; ++i) dst[i] += load_as_float(src, dtype, static_cast<size_t>(i));
}
}  // namespace

// Gradients of consecutive add() calls of one dtype, waiting to be reduce-scattered.
struct GradientReducer::Bucket {
  DType dtype = DType::kF32;
  std::vector<size_t> params;
  std::vector<size_t> staging_offsets_nbytes;  // where each param's whole gradient sits in staging
  std::vector<char> staging;                   // whole gradients, back to back
  int64_t block_numel = 0;                     // sum of the params' slice_numel
  std::vector<char> send, recv;                // rank-major blocks; this rank's reduced block
  std::unique_ptr<Event> done;
};

GradientReducer::GradientReducer(Communicator& comm, Accelerator& accelerator, Stream& stream,
                                 const PartitionLayout& layout, ZeroStage stage, int64_t reduce_bucket_numel)
    : comm_(comm), accelerator_(accelerator), stream_(stream), layout_(layout), stage_(stage),
      reduce_bucket_numel_(reduce_bucket_numel) {
  STRATA_CHECK(layout.world_size() == comm.world_size(), kBadArgument,
               "layout is for world size {}, communicator has {}", layout.world_size(), comm.world_size());
  STRATA_CHECK(reduce_bucket_numel >= 1, kBadArgument, "reduce_bucket_size must be >= 1, got {}",
               reduce_bucket_numel);
  STRATA_CHECK(accelerator.backend() == Backend::kCpu, kBadArgument,
               "GradientReducer works on host-visible buffers (cpu accelerator), got {}", accelerator.name());
  zero();
}

GradientReducer::~GradientReducer() {
  // Buckets still referenced by queued stream work must outlive it.
  try {
    stream_.synchronize();
  } catch (const std::exception&) {
  }
}

void GradientReducer::zero() {
  // A window abandoned without finish(): let queued buckets drain and drop the
  // open one, so no stale gradient reaches the next window.
  stream_.synchronize();
  in_flight_.clear();
  open_.reset();
  shard_.assign(static_cast<size_t>(layout_.shard_numel()), 0.0f);
  if (stage_ == ZeroStage::kStage1) {
    full_.resize(layout_.params().size());
    for (size_t p = 0; p < full_.size(); ++p) full_[p].assign(static_cast<size_t>(layout_.param(p).numel), 0.0f);
  }
}

void GradientReducer::add(size_t p, const void* grad) {
  STRATA_CHECK(p < layout_.params().size(), kBadArgument, "parameter index {} outside the layout ({} params)", p,
               layout_.params().size());
  const ParamSlot& slot = layout_.param(p);
  if (stage_ == ZeroStage::kStage1) {
    accumulate_as_float(grad, slot.dtype, full_[p].data(), slot.numel);
    return;
  }
  int64_t padded_numel = slot.slice_numel * layout_.world_size();
  if (open_ != nullptr && (open_->dtype != slot.dtype ||
                           (open_->block_numel * layout_.world_size() + padded_numel > reduce_bucket_numel_))) {
    flush();
  }
  if (open_ == nullptr) {
    open_ = std::make_unique<Bucket>();
    open_->dtype = slot.dtype;
  }
  size_t nbytes = static_cast<size_t>(slot.numel) * dtype_nbytes(slot.dtype);
  open_->params.push_back(p);
  open_->staging_offsets_nbytes.push_back(open_->staging.size());
  open_->staging.insert(open_->staging.end(), static_cast<const char*>(grad), static_cast<const char*>(grad) + nbytes);
  open_->block_numel += slot.slice_numel;
  if (open_->block_numel * layout_.world_size() >= reduce_bucket_numel_) flush();
}

void GradientReducer::flush() {
  if (open_ == nullptr) return;
  while (in_flight_.size() >= kMaxBucketsInFlight) {
    in_flight_.front()->done->synchronize();
    in_flight_.pop_front();
  }
  Bucket* bucket = open_.get();
  int world = layout_.world_size();
  // Gradients are widened to fp32 while packing and summed across ranks in
  // fp32 (stages.h): a 16-bit ring would round after every hop.
  bucket->send.assign(static_cast<size_t>(bucket->block_numel * world) * sizeof(float), 0);
  bucket->recv.assign(static_cast<size_t>(bucket->block_numel) * sizeof(float), 0);
  // Pack into rank-major blocks on the stream, so the caller's backward goes on.
  stream_.launch_host_func([this, bucket, world] {
    float* send = reinterpret_cast<float*>(bucket->send.data());
    const size_t element_nbytes = dtype_nbytes(bucket->dtype);
    for (int r = 0; r < world; ++r) {
      size_t block_offset = static_cast<size_t>(r * bucket->block_numel);
      for (size_t i = 0; i < bucket->params.size(); ++i) {
        const ParamSlot& slot = layout_.param(bucket->params[i]);
        const size_t owned_numel = static_cast<size_t>(slot.owned_numel(r));
        if (owned_numel > 0) {
          convert(bucket->staging.data() + bucket->staging_offsets_nbytes[i] + slot.owned_begin(r) * element_nbytes,
                  bucket->dtype, send + block_offset, DType::kF32, owned_numel);
        }
        block_offset += static_cast<size_t>(slot.slice_numel);
      }
    }
  });
  comm_.reduce_scatter(bucket->send.data(), bucket->recv.data(), static_cast<size_t>(bucket->block_numel),
                       DType::kF32, ReduceOp::kSum, stream_);
  ++collectives_;
  stream_.launch_host_func([this, bucket] {
    const float* recv = reinterpret_cast<const float*>(bucket->recv.data());
    size_t offset = 0;
    for (size_t p : bucket->params) {
      const ParamSlot& slot = layout_.param(p);
      accumulate_as_float(recv + offset, DType::kF32, shard_.data() + slot.shard_offset_numel, slot.slice_numel);
      offset += static_cast<size_t>(slot.slice_numel);
    }
  });
  bucket->done = accelerator_.create_event();
  stream_.record(*bucket->done);
  in_flight_.push_back(std::move(open_));
}

void GradientReducer::reduce_full_gradients() {
  // Stage 1: allreduce the summed full gradients in buckets of whole parameters.
  std::vector<float> bucket;
  std::vector<size_t> members;
  auto reduce = [&] {
    if (members.empty()) return;
    comm_.allreduce(bucket.data(), bucket.data(), bucket.size(), DType::kF32, ReduceOp::kSum, stream_)->synchronize();
    ++collectives_;
    size_t offset = 0;
    for (size_t p : members) {
      const ParamSlot& slot = layout_.param(p);
      int64_t owned = slot.owned_numel(comm_.rank());
      if (owned > 0) {
        std::copy_n(bucket.data() + offset + slot.owned_begin(comm_.rank()), owned,
                    shard_.data() + slot.shard_offset_numel);
      }
      offset += static_cast<size_t>(slot.numel);
    }
    bucket.clear();
    members.clear();
  };
  for (size_t p = 0; p < full_.size(); ++p) {
    if (!members.empty() && static_cast<int64_t>(bucket.size() + full_[p].size()) > reduce_bucket_numel_) reduce();
    bucket.insert(bucket.end(), full_[p].begin(), full_[p].end());
    members.push_back(p);
  }
  reduce();
}

void GradientReducer::finish(int micro_steps) {
  STRATA_CHECK(micro_steps >= 1, kBadArgument, "micro_steps must be >= 1, got {}", micro_steps);
  if (stage_ == ZeroStage::kStage1) {
    reduce_full_gradients();
  } else {
    flush();
    stream_.synchronize();
    in_flight_.clear();
  }
  // One division of the fp32 sum: the same rounding as one rank averaging the combined batch.
  float divisor = static_cast<float>(layout_.world_size()) * static_cast<float>(micro_steps);
  for (float& value : shard_) value /= divisor;
}

ParameterGatherer::ParameterGatherer(Communicator& comm, Accelerator& accelerator, Stream& stream,
                                     const PartitionLayout& layout)
    : comm_(comm), accelerator_(accelerator), stream_(stream), layout_(layout),
      gathered_(layout.params().size(), nullptr) {
  STRATA_CHECK(layout.world_size() == comm.world_size(), kBadArgument,
               "layout is for world size {}, communicator has {}", layout.world_size(), comm.world_size());
}

ParameterGatherer::~ParameterGatherer() {
  for (size_t p = 0; p < gathered_.size(); ++p) {
    if (gathered_[p] != nullptr) accelerator_.deallocate(gathered_[p]);
  }
}

const void* ParameterGatherer::fetch(size_t p, const void* shard) {
  STRATA_CHECK(p < gathered_.size(), kBadArgument, "parameter index {} outside the layout", p);
  if (gathered_[p] != nullptr) return gathered_[p];
  const ParamSlot& slot = layout_.param(p);
  size_t nbytes = slot.slice_nbytes() * static_cast<size_t>(layout_.world_size());
  void* full = accelerator_.allocate(nbytes);
  try {
    comm_.allgather(static_cast<const char*>(shard) + slot.shard_offset_nbytes, full,
                    static_cast<size_t>(slot.slice_numel), slot.dtype, stream_)
        ->synchronize();
  } catch (...) {
    accelerator_.deallocate(full);
    throw;
  }
  gathered_[p] = full;
  live_nbytes_ += nbytes;
  return full;
}

void ParameterGatherer::release(size_t p) {
  STRATA_CHECK(p < gathered_.size() && gathered_[p] != nullptr, kBadArgument,
               "release of parameter {} that is not gathered", p);
  accelerator_.deallocate(gathered_[p]);
  gathered_[p] = nullptr;
  live_nbytes_ -= layout_.param(p).slice_nbytes() * static_cast<size_t>(layout_.world_size());
}

void ParameterGatherer::gather_all(const void* shard, const std::vector<void*>& params) {
  STRATA_CHECK(params.size() == layout_.params().size(), kBadArgument, "gather_all needs {} outputs, got {}",
               layout_.params().size(), params.size());
  for (size_t p = 0; p < params.size(); ++p) {
    const void* full = fetch(p, shard);
    const ParamSlot& slot = layout_.param(p);
    std::memcpy(params[p], full, static_cast<size_t>(slot.numel) * dtype_nbytes(slot.dtype));
    release(p);
  }
}

}  // namespace strata::partition
