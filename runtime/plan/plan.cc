// The formulas of `strata plan`: memory per tier, traffic per class, efficiency,
// and the recommendation. See plan.h for the sources.
#include "runtime/plan/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace strata::plan {
namespace {

constexpr double kGB = 1e9;  // the papers' unit in messages

void check_count(int64_t value, int64_t min, const char* what) {
  STRATA_CHECK(value >= min, kBadArgument, "plan: {} is {}; it must be at least {}", what, value,
               min);
}

void check_rate(double value, const char* what) {
  STRATA_CHECK(std::isfinite(value) && value > 0, kBadArgument,
               "plan: {} is {}; it must be a number above 0", what, value);
}

void check_capacity(const std::optional<double>& value, const char* what) {
  if (value) {
    STRATA_CHECK(std::isfinite(*value) && *value >= 0, kBadArgument,
                 "plan: {} is {}; it must be at least 0", what, *value);
  }
}

void validate(const PlanInputs& in) {
  const ModelShape& m = in.model;
  check_count(m.param_count, 1, "the parameter count");
  check_count(m.layers, 0, "layers");
  check_count(m.hidden, 0, "hidden size");
  check_count(m.heads, 0, "attention heads");
  check_count(m.intermediate, 0, "intermediate size");
  check_count(m.vocab, 0, "vocabulary size");
  check_count(m.experts, 0, "experts");
  check_count(m.shared_expert_intermediate, 0, "shared expert width");
  STRATA_CHECK(m.active_param_count >= 0 && m.active_param_count <= m.param_count, kBadArgument,
               "plan: {} active parameters of {} (it must be between 0 and the parameter count)",
               m.active_param_count, m.param_count);
  STRATA_CHECK(m.experts == 0 || (m.experts_per_token >= 1 && m.experts_per_token <= m.experts), kBadArgument,
               "plan: {} experts per token of {}", m.experts_per_token, m.experts);
  STRATA_CHECK((m.layers > 0) == (m.hidden > 0), kBadArgument,
               "plan: layers ({}) and hidden size ({}) go together: give both or neither", m.layers,
               m.hidden);
  const TrainingShape& t = in.training;
  check_count(t.seq, 1, "sequence length");
  check_count(t.micro_batch, 1, "micro-batch size");
  check_count(t.grad_accumulation, 1, "gradient accumulation steps");
  check_count(t.layers_per_checkpoint, 1, "layers per checkpoint");
  check_count(t.tiling, 1, "tiling factor");
  check_count(t.reduce_bucket_numel, 1, "reduce_bucket_size");
  check_count(t.prefetch_bucket_numel, 0, "stage3_prefetch_bucket_size");
  check_count(t.sub_group_numel, 1, "sub_group_size");
  check_count(t.param_buffer_count, 1, "offload_param.buffer_count");
  check_count(t.param_buffer_numel, 1, "offload_param.buffer_size");
  check_count(t.optimizer_buffer_count, 1, "offload_optimizer.buffer_count");
  check_count(t.context_parallel, 1, "context-parallel size");
  STRATA_CHECK(t.context_parallel == 1 || t.seq % (2 * t.context_parallel) == 0, kBadArgument,
               "plan: context parallelism {} cuts each sequence into 2 x {} chunks, but the sequence length {} does not "
               "divide by {}",
               t.context_parallel, t.context_parallel, t.seq, 2 * t.context_parallel);
  STRATA_CHECK(t.context_exchange_nbytes >= 0, kBadArgument, "plan: context-parallel bytes {} < 0",
               t.context_exchange_nbytes);
  if (in.lora) {
    check_count(in.lora->rank, 1, "the LoRA rank");
    check_count(in.lora->adapter_count, 1, "the LoRA adapters' parameter count");
    STRATA_CHECK(in.lora->quantized_param_count >= 0 && in.lora->quantized_param_count <= in.model.param_count &&
                     in.lora->quantized_bytes_per_param > 0 && in.lora->quantized_bytes_per_param <= kParam16Bytes,
                 kBadArgument, "the {} base's {} {} parameters (of {}) at {} bytes each do not fit the base",
                 in.lora->quantized_format, in.lora->quantized_param_count, in.lora->quantized_format,
                 in.model.param_count, in.lora->quantized_bytes_per_param);
  }
  const Machine& hw = in.machine;
  check_count(hw.gpus_per_node, 1, "GPUs per node");
  check_count(hw.nodes, 1, "nodes");
  check_count(hw.data_parallel, 1, "the data-parallel degree");
  STRATA_CHECK(hw.data_parallel <= hw.nodes * hw.gpus_per_node, kBadArgument,
               "plan: data-parallel degree {} is more than {} node(s) x {} GPUs", hw.data_parallel,
               hw.nodes, hw.gpus_per_node);
  check_capacity(hw.gpu_nbytes, "GPU memory");
  check_capacity(hw.host_nbytes, "host memory");
  check_capacity(hw.nvme_nbytes, "NVMe capacity");
  check_rate(hw.gpu_cpu_bw, "the GPU<->CPU bandwidth");
  check_rate(hw.nvme_read_bw, "the NVMe read bandwidth");
  check_rate(hw.nvme_write_bw, "the NVMe write bandwidth");
  check_rate(hw.host_memory_bw, "the host memory bandwidth");
  if (hw.interconnect_bw) check_rate(*hw.interconnect_bw, "the interconnect bandwidth");
  check_rate(hw.peak_flops, "the peak compute");
  STRATA_CHECK(in.target_efficiency > 0 && in.target_efficiency < 1, kBadArgument,
               "plan: the target efficiency is {}; it must lie strictly between 0 and 1",
               in.target_efficiency);
}

// The parameters as the memory and traffic formulas see them: those that
// train (every one, or LoRA's adapters) with their bytes per parameter, and
// those frozen (LoRA's base), which hold their 16-bit weights only.
struct ParamClasses {
  double trained = 0, frozen = 0;  // counts
  double trained_param = kParam16Bytes, trained_grad = kGrad16Bytes;
  double frozen_param = kParam16Bytes;
  double all() const { return trained + frozen; }
  // Weight bytes of `trained` and `frozen` parameters (a rank's shard, or all).
  double weights(double trained_numel, double frozen_numel) const {
    return frozen_param * frozen_numel + trained_param * trained_numel;
  }
};

// Bytes per parameter of LoRA's frozen base at ZeRO stage `stage`: its
// 16-bit weight, but at stage 3 a quantized checkpoint's quantized weights
// stay in their stored form (FP8: a byte and a share of a 4-byte scale per
// block; MXFP4: 4.25 bits).
double base_bytes_per_param(const PlanInputs& in, int stage) {
  if (!in.lora || in.lora->quantized_param_count == 0 || stage != 3) return kParam16Bytes;
  const double psi = static_cast<double>(in.model.param_count);
  const double q = static_cast<double>(in.lora->quantized_param_count);
  return (kParam16Bytes * (psi - q) + in.lora->quantized_bytes_per_param * q) / psi;
}

ParamClasses param_classes(const PlanInputs& in, int stage = 3) {
  ParamClasses c;
  const double psi = static_cast<double>(in.model.param_count);
  if (!in.lora) {
    c.trained = psi;
    return c;
  }
  c.frozen = psi;
  c.frozen_param = base_bytes_per_param(in, stage);
  c.trained = static_cast<double>(in.lora->adapter_count);
  c.trained_param = kAdapterParamBytes;
  c.trained_grad = kAdapterGradBytes;
  return c;
}

double gb(double nbytes) {
  return nbytes / kGB;
}

// Fetches (loads) of every parameter per micro-step: forward, backward, and the
// recompute between them when activations are checkpointed (ZeRO-Infinity §4.1).
int parameter_loads(const TrainingShape& t) {
  return t.activation_checkpointing ? 3 : 2;
}

Fit fit_of(double need, std::optional<double> capacity) {
  if (need <= 0) return Fit::kYes;
  if (!capacity) return Fit::kUnknown;
  return need <= *capacity ? Fit::kYes : Fit::kNo;
}

// Pinned host memory of the NVMe optimizer pipeline: buffer_count buffers, each
// one sub-group's fp32 master and both moments and its fp32 gradient, which is
// on NVMe with the optimizer and read beside the state
// (OptimizerSwapper::buffer_nbytes).
double optimizer_staging_nbytes(const Plan& plan) {
  const TrainingShape& t = plan.inputs.training;
  const double shard = param_classes(plan.inputs).trained /
                       static_cast<double>(plan.inputs.machine.data_parallel);
  return (kOptimizerBytes + kGrad32Bytes) * static_cast<double>(t.optimizer_buffer_count) *
         std::min<double>(static_cast<double>(t.sub_group_numel), shard);
}

// Bytes per rank on each tier for one placement (before the fit check).
void fill_memory(const Plan& plan, PlacementPlan& pp) {
  const PlanInputs& in = plan.inputs;
  const TrainingShape& t = in.training;
  const Placement& p = pp.placement;
  const ParamClasses c = param_classes(in, p.stage);
  const double n = static_cast<double>(in.machine.data_parallel);
  const double psi = c.all(), shard = psi / n;
  const double trained = c.trained, trained_shard = trained / n, frozen_shard = c.frozen / n;
  auto at = [](Tier tier, double nbytes) {
    TierBytes b;
    (tier == Tier::kGpu ? b.gpu : tier == Tier::kCpu ? b.cpu : b.nvme) = nbytes;
    return b;
  };
  // Stage 3 partitions the 16-bit parameters (frozen ones too: they are
  // groups of their own, partitioned and offloaded like any other); below it
  // every rank holds all of them.
  pp.param16 = p.stage == 3 ? at(p.params, c.weights(trained_shard, frozen_shard))
                            : at(Tier::kGpu, c.weights(trained, c.frozen));
  // Only trained parameters have gradients and optimizer state.
  // Stage 2 partitions gradients. With the optimizer offloaded each reduced
  // shard leaves the GPU at once (only the reduce bucket stays, under buffers).
  if (p.stage < 2) {
    pp.grad16 = at(Tier::kGpu, c.trained_grad * trained);
  } else if (p.optimizer == Tier::kGpu) {
    pp.grad16 = at(Tier::kGpu, c.trained_grad * trained_shard);
  }
  // Stage 1 partitions optimizer state. ZeRO's K = 12 covers the fp32 copy of
  // the gradient on the GPU; an offloaded optimizer keeps its own fp32 gradient
  // shard beside its state (ZeRO-Infinity's 20 bytes per parameter).
  pp.optimizer = at(p.optimizer, kOptimizerBytes * (p.stage == 0 ? trained : trained_shard));
  if (p.optimizer != Tier::kGpu) pp.grad32 = at(p.optimizer, kGrad32Bytes * trained_shard);

  const auto& acts =
      t.activation_checkpointing ? plan.activations_checkpointed : plan.activations_full;
  if (acts) {
    pp.activations.gpu = acts->working;
    (t.checkpoints_on_cpu ? pp.activations.cpu : pp.activations.gpu) += acts->checkpoints;
  }
  // Below stage 3 the whole model is resident: no operator is fetched.
  if (p.stage == 3) pp.working.gpu = plan.working_whole_nbytes;

  // Staging buffers the ds_config sizes.
  if (p.stage == 3)
    pp.buffers.gpu +=
        kParam16Bytes * std::min<double>(static_cast<double>(t.prefetch_bucket_numel), psi);
  if (p.stage >= 2 || p.optimizer != Tier::kGpu) {
    pp.buffers.gpu +=
        c.trained_grad * std::min<double>(static_cast<double>(t.reduce_bucket_numel), trained);
  }
  if (p.stage == 3 && p.params == Tier::kNvme) {
    pp.buffers.cpu += kParam16Bytes * static_cast<double>(t.param_buffer_count) *
                      std::min<double>(static_cast<double>(t.param_buffer_numel), shard);
  }
  if (p.optimizer == Tier::kNvme) {
    pp.buffers.cpu += optimizer_staging_nbytes(plan);
  }
}

TierBytes sum_memory(const PlacementPlan& pp) {
  TierBytes total;
  for (const TierBytes* part : {&pp.param16, &pp.grad16, &pp.optimizer, &pp.grad32, &pp.activations,
                                &pp.working, &pp.buffers}) {
    total += *part;
  }
  return total;
}

void check_fit(const Plan& plan, PlacementPlan& pp) {
  const Machine& hw = plan.inputs.machine;
  const double ranks = static_cast<double>(hw.gpus_per_node);
  const auto share = [ranks](std::optional<double> node) -> std::optional<double> {
    if (!node) return std::nullopt;
    return *node / ranks;
  };
  pp.total = sum_memory(pp);
  pp.gpu_fit = fit_of(pp.total.gpu, hw.gpu_nbytes);
  // Memory-centric tiling: when the operator fetched whole is what does not
  // fit, fetch it in tiles instead (ZeRO-Infinity §5.1.3).
  if (pp.gpu_fit == Fit::kNo && pp.working.gpu > plan.working_tiled_nbytes) {
    const double tiled_total = pp.total.gpu - pp.working.gpu + plan.working_tiled_nbytes;
    if (tiled_total <= *hw.gpu_nbytes) {
      pp.working.gpu = plan.working_tiled_nbytes;
      pp.total = sum_memory(pp);
      pp.gpu_fit = Fit::kYes;
      pp.needs_tiling = true;
    }
  }
  pp.cpu_fit = fit_of(pp.total.cpu, share(hw.host_nbytes));
  pp.nvme_fit = fit_of(pp.total.nvme, share(hw.nvme_nbytes));
  std::vector<std::string> problems;
  auto say = [&](Fit fit, const char* tier, double need, std::optional<double> capacity) {
    if (fit == Fit::kNo) {
      problems.push_back(
          fmt::format("{} needs {:.1f} GB per rank, has {:.1f} GB", tier, gb(need), gb(*capacity)));
    } else if (fit == Fit::kUnknown) {
      problems.push_back(
          fmt::format("{} capacity unknown ({:.1f} GB per rank needed)", tier, gb(need)));
    }
  };
  say(pp.gpu_fit, "GPU", pp.total.gpu, hw.gpu_nbytes);
  say(pp.cpu_fit, "CPU", pp.total.cpu, share(hw.host_nbytes));
  say(pp.nvme_fit, "NVMe", pp.total.nvme, share(hw.nvme_nbytes));
  for (size_t i = 0; i < problems.size(); ++i) pp.shortfall += (i ? "; " : "") + problems[i];
}

Traffic make_traffic(const Plan& plan, std::string name, std::string path, double nbytes,
                     double seconds) {
  Traffic c;
  c.name = std::move(name);
  c.path = std::move(path);
  c.nbytes = nbytes;
  c.seconds = seconds;
  c.bandwidth = nbytes / seconds;
  c.ait = plan.flops_per_step / nbytes;
  c.efficiency = efficiency(c.ait, c.bandwidth, plan.inputs.machine.peak_flops);
  c.bandwidth_needed = bandwidth_for_efficiency(c.ait, plan.inputs.target_efficiency,
                                                plan.inputs.machine.peak_flops);
  return c;
}

// Bytes each class of traffic moves per optimizer step for this rank, and the
// time it takes on its slowest link. Stages of one pipeline (NVMe->CPU and
// CPU->GPU; read, update, write) overlap one another, so a class takes as long
// as its slowest stage; classes are then added to compute without overlap.
void fill_traffic(const Plan& plan, PlacementPlan& pp) {
  const PlanInputs& in = plan.inputs;
  const Machine& hw = in.machine;
  const TrainingShape& t = in.training;
  const Placement& p = pp.placement;
  const ParamClasses c = param_classes(in, p.stage);
  const double n = static_cast<double>(hw.data_parallel);
  const double trained_shard = c.trained / n, frozen_shard = c.frozen / n;
  const double micro_steps = static_cast<double>(t.grad_accumulation);
  const double loads = parameter_loads(t);
  const double ranks = static_cast<double>(hw.gpus_per_node);
  const double nvme_read_bw = hw.nvme_read_bw / ranks, nvme_write_bw = hw.nvme_write_bw / ranks;
  const double host_bw = hw.host_memory_bw / ranks;

  // Parameters and gradients. Bandwidth-centric partitioning: each rank moves
  // only its 1/N_d shard over its own link; the allgather does the rest.
  double pcie = 0, nvme_read = 0, nvme_write = 0;
  // Every parameter is fetched; only trained ones have gradients and updates.
  const double shard_weights = c.weights(trained_shard, frozen_shard);
  if (p.stage == 3 && p.params != Tier::kGpu) pcie += micro_steps * loads * shard_weights;
  if (p.stage == 3 && p.params == Tier::kNvme) nvme_read += micro_steps * loads * shard_weights;
  if (p.optimizer != Tier::kGpu) {
    // Stage 1 reduces the resident gradients once per step; 2 and 3 per micro-step.
    pcie += (p.stage >= 2 ? micro_steps : 1) * c.trained_grad * trained_shard;
  }
  // The updated 16-bit shard goes from where the optimizer ran to the params' home.
  const Tier param_home = p.stage == 3 ? p.params : Tier::kGpu;
  const bool optimizer_on_host = p.optimizer != Tier::kGpu;
  if (optimizer_on_host != (param_home != Tier::kGpu)) pcie += c.trained_param * trained_shard;
  if (param_home == Tier::kNvme) nvme_write += c.trained_param * trained_shard;
  if (pcie + nvme_read + nvme_write > 0) {
    const double nvme_seconds = nvme_read / nvme_read_bw + nvme_write / nvme_write_bw;
    const double pcie_seconds = pcie / hw.gpu_cpu_bw;
    const std::string path = param_home == Tier::kNvme ? "NVMe <-> CPU <-> GPU" : "CPU <-> GPU";
    pp.traffic.push_back(make_traffic(plan, "params_grads", path,
                                      pcie > 0 ? pcie : nvme_read + nvme_write,
                                      std::max(pcie_seconds, nvme_seconds)));
  }

  // Optimizer state: the CPU optimizer reads and writes 16 bytes per element
  // (ZeRO-Infinity §4.1) at host memory speed; on NVMe it is also read and
  // written once, and the fp32 gradient is accumulated there every micro-step.
  if (p.optimizer != Tier::kGpu) {
    const double host_bytes = 2 * (kOptimizerBytes + kGrad32Bytes) * trained_shard;
    double seconds = host_bytes / host_bw;
    double nbytes = host_bytes;
    std::string path = "CPU memory";
    if (p.optimizer == Tier::kNvme) {
      const double read = (kOptimizerBytes + micro_steps * kGrad32Bytes) * trained_shard;
      const double write = (kOptimizerBytes + micro_steps * kGrad32Bytes) * trained_shard;
      seconds = std::max(seconds, read / nvme_read_bw + write / nvme_write_bw);
      nbytes = read + write;
      path = "NVMe <-> CPU";
    }
    pp.traffic.push_back(make_traffic(plan, "optimizer", path, nbytes, seconds));
  }

  // Activation checkpoints moved to CPU memory and back every micro-step.
  if (t.activation_checkpointing && t.checkpoints_on_cpu && plan.activations_checkpointed) {
    const double nbytes = micro_steps * 2 * plan.activations_checkpointed->checkpoints;
    pp.traffic.push_back(
        make_traffic(plan, "checkpoints", "GPU <-> CPU", nbytes, nbytes / hw.gpu_cpu_bw));
  }

  // Collectives (ZeRO §7: 2ψ elements for stages 0-2, 3ψ for stage 3, plus a
  // gather for the recompute). One reduce-scatter or allgather of all 16-bit
  // values moves (N-1)/N of them per rank, at the bus bandwidth.
  if (hw.data_parallel > 1 && hw.interconnect_bw) {
    // One pass over the gradients (reduce-scatter) or the updated parameters
    // (allgather after the step) covers the trained parameters only; stage
    // 3's gathers for compute cover every parameter, frozen ones too.
    const double grads = (n - 1) / n * c.trained_grad * c.trained;
    const double updated = (n - 1) / n * c.trained_param * c.trained;
    const double gathered = (n - 1) / n * c.weights(c.trained, c.frozen);
    double nbytes = 0;
    switch (p.stage) {
      case 0:
      case 1:
        nbytes = grads + updated;
        break;  // allreduce (= reduce-scatter + allgather), once per step
      case 2:
        nbytes = micro_steps * grads + updated;
        break;  // reduce-scatter per micro-step, allgather per step
      default:
        nbytes = micro_steps * (loads * gathered + grads);
        break;  // allgather per load, reduce-scatter per micro-step
    }
    pp.traffic.push_back(
        make_traffic(plan, "collectives", "GPU <-> GPU", nbytes, nbytes / *hw.interconnect_bw));
  }
  if (plan.tp_collective_nbytes > 0 && hw.interconnect_bw) {
    const double nbytes = micro_steps * plan.tp_collective_nbytes;
    pp.traffic.push_back(
        make_traffic(plan, "tensor parallel", "GPU <-> GPU", nbytes, nbytes / *hw.interconnect_bw));
  }
  if (t.context_exchange_nbytes > 0 && hw.interconnect_bw) {
    const double nbytes = micro_steps * t.context_exchange_nbytes;
    pp.traffic.push_back(
        make_traffic(plan, "context parallel", "GPU <-> GPU", nbytes, nbytes / *hw.interconnect_bw));
  }

  pp.step_seconds = plan.compute_seconds;
  for (const Traffic& c : pp.traffic) pp.step_seconds += c.seconds;
  pp.predicted_efficiency = plan.compute_seconds / pp.step_seconds;
}

void fill_shape_estimates(Plan& plan) {
  const ModelShape& m = plan.inputs.model;
  const TrainingShape& t = plan.inputs.training;
  if (!m.shape_known()) return;
  const double h = static_cast<double>(m.hidden), layers = static_cast<double>(m.layers);
  const double heads =
      m.heads > 0 ? static_cast<double>(m.heads) : std::max(1.0, std::floor(h / 128));
  // A rank's tokens: with context parallelism its seq / cp of each sequence.
  const double cp = static_cast<double>(t.context_parallel);
  const double tokens = static_cast<double>(t.micro_batch) * static_cast<double>(t.seq) / cp;
  const double seq = static_cast<double>(t.seq) / cp;
  const double per_checkpoint = static_cast<double>(std::min(t.layers_per_checkpoint, m.layers));
  // Activation checkpoints (ZeRO-Infinity §3): one 16-bit hidden state per
  // token every c_i layers, 2·bsz·seq·h·L/c_i bytes.
  // Tensor parallelism t: with sequence parallelism each rank keeps 1/t of
  // the residual stream (the checkpoints) and of a layer's activations;
  // without, Korthikanti et al.'s split: 10 of 34 s b h replicated, the rest / t.
  const double tp = static_cast<double>(t.tensor_parallel);
  const double checkpoints = std::ceil(layers / per_checkpoint) * 2 * tokens * h / (t.sequence_parallel ? tp : 1);
  // Activation working memory of one layer (ZeRO-Infinity §3):
  // bsz·seq·(16·h + 2·heads·seq) bytes — what a layer's forward keeps for its
  // backward. With checkpointing, one segment of c_i layers is live during
  // its recompute; without, every layer's is live at the end of the forward.
  const double hidden_share = t.sequence_parallel ? 1 / tp : (10 + 24 / tp) / 34;
  const double layer_working = tokens * (16 * h * hidden_share + 2 * heads * seq / tp);
  // LoRA's adapters keep no activation; their two [rows, r] 16-bit scratch
  // buffers are shared by every adapted projection (nn::LoraScratch).
  const double lora_scratch =
      plan.inputs.lora ? 2 * tokens * static_cast<double>(plan.inputs.lora->rank) * 2 : 0;
  plan.activations_checkpointed =
      ActivationBytes{checkpoints, per_checkpoint * layer_working + lora_scratch};
  plan.activations_full = ActivationBytes{0, layers * layer_working + lora_scratch};

  // Model-state working memory: the largest operator's 16-bit weight and
  // gradient, fetched whole (ZeRO-Infinity §3: 4·h·4h bytes for the h->4h linear).
  const double intermediate =
      std::max(m.intermediate > 0 ? static_cast<double>(m.intermediate) : 4 * h,
               static_cast<double>(m.shared_expert_intermediate));  // a shared expert may be wider
  // A tp rank holds intermediate / t of each MLP projection and vocab / t of the embedding's rows.
  plan.largest_operator = fmt::format("MLP projection ({} x {}{})", m.hidden, static_cast<int64_t>(intermediate),
                                      tp > 1 ? fmt::format(" / tp {}", t.tensor_parallel) : std::string());
  plan.largest_operator_numel = h * intermediate / tp;
  if (m.vocab > 0 && static_cast<double>(m.vocab) * h / tp > plan.largest_operator_numel) {  // vocabulary rows / tp
    plan.largest_operator = fmt::format("embedding / lm_head ({} x {}{})", m.vocab, m.hidden,
                                        tp > 1 ? fmt::format(" / tp {}", t.tensor_parallel) : std::string());
    plan.largest_operator_numel = static_cast<double>(m.vocab) * h / tp;
  }
  // A frozen operator (LoRA's base) is fetched without a gradient.
  plan.working_whole_nbytes =
      (plan.inputs.lora ? kParam16Bytes : kParam16Bytes + kGrad16Bytes) * plan.largest_operator_numel;
  plan.working_tiled_nbytes = plan.working_whole_nbytes / static_cast<double>(t.tiling);
  plan.ait_checkpoints = 24 * h * per_checkpoint;
  if (tp > 1) {
    // Per layer and micro-step, buffers of tokens x h (16-bit): without
    // sequence parallelism 2 allreduces in forward and 2 in backward (+2 per
    // recomputed layer), each moving 2 (t-1)/t of the buffer per rank; with
    // it 2 allgathers + 2 reduce-scatters forward, 4 + 2 backward (+2 + 2
    // recomputed), each (t-1)/t, and two more gathers per micro-step (the
    // final norm's output, the embedding's gradient). Either way the
    // vocabulary-parallel embedding's output and the loss's dh are summed
    // (2 allreduces, or reduce-scatters with it). strata's counts
    // (tests/engine/zero_tensor_parallel_test.cc), less the norms' [hidden]
    // weight-gradient sums and the loss's per-row parts, which are negligible.
    const double buffer = 2 * tokens * h, share = (tp - 1) / tp;
    const double recomputed = t.activation_checkpointing ? layers - 1 : 0;  // the top layer is not recomputed
    plan.tp_collective_nbytes =
        t.sequence_parallel ? share * buffer * (layers * 10 + recomputed * 4 + 4)
                            : 2 * share * buffer * (layers * 4 + recomputed * 2 + 2);
  }
}

void recommend(Plan& plan) {
  const auto& all = plan.placements;
  // Stage 0 (ZeRO's baseline) is planned for reference; strata runs stages
  // 1 to 3 only, so it is never the recommendation.
  const auto runnable = [&](size_t i) { return all[i].fits() && all[i].placement.stage >= 1; };
  std::optional<size_t> best;
  for (size_t i = 0; i < all.size(); ++i) {
    if (runnable(i) && (!best || all[i].predicted_efficiency > all[*best].predicted_efficiency)) best = i;
  }
  if (!best) {
    // Name the placement that comes closest on the GPU, and what it lacks.
    size_t closest = 0;
    for (size_t i = 1; i < all.size(); ++i) {
      if (all[i].total.gpu < all[closest].total.gpu) closest = i;
    }
    plan.reason = fmt::format("no placement is known to fit; the smallest on the GPU is {}: {}",
                              describe(all[closest].placement), all[closest].shortfall);
    return;
  }
  // Among placements within 0.1 points of the fastest, take the first: the
  // lowest stage and least offload, which has fewer moving parts.
  constexpr double kTie = 1e-3;
  for (size_t i = 0; i < all.size(); ++i) {
    if (runnable(i) && all[i].predicted_efficiency >= all[*best].predicted_efficiency - kTie) {
      best = i;
      break;
    }
  }
  plan.recommended = best;
  const PlacementPlan& pick = all[*best];
  size_t fitting = 0;
  for (size_t i = 0; i < all.size(); ++i) fitting += runnable(i) ? 1 : 0;
  plan.reason =
      fmt::format("{}: predicted {:.1f}% of peak, the fastest of the {} placements that fit",
                  describe(pick.placement), 100 * pick.predicted_efficiency, fitting);
  if (pick.needs_tiling) {
    plan.reason += fmt::format(" (with the largest operator fetched in {} tiles)",
                               plan.inputs.training.tiling);
  }
  const Traffic* slowest = nullptr;
  for (const Traffic& c : pick.traffic) {
    if (!slowest || c.seconds > slowest->seconds) slowest = &c;
  }
  if (slowest && slowest->efficiency < plan.inputs.target_efficiency) {
    plan.reason += fmt::format(
        "; its bottleneck is {} ({}) at {:.1f} GB/s per rank, {:.1f} GB/s would give {:.0f}%",
        slowest->name, slowest->path, gb(slowest->bandwidth), gb(slowest->bandwidth_needed),
        100 * plan.inputs.target_efficiency);
  }
  // Of the faster placements that do not fit, the one closest to fitting
  // (the smallest need-to-capacity ratio on its fullest tier), and why.
  const Machine& hw = plan.inputs.machine;
  const auto overshoot = [&](const PlacementPlan& pp) {
    const double ranks = static_cast<double>(hw.gpus_per_node);
    double worst = 0;
    for (const auto& [need, capacity] :
         {std::pair{pp.total.gpu, hw.gpu_nbytes}, std::pair{pp.total.cpu * ranks, hw.host_nbytes},
          std::pair{pp.total.nvme * ranks, hw.nvme_nbytes}}) {
      if (need <= 0) continue;
      worst = std::max(worst, capacity && *capacity > 0 ? need / *capacity : HUGE_VAL);
    }
    return worst;
  };
  const PlacementPlan* faster = nullptr;
  for (const auto& pp : all) {
    if (!pp.fits() && pp.predicted_efficiency > pick.predicted_efficiency + kTie &&
        (!faster || overshoot(pp) < overshoot(*faster))) {
      faster = &pp;
    }
  }
  if (faster) {
    plan.reason += fmt::format("; the nearest faster one, {} ({:.1f}%), does not fit: {}",
                               describe(faster->placement), 100 * faster->predicted_efficiency,
                               faster->shortfall);
  }
}

}  // namespace

std::string_view tier_name(Tier tier) {
  switch (tier) {
    case Tier::kGpu:
      return "gpu";
    case Tier::kCpu:
      return "cpu";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

double TierBytes::on(Tier tier) const {
  return tier == Tier::kGpu ? gpu : tier == Tier::kCpu ? cpu : nvme;
}

TierBytes& TierBytes::operator+=(const TierBytes& other) {
  gpu += other.gpu;
  cpu += other.cpu;
  nvme += other.nvme;
  return *this;
}

bool placement_valid(const Placement& p) {
  if (p.stage < 0 || p.stage > 3) return false;
  if (p.params != Tier::kGpu && p.stage != 3) return false;
  if (p.optimizer != Tier::kGpu && p.stage == 0) return false;
  // The optimizer on the GPU reads and writes the parameter shard there.
  if (p.params != Tier::kGpu && p.optimizer == Tier::kGpu) return false;
  return true;
}

std::vector<Placement> valid_placements() {
  std::vector<Placement> out;
  for (int stage = 0; stage <= 3; ++stage) {
    for (Tier params : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) {
      for (Tier optimizer : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) {
        const Placement p{stage, params, optimizer};
        if (placement_valid(p)) out.push_back(p);
      }
    }
  }
  return out;
}

std::string describe(const Placement& p) {
  return fmt::format("stage {}, params {}, optimizer {}", p.stage, tier_name(p.params),
                     tier_name(p.optimizer));
}

double zero_model_states_per_rank(int64_t param_count, int stage, int64_t data_parallel) {
  STRATA_CHECK(stage >= 0 && stage <= 3, kBadArgument, "plan: ZeRO stage {} is not 0, 1, 2 or 3",
               stage);
  check_count(data_parallel, 1, "the data-parallel degree");
  const double psi = static_cast<double>(param_count), n = static_cast<double>(data_parallel);
  const double p = kParam16Bytes, g = kGrad16Bytes, k = kOptimizerBytes;
  switch (stage) {
    case 0:
      return (p + g + k) * psi;
    case 1:
      return (p + g) * psi + k * psi / n;
    case 2:
      return p * psi + (g + k) * psi / n;
    default:
      return (p + g + k) * psi / n;
  }
}

int64_t transformer_param_count(int64_t layers, int64_t hidden) {
  return 12 * layers * hidden * hidden;
}

double efficiency(double ait, double bandwidth, double peak_flops) {
  return ait * bandwidth / (ait * bandwidth + peak_flops);
}

double bandwidth_for_efficiency(double ait, double target, double peak_flops) {
  return target * peak_flops / (ait * (1 - target));
}

Plan make_plan(const PlanInputs& inputs) {
  validate(inputs);
  Plan plan;
  plan.inputs = inputs;
  const TrainingShape& t = inputs.training;
  const double psi = static_cast<double>(inputs.model.param_count);
  // A rank's tokens (context parallelism: seq / cp of each sequence).
  const double tokens =
      static_cast<double>(t.micro_batch) * static_cast<double>(t.seq) / static_cast<double>(t.context_parallel);
  // 2 flops per parameter and token per pass: forward, backward (2 passes),
  // and the recompute under checkpointing (ZeRO-Infinity §4.1: 2·4·bsz·seq·ψ).
  const double passes = t.activation_checkpointing ? 4 : 3;
  // A token computes with its active parameters (a mixture of experts: k of
  // E experts); every parameter is stored and moved.
  const double active = inputs.model.active_params();
  if (!inputs.lora) {
    plan.flops_per_step = static_cast<double>(t.grad_accumulation) * 2 * passes * tokens * active;
    plan.model_states_nbytes = (kParam16Bytes + kGrad16Bytes + kOptimizerBytes) * psi;
    plan.model_states_with_grad32_nbytes = plan.model_states_nbytes + kGrad32Bytes * psi;
    for (int stage = 0; stage <= 3; ++stage) {
      plan.zero_stage_nbytes[static_cast<size_t>(stage)] =
          zero_model_states_per_rank(inputs.model.param_count, stage, inputs.machine.data_parallel);
    }
  } else {
    // A frozen weight needs no weight gradient: one backward pass (the
    // input's gradient) instead of two.
    const double adapters = static_cast<double>(inputs.lora->adapter_count);
    plan.flops_per_step = static_cast<double>(t.grad_accumulation) * 2 * tokens *
                          ((passes - 1) * psi + passes * adapters);
    LoraStates lora;
    lora.base_bytes_per_param = base_bytes_per_param(inputs, 3);
    lora.base_nbytes = lora.base_bytes_per_param * psi;
    lora.adapter_nbytes = lora.adapter_bytes_per_param * adapters;
    lora.full_finetune_nbytes = (kParam16Bytes + kGrad16Bytes + kOptimizerBytes) * psi;
    lora.ratio = (lora.base_nbytes + lora.adapter_nbytes) / lora.full_finetune_nbytes;
    plan.model_states_nbytes = lora.base_nbytes + lora.adapter_nbytes;
    plan.model_states_with_grad32_nbytes = plan.model_states_nbytes;
    // ZeRO's stages with the base's weights in place of its states: stage 1
    // partitions the adapters' K, 2 their gradients too, 3 everything.
    const double n = static_cast<double>(inputs.machine.data_parallel);
    // (An FP8 base stays FP8 at stage 3 only.)
    const double base = lora.base_nbytes, base16 = base_bytes_per_param(inputs, 2) * psi,
                 w = kAdapterParamBytes * adapters, g = kAdapterGradBytes * adapters, k = kOptimizerBytes * adapters;
    plan.zero_stage_nbytes = {base16 + w + g + k, base16 + w + g + k / n, base16 + w + (g + k) / n,
                              (base + w + g + k) / n};
    plan.lora = lora;
  }
  plan.compute_seconds = plan.flops_per_step / inputs.machine.peak_flops;
  // Flops per byte moved: each parameter serves every token of the batch, or
  // (experts) only the tokens routed to it, active / psi of them on average.
  plan.ait_params_grads = tokens * active / psi;
  plan.ait_optimizer = tokens / 4 * active / psi;
  fill_shape_estimates(plan);

  for (const Placement& p : valid_placements()) {
    PlacementPlan pp;
    pp.placement = p;
    pp.configured = inputs.configured_stage == p.stage && inputs.configured_params == p.params &&
                    inputs.configured_optimizer == p.optimizer;
    fill_memory(plan, pp);
    check_fit(plan, pp);
    fill_traffic(plan, pp);
    plan.placements.push_back(std::move(pp));
  }
  recommend(plan);

  const Machine& hw = inputs.machine;
  if (!inputs.model.shape_known()) {
    plan.notes.push_back(
        "layers and hidden size unknown: activations and working memory are not counted");
  } else if (inputs.model.heads == 0) {
    plan.notes.push_back("attention heads unknown: taken as hidden / 128");
  }
  if (hw.data_parallel > 1 && !hw.interconnect_bw) {
    plan.notes.push_back(
        "interconnect bandwidth unknown: collectives are not counted in the efficiency");
  }
  // DeepSpeed's default sub_group_size (1e9) makes the NVMe optimizer's pinned
  // buffers tens of GB (its issue #3000): say so when that matters here.
  const double staging = optimizer_staging_nbytes(plan);
  if (hw.host_nbytes && staging > 0.25 * *hw.host_nbytes / static_cast<double>(hw.gpus_per_node)) {
    plan.notes.push_back(
        fmt::format("with the optimizer on NVMe, {} pinned buffers of sub_group_size {:.3g} "
                    "elements take {:.1f} "
                    "GB of host memory per rank; a smaller zero_optimization.sub_group_size (or "
                    "offload_optimizer.buffer_count) shrinks them",
                    t.optimizer_buffer_count, static_cast<double>(t.sub_group_numel), gb(staging)));
  }
  plan.notes.push_back(
      "efficiency adds each class's transfer time to compute without overlap (ZeRO-Infinity's "
      "model): a lower "
      "bound where the prefetcher hides transfers");
  return plan;
}

}  // namespace strata::plan
