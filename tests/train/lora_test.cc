// LoRA as a user runs it (`strata finetune --lora-rank ...`) on a base
// transformers wrote (the PEFT fixture's, without its adapter): under ZeRO-3
// with the base and the optimizer state on NVMe on 2 ranks only the adapters
// train, the untargeted tensors come out bit-unchanged, the adapter export is
// PEFT's format and, loaded back onto the base, computes the loss the merged
// export computes; a resume is bit-identical and refused on another base.
// (That PEFT loads the export is checked by hand: see the issue's note.)
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "runtime/nn/param_files.h"
#include "runtime/nn/lora.h"
#include "runtime/nn/safetensors.h"
#include "runtime/train/hf_model.h"
#include "runtime/train/peft_adapter.h"
#include "tests/nn/engine_rig.h"
#include "tests/support/finetune_files.h"
#include "tests/support/plan_check.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using nlohmann::json;
using strata::test::run_command;
using strata::test::strata_binary;
using strata::test::write_file;
namespace fs = std::filesystem;
namespace nn = strata::nn;

namespace {

json read_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return json::parse(in);
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The PEFT fixture's base alone (its directory also holds the adapter, which
// strata refuses to ignore): dir/base.
std::string base_model(const strata::test::TempDir& dir) {
  const std::string src = strata::test::source_dir() + "/tests/data/golden/lora_llama_f32_all";
  const std::string out = dir.file("base");
  fs::create_directories(out);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(src + "/" + f, out + "/" + f);
  return out;
}

// 200 tokens of the fixture's vocabulary (61, or `vocab`) as raw uint16.
std::string tokens(const strata::test::TempDir& dir, int vocab = 61) {
  const std::string path = dir.file("tokens.u16");
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 200; ++i) {
    const auto t = static_cast<uint16_t>((i * 17 + i / 7) % vocab);
    out.write(reinterpret_cast<const char*>(&t), sizeof t);
  }
  REQUIRE(out.good());
  return path;
}

const char* const kTargets = "q_proj,v_proj,down_proj";

// The mean loss of `batch` through the model in `model_dir`, with the PEFT
// adapter in `adapter_dir` on top unless it is empty.
double loss_of(const std::string& model_dir, const std::string& adapter_dir, const std::vector<int32_t>& ids) {
  strata::test::Rig rig;
  nn::DecoderModelOptions options;
  if (!adapter_dir.empty()) options.lora = strata::train::read_peft_adapter(adapter_dir).spec;
  nn::DecoderModel model(*rig.engine, nn::load_decoder_config(model_dir + "/config.json"), options);
  rig.engine->finalize();
  std::vector<nn::ParamId> base, adapters;
  for (nn::ParamId id : model.parameters()) {
    (nn::is_lora_parameter(rig.engine->param_info(id).name) ? adapters : base).push_back(id);
  }
  nn::load_parameters(*rig.engine, base, model_dir + "/model.safetensors");
  if (!adapter_dir.empty()) {
    nn::load_parameters(*rig.engine, adapters, adapter_dir + "/adapter_model.safetensors", false,
                        std::string(nn::kPeftPrefix));
  }
  const int64_t seq = static_cast<int64_t>(ids.size()) - 1;
  const std::vector<int32_t> in(ids.begin(), ids.end() - 1), targets(ids.begin() + 1, ids.end());
  nn::ForwardOptions forward;
  forward.backward = false;
  model.forward(in, targets, 1, seq, forward);
  return model.loss();
}

// A --merge-lora export against its base: every targeted weight moved and
// every other tensor is the base's bit for bit; returns how many moved.
int merged_weights_changed(const std::string& base_weights, const std::string& merged_weights,
                           const nn::LoraSpec& spec) {
  const nn::SafetensorsFile before = nn::SafetensorsFile::open(base_weights);
  const nn::SafetensorsFile after = nn::SafetensorsFile::open(merged_weights);
  REQUIRE(after.names().size() == before.names().size());
  int changed = 0;
  for (const std::string& name : before.names()) {
    INFO(name);
    const strata::TensorView x = before.view(name), y = after.view(name);
    REQUIRE(x.nbytes() == y.nbytes());
    const bool same = std::memcmp(x.data, y.data, x.nbytes()) == 0;
    const bool targeted = name.ends_with(".weight") && spec.targets_module(name.substr(0, name.size() - 7));
    CHECK(same == !targeted);
    changed += !same;
  }
  return changed;
}

}  // namespace

TEST_CASE("LoRA: strata run -n 2 under ZeRO-3 with the base and optimizer on NVMe trains the adapters only, the "
          "adapter export is PEFT's format and computes the merged export's loss, untargeted tensors are unchanged",
          "[finetune][lora]") {
  strata::test::TempDir dir("lora");
  const std::string base = base_model(dir), data = tokens(dir), swap = dir.file("swap");
  const std::string config = strata::test::zero3_nvme_config(dir, "ds.json", swap);
  const std::string common = strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                             " --model " + base + " --data " + data + " --data-format u16 --seq 8 --steps 5 " +
                             "--lora-rank 4 --lora-alpha 8 --lora-targets " + kTargets + " --export-dtype fp32";
  const auto adapter_run = run_command(common + " --out " + dir.file("a") + " --save " + dir.file("ckpt") +
                                       " --export " + dir.file("adapter") + " 2>&1");
  INFO(adapter_run.output);
  REQUIRE(adapter_run.exit_code == 0);
  CHECK_THAT(adapter_run.output, Catch::Contains("ZeRO stage 3, params on nvme, optimizer state on nvme") &&
                                     Catch::Contains("LoRA r=4 alpha=8 (scale 2) on q_proj,v_proj,down_proj") &&
                                     Catch::Contains("12 adapter tensors"));
  const auto merged_run =
      run_command(common + " --out " + dir.file("m") + " --merge-lora --export " + dir.file("merged") + " 2>&1");
  INFO(merged_run.output);
  REQUIRE(merged_run.exit_code == 0);

  // The base alone on NVMe, the optimizer on the accelerator (offload_optimizer
  // absent): the adapters stay resident with their optimizer state, the same
  // update bit for bit. Without LoRA the same config is refused.
  const std::string resident =
      strata::test::zero3_nvme_config(dir, "ds_resident.json", swap, false, /*optimizer_on_nvme=*/false);
  const std::string resident_args = strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " +
                                    resident + " --model " + base + " --data " + data +
                                    " --data-format u16 --seq 8 --steps 5 --out " + dir.file("r");
  const auto resident_run = run_command(resident_args + " --lora-rank 4 --lora-alpha 8 --lora-targets " + kTargets +
                                        " --export " + dir.file("adapter_resident") + " 2>&1");
  INFO(resident_run.output);
  REQUIRE(resident_run.exit_code == 0);
  CHECK_THAT(resident_run.output, Catch::Contains("params on nvme, optimizer state on device"));
  CHECK(file_bytes(dir.file("adapter_resident") + "/adapter_model.safetensors") ==
        file_bytes(dir.file("adapter") + "/adapter_model.safetensors"));
  const auto full = run_command(resident_args + " 2>&1");
  CHECK(full.exit_code != 0);
  CHECK_THAT(full.output, Catch::Contains("or freeze the parameters to offload"));

  // PEFT's files: the config PEFT's LoraConfig reads, fp32 tensors under its names.
  const json adapter = read_json(dir.file("adapter") + "/adapter_config.json");
  CHECK(adapter["peft_type"] == "LORA");
  CHECK(adapter["task_type"] == "CAUSAL_LM");
  CHECK(adapter["r"] == 4);
  CHECK(adapter["lora_alpha"] == 8);
  CHECK(adapter["use_rslora"] == false);
  CHECK(adapter["base_model_name_or_path"] == base);
  CHECK(adapter["target_modules"].get<std::set<std::string>>() ==
        std::set<std::string>{"q_proj", "v_proj", "down_proj"});
  const nn::SafetensorsFile weights = nn::SafetensorsFile::open(dir.file("adapter") + "/adapter_model.safetensors");
  const nn::DecoderConfig c = nn::load_decoder_config(base + "/config.json");
  CHECK(weights.names().size() == static_cast<size_t>(c.num_hidden_layers) * 3 * 2);
  const auto& a = weights.entry("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight");
  CHECK(a.shape == strata::Shape{4, c.intermediate_size});
  CHECK(a.dtype == strata::DType::kF32);
  CHECK(weights.entry("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight").shape ==
        strata::Shape{c.num_attention_heads * c.head_dim, 4});

  // The checkpoints hold the adapters and their optimizer state, not the base.
  for (const auto& entry : fs::recursive_directory_iterator(dir.file("ckpt"))) {
    INFO(entry.path().string());
    CHECK(entry.path().filename().string().find("frozen") == std::string::npos);
  }

  // Merged: the targeted weights moved, every other tensor is the base's, bit for bit.
  const nn::SafetensorsFile before = nn::SafetensorsFile::open(base + "/model.safetensors");
  const nn::SafetensorsFile after = nn::SafetensorsFile::open(dir.file("merged") + "/model.safetensors");
  const nn::LoraSpec spec{4, 8, false, {"q_proj", "v_proj", "down_proj"}};
  CHECK(merged_weights_changed(base + "/model.safetensors", dir.file("merged") + "/model.safetensors", spec) ==
        c.num_hidden_layers * 3);
  // And each targeted weight is the base's W + s B A of the exported adapter
  // (to fp32 rounding): the frozen W itself did not move in training.
  for (const std::string& name : before.names()) {
    const std::string stem = name.substr(0, name.size() - 7);
    if (!name.ends_with(".weight") || !spec.targets_module(stem)) continue;
    INFO(name);
    const std::string peft = std::string(nn::kPeftPrefix) + stem;
    const auto* w = before.view(name).as<const float>();
    const auto* m = after.view(name).as<const float>();
    const auto* la = weights.view(peft + ".lora_A.weight").as<const float>();
    const auto* lb = weights.view(peft + ".lora_B.weight").as<const float>();
    const int64_t out = before.entry(name).shape[0], in = before.entry(name).shape[1];
    double worst = 0, largest = 0;
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        double delta = 0;
        for (int64_t k = 0; k < 4; ++k) delta += static_cast<double>(lb[o * 4 + k]) * la[k * in + i];
        const double want = w[o * in + i] + spec.scaling() * delta;
        worst = std::max(worst, std::abs(m[o * in + i] - want));
        largest = std::max(largest, std::abs(want));
      }
    }
    CHECK(worst <= 1e-6 * largest);
  }

  // Base + adapter computes what the merged model computes; both differ from the base.
  std::vector<int32_t> ids;
  for (int i = 0; i < 17; ++i) ids.push_back((i * 29 + 5) % 61);
  const double adapted = loss_of(base, dir.file("adapter"), ids), merged = loss_of(dir.file("merged"), "", ids);
  const double plain = loss_of(base, "", ids);
  INFO("base " << plain << ", base + adapter " << adapted << ", merged " << merged);
  CHECK(std::abs(adapted - merged) <= 1e-5 * adapted);
  CHECK(std::abs(adapted - plain) > 1e-3 * plain);
}

TEST_CASE("LoRA: a resumed run is bit-identical, and resuming on another base, with other LoRA flags or exporting "
          "its checkpoint is refused",
          "[finetune][lora][checkpoint]") {
  strata::test::TempDir dir("lora-resume");
  const std::string base = base_model(dir), data = tokens(dir);
  const std::string common = strata_binary() + " finetune --model " + base + " --data " + data +
                             " --data-format u16 --seq 8 --lora-rank 2 --lora-rslora --lora-targets all-linear " +
                             "--lora-dropout 0.2 --lr 0.01 --save-every 2";
  const auto whole = run_command(common + " --steps 6 --out " + dir.file("w") + " --save " + dir.file("ck_whole") +
                                 " --export " + dir.file("whole") + " 2>&1");
  INFO(whole.output);
  REQUIRE(whole.exit_code == 0);
  const auto first = run_command(common + " --steps 3 --out " + dir.file("f") + " --save " + dir.file("ck") + " 2>&1");
  INFO(first.output);
  REQUIRE(first.exit_code == 0);
  const auto rest = run_command(common + " --steps 6 --out " + dir.file("r") + " --save " + dir.file("ck") +
                                " --resume --export " + dir.file("resumed") + " 2>&1");
  INFO(rest.output);
  REQUIRE(rest.exit_code == 0);
  CHECK(file_bytes(dir.file("resumed") + "/adapter_model.safetensors") ==
        file_bytes(dir.file("whole") + "/adapter_model.safetensors"));
  CHECK(read_json(dir.file("whole") + "/adapter_config.json")["lora_dropout"] == 0.2);
  // Dropout changes the training: the same run without it ends elsewhere.
  const auto plain = run_command(strata_binary() + " finetune --model " + base + " --data " + data +
                                 " --data-format u16 --seq 8 --lora-rank 2 --lora-rslora --lora-targets all-linear "
                                 "--lr 0.01 --steps 6 --out " + dir.file("p") + " --export " + dir.file("plain") +
                                 " 2>&1");
  REQUIRE(plain.exit_code == 0);
  CHECK(file_bytes(dir.file("plain") + "/adapter_model.safetensors") !=
        file_bytes(dir.file("whole") + "/adapter_model.safetensors"));

  // Other LoRA flags, another base (one byte of the weights changed).
  auto refused = [&](const std::string& args, const std::string& expect) {
    const auto r = run_command(args + " 2>&1");
    INFO(args << "\n" << r.output);
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.output, Catch::Contains(expect));
  };
  refused(strata_binary() + " finetune --model " + base + " --data " + data +
              " --data-format u16 --seq 8 --lora-rank 4 --lora-rslora --lora-targets all-linear --lora-dropout 0.2 "
              "--steps 8 --out " +
              dir.file("x") + " --save " + dir.file("ck") + " --resume",
          "lora.r is 2 in the checkpoint, 4 in this run");
  const std::string other = dir.file("other");
  fs::copy(base, other);
  {
    std::fstream f(other + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x11');
  }
  refused(strata_binary() + " finetune --model " + other + " --data " + data +
              " --data-format u16 --seq 8 --lora-rank 2 --lora-rslora --lora-targets all-linear --lora-dropout 0.2 "
              "--steps 8 --out " +
              dir.file("y") + " --save " + dir.file("ck") + " --resume",
          "base_weights");
  refused(strata_binary() + " export " + dir.file("ck") + " " + dir.file("z"), "a checkpoint of a LoRA run");
}

TEST_CASE("LoRA: bad flags and a model directory holding an adapter are refused before step 1, naming them",
          "[finetune][lora]") {
  strata::test::TempDir dir("lora-refused");
  const std::string base = base_model(dir), data = tokens(dir);
  const std::string common =
      strata_binary() + " finetune --model " + base + " --data " + data + " --data-format u16 --seq 8 --steps 2 --out " +
      dir.file("out") + " ";
  struct Case {
    std::string args, expect;
  };
  const std::string fixture = strata::test::source_dir() + "/tests/data/golden/lora_llama_f32_all";
  const std::vector<Case> cases = {
      {"--lora-rank 4 --lora-dropout 1", "--lora-dropout must be in [0, 1), got 1"},
      {"--lora-rank 4 --lora-targets q_proj,lm_head", "--lora-targets: 'lm_head' is not a projection"},
      {"--lora-rank 4 --lora-targets q_proj,,v_proj", "has an empty name"},
      {"--lora-rank 4 --lora-targets q_proj,q_proj", "names 'q_proj' twice"},
      {"--lora-alpha 16", "--lora-alpha needs --lora-rank"},
      {"--lora-rank 4 --merge-lora", "--merge-lora needs --lora-rank (adapters to merge) and --export DIR"},
      {"--lora-rank 4 --freeze '*norm*'", "--freeze with --lora-rank"},
      {"--lora-rank 0", "--lora-rank"},
  };
  for (const Case& c : cases) {
    const auto r = run_command(common + c.args + " 2>&1");
    INFO(c.args << "\n" << r.output);
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.output, Catch::Contains(c.expect));
    CHECK_THAT(r.output, !Catch::Contains("step 1/"));
  }
  const auto r = run_command(strata_binary() + " finetune --model " + fixture + " --data " + data +
                             " --data-format u16 --seq 8 --steps 2 --out " + dir.file("out2") + " 2>&1");
  INFO(r.output);
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.output, Catch::Contains("holds adapter_config.json, a PEFT adapter"));
}

TEST_CASE("LoRA: --lora-init starts from a PEFT adapter and refuses what plain LoRA does not compute",
          "[finetune][lora]") {
  strata::test::TempDir dir("lora-init");
  const std::string base = base_model(dir), data = tokens(dir);
  const std::string fixture = strata::test::source_dir() + "/tests/data/golden/lora_llama_f32_all";
  const std::string common = strata_binary() + " finetune --model " + base + " --data " + data +
                             " --data-format u16 --seq 8 --steps 2 --weight-decay 0 ";
  // At learning rate 0 the adapter comes out as it went in: PEFT's settings and every value.
  const auto r = run_command(common + "--lr 0 --lora-init " + fixture + " --out " + dir.file("o") + " --export " +
                             dir.file("same") + " 2>&1");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.output, Catch::Contains("LoRA r=4 alpha=8 (scale 2)"));
  const json in_config = read_json(fixture + "/adapter_config.json"), out_config = read_json(dir.file("same") + "/adapter_config.json");
  for (const char* key : {"r", "lora_alpha", "use_rslora", "lora_dropout"}) CHECK(out_config[key] == in_config[key]);
  CHECK(out_config["target_modules"].get<std::set<std::string>>() ==
        in_config["target_modules"].get<std::set<std::string>>());
  const nn::SafetensorsFile a = nn::SafetensorsFile::open(fixture + "/adapter_model.safetensors");
  const nn::SafetensorsFile b = nn::SafetensorsFile::open(dir.file("same") + "/adapter_model.safetensors");
  REQUIRE(a.names().size() == b.names().size());
  for (const std::string& name : a.names()) {
    INFO(name);
    REQUIRE(b.contains(name));
    const strata::TensorView x = a.view(name), y = b.view(name);
    REQUIRE(x.nbytes() == y.nbytes());
    CHECK(std::memcmp(x.data, y.data, x.nbytes()) == 0);
  }
  // What plain LoRA does not compute, and flags the adapter sets, are refused by name.
  auto edited = [&](const std::string& name, const std::string& key, const json& value) {
    const std::string out = dir.file(name);
    fs::create_directories(out);
    json c = in_config;
    c[key] = value;
    write_file(dir, name + "/adapter_config.json", c.dump());
    fs::copy_file(fixture + "/adapter_model.safetensors", out + "/adapter_model.safetensors");
    return out;
  };
  struct Case {
    std::string args, expect;
  };
  const std::vector<Case> cases = {
      {"--lora-init " + edited("dora", "use_dora", true), "key 'use_dora' is true"},
      {"--lora-init " + edited("pattern", "rank_pattern", {{"q_proj", 8}}), "key 'rank_pattern'"},
      {"--lora-init " + edited("saved", "modules_to_save", {"lm_head"}), "key 'modules_to_save'"},
      {"--lora-init " + edited("bias", "bias", "all"), "bias is \"all\""},
      {"--lora-init " + edited("bias_number", "bias", 3), "bias must be a string, got 3"},
      {"--lora-init " + edited("rank_text", "r", "4"), "r must be a whole number, got \"4\""},
      {"--lora-init " + edited("rslora_text", "use_rslora", "yes"), "use_rslora, lora_dropout or target_modules"},
      {"--lora-init " + edited("prefix", "peft_type", "PREFIX_TUNING"), "peft_type is \"PREFIX_TUNING\""},
      {"--lora-init " + edited("rank8", "r", 8), "has shape"},
      {"--lora-init " + fixture + " --lora-rank 4", "--lora-rank with --lora-init"},
      {"--lora-init " + dir.file("nowhere"), "no adapter_config.json there"},
  };
  for (const Case& c : cases) {
    const auto run = run_command(common + c.args + " --out " + dir.file("x") + " 2>&1");
    INFO(c.args << "\n" << run.output);
    CHECK(run.exit_code != 0);
    CHECK_THAT(run.output, Catch::Contains(c.expect));
    CHECK_THAT(run.output, !Catch::Contains("step 1/"));
  }
}


TEST_CASE("LoRA targets on mixtures of experts are PEFT's: the attention's projections, while all-linear and the MLP "
          "names, which PEFT applies to the fused experts, and projections a model lacks are refused by name",
          "[lora][moe]") {
  const auto config = [](const std::string& fixture) {
    return nn::load_decoder_config(strata::test::source_dir() + "/tests/data/golden/" + fixture + "/config.json");
  };
  const auto resolved = [&](const std::string& fixture, const std::string& targets) {
    nn::LoraSpec spec{4, 8, false, nn::parse_lora_targets(targets)};
    spec.validate();
    nn::resolve_lora_targets(spec, config(fixture));
    return spec.targets;
  };
  using Names = std::vector<std::string>;
  CHECK(resolved("lora_llama_f32_all", "all-linear") ==
        Names{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"});
  // gpt-oss: its experts are fused parameters and its router no nn.Linear, so
  // PEFT's all-linear is the attention.
  CHECK(resolved("gpt_oss_untied_f32", "all-linear") == Names{"q_proj", "k_proj", "v_proj", "o_proj"});
  CHECK(resolved("deepseek_v3_qlora_f32", "kv_b_proj,q_a_proj") == Names{"kv_b_proj", "q_a_proj"});
  CHECK(resolved("deepseek_v3_qproj_f32", "q_proj,o_proj") == Names{"q_proj", "o_proj"});
  CHECK(resolved("glm4_moe_f32", "q_proj,v_proj") == Names{"q_proj", "v_proj"});
  struct Case {
    std::string fixture, targets, expect;
  };
  const std::vector<Case> refused = {
      {"qwen3_moe_untied_f32", "all-linear",
       "--lora-targets all-linear on model_type qwen3_moe: PEFT (on transformers 5, which fuses the experts) makes "
       "all-linear reach the routed experts"},
      {"deepseek_v3_qlora_f32", "all-linear", "name the projections instead (q_a_proj,q_b_proj,kv_a_proj_with_mqa,"},
      {"deepseek_v3_qlora_f32", "q_a_proj,gate_proj",
       "--lora-targets gate_proj on model_type deepseek_v3: PEFT (on transformers 5, which fuses the experts) applies "
       "gate_proj, up_proj and down_proj to the routed experts' fused gate_up_proj and down_proj (target_parameters), "
       "never to the dense layers' MLPs or the shared experts"},
      {"glm4_moe_f32", "down_proj", "--lora-targets down_proj on model_type glm4_moe: PEFT"},
      {"mixtral_untied_f32", "all-linear", "--lora-targets all-linear on model_type mixtral: PEFT"},
      {"mixtral_untied_f32", "up_proj", "--lora-targets up_proj on model_type mixtral: every MLP of the model is the "
                                        "routed experts'"},
      {"qwen2_moe_untied_f32", "gate_proj", "never to the dense layers' MLPs or the shared experts"},
      {"gpt_oss_untied_f32", "down_proj", "every MLP of the model is the routed experts'"},
      {"qwen3_moe_untied_f32", "q_a_proj",
       "'q_a_proj' is not a projection of model_type qwen3_moe (its projections: q_proj,k_proj,v_proj,o_proj)"},
      {"deepseek_v3_qlora_f32", "q_proj", "'q_proj' is not a projection of model_type deepseek_v3"},
      {"deepseek_v3_qproj_f32", "q_b_proj", "'q_b_proj' is not a projection of model_type deepseek_v3"},
      {"lora_llama_f32_all", "kv_b_proj", "'kv_b_proj' is not a projection of model_type llama"},
  };
  for (const Case& c : refused) {
    INFO(c.fixture << ": --lora-targets " << c.targets);
    CHECK_THROWS_WITH(resolved(c.fixture, c.targets), Catch::Contains(c.expect));
  }
}

TEST_CASE("LoRA on a mixture of experts: strata run -n 2 with expert parallelism and ZeRO-3 on NVMe trains "
          "DeepSeek-V3's latent-attention adapters with the experts, shared experts and routers frozen, and the adapter "
          "export and the merged export compute the same loss",
          "[finetune][lora][moe]") {
  strata::test::TempDir dir("lora-moe");
  const std::string base = strata::test::source_dir() + "/tests/data/golden/deepseek_v3_qlora_f32";
  const nn::DecoderConfig c = nn::load_decoder_config(base + "/config.json");
  const std::string data = tokens(dir, static_cast<int>(c.vocab_size)), swap = dir.file("swap");
  const std::string config = strata::test::zero3_nvme_config(dir, "ds.json", swap);
  const std::string targets = "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj";
  const std::string common = strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                             " --model " + base + " --data " + data + " --data-format u16 --seq 8 --steps 3 " +
                             "--lora-rank 4 --lora-alpha 8 --lora-targets " + targets + " --export-dtype fp32";
  const auto adapter_run = run_command(common + " --out " + dir.file("a") + " --export " + dir.file("adapter") + " 2>&1");
  INFO(adapter_run.output);
  REQUIRE(adapter_run.exit_code == 0);
  CHECK_THAT(adapter_run.output, Catch::Contains("ZeRO stage 3, params on nvme, optimizer state on nvme") &&
                                     Catch::Contains("expert parallelism: 2 ranks split the 8 experts") &&
                                     Catch::Contains("LoRA r=4 alpha=8 (scale 2) on " + targets) &&
                                     Catch::Contains("20 adapter tensors"));
  const auto merged_run =
      run_command(common + " --out " + dir.file("m") + " --merge-lora --export " + dir.file("merged") + " 2>&1");
  INFO(merged_run.output);
  REQUIRE(merged_run.exit_code == 0);

  const json adapter = read_json(dir.file("adapter") + "/adapter_config.json");
  CHECK(adapter["target_modules"].get<std::set<std::string>>() ==
        std::set<std::string>{"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"});
  const nn::SafetensorsFile weights = nn::SafetensorsFile::open(dir.file("adapter") + "/adapter_model.safetensors");
  CHECK(weights.names().size() == static_cast<size_t>(c.num_hidden_layers) * 5 * 2);
  CHECK(weights.entry("base_model.model.model.layers.1.self_attn.kv_b_proj.lora_A.weight").shape ==
        strata::Shape{4, c.kv_lora_rank});

  // The merge moved exactly the targeted weights; the experts, the shared
  // experts, the routers, their correction biases and the rest are the base's, bit for bit.
  const nn::LoraSpec spec{4, 8, false, {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}};
  CHECK(merged_weights_changed(base + "/model.safetensors", dir.file("merged") + "/model.safetensors", spec) ==
        c.num_hidden_layers * 5);

  std::vector<int32_t> ids;
  for (int i = 0; i < 17; ++i) ids.push_back(static_cast<int32_t>((i * 29 + 5) % c.vocab_size));
  const double adapted = loss_of(base, dir.file("adapter"), ids), merged = loss_of(dir.file("merged"), "", ids);
  const double plain = loss_of(base, "", ids);
  INFO("base " << plain << ", base + adapter " << adapted << ", merged " << merged);
  CHECK(std::abs(adapted - merged) <= 1e-5 * adapted);
  CHECK(std::abs(adapted - plain) > 1e-3 * plain);
}

namespace {

// A LoRA run on a quantized checkpoint (`fixture`, under tests/data/golden:
// FP8 or MXFP4, `format`) and on its dequantized twin (the reader's values,
// transformers' dequantization as tests/nn/nn_quant_test.cc checks, stored
// bf16 without the quantization_config), `ranks` ranks, ZeRO-3 with the base
// and optimizer on NVMe: every step's loss bit for bit the twin's, the log
// stating the kept weights' bytes against bf16's (`ratio`, as "(0.50x)").
// Returns the quantized run's log, the swap directories and the quantized
// element count.
struct QuantRuns {
  std::string kept_log;
  fs::path kept_swap, twin_swap;
  int64_t quantized_numel = 0;
};
QuantRuns check_quantized_base_kept(const strata::test::TempDir& dir, const std::string& fixture,
                                    const std::string& format, const std::string& ratio, int ranks, int vocab,
                                    const std::string& targets) {
  const std::string fp8 = strata::test::source_dir() + "/tests/data/golden/" + fixture;
  const std::string twin = dir.file("bf16");
  fs::create_directories(twin);
  json twin_config = read_json(fp8 + "/config.json");
  REQUIRE(twin_config.contains("quantization_config"));
  twin_config.erase("quantization_config");
  write_file(dir, "bf16/config.json", twin_config.dump(2));
  QuantRuns runs;
  {
    strata::test::Rig rig;
    nn::DecoderModelOptions options;
    options.dtype = strata::DType::kBF16;
    const nn::DecoderConfig c = strata::train::load_hf_config(fp8);
    nn::DecoderModel model(*rig.engine, c, options);
    rig.engine->finalize();
    strata::train::load_hf_weights(*rig.engine, model.parameters(), fp8, {}, c.quant);
    nn::save_parameters(*rig.engine, model.parameters(), twin + "/model.safetensors");
    for (const fs::path& shard : fs::directory_iterator(fp8)) {
      if (shard.extension() != ".safetensors") continue;
      const nn::SafetensorsFile stored = nn::SafetensorsFile::open(shard.string());
      for (const std::string& name : stored.names()) {
        if (stored.entry(name).dtype == strata::DType::kF8E4M3) runs.quantized_numel += stored.view(name).numel();
        if (name.ends_with("_blocks")) runs.quantized_numel += 2 * stored.view(name).numel();  // MXFP4: two per byte
      }
    }
  }
  const std::string data = tokens(dir, vocab);
  const std::string launch =
      ranks > 1 ? strata_binary() + " run -n " + std::to_string(ranks) + " -- " + strata_binary() : strata_binary();
  const auto run = [&](const std::string& model, const std::string& name) {
    const std::string swap = dir.file(name + "_swap");
    const std::string config = write_file(dir, name + ".json", R"({
      "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "bf16": {"enabled": true},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
      "zero_optimization": {"stage": 3, "sub_group_size": 1000, "reduce_bucket_size": 1000,
        "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("},
        "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("}},
      "strata": {"keep_swap_files": true}})");
    const auto result = run_command(launch + " finetune --config " + config + " --model " + model + " --data " +
                                    data + " --data-format u16 --seq 8 --steps 4 --lora-rank 4 --lora-alpha 8 " +
                                    "--lora-targets " + targets + " --out " + dir.file(name + "_out") + " 2>&1");
    INFO(result.output);
    REQUIRE(result.exit_code == 0);
    std::vector<double> losses;
    std::ifstream in(dir.file(name + "_out") + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) losses.push_back(json::parse(line)["loss"].get<double>());
    }
    return std::make_pair(result.output, losses);
  };
  const auto [kept_log, kept] = run(fp8, "quantized");
  const auto [twin_log, dequantized] = run(twin, "bf16");
  CHECK_THAT(kept_log, Catch::Contains("in " + format + " on nvme") && Catch::Contains("(" + ratio + "x)"));
  CHECK_THAT(twin_log, !Catch::Contains(format));
  REQUIRE(kept.size() == 4);
  CHECK(kept == dequantized);  // the same dequantized values, every step's loss bit for bit
  CHECK(std::isfinite(kept.front()));
  runs.kept_log = kept_log;
  runs.kept_swap = dir.file("quantized_swap") + "/param";
  runs.twin_swap = dir.file("bf16_swap") + "/param";
  return runs;
}

int64_t file_size_of(const fs::path& p) {
  REQUIRE(fs::exists(p));
  return static_cast<int64_t>(fs::file_size(p));
}

// Rank 0's swap files of the kept run's base: its quantized home `kept_file`
// and the rest of its base (bf16), beside the bf16 twin's whole base, in bytes.
struct BaseFiles {
  int64_t kept = 0, rest = 0, twin_bf16 = 0;
};
BaseFiles base_files(const QuantRuns& runs, const std::string& kept_file) {
  const fs::path kept = runs.kept_swap / "rank0", twin = runs.twin_swap / "rank0";
  return {file_size_of(kept / kept_file), file_size_of(kept / "bf16_frozen.swp"),
          file_size_of(twin / "bf16_frozen.swp")};
}

}  // namespace

TEST_CASE("LoRA on an FP8 checkpoint keeps the base in FP8 on NVMe, its swap file half of bf16's, and trains to the "
          "dequantized base's losses bit for bit",
          "[finetune][lora][quant]") {
  strata::test::TempDir dir("lora-fp8");
  const QuantRuns runs = check_quantized_base_kept(dir, "fp8_llama", "FP8", "0.50", 1, 61, "q_proj,v_proj,down_proj");
  REQUIRE(runs.quantized_numel == 2 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 192 * 128));
  CHECK_THAT(runs.kept_log, Catch::Contains("the frozen base keeps 14 FP8 weights in FP8 on nvme"));
  // On disk: a byte per element of the FP8 weights, where the twin's bf16 home holds two.
  const BaseFiles files = base_files(runs, "fp8_e4m3_frozen.swp");
  INFO("FP8 home " << files.kept << " bytes, the rest of the base " << files.rest << ", the twin's bf16 base "
                   << files.twin_bf16);
  CHECK(files.kept == runs.quantized_numel);
  CHECK(files.twin_bf16 - files.rest == 2 * files.kept);
  // strata plan --check models each run as it held its base: the FP8 weights
  // a group of e4m3 bytes at home with their scale grids, the twin's in bf16;
  // the swap files exactly.
  for (const std::string name : {"quantized", "bf16"}) {  // check_quantized_base_kept's two runs
    CAPTURE(name);
    const auto check = run_command(strata_binary() + " plan --check " + dir.file(name + "_out") + " --json");
    INFO(check.output);
    const json j = json::parse(check.output);
    strata::test::check_tier_exact(j, "nvme");
    bool grids = false;
    for (const auto& item : j["items"]) grids |= item["name"] == "FP8 scale grids";
    CHECK(grids == (name == "quantized"));
  }
}

TEST_CASE("strata run -n 2: LoRA on a DeepSeek-V3 FP8 checkpoint (ragged blocks) with its experts split over the "
          "ranks keeps the base and the experts in FP8 on NVMe and trains to the dequantized base's losses bit for bit",
          "[finetune][lora][quant][moe]") {
  strata::test::TempDir dir("lora-fp8-moe");
  const QuantRuns runs = check_quantized_base_kept(dir, "fp8_deepseek_v3", "FP8", "0.50", 2, 32,
                                                  "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj");
  CHECK_THAT(runs.kept_log, Catch::Contains("the frozen base keeps 22 FP8 weights in FP8 on nvme") &&
                                Catch::Contains("expert parallelism: 2 ranks split the 2 experts"));
  for (const char* rank : {"rank0", "rank1"}) {
    // Each rank's share of the FP8 weights, the routed experts' own file beside them.
    CHECK(file_size_of(runs.kept_swap / rank / "fp8_e4m3_frozen.swp") > 0);
    CHECK(file_size_of(runs.kept_swap / rank / "fp8_e4m3_frozen_experts.swp") > 0);
    CHECK_FALSE(fs::exists(runs.kept_swap / rank / "bf16_frozen_experts.swp"));
  }
}

TEST_CASE("LoRA on gpt-oss's MXFP4 checkpoint keeps the experts in their 4-bit form on NVMe and trains to the "
          "dequantized base's losses bit for bit",
          "[finetune][lora][quant][gpt_oss]") {
  strata::test::TempDir dir("lora-mxfp4");
  // 2 layers x 4 experts x gate, up [32, 64] and down [64, 32]: 24 weights
  // at 4.25 bits, 0.27x bf16's bytes.
  const QuantRuns runs = check_quantized_base_kept(dir, "mxfp4_gpt_oss", "MXFP4", "0.27", 1, 64, "q_proj,v_proj");
  REQUIRE(runs.quantized_numel == 2 * (4 * 64 * 64 + 4 * 32 * 64));
  CHECK_THAT(runs.kept_log, Catch::Contains("the frozen base keeps 24 MXFP4 weights in MXFP4 on nvme"));
  // On disk: each expert weight's kept form (2048 elements: 1088 bytes) in
  // its own slice, padded to a 4 KiB page as its bf16 twin's 4096 bytes are:
  // on this tiny model the pages hide the 17/64 (zero_mxfp4_test shows it).
  const BaseFiles files = base_files(runs, "mxfp4_frozen.swp");
  INFO("MXFP4 home " << files.kept << " bytes, the rest of the base " << files.rest << ", the twin's bf16 base "
                     << files.twin_bf16);
  CHECK(files.kept == 24 * 4096);
  CHECK(files.twin_bf16 - files.rest == 2 * runs.quantized_numel);
}
