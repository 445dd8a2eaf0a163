// Each family as a user fine-tunes it, in real `strata finetune` processes on
// the fixtures transformers wrote: import, a few steps, export; the export
// holds the source's model_type, architectures and keys and exactly the
// architecture's tensors (names, shapes, dtype), and loading it back gives
// the loss the run would have had on its next step. A Qwen3 model trains
// under ZeRO-3 with parameters and optimizer state on NVMe on 2 ranks. (That
// transformers loads each export as the same model with the same loss is
// checked by hand with scripts/check-export; see docs/DESIGN.md.)
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/nn/decoder_config.h"
#include "runtime/nn/safetensors.h"
#include "runtime/nn/safetensors_stream.h"
#include "tests/support/finetune_files.h"
#include "tests/support/jsonl.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using strata::test::read_jsonl;
using strata::test::run_command;
using strata::test::strata_binary;
using strata::test::one_window;
using strata::test::write_file;
using nlohmann::json;

namespace {

std::string fixture(const std::string& name) {
  return strata::test::source_dir() + "/tests/data/golden/" + name;
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return json::parse(in);
}

// The fp32 AdamW run of the round trips: a learning rate that moves the loss visibly.
const char* const kFp32Config = R"({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
  "zero_optimization": {"stage": 3}})";

// The export in `dir` against the source model `source`: config.json keeps
// every source key and model_type, the weights are exactly hf_tensors in `dtype`.
void check_export(const std::string& dir, const std::string& source, const std::string& dtype) {
  const json src = read_json(source + "/config.json"), out = read_json(dir + "/config.json");
  for (const auto& [key, value] : src.items()) {
    INFO("config key " << key);
    // The weights are written dequantized: the quantization is not the export's.
    if (key == "quantization_config") {
      CHECK_FALSE(out.contains(key));
      continue;
    }
    CHECK(out.contains(key));
    if (key != "dtype" && key != "torch_dtype") CHECK(out[key] == value);
  }
  CHECK(out["model_type"] == src["model_type"]);
  const strata::nn::DecoderConfig c = strata::nn::parse_decoder_config(out);
  const json archs = {c.model_type == "llama"     ? "LlamaForCausalLM"
                      : c.model_type == "mistral" ? "MistralForCausalLM"
                      : c.model_type == "qwen2"   ? "Qwen2ForCausalLM"
                      : c.model_type == "qwen2_moe" ? "Qwen2MoeForCausalLM"
                      : c.model_type == "deepseek_v3" || c.model_type == "kimi_k2" ? "DeepseekV3ForCausalLM"
                      : c.model_type == "glm4_moe"  ? "Glm4MoeForCausalLM"
                      : c.model_type == "gemma2"  ? "Gemma2ForCausalLM"
                      : c.model_type == "gemma3_text" ? "Gemma3ForCausalLM"
                      : c.model_type == "gpt_oss"  ? "GptOssForCausalLM"
                                                  : "Qwen3ForCausalLM"};
  CHECK(out["architectures"] == archs);
  CHECK(out["torch_dtype"] == (dtype == "F32" ? "float32" : "bfloat16"));
  const strata::nn::SafetensorsFile file = strata::nn::SafetensorsFile::open(dir + "/model.safetensors");
  const std::vector<strata::nn::HfTensor> tensors = strata::nn::hf_tensors(c);
  CHECK(file.names().size() == tensors.size());
  for (const auto& t : tensors) {
    INFO("tensor " << t.name);
    REQUIRE(file.contains(t.name));
    CHECK(file.entry(t.name).shape == t.shape);
    // The sigmoid router's weight and correction bias stay fp32, as transformers keeps them.
    const bool fp32 = strata::nn::export_dtype(c, t.name, strata::DType::kBF16) == strata::DType::kF32;
    CHECK(std::string(strata::nn::safetensors_dtype_name(file.entry(t.name).dtype)) == (fp32 ? "F32" : dtype));
  }
}

}  // namespace

TEST_CASE("families: import, fine-tune, export and load back give the next step's loss", "[finetune][families]") {
  for (const char* family : {"llama3", "mistral", "qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3", "gpt_oss"}) {
    INFO(family);
    strata::test::TempDir dir("families");
    const std::string model = fixture(std::string(family) + "_untied_f32");
    const std::string data = one_window(dir, 37, 7);
    const std::string config = write_file(dir, "ds.json", kFp32Config);
    const std::string common = strata_binary() + " finetune --config " + config + " --data " + data +
                               " --data-format u16 --seq 7 ";
    const auto first = run_command(common + "--model " + model + " --steps 3 --out " + dir.file("a") +
                                   " --export " + dir.file("export") + " --export-dtype fp32 2>&1");
    INFO(first.output);
    REQUIRE(first.exit_code == 0);
    check_export(dir.file("export"), model, "F32");
    // The same run one step longer, and a run from the export: the export's
    // first loss is the step the first run did not take.
    const auto longer = run_command(common + "--model " + model + " --steps 4 --out " + dir.file("b") + " 2>&1");
    INFO(longer.output);
    REQUIRE(longer.exit_code == 0);
    const auto again = run_command(common + "--model " + dir.file("export") + " --steps 1 --out " +
                                   dir.file("c") + " 2>&1");
    INFO(again.output);
    REQUIRE(again.exit_code == 0);
    const auto steps = read_jsonl(dir.file("b") + "/metrics.jsonl");
    REQUIRE(steps.size() == 4);
    const double next = steps[3]["loss"].get<double>(), start = steps[0]["loss"].get<double>();
    const double loaded = read_jsonl(dir.file("c") + "/metrics.jsonl").at(0)["loss"].get<double>();
    INFO("step 1 " << start << ", step 4 " << next << ", export's first " << loaded);
    CHECK(std::abs(start - next) > 1e-3 * start);  // training moved the model
    CHECK(std::abs(loaded - next) <= 1e-6 * next);
    // The source's first loss is transformers' on that batch: the golden case
    // checks the model; here the import reads the same weights.
    CHECK(std::isfinite(start));
  }
}

namespace {

// `strata run -n 2 -- strata finetune` of fixture `name` under ZeRO-3 with
// parameters and optimizer state on NVMe, bf16: every step applied and
// reading the drive, the loss falling on one batch, the export the source's.
void check_zero3_nvme_finetune(const std::string& name) {
  INFO(name);
  strata::test::TempDir dir("families-nvme");
  const std::string swap = dir.file("swap");
  const std::string model = fixture(name);
  const std::string data = one_window(dir, 37, 7);
  const std::string config = strata::test::zero3_nvme_config(dir, "ds.json", swap, /*bf16=*/true);
  const std::string out = dir.file("out");
  const auto run = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                               " --model " + model + " --data " + data + " --data-format u16 --seq 7 --steps 6 --out " +
                               out + " --export " + out + "/model 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, Catch::Contains("ZeRO stage 3, params on nvme, optimizer state on nvme"));
  const auto steps = read_jsonl(out + "/metrics.jsonl");
  REQUIRE(steps.size() == 6);
  for (const auto& s : steps) {
    CHECK(s["applied"].get<bool>());
    CHECK(s["nvme_bytes"].get<uint64_t>() > 0);
  }
  // One batch over and over: the loss falls.
  CHECK(steps[5]["loss"].get<double>() < steps[0]["loss"].get<double>() - 0.1);
  check_export(out + "/model", model, "BF16");
}

}  // namespace

TEST_CASE("families: strata run -n 2 -- strata finetune: Qwen3 under ZeRO-3 with parameters and optimizer on NVMe",
          "[finetune][families]") {
  check_zero3_nvme_finetune("qwen3_tied_bf16");
}

TEST_CASE("families: strata run -n 2 -- strata finetune: Gemma 2, Gemma 3 and gpt-oss under ZeRO-3 with parameters "
          "and optimizer on NVMe",
          "[finetune][families][gemma][gpt_oss]") {
  for (const char* name : {"gemma2_tied_bf16", "gemma3_tied_bf16", "gpt_oss_untied_bf16"}) check_zero3_nvme_finetune(name);
}

TEST_CASE("families: strata run -n 2 -- strata finetune: Mixtral under ZeRO-3 on NVMe reports its load-balancing "
          "loss and its routers' load imbalance and exports what it imported",
          "[finetune][families][moe]") {
  strata::test::TempDir dir("families-moe");
  const std::string swap = dir.file("swap");
  const std::string model = fixture("mixtral_untied_f32");
  const json source = read_json(model + "/config.json");
  REQUIRE(source["output_router_logits"] == true);
  const std::string data = one_window(dir, source["vocab_size"].get<int>(), 7);
  const std::string config = strata::test::zero3_nvme_config(dir, "ds.json", swap);
  const std::string out = dir.file("out");
  const auto run = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                               " --model " + model + " --data " + data + " --data-format u16 --seq 7 --steps 4 --out " +
                               out + " --export " + out + "/model --export-dtype fp32 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, Catch::Contains("  aux ") && Catch::Contains("  experts max/mean "));
  const auto steps = read_jsonl(out + "/metrics.jsonl");
  REQUIRE(steps.size() == 4);
  for (const auto& s : steps) {
    REQUIRE(s.contains("aux_loss"));
    // E x the sum over the k slots and E experts of (share of tokens x mean
    // probability): k = 2 when perfectly balanced, at most E x k = 16.
    CHECK(s["aux_loss"].get<double>() >= 1.0);
    CHECK(s["aux_loss"].get<double>() <= 16.0);
    // The busiest expert's tokens over the mean: 1 balanced, at most E / k = 4.
    REQUIRE(s.contains("router_imbalance"));
    CHECK(s["router_imbalance"].get<double>() >= 1.0);
    CHECK(s["router_imbalance"].get<double>() <= 4.0);
  }
  CHECK(steps[3]["loss"].get<double>() < steps[0]["loss"].get<double>());
  const json exported = read_json(out + "/model/config.json");
  CHECK(exported["model_type"] == "mixtral");
  CHECK(exported["architectures"] == source["architectures"]);
  const strata::nn::SafetensorsFile file = strata::nn::SafetensorsFile::open(out + "/model/model.safetensors");
  const strata::nn::DecoderConfig c = strata::nn::parse_decoder_config(exported);
  CHECK(file.names().size() == strata::nn::hf_tensors(c).size());
  for (const auto& t : strata::nn::hf_tensors(c)) {
    INFO(t.name);
    REQUIRE(file.contains(t.name));
    CHECK(file.entry(t.name).shape == t.shape);
  }
}

TEST_CASE("families: strata run -n 2 -- strata finetune: DeepSeek-V3, Kimi K2 and GLM-4.5 with expert parallelism "
          "and ZeRO-3 on NVMe, exported with the correction bias unchanged, and the export loads back to the next "
          "step's loss",
          "[finetune][families][moe][deepseek]") {
  for (const char* name : {"deepseek_v3_qlora_f32", "kimi_k2_f32", "glm4_moe_bf16"}) {
    INFO(name);
    strata::test::TempDir dir("families-deepseek");
    const std::string swap = dir.file("swap");
    const std::string model = fixture(name);
    const bool bf16 = std::string(name).ends_with("_bf16");
    const json source = read_json(model + "/config.json");
    const std::string data = one_window(dir, source["vocab_size"].get<int>(), 7);
    const std::string config = strata::test::zero3_nvme_config(dir, "ds.json", swap, bf16);
    const std::string common = strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                               " --data " + data + " --data-format u16 --seq 7 ";
    const std::string out = dir.file("out");
    const auto run = run_command(common + "--model " + model + " --steps 4 --out " + out + " --export " + out +
                                 "/model" + (bf16 ? "" : " --export-dtype fp32") + " 2>&1");
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    CHECK_THAT(run.output, Catch::Contains("ZeRO stage 3, params on nvme, optimizer state on nvme") &&
                               Catch::Contains("expert parallelism: 2 ranks split the 8 experts"));
    const auto steps = read_jsonl(out + "/metrics.jsonl");
    REQUIRE(steps.size() == 4);
    for (const auto& s : steps) {
      CHECK(s["nvme_bytes"].get<uint64_t>() > 0);
      CHECK(s["router_imbalance"].get<double>() >= 1.0);
    }
    CHECK(steps[3]["loss"].get<double>() < steps[0]["loss"].get<double>());
    check_export(out + "/model", model, bf16 ? "BF16" : "F32");
    // The correction bias is a buffer: the export holds the checkpoint's values
    // exactly, in fp32 (transformers keeps it so; the bf16 fixture was saved
    // from a model cast to bf16 whole, its bias with it).
    const auto src = strata::nn::SafetensorsFile::open(model + "/model.safetensors");
    const auto exported = strata::nn::SafetensorsFile::open(out + "/model/model.safetensors");
    const std::string bias = "model.layers.1.mlp.gate.e_score_correction_bias";
    const auto want = src.view(bias), got = exported.view(bias);
    REQUIRE(got.desc.dtype == strata::DType::kF32);
    REQUIRE(got.numel() == want.numel());
    std::vector<float> values(static_cast<size_t>(want.numel()));
    strata::convert(want.data, want.desc.dtype, values.data(), strata::DType::kF32, values.size());
    CHECK(std::memcmp(got.data, values.data(), values.size() * sizeof(float)) == 0);
    // The same run one step longer, and a run from the export: the export's
    // first loss is the step the first run did not take.
    const auto longer = run_command(common + "--model " + model + " --steps 5 --out " + dir.file("b") + " 2>&1");
    INFO(longer.output);
    REQUIRE(longer.exit_code == 0);
    const auto again =
        run_command(common + "--model " + out + "/model --steps 1 --out " + dir.file("c") + " 2>&1");
    INFO(again.output);
    REQUIRE(again.exit_code == 0);
    const double next = read_jsonl(dir.file("b") + "/metrics.jsonl").at(4)["loss"].get<double>();
    const double loaded = read_jsonl(dir.file("c") + "/metrics.jsonl").at(0)["loss"].get<double>();
    INFO("step 5 " << next << ", the export's first " << loaded);
    CHECK(std::abs(loaded - next) <= (bf16 ? 1e-2 : 1e-6) * next);
  }
}

TEST_CASE("families: a DeepSeek-V3 FP8 checkpoint fine-tunes from its dequantized weights, exports bf16 without "
          "its quantization_config, and the export loads back to the next step's loss",
          "[finetune][families][deepseek][quant]") {
  strata::test::TempDir dir("families-fp8");
  const std::string fp8 = fixture("fp8_deepseek_v3");
  const json source = read_json(fp8 + "/config.json");
  REQUIRE(source["quantization_config"]["quant_method"] == "fp8");
  // The fixture plus an FP8 multi-token prediction module (model.layers.2.*,
  // as DeepSeek ships it): carried untrained, written dequantized.
  const std::string model = dir.file("model");
  std::filesystem::create_directories(model);
  for (const char* f : {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"})
    std::filesystem::copy_file(fp8 + "/" + f, model + "/" + f);
  std::vector<uint8_t> codes(4 * 136);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>((i * 37) % 120);  // finite codes
  const std::vector<float> scale = {0.5f, 0.0625f}, norm(136, 1.5f);
  {
    strata::nn::SafetensorsStreamWriter mtp(model + "/mtp.safetensors",
                                            {{"model.layers.2.eh_proj.weight", strata::DType::kF8E4M3, {4, 136}},
                                             {"model.layers.2.eh_proj.weight_scale_inv", strata::DType::kF32, {1, 2}},
                                             {"model.layers.2.enorm.weight", strata::DType::kF32, {136}}});
    mtp.write("model.layers.2.eh_proj.weight", 0, codes.data(), codes.size());
    mtp.write("model.layers.2.eh_proj.weight_scale_inv", 0, scale.data(), scale.size() * sizeof(float));
    mtp.write("model.layers.2.enorm.weight", 0, norm.data(), norm.size() * sizeof(float));
    mtp.commit();
  }
  json index = read_json(fp8 + "/model.safetensors.index.json");
  for (const char* t : {"model.layers.2.eh_proj.weight", "model.layers.2.eh_proj.weight_scale_inv",
                        "model.layers.2.enorm.weight"})
    index["weight_map"][t] = "mtp.safetensors";
  write_file(dir, "model/model.safetensors.index.json", index.dump());
  const std::string data = one_window(dir, source["vocab_size"].get<int>(), 7);
  const std::string config = write_file(dir, "ds.json", R"({"train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1, "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}, "zero_optimization": {"stage": 3}})");
  const std::string common = strata_binary() + " finetune --config " + config + " --data " + data +
                             " --data-format u16 --seq 7 ";
  const auto first = run_command(common + "--model " + model + " --steps 2 --out " + dir.file("a") + " --export " +
                                 dir.file("export") + " 2>&1");
  INFO(first.output);
  REQUIRE(first.exit_code == 0);
  CHECK_THAT(first.output, Catch::Contains("2 tensors of the multi-token prediction module"));
  // The model's tensors dequantized and trained, in bf16; the MTP module
  // carried in the last shard, its FP8 weight dequantized (fp32 product,
  // rounded once to bf16) and its scale grid gone.
  const json exported = read_json(dir.file("export") + "/config.json");
  CHECK_FALSE(exported.contains("quantization_config"));
  for (const auto& [key, value] : source.items()) {
    INFO("config key " << key);
    if (key != "quantization_config") CHECK(exported.contains(key));
    if (key != "quantization_config" && key != "dtype" && key != "torch_dtype") CHECK(exported[key] == value);
  }
  const json map = read_json(dir.file("export") + "/model.safetensors.index.json")["weight_map"];
  CHECK_FALSE(map.contains("model.layers.2.eh_proj.weight_scale_inv"));
  const auto carried = strata::nn::SafetensorsFile::open(dir.file("export") + "/" +
                                                         map["model.layers.2.eh_proj.weight"].get<std::string>());
  const auto eh = carried.view("model.layers.2.eh_proj.weight");
  REQUIRE(eh.desc.dtype == strata::DType::kBF16);
  REQUIRE(eh.desc.shape == strata::Shape({4, 136}));
  for (size_t i = 0; i < codes.size(); ++i) {
    const float want = strata::fp8_e4m3_to_float(codes[i]) * scale[(i % 136) / 128];
    CHECK(static_cast<const strata::BFloat16*>(eh.data)[i].bits == strata::float_to_bf16(want).bits);
  }
  const auto weights = strata::nn::SafetensorsFile::open(dir.file("export") + "/" +
                                                         map["model.norm.weight"].get<std::string>());
  const strata::nn::DecoderConfig c = strata::nn::parse_decoder_config(exported);
  CHECK(weights.names().size() == strata::nn::hf_tensors(c).size());
  for (const auto& t : strata::nn::hf_tensors(c)) {
    INFO(t.name);
    REQUIRE(weights.contains(t.name));
    CHECK(weights.entry(t.name).shape == t.shape);
    const bool fp32 = strata::nn::export_dtype(c, t.name, strata::DType::kBF16) == strata::DType::kF32;
    CHECK(weights.entry(t.name).dtype == (fp32 ? strata::DType::kF32 : strata::DType::kBF16));
  }
  const auto longer = run_command(common + "--model " + model + " --steps 3 --out " + dir.file("b") + " 2>&1");
  INFO(longer.output);
  REQUIRE(longer.exit_code == 0);
  const auto again =
      run_command(common + "--model " + dir.file("export") + " --steps 1 --out " + dir.file("c") + " 2>&1");
  INFO(again.output);
  REQUIRE(again.exit_code == 0);
  const auto steps = read_jsonl(dir.file("b") + "/metrics.jsonl");
  REQUIRE(steps.size() == 3);
  const double start = steps[0]["loss"].get<double>(), next = steps[2]["loss"].get<double>();
  const double loaded = read_jsonl(dir.file("c") + "/metrics.jsonl").at(0)["loss"].get<double>();
  INFO("step 1 " << start << ", step 3 " << next << ", the export's first " << loaded);
  CHECK(std::abs(start - next) > 1e-3 * start);  // training moved the model
  CHECK(loaded == next);                         // bf16 masters, exported bf16: the same weights
}

TEST_CASE("families: strata run -n 2 -- strata finetune: the text model of a Gemma 3 checkpoint with its vision "
          "tower (Gemma3ForConditionalGeneration) under ZeRO-3 on NVMe, the vision tower carried to the export",
          "[finetune][families][gemma]") {
  strata::test::TempDir dir("families-gemma3mm");
  const std::string model = fixture("gemma3mm_tied_bf16");
  const std::string data = one_window(dir, 34, 7);  // text only: below the image placeholders 34, 35, 36
  const std::string config = strata::test::zero3_nvme_config(dir, "ds.json", dir.file("swap"), /*bf16=*/true);
  const std::string out = dir.file("out"), exported = out + "/model";
  const auto run = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                               " --model " + model + " --data " + data + " --data-format u16 --seq 7 --steps 4 --out " +
                               out + " --export " + exported + " 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, Catch::Contains("ZeRO stage 3, params on nvme, optimizer state on nvme") &&
                             Catch::Contains("23 tensors of the vision tower and projector are passed through "
                                             "unchanged: not trained, not used"));
  const auto steps = read_jsonl(out + "/metrics.jsonl");
  REQUIRE(steps.size() == 4);
  for (const auto& s : steps) CHECK(s["nvme_bytes"].get<uint64_t>() > 0);
  CHECK(steps[3]["loss"].get<double>() < steps[0]["loss"].get<double>() - 0.1);
  // config.json: the source's gemma3 config, its text_config the text model's.
  const json src = read_json(model + "/config.json"), cfg = read_json(exported + "/config.json");
  CHECK(cfg["model_type"] == "gemma3");
  CHECK(cfg["architectures"] == json::array({"Gemma3ForConditionalGeneration"}));
  for (const char* key : {"vision_config", "image_token_index", "boi_token_index", "eoi_token_index",
                          "mm_tokens_per_image"}) {
    INFO(key);
    CHECK(cfg[key] == src[key]);
  }
  for (const auto& [key, value] : src["text_config"].items()) {
    INFO("text_config key " << key);
    CHECK(cfg["text_config"][key] == value);
  }
  // The weights: the text model's under the checkpoint's names, the vision
  // tower's and the projector's byte for byte in the last shard.
  const json index = read_json(exported + "/model.safetensors.index.json");
  const strata::nn::DecoderConfig c = strata::nn::parse_decoder_config(cfg);
  REQUIRE(c.multimodal);
  const strata::nn::SafetensorsFile source = strata::nn::SafetensorsFile::open(model + "/model.safetensors");
  size_t vision = 0;
  for (const std::string& name : source.names()) {
    INFO(name);
    REQUIRE(index["weight_map"].contains(name));
    const auto file = strata::nn::SafetensorsFile::open(exported + "/" + index["weight_map"][name].get<std::string>());
    const strata::TensorView theirs = source.view(name), ours = file.view(name);
    CHECK(ours.desc.shape == theirs.desc.shape);
    CHECK(ours.desc.dtype == theirs.desc.dtype);
    if (!strata::nn::is_vision_tensor(name)) continue;
    ++vision;
    CHECK(index["weight_map"][name] == "model-00002-of-00002.safetensors");
    REQUIRE(ours.nbytes() == theirs.nbytes());
    CHECK(std::memcmp(ours.data, theirs.data, ours.nbytes()) == 0);
  }
  CHECK(vision == 23);
  CHECK(index["weight_map"].size() == source.names().size());
  CHECK(index["weight_map"]["language_model.model.norm.weight"] == "model-00001-of-00002.safetensors");
  // A checkpoint of the run holds the text model only: strata export refuses it (the vision tower stayed in the
  // source), naming what to do instead.
  const std::string save = dir.file("save");
  const auto saved = run_command(strata_binary() + " finetune --config " + write_file(dir, "fp32.json", kFp32Config) +
                                 " --model " + model + " --data " + data + " --data-format u16 --seq 7 --steps 1 --out " +
                                 dir.file("out1") + " --save " + save + " 2>&1");
  INFO(saved.output);
  REQUIRE(saved.exit_code == 0);
  const auto exported_ckpt = run_command(strata_binary() + " export " + save + " " + dir.file("ckpt-export") + " 2>&1");
  INFO(exported_ckpt.output);
  CHECK(exported_ckpt.exit_code != 0);
  CHECK_THAT(exported_ckpt.output, Catch::Contains("does not hold the vision tower and projector") &&
                                       Catch::Contains("--resume and --export DIR"));
  CHECK_FALSE(std::filesystem::exists(dir.file("ckpt-export")));
}

TEST_CASE("families: a gemma3 checkpoint in either layout trains its text model, and image placeholders in the data and "
          "LoRA targets PEFT would also put on the vision tower are refused by name",
          "[finetune][families][gemma]") {
  strata::test::TempDir dir("families-gemma3mm-layout");
  const std::string source = fixture("gemma3mm_tied_f32");
  // transformers 5's in-memory names (model.language_model.*, model.vision_tower.*), as some saves keep them.
  const std::string renamed = dir.file("renamed");
  std::filesystem::create_directories(renamed);
  std::filesystem::copy_file(source + "/config.json", renamed + "/config.json");
  {
    const strata::nn::SafetensorsFile in = strata::nn::SafetensorsFile::open(source + "/model.safetensors");
    const auto rename = [](const std::string& name) {
      return name.starts_with("language_model.model.") ? "model.language_model." + name.substr(21) : "model." + name;
    };
    std::vector<strata::nn::SafetensorsDecl> decls;
    for (const std::string& name : in.names()) {
      decls.push_back({rename(name), in.entry(name).dtype, in.entry(name).shape});
    }
    strata::nn::SafetensorsStreamWriter out(renamed + "/model.safetensors", decls);
    for (const std::string& name : in.names()) {
      const strata::TensorView v = in.view(name);
      out.write(rename(name), 0, v.data, v.nbytes());
    }
    out.commit();
  }
  const std::string data = one_window(dir, 34, 7);
  const std::string cfg = write_file(dir, "ds.json", kFp32Config);
  const auto first_loss = [&](const std::string& model, const std::string& out, const std::string& extra) {
    const auto run = run_command(strata_binary() + " finetune --config " + cfg + " --data " + data +
                                 " --data-format u16 --seq 7 --model " + model + " --steps 1 --out " + dir.file(out) +
                                 extra + " 2>&1");
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    return read_jsonl(dir.file(out) + "/metrics.jsonl").at(0)["loss"].get<double>();
  };
  const double published = first_loss(source, "a", "");
  CHECK(first_loss(renamed, "b", "") == published);
  // LoRA on the text model's o_proj and MLP: the adapter under PEFT's names on Gemma3ForConditionalGeneration.
  first_loss(source, "lora", " --lora-rank 2 --lora-alpha 4 --lora-targets o_proj,down_proj --export " +
                                 dir.file("adapter"));
  const strata::nn::SafetensorsFile adapter =
      strata::nn::SafetensorsFile::open(dir.file("adapter") + "/adapter_model.safetensors");
  CHECK(adapter.contains("base_model.model.model.language_model.layers.2.self_attn.o_proj.lora_B.weight"));
  CHECK(adapter.contains("base_model.model.model.language_model.layers.0.mlp.down_proj.lora_A.weight"));
  CHECK(adapter.names().size() == 3 * 2 * 2);
  // q_proj (and the default q_proj,v_proj, and all-linear) would reach the vision tower under PEFT.
  for (const char* targets : {"q_proj,o_proj", "all-linear"}) {
    const auto refused = run_command(strata_binary() + " finetune --config " + cfg + " --data " + data +
                                     " --data-format u16 --seq 7 --model " + source + " --steps 1 --out " +
                                     dir.file("refused") + " --lora-rank 2 --lora-alpha 4 --lora-targets " + targets +
                                     " 2>&1");
    INFO(refused.output);
    CHECK(refused.exit_code != 0);
    CHECK_THAT(refused.output, Catch::Contains("--lora-targets") && Catch::Contains("vision tower") &&
                                   Catch::Contains("o_proj, gate_proj, up_proj and down_proj"));
  }
  // An image placeholder (boi_token_index 34) in the data: refused naming the file and the position.
  const std::string image = dir.file("image.u16");
  {
    std::ofstream out(image, std::ios::binary);
    for (int i = 0; i <= 7; ++i) {
      const auto t = static_cast<uint16_t>(i == 5 ? 34 : i + 1);
      out.write(reinterpret_cast<const char*>(&t), sizeof t);
    }
  }
  const auto placeholder = run_command(strata_binary() + " finetune --config " + cfg + " --data " + image +
                                       " --data-format u16 --seq 7 --model " + source + " --steps 1 --out " +
                                       dir.file("image") + " 2>&1");
  INFO(placeholder.output);
  CHECK(placeholder.exit_code != 0);
  CHECK_THAT(placeholder.output, Catch::Contains(image + ": token 34 at position 5 is the model's image placeholder "
                                                         "(boi_token_index of config.json)"));
}

TEST_CASE("families: DeepSeek's multi-token prediction weights are carried to the export unchanged, with a notice",
          "[finetune][families][deepseek]") {
  strata::test::TempDir dir("families-mtp");
  const std::string source = fixture("deepseek_v3_qlora_f32");
  const json config = read_json(source + "/config.json");
  REQUIRE(config["num_nextn_predict_layers"] == 1);
  // The fixture's weights plus an MTP module's (model.layers.2.*, what
  // DeepSeek ships and transformers ignores) in a shard of its own.
  const std::string model = dir.file("model");
  std::filesystem::create_directories(model);
  std::filesystem::copy_file(source + "/config.json", model + "/config.json");
  std::filesystem::copy_file(source + "/model.safetensors", model + "/model-00001-of-00002.safetensors");
  const std::vector<float> eh(4 * 64, 0.25f), norm(32, 1.5f);
  {
    strata::nn::SafetensorsStreamWriter mtp(model + "/model-00002-of-00002.safetensors",
                                            {{"model.layers.2.eh_proj.weight", strata::DType::kF32, {4, 64}},
                                             {"model.layers.2.enorm.weight", strata::DType::kF32, {32}}});
    mtp.write("model.layers.2.eh_proj.weight", 0, eh.data(), eh.size() * sizeof(float));
    mtp.write("model.layers.2.enorm.weight", 0, norm.data(), norm.size() * sizeof(float));
    mtp.commit();
  }
  json map = json::object();
  for (const std::string& name : strata::nn::SafetensorsFile::open(source + "/model.safetensors").names()) {
    map[name] = "model-00001-of-00002.safetensors";
  }
  map["model.layers.2.eh_proj.weight"] = map["model.layers.2.enorm.weight"] = "model-00002-of-00002.safetensors";
  write_file(dir, "model/model.safetensors.index.json", json{{"metadata", json::object()}, {"weight_map", map}}.dump());
  const std::string data = one_window(dir, 37, 7);
  const std::string cfg = write_file(dir, "ds.json", kFp32Config);
  const auto run = run_command(strata_binary() + " finetune --config " + cfg + " --data " + data +
                               " --data-format u16 --seq 7 --model " + model + " --steps 2 --out " + dir.file("out") +
                               " --export " + dir.file("export") + " --export-dtype fp32 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, Catch::Contains("2 tensors of the multi-token prediction module (model.layers.2.*)") &&
                             Catch::Contains("carried to the export unchanged"));
  // The export: the model's tensors in one shard, the carried ones in the last.
  const json index = read_json(dir.file("export") + "/model.safetensors.index.json");
  CHECK(index["weight_map"]["model.layers.2.enorm.weight"] == "model-00002-of-00002.safetensors");
  CHECK(index["weight_map"]["model.norm.weight"] == "model-00001-of-00002.safetensors");
  const auto carried = strata::nn::SafetensorsFile::open(dir.file("export") + "/model-00002-of-00002.safetensors");
  CHECK(carried.names().size() == 2);
  const auto eh_out = carried.view("model.layers.2.eh_proj.weight");
  REQUIRE(eh_out.numel() == static_cast<int64_t>(eh.size()));
  CHECK(std::memcmp(eh_out.data, eh.data(), eh.size() * sizeof(float)) == 0);
  const auto weights = strata::nn::SafetensorsFile::open(dir.file("export") + "/model-00001-of-00002.safetensors");
  const strata::nn::DecoderConfig c = strata::nn::parse_decoder_config(read_json(dir.file("export") + "/config.json"));
  CHECK(weights.names().size() == strata::nn::hf_tensors(c).size());
  // The export loads again (its MTP shard carried once more).
  const auto again = run_command(strata_binary() + " finetune --config " + cfg + " --data " + data +
                                 " --data-format u16 --seq 7 --model " + dir.file("export") + " --steps 1 --out " +
                                 dir.file("out2") + " 2>&1");
  INFO(again.output);
  CHECK(again.exit_code == 0);
}

TEST_CASE("families: strata finetune refuses another architecture, or a checkpoint that is not config.json's, "
          "before step 1",
          "[finetune][families]") {
  strata::test::TempDir dir("families-refused");
  const std::string data = one_window(dir, 37, 7);
  // A directory with a fixture's weights and an edited config.json.
  auto model_dir = [&](const std::string& name, const std::string& source, auto edit) {
    const std::string out = dir.file(name);
    std::filesystem::create_directories(out);
    json config = read_json(fixture(source) + "/config.json");
    edit(config);
    write_file(dir, name + "/config.json", config.dump());
    std::filesystem::copy_file(fixture(source) + "/model.safetensors", out + "/model.safetensors");
    return out;
  };
  struct Case {
    std::string model, expect;
  };
  const std::vector<Case> cases = {
      {model_dir("gemma", "llama_untied_f32", [](json& c) { c["model_type"] = "gemma"; }),
       "model_type \"gemma\" is not supported"},
      {model_dir("dynamic", "llama_untied_f32",
                 [](json& c) {
                   c["rope_parameters"] = {{"rope_type", "dynamic"}, {"rope_theta", 1e4}, {"factor", 4.0}};
                 }),
       "rope_type \"dynamic\""},
      {model_dir("qwen2_as_llama", "qwen2_untied_f32",
                 [](json& c) {
                   c["model_type"] = "llama";
                   for (const char* k : {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
                     c.erase(k);
                 }),
       "tensor 'model.layers.0.self_attn.k_proj.bias'"},
  };
  for (const Case& c : cases) {
    const std::string out = dir.file("out_" + std::filesystem::path(c.model).filename().string());
    const auto run = run_command(strata_binary() + " finetune --model " + c.model + " --data " + data +
                                 " --data-format u16 --seq 7 --steps 1 --out " + out + " 2>&1");
    INFO(run.output);
    CHECK(run.exit_code != 0);
    CHECK_THAT(run.output, Catch::Contains(c.expect) && !Catch::Contains("failed at"));
    CHECK_FALSE(std::filesystem::exists(out + "/metrics.jsonl"));  // nothing trained
  }
}

TEST_CASE("families: a gpt-oss MXFP4 checkpoint loads to transformers' dequantized experts exactly, computes "
          "transformers' loss on them, and exports fp32 without its quantization_config",
          "[finetune][families][gpt_oss][quant]") {
  strata::test::TempDir dir("families-mxfp4");
  // scripts/make-golden-mxfp4: the experts as "_blocks" + "_scales"; beside
  // them transformers' convert_moe_packed_tensors of each and its loss.
  const std::string model = fixture("mxfp4_gpt_oss");
  const json source = read_json(model + "/config.json");
  REQUIRE(source["quantization_config"]["quant_method"] == "mxfp4");
  const json expected = read_json(model + "/expected.json");
  const int seq = expected["seq"].get<int>();
  const std::string data = one_window(dir, source["vocab_size"].get<int>(), seq);
  // lr 0: the step leaves every weight as loaded, so the export shows what was read.
  const std::string config = write_file(dir, "ds.json", R"({"train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0}}, "zero_optimization": {"stage": 3}})");
  const auto run = run_command(strata_binary() + " finetune --config " + config + " --data " + data +
                               " --data-format u16 --seq " + std::to_string(seq) + " --model " + model +
                               " --steps 1 --out " + dir.file("out") + " --export " + dir.file("export") +
                               " --export-dtype fp32 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  const double loss = read_jsonl(dir.file("out") + "/metrics.jsonl").at(0)["loss"].get<double>();
  CHECK(loss == Approx(expected["loss"].get<double>()).epsilon(1e-5));
  CHECK_FALSE(read_json(dir.file("export") + "/config.json").contains("quantization_config"));
  const auto want = strata::nn::SafetensorsFile::open(model + "/expected.safetensors");
  const auto got = strata::nn::SafetensorsFile::open(dir.file("export") + "/model.safetensors");
  REQUIRE(want.names().size() == 4);
  for (const std::string& name : want.names()) {
    INFO(name);
    REQUIRE(got.contains(name));
    REQUIRE(got.entry(name).shape == want.entry(name).shape);
    // Equal values (an lr 0 AdamW step may turn a -0 into +0, as torch's
    // does: -0 + (+0) is +0); anything else is a wrong dequantization.
    const auto w = want.view(name), g = got.view(name);
    int64_t differ = 0;
    for (int64_t i = 0; i < w.numel(); ++i) differ += w.as<float>()[i] != g.as<float>()[i];
    CHECK(differ == 0);
  }
  // The unquantized tensors come out as they went in.
  const auto source_file = strata::nn::SafetensorsFile::open(model + "/model.safetensors");
  for (const std::string& name : source_file.names()) {
    if (name.ends_with("_blocks") || name.ends_with("_scales")) continue;
    INFO(name);
    REQUIRE(got.contains(name));
    const auto a = source_file.view(name), b = got.view(name);
    REQUIRE(a.numel() == b.numel());
    CHECK(std::memcmp(a.data, b.data, static_cast<size_t>(a.numel()) * sizeof(float)) == 0);
  }
}
