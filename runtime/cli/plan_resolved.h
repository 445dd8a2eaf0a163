// `strata plan`'s inputs once resolved from flags, the ds_config and this
// machine (`Resolved`, filled by plan_cmd.cc's resolvers in turn), and what
// the other planning files add to them:
//   plan_parallelism.cc     expert, tensor, pipeline and context parallelism
//                           as strata finetune reads and refuses them, and
//                           what each adds to the report (a JSON object);
//   plan_micro_batch_order.cc  the micro-batch order and both orders' predictions.
// A new dimension's flags resolve in plan_parallelism.cc and are called from
// run_plan (plan_cmd.cc) in their place in the order below. Internal to
// runtime/cli; errors are Error(kBadArgument) naming the flag or key.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "runtime/cli/plan_cli.h"
#include "runtime/config/config.h"
#include "runtime/engine/zero_sizes.h"
#include "runtime/nn/context_attention.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/nn/lora.h"
#include "runtime/pipeline/schedule.h"
#include "runtime/plan/plan.h"

namespace strata::cli::plan_cli {

// Inputs for the plan, and a line of provenance per value for the header.
struct Resolved {
  plan::PlanInputs inputs;
  std::map<std::string, std::string> sources;
  std::string model_source;
  std::optional<nn::DecoderConfig> config;  // with --model
  std::vector<std::string> hints;  // what flag would make the plan more exact
  nn::LoraSpec lora;               // --lora-rank, --lora-targets
  // sub_group_size and reduce_bucket_size: the config's (0: left out, or no
  // --config), then as the engine would use them (resolve_zero_sizes).
  int64_t sub_group_given = 0, reduce_bucket_given = 0;
  engine::ZeroSizes zero_sizes;
  // stage3_max_live_parameters and stage3_max_reuse_distance (DeepSpeed's defaults without --config).
  struct {
    int64_t max_live = 1'000'000'000, max_reuse_distance = 1'000'000'000;
  } zero_limits;
  // moe.expert_parallel_size as strata finetune would choose it (needs
  // --model with experts; 1 otherwise), and what it changes per rank.
  int expert_parallel = 1;
  // Tensor parallelism (--tp or tensor_parallel.autotp_size; 1: none): the
  // whole model's parameter count (inputs.model.param_count is then one rank's)
  // and the ranks (tp x data-parallel).
  int tensor_parallel = 1;
  int64_t whole_param_count = 0, ranks = 0;
  // Pipeline parallelism (--pp or pipeline_parallel.size; stages 1: none):
  // the schedule, and per stage (pp rank) its layers and parameters (a tp
  // rank's with tensor parallelism); inputs.model.param_count is then the
  // largest stage's.
  pipeline::ScheduleSpec pipeline{.stages = 1};  // 1: no pipeline (ScheduleSpec's own default is 2)
  std::vector<int64_t> stage_layers, stage_params;
  std::vector<std::vector<int64_t>> stage_chunk_layers;  // per stage, its chunks' layer counts
  // Context parallelism (--cp or context_parallel.size; 1: none) and its method.
  int context_parallel = 1;
  nn::ContextMethod context_method = nn::ContextMethod::kRing;
};

// ---- plan_parallelism.cc: each called by run_plan after resolve_machine, in
// this order (tensor, pipeline, context; expert after the ZeRO sizes) --------

// A parallel size as strata finetune reads it: the flag (when given) over
// the config's key; both given and different is refused, naming both.
int size_over_config(const char* flag, const std::string& given, int from_config, const std::string& config_path,
                     const char* key);

void resolve_tensor_parallel(const PlanOptions& o, const std::optional<Config>& config, Resolved& r);
void resolve_pipeline_parallel(const PlanOptions& o, const std::optional<Config>& config, Resolved& r);
void resolve_context_parallel(const PlanOptions& o, const std::optional<Config>& config, Resolved& r);
void resolve_expert_parallel(const PlanOptions& o, const std::optional<Config>& config, Resolved& r);

// What expert parallelism changes per rank, per micro-step (16-bit activations,
// as the rest of the plan): the experts each rank runs, the rows they may
// receive, and the all-to-all's bytes (rows out and back, forward and backward).
struct ExpertParallelShape {
  int64_t experts_per_rank = 0, max_rows = 0;
  double max_expert_activation_nbytes = 0;  // per layer: gate, up, act + received rows
  double exchange_nbytes = 0;               // per micro-step, all layers, sent by one rank
};
ExpertParallelShape expert_parallel_shape(const Resolved& r);

// What one rank sends in its cp group per layer and per micro-step (the
// formulas at context_exchange in plan_parallelism.cc).
struct ContextExchange {
  double forward = 0, backward = 0;  // per layer
  double per_micro_step = 0;
};
ContextExchange context_exchange(const Resolved& r);

// The --json report's object for each dimension in use.
nlohmann::json expert_parallel_json(const Resolved& r);
nlohmann::json tensor_parallel_json(const Resolved& r, const plan::Plan& plan);
nlohmann::json pipeline_parallel_json(const Resolved& r);
nlohmann::json context_parallel_json(const Resolved& r);

// ---- plan_micro_batch_order.cc ----------------------------------------------

// The micro-batch order (--micro-batch-order, else the config's
// strata.micro_batch_order, else finetune's default step-major), what auto
// chooses, and both orders' parameter reads and step bounds (plan/order_plan.h)
// on the config's placement (else the recommended one). Refuses what finetune
// refuses (layer-major with what it does not do yet). Null when the model's
// shape or a placement is unknown.
nlohmann::json micro_batch_order_json(const PlanOptions& o, const std::optional<Config>& config, const Resolved& r,
                                      const plan::Plan& result);
// The text report's lines for that object.
std::string micro_batch_order_text(const nlohmann::json& j);

}  // namespace strata::cli::plan_cli
