// Checking a configuration document against the schema and building Config.
#include "runtime/config/config.h"


#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include "runtime/config/json_describe.h"
#include "runtime/config/schema.h"
#include "runtime/config/size.h"

namespace strata {
namespace {

using nlohmann::json;

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
      } else {
        const std::string suggestion = closest_key(path);
        problem("{}: unknown key{}", given,
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
    problems_.push_back(fmt::format(format, std::forward<Args>(args)...));
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
    if (value.is_string() && value.get<std::string>() == "auto") return;  // Hugging Face: use the default
    std::optional<json> accepted = convert(f, value);
    if (!accepted) {
      const std::string got = f.kind == FieldKind::kEnum && value.is_string()
                                  ? fmt::format("\"{}\"", value.get<std::string>())
                                  : describe_json(value);
      problem("{}: {} is not {}", given, got, describe_accepted(f));
      return;
    }
    values_[f.path] = *accepted;
    given_as_[f.path] = given;
    if (f.no_effect) no_effect_.push_back(given);
  }

  static bool in_range(const ConfigField& f, double x) { return std::isfinite(x) && x >= f.min && x <= f.max; }

  static std::optional<json> convert(const ConfigField& f, const json& value) {
    switch (f.kind) {
      case FieldKind::kBool:
        if (value.is_boolean()) return value;
        return std::nullopt;
      case FieldKind::kInt: {
        if (!value.is_number()) return std::nullopt;
        const double x = value.get<double>();
        if (x != std::floor(x) || !in_range(f, x)) return std::nullopt;
        return json(static_cast<int64_t>(x));
      }
      case FieldKind::kNumber:
        if (!value.is_number() || !in_range(f, value.get<double>())) return std::nullopt;
        return json(value.get<double>());
      case FieldKind::kSize: {
        double x = -1;
        if (value.is_number()) {
          x = value.get<double>();
        } else if (value.is_string()) {
          if (auto parsed = parse_size(value.get<std::string>())) x = static_cast<double>(*parsed);
        }
        if (x < 0 || x != std::floor(x) || !in_range(f, x) || x > 1.8e19) return std::nullopt;
        return json(static_cast<uint64_t>(x));
      }
      case FieldKind::kString:
        if (!value.is_string()) return std::nullopt;
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
    }
    return std::nullopt;
  }

  std::string source_;
  std::map<std::string, json> values_;
  std::map<std::string, std::string> given_as_;  // canonical path -> the name the file used
  std::vector<std::string> problems_;
  std::vector<std::string> no_effect_;
};

OffloadDevice parse_device(const std::string& name) {
  if (name == "cpu") return OffloadDevice::kCpu;
  if (name == "nvme") return OffloadDevice::kNvme;
  return OffloadDevice::kNone;
}

// Fills the typed structs from the complete effective document.
Config build(const json& e) {
  Config c;
  c.micro_batch_size = e["train_micro_batch_size_per_gpu"].get<int>();
  c.gradient_accumulation_steps = e["gradient_accumulation_steps"].get<int>();
  c.train_batch_size = e["train_batch_size"].get<int64_t>();
  c.gradient_clipping = e["gradient_clipping"].get<double>();
  c.steps_per_print = e["steps_per_print"].get<int64_t>();
  c.bf16 = e["bf16"]["enabled"].get<bool>();
  const json& fp16 = e["fp16"];
  c.fp16 = {fp16["enabled"].get<bool>(),        fp16["loss_scale"].get<double>(),
            fp16["initial_scale_power"].get<int>(), fp16["loss_scale_window"].get<int>(),
            fp16["hysteresis"].get<int>(),      fp16["min_loss_scale"].get<double>()};
  const json& opt = e["optimizer"];
  c.optimizer.type = opt["type"].get<std::string>();
  c.optimizer.lr = opt["params"]["lr"].get<double>();
  c.optimizer.betas = {opt["params"]["betas"][0].get<double>(), opt["params"]["betas"][1].get<double>()};
  c.optimizer.eps = opt["params"]["eps"].get<double>();
  c.optimizer.weight_decay = opt["params"]["weight_decay"].get<double>();
  const json& z = e["zero_optimization"];
  c.zero.stage = z["stage"].get<int>();
  const json& op = z["offload_param"];
  c.zero.offload_param = {parse_device(op["device"].get<std::string>()), op["nvme_path"].get<std::string>(),
                          op["pin_memory"].get<bool>(),  op["buffer_count"].get<int>(),
                          op["buffer_size"].get<uint64_t>(), op["max_in_cpu"].get<uint64_t>()};
  const json& oo = z["offload_optimizer"];
  c.zero.offload_optimizer = {parse_device(oo["device"].get<std::string>()), oo["nvme_path"].get<std::string>(),
                              oo["pin_memory"].get<bool>(), oo["buffer_count"].get<int>()};
  c.zero.sub_group_numel = z["sub_group_size"].get<uint64_t>();
  c.zero.reduce_bucket_numel = z["reduce_bucket_size"].get<uint64_t>();
  c.zero.overlap_comm = z["overlap_comm"].get<bool>();
  c.zero.contiguous_gradients = z["contiguous_gradients"].get<bool>();
  c.zero.prefetch_bucket_numel = z["stage3_prefetch_bucket_size"].get<uint64_t>();
  c.zero.param_persistence_threshold_numel = z["stage3_param_persistence_threshold"].get<uint64_t>();
  c.zero.max_live_parameters_numel = z["stage3_max_live_parameters"].get<uint64_t>();
  c.zero.max_reuse_distance_numel = z["stage3_max_reuse_distance"].get<uint64_t>();
  const json& aio = e["aio"];
  c.aio = {aio["block_size"].get<uint64_t>(), aio["queue_depth"].get<int>(), aio["thread_count"].get<int>(),
           aio["single_submit"].get<bool>(), aio["overlap_events"].get<bool>()};
  c.cpu_checkpointing = e["activation_checkpointing"]["cpu_checkpointing"].get<bool>();
  const json& s = e["strata"];
  c.strata = {s["accelerator"].get<std::string>(),  s["io_engine"].get<std::string>(),
              s["seed"].get<uint64_t>(),           s["log_level"].get<std::string>(),
              s["collective_timeout_s"].get<double>(), s["pinned_pool_size"].get<uint64_t>(),
              s["trace_path"].get<std::string>(),  s["keep_swap_files"].get<bool>()};
  c.effective = e;
  return c;
}

// Combinations that are individually valid but inconsistent together.
void check_combinations(const Config& c, Checker& checker) {
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
  if (oo.device != OffloadDevice::kNone && c.zero.stage == 0) {
    checker.problem(
        "zero_optimization.offload_optimizer.device is \"{}\" but zero_optimization.stage is 0: optimizer "
        "offload works on optimizer-state shards, which need stage 1 or higher",
        offload_device_name(oo.device));
  }
  if (oo.device == OffloadDevice::kNvme && c.zero.stage != 3 && c.zero.stage != 0) {
    checker.problem(
        "zero_optimization.offload_optimizer.device is \"nvme\" but zero_optimization.stage is {}: NVMe "
        "optimizer offload needs stage 3 (as in DeepSpeed)",
        c.zero.stage);
  }
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
  if (c.aio.block_size % 4096 != 0) {
    checker.problem("aio.block_size {} is not a multiple of 4096 bytes, which O_DIRECT requires",
                    c.aio.block_size);
  }
  if (c.aio.block_size > (uint64_t{1} << 30)) {
    checker.problem("aio.block_size {} is over 1 GiB (1073741824), the largest I/O piece strata issues "
                    "(io_uring lengths are 32-bit); 1 MiB to 16 MiB is typical",
                    c.aio.block_size);
  }
  if (c.effective["aio"]["use_gds"].get<bool>()) {
    checker.problem("aio.use_gds is true: GPUDirect Storage is not supported by strata; remove it or set false");
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

Config parse_config(const json& document, std::string_view source) {
  Checker checker{std::string(source)};
  if (!document.is_object()) {
    throw ConfigError(std::string(source), {fmt::format("the top level must be a JSON object, got {}",
                                                        describe_json(document))});
  }
  checker.walk(document, "");
  if (!checker.problems().empty()) throw ConfigError(std::string(source), checker.problems());
  Config config = build(checker.effective());
  config.no_effect_keys = checker.no_effect();
  check_combinations(config, checker);
  if (!checker.problems().empty()) throw ConfigError(std::string(source), checker.problems());
  return config;
}

Config parse_config_text(std::string_view text, std::string_view source) {
  json document;
  try {
    document = json::parse(text);
  } catch (const json::parse_error& e) {
    // Translate the byte offset into line:column for the message.
    size_t line = 1, column = 1;
    for (size_t i = 0; i + 1 < e.byte && i < text.size(); ++i) {
      if (text[i] == '\n') ++line, column = 1;
      else ++column;
    }
    std::string detail = e.what();
    const auto colon = detail.find("syntax error");
    if (colon != std::string::npos) detail = detail.substr(colon);
    throw ConfigError(std::string(source), {fmt::format("{}:{}: JSON {}", line, column, detail)});
  }
  return parse_config(document, source);
}

Config load_config_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) raise_errno(errno, fmt::format("cannot read config file {}", path));
  std::stringstream buffer;
  buffer << file.rdbuf();
  return parse_config_text(buffer.str(), path);
}

Config default_config() { return parse_config(json::object(), "defaults"); }

}  // namespace strata
