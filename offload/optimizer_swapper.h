// The optimizer step over this rank's shard (DESIGN.md §3 Step): walks the
// shard in sub-groups of sub_group_numel. With optimizer state on NVMe it is a
// pipeline — read k+1 ‖ update k ‖ write k-1 — through pinned-pool buffers, so
// never more is in flight than the pool holds; with state in CPU memory it is
// the same walk without I/O.
//
// Crash safety (NVMe): the state lives in two slots (files); a step reads the
// committed slot and writes the other, then commits by atomically replacing a
// small manifest. A failed step leaves the committed slot untouched, loadable
// by a new swapper with resume = true. A new swapper without resume keeps an
// earlier run's committed state intact until its initialize() commits. If the
// directory fsync after a manifest rename fails, the swapper refuses further
// writes (the committed generation on disk is unknown); resume from disk.
//
// A step may also be taken in parts, so the optimizer can overlap backward:
// begin_step, update_sub_groups as each sub-group's gradient becomes final,
// then commit_step — or abort_step, which leaves the state exactly as before
// begin_step (NVMe: the committed slot is never written by an open step; cpu:
// a revocable step saves each sub-group's state before updating it).
//
// Thread-safety: not thread-safe; one thread at a time drives a swapper (an
// open step may pass between threads when the caller orders the hand-over). Ownership: the
// pool and the I/O handle belong to the caller and must outlive the swapper.
// Errors: Error(kBadArgument) for inconsistent options or inputs; Error(kIo)
// from any failed read, write or manifest update (step() then leaves the
// committed state as it was); Error(kOutOfMemory) when the pool is too small.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kernels/optimizer.h"
#include "nvme/aio_handle.h"
#include "nvme/swap_space.h"
#include "offload/pinned_pool.h"
#include "core/tensor.h"

namespace strata::offload {

struct OptimizerSwapperOptions {
  size_t numel = 0;                          // elements of this rank's shard
  size_t sub_group_numel = 1000000000;       // DeepSpeed's sub_group_size
  Tier state_tier = Tier::kCpu;              // kCpu or kNvme
  kernels::AdamConfig adam;
  std::optional<kernels::CpuIsa> isa;        // nullopt: kernels::default_isa()
  int threads = 0;                           // optimizer threads; 0: OpenMP default
  // NVMe only: swap space <nvme_path>/<group>/rank<rank>/.
  std::filesystem::path nvme_path;
  std::string group = "optimizer";
  int rank = 0;
  bool resume = false;      // open the committed state already on disk instead of initialize()
  bool keep_files = false;  // leave the swap files on disk at destruction (checkpoint)
};

// What one step() took, for the bench and the trace.
struct StepTimings {
  double total_seconds = 0;
  double update_seconds = 0;      // inside the Adam kernel
  double read_wait_seconds = 0;   // blocked waiting for reads
  double write_wait_seconds = 0;  // blocked waiting for writes (incl. the final drain)
  double commit_seconds = 0;      // fdatasync + manifest
  size_t sub_groups = 0;
  uint64_t bytes_read = 0, bytes_written = 0;
};

// The gradient and the new parameter values of one step: whole-shard arrays,
// or streamed sub-group by sub-group through callbacks (so neither the
// gradient nor the parameters of a shard need to be in memory at once).
struct StepInputs {
  const void* grad = nullptr;       // [numel] of grad_dtype (this rank's shard)
  DType grad_dtype = DType::kF32;
  float grad_scale = 1.0f;          // kernels::combined_grad_scale (unscale + clip)
  void* param16 = nullptr;          // [numel] of param16_dtype, or nullptr
  DType param16_dtype = DType::kBF16;
  // Instead of `grad`: returns the gradient of elements [first, first + numel)
  // (one sub-group, in order), valid until the next call or the end of step().
  std::function<const void*(size_t first, size_t numel)> grad_source;
  // Instead of `param16`: called right after sub-group [first, first + numel)
  // is updated with its new parameter values — the 16-bit copy in
  // param16_dtype, or the fp32 master weights themselves when param16_dtype is
  // kF32 — valid only during the call. A sink that throws fails the step; with
  // state on NVMe the committed state stays as it was (the step never commits),
  // in CPU memory the sub-groups already updated keep their new state.
  std::function<void(size_t first, size_t numel, const void* values)> param_sink;
  // Optional, with grad_source (NVMe state, fp32 gradient): starts reading the
  // gradient of [first, first + numel) into dst (pinned, O_DIRECT-aligned,
  // numel floats) and returns the completion: it waits for the read and
  // returns dst holding exactly what grad_source would give (its side effects
  // included). The pipeline then reads each sub-group's gradient beside its
  // state, into the same pool buffer (when the buffers have room:
  // buffer_nbytes(numel, true)), instead of the update waiting for it behind
  // the reads queued ahead. A completion is called at most once; one not
  // called (an error path) is still called, its result ignored, before its
  // buffer returns to the pool.
  using GradCompletion = std::function<const void*()>;
  std::function<GradCompletion(size_t first, size_t numel, float* dst)> grad_read;
  // Optional, with param_sink (NVMe state): starts writing the new values
  // of [first, first + numel) — `values`, in a pool buffer (O_DIRECT-aligned,
  // held until the write ends): the master weights for kF32, else the 16-bit
  // copy behind the record (pool buffers of buffer_nbytes(numel, true)) —
  // where param_sink would put them, and calls done(error) exactly once, on
  // any thread, when the write has ended (error nullptr on success; quick, no
  // throw) — or throws without calling it when the write cannot start. The pipeline then goes on while it runs; the updated hook is
  // called from `done` on success, and a failed write fails the step like a
  // failed state write. Where no pool buffer holds the values (cpu state, a
  // 16-bit copy without the room), param_sink is used.
  using WriteDone = std::function<void(std::exception_ptr error)>;
  std::function<void(size_t first, size_t numel, const void* values, WriteDone done)> param_write;
};

class OptimizerSwapper {
 public:
  // pool and aio are required for Tier::kNvme (pool buffers of at least
  // record_nbytes(sub_group_numel), two or more of them; three give full overlap).
  OptimizerSwapper(OptimizerSwapperOptions options, PinnedBufferPool* pool, nvme::AioHandle* aio);
  ~OptimizerSwapper();
  OptimizerSwapper(const OptimizerSwapper&) = delete;
  OptimizerSwapper& operator=(const OptimizerSwapper&) = delete;

  // Bytes one sub-group of `numel` elements takes on disk and in a pool buffer
  // (fp32 master, exp_avg, exp_avg_sq; rounded up for O_DIRECT).
  static size_t record_nbytes(size_t numel);
  // Bytes of a pool buffer for sub-groups of `numel` elements: the record,
  // and with `with_grad` room after it for the sub-group's fp32 gradient
  // (StepInputs::grad_read).
  static size_t buffer_nbytes(size_t numel, bool with_grad);

  // Sets the master weights to master[numel], moments to zero, step count to 0,
  // and commits that state.
  void initialize(const float* master);
  // Same, with the master weights produced sub-group by sub-group by
  // fill(first, numel, out) — no full fp32 copy of the shard in memory.
  using FillFn = std::function<void(size_t first, size_t numel, float* out)>;
  void initialize(const FillFn& fill);
  // Sets the whole state — master weights and both moments, produced
  // sub-group by sub-group by fill(first, numel, master, exp_avg, exp_avg_sq)
  // — and the step count, and commits it (a checkpoint being loaded).
  using StateFillFn =
      std::function<void(size_t first, size_t numel, float* master, float* exp_avg, float* exp_avg_sq)>;
  void restore(const StateFillFn& fill, int64_t step_count);
  // One Adam/AdamW step (step count + 1) over the whole shard: begin_step,
  // every sub-group in order, commit_step.
  void step(const StepInputs& inputs);

  // ---- one step in parts --------------------------------------------------------
  // Opens step step_count() + 1 with `inputs` (copied; what its callbacks and
  // pointers refer to must stay valid until the step closes) and the current
  // learning rate. `revocable` (cpu state): save each sub-group's state before
  // its update, 12 bytes per element, so abort_step can restore it (NVMe state
  // is always revocable and saves nothing). Error(kBadArgument) when a step is
  // already open or before initialize().
  void begin_step(const StepInputs& inputs, bool revocable);
  // Updates the listed sub-groups of the open step (each once per step; any
  // order, any batching), pipelined as step() is. Returns once their new
  // values are delivered (param16, param_sink, or param_write ended); with
  // state on NVMe their state writes may still be in flight, holding their
  // buffers — a later call, commit_step or abort_step waits for them, so a
  // failed state write may fail one of those instead. Error(kBadArgument) for
  // a sub-group out of range or already updated. On an error the step stays
  // open (with the sub-groups updated so far): abort_step it.
  void update_sub_groups(std::span<const size_t> sub_groups);
  // Reads sub-group k's committed state (NVMe) into a free pool buffer now,
  // ahead of its update in the open step, so that update_sub_groups finds it
  // there instead of reading it (the state does not depend on the gradient,
  // so it can be read before the global norm is known). Never blocks: false
  // when no pool buffer is free, when k is updated or already read ahead, and
  // for cpu state (nothing to read). The buffer is held until k's update (or
  // abort_step), so a caller holding buffers for sub-groups it does not pass
  // to update_sub_groups can starve that call's pipeline: update the
  // read-ahead sub-groups first, or leave `keep_free` buffers in the pool
  // (false when no more than that are free; two keep a pipeline going).
  // Error(kBadArgument) without an open step.
  bool prefetch(size_t k, size_t keep_free = 0);
  // Reads sub-group k's gradient (the open step's StepInputs::grad_read, its
  // side effects included) into the buffer k's state was read ahead into,
  // waits for it and returns it: k's update then uses it instead of reading
  // it again. The gradient must be final (it is read once). nullptr when k
  // is not read ahead, its buffer has no room for a gradient, or the inputs
  // have no grad_read; the same pointer when called again.
  // Error(kBadArgument) without an open step; Error(kIo) from the read.
  const float* read_grad_ahead(size_t k);
  // Waits for the open step's state writes still in flight (see
  // update_sub_groups) and returns their buffers to the pool — which another
  // swapper sharing it may be waiting for; rethrows a failed write's error
  // (the step stays open: abort_step it). No-op without an open step.
  void finish_writes();
  // Forgets the gradients read_grad_ahead read (more gradient was added
  // since: another backward); the updates read them again.
  void drop_grads_read_ahead();
  // Sub-groups read ahead and not yet updated in the open step.
  std::vector<size_t> prefetched() const;
  bool prefetched(size_t k) const;
  // Replaces the open step's inputs (grad_scale included) and takes the
  // current learning rate, while none of its sub-groups is updated: a step
  // opened to read ahead before its gradient scale was known.
  // Error(kBadArgument) when no step is open or a sub-group is updated.
  void set_step_inputs(const StepInputs& inputs);
  // Closes the open step once every sub-group is updated: NVMe: the state
  // writes still in flight, fdatasync and the manifest commit; the step count
  // advances. Error(kBadArgument) while a sub-group is not updated; Error(kIo)
  // from a state write or the commit (the step is then closed, the committed
  // state the old one).
  void commit_step();
  // Closes the open step without applying it: NVMe: the committed slot is as
  // it was; cpu: a revocable step's updated sub-groups get their saved state
  // back (a step that was not revocable keeps its updated sub-groups' new
  // state: Error(kBadArgument), the state is then mixed). No-op when no step
  // is open. The parameter values given to param_sink are not undone: the
  // caller rewrites them from load_sub_group.
  void abort_step();
  bool step_open() const { return open_ != nullptr; }
  // Sub-group k was updated by the open step.
  bool updated(size_t k) const;
  // Called by whoever drives update_sub_groups right after sub-group k's
  // update, once its new values are in StepInputs::param16 or param_sink
  // returned — or, with param_write, from its `done` (on an I/O thread) once
  // the write has ended (the overlap with the next forward releases k's
  // parameters then). Empty: none. Not called for a sub-group whose update
  // or write failed.
  void set_updated_hook(std::function<void(size_t k)> hook) { updated_hook_ = std::move(hook); }
  // The learning rate of later steps (a schedule's value); Error(kBadArgument)
  // when negative or not finite.
  void set_lr(float lr);
  // Copies the committed state out (any argument may be nullptr).
  void load_state(float* master, float* exp_avg, float* exp_avg_sq);
  // Same for sub-group k only: sub_group_range(k).numel elements each. While
  // a step is open: NVMe gives the committed (pre-step) state, cpu the current.
  void load_sub_group(size_t k, float* master, float* exp_avg, float* exp_avg_sq);
  // First element and length of sub-group k.
  std::pair<size_t, size_t> sub_group_range(size_t k) const;

  int64_t step_count() const { return step_count_; }
  size_t numel() const { return options_.numel; }
  size_t sub_group_count() const { return sub_groups_; }
  const StepTimings& last_timings() const { return timings_; }

  // For the bench's lower bound (NVMe only): seconds to read every record of
  // the committed slot, and to write every record of the spare slot and
  // fdatasync it (durable, as step() must be before its commit), each alone,
  // with the same pool and handle. Does not change the committed state.
  double time_read_alone();
  double time_write_alone();
  // Both at once (reads of the committed slot interleaved with writes of the
  // spare one, as a step issues them, then fdatasync) but no update: the
  // device's I/O floor for a step when reads and writes share its bandwidth.
  double time_read_write_alone();

 private:
  struct Range {
    size_t offset, numel;
  };
  Range sub_group(size_t k) const;
  uint64_t file_offset(size_t k) const { return static_cast<uint64_t>(k) * stride_nbytes_; }
  nvme::File& slot_file(int slot);
  // grad: the sub-group's gradient already read (grad_read), or nullptr: from grad_source / grad.
  // deliver: hand the new values to param16 / param_sink and call the
  // updated hook (else the caller does: an asynchronous param_write).
  void update(const kernels::AdamCoefficients& c, const StepInputs& in, size_t k, float* p,
              float* m, float* v, const void* grad = nullptr, bool deliver = true);
  // The room behind the record in a pool buffer (buffer_nbytes(numel, true)), or nullptr.
  float* spare_area(void* buffer) const;
  // Where a pool buffer holds the sub-group's gradient, when the open step reads it there (else nullptr).
  float* grad_area(void* buffer) const;
  void update_nvme(std::span<const size_t> sub_groups);
  struct OpenStep;
  // Waits out the open step's reads ahead and state writes still in flight
  // and returns their buffers.
  void release_buffers(OpenStep& open);
  void write_state(const StateFillFn& fill, int64_t step_count);
  void commit(uint64_t generation, int64_t step_count);
  // Throws Error(kIo) once a commit's durability became unknown.
  void check_writable() const;
  void read_manifest();
  std::filesystem::path manifest_path() const;

  OptimizerSwapperOptions options_;
  PinnedBufferPool* pool_;
  nvme::AioHandle* aio_;
  size_t sub_groups_ = 0;
  size_t stride_nbytes_ = 0;  // record_nbytes(sub_group_numel): file offset between records
  int64_t step_count_ = 0;
  bool initialized_ = false;
  StepTimings timings_;
  std::unique_ptr<OpenStep> open_;  // the step begun and not yet committed or aborted
  std::function<void(size_t k)> updated_hook_;  // set_updated_hook

  // kCpu state.
  std::vector<float> master_, exp_avg_, exp_avg_sq_;
  std::vector<uint16_t> sink_scratch_;  // the 16-bit copy of one sub-group (param_sink)
  // kNvme state: slot (generation % 2) is committed.
  std::unique_ptr<nvme::SwapSpace> swap_;
  uint64_t generation_ = 0;
  bool commit_uncertain_ = false;  // a manifest rename may not be durable (directory fsync failed)
};

}  // namespace strata::offload
