// The optimizer step walker: CPU-resident state updated in place, or
// NVMe-resident state streamed through pool buffers as a three-stage pipeline
// with a two-slot, manifest-committed layout on disk.
#include "offload/optimizer_swapper.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>

#include "core/durable_file.h"
#include "core/error.h"
#include "core/trace_recorder.h"
#include "core/log.h"

namespace strata::offload {
namespace {

constexpr const char* kManifestFormat = "strata-optimizer-swap-v1";
constexpr size_t kStateArrays = 3;  // master, exp_avg, exp_avg_sq

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The write of a sub-group's new values to their home (StepInputs::
// param_write), ended on an I/O thread.
struct HomeWrite {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void end(std::exception_ptr e) {
    {
      std::lock_guard lock(mutex);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
  // Waits for the write; rethrows its error.
  void wait() {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return done; });
    if (error) std::rethrow_exception(error);
  }
};

// A pool buffer with the I/O request using it, if any, the read of its
// sub-group's gradient into it (StepInputs::grad_read), if one is in flight,
// and the write of its new values to their home from it (param_write).
struct Op {
  explicit Op(PinnedBuffer b) : buffer(std::move(b)) {}
  PinnedBuffer buffer;
  nvme::Ticket ticket = 0;
  bool pending = false;
  StepInputs::GradCompletion grad;  // empty: no gradient read into this buffer
  const void* grad_ready = nullptr;  // the gradient, already read into this buffer (read_grad_ahead)
  std::shared_ptr<HomeWrite> home_write;  // null: none from this buffer
};

// On an error path: waits out a gradient read still in flight into op's buffer.
void drain_grad(Op& op) {
  if (!op.grad) return;
  StepInputs::GradCompletion grad = std::move(op.grad);
  op.grad = nullptr;
  try { grad(); } catch (...) {}
}

// Waits out the home write from op's buffer; rethrows its error.
void finish_home_write(Op& op) {
  if (!op.home_write) return;
  std::shared_ptr<HomeWrite> write = std::move(op.home_write);
  write->wait();
}

// Waits for op's request and then its home write; rethrows either's error.
void finish(nvme::AioHandle& aio, Op& op) {
  op.pending = false;
  aio.wait(op.ticket);
  finish_home_write(op);
}

// On an error path: waits out every request still in flight, so no buffer
// returns to the pool under a transfer. Their errors are secondary to the one
// being rethrown and are dropped.
void drain_pending(nvme::AioHandle& aio, std::deque<Op>& ops) {
  for (Op& op : ops) {
    drain_grad(op);
    try { finish_home_write(op); } catch (...) {}
    if (!op.pending) continue;
    op.pending = false;
    try { aio.wait(op.ticket); } catch (...) {}
  }
}

}  // namespace

size_t OptimizerSwapper::record_nbytes(size_t numel) {
  return round_up(numel * kStateArrays * sizeof(float), nvme::kDirectIoAlignment);
}

size_t OptimizerSwapper::buffer_nbytes(size_t numel, bool with_grad) {
  return record_nbytes(numel) + (with_grad ? round_up(numel * sizeof(float), nvme::kDirectIoAlignment) : 0);
}

OptimizerSwapper::OptimizerSwapper(OptimizerSwapperOptions options, PinnedBufferPool* pool,
                                   nvme::AioHandle* aio)
    : options_(std::move(options)), pool_(pool), aio_(aio) {
  options_.adam.validate();
  STRATA_CHECK(options_.numel > 0, kBadArgument, "optimizer swapper: shard numel must be > 0");
  STRATA_CHECK(options_.sub_group_numel > 0, kBadArgument, "sub_group_size must be > 0");
  STRATA_CHECK(options_.state_tier == Tier::kCpu || options_.state_tier == Tier::kNvme, kBadArgument,
               "optimizer state tier must be cpu or nvme, got {}", tier_name(options_.state_tier));
  options_.sub_group_numel = std::min(options_.sub_group_numel, options_.numel);
  sub_groups_ = (options_.numel + options_.sub_group_numel - 1) / options_.sub_group_numel;
  stride_nbytes_ = record_nbytes(options_.sub_group_numel);
  if (options_.state_tier == Tier::kCpu) {
    STRATA_CHECK(!options_.resume, kBadArgument, "optimizer swapper: resume needs state on nvme");
    master_.assign(options_.numel, 0.0f);
    exp_avg_.assign(options_.numel, 0.0f);
    exp_avg_sq_.assign(options_.numel, 0.0f);
    return;
  }
  STRATA_CHECK(pool_ != nullptr && aio_ != nullptr, kBadArgument,
               "optimizer state on nvme needs a pinned pool and an I/O handle");
  STRATA_CHECK(!options_.nvme_path.empty(), kBadArgument,
               "offload_optimizer.nvme_path must be set when the optimizer state is on nvme");
  STRATA_CHECK(pool_->buffer_nbytes() >= stride_nbytes_, kBadArgument,
               "pinned pool buffers hold {} bytes but one sub-group of {} elements needs {} "
               "(fp32 master + 2 moments); lower sub_group_size or raise the buffer size",
               pool_->buffer_nbytes(), options_.sub_group_numel, stride_nbytes_);
  STRATA_CHECK(pool_->buffer_count() >= 2, kBadArgument,
               "the optimizer pipeline needs at least 2 pool buffers (3 to overlap read, update "
               "and write), the pool has {}", pool_->buffer_count());
  swap_ = std::make_unique<nvme::SwapSpace>(
      nvme::SwapSpaceOptions{options_.nvme_path, options_.group, options_.rank, true});
  const uint64_t slot_nbytes = static_cast<uint64_t>(sub_groups_) * stride_nbytes_;
  swap_->create({{"slot0", slot_nbytes}, {"slot1", slot_nbytes}});
  if (options_.keep_files) swap_->keep();
  if (options_.resume) {
    read_manifest();
    initialized_ = true;
  } else if (std::filesystem::exists(manifest_path())) {
    // A committed state from an earlier run stays intact until initialize()
    // commits a new one: continue its generation count, so the first write
    // goes to the slot it does not name. A manifest this run cannot use (other
    // shape, unreadable) is removed durably first, so it can never name a slot
    // this run is about to overwrite.
    try {
      read_manifest();
      step_count_ = 0;
    } catch (const std::exception&) {
      std::filesystem::remove(manifest_path());
      sync_directory(swap_->directory());
      generation_ = 0;
      step_count_ = 0;
    }
  }
}

OptimizerSwapper::~OptimizerSwapper() {
  if (open_) release_buffers(*open_);  // no transfer may use a buffer back in the pool
  if (swap_ && !options_.keep_files) {
    std::error_code ignored;
    std::filesystem::remove(manifest_path(), ignored);
    std::filesystem::remove(manifest_path().string() + ".tmp", ignored);
  }
}

OptimizerSwapper::Range OptimizerSwapper::sub_group(size_t k) const {
  const size_t offset = k * options_.sub_group_numel;
  return {offset, std::min(options_.sub_group_numel, options_.numel - offset)};
}

nvme::File& OptimizerSwapper::slot_file(int slot) { return swap_->file(slot == 0 ? "slot0" : "slot1"); }

std::filesystem::path OptimizerSwapper::manifest_path() const {
  return swap_->directory() / "manifest.json";
}

void OptimizerSwapper::initialize(const float* master) {
  STRATA_CHECK(master != nullptr, kBadArgument, "optimizer swapper initialize: master is null");
  initialize([master](size_t first, size_t numel, float* out) {
    std::copy(master + first, master + first + numel, out);
  });
}

void OptimizerSwapper::initialize(const FillFn& fill) {
  write_state(
      [&](size_t first, size_t numel, float* master, float* exp_avg, float* exp_avg_sq) {
        fill(first, numel, master);
        std::fill(exp_avg, exp_avg + numel, 0.0f);
        std::fill(exp_avg_sq, exp_avg_sq + numel, 0.0f);
      },
      0);
}

void OptimizerSwapper::restore(const StateFillFn& fill, int64_t step_count) {
  STRATA_CHECK(step_count >= 0, kBadArgument, "optimizer swapper restore: step count {} < 0", step_count);
  write_state(fill, step_count);
}

void OptimizerSwapper::write_state(const StateFillFn& fill, int64_t step_count) {
  STRATA_CHECK(open_ == nullptr, kBadArgument, "optimizer swapper: initialize or restore while a step is open");
  if (options_.state_tier == Tier::kCpu) {
    for (size_t k = 0; k < sub_groups_; ++k) {
      const Range r = sub_group(k);
      fill(r.offset, r.numel, master_.data() + r.offset, exp_avg_.data() + r.offset, exp_avg_sq_.data() + r.offset);
    }
  } else {
    check_writable();
    // Written to the spare slot and committed, like a step, so an interrupted
    // initialize or restore never damages a committed state.
    const int out_slot = static_cast<int>((generation_ + 1) % 2);
    nvme::File& out = slot_file(out_slot);
    std::deque<Op> writes;
    try {
      for (size_t k = 0; k < sub_groups_; ++k) {
        while (pool_->available() == 0 && !writes.empty()) {
          writes.front().pending = false;
          aio_->wait(writes.front().ticket);
          writes.pop_front();
        }
        Op op{pool_->acquire()};
        const Range r = sub_group(k);
        float* p = op.buffer.as<float>();
        fill(r.offset, r.numel, p, p + r.numel, p + 2 * r.numel);  // the record: master, exp_avg, exp_avg_sq
        std::memset(p + 3 * r.numel, 0, record_nbytes(r.numel) - 3 * r.numel * sizeof(float));
        op.ticket = aio_->submit_write(out, p, record_nbytes(r.numel), file_offset(k));
        op.pending = true;
        writes.push_back(std::move(op));
      }
      while (!writes.empty()) {
        writes.front().pending = false;
        aio_->wait(writes.front().ticket);
        writes.pop_front();
      }
      out.sync();
    } catch (...) {
      drain_pending(*aio_, writes);
      throw;
    }
    commit(generation_ + 1, step_count);
  }
  step_count_ = step_count;
  initialized_ = true;
}

void OptimizerSwapper::update(const kernels::AdamCoefficients& c, const StepInputs& in, size_t k,
                              float* p, float* m, float* v, const void* grad, bool deliver) {
  const Range r = sub_group(k);
  kernels::AdamBuffers b;
  b.param = p;
  b.exp_avg = m;
  b.exp_avg_sq = v;
  if (grad != nullptr) {
    b.grad = grad;
  } else if (in.grad_source) {
    b.grad = in.grad_source(r.offset, r.numel);
    STRATA_CHECK(b.grad != nullptr, kBadArgument, "optimizer step: the gradient source gave no gradient for [{}, {})",
                 r.offset, r.offset + r.numel);
  } else {
    b.grad = static_cast<const char*>(in.grad) + r.offset * dtype_nbytes(in.grad_dtype);
  }
  b.grad_dtype = in.grad_dtype;
  const bool sink16 = in.param_sink && in.param16_dtype != DType::kF32;
  if (sink16) {
    sink_scratch_.resize(std::max(sink_scratch_.size(), r.numel));
    b.param16 = sink_scratch_.data();
  } else {
    b.param16 = in.param16 == nullptr
                    ? nullptr
                    : static_cast<char*>(in.param16) + r.offset * dtype_nbytes(in.param16_dtype);
  }
  b.param16_dtype = in.param16_dtype;
  b.numel = r.numel;
  const auto start = Clock::now();
  {
    trace::Span span("optimizer", "adam");
    // Bytes the kernel streams: p, m, v read and written, the gradient read, the 16-bit copy written.
    const size_t per_element = 24 + dtype_nbytes(b.grad_dtype) + (b.param16 != nullptr ? dtype_nbytes(b.param16_dtype) : 0);
    span.value("sub_group", static_cast<int64_t>(k)).bytes(r.numel * per_element);
    kernels::adam_step(c, b, options_.isa, options_.threads);
  }
  timings_.update_seconds += seconds_since(start);
  if (!deliver) return;
  if (in.param_sink) {
    trace::Span span("optimizer", "new values to home");
    span.value("sub_group", static_cast<int64_t>(k));
    in.param_sink(r.offset, r.numel, sink16 ? static_cast<const void*>(b.param16) : p);
  }
  if (updated_hook_) updated_hook_(k);
}

struct OptimizerSwapper::OpenStep {
  StepInputs inputs;
  kernels::AdamCoefficients coefficients;
  bool revocable = false;
  std::vector<uint8_t> updated;  // per sub-group
  size_t updated_count = 0;
  // cpu, revocable: each updated sub-group's state before its update (master | exp_avg | exp_avg_sq).
  std::vector<std::pair<size_t, std::vector<float>>> saved;
  // NVMe: sub-groups whose committed record was read ahead (prefetch), in
  // the buffer their update will use; the read may still be in flight.
  std::map<size_t, Op> prefetched;
  // NVMe: state writes of updated sub-groups still in flight, oldest first,
  // each holding its buffer. update_sub_groups returns once the home writes
  // it started have ended, not these: the next call waits for them when it
  // needs their buffers, commit_step for all (before its fdatasync), and
  // abort_step drains them — so a batch's write-back overlaps whatever its
  // caller does next (the optimizer thread's last batch: the norm, step()).
  std::deque<Op> writes;
};

float* OptimizerSwapper::spare_area(void* buffer) const {
  if (pool_ == nullptr || pool_->buffer_nbytes() < buffer_nbytes(options_.sub_group_numel, true)) return nullptr;
  return reinterpret_cast<float*>(static_cast<char*>(buffer) + stride_nbytes_);
}

float* OptimizerSwapper::grad_area(void* buffer) const {
  if (open_ == nullptr || !open_->inputs.grad_read) return nullptr;
  return spare_area(buffer);
}

void OptimizerSwapper::release_buffers(OpenStep& open) {
  if (!open.writes.empty()) drain_pending(*aio_, open.writes);  // NVMe only: cpu state has no I/O handle
  open.writes.clear();
  for (auto& [k, op] : open.prefetched) {
    drain_grad(op);
    if (!op.pending) continue;
    op.pending = false;
    try {
      aio_->wait(op.ticket);
    } catch (...) {
      // A read ahead that failed is never used; the step is being closed.
    }
  }
  open.prefetched.clear();
}

void OptimizerSwapper::step(const StepInputs& in) {
  begin_step(in, /*revocable=*/false);
  std::vector<size_t> all(sub_groups_);
  for (size_t k = 0; k < sub_groups_; ++k) all[k] = k;
  try {
    update_sub_groups(all);
    commit_step();
  } catch (...) {
    // NVMe: the committed state is untouched; cpu: updated sub-groups keep their new state.
    if (open_) release_buffers(*open_);  // commit_step closes the step (draining it) before it can fail
    open_.reset();
    throw;
  }
}

void OptimizerSwapper::begin_step(const StepInputs& in, bool revocable) {
  STRATA_CHECK(initialized_, kBadArgument, "optimizer swapper: step before initialize()");
  STRATA_CHECK(open_ == nullptr, kBadArgument, "optimizer swapper: a step is already open");
  STRATA_CHECK(in.grad != nullptr || in.grad_source, kBadArgument, "optimizer step: gradient is null");
  STRATA_CHECK(!in.param_sink || in.param16 == nullptr, kBadArgument,
               "optimizer step: give param16 or param_sink, not both");
  if (swap_) check_writable();
  auto open = std::make_unique<OpenStep>();
  open->inputs = in;
  open->coefficients = kernels::adam_coefficients(options_.adam, step_count_ + 1, in.grad_scale);
  open->revocable = revocable && options_.state_tier == Tier::kCpu;
  open->updated.assign(sub_groups_, 0);
  open_ = std::move(open);
  timings_ = StepTimings{};
}

bool OptimizerSwapper::prefetch(size_t k, size_t keep_free) {
  STRATA_CHECK(open_ != nullptr, kBadArgument, "optimizer swapper: prefetch without begin_step");
  STRATA_CHECK(k < sub_groups_, kBadArgument, "sub-group {} out of range ({} sub-groups)", k, sub_groups_);
  if (options_.state_tier != Tier::kNvme || open_->updated[k] != 0 || open_->prefetched.count(k) != 0) return false;
  if (pool_->available() <= keep_free) return false;
  std::optional<PinnedBuffer> buffer = pool_->try_acquire();
  if (!buffer) return false;
  Op op{std::move(*buffer)};
  const size_t nbytes = record_nbytes(sub_group(k).numel);
  op.ticket = aio_->submit_read(slot_file(static_cast<int>(generation_ % 2)), op.buffer.data(), nbytes,
                                file_offset(k));
  op.pending = true;
  timings_.bytes_read += nbytes;
  open_->prefetched.emplace(k, std::move(op));
  return true;
}

const float* OptimizerSwapper::read_grad_ahead(size_t k) {
  STRATA_CHECK(open_ != nullptr, kBadArgument, "optimizer swapper: read_grad_ahead without begin_step");
  const auto ahead = open_->prefetched.find(k);
  if (ahead == open_->prefetched.end()) return nullptr;
  Op& op = ahead->second;
  if (op.grad_ready != nullptr) return static_cast<const float*>(op.grad_ready);
  float* grad = grad_area(op.buffer.data());
  if (grad == nullptr) return nullptr;
  const Range r = sub_group(k);
  StepInputs::GradCompletion complete = open_->inputs.grad_read(r.offset, r.numel, grad);
  op.grad_ready = complete();
  return static_cast<const float*>(op.grad_ready);
}

void OptimizerSwapper::finish_writes() {
  if (open_ == nullptr) return;
  std::deque<Op>& writes = open_->writes;
  const auto start = Clock::now();
  try {
    while (!writes.empty()) {
      finish(*aio_, writes.front());
      writes.pop_front();
    }
  } catch (...) {
    drain_pending(*aio_, writes);
    writes.clear();
    throw;
  }
  timings_.write_wait_seconds += seconds_since(start);
}

void OptimizerSwapper::drop_grads_read_ahead() {
  if (open_ == nullptr) return;
  for (auto& entry : open_->prefetched) entry.second.grad_ready = nullptr;
}

bool OptimizerSwapper::prefetched(size_t k) const { return open_ != nullptr && open_->prefetched.count(k) != 0; }

std::vector<size_t> OptimizerSwapper::prefetched() const {
  std::vector<size_t> out;
  if (open_ == nullptr) return out;
  for (const auto& entry : open_->prefetched) out.push_back(entry.first);
  return out;
}

void OptimizerSwapper::set_step_inputs(const StepInputs& in) {
  STRATA_CHECK(open_ != nullptr, kBadArgument, "optimizer swapper: set_step_inputs without begin_step");
  STRATA_CHECK(open_->updated_count == 0, kBadArgument,
               "optimizer swapper: set_step_inputs after {} sub-group(s) of the step were updated", open_->updated_count);
  STRATA_CHECK(in.grad != nullptr || in.grad_source, kBadArgument, "optimizer step: gradient is null");
  STRATA_CHECK(!in.param_sink || in.param16 == nullptr, kBadArgument,
               "optimizer step: give param16 or param_sink, not both");
  open_->inputs = in;
  open_->coefficients = kernels::adam_coefficients(options_.adam, step_count_ + 1, in.grad_scale);
}

bool OptimizerSwapper::updated(size_t k) const {
  return open_ != nullptr && k < sub_groups_ && open_->updated[k] != 0;
}

void OptimizerSwapper::update_sub_groups(std::span<const size_t> ks) {
  STRATA_CHECK(open_ != nullptr, kBadArgument, "optimizer swapper: update_sub_groups without begin_step");
  for (size_t k : ks) {
    STRATA_CHECK(k < sub_groups_, kBadArgument, "sub-group {} out of range ({} sub-groups)", k, sub_groups_);
    STRATA_CHECK(open_->updated[k] == 0, kBadArgument, "sub-group {} is already updated in this step", k);
  }
  const auto start = Clock::now();
  if (options_.state_tier == Tier::kCpu) {
    for (size_t k : ks) {
      const Range r = sub_group(k);
      if (open_->revocable) {
        std::vector<float> saved(3 * r.numel);
        std::copy_n(master_.data() + r.offset, r.numel, saved.data());
        std::copy_n(exp_avg_.data() + r.offset, r.numel, saved.data() + r.numel);
        std::copy_n(exp_avg_sq_.data() + r.offset, r.numel, saved.data() + 2 * r.numel);
        open_->saved.emplace_back(k, std::move(saved));
      }
      open_->updated[k] = 1;  // before: a sink that throws leaves k updated (and, revocable, saved)
      ++open_->updated_count;
      update(open_->coefficients, open_->inputs, k, master_.data() + r.offset, exp_avg_.data() + r.offset,
             exp_avg_sq_.data() + r.offset);
    }
  } else {
    update_nvme(ks);
  }
  timings_.sub_groups += ks.size();
  timings_.total_seconds += seconds_since(start);
}

void OptimizerSwapper::commit_step() {
  STRATA_CHECK(open_ != nullptr, kBadArgument, "optimizer swapper: commit_step without begin_step");
  STRATA_CHECK(open_->updated_count == sub_groups_, kBadArgument,
               "optimizer swapper: commit_step with {} of {} sub-groups updated", open_->updated_count, sub_groups_);
  try {
    finish_writes();
  } catch (...) {
    open_.reset();  // closed: the committed state stays the old one
    throw;
  }
  std::unique_ptr<OpenStep> open = std::move(open_);  // closed, whatever happens below
  if (options_.state_tier == Tier::kCpu) {
    ++step_count_;
    return;
  }
  const auto start = Clock::now();
  slot_file(static_cast<int>((generation_ + 1) % 2)).sync();
  commit(generation_ + 1, step_count_ + 1);
  timings_.commit_seconds = seconds_since(start);
  timings_.total_seconds += timings_.commit_seconds;
}

void OptimizerSwapper::abort_step() {
  if (open_ == nullptr) return;
  std::unique_ptr<OpenStep> open = std::move(open_);
  release_buffers(*open);
  if (options_.state_tier != Tier::kCpu) return;  // the committed slot was never written
  for (const auto& [k, saved] : open->saved) {
    const Range r = sub_group(k);
    std::copy_n(saved.data(), r.numel, master_.data() + r.offset);
    std::copy_n(saved.data() + r.numel, r.numel, exp_avg_.data() + r.offset);
    std::copy_n(saved.data() + 2 * r.numel, r.numel, exp_avg_sq_.data() + r.offset);
  }
  STRATA_CHECK(open->revocable || open->updated_count == 0, kBadArgument,
               "optimizer swapper: a step that was not revocable aborted after updating {} sub-group(s): "
               "they keep their new state",
               open->updated_count);
}

void OptimizerSwapper::update_nvme(std::span<const size_t> ks) {
  const kernels::AdamCoefficients& c = open_->coefficients;
  const StepInputs& in = open_->inputs;
  nvme::File& in_file = slot_file(static_cast<int>(generation_ % 2));
  nvme::File& out_file = slot_file(static_cast<int>((generation_ + 1) % 2));
  // Sub-groups read ahead (prefetch) first: their buffers are taken, and the
  // reads of the others go into the buffers they free. Any order gives the
  // same bits (each sub-group's update is its own).
  std::vector<size_t> order(ks.begin(), ks.end());
  std::stable_partition(order.begin(), order.end(), [&](size_t k) { return open_->prefetched.count(k) != 0; });
  std::vector<size_t> to_read;
  for (size_t k : order) {
    if (open_->prefetched.count(k) == 0) to_read.push_back(k);
  }
  // A pool buffer cycles read -> update (in place) -> write. Reads are issued
  // as far ahead as free buffers allow, so the drive always has queued work and
  // reads (on the critical path) are queued before later writes; writes hold
  // their buffers until done, which is the backpressure bounding what is in flight.
  std::deque<Op> reads;
  std::deque<Op>& writes = open_->writes;  // earlier calls' too: their buffers come back as they end
  size_t next_read = 0;  // index into to_read
  auto finish_timed = [&](Op& op, double& waited) {
    const auto start = Clock::now();
    finish(*aio_, op);
    waited += seconds_since(start);
  };
  auto start_read = [&] {
    const size_t k = to_read[next_read++];
    Op op{pool_->acquire()};
    const Range r = sub_group(k);
    const size_t nbytes = record_nbytes(r.numel);
    op.ticket = aio_->submit_read(in_file, op.buffer.data(), nbytes, file_offset(k));
    op.pending = true;
    timings_.bytes_read += nbytes;
    // The gradient behind the state, into the same buffer: queued ahead with
    // it, so the update finds both there rather than reading the gradient
    // then (behind the reads queued meanwhile).
    if (float* grad = grad_area(op.buffer.data())) {
      reads.push_back(std::move(op));
      reads.back().grad = in.grad_read(r.offset, r.numel, grad);
      return;
    }
    reads.push_back(std::move(op));
  };
  // Issues reads until min_reads are in flight (waiting for the oldest write
  // when the pool is empty), then every further read a free buffer allows.
  auto top_up_reads = [&](size_t min_reads) {
    while (reads.size() < min_reads && next_read < to_read.size()) {
      while (pool_->available() == 0 && !writes.empty()) {
        finish_timed(writes.front(), timings_.write_wait_seconds);
        writes.pop_front();
      }
      // Every buffer already holds a read: enough in flight. (With no read at
      // all, the pool is shared and another user holds it: block in acquire.)
      if (pool_->available() == 0 && !reads.empty()) break;
      start_read();
    }
    while (next_read < to_read.size() && pool_->available() > 0) start_read();
  };
  std::optional<Op> current;
  try {
    // The gradients of the sub-groups read ahead, all queued now into their
    // buffers (the state is there already), so each update finds its
    // gradient rather than reading it behind the previous one's write-back.
    for (size_t k : order) {
      const auto ahead = open_->prefetched.find(k);
      if (ahead == open_->prefetched.end()) break;
      float* grad = grad_area(ahead->second.buffer.data());
      if (grad == nullptr || ahead->second.grad || ahead->second.grad_ready != nullptr) continue;
      const Range r = sub_group(k);
      ahead->second.grad = in.grad_read(r.offset, r.numel, grad);
    }
    for (size_t k : order) {
      const auto ahead = open_->prefetched.find(k);
      if (ahead != open_->prefetched.end()) {
        current.emplace(std::move(ahead->second));
        open_->prefetched.erase(ahead);
        top_up_reads(0);  // only into buffers free now
        if (current->pending) finish_timed(*current, timings_.read_wait_seconds);
      } else {
        top_up_reads(2);  // read k at the front, the next behind it while k is waited on and updated
        finish_timed(reads.front(), timings_.read_wait_seconds);
        current.emplace(std::move(reads.front()));
        reads.pop_front();
      }
      const Range r = sub_group(k);
      float* p = current->buffer.as<float>();
      const void* grad = current->grad_ready;
      if (current->grad) {
        const auto start = Clock::now();
        StepInputs::GradCompletion complete = std::move(current->grad);
        current->grad = nullptr;
        grad = complete();
        timings_.read_wait_seconds += seconds_since(start);
      }
      open_->updated[k] = 1;  // its spare-slot record is about to change; the committed one never does
      ++open_->updated_count;
      // The new values' home write runs from this buffer while the pipeline
      // goes on (the buffer is held until it ends), and the updated hook
      // fires when it ends: fp32 values are the master weights here; a
      // 16-bit copy goes behind the record, where the gradient was (the
      // update has read it) — when the buffers have that room.
      const bool sixteen = in.param16_dtype != DType::kF32;
      void* values = sixteen ? static_cast<void*>(spare_area(p)) : static_cast<void*>(p);
      const bool write_async = in.param_write && in.param_sink && values != nullptr;
      update(c, in, k, p, p + r.numel, p + 2 * r.numel, grad, /*deliver=*/!write_async);
      if (write_async) {
        trace::Span span("optimizer", "new values to home");
        span.value("sub_group", static_cast<int64_t>(k));
        if (sixteen) std::memcpy(values, sink_scratch_.data(), r.numel * dtype_nbytes(in.param16_dtype));
        auto write = std::make_shared<HomeWrite>();
        in.param_write(r.offset, r.numel, values, [write, k, hook = updated_hook_](std::exception_ptr error) {
          if (!error && hook) hook(k);
          write->end(std::move(error));
        });
        current->home_write = std::move(write);  // only once started: one that threw never ends
      }
      const size_t nbytes = record_nbytes(r.numel);
      current->ticket = aio_->submit_write(out_file, p, nbytes, file_offset(k));
      current->pending = true;
      timings_.bytes_written += nbytes;
      writes.push_back(std::move(*current));
      current.reset();
      // Completed writes free their buffers for reads further ahead.
      while (!writes.empty() && aio_->done(writes.front().ticket)) {
        finish_timed(writes.front(), timings_.write_wait_seconds);
        writes.pop_front();
      }
    }
    // The home writes end before this returns (the caller may release the
    // parameters); the state writes go on behind it (OpenStep::writes).
    const auto start = Clock::now();
    for (Op& op : writes) finish_home_write(op);
    timings_.write_wait_seconds += seconds_since(start);
  } catch (...) {
    if (current) {
      drain_grad(*current);
      try { finish_home_write(*current); } catch (...) {}
    }
    if (current && current->pending) {
      current->pending = false;
      try { aio_->wait(current->ticket); } catch (...) {}
    }
    drain_pending(*aio_, reads);
    drain_pending(*aio_, writes);
    throw;
  }
}

void OptimizerSwapper::commit(uint64_t generation, int64_t step_count) {
  const nlohmann::json manifest = {{"format", kManifestFormat},
                                   {"generation", generation},
                                   {"step", step_count},
                                   {"numel", options_.numel},
                                   {"sub_group_numel", options_.sub_group_numel},
                                   {"slot", generation % 2}};
  // Durable before it becomes visible; the rename is the commit point.
  DurableFile out(manifest_path());
  try {
    out.append(manifest.dump(2) + "\n");
    out.commit();
  } catch (const Error&) {
    // Renamed but the directory's fsync failed: visible but maybe not
    // durable, disk may name either generation, so neither slot may be
    // written again in this process.
    if (out.renamed()) commit_uncertain_ = true;
    throw;
  }
  generation_ = generation;
  step_count_ = step_count;
}

void OptimizerSwapper::check_writable() const {
  STRATA_CHECK(!commit_uncertain_, kIo,
               "optimizer state in {} (rank {}): an earlier commit's directory fsync failed, so the "
               "committed generation on disk is unknown; restart with resume = true to continue from "
               "what the manifest names",
               swap_->directory().string(), options_.rank);
}

void OptimizerSwapper::read_manifest() {
  const std::filesystem::path path = manifest_path();
  std::ifstream in(path);
  STRATA_CHECK(in.good(), kIo, "cannot resume optimizer state: {} is missing (rank {})",
               path.string(), options_.rank);
  nlohmann::json manifest;
  try {
    in >> manifest;
  } catch (const std::exception& e) {
    raise(ErrorCategory::kIo, "optimizer manifest {} is not valid JSON: {}", path.string(), e.what());
  }
  STRATA_CHECK(manifest.value("format", "") == kManifestFormat, kIo,
               "optimizer manifest {} has format '{}', expected '{}'", path.string(),
               manifest.value("format", ""), kManifestFormat);
  const size_t numel = manifest.at("numel").get<size_t>();
  const size_t sub_group = manifest.at("sub_group_numel").get<size_t>();
  STRATA_CHECK(numel == options_.numel && sub_group == options_.sub_group_numel, kBadArgument,
               "optimizer state in {} has numel {} / sub_group {}, this run expects {} / {}",
               path.string(), numel, sub_group, options_.numel, options_.sub_group_numel);
  generation_ = manifest.at("generation").get<uint64_t>();
  step_count_ = manifest.at("step").get<int64_t>();
}

void OptimizerSwapper::load_state(float* master, float* exp_avg, float* exp_avg_sq) {
  STRATA_CHECK(initialized_, kBadArgument, "optimizer swapper: load_state() before initialize()");
  for (size_t k = 0; k < sub_groups_; ++k) {
    const size_t offset = sub_group(k).offset;
    load_sub_group(k, master ? master + offset : nullptr, exp_avg ? exp_avg + offset : nullptr,
                   exp_avg_sq ? exp_avg_sq + offset : nullptr);
  }
}

void OptimizerSwapper::set_lr(float lr) {
  kernels::AdamConfig next = options_.adam;
  next.lr = lr;
  next.validate();
  options_.adam = next;
}

std::pair<size_t, size_t> OptimizerSwapper::sub_group_range(size_t k) const {
  STRATA_CHECK(k < sub_groups_, kBadArgument, "sub-group {} out of range ({} sub-groups)", k, sub_groups_);
  const Range r = sub_group(k);
  return {r.offset, r.numel};
}

void OptimizerSwapper::load_sub_group(size_t k, float* master, float* exp_avg, float* exp_avg_sq) {
  STRATA_CHECK(initialized_, kBadArgument, "optimizer swapper: load before initialize()");
  STRATA_CHECK(k < sub_groups_, kBadArgument, "sub-group {} out of range ({} sub-groups)", k, sub_groups_);
  const Range r = sub_group(k);
  if (options_.state_tier == Tier::kCpu) {
    if (master) std::copy_n(master_.data() + r.offset, r.numel, master);
    if (exp_avg) std::copy_n(exp_avg_.data() + r.offset, r.numel, exp_avg);
    if (exp_avg_sq) std::copy_n(exp_avg_sq_.data() + r.offset, r.numel, exp_avg_sq);
    return;
  }
  PinnedBuffer buffer = pool_->acquire();
  aio_->read(slot_file(static_cast<int>(generation_ % 2)), buffer.data(), record_nbytes(r.numel),
             file_offset(k));
  const float* p = buffer.as<float>();
  if (master) std::copy(p, p + r.numel, master);
  if (exp_avg) std::copy(p + r.numel, p + 2 * r.numel, exp_avg);
  if (exp_avg_sq) std::copy(p + 2 * r.numel, p + 3 * r.numel, exp_avg_sq);
}

namespace {

// Streams every record through pool buffers with as many requests in flight
// as the pool holds.
template <typename Submit>
void stream_records(PinnedBufferPool& pool, nvme::AioHandle& aio, size_t count, Submit submit) {
  std::deque<Op> inflight;
  try {
    for (size_t k = 0; k < count; ++k) {
      while (pool.available() == 0 && !inflight.empty()) {
        inflight.front().pending = false;
        aio.wait(inflight.front().ticket);
        inflight.pop_front();
      }
      Op op{pool.acquire()};
      op.ticket = submit(k, op.buffer.data());
      op.pending = true;
      inflight.push_back(std::move(op));
    }
    while (!inflight.empty()) {
      inflight.front().pending = false;
      aio.wait(inflight.front().ticket);
      inflight.pop_front();
    }
  } catch (...) {
    drain_pending(aio, inflight);
    throw;
  }
}

}  // namespace

double OptimizerSwapper::time_read_alone() {
  STRATA_CHECK(swap_ != nullptr && initialized_, kBadArgument, "time_read_alone needs initialized nvme state");
  nvme::File& file = slot_file(static_cast<int>(generation_ % 2));
  const auto start = Clock::now();
  stream_records(*pool_, *aio_, sub_groups_, [&](size_t k, void* buf) {
    return aio_->submit_read(file, buf, record_nbytes(sub_group(k).numel), file_offset(k));
  });
  return seconds_since(start);
}

double OptimizerSwapper::time_write_alone() {
  STRATA_CHECK(swap_ != nullptr && initialized_, kBadArgument, "time_write_alone needs initialized nvme state");
  // The spare slot: the next step overwrites it anyway, the commit never points at it.
  nvme::File& file = slot_file(static_cast<int>((generation_ + 1) % 2));
  const auto start = Clock::now();
  stream_records(*pool_, *aio_, sub_groups_, [&](size_t k, void* buf) {
    return aio_->submit_write(file, buf, record_nbytes(sub_group(k).numel), file_offset(k));
  });
  file.sync();  // written = durable, as a step's commit requires (a drive's write cache)
  return seconds_since(start);
}

double OptimizerSwapper::time_read_write_alone() {
  STRATA_CHECK(swap_ != nullptr && initialized_, kBadArgument, "time_read_write_alone needs initialized nvme state");
  nvme::File& in = slot_file(static_cast<int>(generation_ % 2));
  nvme::File& out = slot_file(static_cast<int>((generation_ + 1) % 2));
  const auto start = Clock::now();
  stream_records(*pool_, *aio_, 2 * sub_groups_, [&](size_t i, void* buf) {
    const size_t k = i / 2;
    const size_t nbytes = record_nbytes(sub_group(k).numel);
    return i % 2 == 0 ? aio_->submit_read(in, buf, nbytes, file_offset(k))
                      : aio_->submit_write(out, buf, nbytes, file_offset(k));
  });
  out.sync();
  return seconds_since(start);
}

}  // namespace strata::offload
