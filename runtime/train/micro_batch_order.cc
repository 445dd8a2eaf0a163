// The micro-batch order: the name checked, auto resolved, layer-major's gaps refused by name.
#include "runtime/train/micro_batch_order.h"

#include "core/error.h"

namespace strata::train {

namespace {

// What keeps layer-major from running `context`, in the user's terms; empty: nothing.
std::string layer_major_gap(const MicroBatchOrderContext& c) {
  if (c.tensor_parallel > 1) return fmt::format("tensor parallelism (--tp {})", c.tensor_parallel);
  if (c.pipeline_parallel > 1) return fmt::format("pipeline parallelism (--pp {})", c.pipeline_parallel);
  if (c.expert_parallel > 1) return fmt::format("expert parallelism (moe.expert_parallel_size {})", c.expert_parallel);
  if (c.context_parallel > 1) return fmt::format("context parallelism (--cp {})", c.context_parallel);
  if (c.lora) return "LoRA (--lora-rank)";
  if (c.tied_embeddings) return "tied embeddings (tie_word_embeddings true in config.json)";
  if (c.router_aux_loss) return "the load-balancing loss (output_router_logits true in config.json)";
  return {};
}

}  // namespace

std::string_view micro_batch_order_name(MicroBatchOrder order) {
  return order == MicroBatchOrder::kLayerMajor ? "layer-major" : "step-major";
}

MicroBatchOrderChoice choose_micro_batch_order(std::string_view name, std::string_view what,
                                               const MicroBatchOrderContext& context) {
  STRATA_CHECK(name == "step-major" || name == "layer-major" || name == "auto", kBadArgument,
               "{} {}: not a micro-batch order; one of step-major, layer-major, auto", what, name);
  const std::string gap = layer_major_gap(context);
  if (name == "step-major") return {};
  if (name == "layer-major") {
    STRATA_CHECK(gap.empty(), kBadArgument, "{} layer-major with {}: not implemented yet; use step-major", what, gap);
    return {MicroBatchOrder::kLayerMajor, {}};
  }
  const bool off_device = context.param_tier != Tier::kDevice;
  if (!off_device || context.micro_batches <= 1) {
    return {MicroBatchOrder::kStepMajor,
            fmt::format("{} auto: step-major ({})", what,
                        !off_device ? "the parameters live on the device: layer-major would save no parameter reads"
                                    : "one micro-batch per step: the orders are the same")};
  }
  if (!gap.empty()) {
    return {MicroBatchOrder::kStepMajor,
            fmt::format("{} auto: step-major (layer-major would read each layer's parameters once per step instead of "
                        "{} times, but it does not run with {} yet)",
                        what, context.micro_batches, gap)};
  }
  return {MicroBatchOrder::kLayerMajor,
          fmt::format("{} auto: layer-major (parameters on {}, {} micro-batches: each layer's parameters fetched for "
                      "{} forwards in a row and {} backwards in a row)",
                      what, context.param_tier == Tier::kNvme ? "NVMe" : "the CPU", context.micro_batches,
                      context.micro_batches, context.micro_batches)};
}

}  // namespace strata::train
