// `strata plan --check RUN`: the prediction for the configuration a `strata
// finetune` run used (its run.json, or flags) set beside what that run
// measured (runtime/plan/plan_check.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "runtime/cli/plan_cli.h"
#include "runtime/config/config.h"
#include "runtime/config/json_text.h"
#include "core/error.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/nn/lora.h"
#include "runtime/pipeline/kept_boundaries.h"
#include "runtime/pipeline/schedule.h"
#include "runtime/pipeline/stages.h"
#include "runtime/plan/machine_probe.h"
#include "runtime/plan/plan_check.h"
#include "runtime/plan/runtime_memory.h"
#include "runtime/train/finetune.h"
#include "runtime/train/micro_batch_order.h"
#include "runtime/train/run_report.h"
#include "runtime/train/zero_config.h"

namespace strata::cli::plan_cli {
namespace {

// ---- --check: a run's measured memory beside the prediction for that run ------------

// What a `strata finetune` run was started with, as far as the plan needs it.
struct RunSetup {
  std::filesystem::path config, model;  // model: an HF directory or a config.json
  int64_t seq = train::FinetuneOptions{}.seq;
  int64_t world_size = 1;
  bool checkpoint_activations = false;
  int tensor_parallel = 0;         // --tp (0: not given: the config's)
  int context_parallel = 0;        // --cp (0: not given: the config's)
  std::string context_method;      // --cp-method (empty: the config's)
  int pipeline_parallel = 0;       // --pp (0: not given: the config's)
  std::string pipeline_schedule;   // --pp-schedule (empty: the config's)
  int virtual_stages = 0;          // --virtual-stages (0: the config's)
  std::string micro_batch_order;  // --micro-batch-order (empty: the config's)
  bool sequence_parallel = false;  // --sequence-parallel
  // finetune's LoRA flags as given (empty: not a LoRA run), parsed as finetune parses them.
  std::string lora_rank, lora_targets = "q_proj,v_proj";
  std::filesystem::path cwd;
  std::optional<uint64_t> resident_at_start;   // run.json: rank 0's VmRSS before its first step
  // run.json: the configurations as the run read them (null: older runs, or
  // replaced by --config / --model); preferred to the files, which may have
  // changed since.
  nlohmann::json ds_config, model_config;
  std::map<std::string, std::string> sources;  // where each came from
};

// Reads the finetune flags the plan needs from run.json's command line
// (both "--flag value" and "--flag=value", as CLI11 accepts them).
void setup_from_record(const train::RunRecord& record, const std::string& source, RunSetup& s) {
  const auto finetune = std::find(record.argv.begin(), record.argv.end(), "finetune");
  STRATA_CHECK(finetune != record.argv.end(), kBadArgument,
               "{}: the run's command line has no 'finetune' ('{}'); --check compares `strata "
               "finetune` runs",
               source, printable_excerpt(record.argv.empty() ? std::string() : record.argv[0], 80));
  const auto resolve = [&](const std::string& path) {
    const std::filesystem::path p(path);
    return p.is_absolute() ? p : record.cwd / p;
  };
  for (auto it = finetune + 1; it != record.argv.end(); ++it) {
    std::string flag = *it, value;
    const size_t eq = flag.find('=');
    const bool inline_value = flag.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) {
      value = flag.substr(eq + 1);
      flag.resize(eq);
    }
    const auto take = [&]() -> std::string {
      if (inline_value) return value;
      STRATA_CHECK(it + 1 != record.argv.end(), kBadArgument,
                   "{}: {} has no value in the run's command line", source, flag);
      return *++it;
    };
    if (flag == "--config") {
      s.config = resolve(take());
      s.sources["config"] = source;
    } else if (flag == "--init" || flag == "--model") {
      s.model = resolve(take());
      s.sources["model"] = source;
    } else if (flag == "--seq") {
      s.seq = parse_integer(source + ": --seq", take(), 1);
      s.sources["seq"] = source;
    } else if (flag == "--checkpoint-activations") {
      s.checkpoint_activations = true;
    } else if (flag == "--lora-rank") {
      s.lora_rank = take();
      s.sources["lora"] = source;
    } else if (flag == "--lora-targets") {
      s.lora_targets = take();
    } else if (flag == "--tp") {
      s.tensor_parallel = static_cast<int>(parse_integer(source + ": --tp", take(), 1));
    } else if (flag == "--sequence-parallel") {
      s.sequence_parallel = true;
    } else if (flag == "--pp") {
      s.pipeline_parallel = static_cast<int>(parse_integer(source + ": --pp", take(), 1));
    } else if (flag == "--cp") {
      s.context_parallel = static_cast<int>(parse_integer(source + ": --cp", take(), 1));
    } else if (flag == "--cp-method") {
      s.context_method = take();
    } else if (flag == "--pp-schedule") {
      s.pipeline_schedule = take();
    } else if (flag == "--virtual-stages") {
      s.virtual_stages = static_cast<int>(parse_integer(source + ": --virtual-stages", take(), 1));
    } else if (flag == "--micro-batch-order") {
      s.micro_batch_order = take();
    }
  }
  if (!record.ds_config.is_null()) {
    s.ds_config = record.ds_config;
    s.sources["config"] = source + " (the ds_config as the run read it)";
  }
  if (!record.model_config.is_null()) {
    s.model_config = record.model_config;
    s.sources["model"] = source + " (the model config as the run read it)";
  }
  s.world_size = record.world_size;
  s.sources["world_size"] = source;
  s.resident_at_start = record.resident_at_start_nbytes;
  s.cwd = record.cwd;
}

// Rank 0's swap files, while they exist: <nvme_path>/<group>/rank0/*.swp (nvme/swap_space.h).
std::optional<double> swap_files_nbytes(const std::filesystem::path& root) {
  std::error_code ec;
  if (!std::filesystem::is_directory(root, ec)) return std::nullopt;
  double total = 0;
  bool any = false;
  for (const auto& group : std::filesystem::directory_iterator(root, ec)) {
    const std::filesystem::path rank0 = group.path() / "rank0";
    if (!std::filesystem::is_directory(rank0, ec)) continue;
    for (const auto& file : std::filesystem::directory_iterator(rank0, ec)) {
      if (file.path().extension() != ".swp") continue;
      total += static_cast<double>(file.file_size(ec));
      any = true;
    }
  }
  return any ? std::optional<double>(total) : std::nullopt;
}

// What the comparison cannot see, said every time rather than hidden in a tolerance.
std::string check_notes(bool device_is_host) {
  std::string out =
      "Not predicted: what the process adds while it steps besides the items above — heap that the "
      "allocator "
      "keeps beyond the bytes live at once";
  out += device_is_host ? " (the cpu accelerator takes blocks under 1 MiB from malloc)" : "";
  out +=
      ", per-thread malloc arenas (I/O, communicator and stream threads), code first run in the "
      "steps. It does not "
      "grow with the model, so the host row is tight only when the run holds much more than "
      "it.\n\n";
  return out;
}

}  // namespace

int run_plan_check(const PlanOptions& o) {
  // The measurement first: a bad metrics file is the likeliest mistake.
  std::filesystem::path metrics = o.check, dir;
  std::error_code ec;
  if (std::filesystem::is_directory(metrics, ec)) {
    dir = metrics;
    metrics /= "metrics.jsonl";
  } else {
    dir = metrics.has_parent_path() ? metrics.parent_path() : std::filesystem::path(".");
  }
  const plan::RunMeasurement measured = plan::read_metrics(metrics);
  double tolerance = 0;
  {
    const bool percent = !o.tolerance.empty() && o.tolerance.back() == '%';
    const auto number =
        parse_number(percent ? std::string_view(o.tolerance).substr(0, o.tolerance.size() - 1)
                             : std::string_view(o.tolerance));
    tolerance = number ? *number / (percent ? 100 : 1) : -1;
    if (!(tolerance >= 0 && tolerance < 10))
      bad("--tolerance", o.tolerance, "a fraction >= 0 (0.15, or 15%)");
  }

  RunSetup s;
  const std::filesystem::path run_json = dir / "run.json";
  if (std::filesystem::exists(run_json, ec)) {
    std::ifstream file(run_json, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(file)),
                           std::istreambuf_iterator<char>());
    setup_from_record(train::parse_run_record(text, run_json.string()), run_json.string(), s);
  }
  // Flags describe the run where run.json does not (older runs), or override it.
  const auto override_with = [&](const std::string& given, const char* flag, const char* key,
                                 auto apply) {
    if (given.empty()) return;
    apply(given);
    s.sources[key] = flag;
  };
  override_with(o.config, "--config", "config", [&](const std::string& v) {
    s.config = v;
    s.ds_config = nullptr;
  });
  override_with(o.model, "--model", "model", [&](const std::string& v) {
    s.model = v;
    s.model_config = nullptr;
  });
  override_with(o.seq, "--seq", "seq",
                [&](const std::string& v) { s.seq = parse_integer("--seq", v, 1); });
  override_with(o.dp, "--dp", "world_size",
                [&](const std::string& v) { s.world_size = parse_integer("--dp", v, 1); });
  if (o.checkpoint_activations) s.checkpoint_activations = true;
  const std::string no_record =
      std::filesystem::exists(run_json, ec)
          ? fmt::format("{} does not name it", run_json.string())
          : fmt::format("{} has no run.json (a run of an older strata)", dir.string());
  STRATA_CHECK(
      !s.model.empty() || !s.model_config.is_null(), kBadArgument,
      "--check: the run's model is unknown ({}): give --model (its config.json or HF directory)",
      no_record);
  STRATA_CHECK(!s.config.empty() || !s.ds_config.is_null(), kBadArgument,
               "--check: the run's ds_config is unknown ({}, or the run used finetune's built-in "
               "defaults): give "
               "--config",
               no_record);
  if (!s.sources.count("world_size")) s.sources["world_size"] = "assumed (no run.json, no --dp)";

  // What the run was given: the file it named, or finetune's defaults.
  const std::string config_name = s.config.empty() ? "(finetune's built-in defaults)" : s.config.string();
  const std::string config_source =
      s.ds_config.is_null() ? s.config.string() : run_json.string() + " (\"ds_config\")";
  const Config config = s.ds_config.is_null() ? load_config_file(s.config.string())
                                              : parse_config(s.ds_config, config_source);
  // As finetune reads them: --pp and the schedule's flags over the config's pipeline_parallel.
  const int pp = s.pipeline_parallel > 0 ? s.pipeline_parallel : config.pipeline_parallel_size;
  plan::RuntimeInputs in;
  // Context parallelism as finetune reads it: --cp and --cp-method over the config's context_parallel.
  in.context_parallel = s.context_parallel > 0 ? s.context_parallel : config.context_parallel_size;
  in.context_method = s.context_method.empty()
                          ? nn::parse_context_method(config.context_parallel_method,
                                                     config_source + ": context_parallel.method")
                          : nn::parse_context_method(s.context_method, run_json.string() + ": --cp-method");
  const int cp = in.context_parallel;
  // As finetune reads them: --tp over the config's autotp_size, either sequence-parallel switch.
  in.tensor_parallel = s.tensor_parallel > 0 ? s.tensor_parallel : config.tensor_parallel_size;
  in.sequence_parallel = s.sequence_parallel || config.sequence_parallel;
  if (!s.model_config.is_null()) {
    in.model = nn::parse_decoder_config(s.model_config, run_json.string() + " (\"model_config\")");
  } else {
    std::filesystem::path model_config = s.model;
    if (std::filesystem::is_directory(model_config, ec)) model_config /= "config.json";
    in.model = nn::load_decoder_config(model_config.string());
  }
  // The micro-batch order: auto chose as finetune chooses (the run's ranks on one node).
  const Tier param_tier = config.zero.offload_param.device == OffloadDevice::kNvme  ? Tier::kNvme
                          : config.zero.offload_param.device == OffloadDevice::kCpu ? Tier::kCpu
                                                                                    : Tier::kDevice;
  const int dp = static_cast<int>(s.world_size) / (in.tensor_parallel * pp * cp);
  const std::optional<plan::OrderPlan> predicted_orders = train::predict_run_orders(
      in.model, config.zero.stage, param_tier, static_cast<int64_t>(config.zero.max_reuse_distance_numel),
      static_cast<int64_t>(config.zero.max_live_parameters_numel), config.micro_batch_size, s.seq,
      config.gradient_accumulation_steps, s.checkpoint_activations || config.cpu_checkpointing, std::max(1, dp),
      static_cast<int>(s.world_size), config.strata.keeps_layer_activations());
  train::MicroBatchOrderContext order_context{param_tier, config.gradient_accumulation_steps, in.tensor_parallel, pp,
                                              1, !s.lora_rank.empty(), in.model.tie_word_embeddings,
                                              in.model.moe() && in.model.output_router_logits, cp};
  order_context.predicted = predicted_orders ? &*predicted_orders : nullptr;
  const train::MicroBatchOrderChoice order = train::choose_micro_batch_order(
      s.micro_batch_order.empty() ? config.strata.micro_batch_order : s.micro_batch_order,
      s.micro_batch_order.empty() ? "strata.micro_batch_order" : "--micro-batch-order", order_context);
  if (pp > 1) {
    // Rank 0's memory is measured: pp rank 0's (Megatron's order puts the pipeline slowest).
    const std::string name = s.pipeline_schedule.empty() ? config.pipeline_schedule : s.pipeline_schedule;
    const std::optional<pipeline::ScheduleKind> kind = pipeline::parse_schedule(name);
    STRATA_CHECK(kind.has_value(), kBadArgument, "{}: --pp-schedule {}: not a pipeline schedule; one of {}",
                 run_json.string(), name, pipeline::schedule_names());
    in.pipeline = {*kind, pp, static_cast<int>(config.gradient_accumulation_steps),
                   s.virtual_stages > 0 ? s.virtual_stages : config.virtual_stages};
    in.pipeline.check();
    in.pipeline_split = pipeline::split_layers(in.model.num_hidden_layers, pp, in.pipeline.virtual_stages,
                                               config.pipeline_layers);
    in.pipeline_rank = 0;
  }
  if (order.order == train::MicroBatchOrder::kLayerMajor) {
    // A run's run.json records what auto chose; a config given here may not.
    STRATA_CHECK(config.strata.layer_major_activations != "auto", kBadArgument,
                 "{}: strata.layer_major_activations auto: the run chose keep or recompute from its accelerator's "
                 "memory, which this configuration does not record; give the one it logged",
                 config_source);
    in.layer_major = {static_cast<int>(config.gradient_accumulation_steps), config.strata.keeps_layer_activations(),
                      pipeline::parse_boundary_home(config.strata.layer_major_boundaries,
                                                    config_source + ": strata.layer_major_boundaries")};
  }
  in.param_dtype = config.bf16 ? DType::kBF16 : config.fp16.enabled ? DType::kF16 : DType::kF32;
  const bool device_is_host =
      config.strata.accelerator == "cpu" ||
      (config.strata.accelerator == "auto" && plan::detect_machine().gpu_count == 0);
  in.device_is_host = device_is_host;
  in.activation_dtype = device_is_host ? DType::kF32 : in.param_dtype;
  in.micro_batch = config.micro_batch_size;
  in.seq = s.seq;
  in.checkpoint_activations = s.checkpoint_activations || config.cpu_checkpointing;
  in.cpu_checkpointing = config.cpu_checkpointing;
  in.world_size = static_cast<int>(s.world_size);
  in.zero = train::zero_engine_options(config, config_source);
  in.zero.expert_parallel_size = train::choose_expert_parallel_size(
      config, in.model, in.world_size / (in.tensor_parallel * pp * cp), config_source);  // over the data-parallel ranks
  if (!s.lora_rank.empty()) {
    // The frozen base and the adapters' groups; alpha (the scale) sizes nothing.
    in.lora.rank = parse_integer(s.sources["lora"] + ": --lora-rank", s.lora_rank, 1);
    in.lora.alpha = 8;
    in.lora.targets = nn::parse_lora_targets(s.lora_targets);
    nn::resolve_lora_targets(in.lora, in.model);
  }
  // Relative swap paths are relative to the run's working directory.
  if (!in.zero.nvme_path.empty() && in.zero.nvme_path.is_relative() && !s.cwd.empty())
    in.zero.nvme_path = s.cwd / in.zero.nvme_path;
  const plan::RuntimeMemory memory = plan::runtime_memory(in);

  // The process itself (code and libraries, threads and their stacks, BLAS,
  // communicator and allocator overhead) is measured, not predicted: the
  // run's resident set before its first step less the setup items above
  // (which it already held), else this very binary's resident set now —
  // which loaded the same libraries but started no threads, so it is lower.
  const double bare = static_cast<double>(train::resident_nbytes());
  const double setup = memory.setup_resident_nbytes(device_is_host);
  double baseline = bare;
  std::string baseline_from =
      "this strata binary's resident set now (no threads, BLAS or communicators yet)";
  if (!o.baseline_rss.empty()) {
    baseline = parse_memory("--baseline-rss", o.baseline_rss);
    baseline_from = "--baseline-rss";
  } else if (s.resident_at_start && static_cast<double>(*s.resident_at_start) > setup) {
    baseline = static_cast<double>(*s.resident_at_start) - setup;
    baseline_from = fmt::format(
        "the run's resident set before its first step ({:.2f} MB, run.json) less the {:.2f} MB of "
        "setup items; "
        "a bare strata process holds {:.2f} MB",
        static_cast<double>(*s.resident_at_start) / 1e6, setup / 1e6, bare / 1e6);
  }

  plan::CheckResult result;
  result.tolerance = tolerance;
  const std::string rank0 =
      fmt::format("{}, rank 0, highest of {} step(s)", metrics.filename().string(), measured.steps);
  result.rows.push_back({device_is_host ? "device (cpu)" : "device", memory.device_nbytes,
                         static_cast<double>(measured.device_peak_nbytes),
                         "memory.device_peak_bytes in " + rank0});
  // The activations the run counts itself (memory.activation_bytes): the
  // items `counted` names, under the row `tier`.
  const auto activations_row = [&](std::string tier, const auto& counted) {
    double predicted = 0;
    for (const plan::MemoryItem& item : memory.items) predicted += counted(item) ? item.nbytes : 0;
    result.rows.push_back(
        {std::move(tier), predicted,
         measured.activation_nbytes ? std::optional<double>(static_cast<double>(*measured.activation_nbytes))
                                    : std::nullopt,
         measured.activation_nbytes ? "memory.activation_bytes in " + rank0
                                    : std::string("not measured: the records have no memory.activation_bytes")});
  };
  if (pp > 1) {
    // The arenas of pp rank 0's micro-batch slots.
    activations_row("activations (pp rank 0)",
                    [](const plan::MemoryItem& item) { return item.name == "activation arenas"; });
  }
  if (in.layer_major.micro_batches > 0) {
    // The layers' arenas, and the boundaries kept in device memory.
    activations_row("activations (layer-major)", [](const plan::MemoryItem& item) {
      return item.name == "activation arenas" ||
             (item.name == "layer-major boundaries" && item.where == plan::Where::kDevice);
    });
  }
  if (cp > 1) {
    // A cp rank's arena and the ring's or Ulysses' buffers.
    activations_row(fmt::format("activations (cp rank, s/{})", cp), [](const plan::MemoryItem& item) {
      return item.name == "activation arena" || item.name == "context-parallel attention buffers";
    });
  }
  result.rows.push_back({"host resident", baseline + memory.resident_nbytes(device_is_host),
                         static_cast<double>(measured.host_peak_rss_nbytes),
                         "memory.host_peak_rss_bytes in " + rank0});
  if (memory.nvme_nbytes > 0) {
    const std::optional<double> files = swap_files_nbytes(in.zero.nvme_path);
    result.rows.push_back(
        {"nvme", memory.nvme_nbytes, files,
         files ? "rank 0's swap files under " + in.zero.nvme_path.string()
               : "not measured: the run removes its swap files at exit and metrics.jsonl does not "
                 "record them"});
  }

  if (o.json) {
    nlohmann::json items = nlohmann::json::array();
    for (const plan::MemoryItem& item : memory.items) {
      items.push_back({{"name", item.name},
                       {"where", plan::where_name(item.where)},
                       {"bytes", static_cast<uint64_t>(std::llround(item.nbytes))},
                       {"upper_bound", item.upper_bound},
                       {"during_steps", item.during_steps},
                       {"basis", item.basis}});
    }
    nlohmann::json out = plan::check_json(result);
    out["run"] = {{"metrics", metrics.string()},
                  {"steps", measured.steps},
                  {"config", config_name},
                  {"model", s.model.string()},
                  {"seq", s.seq},
                  {"micro_batch", in.micro_batch},
                  {"world_size", s.world_size},
                  {"checkpoint_activations", in.checkpoint_activations},
                  {"sources", s.sources}};
    if (in.lora.enabled())
      out["run"]["lora"] = {{"rank", in.lora.rank}, {"targets", in.lora.targets}};
    if (pp > 1) {
      out["run"]["pipeline"] = {{"size", pp},
                                {"schedule", pipeline::schedule_name(in.pipeline.kind)},
                                {"virtual_stages", in.pipeline.virtual_stages},
                                {"micro_batches", in.pipeline.micro_batches},
                                {"layers", in.pipeline_split},
                                {"rank_modelled", in.pipeline_rank}};
    }
    if (in.layer_major.micro_batches > 0) {
      out["run"]["micro_batch_order"] = {
          {"order", "layer-major"},
          {"micro_batches", in.layer_major.micro_batches},
          {"activations", in.layer_major.keep_activations ? "keep" : "recompute"},
          {"boundaries", pipeline::boundary_home_name(in.layer_major.boundaries)}};
    }
    out["items"] = items;
    out["process_baseline"] = {{"bytes", static_cast<uint64_t>(std::llround(baseline))},
                               {"from", baseline_from},
                               {"bare_process_bytes", static_cast<uint64_t>(std::llround(bare))}};
    std::cout << out.dump(2) << "\n";
  } else {
    std::string text = fmt::format(
        "Run       {} ({} steps)\n"
        "          config {} ({}), model {} ({})\n"
        "          {} rank(s) ({}), micro-batch {}, seq {}, {} parameters, activation "
        "checkpointing {}{}{}{}\n\n"
        "What this runtime holds per rank (runtime/plan/runtime_memory.h):\n",
        metrics.string(), measured.steps, config_name, s.sources["config"], s.model.string(),
        s.sources["model"], s.world_size, s.sources["world_size"], in.micro_batch, s.seq,
        dtype_name(in.param_dtype),
        in.checkpoint_activations
            ? (in.cpu_checkpointing ? "on, checkpoints in pinned host memory" : "on")
            : "off",
        in.lora.enabled() ? fmt::format("\n          LoRA rank {} on {} ({}): the base frozen",
                                        in.lora.rank, fmt::join(in.lora.targets, ","),
                                        s.sources["lora"])
                          : std::string(),
        pp > 1
            ? fmt::format("\n          pipeline parallel: {} stages, schedule {}{}, {} micro-batches, layers per "
                          "{}stage {}; pp rank 0's share (rank 0 measured it)",
                          pp, pipeline::schedule_name(in.pipeline.kind),
                          in.pipeline.virtual_stages > 1
                              ? fmt::format(" ({} chunks per rank)", in.pipeline.virtual_stages)
                              : std::string(),
                          in.pipeline.micro_batches, in.pipeline.virtual_stages > 1 ? "virtual " : "",
                          fmt::join(in.pipeline_split, ","))
            : std::string(),
        in.layer_major.micro_batches > 0
            ? fmt::format("\n          micro-batches layer-major: {} of them through each layer in turn, "
                          "activations {}, boundaries on {}",
                          in.layer_major.micro_batches, in.layer_major.keep_activations ? "kept" : "recomputed",
                          pipeline::boundary_home_name(in.layer_major.boundaries))
            : std::string());
    for (const plan::MemoryItem& item : memory.items) {
      text += fmt::format("  {:<34} {:<12} {:<6} {:>2}{:>9.2f} MB  {}\n", item.name,
                          plan::where_name(item.where), item.during_steps ? "steps" : "setup",
                          item.upper_bound ? "<=" : "", item.nbytes / 1e6, item.basis);
    }
    text += fmt::format("  {:<34} {:<12} {:<6} {:>11.2f} MB  {}\n", "process baseline", "host", "",
                        baseline / 1e6, baseline_from);
    text += fmt::format(
        "\nPredicted: device {:.2f} MB; host resident = baseline + pinned {:.2f} MB + host {:.2f} "
        "MB{}; nvme "
        "{:.2f} MB\n\n",
        memory.device_nbytes / 1e6, memory.pinned_nbytes / 1e6, memory.host_nbytes / 1e6,
        device_is_host ? " + device (the cpu accelerator's memory is the process's)" : "",
        memory.nvme_nbytes / 1e6);
    text += check_notes(device_is_host);
    std::cout << text << plan::check_text(result)
              << (result.ok()
                      ? fmt::format("every measured tier is within {:.0f}%\n", 100 * tolerance)
                      : fmt::format("a measured tier is outside {:.0f}%\n", 100 * tolerance));
  }
  return result.ok() ? 0 : 1;
}

// Flags that describe a hypothetical job or machine mean nothing to --check,
// which compares a run that happened; the --check flags mean nothing without it.

}  // namespace strata::cli::plan_cli
