// GradShard: the fp32 gradient shard in accelerator memory or in a file.
#include "offload/grad_shard.h"

#include <algorithm>
#include <cstring>

#include "nvme/aio_handle.h"
#include "nvme/swap_space.h"
#include "core/error.h"

namespace strata::offload {
namespace {

TensorView fp32_view(float* data, int64_t numel, Tier tier) {
  return TensorView{TensorDesc{DType::kF32, {numel}, tier}, data};
}

}  // namespace

GradShard::GradShard(Accelerator& accelerator, ops::Ops& ops, const partition::PartitionLayout& layout)
    : accelerator_(accelerator), ops_(ops), layout_(layout) {
  const size_t nbytes = static_cast<size_t>(layout.shard_numel()) * sizeof(float);
  memory_ = static_cast<float*>(accelerator.allocate(nbytes));
  auto stream = accelerator.create_stream();
  accelerator.memset_async(memory_, 0, nbytes, *stream);
  stream->synchronize();
}

GradShard::GradShard(Accelerator& accelerator, ops::Ops& ops, const partition::PartitionLayout& layout,
                     nvme::AioHandle& aio, nvme::SwapSpace& swap, const std::string& key)
    : accelerator_(accelerator), ops_(ops), layout_(layout), aio_(&aio) {
  file_ = &swap.create({key, static_cast<uint64_t>(layout.shard_numel()) * sizeof(float)});
  written_.assign(layout.params().size(), 0);
  for (const auto& slot : layout.params()) {
    scratch_numel_ = std::max(scratch_numel_, static_cast<size_t>(slot.slice_numel));
  }
  if (scratch_numel_ > 0) {
    scratch_ = static_cast<float*>(accelerator.allocate_pinned(2 * scratch_numel_ * sizeof(float)));
  }
}

GradShard::~GradShard() {
  if (memory_ != nullptr) accelerator_.deallocate(memory_);
  if (scratch_ != nullptr) accelerator_.deallocate_pinned(scratch_);
  if (window_ != nullptr) accelerator_.deallocate_pinned(window_);
}

void GradShard::accumulate(size_t p, const float* block, Stream& stream, ops::ComputeContext& ctx) {
  const partition::ParamSlot& slot = layout_.param(p);
  if (slot.slice_numel == 0) return;
  if (memory_ != nullptr) {
    const TensorView accum = fp32_view(memory_ + slot.shard_offset_numel, slot.slice_numel, Tier::kDevice);
    ops_.add(ctx, accum, fp32_view(const_cast<float*>(block), slot.slice_numel, Tier::kDevice), accum);
    return;
  }
  // The block lands in the aligned pinned scratch (O_DIRECT), then a host
  // function on the same stream writes it, or adds it to what is on disk.
  // Later blocks' copies queue behind that function, so one scratch serves all.
  const size_t nbytes = static_cast<size_t>(slot.slice_numel) * sizeof(float);
  const uint64_t offset = static_cast<uint64_t>(slot.shard_offset_numel) * sizeof(float);
  accelerator_.copy_async(scratch_, block, nbytes, CopyKind::kDeviceToHost, stream);
  stream.launch_host_func([this, p, nbytes, offset, numel = static_cast<size_t>(slot.slice_numel)] {
    if (written_[p] != 0) {
      float* on_disk = scratch_ + scratch_numel_;
      aio_->read(*file_, on_disk, nbytes, offset);
      for (size_t i = 0; i < numel; ++i) scratch_[i] += on_disk[i];
    }
    aio_->write(*file_, scratch_, nbytes, offset);
    written_[p] = 1;
  });
}

void GradShard::zero(Stream& stream) {
  if (memory_ != nullptr) {
    accelerator_.memset_async(memory_, 0, static_cast<size_t>(layout_.shard_numel()) * sizeof(float), stream);
    stream.synchronize();
    return;
  }
  std::fill(written_.begin(), written_.end(), 0);
}

void GradShard::ensure_window(size_t numel) {
  if (numel <= window_numel_) return;
  if (window_ != nullptr) accelerator_.deallocate_pinned(window_);
  window_ = nullptr;
  window_numel_ = 0;
  window_ = static_cast<float*>(accelerator_.allocate_pinned(numel * sizeof(float)));
  window_numel_ = numel;
}

const float* GradShard::read(size_t first, size_t numel, Stream& stream) {
  STRATA_CHECK(first + numel <= static_cast<size_t>(layout_.shard_numel()), kBadArgument,
               "gradient range [{}, {}) outside the shard ({} elements)", first, first + numel, layout_.shard_numel());
  if (memory_ != nullptr) {
    if (accelerator_.backend() == Backend::kCpu) return memory_ + first;
    ensure_window(numel);
    accelerator_.copy_async(window_, memory_ + first, numel * sizeof(float), CopyKind::kDeviceToHost, stream);
    stream.synchronize();
    return window_;
  }
  ensure_window(numel);
  aio_->read(*file_, window_, numel * sizeof(float), static_cast<uint64_t>(first) * sizeof(float));
  // Slices no block reached since zero() hold an older step's values: zeros.
  for (size_t p = 0; p < written_.size(); ++p) {
    if (written_[p] != 0) continue;
    const partition::ParamSlot& slot = layout_.param(p);
    const size_t begin = std::max(first, static_cast<size_t>(slot.shard_offset_numel));
    const size_t end = std::min(first + numel, static_cast<size_t>(slot.shard_offset_numel + slot.slice_numel));
    if (begin < end) std::fill(window_ + (begin - first), window_ + (end - first), 0.0f);
  }
  return window_;
}

}  // namespace strata::offload
