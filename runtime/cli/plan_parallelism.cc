// `strata plan`'s parallel dimensions -- expert, tensor, pipeline and context
// parallelism -- read from flags and the ds_config as strata finetune reads
// them, refused where finetune refuses them, and what each adds per rank to
// the report (plan_resolved.h).
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/cli/plan_resolved.h"
#include "runtime/nn/context_attention.h"
#include "runtime/nn/context_support.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/pipeline/schedule.h"
#include "runtime/pipeline/stages.h"
#include "runtime/plan/plan.h"
#include "runtime/plan/runtime_memory.h"
#include "runtime/train/zero_config.h"

namespace strata::cli::plan_cli {

// Expert parallelism with a mixture of experts from --model: the size
// finetune would use (the config's, or the data-parallel world when it
// divides the experts), refused as finetune refuses it.
void resolve_expert_parallel(const PlanOptions& o, const std::optional<Config>& config, Resolved& r) {
  if (!r.config || !r.config->moe()) return;
  const Config given = config ? *config : Config{};
  r.expert_parallel = train::choose_expert_parallel_size(given, *r.config,
                                                         static_cast<int>(r.inputs.machine.data_parallel),
                                                         config ? o.config : std::string("strata plan"));
}

ExpertParallelShape expert_parallel_shape(const Resolved& r) {
  const nn::DecoderConfig& c = *r.config;
  const plan::TrainingShape& t = r.inputs.training;
  const int64_t n = r.expert_parallel, rows = t.micro_batch * t.seq * c.num_experts_per_tok;
  ExpertParallelShape s;
  s.experts_per_rank = c.num_experts / n;
  s.max_rows = n * rows;
  s.max_expert_activation_nbytes =
      2.0 * static_cast<double>(s.max_rows) * static_cast<double>(3 * c.moe_intermediate_size + c.hidden_size);
  // Each of the 4 exchanges a layer makes (rows out, outputs back, and their
  // gradients) sends the share of the rows other members hold: (n-1)/n on average.
  s.exchange_nbytes = 4.0 * static_cast<double>(c.num_hidden_layers) * static_cast<double>(rows) *
                      static_cast<double>(c.hidden_size) * 2.0 * static_cast<double>(n - 1) / static_cast<double>(n);
  return s;
}
nlohmann::json expert_parallel_json(const Resolved& r) {
  const ExpertParallelShape s = expert_parallel_shape(r);
  return {{"size", r.expert_parallel},
          {"experts_per_rank", s.experts_per_rank},
          {"max_rows_per_rank", s.max_rows},
          {"max_expert_activation_bytes_per_layer", s.max_expert_activation_nbytes},
          {"exchange_bytes_per_micro_step", s.exchange_nbytes}};
}

// A parallel size as strata finetune reads it: the flag (when given) over
// the config's key; both given and different is refused, naming both.
int size_over_config(const char* flag, const std::string& given, int from_config, const std::string& config_path,
                     const char* key) {
  const int size = !given.empty() ? static_cast<int>(parse_integer(flag, given, 1)) : from_config;
  if (!given.empty() && from_config > 1 && from_config != size) {
    raise(ErrorCategory::kBadArgument, "{} {} and {}'s {} {} disagree: give one", flag, size, config_path, key,
          from_config);
  }
  return size;
}

// Tensor parallelism as strata finetune reads it (--tp over the config's
// tensor_parallel.autotp_size, either sequence-parallel switch) and refuses
// it: the model must split (--model), no LoRA. N_d is then the ranks / tp
// (or --dp, with tp x --dp ranks), and the plan's model states are tp rank
// 0's: its shards and the replicated tensors (plan::decoder_rank_params).
void resolve_tensor_parallel(const PlanOptions& o, const std::optional<Config>& config, Resolved& r) {
  const int tp = size_over_config("--tp", o.tp, config ? config->tensor_parallel_size : 1, o.config,
                                  "tensor_parallel.autotp_size");
  const bool sp = o.sequence_parallel || (config && config->sequence_parallel);
  const char* sp_name = o.sequence_parallel ? "--sequence-parallel" : "sequence_parallel";
  plan::Machine& hw = r.inputs.machine;
  r.ranks = hw.data_parallel;
  if (tp == 1) {
    STRATA_CHECK(!sp, kBadArgument, "{} needs tensor parallelism (--tp or tensor_parallel.autotp_size of 2 or more)",
                 sp_name);
    return;
  }
  STRATA_CHECK(r.config.has_value(), kBadArgument,
               "--tp {}: which tensors split depends on the architecture: give --model (its config.json)", tp);
  STRATA_CHECK(!r.lora.enabled(), kBadArgument, "--tp with --lora-rank: strata does not implement LoRA with tensor "
               "parallelism yet");
  nn::tensor_parallel_share(*r.config, tp);  // refuses what does not split, naming the sizes
  plan::TrainingShape& t = r.inputs.training;
  STRATA_CHECK(!sp || t.micro_batch * t.seq % tp == 0, kBadArgument,
               "{}: the micro-batch's {} x {} tokens do not divide over the {} tensor-parallel ranks", sp_name,
               t.micro_batch, t.seq, tp);
  if (r.sources["data_parallel"] == "--dp") {
    r.ranks = hw.data_parallel * tp;
    STRATA_CHECK(r.ranks <= hw.gpus_per_node * hw.nodes, kBadArgument,
                 "--dp {} x --tp {} = {} ranks, more than the {} GPUs of {} node(s) x {} GPUs (--nodes, --gpus)",
                 hw.data_parallel, tp, r.ranks, hw.gpus_per_node * hw.nodes, hw.nodes, hw.gpus_per_node);
  } else {
    STRATA_CHECK(hw.data_parallel % tp == 0, kBadArgument, "--tp {} does not divide the {} GPUs ({})", tp,
                 hw.data_parallel, r.sources["data_parallel"]);
    hw.data_parallel /= tp;
    r.sources["data_parallel"] += fmt::format(" / tp {}", tp);
  }
  r.tensor_parallel = tp;
  r.whole_param_count = r.inputs.model.param_count;
  int64_t per_rank = 0;
  for (const plan::RankParam& p : plan::decoder_rank_params(*r.config, DType::kBF16, tp)) {
    per_rank += shape_numel(p.spec.shape);
  }
  r.inputs.model.param_count = per_rank;
  r.inputs.model.active_param_count = 0;  // dense: every parameter active
  r.inputs.model.input_embedding_count = 0;  // per rank: the whole model's is in the text
  t.tensor_parallel = tp;
  t.sequence_parallel = sp;
}

// Pipeline parallelism as strata finetune reads it (--pp over the config's
// pipeline_parallel.size, the schedule and virtual stages likewise, the
// micro-batches the gradient accumulation steps); needs --model (the split
// is of its layers). N_d is then the ranks / (pp x tp), and the plan's model
// states are the largest stage's.
void resolve_pipeline_parallel(const PlanOptions& o, const std::optional<Config>& config, Resolved& r) {
  const int pp = size_over_config("--pp", o.pp, config ? config->pipeline_parallel_size : 1, o.config,
                                  "pipeline_parallel.size");
  if (pp == 1) {
    STRATA_CHECK(o.pp_schedule.empty() && o.virtual_stages.empty(), kBadArgument,
                 "--pp-schedule and --virtual-stages shape a pipeline: give --pp (or pipeline_parallel.size)");
    return;
  }
  STRATA_CHECK(r.config.has_value(), kBadArgument,
               "--pp {}: the stages split the model's layers: give --model (its config.json)", pp);
  const std::string name = !o.pp_schedule.empty() ? o.pp_schedule : config ? config->pipeline_schedule : "1f1b";
  const auto kind = pipeline::parse_schedule(name);
  STRATA_CHECK(kind.has_value(), kBadArgument, "--pp-schedule {}: not a pipeline schedule; one of {}", name,
               pipeline::schedule_names());
  const int v = !o.virtual_stages.empty() ? static_cast<int>(parse_integer("--virtual-stages", o.virtual_stages, 1))
                : config                  ? config->virtual_stages
                                          : 1;
  plan::TrainingShape& t = r.inputs.training;
  r.pipeline = {*kind, pp, static_cast<int>(t.grad_accumulation), v};
  r.pipeline.check();
  const nn::DecoderConfig& c = *r.config;
  const std::vector<int64_t> split =
      pipeline::split_layers(c.num_hidden_layers, pp, v, config ? config->pipeline_layers : std::vector<int64_t>{});
  // Each tensor of a (tp) rank to the stage holding it, by its name.
  std::vector<int> stage_of_layer;
  for (size_t s = 0; s < split.size(); ++s) {
    for (int64_t l = 0; l < split[s]; ++l) stage_of_layer.push_back(static_cast<int>(s % static_cast<size_t>(pp)));
  }
  r.stage_layers.assign(static_cast<size_t>(pp), 0);
  r.stage_chunk_layers.assign(static_cast<size_t>(pp), {});
  for (size_t s = 0; s < split.size(); ++s) {
    r.stage_layers[s % static_cast<size_t>(pp)] += split[s];
    r.stage_chunk_layers[s % static_cast<size_t>(pp)].push_back(split[s]);
  }
  r.stage_params.assign(static_cast<size_t>(pp), 0);
  for (const plan::RankParam& p : plan::decoder_rank_params(c, DType::kBF16, r.tensor_parallel)) {
    const std::string& n = p.spec.name;
    const int64_t numel = shape_numel(p.spec.shape);
    if (n.rfind("model.layers.", 0) == 0) {
      const int64_t layer = std::stoll(n.substr(13, n.find('.', 13) - 13));
      r.stage_params[static_cast<size_t>(stage_of_layer[static_cast<size_t>(layer)])] += numel;
    } else if (n.rfind("model.embed_tokens.", 0) == 0) {
      r.stage_params.front() += numel;
      if (c.tie_word_embeddings) r.stage_params.back() += numel;  // the last stage's lm_head
    } else {
      r.stage_params.back() += numel;  // the final norm and lm_head
    }
  }
  plan::Machine& hw = r.inputs.machine;
  if (r.sources["data_parallel"] == "--dp") {
    r.ranks = (r.ranks > 0 ? r.ranks : hw.data_parallel) * pp;
  } else {
    STRATA_CHECK(hw.data_parallel % pp == 0, kBadArgument, "--pp {} does not divide the {} data-parallel ranks ({})",
                 pp, hw.data_parallel, r.sources["data_parallel"]);
    hw.data_parallel /= pp;
    r.sources["data_parallel"] += fmt::format(" / pp {}", pp);
    r.ranks = (r.ranks > 0 ? r.ranks : hw.data_parallel * pp);
  }
  if (r.whole_param_count == 0) r.whole_param_count = r.inputs.model.param_count;
  r.inputs.model.param_count = *std::max_element(r.stage_params.begin(), r.stage_params.end());
  r.inputs.model.active_param_count = 0;
  r.inputs.model.input_embedding_count = 0;  // per stage: the whole model's is in the text
}

// Per stage: its activation memory (strata's arena per micro-batch for its
// layers, times the micro-batches the schedule keeps in flight on it), the
// bytes it sends per step point to point, and how a ZeRO-3 stage gathers.
nlohmann::json pipeline_parallel_json(const Resolved& r) {
  const nn::DecoderConfig& c = *r.config;
  const plan::TrainingShape& t = r.inputs.training;
  const pipeline::ScheduleSpec& spec = r.pipeline;
  const int p = spec.stages;
  const int64_t rows = t.micro_batch * t.seq / (t.sequence_parallel ? r.tensor_parallel : 1);
  // One boundary transfer: [rows, hidden] in 16 bits.
  const double transfer = static_cast<double>(rows * c.hidden_size) * 2.0;
  const auto& limits = r.zero_limits;
  nlohmann::json stages = nlohmann::json::array();
  for (int s = 0; s < p; ++s) {
    size_t arena = 0;
    for (int64_t layers : r.stage_chunk_layers[static_cast<size_t>(s)]) {
      nn::DecoderConfig part = c;
      part.num_hidden_layers = layers;
      arena += plan::decoder_arena_nbytes(part, DType::kBF16, t.micro_batch, t.seq, t.activation_checkpointing,
                                          t.checkpoints_on_cpu, {}, 1, r.tensor_parallel, t.sequence_parallel);
    }
    // Per chunk arena above; in flight counts micro-batch chunks.
    const int in_flight = pipeline::promised_in_flight(spec, s);
    const double per_chunk = static_cast<double>(arena) / static_cast<double>(spec.virtual_stages);
    // Sends per step: each chunk's output forward (not the last virtual
    // stage's) and input gradient back (not the first's), per micro-batch.
    int boundaries = 0;
    for (int k = 0; k < spec.virtual_stages; ++k) {
      const int vs = k * p + s;
      boundaries += (vs + 1 < p * spec.virtual_stages) + (vs > 0);
    }
    const int64_t params = r.stage_params[static_cast<size_t>(s)];
    // ZeRO-3: a stage's parameter comes back to use after the stage's other
    // parameters (the next micro-batch): kept gathered while they fit the
    // reuse distance and the live budget, else gathered for every use (a
    // forward and a backward per micro-batch; a recompute too with checkpoints).
    const bool kept = params <= limits.max_reuse_distance && params <= limits.max_live;
    const int uses = spec.micro_batches * (t.activation_checkpointing ? 3 : 2);
    stages.push_back({{"stage", s},
                      {"layers", r.stage_layers[static_cast<size_t>(s)]},
                      {"parameters", params},
                      {"micro_batches_in_flight", in_flight},
                      {"activation_bytes", per_chunk * in_flight},
                      {"p2p_bytes_sent_per_step", transfer * boundaries * spec.micro_batches},
                      {"zero3_parameters_kept_for_the_step", kept},
                      {"zero3_gathers_per_parameter_per_step", kept ? 1 : uses}});
  }
  return {{"size", p},
          {"schedule", pipeline::schedule_name(spec.kind)},
          {"virtual_stages", spec.virtual_stages},
          {"micro_batches", spec.micro_batches},
          {"bubble", pipeline::bubble_formula(spec)},
          {"ranks", r.ranks},
          {"whole_parameters", r.whole_param_count},
          {"stages", stages}};
}

// Context parallelism as strata finetune reads it (--cp over the config's
// context_parallel.size, --cp-method over its method) and refuses it: the
// dense GQA families from --model, not with pipeline stages or LoRA, seq
// divisible by 2 x cp, Ulysses's heads (a tp rank's) divisible by cp. ZeRO
// partitions over dp x cp (finetune's), so N_d stays the data-parallel
// ranks it was; each of them holds seq / cp tokens of every sequence.
void resolve_context_parallel(const PlanOptions& o, const std::optional<Config>& config, Resolved& r) {
  const int cp = size_over_config("--cp", o.cp, config ? config->context_parallel_size : 1, o.config,
                                  "context_parallel.size");
  if (cp == 1) {
    STRATA_CHECK(o.cp_method.empty(), kBadArgument, "--cp-method goes with --cp (or context_parallel.size) of 2 or more");
    return;
  }
  r.context_method = !o.cp_method.empty() ? nn::parse_context_method(o.cp_method, "--cp-method")
                     : config ? nn::parse_context_method(config->context_parallel_method,
                                                         o.config + ": context_parallel.method")
                              : nn::ContextMethod::kRing;
  STRATA_CHECK(r.config.has_value(), kBadArgument,
               "--cp {}: what the ring or Ulysses moves depends on the attention's heads: give --model (its "
               "config.json)",
               cp);
  const nn::DecoderConfig& c = *r.config;
  nn::refuse_unsupported_with_context_parallel(
      fmt::format("--cp {}", cp), nn::context_parallel_uses(c, r.lora.enabled(), r.pipeline.stages));
  STRATA_CHECK(r.pipeline.stages == 1, kBadArgument,
               "--cp {} with pipeline parallelism (--pp {}): strata finetune trains it, but strata plan does not model "
               "it yet",
               cp, r.pipeline.stages);
  plan::TrainingShape& t = r.inputs.training;
  STRATA_CHECK(t.seq % (2 * cp) == 0, kBadArgument,
               "--seq {} does not divide by 2 x --cp {} = {}: context parallelism cuts every sequence into two chunks "
               "per rank",
               t.seq, cp, 2 * cp);
  nn::check_context_parallel(c.num_attention_heads, c.num_key_value_heads, cp, r.context_method, r.tensor_parallel);
  plan::Machine& hw = r.inputs.machine;
  STRATA_CHECK(hw.data_parallel % cp == 0, kBadArgument,
               "--cp {} does not divide the {} data-parallel ranks ({}): ZeRO partitions over dp x cp", cp,
               hw.data_parallel, r.sources["data_parallel"]);
  STRATA_CHECK(!t.sequence_parallel || t.micro_batch * (t.seq / cp) % r.tensor_parallel == 0, kBadArgument,
               "sequence parallelism: a cp rank's {} x {} tokens do not divide over the {} tensor-parallel ranks",
               t.micro_batch, t.seq / cp, r.tensor_parallel);
  r.context_parallel = cp;
  r.sources["data_parallel"] += fmt::format(" (dp {} x cp {})", hw.data_parallel / cp, cp);
  t.context_parallel = cp;
}

// What one rank sends in its cp group, 16-bit activations as the rest of the
// plan: ring attention's hops of its kv heads' keys and values, 2·(s/cp)·b·
// h_kv bytes-per-element each, cp − 1 per layer forward ((cp−1)/cp · 2·s·b·h_kv)
// and 2cp − 1 backward (the keys and values again, and the dk/dv
// accumulators one hop behind them, the last hop home: about twice); Ulysses'
// all-to-alls, each sending (cp−1)/cp of a rank's share: forward q, k, v and
// out (about 4·s·b·h/cp), lse (fp32), backward q, k, v, out, dout, lse and dq,
// dk, dv. The recompute of a checkpointed layer passes forward again.
// RingAttention's and UlyssesAttention's bytes_sent() count the same
// (tests/cp/ring_attention_test.cc).
ContextExchange context_exchange(const Resolved& r) {
  const nn::DecoderConfig share = nn::tensor_parallel_share(*r.config, r.tensor_parallel);
  const plan::TrainingShape& t = r.inputs.training;
  const double cp = r.context_parallel, e = 2, d = static_cast<double>(r.config->head_dim);
  const double tokens = static_cast<double>(t.micro_batch) * static_cast<double>(t.seq) / cp;  // a rank's
  const double h = static_cast<double>(share.num_attention_heads) * d;
  const double h_kv = static_cast<double>(share.num_key_value_heads) * d;
  ContextExchange x;
  if (r.context_method == nn::ContextMethod::kRing) {
    const double hop = 2 * tokens * h_kv * e;
    x.forward = (cp - 1) * hop;
    x.backward = (2 * cp - 1) * hop;
  } else {
    const double share_sent = (cp - 1) / cp * tokens;
    const double lse = static_cast<double>(share.num_attention_heads) * 4;
    x.forward = share_sent * ((2 * h + 2 * h_kv) * e + lse);
    x.backward = share_sent * ((4 * h + 4 * h_kv) * e + lse);
  }
  const double layers = static_cast<double>(r.config->num_hidden_layers);
  const double recomputed = t.activation_checkpointing ? layers - 1 : 0;  // the top layer is not recomputed
  x.per_micro_step = layers * (x.forward + x.backward) + recomputed * x.forward;
  return x;
}

nlohmann::json context_parallel_json(const Resolved& r) {
  const nn::DecoderConfig& c = *r.config;
  const plan::TrainingShape& t = r.inputs.training;
  const int cp = r.context_parallel, tp = r.tensor_parallel;
  const nn::DecoderConfig share = nn::tensor_parallel_share(c, tp);
  const auto arena = [&](int n) {
    return plan::decoder_arena_nbytes(c, DType::kBF16, t.micro_batch, t.seq, t.activation_checkpointing,
                                      t.checkpoints_on_cpu, {}, 1, tp, t.sequence_parallel, n);
  };
  const ContextExchange x = context_exchange(r);
  return {{"size", cp},
          {"method", std::string(nn::context_method_name(r.context_method))},
          {"data_parallel", r.inputs.machine.data_parallel / cp},
          {"tokens_per_rank", t.micro_batch * t.seq / cp},
          {"activation_arena_bytes_per_rank", arena(cp)},
          {"activation_arena_bytes_at_cp_1", arena(1)},
          {"attention_buffer_bytes_per_rank",
           nn::context_buffer_nbytes(r.context_method, cp, t.micro_batch, t.seq, share.num_attention_heads,
                                     share.num_key_value_heads, c.head_dim, DType::kBF16)},
          {"bytes_per_layer_forward", x.forward},
          {"bytes_per_layer_backward", x.backward},
          {"bytes_per_micro_step", x.per_micro_step}};
}

nlohmann::json tensor_parallel_json(const Resolved& r, const plan::Plan& plan) {
  const plan::TrainingShape& t = r.inputs.training;
  const nn::DecoderConfig& c = *r.config;
  return {{"size", r.tensor_parallel},
          {"sequence_parallel", t.sequence_parallel},
          {"ranks", r.ranks},
          {"whole_parameters", r.whole_param_count},
          {"parameters_per_rank", r.inputs.model.param_count},
          {"activation_arena_bytes_per_rank",
           plan::decoder_arena_nbytes(c, DType::kBF16, t.micro_batch, t.seq, t.activation_checkpointing,
                                    t.checkpoints_on_cpu, {}, 1, r.tensor_parallel, t.sequence_parallel,
                                    r.context_parallel)},
          {"collective_bytes_per_micro_step", plan.tp_collective_nbytes}};
}

}  // namespace strata::cli::plan_cli
