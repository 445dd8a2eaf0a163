// The micro-batch order: the name checked, auto resolved, layer-major's gaps refused by name.
#include "runtime/train/micro_batch_order.h"

#include <algorithm>

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
  const std::string home = context.param_tier == Tier::kNvme ? "NVMe" : "the CPU";
  if (context.predicted == nullptr) {
    return {MicroBatchOrder::kStepMajor,
            fmt::format("{} auto: step-major (parameters on {}, {} micro-batches, but no prediction of the orders' "
                        "step times here: give layer-major to run it)",
                        what, home, context.micro_batches)};
  }
  const plan::OrderPlan& p = *context.predicted;
  if (p.layer_major.step_seconds < p.step_major.step_seconds) {
    return {MicroBatchOrder::kLayerMajor,
            fmt::format("{} auto: layer-major, predicted {:.3g} s/step against step-major's {:.3g} s (parameters on "
                        "{}, {} micro-batches: {})",
                        what, p.layer_major.step_seconds, p.step_major.step_seconds, home, context.micro_batches,
                        p.describe())};
  }
  return {MicroBatchOrder::kStepMajor,
          fmt::format("{} auto: step-major, predicted {:.3g} s/step against layer-major's {:.3g} s (parameters on "
                      "{}, {} micro-batches: {}{})",
                      what, p.step_major.step_seconds, p.layer_major.step_seconds, home, context.micro_batches,
                      p.describe(),
                      p.chunks_kept && !p.whole_model_kept ? ", but compute bounds the step" : "")};
}

std::optional<plan::OrderPlan> predict_run_orders(const nn::DecoderConfig& model, int zero_stage, Tier param_tier,
                                                  int64_t max_reuse_distance, int64_t max_live, int64_t micro_batch,
                                                  int64_t seq, int64_t micro_batches, bool activation_checkpointing,
                                                  int data_parallel, int ranks_per_node,
                                                  bool layer_major_keeps_activations) {
  if (zero_stage != 3 || param_tier == Tier::kDevice || micro_batches <= 1) return std::nullopt;
  plan::TrainingShape shape;
  shape.seq = seq;
  shape.micro_batch = micro_batch;
  shape.grad_accumulation = micro_batches;
  shape.activation_checkpointing = activation_checkpointing;
  shape.layer_major_keeps_activations = layer_major_keeps_activations;
  plan::Machine machine;
  machine.data_parallel = data_parallel;
  machine.gpus_per_node = std::max(1, ranks_per_node);
  machine.nodes = (data_parallel + machine.gpus_per_node - 1) / machine.gpus_per_node;
  return plan::predict_micro_batch_orders_for(model, shape, machine,
                                              param_tier == Tier::kNvme ? plan::Tier::kNvme : plan::Tier::kCpu,
                                              max_reuse_distance, max_live);
}

LayerActivationsChoice choose_layer_activations(std::string_view name, std::string_view what,
                                                const plan::RuntimeInputs& run, size_t budget_nbytes) {
  STRATA_CHECK(name == "recompute" || name == "keep" || name == "auto", kBadArgument,
               "{} {}: not what layer-major does with its activations; one of recompute, keep, auto", what, name);
  if (name != "auto") return {name == "keep", {}};
  plan::RuntimeInputs kept = run, recomputed = run;
  kept.layer_major.keep_activations = true;
  recomputed.layer_major.keep_activations = false;
  double keep_nbytes = 0, recompute_nbytes = 0;
  try {
    keep_nbytes = plan::runtime_memory(kept).device_nbytes;
    recompute_nbytes = plan::runtime_memory(recomputed).device_nbytes;
  } catch (const Error& e) {
    return {false, fmt::format("{} auto: recompute (strata plan's model does not describe this run, so keeping "
                               "every micro-batch's activations cannot be sized: {})",
                               what, e.message())};
  }
  const double limit = kAutoKeepBudgetShare * static_cast<double>(budget_nbytes);
  const auto gib = [](double nbytes) { return nbytes / static_cast<double>(1 << 30); };
  const bool keep = keep_nbytes <= limit;
  return {keep, fmt::format("{} auto: {} (device memory predicted {:.3f} GiB keeping every micro-batch's activations, "
                            "{:.3f} GiB recomputing them; {} {:.0f}% of the accelerator's {:.3f} GiB)",
                            what, keep ? "keep" : "recompute", gib(keep_nbytes), gib(recompute_nbytes),
                            keep ? "within" : "keeping would pass", 100 * kAutoKeepBudgetShare,
                            gib(static_cast<double>(budget_nbytes)))};
}

}  // namespace strata::train
