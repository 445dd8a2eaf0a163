// ZeroEngine: shard homes, on-demand gathers, bucketed gradient reduction and
// the CPU optimizer at the accumulation boundary.
#include "runtime/engine/zero_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "nvme/aio_handle.h"
#include "nvme/swap_space.h"
#include "offload/optimizer_swapper.h"
#include "offload/pinned_pool.h"
#include "partition/layout.h"
#include "core/error.h"
#include "core/log.h"
#include "runtime/engine/bucket_reducer.h"
#include "runtime/engine/zero_engine_parts.h"

namespace strata::engine {
namespace {

// Each full parameter and gradient starts on a 256-byte boundary (the
// accelerator's allocation alignment), as in the ResidentEngine.
constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The optimizer walks the layout's sub-groups: the layout cuts the shard every
// sub_group_numel elements rounded up to the alignment, so the swapper's
// uniform sub-groups of that size start exactly where the layout's do — each
// an aligned range of the parameter, gradient and state files.
size_t optimizer_sub_group_numel(const partition::PartitionLayout& layout, DType dtype, int64_t sub_group_numel) {
  const int64_t align_numel = static_cast<int64_t>(layout.alignment_nbytes() / dtype_nbytes(dtype));
  const int64_t limit = (sub_group_numel + align_numel - 1) / align_numel * align_numel;
  const size_t numel = static_cast<size_t>(std::min(limit, std::max<int64_t>(layout.shard_numel(), 1)));
  int64_t first = 0;
  for (const auto& sub_group : layout.sub_groups()) {
    STRATA_CHECK(first % static_cast<int64_t>(numel) == 0, kInternal,
                 "the layout's sub-group at element {} does not start at a multiple of {}", first, numel);
    first += sub_group.numel;
  }
  return numel;
}


}  // namespace

void ZeroEngineOptions::validate() const {
  STRATA_CHECK(stage >= 1 && stage <= 3, kBadArgument, "zero_optimization.stage must be 1, 2 or 3, got {}", stage);
  STRATA_CHECK(param_tier == Tier::kDevice || stage == 3, kBadArgument,
               "offload_param.device {} needs zero_optimization.stage 3 (got stage {}): only stage 3 partitions "
               "the parameters",
               tier_name(param_tier), stage);
  // The optimizer on the accelerator reads the gradient shard and writes the
  // parameter home in accelerator memory; with either offloaded, its 12 bytes
  // per element of state would stay on the accelerator to spare 2 to 4.
  STRATA_CHECK(optimizer_tier != Tier::kDevice || param_tier == Tier::kDevice, kBadArgument,
               "offload_optimizer.device none keeps the optimizer state on the accelerator, which needs the "
               "parameters there too, but offload_param.device is {}: offload the optimizer as well "
               "(offload_optimizer.device cpu or nvme) or keep the parameters (offload_param.device none)",
               tier_name(param_tier));
  STRATA_CHECK(optimizer_tier != Tier::kDevice || grad_tier == Tier::kDevice, kBadArgument,
               "the optimizer on the accelerator reads the gradient shard there: grad tier {} is not device",
               tier_name(grad_tier));
  STRATA_CHECK(grad_tier == Tier::kDevice || grad_tier == Tier::kNvme, kBadArgument,
               "the gradient shard lives in accelerator memory or on nvme, not {}", tier_name(grad_tier));
  STRATA_CHECK(!nvme_path.empty() ||
                   (param_tier != Tier::kNvme && optimizer_tier != Tier::kNvme && grad_tier != Tier::kNvme),
               kBadArgument, "an nvme tier needs nvme_path");
  STRATA_CHECK(reduce_bucket_numel >= 1, kBadArgument, "reduce_bucket_size must be >= 1, got {}",
               reduce_bucket_numel);
  STRATA_CHECK(sub_group_numel >= 1, kBadArgument, "sub_group_size must be >= 1, got {}", sub_group_numel);
  STRATA_CHECK(persistence_threshold_numel >= 0, kBadArgument,
               "stage3_param_persistence_threshold must be >= 0, got {}", persistence_threshold_numel);
  STRATA_CHECK(gradient_clipping >= 0 && std::isfinite(gradient_clipping), kBadArgument,
               "gradient_clipping must be >= 0, got {}", gradient_clipping);
  STRATA_CHECK(optimizer_buffer_count >= 2, kBadArgument, "the optimizer pipeline needs >= 2 buffers, got {}",
               optimizer_buffer_count);
  STRATA_CHECK(prefetch_bucket_numel >= 0, kBadArgument, "stage3_prefetch_bucket_size must be >= 0, got {}",
               prefetch_bucket_numel);
  STRATA_CHECK(max_live_parameters_numel >= 1, kBadArgument, "stage3_max_live_parameters must be >= 1, got {}",
               max_live_parameters_numel);
  STRATA_CHECK(max_reuse_distance_numel >= 0, kBadArgument, "stage3_max_reuse_distance must be >= 0, got {}",
               max_reuse_distance_numel);
  STRATA_CHECK(param_buffer_count >= 1, kBadArgument, "offload_param.buffer_count must be >= 1, got {}",
               param_buffer_count);
  STRATA_CHECK(param_buffer_numel >= 1, kBadArgument, "offload_param.buffer_size must be >= 1, got {}",
               param_buffer_numel);
  adam.validate();
  if (param_tier == Tier::kNvme || optimizer_tier == Tier::kNvme || grad_tier == Tier::kNvme) aio.validate();
}


ZeroEngine::ZeroEngine(Accelerator& accelerator, ZeroComms comms, ZeroEngineOptions options)
    : Engine(accelerator), comms_(comms), options_(std::move(options)) {
  options_.validate();
  if (options_.loss_scaling) loss_scaler_ = LossScaler(*options_.loss_scaling);
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
  home_stream_ = accelerator.create_stream();
  overlap_ = std::make_unique<Overlap>();
  compute_point_ = accelerator.create_event();
  gather_point_ = accelerator.create_event();
}

ZeroEngine::~ZeroEngine() {
  {
    std::lock_guard lock(overlap_->mutex);
    overlap_->stop = true;
  }
  overlap_->cv.notify_all();
  if (overlap_->thread.joinable()) overlap_->thread.join();
  // Queued work reads and writes the memory freed below.
  for (Stream* stream : {&compute_stream(), gather_stream_.get(), control_stream_.get(), home_stream_.get()}) {
    try {
      stream->synchronize();
    } catch (...) {
      // Reported (or never to be) on the caller's path; the memory may go now.
    }
  }
  read_queue_.reset();  // submits what is left (every point it waits for is passed)
  drain_staging();      // reads in flight write into the staging buffers
  for (auto& group : groups_) {
    for (auto& buffer : group->staging.buffers) accelerator().deallocate_pinned(buffer.data);
  }
  for (auto& group : groups_) {
    group->reducer.reset();  // waits for its stream
    group->grads.reset();
    group->swapper.reset();
    group->device_optimizer.reset();
  }
  for (auto& gathered : gathered_) {
    if (gathered && gathered->full) accelerator().deallocate(gathered->full);
  }
  for (float* grad : grad_full_) {
    if (grad != nullptr && options_.stage != 1) accelerator().deallocate(grad);
  }
  for (auto& group : groups_) {
    if (group->full_flat) accelerator().deallocate(group->full_flat);
    if (group->home) {
      if (options_.param_tier == Tier::kCpu) {
        accelerator().deallocate_pinned(group->home);
      } else {
        accelerator().deallocate(group->home);
      }
    }
  }
  if (stage1_grads_) accelerator().deallocate(stage1_grads_);
  if (window_) accelerator().deallocate_pinned(window_);
  if (control_buffer_) accelerator().deallocate(control_buffer_);
}

int ZeroEngine::rank() const { return comms_.control->rank(); }
int ZeroEngine::world_size() const { return comms_.control->world_size(); }
int64_t ZeroEngine::step_count() const { return steps_; }
uint64_t ZeroEngine::nvme_bytes_read() const { return aio_ ? aio_->stats().bytes_read : 0; }
uint64_t ZeroEngine::nvme_bytes_written() const { return aio_ ? aio_->stats().bytes_written : 0; }

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
  visited_.assign(static_cast<size_t>(parameter_count()), 0);
  if (options_.stage == 3) {
    trace_ = std::make_unique<OperatorTrace>(
        [this](OpId op) -> const std::vector<ParamId>& { return op_info(op).params; },
        [this](ParamId id) { return gathered_numel(id); });
  }

  if (options_.param_tier == Tier::kNvme || options_.optimizer_tier == Tier::kNvme ||
      options_.grad_tier == Tier::kNvme) {
    aio_ = std::make_unique<nvme::AioHandle>(options_.aio, options_.io_backend ? options_.io_backend() : nullptr);
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
            nvme::SwapSpaceOptions{options_.nvme_path, "param", rank(), true, options_.keep_swap_files});
        g.file = &g.swap->create({std::string(dtype_name(g.dtype)), shard_nbytes});
        break;
      }
    }
    if (options_.param_tier == Tier::kNvme) {
      // The file may hold an earlier run's bytes: zeros, so padding is zero
      // as in the other homes (the window, bounded, one range at a time).
      for_each_home_chunk(g, [&](size_t first, size_t numel) {
        std::memset(home_range(g, first, numel, /*load=*/false), 0, numel * dtype_nbytes(g.dtype));
        store_home_range(g, first, numel);
      });
    }
    if (options_.param_tier == Tier::kNvme) {
      // nc staging: one buffer holds one slice, so buffers larger than the
      // largest slice, or more of them than there are slices, would only pin
      // memory that is never used.
      size_t largest = 0;
      for (size_t i = 0; i < g.params.size(); ++i) largest = std::max(largest, g.layout->param(i).slice_nbytes());
      const size_t element_nbytes = dtype_nbytes(g.dtype);
      STRATA_CHECK(largest <= static_cast<size_t>(options_.param_buffer_numel) * element_nbytes, kBadArgument,
                   "offload_param.buffer_size ({} elements) is smaller than this rank's largest {} parameter slice "
                   "({} elements); raise it",
                   options_.param_buffer_numel, dtype_name(g.dtype), largest / element_nbytes);
      g.staging.buffer_nbytes = largest;
      g.staging.buffers.resize(std::min(options_.param_buffer_count, g.params.size()));
      for (auto& buffer : g.staging.buffers) {
        buffer.data = accelerator().allocate_pinned(largest);
      }
      if (read_queue_ == nullptr) read_queue_ = std::make_unique<ReadQueue>(*aio_);
    }
    if (options_.grad_tier == Tier::kNvme) {
      if (grad_swap_ == nullptr) {
        grad_swap_ = std::make_unique<nvme::SwapSpace>(
            nvme::SwapSpaceOptions{options_.nvme_path, "grad", rank(), true, options_.keep_swap_files});
      }
      g.grads = std::make_unique<GradShard>(accelerator(), ops(), *g.layout, *aio_, *grad_swap_,
                                            std::string(dtype_name(g.dtype)));
    } else {
      g.grads = std::make_unique<GradShard>(accelerator(), ops(), *g.layout);
    }
    g.reducer = std::make_unique<BucketReducer>(accelerator(), ops(), *comms_.reduce, *g.layout,
                                                options_.reduce_bucket_numel, *g.grads);

    if (options_.stage < 3) {
      size_t total = 0;
      for (ParamId id : g.params) {
        g.full_offset.push_back(total);
        total += align_up(param_info(id).nbytes());
      }
      g.full_flat = accelerator().allocate(total);
      accelerator().memset_async(g.full_flat, 0, total, stream);
    }

    const size_t sub_group_numel = optimizer_sub_group_numel(*g.layout, g.dtype, options_.sub_group_numel);
    if (options_.optimizer_tier == Tier::kDevice) {
      g.device_optimizer = std::make_unique<DeviceOptimizer>(accelerator(), ops(), *home_stream_, shard_numel,
                                                             sub_group_numel, options_.adam);
    }
    offload::OptimizerSwapperOptions swapper_options;
    swapper_options.numel = shard_numel;
    swapper_options.sub_group_numel = sub_group_numel;
    swapper_options.state_tier = options_.optimizer_tier;
    swapper_options.adam = options_.adam;
    swapper_options.threads = options_.optimizer_threads;
    swapper_options.nvme_path = options_.nvme_path;
    swapper_options.group = std::string("optimizer_") + std::string(dtype_name(g.dtype));
    swapper_options.rank = rank();
    swapper_options.keep_files = options_.keep_swap_files;
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
    if (!g.device_optimizer) {
      g.swapper = std::make_unique<offload::OptimizerSwapper>(swapper_options, pool_, aio_.get());
    }

    // Which sub-groups each member's slice meets, for the optimizer overlapping backward.
    const size_t sub_groups = g.sub_group_count();
    g.sub_group_numel = g.sub_group_range(0).second;
    g.param_sub_groups.assign(g.params.size(), {});
    g.members_of_sub_group.assign(sub_groups, 0);
    for (size_t i = 0; i < g.params.size(); ++i) {
      const partition::ParamSlot& slot = g.layout->param(i);
      if (slot.slice_numel <= 0) continue;
      const size_t first = static_cast<size_t>(slot.shard_offset_numel);
      const size_t last = first + static_cast<size_t>(slot.slice_numel) - 1;
      for (size_t k = first / g.sub_group_numel; k <= last / g.sub_group_numel; ++k) {
        g.param_sub_groups[i].push_back(static_cast<uint32_t>(k));
        ++g.members_of_sub_group[k];
      }
    }
    g.pending.assign(sub_groups, 0);
    g.landed.assign(g.params.size(), 0);
    g.stats.assign(sub_groups, {});
    g.stats_known.assign(sub_groups, 0);
    const size_t group_index = static_cast<size_t>(&gp - groups_.data());
    g.reducer->set_landed_callback(
        [this, group_index](const std::vector<size_t>& params) { on_landed(group_index, params); });
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
  abandon_speculation();  // a step prepared and abandoned: its speculative updates are undone
  for (auto& g : groups_) {
    g->reducer->synchronize();
    g->grads->zero(g->reducer->stream());
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
  check_not_prepared("for_each_owned_range");
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
  // Nothing queued may touch the home while the host does, and nothing
  // staged may outlive a write.
  compute_stream().synchronize();
  gather_stream_->synchronize();
  drain_staging();
  const size_t first = static_cast<size_t>(slot.shard_offset_numel), numel = static_cast<size_t>(slot.slice_numel);
  void* host = home_range(g, first, numel, /*load=*/true);
  const TensorView view{TensorDesc{info.dtype, {owned}, Tier::kCpu}, host};
  fn(slot.owned_begin(rank()), view);
  if (access == Access::kRead) return;
  store_home_range(g, first, numel);
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
  STRATA_CHECK(count <= kControlSlots, kInternal, "allreduce_f64 of {} values (at most {})", count, kControlSlots);
  const size_t nbytes = count * sizeof(double);
  // One small accelerator buffer serves every call (two or three a step).
  if (control_buffer_ == nullptr) control_buffer_ = accelerator().allocate(kControlSlots * sizeof(double));
  accelerator().copy_async(control_buffer_, values, nbytes, CopyKind::kHostToDevice, *control_stream_);
  comms_.control->allreduce(control_buffer_, control_buffer_, count, DType::kF64, partition::ReduceOp::kSum,
                            *control_stream_);
  accelerator().copy_async(values, control_buffer_, nbytes, CopyKind::kDeviceToHost, *control_stream_);
  control_stream_->synchronize();
}

// ---- the parameter shard's home, one bounded range at a time --------------------

size_t ZeroEngine::max_home_range_numel(const Group& g) const {
  size_t numel = optimizer_sub_group_numel(*g.layout, g.dtype, options_.sub_group_numel);
  for (const auto& slot : g.layout->params()) numel = std::max(numel, static_cast<size_t>(slot.slice_numel));
  return numel;
}

void ZeroEngine::for_each_home_chunk(const Group& g, const std::function<void(size_t, size_t)>& fn) const {
  // Sub-group-sized chunks: multiples of the alignment, so aligned ranges.
  const size_t chunk = optimizer_sub_group_numel(*g.layout, g.dtype, options_.sub_group_numel);
  const size_t shard_numel = static_cast<size_t>(g.layout->shard_numel());
  for (size_t first = 0; first < shard_numel; first += chunk) fn(first, std::min(chunk, shard_numel - first));
}

void* ZeroEngine::home_range(Group& g, size_t first, size_t numel, bool load) {
  const size_t element_nbytes = dtype_nbytes(g.dtype);
  STRATA_CHECK(first + numel <= static_cast<size_t>(g.layout->shard_numel()), kInternal,
               "parameter range [{}, {}) outside the shard ({} elements)", first, first + numel,
               g.layout->shard_numel());
  if (home_is_host_addressable()) return static_cast<char*>(g.home) + first * element_nbytes;
  const size_t nbytes = numel * element_nbytes;
  if (nbytes > window_nbytes_) {
    // Grows to the largest range any group asks for, then stays: bounded by
    // the largest slice and sub_group_size, not by the model.
    size_t want = nbytes;
    for (const auto& other : groups_) {
      if (other->layout) want = std::max(want, max_home_range_numel(*other) * dtype_nbytes(other->dtype));
    }
    if (window_ != nullptr) accelerator().deallocate_pinned(window_);
    window_ = nullptr;
    window_nbytes_ = 0;
    window_ = accelerator().allocate_pinned(want);
    window_nbytes_ = want;
  }
  if (load) {
    if (options_.param_tier == Tier::kNvme) {
      aio_->read(*g.file, window_, nbytes, first * element_nbytes);
    } else {
      accelerator().copy_async(window_, static_cast<char*>(g.home) + first * element_nbytes, nbytes,
                               CopyKind::kDeviceToHost, *home_stream_);
      home_stream_->synchronize();
    }
  }
  return window_;
}

void ZeroEngine::store_home_range(Group& g, size_t first, size_t numel) {
  if (home_is_host_addressable()) return;
  const size_t element_nbytes = dtype_nbytes(g.dtype), nbytes = numel * element_nbytes;
  if (options_.param_tier == Tier::kNvme) {
    aio_->write(*g.file, window_, nbytes, first * element_nbytes);
  } else {
    accelerator().copy_async(static_cast<char*>(g.home) + first * element_nbytes, window_, nbytes,
                             CopyKind::kHostToDevice, *home_stream_);
    home_stream_->synchronize();
  }
}

}  // namespace strata::engine
