// ZeroEngine's stage-3 parameter coordinator: the pre_op/post_op hooks,
// on-demand and prefetched gathers (gg), NVMe->pinned reads into staging (nc),
// the operator trace, and the live/reuse budgets. See zero_engine.h.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>

#include "nvme/aio_handle.h"
#include "partition/layout.h"
#include "core/error.h"
#include "core/log.h"
#include "core/trace_recorder.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/engine/zero_engine_parts.h"

namespace strata::engine {

// ---- stall accounting ---------------------------------------------------------------

// One step's stall figures. The training thread opens an entry per timed
// (op, phase) and enqueues the host functions; the compute stream's host
// functions stamp and add. The stream runs its host functions one at a time
// and in order, so one bracket is open at a time and `begin_ns` is its start.
struct StallLog {
  explicit StallLog(size_t op_count) : entries(op_count * kPhases) {}
  static constexpr size_t kPhases = 3;  // Phase's values

  std::mutex mutex;
  std::vector<OpStall> entries;  // per op * kPhases + phase; op < 0 until first timed
  double seconds = 0;
  int64_t windows = 0;
  int64_t begin_ns = 0;
};

namespace {

size_t stall_index(OpId op, Phase phase) {
  return static_cast<size_t>(op) * StallLog::kPhases + static_cast<size_t>(phase);
}

// Makes `compute` wait for every event of `waits` (a window's parameters)
// and, when one of them is not complete yet, times that wait on the stream
// itself: host functions right before and right after it stamp the time, so
// the difference is how long the stream sat there. A complete event cannot
// stall the stream, so its wait costs no host function.
void wait_timed(Stream& compute, PrefetchStats& stats, int32_t op_count, OpId op, Phase phase,
                const std::string& name, const std::vector<Event*>& waits) {
  const bool pending = std::any_of(waits.begin(), waits.end(), [](Event* e) { return !e->query(); });
  if (!pending) {
    for (Event* e : waits) compute.wait(*e);
    return;
  }
  if (stats.stall_log == nullptr) stats.stall_log = std::make_shared<StallLog>(static_cast<size_t>(op_count));
  const size_t index = stall_index(op, phase);
  {
    std::lock_guard lock(stats.stall_log->mutex);
    OpStall& entry = stats.stall_log->entries[index];
    if (entry.op < 0) {  // the stream reads only seconds/windows: the name is set here, once
      entry.op = op;
      entry.phase = phase;
      entry.name = name;
    }
  }
  compute.launch_host_func([log = stats.stall_log] {
    const int64_t now = trace::now_ns();
    std::lock_guard lock(log->mutex);
    log->begin_ns = now;
  });
  for (Event* e : waits) compute.wait(*e);
  compute.launch_host_func([log = stats.stall_log, index] {
    const int64_t end = trace::now_ns();
    int64_t begin = 0;
    std::string_view name;
    {
      std::lock_guard lock(log->mutex);
      begin = log->begin_ns;
      OpStall& entry = log->entries[index];
      const double seconds = static_cast<double>(end - begin) * 1e-9;
      entry.seconds += seconds;
      ++entry.windows;
      log->seconds += seconds;
      ++log->windows;
      name = entry.name;  // set before this function was enqueued; never changes
    }
    if (trace::enabled()) {
      trace::Args args;
      args.detail_key = "op";
      args.detail = name;
      args.value_key = "stall_us";
      args.value = (end - begin) / 1000;
      trace::complete("engine", "param stall", begin, end, args);
    }
  });
}

}  // namespace

double PrefetchStats::param_stall_seconds() const {
  if (stall_log == nullptr) return 0;
  std::lock_guard lock(stall_log->mutex);
  return stall_log->seconds;
}

int64_t PrefetchStats::stalled_windows() const {
  if (stall_log == nullptr) return 0;
  std::lock_guard lock(stall_log->mutex);
  return stall_log->windows;
}

std::vector<OpStall> PrefetchStats::op_stalls() const {
  std::vector<OpStall> out;
  if (stall_log == nullptr) return out;
  {
    std::lock_guard lock(stall_log->mutex);
    for (const OpStall& entry : stall_log->entries) {
      if (entry.windows > 0) out.push_back(entry);
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const OpStall& a, const OpStall& b) { return a.seconds > b.seconds; });
  return out;
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
  const OpInfo& info = op_info(op);
  std::vector<Event*> waits;
  waits.reserve(info.params.size());
  for (ParamId id : info.params) {
    fetch(id);
    waits.push_back(gathered_[id]->ready.get());
  }
  wait_timed(compute_stream(), prefetch_, operator_count(), op, phase, info.name, waits);
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

void ZeroEngine::wait_for_room(int64_t need) {
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
  // pre_op makes compute wait on gathered.ready (timed: wait_timed).
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
  wait_for_room(gathered_numel(id));
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
  prefetch_.gather_nbytes += full_nbytes;
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
  prefetch_.read_nbytes += slot.slice_nbytes();
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
  if (!gathered->prefetched) {
    // Compute may still read it: its memory is free once compute passes here.
    std::shared_ptr<Event> point = accelerator().create_event();
    compute_stream().record(*point);
    releasing_.push_back({std::move(point), gathered_numel(id)});
    releasing_numel_ += gathered_numel(id);
  }
  // A copy no pre_op used was never waited on by compute: free it after its
  // own allgather instead.
  accelerator().deallocate_after(gathered->full, gathered->prefetched ? *gathered->ready : after);
  gathered->full = nullptr;
  gathered->prefetched = false;
  gathered->kept_until = OperatorTrace::npos;
  live_numel_ -= gathered_numel(id);
  gathered_nbytes_ -= static_cast<size_t>(gathered_numel(id)) * dtype_nbytes(param_info(id).dtype);
}

}  // namespace strata::engine
