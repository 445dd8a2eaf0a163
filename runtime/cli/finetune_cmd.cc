// `strata finetune`: train a model of the Llama family with ZeRO (runtime/train/finetune.h).
#include <fmt/format.h>

#include <memory>

#include "runtime/cli/commands.h"
#include "runtime/config/size.h"
#include "runtime/nn/llama_config.h"
#include "core/error.h"
#include "runtime/launcher/interrupt.h"
#include "runtime/train/finetune.h"

namespace strata::cli {

void add_finetune_command(CLI::App& app) {
  auto options = std::make_shared<train::FinetuneOptions>();
  auto seed = std::make_shared<uint64_t>(0);
  CLI::App* cmd = app.add_subcommand(
      "finetune",
      fmt::format("Fine-tune (or train from scratch) a decoder of the families {} with ZeRO stage 1/2/3, "
                  "parameters and optimizer state in device memory, pinned CPU memory or on NVMe as the config "
                  "says. Any other model_type, a config.json key strata does not compute (e.g. rope_type yarn) "
                  "or a checkpoint tensor the architecture does not use is refused before training. Run one "
                  "process per rank: `strata run -n N -- strata finetune ...`; alone it is one rank. Rank 0 "
                  "shows progress and writes OUT/metrics.jsonl (one JSON object per step) and OUT/loss.svg.",
                  nn::supported_model_types()));
  cmd->add_option("--config", options->config,
                  "DeepSpeed-style JSON config (checked as `strata config check` does); default: ZeRO-3 in "
                  "memory, AdamW lr 1e-4, micro-batch 1")
      ->check(CLI::ExistingFile);
  cmd->add_option("--model", options->model,
                  "Hugging Face model directory: config.json and model.safetensors (or sharded, with "
                  "model.safetensors.index.json); each rank loads only its partitions");
  cmd->add_option("--init", options->init,
                  "Start from random weights with the shape of this HF config.json instead of --model (the "
                  "same model for any world size)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--data", options->data,
                  "Token file: llm.c format (magic 20240520), raw uint16/uint32 tokens, or text read as bytes "
                  "(vocab 256)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--data-format", options->data_format, "auto, llmc, u16, u32 or text")
      ->check(CLI::IsMember({"auto", "llmc", "u16", "u32", "text"}))
      ->capture_default_str();
  cmd->add_option("--steps", options->steps, "Optimizer steps")->check(whole_number(1))->capture_default_str();
  cmd->add_option("--seq", options->seq, "Tokens per sample")->check(whole_number(1))->capture_default_str();
  cmd->add_option("--seed", *seed, "Seed of the initialisation and the data order (default: strata.seed)")
      ->check(whole_unsigned());
  cmd->add_flag("--checkpoint-activations", options->checkpoint_activations,
               "Keep only each decoder layer's input in forward and recompute the layer in backward (less "
               "activation memory, about a quarter more compute); activation_checkpointing.cpu_checkpointing in "
               "the config also turns it on and keeps the checkpoints in pinned CPU memory");
  cmd->add_option("--freeze", options->freeze,
                  "Do not train the parameters whose Hugging Face names match this shell glob (repeatable; e.g. "
                  "'model.embed_tokens.*', '*norm*', 'model.layers.[0-9].*'): no gradient and no optimizer state "
                  "for them; a pattern that matches nothing is an error")
      ->take_all();
  cmd->add_option("--out", options->out, "Directory for metrics.jsonl and loss.svg")->capture_default_str();
  cmd->add_option("--save", options->save_dir,
                  "Checkpoint directory: DIR/step_<N>/ with every rank's shards and optimizer state and a manifest "
                  "written last, so a crash never leaves a checkpoint that looks complete");
  cmd->add_option("--save-every", options->save_every, "Steps between checkpoints (one is also taken at the end)")
      ->check(whole_number(1))
      ->capture_default_str();
  cmd->add_option("--keep-checkpoints", options->keep_checkpoints, "Complete checkpoints kept; older ones are removed")
      ->check(whole_number(1, 1 << 30))
      ->capture_default_str();
  cmd->add_flag("--resume", options->resume,
                "Continue from the newest complete checkpoint in --save DIR (same world size), exactly where it "
                "stopped: parameters, optimizer state, loss scale, learning-rate schedule, data position");
  cmd->add_option("--export", options->export_dir,
                  "At the end, write a Hugging Face directory here (config.json + safetensors, streamed tensor by "
                  "tensor; transformers' from_pretrained loads it)");
  cmd->add_option("--export-dtype", options->export_dtype, "fp32, fp16 or bf16 (default: the training dtype)")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  auto shard_size = std::make_shared<std::string>("5GB");
  cmd->add_option("--export-shard-size", *shard_size,
                  "Largest safetensors file of the export; past it the weights are sharded with "
                  "model.safetensors.index.json")
      ->capture_default_str();
  cmd->add_option("--trace", options->trace,
                  "Write a timeline of the run as Chrome/Perfetto trace JSON (open it in ui.perfetto.dev): a track "
                  "per I/O worker, communicator and stream thread, spans for each step's phases, I/O requests "
                  "and collectives with bytes and GB/s. One file per rank: {rank} in FILE is replaced by the "
                  "rank, else .rank<N> goes before .json when there are several ranks");
  on_selected(cmd, [cmd, options, seed, shard_size] {
    if (cmd->count("--seed") > 0) options->seed = *seed;
    const std::optional<uint64_t> shard_nbytes = parse_size(*shard_size);
    STRATA_CHECK(shard_nbytes && *shard_nbytes > 0, kBadArgument,
                 "--export-shard-size: \"{}\" is not a size (e.g. 5GB, 500MiB, 1000000)", *shard_size);
    options->export_shard_nbytes = *shard_nbytes;
    // Ctrl-C and SIGTERM remove the swap files and keep the checkpoints (before any thread starts).
    launcher::install_interrupt_cleanup("strata finetune");
    const train::FinetuneResult result = train::run_finetune(*options);
    (void)result;
    return 0;
  });
}

}  // namespace strata::cli
