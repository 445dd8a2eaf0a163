// The pipeline executor (docs/DESIGN.md §5.4): runs one rank's action list of
// a schedule (schedule.h) over the stage-sized DecoderModels of its chunks,
// passing activations and gradients to its neighbours through the pipeline
// group's communicator.
//
// What runs where:
//   F(i, k)   chunk k's forward of micro-batch i in a micro-batch slot of the
//             model (DecoderModel's own arena per slot: a slot is taken at
//             the micro-batch's first action on the chunk and given back once
//             its backward — its W when split — is done and its sends have
//             left, so the slots made are the schedule's micro-batches in
//             flight); the head chunk's fused loss runs here, its statistics
//             copied aside without a host wait.
//   B(i, k)   the backward; with a split schedule (zb-h1) only the input
//             gradient: the Linear layers hand their weight gradients'
//             inputs to the slot's DeferredWeightGrads (engine::Engine::
//             WeightGradSink) instead of computing them.
//   W(i, k)   those weight gradients.
//   receives  one Communicator::exchange on the compute stream, straight into
//             the slot's boundary buffers (DecoderModel::boundary).
//   sends     each an exchange on the executor's send stream, after the
//             compute that produced it: a send waits for its receiver, never
//             the compute stream (schedule.h's simulation assumes this).
// After the last action: the send stream is drained, the shared parameters'
// gradients summed with the peer stage (Engine::sum_stage_gradients: a tied
// embedding), and the loss summed over the pipeline group (every stage reports
// the last stage's loss).
//
// Every transfer is tagged with what it carries (kind, virtual stage,
// micro-batch) and its shape, which the two sides agree on before the data
// moves (Communicator::exchange on Gloo), so a mismatch is an error naming
// the stages, never wrong data.
//
// Timeline: each F, B and W is a span "F3.1" (micro-batch 3, chunk 1) on the
// track "pipeline <stage>", each send and receive one on "pipeline <stage>
// send" / the same track, timed on the stream that runs it; StepStats has
// the busy time for the idle fraction strata-train prints.
//
// Ownership: borrows the engine, the communicator and the models (which must
// outlive it). Thread-safety: one training thread. Errors: Error(kBadArgument)
// for models that do not fit the schedule (checked at construction); errors of
// enqueued work (a transfer that fails, naming the stage) surface from run().
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "partition/communicator.h"
#include "runtime/engine/engine.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/pipeline/kept_boundaries.h"
#include "runtime/pipeline/schedule.h"
#include "runtime/pipeline/stages.h"

namespace strata::pipeline {

class DeferredWeightGrads;

// Layer-major (ScheduleSpec::local_handoff): what each chunk keeps of a
// micro-batch between its forward and its backward.
//   kRecompute  one slot per chunk, its arena reused by every micro-batch:
//               backward runs the chunk's forward again from the kept input
//               (activation checkpointing's recompute; a chunk's activations
//               for one micro-batch at a time).
//   kKeep       a slot per micro-batch (m per chunk, as a pipeline keeps one
//               per micro-batch in flight): backward finds its forward's
//               activations, nothing is recomputed; m times the activation
//               memory of step-major without checkpointing. The same kernels
//               on the same inputs either way, so the same bits.
enum class LayerActivations : uint8_t { kRecompute, kKeep };

// One micro-batch, as DecoderModel::forward takes it.
struct MicroBatch {
  std::span<const int32_t> ids, targets, positions;  // [batch * seq]; positions may be empty
  int64_t batch = 0, seq = 0;
  uint64_t dropout_seed = 0;  // its LoRA dropout masks' seed (nn::ForwardOptions::dropout_seed)
};

struct StepStats {
  // The last stage's loss over the step's micro-batches (every rank of the
  // pipeline gets it): sum of per-token losses and the count of targets.
  double loss_sum = 0, loss_count = 0;
  // This rank: the step's wall time (from run() to its last action's end),
  // and the time its compute stream spent in F, B and W (and in each).
  double step_seconds = 0, busy_seconds = 0;
  double forward_seconds = 0, backward_seconds = 0, weight_seconds = 0;
  // Each compute action's time, by its index in this rank's list (0 for the
  // others): simulate(schedule, cost) replays the step with them.
  std::vector<double> action_seconds;
  // Micro-batch slots each chunk has made so far (its peak in flight), and
  // their activation memory (DecoderModel::arena_nbytes, every chunk).
  std::vector<int> slots;
  size_t activation_nbytes = 0;
  // Layer-major's layer-boundary activations and the gradients flowing down
  // that the executor keeps per micro-batch (0 for the other schedules, whose
  // chunks keep their boundaries in their slots): part of activation_nbytes
  // in accelerator memory, pinned host memory when boundaries_pinned (with
  // boundaries on nvme: their staging buffers and the gradients).
  size_t boundary_nbytes = 0;
  bool boundaries_pinned = false;
  // Layer-major: the chunk forwards run again before a backward because the
  // chunk's slot held another micro-batch (LayerActivations::kRecompute; 0 with kKeep).
  int64_t recomputed_forwards = 0;
  // zb-h1: the Linear inputs W read where forward left them (the slot's
  // saved activations) and those it had to copy (DeferredWeightGrads).
  int64_t weight_inputs_in_place = 0, weight_inputs_copied = 0;
  double idle_fraction() const { return step_seconds > 0 ? 1.0 - busy_seconds / step_seconds : 0.0; }
};

class PipelineExecutor {
 public:
  // chunks[k] is the model of this rank's virtual stage k * p + rank
  // (stage_part), every one on `engine`; `pp` is the pipeline group's
  // communicator (its rank is this stage; size p = spec.stages).
  PipelineExecutor(engine::Engine& engine, partition::Communicator& pp, const ScheduleSpec& spec,
                   std::vector<nn::DecoderModel*> chunks);
  // A schedule of one rank whose chunks hand their boundaries over in memory
  // (ScheduleSpec::local_handoff: layer-major): no pipeline group; the loss
  // is this rank's. chunks[k] is virtual stage k. Only each micro-batch's
  // boundaries are kept (its input to every chunk, its gradient flowing
  // down); each chunk computes in one slot and runs its forward again before
  // a backward whose activations its slot no longer holds (DESIGN §5.5) —
  // or, with `activations` kKeep, keeps a slot per micro-batch and
  // recomputes nothing. The boundaries live in `home` (kept_boundaries.h;
  // `nvme` for kNvme).
  PipelineExecutor(engine::Engine& engine, const ScheduleSpec& spec, std::vector<nn::DecoderModel*> chunks,
                   BoundaryHome home = BoundaryHome::kDevice, const BoundaryNvme& nvme = {},
                   LayerActivations activations = LayerActivations::kRecompute);
  ~PipelineExecutor();
  PipelineExecutor(const PipelineExecutor&) = delete;
  PipelineExecutor& operator=(const PipelineExecutor&) = delete;

  // One training step's forwards and backwards in the schedule's order.
  // `micro_batch(i)` gives micro-batch i (called for each of its forwards;
  // its spans must stay valid until run returns); `options` are every
  // forward's (normalizer: the step's global count of targets; grad_scale).
  // Every rank of the pipeline calls it at the same point. Afterwards the
  // gradients of the step are complete (shared ones summed); step() is the
  // caller's.
  StepStats run(const std::function<MicroBatch(int)>& micro_batch, const nn::ForwardOptions& options);
  // An evaluation pass: `count` micro-batches forward only (no backward, no
  // gradient), each through every virtual stage in order, a stage's sends
  // on its send stream as in run(). Returns the last stage's loss sum and
  // count of targets, summed over the pipeline group (every rank gets them).
  // Every rank of the pipeline calls it at the same point.
  std::pair<double, double> evaluate(const std::function<MicroBatch(int)>& micro_batch, int count);

  const Schedule& schedule() const { return schedule_; }
  int stage() const { return stage_; }

 private:
  PipelineExecutor(engine::Engine& engine, partition::Communicator* pp, const ScheduleSpec& spec,
                   std::vector<nn::DecoderModel*> chunks, BoundaryHome home, const BoundaryNvme& nvme,
                   LayerActivations activations);
  struct Slot;
  struct Chunk;
  Slot& slot_of(int chunk, int micro_batch, const MicroBatch& mb);
  void release(int chunk, int micro_batch);
  // Runs `list` (this rank's actions), giving slots back after each one's last use.
  void run_list(const std::vector<Action>& list, const std::function<MicroBatch(int)>& micro_batch,
                const nn::ForwardOptions& options);
  // The loss statistics of `micro_batches` micro-batches' head forwards, summed over the pipeline group.
  std::pair<double, double> pipeline_loss(int micro_batches);
  void reserve_losses(int micro_batches);
  void receive(std::span<const Action> actions, const std::function<MicroBatch(int)>& micro_batch);
  void send(const Action& action);
  // local_handoff: copies between `chunk`'s slot and the boundaries kept for
  // `micro_batch` (KeptBoundaries): the activation (the input into the slot,
  // or the output out to the next chunk's kept input) or the gradient (the
  // output's gradient into the slot, or the input's out), on the compute
  // stream; nothing where the chunk has no such neighbour. An evaluation
  // keeps every micro-batch's in micro-batch 0's (one passes at a time).
  void hand_over(int chunk, int micro_batch, int slot, bool gradient, bool into_slot);
  // local_handoff with boundaries on nvme: tells kept_ which boundaries the
  // compute actions after list[position] restore (the next chunk's worth).
  void prefetch_boundaries(const std::vector<Action>& list, size_t position, bool training);
  void compute(const Action& action, const std::function<MicroBatch(int)>& micro_batch,
               const nn::ForwardOptions& options, size_t position);
  // The transfer's description: both sides compute the same tag and words.
  partition::P2POp transfer(const Action& action, const nn::DecoderModel::Boundary& boundary) const;
  // Times `body`'s work on `stream` as a span of `track` (and busy time when `busy`).
  // `busy`: the kind's index in busy_ns_ (0 F, 1 B, 2 W), -1 for transfers;
  // a compute's duration also goes to action_ns_[action].
  template <typename Body>
  void timed(Stream& stream, uint32_t track, std::string name, int busy, Body&& body, size_t action = 0);

  engine::Engine& engine_;
  partition::Communicator* pp_;  // null: one rank, local handoff
  Schedule schedule_;
  int stage_;
  std::vector<std::unique_ptr<Chunk>> chunks_;
  std::unique_ptr<Stream> send_stream_;
  uint32_t track_ = 0, send_track_ = 0;
  // Per micro-batch: the head's loss statistics (sum, count), pinned host memory.
  double* losses_ = nullptr;
  size_t losses_capacity_ = 0;
  // Busy nanoseconds of the step so far: F, B, W (written by the stream's host functions).
  std::shared_ptr<std::array<std::atomic<int64_t>, 3>> busy_ns_;
  std::shared_ptr<std::atomic<int64_t>> last_end_ns_;
  std::shared_ptr<std::vector<int64_t>> action_ns_;  // per action of the list being run
  // local_handoff (layer-major): each micro-batch's layer-boundary activations
  // and its gradient flowing down, kept here; each chunk computes in one slot.
  std::unique_ptr<KeptBoundaries> kept_;
  // kKeep: each micro-batch's slot is held from its forward to its backward.
  bool keep_activations_ = false;
  int64_t recomputed_forwards_ = 0;  // in the step run() is running
  std::vector<int> resident_;  // kRecompute, [chunk]: the micro-batch whose activations its slot holds; -1 none
};

// This rank's chunks of a pipeline (virtual stage k * p + pp.rank() for
// chunk k) as stage-sized models on `engine`, their layers split by
// split_layers(..., `layers`); a tied embedding held by the first and the
// last stage is shared between them (Engine::share_with_stage). Before
// engine.finalize().
std::vector<std::unique_ptr<nn::DecoderModel>> make_stage_models(engine::Engine& engine, const nn::DecoderConfig& config,
                                                                 const nn::DecoderModelOptions& options,
                                                                 const ScheduleSpec& spec, partition::Communicator& pp,
                                                                 std::span<const int64_t> layers = {});

// The layer-major chunks of a whole model on one rank (ScheduleKind::
// kLayerMajor), L + 2 of them for L decoder layers: chunk 0 is the embedding,
// chunk k + 1 decoder layer k, chunk L + 1 the final norm and lm_head with
// the loss, named and declared in the whole model's order (so its
// checkpoints are the step-major model's). Refuses
// tied embeddings by name (the last chunk's lm_head is the first chunk's
// table, used by chunks m backwards apart: the gradient's two halves would
// add in another order than step-major's). Before engine.finalize().
std::vector<std::unique_ptr<nn::DecoderModel>> make_layer_models(engine::Engine& engine, const nn::DecoderConfig& config,
                                                                 const nn::DecoderModelOptions& options);

}  // namespace strata::pipeline
