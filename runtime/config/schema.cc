// The table of configuration keys with their defaults (DeepSpeed v0.19's where the
// key is shared) and documentation.
#include "runtime/config/schema.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <set>

#include "nvme/io_options.h"
#include "core/error.h"

namespace strata {
namespace {

using nlohmann::json;

ConfigField field(std::string path, FieldKind kind, json default_value, std::string doc) {
  ConfigField f;
  f.path = std::move(path);
  f.kind = kind;
  f.default_value = std::move(default_value);
  f.doc = std::move(doc);
  return f;
}
ConfigField flag(std::string path, bool default_value, std::string doc) {
  return field(std::move(path), FieldKind::kBool, default_value, std::move(doc));
}
ConfigField integer(std::string path, int64_t default_value, double min, double max, std::string doc) {
  ConfigField f = field(std::move(path), FieldKind::kInt, default_value, std::move(doc));
  f.min = min;
  f.max = max;
  return f;
}
ConfigField number(std::string path, double default_value, double min, double max, std::string doc) {
  ConfigField f = field(std::move(path), FieldKind::kNumber, default_value, std::move(doc));
  f.min = min;
  f.max = max;
  return f;
}
ConfigField size(std::string path, uint64_t default_value, std::string unit, double min, std::string doc) {
  ConfigField f = field(std::move(path), FieldKind::kSize, default_value, std::move(doc));
  f.unit = std::move(unit);
  f.min = min;
  return f;
}
// A size whose default is chosen from the model (null in the effective config).
ConfigField chosen_size(std::string path, std::string doc) {
  ConfigField f = field(std::move(path), FieldKind::kSize, nullptr, std::move(doc));
  f.unit = "elements";
  f.min = 1;
  return f;
}
ConfigField choice(std::string path, std::string default_value, std::vector<std::string> choices,
                   std::string doc) {
  ConfigField f = field(std::move(path), FieldKind::kEnum, default_value, std::move(doc));
  f.choices = std::move(choices);
  return f;
}
ConfigField text(std::string path, std::string default_value, std::string doc) {
  return field(std::move(path), FieldKind::kString, default_value, std::move(doc));
}
ConfigField ignored(ConfigField f) {
  f.no_effect = true;
  return f;
}

std::vector<ConfigField> build_fields() {
  const std::vector<std::string> devices = {"none", "cpu", "nvme"};
  std::vector<ConfigField> f;
  // Batch and step.
  f.push_back(integer("train_micro_batch_size_per_gpu", 1, 1, 1 << 20, "Sequences per rank per micro-step."));
  f.push_back(integer("gradient_accumulation_steps", 1, 1, 1 << 20, "Micro-steps whose gradients are summed before each optimizer step."));
  f.push_back(integer("train_batch_size", 0, 0, 1e12, "Global batch = micro batch x accumulation x world size; 0 derives it. When set, must be divisible by micro batch x accumulation."));
  f.push_back(number("gradient_clipping", 0.0, 0, kUnbounded, "Clip the global gradient L2 norm to this value; 0 disables clipping."));
  f.push_back(integer("steps_per_print", 10, 1, 1e12, "Log loss and throughput every this many optimizer steps."));
  f.push_back(ignored(flag("wall_clock_breakdown", false, "DeepSpeed timing breakdown; strata writes its timeline with strata.trace_path instead.")));
  f.push_back(ignored(flag("zero_allow_untested_optimizer", false, "DeepSpeed safety switch; strata only runs its own optimizers.")));
  // Mixture of experts.
  {
    ConfigField ep = integer("moe.expert_parallel_size", 1, 1, 1 << 16, "Expert parallelism for a mixture-of-experts model (mixtral, qwen3_moe, qwen2_moe, deepseek_v3, kimi_k2, glm4_moe, gpt_oss): this many data-parallel ranks split each layer's experts between them, each holding num_local_experts / N experts and their optimizer state and running them on the tokens every member routes to them (an all-to-all before and after the experts); the experts are partitioned over the ranks that hold the same ones. Must divide the world size and the number of experts. Left out (or null): the world size when it divides the number of experts, else 1 (logged at start). 1: every rank holds every expert (ZeRO partitions them like any parameter). With LoRA (`--lora-rank`) the experts are frozen and split the same way: only the attention's adapters train (docs/DESIGN.md §4.2.1).");
    ep.default_value = nullptr;
    f.push_back(ep);
  }
  f.push_back(number("moe.router_bias_update_rate", 0, 0, 1, "DeepSeek-V3's auxiliary-loss-free load balancing (Megatron's moe_router_bias_update_rate) for the models with a correction bias (deepseek_v3, kimi_k2, glm4_moe; any other model is refused when it is not 0): after each optimizer step every MoE layer's e_score_correction_bias becomes b_i + rate x sign(mean load - load_i) in fp32, load_i the tokens routed to expert i in that step, over all its micro-batches and ranks (the counts every rank agrees on; sign(0) = 0). The bias is then trained state: saved in checkpoints, resumed exactly and exported as updated. 0 (the default, and transformers' behaviour): the bias is a buffer, never changed. With LoRA the checkpoints then hold the frozen base too (the biases are in its fp32 group), and the export must be merged (--merge-lora): a PEFT adapter has no place for the biases. strata finetune --moe-router-bias-update-rate sets it too."));
  // Tensor parallelism.
  f.push_back(integer("tensor_parallel.autotp_size", 1, 1, 1 << 16, "Tensor parallelism (DeepSpeed's AutoTP key, Megatron's layout): this many consecutive ranks split each decoder layer — column-parallel q/k/v and gate/up, row-parallel o and down, each rank num_attention_heads / N heads and intermediate_size / N MLP features — and sum the partial outputs with an allreduce; ZeRO partitions each shard over the ranks holding the same one (the world / N data-parallel ranks), which split the batch. Must divide the world size, num_attention_heads and intermediate_size, and divide num_key_value_heads or be a multiple of it (then tp / num_key_value_heads ranks share each kv head). The embedding, lm_head and norms are replicated. Not yet with experts, LoRA or MLP tiling (refused by name)."));
  f.push_back(integer("pipeline_parallel.size", 1, 1, 1 << 16, "Pipeline parallelism: this many stages divide the decoder's layers (equal by default, or as pipeline_parallel.layers says; the embedding on the first stage, the final norm and lm_head on the last), each holding and streaming its share of the model, micro-batches flowing through them — activations forward, gradients back, point to point. Ranks are laid out world = pp x dp x tp (Megatron's order: tp fastest, then dp, then pp); ZeRO partitions each stage over its dp ranks, which split the batch. gradient_accumulation_steps is the number of micro-batches each step pipelines. Must divide the world size (with autotp_size)."));
  f.push_back(choice("pipeline_parallel.schedule", "1f1b", {"gpipe", "1f1b", "interleaved", "zb-h1"}, "The pipeline schedule: gpipe (every forward, then every backward: all micro-batches in flight), 1f1b (Megatron's: p - r - 1 warm-up forwards on stage r, then one forward and one backward in turn: at most p - r in flight; bubble (p-1)/(m+p-1)), interleaved (Megatron's interleaved 1F1B over pipeline_parallel.virtual_stages chunks per rank: bubble divided by v; the micro-batches, gradient_accumulation_steps, must be a multiple of the size) or zb-h1 (Zero Bubble's ZB-H1: the backward split into the input gradient and the weight gradients, the latter deferred into the bubble; 1f1b's memory, about a third of its bubble)."));
  f.push_back(integer("pipeline_parallel.virtual_stages", 1, 1, 1 << 10, "Chunks of layers per rank for the interleaved schedule (2 or more; 1 otherwise): virtual stage k x size + r is chunk k of stage r (Megatron's placement)."));
  ConfigField layers = field("pipeline_parallel.layers", FieldKind::kIntList, json::array(), "Decoder layers per (virtual) stage, in order: one entry per stage (size x virtual_stages), each at least 1, summing to num_hidden_layers. Empty: as equal as possible, the first stages taking one more.");
  layers.min = 1;
  layers.max = 1 << 20;
  f.push_back(layers);
  f.push_back(integer("context_parallel.size", 1, 1, 1 << 16, "Context parallelism (issue 46; Megatron's CP): this many ranks split every sequence, each holding 2 of its 2 x N chunks (rank c chunks c and 2N-1-c, Megatron's load balance for the causal mask) of every layer's activations, the attention crossing them as context_parallel.method says; positions, packed documents and sliding windows are taken in the whole sequence, and the loss, its token count and every gradient are summed over the N ranks as over data parallelism (ZeRO partitions over all ranks holding the same parameters, dp x cp of them). Ranks are laid out world = dp x cp x tp (Megatron's order: tp fastest, then cp): with tensor parallelism each tp rank runs the attention over its own cp group on its own heads, and sequence parallelism shards a cp rank's tokens. The sequence length must divide by 2 x N. LoRA adapters are summed over the N ranks like any parameter. Not yet with pipeline parallelism, mixture-of-experts models, multi-head latent attention or layer-major micro-batches (refused by name)."));
  f.push_back(choice("context_parallel.method", "ring", {"ring", "ulysses"}, "How the attention crosses the context-parallel ranks: ring (keys and values of the kv heads passed around the ranks, each hop overlapped with the attention of the chunk in hand, the blocks merged by their log-sum-exps) or ulysses (DeepSpeed Ulysses: an all-to-all from sequence- to head-sharded q/k/v and back; num_attention_heads and num_key_value_heads, a tp rank's with tensor parallelism, must divide by context_parallel.size)."));
  f.push_back(flag("sequence_parallel", false, "Megatron's sequence parallelism on top of tensor parallelism: the residual stream, the norms and what they save for backward hold each tensor-parallel rank's share of the micro-batch's tokens, gathered before each attention and MLP block and reduce-scattered after it, so every activation a layer keeps is divided by the tensor-parallel size at no extra traffic but a gather of each block's input in backward. Needs tensor_parallel.autotp_size (or --tp) of 2 or more, and micro-batch x seq divisible by it."));
  // Precision.
  f.push_back(flag("bf16.enabled", false, "Train with bf16 parameters and gradients (fp32 master weights)."));
  f.push_back(flag("fp16.enabled", false, "Train with fp16 parameters and gradients, with loss scaling."));
  f.push_back(number("fp16.loss_scale", 0.0, 0, kUnbounded, "Static loss scale; 0 selects dynamic loss scaling."));
  f.push_back(integer("fp16.initial_scale_power", 16, 0, 64, "Dynamic scaling starts at 2^initial_scale_power."));
  f.push_back(integer("fp16.loss_scale_window", 1000, 1, INT_MAX, "Steps without overflow before the dynamic scale doubles."));
  f.push_back(integer("fp16.hysteresis", 2, 1, 1e6, "Overflows tolerated before the dynamic scale halves."));
  f.push_back(number("fp16.min_loss_scale", 1.0, 0, kUnbounded, "Lower bound of the dynamic loss scale."));
  // Optimizer.
  f.push_back(choice("optimizer.type", "AdamW", {"Adam", "AdamW"}, "Adam (L2 weight decay added to the gradient) or AdamW (decoupled weight decay), PyTorch's formulas."));
  f.push_back(number("optimizer.params.lr", 1e-3, 0, 1e30, "Learning rate."));
  ConfigField betas = field("optimizer.params.betas", FieldKind::kNumberPair, json::array({0.9, 0.999}), "Adam's (beta1, beta2), each in [0, 1).");
  betas.min = 0;
  betas.max = 0.9999999;  // below 1 once rounded to the optimizer's float
  f.push_back(betas);
  f.push_back(number("optimizer.params.eps", 1e-8, 0, 1, "Added to the square root of the second moment."));
  f.push_back(number("optimizer.params.weight_decay", 0.01, 0, 1e30, "Weight decay (decoupled for AdamW)."));
  f.push_back(ignored(flag("optimizer.params.torch_adam", false, "DeepSpeed's choice of torch's Adam; strata uses its own CPU/CUDA Adam.")));
  f.push_back(ignored(flag("optimizer.params.adam_w_mode", true, "DeepSpeed's Adam/AdamW switch; use optimizer.type.")));
  // ZeRO.
  // Learning-rate schedule (DeepSpeed's scheduler block; runtime/engine/lr_schedule.h).
  // Defaults that depend on the type (WarmupDecayLR warms up to 0.001, WarmupLR
  // to the optimizer's lr) are applied by the schedule, not here.
  f.push_back(choice("scheduler.type", "Constant", {"Constant", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}, "Learning-rate schedule; Constant keeps optimizer.params.lr."));
  f.push_back(number("scheduler.params.warmup_min_lr", 0, 0, kUnbounded, "WarmupLR/WarmupDecayLR: rate at the first step."));
  f.push_back(number("scheduler.params.warmup_max_lr", 0.001, 0, kUnbounded, "WarmupLR/WarmupDecayLR: rate at the end of warmup (WarmupLR: the optimizer's lr when absent)."));
  f.push_back(integer("scheduler.params.warmup_num_steps", 1000, 1, 1e12, "Optimizer steps of warmup."));
  f.push_back(choice("scheduler.params.warmup_type", "log", {"log", "linear"}, "Warmup curve."));
  f.push_back(integer("scheduler.params.total_num_steps", 0, 0, 1e12, "WarmupDecayLR/WarmupCosineLR (required there, >= 1): the step where decay ends; 0: not set."));
  f.push_back(number("scheduler.params.warmup_min_ratio", 0, 0, 1, "WarmupCosineLR: lr ratio at the first step."));
  f.push_back(number("scheduler.params.cos_min_ratio", 1e-4, 0, 1, "WarmupCosineLR: lr ratio at the end of the cosine."));
  f.push_back(ignored(integer("scheduler.params.last_batch_iteration", -1, -1, 1e12, "DeepSpeed resume position; strata checkpoints its own step count.")));
  f.push_back(integer("zero_optimization.stage", 1, 0, 3, "ZeRO stage: 1 optimizer state sharded, 2 plus gradients, 3 plus parameters. 0 (DeepSpeed's default: no partitioning) is refused: strata partitions at least the optimizer state, and stage 1 computes the same step, so 1 is the default here."));
  f.push_back(choice("zero_optimization.offload_param.device", "none", devices, "Where parameter shards live between uses (stage 3 only)."));
  f.push_back(text("zero_optimization.offload_param.nvme_path", "", "Directory for parameter swap files; required with device nvme."));
  f.push_back(ignored(flag("zero_optimization.offload_param.pin_memory", true, "DeepSpeed's choice of pageable staging; strata always stages parameters through its own page-locked buffers (offload_param.buffer_count x buffer_size), so false would not save memory here.")));
  f.push_back(integer("zero_optimization.offload_param.buffer_count", 5, 1, 1 << 20, "Pinned buffers for parameters in flight from NVMe."));
  f.push_back(size("zero_optimization.offload_param.buffer_size", 100000000, "elements", 1, "Elements per parameter swap buffer."));
  f.push_back(ignored(size("zero_optimization.offload_param.max_in_cpu", 1000000000, "elements", 0, "DeepSpeed's CPU cache of NVMe-offloaded parameters; strata keeps none: every NVMe slice is read through the staging buffers (offload_param.buffer_count x buffer_size) ahead of its use.")));
  f.push_back(choice("zero_optimization.offload_optimizer.device", "none", devices, "Where optimizer state (fp32 master, momentum, variance) lives and is updated: none on the accelerator (needs offload_param none), cpu and nvme by the CPU optimizer."));
  f.push_back(text("zero_optimization.offload_optimizer.nvme_path", "", "Directory for optimizer-state swap files; required with device nvme."));
  f.push_back(ignored(flag("zero_optimization.offload_optimizer.pin_memory", true, "DeepSpeed's choice of pageable staging; strata always stages optimizer state through its own page-locked pipeline buffers (offload_optimizer.buffer_count).")));
  f.push_back(integer("zero_optimization.offload_optimizer.buffer_count", 4, 2, 1 << 20, "Pinned buffers for the optimizer swap pipeline (read, update, write): at least 2 (one read ahead while one updates); 3 overlap fully."));
  f.push_back(ignored(integer("zero_optimization.offload_optimizer.pipeline_read", 0, 0, 1, "DeepSpeed pipelining switch; strata always pipelines the NVMe optimizer step.")));
  f.push_back(ignored(integer("zero_optimization.offload_optimizer.pipeline_write", 0, 0, 1, "DeepSpeed pipelining switch; strata always pipelines the NVMe optimizer step.")));
  f.push_back(ignored(flag("zero_optimization.offload_optimizer.fast_init", false, "DeepSpeed initialisation shortcut; not needed in strata.")));
  // Left out: chosen from the model's decoder layers when the engine is
  // finalized (runtime/engine/zero_sizes.h); the default is null ("not
  // given"), not DeepSpeed's 1e9 / 5e8, which give any model under a billion
  // parameters one sub-group and one bucket, so nothing overlaps backward.
  f.push_back(chosen_size("zero_optimization.sub_group_size", "Optimizer step granularity: elements of this rank's shard updated per pipeline stage (and, with strata.overlap_optimizer, per update during backward). Left out (or null): one decoder layer's share of the shard, at most 256 MiB of optimizer state, chosen from the model and logged at start (DeepSpeed's default, 1e9, gives a model under a billion parameters one sub-group)."));
  f.push_back(chosen_size("zero_optimization.reduce_bucket_size", "Elements per gradient reduce-scatter bucket. Left out (or null): one decoder layer's gradients plus a norm's, at most 256 MiB, chosen from the model and logged at start (DeepSpeed's default is 5e8). \"auto\" (a Hugging Face Trainer config) is the Trainer's hidden_size^2 in strata finetune (which reads the model with the config); elsewhere (strata config check, strata plan, the C API) DeepSpeed's 5e8."));
  f.push_back(ignored(flag("zero_optimization.overlap_comm", true, "strata always overlaps gradient reduction with backward (each bucket is reduce-scattered on its own stream as it fills).")));
  f.push_back(ignored(flag("zero_optimization.contiguous_gradients", true, "strata always packs gradients into contiguous reduce buckets (reduce_bucket_size).")));
  f.push_back(size("zero_optimization.stage3_prefetch_bucket_size", 50000000, "elements", 0, "Parameter elements prefetched ahead of use (stage 3)."));
  f.push_back(size("zero_optimization.stage3_param_persistence_threshold", 100000, "elements", 0, "Parameters smaller than this stay gathered on the device (stage 3)."));
  f.push_back(size("zero_optimization.stage3_max_live_parameters", 1000000000, "elements", 1, "Upper bound of gathered parameter elements on the device (stage 3)."));
  f.push_back(size("zero_optimization.stage3_max_reuse_distance", 1000000000, "elements", 0, "Keep a gathered parameter if it is used again within this many elements of other parameters."));
  f.push_back(ignored(flag("zero_optimization.allgather_partitions", true, "DeepSpeed stage 1/2 switch; strata always allgathers partitions.")));
  f.push_back(ignored(size("zero_optimization.allgather_bucket_size", 500000000, "elements", 1, "DeepSpeed stage 1/2 bucket; strata sizes allgathers by parameter.")));
  f.push_back(ignored(flag("zero_optimization.reduce_scatter", true, "DeepSpeed stage 1/2 switch; strata always reduce-scatters.")));
  f.push_back(ignored(flag("zero_optimization.round_robin_gradients", false, "DeepSpeed stage 1/2 option; not applicable.")));
  f.push_back(ignored(flag("zero_optimization.stage3_gather_16bit_weights_on_model_save", false, "DeepSpeed save option; strata checkpoints shards and converts with its own tools.")));
  // Asynchronous I/O.
  f.push_back(size("aio.block_size", 1048576, "bytes", 4096, "Bytes per I/O request piece; a multiple of 4096 (O_DIRECT), at most 1 GiB."));
  f.push_back(integer("aio.queue_depth", 8, 1, nvme::kMaxQueueDepth,
                      "Requests in flight per I/O worker."));
  f.push_back(integer("aio.thread_count", 1, 1, nvme::kMaxThreadCount,
                      "I/O workers, each with its own ring. Alias: intra_op_parallelism."));
  f.push_back(choice("aio.engine", "uring", {"uring", "aio", "psync"}, "NVMe I/O backend: io_uring, libaio, or pread/pwrite (`strata-io tune` measures which is faster; `strata.io_engine` is its older name)."));
  f.push_back(flag("aio.single_submit", false, "Submit requests one at a time instead of in batches."));
  f.push_back(flag("aio.overlap_events", true, "Reap completions while submitting new requests."));
  f.push_back(flag("aio.auto_tune", false, "Choose block_size and queue_depth online: the first 512 MiB of reads and of writes try the configured block_size x queue_depth and 256 KiB x 32, 1 MiB x 8, 1 MiB x 32, 4 MiB x 8 on the live traffic, keep the fastest per direction (bytes / busy time, from the completions) and log the choice; the data is unchanged. Needs engine uring or aio. `strata-io tune` stays for offline tuning (engine and thread_count too)."));
  f.push_back(flag("aio.use_gds", false, "GPUDirect Storage; not supported by strata, must stay false."));
  // Activations.
  f.push_back(flag("activation_checkpointing.cpu_checkpointing", false, "Move activation checkpoints to CPU memory."));
  f.push_back(ignored(flag("activation_checkpointing.partition_activations", false, "DeepSpeed model-parallel option; not applicable.")));
  f.push_back(ignored(flag("activation_checkpointing.contiguous_memory_optimization", false, "DeepSpeed option; strata allocates checkpoints from its own pool.")));
  f.push_back(ignored(flag("activation_checkpointing.synchronize_checkpoint_boundary", false, "DeepSpeed profiling option.")));
  f.push_back(ignored(flag("activation_checkpointing.profile", false, "DeepSpeed profiling option.")));
  // strata's own keys.
  f.push_back(choice("strata.accelerator", "auto", {"auto", "cpu", "cuda"}, "Backend: auto uses CUDA when a GPU is present."));
  f.push_back(integer("strata.seed", 1234, 0, 9.007199254740992e15, "Seed of the counter-based parameter initialisation (same model for any world size). At most 2^53, the largest integer every JSON reader holds exactly."));
  f.push_back(choice("strata.log_level", "info", {"trace", "debug", "info", "warn", "error", "off"}, "Logging threshold."));
  f.push_back(number("strata.collective_timeout_s", 300, 0.1, 1e9, "Seconds before a collective or rendezvous fails with an error naming the missing rank."));
  f.push_back(size("strata.pinned_pool_size", 0, "bytes", 0, "Upper bound of page-locked host memory; 0 sizes the pool from the buffer counts."));
  for (const char* monitor : {"csv_monitor", "tensorboard"}) {
    const std::string m = monitor;
    f.push_back(flag(m + ".enabled", false, m == "csv_monitor" ? "Write each step's train/loss, train/lr, train/grad_norm, train/tokens_per_second and eval/loss as CSV files (one per value: step,value), as DeepSpeed's csv_monitor." : "Write each step's train/loss, train/lr, train/grad_norm, train/tokens_per_second and eval/loss as TensorBoard event files, as DeepSpeed's tensorboard monitor."));
    f.push_back(text(m + ".output_path", "", "Directory of the files (empty: the finetune --out directory)."));
    f.push_back(text(m + ".job_name", "DeepSpeedJobName", "Subdirectory of output_path for this run."));
  }
  f.push_back(flag("wandb.enabled", false, "Weights & Biases: refused when true (it needs network access to its servers); use csv_monitor or tensorboard."));
  f.push_back(text("wandb.team", "", "Weights & Biases team (not used: wandb is refused)."));
  f.push_back(text("wandb.group", "", "Weights & Biases group (not used: wandb is refused)."));
  f.push_back(text("wandb.project", "deepspeed", "Weights & Biases project (not used: wandb is refused)."));
  f.push_back(text("strata.trace_path", "", "Write a Chrome-trace timeline of every transfer and kernel here; empty disables."));
  f.push_back(flag("strata.keep_swap_files", false, "Keep NVMe swap files after a clean shutdown."));
  f.push_back(flag("strata.overlap_optimizer", true, "ZeRO-2/3: update each optimizer sub-group during the last backward as soon as its gradient is final (rolled back exactly when clipping or an overflow fires); a smaller zero_optimization.sub_group_size overlaps more. false: the optimizer runs after backward."));
  f.push_back(choice("strata.micro_batch_order", "step-major", {"step-major", "layer-major", "auto"}, "The order of a step's gradient_accumulation_steps micro-batches: step-major (each micro-batch's forward and backward through the whole model, one after another: every parameter used 2m times per step), layer-major (every micro-batch through decoder layer l before layer l + 1, then the backwards layer by layer from the top: each layer's parameters used in m forwards in a row and m backwards in a row; each micro-batch's activations of every layer kept until its backward; the parameters after each step bit-identical to step-major's; not with tied embeddings, tensor, pipeline or expert parallelism, LoRA or a mixture of experts' load-balancing loss) or auto (layer-major where strata plan's model predicts it a shorter step than step-major's: the parameters living off the device, offload_param cpu or nvme, and more than one micro-batch are necessary, not sufficient; said once at start with both predicted step times; `strata plan --micro-batch-order auto` prints the same choice)."));
  f.push_back(choice("strata.layer_major_activations", "auto", {"auto", "recompute", "keep"}, "Layer-major micro-batches (strata.micro_batch_order): what each decoder layer keeps of a micro-batch between its forward and its backward. recompute (each layer's activations for one micro-batch at a time, its forward run again from the kept input before each backward, as activation checkpointing does: about a third more compute than step-major without checkpointing), keep (every micro-batch's activations of every layer kept in accelerator memory from its forward to its backward, nothing recomputed: m times the activation memory of step-major without checkpointing, for gradient_accumulation_steps m) or auto (keep where strata plan's model of the run predicts device memory with them kept within 75% of the accelerator's, on every rank; recompute otherwise; logged once with both predictions, and recorded in run.json as chosen). The same parameters bit for bit either way. With --checkpoint-activations each layer recomputes inside itself in both orders."));
  f.push_back(choice("strata.layer_major_boundaries", "device", {"device", "cpu", "nvme"}, "Layer-major micro-batches (strata.micro_batch_order): where each micro-batch's input to every layer and its gradient flowing down are kept until that layer's backward: device (accelerator memory), cpu (pinned host memory, copied out after each forward and back before each use, counted in strata.pinned_pool_size: a run whose boundaries do not fit it is refused before step 1) or nvme (the inputs in a file under the nvme_path of the tier on nvme, written once and read back ahead of their use through 2m + 2 pinned staging buffers; the m gradients in pinned host memory; both counted in strata.pinned_pool_size)."));
  return f;
}

}  // namespace

const std::vector<ConfigField>& config_fields() {
  static const std::vector<ConfigField> fields = build_fields();
  return fields;
}

const ConfigField* find_config_field(std::string_view path) {
  for (const auto& f : config_fields()) {
    if (f.path == path) return &f;
  }
  return nullptr;
}

std::string_view canonical_config_path(std::string_view path) {
  if (path == "aio.intra_op_parallelism") return "aio.thread_count";
  if (path == "strata.io_engine") return "aio.engine";
  return path;
}

bool is_config_section(std::string_view path) {
  const std::string prefix = std::string(path) + ".";
  return std::any_of(config_fields().begin(), config_fields().end(),
                     [&](const ConfigField& f) { return f.path.rfind(prefix, 0) == 0; });
}

namespace {
// A bound as people read it: "1048576", "0.1", "2^53"; "" for the
// open ends (kUnbounded).
std::string bound(double value) {
  if (std::isinf(value)) return "";
  if (std::abs(value) < 9.2e18 && value == static_cast<double>(static_cast<int64_t>(value))) {
    const auto i = static_cast<int64_t>(value);
    // Large powers of two (2^53) say more as such than as 16 digits.
    if (i >= (int64_t{1} << 32) && (i & (i - 1)) == 0) return fmt::format("2^{}", __builtin_ctzll(static_cast<uint64_t>(i)));
    return fmt::format("{}", i);
  }
  return fmt::format("{}", value);
}
std::string range(const ConfigField& f) {
  const std::string lo = bound(f.min), hi = bound(f.max);
  if (!lo.empty() && !hi.empty()) return fmt::format(" {}..{}", lo, hi);
  if (!lo.empty()) return fmt::format(" >= {}", lo);
  return "";
}
}  // namespace

bool accepts_auto(const ConfigField& f) {
  return f.kind == FieldKind::kString ||
         (f.kind == FieldKind::kEnum && std::find(f.choices.begin(), f.choices.end(), "auto") != f.choices.end());
}

std::string describe_accepted(const ConfigField& f) {
  switch (f.kind) {
    case FieldKind::kBool: return "true or false";
    case FieldKind::kInt: return "an integer" + range(f);
    case FieldKind::kNumber: return "a number" + range(f);
    case FieldKind::kSize:
      return fmt::format("a count of {}{} (a number, or a string such as \"1GB\" or \"512MiB\")", f.unit,
                         range(f));
    case FieldKind::kString: return "a string (without NUL characters)";
    case FieldKind::kEnum: return fmt::format("one of {}", fmt::join(f.choices, ", "));
    case FieldKind::kNumberPair: return "a list of two numbers" + range(f);
    case FieldKind::kIntList: return "a list of integers" + range(f);
  }
  return "?";
}

std::string config_reference_markdown() {
  std::string out =
      "# Configuration reference\n\n"
      "<!-- Generated by `strata config docs` from runtime/config/schema.cc; do not edit by hand. -->\n\n"
      "strata reads a JSON file that uses DeepSpeed's key names where the concept is shared, so an\n"
      "existing `ds_config.json` mostly works. Unknown keys, keys given twice, wrong types and values\n"
      "out of range are errors naming the key and what it accepts (with the closest valid key when one\n"
      "is near); integer bounds are checked exactly and never exceed what strata reads them into.\n"
      "Keys marked *no effect* are DeepSpeed keys strata accepts for compatibility and does not use;\n"
      "`strata config check` lists them. The value `\"auto\"` (written by Hugging Face's integration)\n"
      "means the default (`reduce_bucket_size`: see its row). A default \"chosen from the model\" is\n"
      "null in the effective config and picked when the engine is built (one decoder layer per\n"
      "sub-group and per bucket; docs/DESIGN.md §5.2). Sizes accept numbers (`1e9`) or strings (`\"1GB\"` = 10^9, `\"1GiB\"` = 2^30);\n"
      "for element counts the unit names only the multiplier.\n\n"
      "Checked combinations (one function, runtime/config/config.cc, which `strata config check`,\n"
      "`strata finetune`, `strata plan` and the C API all run, so a file valid for one is valid for\n"
      "all): stage 0 is refused (strata partitions at least the optimizer state; stage 1 computes\n"
      "the same step, and is the default); parameter offload needs stage 3 and the optimizer\n"
      "offloaded too; NVMe offload needs `nvme_path`, the same one for parameters and optimizer;\n"
      "fp16 and bf16 are exclusive; `train_batch_size` must be divisible by micro batch x\n"
      "accumulation steps; `aio.block_size` must be a multiple of 4096; `aio.auto_tune` needs\n"
      "engine uring or aio; and whatever else the engine would refuse (engine_options.cc) is listed\n"
      "as a problem of the file.\n";
  std::string section;
  for (const auto& f : config_fields()) {
    const auto dot = f.path.find('.');
    const std::string top = dot == std::string::npos ? "(top level)" : f.path.substr(0, dot);
    if (top != section) {
      section = top;
      out += fmt::format("\n## `{}`\n\n| key | accepts | default | meaning |\n|---|---|---|---|\n", section);
    }
    const std::string default_text =
        f.default_value.is_null() ? "chosen from the model" : fmt::format("`{}`", f.default_value.dump());
    out += fmt::format("| `{}` | {} | {} | {}{} |\n", f.path, describe_accepted(f), default_text,
                       f.no_effect ? "*no effect in strata.* " : "", f.doc);
  }
  out += "\n`aio.intra_op_parallelism` is accepted as another name for `aio.thread_count`.\n";
  return out;
}

}  // namespace strata
