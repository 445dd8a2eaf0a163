// adapter_config.json -> LoraSpec, refusing what plain LoRA does not compute.
#include "runtime/train/peft_adapter.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "core/error.h"

namespace strata::train {
namespace fs = std::filesystem;
namespace {

// Keys that describe the adapter without changing what it computes once its
// weights are loaded (its initialisation included), or that configure a
// variant only when another key switches it on (that key is checked).
const std::set<std::string> kDescriptive = {
    "peft_type",          "task_type",   "base_model_name_or_path", "revision", "inference_mode",
    "peft_version",       "auto_mapping", "init_lora_weights",      "megatron_core",
    "qalora_group_size",  "layers_pattern"};
// Keys read into the spec.
const std::set<std::string> kRead = {"r", "lora_alpha", "use_rslora", "lora_dropout", "target_modules", "bias"};

bool neutral(const nlohmann::json& v) {
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_object() && v.empty()) ||
         (v.is_array() && v.empty());
}

}  // namespace

PeftAdapter read_peft_adapter(const fs::path& dir) {
  const fs::path config_path = dir / "adapter_config.json";
  std::ifstream in(config_path);
  STRATA_CHECK(in.good(), kBadArgument, "--lora-init {}: no adapter_config.json there (a PEFT adapter directory)",
               dir.string());
  const nlohmann::json c = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  const std::string where = config_path.string();
  STRATA_CHECK(c.is_object(), kBadArgument, "{}: not a JSON object", where);
  // Strings where strings belong, before any is read as one.
  for (const char* key : {"peft_type", "bias"}) {
    STRATA_CHECK(!c.contains(key) || c[key].is_string(), kBadArgument, "{}: {} must be a string, got {}", where, key,
                 c[key].dump());
  }
  STRATA_CHECK(c.value("peft_type", std::string()) == "LORA", kBadArgument,
               "{}: peft_type is {}, strata trains LoRA adapters only", where,
               c.contains("peft_type") ? c["peft_type"].dump() : std::string("absent"));
  for (const auto& [key, value] : c.items()) {
    if (kDescriptive.count(key) != 0 || kRead.count(key) != 0) continue;
    STRATA_CHECK(neutral(value), kBadArgument,
                 "{}: key '{}' is {}: that changes what PEFT computes, and strata computes plain LoRA (r, "
                 "lora_alpha, use_rslora, lora_dropout, target_modules, bias \"none\")",
                 where, key, value.dump().substr(0, 120));
  }
  STRATA_CHECK(c.value("bias", std::string("none")) == "none", kBadArgument,
               "{}: bias is {}: strata trains no biases with LoRA (PEFT's bias \"none\")", where, c["bias"].dump());
  PeftAdapter a;
  try {
    STRATA_CHECK(c.at("r").is_number_integer(), kBadArgument, "{}: r must be a whole number, got {}", where,
                 c["r"].dump());
    a.spec.rank = c.at("r").get<int64_t>();
    a.spec.alpha = c.at("lora_alpha").get<double>();
    a.spec.rslora = c.value("use_rslora", false);
    a.spec.dropout = c.value("lora_dropout", 0.0);
    const nlohmann::json& targets = c.at("target_modules");
    a.spec.targets = targets.is_string() ? nn::parse_lora_targets(targets.get<std::string>())
                                         : targets.get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    raise(ErrorCategory::kBadArgument,
          "{}: r, lora_alpha, use_rslora, lora_dropout or target_modules missing or of the wrong type ({})", where,
          e.what());
  }
  try {
    a.spec.validate();
  } catch (const Error& e) {
    raise(ErrorCategory::kBadArgument, "{}: {}", where, e.message());
  }
  a.weights = dir / "adapter_model.safetensors";
  STRATA_CHECK(fs::exists(a.weights), kBadArgument,
               "--lora-init {}: no adapter_model.safetensors (an adapter saved as adapter_model.bin is a pickle: "
               "save it with safe_serialization)",
               dir.string());
  return a;
}

}  // namespace strata::train
