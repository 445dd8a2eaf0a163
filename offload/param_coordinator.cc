// The stage-3 parameter coordinator: the pre_op/post_op hooks, on-demand and
// prefetched gathers (gg), home->pinned reads into staging (nc), the operator
// trace, and the live/reuse budgets. See param_coordinator.h.
#include "offload/param_coordinator.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "offload/param_stall.h"

namespace strata::offload {

// A gathered full parameter (world x slice elements).
struct ParamCoordinator::Gathered {
  void* full = nullptr;
  std::unique_ptr<Event> ready;  // on the gather stream, after the allgather
  bool prefetched = false;       // gathered ahead; no pre_op has used this copy yet
  size_t kept_until = OperatorTrace::npos;  // kept for reuse: the trace entry that uses it next
  int staged = -1;               // the staging buffer holding its read, -1: none
  bool read_after_update = false;  // its staged read waits for the optimizer's update of the slice
  bool after_update = false;     // its latest gather is ordered after the optimizer's update of the slice
};

// The pinned staging buffers of one home (nc). A buffer is free when no
// parameter holds it and the gather stream is past its last reader.
struct ParamCoordinator::Staging {
  struct Buffer {
    void* data = nullptr;
    ParamId holder = -1;                   // the parameter whose read it holds (no gather yet), -1: none
    std::shared_ptr<HostEvent> read_done;  // its latest read (shared with the read's callback)
    // Gather stream, after the copy / allgather that last read the buffer; a
    // fresh event per reader, since a deferred read waits for this one point.
    std::shared_ptr<Event> consumed;
    uint64_t consumed_seq = 0;             // order of `consumed` on the gather stream
  };
  ParamHome* home = nullptr;
  std::vector<Buffer> buffers;
};

namespace {

// A read completion that completes `done` (on the I/O worker). It holds its
// own reference, so the event outlives the signal even when the coordinator
// has moved on.
ParamHome::DoneFn complete_with(std::shared_ptr<HostEvent> done) {
  return [done = std::move(done)](std::exception_ptr error) {
    if (error) {
      done->fail(std::move(error));
    } else {
      done->signal();
    }
  };
}

}  // namespace

// nc reads that must wait until the gather stream is past a staging buffer's
// last reader: one thread takes them in issue order (the gather stream's
// order), waits for that point and submits the read, whose completion
// completes the HostEvent the gather stream waits on. So a gather issued far
// ahead never blocks the host for a buffer, and no thread blocks per read.
// No cycle: the point a read waits for lies before, on the gather stream, the
// wait on that read's own event.
class ParamCoordinator::ReadQueue {
 public:
  struct Item {
    std::shared_ptr<Event> after;  // null: no buffer reader to wait for
    // The optimizer's update of the range (HomeUpdate): the read starts after
    // them, and fails with the first one's error instead of reading.
    std::vector<std::shared_ptr<Event>> updates;
    ParamHome* home = nullptr;
    void* buf = nullptr;
    size_t nbytes = 0;
    uint64_t offset = 0;
    std::shared_ptr<HostEvent> done;
  };
  ReadQueue() : thread_([this] { run(); }) {}
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
      std::exception_ptr update_error;
      for (const auto& update : item.updates) {
        try {
          update->synchronize();
        } catch (...) {
          if (!update_error) update_error = std::current_exception();
        }
      }
      try {
        if (item.after) item.after->synchronize();
      } catch (...) {
        // The reader failed, but it is over: the buffer may be written. (Its
        // error reached the gather stream already.)
      }
      if (update_error) {
        item.done->fail(update_error);
        continue;
      }
      try {
        item.home->read_async(item.buf, item.nbytes, item.offset, complete_with(item.done));
      } catch (...) {
        item.done->fail(std::current_exception());
      }
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> items_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

ParamCoordinator::ParamCoordinator(Accelerator& accelerator, Stream& compute, Stream& gather,
                                   partition::Communicator& gather_comm, CoordinatorOptions options,
                                   std::vector<CoordinatedParam> params, std::vector<CoordinatedOp> ops)
    : accelerator_(accelerator),
      compute_(compute),
      gather_(gather),
      comm_(gather_comm),
      options_(options),
      params_(std::move(params)),
      ops_(std::move(ops)),
      trace_([this](OpId op) -> const std::vector<ParamId>& { return ops_[static_cast<size_t>(op)].params; },
             [this](ParamId id) { return gathered_numel(id); }) {
  const size_t count = params_.size();
  std::vector<int32_t> op_layer;
  for (const CoordinatedOp& op : ops_) op_layer.push_back(op.layer);
  layers_ = LayerTally(std::move(op_layer), count,
                       [this](OpId op) -> const std::vector<ParamId>& { return ops_[static_cast<size_t>(op)].params; });
  gathered_.resize(count);
  open_uses_.assign(count, 0);
  visited_.assign(count, 0);
  staging_of_.assign(count, -1);
  compute_point_ = accelerator_.create_event();
  // nc staging per home the gathers cannot read in place: one buffer holds
  // one slice, so buffers larger than the largest slice, or more of them than
  // there are slices, would only pin memory that is never used.
  for (size_t id = 0; id < count; ++id) {
    ParamHome* home = params_[id].home;
    if (home == nullptr || home->memory() != nullptr) continue;
    auto it = std::find_if(staging_.begin(), staging_.end(), [&](const auto& s) { return s->home == home; });
    if (it == staging_.end()) {
      staging_.push_back(std::make_unique<Staging>());
      staging_.back()->home = home;
      it = staging_.end() - 1;
    }
    staging_of_[id] = static_cast<int>(it - staging_.begin());
  }
  for (size_t s = 0; s < staging_.size(); ++s) {
    Staging& staging = *staging_[s];
    const DType dtype = staging.home->dtype();
    size_t largest = 0, members = 0;
    for (size_t id = 0; id < count; ++id) {
      if (staging_of_[id] != static_cast<int>(s)) continue;
      largest = std::max(largest, params_[id].slice_numel);
      ++members;
    }
    STRATA_CHECK(largest <= static_cast<size_t>(options_.param_buffer_numel), kBadArgument,
                 "offload_param.buffer_size ({} elements) is smaller than this rank's largest {} parameter slice "
                 "({} elements); raise it",
                 options_.param_buffer_numel, dtype_name(dtype), largest);
    staging.buffers.resize(std::min(options_.param_buffer_count, members));
    for (auto& buffer : staging.buffers) buffer.data = accelerator_.allocate_pinned(largest * dtype_nbytes(dtype));
  }
  if (!staging_.empty()) read_queue_ = std::make_unique<ReadQueue>();
}

ParamCoordinator::~ParamCoordinator() {
  read_queue_.reset();  // submits what is left (every point it waits for is passed)
  drain_staging();      // reads in flight write into the staging buffers
  for (auto& staging : staging_) {
    for (auto& buffer : staging->buffers) accelerator_.deallocate_pinned(buffer.data);
  }
  for (auto& gathered : gathered_) {
    if (gathered && gathered->full) accelerator_.deallocate(gathered->full);
  }
}

void* ParamCoordinator::full(ParamId id) const {
  const Gathered* gathered = gathered_[static_cast<size_t>(id)].get();
  STRATA_CHECK(gathered != nullptr && gathered->full != nullptr, kInternal, "parameter {} is not gathered", id);
  return gathered->full;
}

bool ParamCoordinator::gathered(ParamId id) const {
  const Gathered* gathered = gathered_[static_cast<size_t>(id)].get();
  return gathered != nullptr && gathered->full != nullptr;
}

// ---- hooks --------------------------------------------------------------------------

void ParamCoordinator::pre_op(OpId op, Phase phase) {
  // Paused: not a window of the step (position npos: no prefetch, no reuse).
  const OperatorTrace::Advance advance = trace_paused_ ? OperatorTrace::Advance{} : trace_.advance(op, phase);
  window_position_.push_back({op, advance.position});
  if (advance.dropped) on_trace_dropped(advance, OperatorTrace::Entry{op, phase});
  if (!trace_paused_) {
    ++current_.windows;
    ++layers_.of_op(current_.layer_counts, op).windows;
  }
  const CoordinatedOp& info = ops_[static_cast<size_t>(op)];
  for (ParamId id : info.params) ++open_uses_[static_cast<size_t>(id)];
  make_room(op);
  std::vector<Event*> waits;
  waits.reserve(info.params.size());
  bool after_update = false;  // a gather waits for the optimizer's update: the stall is the optimizer's too
  for (ParamId id : info.params) {
    fetch(id);
    const Gathered& gathered = *gathered_[static_cast<size_t>(id)];
    waits.push_back(gathered.ready.get());
    after_update = after_update || (gathered.after_update && !gathered.ready->query());
  }
  wait_timed(compute_, current_, ops_.size(), op, phase, info.name, waits, layers_, after_update);
  if (advance.position != OperatorTrace::npos && options_.prefetch_bucket_numel > 0) {
    prefetch_from(advance.position);
  }
}

void ParamCoordinator::post_op(OpId op, Phase /*phase*/) {
  // Windows may close in any order; an operator is open at most once.
  const auto open = std::find_if(window_position_.begin(), window_position_.end(),
                                 [&](const OpenWindow& w) { return w.op == op; });
  STRATA_CHECK(open != window_position_.end(), kInternal, "post_op of operator '{}', which is not open",
               ops_[static_cast<size_t>(op)].name);
  const size_t position = open->position;
  window_position_.erase(open);
  for (ParamId id : ops_[static_cast<size_t>(op)].params) --open_uses_[static_cast<size_t>(id)];
  keep_or_release(op, position);
}

void ParamCoordinator::skip_op(OpId op, Phase phase) {
  const OperatorTrace::Advance advance =
      trace_paused_ ? OperatorTrace::Advance{} : trace_.advance(op, phase, /*skipped=*/true);
  if (advance.dropped) on_trace_dropped(advance, OperatorTrace::Entry{op, phase});
  if (!trace_paused_) {
    ++current_.skipped_windows;
    ++layers_.of_op(current_.layer_counts, op).skipped_windows;
  }
  keep_or_release(op, advance.position);
  if (advance.position != OperatorTrace::npos && options_.prefetch_bucket_numel > 0) {
    prefetch_from(advance.position);
  }
}

void ParamCoordinator::plan_skip(std::span<const OpId> ops, std::span<const uint8_t> skipped) {
  if (trace_paused_) return;
  for (size_t i = 0; i < ops.size(); ++i) trace_.plan_skip(ops[i], skipped[i] != 0);
  if (!trace_.following()) return;
  // Fetch ahead by the plan now rather than at the next window, which would
  // itself be fetched on demand after a wrong prediction.
  const size_t position = trace_.position();
  if (position > 0 && options_.prefetch_bucket_numel > 0) prefetch_from(position - 1);
}

void ParamCoordinator::keep_or_release(OpId op, size_t position) {
  compute_.record(*compute_point_);
  const auto& params = ops_[static_cast<size_t>(op)].params;
  // The trace may have been dropped since this window opened: then its
  // position says nothing about the future any more.
  const bool follow = position != OperatorTrace::npos && trace_.following();
  for (size_t k = 0; k < params.size(); ++k) {
    const ParamId id = params[k];
    if (!gathered(id)) continue;  // a skipped window's parameter nobody fetched
    if (persistent(id)) continue;
    if (in_use(id)) continue;  // an enclosing window still uses it
    if (follow) {
      // Used again soon (by the trace): keep it rather than gather it again.
      const size_t next = trace_.next_use(position, k);
      if (next != OperatorTrace::npos && trace_.numel_between(position, next) <= options_.max_reuse_distance_numel) {
        gathered_[static_cast<size_t>(id)]->kept_until = next;
        continue;
      }
    }
    release_gathered(id, *compute_point_);
  }
}

void ParamCoordinator::end_step() {
  const bool was_following = trace_.following();
  if (trace_.end_step()) on_trace_dropped(trace_.ended_early(), std::nullopt);
  current_.trace_followed = was_following && !current_.trace_dropped && current_.windows > 0;
  // No read may still be in flight or staged when the homes are rewritten
  // (staged values would be stale after it).
  if (!staging_.empty()) {
    gather_.synchronize();  // prefetched gathers' reads have landed (an error is the step's)
    drain_staging();
  }
  end_step_timeline(compute_, current_, layers_);
  last_ = current_;
  current_ = PrefetchStats{};
  ++step_boundaries_;
}

void ParamCoordinator::quiesce() {
  gather_.synchronize();
  drain_staging();
}

void ParamCoordinator::release_all() {
  compute_.record(*compute_point_);
  for (ParamId id = 0; id < static_cast<ParamId>(params_.size()); ++id) release_gathered(id, *compute_point_);
}

void ParamCoordinator::release(ParamId id) {
  compute_.record(*compute_point_);
  release_gathered(id, *compute_point_);
}

// ---- gathers and budgets --------------------------------------------------------------

void ParamCoordinator::wait_for_room(int64_t need) {
  // Host bookkeeping releases a copy at post_op, but the compute stream may
  // still be many operators behind the host and read it: its memory is free
  // only when compute passes that post_op. Without this wait the host, which
  // never waits for compute in forward, would gather the whole model ahead
  // of it. Blocking changes no decision (the collectives stay the same on
  // every rank); it only keeps live + releasing within max_live_parameters.
  while (!releasing_.empty() && releasing_.front().after->query()) {
    releasing_numel_ -= releasing_.front().numel;
    releasing_.pop_front();
  }
  while (!releasing_.empty() && live_numel_ + releasing_numel_ + need > options_.max_live_parameters_numel) {
    releasing_.front().after->synchronize();  // a failed compute stream throws here: the step's error
    releasing_numel_ -= releasing_.front().numel;
    releasing_.pop_front();
  }
}

int64_t ParamCoordinator::gathered_numel(ParamId id) const {
  return static_cast<int64_t>(params_[static_cast<size_t>(id)].slice_numel) * comm_of(id).world_size();
}

size_t ParamCoordinator::gathered_bytes(ParamId id) const {
  const CoordinatedParam& param = params_[static_cast<size_t>(id)];
  if (param.expand) return param.expanded_nbytes;
  return static_cast<size_t>(gathered_numel(id)) * dtype_nbytes(param.home->dtype());
}

partition::Communicator& ParamCoordinator::comm_of(ParamId id) const {
  partition::Communicator* comm = params_[static_cast<size_t>(id)].comm;
  return comm != nullptr ? *comm : comm_;
}

bool ParamCoordinator::persistent(ParamId id) const {
  return params_[static_cast<size_t>(id)].numel <= options_.persistence_threshold_numel;
}

ParamCoordinator::Staging* ParamCoordinator::staging_of(ParamId id) {
  const int s = staging_of_[static_cast<size_t>(id)];
  return s < 0 ? nullptr : staging_[static_cast<size_t>(s)].get();
}

void ParamCoordinator::fetch(ParamId id) {
  auto& slot = gathered_[static_cast<size_t>(id)];
  if (slot == nullptr) slot = std::make_unique<Gathered>();
  Gathered& gathered = *slot;
  if (gathered.full == nullptr) {
    ++current_.on_demand;
    issue_gather(id, /*prefetch=*/false);
  } else if (gathered.prefetched) {
    ++(gathered.ready->query() ? current_.prefetched_ready : current_.prefetched_in_flight);
    gathered.prefetched = false;
  } else {
    ++current_.reused;
  }
  gathered.kept_until = OperatorTrace::npos;
  // pre_op makes compute wait on gathered.ready (timed: wait_timed).
}

void ParamCoordinator::issue_gather(ParamId id, bool prefetch) {
  auto& slot = gathered_[static_cast<size_t>(id)];
  if (slot == nullptr) slot = std::make_unique<Gathered>();
  Gathered& gathered = *slot;
  const CoordinatedParam& param = params_[static_cast<size_t>(id)];
  const DType dtype = param.home->dtype();
  const size_t slice_nbytes = param.slice_numel * dtype_nbytes(dtype);
  partition::Communicator& comm = comm_of(id);
  const size_t full_nbytes = slice_nbytes * static_cast<size_t>(comm.world_size());
  if (gathered.ready == nullptr) gathered.ready = accelerator_.create_event();
  // nc first (it may block for a staging buffer): nothing is allocated yet.
  Staging* staging = staging_of(id);
  Staging::Buffer* staged = nullptr;
  if (staging != nullptr) {
    if (gathered.staged < 0) stage_read(id, /*ahead=*/false);
    staged = &staging->buffers[static_cast<size_t>(gathered.staged)];
  }
  wait_for_room(gathered_numel(id));
  gathered.full = accelerator_.allocate(gathered_bytes(id));
  // An expanded parameter's stored elements land in scratch first.
  void* target = param.expand ? accelerator_.allocate(full_nbytes) : gathered.full;

  // The slice as the allgather reads it: in the home's memory, or staged.
  const char* slice = nullptr;
  if (staged != nullptr) {
    // The read lands before anything after this wait runs on the gather
    // stream; a failed read becomes the gather stream's error.
    gather_.wait(*staged->read_done);
    slice = static_cast<const char*>(staged->data);
    gathered.after_update = gathered.read_after_update;
  } else {
    slice = static_cast<const char*>(param.home->memory()) + param.home_offset_numel * dtype_nbytes(dtype);
    // Read in place: after the optimizer has written the slice's new values.
    gathered.after_update = false;
    for (const auto& update : update_events(id)) {
      if (!update->query()) gathered.after_update = true;
      gather_.wait(*update);
    }
  }
  if (gathered.after_update) ++current_.gathers_after_update;
  const void* src = slice;
  void* device_copy = nullptr;
  if (param.home->tier() != Tier::kDevice && !accelerator_.host_addressable()) {
    // cg: pinned -> device on the gather stream, right before the allgather.
    device_copy = accelerator_.allocate(slice_nbytes);
    accelerator_.copy_async(device_copy, slice, slice_nbytes, CopyKind::kHostToDevice, gather_);
    src = device_copy;
  }
  const auto mark_consumed = [&] {  // the staging buffer is free once this point is passed
    staged->consumed = accelerator_.create_event();
    gather_.record(*staged->consumed);
    staged->consumed_seq = ++consumed_seq_;
  };
  if (staged != nullptr && device_copy != nullptr) mark_consumed();
  comm.allgather(src, target, param.slice_numel, dtype, gather_);
  if (param.expand) param.expand(target, gathered.full, gather_);
  ++gathers_issued_;
  ++current_.gathers;
  current_.gather_nbytes += full_nbytes;
  LayerFetch& layer = layers_.of_param(current_.layer_counts, id);
  ++layer.gathers;
  layer.gather_nbytes += full_nbytes;
  layers_.trace_bytes(layer);
  gather_.record(*gathered.ready);
  if (staged != nullptr) {
    if (device_copy == nullptr) mark_consumed();  // the allgather read it
    staged->holder = -1;
    gathered.staged = -1;
  }
  if (device_copy != nullptr) accelerator_.deallocate_after(device_copy, *gathered.ready);
  if (target != gathered.full) accelerator_.deallocate_after(target, *gathered.ready);
  gathered.prefetched = prefetch;
  live_numel_ += gathered_numel(id);
  gathered_nbytes_ += gathered_bytes(id);
  peak_gathered_nbytes_ = std::max(peak_gathered_nbytes_, gathered_nbytes_);
  current_.peak_gathered_nbytes = std::max(current_.peak_gathered_nbytes, gathered_nbytes_);
}

std::vector<std::shared_ptr<Event>> ParamCoordinator::update_events(ParamId id) const {
  std::vector<std::shared_ptr<Event>> events;
  const CoordinatedParam& param = params_[static_cast<size_t>(id)];
  for (const HomeUpdate& update : home_updates_) {
    if (update.home != param.home || update.stride_numel == 0 || param.slice_numel == 0) continue;
    const size_t first = param.home_offset_numel / update.stride_numel;
    const size_t last = (param.home_offset_numel + param.slice_numel - 1) / update.stride_numel;
    for (size_t k = first; k <= last && k < update.ready.size(); ++k) events.push_back(update.ready[k]);
  }
  return events;
}

bool ParamCoordinator::stage_read(ParamId id, bool ahead) {
  Staging& staging = *staging_of(id);
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
    gathered_[static_cast<size_t>(buffer->holder)]->staged = -1;
    buffer->holder = -1;
    ++current_.blocked_waits;
    current_.blocked_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const CoordinatedParam& param = params_[static_cast<size_t>(id)];
  const size_t element_nbytes = dtype_nbytes(param.home->dtype());
  const size_t nbytes = param.slice_numel * element_nbytes;
  const uint64_t offset = param.home_offset_numel * element_nbytes;
  std::shared_ptr<HostEvent> done = accelerator_.create_host_event();
  // The optimizer may still be writing the range (its update overlapping this forward).
  std::vector<std::shared_ptr<Event>> updates = update_events(id);
  const bool update_pending = std::any_of(updates.begin(), updates.end(), [](const auto& e) { return !e->query(); });
  std::exception_ptr update_error;
  if (!update_pending) {
    for (const auto& update : updates) {
      try {
        update->synchronize();  // complete: returns at once, or names how the update failed
      } catch (...) {
        update_error = std::current_exception();
        break;
      }
    }
  }
  if (update_error) {
    done->fail(update_error);  // the gather fails as for a failed read
  } else if (deferred || update_pending) {
    ReadQueue::Item item{deferred ? buffer->consumed : nullptr, {}, param.home, buffer->data, nbytes, offset, done};
    if (update_pending) item.updates = std::move(updates);
    read_queue_->push(std::move(item));
    if (deferred) ++current_.reads_deferred;
    if (update_pending) ++current_.reads_after_update;
  } else {
    param.home->read_async(buffer->data, nbytes, offset, complete_with(done));
  }
  buffer->read_done = std::move(done);
  buffer->holder = id;
  auto& slot = gathered_[static_cast<size_t>(id)];
  if (slot == nullptr) slot = std::make_unique<Gathered>();
  slot->staged = static_cast<int>(buffer - staging.buffers.data());
  slot->read_after_update = update_pending;
  ++current_.reads;
  current_.read_nbytes += nbytes;
  LayerFetch& layer = layers_.of_param(current_.layer_counts, id);
  ++layer.reads;
  layer.read_nbytes += nbytes;
  layers_.trace_bytes(layer);
  if (ahead) ++current_.reads_ahead;
  return true;
}

void ParamCoordinator::prefetch_from(size_t position) {
  // One walk along the trace after the current entry, each parameter once:
  // gg issues allgathers while both budgets allow, then nc goes on reading
  // slices into free staging buffers until none is free.
  if (++walk_ == 0) {  // the generation wrapped: forget old marks
    std::fill(visited_.begin(), visited_.end(), 0);
    walk_ = 1;
  }
  for (ParamId id : ops_[static_cast<size_t>(trace_.entry(position).op)].params) visited_[static_cast<size_t>(id)] = walk_;
  int64_t ahead = 0;  // elements gathered (or gathering) for entries after the current one
  bool gg = true;
  for (size_t j = position + 1; j < trace_.size(); ++j) {
    if (trace_.skipped(j)) continue;  // planned, or predicted from the last step
    // Routing not known yet (a later layer's experts): nc reads ahead what the
    // last step routed; gg gathers only what a plan says runs.
    const bool predicted = trace_.predicted(j);
    for (ParamId id : ops_[static_cast<size_t>(trace_.entry(j).op)].params) {
      if (visited_[static_cast<size_t>(id)] == walk_) continue;
      visited_[static_cast<size_t>(id)] = walk_;
      const Gathered* gathered = gathered_[static_cast<size_t>(id)].get();
      if (gathered != nullptr && gathered->full != nullptr) {
        ahead += gathered_numel(id);
        continue;
      }
      if (predicted) {
        if (staging_of(id) == nullptr || (gathered != nullptr && gathered->staged >= 0)) continue;
        if (!stage_read(id, /*ahead=*/true) && !gg) return;
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
        if (staging_.empty()) return;
      }
      if (staging_of(id) == nullptr) continue;  // read in place by its gather
      if (gathered != nullptr && gathered->staged >= 0) continue;
      if (!stage_read(id, /*ahead=*/true)) return;
    }
  }
}

void ParamCoordinator::make_room(OpId op) {
  const auto& params = ops_[static_cast<size_t>(op)].params;
  int64_t need = 0;
  for (ParamId id : params) {
    if (!gathered(id)) need += gathered_numel(id);
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
                          ops_[static_cast<size_t>(op)].name, need, live_numel_,
                          options_.max_live_parameters_numel));
  }
}

void ParamCoordinator::release_kept(size_t after, int64_t need, bool prefetched_too) {
  // Candidates, the furthest next use first (a prefetched copy's next use is
  // unknown here: after every kept one).
  std::vector<std::pair<size_t, ParamId>> candidates;
  for (ParamId id = 0; id < static_cast<ParamId>(params_.size()); ++id) {
    const Gathered* gathered = gathered_[static_cast<size_t>(id)].get();
    if (gathered == nullptr || gathered->full == nullptr) continue;
    if (persistent(id) || in_use(id)) continue;
    if (gathered->prefetched) {
      if (prefetched_too) candidates.emplace_back(0, id);
    } else if (gathered->kept_until == OperatorTrace::npos || gathered->kept_until > after) {
      candidates.emplace_back(
          gathered->kept_until == OperatorTrace::npos ? OperatorTrace::npos - 1 : gathered->kept_until + 1, id);
    }
  }
  if (candidates.empty()) return;
  std::sort(candidates.begin(), candidates.end(), std::greater<>());
  compute_.record(*compute_point_);
  for (const auto& [next, id] : candidates) {
    if (live_numel_ + need <= options_.max_live_parameters_numel) return;
    release_gathered(id, *compute_point_);
  }
}

void ParamCoordinator::on_trace_dropped(const OperatorTrace::Advance& what,
                                        std::optional<OperatorTrace::Entry> got) {
  const auto describe = [this](const OperatorTrace::Entry& e) {
    return fmt::format("'{}' ({})", ops_[static_cast<size_t>(e.op)].name, phase_name(e.phase));
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
  current_.trace_dropped = true;
  release_all_unused();
}

void ParamCoordinator::release_all_unused() {
  compute_.record(*compute_point_);
  for (ParamId id = 0; id < static_cast<ParamId>(params_.size()); ++id) {
    if (persistent(id) || in_use(id)) continue;
    release_gathered(id, *compute_point_);
  }
}

void ParamCoordinator::drain_staging() {
  // Callers have synchronized the gather stream (or given up on it), so every
  // deferred read has been submitted; each one's event completes after its I/O.
  for (auto& staging : staging_) {
    for (auto& buffer : staging->buffers) {
      if (buffer.read_done != nullptr) {
        try {
          buffer.read_done->synchronize();
        } catch (...) {
          // Dropped unused, or already the gather stream's error; a read that
          // fails again fails where it is used.
        }
      }
      if (buffer.holder >= 0) gathered_[static_cast<size_t>(buffer.holder)]->staged = -1;
      buffer.holder = -1;
    }
  }
}

void ParamCoordinator::release_gathered(ParamId id, Event& after) {
  Gathered* gathered = gathered_[static_cast<size_t>(id)].get();
  if (gathered == nullptr || gathered->full == nullptr) return;
  if (!gathered->prefetched) {
    // Compute may still read it: its memory is free once compute passes here.
    std::shared_ptr<Event> point = accelerator_.create_event();
    compute_.record(*point);
    releasing_.push_back({std::move(point), gathered_numel(id)});
    releasing_numel_ += gathered_numel(id);
  }
  // A copy no pre_op used was never waited on by compute: free it after its
  // own allgather instead.
  accelerator_.deallocate_after(gathered->full, gathered->prefetched ? *gathered->ready : after);
  gathered->full = nullptr;
  gathered->prefetched = false;
  gathered->kept_until = OperatorTrace::npos;
  live_numel_ -= gathered_numel(id);
  gathered_nbytes_ -= gathered_bytes(id);
}

}  // namespace strata::offload
