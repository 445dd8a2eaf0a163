// GradShard: the fp32 gradient shard in accelerator memory or in a file.
#include "offload/grad_shard.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "nvme/aio_handle.h"
#include "nvme/io_options.h"
#include "nvme/swap_space.h"
#include "core/error.h"

namespace strata::offload {
namespace {

TensorView fp32_view(float* data, int64_t numel, Tier tier) {
  return TensorView{TensorDesc{DType::kF32, {numel}, tier}, data};
}

}  // namespace

// The nvme home's read-add-write of each block, on a thread of its own, in
// the order accumulate() queued them. A job starts once its block has landed
// in the scratch: the stream's host function says so (a notice, never I/O). If
// the stream failed before the notice, the notice is skipped; the event
// recorded after it then completes with the stream's error, which the job
// passes on. Either way the job's HostEvent completes — the stream waits on it,
// and on cuda a wait on a host event that never completes would hold the
// stream for ever.
class GradShard::IoThread {
 public:
  struct Job {
    std::function<void()> work;        // read, add, write
    std::unique_ptr<Event> noticed;    // recorded on the stream after the notice
    std::unique_ptr<HostEvent> done;   // the stream waits on it
    bool landed = false;               // guarded by State::mutex
    size_t first = 0, end = 0;         // the shard elements it writes
  };
  struct State {
    std::mutex mutex;
    std::condition_variable changed;
    std::deque<std::shared_ptr<Job>> jobs;  // queued or running, in order
    bool stopping = false;
  };

  IoThread() : state_(std::make_shared<State>()), thread_([this] { run(); }) {}
  ~IoThread() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stopping = true;
    }
    state_->changed.notify_all();
    thread_.join();  // after the queued jobs: their streams wait on them
  }
  IoThread(const IoThread&) = delete;
  IoThread& operator=(const IoThread&) = delete;

  // The host function that tells `job` its block landed: launched on the
  // stream after the copy, before the job is posted.
  std::function<void()> notice(std::shared_ptr<Job> job) {
    return [state = state_, job = std::move(job)] {
      {
        std::lock_guard<std::mutex> lock(state->mutex);
        job->landed = true;
      }
      state->changed.notify_all();
    };
  }

  // Queues `job`, once the stream holds its notice, the event after it and
  // the wait on its `done` (until then the thread must not look at them).
  void post(std::shared_ptr<Job> job) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->jobs.push_back(std::move(job));
    }
    state_->changed.notify_all();
  }

  // Returns once every queued job has finished (what they wrote is then
  // visible to the caller).
  void drain() {
    std::unique_lock<std::mutex> lock(state_->mutex);
    state_->changed.wait(lock, [&] { return state_->jobs.empty(); });
  }

  // Returns once no queued job writes shard elements in [first, end): the
  // optimizer's read of a final sub-group during backward waits for that
  // sub-group's writes only, not for the blocks still landing elsewhere
  // (a full drain there waited out the rest of backward).
  void drain_range(size_t first, size_t end) {
    std::unique_lock<std::mutex> lock(state_->mutex);
    state_->changed.wait(lock, [&] {
      return std::none_of(state_->jobs.begin(), state_->jobs.end(),
                          [&](const std::shared_ptr<Job>& job) { return job->first < end && first < job->end; });
    });
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(state_->mutex);
    for (;;) {
      state_->changed.wait(lock, [&] { return state_->stopping || !state_->jobs.empty(); });
      if (state_->jobs.empty()) return;  // stopping and drained
      const std::shared_ptr<Job> job = state_->jobs.front();
      std::exception_ptr error;
      while (!job->landed) {
        // The notice wakes this wait; the event is looked at only when none
        // came for a while (a skipped notice: the stream failed before it).
        if (state_->changed.wait_for(lock, std::chrono::milliseconds(20), [&] { return job->landed; })) break;
        lock.unlock();
        const bool passed = job->noticed->query();
        lock.lock();
        if (passed && !job->landed) {
          lock.unlock();
          try {
            job->noticed->synchronize();
            error = std::make_exception_ptr(Error(ErrorCategory::kInternal,
                                                  "a gradient block's notice was skipped on a stream without error"));
          } catch (...) {
            error = std::current_exception();
          }
          lock.lock();
          break;
        }
      }
      lock.unlock();
      if (!error) {
        try {
          job->work();
        } catch (...) {
          error = std::current_exception();
        }
      }
      if (error) {
        job->done->fail(error);
      } else {
        job->done->signal();
      }
      lock.lock();
      state_->jobs.pop_front();
      state_->changed.notify_all();
    }
  }

  std::shared_ptr<State> state_;
  std::thread thread_;
};

// The parameter whose block the scratch holds, final (summed with what was on
// disk) and not yet overwritten: set by the I/O thread before it writes the
// block, cleared on the stream before the next block's copy into the scratch
// (which waits while a read copies from it: both under `mutex`) and by zero().
struct GradShard::Tail {
  std::mutex mutex;
  std::optional<size_t> param;
};

// A parameter's held sum (hold_blocks): host memory aligned for O_DIRECT, so
// that a reader can write it out as it is (write_held).
struct GradShard::HeldSum {
  float* data = nullptr;
  size_t capacity = 0;  // floats
  explicit HeldSum(size_t numel) {
    const size_t nbytes = (numel * sizeof(float) + nvme::kDirectIoAlignment - 1) / nvme::kDirectIoAlignment *
                          nvme::kDirectIoAlignment;
    data = static_cast<float*>(std::aligned_alloc(nvme::kDirectIoAlignment, nbytes));
    STRATA_CHECK(data != nullptr, kOutOfMemory, "cannot allocate {} bytes of host memory to hold a gradient",
                 nbytes);
    capacity = nbytes / sizeof(float);
  }
  ~HeldSum() { std::free(data); }
  HeldSum(const HeldSum&) = delete;
  HeldSum& operator=(const HeldSum&) = delete;
};

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
  blocks_.assign(layout.params().size(), 0);
  held_.resize(layout.params().size());
  for (const auto& slot : layout.params()) {
    scratch_numel_ = std::max(scratch_numel_, static_cast<size_t>(slot.slice_numel));
  }
  if (scratch_numel_ > 0) {
    scratch_ = static_cast<float*>(accelerator.allocate_pinned(2 * scratch_numel_ * sizeof(float)));
  }
  tail_ = std::make_shared<Tail>();
  io_ = std::make_unique<IoThread>();
}

GradShard::~GradShard() {
  io_.reset();  // its last jobs use the scratch and the file
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
  // The block lands in the aligned pinned scratch (O_DIRECT); the I/O thread
  // writes it, or adds it to what is on disk, and signals `done`. The stream
  // waits on `done`, so later blocks' copies into the scratch queue behind
  // the I/O and one scratch serves all.
  const size_t nbytes = static_cast<size_t>(slot.slice_numel) * sizeof(float);
  const uint64_t offset = static_cast<uint64_t>(slot.shard_offset_numel) * sizeof(float);
  stream.launch_host_func([tail = tail_] {
    std::lock_guard lock(tail->mutex);
    tail->param.reset();
  });
  accelerator_.copy_async(scratch_, block, nbytes, CopyKind::kDeviceToHost, stream);
  auto job = std::make_shared<IoThread::Job>();
  job->noticed = accelerator_.create_event();
  job->done = accelerator_.create_host_event();
  job->first = static_cast<size_t>(slot.shard_offset_numel);
  job->end = job->first + static_cast<size_t>(slot.slice_numel);
  job->work = [this, p, nbytes, offset, numel = static_cast<size_t>(slot.slice_numel), hold = hold_] {
    // Every addition is the new block plus the sum of the earlier ones (fp32
    // addition commutes bit for bit), whether that sum is held or on disk.
    const int blocks = ++blocks_[p];
    std::unique_ptr<HeldSum>& held = held_[p];
    if (blocks < hold && written_[p] == 0) {  // an earlier block of a held run: summed here, not written
      if (!held) {
        held = take_spare(numel);
        std::memcpy(held->data, scratch_, nbytes);
      } else {
        for (size_t i = 0; i < numel; ++i) held->data[i] += scratch_[i];
      }
      return;
    }
    if (held) {
      for (size_t i = 0; i < numel; ++i) scratch_[i] += held->data[i];
      give_back(std::move(held));
    } else if (written_[p] != 0) {
      float* on_disk = scratch_ + scratch_numel_;
      aio_->read(*file_, on_disk, nbytes, offset);
      for (size_t i = 0; i < numel; ++i) scratch_[i] += on_disk[i];
    }
    {
      std::lock_guard lock(tail_->mutex);
      tail_->param = p;
    }
    aio_->write(*file_, scratch_, nbytes, offset);
    written_[p] = 1;
  };
  stream.launch_host_func(io_->notice(job));
  stream.record(*job->noticed);
  stream.wait(*job->done);
  io_->post(std::move(job));
}

void GradShard::zero(Stream& stream) {
  if (memory_ != nullptr) {
    accelerator_.memset_async(memory_, 0, static_cast<size_t>(layout_.shard_numel()) * sizeof(float), stream);
    stream.synchronize();
    return;
  }
  io_->drain();
  std::fill(written_.begin(), written_.end(), 0);
  std::fill(blocks_.begin(), blocks_.end(), 0);
  for (auto& held : held_) {
    if (held) give_back(std::move(held));  // a step abandoned half way: its sums are dropped
  }
  std::lock_guard lock(tail_->mutex);
  tail_->param.reset();
}

void GradShard::hold_blocks(int blocks) {
  STRATA_CHECK(blocks >= 1, kBadArgument, "GradShard::hold_blocks({}): at least 1", blocks);
  hold_ = blocks;
}

std::unique_ptr<GradShard::HeldSum> GradShard::take_spare(size_t numel) {
  {
    std::lock_guard lock(spare_mutex_);
    for (auto it = spare_.begin(); it != spare_.end(); ++it) {
      if ((*it)->capacity >= numel) {
        std::unique_ptr<HeldSum> sum = std::move(*it);
        spare_.erase(it);
        return sum;
      }
    }
  }
  return std::make_unique<HeldSum>(numel);
}

void GradShard::give_back(std::unique_ptr<HeldSum> sum) {
  std::lock_guard lock(spare_mutex_);
  spare_.push_back(std::move(sum));
}

void GradShard::write_held(size_t first, size_t end) {
  for (size_t p = 0; p < held_.size(); ++p) {
    const partition::ParamSlot& slot = layout_.param(p);
    const size_t begin = static_cast<size_t>(slot.shard_offset_numel);
    // Only this range's parameters are looked at: the I/O thread may be summing others'.
    if (begin >= end || begin + static_cast<size_t>(slot.slice_numel) <= first || !held_[p]) continue;
    const size_t nbytes = static_cast<size_t>(slot.slice_numel) * sizeof(float);
    aio_->write(*file_, held_[p]->data, nbytes, static_cast<uint64_t>(begin) * sizeof(float));
    written_[p] = 1;
    give_back(std::move(held_[p]));
  }
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
    if (accelerator_.host_addressable()) return memory_ + first;  // the host reads it in place
    ensure_window(numel);
    accelerator_.copy_async(window_, memory_ + first, numel * sizeof(float), CopyKind::kDeviceToHost, stream);
    stream.synchronize();
    return window_;
  }
  ensure_window(numel);
  read_async(first, numel, window_)();
  return window_;
}

std::function<void()> GradShard::read_async(size_t first, size_t numel, float* dst) {
  STRATA_CHECK(first + numel <= static_cast<size_t>(layout_.shard_numel()), kBadArgument,
               "gradient range [{}, {}) outside the shard ({} elements)", first, first + numel, layout_.shard_numel());
  STRATA_CHECK(file_ != nullptr, kInternal, "GradShard::read_async of a gradient shard in memory");
  const size_t end = first + numel;
  // The part of the range in the block the scratch holds is copied from it
  // (its write may still be running: both only read the scratch); the rest,
  // at most a piece on either side (slice boundaries are aligned), is read
  // once its own writes are done.
  size_t copied_begin = end, copied_end = end;
  {
    std::lock_guard lock(tail_->mutex);
    if (tail_->param) {
      const partition::ParamSlot& slot = layout_.param(*tail_->param);
      const size_t slice = static_cast<size_t>(slot.shard_offset_numel);
      const size_t begin = std::max(first, slice);
      const size_t stop = std::min(end, slice + static_cast<size_t>(slot.slice_numel));
      if (begin < stop) {
        std::memcpy(dst + (begin - first), scratch_ + (begin - slice), (stop - begin) * sizeof(float));
        copied_begin = begin;
        copied_end = stop;
      }
    }
  }
  struct Piece {
    size_t first, end;
    nvme::Ticket ticket;
  };
  std::vector<Piece> pieces;
  for (const auto& [begin, stop] : {std::pair{first, copied_begin}, std::pair{copied_end, end}}) {
    if (begin >= stop) continue;
    io_->drain_range(begin, stop);
    write_held(begin, stop);  // sums of fewer blocks than held: on disk before the read
    pieces.push_back({begin, stop,
                      aio_->submit_read(*file_, dst + (begin - first), (stop - begin) * sizeof(float),
                                        static_cast<uint64_t>(begin) * sizeof(float))});
  }
  return [this, pieces = std::move(pieces), first, dst] {
    std::exception_ptr error;
    for (const Piece& piece : pieces) {
      try {
        aio_->wait(piece.ticket);  // every piece waited for before dst is given back
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    for (const Piece& piece : pieces) zero_unwritten(piece.first, piece.end - piece.first, dst + (piece.first - first));
  };
}

void GradShard::zero_unwritten(size_t first, size_t numel, float* dst) const {
  // Slices no block reached since zero() hold an older step's values: zeros.
  // Only the flags of slices in the range are read: the optimizer reads a
  // final sub-group while the I/O thread still writes other slices' flags.
  for (size_t p = 0; p < written_.size(); ++p) {
    const partition::ParamSlot& slot = layout_.param(p);
    const size_t begin = std::max(first, static_cast<size_t>(slot.shard_offset_numel));
    const size_t end = std::min(first + numel, static_cast<size_t>(slot.shard_offset_numel + slot.slice_numel));
    if (begin >= end || written_[p] != 0) continue;
    std::fill(dst + (begin - first), dst + (end - first), 0.0f);
  }
}

}  // namespace strata::offload
