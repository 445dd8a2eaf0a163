// ParamCoordinator: ZeRO stage 3's parameter coordinator (docs/DESIGN.md
// §5.1). Each rank keeps only its slice of every parameter, at home on one
// tier (ParamHome); before an operator runs, the coordinator makes the full
// parameters it reads exist in accelerator memory — gathered from every
// rank's slice — and after it runs, releases them unless they are used again
// soon. It moves the same bytes earlier when it can (prefetch); it never
// changes a result.
//
//   trace: the first step records its (operator, phase) windows
//          (OperatorTrace); later steps follow the trace while each pre_op
//          matches the next entry. A window that differs (or a step that ends
//          early) drops the trace with one log line; the rest of that step
//          fetches on demand and the next step records afresh.
//   gg:    while following, pre_op issues the allgathers of upcoming
//          operators' parameters, in trace order, as long as the elements
//          gathered ahead of the current op stay within prefetch_bucket_numel
//          and everything gathered (the current op's included) within
//          max_live_parameters_numel (kept copies are released first when the
//          current op needs the room).
//   nc:    a home the accelerator cannot read (nvme) is read into pinned
//          staging (ParamHome::read_async), many reads in flight, bounded by
//          param_buffer_count buffers of one slice each; each read completes a
//          HostEvent the gather stream waits on. Beyond gg's reach nc reads
//          ahead, in trace order, into buffers free now; a gather that finds
//          none queues its read for one thread, which submits it once the
//          gather stream is past the buffer's last reader. No thread blocks per
//          read, and the host blocks only when every buffer holds a read no
//          gather used (the trace changed) — counted in PrefetchStats.
//   cg:    an accelerator that cannot read host memory gets the pinned slice
//          copied to device memory on the gather stream right before its
//          allgather (the cpu accelerator's allgather reads it in place).
//   release: a parameter is released after post_op with a stream-ordered
//          free — except parameters of at most persistence_threshold_numel
//          elements, which stay gathered until the homes change, and
//          parameters the trace says are used again within
//          max_reuse_distance_numel elements. The host, which never waits for
//          compute in forward, blocks before a gather only while the copies
//          compute may still read would push it past max_live_parameters.
//   update: after a step whose update overlaps the next forward
//          (set_home_updates), a range of a home is final only once the
//          optimizer's event for it completes: a staged read of it is
//          submitted by the read queue after that event (without blocking
//          the host), a gather reading the home in place waits on it on the
//          gather stream, and a failed update fails the gather like a failed
//          read. The windows whose gathers waited on an update have their
//          stall counted as update_stall_seconds too.
// Allgathers are collectives: every decision that issues one depends only on
// the trace, the budgets and what is gathered — the same on every rank. Reads
// are local and may run as far ahead as staging allows.
//
// Ownership: borrows the accelerator, both streams, the communicator and the
// homes, which must outlive it; owns the gathered copies, the staging buffers
// and the read-queue thread. Destroy it only after synchronizing the compute
// and gather streams (the destructor waits for reads in flight).
// Thread-safety: one training thread drives it.
// Errors: collectives fail with Error(kCommunication), a failed read fails its
// HostEvent, so the error reaches the gather and compute streams and surfaces
// from the step's next synchronize on this rank (its peers' pending
// allgathers fail within the communicator's timeout); Error(kBadArgument) at
// construction when a slice is larger than offload_param.buffer_size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/accelerator.h"
#include "offload/hook_ids.h"
#include "offload/layer_fetch.h"
#include "offload/operator_trace.h"
#include "offload/param_home.h"
#include "partition/communicator.h"

namespace strata::offload {

// Where compute waited for one operator's parameters in one step: the
// compute stream's time from reaching the op's pre_op waits to passing them,
// summed over the op's windows of one phase.
struct OpStall {
  OpId op = -1;
  Phase phase = Phase::kForward;
  std::string name;      // the operator's name
  int32_t layer = -1;    // its CoordinatedOp::layer
  int64_t windows = 0;   // windows of (op, phase) whose wait was timed
  double seconds = 0;    // compute-stream time spent at those waits
};

struct StallLog;  // written by the compute stream; param_stall.cc

// What the coordinator did in one step (from one end_step to the next). A
// fetch is a parameter an operator needs at pre_op that was not still
// gathered from an earlier use: it was prefetched (complete or still in flight
// at pre_op) or gathered on demand there.
struct PrefetchStats {
  bool trace_followed = false;   // the step matched a recorded trace to its end
  bool trace_dropped = false;    // the step diverged from the trace (logged once)
  int64_t windows = 0;           // pre_op calls
  int64_t skipped_windows = 0;   // skip_op calls (windows that ran no kernels)
  int64_t prefetched_ready = 0;  // fetches whose allgather had completed at pre_op
  int64_t prefetched_in_flight = 0;  // fetches issued ahead, still running at pre_op
  int64_t on_demand = 0;         // fetches issued at their op's pre_op
  int64_t reused = 0;            // uses served by a copy kept gathered (reuse distance,
                                 // persistence, an enclosing window)
  int64_t gathers = 0;           // allgathers issued (prefetch and on demand)
  uint64_t gather_nbytes = 0;    // bytes of full parameters those allgathers produce (this rank)
  int64_t reads = 0;             // home->pinned reads issued (nvme)
  int64_t reads_ahead = 0;       // of them, issued by nc's walk before a gather needed them
  int64_t reads_deferred = 0;    // of them, queued for a buffer the gather stream still reads
  uint64_t read_nbytes = 0;      // bytes of parameter slices those reads move (this rank)
  int64_t reads_after_update = 0;  // of them, submitted only after the optimizer's update of their range
  int64_t gathers_after_update = 0;  // gathers ordered after the optimizer's update of their slice
  int64_t blocked_waits = 0;     // times pre_op blocked the host (every staging buffer held
                                 // by a read no gather used: after a trace change)
  double blocked_seconds = 0;    // host time pre_op spent blocked
  size_t peak_gathered_nbytes = 0;  // most bytes of full parameters gathered at once

  int64_t fetches() const { return prefetched_ready + prefetched_in_flight + on_demand; }
  int64_t prefetched() const { return prefetched_ready + prefetched_in_flight; }

  // Stall on parameters: how long the compute stream sat at pre_op's waits
  // for gathered parameters. Timed on the stream itself, by host functions
  // enqueued right before and right after the waits (cpu: on the stream's
  // thread; cuda: when the stream reaches them), so it means the same on
  // every backend: time compute could not run because a parameter was not
  // there. Only windows with a gather not yet complete at pre_op are timed
  // (the others cannot stall, and cost no host function).
  // The stream writes these figures after pre_op returns, into a log this
  // struct's copies share: they are final once the compute stream has passed
  // the step's last timed wait — after a synchronize of it, and after the
  // engine's step() of a step whose last window produced gradients (which
  // waits for every gradient bucket, each of which waits for compute). Work
  // the stream skips after an error is not timed. Thread-safe.
  double param_stall_seconds() const;
  // Of it, the windows with a gather ordered after the optimizer's update of
  // its slice (set_home_updates): time compute waited for the optimizer.
  double update_stall_seconds() const;
  int64_t stalled_windows() const;          // windows timed
  std::vector<OpStall> op_stalls() const;   // per (op, phase) timed, most seconds first
  std::shared_ptr<StallLog> stall_log;      // null: nothing timed (yet)

  // The step by decoder layer (layer_fetch.h), indexed by layer + 1 (index 0:
  // operators outside every layer): the counts above split by layer —
  // windows, skipped_windows, gathers, gather_nbytes, reads and read_nbytes
  // add up to this struct's — and each layer's stall from stall_log (final
  // when param_stall_seconds() is). Empty before the step's first window.
  std::vector<LayerFetch> per_layer() const;
  std::vector<LayerFetch> layer_counts;  // the host-counted part of per_layer()
};

// Budgets, in elements; the engine's defaults are DeepSpeed's.
struct CoordinatorOptions {
  int64_t prefetch_bucket_numel = 50'000'000;         // stage3_prefetch_bucket_size; 0: no prefetch
  int64_t max_live_parameters_numel = 1'000'000'000;  // stage3_max_live_parameters
  int64_t max_reuse_distance_numel = 1'000'000'000;   // stage3_max_reuse_distance
  int64_t persistence_threshold_numel = 100'000;      // stage3_param_persistence_threshold
  // nc staging per home: buffer_count buffers holding one slice each —
  // clamped to the home's parameter count; each as large as its largest
  // slice, which must be at most buffer_numel elements.
  size_t param_buffer_count = 5;                      // offload_param.buffer_count
  int64_t param_buffer_numel = 100'000'000;           // offload_param.buffer_size
};

// The optimizer is still writing a home's new values (its update overlapping
// the next forward): elements [k * stride_numel, (k + 1) * stride_numel) are
// final once ready[k] completes (failed: the update failed).
struct HomeUpdate {
  const ParamHome* home = nullptr;
  size_t stride_numel = 0;
  std::vector<std::shared_ptr<HostEvent>> ready;
};

// One parameter as the coordinator sees it.
struct CoordinatedParam {
  // Its group's home (gives the dtype); null: this rank does not hold the
  // parameter (an expert another ep member owns), and no operator it runs lists it.
  ParamHome* home = nullptr;
  size_t slice_numel = 0;        // this rank's slice; every rank's is as long (padding included)
  size_t home_offset_numel = 0;  // where the slice starts in the home
  int64_t numel = 0;             // the parameter's own elements (the persistence threshold)
  // The ranks it is partitioned over (an expert's: its expert-dp group);
  // null: the coordinator's gather communicator. Used on the gather stream.
  partition::Communicator* comm = nullptr;
  // The home holds the parameter in another form than compute reads it (a
  // frozen FP8 weight, its e4m3 bytes): the allgather fills a scratch buffer
  // of the stored elements, then expand(stored, full, gather stream)
  // enqueues the writing of the whole parameter (expanded_nbytes) from it on
  // that stream. Empty: the gathered elements are the parameter.
  std::function<void(const void* stored, void* full, Stream& stream)> expand = nullptr;
  size_t expanded_nbytes = 0;
};

// One operator: the parameters its kernels read, in order.
struct CoordinatedOp {
  std::string name;
  std::vector<ParamId> params;
  int32_t layer = -1;  // the decoder layer it belongs to, for per-layer accounting only (-1: none)
};

class ParamCoordinator {
 public:
  ParamCoordinator(Accelerator& accelerator, Stream& compute, Stream& gather, partition::Communicator& gather_comm,
                   CoordinatorOptions options, std::vector<CoordinatedParam> params, std::vector<CoordinatedOp> ops);
  ~ParamCoordinator();
  ParamCoordinator(const ParamCoordinator&) = delete;
  ParamCoordinator& operator=(const ParamCoordinator&) = delete;

  // Every parameter of `op` is gathered (now, or earlier) when this returns,
  // and work enqueued on the compute stream afterwards runs after the gathers
  // (the stream waits on their events; the wait is timed when one is pending).
  // Windows may nest or overlap and close in any order; an operator is open
  // at most once.
  void pre_op(OpId op, Phase phase);
  // The op's kernels are enqueued; releases or keeps its parameters.
  void post_op(OpId op, Phase phase);
  // A window of `op` that runs no kernels this time (an expert no rank routed
  // a token to): an entry of the trace like any window, but nothing is
  // fetched; a copy gathered ahead for it is kept for its next use within
  // max_reuse_distance, else released. Every rank must skip the same windows.
  void skip_op(OpId op, Phase phase);
  // ops[i]'s windows of this micro-batch (from its next one to the forward
  // one after it) will be skipped when skipped[i] (OperatorTrace::plan_skip):
  // prefetch follows the plan instead of the last step's, from here on (a
  // walk starts now). Every rank must plan alike.
  void plan_skip(std::span<const OpId> ops, std::span<const uint8_t> skipped);
  // The gathered parameter (world x slice elements of its dtype, accelerator
  // memory): valid between pre_op and post_op of an op that lists it.
  void* full(ParamId id) const;

  // The step boundary: the trace closes (or is dropped for ending early), and
  // no read is left in flight or staged (the homes are about to change).
  void end_step();
  // Windows opened while paused are not part of a training step (an
  // evaluation forward between steps): they are neither recorded nor matched
  // against the trace, nothing is prefetched for them, and their parameters
  // are released after use; the trace of the training step is kept.
  void set_trace_paused(bool paused) { trace_paused_ = paused; }
  bool trace_paused() const { return trace_paused_; }
  // Waits until nothing queued or staged reads the homes (the host is about to).
  void quiesce();
  // From now on, gathers of the ranges `updates` name are ordered after
  // their events (see "update" above); replaces the previous set (empty:
  // every home is final). Set after release_all(), cleared once every event
  // completed.
  void set_home_updates(std::vector<HomeUpdate> updates) { home_updates_ = std::move(updates); }
  // The homes changed: every gathered copy is stale and released once compute
  // passes what it has queued. release(id): parameter id's only.
  void release_all();
  void release(ParamId id);
  bool gathered(ParamId id) const;

  // Bytes of full parameters gathered now and at most since construction.
  size_t gathered_nbytes() const { return gathered_nbytes_; }
  size_t peak_gathered_nbytes() const { return peak_gathered_nbytes_; }
  int64_t gathers_issued() const { return gathers_issued_; }
  PrefetchStats last_step() const { return last_; }
  PrefetchStats current_step() const { return current_; }
  int64_t trace_drops() const { return trace_.drops(); }

 private:
  struct Gathered;
  struct Staging;
  class ReadQueue;

  void fetch(ParamId id);
  void issue_gather(ParamId id, bool prefetch);
  // nc: read id's slice into a staging buffer. ahead: only into a free one
  // (false when none is); else for a gather being issued (deferred to the
  // read queue when every buffer still has a reader queued).
  bool stage_read(ParamId id, bool ahead);
  void prefetch_from(size_t position);
  // After op's window at trace entry `position` (npos: unknown): each of its
  // gathered parameters is kept for its next use or released.
  void keep_or_release(OpId op, size_t position);
  // max_live: release kept copies the current op needs the room of.
  void make_room(OpId op);
  // Releases kept copies whose next use is after trace entry `after` (and,
  // with prefetched_too, unused prefetched copies) until `need` more fit.
  void release_kept(size_t after, int64_t need, bool prefetched_too);
  // The one log line of a drop; `got` is the window that diverged (nullopt:
  // the step ended early). Releases what was fetched for the lost future.
  void on_trace_dropped(const OperatorTrace::Advance& what, std::optional<OperatorTrace::Entry> got);
  void release_all_unused();
  void drain_staging();
  // `after`: where compute's last use of the copy is; a copy compute never
  // used (prefetched) is freed after its own gather instead.
  void release_gathered(ParamId id, Event& after);
  void wait_for_room(int64_t need);
  int64_t gathered_numel(ParamId id) const;
  size_t gathered_bytes(ParamId id) const;  // of its gathered copy (expanded_nbytes for an expanded one)
  partition::Communicator& comm_of(ParamId id) const;  // CoordinatedParam::comm or comm_
  bool persistent(ParamId id) const;
  bool in_use(ParamId id) const { return open_uses_[static_cast<size_t>(id)] > 0; }
  Staging* staging_of(ParamId id);
  // The optimizer's events for id's slice (set_home_updates); empty when its home is final.
  std::vector<std::shared_ptr<Event>> update_events(ParamId id) const;

  Accelerator& accelerator_;
  Stream& compute_;
  Stream& gather_;
  partition::Communicator& comm_;
  CoordinatorOptions options_;
  std::vector<CoordinatedParam> params_;
  std::vector<CoordinatedOp> ops_;
  OperatorTrace trace_;
  LayerTally layers_;                                // which layer each op and parameter counts for
  std::vector<std::unique_ptr<Gathered>> gathered_;  // per parameter
  std::vector<int32_t> open_uses_;                   // per parameter: open windows listing it
  std::vector<std::unique_ptr<Staging>> staging_;    // per home the accelerator cannot read
  std::vector<int> staging_of_;                      // per parameter: index in staging_, -1: none
  std::unique_ptr<Event> compute_point_;
  size_t gathered_nbytes_ = 0, peak_gathered_nbytes_ = 0;
  int64_t gathers_issued_ = 0;
  int64_t live_numel_ = 0;  // elements gathered now (max_live_parameters)
  // Copies released at a post_op that compute may still read until it passes `after`.
  struct Releasing {
    std::shared_ptr<Event> after;
    int64_t numel = 0;
  };
  std::deque<Releasing> releasing_;
  int64_t releasing_numel_ = 0;
  struct OpenWindow {
    OpId op;
    size_t position;  // its trace entry, or npos
  };
  std::vector<OpenWindow> window_position_;  // per open window, in opening order
  std::vector<uint32_t> visited_;        // per parameter: walk generation (prefetch_from)
  uint32_t walk_ = 0;
  int64_t step_boundaries_ = 0;          // end_step calls (for messages)
  bool trace_paused_ = false;
  uint64_t consumed_seq_ = 0;            // staging readers recorded on the gather stream so far
  std::vector<HomeUpdate> home_updates_;  // set_home_updates
  std::unique_ptr<ReadQueue> read_queue_;  // with staging; destroyed first
  PrefetchStats current_, last_;
};

}  // namespace strata::offload
