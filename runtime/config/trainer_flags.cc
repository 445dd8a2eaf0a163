// apply_trainer_flags: "auto" values of Hugging Face Trainer configs, filled from finetune's flags.
#include "runtime/config/trainer_flags.h"

#include <fmt/format.h>

#include <utility>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/config/schema.h"

namespace strata {
namespace {

using json = nlohmann::json;

bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

// A key whose own values include "auto" (strata.accelerator): not a Trainer placeholder.
bool auto_is_a_value(const std::string& path) {
  const ConfigField* f = find_config_field(canonical_config_path(path));
  return f != nullptr && accepts_auto(*f);
}

// The value at a dotted path, or null when a part is missing.
json* find(json& doc, const std::string& path) {
  json* at = &doc;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t dot = path.find('.', start);
    const std::string key = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!at->is_object() || !at->contains(key)) return nullptr;
    at = &(*at)[key];
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return at;
}

// Every "auto" under `value`, as dotted paths.
void find_autos(const json& value, const std::string& path, std::vector<std::string>& out) {
  if (is_auto(value)) out.push_back(path);
  if (!value.is_object()) return;
  for (const auto& [key, child] : value.items()) find_autos(child, path.empty() ? key : path + "." + key, out);
}

}  // namespace

const char* trainer_flag_of(std::string_view key) {
  static constexpr std::pair<std::string_view, const char*> kFlags[] = {
      {"train_micro_batch_size_per_gpu", "--micro-batch"},
      {"gradient_accumulation_steps", "--grad-accum"},
      {"optimizer.params.lr", "--lr"},
      {"optimizer.params.weight_decay", "--weight-decay"},
      {"scheduler.params.warmup_max_lr", "--lr"},
      {"scheduler.params.warmup_num_steps", "--warmup-steps"},
      {"scheduler.params.total_num_steps", "--steps"},
      {"bf16.enabled", "--bf16"},
      {"fp16.enabled", "--fp16"},
  };
  for (const auto& [k, flag] : kFlags) {
    if (k == key) return flag;
  }
  return nullptr;
}

bool trainer_derived(std::string_view key) {
  return key == "train_batch_size" || key == "zero_optimization.reduce_bucket_size" ||
         key == "zero_optimization.stage3_prefetch_bucket_size" ||
         key == "zero_optimization.stage3_param_persistence_threshold" || key == "scheduler.params.warmup_min_lr";
}

json apply_trainer_flags(json doc, const TrainerFlags& flags, const std::string& source) {
  std::vector<std::string> problems;
  struct Fill {
    const char* key;
    const char* flag;           // what fills it
    std::optional<json> value;  // the value it is filled with; nullopt: the flag was not given
    bool given;                 // the user gave the flag (a value that differs is then a conflict)
    bool set_when_absent;       // a given flag adds the key when the config lacks it
  };
  const int64_t h = flags.hidden_size;
  const std::optional<json> none;
  const auto opt = [](const auto& v) { return v ? std::optional<json>(*v) : std::nullopt; };
  const Fill fills[] = {
      {"train_micro_batch_size_per_gpu", "--micro-batch", opt(flags.micro_batch), flags.micro_batch.has_value(), true},
      {"gradient_accumulation_steps", "--grad-accum", opt(flags.grad_accum), flags.grad_accum.has_value(), true},
      {"optimizer.params.lr", "--lr", opt(flags.lr), flags.lr.has_value(), true},
      {"optimizer.params.weight_decay", "--weight-decay", opt(flags.weight_decay), flags.weight_decay.has_value(),
       true},
      {"scheduler.params.warmup_max_lr", "--lr", opt(flags.lr), flags.lr.has_value(), false},
      {"scheduler.params.warmup_min_lr", "0 (as the Trainer)", json(0.0), false, false},
      {"scheduler.params.warmup_num_steps", "--warmup-steps", opt(flags.warmup_steps), flags.warmup_steps.has_value(),
       false},
      {"scheduler.params.total_num_steps", "--steps", flags.steps > 0 ? std::optional<json>(flags.steps) : none, false,
       false},
      {"bf16.enabled", "--bf16", json(flags.bf16), flags.bf16, true},
      {"fp16.enabled", "--fp16", json(flags.fp16), flags.fp16, true},
      {"zero_optimization.reduce_bucket_size", "the model's hidden_size^2", h > 0 ? std::optional<json>(h * h) : none,
       false, false},
      {"zero_optimization.stage3_prefetch_bucket_size", "the model's 0.9 x hidden_size^2",
       h > 0 ? std::optional<json>(static_cast<int64_t>(0.9 * static_cast<double>(h * h))) : none, false, false},
      {"zero_optimization.stage3_param_persistence_threshold", "the model's 10 x hidden_size",
       h > 0 ? std::optional<json>(10 * h) : none, false, false},
  };
  for (const Fill& f : fills) {
    json* at = find(doc, f.key);
    if (at != nullptr && is_auto(*at)) {
      if (!f.value) {
        problems.push_back(fmt::format("{}: \"auto\" is filled from {}, which was not given: give {} or a value here",
                                       f.key, f.flag, f.flag));
      } else {
        *at = *f.value;
      }
    } else if (at != nullptr && f.given && flags.override_values) {
      *at = *f.value;
    } else if (at != nullptr && f.given && *at != *f.value) {
      problems.push_back(fmt::format("{}: {} here, but {} says {}: give one of them (or \"auto\" here)", f.key,
                                     at->dump(), f.flag, f.value->dump()));
    } else if (at == nullptr && f.given && f.set_when_absent) {
      std::string pointer = std::string("/") + f.key;
      for (char& c : pointer) c = c == '.' ? '/' : c;
      doc[json::json_pointer(pointer)] = *f.value;
    }
  }
  if (json* total = find(doc, "train_batch_size"); total != nullptr && is_auto(*total)) {
    doc.erase("train_batch_size");  // derived: micro-batch x accumulation x world size
  }
  std::vector<std::string> left;
  find_autos(doc, "", left);
  for (const std::string& key : left) {
    if (auto_is_a_value(key)) continue;
    problems.push_back(fmt::format("{}: \"auto\" is a Hugging Face Trainer value strata has no flag for: give the "
                                   "value",
                                   key));
  }
  if (!problems.empty()) throw ConfigError(source, problems);
  return doc;
}

}  // namespace strata
