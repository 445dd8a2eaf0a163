// Checks strata's LlamaModel against the fixtures scripts/make-golden wrote
// from Hugging Face transformers (tests/data/golden/<case>/): the mean loss and
// every parameter's gradient, on a given accelerator.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/nn/llama_model.h"
#include "runtime/nn/llama_weights.h"
#include "runtime/nn/safetensors.h"
#include "tests/nn/engine_rig.h"
#include "tests/support/tolerances.h"

namespace strata::test {

inline std::string golden_dir(const std::string& name) {
  return std::string(STRATA_SOURCE_DIR) + "/tests/data/golden/" + name;
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

// Runs the case's batch through a LlamaModel with the case's storage dtype and
// `activation_dtype` (unset: the accelerator's default), forward and backward,
// and compares with expected.json[loss_key] and `grads_file`. The last two
// arguments set LlamaModelOptions' activation checkpointing.
inline void check_golden(Backend backend, const std::string& name, const std::string& loss_key,
                         const std::string& grads_file, GoldenTolerance tol,
                         std::optional<DType> activation_dtype = std::nullopt,
                         bool checkpoint_activations = false, bool cpu_checkpointing = false) {
  const std::string dir = golden_dir(name);
  const nn::LlamaConfig config = nn::load_llama_config(dir + "/config.json");
  const nlohmann::json expected = read_json(dir + "/expected.json");
  const nlohmann::json inputs = read_json(dir + "/inputs.json");
  nn::LlamaModelOptions options;
  options.dtype = parse_dtype(expected.at("dtype").get<std::string>());
  options.activation_dtype = activation_dtype;
  options.loss_chunk_rows = 5;  // several chunks, the last one short
  options.checkpoint_activations = checkpoint_activations;
  options.cpu_checkpointing = cpu_checkpointing;
  Rig rig(backend);
  nn::LlamaModel model(*rig.engine, config, options);
  rig.engine->finalize();
  nn::load_parameters(*rig.engine, model.parameters(), dir + "/model.safetensors");
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

  const nn::SafetensorsFile grads = nn::SafetensorsFile::open(dir + "/" + grads_file);
  size_t compared = 0;
  for (nn::ParamId id : model.parameters()) {
    const std::string& pname = rig.engine->param_info(id).name;
    const std::vector<float> ours = rig.grad_values(id);
    const TensorView ref = grads.view(pname);
    REQUIRE(static_cast<size_t>(ref.numel()) == ours.size());
    const auto* r = ref.as<const float>();
    double max_ref = 0, max_diff = 0;
    for (size_t i = 0; i < ours.size(); ++i) {
      max_ref = std::max(max_ref, std::abs(static_cast<double>(r[i])));
      max_diff = std::max(max_diff, std::abs(static_cast<double>(ours[i]) - r[i]));
    }
    INFO(name << " gradient of " << pname << ": max |diff| " << max_diff << ", max |ref| "
              << max_ref << " (" << max_diff / max_ref << " of max)");
    CHECK(max_ref > 0);
    CHECK(max_diff <= tol.grad_of_max * max_ref);
    ++compared;
  }
  CHECK(compared == grads.names().size());  // every HF gradient has its parameter
}

}  // namespace strata::test
