// ZeroEngine: the update overlapping the next forward (ZeroEngineOptions::
// overlap_next_forward) — where it may run, and the join that ends it
// (docs/DESIGN.md §5.2). step() hands the update over; see zero_engine.cc.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>

#include "core/log.h"
#include "core/trace_recorder.h"
#include "runtime/engine/zero_engine.h"

namespace strata::engine {
namespace {

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

bool ZeroEngine::update_can_overlap_forward() const {
  if (!options_.overlap_optimizer || !options_.overlap_next_forward || !coordinator_ ||
      options_.optimizer_tier == Tier::kDevice) {
    return false;
  }
  // The thread's host writes must not wait on device work queued behind a
  // stream's wait on them (core/accelerator.h, HostEvent): where the
  // accelerator's memory is not the host's, only homes and gradient shards
  // the host reaches without a device copy qualify.
  if (accelerator().host_addressable()) return true;
  return std::all_of(groups_.begin(), groups_.end(), [](const auto& g) {
    return g->frozen || (g->home->tier() != Tier::kDevice && g->grads->on_nvme());
  });
}

void ZeroEngine::finish_update() {
  if (!update_pending_) return;
  update_pending_ = false;
  // When compute reaches this point it has nothing left to run until the join returns.
  join_reached_ = std::make_shared<std::atomic<int64_t>>(0);
  compute_stream().launch_host_func([reached = join_reached_] { reached->store(steady_ns()); });
  offload::ShardOptimizer::Finished finished;
  try {
    trace::Span span("engine", "join the update");  // the host's wait for the last step's update (--trace)
    finished = optimizer_->finish();
    join_end_ns_ = steady_ns();
  } catch (...) {
    // The step did not happen: its state stays the last committed step's and
    // the homes were rewritten from it, so the copies gathered since are stale.
    coordinator_->set_home_updates({});
    join_reached_.reset();
    deferred_prepare_.reset();
    --steps_;
    logger().error("step {}: the optimizer's update (overlapping the next forward) failed; the step is undone",
                   steps_ + 1);
    refresh_copies();
    zero_grad_shards();
    throw;
  }
  coordinator_->set_home_updates({});
  update_seconds_ = finished.busy_seconds;
  zero_grad_shards();
  if (deferred_prepare_) {
    const float lr = *deferred_prepare_;
    deferred_prepare_.reset();
    arm_step(lr);
  }
}

}  // namespace strata::engine
