// The optimizer of this rank's shards: the step in parts at the boundary, and
// the optimizer overlapping backward — sub-groups updated by the optimizer
// thread as their gradients become final, speculating that the step applies
// unclipped, rolled back exactly when it does not; or, after a step that
// clipped, their statistics taken and state read ahead, so the boundary is
// left the arithmetic. See shard_optimizer.h.
#include "offload/shard_optimizer.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "core/trace_recorder.h"
#include "offload/pinned_pool.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

// Pool buffers a speculating thread leaves free when it reads state ahead of
// a sub-group's gradient: the pipeline's read of the next sub-group beside
// the update of the current one.
constexpr size_t kPipelineBuffers = 2;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

const char* overlap_mode_name(OverlapMode mode) {
  return mode == OverlapMode::kSpeculate ? "speculate" : "read-ahead";
}

size_t sub_group_stride(const partition::PartitionLayout& layout, DType dtype, int64_t sub_group_numel) {
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

// One dtype group: its optimizer and, for the overlap, what each sub-group
// waits for. pending, landed and armed change under Overlap::mutex (on the
// reducer stream's host thread); stats are written by whoever drives the
// swapper (one at a time).
struct ShardOptimizer::Group {
  OptimizedShard shard;
  // One of the two.
  std::unique_ptr<OptimizerSwapper> swapper;
  std::unique_ptr<DeviceOptimizer> device;
  size_t sub_group_numel = 0;                           // uniform sub-group length
  std::vector<std::vector<uint32_t>> param_sub_groups;  // per member: the sub-groups its slice meets
  std::vector<int32_t> members_of_sub_group;            // per sub-group: members whose slice meets it
  std::vector<int32_t> pending;                         // per sub-group: members not landed since arming
  std::vector<int32_t> landed;                          // per member: landings since arming
  bool armed = false;                                   // counting the last backward's landings
  bool landed_twice = false;                            // a member landed twice: more than one backward
  std::vector<kernels::GradStats> stats;                // per sub-group: its gradient's statistics
  std::vector<uint8_t> stats_known;                     // per sub-group: stats computed this step
  // The order sub-groups became final in since arming, and in the last
  // backward that finalized them all: the next one's, to read state ahead by.
  std::vector<size_t> final_order;
  std::vector<size_t> predicted_order;

  size_t sub_group_count() const { return swapper ? swapper->sub_group_count() : device->sub_group_count(); }
  std::pair<size_t, size_t> sub_group_range(size_t k) const {
    return swapper ? swapper->sub_group_range(k) : device->sub_group_range(k);
  }
};

// The thread that updates sub-groups as they become final, and its queue.
struct ShardOptimizer::Overlap {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<std::pair<size_t, size_t>> ready;  // (group, sub-group) final, not yet updated
  bool stop = false;
  bool busy = false;                 // updating a batch taken from `ready`
  uint64_t generation = 0;           // of arming: an arming queued on a reducer stream before a
                                     // settle or a failed prepare must not arm
  std::exception_ptr error;          // the first failure of the thread (rethrown by settle())
  double busy_seconds = 0;           // since prepare
  int64_t updated = 0;               // sub-groups the thread updated since prepare
  int64_t prefetched = 0;            // speculating: sub-groups whose state was read ahead since prepare
  OverlapMode mode = OverlapMode::kSpeculate;  // prepare's
  float lr = 0;                      // prepare's
  int backwards = 1;                 // prepare's: the landings that make a member final
  float grad_scale = 1;              // the speculated one
  double loss_scale = 1;
  // apply_async's work: set by the caller, run once by the thread.
  std::function<void()> job;
  bool job_done = false;             // the job ran; finish() takes its outcome
  std::exception_ptr job_error;
  double job_busy_seconds = 0;
  std::thread thread;
};

ShardOptimizer::ShardOptimizer(Accelerator& accelerator, ops::Ops& ops, Stream& home_stream, nvme::AioHandle* aio,
                               ShardOptimizerOptions options, std::vector<OptimizedShard> shards)
    : accelerator_(accelerator), home_stream_(home_stream), options_(std::move(options)) {
  // Fine-tuning with clipping on clips from the first steps: read ahead until a step does not.
  last_clipped_ = options_.clipping;
  overlap_ = std::make_unique<Overlap>();
  PinnedBufferPool* pool = nullptr;
  for (const OptimizedShard& shard : shards) {
    groups_.push_back(std::make_unique<Group>());
    Group& g = *groups_.back();
    g.shard = shard;
    const partition::PartitionLayout& layout = *shard.layout;
    const size_t shard_numel = static_cast<size_t>(layout.shard_numel());
    const size_t stride = sub_group_stride(layout, shard.dtype, options_.sub_group_numel);
    kernels::AdamConfig adam = options_.adam;
    if (shard.weight_decay) adam.weight_decay = *shard.weight_decay;
    if (options_.tier == Tier::kDevice) {
      g.device = std::make_unique<DeviceOptimizer>(accelerator, ops, home_stream, shard_numel, stride, adam);
    } else {
      OptimizerSwapperOptions swapper;
      swapper.numel = shard_numel;
      swapper.sub_group_numel = stride;
      swapper.state_tier = options_.tier;
      swapper.adam = adam;
      swapper.threads = options_.threads;
      swapper.nvme_path = options_.nvme_path;
      swapper.group = "optimizer_" + (shard.name.empty() ? std::string(dtype_name(shard.dtype)) : shard.name);
      swapper.rank = options_.rank;
      swapper.keep_files = options_.keep_files;
      if (options_.tier == Tier::kNvme) {
        // Groups share a pool while its buffers are big enough for their sub-groups.
        // Room for the sub-group's gradient beside its state when the gradient is on NVMe too
        // (StepInputs::grad_read: the pipeline reads both ahead).
        const size_t record = OptimizerSwapper::buffer_nbytes(stride, shard.grads->on_nvme());
        if (pool == nullptr || pool->buffer_nbytes() < record) {
          PinnedPoolOptions pool_options;
          pool_options.buffer_count = options_.buffer_count;
          pool_options.buffer_nbytes = record;
          pool_options.name = "optimizer pool";
          pools_.push_back(std::make_unique<PinnedBufferPool>(pool_options, &accelerator));
          pool = pools_.back().get();
        }
      }
      g.swapper = std::make_unique<OptimizerSwapper>(swapper, pool, aio);
    }

    // Which sub-groups each member's slice meets, for the overlap.
    const size_t sub_groups = g.sub_group_count();
    g.sub_group_numel = g.sub_group_range(0).second;
    g.param_sub_groups.assign(layout.params().size(), {});
    g.members_of_sub_group.assign(sub_groups, 0);
    for (size_t i = 0; i < layout.params().size(); ++i) {
      const partition::ParamSlot& slot = layout.param(i);
      if (slot.slice_numel <= 0) continue;
      const size_t first = static_cast<size_t>(slot.shard_offset_numel);
      const size_t last = first + static_cast<size_t>(slot.slice_numel) - 1;
      for (size_t k = first / g.sub_group_numel; k <= last / g.sub_group_numel; ++k) {
        g.param_sub_groups[i].push_back(static_cast<uint32_t>(k));
        ++g.members_of_sub_group[k];
      }
    }
    g.pending.assign(sub_groups, 0);
    g.landed.assign(layout.params().size(), 0);
    g.stats.assign(sub_groups, {});
    g.stats_known.assign(sub_groups, 0);
    const size_t index = groups_.size() - 1;
    shard.reducer->set_landed_callback([this, index](const std::vector<size_t>& params) { on_landed(index, params); });
  }
}

ShardOptimizer::~ShardOptimizer() { stop(); }

void ShardOptimizer::stop() {
  {
    std::lock_guard lock(overlap_->mutex);
    overlap_->stop = true;
  }
  overlap_->cv.notify_all();
  if (overlap_->thread.joinable()) overlap_->thread.join();
}

bool ShardOptimizer::overlaps() const { return options_.overlap && options_.tier != Tier::kDevice; }

OverlapMode ShardOptimizer::choose_mode() const {
  switch (options_.policy) {
    case OverlapPolicy::kSpeculate:
      return OverlapMode::kSpeculate;
    case OverlapPolicy::kReadAhead:
      return OverlapMode::kReadAhead;
    case OverlapPolicy::kAuto:
      break;
  }
  // Speculation redone is the whole update spent for nothing; reading ahead
  // when clipping does not fire leaves the arithmetic to step() (or to the
  // update overlapping the next forward, which then has the whole update to
  // hide instead of the sub-groups speculation did not reach: measured
  // slower, bench/PERFORMANCE.md "The update overlapping the next forward").
  return options_.clipping && last_clipped_ ? OverlapMode::kReadAhead : OverlapMode::kSpeculate;
}

void ShardOptimizer::initialize_if_stale() {
  if (!stale_) return;
  for (auto& gp : groups_) {
    Group& g = *gp;
    ParamHome& home = *g.shard.home;
    if (g.device) {
      g.device->initialize(home.memory(), g.shard.dtype);
      continue;
    }
    // The fp32 master weights start as the (widened) parameters, padding zero.
    g.swapper->initialize([&](size_t first, size_t numel, float* out) {
      convert(home.host_range(first, numel, /*load=*/true), g.shard.dtype, out, DType::kF32, numel);
    });
  }
  stale_ = false;
}

StepInputs ShardOptimizer::step_inputs(Group& g, float grad_scale) {
  StepInputs inputs;
  Group* group = &g;
  // Streamed sub-group by sub-group: the gradient from its shard (its
  // statistics recorded on the way, once per step), the new values (the
  // 16-bit copy, or the fp32 master itself) to the home.
  inputs.grad_source = [this, group](size_t first, size_t numel) -> const void* {
    const float* grads = group->shard.grads->read(first, numel, home_stream_);
    const size_t k = first / group->sub_group_numel;
    if (group->stats_known[k] == 0) {
      group->stats[k] = kernels::grad_stats(grads, DType::kF32, numel, 1.0f, std::nullopt, options_.threads);
      group->stats_known[k] = 1;
    }
    return grads;
  };
  if (g.shard.grads->on_nvme()) {
    // The same gradient and statistics as grad_source, read by the NVMe pipeline beside the state.
    inputs.grad_read = [this, group](size_t first, size_t numel, float* dst) -> StepInputs::GradCompletion {
      std::function<void()> read = group->shard.grads->read_async(first, numel, dst);
      return [this, group, first, numel, dst, read = std::move(read)]() -> const void* {
        read();
        const size_t k = first / group->sub_group_numel;
        if (group->stats_known[k] == 0) {
          group->stats[k] = kernels::grad_stats(dst, DType::kF32, numel, 1.0f, std::nullopt, options_.threads);
          group->stats_known[k] = 1;
        }
        return dst;
      };
    };
  }
  inputs.grad_dtype = DType::kF32;
  inputs.grad_scale = grad_scale;
  inputs.param16_dtype = g.shard.dtype;
  ParamHome* home = g.shard.home;
  if (home->host_addressable() && g.shard.dtype != DType::kF32) {
    inputs.param16 = home->memory();  // the kernel writes the home directly
  } else {
    inputs.param_sink = [home](size_t first, size_t numel, const void* values) {
      void* range = home->host_range(first, numel, /*load=*/false);
      if (range != values) std::memcpy(range, values, numel * dtype_nbytes(home->dtype()));
      home->store_host_range(first, numel);
    };
    if (home->tier() == Tier::kNvme) {
      // fp32: the NVMe pipeline writes the master weights to the home from
      // its buffer while it goes on (StepInputs::param_write).
      inputs.param_write = [home](size_t first, size_t numel, const void* values, StepInputs::WriteDone done) {
        const size_t bytes = dtype_nbytes(home->dtype());
        home->write_async(values, numel * bytes, first * bytes, std::move(done));
      };
    }
  }
  return inputs;
}

// ---- the optimizer overlapping backward --------------------------------------------

void ShardOptimizer::prepare(float lr, float grad_scale, double loss_scale, int backwards) {
  check_not_updating("prepare_step()");
  STRATA_CHECK(!prepared_, kBadArgument, "prepare_step() twice without a step() between");
  STRATA_CHECK(backwards >= 1, kBadArgument, "prepare_step(): {} backward passes to come; at least 1", backwards);
  kernels::AdamConfig adam = options_.adam;
  adam.lr = lr;
  adam.validate();  // a bad lr fails here, not on the optimizer thread
  Overlap& o = *overlap_;
  o.lr = lr;
  o.backwards = backwards;
  o.loss_scale = loss_scale;
  o.grad_scale = grad_scale;
  mode_ = choose_mode();
  if (!overlaps()) {  // stage 1 reduces at the boundary; the device optimizer is not worth hiding
    prepared_ = true;  // still: misuse until the step is refused alike
    return;
  }
  initialize_if_stale();
  {
    std::lock_guard lock(o.mutex);
    o.busy_seconds = 0;
    o.updated = 0;
    o.prefetched = 0;
    o.mode = mode_;
    o.error = nullptr;
    o.ready.clear();
  }
  try {
    arm(lr);
  } catch (...) {
    // Nothing was updated yet: disarm (an arming still queued on a reducer
    // stream finds its generation stale), close what was opened, and the
    // step runs unprepared.
    {
      std::lock_guard lock(o.mutex);
      ++o.generation;
      o.ready.clear();
      for (auto& g : groups_) g->armed = false;
    }
    for (auto& g : groups_) g->swapper->abort_step();
    throw;
  }
  prepared_ = true;
  armed_ = true;
  if (!o.thread.joinable()) o.thread = std::thread([this] { thread_main(); });
}

void ShardOptimizer::arm(float lr) {
  Overlap& o = *overlap_;
  uint64_t generation = 0;
  {
    std::lock_guard lock(o.mutex);
    generation = ++o.generation;
  }
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = *groups_[gi];
    // A bucket still open holds the previous micro-step's gradients: it is
    // reduced (a collective every rank issues here) before counting starts.
    g.shard.reducer->flush();
    {
      std::lock_guard lock(o.mutex);
      g.pending = g.members_of_sub_group;
      std::fill(g.landed.begin(), g.landed.end(), 0);
      g.landed_twice = false;
      g.armed = false;
      if (g.final_order.size() == g.sub_group_count()) g.predicted_order = std::move(g.final_order);
      g.final_order.clear();
    }
    std::fill(g.stats_known.begin(), g.stats_known.end(), 0);
    g.swapper->set_lr(lr * g.shard.lr_scale);
    // Read-ahead updates nothing before apply(), which sets the step's real
    // scale and lr: no state to save for a rollback.
    g.swapper->begin_step(step_inputs(g, o.grad_scale), /*revocable=*/o.mode == OverlapMode::kSpeculate);
    // Read-ahead: the state does not depend on the gradient, so the buffers
    // take it now in shard order — the embedding's and the first layers',
    // whose updates the next forward waits for first (the embedding's
    // gradient is final only when backward ends) — rather than the last
    // layers' as their gradients become final. Before the arming below, so
    // the thread (which drives the swapper once landings come) is not yet on it.
    if (o.mode == OverlapMode::kReadAhead) {
      for (size_t k = 0; k < g.swapper->sub_group_count() && g.swapper->prefetch(k); ++k) {
      }
    } else {
      // Speculating: the sub-groups that become final last (the embedding's,
      // when backward ends) have no backward left to hide their state's read
      // behind, so it is read now, into the buffers the pipeline can spare
      // (the order is the last backward's; none before one finalized them all).
      int64_t read = 0;
      for (auto k = g.predicted_order.rbegin();
           k != g.predicted_order.rend() && g.swapper->prefetch(*k, kPipelineBuffers); ++k) {
        ++read;
      }
      std::lock_guard lock(o.mutex);
      o.prefetched += read;
    }
    // Armed in the reducer's stream order: landings of earlier buckets are not counted.
    g.shard.reducer->stream().launch_host_func([this, gi, generation] {
      std::lock_guard lock(overlap_->mutex);
      if (overlap_->generation == generation) groups_[gi]->armed = true;
    });
  }
}

void ShardOptimizer::on_landed(size_t group, const std::vector<size_t>& params) {
  Overlap& o = *overlap_;
  std::lock_guard lock(o.mutex);
  Group& g = *groups_[group];
  if (!g.armed) return;
  bool queued = false;
  for (size_t p : params) {
    if (g.landed[p] >= o.backwards) {
      g.landed_twice = true;  // one backward more: what was speculated may miss its gradient
      continue;
    }
    if (++g.landed[p] < o.backwards) continue;  // more of this step's backwards to come
    for (uint32_t k : g.param_sub_groups[p]) {
      if (--g.pending[k] == 0) {
        o.ready.emplace_back(group, k);
        g.final_order.push_back(k);
        queued = true;
      }
    }
  }
  if (queued) o.cv.notify_all();
}

void ShardOptimizer::thread_main() {
  trace::name_this_thread("optimizer");
  Overlap& o = *overlap_;
  std::unique_lock lock(o.mutex);
  for (;;) {
    o.cv.wait(lock, [&] { return o.stop || o.job || (!o.ready.empty() && o.error == nullptr); });
    if (o.job) {  // handed over before any stop: run it, so its events complete
      std::function<void()> job = std::move(o.job);
      o.job = nullptr;
      o.busy = true;
      lock.unlock();
      const auto start = Clock::now();
      std::exception_ptr error;
      {
        trace::Span span("optimizer", "update overlapping the next forward");
        try {
          job();
        } catch (...) {
          error = std::current_exception();
        }
      }
      // Every range completes: one never updated fails with the error, so
      // nothing waits on it for ever.
      for (auto& ready : home_ready_) {
        for (auto& event : ready) {
          if (error) {
            event->fail(error);
          } else {
            event->signal();
          }
        }
      }
      const double seconds = seconds_since(start);
      lock.lock();
      o.busy = false;
      o.job_done = true;
      o.job_error = error;
      o.job_busy_seconds = seconds;
      o.cv.notify_all();
      continue;
    }
    if (o.stop) return;
    // Every final sub-group of one group at once: the NVMe pipeline reads ahead across them.
    const size_t group = o.ready.front().first;
    std::vector<size_t> batch;
    while (!o.ready.empty() && o.ready.front().first == group) {
      batch.push_back(o.ready.front().second);
      o.ready.pop_front();
    }
    o.busy = true;
    const OverlapMode mode = o.mode;
    lock.unlock();
    const auto start = Clock::now();
    std::exception_ptr error;
    try {
      Group& g = *groups_[group];
      if (mode == OverlapMode::kSpeculate) {
        {
          trace::Span span("optimizer", "overlapped sub-groups");
          span.value("count", static_cast<int64_t>(batch.size()));
          finish_other_writes(g);
          g.swapper->update_sub_groups(batch);
        }
        prefetch_next();
      } else {
        trace::Span span("optimizer", "read-ahead sub-groups");
        span.value("count", static_cast<int64_t>(batch.size()));
        read_ahead(g, batch);
      }
    } catch (...) {
      error = std::current_exception();
    }
    const double seconds = seconds_since(start);
    lock.lock();
    o.busy = false;
    o.busy_seconds += seconds;
    if (error) {
      if (!o.error) o.error = error;
    } else if (mode == OverlapMode::kSpeculate) {
      o.updated += static_cast<int64_t>(batch.size());
    }
    o.cv.notify_all();
  }
}

void ShardOptimizer::finish_other_writes(const Group& g) {
  // Groups may share a pool (the constructor): the state writes another
  // group's batch left in flight hold buffers this group's pipeline needs,
  // and only their swapper returns them.
  for (auto& other : groups_) {
    if (other.get() != &g && other->swapper) other->swapper->finish_writes();
  }
}

void ShardOptimizer::prefetch_next() {
  // Between two landings the drive is idle: the state of the sub-groups the
  // last backward finalized next is read into the buffers the pipeline can
  // spare, so their updates find it there.
  Overlap& o = *overlap_;
  {
    std::lock_guard lock(o.mutex);
    if (!o.ready.empty()) return;
  }
  int64_t read = 0;
  for (auto& gp : groups_) {
    Group& g = *gp;
    if (!g.swapper) continue;
    for (size_t k : g.predicted_order) {
      if (g.swapper->updated(k) || g.swapper->prefetched(k)) continue;
      if (!g.swapper->prefetch(k, kPipelineBuffers)) break;
      ++read;
    }
  }
  std::lock_guard lock(o.mutex);
  o.prefetched += read;
}

void ShardOptimizer::take_stats(Group& g, size_t k) {
  if (g.stats_known[k] != 0) return;
  // A sub-group whose state is in a pipeline buffer: its gradient is read
  // there, the statistics taken on the way (grad_read's), and kept for the
  // update, which would read it again.
  if (g.swapper && g.swapper->step_open() && g.swapper->read_grad_ahead(k) != nullptr && g.stats_known[k] != 0) {
    return;
  }
  const auto [first, numel] = g.sub_group_range(k);
  const float* grads = g.shard.grads->read(first, numel, home_stream_);
  g.stats[k] = kernels::grad_stats(grads, DType::kF32, numel, 1.0f, std::nullopt, options_.threads);
  g.stats_known[k] = 1;
}

void ShardOptimizer::read_ahead(Group& g, const std::vector<size_t>& sub_groups) {
  // The arming took every free buffer for state (shard order), and none
  // frees before apply(): what is left as sub-groups become final is their
  // statistics (into their buffer where their state is there).
  for (size_t k : sub_groups) take_stats(g, k);
}

double ShardOptimizer::settle_thread(bool take_queued) {
  // Called once no more landings can come (the reducers synchronized): the
  // thread finishes its batch and, with take_queued, the final sub-groups
  // queued behind it (until it fails); what it has not taken is left to the caller.
  Overlap& o = *overlap_;
  const auto start = Clock::now();
  std::unique_lock lock(o.mutex);
  o.cv.wait(lock, [&] { return !o.busy && (!take_queued || o.ready.empty() || o.error != nullptr); });
  o.ready.clear();
  ++o.generation;
  for (auto& g : groups_) g->armed = false;
  return seconds_since(start);
}

double ShardOptimizer::settle() {
  if (!armed_) return 0;
  // The sub-groups final at the end of backward (the embedding's, when its
  // landing queued behind a batch still running) are taken by the thread
  // too: left to apply_async, the next forward's first gather would wait
  // for them after step() returns, where waiting in step() for the thread
  // already holding their state costs less (bench/PERFORMANCE.md).
  const double seconds = settle_thread(/*take_queued=*/true);
  std::lock_guard lock(overlap_->mutex);
  if (overlap_->error) std::rethrow_exception(overlap_->error);
  return seconds;
}

bool ShardOptimizer::roll_back() {
  bool rolled_back = false;
  for (auto& gp : groups_) {
    Group& g = *gp;
    if (!g.swapper || !g.swapper->step_open()) continue;
    std::vector<size_t> updated;
    for (size_t k = 0; k < g.swapper->sub_group_count(); ++k) {
      if (g.swapper->updated(k)) updated.push_back(k);
    }
    try {
      g.swapper->abort_step();
    } catch (const Error&) {
      // cpu state of a step that was not revocable: its updated sub-groups
      // keep their new state, which is what their home holds.
      continue;
    }
    // The home holds the updated sub-groups' new values: back to the restored
    // master weights (the 16-bit copy of the master is the parameter).
    ParamHome& home = *g.shard.home;
    std::vector<float> master;
    for (size_t k : updated) {
      const auto [first, numel] = g.swapper->sub_group_range(k);
      master.resize(numel);
      g.swapper->load_sub_group(k, master.data(), nullptr, nullptr);
      convert(master.data(), DType::kF32, home.host_range(first, numel, /*load=*/false), g.shard.dtype, numel);
      home.store_host_range(first, numel);
      rolled_back = true;
    }
  }
  return rolled_back;
}

bool ShardOptimizer::abort() {
  check_not_updating("abort");
  const bool armed = armed_;
  const bool speculated = armed_ && mode_ == OverlapMode::kSpeculate;
  prepared_ = false;
  armed_ = false;
  if (armed) {
    for (auto& g : groups_) g->shard.reducer->synchronize();
    settle_thread(/*take_queued=*/false);
  }
  roll_back();  // read-ahead: releases the buffers read into, nothing was updated
  return speculated;
}

// ---- the step ------------------------------------------------------------------------

kernels::GradStats ShardOptimizer::grad_stats(std::span<const uint8_t> include) {
  STRATA_CHECK(include.empty() || include.size() == groups_.size(), kBadArgument,
               "grad_stats: {} flags for {} shards", include.size(), groups_.size());
  // Statistics the thread took are of the final gradient only when one
  // backward followed prepare(): a second one adds to what it measured.
  const bool twice = std::any_of(groups_.begin(), groups_.end(), [](const auto& g) { return g->landed_twice; });
  if (!armed_ || twice) {
    for (auto& gp : groups_) {
      std::fill(gp->stats_known.begin(), gp->stats_known.end(), 0);
      // So are the gradients read into pipeline buffers with them.
      if (gp->swapper && gp->swapper->step_open()) gp->swapper->drop_grads_read_ahead();
    }
  }
  kernels::GradStats local;
  for (size_t s = 0; s < groups_.size(); ++s) {
    if (!include.empty() && include[s] == 0) continue;
    Group& g = *groups_[s];
    if (g.device) {  // every sub-group's statistics in one round trip
      g.stats = g.device->grad_stats(g.shard.grads->memory());
      std::fill(g.stats_known.begin(), g.stats_known.end(), 1);
    }
    for (size_t k = 0; k < g.sub_group_count(); ++k) {
      take_stats(g, k);
      local = kernels::merge(local, g.stats[k]);
    }
  }
  return local;
}

ShardOptimizer::Boundary ShardOptimizer::open_boundary(float lr, float grad_scale, double loss_scale) {
  Overlap& o = *overlap_;
  Boundary b;
  AppliedStep& applied = b.applied;
  b.keep = armed_ && mode_ == OverlapMode::kSpeculate;
  if (armed_) {
    applied.mode = mode_;
    applied.clipped = grad_scale != o.grad_scale;
    applied.landed_twice =
        std::any_of(groups_.begin(), groups_.end(), [](const auto& g) { return g->landed_twice; });
  }
  if (b.keep) {
    applied.redo_reason = applied.clipped            ? "gradient clipping fired"
                          : lr != o.lr               ? "step() got another lr than prepare_step()"
                          : loss_scale != o.loss_scale ? "the loss scale changed"
                          : applied.landed_twice     ? "more than one backward followed prepare_step()"
                                                     : nullptr;
    if (applied.redo_reason != nullptr) {
      b.keep = false;
      roll_back();
      std::lock_guard lock(o.mutex);
      applied.rolled_back = o.updated > 0;
    }
  }
  b.read_ahead_step = armed_ && mode_ == OverlapMode::kReadAhead;
  initialize_if_stale();
  return b;
}

void ShardOptimizer::set_step(Boundary& b, float lr, float grad_scale) {
  for (auto& gp : groups_) {
    Group& g = *gp;
    if (!g.swapper) continue;
    g.swapper->set_lr(lr * g.shard.lr_scale);
    if (b.read_ahead_step) {
      // Opened at prepare() to read ahead: now the real scale and lr.
      g.swapper->set_step_inputs(step_inputs(g, grad_scale));
      b.applied.sub_groups_read_ahead += static_cast<int64_t>(g.swapper->prefetched().size());
    } else if (!b.keep) {
      g.swapper->begin_step(step_inputs(g, grad_scale), /*revocable=*/false);
    }
    b.applied.sub_groups += static_cast<int64_t>(g.swapper->sub_group_count());
  }
}

void ShardOptimizer::update_rest(const Boundary& b) {
  // Read-ahead: the sub-groups whose state is in pipeline buffers first, every
  // group's, so no group's pipeline waits on buffers another group holds.
  if (b.read_ahead_step) {
    for (auto& gp : groups_) {
      if (!gp->swapper) continue;
      finish_other_writes(*gp);
      gp->swapper->update_sub_groups(gp->swapper->prefetched());
    }
  }
  // Then the rest in shard order: the order the next forward needs them.
  for (auto& gp : groups_) {
    Group& g = *gp;
    if (!g.swapper) continue;
    std::vector<size_t> left;
    for (size_t k = 0; k < g.swapper->sub_group_count(); ++k) {
      if (!g.swapper->updated(k)) left.push_back(k);
    }
    finish_other_writes(g);
    g.swapper->update_sub_groups(left);
  }
  // Commit only once every group is updated, so a failure above rolls back
  // every group (NVMe always; cpu when speculating).
  for (auto& gp : groups_) {
    if (gp->swapper) gp->swapper->commit_step();
  }
}

void ShardOptimizer::close_boundary(Boundary& b) {
  Overlap& o = *overlap_;
  if (b.keep || b.read_ahead_step) {
    std::lock_guard lock(o.mutex);
    b.applied.sub_groups_overlapped = b.keep ? o.updated : 0;
    b.applied.sub_groups_prefetched = b.keep ? o.prefetched : 0;
    b.applied.overlapped_seconds = o.busy_seconds;
  }
  if (armed_) last_clipped_ = b.applied.clipped;
  prepared_ = false;
  armed_ = false;
}

void ShardOptimizer::check_not_updating(const char* what) const {
  STRATA_CHECK(!updating_, kBadArgument,
               "{}: the optimizer's update overlapping the next forward is still running (finish() first)", what);
}

AppliedStep ShardOptimizer::apply(float lr, float grad_scale, double loss_scale) {
  check_not_updating("apply");
  Boundary b = open_boundary(lr, grad_scale, loss_scale);
  set_step(b, lr, grad_scale);
  for (auto& gp : groups_) {  // state on the accelerator: one pass over the shard
    Group& g = *gp;
    if (!g.device) continue;
    g.device->set_lr(lr * g.shard.lr_scale);
    g.device->step(g.shard.grads->memory(), grad_scale, g.shard.home->memory(), g.shard.dtype);
    b.applied.sub_groups += static_cast<int64_t>(g.sub_group_count());
  }
  update_rest(b);
  close_boundary(b);
  return b.applied;
}

AppliedStep ShardOptimizer::apply_async(float lr, float grad_scale, double loss_scale,
                                        std::vector<std::shared_ptr<Event>> after) {
  check_not_updating("apply_async");
  for (const auto& g : groups_) {
    STRATA_CHECK(g->swapper != nullptr, kBadArgument,
                 "apply_async: shard '{}' has its optimizer state on the accelerator", g->shard.name);
  }
  Boundary b = open_boundary(lr, grad_scale, loss_scale);
  set_step(b, lr, grad_scale);
  close_boundary(b);
  // One event per sub-group; those speculated during backward are in their home already.
  home_ready_.assign(groups_.size(), {});
  for (size_t s = 0; s < groups_.size(); ++s) {
    OptimizerSwapper& swapper = *groups_[s]->swapper;
    std::vector<std::shared_ptr<HostEvent>>& ready = home_ready_[s];
    for (size_t k = 0; k < swapper.sub_group_count(); ++k) {
      ready.push_back(accelerator_.create_host_event());
      if (swapper.updated(k)) ready.back()->signal();
    }
    swapper.set_updated_hook([ready](size_t k) { ready[k]->signal(); });
  }
  Overlap& o = *overlap_;
  {
    std::lock_guard lock(o.mutex);
    o.job = [this, b, after = std::move(after)] {
      for (const auto& point : after) point->synchronize();  // the homes' last readers are done
      update_rest(b);
    };
    o.job_done = false;
    o.job_error = nullptr;
    o.job_busy_seconds = 0;
  }
  updating_ = true;
  if (!o.thread.joinable()) o.thread = std::thread([this] { thread_main(); });
  o.cv.notify_all();
  return b.applied;
}

const std::vector<std::shared_ptr<HostEvent>>& ShardOptimizer::home_ready(size_t s) const { return home_ready_.at(s); }

size_t ShardOptimizer::home_stride(size_t s) const { return groups_.at(s)->sub_group_numel; }

ShardOptimizer::Finished ShardOptimizer::finish() {
  Finished finished;
  if (!updating_) return finished;
  Overlap& o = *overlap_;
  const auto start = Clock::now();
  std::exception_ptr error;
  {
    std::unique_lock lock(o.mutex);
    o.cv.wait(lock, [&] { return o.job_done; });
    o.job_done = false;
    error = o.job_error;
    o.job_error = nullptr;
    finished.busy_seconds = o.job_busy_seconds;
  }
  finished.wait_seconds = seconds_since(start);
  updating_ = false;
  for (auto& g : groups_) g->swapper->set_updated_hook({});
  if (error) {
    try {
      roll_back();  // as a failed apply() leaves it: the open steps aborted, the homes rewritten
    } catch (...) {
      // The update's own error is the one reported.
    }
    std::rethrow_exception(error);
  }
  return finished;
}

// ---- checkpoints --------------------------------------------------------------------

void ShardOptimizer::save(size_t s, const StateSinkFn& sink) {
  check_not_updating("save");
  initialize_if_stale();  // never stepped (or loaded since): the master weights are the parameters
  Group& g = *groups_.at(s);
  if (g.device) {
    g.device->save(sink);
    return;
  }
  std::vector<float> p, m, v;
  for (size_t k = 0; k < g.swapper->sub_group_count(); ++k) {
    const auto [first, numel] = g.swapper->sub_group_range(k);
    p.resize(numel), m.resize(numel), v.resize(numel);
    g.swapper->load_sub_group(k, p.data(), m.data(), v.data());
    sink(first, numel, p.data(), m.data(), v.data());
  }
}

void ShardOptimizer::restore(size_t s, const StateFillFn& fill, int64_t step_count) {
  check_not_updating("restore");
  Group& g = *groups_.at(s);
  if (g.device) {
    g.device->restore(fill, step_count);
  } else {
    g.swapper->restore(fill, step_count);
  }
  stale_ = false;  // every shard is restored before the next update
}

}  // namespace strata::offload
