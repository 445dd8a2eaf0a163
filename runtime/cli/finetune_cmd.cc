// `strata finetune`: train a model of the Llama family with ZeRO (runtime/train/finetune.h).
#include <fmt/format.h>

#include <memory>

#include "runtime/cli/commands.h"
#include "runtime/config/size.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/nn/lora.h"
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
                  "says. Any other model_type, a config.json key strata does not compute (e.g. rope_type dynamic) "
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
                  "Training data: prepared documents with loss masks (`strata data prepare` from chat, "
                  "prompt-completion or text JSONL), an llm.c token file (magic 20240520), raw uint16/uint32 "
                  "tokens, or text read as bytes (vocab 256)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--data-format", options->data_format,
                  "auto (by the file's magic number: prepared data or llm.c; any other file is refused), prepared, "
                  "llmc, u16, u32 or text")
      ->check(CLI::IsMember({"auto", "prepared", "llmc", "u16", "u32", "text"}))
      ->capture_default_str();
  cmd->add_flag("--no-packing{false}", options->packing,
                "Prepared data: one document per sample, padded (default: documents packed into each --seq "
                "window, positions restarting and attention kept within each document)");
  // Trainer-like flags: fill a Hugging Face Trainer ds_config's "auto" values.
  auto lr = std::make_shared<double>(0), weight_decay = std::make_shared<double>(0);
  auto micro = std::make_shared<int64_t>(0), accum = std::make_shared<int64_t>(0), warmup = std::make_shared<int64_t>(0);
  cmd->add_option("--lr", *lr, "Learning rate: fills \"auto\" in optimizer.params.lr and scheduler.params.warmup_max_lr "
                               "(as the Trainer's learning_rate); without --config it sets the built-in default's");
  cmd->add_option("--weight-decay", *weight_decay, "Fills \"auto\" in optimizer.params.weight_decay");
  cmd->add_option("--micro-batch", *micro, "Fills \"auto\" in train_micro_batch_size_per_gpu")->check(whole_number(1));
  cmd->add_option("--grad-accum", *accum, "Fills \"auto\" in gradient_accumulation_steps")->check(whole_number(1));
  cmd->add_option("--warmup-steps", *warmup, "Fills \"auto\" in scheduler.params.warmup_num_steps")
      ->check(whole_number(0));
  cmd->add_flag("--bf16", options->trainer.bf16, "Fills \"auto\" in bf16.enabled (true; absent: false)");
  cmd->add_flag("--fp16", options->trainer.fp16, "Fills \"auto\" in fp16.enabled (true; absent: false)");
  cmd->add_option("--eval-data", options->eval_data,
                  "Held-out data (same --data-format): its masked mean loss, forward only, is shown on the progress "
                  "line and written to metrics.jsonl (eval_loss) and loss.svg")
      ->check(CLI::ExistingFile);
  cmd->add_option("--eval-every", options->eval_every,
                  "Steps between evaluations (one also follows the last step); 0: only after the last")
      ->check(whole_number(0))
      ->capture_default_str();
  cmd->add_option("--eval-batches", options->eval_batches,
                  "Micro-batches per rank each evaluation reads from the start of --eval-data; 0: all of it")
      ->check(whole_number(0))
      ->capture_default_str();
  cmd->add_flag("--keep-best", options->keep_best,
                "With --save: also keep the checkpoint of the lowest evaluation loss (SAVE/best.json names it), "
                "whatever --keep-checkpoints removes");
  cmd->add_option("--steps", options->steps, "Optimizer steps")->check(whole_number(1))->capture_default_str();
  cmd->add_option("--seq", options->seq, "Tokens per sample")->check(whole_number(1))->capture_default_str();
  cmd->add_option("--seed", *seed, "Seed of the initialisation and the data order (default: strata.seed)")
      ->check(whole_unsigned());
  cmd->add_flag("--checkpoint-activations", options->checkpoint_activations,
               "Keep only each decoder layer's input in forward and recompute the layer in backward (less "
               "activation memory, about a quarter more compute); activation_checkpointing.cpu_checkpointing in "
               "the config also turns it on and keeps the checkpoints in pinned CPU memory");
  cmd->add_option("--tp", options->tensor_parallel,
                  "Tensor parallelism: this many consecutive ranks split each decoder layer's heads and MLP "
                  "features (tensor_parallel.autotp_size; must divide -n, the heads, kv heads and intermediate "
                  "size); the world / N data-parallel ranks split the batch")
      ->check(whole_number(1));
  cmd->add_option("--pp", options->pipeline_parallel,
                  "Pipeline parallelism: this many stages divide the decoder's layers (pipeline_parallel.size; the "
                  "world is pp x dp x tp); gradient_accumulation_steps micro-batches flow through them each step")
      ->check(whole_number(1));
  cmd->add_option("--pp-schedule", options->pipeline_schedule,
                  "The pipeline schedule (pipeline_parallel.schedule): gpipe, 1f1b, interleaved or zb-h1");
  cmd->add_option("--virtual-stages", options->virtual_stages,
                  "Chunks of layers per pipeline rank for the interleaved schedule (pipeline_parallel.virtual_stages)")
      ->check(whole_number(1));
  cmd->add_option("--micro-batch-order", options->micro_batch_order,
                  "The order of a step's micro-batches (strata.micro_batch_order): step-major (each through the whole "
                  "model in turn), layer-major (all through each decoder layer before the next, backwards layer by "
                  "layer: each layer's parameters fetched once forward and once backward per step; the same "
                  "parameters bit for bit) or auto (layer-major when the parameters are offloaded and "
                  "gradient_accumulation_steps > 1)");
  cmd->add_option("--moe-router-bias-update-rate", options->router_bias_update_rate,
                  "DeepSeek-V3's auxiliary-loss-free load balancing (moe.router_bias_update_rate; deepseek_v3, "
                  "kimi_k2, glm4_moe): after each step every MoE layer's e_score_correction_bias moves by this rate "
                  "towards balance, b_i += rate x sign(mean load - load_i), from the step's token counts over all "
                  "micro-batches and ranks; the bias is then checkpointed and exported as updated. 0: off "
                  "(transformers' behaviour, the default)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--cp", options->context_parallel,
                  "Context parallelism: this many ranks split every sequence, each holding 2 of its 2 x N chunks of "
                  "every layer (context_parallel.size; the world is dp x cp; --seq must divide by 2 x N); the "
                  "world / N data-parallel ranks split the batch")
      ->check(whole_number(1));
  cmd->add_option("--cp-method", options->context_method,
                  "How the attention crosses the --cp ranks (context_parallel.method): ring (keys and values passed "
                  "around them) or ulysses (all-to-alls between sequence and heads; the heads must divide by --cp)");
  cmd->add_flag("--sequence-parallel", options->sequence_parallel,
                "Megatron's sequence parallelism over the --tp ranks (the config's sequence_parallel): each keeps "
                "its share of the tokens' residual stream and norms, so every activation a layer saves is divided "
                "by --tp; micro-batch x --seq must divide by it");
  cmd->add_option("--freeze", options->freeze,
                  "Do not train the parameters whose Hugging Face names match this shell glob (repeatable; e.g. "
                  "'model.embed_tokens.*', '*norm*', 'model.layers.[0-9].*'): no gradient and no optimizer state "
                  "for them; a pattern that matches nothing is an error")
      ->take_all();
  cmd->add_option("--lora-rank", options->lora.rank,
                  "Train LoRA adapters of this rank r instead of the model: the base is frozen (no gradient, no "
                  "optimizer state, left out of checkpoints), each targeted projection gains y += s (x A^T) B^T with "
                  "A [r, in] (Kaiming-uniform) and B [out, r] (zero), fp32, as PEFT initialises and computes them")
      ->check(whole_number(1));
  cmd->add_option("--lora-alpha", options->lora.alpha,
                  "LoRA alpha: the adapters' scale s = alpha / r (default: 8, PEFT's)");
  auto lora_targets = std::make_shared<std::string>("q_proj,v_proj");
  cmd->add_option("--lora-targets", *lora_targets,
                  "Projections that get adapters, comma-separated from q_proj, k_proj, v_proj, o_proj, gate_proj, "
                  "up_proj, down_proj, or all-linear (all seven); the default is PEFT's for these models")
      ->capture_default_str();
  cmd->add_flag("--lora-rslora", options->lora.rslora, "Rank-stabilised LoRA: s = alpha / sqrt(r)");
  cmd->add_option("--lora-dropout", options->lora.dropout,
                  "Dropout on the adapters' input in training (PEFT's lora_dropout; its masks follow from the seed, "
                  "the step and the micro-batch, so a resumed run drops the same elements)")
      ->capture_default_str();
  cmd->add_option("--lora-init", options->lora_init,
                  "Start the adapters from a PEFT adapter directory (adapter_config.json + "
                  "adapter_model.safetensors, as --export writes or PEFT saves) instead of PEFT's initialisation; "
                  "its config sets r, alpha, rsLoRA, the targets and the dropout (--lora-dropout may change the "
                  "dropout); only plain LoRA is accepted");
  cmd->add_flag("--merge-lora", options->merge_lora,
                "With --export: write the merged model (each targeted W + s B A, a Hugging Face directory like "
                "any export) instead of the adapter in PEFT's format (adapter_config.json + "
                "adapter_model.safetensors, which PeftModel.from_pretrained loads onto the base)");
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
  cmd->add_option("--export-dtype", options->export_dtype,
                  "fp32, fp16, bf16 or fp8 (the decoder layers' linear weights block-quantized as DeepSeek's FP8 "
                  "checkpoints, 128 x 128 blocks or the source's, the rest bf16; with --lora-rank only merged); "
                  "default: the training dtype")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16", "fp8"}));
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
  on_selected(cmd, [cmd, options, seed, shard_size, lr, weight_decay, micro, accum, warmup, lora_targets] {
    if (cmd->count("--seed") > 0) options->seed = *seed;
    const bool lora = cmd->count("--lora-rank") > 0, init = cmd->count("--lora-init") > 0;
    for (const char* flag : {"--lora-rank", "--lora-alpha", "--lora-targets", "--lora-rslora"}) {
      STRATA_CHECK(!init || cmd->count(flag) == 0, kBadArgument,
                   "{} with --lora-init: the adapter's adapter_config.json sets it", flag);
    }
    for (const char* flag : {"--lora-alpha", "--lora-targets", "--lora-rslora", "--lora-dropout", "--merge-lora"}) {
      STRATA_CHECK(lora || init || cmd->count(flag) == 0, kBadArgument, "{} needs --lora-rank (LoRA adapters)",
                   flag);
    }
    options->lora_dropout_given = cmd->count("--lora-dropout") > 0;
    if (lora) {
      options->lora.targets = nn::parse_lora_targets(*lora_targets);
      if (cmd->count("--lora-alpha") == 0) options->lora.alpha = 8;
      options->lora.validate();
    }
    if (cmd->count("--lr") > 0) options->trainer.lr = *lr;
    if (cmd->count("--weight-decay") > 0) options->trainer.weight_decay = *weight_decay;
    if (cmd->count("--micro-batch") > 0) options->trainer.micro_batch = *micro;
    if (cmd->count("--grad-accum") > 0) options->trainer.grad_accum = *accum;
    if (cmd->count("--warmup-steps") > 0) options->trainer.warmup_steps = *warmup;
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
