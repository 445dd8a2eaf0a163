// `strata plan`: memory per tier and rank for every ZeRO stage and offload
// placement, the bandwidth each needs, the efficiency predicted and the
// placement to use, for a model (HF config.json or sizes), an optional
// ds_config and a machine (detected, or described by flags). The model is in
// runtime/plan; this file turns flags, files and probes into its inputs
// (plan_resolved.h's Resolved) and says where each value came from. The
// parallel dimensions resolve in plan_parallelism.cc, the micro-batch order
// in plan_micro_batch_order.cc; --check RUN is plan_check_cmd.cc.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "runtime/cli/commands.h"
#include "runtime/cli/plan_cli.h"
#include "runtime/cli/plan_resolved.h"
#include "runtime/config/config.h"
#include "runtime/config/engine_options.h"
#include "runtime/config/json_text.h"
#include "runtime/config/size.h"
#include "core/error.h"
#include "runtime/nn/context_attention.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/nn/lora.h"
#include "runtime/plan/machine_probe.h"
#include "runtime/pipeline/schedule.h"
#include "runtime/plan/plan.h"
#include "runtime/plan/plan_report.h"
#include "runtime/plan/runtime_memory.h"
#include "partition/layout.h"
#include "runtime/engine/zero_sizes.h"

namespace strata::cli {

namespace plan_cli {

[[noreturn]] void bad(const std::string& flag, const std::string& text,
                      const std::string& expected) {
  raise(ErrorCategory::kBadArgument, "{}: '{}' is not {}", flag, printable_excerpt(text, 60),
        expected);
}

std::optional<double> parse_number(std::string_view text) {
  double value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || stop != end || !std::isfinite(value)) return std::nullopt;
  return value;
}

int64_t parse_integer(const std::string& flag, const std::string& text, int64_t min) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || stop != end || value < min)
    bad(flag, text, fmt::format("an integer >= {}", min));
  return value;
}

// A memory size: a bare number is GB (1e9 bytes); else a size with its unit
// (80GB, 80GiB, 512M; as in configs, K/M/G/T alone are binary).
double parse_memory(const std::string& flag, const std::string& text) {
  if (const auto gb = parse_number(text)) {
    if (*gb < 0) bad(flag, text, "a size >= 0 (GB, or with a unit: 80GB, 80GiB)");
    return *gb * 1e9;
  }
  const auto nbytes = parse_size(text);
  if (!nbytes) bad(flag, text, "a size >= 0 (GB, or with a unit: 80GB, 80GiB)");
  return static_cast<double>(*nbytes);
}

}  // namespace plan_cli

namespace {

using plan::Tier;
using namespace plan_cli;
using Options = PlanOptions;

// A parameter count: 7.5B, 100B, 0.1T, 350M, 1.3e9 (K, M, B or G, T are decimal).
int64_t parse_param_count(const std::string& flag, const std::string& text) {
  std::string digits = text;
  double scale = 1;
  if (!digits.empty() && std::isalpha(static_cast<unsigned char>(digits.back()))) {
    switch (std::toupper(static_cast<unsigned char>(digits.back()))) {
      case 'K':
        scale = 1e3;
        break;
      case 'M':
        scale = 1e6;
        break;
      case 'B':
      case 'G':
        scale = 1e9;
        break;
      case 'T':
        scale = 1e12;
        break;
      default:
        bad(flag, text, "a parameter count (examples: 7.5B, 100B, 0.1T, 350M, 1.3e9)");
    }
    digits.pop_back();
  }
  const auto number = parse_number(digits);
  const double count = number ? std::round(*number * scale) : 0;
  if (!number || count < 1 || count > 0x1p62) {
    bad(flag, text, "a parameter count from 1 to 2^62 (examples: 7.5B, 100B, 0.1T, 350M, 1.3e9)");
  }
  return static_cast<int64_t>(count);
}

// A bandwidth: a bare number is GB/s; else a size with an optional "/s" (25GB/s, 12GiB/s).
double parse_rate(const std::string& flag, const std::string& text) {
  std::string size_text = text;
  if (size_text.size() > 2 && size_text.compare(size_text.size() - 2, 2, "/s") == 0)
    size_text.resize(size_text.size() - 2);
  double bytes_per_s = 0;
  if (const auto gb = parse_number(size_text)) {
    bytes_per_s = *gb * 1e9;
  } else if (const auto nbytes = parse_size(size_text)) {
    bytes_per_s = static_cast<double>(*nbytes);
  }
  if (!(bytes_per_s > 0))
    bad(flag, text, "a bandwidth above 0 (GB/s, or with a unit: 25GB/s, 12GiB/s)");
  return bytes_per_s;
}

double parse_fraction(const std::string& flag, const std::string& text) {
  const bool percent = !text.empty() && text.back() == '%';
  const auto number =
      parse_number(percent ? std::string_view(text).substr(0, text.size() - 1) : text);
  const double value = number ? *number / (percent ? 100 : 1) : 0;
  if (!(value > 0 && value < 1)) bad(flag, text, "an efficiency between 0 and 1 (0.9, or 90%)");
  return value;
}

// The plan's name for where the engine keeps a kind of state.
Tier tier_of(strata::Tier tier) {
  return tier == strata::Tier::kCpu    ? Tier::kCpu
         : tier == strata::Tier::kNvme ? Tier::kNvme
                                       : Tier::kGpu;
}

std::string gb_text(double nbytes) {
  return fmt::format("{:.1f} GB", nbytes / 1e9);
}

// 7.5B, 100.7B, 1.0T, 350.0M: parameter counts as papers write them.
std::string count_text(int64_t count) {
  const double n = static_cast<double>(count);
  if (n >= 1e12) return fmt::format("{:.2f}T", n / 1e12);
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  return std::to_string(count);
}


void resolve_model(const Options& o, Resolved& r) {
  plan::ModelShape& m = r.inputs.model;
  const bool sizes_given = !o.params.empty() || !o.layers.empty() || !o.hidden.empty() ||
                           !o.heads.empty() || !o.intermediate.empty() || !o.vocab.empty();
  if (!o.model.empty()) {
    if (sizes_given)
      raise(ErrorCategory::kBadArgument,
            "--model gives the model's shape; --params, --layers, --hidden, --heads, "
            "--intermediate and "
            "--vocab cannot be combined with it");
    std::filesystem::path path = o.model;
    if (std::filesystem::is_directory(path)) path /= "config.json";
    if (!std::filesystem::exists(path))
      raise(ErrorCategory::kBadArgument, "--model: {} does not exist{}", path.string(),
            std::filesystem::is_directory(o.model) ? " (the directory has no config.json)" : "");
    const nn::DecoderConfig& config = r.config.emplace(nn::load_decoder_config(path.string()));
    m = plan::decoder_model_shape(config);
    m.carried_param_count = config.checkpoint_parameter_count() - config.parameter_count();
    r.model_source = path.string();
    return;
  }
  if (!o.layers.empty()) m.layers = parse_integer("--layers", o.layers, 1);
  if (!o.hidden.empty()) m.hidden = parse_integer("--hidden", o.hidden, 1);
  if (!o.heads.empty()) m.heads = parse_integer("--heads", o.heads, 1);
  if (!o.intermediate.empty()) m.intermediate = parse_integer("--intermediate", o.intermediate, 1);
  if (!o.vocab.empty()) m.vocab = parse_integer("--vocab", o.vocab, 1);
  if ((m.layers > 0) != (m.hidden > 0))
    raise(ErrorCategory::kBadArgument,
          "--layers and --hidden go together: give both (or only --params for model states alone)");
  if (!o.params.empty()) {
    m.param_count = parse_param_count("--params", o.params);
    r.model_source = "--params";
  } else {
    if (m.layers == 0)
      raise(ErrorCategory::kBadArgument,
            "no model: give --model (a Hugging Face config.json or its directory), --params, or "
            "--layers and "
            "--hidden");
    // 12·L·h² for the layers (ZeRO-Infinity's count), plus embedding and lm_head when the vocabulary is
    // known.
    const double count = 12.0 * static_cast<double>(m.layers) * static_cast<double>(m.hidden) *
                             static_cast<double>(m.hidden) +
                         2.0 * static_cast<double>(m.vocab) * static_cast<double>(m.hidden);
    if (count > 0x1p62)
      raise(ErrorCategory::kBadArgument,
            "--layers {} and --hidden {} give {:.3g} parameters, beyond 2^62", m.layers, m.hidden,
            count);
    m.param_count = static_cast<int64_t>(count);
    r.model_source = m.vocab > 0 ? "12*layers*hidden^2 + 2*vocab*hidden" : "12*layers*hidden^2";
  }
}

// --lora-rank and --lora-targets, parsed and checked as finetune does, and
// the adapters' exact parameter count: r·(in + out) for every targeted
// projection of every layer, from the model's own tensor list with --model,
// else from --layers, --hidden and --intermediate.
void resolve_lora(const Options& o, Resolved& r) {
  if (o.lora_rank.empty()) {
    if (!o.lora_targets.empty())
      raise(ErrorCategory::kBadArgument, "--lora-targets needs --lora-rank (LoRA adapters)");
    return;
  }
  nn::LoraSpec spec;
  spec.rank = parse_integer("--lora-rank", o.lora_rank, 1);
  spec.alpha = 8;  // PEFT's default; the scale changes no size
  spec.targets = nn::parse_lora_targets(o.lora_targets.empty() ? "q_proj,v_proj" : o.lora_targets);
  spec.validate();
  if (r.config) {
    nn::resolve_lora_targets(spec, *r.config);
  } else if (spec.targets.front() == nn::kAllLinear) {
    spec.targets = nn::lora_projections(nn::DecoderConfig{});  // a dense model's: attention and MLP
  }
  r.lora = spec;
  plan::LoraShape lora;
  lora.rank = spec.rank;
  lora.targets = spec.targets;
  double count = 0;
  if (r.config) {
    for (const nn::HfTensor& t : nn::hf_tensors(*r.config)) {
      constexpr std::string_view kWeight = ".weight";
      const std::string_view name = t.name;
      if (name.size() <= kWeight.size() || name.substr(name.size() - kWeight.size()) != kWeight)
        continue;
      if (!spec.targets_module(name.substr(0, name.size() - kWeight.size()))) continue;
      // A projection's weight is [out, in].
      count += static_cast<double>(spec.rank) * static_cast<double>(t.shape[0] + t.shape[1]);
    }
  } else {
    const plan::ModelShape& m = r.inputs.model;
    if (!m.shape_known())
      raise(ErrorCategory::kBadArgument,
            "--lora-rank needs the projections' shapes: give --model (a Hugging Face config.json or "
            "its directory), or --layers and --hidden (and --intermediate for MLP targets); "
            "--params alone does not say them");
    const double h = static_cast<double>(m.hidden);
    for (const std::string& target : spec.targets) {
      const bool mlp = target == "gate_proj" || target == "up_proj" || target == "down_proj";
      if (mlp && m.intermediate == 0)
        raise(ErrorCategory::kBadArgument,
              "--lora-targets {}: the MLP's width is unknown: give --intermediate (or --model)",
              target);
      // Attention projections are hidden x hidden (every head its own k and
      // v: without --model the key/value heads are not known); the MLP's
      // hidden x intermediate.
      const double in_out = mlp ? h + static_cast<double>(m.intermediate) : 2 * h;
      count += static_cast<double>(m.layers) * static_cast<double>(spec.rank) * in_out;
    }
    const bool kv = std::find(spec.targets.begin(), spec.targets.end(), "k_proj") != spec.targets.end() ||
                    std::find(spec.targets.begin(), spec.targets.end(), "v_proj") != spec.targets.end();
    if (kv)
      r.hints.push_back(
          "LoRA: k_proj and v_proj taken as hidden x hidden (no grouped-query attention); give "
          "--model for the exact adapter count of a GQA model");
  }
  if (count > 0x1p62)
    raise(ErrorCategory::kBadArgument, "--lora-rank {} gives {:.3g} adapter parameters, beyond 2^62",
          spec.rank, count);
  lora.adapter_count = static_cast<int64_t>(count);
  if (r.config && r.config->quant.quantized()) {
    // The weights a checkpoint stores quantized, as the published ones do --
    // FP8: plan::stored_fp8 (the layers' 2-D weights but the router's and
    // modules_to_not_convert's); MXFP4: gpt-oss's stacked expert weights.
    const nn::CheckpointQuant& q = r.config->quant;
    const bool mxfp4 = q.method == nn::QuantMethod::kMxfp4;
    int64_t quantized = 0;
    for (const nn::HfTensor& t : nn::hf_tensors(*r.config)) {
      const std::string& name = t.name;
      const bool stored = mxfp4 ? t.shape.size() == 3 && name.find(".mlp.experts.") != std::string::npos &&
                                      !name.ends_with("_bias") && !q.not_converted(name.substr(0, name.rfind('.')))
                                : plan::stored_fp8(*r.config, name, t.shape);
      if (stored) quantized += shape_numel(t.shape);
    }
    lora.quantized_param_count = quantized;
    lora.quantized_bytes_per_param = mxfp4 ? 17.0 / 32.0 : 1 + 4 / (static_cast<double>(q.block_rows) * q.block_cols);
    lora.quantized_format = mxfp4 ? "MXFP4" : "FP8";
  }
  r.inputs.lora = std::move(lora);
}

void resolve_training(const Options& o, const std::optional<Config>& config, Resolved& r) {
  plan::TrainingShape& t = r.inputs.training;
  if (config) {
    // The shape from the same mapping the engine is built with (engine_options.h).
    const engine::ZeroEngineOptions z = zero_engine_options(*config, o.config);
    t.micro_batch = config->micro_batch_size;
    t.grad_accumulation = config->gradient_accumulation_steps;
    t.checkpoints_on_cpu = config->cpu_checkpointing;
    // auto counts as recompute: what a run keeps depends on its accelerator's memory.
    t.layer_major_keeps_activations = config->strata.keeps_layer_activations();
    r.reduce_bucket_given = z.reduce_bucket_numel;  // 0: chosen from the model (resolve_zero_sizes)
    t.prefetch_bucket_numel = z.prefetch_bucket_numel;
    r.sub_group_given = z.sub_group_numel;
    t.param_buffer_count = static_cast<int>(z.param_buffer_count);
    t.param_buffer_numel = z.param_buffer_numel;
    t.optimizer_buffer_count = static_cast<int>(z.optimizer_buffer_count);
    r.inputs.configured_stage = z.stage;
    r.inputs.configured_params = tier_of(z.param_tier);
    r.inputs.configured_optimizer = tier_of(z.optimizer_tier);
  }
  if (!o.seq.empty()) t.seq = parse_integer("--seq", o.seq, 1);
  if (!o.batch.empty()) t.micro_batch = parse_integer("--batch", o.batch, 1);
  if (!o.grad_accum.empty()) t.grad_accumulation = parse_integer("--grad-accum", o.grad_accum, 1);
  if (!o.checkpoint_every.empty())
    t.layers_per_checkpoint = parse_integer("--checkpoint-every", o.checkpoint_every, 1);
  if (!o.tiling.empty()) t.tiling = parse_integer("--tiling", o.tiling, 1);
  t.activation_checkpointing = !o.no_checkpointing;
}

// sub_group_size and reduce_bucket_size as the engine would use them over
// N_d ranks: a size the config gives (or leaves out, or no --config) through
// the engine's own choice (engine::choose_zero_sizes), from the model's tensor
// list with --model; else from a layer of 12·hidden² (4·hidden² + 3·hidden·
// intermediate with --intermediate) and a norm per layer; else (--params
// alone) the whole model as one piece.
void resolve_zero_sizes(Resolved& r) {
  const plan::ModelShape& m = r.inputs.model;
  std::vector<engine::SizedParam> sized;
  const DType dtype = DType::kBF16;  // 16-bit parameters, as the plan's formulas take them
  if (r.config) {
    sized = plan::decoder_sized_params(*r.config, dtype, r.lora, r.tensor_parallel);
  } else if (m.shape_known()) {
    const int64_t h = m.hidden;
    const int64_t block = m.intermediate > 0 ? 4 * h * h + 3 * h * m.intermediate : 12 * h * h;
    const bool lora = r.lora.enabled() && r.inputs.lora;
    if (m.vocab > 0) sized.push_back({"embed_tokens", m.vocab * h, dtype, !lora});
    for (int64_t l = 0; l < m.layers; ++l) {
      const std::string layer = fmt::format("layers.{}.", l);
      sized.push_back({layer + "block", block, dtype, !lora});
      sized.push_back({layer + "norm", h, dtype, !lora});
      if (lora) sized.push_back({layer + "lora", r.inputs.lora->adapter_count / m.layers, DType::kF32, true});
    }
  } else {
    sized.push_back({"model", m.param_count, dtype, true});
  }
  r.zero_sizes = engine::choose_zero_sizes(sized, static_cast<int>(r.inputs.machine.data_parallel),
                                           r.sub_group_given, r.reduce_bucket_given,
                                           partition::kDefaultAlignmentNbytes);
  r.inputs.training.sub_group_numel = r.zero_sizes.sub_group_numel;
  r.inputs.training.reduce_bucket_numel = r.zero_sizes.reduce_bucket_numel;
}


void resolve_machine(const Options& o, const std::optional<Config>& config, Resolved& r) {
  plan::Machine& hw = r.inputs.machine;
  auto& src = r.sources;
  const plan::DetectedMachine found = plan::detect_machine();

  // 0: not given. (Plain integers, not std::optional: GCC 12 warns that an
  // optional's value may be uninitialised here, wrongly, and warnings are errors.)
  const int64_t dp = o.dp.empty() ? 0 : parse_integer("--dp", o.dp, 1);
  const int64_t nodes = o.nodes.empty() ? 0 : parse_integer("--nodes", o.nodes, 1);
  if (!o.gpus.empty()) {
    hw.gpus_per_node = parse_integer("--gpus", o.gpus, 1);
    src["gpus_per_node"] = "--gpus";
  } else if (found.gpu_count > 0) {
    hw.gpus_per_node = found.gpu_count;
    src["gpus_per_node"] = "detected";
  } else {
    // No GPU here and none named: one rank per node, or --dp spread over --nodes.
    const int64_t node_guess = nodes > 0 ? nodes : 1;
    hw.gpus_per_node = dp > 0 ? (dp + node_guess - 1) / node_guess : 1;
    src["gpus_per_node"] = dp > 0 ? "--dp / --nodes" : "assumed";
  }
  const int64_t node_count = nodes > 0 ? nodes
                             : dp > 0  ? (dp + hw.gpus_per_node - 1) / hw.gpus_per_node
                                       : 1;
  hw.nodes = node_count;
  hw.data_parallel = dp > 0 ? dp : hw.gpus_per_node * node_count;
  if (hw.data_parallel > hw.gpus_per_node * node_count)
    raise(ErrorCategory::kBadArgument,
          "--dp {} is more than the {} GPUs of {} node(s) x {} GPUs (--nodes, --gpus)",
          hw.data_parallel, hw.gpus_per_node * node_count, node_count, hw.gpus_per_node);
  src["data_parallel"] = dp > 0 ? "--dp" : "GPUs x nodes";

  if (!o.gpu_mem.empty()) {
    hw.gpu_nbytes = parse_memory("--gpu-mem", o.gpu_mem);
    if (!(*hw.gpu_nbytes > 0)) raise(ErrorCategory::kBadArgument, "--gpu-mem: must be above 0");
    src["gpu_bytes"] = "--gpu-mem";
  } else if (found.gpu_nbytes) {
    hw.gpu_nbytes = static_cast<double>(*found.gpu_nbytes);
    src["gpu_bytes"] = "detected: " + found.gpu_name;
  } else {
    src["gpu_bytes"] = "unknown: " + found.gpu_detail;
    r.hints.push_back("no GPU detected: give --gpu-mem (and --gpus) to see which placements fit");
  }
  if (!o.host_mem.empty()) {
    hw.host_nbytes = parse_memory("--host-mem", o.host_mem);
    src["host_bytes"] = "--host-mem";
  } else if (found.host_available_nbytes) {
    hw.host_nbytes = static_cast<double>(*found.host_available_nbytes);
    src["host_bytes"] = "detected: MemAvailable of this machine";
  } else {
    src["host_bytes"] = "unknown";
  }
  // NVMe: a capacity given, else the free space of --nvme-path, else of the
  // ds_config's swap directory when it exists.
  std::string nvme_dir = o.nvme_path;
  if (nvme_dir.empty() && config) {
    for (const std::string& dir :
         {config->zero.offload_optimizer.nvme_path, config->zero.offload_param.nvme_path}) {
      if (!dir.empty() && std::filesystem::is_directory(dir)) {
        nvme_dir = dir;
        break;
      }
    }
  }
  if (!o.nvme_capacity.empty()) {
    hw.nvme_nbytes = parse_memory("--nvme-capacity", o.nvme_capacity);
    src["nvme_bytes"] = "--nvme-capacity";
  } else if (!nvme_dir.empty()) {
    hw.nvme_nbytes = static_cast<double>(plan::free_space_nbytes(nvme_dir));
    src["nvme_bytes"] = "detected: free space of " + nvme_dir;
  } else {
    src["nvme_bytes"] = "unknown";
    r.hints.push_back(
        "NVMe capacity unknown: give --nvme-path DIR or --nvme-capacity so NVMe placements can be "
        "recommended");
  }

  auto rate = [&](const std::string& text, const char* flag, double& field, const char* key) {
    if (text.empty()) {
      src[key] = "assumed";
    } else {
      field = parse_rate(flag, text);
      src[key] = flag;
    }
  };
  rate(o.bw_gpu_cpu, "--bw-gpu-cpu", hw.gpu_cpu_bw, "gpu_cpu_bw");
  rate(o.bw_nvme, "--bw-nvme", hw.nvme_read_bw, "nvme_read_bw");
  hw.nvme_write_bw = hw.nvme_read_bw;
  src["nvme_write_bw"] = src["nvme_read_bw"];
  if (!o.bw_nvme_write.empty())
    rate(o.bw_nvme_write, "--bw-nvme-write", hw.nvme_write_bw, "nvme_write_bw");
  rate(o.bw_host_mem, "--bw-host-mem", hw.host_memory_bw, "host_memory_bw");
  if (!o.bw_interconnect.empty()) {
    hw.interconnect_bw = parse_rate("--bw-interconnect", o.bw_interconnect);
    src["interconnect_bw"] = "--bw-interconnect";
  } else {
    src["interconnect_bw"] = "unknown";
  }
  if (!o.peak_tflops.empty()) {
    const auto tflops = parse_number(o.peak_tflops);
    if (!tflops || *tflops <= 0) bad("--peak-tflops", o.peak_tflops, "a number of TFLOPS above 0");
    hw.peak_flops = *tflops * 1e12;
    src["peak_flops"] = "--peak-tflops";
  } else {
    src["peak_flops"] = "assumed";
  }
  if (!o.target_efficiency.empty())
    r.inputs.target_efficiency = parse_fraction("--target-efficiency", o.target_efficiency);
  if (src["gpu_cpu_bw"] == "assumed" || src["nvme_read_bw"] == "assumed" ||
      src["peak_flops"] == "assumed") {
    r.hints.push_back(
        "assumed bandwidths and peak: measure them with strata-bw (GPU<->CPU), strata-io (NVMe), "
        "strata-adam (host) "
        "and give --bw-gpu-cpu, --bw-nvme, --bw-host-mem, --peak-tflops");
  }
}

std::string header(const Resolved& r, const plan::Plan& plan) {
  const plan::PlanInputs& in = r.inputs;
  const plan::ModelShape& m = in.model;
  const plan::TrainingShape& t = in.training;
  const plan::Machine& hw = in.machine;
  auto src = [&](const char* key) { return r.sources.at(key); };
  std::string out =
      r.pipeline.stages > 1
          ? fmt::format("Model     {} parameters ({}); {} on the largest pipeline stage{}\n",
                        count_text(r.whole_param_count), r.model_source, count_text(m.param_count),
                        r.tensor_parallel > 1 ? " per tensor-parallel rank" : "")
      : r.tensor_parallel > 1
          ? fmt::format("Model     {} parameters ({}); {} per tensor-parallel rank\n",
                        count_text(r.whole_param_count), r.model_source, count_text(m.param_count))
          : fmt::format("Model     {} parameters ({})\n", count_text(m.param_count), r.model_source);
  if (m.shape_known()) {
    out += fmt::format("          {} layers, hidden {}, {} heads, intermediate {}, vocab {}\n",
                       m.layers, m.hidden, m.heads > 0 ? std::to_string(m.heads) : "?",
                       m.intermediate > 0 ? std::to_string(m.intermediate) : "4*hidden",
                       m.vocab > 0 ? std::to_string(m.vocab) : "?");
  }
  if (r.config) {
    // The whole model's, with and without the input embedding (a lookup):
    // published active counts differ on it (gpt-oss-120b's 5.1B leaves it out).
    const int64_t active = r.config->active_parameter_count(), lookup = r.config->input_embedding_count();
    out += lookup > 0
               ? fmt::format("          active per token: {} parameters with the input embedding, {} without it "
                             "(its {} x {} table is a lookup; published active counts leave it out)\n",
                             count_text(active), count_text(active - lookup), r.config->vocab_size,
                             r.config->hidden_size)
               : fmt::format("          active per token: {} parameters, the embedding included (tied to lm_head, "
                             "it is the output projection too)\n",
                             count_text(active));
    if (m.carried_param_count > 0) {
      out += fmt::format("          the text model of a Gemma3ForConditionalGeneration checkpoint of {} parameters: its "
                         "vision tower and projector ({}) are carried to the export untrained\n",
                         count_text(m.param_count + m.carried_param_count), count_text(m.carried_param_count));
    }
  }
  if (m.experts > 0) {
    out += fmt::format("          mixture of experts: {} experts of width {} per layer, {} per token (compute counts "
                       "the active parameters; memory and transfers every expert)\n",
                       m.experts, m.intermediate, m.experts_per_token);
    if (m.shared_expert_intermediate > 0) {
      out += fmt::format("          plus a shared expert of width {} per layer that every token uses (active)\n",
                         m.shared_expert_intermediate);
    }
  }
  if (r.expert_parallel > 1) {
    const ExpertParallelShape s = expert_parallel_shape(r);
    out += fmt::format(
        "          expert parallelism {} (moe.expert_parallel_size): each rank holds {} experts per layer and their "
        "optimizer state, partitioned over the {} rank(s) that hold the same; it runs them on up to {} token rows "
        "(every member's), {:.1f} MB of expert activations per layer at most, and sends {:.1f} MB per micro-step "
        "all-to-all (model states per rank as without it)\n",
        r.expert_parallel, s.experts_per_rank, r.inputs.machine.data_parallel / r.expert_parallel, s.max_rows,
        s.max_expert_activation_nbytes / 1e6, s.exchange_nbytes / 1e6);
  }
  if (r.tensor_parallel > 1) {
    const nn::DecoderConfig share = nn::tensor_parallel_share(*r.config, r.tensor_parallel);
    out += fmt::format(
        "          tensor parallelism {} x data parallelism {} = {} ranks: each holds {} heads, {} kv head(s) and {} "
        "MLP features of every layer{}; activations per rank as Korthikanti et al. count them (strata's arena "
        "for them: {}, 16-bit), {:.1f} MB sent per rank and micro-step in the layers' tp collectives\n",
        r.tensor_parallel, r.inputs.machine.data_parallel, r.ranks, share.num_attention_heads,
        share.num_key_value_heads, share.intermediate_size,
        t.sequence_parallel ? ", with sequence parallelism (norms and residual on 1/tp of the tokens)" : "",
        gb_text(static_cast<double>(tensor_parallel_json(r, plan)["activation_arena_bytes_per_rank"].get<size_t>())),
        plan.tp_collective_nbytes / 1e6);
  }
  if (r.context_parallel > 1) {
    const nlohmann::json cj = context_parallel_json(r);
    const int cp = r.context_parallel;
    out += fmt::format(
        "          context parallelism {} ({}) x data parallelism {}{}: each rank holds {} of every sequence's {} tokens "
        "(chunks r and {}-r of {}); activations per rank at s/{} (strata's arena {} against {} at cp 1, plus {} of "
        "{} buffers, 16-bit); sends {:.2f} MB per layer forward, {:.2f} MB backward, {:.1f} MB per micro-step; "
        "ZeRO over the {} dp x cp ranks\n",
        cp, nn::context_method_name(r.context_method), r.inputs.machine.data_parallel / cp,
        r.tensor_parallel > 1 ? std::string(" (a cp group per tp rank, on its heads)") : std::string(), t.seq / cp,
        t.seq, 2 * cp - 1, 2 * cp, cp, gb_text(cj["activation_arena_bytes_per_rank"].get<double>()),
        gb_text(cj["activation_arena_bytes_at_cp_1"].get<double>()),
        gb_text(cj["attention_buffer_bytes_per_rank"].get<double>()), nn::context_method_name(r.context_method),
        cj["bytes_per_layer_forward"].get<double>() / 1e6, cj["bytes_per_layer_backward"].get<double>() / 1e6,
        cj["bytes_per_micro_step"].get<double>() / 1e6, r.inputs.machine.data_parallel);
  }
  if (r.pipeline.stages > 1) {
    const nlohmann::json pj = pipeline_parallel_json(r);
    out += fmt::format(
        "          pipeline parallelism {} ({}{}, {} micro-batches per step): bubble {:.3f} of the step by the "
        "schedule's formula; the model states below are the largest stage's\n",
        r.pipeline.stages, pipeline::schedule_name(r.pipeline.kind),
        r.pipeline.virtual_stages > 1 ? fmt::format(", {} chunks per rank", r.pipeline.virtual_stages) : std::string(),
        r.pipeline.micro_batches, pj["bubble"].get<double>());
    for (const nlohmann::json& s : pj["stages"]) {
      out += fmt::format(
          "          stage {}: {} layers, {} parameters, {} micro-batch(es) in flight: {} of activations (strata's "
          "arena, 16-bit); sends {:.1f} MB per step point to point; ZeRO-3 {}\n",
          s["stage"].get<int>(), s["layers"].get<int64_t>(), count_text(s["parameters"].get<int64_t>()),
          s["micro_batches_in_flight"].get<int>(), gb_text(s["activation_bytes"].get<double>()),
          s["p2p_bytes_sent_per_step"].get<double>() / 1e6,
          s["zero3_parameters_kept_for_the_step"].get<bool>()
              ? "gathers each parameter once per step and keeps it for the step's micro-batches (the stage's "
                "parameters fit stage3_max_reuse_distance and stage3_max_live_parameters)"
              : fmt::format("gathers each parameter for every use, {} per step (the stage's parameters exceed "
                            "stage3_max_reuse_distance or stage3_max_live_parameters)",
                            s["zero3_gathers_per_parameter_per_step"].get<int>()));
    }
  }
  out += fmt::format(
      "Training  seq {}, micro-batch {}, gradient accumulation {}, {}\n", t.seq, t.micro_batch,
      t.grad_accumulation,
      t.activation_checkpointing
          ? fmt::format("activation checkpoint every {} layer(s){}", t.layers_per_checkpoint,
                        t.checkpoints_on_cpu ? ", kept in CPU memory" : "")
          : std::string("no activation checkpointing"));
  out += fmt::format("ZeRO      {}\n", r.zero_sizes.describe());
  out +=
      fmt::format("Machine   {} node(s) x {} GPUs ({}), data-parallel N_d = {} ({})\n", hw.nodes,
                  hw.gpus_per_node, src("gpus_per_node"), hw.data_parallel, src("data_parallel"));
  auto capacity = [](const std::optional<double>& nbytes) {
    return nbytes ? gb_text(*nbytes) : std::string("?");
  };
  out += fmt::format("          GPU {} each ({}); host {} per node ({}); NVMe {} per node ({})\n",
                     capacity(hw.gpu_nbytes), src("gpu_bytes"), capacity(hw.host_nbytes),
                     src("host_bytes"), capacity(hw.nvme_nbytes), src("nvme_bytes"));
  out += fmt::format(
      "          GPU<->CPU {:.1f} GB/s per GPU ({}); NVMe {:.1f}/{:.1f} GB/s read/write per node "
      "({}); host memory "
      "{:.1f} GB/s per node ({});\n          interconnect {} ({}); peak {:.0f} TFLOPS per GPU "
      "({})\n",
      hw.gpu_cpu_bw / 1e9, src("gpu_cpu_bw"), hw.nvme_read_bw / 1e9, hw.nvme_write_bw / 1e9,
      src("nvme_read_bw"), hw.host_memory_bw / 1e9, src("host_memory_bw"),
      hw.interconnect_bw ? fmt::format("{:.1f} GB/s per GPU", *hw.interconnect_bw / 1e9)
                         : std::string("?"),
      src("interconnect_bw"), hw.peak_flops / 1e12, src("peak_flops"));
  return out;
}

void check_flag_combination(const Options& o) {
  const std::vector<std::pair<const char*, bool>> plan_only = {
      {"--params", !o.params.empty()},
      {"--layers", !o.layers.empty()},
      {"--hidden", !o.hidden.empty()},
      {"--heads", !o.heads.empty()},
      {"--intermediate", !o.intermediate.empty()},
      {"--vocab", !o.vocab.empty()},
      {"--batch", !o.batch.empty()},
      {"--grad-accum", !o.grad_accum.empty()},
      {"--checkpoint-every", !o.checkpoint_every.empty()},
      {"--tiling", !o.tiling.empty()},
      {"--no-checkpointing", o.no_checkpointing},
      {"--gpus", !o.gpus.empty()},
      {"--nodes", !o.nodes.empty()},
      {"--gpu-mem", !o.gpu_mem.empty()},
      {"--host-mem", !o.host_mem.empty()},
      {"--nvme-path", !o.nvme_path.empty()},
      {"--nvme-capacity", !o.nvme_capacity.empty()},
      {"--bw-gpu-cpu", !o.bw_gpu_cpu.empty()},
      {"--bw-nvme", !o.bw_nvme.empty()},
      {"--bw-nvme-write", !o.bw_nvme_write.empty()},
      {"--bw-host-mem", !o.bw_host_mem.empty()},
      {"--bw-interconnect", !o.bw_interconnect.empty()},
      {"--peak-tflops", !o.peak_tflops.empty()},
      {"--target-efficiency", !o.target_efficiency.empty()},
      {"--lora-rank", !o.lora_rank.empty()},
      {"--lora-targets", !o.lora_targets.empty()},
      {"--tp", !o.tp.empty()},
      {"--pp", !o.pp.empty()},
      {"--pp-schedule", !o.pp_schedule.empty()},
      {"--virtual-stages", !o.virtual_stages.empty()},
      {"--cp", !o.cp.empty()},
      {"--cp-method", !o.cp_method.empty()},
      {"--micro-batch-order", !o.micro_batch_order.empty()},
      {"--sequence-parallel", o.sequence_parallel},
      {"--units", o.units != "GB"}};
  const std::vector<std::pair<const char*, bool>> check_only = {
      {"--tolerance", o.tolerance != "15%"},
      {"--baseline-rss", !o.baseline_rss.empty()},
      {"--checkpoint-activations", o.checkpoint_activations}};
  for (const auto& [flag, given] : o.check.empty() ? check_only : plan_only) {
    if (!given) continue;
    if (o.check.empty())
      raise(ErrorCategory::kBadArgument, "{} goes with --check RUN (comparing a run with its plan)",
            flag);
    raise(ErrorCategory::kBadArgument,
          "{} describes a planned job or machine; --check takes the run's own configuration (from "
          "run.json, "
          "or --config, --model, --seq, --dp)",
          flag);
  }
}

int run_plan(const Options& o) {
  check_flag_combination(o);
  if (!o.check.empty()) return run_plan_check(o);
  std::optional<Config> config;
  if (!o.config.empty()) config = load_config_file(o.config);
  Resolved r;
  resolve_model(o, r);
  resolve_lora(o, r);
  resolve_training(o, config, r);
  resolve_machine(o, config, r);
  resolve_tensor_parallel(o, config, r);
  resolve_pipeline_parallel(o, config, r);
  resolve_context_parallel(o, config, r);
  if (r.context_parallel > 1) r.inputs.training.context_exchange_nbytes = context_exchange(r).per_micro_step;
  resolve_zero_sizes(r);
  if (config) {
    r.zero_limits.max_live = static_cast<int64_t>(config->zero.max_live_parameters_numel);
    r.zero_limits.max_reuse_distance = static_cast<int64_t>(config->zero.max_reuse_distance_numel);
  }
  resolve_expert_parallel(o, config, r);
  plan::Plan result = plan::make_plan(r.inputs);
  for (const std::string& hint : r.hints) result.notes.push_back(hint);
  const nlohmann::json order = micro_batch_order_json(o, config, r, result);
  if (o.json) {
    nlohmann::json out = plan::to_json(result);
    out["model"]["source"] = r.model_source;
    out["sources"] = r.sources;
    out["zero_sizes"] = r.zero_sizes.to_json();
    if (r.expert_parallel > 1) out["expert_parallel"] = expert_parallel_json(r);
    if (r.tensor_parallel > 1) out["tensor_parallel"] = tensor_parallel_json(r, result);
    if (r.pipeline.stages > 1) out["pipeline_parallel"] = pipeline_parallel_json(r);
    if (r.context_parallel > 1) out["context_parallel"] = context_parallel_json(r);
    if (!order.is_null()) out["micro_batch_order"] = order;
    std::cout << out.dump(2) << "\n";
  } else {
    std::cout << header(r, result) << (order.is_null() ? std::string() : micro_batch_order_text(order))
              << plan::to_text(result, o.units == "GiB" ? plan::Units::kGiB : plan::Units::kGB);
  }
  return 0;
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("plan",
                                     "Plan memory and bandwidth for a model on a machine: memory "
                                     "per tier (GPU, CPU, NVMe) per rank for every ZeRO "
                                     "stage and offload placement (the ZeRO formulas, plus "
                                     "activations and the largest operator's working "
                                     "memory), the bandwidth each class of traffic needs for a "
                                     "target efficiency, the efficiency predicted "
                                     "(ZeRO-Infinity's model), and the placement to use. Sizes "
                                     "print in GB (1e9 bytes), as the papers do.");
  const auto text = [&](const char* name, std::string& field, const char* help) {
    return cmd->add_option(name, field, help);
  };
  text("--model", o->model, "Hugging Face config.json, or the model directory holding it")
      ->type_name("PATH");
  text("--params", o->params, "Parameter count instead of --model: 7.5B, 100B, 0.1T, 350M, 1.3e9")
      ->type_name("N");
  text("--layers", o->layers,
       "Transformer layers; with --hidden they give activations and working memory, and "
       "without --params the parameter count 12*layers*hidden^2 (+ 2*vocab*hidden)")
      ->type_name("INT");
  text("--hidden", o->hidden, "Hidden size")->type_name("INT");
  text("--heads", o->heads, "Attention heads (default hidden/128)")->type_name("INT");
  text("--intermediate", o->intermediate, "MLP width (default 4*hidden)")->type_name("INT");
  text("--vocab", o->vocab, "Vocabulary size (adds embedding and lm_head)")->type_name("INT");
  text("--seq", o->seq, "Sequence length (default 1024)")->type_name("INT");
  text("--batch", o->batch,
       "Micro-batch per GPU (default: the config's train_micro_batch_size_per_gpu, else 1)")
      ->type_name("INT");
  text("--grad-accum", o->grad_accum,
       "Micro-steps per optimizer step (default: the config's, else 1)")
      ->type_name("INT");
  cmd->add_flag("--no-checkpointing", o->no_checkpointing,
                "Plan without activation checkpointing (default: a checkpoint every "
                "--checkpoint-every layers)");
  text("--checkpoint-every", o->checkpoint_every,
       "Layers between activation checkpoints, c_i (default 1)")
      ->type_name("INT");
  text("--tiling", o->tiling,
       "Tiles the largest operator is cut into when it does not fit whole (default 16)")
      ->type_name("INT");
  text("--config", o->config,
       "ds_config JSON: marks its placement (stage, offload devices) and supplies micro-batch, "
       "accumulation, "
       "cpu_checkpointing and buffer sizes")
      ->type_name("FILE");
  text("--gpus", o->gpus, "GPUs (ranks) per node (default: detected, else 1)")->type_name("INT");
  text("--nodes", o->nodes, "Nodes (default 1, or enough for --dp)")->type_name("INT");
  text("--dp", o->dp, "Data-parallel degree N_d (default GPUs x nodes)")->type_name("INT");
  text("--gpu-mem", o->gpu_mem,
       "Memory per GPU: GB, or with a unit (80GB, 80GiB) (default: detected)")
      ->type_name("SIZE");
  text("--host-mem", o->host_mem,
       "Host memory per node for training (default: this machine's MemAvailable)")
      ->type_name("SIZE");
  text("--nvme-path", o->nvme_path,
       "Directory for swap files: its free space is the NVMe capacity (default: the "
       "config's nvme_path when it exists)")
      ->type_name("DIR");
  text("--nvme-capacity", o->nvme_capacity, "NVMe space per node instead of --nvme-path")
      ->type_name("SIZE");
  text("--bw-gpu-cpu", o->bw_gpu_cpu,
       "Pinned GPU<->CPU copy bandwidth per GPU, GB/s or 25GB/s (default 25, PCIe "
       "Gen4; measure with strata-bw)")
      ->type_name("RATE");
  text("--bw-nvme", o->bw_nvme,
       "NVMe read bandwidth per node, and write unless --bw-nvme-write (default 7; measure "
       "with strata-io)")
      ->type_name("RATE");
  text("--bw-nvme-write", o->bw_nvme_write, "NVMe write bandwidth per node (default: --bw-nvme)")
      ->type_name("RATE");
  text("--bw-host-mem", o->bw_host_mem,
       "Host memory bandwidth per node the CPU optimizer streams at (default 100; "
       "strata-adam measures it)")
      ->type_name("RATE");
  text("--bw-interconnect", o->bw_interconnect,
       "Collective bus bandwidth per GPU (strata-bw's busbw); without it "
       "collectives are not counted")
      ->type_name("RATE");
  text("--peak-tflops", o->peak_tflops,
       "Achievable compute per GPU in TFLOPS (default 70, the paper's V100)")
      ->type_name("NUM");
  text("--target-efficiency", o->target_efficiency,
       "Efficiency the bandwidth needs are computed for (default 0.9; "
       "or 90%)")
      ->type_name("FRAC");
  text("--lora-rank", o->lora_rank,
       "Plan LoRA fine-tuning (`strata finetune --lora-rank`): adapters of rank r on a frozen "
       "base, which keeps its 16-bit weights only; the adapters train in fp32 (20 B/param). "
       "Needs the projections' shapes: --model, or --layers and --hidden")
      ->type_name("R");
  text("--lora-targets", o->lora_targets,
       "With --lora-rank: the projections adapted, comma-separated (q_proj,k_proj,v_proj,o_proj,"
       "gate_proj,up_proj,down_proj) or all-linear (default q_proj,v_proj, PEFT's)")
      ->type_name("LIST");
  cmd->add_option("--units", o->units, "Units of the table: GB (1e9, default) or GiB (2^30)")
      ->check(CLI::IsMember({"GB", "GiB"}));
  cmd->add_flag("--json", o->json, "Print the plan as JSON (bytes, bytes/s, fractions)");
  text("--check", o->check,
       "Compare with a `strata finetune` run: its directory (or metrics.jsonl). The configuration "
       "comes from "
       "the run's run.json (--config, --model, --seq, --dp override it); prints what this runtime "
       "holds per "
       "rank and, per tier, predicted vs measured peak memory; exits 1 when a measured tier is "
       "outside "
       "--tolerance")
      ->type_name("RUN");
  text("--tolerance", o->tolerance,
       "With --check: the largest |measured/predicted - 1| accepted (default 15%)")
      ->type_name("FRAC");
  text("--baseline-rss", o->baseline_rss,
       "With --check: the process's own resident memory (code, libraries, threads) to add to the "
       "host "
       "prediction (default: the run's resident set before its first step, from run.json, less the "
       "setup "
       "items; for runs without it, this binary's resident set at the check)")
      ->type_name("SIZE");
  text("--tp", o->tp,
       "Tensor parallelism (strata finetune --tp; tensor_parallel.autotp_size): this many ranks split each "
       "layer, N_d = GPUs / N data-parallel ranks (or --dp, with N x --dp ranks); needs --model. Model states, "
       "activations and traffic are then one rank's")
      ->type_name("N");
  text("--pp", o->pp,
       "Pipeline parallelism (strata finetune --pp; pipeline_parallel.size): this many stages split the layers, "
       "N_d = GPUs / (pp x tp) (or --dp, with pp x tp x --dp ranks); needs --model. Prints per stage its layers, "
       "parameters, activations for the micro-batches in flight, point-to-point bytes and how ZeRO-3 gathers; the "
       "model states are the largest stage's")
      ->type_name("N");
  text("--cp", o->cp,
       "Context parallelism (strata finetune --cp; context_parallel.size): this many ranks split every sequence "
       "(two chunks of seq / 2N each); needs --model. ZeRO partitions over dp x cp, so N_d stays GPUs / tp (or "
       "--dp); activations, compute and tp traffic are a rank's seq / N tokens', and the ring's or Ulysses' bytes "
       "a traffic class")
      ->type_name("N");
  text("--cp-method", o->cp_method, "With --cp: ring or ulysses (default: the config's context_parallel.method)")
      ->type_name("NAME");
  text("--pp-schedule", o->pp_schedule, "With --pp: gpipe, 1f1b, interleaved or zb-h1 (default: the config's)")
      ->type_name("NAME");
  text("--virtual-stages", o->virtual_stages, "With --pp: chunks of layers per rank (interleaved)")->type_name("V");
  text("--micro-batch-order", o->micro_batch_order,
       "The order of a step's micro-batches (strata finetune --micro-batch-order; the config's "
       "strata.micro_batch_order): step-major, layer-major or auto. Prints both orders' parameter bytes read per "
       "step and step bounds on the config's placement (else the recommended one) with the ZeRO-3 budgets "
       "(stage3_max_reuse_distance, stage3_max_live_parameters), and which auto chooses")
      ->type_name("ORDER");
  cmd->add_flag("--sequence-parallel", o->sequence_parallel,
                "With --tp: Megatron's sequence parallelism (the config's sequence_parallel): activations divided "
                "by N");
  cmd->add_flag("--checkpoint-activations", o->checkpoint_activations,
                "With --check: the run used finetune's --checkpoint-activations (when run.json "
                "does not say)");
  on_selected(cmd, [o] { return run_plan(*o); });
}

}  // namespace strata::cli
