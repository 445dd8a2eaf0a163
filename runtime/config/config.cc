// Checking a configuration document against the schema and building Config.
#include "runtime/config/config.h"

#include "runtime/pipeline/schedule.h"
#include "runtime/config/trainer_flags.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <limits>
#include <map>
#include <optional>

#include "nvme/io_options.h"
#include "runtime/config/engine_options.h"
#include "runtime/config/json_describe.h"
#include "runtime/config/json_text.h"
#include "runtime/config/schema.h"
#include "runtime/config/size.h"
#include "runtime/engine/lr_schedule.h"
#include "runtime/nn/context_support.h"

namespace strata {
namespace {

using nlohmann::json;

// Problems listed in one error; the rest are counted ("... and 12 more").
constexpr size_t kMaxListedProblems = 50;
// Unknown keys longer than this get no "did you mean": no valid key is near,
// and the edit distance costs length x length.
constexpr size_t kMaxSuggestedKeyLength = 64;
// A configuration is a few kilobytes; anything this large is not one (and
// /dev/zero must not be read until memory runs out).
constexpr size_t kMaxConfigFileNbytes = size_t{16} << 20;

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitution = diagonal + (std::tolower(a[i - 1]) == std::tolower(b[j - 1]) ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitution});
    }
  }
  return row[b.size()];
}

std::string last_component(std::string_view path) {
  const auto dot = path.rfind('.');
  return std::string(dot == std::string_view::npos ? path : path.substr(dot + 1));
}

// The valid key closest to an unknown `path`: first among its siblings (a typo),
// then anywhere (a key put in the wrong section).
std::string closest_key(const std::string& path) {
  const auto dot = path.rfind('.');
  const std::string parent = dot == std::string::npos ? "" : path.substr(0, dot + 1);
  const std::string name = last_component(path);
  if (name.size() > kMaxSuggestedKeyLength) return "";
  std::string best;
  size_t best_distance = SIZE_MAX;
  auto consider = [&](const std::string& candidate_path, const std::string& candidate_name) {
    size_t d = edit_distance(name, candidate_name);
    // A truncated or extended name ("train_micro_batch_size") is nearer than its edit distance says.
    if (candidate_name.rfind(name, 0) == 0 || name.rfind(candidate_name, 0) == 0) {
      const size_t length_gap = std::max(name.size(), candidate_name.size()) - std::min(name.size(), candidate_name.size());
      d = std::min<size_t>(d, std::max<size_t>(1, length_gap / 4));
    }
    if (d < best_distance) best_distance = d, best = candidate_path;
  };
  for (const auto& f : config_fields()) {
    if (f.path.rfind(parent, 0) != 0) continue;
    // Immediate children: fields and sections directly under parent.
    const std::string rest = f.path.substr(parent.size());
    const std::string child = rest.substr(0, rest.find('.'));
    consider(parent + child, child);
  }
  consider(parent + "intra_op_parallelism", "intra_op_parallelism");
  const size_t limit = std::max<size_t>(2, name.size() / 3);
  if (best_distance <= limit) return best;
  for (const auto& f : config_fields()) {  // same name elsewhere
    if (last_component(f.path) == name) return f.path;
  }
  return "";
}

class Checker {
 public:
  explicit Checker(std::string source) : source_(std::move(source)) {}

  void walk(const json& object, const std::string& prefix) {
    for (const auto& [key, value] : object.items()) {
      const std::string given = prefix.empty() ? key : prefix + "." + key;
      const std::string path(canonical_config_path(given));
      if (const ConfigField* f = find_config_field(path)) {
        check_field(*f, given, value);
      } else if (is_config_section(path)) {
        if (value.is_object()) {
          walk(value, path);
        } else {
          problem("{}: expected an object (a section), got {}", given, describe_json(value));
        }
      } else if (full()) {
        ++unlisted_;  // counted only: no suggestion search for problems nobody sees
      } else {
        // Sections are known names, so only the last component can be long or odd.
        const std::string shown = (prefix.empty() ? "" : prefix + ".") + printable_excerpt(key, 80);
        const std::string suggestion = closest_key(path);
        problem("{}: unknown key{}", shown,
                suggestion.empty() ? "" : fmt::format(" (did you mean \"{}\"?)", suggestion));
      }
    }
  }

  json effective() const {
    json out = json::object();
    for (const auto& f : config_fields()) {
      auto it = values_.find(f.path);
      out[json::json_pointer("/" + replace_dots(f.path))] = it != values_.end() ? it->second : f.default_value;
    }
    return out;
  }

  bool given(const std::string& path) const { return values_.count(path) != 0; }
  const std::vector<std::string>& no_effect() const { return no_effect_; }
  std::vector<std::string>& problems() { return problems_; }

  template <typename... Args>
  void problem(fmt::format_string<Args...> format, Args&&... args) {
    if (full()) {
      ++unlisted_;
      return;
    }
    problems_.push_back(fmt::format(format, std::forward<Args>(args)...));
  }
  bool full() const { return problems_.size() >= kMaxListedProblems; }
  // The problems to report: at most kMaxListedProblems, then one line counting the rest.
  std::vector<std::string> listed_problems() const {
    std::vector<std::string> out = problems_;
    if (unlisted_ > 0) out.push_back(fmt::format("... and {} more problem{}", unlisted_, unlisted_ == 1 ? "" : "s"));
    return out;
  }

 private:
  static std::string replace_dots(std::string path) {
    std::replace(path.begin(), path.end(), '.', '/');
    return path;
  }

  void check_field(const ConfigField& f, const std::string& given, const json& value) {
    if (auto it = values_.find(f.path); it != values_.end()) {  // set before under its other name
      if (it->second != value) {
        problem("{}: conflicts with {} (they are the same setting, given different values)", given,
                given_as_[f.path]);
      }
      return;
    }
    if (value.is_string() && value.get<std::string>() == "auto" && !accepts_auto(f)) {
      // Hugging Face Trainer configs: a value the Trainer fills from its own
      // arguments is filled only by strata finetune's flag of that meaning
      // (trainer_flags.h); here it is refused, never silently defaulted. The
      // sizes the Trainer derives keep strata's default.
      if (const char* flag = trainer_flag_of(f.path)) {
        problem("{}: \"auto\" is a Hugging Face Trainer value: strata finetune fills it from {}; give the value "
                "here",
                given, flag);
      } else if (!trainer_derived(f.path)) {
        problem("{}: \"auto\" is a Hugging Face Trainer value strata has no flag for: give the value", given);
      } else if (f.default_value.is_null()) {
        // reduce_bucket_size: the Trainer's hidden_size^2 is filled in by
        // finetune and plan --model (apply_trainer_flags) before this; here,
        // without the model, DeepSpeed's default, as "auto" always read — an
        // "auto" is given, never the per-layer choice of a key left out.
        values_[f.path] = json(kDeepSpeedReduceBucketNumel);
        given_as_[f.path] = given;
      }
      return;
    }
    if (value.is_null() && f.default_value.is_null()) return;  // the sizes chosen from the model: as if left out
    std::optional<json> accepted = convert(f, value);
    if (!accepted) {
      const std::string got = f.kind == FieldKind::kEnum && value.is_string()
                                  ? fmt::format("\"{}\"", printable_excerpt(value.get_ref<const std::string&>()))
                                  : describe_json(value);
      problem("{}: {} is not {}", given, got, describe_accepted(f));
      return;
    }
    values_[f.path] = *accepted;
    given_as_[f.path] = given;
    if (f.no_effect) no_effect_.push_back(given);
  }

  static bool in_range(const ConfigField& f, double x) { return std::isfinite(x) && x >= f.min && x <= f.max; }

  // An integer JSON value compared exactly with the field's bounds (a double
  // would round 2^53 + 1 to 2^53 and accept it, then store the other value).
  static std::optional<int64_t> exact_int(const ConfigField& f, const json& value) {
    constexpr double kInt64Bound = 9.2e18;  // below 2^63: every bound in the schema is far inside
    const int64_t lo = f.min <= -kInt64Bound ? std::numeric_limits<int64_t>::min() : static_cast<int64_t>(std::ceil(f.min));
    const int64_t hi = f.max >= kInt64Bound ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(std::floor(f.max));
    if (value.is_number_unsigned()) {
      const uint64_t u = value.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
      const auto i = static_cast<int64_t>(u);
      if (i < lo || i > hi) return std::nullopt;
      return i;
    }
    const int64_t i = value.get<int64_t>();
    if (i < lo || i > hi) return std::nullopt;
    return i;
  }

  static std::optional<json> convert(const ConfigField& f, const json& value) {
    switch (f.kind) {
      case FieldKind::kBool:
        if (value.is_boolean()) return value;
        return std::nullopt;
      case FieldKind::kInt: {
        if (!value.is_number()) return std::nullopt;
        if (value.is_number_integer()) {
          const auto i = exact_int(f, value);
          if (!i) return std::nullopt;
          return json(*i);
        }
        const double x = value.get<double>();  // 1e6 written as a float
        if (x != std::floor(x) || !in_range(f, x) || std::fabs(x) > 9.2e18) return std::nullopt;
        return json(static_cast<int64_t>(x));
      }
      case FieldKind::kNumber:
        if (!value.is_number() || !in_range(f, value.get<double>())) return std::nullopt;
        return json(value.get<double>());
      case FieldKind::kSize: {
        std::optional<uint64_t> exact;  // integers and size strings: no rounding through double
        if (value.is_number_unsigned()) {
          exact = value.get<uint64_t>();
        } else if (value.is_number_integer()) {  // signed: a document built in code
          if (value.get<int64_t>() < 0) return std::nullopt;
          exact = static_cast<uint64_t>(value.get<int64_t>());
        } else if (value.is_string()) {
          exact = parse_size(value.get<std::string>());
        }
        if (exact) {
          if (!in_range(f, static_cast<double>(*exact))) return std::nullopt;
          return json(*exact);
        }
        if (!value.is_number_float()) return std::nullopt;  // other types, strings that are not sizes
        const double x = value.get<double>();
        if (x < 0 || x != std::floor(x) || !in_range(f, x) || x > 1.8e19) return std::nullopt;
        return json(static_cast<uint64_t>(x));
      }
      case FieldKind::kString:
        // A NUL would silently cut a path where the operating system reads it.
        if (!value.is_string() || value.get_ref<const std::string&>().find('\0') != std::string::npos) {
          return std::nullopt;
        }
        return value;
      case FieldKind::kEnum: {
        if (!value.is_string()) return std::nullopt;
        const std::string s = value.get<std::string>();
        for (const auto& c : f.choices) {  // case-insensitive match, canonical spelling kept
          if (c.size() == s.size() && edit_distance(c, s) == 0) return json(c);
        }
        return std::nullopt;
      }
      case FieldKind::kNumberPair:
        if (!value.is_array() || value.size() != 2 || !value[0].is_number() || !value[1].is_number() ||
            !in_range(f, value[0].get<double>()) || !in_range(f, value[1].get<double>())) {
          return std::nullopt;
        }
        return value;
      case FieldKind::kIntList: {
        if (!value.is_array()) return std::nullopt;
        json out = json::array();
        for (const json& item : value) {
          if (!item.is_number_integer()) return std::nullopt;
          const auto i = exact_int(f, item);
          if (!i) return std::nullopt;
          out.push_back(*i);
        }
        return out;
      }
    }
    return std::nullopt;
  }

  std::string source_;
  std::map<std::string, json> values_;
  std::map<std::string, std::string> given_as_;  // canonical path -> the name the file used
  std::vector<std::string> problems_;
  size_t unlisted_ = 0;
  std::vector<std::string> no_effect_;
};

OffloadDevice parse_device(const std::string& name) {
  if (name == "cpu") return OffloadDevice::kCpu;
  if (name == "nvme") return OffloadDevice::kNvme;
  return OffloadDevice::kNone;
}

// A schema-checked integer read into an `int` member. The schema's bounds are
// what keep it in range; a field whose bound exceeds int is a bug in the
// schema, reported as such rather than wrapped to another value.
int as_int(const json& value) {
  const auto v = value.get<int64_t>();
  STRATA_CHECK(v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(), kInternal,
               "configuration value {} does not fit the int it is read into: the schema's bound is too wide", v);
  return static_cast<int>(v);
}

// Fills the typed structs from the complete effective document.
Config build(const json& e) {
  Config c;
  c.micro_batch_size = as_int(e["train_micro_batch_size_per_gpu"]);
  c.gradient_accumulation_steps = as_int(e["gradient_accumulation_steps"]);
  c.train_batch_size = e["train_batch_size"].get<int64_t>();
  c.gradient_clipping = e["gradient_clipping"].get<double>();
  c.expert_parallel_size = e["moe"]["expert_parallel_size"].is_null() ? 0 : as_int(e["moe"]["expert_parallel_size"]);
  c.router_bias_update_rate = e["moe"]["router_bias_update_rate"].get<double>();
  c.tensor_parallel_size = as_int(e["tensor_parallel"]["autotp_size"]);
  c.sequence_parallel = e["sequence_parallel"].get<bool>();
  c.context_parallel_size = as_int(e["context_parallel"]["size"]);
  c.context_parallel_method = e["context_parallel"]["method"].get<std::string>();
  const json& pipeline = e["pipeline_parallel"];
  c.pipeline_parallel_size = as_int(pipeline["size"]);
  c.pipeline_schedule = pipeline["schedule"].get<std::string>();
  c.virtual_stages = as_int(pipeline["virtual_stages"]);
  for (const json& n : pipeline["layers"]) c.pipeline_layers.push_back(n.get<int64_t>());
  c.steps_per_print = e["steps_per_print"].get<int64_t>();
  c.bf16 = e["bf16"]["enabled"].get<bool>();
  for (auto [monitor, name] : {std::pair{&c.csv_monitor, "csv_monitor"}, {&c.tensorboard, "tensorboard"}}) {
    monitor->enabled = e[name]["enabled"].get<bool>();
    monitor->output_path = e[name]["output_path"].get<std::string>();
    monitor->job_name = e[name]["job_name"].get<std::string>();
  }
  c.wandb_enabled = e["wandb"]["enabled"].get<bool>();
  const json& fp16 = e["fp16"];
  c.fp16 = {fp16["enabled"].get<bool>(),        fp16["loss_scale"].get<double>(),
            as_int(fp16["initial_scale_power"]), as_int(fp16["loss_scale_window"]),
            as_int(fp16["hysteresis"]),      fp16["min_loss_scale"].get<double>()};
  const json& opt = e["optimizer"];
  c.optimizer.type = opt["type"].get<std::string>();
  c.optimizer.lr = opt["params"]["lr"].get<double>();
  c.optimizer.betas = {opt["params"]["betas"][0].get<double>(), opt["params"]["betas"][1].get<double>()};
  c.optimizer.eps = opt["params"]["eps"].get<double>();
  c.optimizer.weight_decay = opt["params"]["weight_decay"].get<double>();
  const json& z = e["zero_optimization"];
  c.zero.stage = as_int(z["stage"]);
  const json& op = z["offload_param"];
  c.zero.offload_param = {parse_device(op["device"].get<std::string>()), op["nvme_path"].get<std::string>(),
                          op["pin_memory"].get<bool>(),  as_int(op["buffer_count"]),
                          op["buffer_size"].get<uint64_t>(), op["max_in_cpu"].get<uint64_t>()};
  const json& oo = z["offload_optimizer"];
  c.zero.offload_optimizer = {parse_device(oo["device"].get<std::string>()), oo["nvme_path"].get<std::string>(),
                              oo["pin_memory"].get<bool>(), as_int(oo["buffer_count"])};
  // null: left out, chosen from the model at finalize (0, engine::kChooseFromModel).
  c.zero.sub_group_numel = z["sub_group_size"].is_null() ? 0 : z["sub_group_size"].get<uint64_t>();
  c.zero.reduce_bucket_numel = z["reduce_bucket_size"].is_null() ? 0 : z["reduce_bucket_size"].get<uint64_t>();
  c.zero.overlap_comm = z["overlap_comm"].get<bool>();
  c.zero.contiguous_gradients = z["contiguous_gradients"].get<bool>();
  c.zero.prefetch_bucket_numel = z["stage3_prefetch_bucket_size"].get<uint64_t>();
  c.zero.param_persistence_threshold_numel = z["stage3_param_persistence_threshold"].get<uint64_t>();
  c.zero.max_live_parameters_numel = z["stage3_max_live_parameters"].get<uint64_t>();
  c.zero.max_reuse_distance_numel = z["stage3_max_reuse_distance"].get<uint64_t>();
  const json& aio = e["aio"];
  c.aio = {aio["engine"].get<std::string>(), aio["block_size"].get<uint64_t>(), as_int(aio["queue_depth"]), as_int(aio["thread_count"]),
           aio["single_submit"].get<bool>(), aio["overlap_events"].get<bool>(), aio["auto_tune"].get<bool>()};
  c.cpu_checkpointing = e["activation_checkpointing"]["cpu_checkpointing"].get<bool>();
  const json& s = e["strata"];
  c.strata = {s["accelerator"].get<std::string>(),
              s["seed"].get<uint64_t>(),           s["log_level"].get<std::string>(),
              s["collective_timeout_s"].get<double>(), s["pinned_pool_size"].get<uint64_t>(),
              s["trace_path"].get<std::string>(),  s["keep_swap_files"].get<bool>(),
              s["overlap_optimizer"].get<bool>(),  s["micro_batch_order"].get<std::string>(),
              s["layer_major_boundaries"].get<std::string>(), s["layer_major_activations"].get<std::string>()};
  c.effective = e;
  return c;
}

// Combinations that are individually valid but inconsistent together: every
// cross-key rule, in one place, so that `strata config check` says valid
// exactly when finetune, strata-train, the C API and `strata plan` accept.
void check_combinations(const Config& c, Checker& checker, bool frozen_parameters) {
  const auto& op = c.zero.offload_param;
  const auto& oo = c.zero.offload_optimizer;
  if (op.device != OffloadDevice::kNone && c.zero.stage != 3) {
    checker.problem(
        "zero_optimization.offload_param.device is \"{}\" but zero_optimization.stage is {}: only stage 3 "
        "partitions parameters, so parameter offload needs stage 3",
        offload_device_name(op.device), c.zero.stage);
  }
  if (op.device == OffloadDevice::kNvme && op.nvme_path.empty()) {
    checker.problem(
        "zero_optimization.offload_param.device is \"nvme\" but zero_optimization.offload_param.nvme_path is "
        "not set: say which directory holds the parameter swap files");
  }
  if (c.zero.stage == 0) {
    checker.problem(
        "zero_optimization.stage is 0 (no partitioning, DeepSpeed's default): strata partitions at least the "
        "optimizer state; use 1 (the same step as plain data parallelism), 2 or 3");
  }
  if (op.device != OffloadDevice::kNone && oo.device == OffloadDevice::kNone && !frozen_parameters) {
    checker.problem(
        "zero_optimization.offload_param.device is \"{}\" but offload_optimizer.device is \"none\": the "
        "optimizer state (12 bytes per parameter) would stay on the accelerator to spare the parameters' 2; "
        "offload the optimizer too (offload_optimizer.device \"cpu\" or \"nvme\"), or freeze the parameters "
        "to offload (a LoRA run, or finetune --freeze: the trained ones then stay on the accelerator)",
        offload_device_name(op.device));
  }
  if (op.device == OffloadDevice::kNvme && oo.device == OffloadDevice::kNvme && op.nvme_path != oo.nvme_path) {
    checker.problem(
        "zero_optimization.offload_param.nvme_path (\"{}\") and offload_optimizer.nvme_path (\"{}\") differ: "
        "strata keeps both kinds of swap files under one directory; give the same path",
        op.nvme_path, oo.nvme_path);
  }
  // NVMe optimizer offload at stages 1 and 2 goes beyond DeepSpeed (which
  // asks for stage 3): the engine swaps any stage's optimizer shard, and the
  // equivalence matrix (tests/engine/zero_matrix_test.cc) runs those cells.
  if (oo.device == OffloadDevice::kNvme && oo.nvme_path.empty()) {
    checker.problem(
        "zero_optimization.offload_optimizer.device is \"nvme\" but "
        "zero_optimization.offload_optimizer.nvme_path is not set: say which directory holds the "
        "optimizer swap files");
  }
  if (c.fp16.enabled && c.bf16) {
    checker.problem("fp16.enabled and bf16.enabled are both true: choose one 16-bit format");
  }
  const int64_t per_rank = static_cast<int64_t>(c.micro_batch_size) * c.gradient_accumulation_steps;
  if (c.train_batch_size != 0 && c.train_batch_size % per_rank != 0) {
    checker.problem(
        "train_batch_size {} is not divisible by train_micro_batch_size_per_gpu {} x "
        "gradient_accumulation_steps {} = {}: the world size would not be a whole number",
        c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps, per_rank);
  }
  // The I/O engine's own limits (nvme/io_options.h), so that a file this
  // accepts is one the engine accepts.
  if (c.aio.block_size % nvme::kDirectIoAlignment != 0) {
    checker.problem("aio.block_size {} is not a multiple of {} bytes, which O_DIRECT requires",
                    c.aio.block_size, nvme::kDirectIoAlignment);
  }
  if (c.aio.block_size > nvme::kMaxBlockNbytes) {
    checker.problem("aio.block_size {} is over 1 GiB ({}), the largest I/O piece strata issues "
                    "(io_uring lengths are 32-bit); 1 MiB to 16 MiB is typical",
                    c.aio.block_size, nvme::kMaxBlockNbytes);
  }
  if (c.aio.auto_tune && c.aio.engine == "psync") {
    checker.problem("aio.auto_tune is true with aio.engine \"psync\": psync moves one piece at a "
                    "time, so there is no queue depth to tune; use engine \"uring\" or \"aio\", "
                    "or set auto_tune false");
  }
  if (c.effective["aio"]["use_gds"].get<bool>()) {
    checker.problem("aio.use_gds is true: GPUDirect Storage is not supported by strata; remove it or set false");
  }
  if (c.tensor_parallel_size > 1 && c.expert_parallel_size > 1) {
    checker.problem("tensor_parallel.autotp_size {} with moe.expert_parallel_size {}: tensor parallelism is not "
                    "implemented for mixture-of-experts models yet",
                    c.tensor_parallel_size, c.expert_parallel_size);
  }
  if (c.context_parallel_size > 1) {
    // What context parallelism is not built with yet (nn/context_support.h), by the keys that ask for it.
    using nn::CpFeature;
    for (const std::string& problem : nn::unsupported_with_context_parallel(
             fmt::format("context_parallel.size {}", c.context_parallel_size),
             {{CpFeature::kPipeline, c.pipeline_parallel_size > 1,
               fmt::format("pipeline_parallel.size {}", c.pipeline_parallel_size)},
              {CpFeature::kExperts, c.expert_parallel_size > 1,
               fmt::format("moe.expert_parallel_size {}", c.expert_parallel_size)},
              {CpFeature::kLayerMajor, c.strata.micro_batch_order == "layer-major",
               "strata.micro_batch_order \"layer-major\""}})) {
      checker.problem("{}", problem);
    }
  }
  if (c.pipeline_parallel_size > 1 || c.virtual_stages > 1 || !c.pipeline_layers.empty()) {
    const auto kind = pipeline::parse_schedule(c.pipeline_schedule);
    if (c.pipeline_parallel_size == 1) {
      checker.problem("pipeline_parallel.{} is given but pipeline_parallel.size is 1: there is no pipeline to "
                      "shape; set the size (or finetune --pp) or leave it out",
                      c.virtual_stages > 1 ? "virtual_stages" : "layers");
    } else if (*kind != pipeline::ScheduleKind::kInterleaved && c.virtual_stages > 1) {
      checker.problem("pipeline_parallel.virtual_stages {} needs pipeline_parallel.schedule \"interleaved\" (it is "
                      "\"{}\")",
                      c.virtual_stages, c.pipeline_schedule);
    } else if (*kind == pipeline::ScheduleKind::kInterleaved && c.virtual_stages < 2) {
      checker.problem("pipeline_parallel.schedule \"interleaved\" needs pipeline_parallel.virtual_stages of 2 or "
                      "more (chunks of layers per rank)");
    } else if (*kind == pipeline::ScheduleKind::kInterleaved &&
               c.gradient_accumulation_steps % c.pipeline_parallel_size != 0) {
      checker.problem("pipeline_parallel.schedule \"interleaved\" runs micro-batches in groups of the pipeline "
                      "size (Megatron's rule): gradient_accumulation_steps {} (the micro-batches of a step) is not "
                      "a multiple of pipeline_parallel.size {}",
                      c.gradient_accumulation_steps, c.pipeline_parallel_size);
    } else if (!c.pipeline_layers.empty() &&
               static_cast<int64_t>(c.pipeline_layers.size()) !=
                   static_cast<int64_t>(c.pipeline_parallel_size) * c.virtual_stages) {
      checker.problem("pipeline_parallel.layers has {} entries; one per stage (size {} x virtual_stages {}) is "
                      "needed",
                      c.pipeline_layers.size(), c.pipeline_parallel_size, c.virtual_stages);
    }
  }
  if (c.wandb_enabled) {
    checker.problem("wandb.enabled is true: Weights & Biases logs to its servers over the network, which strata's "
                    "training machines are not given; use csv_monitor or tensorboard (written to local files; "
                    "tensorboard --logdir reads them) and metrics.jsonl");
  }
}

std::string join_problems(const std::string& source, const std::vector<std::string>& problems) {
  std::string message = fmt::format("{}: {} problem{} in the configuration:", source, problems.size(),
                                    problems.size() == 1 ? "" : "s");
  for (const auto& p : problems) message += "\n  - " + p;
  return message;
}

}  // namespace

ConfigError::ConfigError(std::string source, std::vector<std::string> problems)
    : Error(ErrorCategory::kBadArgument, join_problems(source, problems)),
      source_(std::move(source)),
      problems_(std::move(problems)) {}

std::string_view offload_device_name(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "?";
}

namespace {
// parse_config with problems already found in the text (duplicate keys).
Config check_document(const json& document, std::string_view source, const std::vector<std::string>& text_problems,
                      bool frozen_parameters = false) {
  Checker checker{std::string(source)};
  for (const auto& p : text_problems) checker.problem("{}", p);
  if (!document.is_object()) {
    checker.problem("the top level must be a JSON object, got {}", describe_json(document));
    throw ConfigError(std::string(source), checker.listed_problems());
  }
  checker.walk(document, "");
  if (!checker.problems().empty()) throw ConfigError(std::string(source), checker.listed_problems());
  Config config = build(checker.effective());
  config.no_effect_keys = checker.no_effect();
  check_combinations(config, checker, frozen_parameters);
  if (checker.problems().empty()) {
    // The engine's own limits, through the same mapping every user of a
    // config runs (engine_options.h): valid here means accepted there.
    if (const auto refusal = engine_refusal(config)) checker.problem("{}", *refusal);
  }
  if (document.contains("scheduler")) {
    config.scheduler = document.at("scheduler");
    try {
      (void)engine::LrSchedule::from_json(config.scheduler, config.optimizer.lr);
    } catch (const Error& e) {
      checker.problem("{}", e.message());
    }
  }
  if (!checker.problems().empty()) throw ConfigError(std::string(source), checker.listed_problems());
  return config;
}
}  // namespace

Config parse_config(const json& document, std::string_view source) { return check_document(document, source, {}); }

Config parse_config_text(std::string_view text, std::string_view source, const DocumentFilter& filter,
                         bool frozen_parameters) {
  JsonTextResult parsed = parse_json_text(text);
  if (!parsed.ok) throw ConfigError(std::string(source), {parsed.error});
  std::vector<std::string> duplicates;
  for (const auto& key : parsed.duplicate_keys) {
    duplicates.push_back(fmt::format("{}: given more than once (a second value would silently replace the first)", key));
  }
  if (parsed.duplicate_key_count > parsed.duplicate_keys.size()) {
    duplicates.push_back(fmt::format("... and {} more keys given more than once",
                                     parsed.duplicate_key_count - parsed.duplicate_keys.size()));
  }
  if (filter && duplicates.empty()) {
    return check_document(filter(std::move(parsed.document)), source, duplicates, frozen_parameters);
  }
  return check_document(parsed.document, source, duplicates, frozen_parameters);
}

Config load_config_file(const std::string& path, const DocumentFilter& filter, bool frozen_parameters) {
  const std::string what = fmt::format("cannot read config file {}", path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) raise_errno(errno, what);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || S_ISDIR(st.st_mode)) {
    const int err = S_ISDIR(st.st_mode) ? EISDIR : errno;
    ::close(fd);
    raise_errno(err, what);  // "...: Is a directory", not a JSON error about empty input
  }
  // Read at most one byte past the limit (pipes and devices have no size to check first).
  std::string text;
  char buffer[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      raise_errno(err, what);
    }
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (text.size() > kMaxConfigFileNbytes) {
      ::close(fd);
      throw ConfigError(path, {fmt::format("the file is larger than {} bytes (16 MiB); a configuration is a few "
                                           "kilobytes of JSON", kMaxConfigFileNbytes)});
    }
  }
  ::close(fd);
  return parse_config_text(text, path, filter, frozen_parameters);
}

Config default_config() { return parse_config(json::object(), "defaults"); }

std::vector<std::string> no_effect_notes(const Config& config) {
  std::vector<std::string> notes;
  for (const auto& key : config.no_effect_keys) {
    const ConfigField* field = find_config_field(canonical_config_path(key));
    notes.push_back(fmt::format("{} is a DeepSpeed key that strata accepts but does not use{}{}", key,
                                field != nullptr ? ": " : "", field != nullptr ? field->doc : ""));
  }
  return notes;
}

}  // namespace strata
