// The model behind `strata plan`: from a model's shape, the training shape
// (sequence, micro-batch, checkpointing), ZeRO buffers and a machine, it works
// out the memory each tier (GPU, CPU, NVMe) needs per rank for every ZeRO stage
// and offload placement, the bytes each class of traffic moves per step, the
// bandwidth it needs for a target efficiency, the efficiency predicted, and the
// placement to use.
//
// The formulas are the papers' (ZeRO, arXiv 1910.02054; ZeRO-Infinity, arXiv 2104.07857): ZeRO
// (arXiv 1910.02054) for model states per stage, ZeRO-Infinity (arXiv
// 2104.07857, §3–4) for activations, working memory, arithmetic intensity and
// efficiency. Every size here is in bytes (double: these are estimates, and
// ψ/N_d is rarely whole); every bandwidth in bytes per second; compute in flops.
//
// Thread-safety: plain values and pure functions; no I/O, no globals.
// Errors: make_plan() throws Error(kBadArgument) naming the input that is out
// of range (a count below 1, a bandwidth not above 0, a target outside (0, 1)).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace strata::plan {

// Mixed-precision Adam, bytes per parameter (ZeRO §3.1): a 16-bit weight and
// gradient, K = 12 bytes of optimizer state (fp32 master, momentum, variance).
// ZeRO-Infinity also counts the fp32 gradient the optimizer reads, giving 20.
inline constexpr double kParam16Bytes = 2;
inline constexpr double kGrad16Bytes = 2;
inline constexpr double kOptimizerBytes = 12;  // K
inline constexpr double kGrad32Bytes = 4;

// LoRA (runtime/nn/lora.h): the base is frozen, so it holds only its 16-bit
// weights (no gradient, fp32 master or optimizer state); the adapters train
// in fp32: a 4-byte weight and a 4-byte gradient where the 16-bit ones would
// be, K = 12 bytes of optimizer state, and the fp32 gradient an offloaded
// optimizer reads (kGrad32Bytes) -- 20 bytes per adapter parameter.
inline constexpr double kAdapterParamBytes = 4;
inline constexpr double kAdapterGradBytes = 4;

// Where a kind of state lives. kGpu is ds_config's offload device "none".
enum class Tier { kGpu, kCpu, kNvme };
std::string_view tier_name(Tier tier);  // "gpu", "cpu", "nvme"

struct ModelShape {
  int64_t param_count = 0;  // ψ; must be > 0
  // The transformer's shape; 0 means unknown, and then activations and working
  // memory are not estimated (the model-state figures still are).
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;         // 0: hidden / 128 (the common head size)
  int64_t intermediate = 0;  // the MLP's width; 0: 4 * hidden
  int64_t vocab = 0;         // 0: unknown (then the embedding is not a candidate largest operator)
  // A mixture of experts (0 experts: dense): each layer's MLP is `experts`
  // experts of width `intermediate`, `experts_per_token` of them per token;
  // active_param_count is what one token computes with (the rest are other
  // experts). Compute counts the active parameters; the model states and the
  // transfers count every parameter (each expert is stored, trained and, at
  // worst, fetched every step).
  int64_t experts = 0;
  int64_t experts_per_token = 0;
  // qwen2_moe's shared expert: one more MLP of this width per layer that
  // every token goes through (its parameters are active); 0: none.
  int64_t shared_expert_intermediate = 0;
  int64_t active_param_count = 0;  // 0: param_count
  // Of the active parameters, the input embedding's table when it is not
  // tied to lm_head (a lookup: published active counts such as gpt-oss's
  // 5.1B leave it out); 0 when tied or unknown.
  int64_t input_embedding_count = 0;
  // Parameters the checkpoint holds beside the model, carried untrained (a
  // gemma3 checkpoint's vision tower and projector): no memory in training.
  int64_t carried_param_count = 0;
  bool shape_known() const { return layers > 0 && hidden > 0; }
  double active_params() const {
    return static_cast<double>(active_param_count > 0 ? active_param_count : param_count);
  }
};

// LoRA adapters on a frozen base (`strata finetune --lora-rank`).
struct LoraShape {
  int64_t rank = 0;                  // r; > 0
  std::vector<std::string> targets;  // projection names (nn::kLoraProjections)
  int64_t adapter_count = 0;         // ψ_a: Σ r·(in + out) over the adapted projections; > 0
  // A base from a quantized checkpoint (quantization_config fp8 or mxfp4):
  // of its parameters, those stored quantized, which ZeRO-3 keeps so at
  // quantized_bytes_per_param each (docs/DESIGN.md §4.2.2) -- FP8: a byte
  // and a 4-byte scale per block (1 + 4 / 16384 for 128 x 128); MXFP4: half
  // a byte and a byte of scale per 32 (17/32, 4.25 bits); the rest, and all
  // of them below stage 3, take 16 bits. 0: none.
  int64_t quantized_param_count = 0;
  double quantized_bytes_per_param = 1.0 + 4.0 / (128.0 * 128.0);
  std::string quantized_format = "FP8";  // "FP8" or "MXFP4", for the report
};

// What one training step does, and the ZeRO buffers it keeps (ds_config keys,
// DeepSpeed's defaults).
struct TrainingShape {
  int64_t seq = 1024;
  int64_t micro_batch = 1;        // train_micro_batch_size_per_gpu
  int64_t grad_accumulation = 1;  // micro-steps per optimizer step
  bool activation_checkpointing = true;
  int64_t layers_per_checkpoint = 1;  // c_i
  bool checkpoints_on_cpu = false;    // activation_checkpointing.cpu_checkpointing
  // strata.layer_major_activations keep: layer-major keeps every micro-batch's
  // activations (no recompute; plan/order_plan.h).
  bool layer_major_keeps_activations = false;
  int64_t tiling = 16;  // memory-centric tiling factor (ZeRO-Infinity §5.1.3 used 16)
  int64_t reduce_bucket_numel = 500'000'000;   // reduce_bucket_size
  int64_t prefetch_bucket_numel = 50'000'000;  // stage3_prefetch_bucket_size
  int64_t sub_group_numel = 1'000'000'000;     // sub_group_size
  int64_t param_buffer_count = 5;              // offload_param.buffer_count
  int64_t param_buffer_numel = 100'000'000;    // offload_param.buffer_size
  int64_t optimizer_buffer_count = 4;          // offload_optimizer.buffer_count
  // Tensor parallelism (Megatron's; tensor_parallel.autotp_size): ranks =
  // tensor_parallel x Machine::data_parallel, and ModelShape::param_count is
  // one rank's (its shards and the replicated tensors). Activations per
  // rank follow Korthikanti et al. (arXiv 2205.05198): 10 of a layer's 34 s
  // b h replicated and 24 divided by t, all 34 divided with sequence
  // parallelism; the layers' tp collectives are a traffic class.
  int64_t tensor_parallel = 1;
  bool sequence_parallel = false;
  // Context parallelism (context_parallel.size, --cp): each rank holds seq /
  // context_parallel tokens of every sequence (its two chunks), so its
  // activations, compute and tp collectives are those tokens' (the attention
  // scores' term: s/cp queries against s/cp keys in hand, the ring's chunk
  // pair or Ulysses' heads / cp over the whole s alike); Machine::data_parallel
  // stays ZeRO's partitions, dp x cp. The ring's or Ulysses' bytes one rank
  // sends per micro-step are given (the caller knows the kv heads) and are a
  // traffic class.
  int64_t context_parallel = 1;
  double context_exchange_nbytes = 0;
};

// The hardware. Memory capacities are optional: a tier whose capacity is
// unknown is reported but never counted as fitting.
struct Machine {
  // Ranks per node: host memory, NVMe and their bandwidth are shared by them.
  int64_t gpus_per_node = 1;
  int64_t nodes = 1;
  int64_t data_parallel = 1;          // N_d, ranks over all nodes: at most nodes x gpus_per_node
  std::optional<double> gpu_nbytes;   // per GPU
  std::optional<double> host_nbytes;  // per node, usable for training
  std::optional<double> nvme_nbytes;  // per node, free for swap files
  double gpu_cpu_bw = 25e9;           // per GPU, pinned copies each way (PCIe Gen4)
  double nvme_read_bw = 7e9;          // per node (one Gen4 drive)
  double nvme_write_bw = 7e9;         // per node
  double host_memory_bw = 100e9;      // per node: what the CPU optimizer streams its state at
  std::optional<double>
      interconnect_bw;        // per GPU, collective bus bandwidth; unknown: not modelled
  double peak_flops = 70e12;  // per GPU, achieved (the paper's V100 figure)
};

struct PlanInputs {
  ModelShape model;
  TrainingShape training;
  Machine machine;
  double target_efficiency = 0.9;
  // LoRA: model.param_count is then the frozen base, and the adapters'
  // lora->adapter_count parameters are what trains.
  std::optional<LoraShape> lora;
  // The placement the ds_config chose, if one was given (marked in the plan).
  std::optional<int> configured_stage;
  std::optional<Tier> configured_params, configured_optimizer;
};

// Bytes per rank on each tier.
struct TierBytes {
  double gpu = 0, cpu = 0, nvme = 0;
  double on(Tier tier) const;
  TierBytes& operator+=(const TierBytes& other);
};

struct Placement {
  int stage = 0;  // 0..3
  Tier params = Tier::kGpu;
  Tier optimizer = Tier::kGpu;
  bool operator==(const Placement&) const = default;
};

// Whether strata's ds_config accepts it: parameter offload only with stage 3,
// optimizer offload from stage 1 (to NVMe too, which DeepSpeed allows only at
// stage 3), and offloaded parameters only with the optimizer offloaded too
// (runtime/config, runtime/train/zero_config.cc).
bool placement_valid(const Placement& placement);
// Every valid placement: stage 0, then 1 and 2 with the optimizer on gpu, cpu
// or nvme, then stage 3's seven (params x optimizer, not params offloaded
// with the optimizer on gpu).
std::vector<Placement> valid_placements();
std::string describe(const Placement& placement);  // "stage 3, params cpu, optimizer nvme"

// One class of traffic a placement causes, per rank and optimizer step, on its
// slowest link.
struct Traffic {
  std::string name;             // params_grads | optimizer | checkpoints | collectives
  std::string path;             // "CPU <-> GPU (PCIe)", ...
  double nbytes = 0;            // moved per step per rank over the bottleneck
  double bandwidth = 0;         // bytes/s this rank gets on it
  double seconds = 0;           // nbytes / bandwidth
  double ait = 0;               // flops per byte: compute per step / nbytes
  double efficiency = 0;        // ait*bw / (ait*bw + peak): this class alone, not overlapped
  double bandwidth_needed = 0;  // for the target efficiency
};

enum class Fit { kYes, kNo, kUnknown };

struct PlacementPlan {
  Placement placement;
  // Per rank, by kind.
  TierBytes param16, grad16, optimizer, grad32, activations, working, buffers;
  TierBytes total;
  Fit gpu_fit = Fit::kUnknown, cpu_fit = Fit::kUnknown, nvme_fit = Fit::kUnknown;
  bool fits() const {
    return gpu_fit == Fit::kYes && cpu_fit == Fit::kYes && nvme_fit == Fit::kYes;
  }
  bool needs_tiling = false;  // fits only with the operator tiled
  std::string shortfall;      // why it does not fit (empty when it does)
  std::vector<Traffic> traffic;
  double step_seconds = 0;          // compute + every class, not overlapped (the paper's model)
  double predicted_efficiency = 0;  // compute / step_seconds
  bool configured = false;          // the ds_config's placement
};

struct ActivationBytes {
  double checkpoints = 0;  // kept between forward and backward
  double working = 0;      // one segment's activations during recompute / backward
  double total() const { return checkpoints + working; }
};

// The model states of a LoRA plan beside full fine-tuning of the same base.
struct LoraStates {
  // Frozen: the 16-bit weight only -- at ZeRO-3 a quantized base's quantized
  // weights at LoraShape::quantized_bytes_per_param, averaged over the base.
  double base_bytes_per_param = kParam16Bytes;
  // Adapters: fp32 weight + fp32 gradient + K; their gradient is already the
  // fp32 one ZeRO-Infinity counts, so 20 in both counts (stage 1 with the
  // optimizer offloaded keeps a second, reduced fp32 copy beside it: 24).
  double adapter_bytes_per_param = kAdapterParamBytes + kAdapterGradBytes + kOptimizerBytes;
  double base_nbytes = 0;           // the base's weights
  double adapter_nbytes = 0;        // the adapters' states, ZeRO's count
  double full_finetune_nbytes = 0;  // (2 + 2 + K) ψ: every parameter of the base trained
  double ratio = 0;                 // (base_nbytes + adapter_nbytes) / full_finetune_nbytes
};

struct Plan {
  PlanInputs inputs;
  std::optional<LoraStates> lora;              // present with inputs.lora
  double flops_per_step = 0;                   // per rank
  double compute_seconds = 0;                  // flops_per_step / peak
  double model_states_nbytes = 0;              // 16 ψ, the whole model (LoRA: 2 ψ + 20 ψ_a)
  double model_states_with_grad32_nbytes = 0;  // 20 ψ, ZeRO-Infinity's count (LoRA: 2 ψ + 20 ψ_a)
  std::array<double, 4> zero_stage_nbytes{};   // per rank, ZeRO's formula, stage 0..3
  // Present when the model's shape is known.
  std::optional<ActivationBytes> activations_checkpointed;
  std::optional<ActivationBytes> activations_full;
  std::string largest_operator;  // "mlp up (4096 x 11008)"
  double largest_operator_numel = 0;
  double working_whole_nbytes =
      0;  // its 16-bit weight + gradient, fetched whole (LoRA: frozen, the weight only)
  double working_tiled_nbytes = 0;  // the same cut in `tiling` tiles
  // ZeRO-Infinity's arithmetic intensities (flops per byte) for one GPU.
  double ait_params_grads = 0;            // seq * bsz
  double ait_optimizer = 0;               // seq * bsz / 4
  double ait_checkpoints = 0;             // 24 * hidden * c_i (0 when the shape is unknown)
  // Tensor parallelism: bytes one rank sends per micro-step in the layers'
  // tp collectives (16-bit activations; 0 without tp or an unknown shape).
  double tp_collective_nbytes = 0;
  std::vector<PlacementPlan> placements;  // valid_placements() order
  std::optional<size_t> recommended;      // index into placements
  std::string reason;                     // why that one, or why none
  std::vector<std::string> notes;         // assumptions worth saying
};

// ZeRO's model states per rank (ZeRO §5.1, K = 12): stage 0 (2+2+K)ψ,
// stage 1 4ψ + Kψ/N_d, stage 2 2ψ + (2+K)ψ/N_d, stage 3 (4+K)ψ/N_d.
double zero_model_states_per_rank(int64_t param_count, int stage, int64_t data_parallel);
// A transformer of `layers` layers of hidden size h: 12·L·h² parameters
// (four linears h×3h, h×h, h×4h, 4h×h).
int64_t transformer_param_count(int64_t layers, int64_t hidden);
// ZeRO-Infinity's efficiency of one class of traffic: ait*bw / (ait*bw + peak).
double efficiency(double ait, double bandwidth, double peak_flops);
// The bandwidth at which efficiency() reaches `target`: target*peak / (ait*(1-target)).
double bandwidth_for_efficiency(double ait, double target, double peak_flops);

// The whole plan. Throws Error(kBadArgument) naming the bad input.
Plan make_plan(const PlanInputs& inputs);

}  // namespace strata::plan
