// ZeroEngine's optimizer: the step at the accumulation boundary, and the
// optimizer overlapping backward — sub-groups updated by the optimizer thread
// as their gradients become final, speculating that the step applies
// unclipped, rolled back exactly when it does not.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/log.h"
#include "core/trace_recorder.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/engine/zero_engine_parts.h"

namespace strata::engine {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

double StepResult::optimizer_not_hidden_fraction() const {
  const double own = optimizer_seconds - optimizer_drain_seconds + optimizer_overlapped_seconds;
  return own > 0 ? std::min(1.0, optimizer_seconds / own) : 1.0;
}

void ZeroEngine::init_optimizer() {
  for (auto& gp : groups_) {
    Group& g = *gp;
    if (g.device_optimizer) {
      // The home is accelerator memory here, last written on the compute or home stream.
      compute_stream().record(*compute_point_);
      home_stream_->wait(*compute_point_);
      g.device_optimizer->initialize(g.home, g.dtype);
      continue;
    }
    // The fp32 master weights start as the (widened) parameters, padding zero.
    g.swapper->initialize([&](size_t first, size_t numel, float* out) {
      convert(home_range(g, first, numel, /*load=*/true), g.dtype, out, DType::kF32, numel);
    });
  }
  optimizer_stale_ = false;
}

offload::StepInputs ZeroEngine::step_inputs(Group& g, float grad_scale) {
  offload::StepInputs inputs;
  Group* group = &g;
  // Streamed sub-group by sub-group: the gradient from its shard (its
  // statistics recorded on the way, once per step), the new values (the
  // 16-bit copy, or the fp32 master itself) to the home.
  inputs.grad_source = [this, group](size_t first, size_t numel) -> const void* {
    const float* grads = group->grads->read(first, numel, *home_stream_);
    const size_t k = first / group->sub_group_numel;
    if (group->stats_known[k] == 0) {
      group->stats[k] = kernels::grad_stats(grads, DType::kF32, numel, 1.0f, std::nullopt, options_.optimizer_threads);
      group->stats_known[k] = 1;
    }
    return grads;
  };
  inputs.grad_dtype = DType::kF32;
  inputs.grad_scale = grad_scale;
  inputs.param16_dtype = g.dtype;
  if (home_is_host_addressable() && g.dtype != DType::kF32) {
    inputs.param16 = g.home;  // the kernel writes the home directly
  } else {
    inputs.param_sink = [this, group](size_t first, size_t numel, const void* values) {
      void* range = home_range(*group, first, numel, /*load=*/false);
      if (range != values) std::memcpy(range, values, numel * dtype_nbytes(group->dtype));
      store_home_range(*group, first, numel);
    };
  }
  return inputs;
}

bool ZeroEngine::step_prepared() const { return overlap_->prepared; }

bool ZeroEngine::overlaps_optimizer() const {
  return options_.stage > 1 && options_.overlap_optimizer && options_.optimizer_tier != Tier::kDevice;
}

void ZeroEngine::check_not_prepared(const char* what) const {
  STRATA_CHECK(!overlap_->prepared, kBadArgument,
               "{}() between prepare_step() and step(): the optimizer may be updating the parameters; call it "
               "between steps",
               what);
}

// ---- the optimizer overlapping backward --------------------------------------------

void ZeroEngine::prepare_step(float lr) {
  STRATA_CHECK(finalized(), kBadArgument, "prepare_step() before finalize()");
  Overlap& o = *overlap_;
  STRATA_CHECK(!o.prepared, kBadArgument, "prepare_step() twice without a step() between");
  kernels::AdamConfig adam = options_.adam;
  adam.lr = lr;
  adam.validate();  // a bad lr fails here, not on the optimizer thread
  o.lr = lr;
  o.loss_scale = loss_scaler_.scale();
  if (!overlaps_optimizer()) {  // stage 1 reduces at step(); the device optimizer is not worth hiding
    o.prepared = true;  // still: misuse until step() is refused alike
    return;
  }
  if (optimizer_stale_) init_optimizer();
  // What the step will apply when clipping does not fire: the loss scale divided out.
  o.grad_scale = kernels::combined_grad_scale(kernels::GradStats{0.0, true}, static_cast<float>(o.loss_scale),
                                              static_cast<float>(options_.gradient_clipping));
  {
    std::lock_guard lock(o.mutex);
    o.busy_seconds = 0;
    o.updated = 0;
    o.error = nullptr;
    o.ready.clear();
  }
  try {
    arm_groups(lr);
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
  o.prepared = true;
  if (!o.thread.joinable()) o.thread = std::thread([this] { overlap_main(); });
}

void ZeroEngine::arm_groups(float lr) {
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
    g.reducer->flush();
    {
      std::lock_guard lock(o.mutex);
      g.pending = g.members_of_sub_group;
      std::fill(g.landed.begin(), g.landed.end(), 0);
      g.landed_twice = false;
      g.armed = false;
    }
    std::fill(g.stats_known.begin(), g.stats_known.end(), 0);
    g.swapper->set_lr(lr);
    g.swapper->begin_step(step_inputs(g, o.grad_scale), /*revocable=*/true);
    // Armed in the reducer's stream order: landings of earlier buckets are not counted.
    g.reducer->stream().launch_host_func([this, gi, generation] {
      std::lock_guard lock(overlap_->mutex);
      if (overlap_->generation == generation) groups_[gi]->armed = true;
    });
  }
}

void ZeroEngine::on_landed(size_t group, const std::vector<size_t>& params) {
  Overlap& o = *overlap_;
  std::lock_guard lock(o.mutex);
  Group& g = *groups_[group];
  if (!g.armed) return;
  bool queued = false;
  for (size_t p : params) {
    if (g.landed[p] != 0) {
      g.landed_twice = true;  // a second backward: what was speculated may miss its gradient
      continue;
    }
    g.landed[p] = 1;
    for (uint32_t k : g.param_sub_groups[p]) {
      if (--g.pending[k] == 0) {
        o.ready.emplace_back(group, k);
        queued = true;
      }
    }
  }
  if (queued) o.cv.notify_all();
}

void ZeroEngine::overlap_main() {
  trace::name_this_thread("optimizer");
  Overlap& o = *overlap_;
  std::unique_lock lock(o.mutex);
  for (;;) {
    o.cv.wait(lock, [&] { return o.stop || (!o.ready.empty() && o.error == nullptr); });
    if (o.stop) return;
    // Every final sub-group of one group at once: the NVMe pipeline reads ahead across them.
    const size_t group = o.ready.front().first;
    std::vector<size_t> batch;
    while (!o.ready.empty() && o.ready.front().first == group) {
      batch.push_back(o.ready.front().second);
      o.ready.pop_front();
    }
    o.busy = true;
    lock.unlock();
    const auto start = Clock::now();
    std::exception_ptr error;
    try {
      trace::Span span("optimizer", "overlapped sub-groups");
      span.value("count", static_cast<int64_t>(batch.size()));
      groups_[group]->swapper->update_sub_groups(batch);
    } catch (...) {
      error = std::current_exception();
    }
    const double seconds = seconds_since(start);
    lock.lock();
    o.busy = false;
    o.busy_seconds += seconds;
    if (error) {
      if (!o.error) o.error = error;
    } else {
      o.updated += static_cast<int64_t>(batch.size());
    }
    o.cv.notify_all();
  }
}

double ZeroEngine::settle_overlap() {
  // Called once no more landings can come (the reducers synchronized): the
  // thread finishes its batch; sub-groups it has not taken are left to the caller.
  Overlap& o = *overlap_;
  const auto start = Clock::now();
  std::unique_lock lock(o.mutex);
  o.cv.wait(lock, [&] { return !o.busy; });
  o.ready.clear();
  ++o.generation;
  for (auto& g : groups_) g->armed = false;
  return seconds_since(start);
}

void ZeroEngine::roll_back_speculation() {
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
    std::vector<float> master;
    for (size_t k : updated) {
      const auto [first, numel] = g.swapper->sub_group_range(k);
      master.resize(numel);
      g.swapper->load_sub_group(k, master.data(), nullptr, nullptr);
      convert(master.data(), DType::kF32, home_range(g, first, numel, /*load=*/false), g.dtype, numel);
      store_home_range(g, first, numel);
    }
  }
}

void ZeroEngine::abandon_speculation() {
  Overlap& o = *overlap_;
  if (!o.prepared) return;
  o.prepared = false;
  if (!overlaps_optimizer()) return;
  for (auto& g : groups_) g->reducer->synchronize();
  settle_overlap();
  roll_back_speculation();
}

// ---- the step ------------------------------------------------------------------------

StepResult ZeroEngine::step(float lr) {
  STRATA_CHECK(finalized(), kBadArgument, "step() before finalize()");
  STRATA_CHECK(std::all_of(grad_full_.begin(), grad_full_.end(), [&](float* g) { return options_.stage == 1 || g == nullptr; }),
               kBadArgument, "step() with a backward pass not finished (a gradient is still being accumulated)");
  Overlap& o = *overlap_;
  const bool speculating = o.prepared && overlaps_optimizer();
  o.prepared = false;
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
  StepResult result;
  // Whatever fails from here on, speculative updates do not stay behind.
  struct RollBackOnError {
    ZeroEngine* engine;
    bool armed;
    ~RollBackOnError() {
      if (!armed) return;
      try {
        engine->settle_overlap();
        engine->roll_back_speculation();
      } catch (...) {
        // The step's own error is the one reported.
      }
    }
  } guard{this, true};
  // The gradient shards are final once every bucket has landed.
  auto start = Clock::now();
  for (auto& gp : groups_) gp->reducer->synchronize();
  result.grad_wait_seconds = seconds_since(start);
  start = Clock::now();
  if (speculating) {
    result.optimizer_drain_seconds = settle_overlap();
    std::lock_guard lock(o.mutex);
    if (o.error) std::rethrow_exception(o.error);  // the guard rolls back
  } else {
    for (auto& gp : groups_) std::fill(gp->stats_known.begin(), gp->stats_known.end(), 0);
  }
  // Statistics of every sub-group, merged in one order whoever computed them,
  // so the norm's bits do not depend on the overlap.
  kernels::GradStats local;
  for (auto& gp : groups_) {
    Group& g = *gp;
    if (g.device_optimizer) {  // every sub-group's statistics in one round trip
      g.stats = g.device_optimizer->grad_stats(g.grads->memory());
      std::fill(g.stats_known.begin(), g.stats_known.end(), 1);
    }
    for (size_t k = 0; k < g.sub_group_count(); ++k) {
      if (g.stats_known[k] == 0) {
        const auto [first, numel] = g.swapper->sub_group_range(k);
        const float* grads = g.grads->read(first, numel, *home_stream_);
        g.stats[k] = kernels::grad_stats(grads, DType::kF32, numel, 1.0f, std::nullopt, options_.optimizer_threads);
        g.stats_known[k] = 1;
      }
      local = kernels::merge(local, g.stats[k]);
    }
  }
  // Global norm and finiteness: one f64 allreduce of (sum of squares, non-finite ranks).
  double reduced[2] = {local.finite ? local.sum_sq : 0.0, local.finite ? 0.0 : 1.0};
  allreduce_f64(reduced, 2);
  kernels::GradStats global;
  global.sum_sq = reduced[0];
  global.finite = reduced[1] == 0.0 && std::isfinite(reduced[0]);
  const double loss_scale = loss_scaler_.scale();
  result.loss_scale = loss_scale;
  // The gradients hold loss_scale x the true ones; report the true norm.
  result.grad_norm = global.finite ? global.norm() / loss_scale : std::numeric_limits<double>::infinity();
  if (!global.finite) {
    if (speculating) {
      roll_back_speculation();
      result.rolled_back = true;
    }
    guard.armed = false;
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
    result.optimizer_seconds = seconds_since(start);
    return result;
  }
  loss_scaler_.update(false);
  result.grad_scale = kernels::combined_grad_scale(global, static_cast<float>(loss_scale),
                                                   static_cast<float>(options_.gradient_clipping));
  bool keep = speculating;
  if (speculating) {
    const bool landed_twice = std::any_of(groups_.begin(), groups_.end(), [](const auto& g) { return g->landed_twice; });
    const char* why = result.grad_scale != o.grad_scale ? "gradient clipping fired"
                      : lr != o.lr                      ? "step() got another lr than prepare_step()"
                      : loss_scale != o.loss_scale      ? "the loss scale changed"
                      : landed_twice                    ? "more than one backward followed prepare_step()"
                                                        : nullptr;
    if (why != nullptr) {
      keep = false;
      std::lock_guard lock(o.mutex);
      if (o.updated > 0) {
        logger().debug("step {}: {}; the {} sub-group(s) updated during backward are rolled back and redone",
                       steps_ + 1, why, o.updated);
      }
    }
    if (landed_twice) logger().warn("step {}: more than one backward after prepare_step(); call it before the last", steps_ + 1);
  }
  if (speculating && !keep) {
    roll_back_speculation();
    result.rolled_back = o.updated > 0;
  }
  if (optimizer_stale_) init_optimizer();
  for (auto& gp : groups_) {
    Group& g = *gp;
    if (g.device_optimizer) {
      // The home may still be read by a gather queued before the boundary.
      gather_stream_->record(*gather_point_);
      home_stream_->wait(*gather_point_);
      g.device_optimizer->set_lr(lr);
      g.device_optimizer->step(g.grads->memory(), result.grad_scale, g.home, g.dtype);
      result.sub_groups += static_cast<int64_t>(g.sub_group_count());
      continue;
    }
    if (!keep) {
      g.swapper->set_lr(lr);
      g.swapper->begin_step(step_inputs(g, result.grad_scale), /*revocable=*/false);
    }
    std::vector<size_t> left;
    for (size_t k = 0; k < g.swapper->sub_group_count(); ++k) {
      if (!g.swapper->updated(k)) left.push_back(k);
    }
    g.swapper->update_sub_groups(left);
    result.sub_groups += static_cast<int64_t>(g.swapper->sub_group_count());
  }
  // Commit only once every group is updated, so a failure above rolls back
  // every group (NVMe always; cpu when speculating).
  for (auto& gp : groups_) {
    if (gp->swapper) gp->swapper->commit_step();
  }
  guard.armed = false;
  ++steps_;
  result.applied = true;
  result.step = steps_;
  if (keep) {
    std::lock_guard lock(o.mutex);
    result.sub_groups_overlapped = o.updated;
    result.optimizer_overlapped_seconds = o.busy_seconds;
  }
  result.optimizer_seconds = seconds_since(start);
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
