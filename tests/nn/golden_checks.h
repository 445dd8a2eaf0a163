// Checks strata's DecoderModel against the fixtures scripts/make-golden wrote
// from Hugging Face transformers (tests/data/golden/<case>/): the mean loss and
// every parameter's gradient, on a given accelerator; and, with LoRA adapters,
// against the fixtures of scripts/make-golden-lora from PEFT: the loss and
// every adapter's gradient.
#pragma once

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "runtime/nn/decoder_model.h"
#include "runtime/nn/param_files.h"
#include "runtime/nn/lora.h"
#include "runtime/train/peft_adapter.h"
#include "runtime/nn/safetensors.h"
#include "tests/nn/engine_rig.h"
#include "tests/support/tolerances.h"
#include "tests/support/test_paths.h"

namespace strata::test {

inline std::string golden_dir(const std::string& name) {
  return strata::test::source_dir() + "/tests/data/golden/" + name;
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

struct GoldenRun {
  std::optional<DType> activation_dtype;  // unset: the accelerator's default
  bool checkpoint_activations = false, cpu_checkpointing = false;
  // The case's PEFT adapter (adapter_config.json + adapter_model.safetensors):
  // the base frozen, only the adapters' gradients compared.
  bool lora = false;
  // Mixture of experts: the config's output_router_logits forced off (the
  // loss without the load-balancing term; compare it with loss_without_aux
  // and no gradients file, which holds the total loss's gradients).
  bool router_logits_off = false;
};

// The largest gradient difference of the last check_golden_run, relative to
// each gradient's largest magnitude (for tests that report it).
inline double& last_golden_grad_rel() {
  static double worst = 0;
  return worst;
}

// Whether `pname` is an expert of a layer that the case says no token chose
// (expected.json "unrouted_experts": [[layer, expert], ...]): its gradient is zero.
inline bool unrouted_expert(const nlohmann::json& expected, const std::string& pname) {
  if (!expected.contains("unrouted_experts")) return false;
  for (const auto& le : expected.at("unrouted_experts")) {
    const std::string layer = "layers." + std::to_string(le.at(0).get<int>()) + ".";
    const std::string expert = ".experts." + std::to_string(le.at(1).get<int>()) + ".";
    if (pname.find(layer) != std::string::npos && pname.find(expert) != std::string::npos) return true;
  }
  return false;
}

// Runs the case's batch through a DecoderModel with the case's storage dtype and
// `run`'s options, forward and backward, and compares with
// expected.json[loss_key] and `grads_file` (every gradient it holds, and no
// trained parameter without one).
inline void check_golden_run(Backend backend, const std::string& name, const std::string& loss_key,
                             const std::string& grads_file, GoldenTolerance tol, const GoldenRun& run) {
  const std::string dir = golden_dir(name);
  nn::DecoderConfig config = nn::load_decoder_config(dir + "/config.json");
  if (run.router_logits_off) config.output_router_logits = false;
  const nlohmann::json expected = read_json(dir + "/expected.json");
  const nlohmann::json inputs = read_json(dir + "/inputs.json");
  nn::DecoderModelOptions options;
  options.dtype = parse_dtype(expected.at("dtype").get<std::string>());
  options.activation_dtype = run.activation_dtype;
  options.loss_chunk_rows = 5;  // several chunks, the last one short
  options.checkpoint_activations = run.checkpoint_activations;
  options.cpu_checkpointing = run.cpu_checkpointing;
  if (run.lora) {
    options.lora = train::read_peft_adapter(dir).spec;  // PEFT's adapter_config.json, as --lora-init reads it
    CHECK(options.lora.scaling() == Approx(expected.at("lora").at("scaling").get<double>()));
  }
  Rig rig(backend);
  nn::DecoderModel model(*rig.engine, config, options);
  rig.engine->finalize();
  std::vector<nn::ParamId> base, adapters;
  for (nn::ParamId id : model.parameters()) {
    (nn::is_lora_parameter(rig.engine->param_info(id).name) ? adapters : base).push_back(id);
  }
  // A gemma3 checkpoint's text model sits under its own names, beside the vision tower (not loaded).
  const nn::CheckpointNames& names = nn::checkpoint_names(config);
  nn::load_parameters(*rig.engine, base, dir + "/model.safetensors", /*allow_unused=*/config.multimodal.has_value(),
                      [&](const std::string& name) { return names.file_name(name); });
  if (run.lora) {
    nn::load_parameters(*rig.engine, adapters, dir + "/adapter_model.safetensors", false,
                        [&](const std::string& name) { return names.adapter_name(name); });
  }
  const auto ids = inputs.at("ids").get<std::vector<int32_t>>();
  const auto targets = inputs.at("targets").get<std::vector<int32_t>>();
  // Packed cases (scripts/make-golden-packed) give each row's documents' positions.
  std::vector<int32_t> positions;
  if (inputs.contains("positions")) positions = inputs.at("positions").get<std::vector<int32_t>>();
  nn::ForwardOptions forward;
  forward.positions = positions;
  rig.engine->zero_grad();
  model.forward(ids, targets, inputs.at("batch").get<int64_t>(), inputs.at("seq").get<int64_t>(), forward);
  model.backward();
  const double loss = model.loss(), want = expected.at(loss_key).get<double>();
  INFO(name << " loss " << loss << " expected " << want);
  CHECK(std::abs(loss - want) <= tol.loss_rel * std::abs(want));
  if (grads_file.empty()) return;  // the loss only

  const nn::SafetensorsFile grads = nn::SafetensorsFile::open(dir + "/" + grads_file);
  std::set<std::string> compared;  // the HF gradients met
  last_golden_grad_rel() = 0;
  for (nn::ParamId id : model.parameters()) {
    const engine::ParamInfo& info = rig.engine->param_info(id);
    const std::string& pname = info.name;
    // A view of a larger tensor (gpt-oss's stacked experts) compares with its elements of it.
    const std::string& tensor = info.slice ? info.slice->tensor : pname;
    if (info.frozen) {
      INFO(pname);
      CHECK((run.lora || nn::is_buffer_tensor(pname)));  // only LoRA's base and buffers are frozen here
      CHECK_FALSE(grads.contains(tensor));
      continue;
    }
    const std::vector<float> ours = rig.grad_values(id);
    const TensorView whole = grads.view(tensor);
    std::vector<float> ref_values(ours.size());
    nn::for_each_tensor_run(info, 0, static_cast<int64_t>(ours.size()), [&](int64_t at, int64_t from, int64_t n) {
      REQUIRE(at + n <= whole.numel());
      std::copy_n(whole.as<const float>() + at, n, ref_values.begin() + from);
    });
    if (!info.slice) REQUIRE(static_cast<size_t>(whole.numel()) == ours.size());
    const float* r = ref_values.data();
    double max_ref = 0, max_diff = 0;
    for (size_t i = 0; i < ours.size(); ++i) {
      max_ref = std::max(max_ref, std::abs(static_cast<double>(r[i])));
      max_diff = std::max(max_diff, std::abs(static_cast<double>(ours[i]) - r[i]));
    }
    INFO(name << " gradient of " << pname << ": max |diff| " << max_diff << ", max |ref| "
              << max_ref << " (" << max_diff / max_ref << " of max)");
    if (unrouted_expert(expected, pname)) CHECK(max_ref == 0);
    if (max_ref == 0 && pname.find(".experts.") != std::string::npos) {
      // No token chose this expert (or only tokens whose outputs reach no
      // loss: a last position with an ignored target): transformers'
      // gradient is zero, and ours must be exactly zero too.
      CHECK(max_diff == 0);
      compared.insert(tensor);
      continue;
    }
    CHECK(max_ref > 0);
    CHECK(max_diff <= tol.grad_of_max * max_ref);
    if (max_ref > 0) last_golden_grad_rel() = std::max(last_golden_grad_rel(), max_diff / max_ref);
    compared.insert(tensor);
  }
  CHECK(compared.size() == grads.names().size());  // every HF gradient has its parameter
}

inline void check_golden(Backend backend, const std::string& name, const std::string& loss_key,
                         const std::string& grads_file, GoldenTolerance tol,
                         std::optional<DType> activation_dtype = std::nullopt,
                         bool checkpoint_activations = false, bool cpu_checkpointing = false) {
  check_golden_run(backend, name, loss_key, grads_file, tol,
                   GoldenRun{activation_dtype, checkpoint_activations, cpu_checkpointing});
}

// A case of scripts/make-golden-lora: the base frozen, PEFT's adapter trained.
inline void check_lora_golden(Backend backend, const std::string& name, const std::string& loss_key,
                              const std::string& grads_file, GoldenTolerance tol,
                              std::optional<DType> activation_dtype = std::nullopt) {
  GoldenRun run;
  run.activation_dtype = activation_dtype;
  run.lora = true;
  check_golden_run(backend, name, loss_key, grads_file, tol, run);
}

}  // namespace strata::test
