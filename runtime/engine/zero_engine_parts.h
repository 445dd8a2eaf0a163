// ZeroEngine's internals shared by its translation units (zero_engine.cc:
// storage, gradients, step; zero_coordinator.cc: the stage-3 hooks and
// parameter coordinator; zero_engine_state.cc: checkpoints). Not a public
// header.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "nvme/aio_handle.h"
#include "nvme/swap_space.h"
#include "offload/optimizer_swapper.h"
#include "partition/layout.h"
#include "runtime/engine/bucket_reducer.h"
#include "runtime/engine/device_optimizer.h"
#include "runtime/engine/grad_shard.h"
#include "runtime/engine/zero_engine.h"

namespace strata::engine {

// An I/O completion callback that completes `done` (on the I/O worker). It
// holds its own reference, so the event outlives the signal even when the
// engine has moved on.
inline nvme::AioHandle::DoneFn complete_with(std::shared_ptr<HostEvent> done) {
  return [done = std::move(done)](std::exception_ptr error) {
    if (error) {
      done->fail(std::move(error));
    } else {
      done->signal();
    }
  };
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

// nvme home: the pinned staging buffers of one group (nc). A buffer is free
// when no parameter holds it and the gather stream is past its last reader.
struct ZeroEngine::Staging {
  struct Buffer {
    void* data = nullptr;
    ParamId holder = -1;                   // the parameter whose read it holds (no gather yet), -1: none
    std::shared_ptr<HostEvent> read_done;  // its latest read (shared with the read's callback)
    // Gather stream, after the copy / allgather that last read the buffer; a
    // fresh event per reader, since a deferred read waits for this one point.
    std::shared_ptr<Event> consumed;
    uint64_t consumed_seq = 0;             // order of `consumed` on the gather stream
  };
  std::vector<Buffer> buffers;
  size_t buffer_nbytes = 0;
};

// One dtype group: its layout, this rank's shard at home, its gradient shard,
// reducer and optimizer.
struct ZeroEngine::Group {
  DType dtype = DType::kF32;
  std::vector<ParamId> params;
  std::unique_ptr<partition::PartitionLayout> layout;
  void* home = nullptr;  // device: accelerator memory; cpu: pinned memory; nvme: unused
  std::unique_ptr<nvme::SwapSpace> swap;
  nvme::File* file = nullptr;         // nvme home
  std::unique_ptr<GradShard> grads;   // this rank's fp32 gradient shard (memory or nvme)
  std::unique_ptr<BucketReducer> reducer;  // after grads: destroyed first (its stream writes them)
  // The optimizer: one of the two. swapper: state on cpu or nvme, updated by
  // the CPU Adam; device_optimizer: state in accelerator memory (tier device).
  std::unique_ptr<offload::OptimizerSwapper> swapper;
  std::unique_ptr<DeviceOptimizer> device_optimizer;
  void* full_flat = nullptr;          // stages 1/2: every full parameter
  std::vector<size_t> full_offset;    // per member: offset in full_flat
  Staging staging;                    // stage 3, nvme home

  // The optimizer's sub-groups (swapper->sub_group_range) and, for the
  // optimizer overlapping backward, what each waits for. pending, landed and
  // armed change under Overlap::mutex (on the reducer stream's host thread);
  // stats are written by whoever drives the swapper (one at a time).
  size_t sub_group_numel = 0;                         // swapper's uniform sub-group length
  std::vector<std::vector<uint32_t>> param_sub_groups;  // per member: the sub-groups its slice meets
  std::vector<int32_t> members_of_sub_group;          // per sub-group: members whose slice meets it
  std::vector<int32_t> pending;                       // per sub-group: members not landed since arming
  std::vector<uint8_t> landed;                        // per member: landed since arming
  bool armed = false;                                 // counting the last backward's landings
  bool landed_twice = false;                          // a member landed twice: more than one backward
  std::vector<kernels::GradStats> stats;              // per sub-group: its gradient's statistics
  std::vector<uint8_t> stats_known;                   // per sub-group: stats computed this step

  size_t sub_group_count() const {
    return swapper ? swapper->sub_group_count() : device_optimizer->sub_group_count();
  }
  std::pair<size_t, size_t> sub_group_range(size_t k) const {
    return swapper ? swapper->sub_group_range(k) : device_optimizer->sub_group_range(k);
  }
};

// The optimizer overlapping backward: the thread that updates sub-groups as
// they become final (ZeroEngine::overlap_main) and the queue feeding it.
struct ZeroEngine::Overlap {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<std::pair<size_t, size_t>> ready;  // (group, sub-group) final, not yet updated
  bool stop = false;
  bool busy = false;                 // updating a batch taken from `ready`
  bool prepared = false;             // prepare_step called, step() not yet
  uint64_t generation = 0;           // of arming: an arming queued on a reducer stream before a
                                     // settle or a failed prepare_step must not arm
  std::exception_ptr error;          // the first failure of the thread (rethrown by step())
  double busy_seconds = 0;           // since prepare_step
  int64_t updated = 0;               // sub-groups the thread updated since prepare_step
  float lr = 0;                      // prepare_step's
  float grad_scale = 1;              // the speculated one (no clipping, the loss scale then)
  double loss_scale = 1;
  std::thread thread;
};

}  // namespace strata::engine
