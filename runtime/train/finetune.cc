// The finetune job, top to bottom: configuration → ranks and communicators →
// engine and model → weights → data → steps → report.
#include "runtime/train/finetune.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "partition/communicator.h"
#include "partition/process_groups.h"
#include "partition/rendezvous.h"
#include "runtime/nn/context_support.h"
#include "runtime/launcher/launcher.h"
#include "runtime/config/config.h"
#include "kernels/op_totals.h"
#include "runtime/config/trainer_flags.h"
#include "core/accelerator.h"
#include "core/directory_lock.h"
#include "core/durable_file.h"
#include "core/error.h"
#include "core/log.h"
#include "core/stream_span.h"
#include "core/trace_recorder.h"
#include "runtime/data/batches.h"
#include "runtime/engine/lr_schedule.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/nn/param_files.h"
#include "runtime/pipeline/executor.h"
#include "runtime/train/micro_batch_order.h"
#include "runtime/plan/runtime_memory.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/freeze.h"
#include "runtime/train/hf_export.h"
#include "runtime/train/hf_model.h"
#include "runtime/train/monitors.h"
#include "runtime/train/peft_adapter.h"
#include "runtime/train/run_report.h"
#include "runtime/train/run_setup.h"
#include "runtime/train/zero_config.h"

namespace strata::train {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Without --config: ZeRO stage 3, everything in memory, AdamW at 1e-4.
constexpr const char* kBuiltinConfig = R"({
  "train_micro_batch_size_per_gpu": 1,
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
  "zero_optimization": {"stage": 3}
})";

double count_targets(const std::vector<int32_t>& targets) {
  double n = 0;
  for (int32_t t : targets) n += t != ops::kIgnoreIndex;
  return n;
}

// LoRA dropout's masks for a step's micro-batch m (0-based): a function of
// the run's seed, the step and the micro-batch, so a resumed run drops what
// the uninterrupted one did and a pipeline's stages what one rank would.
uint64_t lora_dropout_seed(uint64_t seed, int64_t step, int64_t m) {
  return seed ^ (static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ull) ^
         (static_cast<uint64_t>(m + 1) * 0xc2b2ae3d27d4eb4full);
}

}  // namespace

FinetuneResult run_finetune(const FinetuneOptions& options) {
  // ---- inputs, all checked before any rank connects or allocates -------------------
  const std::string source = options.config.empty() ? "built-in defaults" : options.config.string();
  STRATA_CHECK(options.model.empty() != options.init.empty(), kBadArgument,
               "give exactly one of --model DIR (Hugging Face weights) and --init CONFIG.json (random weights)");
  const nn::DecoderConfig model_config =
      options.model.empty() ? nn::load_decoder_config(options.init.string()) : load_hf_config(options.model);
  // "auto" values (Hugging Face Trainer configs) from the Trainer-like flags; the
  // flags set the built-in defaults' values too.
  TrainerFlags flags = options.trainer;
  flags.steps = options.steps;
  flags.hidden_size = model_config.hidden_size;
  flags.override_values = options.config.empty();
  const DocumentFilter fill = [&](nlohmann::json doc) { return apply_trainer_flags(std::move(doc), flags, source); };
  // LoRA: from the flags, or from the adapter --lora-init names (its
  // adapter_config.json; --lora-dropout may still set the dropout).
  nn::LoraSpec lora = options.lora;
  std::optional<PeftAdapter> start_adapter;
  if (!options.lora_init.empty()) {
    start_adapter = read_peft_adapter(options.lora_init);
    const double dropout = options.lora_dropout_given ? options.lora.dropout : start_adapter->spec.dropout;
    lora = start_adapter->spec;
    lora.dropout = dropout;
    lora.validate();
  }
  // A run that freezes parameters may offload them alone (config.h).
  const bool frozen = lora.enabled() || !options.freeze.empty();
  const Config config = options.config.empty() ? parse_config_text(kBuiltinConfig, source, fill, frozen)
                                               : load_config_file(options.config.string(), fill, frozen);
  STRATA_CHECK(!config.tensorboard.enabled || tensorboard_available(), kBadArgument,
               "{}: tensorboard.enabled is true, but this strata was built without protobuf (Debian: libprotobuf-dev "
               "protobuf-compiler, then rebuild); use csv_monitor (the same values as CSV) or metrics.jsonl",
               source);
  engine::ZeroEngineOptions zero = zero_engine_options(config, source);
  const engine::LrSchedule schedule = engine::LrSchedule::from_json(config.scheduler, config.optimizer.lr);
  STRATA_CHECK(options.steps >= 1, kBadArgument, "--steps must be >= 1, got {}", options.steps);
  STRATA_CHECK(!options.resume || !options.save_dir.empty(), kBadArgument,
               "--resume needs --save DIR (the directory the checkpoints are in)");
  STRATA_CHECK(options.save_every >= 1, kBadArgument, "--save-every must be >= 1, got {}", options.save_every);
  STRATA_CHECK(options.eval_every >= 0 && options.eval_batches >= 0, kBadArgument,
               "--eval-every and --eval-batches must be >= 0");
  STRATA_CHECK(!options.eval_data.empty() || (options.eval_every == 0 && options.eval_batches == 0 && !options.keep_best),
               kBadArgument, "--eval-every, --eval-batches and --keep-best need --eval-data FILE (held-out data)");
  STRATA_CHECK(!options.keep_best || !options.save_dir.empty(), kBadArgument,
               "--keep-best needs --save DIR (where the best checkpoint is kept)");
  STRATA_CHECK(options.seq >= 1 && options.seq <= model_config.max_position_embeddings, kBadArgument,
               "--seq {} must be in [1, {}] (the model's max_position_embeddings)", options.seq,
               model_config.max_position_embeddings);
  if (lora.enabled()) {
    lora.validate();
    nn::resolve_lora_targets(lora, model_config);  // all-linear as PEFT expands it on this model; what it lacks refused
    STRATA_CHECK(options.freeze.empty(), kBadArgument,
                 "--freeze with --lora-rank: LoRA trains the adapters only, the whole base is frozen already");
  }
  STRATA_CHECK(!options.merge_lora || (lora.enabled() && !options.export_dir.empty()), kBadArgument,
               "--merge-lora needs --lora-rank (adapters to merge) and --export DIR (where the merged model goes)");
  // DeepSeek-V3's auxiliary-loss-free balancing: the correction biases move after each step.
  const bool bias_rate_flag = options.router_bias_update_rate >= 0;
  const double bias_rate = bias_rate_flag ? options.router_bias_update_rate : config.router_bias_update_rate;
  const char* bias_rate_name = bias_rate_flag ? "--moe-router-bias-update-rate" : "moe.router_bias_update_rate";
  STRATA_CHECK(bias_rate <= 1 && std::isfinite(bias_rate), kBadArgument, "{} {}: must be in [0, 1]", bias_rate_name,
               bias_rate);
  if (bias_rate > 0) {
    STRATA_CHECK(model_config.sigmoid_router, kBadArgument,
                 "{} {}: model_type {} has no e_score_correction_bias (DeepSeek's auxiliary-loss-free balancing is "
                 "for deepseek_v3, kimi_k2 and glm4_moe); leave it out or set 0",
                 bias_rate_name, bias_rate, model_config.model_type);
    // With LoRA the biases move beside the adapters: a merged export carries
    // them; a PEFT adapter has no place for them (docs/DESIGN.md §4.2.1).
    STRATA_CHECK(!lora.enabled() || options.export_dir.empty() || options.merge_lora, kBadArgument,
                 "{} {} with --lora-rank exports the merged model only (--merge-lora): a PEFT adapter holds the "
                 "adapters, not the updated e_score_correction_bias of each MoE layer's router",
                 bias_rate_name, bias_rate);
  }
  const uint64_t seed = options.seed.value_or(config.strata.seed);
  const DType train_dtype = config.bf16 ? DType::kBF16 : config.fp16.enabled ? DType::kF16 : DType::kF32;
  ExportOptions export_options;
  set_export_dtype(export_options, options.export_dtype, train_dtype, "--export-dtype");
  export_options.max_shard_nbytes = options.export_shard_nbytes;
  // The source's tokenizer, chat template and generation config go with every export and checkpoint.
  if (!options.model.empty()) {
    export_options.files = read_model_files(options.model, model_config.to_hf_json(DType::kF32));
    // The MTP modules and a gemma3 vision tower: not trained, carried to the export as they are.
    export_options.carried = carried_hf_tensors(model_config, options.model);
    export_options.quant = model_config.quant;
    export_options.names = nn::checkpoint_names(model_config);
  }
  // A PEFT adapter is written in fp32 (adapters stay in their dtype); merged, the model is the base's.
  STRATA_CHECK(!export_options.fp8 || !lora.enabled() || options.merge_lora, kBadArgument,
               "--export-dtype fp8 with --lora-rank: the export is a PEFT adapter, written in fp32 as adapters "
               "are (not quantized); add --merge-lora to export the merged model with FP8 weights");

  // ---- ranks, accelerator, communicators ------------------------------------------------
  const partition::RankInfo rank = launcher::rank_info_from_env();
  const int64_t micro_batch = config.micro_batch_size, accumulation = config.gradient_accumulation_steps;
  // Tensor parallelism: tp consecutive ranks split each layer and read the
  // same samples; the world / tp data-parallel ranks split the batch.
  STRATA_CHECK(options.tensor_parallel == 0 || config.tensor_parallel_size == 1 ||
                   config.tensor_parallel_size == options.tensor_parallel,
               kBadArgument, "--tp {} and {}'s tensor_parallel.autotp_size {} disagree: give one", options.tensor_parallel,
               source, config.tensor_parallel_size);
  const int tp = options.tensor_parallel > 0 ? options.tensor_parallel : config.tensor_parallel_size;
  STRATA_CHECK(rank.world_size % tp == 0, kBadArgument,
               "tensor parallelism {} (--tp / tensor_parallel.autotp_size) does not divide the {} ranks (-n)", tp,
               rank.world_size);
  if (tp > 1) {
    nn::tensor_parallel_share(model_config, tp);  // refuses a model that does not split, naming the sizes
    STRATA_CHECK(!lora.enabled(), kBadArgument, "--lora-rank with tensor parallelism (--tp {}): not implemented yet",
                 tp);
  }
  const bool sequence_parallel = options.sequence_parallel || config.sequence_parallel;
  if (sequence_parallel) {
    const char* what = options.sequence_parallel ? "--sequence-parallel" : "sequence_parallel";
    STRATA_CHECK(tp > 1, kBadArgument,
                 "{} needs tensor parallelism (--tp or tensor_parallel.autotp_size of 2 or more): its tokens are "
                 "split over the tensor-parallel ranks",
                 what);
    STRATA_CHECK(micro_batch * options.seq % tp == 0, kBadArgument,
                 "{}: the micro-batch's {} x {} (train_micro_batch_size_per_gpu x --seq) tokens do not divide over "
                 "the {} tensor-parallel ranks",
                 what, micro_batch, options.seq, tp);
  }
  // Pipeline parallelism: pp stages of the layers, the world pp x dp x tp
  // (Megatron's order); the step's micro-batches flow through the stages.
  STRATA_CHECK(options.pipeline_parallel == 0 || config.pipeline_parallel_size == 1 ||
                   config.pipeline_parallel_size == options.pipeline_parallel,
               kBadArgument, "--pp {} and {}'s pipeline_parallel.size {} disagree: give one", options.pipeline_parallel,
               source, config.pipeline_parallel_size);
  const int pp = options.pipeline_parallel > 0 ? options.pipeline_parallel : config.pipeline_parallel_size;
  pipeline::ScheduleSpec pipeline_spec;
  std::vector<int64_t> stage_layers;
  if (pp > 1 || !options.pipeline_schedule.empty() || options.virtual_stages > 0) {
    const std::string name = options.pipeline_schedule.empty() ? config.pipeline_schedule : options.pipeline_schedule;
    const std::optional<pipeline::ScheduleKind> kind = pipeline::parse_schedule(name);
    STRATA_CHECK(kind.has_value(), kBadArgument, "--pp-schedule {}: not a pipeline schedule; one of {}", name,
                 pipeline::schedule_names());
    STRATA_CHECK(pp > 1, kBadArgument,
                 "--pp-schedule and --virtual-stages shape a pipeline: give --pp (or pipeline_parallel.size) of 2 or "
                 "more");
    pipeline_spec = {*kind, pp, static_cast<int>(accumulation),
                     options.virtual_stages > 0 ? options.virtual_stages : config.virtual_stages};
    pipeline_spec.check();  // the interleaved schedule's rule, named
    stage_layers = pipeline::split_layers(model_config.num_hidden_layers, pp, pipeline_spec.virtual_stages,
                                          config.pipeline_layers);
    STRATA_CHECK(!(model_config.moe() && model_config.output_router_logits), kBadArgument,
                 "--pp {} with model_type {}'s load-balancing loss (output_router_logits true): not implemented yet "
                 "(the loss needs every layer's routing at once); set output_router_logits false in config.json",
                 pp, model_config.model_type);
  }
  STRATA_CHECK(rank.world_size % (tp * pp) == 0, kBadArgument,
               "pipeline parallelism {} (--pp / pipeline_parallel.size) x tensor parallelism {} does not divide the {} "
               "ranks (-n)",
               pp, tp, rank.world_size);
  // Context parallelism: cp ranks read the same samples, each computing two
  // chunks of every sequence; ZeRO runs over the dp x cp ranks.
  STRATA_CHECK(options.context_parallel == 0 || config.context_parallel_size == 1 ||
                   config.context_parallel_size == options.context_parallel,
               kBadArgument, "--cp {} and {}'s context_parallel.size {} disagree: give one", options.context_parallel,
               source, config.context_parallel_size);
  const int cp = options.context_parallel > 0 ? options.context_parallel : config.context_parallel_size;
  const nn::ContextMethod cp_method =
      options.context_method.empty() ? nn::parse_context_method(config.context_parallel_method, source + ": context_parallel.method")
                                     : nn::parse_context_method(options.context_method, "--cp-method");
  if (cp > 1) {
    nn::refuse_unsupported_with_context_parallel(fmt::format("--cp {}", cp),
                                                 nn::context_parallel_uses(model_config, lora.enabled(), pp));
    STRATA_CHECK(options.seq % (2 * cp) == 0, kBadArgument,
                 "--seq {} does not divide by 2 x --cp {} = {}: context parallelism cuts every sequence into two "
                 "chunks per rank",
                 options.seq, cp, 2 * cp);
    // With tensor parallelism the cp group of each tp rank splits its heads.
    nn::check_context_parallel(model_config.num_attention_heads, model_config.num_key_value_heads, cp, cp_method, tp);
    STRATA_CHECK(rank.world_size % (cp * tp * pp) == 0, kBadArgument,
                 "context parallelism {} (--cp / context_parallel.size){} does not divide the {} ranks (-n)", cp,
                 tp > 1 ? fmt::format(" x tensor parallelism {}", tp) : std::string(), rank.world_size);
    // Sequence parallelism splits a cp rank's tokens (its two chunks of every sequence) over the tp ranks.
    STRATA_CHECK(!sequence_parallel || micro_batch * (options.seq / cp) % tp == 0, kBadArgument,
                 "{}: a cp rank's {} x {} (train_micro_batch_size_per_gpu x --seq / --cp {}) tokens do not divide "
                 "over the {} tensor-parallel ranks",
                 options.sequence_parallel ? "--sequence-parallel" : "sequence_parallel", micro_batch,
                 options.seq / cp, cp, tp);
  }
  const partition::ParallelLayout parallel_layout(rank.world_size, tp, 1, pp, cp);
  const int dp = parallel_layout.dp_size(), dp_rank = parallel_layout.dp_rank(rank.rank);
  const int cp_rank = parallel_layout.cp_rank(rank.rank);
  // The data, each data-parallel rank its samples; a file that is not what --data-format says is refused here.
  const std::unique_ptr<data::Batches> batches = data::open_batches(
      options.data.string(), options.data_format, {options.seq, micro_batch, dp_rank, dp, seed, options.packing});
  const std::unique_ptr<data::Batches> eval_batches =
      options.eval_data.empty()
          ? nullptr
          : data::open_batches(options.eval_data.string(), options.data_format,
                               {options.seq, micro_batch, dp_rank, dp, seed, options.packing});
  const int64_t eval_count = !eval_batches             ? 0
                             : options.eval_batches > 0 ? std::min(options.eval_batches, eval_batches->eval_batches())
                                                        : eval_batches->eval_batches();
  set_log_rank(rank.rank, rank.world_size);
  set_log_level(config.strata.log_level);
  // The directories this run writes are its own from now on: another run
  // holding them is refused before anything is touched (core/directory_lock.h).
  const std::vector<std::shared_ptr<DirectoryLock>> owned = own_run_directories(zero, options, rank.rank);
  // The timeline: recording from here on; each rank's file is created now.
  std::optional<trace::Session> tracing;
  // --trace, else the ds_config's strata.trace_path.
  const std::filesystem::path trace_path =
      !options.trace.empty() ? options.trace : std::filesystem::path(config.strata.trace_path);
  if (!trace_path.empty()) {
    trace::Options trace_options;
    trace_options.path = trace_path.string();
    trace_options.rank = rank.rank;
    trace_options.world_size = rank.world_size;
    trace_options.process_name = fmt::format("strata finetune rank {}", rank.rank);
    tracing.emplace(trace_options);
    trace::name_this_thread("train loop");
  }
  std::optional<trace::Span> setup_span(std::in_place, "phase", "connect");
  STRATA_CHECK(config.train_batch_size == 0 || config.train_batch_size == micro_batch * accumulation * dp,
               kBadArgument,
               "{}: train_batch_size {} != train_micro_batch_size_per_gpu {} x gradient_accumulation_steps {} x "
               "data-parallel ranks {}{}",
               source, config.train_batch_size, micro_batch, accumulation, dp,
               tp > 1 || pp > 1 ? fmt::format(" (the world {} / tensor parallelism {} / pipeline parallelism {})",
                                              rank.world_size, tp, pp)
                                : std::string());
  const int expert_parallel = choose_expert_parallel_size(config, model_config, dp, source);
  zero.expert_parallel_size = expert_parallel;
  // The step's micro-batches layer by layer (docs/DESIGN.md §5.5) or one
  // after another; auto asks strata plan's model for both orders' step
  // times, on its default machine figures with this run's ranks.
  const std::optional<plan::OrderPlan> predicted_orders = predict_run_orders(
      model_config, zero.stage, zero.param_tier, zero.max_reuse_distance_numel, zero.max_live_parameters_numel,
      micro_batch, options.seq, accumulation, options.checkpoint_activations || config.cpu_checkpointing, dp,
      rank.local_world_size, config.strata.keeps_layer_activations());  // auto's activations counted recomputed
  MicroBatchOrderContext order_context{zero.param_tier, accumulation, tp, pp, expert_parallel, lora.enabled(),
                                       model_config.tie_word_embeddings,
                                       model_config.moe() && model_config.output_router_logits, cp};
  order_context.predicted = predicted_orders ? &*predicted_orders : nullptr;
  const MicroBatchOrderChoice order = choose_micro_batch_order(
      options.micro_batch_order.empty() ? config.strata.micro_batch_order : options.micro_batch_order,
      options.micro_batch_order.empty() ? "strata.micro_batch_order" : "--micro-batch-order", order_context);
  const bool layer_major = order.order == MicroBatchOrder::kLayerMajor;
  if (!order.said.empty() && rank.rank == 0) logger().info("{}", order.said);
  const std::string& boundaries_where = config.strata.layer_major_boundaries;
  const pipeline::BoundaryHome boundary_home =
      pipeline::parse_boundary_home(boundaries_where, source + ": strata.layer_major_boundaries");
  const bool boundaries_pinned = boundary_home != pipeline::BoundaryHome::kDevice;
  if (boundaries_pinned && !layer_major && rank.rank == 0) {
    logger().info("strata.layer_major_boundaries {}: no effect, the micro-batches are step-major (no boundaries "
                  "are kept)",
                  boundaries_where);
  }
  if (config.strata.keeps_layer_activations() && !layer_major && rank.rank == 0) {
    logger().info("strata.layer_major_activations keep: no effect, the micro-batches are step-major");
  }
  STRATA_CHECK(!layer_major || boundary_home != pipeline::BoundaryHome::kNvme || zero.any_nvme(), kBadArgument,
               "{}: strata.layer_major_boundaries nvme puts the boundaries' file under the run's nvme_path, but no "
               "tier is on nvme (offload_param.device or offload_optimizer.device): set one, or keep the boundaries "
               "on the device or cpu",
               source);
  std::unique_ptr<Accelerator> accelerator = make_accelerator(config.strata.accelerator);
  // Layer-major keeps each micro-batch's input to every chunk but the
  // embedding's, and the gradient flowing down (pipeline::KeptBoundaries):
  // [micro_batch x seq, hidden] each in the activation dtype (fp32 on the cpu accelerator).
  const DType activation_dtype = accelerator->host_addressable() ? DType::kF32 : train_dtype;
  const size_t one_boundary_nbytes = static_cast<size_t>(micro_batch * options.seq * model_config.hidden_size) *
                                     dtype_nbytes(activation_dtype);
  const int layer_chunks = static_cast<int>(model_config.num_hidden_layers + 2);
  // All of them, and what of them is pinned host memory (with nvme: the staging and the gradients).
  const double boundary_nbytes =
      layer_major ? static_cast<double>(pipeline::kept_boundaries_size(pipeline::BoundaryHome::kDevice, layer_chunks,
                                                                       static_cast<int>(accumulation),
                                                                       one_boundary_nbytes)
                                            .memory_nbytes)
                  : 0.0;
  const double boundary_pinned_nbytes =
      layer_major && boundaries_pinned
          ? static_cast<double>(pipeline::kept_boundaries_size(boundary_home, layer_chunks,
                                                               static_cast<int>(accumulation), one_boundary_nbytes)
                                    .memory_nbytes)
          : 0.0;
  // Layer-major's activations kept or recomputed (auto: kept where strata
  // plan's model of this run says they fit the accelerator; every rank agrees below).
  LayerActivationsChoice activations;
  {
    plan::RuntimeInputs pinned;
    pinned.model = model_config;
    pinned.param_dtype = train_dtype;
    pinned.device_is_host = accelerator->host_addressable();
    pinned.activation_dtype = activation_dtype;
    pinned.micro_batch = micro_batch;
    pinned.seq = options.seq;
    pinned.context_parallel = cp;  // this rank's tokens of each sequence: seq / cp
    pinned.context_method = cp_method;
    pinned.checkpoint_activations = options.checkpoint_activations || config.cpu_checkpointing;
    pinned.cpu_checkpointing = config.cpu_checkpointing;
    pinned.world_size = dp * cp;  // ZeRO's partitions (each holds a tp shard: the model's memory counted whole is an upper bound)
    pinned.zero = zero;
    pinned.lora = lora;
    if (layer_major) {
      pinned.layer_major = {static_cast<int>(accumulation), false, boundary_home};
      activations = choose_layer_activations(config.strata.layer_major_activations, "strata.layer_major_activations",
                                             pinned, accelerator->memory_stats().capacity_nbytes);
      pinned.layer_major.keep_activations = activations.keep;
    }
    check_pinned_budget(config, source, pinned);
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(config.strata.collective_timeout_s * 1000));
  partition::Rendezvous rendezvous(rank, timeout);
  if (expert_parallel > 1 && rank.rank == 0) {
    logger().info("expert parallelism: {} ranks split the {} experts of each layer ({} each){}", expert_parallel,
                  model_config.num_experts, model_config.num_experts / expert_parallel,
                  config.expert_parallel_size == 0 ? " (moe.expert_parallel_size left out: the world size)" : "");
  }
  if (tp > 1 && rank.rank == 0) {
    const nn::DecoderConfig share = nn::tensor_parallel_share(model_config, tp);
    logger().info("tensor parallelism: {} tp groups of {} consecutive ranks split each layer ({} heads, {} kv "
                  "head(s){} and {} MLP features per rank) and the embedding and lm_head ({} of the {} vocabulary "
                  "rows per rank){}; ZeRO over {} data-parallel rank(s)",
                  dp, tp, share.num_attention_heads, share.num_key_value_heads,
                  tp > model_config.num_key_value_heads ? " shared" : "", share.intermediate_size,
                  model_config.vocab_size / tp, model_config.vocab_size,
                  !sequence_parallel ? std::string()
                  : cp > 1 ? fmt::format(", sequence parallel ({} of a cp rank's {} tokens of each micro-batch per rank)",
                                         micro_batch * options.seq / (cp * tp), micro_batch * options.seq / cp)
                           : fmt::format(", sequence parallel ({} of each micro-batch's {} tokens per rank)",
                                         micro_batch * options.seq / tp, micro_batch * options.seq),
                  dp);
  }
  if (pp > 1 && rank.rank == 0) {
    std::string split;
    for (int64_t n : stage_layers) split += (split.empty() ? "" : ", ") + std::to_string(n);
    logger().info("pipeline parallelism: {} stages of {} rank(s) each, schedule {}{} over {} micro-batches; layers "
                  "per {}stage: {}; bubble (idle share of a step) by the schedule's formula {:.3f}",
                  pp, dp * tp, pipeline::schedule_name(pipeline_spec.kind),
                  pipeline_spec.virtual_stages > 1 ? fmt::format(" ({} chunks per rank)", pipeline_spec.virtual_stages)
                                                   : std::string(),
                  accumulation, pipeline_spec.virtual_stages > 1 ? "virtual " : "", split,
                  pipeline::bubble_formula(pipeline_spec));
  }
  if (cp > 1 && rank.rank == 0) {
    logger().info("context parallelism: {} cp groups of {} ranks split each sequence of {} tokens into {} chunks of {} "
                  "(two per rank: {} tokens of each sequence per rank), attention by {}{}; ZeRO over the {} x {} ranks",
                  dp * tp, cp, options.seq, 2 * cp, options.seq / (2 * cp), options.seq / cp,
                  nn::context_method_name(cp_method),
                  tp > 1 ? fmt::format(" over each tp rank's heads (a cp group per tp rank, stride {})", tp)
                         : std::string(),
                  dp, cp);
  }
  const ZeroCommunicators comms = make_zero_communicators(*accelerator, rendezvous.store(), rank.rank,
                                                          rank.world_size, timeout, "strata/finetune", expert_parallel,
                                                          tp, pp, cp);

  // ---- engine, model, weights ---------------------------------------------------------
  setup_span.emplace("phase", options.model.empty() ? "init weights" : "load weights");
  engine::ZeroEngine engine(*accelerator, comms.comms(), zero);
  nn::DecoderModelOptions model_options;
  model_options.dtype = train_dtype;
  model_options.checkpoint_activations = options.checkpoint_activations || config.cpu_checkpointing;
  model_options.cpu_checkpointing = config.cpu_checkpointing;
  model_options.lora = lora;
  model_options.sequence_parallel = sequence_parallel;
  model_options.context_method = cp_method;
  // One model, or this rank's pipeline stages (a model per chunk).
  std::vector<std::unique_ptr<nn::DecoderModel>> stages;
  try {
    if (pp > 1) {
      stages = pipeline::make_stage_models(engine, model_config, model_options, pipeline_spec, *comms.pipeline,
                                           stage_layers);
    } else if (layer_major) {
      stages = pipeline::make_layer_models(engine, model_config, model_options);
    } else {
      stages.push_back(std::make_unique<nn::DecoderModel>(engine, model_config, model_options));
    }
    const Frozen frozen = freeze_parameters(engine, options.freeze);
    if (frozen.tensors > 0 && rank.rank == 0) {
      logger().info("--freeze: {} of {} parameter tensors ({} elements) are not trained", frozen.tensors,
                    frozen.total_tensors, frozen.elements);
    }
    // LoRA's base from an FP8 or MXFP4 checkpoint stays so at home (ZeRO-3; docs/DESIGN.md
    // §4.2.2). Not --freeze's: its checkpoints save the frozen tensors, which
    // `strata export` reads back in the run's dtype.
    if (lora.enabled() && !options.model.empty()) {
      std::vector<engine::ParamId> all;
      for (const auto& stage : stages) {
        const std::vector<engine::ParamId> ids = stage->parameters();
        all.insert(all.end(), ids.begin(), ids.end());
      }
      keep_quantized_frozen(engine, all, options.model, model_config.quant);
    }
    engine.finalize();
  } catch (const Error& e) {
    if (e.category() != ErrorCategory::kOutOfMemory) throw;
    // Say which inputs size the allocation that failed, in the user's terms.
    raise(ErrorCategory::kOutOfMemory,
          "{}. What is allocated here is sized by the model ({} parameters; the embedding alone is vocab_size {} x "
          "hidden_size {}) and by the ds_config's buffers (offload_optimizer.buffer_count {}, offload_param."
          "buffer_count {} x buffer_size {}, sub_group_size {}, reduce_bucket_size {}): check those values",
          e.message(), model_config.parameter_count(), model_config.vocab_size, model_config.hidden_size,
          config.zero.offload_optimizer.buffer_count, config.zero.offload_param.buffer_count,
          config.zero.offload_param.buffer_numel, engine.options().sub_group_numel,
          engine.options().reduce_bucket_numel);
  }
  nn::DecoderModel& model = *stages.front();
  std::unique_ptr<pipeline::PipelineExecutor> executor;
  if (pp > 1) {
    std::vector<nn::DecoderModel*> chunks;
    for (const auto& stage : stages) chunks.push_back(stage.get());
    executor = std::make_unique<pipeline::PipelineExecutor>(engine, *comms.pipeline, pipeline_spec, chunks);
  } else if (layer_major) {
    // One rank's layers as single-layer chunks between the embedding's and the head's, the schedule
    // layer-major (runtime/pipeline/schedule.h).
    std::vector<nn::DecoderModel*> chunks;
    for (const auto& stage : stages) chunks.push_back(stage.get());
    const pipeline::ScheduleSpec spec{pipeline::ScheduleKind::kLayerMajor, 1, static_cast<int>(accumulation),
                                      static_cast<int>(chunks.size())};
    pipeline::BoundaryNvme on_nvme;
    if (boundary_home == pipeline::BoundaryHome::kNvme) {
      on_nvme = {engine.nvme_io(), zero.nvme_path, engine.job_rank(), zero.keep_swap_files, one_boundary_nbytes,
                 static_cast<int>(accumulation)};
    }
    // Recompute gathers parameters again: every rank runs the same choice
    // (auto sized it from this rank's accelerator; keep only where all can).
    const bool keep = engine.job_sum(activations.keep ? 1.0 : 0.0) == static_cast<double>(engine.job_size());
    if (!activations.said.empty() && rank.rank == 0) {
      logger().info("{}{}", activations.said,
                    keep == activations.keep ? "" : "; recompute on every rank: another rank's accelerator cannot keep them");
    }
    activations.keep = keep;
    executor = std::make_unique<pipeline::PipelineExecutor>(
        engine, spec, chunks, boundary_home, on_nvme,
        keep ? pipeline::LayerActivations::kKeep : pipeline::LayerActivations::kRecompute);
    if (rank.rank == 0) {
      logger().info("micro-batch order layer-major: {} micro-batches through each of the {} decoder layers in turn, "
                    "then each layer's backwards from the top, {}; the layer-boundary "
                    "activations and gradients take {:.1f} MiB of {} (strata.layer_major_boundaries), besides {}",
                    accumulation, chunks.size() - 2,
                    keep ? "on the activations their forwards kept (strata.layer_major_activations keep)"
                         : "recomputed from its input",
                    boundary_nbytes / (1 << 20),
                    boundary_home == pipeline::BoundaryHome::kNvme
                        ? fmt::format("nvme, through {:.1f} MiB of pinned staging", boundary_pinned_nbytes / (1 << 20))
                    : boundaries_pinned ? std::string("pinned host memory")
                                        : std::string("device memory"),
                    keep ? fmt::format("a working arena per micro-batch ({}) of every layer, the embedding and the head",
                                       accumulation)
                         : std::string("one working arena per layer, the embedding's and the head's"));
    }
  }
  // The base from the checkpoint (or seeded), LoRA's adapters as PEFT starts them.
  std::vector<engine::ParamId> base, adapters;
  for (const auto& stage : stages) {
    for (engine::ParamId id : stage->parameters()) {
      (nn::is_lora_parameter(engine.param_info(id).name) ? adapters : base).push_back(id);
    }
  }
  if (options.model.empty()) {
    // A norm weight starts at 1 times the normalised input: Gemma's (1 + w) at w = 0.
    nn::initialize_parameters(engine, base, seed, 0.02, 1.0f - model.config().norm_weight_offset);
  } else {
    std::set<std::string> carried;
    for (const auto& [name, file] : export_options.carried) carried.insert(name);
    load_hf_weights(engine, base, options.model, carried, model_config.quant, nn::checkpoint_names(model_config));
  }
  nn::initialize_parameters(engine, adapters, seed);
  if (rank.rank == 0) log_quantized_base(engine, model_config, zero);
  if (start_adapter) {
    // Exactly the adapters this model declares: a tensor more or less is refused by name.
    const nn::CheckpointNames& names = nn::checkpoint_names(model_config);
    nn::load_parameters(engine, adapters, start_adapter->weights.string(), false,
                        [&](const std::string& name) { return names.adapter_name(name); });
  }
  setup_span.reset();
  // A gemma3 checkpoint's image placeholders: the text model cannot take them.
  const data::Batches::RefusedIds refused =
      model_config.multimodal ? model_config.multimodal->image_tokens : data::Batches::RefusedIds{};
  batches->check_ids(model_config.vocab_size, refused);
  if (eval_batches) eval_batches->check_ids(model_config.vocab_size, refused);
  if (lora.enabled()) {
    int64_t trained = 0;
    for (engine::ParamId id : adapters) trained += engine.param_info(id).numel();
    std::string targets;
    for (const std::string& t : lora.targets) targets += (targets.empty() ? "" : ",") + t;
    logger().info("finetune: LoRA r={} alpha={} (scale {:.4g}{}{}) on {}: {} adapter tensors, {} parameters trained",
                  lora.rank, lora.alpha, lora.scaling(), lora.rslora ? ", rsLoRA" : "",
                  lora.dropout > 0 ? fmt::format(", dropout {}", lora.dropout) : std::string(),
                  targets, adapters.size(), trained);
  }
  logger().info("finetune: {} parameters ({}), ZeRO stage {}, params on {}, optimizer state on {}, {} rank(s) x "
                "{} x {} sequences of {} tokens per step, {}, activation checkpoints {}; data {}",
                [&] {
                  int64_t n = 0;
                  for (engine::ParamId id = 0; id < engine.parameter_count(); ++id) {
                    const engine::ParamInfo& p = engine.param_info(id);
                    n += p.tp_split ? shape_numel(p.slice->tensor_shape) : p.numel();  // a tp shard's whole tensor
                  }
                  return n;
                }(),
                dtype_name(model_options.dtype), zero.stage, tier_name(zero.param_tier), tier_name(zero.optimizer_tier),
                dp, accumulation, micro_batch, options.seq, schedule.describe(),
                !model_options.checkpoint_activations ? "off"
                : model_options.cpu_checkpointing     ? "in pinned CPU memory"
                                                      : "on the device",
                batches->describe());
  if (eval_batches) {
    logger().info("finetune: evaluation on {}, {} micro-batch(es) per rank {}", eval_batches->describe(), eval_count,
                  options.eval_every > 0 ? fmt::format("every {} steps and after the last", options.eval_every)
                                         : std::string("after the last step"));
  }

  // ---- the steps ------------------------------------------------------------------------
  // ---- resume -----------------------------------------------------------------------------
  // What the checkpoints are of, so `strata export` can rebuild the model from one.
  nlohmann::json checkpoint_model = {{"config", model_config.to_json()}, {"dtype", dtype_name(train_dtype)}};
  // Each rank's checkpoint holds the experts it owns: a resume or an export needs the same split.
  if (zero.expert_parallel_size > 1) checkpoint_model["expert_parallel_size"] = zero.expert_parallel_size;
  if (tp > 1) checkpoint_model["tensor_parallel_size"] = tp;
  // ZeRO partitions over dp x cp: an export rebuilds the same communicators.
  if (cp > 1) checkpoint_model["context_parallel_size"] = cp;
  // Each rank's checkpoint holds its stage's layers: a resume or an export needs the same split.
  if (pp > 1) {
    checkpoint_model["pipeline_parallel_size"] = pp;
    checkpoint_model["pipeline_layers"] = stage_layers;
  }
  std::optional<Checkpoints> checkpoints;
  if (!options.save_dir.empty()) {
    checkpoints.emplace(options.save_dir, options.keep_checkpoints);
    if (lora.enabled()) {
      // A LoRA checkpoint holds the adapters; the base is named by its
      // identity, and a resume on other base weights is refused.
      checkpoint_model["lora"] = {{"r", lora.rank},
                                  {"alpha", lora.alpha},
                                  {"rslora", lora.rslora},
                                  {"dropout", lora.dropout},
                                  {"targets", lora.targets}};
      if (options.model.empty()) {
        checkpoint_model["base_weights"] = {{"init_seed", seed}};
      } else {
        // Rank 0 reads the base once for its checksums; the others receive them.
        nlohmann::json identity = hf_weights_identity(options.model, /*checksums=*/rank.rank == 0);
        for (auto& file : identity) {
          const double crc = rank.rank == 0 ? file["crc32"].get<double>() : 0.0;
          file["crc32"] = static_cast<uint32_t>(engine.global_sum(crc));
        }
        checkpoint_model["base_weights"] = identity;
      }
      // The frozen base is left out, unless the correction biases move:
      // they live in the base's frozen fp32 group, saved whole then.
      if (bias_rate == 0) checkpoints->omit_frozen();
    }
    checkpoints->expect_model(checkpoint_model);
  }
  int64_t done = 0;  // steps already taken (by the run a checkpoint came from)
  if (options.resume) {
    trace::Span span("phase", "resume");
    const std::optional<TrainerState> resumed = checkpoints->find_and_load(engine);
    if (!resumed) {
      raise(ErrorCategory::kBadArgument, "--resume: no complete checkpoint in {} (nothing to resume)",
            options.save_dir.string());
    }
    done = resumed->step;
    if (options.steps < done) {
      raise(ErrorCategory::kBadArgument,
            "--steps {}: the checkpoint in {} is at step {} already, past the last step asked for; give --steps "
            "{} or more to continue (or `strata export {}` to export it)",
            options.steps, options.save_dir.string(), done, done, options.save_dir.string());
    }
    // A run killed after its last checkpoint (during the export, say) is
    // finished by the same command: restart-until-it-succeeds must end.
    if (options.steps == done && rank.rank == 0) {
      logger().info("--resume: the checkpoint is at step {} = --steps, so training is complete; {}", done,
                    options.export_dir.empty() ? "nothing is left to do" : "exporting it");
    }
    batches->set_cursor(resumed->data_cursor);
  }

  // ---- the steps ------------------------------------------------------------------------
  std::unique_ptr<RunReport> report;
  if (rank.rank == 0) {
    // What ran: auto's activations as chosen, so that strata plan --check models them.
    nlohmann::json effective = config.effective;
    if (layer_major) effective["strata"]["layer_major_activations"] = activations.keep ? "keep" : "recompute";
    const RunRecord inputs = configured_run_record(effective, model_config.to_json(), engine.zero_sizes());
    report = std::make_unique<RunReport>(options.out, options.steps, options.progress,
                                         options.resume ? std::optional<int64_t>(done) : std::nullopt, inputs);
    report->set_print_every(config.steps_per_print);
  }
  // DeepSpeed's monitors (rank 0): csv_monitor's files beside the metrics.
  std::unique_ptr<CsvMonitor> csv;
  std::unique_ptr<TensorBoardMonitor> tensorboard;
  if (rank.rank == 0 && config.csv_monitor.enabled) {
    csv = std::make_unique<CsvMonitor>(monitor_dir(config.csv_monitor, options.out));
  }
  if (rank.rank == 0 && config.tensorboard.enabled) {
    tensorboard = std::make_unique<TensorBoardMonitor>(monitor_dir(config.tensorboard, options.out));
  }
  FinetuneResult result;
  // Evaluation: the masked mean loss over the held-out windows, forward only.
  // Every rank runs the same number of forwards (its share; rows past the end
  // are empty), the count of targets is known to each rank (Batches::eval_targets),
  // so one reduction gives the mean. Under ZeRO-3 the passes are outside the
  // operator trace (ZeroEngine::begin_evaluation), so prefetch keeps following it.
  const double eval_targets = eval_batches ? static_cast<double>(eval_batches->eval_targets(eval_count)) : 0;
  STRATA_CHECK(!eval_batches || eval_targets > 0, kBadArgument, "--eval-data {}: nothing to evaluate on",
               options.eval_data.string());
  auto evaluate = [&]() {
    trace::Span span("phase", "evaluation");
    engine.begin_evaluation();
    double sum = 0;
    data::Batch b;
    if (executor) {
      // Every stage's share of each micro-batch, forward only, through the pipeline.
      std::vector<data::Batch> all(static_cast<size_t>(eval_count));
      for (int64_t k = 0; k < eval_count; ++k) eval_batches->eval_batch(k, all[static_cast<size_t>(k)]);
      sum = executor
                ->evaluate(
                    [&](int i) {
                      const data::Batch& e = all[static_cast<size_t>(i)];
                      return pipeline::MicroBatch{e.ids, e.targets, e.positions, micro_batch, options.seq};
                    },
                    static_cast<int>(eval_count))
                .first;
    } else {
      nn::ForwardOptions forward;
      forward.backward = false;
      for (int64_t k = 0; k < eval_count; ++k) {
        eval_batches->eval_batch(k, b);
        forward.positions = b.positions;
        model.forward(b.ids, b.targets, micro_batch, options.seq, forward);
        sum += model.loss_stats().sum;
      }
    }
    engine.end_evaluation();
    return engine.global_sum(sum) / eval_targets;
  };
  std::optional<double> best_eval;
  if (options.keep_best && options.resume) {
    // The best so far of the run resumed, when its checkpoint is still there.
    const std::filesystem::path best_file = options.save_dir / "best.json";
    std::error_code ec;
    if (std::filesystem::is_regular_file(best_file, ec)) {
      std::ifstream in(best_file);
      const nlohmann::json best = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (best.is_object() && best.contains("step") && best.contains("eval_loss") && best["eval_loss"].is_number() &&
          best["step"].is_number_integer() && best["step"].get<int64_t>() <= done) {
        best_eval = best["eval_loss"].get<double>();
        result.best_step = best["step"].get<int64_t>();
        checkpoints->keep_also(result.best_step);
      }
    }
  }
  std::vector<data::Batch> micro(static_cast<size_t>(accumulation));
  for (int64_t step = done + 1; step <= options.steps; ++step) {
    trace::Span step_span("phase", "step");
    step_span.value("step", step);
    const auto start = Clock::now();
    const uint64_t nvme_before = engine.nvme_bytes_read() + engine.nvme_bytes_written();
    double local_count = 0;
    for (data::Batch& b : micro) {
      batches->next(b);
      // The ranks of a cp group read the same samples: one of them counts them.
      if (cp_rank == 0) local_count += count_targets(b.targets);
    }
    // Normalise by every rank's predicted tokens of this step, so N ranks equal one rank on the combined batch.
    const double global_count = engine.global_sum(local_count);
    STRATA_CHECK(global_count > 0, kBadArgument, "step {}: every target of the global batch is ignored", step);
    const double lr = schedule.lr(engine.step_count());
    double loss_sum = 0, aux_sum = 0;
    bool aux = false;  // a mixture of experts with its load-balancing loss
    for (const auto& stage : stages) stage->reset_router_load();  // an evaluation since the last step routed too
    std::optional<pipeline::StepStats> piped;
    if (executor) {
      // The step's micro-batches through the pipeline (pipeline parallelism:
      // no prepare_step, the backwards of one step interleave with forwards).
      nn::ForwardOptions forward;
      forward.normalizer = global_count;
      forward.grad_scale = engine.loss_scale();
      trace::Span span("phase", "pipeline");
      // Layer-major: each layer's gradient is final after its m backwards, and its update overlaps the layers below.
      if (layer_major) engine.prepare_step(static_cast<float>(lr), static_cast<int>(micro.size()));
      piped = executor->run(
          [&](int i) {
            const data::Batch& b = micro[static_cast<size_t>(i)];
            return pipeline::MicroBatch{b.ids, b.targets, b.positions, micro_batch, options.seq,
                                        lora_dropout_seed(seed, step, i)};
          },
          forward);
      loss_sum = piped->loss_sum;
    }
    for (size_t m = 0; m < (executor ? 0 : micro.size()); ++m) {
      // The optimizer may update each sub-group during the last backward, as soon as its gradient is final.
      if (m + 1 == micro.size()) engine.prepare_step(static_cast<float>(lr));
      nn::ForwardOptions forward;
      forward.normalizer = global_count;
      forward.grad_scale = engine.loss_scale();  // fp16: step() divides it out
      forward.positions = micro[m].positions;     // packed documents: attention within each
      forward.dropout_seed = lora_dropout_seed(seed, step, static_cast<int64_t>(m));
      // Each phase twice on the timeline: on the loop's track, the host's view
      // (issuing ops, waiting for parameters); on the compute stream's, the
      // ops' (from the first to the last of them having run).
      {
        trace::Span span("phase", "forward");
        span.value("micro_batch", static_cast<int64_t>(m));
        StreamSpan ops(engine.compute_stream(), "compute", "forward");
        model.forward(micro[m].ids, micro[m].targets, micro_batch, options.seq, forward);
      }
      {
        trace::Span span("phase", "backward");
        span.value("micro_batch", static_cast<int64_t>(m));
        StreamSpan ops(engine.compute_stream(), "compute", "backward");
        model.backward();
        ops.end();
        const nn::LossStats stats = model.loss_stats();  // waits for the backward's loss
        loss_sum += stats.sum;
        aux_sum += stats.aux;
        aux = stats.aux_coef > 0;
      }
    }
    const double forward_backward = seconds_since(start);
    const double loss = engine.global_sum(loss_sum) / global_count;
    trace::Span optimizer_span("phase", "optimizer step");
    const engine::StepResult stepped = engine.step(static_cast<float>(lr));
    optimizer_span.end();
    if (bias_rate > 0 && stepped.applied) {
      // From this step's routing (reset at its start): every rank's counts, so every rank writes the same.
      trace::Span span("phase", "correction bias update");
      for (const auto& stage : stages) stage->update_correction_biases(static_cast<float>(bias_rate));
    }
    StepRecord r;
    r.step = step;
    r.loss = loss;
    r.lr = lr;
    r.grad_norm = stepped.grad_norm;
    r.loss_scale = stepped.loss_scale;
    r.applied = stepped.applied;
    r.tokens = static_cast<int64_t>(global_count);
    r.seconds = seconds_since(start);
    r.nvme_bytes = engine.nvme_bytes_read() + engine.nvme_bytes_written() - nvme_before;
    // What this step's forward and backward waited for the last step's update (overlapping the forward) is
    // the optimizer's time, as is step()'s; the thread's time behind backward and the forward is hidden.
    r.forward_backward_seconds = forward_backward - stepped.previous_update_wait_seconds;
    r.optimizer_seconds = r.seconds - r.forward_backward_seconds;
    r.optimizer_hidden_seconds =
        stepped.optimizer_overlapped_seconds +
        std::max(0.0, stepped.previous_update_seconds - stepped.previous_update_wait_seconds);
    r.optimizer_not_hidden_fraction = stepped.optimizer_not_hidden_fraction();
    if (stepped.overlap_mode) r.optimizer_overlap = offload::overlap_mode_name(*stepped.overlap_mode);
    r.optimizer_rolled_back = stepped.rolled_back;
    r.optimizer_overlaps_forward = stepped.update_overlaps_forward;
    r.device_peak_nbytes = accelerator->memory_stats().peak_nbytes;
    r.host_peak_rss_nbytes = peak_rss_nbytes();
    if (model.config().moe()) {
      double worst = 0;
      for (const auto& stage : stages) worst = std::max(worst, stage->router_load_imbalance());
      r.router_imbalance = worst;
    }
    if (piped) {
      if (pp > 1) r.pipeline_idle_fraction = piped->idle_fraction();
      r.activation_nbytes = piped->activation_nbytes;
    } else {
      // The arena, and with context parallelism the ring's or Ulysses' buffers beside it.
      r.activation_nbytes = model.arena_nbytes() + model.context_buffer_nbytes();
    }
    if (aux) {
      // The mean over the step's micro-batches and ranks (the gradients add each one's).
      r.aux_loss = engine.global_sum(aux_sum) / static_cast<double>(micro.size() * static_cast<size_t>(rank.world_size));
    }
    const bool eval_due =
        eval_batches && ((options.eval_every > 0 && step % options.eval_every == 0) || step == options.steps);
    if (eval_due) {
      r.eval_loss = evaluate();
      result.eval_losses.emplace_back(step, *r.eval_loss);
    }
    if (report) report->record(r);
    const auto monitor = [&](const std::string& name, double value) {
      if (csv) csv->write(name, step, value);
      if (tensorboard) tensorboard->write(name, step, value);
    };
    monitor("train/loss", r.loss);
    monitor("train/lr", r.lr);
    monitor("train/grad_norm", r.grad_norm);
    monitor("train/tokens_per_second", r.tokens_per_second());
    if (r.eval_loss) monitor("eval/loss", *r.eval_loss);
    if (r.aux_loss) monitor("train/aux_loss", *r.aux_loss);
    if (r.router_imbalance) monitor("train/router_imbalance", *r.router_imbalance);
    const bool new_best = options.keep_best && r.eval_loss && (!best_eval || *r.eval_loss < *best_eval);
    if (checkpoints && (step % options.save_every == 0 || step == options.steps || new_best)) {
      trace::Span span("phase", "checkpoint");
      if (new_best) checkpoints->keep_also(step);
      const std::filesystem::path saved = checkpoints->save(engine, {step, batches->cursor(), checkpoint_model, export_options.files});
      if (new_best) {
        best_eval = r.eval_loss;
        result.best_step = step;
        if (rank.rank == 0) {
          write_file_durably(options.save_dir / "best.json",
                             nlohmann::json{{"step", step}, {"eval_loss", *r.eval_loss},
                                            {"checkpoint", saved.filename().string()}}
                                     .dump(1) +
                                 "\n");
        }
      }
    }
    if (step == done + 1) result.first_loss = loss;
    result.last_loss = loss;
    result.skipped += !stepped.applied;
    result.steps = step;
  }
  if (report) {
    report->finish();
    result.metrics = report->metrics_path();
    result.curve = report->curve_path();
  }
  if (!options.export_dir.empty()) {
    trace::Span span("phase", "export");
    const auto start = Clock::now();
    ExportResult exported;
    if (lora.enabled() && !options.merge_lora) {
      exported = export_lora_adapter(engine, *comms.control, lora, adapters, options.model.string(),
                                     options.export_dir, export_options, comms.pipeline.get());
    } else {
      if (options.merge_lora) export_options.merge = LoraMerge{lora, adapters};
      exported = export_hf_model(engine, *comms.control, model_config, base, options.export_dir, export_options,
                                 comms.tensor.get(), comms.pipeline.get());
    }
    result.exported = exported.files;
    if (rank.rank == 0 && options.progress != nullptr) {
      const bool adapter = lora.enabled() && !options.merge_lora;
      fmt::print(options.progress, "  exported         {} ({}{} in {}, {:.1f} MB) in {:.1f} s\n",
                 options.export_dir.string(),
                 adapter ? "the LoRA adapter in PEFT's format"
                         : exported.files.size() == 1 ? "one file" : "sharded",
                 options.merge_lora ? ", merged with its LoRA adapter" : "",
                 adapter ? "fp32" : export_dtype_label(export_options), static_cast<double>(exported.tensor_nbytes) / 1e6,
                 seconds_since(start));
    }
  }
  if (tracing) {
    const trace::Summary traced = tracing->finish();
    if (rank.rank == 0 && options.progress != nullptr) {
      fmt::print(options.progress, "  trace            {}{} ({} events{}; open in ui.perfetto.dev)\n", traced.path,
                 rank.world_size > 1 ? " and the other ranks' files beside it" : "", traced.events,
                 traced.dropped > 0 ? fmt::format(", {} dropped", traced.dropped) : "");
      const std::string table = ops::op_totals_table(ops::op_totals(), "    ");
      if (!table.empty()) fmt::print(options.progress, "  time by op (rank 0, every step; timed on the compute stream)\n{}", table);
    }
  }
  return result;
}

}  // namespace strata::train
