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
// or key and what layer-major does not do yet.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/tensor.h"

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
  int context_parallel = 1;         // last: callers that list the fields above by position leave it 1
};

struct MicroBatchOrderChoice {
  MicroBatchOrder order = MicroBatchOrder::kStepMajor;
  // For auto: the line to log once, saying what it chose and why; empty otherwise.
  std::string said;
};

// `name` ("step-major", "layer-major" or "auto") as `what` gives it (the
// flag or the config key, for errors). layer-major with what it does not do
// yet (tensor, pipeline, expert or context parallelism, LoRA, tied embeddings, the
// load-balancing loss) is refused naming it; auto chooses layer-major when
// the parameters live off the device and there is more than one
// micro-batch, and it can run; step-major otherwise.
MicroBatchOrderChoice choose_micro_batch_order(std::string_view name, std::string_view what,
                                               const MicroBatchOrderContext& context);

std::string_view micro_batch_order_name(MicroBatchOrder order);

}  // namespace strata::train
