// strata export: rebuild the model a checkpoint names, load it, export it.
#include "runtime/train/export_checkpoint.h"

#include <fmt/format.h>

#include <chrono>

#include "partition/rendezvous.h"
#include "runtime/launcher/launcher.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "core/log.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/pipeline/executor.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/zero_config.h"

namespace strata::train {

ExportResult export_checkpoint(const ExportCheckpointOptions& options) {
  const CheckpointInfo info = newest_checkpoint(options.checkpoint);
  const partition::RankInfo rank = launcher::rank_info_from_env();
  set_log_rank(rank.rank, rank.world_size);
  STRATA_CHECK(rank.world_size == info.world_size, kBadArgument,
               "{} was written by {} ranks and each rank loads its own shards: run `strata run -n {} -- strata "
               "export ...`",
               info.dir.string(), info.world_size, info.world_size);
  STRATA_CHECK(info.state.model.is_object() && info.state.model.contains("config"), kBadArgument,
               "{}/manifest.json does not say what model it holds (written by an older strata)", info.dir.string());
  // A LoRA run's checkpoint holds the adapters, not the base they adapt.
  STRATA_CHECK(!info.state.model.contains("lora"), kBadArgument,
               "{} is a checkpoint of a LoRA run: it holds the adapters only, not the base model they adapt. Export "
               "it by finishing the run: strata finetune with the same flags, --resume and --export DIR (add "
               "--merge-lora for a merged model)",
               info.dir.string());
  const nn::DecoderConfig config = nn::parse_decoder_config(info.state.model["config"], info.dir.string() + "/manifest.json");
  // A checkpoint holds what was trained: a gemma3 checkpoint's vision tower
  // stayed in the source model, and Gemma3ForConditionalGeneration without it
  // would load with a random one.
  STRATA_CHECK(!config.multimodal, kBadArgument,
               "{} is a checkpoint of the text model of a gemma3 checkpoint (Gemma3ForConditionalGeneration): it does "
               "not hold the vision tower and projector, which the run carried untrained from the source model, so "
               "its export would not load as that model. Export by finishing the run: strata finetune with the same "
               "flags, --resume and --export DIR",
               info.dir.string());
  const DType train_dtype = parse_dtype(info.state.model.value("dtype", std::string("fp32")));
  ExportOptions export_options;
  set_export_dtype(export_options, options.dtype, train_dtype, "--dtype");
  export_options.quant = config.quant;
  export_options.max_shard_nbytes = options.shard_nbytes;
  export_options.files = info.state.model_files;  // the source's tokenizer, template, generation config

  const auto start = std::chrono::steady_clock::now();
  auto accelerator = make_accelerator("auto");
  const auto timeout = std::chrono::milliseconds(300'000);
  partition::Rendezvous rendezvous(rank, timeout);
  // Each rank holds the experts the run's split gave it (moe.expert_parallel_size).
  const int expert_parallel = info.state.model.value("expert_parallel_size", 1);
  // ... and the tp shards of its tp rank (tensor_parallel.autotp_size).
  const int tensor_parallel = info.state.model.value("tensor_parallel_size", 1);
  // ... and its pipeline stage's layers (pipeline_parallel.size and the split).
  const int pipeline_parallel = info.state.model.value("pipeline_parallel_size", 1);
  const std::vector<int64_t> stage_layers =
      info.state.model.value("pipeline_layers", std::vector<int64_t>{});
  // ... and ZeRO's partition over the dp x cp ranks (context_parallel.size).
  const int context_parallel = info.state.model.value("context_parallel_size", 1);
  const ZeroCommunicators comms = make_zero_communicators(*accelerator, rendezvous.store(), rank.rank,
                                                          rank.world_size, timeout, "strata/export", expert_parallel,
                                                          tensor_parallel, pipeline_parallel, context_parallel);
  // The shard layout does not depend on the stage or the tiers: load into the simplest engine.
  engine::ZeroEngineOptions zero;
  zero.stage = 3;
  zero.expert_parallel_size = expert_parallel;
  engine::ZeroEngine engine(*accelerator, comms.comms(), zero);
  nn::DecoderModelOptions model_options;
  model_options.dtype = train_dtype;
  // The stage's models: one chunk per split entry this rank holds (virtual stages: entries / size).
  std::vector<std::unique_ptr<nn::DecoderModel>> models;
  if (pipeline_parallel > 1) {
    const int virtual_stages = static_cast<int>(stage_layers.size()) / pipeline_parallel;
    const pipeline::ScheduleSpec spec{virtual_stages > 1 ? pipeline::ScheduleKind::kInterleaved
                                                         : pipeline::ScheduleKind::k1F1B,
                                      pipeline_parallel, pipeline_parallel, virtual_stages};
    models = pipeline::make_stage_models(engine, config, model_options, spec, *comms.pipeline, stage_layers);
  } else {
    models.push_back(std::make_unique<nn::DecoderModel>(engine, config, model_options));
  }
  std::vector<engine::ParamId> params;
  for (const auto& model : models) {
    for (engine::ParamId id : model->parameters()) params.push_back(id);
  }
  engine.finalize();
  const bool is_step_dir = info.dir == options.checkpoint || std::filesystem::equivalent(info.dir, options.checkpoint);
  Checkpoints checkpoints(info.dir.parent_path(), 1);
  const auto loaded = checkpoints.find_and_load(engine, is_step_dir ? std::optional<int64_t>(info.state.step)
                                                                    : std::nullopt);
  STRATA_CHECK(loaded.has_value(), kBadArgument, "{}: no complete checkpoint to export", options.checkpoint.string());
  if (rank.rank == 0 && config.mtp_layers > 0) {
    // A checkpoint holds what was trained: the MTP modules' weights stayed in the source model.
    logger().warn("{}: the checkpoint does not hold the {} multi-token prediction module(s) (model.layers.{}.*), "
                  "which the run carried untrained: the export has none; copy them from the source model "
                  "(strata finetune --export writes them)",
                  options.checkpoint.string(), config.mtp_layers, config.num_hidden_layers);
  }
  const ExportResult result =
      export_hf_model(engine, *comms.control, config, params, options.out, export_options, comms.tensor.get(),
                      comms.pipeline.get());
  if (rank.rank == 0 && options.progress != nullptr) {
    fmt::print(options.progress, "exported step {} of {} to {} ({} file(s), {} in {}, {:.1f} MB) in {:.1f} s\n",
               loaded->step, checkpoints.root().string(), options.out.string(), result.files.size(),
               export_dtype_label(export_options), result.files.size() > 1 ? "sharded" : "one file",
               static_cast<double>(result.tensor_nbytes) / 1e6,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return result;
}

}  // namespace strata::train
