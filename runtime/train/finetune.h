// `strata finetune`: the training loop of the main job, read top to bottom in
// finetune.cc. Each rank (started by `strata run`, torchrun or mpirun; alone
// it is rank 0 of 1) builds the accelerator, the rendezvous and the three
// communicators, a ZeroEngine from the ds_config, a DecoderModel on it (weights
// from a Hugging Face directory, loaded shard by shard into each rank's
// partitions, or a seeded initialisation that does not depend on the world
// size), reads its own samples of a token file, and runs optimizer steps of
// micro_batch x gradient_accumulation_steps x world sequences. The loss is
// normalised by the global count of predicted tokens. Rank 0 reports progress,
// writes metrics.jsonl and the loss curve.
//
// Errors: every bad input (config, model directory, data file, flags) is an
// Error naming the file or flag and what was wrong, raised before any training
// work; failures during training (I/O, a dead rank) propagate as Error.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "runtime/config/trainer_flags.h"
#include "runtime/nn/lora.h"

namespace strata::train {

struct FinetuneOptions {
  std::filesystem::path config;      // ds_config JSON; empty: the built-in defaults
  // Trainer-like flags: fill the config's "auto" values (runtime/config/trainer_flags.h).
  TrainerFlags trainer;
  std::filesystem::path model;       // HF directory (config.json + safetensors), or
  std::filesystem::path init;        // an HF config.json to initialise randomly
  std::filesystem::path data;        // token file or prepared data (runtime/data/batches.h)
  std::string data_format = "auto";  // auto | prepared | llmc | u16 | u32 | text
  bool packing = true;               // prepared data: several documents per --seq window
  // Evaluation (no gradient) on held-out data of the same kinds as `data`:
  // every eval_every steps (0: only after the last step), eval_batches
  // micro-batches per rank (0: the whole file once).
  std::filesystem::path eval_data;
  int64_t eval_every = 0;
  int64_t eval_batches = 0;
  // With --save: also keep the checkpoint of the lowest evaluation loss
  // (SAVE/best.json names it), whatever --keep-checkpoints removes.
  bool keep_best = false;
  int64_t steps = 100;               // optimizer steps
  int64_t seq = 256;                 // tokens per sample
  std::optional<uint64_t> seed;      // overrides strata.seed (init and data order)
  // Per-layer activation checkpointing (recompute in backward); also on when
  // the config sets activation_checkpointing.cpu_checkpointing.
  bool checkpoint_activations = false;
  // --tp: tensor parallelism (0: the config's tensor_parallel.autotp_size).
  int tensor_parallel = 0;
  // --pp, --pp-schedule, --virtual-stages: pipeline parallelism (0 / empty:
  // the config's pipeline_parallel keys; given both, they must agree).
  int pipeline_parallel = 0;
  std::string pipeline_schedule;
  int virtual_stages = 0;
  // --micro-batch-order: step-major | layer-major | auto (runtime/train/
  // micro_batch_order.h); empty: the config's strata.micro_batch_order.
  std::string micro_batch_order;
  // --moe-router-bias-update-rate: DeepSeek-V3's auxiliary-loss-free
  // balancing rate (moe.router_bias_update_rate); negative: the config's.
  double router_bias_update_rate = -1;
  // --cp, --cp-method: context parallelism (0 / empty: the config's
  // context_parallel keys; given both, they must agree).
  int context_parallel = 0;
  std::string context_method;
  // --sequence-parallel: Megatron's sequence parallelism over the tp ranks
  // (also on with the config's sequence_parallel true).
  bool sequence_parallel = false;
  // Parameters not trained (shell globs of their Hugging Face names,
  // runtime/train/freeze.h): no gradient and no optimizer state.
  std::vector<std::string> freeze;
  // LoRA adapters (runtime/nn/lora.h; rank 0: none): the base frozen and left
  // out of checkpoints, which record its identity (the weights files' sizes
  // and CRC-32s, or the seed of --init) and refuse to resume on another base.
  nn::LoraSpec lora;
  // Start the adapters from this PEFT adapter directory (runtime/train/peft_adapter.h)
  // instead of PEFT's initialisation; its adapter_config.json sets the LoRA
  // spec (lora above stays unset), except the dropout when lora_dropout_given.
  std::filesystem::path lora_init;
  bool lora_dropout_given = false;
  // With lora and export_dir: export the merged model (W + s B A) instead of
  // the adapter in PEFT's format.
  bool merge_lora = false;
  std::filesystem::path out = "finetune_out";  // metrics.jsonl, loss.svg
  std::filesystem::path save_dir;    // checkpoints (runtime/train/checkpoint.h); empty: none
  int64_t save_every = 100;          // steps between checkpoints (and one at the end)
  int keep_checkpoints = 2;          // complete checkpoints kept
  bool resume = false;               // continue from save_dir's newest complete checkpoint
  std::filesystem::path export_dir;  // empty: no export; else a Hugging Face directory at the end
  std::string export_dtype;          // fp32 | fp16 | bf16 | fp8 (hf_export.h); empty: the training dtype
  uint64_t export_shard_nbytes = 5'000'000'000;
  // Chrome/Perfetto trace JSON of the run, one file per rank ("{rank}" in the
  // path is replaced, else ".rank<N>" is added with several ranks; see
  // core/trace_recorder.h); empty: no trace. Created before any rank
  // connects, so a bad path fails at once; written at the end, and also when
  // the run fails (up to the failure).
  std::filesystem::path trace;
  std::FILE* progress = stderr;      // rank 0's progress lines; nullptr: none
};

// What the run did (rank 0's view; every rank returns the same losses).
struct FinetuneResult {
  int64_t steps = 0, skipped = 0;
  double first_loss = 0, last_loss = 0;
  std::vector<std::pair<int64_t, double>> eval_losses;  // (step, loss) of each evaluation
  int64_t best_step = 0;                                // --keep-best: the step kept
  std::filesystem::path metrics, curve;  // rank 0 only
  std::vector<std::filesystem::path> exported;  // files written by the export
};

FinetuneResult run_finetune(const FinetuneOptions& options);

}  // namespace strata::train
