// `strata plan`'s micro-batch order: what the flag or the config asks for,
// what auto chooses, and both orders' parameter reads and step bounds
// (runtime/plan/order_plan.h) on the planned placement (plan_resolved.h).
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "runtime/cli/plan_resolved.h"
#include "runtime/plan/order_plan.h"
#include "runtime/plan/plan.h"
#include "runtime/plan/runtime_memory.h"
#include "runtime/train/micro_batch_order.h"

namespace strata::cli::plan_cli {

// The largest layer-major chunk and decoder layer (plan/order_plan.h), this
// (tp) rank's elements: from the model's tensors with --model, else a layer of
// 4·hidden² + 3·hidden·intermediate (12·hidden² without --intermediate) and
// two norms, the embedding and the head vocab·hidden; 0 when the shape is unknown.
namespace {

std::pair<int64_t, int64_t> largest_chunk_and_layer(const Resolved& r) {
  if (r.config) {
    const plan::ChunkSizes sizes = plan::largest_chunk_and_layer(*r.config, r.tensor_parallel);
    return {sizes.largest_chunk, sizes.largest_layer};
  }
  const plan::ModelShape& m = r.inputs.model;
  if (!m.shape_known()) return {0, 0};
  const int64_t h = m.hidden;
  const int64_t layer = (m.intermediate > 0 ? 4 * h * h + 3 * h * m.intermediate : 12 * h * h) + 2 * h;
  const int64_t embedding = m.vocab * h, head = m.vocab * h + h;
  return {std::max({embedding, head, layer}), layer};
}

}  // namespace

// The micro-batch order (--micro-batch-order, else the config's
// strata.micro_batch_order, else finetune's default step-major), what auto
// chooses, and both orders' parameter reads and step bounds (plan/order_plan.h)
// on the config's placement (else the recommended one). Refuses what finetune
// refuses (layer-major with what it does not do yet). Null when the model's
// shape or a placement is unknown.
nlohmann::json micro_batch_order_json(const PlanOptions& o, const std::optional<Config>& config, const Resolved& r,
                                      const plan::Plan& result) {
  const std::string what = !o.micro_batch_order.empty() ? "--micro-batch-order" : "strata.micro_batch_order";
  const std::string name = !o.micro_batch_order.empty() ? o.micro_batch_order
                           : config                     ? config->strata.micro_batch_order
                                                        : std::string("step-major");
  std::optional<plan::Placement> placement;
  if (r.inputs.configured_stage) {
    placement = plan::Placement{*r.inputs.configured_stage, *r.inputs.configured_params,
                                *r.inputs.configured_optimizer};
  } else if (result.recommended) {
    placement = result.placements[*result.recommended].placement;
  }
  const plan::Tier params = placement && placement->stage == 3 ? placement->params : plan::Tier::kGpu;
  const plan::TrainingShape& t = r.inputs.training;
  const auto [chunk, layer] = largest_chunk_and_layer(r);
  // Both orders predicted (plan/order_plan.h) where the parameters live off the device.
  std::optional<plan::OrderInputs> in;
  std::optional<plan::OrderPlan> predicted;
  if (placement && chunk > 0 && params != plan::Tier::kGpu) {
    in = plan::order_inputs(r.inputs, result.compute_seconds, chunk, layer, params, r.zero_limits.max_reuse_distance,
                            r.zero_limits.max_live);
    predicted = plan::predict_micro_batch_orders(*in);
  }
  train::MicroBatchOrderContext context{
      params == plan::Tier::kNvme  ? strata::Tier::kNvme
      : params == plan::Tier::kCpu ? strata::Tier::kCpu
                                   : strata::Tier::kDevice,
      t.grad_accumulation, r.tensor_parallel, r.pipeline.stages, r.expert_parallel, r.lora.enabled(),
      r.config && r.config->tie_word_embeddings, r.config && r.config->moe() && r.config->output_router_logits};
  context.context_parallel = r.context_parallel;
  context.predicted = predicted ? &*predicted : nullptr;
  const train::MicroBatchOrderChoice chosen = train::choose_micro_batch_order(name, what, context);
  const train::MicroBatchOrderChoice automatic = train::choose_micro_batch_order("auto", what, context);
  if (!placement || chunk == 0) return nullptr;
  nlohmann::json out = {{"given", name},
                        {"source", !o.micro_batch_order.empty() ? "--micro-batch-order"
                                   : config                     ? "strata.micro_batch_order"
                                                                : "the default"},
                        {"order", train::micro_batch_order_name(chosen.order)},
                        {"auto_chooses", train::micro_batch_order_name(automatic.order)},
                        {"auto_says", automatic.said},
                        {"placement", plan::describe(*placement)},
                        {"micro_batches", t.grad_accumulation},
                        {"largest_chunk_parameters", chunk},
                        {"largest_layer_parameters", layer}};
  if (!predicted) return out;  // nothing read off the device in either order
  const auto order_json = [](const plan::OrderPrediction& p) {
    return nlohmann::json{{"fetches_per_step", p.fetches},
                          {"param_read_bytes_per_step", p.param_read_nbytes},
                          {"io_seconds", p.io_seconds},
                          {"compute_seconds", p.compute_seconds},
                          {"step_seconds", p.step_seconds}};
  };
  out["read_bandwidth"] = in->read_bandwidth;
  out["step_major"] = order_json(predicted->step_major);
  out["layer_major"] = order_json(predicted->layer_major);
  out["whole_model_kept"] = predicted->whole_model_kept;
  out["chunks_kept"] = predicted->chunks_kept;
  out["predicted_speedup"] = predicted->speedup();
  out["why"] = predicted->describe();
  return out;
}

std::string micro_batch_order_text(const nlohmann::json& j) {
  const std::string said = j["auto_says"].get<std::string>();
  std::string out = fmt::format("Order     micro-batch order {} ({}: {}); auto would choose {}{}\n",
                                j["order"].get<std::string>(), j["source"].get<std::string>(),
                                j["given"].get<std::string>(), j["auto_chooses"].get<std::string>(),
                                said.empty() ? std::string() : " -- " + said);
  if (!j.contains("step_major")) {
    out += fmt::format("          {}: the parameters live on the device, so neither order reads them from off it\n",
                       j["placement"].get<std::string>());
    return out;
  }
  const auto order = [&](const char* name, const nlohmann::json& p) {
    return fmt::format("{} fetches every parameter {:g} time(s) per step, {:.2f} GB per rank ({:.3f} s at {:.1f} "
                       "GB/s), compute {:.3f} s: step >= {:.3f} s",
                       name, p["fetches_per_step"].get<double>(), p["param_read_bytes_per_step"].get<double>() / 1e9,
                       p["io_seconds"].get<double>(), j["read_bandwidth"].get<double>() / 1e9,
                       p["compute_seconds"].get<double>(), p["step_seconds"].get<double>());
  };
  out += fmt::format("          {}, {} micro-batches: {};\n          {} ({:.2f}x step-major's step by these "
                     "bounds)\n          {}\n",
                     j["placement"].get<std::string>(), j["micro_batches"].get<int64_t>(),
                     order("step-major", j["step_major"]), order("layer-major", j["layer_major"]),
                     j["predicted_speedup"].get<double>(), j["why"].get<std::string>());
  return out;
}

}  // namespace strata::cli::plan_cli
