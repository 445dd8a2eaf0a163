// strata-train's ZeRO mode (--zero 1|2|3): the resident benchmark's Llama
// trained through a ZeroEngine — ZeRO stage, parameter and optimizer tiers as
// the flags say — one rank per process under `strata run -n N`, or N threads
// of this process with --ranks N. Per step it reports tokens/s and the step's
// breakdown (compute, stall on parameters, stall on gradients, optimizer),
// the bytes moved per tier, and the step's ratio to its bound, max(the same
// step with everything resident, parameter bytes read / the drive's read
// bandwidth), each measured in the same run. Definitions: PERFORMANCE.md.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "runtime/engine/zero_engine.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/nn/decoder_model.h"

namespace strata::bench::train {

// What the resident benchmark's flags say that the ZeRO mode uses too.
struct ModelRun {
  nn::DecoderConfig config;
  int64_t batch = 0, seq = 0;  // sequences per rank per step, tokens per sequence
  std::string dtype, accelerator, json;
  int threads = 0, steps = 0, warmup = 0, rounds = 0;
  bool checkpoint_activations = false, cpu_checkpointing = false;
  bool skip_unrouted_experts = true;  // DecoderModelOptions' (strata-train --all-experts: false)
};

struct ZeroFlags {
  int stage = 0;  // 0: the resident benchmark, not the ZeRO mode
  std::string offload_param = "none", offload_optimizer = "none", nvme_dir;
  // The gradient shard: "auto" as a config gets it (runtime/config/
  // engine_options.cc: on NVMe with an nvme optimizer, ZeRO-Infinity's
  // gradient swapping, else in accelerator memory), "none" (accelerator
  // memory) or "nvme".
  std::string offload_grad = "auto";
  // Leave out the resident reference model (the whole model and its
  // gradients, resident, per rank): no resident step in the bound and no
  // first-loss check, so peak host RSS is the ZeRO engine's alone.
  bool no_resident = false;
  bool layer_breakdown = false;  // print the per-layer table (always with experts)
  int ranks = 0;  // threads of this process when not started by `strata run`; 0: 1
  bool vs_unoffloaded = false;  // also time the same stage with nothing offloaded
  int expert_parallel = 1;  // --ep: moe.expert_parallel_size (needs --experts)
  // --cp N [--cp-method]: context parallelism (issue 46), the ranks in cp
  // groups of N that each hold 2 of 2N chunks of every sequence; ZeRO over
  // dp x cp, dp = ranks / cp.
  int context_parallel = 1;
  std::string context_method = "ring";
  float lr = 1e-3f;
  int64_t drive_test_mib = 1024;  // the bandwidth probe's file
  bool overlap_optimizer = true;  // prepare_step before each step's backward
  std::string overlap_policy = "auto";  // ZeroEngine::set_overlap_policy: auto, speculate, read-ahead
  // Micro-batches per step, their gradients accumulated (--micro-batches
  // without --pp), each --batch sequences (the same tokens each), and their
  // order (--micro-batch-order: step-major, layer-major or auto;
  // runtime/train/micro_batch_order.h).
  int micro_batches = 1;
  std::string micro_batch_order = "step-major";
  // --layer-major-activations: recompute or keep (strata.layer_major_activations).
  std::string layer_major_activations = "recompute";
  // The coordinator's budgets and aio: DeepSpeed's defaults
  // (ZeroEngineOptions'), settable per flag; sub_group_size and
  // reduce_bucket_size: chosen from the model (engine::kChooseFromModel)
  // unless --sub-group / --reduce-bucket give them.
  engine::ZeroEngineOptions engine;
};

// Adds --zero, --offload-param, --offload-optimizer, --nvme-dir, --ranks and
// the engine's knobs to `app`, bound to `flags`.
void add_zero_flags(CLI::App& app, ZeroFlags& flags);

// The engine options the flags say (tiers, Adam, threads, the swap directory
// under --nvme-dir), and the model's.
engine::ZeroEngineOptions zero_options(const ModelRun& run, const ZeroFlags& flags);
nn::DecoderModelOptions model_options(const ModelRun& run);
// With the flags' context-parallel method.
nn::DecoderModelOptions model_options(const ModelRun& run, const ZeroFlags& flags);

// Runs the ZeRO benchmark; rank 0 prints (and writes run.json). Returns the
// exit status: 0, or 1 when a correctness check failed. Throws strata::Error
// for bad flags or a failed run.
int run_zero(const ModelRun& run, const ZeroFlags& flags);

}  // namespace strata::bench::train
