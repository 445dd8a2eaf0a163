// Rendering a Plan as JSON and as the human table of `strata plan`.
#include "runtime/plan/plan_report.h"

#include <fmt/format.h>

#include <cmath>

namespace strata::plan {
namespace {

using nlohmann::json;

// Whole bytes (or bytes/s) for JSON: the estimates are doubles, the output is not.
json whole(double value) {
  return static_cast<uint64_t>(std::llround(value));
}
json whole_or_null(const std::optional<double>& value) {
  return value ? whole(*value) : json(nullptr);
}

std::string_view fit_name(Fit fit) {
  switch (fit) {
    case Fit::kYes:
      return "yes";
    case Fit::kNo:
      return "no";
    case Fit::kUnknown:
      return "unknown";
  }
  return "?";
}

json tier_json(const PlacementPlan& pp, Tier tier) {
  return {{"total_bytes", whole(pp.total.on(tier))},
          {"param16_bytes", whole(pp.param16.on(tier))},
          {"grad16_bytes", whole(pp.grad16.on(tier))},
          {"optimizer_bytes", whole(pp.optimizer.on(tier))},
          {"grad32_bytes", whole(pp.grad32.on(tier))},
          {"activation_bytes", whole(pp.activations.on(tier))},
          {"working_bytes", whole(pp.working.on(tier))},
          {"buffer_bytes", whole(pp.buffers.on(tier))}};
}

json activations_json(const std::optional<ActivationBytes>& a) {
  if (!a) return nullptr;
  return {{"checkpoint_bytes", whole(a->checkpoints)},
          {"working_bytes", whole(a->working)},
          {"total_bytes", whole(a->total())}};
}

struct Scale {
  double divisor;
  const char* name;
};

Scale scale_of(Units units) {
  return units == Units::kGB ? Scale{1e9, "GB"} : Scale{0x1p30, "GiB"};
}

std::string traffic_label(const std::string& name) {
  if (name == "params_grads") return "params/grads";
  if (name == "optimizer") return "optimizer state";
  if (name == "checkpoints") return "act. checkpoints";
  return name;
}

// "yes", "tiled" (fits with the largest operator tiled), "no", or "?" (a tier's capacity unknown).
std::string_view fits_label(const PlacementPlan& pp) {
  if (pp.fits()) return pp.needs_tiling ? "tiled" : "yes";
  const bool short_somewhere =
      pp.gpu_fit == Fit::kNo || pp.cpu_fit == Fit::kNo || pp.nvme_fit == Fit::kNo;
  return short_somewhere ? "no" : "?";
}

}  // namespace

json to_json(const Plan& plan) {
  const PlanInputs& in = plan.inputs;
  json out;
  out["model"] = {{"param_count", in.model.param_count},
                  {"layers", in.model.layers},
                  {"hidden", in.model.hidden},
                  {"heads", in.model.heads},
                  {"intermediate", in.model.intermediate},
                  {"vocab", in.model.vocab},
                  {"experts", in.model.experts},
                  {"experts_per_token", in.model.experts_per_token},
                  {"shared_expert_intermediate", in.model.shared_expert_intermediate},
                  {"active_param_count", static_cast<int64_t>(in.model.active_params())},
                  {"active_param_count_without_input_embedding",
                   static_cast<int64_t>(in.model.active_params()) - in.model.input_embedding_count},
                  {"checkpoint_param_count", in.model.param_count + in.model.carried_param_count}};
  const TrainingShape& t = in.training;
  out["training"] = {{"seq", t.seq},
                     {"micro_batch", t.micro_batch},
                     {"grad_accumulation", t.grad_accumulation},
                     {"activation_checkpointing", t.activation_checkpointing},
                     {"layers_per_checkpoint", t.layers_per_checkpoint},
                     {"checkpoints_on_cpu", t.checkpoints_on_cpu},
                     {"tiling", t.tiling},
                     {"tensor_parallel", t.tensor_parallel},
                     {"sequence_parallel", t.sequence_parallel},
                     {"context_parallel", t.context_parallel}};
  const Machine& hw = in.machine;
  out["machine"] = {{"gpus_per_node", hw.gpus_per_node},
                    {"nodes", hw.nodes},
                    {"data_parallel", hw.data_parallel},
                    {"gpu_bytes", whole_or_null(hw.gpu_nbytes)},
                    {"host_bytes", whole_or_null(hw.host_nbytes)},
                    {"nvme_bytes", whole_or_null(hw.nvme_nbytes)},
                    {"gpu_cpu_bytes_per_s", whole(hw.gpu_cpu_bw)},
                    {"nvme_read_bytes_per_s", whole(hw.nvme_read_bw)},
                    {"nvme_write_bytes_per_s", whole(hw.nvme_write_bw)},
                    {"host_memory_bytes_per_s", whole(hw.host_memory_bw)},
                    {"interconnect_bytes_per_s", whole_or_null(hw.interconnect_bw)},
                    {"peak_flops", hw.peak_flops}};
  out["target_efficiency"] = in.target_efficiency;
  out["compute"] = {{"flops_per_step", plan.flops_per_step},
                    {"seconds_per_step", plan.compute_seconds}};
  json stages = json::array();
  for (int s = 0; s <= 3; ++s) {
    stages.push_back(
        {{"stage", s}, {"bytes_per_rank", whole(plan.zero_stage_nbytes[static_cast<size_t>(s)])}});
  }
  out["model_states"] = {{"bytes", whole(plan.model_states_nbytes)},
                         {"bytes_with_fp32_grads", whole(plan.model_states_with_grad32_nbytes)},
                         {"zero_stages", stages}};
  if (plan.lora && in.lora) {
    const LoraStates& l = *plan.lora;
    out["lora"] = {{"rank", in.lora->rank},
                   {"targets", in.lora->targets},
                   {"base_param_count", in.model.param_count},
                   {"adapter_param_count", in.lora->adapter_count},
                   {"base_bytes_per_param", l.base_bytes_per_param},
                   {"base_quantized_param_count", in.lora->quantized_param_count},
                   {"base_quantized_format", in.lora->quantized_param_count > 0 ? in.lora->quantized_format : ""},
                   {"adapter_bytes_per_param", l.adapter_bytes_per_param},
                   {"base_bytes", whole(l.base_nbytes)},
                   {"adapter_bytes", whole(l.adapter_nbytes)},
                   {"model_states_bytes", whole(l.base_nbytes + l.adapter_nbytes)},
                   {"full_finetune_bytes", whole(l.full_finetune_nbytes)},
                   {"ratio_to_full_finetune", l.ratio}};
  }  // without LoRA the JSON is as before: no "lora" key
  out["activations"] = {{"checkpointed", activations_json(plan.activations_checkpointed)},
                        {"full", activations_json(plan.activations_full)}};
  if (plan.largest_operator_numel > 0) {
    out["working_memory"] = {{"operator", plan.largest_operator},
                             {"numel", whole(plan.largest_operator_numel)},
                             {"whole_bytes", whole(plan.working_whole_nbytes)},
                             {"tiled_bytes", whole(plan.working_tiled_nbytes)},
                             {"tiling", t.tiling}};
  } else {
    out["working_memory"] = nullptr;
  }
  const double target = in.target_efficiency, peak = hw.peak_flops;
  json ait = {{"params_grads", plan.ait_params_grads}, {"optimizer", plan.ait_optimizer}};
  json needed = {
      {"params_grads", whole(bandwidth_for_efficiency(plan.ait_params_grads, target, peak))},
      {"optimizer", whole(bandwidth_for_efficiency(plan.ait_optimizer, target, peak))}};
  if (plan.ait_checkpoints > 0) {
    ait["checkpoints"] = plan.ait_checkpoints;
    needed["checkpoints"] = whole(bandwidth_for_efficiency(plan.ait_checkpoints, target, peak));
  }
  out["arithmetic_intensity"] = ait;
  out["bandwidth_needed_bytes_per_s"] = needed;

  json placements = json::array();
  for (const PlacementPlan& pp : plan.placements) {
    json traffic = json::array();
    for (const Traffic& c : pp.traffic) {
      traffic.push_back({{"class", c.name},
                         {"path", c.path},
                         {"bytes_per_step", whole(c.nbytes)},
                         {"bytes_per_s", whole(c.bandwidth)},
                         {"seconds", c.seconds},
                         {"ait", c.ait},
                         {"efficiency", c.efficiency},
                         {"bytes_per_s_needed", whole(c.bandwidth_needed)}});
    }
    placements.push_back({{"stage", pp.placement.stage},
                          {"params", tier_name(pp.placement.params)},
                          {"optimizer", tier_name(pp.placement.optimizer)},
                          {"configured", pp.configured},
                          {"fits", pp.fits()},
                          {"fit",
                           {{"gpu", fit_name(pp.gpu_fit)},
                            {"cpu", fit_name(pp.cpu_fit)},
                            {"nvme", fit_name(pp.nvme_fit)}}},
                          {"needs_tiling", pp.needs_tiling},
                          {"shortfall", pp.shortfall},
                          {"gpu", tier_json(pp, Tier::kGpu)},
                          {"cpu", tier_json(pp, Tier::kCpu)},
                          {"nvme", tier_json(pp, Tier::kNvme)},
                          {"traffic", traffic},
                          {"step_seconds", pp.step_seconds},
                          {"predicted_efficiency", pp.predicted_efficiency}});
  }
  out["placements"] = placements;
  if (plan.recommended) {
    const PlacementPlan& pick = plan.placements[*plan.recommended];
    out["recommendation"] = {{"stage", pick.placement.stage},
                             {"params", tier_name(pick.placement.params)},
                             {"optimizer", tier_name(pick.placement.optimizer)},
                             {"predicted_efficiency", pick.predicted_efficiency},
                             {"needs_tiling", pick.needs_tiling}};
  } else {
    out["recommendation"] = nullptr;
  }
  out["reason"] = plan.reason;
  out["notes"] = plan.notes;
  return out;
}

std::string to_text(const Plan& plan, Units units) {
  const Scale scale = scale_of(units);
  const auto size = [&](double nbytes) { return fmt::format("{:.1f}", nbytes / scale.divisor); };
  const auto rate = [](double bytes_per_s) {
    return fmt::format("{:.1f} GB/s", bytes_per_s / 1e9);
  };
  const PlanInputs& in = plan.inputs;
  const TrainingShape& t = in.training;
  std::string out;

  out += fmt::format("\nModel states (ZeRO, mixed-precision Adam, K = 12)\n");
  if (plan.lora && in.lora) {
    const LoraStates& l = *plan.lora;
    const auto count = [](double n) {
      return n >= 1e9   ? fmt::format("{:.2f}B", n / 1e9)
             : n >= 1e6 ? fmt::format("{:.2f}M", n / 1e6)
                        : fmt::format("{:.0f}", n);
    };
    std::string targets;
    for (const std::string& name : in.lora->targets) targets += (targets.empty() ? "" : ",") + name;
    const double psi = static_cast<double>(in.model.param_count);
    const double adapters = static_cast<double>(in.lora->adapter_count);
    out += fmt::format("  LoRA rank {} on {}: the base frozen, the adapters trained in fp32\n",
                       in.lora->rank, targets);
    if (in.lora->quantized_param_count > 0) {
      const std::string& format = in.lora->quantized_format;
      out += fmt::format(
          "  base             {} parameters, frozen: {:.3g} B/param at ZeRO-3 (the {} checkpoint's {} {} "
          "weights kept in {}, {:.4g} B each with their scales, the rest 16-bit; 2 B below stage 3; on the "
          "parameters' tier, no gradient, no optimizer state) = {} {}\n",
          count(psi), l.base_bytes_per_param, format, count(static_cast<double>(in.lora->quantized_param_count)),
          format, format, in.lora->quantized_bytes_per_param, size(l.base_nbytes), scale.name);
    } else {
      out += fmt::format(
          "  base             {} parameters, frozen: {:.0f} B/param (16-bit weights only, on the "
          "parameters' tier; no gradient, no optimizer state) = {} {}\n",
          count(psi), l.base_bytes_per_param, size(l.base_nbytes), scale.name);
    }
    out += fmt::format(
        "  adapters         {} parameters ({:.3g}% of the base): {:.0f} B/param (fp32 weight "
        "{:.0f} + "
        "gradient {:.0f} on the GPU, optimizer state {:.0f} on the optimizer's tier) = {} {}\n",
        count(adapters), 100 * adapters / psi, l.adapter_bytes_per_param, kAdapterParamBytes,
        kAdapterGradBytes, kOptimizerBytes, size(l.adapter_nbytes), scale.name);
    out += fmt::format(
        "  whole model      {} {}, vs {} {} to fine-tune every parameter at 16 B/param: {:.3g} of "
        "it\n",
        size(plan.model_states_nbytes), scale.name, size(l.full_finetune_nbytes), scale.name,
        l.ratio);
  } else {
    // With tensor parallelism ψ is one tp rank's tensors (its shards and the replicated ones).
    out += fmt::format(
        "  {}{} {} at 16 B/param; {} {} at 20 B/param (with fp32 gradients, as "
        "ZeRO-Infinity counts)\n",
        in.training.tensor_parallel > 1 ? fmt::format("a tp {} rank's   ", in.training.tensor_parallel)
                                        : std::string("whole model      "),
        size(plan.model_states_nbytes), scale.name, size(plan.model_states_with_grad32_nbytes),
        scale.name);
  }
  out += fmt::format("  per rank, N_d = {}:", in.machine.data_parallel);
  static constexpr const char* kStageNames[] = {"baseline", "P_os", "P_os+g", "P_os+g+p"};
  for (size_t s = 0; s < 4; ++s) {
    out += fmt::format("  stage {} ({}) {} {}", s, kStageNames[s], size(plan.zero_stage_nbytes[s]),
                       scale.name);
    out += s < 3 ? "," : "\n";
  }

  if (plan.activations_checkpointed && plan.activations_full) {
    out += fmt::format("\nActivations per rank (micro-batch {} x seq {}{})\n", t.micro_batch, t.seq,
                       t.context_parallel > 1 ? fmt::format(" / cp {}: {} tokens of each sequence per rank",
                                                            t.context_parallel, t.seq / t.context_parallel)
                                              : std::string());
    out += fmt::format(
        "  checkpointed every {} layer(s)  {} {} checkpoints + {} {} working (recompute of one "
        "segment)\n",
        std::min(t.layers_per_checkpoint, in.model.layers),
        size(plan.activations_checkpointed->checkpoints), scale.name,
        size(plan.activations_checkpointed->working), scale.name);
    out += fmt::format("  without checkpointing          {} {}\n",
                       size(plan.activations_full->total()), scale.name);
    out += fmt::format(
        "Largest operator: {}, {:.3g} elements: {} {} fetched whole, {} {} in {} tiles\n",
        plan.largest_operator, plan.largest_operator_numel, size(plan.working_whole_nbytes),
        scale.name, size(plan.working_tiled_nbytes), scale.name, t.tiling);
  }

  const double target = in.target_efficiency, peak = in.machine.peak_flops;
  out += fmt::format(
      "\nBandwidth for {:.0f}% efficiency at {:.0f} TFLOPS per GPU (ZeRO-Infinity: one GPU, no "
      "partitioning)\n",
      100 * target, peak / 1e12);
  auto need_line = [&](const char* what, const char* formula, double ait) {
    out += fmt::format("  {:<17} AIT {:<10} = {:<9.0f} needs {}\n", what, formula, ait,
                       rate(bandwidth_for_efficiency(ait, target, peak)));
  };
  need_line("params/grads", "seq*bsz", plan.ait_params_grads);
  need_line("optimizer state", "seq*bsz/4", plan.ait_optimizer);
  if (plan.ait_checkpoints > 0) need_line("act. checkpoints", "24*h*c_i", plan.ait_checkpoints);

  out += fmt::format(
      "\nPlacements ({} per rank; CPU and NVMe are this rank's share of its node; * = the "
      "ds_config's)\n",
      scale.name);
  out += fmt::format("  {:<1} {:>5} {:<6} {:<9} {:>9} {:>9} {:>9}  {:<6} {:>10}  {}\n", "", "stage",
                     "params", "optimizer", "GPU", "CPU", "NVMe", "fits", "efficiency",
                     "slowest transfer (per rank)");
  for (const PlacementPlan& pp : plan.placements) {
    const Traffic* slowest = nullptr;
    for (const Traffic& c : pp.traffic) {
      if (!slowest || c.seconds > slowest->seconds) slowest = &c;
    }
    const std::string_view fits = fits_label(pp);
    const std::string bottleneck =
        slowest ? fmt::format("{} {} ({}; {:.0f}% alone)", traffic_label(slowest->name),
                              rate(slowest->bandwidth), slowest->path, 100 * slowest->efficiency)
                : "none";
    out += fmt::format("  {:<1} {:>5} {:<6} {:<9} {:>9} {:>9} {:>9}  {:<6} {:>9.1f}%  {}\n",
                       pp.configured ? "*" : "", pp.placement.stage, tier_name(pp.placement.params),
                       tier_name(pp.placement.optimizer), size(pp.total.gpu), size(pp.total.cpu),
                       size(pp.total.nvme), fits, 100 * pp.predicted_efficiency, bottleneck);
  }

  out += plan.recommended ? "\nRecommended: " : "\nNo recommendation: ";
  out += plan.reason + "\n";
  for (const PlacementPlan& pp : plan.placements) {
    if (pp.configured && !pp.fits()) {
      out += fmt::format("The ds_config's placement ({}) does not fit: {}\n",
                         describe(pp.placement), pp.shortfall);
    }
  }
  if (!plan.notes.empty()) {
    out += "Notes\n";
    for (const std::string& note : plan.notes) out += "  - " + note + "\n";
  }
  return out;
}

}  // namespace strata::plan
