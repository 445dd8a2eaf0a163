// The order of a step's micro-batches (strata.micro_batch_order,
// --micro-batch-order; docs/DESIGN.md §5.5): step-major runs each
// micro-batch's forward and backward through the whole model in turn;
// layer-major runs every micro-batch through decoder layer l before layer
// l + 1 and the backwards layer by layer from the top (the schedule
// pipeline::layer_major, run by the pipeline executor on one rank), so each
// layer's parameters are used by m forwards and m backwards in a row. Both
// give the same parameters after each step, bit for bit.
//
// Thread-safety: pure functions. Errors: Error(kBadArgument) naming the flag
// or key and what layer-major does not do yet, or a name that is not a choice.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/tensor.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/plan/order_plan.h"
#include "runtime/plan/runtime_memory.h"

namespace strata::train {

enum class MicroBatchOrder : uint8_t { kStepMajor, kLayerMajor };

// What decides the order, in the run's terms.
struct MicroBatchOrderContext {
  Tier param_tier = Tier::kDevice;  // where the parameters live between uses
  int64_t micro_batches = 1;        // gradient_accumulation_steps
  int tensor_parallel = 1, pipeline_parallel = 1, expert_parallel = 1;
  bool lora = false;
  bool tied_embeddings = false;     // tie_word_embeddings
  bool router_aux_loss = false;     // a mixture of experts' load-balancing loss (output_router_logits)
  int context_parallel = 1;         // callers that list the fields above by position leave it 1
  // Both orders' step times predicted for this run (plan::predict_micro_batch_orders_for);
  // null: none, and auto stays step-major.
  const plan::OrderPlan* predicted = nullptr;
};

struct MicroBatchOrderChoice {
  MicroBatchOrder order = MicroBatchOrder::kStepMajor;
  // For auto: the line to log once, saying what it chose and why; empty otherwise.
  std::string said;
};

// `name` ("step-major", "layer-major" or "auto") as `what` gives it (the
// flag or the config key, for errors). layer-major with what it does not do
// yet (tensor, pipeline, expert or context parallelism, LoRA, tied embeddings, the
// load-balancing loss) is refused naming it; auto chooses layer-major where
// the parameters live off the device, there is more than one micro-batch,
// it can run, and context.predicted gives it a shorter step than
// step-major's (the first three are necessary, not sufficient: budgets that
// keep the whole model gathered, or a step its compute bounds, gain
// nothing); step-major otherwise. Either way it says why, once.
MicroBatchOrderChoice choose_micro_batch_order(std::string_view name, std::string_view what,
                                               const MicroBatchOrderContext& context);

std::string_view micro_batch_order_name(MicroBatchOrder order);

// strata.layer_major_activations for a layer-major run.
struct LayerActivationsChoice {
  bool keep = false;
  // For auto: the line to log once, saying what it chose and why; empty otherwise.
  std::string said;
};

// Of the accelerator's memory budget, the share the device memory predicted
// with every micro-batch's activations kept may take for auto to keep them:
// the rest is for what the prediction leaves out (op scratch, an allocator's
// cache and fragmentation).
inline constexpr double kAutoKeepBudgetShare = 0.75;

// `name` ("recompute", "keep" or "auto") as `what` gives it (for errors).
// auto keeps where strata plan's runtime model of this run (`run`, its
// layer_major set; keep_activations ignored) predicts device memory with the
// activations kept of at most kAutoKeepBudgetShare x `budget_nbytes` (the
// accelerator's, Accelerator::memory_stats().capacity_nbytes), and recomputes
// otherwise or where the model does not describe the run; either way it says
// why, with both predictions. Every rank must run the same choice (recompute
// gathers parameters again): the caller agrees on it across ranks.
LayerActivationsChoice choose_layer_activations(std::string_view name, std::string_view what,
                                                const plan::RuntimeInputs& run, size_t budget_nbytes);

// Both orders predicted for a run of `model` (plan::predict_micro_batch_orders_for):
// `micro_batches` of micro_batch x seq tokens per rank, ZeRO-3 with the
// parameters on `param_tier` and the budgets `max_reuse_distance` and
// `max_live` (stage3_max_reuse_distance, stage3_max_live_parameters), on
// strata plan's default machine figures with `data_parallel` ranks,
// `ranks_per_node` of them sharing a node's NVMe. Nothing where auto needs
// no prediction: a stage below 3, the parameters on the device, one micro-batch.
// `layer_major_keeps_activations`: strata.layer_major_activations keep (no recompute).
std::optional<plan::OrderPlan> predict_run_orders(const nn::DecoderConfig& model, int zero_stage, Tier param_tier,
                                                  int64_t max_reuse_distance, int64_t max_live, int64_t micro_batch,
                                                  int64_t seq, int64_t micro_batches, bool activation_checkpointing,
                                                  int data_parallel, int ranks_per_node,
                                                  bool layer_major_keeps_activations = false);

}  // namespace strata::train
