// What the order of a step's micro-batches (strata.micro_batch_order;
// docs/DESIGN.md §5.5) does to a ZeRO-3 step whose parameters live off the
// device, predicted for `strata plan`: the parameter bytes each rank reads
// per step in step-major and in layer-major order, and the step times they
// bound — from the model's sizes, the ZeRO-3 budgets
// (stage3_max_reuse_distance, stage3_max_live_parameters) and the bandwidth
// of the parameters' home.
//
// The fetch counts are the coordinator's (offload/param_coordinator.h): a
// gathered parameter is kept while its next use lies within the reuse
// distance (the elements of the windows in between) and the live budget
// holds it, else fetched again.
//   step-major  each micro-batch runs the whole model, forward then
//               backward: a parameter is fetched for its forward and again
//               for its backward (its recompute beside it, when a layer fits
//               the reuse distance), 2 m fetches per step — or once per step
//               when the whole model fits both budgets (kept gathered for
//               the step).
//   layer-major every micro-batch through a chunk (a layer; the embedding
//               and the head are chunks of their own) before the next: a
//               layer's next use is the next micro-batch's, about two
//               layers' windows away in backward (recompute and backward
//               alternate; the embedding's and the head's uses follow one
//               another at once), so with budgets of twice the largest layer
//               (and a live budget holding the largest chunk) each parameter
//               is fetched once for the m forwards and once for the m
//               backwards: 2 per step, flat in m. Below that, what
//               step-major fetches.
// Compute: every layer-major chunk but the head runs its forward again
// before its backward (activation checkpointing's recompute), so without
// checkpointing layer-major computes 4 passes where step-major computes 3 —
// unless it keeps every micro-batch's activations
// (strata.layer_major_activations keep): then 3, as step-major.
// The step's bound is the larger of compute and the reads (the coordinator
// reads ahead while compute runs), as strata-train's bound.
//
// Thread-safety: pure functions. Errors: Error(kBadArgument) naming the input
// out of range.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/nn/decoder_config.h"
#include "runtime/plan/plan.h"

namespace strata::plan {

struct OrderInputs {
  int64_t param_count = 0;           // the model's parameters (ψ), > 0
  int64_t largest_chunk_params = 0;  // the largest layer-major chunk: a layer, the embedding or the head; > 0
  int64_t largest_layer_params = 0;  // the largest decoder layer; > 0
  double shard_nbytes = 0;           // this rank's share of one fetch of every parameter (ψ x bytes / N_d), > 0
  int64_t micro_batches = 1;         // gradient_accumulation_steps, >= 1
  bool activation_checkpointing = true;
  // strata.layer_major_activations keep: layer-major runs no recompute of its own.
  bool layer_major_keeps_activations = false;
  int64_t max_reuse_distance = 1'000'000'000;  // stage3_max_reuse_distance (elements)
  int64_t max_live = 1'000'000'000;            // stage3_max_live_parameters (elements)
  double read_bandwidth = 0;         // bytes/s this rank reads its parameters at from their home, > 0
  double step_major_compute_seconds = 0;  // the step's compute in step-major, >= 0
};

struct OrderPrediction {
  double fetches = 0;            // of every parameter, per step
  double param_read_nbytes = 0;  // per rank and step: fetches x shard_nbytes
  double io_seconds = 0;         // param_read_nbytes / read_bandwidth
  double compute_seconds = 0;
  double step_seconds = 0;       // max(compute, io)
};

struct OrderPlan {
  OrderPrediction step_major, layer_major;
  // Whether the budgets keep the whole model gathered through the step (then
  // the orders read the same), and layer-major's chunks through their uses.
  bool whole_model_kept = false, chunks_kept = false;
  double speedup() const { return layer_major.step_seconds > 0 ? step_major.step_seconds / layer_major.step_seconds : 0; }
  double read_ratio() const {
    return layer_major.param_read_nbytes > 0 ? step_major.param_read_nbytes / layer_major.param_read_nbytes : 0;
  }
  // One line: what layer-major saves (or why it saves nothing) with these budgets.
  std::string describe() const;
};

OrderPlan predict_micro_batch_orders(const OrderInputs& in);

// The prediction's inputs for a plan's model, training and machine
// (`inputs`; model.param_count is this rank's), the step's compute that
// make_plan predicts for them, the largest layer-major chunk and decoder
// layer (largest_chunk_and_layer), the tier the parameters live on (not
// kGpu) and the ZeRO-3 budgets: this rank's share of a fetch of every
// 16-bit parameter, read from NVMe (the node's bandwidth shared by its
// GPUs) or from CPU memory (the GPU<->CPU bandwidth). One mapping for
// `strata plan` and for `strata finetune`'s auto.
OrderInputs order_inputs(const PlanInputs& inputs, double step_major_compute_seconds, int64_t largest_chunk_params,
                         int64_t largest_layer_params, Tier params, int64_t max_reuse_distance, int64_t max_live);

// The largest layer-major chunk and decoder layer of `model`, a
// tensor-parallel rank's elements (decoder_rank_params): each decoder layer,
// the embedding, the head (the final norm and lm_head, the embedding again
// when tied).
struct ChunkSizes {
  int64_t largest_chunk = 0, largest_layer = 0;
};
ChunkSizes largest_chunk_and_layer(const nn::DecoderConfig& model, int tensor_parallel = 1);

// A run's model, training and machine (`hardware`: strata plan's default
// figures, with the run's ranks) as strata plan sees them: its shape
// (decoder_model_shape), and both orders predicted with `params` the
// parameters' home and the ZeRO-3 budgets. What strata finetune's
// micro_batch_order auto asks, so that `strata plan` with the same
// configuration (--model, --config, --seq, --dp and --gpus the ranks) prints
// the same choice.
OrderPlan predict_micro_batch_orders_for(const nn::DecoderConfig& model, const TrainingShape& training,
                                         const Machine& hardware, Tier params, int64_t max_reuse_distance,
                                         int64_t max_live);

}  // namespace strata::plan
