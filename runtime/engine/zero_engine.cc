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
#include "runtime/core/error.h"
#include "runtime/core/log.h"
#include "runtime/engine/bucket_reducer.h"
#include "runtime/engine/zero_engine_parts.h"

namespace strata::engine {
namespace {

// Each full parameter and gradient starts on a 256-byte boundary (the
// accelerator's allocation alignment), as in the ResidentEngine.
constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// An I/O completion callback that completes `done` (on the I/O worker). It
// holds its own reference, so the event outlives the signal even when the
// engine has moved on.
nvme::AioHandle::DoneFn complete_with(std::shared_ptr<HostEvent> done) {
  return [done = std::move(done)](std::exception_ptr error) {
    if (error) {
      done->fail(std::move(error));
    } else {
      done->signal();
    }
  };
}

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
  if (param_tier == Tier::kNvme || optimizer_tier == Tier::kNvme) aio.validate();
}

// nc reads that must wait until the gather stream is past a staging buffer's
// last reader: one thread takes them in issue order (the gather stream's
// order), waits for that point and submits the read, whose completion
// callback completes the HostEvent the gather stream waits on. So a gather
// issued far ahead never blocks the host for a buffer, and no thread blocks
// per read. No cycle: the point a read waits for lies before, on the gather
// stream, the wait on that read's own event.
struct ZeroEngine::ReadQueue {
  struct Item {
    std::shared_ptr<Event> after;
    const nvme::File* file = nullptr;
    void* buf = nullptr;
    size_t nbytes = 0;
    uint64_t offset = 0;
    std::shared_ptr<HostEvent> done;
  };
  explicit ReadQueue(nvme::AioHandle& aio) : aio_(aio), thread_([this] { run(); }) {}
  // Submits what is queued (each after its point), then joins.
  ~ReadQueue() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void push(Item item) {
    {
      std::lock_guard lock(mutex_);
      items_.push_back(std::move(item));
    }
    cv_.notify_all();
  }

 private:
  void run() {
    for (;;) {
      Item item;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !items_.empty(); });
        if (items_.empty()) return;
        item = std::move(items_.front());
        items_.pop_front();
      }
      try {
        item.after->synchronize();
      } catch (...) {
        // The reader failed, but it is over: the buffer may be written. (Its
        // error reached the gather stream already.)
      }
      try {
        aio_.submit_read(*item.file, item.buf, item.nbytes, item.offset, complete_with(item.done));
      } catch (...) {
        item.done->fail(std::current_exception());
      }
    }
  }
  nvme::AioHandle& aio_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> items_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses
};


// Stage 3: a gathered full parameter (world x slice_numel elements).
struct ZeroEngine::Gathered {
  void* full = nullptr;
  std::unique_ptr<Event> ready;  // on the gather stream, after the allgather
  bool prefetched = false;       // gathered ahead; no pre_op has used this copy yet
  size_t kept_until = OperatorTrace::npos;  // kept for reuse: the trace entry that uses it next
  int staged = -1;               // nvme: the staging buffer holding its read, -1: none
};

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
  read_queue_.reset();  // submits what is left (every point it waits for is passed)
  drain_staging();      // reads in flight write into the staging buffers
  for (auto& group : groups_) {
    for (auto& buffer : group->staging.buffers) accelerator().deallocate_pinned(buffer.data);
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

  if (options_.param_tier == Tier::kNvme || options_.optimizer_tier == Tier::kNvme) {
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
  const OperatorTrace::Advance advance = trace_->advance(op, phase);
  window_position_.push_back(advance.position);
  if (advance.dropped) on_trace_dropped(advance, OperatorTrace::Entry{op, phase});
  ++prefetch_.windows;
  make_room(op);
  for (ParamId id : op_info(op).params) fetch(id);
  if (advance.position != OperatorTrace::npos && options_.prefetch_bucket_numel > 0) {
    prefetch_from(advance.position);
  }
}

void ZeroEngine::post_op(OpId op, Phase phase) {
  close_window(op, phase);
  compute_stream().record(*compute_point_);
  if (phase == Phase::kBackward) note_backward_done(op, *compute_point_);
  if (options_.stage < 3) return;
  const size_t position = window_position_.back();
  window_position_.pop_back();
  // The trace may have been dropped since this window opened: then its
  // position says nothing about the future any more.
  const bool follow = position != OperatorTrace::npos && trace_->following();
  const auto& params = op_info(op).params;
  for (size_t k = 0; k < params.size(); ++k) {
    const ParamId id = params[k];
    if (persistent(id)) continue;
    if (in_window(id, false)) continue;  // an enclosing window still uses it
    if (follow) {
      // Used again soon (by the trace): keep it rather than gather it again.
      const size_t next = trace_->next_use(position, k);
      if (next != OperatorTrace::npos &&
          trace_->numel_between(position, next) <= options_.max_reuse_distance_numel) {
        gathered_[id]->kept_until = next;
        continue;
      }
    }
    release_gathered(id, *compute_point_);
  }
}

int64_t ZeroEngine::gathered_numel(ParamId id) const {
  const Group& g = *groups_[group_of_[id]];
  return g.layout->param(index_in_group_[id]).slice_numel * world_size();
}

bool ZeroEngine::persistent(ParamId id) const {
  return param_info(id).numel() <= options_.persistence_threshold_numel;
}

void ZeroEngine::fetch(ParamId id) {
  auto& slot_ptr = gathered_[id];
  if (slot_ptr == nullptr) slot_ptr = std::make_unique<Gathered>();
  Gathered& gathered = *slot_ptr;
  if (gathered.full == nullptr) {
    ++prefetch_.on_demand;
    issue_gather(id, /*prefetch=*/false);
  } else if (gathered.prefetched) {
    ++(gathered.ready->query() ? prefetch_.prefetched_ready : prefetch_.prefetched_in_flight);
    gathered.prefetched = false;
  } else {
    ++prefetch_.reused;
  }
  gathered.kept_until = OperatorTrace::npos;
  compute_stream().wait(*gathered.ready);
}

void ZeroEngine::issue_gather(ParamId id, bool prefetch) {
  auto& slot_ptr = gathered_[id];
  if (slot_ptr == nullptr) slot_ptr = std::make_unique<Gathered>();
  Gathered& gathered = *slot_ptr;
  Group& g = *groups_[group_of_[id]];
  const partition::ParamSlot& slot = g.layout->param(index_in_group_[id]);
  const size_t full_nbytes = slot.slice_nbytes() * static_cast<size_t>(world_size());
  if (gathered.ready == nullptr) gathered.ready = accelerator().create_event();
  // nc first (it may block for a staging buffer): nothing is allocated yet.
  Staging::Buffer* staged = nullptr;
  if (options_.param_tier == Tier::kNvme) {
    if (gathered.staged < 0) stage_read(id, /*ahead=*/false);
    staged = &g.staging.buffers[static_cast<size_t>(gathered.staged)];
  }
  gathered.full = accelerator().allocate(full_nbytes);

  const void* src = nullptr;
  void* device_copy = nullptr;
  if (options_.param_tier == Tier::kDevice) {
    src = static_cast<const char*>(g.home) + slot.shard_offset_nbytes;
  } else {
    const char* host = nullptr;
    if (staged != nullptr) {
      // The read lands before anything after this wait runs on the gather
      // stream; a failed read becomes the gather stream's error.
      gather_stream_->wait(*staged->read_done);
      host = static_cast<const char*>(staged->data);
    } else {
      host = static_cast<const char*>(g.home) + slot.shard_offset_nbytes;
    }
    if (accelerator().backend() == Backend::kCpu) {
      src = host;  // the allgather reads pinned memory directly
    } else {
      // cg: pinned -> device on the gather stream, right before the allgather.
      device_copy = accelerator().allocate(slot.slice_nbytes());
      accelerator().copy_async(device_copy, host, slot.slice_nbytes(), CopyKind::kHostToDevice, *gather_stream_);
      src = device_copy;
    }
  }
  const auto mark_consumed = [&] {  // the staging buffer is free once this point is passed
    staged->consumed = accelerator().create_event();
    gather_stream_->record(*staged->consumed);
    staged->consumed_seq = ++consumed_seq_;
  };
  if (staged != nullptr && device_copy != nullptr) mark_consumed();
  comms_.gather->allgather(src, gathered.full, static_cast<size_t>(slot.slice_numel), g.dtype, *gather_stream_);
  ++gathers_issued_;
  ++prefetch_.gathers;
  gather_stream_->record(*gathered.ready);
  if (staged != nullptr) {
    if (device_copy == nullptr) mark_consumed();  // the allgather read it
    staged->holder = -1;
    gathered.staged = -1;
  }
  if (device_copy != nullptr) accelerator().deallocate_after(device_copy, *gathered.ready);
  gathered.prefetched = prefetch;
  live_numel_ += gathered_numel(id);
  gathered_nbytes_ += full_nbytes;
  peak_gathered_nbytes_ = std::max(peak_gathered_nbytes_, gathered_nbytes_);
  prefetch_.peak_gathered_nbytes = std::max(prefetch_.peak_gathered_nbytes, gathered_nbytes_);
}

bool ZeroEngine::stage_read(ParamId id, bool ahead) {
  Group& g = *groups_[group_of_[id]];
  Staging& staging = g.staging;
  // Free: held by no parameter, and the gather stream is past its last reader.
  Staging::Buffer* buffer = nullptr;
  for (auto& b : staging.buffers) {
    if (b.holder < 0 && (b.consumed == nullptr || b.consumed->query())) {
      buffer = &b;
      break;
    }
  }
  bool deferred = false;
  if (buffer == nullptr) {
    if (ahead) return false;  // nc runs ahead only into free buffers
    // A gather is being issued: take the buffer whose last reader comes
    // first on the gather stream and let the read queue submit the read once
    // the stream is past it — the host does not wait.
    for (auto& b : staging.buffers) {
      if (b.holder < 0 && (buffer == nullptr || b.consumed_seq < buffer->consumed_seq)) buffer = &b;
    }
    deferred = buffer != nullptr;
  }
  if (buffer == nullptr) {
    // Every buffer holds a read no gather has used yet (the trace changed
    // under nc): give one up. Its read must land before the buffer is reused;
    // it is read again if it is needed.
    const auto start = std::chrono::steady_clock::now();
    for (auto& b : staging.buffers) {
      if (b.holder != id) buffer = &b;
    }
    try {
      buffer->read_done->synchronize();
    } catch (...) {
      // Dropped unused; a read that fails again fails where it is used.
    }
    gathered_[buffer->holder]->staged = -1;
    buffer->holder = -1;
    ++prefetch_.blocked_waits;
    prefetch_.blocked_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const partition::ParamSlot& slot = g.layout->param(index_in_group_[id]);
  std::shared_ptr<HostEvent> done = accelerator().create_host_event();
  if (deferred) {
    read_queue_->push(
        ReadQueue::Item{buffer->consumed, g.file, buffer->data, slot.slice_nbytes(), slot.shard_offset_nbytes, done});
    ++prefetch_.reads_deferred;
  } else {
    aio_->submit_read(*g.file, buffer->data, slot.slice_nbytes(), slot.shard_offset_nbytes, complete_with(done));
  }
  buffer->read_done = std::move(done);
  buffer->holder = id;
  auto& slot_ptr = gathered_[id];
  if (slot_ptr == nullptr) slot_ptr = std::make_unique<Gathered>();
  slot_ptr->staged = static_cast<int>(buffer - staging.buffers.data());
  ++prefetch_.reads;
  if (ahead) ++prefetch_.reads_ahead;
  return true;
}

void ZeroEngine::prefetch_from(size_t position) {
  // One walk along the trace after the current entry, each parameter once:
  // gg issues allgathers while both budgets allow, then nc goes on reading
  // shards into free staging buffers (nvme home) until none is free.
  if (++walk_ == 0) {  // the generation wrapped: forget old marks
    std::fill(visited_.begin(), visited_.end(), 0);
    walk_ = 1;
  }
  for (ParamId id : op_info(trace_->entry(position).op).params) visited_[id] = walk_;
  const bool nvme = options_.param_tier == Tier::kNvme;
  int64_t ahead = 0;  // elements gathered (or gathering) for entries after the current one
  bool gg = true;
  for (size_t j = position + 1; j < trace_->size(); ++j) {
    for (ParamId id : op_info(trace_->entry(j).op).params) {
      if (visited_[id] == walk_) continue;
      visited_[id] = walk_;
      const Gathered* gathered = gathered_[id].get();
      if (gathered != nullptr && gathered->full != nullptr) {
        ahead += gathered_numel(id);
        continue;
      }
      if (gg) {
        const int64_t numel = gathered_numel(id);
        const bool in_bucket = ahead + numel <= options_.prefetch_bucket_numel;
        if (in_bucket && live_numel_ + numel > options_.max_live_parameters_numel) {
          // A copy kept for a use after entry j holds room this one needs sooner.
          release_kept(j, numel, /*prefetched_too=*/false);
        }
        if (in_bucket && live_numel_ + numel <= options_.max_live_parameters_numel) {
          issue_gather(id, /*prefetch=*/true);
          ahead += numel;
          continue;
        }
        gg = false;  // in trace order: later parameters wait for this one
        if (!nvme) return;
      }
      if (gathered != nullptr && gathered->staged >= 0) continue;
      if (!stage_read(id, /*ahead=*/true)) return;
    }
  }
}

void ZeroEngine::make_room(OpId op) {
  const auto& params = op_info(op).params;
  int64_t need = 0;
  for (ParamId id : params) {
    const Gathered* gathered = gathered_[id].get();
    if (gathered == nullptr || gathered->full == nullptr) need += gathered_numel(id);
  }
  if (live_numel_ + need <= options_.max_live_parameters_numel) return;
  // Copies kept for reuse go first, then copies prefetched for later ops
  // (there are such only when the current op was not prefetched itself:
  // budgets shrank under a kept copy); never one an open window uses.
  release_kept(0, need, /*prefetched_too=*/true);
  if (live_numel_ + need > options_.max_live_parameters_numel) {
    warn_once("zero.max_live",
              fmt::format("operator '{}' needs {} gathered elements with {} held by open windows and persistent "
                          "parameters: more than stage3_max_live_parameters ({}); gathering it anyway",
                          op_info(op).name, need, live_numel_, options_.max_live_parameters_numel));
  }
}

void ZeroEngine::release_kept(size_t after, int64_t need, bool prefetched_too) {
  // Candidates, the furthest next use first (a prefetched copy's next use is
  // unknown here: after every kept one).
  std::vector<std::pair<size_t, ParamId>> candidates;
  for (ParamId id = 0; id < parameter_count(); ++id) {
    const Gathered* gathered = gathered_[id].get();
    if (gathered == nullptr || gathered->full == nullptr) continue;
    if (persistent(id) || in_window(id, false)) continue;
    if (gathered->prefetched) {
      if (prefetched_too) candidates.emplace_back(0, id);
    } else if (gathered->kept_until == OperatorTrace::npos || gathered->kept_until > after) {
      candidates.emplace_back(gathered->kept_until == OperatorTrace::npos ? OperatorTrace::npos - 1
                                                                         : gathered->kept_until + 1,
                              id);
    }
  }
  if (candidates.empty()) return;
  std::sort(candidates.begin(), candidates.end(), std::greater<>());
  compute_stream().record(*compute_point_);
  for (const auto& [next, id] : candidates) {
    if (live_numel_ + need <= options_.max_live_parameters_numel) return;
    release_gathered(id, *compute_point_);
  }
}

void ZeroEngine::on_trace_dropped(const OperatorTrace::Advance& what, std::optional<OperatorTrace::Entry> got) {
  const auto describe = [this](const OperatorTrace::Entry& e) {
    return fmt::format("'{}' ({})", op_info(e.op).name, phase_name(e.phase));
  };
  const std::string where =
      what.pass == OperatorTrace::npos
          ? std::string()
          : fmt::format(" ({} pass {})", what.backward_pass ? "backward" : "forward", what.pass);
  std::string line;
  if (!got) {
    line = fmt::format("operator trace: step {} ended after {} of the trace's {} windows{}; expected {} next",
                       step_boundaries_ + 1, what.at, what.trace_size, where,
                       what.expected ? describe(*what.expected) : std::string("?"));
  } else if (!what.expected) {
    line = fmt::format("operator trace: step {} ran past the trace's {} windows with {}", step_boundaries_ + 1,
                       what.trace_size, describe(*got));
  } else {
    line = fmt::format("operator trace: step {} diverged at window {}{}: expected {}, got {}", step_boundaries_ + 1,
                       what.at, where, describe(*what.expected), describe(*got));
  }
  logger().info("{}; prefetch is off until the step ends and the next step records a new trace", line);
  prefetch_.trace_dropped = true;
  release_all_unused();
}

void ZeroEngine::release_all_unused() {
  compute_stream().record(*compute_point_);
  for (ParamId id = 0; id < parameter_count(); ++id) {
    if (persistent(id) || in_window(id, false)) continue;
    release_gathered(id, *compute_point_);
  }
}

void ZeroEngine::drain_staging() {
  // Callers have synchronized the gather stream (or given up on it), so every
  // deferred read has been submitted; each one's event completes after its I/O.
  for (auto& group : groups_) {
    for (auto& buffer : group->staging.buffers) {
      if (buffer.read_done != nullptr) {
        try {
          buffer.read_done->synchronize();
        } catch (...) {
          // Dropped unused, or already the gather stream's error; a read that
          // fails again fails where it is used.
        }
      }
      if (buffer.holder >= 0) gathered_[buffer.holder]->staged = -1;
      buffer.holder = -1;
    }
  }
}

void ZeroEngine::release_gathered(ParamId id, Event& after) {
  Gathered* gathered = gathered_[id].get();
  if (gathered == nullptr || gathered->full == nullptr) return;
  // A copy no pre_op used was never waited on by compute: free it after its
  // own allgather instead.
  accelerator().deallocate_after(gathered->full, gathered->prefetched ? *gathered->ready : after);
  gathered->full = nullptr;
  gathered->prefetched = false;
  gathered->kept_until = OperatorTrace::npos;
  live_numel_ -= gathered_numel(id);
  gathered_nbytes_ -= static_cast<size_t>(gathered_numel(id)) * dtype_nbytes(param_info(id).dtype);
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
  // Nothing queued may touch the home while the host does, and nothing
  // staged may outlive a write.
  compute_stream().synchronize();
  gather_stream_->synchronize();
  drain_staging();
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
  if (options_.stage == 3) {
    // The step boundary: the trace closes (or diverges by ending early), and
    // no read may still be in flight or staged when the optimizer rewrites
    // the shards (staged values would be stale after it).
    const bool was_following = trace_->following();
    if (trace_->end_step()) on_trace_dropped(trace_->ended_early(), std::nullopt);
    prefetch_.trace_followed = was_following && !prefetch_.trace_dropped && prefetch_.windows > 0;
    if (options_.param_tier == Tier::kNvme) {
      gather_stream_->synchronize();  // prefetched gathers' reads have landed (an error is the step's)
      drain_staging();
    }
    last_prefetch_ = prefetch_;
    prefetch_ = PrefetchStats{};
    ++step_boundaries_;
  }
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
  const double loss_scale = loss_scaler_.scale();
  result.loss_scale = loss_scale;
  // The gradients hold loss_scale x the true ones; report the true norm.
  result.grad_norm = global.finite ? global.norm() / loss_scale : std::numeric_limits<double>::infinity();
  if (!global.finite) {
    // Every rank saw the same reduced flags, so every rank skips and backs off alike.
    if (options_.loss_scaling) {
      logger().info("step {}: the gradients overflow at loss scale {} on {} rank(s); the step is skipped", steps_ + 1,
                    loss_scale, reduced[1]);
    } else {
      logger().warn("step {}: a gradient is not finite on {} rank(s); the step is skipped", steps_ + 1, reduced[1]);
    }
    zero_grad();
    loss_scaler_.update(true);  // throws at the minimum scale: no progress is possible
    result.step = steps_;
    return result;
  }
  loss_scaler_.update(false);
  result.grad_scale = kernels::combined_grad_scale(global, static_cast<float>(loss_scale),
                                                   static_cast<float>(options_.gradient_clipping));
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
