// ZeroEngine: shard homes, on-demand gathers, bucketed gradient reduction and
// the CPU optimizer at the accumulation boundary.
#include "runtime/engine/zero_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include "nvme/aio_handle.h"
#include "nvme/swap_space.h"
#include "offload/optimizer_swapper.h"
#include "offload/pinned_pool.h"
#include "partition/layout.h"
#include "runtime/core/error.h"
#include "runtime/core/log.h"
#include "runtime/engine/bucket_reducer.h"

namespace strata::engine {
namespace {

// Each full parameter and gradient starts on a 256-byte boundary (the
// accelerator's allocation alignment), as in the ResidentEngine.
constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

void ZeroEngineOptions::validate() const {
  STRATA_CHECK(stage >= 1 && stage <= 3, kBadArgument, "zero_optimization.stage must be 1, 2 or 3, got {}", stage);
  STRATA_CHECK(param_tier == Tier::kDevice || stage == 3, kBadArgument,
               "offload_param.device {} needs zero_optimization.stage 3 (got stage {}): only stage 3 partitions "
               "the parameters",
               tier_name(param_tier), stage);
  STRATA_CHECK(optimizer_tier == Tier::kCpu || optimizer_tier == Tier::kNvme, kBadArgument,
               "the ZeroEngine's optimizer runs on the CPU: its state lives on cpu or nvme, not {}",
               tier_name(optimizer_tier));
  STRATA_CHECK(!nvme_path.empty() || (param_tier != Tier::kNvme && optimizer_tier != Tier::kNvme), kBadArgument,
               "an nvme tier needs nvme_path");
  STRATA_CHECK(reduce_bucket_numel >= 1, kBadArgument, "reduce_bucket_size must be >= 1, got {}",
               reduce_bucket_numel);
  STRATA_CHECK(sub_group_numel >= 1, kBadArgument, "sub_group_size must be >= 1, got {}", sub_group_numel);
  STRATA_CHECK(persistence_threshold_numel >= 0, kBadArgument,
               "stage3_param_persistence_threshold must be >= 0, got {}", persistence_threshold_numel);
  STRATA_CHECK(gradient_clipping >= 0 && std::isfinite(gradient_clipping), kBadArgument,
               "gradient_clipping must be >= 0, got {}", gradient_clipping);
  STRATA_CHECK(optimizer_buffer_count >= 2, kBadArgument, "the optimizer pipeline needs >= 2 buffers, got {}",
               optimizer_buffer_count);
  adam.validate();
  if (param_tier == Tier::kNvme || optimizer_tier == Tier::kNvme) aio.validate();
}

// One dtype group: its layout, this rank's shard at home, its gradient shard,
// reducer and optimizer.
struct ZeroEngine::Group {
  DType dtype = DType::kF32;
  std::vector<ParamId> params;
  std::unique_ptr<partition::PartitionLayout> layout;
  void* home = nullptr;  // device: accelerator memory; cpu: pinned memory; nvme: unused
  std::unique_ptr<nvme::SwapSpace> swap;
  nvme::File* file = nullptr;         // nvme home
  void* host_params = nullptr;        // pinned shard staging when home is not host-addressable
  float* host_grads = nullptr;        // pinned fp32 shard staging (non-cpu accelerators)
  float* grad_accum = nullptr;        // fp32 [shard_numel], accelerator memory
  std::unique_ptr<BucketReducer> reducer;
  std::unique_ptr<offload::OptimizerSwapper> swapper;
  void* full_flat = nullptr;          // stages 1/2: every full parameter
  std::vector<size_t> full_offset;    // per member: offset in full_flat
};

// Stage 3: a gathered full parameter (world x slice_numel elements).
struct ZeroEngine::Gathered {
  void* full = nullptr;
  std::unique_ptr<Event> ready;  // on the gather stream, after the allgather
};

ZeroEngine::ZeroEngine(Accelerator& accelerator, ZeroComms comms, ZeroEngineOptions options)
    : Engine(accelerator), comms_(comms), options_(std::move(options)) {
  options_.validate();
  STRATA_CHECK(comms_.gather != nullptr && comms_.reduce != nullptr && comms_.control != nullptr, kBadArgument,
               "ZeroEngine needs gather, reduce and control communicators");
  STRATA_CHECK(comms_.gather != comms_.reduce && comms_.gather != comms_.control && comms_.reduce != comms_.control,
               kBadArgument, "gather, reduce and control need three communicators (each runs on its own stream)");
  STRATA_CHECK(comms_.gather->world_size() == comms_.reduce->world_size() &&
                   comms_.gather->world_size() == comms_.control->world_size() &&
                   comms_.gather->rank() == comms_.reduce->rank() && comms_.gather->rank() == comms_.control->rank(),
               kBadArgument, "the three communicators disagree on rank or world size");
  gather_stream_ = accelerator.create_stream();
  control_stream_ = accelerator.create_stream();
  compute_point_ = accelerator.create_event();
}

ZeroEngine::~ZeroEngine() {
  // Queued work reads and writes the memory freed below.
  for (Stream* stream : {&compute_stream(), gather_stream_.get(), control_stream_.get()}) {
    try {
      stream->synchronize();
    } catch (...) {
      // Reported (or never to be) on the caller's path; the memory may go now.
    }
  }
  for (auto& group : groups_) {
    group->reducer.reset();  // waits for its stream
    group->swapper.reset();
  }
  for (auto& gathered : gathered_) {
    if (gathered && gathered->full) accelerator().deallocate(gathered->full);
  }
  for (float* grad : grad_full_) {
    if (grad != nullptr && options_.stage != 1) accelerator().deallocate(grad);
  }
  for (auto& group : groups_) {
    if (group->full_flat) accelerator().deallocate(group->full_flat);
    if (group->grad_accum) accelerator().deallocate(group->grad_accum);
    if (group->host_params) accelerator().deallocate_pinned(group->host_params);
    if (group->host_grads) accelerator().deallocate_pinned(group->host_grads);
    if (group->home) {
      if (options_.param_tier == Tier::kCpu) {
        accelerator().deallocate_pinned(group->home);
      } else {
        accelerator().deallocate(group->home);
      }
    }
  }
  if (stage1_grads_) accelerator().deallocate(stage1_grads_);
}

int ZeroEngine::rank() const { return comms_.control->rank(); }
int ZeroEngine::world_size() const { return comms_.control->world_size(); }
int64_t ZeroEngine::step_count() const { return steps_; }

bool ZeroEngine::home_is_host_addressable() const {
  return options_.param_tier == Tier::kCpu ||
         (options_.param_tier == Tier::kDevice && accelerator().backend() == Backend::kCpu);
}

void ZeroEngine::on_finalize() {
  // Group parameters by dtype, in declaration order within a group.
  std::map<DType, size_t> group_index;
  group_of_.resize(static_cast<size_t>(parameter_count()));
  index_in_group_.resize(static_cast<size_t>(parameter_count()));
  for (ParamId id = 0; id < parameter_count(); ++id) {
    const DType dtype = param_info(id).dtype;
    auto [it, inserted] = group_index.emplace(dtype, groups_.size());
    if (inserted) {
      groups_.push_back(std::make_unique<Group>());
      groups_.back()->dtype = dtype;
    }
    Group& g = *groups_[it->second];
    group_of_[id] = static_cast<int>(it->second);
    index_in_group_[id] = g.params.size();
    g.params.push_back(id);
  }
  gathered_.resize(static_cast<size_t>(parameter_count()));
  grad_full_.assign(static_cast<size_t>(parameter_count()), nullptr);

  if (options_.param_tier == Tier::kNvme || options_.optimizer_tier == Tier::kNvme) {
    aio_ = std::make_unique<nvme::AioHandle>(options_.aio);
  }
  Stream& stream = compute_stream();
  for (auto& gp : groups_) {
    Group& g = *gp;
    std::vector<partition::ParamSpec> specs;
    for (ParamId id : g.params) specs.push_back({param_info(id).name, param_info(id).shape, g.dtype});
    partition::LayoutOptions layout_options;
    layout_options.world_size = world_size();
    layout_options.sub_group_numel = options_.sub_group_numel;
    g.layout = std::make_unique<partition::PartitionLayout>(std::move(specs), layout_options);
    const size_t shard_nbytes = g.layout->shard_nbytes();
    const size_t shard_numel = static_cast<size_t>(g.layout->shard_numel());

    switch (options_.param_tier) {
      case Tier::kDevice:
        g.home = accelerator().allocate(shard_nbytes);
        accelerator().memset_async(g.home, 0, shard_nbytes, stream);
        break;
      case Tier::kCpu:
        g.home = accelerator().allocate_pinned(shard_nbytes);
        std::memset(g.home, 0, shard_nbytes);
        break;
      case Tier::kNvme: {
        g.swap = std::make_unique<nvme::SwapSpace>(
            nvme::SwapSpaceOptions{options_.nvme_path, "param", rank(), true});
        g.file = &g.swap->create({std::string(dtype_name(g.dtype)), shard_nbytes});
        break;
      }
    }
    if (!home_is_host_addressable()) {
      g.host_params = accelerator().allocate_pinned(shard_nbytes);
      std::memset(g.host_params, 0, shard_nbytes);
      if (options_.param_tier == Tier::kNvme) aio_->write(*g.file, g.host_params, shard_nbytes, 0);
    }
    g.grad_accum = static_cast<float*>(accelerator().allocate(shard_numel * sizeof(float)));
    accelerator().memset_async(g.grad_accum, 0, shard_numel * sizeof(float), stream);
    if (accelerator().backend() != Backend::kCpu) {
      g.host_grads = static_cast<float*>(accelerator().allocate_pinned(shard_numel * sizeof(float)));
    }
    g.reducer = std::make_unique<BucketReducer>(accelerator(), ops(), *comms_.reduce, *g.layout,
                                                options_.reduce_bucket_numel, g.grad_accum);

    if (options_.stage < 3) {
      size_t total = 0;
      for (ParamId id : g.params) {
        g.full_offset.push_back(total);
        total += align_up(param_info(id).nbytes());
      }
      g.full_flat = accelerator().allocate(total);
      accelerator().memset_async(g.full_flat, 0, total, stream);
    }

    offload::OptimizerSwapperOptions swapper_options;
    swapper_options.numel = shard_numel;
    swapper_options.sub_group_numel =
        std::min<size_t>(static_cast<size_t>(options_.sub_group_numel), shard_numel);
    swapper_options.state_tier = options_.optimizer_tier;
    swapper_options.adam = options_.adam;
    swapper_options.threads = options_.optimizer_threads;
    swapper_options.nvme_path = options_.nvme_path;
    swapper_options.group = std::string("optimizer_") + std::string(dtype_name(g.dtype));
    swapper_options.rank = rank();
    if (options_.optimizer_tier == Tier::kNvme) {
      // Groups share a pool while its buffers are big enough for their sub-groups.
      const size_t record = offload::OptimizerSwapper::record_nbytes(swapper_options.sub_group_numel);
      if (pool_ == nullptr || pool_->buffer_nbytes() < record) {
        offload::PinnedPoolOptions pool_options;
        pool_options.buffer_count = options_.optimizer_buffer_count;
        pool_options.buffer_nbytes = record;
        pool_options.name = "optimizer pool";
        pools_.push_back(std::make_unique<offload::PinnedBufferPool>(pool_options, &accelerator()));
        pool_ = pools_.back().get();
      }
    }
    g.swapper = std::make_unique<offload::OptimizerSwapper>(swapper_options, pool_, aio_.get());
  }
  if (options_.stage == 1) {
    size_t total = 0;
    for (ParamId id = 0; id < parameter_count(); ++id) {
      grad_full_[id] = reinterpret_cast<float*>(total);  // offsets for now
      total += align_up(static_cast<size_t>(param_info(id).numel()) * sizeof(float));
    }
    stage1_grads_ = accelerator().allocate(total);
    stage1_grads_nbytes_ = total;
    accelerator().memset_async(stage1_grads_, 0, total, stream);
    for (ParamId id = 0; id < parameter_count(); ++id) {
      grad_full_[id] = reinterpret_cast<float*>(static_cast<char*>(stage1_grads_) +
                                                reinterpret_cast<size_t>(grad_full_[id]));
    }
  }
  stream.synchronize();
  optimizer_stale_ = true;
  full_params_stale_ = false;
}

// ---- hooks --------------------------------------------------------------------------

void ZeroEngine::pre_op(OpId op, Phase phase) {
  open_window(op, phase);
  if (options_.stage < 3) {
    if (full_params_stale_) sync_full_params();
    return;
  }
  for (ParamId id : op_info(op).params) gather(id);
}

void ZeroEngine::post_op(OpId op, Phase phase) {
  close_window(op, phase);
  compute_stream().record(*compute_point_);
  if (phase == Phase::kBackward) note_backward_done(op, *compute_point_);
  if (options_.stage < 3) return;
  for (ParamId id : op_info(op).params) {
    if (param_info(id).numel() <= options_.persistence_threshold_numel) continue;
    if (in_window(id, false)) continue;  // an enclosing window still uses it
    release_gathered(id, *compute_point_);
  }
}

void ZeroEngine::gather(ParamId id) {
  auto& slot_ptr = gathered_[id];
  if (slot_ptr == nullptr) slot_ptr = std::make_unique<Gathered>();
  Gathered& gathered = *slot_ptr;
  if (gathered.full != nullptr) {
    compute_stream().wait(*gathered.ready);
    return;
  }
  Group& g = *groups_[group_of_[id]];
  const partition::ParamSlot& slot = g.layout->param(index_in_group_[id]);
  const size_t full_nbytes = slot.slice_nbytes() * static_cast<size_t>(world_size());
  gathered.full = accelerator().allocate(full_nbytes);
  if (gathered.ready == nullptr) gathered.ready = accelerator().create_event();

  const void* src = nullptr;
  void* device_copy = nullptr;
  if (options_.param_tier == Tier::kDevice) {
    src = static_cast<const char*>(g.home) + slot.shard_offset_nbytes;
  } else {
    const char* host = nullptr;
    if (options_.param_tier == Tier::kCpu) {
      host = static_cast<const char*>(g.home) + slot.shard_offset_nbytes;
    } else {
      // nvme: read the slice into the group's pinned staging (the host waits;
      // the prefetching pipeline is the next layer). The staging may still
      // feed an earlier allgather.
      gather_stream_->synchronize();
      char* staging = static_cast<char*>(g.host_params) + slot.shard_offset_nbytes;
      aio_->read(*g.file, staging, slot.slice_nbytes(), slot.shard_offset_nbytes);
      host = staging;
    }
    if (accelerator().backend() == Backend::kCpu) {
      src = host;
    } else {
      device_copy = accelerator().allocate(slot.slice_nbytes());
      accelerator().copy_async(device_copy, host, slot.slice_nbytes(), CopyKind::kHostToDevice, *gather_stream_);
      src = device_copy;
    }
  }
  comms_.gather->allgather(src, gathered.full, static_cast<size_t>(slot.slice_numel), g.dtype, *gather_stream_);
  ++gathers_issued_;
  gather_stream_->record(*gathered.ready);
  if (device_copy != nullptr) accelerator().deallocate_after(device_copy, *gathered.ready);
  compute_stream().wait(*gathered.ready);
  gathered_nbytes_ += full_nbytes;
  peak_gathered_nbytes_ = std::max(peak_gathered_nbytes_, gathered_nbytes_);
}

void ZeroEngine::release_gathered(ParamId id, Event& after) {
  Gathered* gathered = gathered_[id].get();
  if (gathered == nullptr || gathered->full == nullptr) return;
  accelerator().deallocate_after(gathered->full, after);
  gathered->full = nullptr;
  const Group& g = *groups_[group_of_[id]];
  gathered_nbytes_ -= g.layout->param(index_in_group_[id]).slice_nbytes() * static_cast<size_t>(world_size());
}

TensorView ZeroEngine::param(ParamId id) {
  STRATA_CHECK(in_window(id, false), kBadArgument,
               "parameter '{}' used outside a hook window of an operator that lists it", param_info(id).name);
  const ParamInfo& info = param_info(id);
  const Group& g = *groups_[group_of_[id]];
  void* data = options_.stage < 3 ? static_cast<char*>(g.full_flat) + g.full_offset[index_in_group_[id]]
                                  : gathered_[id]->full;
  return TensorView{TensorDesc{info.dtype, info.shape, Tier::kDevice}, data};
}

TensorView ZeroEngine::grad(ParamId id) {
  STRATA_CHECK(in_window(id, true), kBadArgument,
               "gradient of '{}' used outside a backward window of an operator that lists it", param_info(id).name);
  const ParamInfo& info = param_info(id);
  float*& grad = grad_full_[id];
  if (grad == nullptr) {  // stages 2/3: exists from its first use in backward to its reduction
    const size_t nbytes = static_cast<size_t>(info.numel()) * sizeof(float);
    grad = static_cast<float*>(accelerator().allocate(nbytes));
    accelerator().memset_async(grad, 0, nbytes, compute_stream());
  }
  return TensorView{TensorDesc{DType::kF32, info.shape, Tier::kDevice}, grad};
}

void ZeroEngine::on_grad_ready(ParamId id, Event& ready) {
  if (options_.stage == 1) return;  // reduced at the boundary from the resident gradients
  float* grad = grad_full_[id];
  if (grad == nullptr) return;  // the op never asked for this gradient
  grad_full_[id] = nullptr;
  Group& g = *groups_[group_of_[id]];
  g.reducer->add(index_in_group_[id], grad, ready,
                 [this, grad](Event& consumed) { accelerator().deallocate_after(grad, consumed); });
}

void ZeroEngine::zero_grad() {
  STRATA_CHECK(finalized(), kBadArgument, "zero_grad() before finalize()");
  for (auto& g : groups_) {
    g->reducer->synchronize();
    accelerator().memset_async(g->grad_accum, 0, static_cast<size_t>(g->layout->shard_numel()) * sizeof(float),
                               g->reducer->stream());
    g->reducer->stream().synchronize();
  }
  if (options_.stage == 1) {
    accelerator().memset_async(stage1_grads_, 0, stage1_grads_nbytes_, compute_stream());
    return;
  }
  // A backward abandoned half way: its partial gradients are dropped.
  compute_stream().record(*compute_point_);
  for (float*& grad : grad_full_) {
    if (grad == nullptr) continue;
    accelerator().deallocate_after(grad, *compute_point_);
    grad = nullptr;
  }
}

// ---- stages 1/2: full parameters --------------------------------------------------

void ZeroEngine::sync_full_params() {
  // The gather stream writes the full copies: after compute's last read of them.
  compute_stream().record(*compute_point_);
  gather_stream_->wait(*compute_point_);
  const int world = world_size();
  for (auto& gp : groups_) {
    Group& g = *gp;
    const size_t shard_nbytes = g.layout->shard_nbytes();
    const size_t element_nbytes = dtype_nbytes(g.dtype);
    void* all = accelerator().allocate(shard_nbytes * static_cast<size_t>(world));
    comms_.gather->allgather(g.home, all, static_cast<size_t>(g.layout->shard_numel()), g.dtype, *gather_stream_);
    for (size_t i = 0; i < g.params.size(); ++i) {
      const partition::ParamSlot& slot = g.layout->param(i);
      char* full = static_cast<char*>(g.full_flat) + g.full_offset[i];
      for (int r = 0; r < world; ++r) {
        const int64_t owned = slot.owned_numel(r);
        if (owned <= 0) continue;
        accelerator().copy_async(full + static_cast<size_t>(slot.owned_begin(r)) * element_nbytes,
                                 static_cast<char*>(all) + static_cast<size_t>(r) * shard_nbytes +
                                     slot.shard_offset_nbytes,
                                 static_cast<size_t>(owned) * element_nbytes, CopyKind::kDeviceToDevice,
                                 *gather_stream_);
      }
    }
    auto done = accelerator().create_event();
    gather_stream_->record(*done);
    accelerator().deallocate_after(all, *done);
  }
  gather_stream_->record(*compute_point_);
  compute_stream().wait(*compute_point_);
  full_params_stale_ = false;
}

// ---- init, load and save -------------------------------------------------------------

void ZeroEngine::for_each_owned_range(ParamId id, Access access, const RangeFn& fn) {
  STRATA_CHECK(finalized(), kBadArgument, "for_each_owned_range before finalize()");
  const ParamInfo& info = param_info(id);
  Group& g = *groups_[group_of_[id]];
  const partition::ParamSlot& slot = g.layout->param(index_in_group_[id]);
  const int64_t owned = slot.owned_numel(rank());
  if (owned <= 0) {
    // Nothing to write here, but every rank must agree that copies are stale
    // (stages 1/2 re-gather collectively at the next pre_op).
    if (access == Access::kWrite) note_written(id);
    return;
  }
  // Nothing queued may touch the home while the host does.
  compute_stream().synchronize();
  gather_stream_->synchronize();
  char* host = nullptr;
  if (home_is_host_addressable()) {
    host = static_cast<char*>(g.home) + slot.shard_offset_nbytes;
  } else {
    host = static_cast<char*>(g.host_params) + slot.shard_offset_nbytes;
    if (options_.param_tier == Tier::kNvme) {
      aio_->read(*g.file, host, slot.slice_nbytes(), slot.shard_offset_nbytes);
    } else {
      accelerator().copy_async(host, static_cast<char*>(g.home) + slot.shard_offset_nbytes, slot.slice_nbytes(),
                               CopyKind::kDeviceToHost, *gather_stream_);
      gather_stream_->synchronize();
    }
  }
  const TensorView view{TensorDesc{info.dtype, {owned}, Tier::kCpu}, host};
  fn(slot.owned_begin(rank()), view);
  if (access == Access::kRead) return;
  if (!home_is_host_addressable()) {
    if (options_.param_tier == Tier::kNvme) {
      aio_->write(*g.file, host, slot.slice_nbytes(), slot.shard_offset_nbytes);
    } else {
      accelerator().copy_async(static_cast<char*>(g.home) + slot.shard_offset_nbytes, host, slot.slice_nbytes(),
                               CopyKind::kHostToDevice, *gather_stream_);
      gather_stream_->synchronize();
    }
  }
  note_written(id);
}

void ZeroEngine::note_written(ParamId id) {
  // Copies made from the old values are stale now.
  if (options_.stage < 3) {
    full_params_stale_ = true;
  } else if (gathered_[id] && gathered_[id]->full != nullptr) {
    STRATA_CHECK(!in_window(id, false), kBadArgument, "parameter '{}' written inside a hook window that uses it",
                 param_info(id).name);
    compute_stream().record(*compute_point_);
    release_gathered(id, *compute_point_);
  }
  optimizer_stale_ = true;
}

// ---- the optimizer step ----------------------------------------------------------

double ZeroEngine::global_sum(double value) {
  double sum = value;
  allreduce_f64(&sum, 1);
  return sum;
}

void ZeroEngine::allreduce_f64(double* values, size_t count) {
  const size_t nbytes = count * sizeof(double);
  void* device = accelerator().allocate(nbytes);
  try {
    accelerator().copy_async(device, values, nbytes, CopyKind::kHostToDevice, *control_stream_);
    comms_.control->allreduce(device, device, count, DType::kF64, partition::ReduceOp::kSum, *control_stream_);
    accelerator().copy_async(values, device, nbytes, CopyKind::kDeviceToHost, *control_stream_);
    control_stream_->synchronize();
  } catch (...) {
    accelerator().deallocate(device);
    throw;
  }
  accelerator().deallocate(device);
}

// Host views of a group's shard: parameters (storage dtype) and fp32 gradients.
void* ZeroEngine::host_params(Group& g, bool load) {
  if (home_is_host_addressable()) return g.home;
  if (load) {
    if (options_.param_tier == Tier::kNvme) {
      aio_->read(*g.file, g.host_params, g.layout->shard_nbytes(), 0);
    } else {
      accelerator().copy_async(g.host_params, g.home, g.layout->shard_nbytes(), CopyKind::kDeviceToHost,
                               *gather_stream_);
      gather_stream_->synchronize();
    }
  }
  return g.host_params;
}

void ZeroEngine::store_host_params(Group& g) {
  if (home_is_host_addressable()) return;
  if (options_.param_tier == Tier::kNvme) {
    aio_->write(*g.file, g.host_params, g.layout->shard_nbytes(), 0);
  } else {
    accelerator().copy_async(g.home, g.host_params, g.layout->shard_nbytes(), CopyKind::kHostToDevice,
                             *gather_stream_);
    gather_stream_->synchronize();
  }
}

void ZeroEngine::init_optimizer() {
  for (auto& gp : groups_) {
    Group& g = *gp;
    const char* params = static_cast<const char*>(host_params(g, /*load=*/true));
    const size_t element_nbytes = dtype_nbytes(g.dtype);
    // The fp32 master weights start as the (widened) parameters, padding zero.
    g.swapper->initialize([&](size_t first, size_t numel, float* out) {
      convert(params + first * element_nbytes, g.dtype, out, DType::kF32, numel);
    });
  }
  optimizer_stale_ = false;
}

StepResult ZeroEngine::step(float lr) {
  STRATA_CHECK(finalized(), kBadArgument, "step() before finalize()");
  STRATA_CHECK(std::all_of(grad_full_.begin(), grad_full_.end(), [&](float* g) { return options_.stage == 1 || g == nullptr; }),
               kBadArgument, "step() with a backward pass not finished (a gradient is still being accumulated)");
  compute_stream().record(*compute_point_);
  if (options_.stage == 1) {
    for (ParamId id = 0; id < parameter_count(); ++id) {
      groups_[group_of_[id]]->reducer->add(index_in_group_[id], grad_full_[id], *compute_point_);
    }
  }
  // The gradient shards are final once every bucket has landed.
  kernels::GradStats local;
  for (auto& gp : groups_) {
    Group& g = *gp;
    g.reducer->synchronize();
    const size_t shard_numel = static_cast<size_t>(g.layout->shard_numel());
    if (g.host_grads != nullptr) {
      accelerator().copy_async(g.host_grads, g.grad_accum, shard_numel * sizeof(float), CopyKind::kDeviceToHost,
                               g.reducer->stream());
      g.reducer->stream().synchronize();
    }
    const float* grads = g.host_grads != nullptr ? g.host_grads : g.grad_accum;
    local = kernels::merge(local, kernels::grad_stats(grads, DType::kF32, shard_numel, 1.0f, std::nullopt,
                                                      options_.optimizer_threads));
  }
  // Global norm and finiteness: one f64 allreduce of (sum of squares, non-finite ranks).
  double reduced[2] = {local.finite ? local.sum_sq : 0.0, local.finite ? 0.0 : 1.0};
  allreduce_f64(reduced, 2);
  kernels::GradStats global;
  global.sum_sq = reduced[0];
  global.finite = reduced[1] == 0.0 && std::isfinite(reduced[0]);
  StepResult result;
  result.grad_norm = global.finite ? global.norm() : std::numeric_limits<double>::infinity();
  if (!global.finite) {
    logger().warn("step {}: a gradient is not finite on {} rank(s); the step is skipped", steps_ + 1, reduced[1]);
    zero_grad();
    result.step = steps_;
    return result;
  }
  result.grad_scale = kernels::combined_grad_scale(global, 1.0f, static_cast<float>(options_.gradient_clipping));
  if (optimizer_stale_) init_optimizer();
  for (auto& gp : groups_) {
    Group& g = *gp;
    void* params = host_params(g, /*load=*/false);
    g.swapper->set_lr(lr);
    offload::StepInputs inputs;
    inputs.grad = g.host_grads != nullptr ? g.host_grads : g.grad_accum;
    inputs.grad_dtype = DType::kF32;
    inputs.grad_scale = result.grad_scale;
    if (g.dtype != DType::kF32) {
      inputs.param16 = params;
      inputs.param16_dtype = g.dtype;
    }
    g.swapper->step(inputs);
    // fp32 parameters are the master weights themselves.
    if (g.dtype == DType::kF32) g.swapper->load_state(static_cast<float*>(params), nullptr, nullptr);
    store_host_params(g);
  }
  ++steps_;
  result.applied = true;
  result.step = steps_;
  // Copies of the old values are stale: re-gather.
  if (options_.stage < 3) {
    sync_full_params();
  } else {
    compute_stream().record(*compute_point_);
    for (ParamId id = 0; id < parameter_count(); ++id) release_gathered(id, *compute_point_);
  }
  zero_grad();
  return result;
}

}  // namespace strata::engine
