// strata.micro_batch_order layer-major (docs/DESIGN.md §5.5) as a user runs
// it: two real ranks under `strata run`, against step-major on the same
// micro-batches. The parameters after every step must be the same bits: the
// exports compared byte for byte and every step's loss and gradient norm
// exactly, across ZeRO stages and tiers, with clipping firing and not, and
// after kill -9 and resume.
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "runtime/nn/decoder_config.h"
#include "runtime/plan/runtime_memory.h"
#include "runtime/train/micro_batch_order.h"
#include "tests/support/finetune_files.h"
#include "tests/support/killed_runs.h"
#include "tests/support/plan_check.h"
#include "tests/support/jsonl.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using strata::test::file_bytes;
using strata::test::kFinetuneExamples;
using strata::test::read_jsonl;
using strata::test::run_command;
using strata::test::strata_binary;
using strata::test::write_file;

namespace {

// Three layers, untied (layer-major refuses tied embeddings), initialised
// with a large scale so every piece of math moves the loss.
std::string three_layers(const strata::test::TempDir& dir) {
  return write_file(dir, "three.json", R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})");
}

// A ds_config of 3 micro-batches of 2 sequences per rank: `zero` is the
// zero_optimization block's body, `clip` the gradient_clipping.
std::string config(const strata::test::TempDir& dir, const std::string& name, const std::string& zero, double clip) {
  return write_file(dir, name + ".json", R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "gradient_clipping": )" +
                                             std::to_string(clip) + R"(,
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-3}},
    "zero_optimization": {)" + zero + "}}");
}

// One ZeRO configuration of a test's matrix: the zero_optimization body and
// the gradient_clipping (0.05 fires on every step of this model, whose
// gradient norm is several times that; 0 turns it off).
struct ZeroCase {
  std::string name, zero;
  double clip;
};

// Parameters and optimizer state on NVMe under `swap`: zero_optimization's offload keys.
std::string nvme_tiers(const std::string& swap) {
  return R"("offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("})";
}

struct Run {
  std::string output, exported;
  std::vector<nlohmann::json> steps;
};

Run finetune(const strata::test::TempDir& dir, const std::string& name, const std::string& ds,
             const std::string& order, int steps, const std::string& extra = "") {
  const std::string out = dir.file(name);
  const auto r = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + ds +
                             " --init " + dir.file("three.json") + " --data " + kFinetuneExamples +
                             "/data/gpl-3.0.txt --data-format text --seq 16 --steps " + std::to_string(steps) +
                             (order.empty() ? "" : " --micro-batch-order " + order) + " --out " + out + " --export " + out +
                             "_model --export-dtype fp32" + extra + " 2>&1");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  return {r.output, file_bytes(out + "_model/model.safetensors"), read_jsonl(out + "/metrics.jsonl")};
}

void check_same(const Run& layer, const Run& step, int steps) {
  REQUIRE(layer.steps.size() == static_cast<size_t>(steps));
  REQUIRE(step.steps.size() == static_cast<size_t>(steps));
  for (int i = 0; i < steps; ++i) {
    CAPTURE(i);
    CHECK(layer.steps[i]["loss"] == step.steps[i]["loss"]);
    CHECK(layer.steps[i]["grad_norm"] == step.steps[i]["grad_norm"]);
    // An evaluation runs forward only through the same chunks, layer by layer.
    REQUIRE(layer.steps[i].contains("eval_loss") == step.steps[i].contains("eval_loss"));
    if (step.steps[i].contains("eval_loss")) CHECK(layer.steps[i]["eval_loss"] == step.steps[i]["eval_loss"]);
  }
  REQUIRE(step.exported.size() > 1000);
  CHECK(layer.exported == step.exported);
}

}  // namespace

TEST_CASE("layer-major micro-batches give step-major's parameters bit for bit at every ZeRO stage and tier, clipping "
          "firing and not, on 2 ranks",
          "[finetune][layer-major]") {
  strata::test::TempDir dir;
  three_layers(dir);
  const std::string nvme = nvme_tiers(dir.file("swap"));
  const ZeroCase cases[] = {
      {"stage1", R"("stage": 1)", 0.05},
      {"stage2_cpu", R"("stage": 2, "offload_optimizer": {"device": "cpu"})", 0.0},
      {"stage3_cpu", R"("stage": 3, "sub_group_size": 5000, "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "cpu"})", 0.05},
      {"stage3_nvme", R"("stage": 3, "sub_group_size": 5000, )" + nvme, 0.0},
      {"stage3_nvme_clip", R"("stage": 3, "sub_group_size": 5000, )" + nvme, 0.05},
  };
  constexpr int kSteps = 3;
  for (const ZeroCase& c : cases) {
    SECTION(c.name) {
      // Recomputing (auto keeps this model's activations: the keep test below).
      const std::string ds =
          config(dir, c.name, c.zero + R"(}, "strata": {"layer_major_activations": "recompute")", c.clip);
      // With every tier on NVMe, an evaluation after each step too.
      const std::string eval = c.name.rfind("stage3_nvme", 0) == 0 ? " --eval-data " + kFinetuneExamples +
                                                                          "/data/gpl-3.0.txt --eval-batches 3 "
                                                                          "--eval-every 1"
                                                                    : "";
      const Run step = finetune(dir, c.name + "_step", ds, "step-major", kSteps, eval);
      const Run layer = finetune(dir, c.name + "_layer", ds, "layer-major", kSteps, eval);
      if (!eval.empty()) CHECK(layer.steps.back().contains("eval_loss"));
      CHECK_THAT(layer.output, Catch::Contains("micro-batch order layer-major: 3 micro-batches through each of the 3 "
                                               "decoder layers in turn"));
      // 3 micro-batches x 5 chunks (the 3 layers, the embedding, the head) x 2 x 16 rows x 64 x 4 bytes
      // (fp32 on the cpu): 0.117 MiB.
      CHECK_THAT(layer.output, Catch::Contains("the layer-boundary activations and gradients take 0.1 MiB"));
      CHECK_THAT(step.output, !Catch::Contains("micro-batch order layer-major"));
      for (const auto& s : layer.steps) {
        CHECK(s["grad_norm"].get<double>() > 0);
        if (c.clip > 0) CHECK(s["grad_norm"].get<double>() > c.clip);  // clipping fired
        CHECK(s["memory"]["activation_bytes"].get<double>() > 0);  // the boundaries and each layer's arena
      }
      check_same(layer, step, kSteps);
    }
  }
}

TEST_CASE("layer-major keeping every micro-batch's activations (strata.layer_major_activations keep, and auto "
          "where they fit) gives step-major's parameters bit for bit, recomputing nothing, on 2 ranks",
          "[finetune][layer-major]") {
  strata::test::TempDir dir;
  three_layers(dir);
  const ZeroCase cases[] = {
      {"stage2_cpu", R"("stage": 2, "offload_optimizer": {"device": "cpu"})", 0.0},
      {"stage3_nvme_clip", R"("stage": 3, "sub_group_size": 5000, )" + nvme_tiers(dir.file("swap")), 0.05},
  };
  constexpr int kSteps = 3;
  for (const ZeroCase& c : cases) {
    SECTION(c.name) {
      const std::string ds =
          config(dir, c.name, c.zero + R"(}, "strata": {"layer_major_activations": "recompute")", c.clip);
      const std::string kept = config(dir, c.name + "_keep", c.zero + R"(}, "strata": {"layer_major_activations": "keep")",
                                      c.clip);
      const std::string automatic = config(dir, c.name + "_auto", c.zero, c.clip);  // the default: auto
      const Run step = finetune(dir, c.name + "_step", kept, "step-major", kSteps);
      const Run recompute = finetune(dir, c.name + "_recompute", ds, "layer-major", kSteps);
      const Run keep = finetune(dir, c.name + "_keep", kept, "layer-major", kSteps);
      const Run chosen = finetune(dir, c.name + "_auto", automatic, "layer-major", kSteps);
      // auto: this model's kept activations are far within the cpu
      // accelerator's budget (half the host's memory), so it keeps them, says
      // so with both predictions, and run.json records what ran.
      CHECK_THAT(chosen.output, Catch::Contains("strata.layer_major_activations auto: keep (device memory predicted") &&
                                    Catch::Contains("GiB recomputing them; within 75% of the accelerator's"));
      std::ifstream run_json(dir.file(c.name + "_auto") + "/run.json");
      CHECK(nlohmann::json::parse(run_json)["ds_config"]["strata"]["layer_major_activations"] == "keep");
      CHECK(chosen.steps[0]["memory"]["activation_bytes"] == keep.steps[0]["memory"]["activation_bytes"]);
      check_same(chosen, step, kSteps);
      CHECK_THAT(step.output, Catch::Contains("strata.layer_major_activations keep: no effect, the micro-batches are "
                                              "step-major"));
      CHECK_THAT(keep.output, Catch::Contains("then each layer's backwards from the top, on the activations their "
                                              "forwards kept (strata.layer_major_activations keep)"));
      CHECK_THAT(keep.output, Catch::Contains("a working arena per micro-batch (3) of every layer"));
      CHECK_THAT(recompute.output, Catch::Contains("recomputed from its input"));
      // Three arenas of each chunk where recompute has one: more activation memory, the same boundaries.
      REQUIRE(keep.steps.size() == recompute.steps.size());
      CHECK(keep.steps[0]["memory"]["activation_bytes"].get<double>() >
            2 * recompute.steps[0]["memory"]["activation_bytes"].get<double>());
      if (c.clip > 0) CHECK(keep.steps[0]["grad_norm"].get<double>() > c.clip);  // clipping fired
      check_same(keep, step, kSteps);
      check_same(recompute, step, kSteps);
    }
  }
}

TEST_CASE("strata.layer_major_activations auto keeps where strata plan's model of the run fits 75% of the "
          "accelerator's budget and recomputes where it does not (saying why) while keep and recompute pass through",
          "[layer-major]") {
  namespace train = strata::train;
  strata::plan::RuntimeInputs run;
  run.model = strata::nn::parse_decoder_config(nlohmann::json::parse(R"({"model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": false})"),
                                               "three layers");
  run.micro_batch = 2;
  run.seq = 16;
  run.layer_major = {3, false, strata::pipeline::BoundaryHome::kDevice};
  strata::plan::RuntimeInputs kept = run;
  kept.layer_major.keep_activations = true;
  const double keep_nbytes = strata::plan::runtime_memory(kept).device_nbytes;
  const double recompute_nbytes = strata::plan::runtime_memory(run).device_nbytes;
  REQUIRE(keep_nbytes > recompute_nbytes);
  // The budget at which keeping takes exactly 75%, and a byte short of what keeping needs there.
  const auto fits = static_cast<size_t>(std::ceil(keep_nbytes / train::kAutoKeepBudgetShare));
  const train::LayerActivationsChoice roomy = train::choose_layer_activations("auto", "key", run, fits);
  CHECK(roomy.keep);
  CHECK_THAT(roomy.said, Catch::StartsWith("key auto: keep (device memory predicted") &&
                             Catch::Contains("within 75% of the accelerator's"));
  const train::LayerActivationsChoice tight =
      train::choose_layer_activations("auto", "key", run, static_cast<size_t>(keep_nbytes));
  CHECK_FALSE(tight.keep);
  CHECK_THAT(tight.said, Catch::StartsWith("key auto: recompute (device memory predicted") &&
                             Catch::Contains("keeping would pass 75% of the accelerator's"));
  // Given, whatever the budget: no line to log.
  CHECK(train::choose_layer_activations("keep", "key", run, 1).keep);
  CHECK(train::choose_layer_activations("keep", "key", run, 1).said.empty());
  CHECK_FALSE(train::choose_layer_activations("recompute", "key", run, fits).keep);
  CHECK_THROWS_WITH(train::choose_layer_activations("kept", "--layer-major-activations", run, fits),
                    Catch::Contains("--layer-major-activations kept: not what layer-major does with its activations; "
                                    "one of recompute, keep, auto"));
  // A run the model does not describe (layer-major with tensor parallelism is refused) recompute, saying why.
  strata::plan::RuntimeInputs undescribed = run;
  undescribed.tensor_parallel = 2;
  undescribed.world_size = 2;
  const train::LayerActivationsChoice unknown = train::choose_layer_activations("auto", "key", undescribed, fits);
  CHECK_FALSE(unknown.keep);
  CHECK_THAT(unknown.said, Catch::Contains("does not describe this run"));
}

TEST_CASE("layer-major killed with SIGKILL and resumed ends with step-major's parameters bit for bit, auto and what "
          "layer-major does not do are said by name",
          "[finetune][layer-major][checkpoint]") {
  strata::test::TempDir dir;
  three_layers(dir);
  const std::string swap = dir.file("swap");
  const std::string ds = config(dir, "nvme", R"("stage": 3, "sub_group_size": 5000,
      "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("})", 0.05);
  constexpr int kSteps = 6;
  // auto (the config's key) asks strata plan's prediction: parameters on
  // NVMe and 3 micro-batches are not enough. A reuse distance that holds two
  // layers (61696 elements) but not the model (125376): layer-major fetches
  // each parameter twice per step where step-major fetches it 6 times, a
  // predicted gain, said once with both step times.
  const Run step = finetune(dir, "step", ds, "step-major", kSteps);
  const auto auto_config = [&](const std::string& name, const std::string& budget) {
    return config(dir, name, R"("stage": 3, "sub_group_size": 5000,)" + budget + R"(
      "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("}}, "strata": {"micro_batch_order": "auto")",
                  0.05);
  };
  const auto automatic_start = std::chrono::steady_clock::now();
  const Run automatic = finetune(dir, "auto", auto_config("keyed", R"( "stage3_max_reuse_distance": 100000,)"), "",
                                 kSteps);
  // The kills below are spread over this uninterrupted layer-major run's time.
  const auto automatic_took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - automatic_start);
  CHECK_THAT(automatic.output, Catch::Contains("strata.micro_batch_order auto: layer-major, predicted") &&
                                   Catch::Contains("s/step against step-major's") &&
                                   Catch::Contains("layer-major fetches each parameter twice per step, step-major 6 "
                                                   "times"));
  CHECK_THAT(automatic.output, Catch::Contains("micro-batch order layer-major: 3 micro-batches"));
  check_same(automatic, step, kSteps);
  // DeepSpeed's default budgets keep the whole model gathered: both orders
  // fetch each parameter once, no gain, and auto stays step-major.
  const auto whole = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " +
                                auto_config("whole", "") + " --init " + dir.file("three.json") + " --data " +
                                kFinetuneExamples + "/data/gpl-3.0.txt --data-format text --seq 16 --steps 1 --out " +
                                dir.file("whole") + " 2>&1");
  INFO(whole.output);
  REQUIRE(whole.exit_code == 0);
  CHECK_THAT(whole.output, Catch::Contains("strata.micro_batch_order auto: step-major, predicted") &&
                              Catch::Contains("the whole model fits stage3_max_reuse_distance"));
  CHECK_THAT(whole.output, !Catch::Contains("micro-batch order layer-major"));

  // Killed at once (every process of the run) at moments from start-up to
  // the export, resumed from its newest checkpoint each time.
  const std::string ckpt = dir.file("killed_ckpt");
  const std::string args = strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + ds +
                           " --init " + dir.file("three.json") + " --data " + kFinetuneExamples +
                           "/data/gpl-3.0.txt --data-format text --seq 16 --steps " + std::to_string(kSteps) +
                           " --micro-batch-order layer-major --save " + ckpt + " --save-every 1 --out " +
                           dir.file("killed") + " --export " + dir.file("killed_model") + " --export-dtype fp32";
  const int kills =
      strata::test::run_killed_and_resumed(dir, args, ckpt, strata::test::kill_delays_over(automatic_took));
  INFO("killed " << kills << " times");
  CHECK(kills >= 3);
  CHECK(file_bytes(dir.file("killed_model") + "/model.safetensors") == step.exported);
  const auto killed = read_jsonl(dir.file("killed") + "/metrics.jsonl");
  REQUIRE(killed.size() == kSteps);
  for (int i = 0; i < kSteps; ++i) CHECK(killed[i]["loss"] == step.steps[i]["loss"]);
  // strata plan --check reads the order from the run's command line and
  // predicts what layer-major holds (its arenas and boundaries) exactly.
  const auto planned = run_command(strata_binary() + " plan --check " + dir.file("killed") + " --json 2>/dev/null");
  INFO(planned.output);
  const nlohmann::json check = nlohmann::json::parse(planned.output);
  CHECK(check["run"]["micro_batch_order"]["order"] == "layer-major");
  strata::test::check_tier_exact(check, "activations (layer-major)");

  // The orders share the checkpoint layout: step-major's checkpoint of step
  // 3 resumed layer-major ends where step-major does.
  const std::string half = strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + ds +
                           " --init " + dir.file("three.json") + " --data " + kFinetuneExamples +
                           "/data/gpl-3.0.txt --data-format text --seq 16 --save " + dir.file("half_ckpt") +
                           " --save-every 3 --out " + dir.file("half") + " --export " + dir.file("half_model") +
                           " --export-dtype fp32 --steps ";
  const auto first = run_command(half + "3 --micro-batch-order step-major 2>&1");
  INFO(first.output);
  REQUIRE(first.exit_code == 0);
  const auto second = run_command(half + std::to_string(kSteps) + " --micro-batch-order layer-major --resume 2>&1");
  INFO(second.output);
  REQUIRE(second.exit_code == 0);
  CHECK_THAT(second.output, Catch::Contains("micro-batch order layer-major"));
  CHECK(file_bytes(dir.file("half_model") + "/model.safetensors") == step.exported);

  // What layer-major does not do yet is refused before step 1, by name.
  write_file(dir, "tied.json", R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "tie_word_embeddings": true})");
  const std::string one = strata_binary() + " finetune --config " + ds + " --data " + kFinetuneExamples +
                          "/data/gpl-3.0.txt --data-format text --seq 16 --steps 1 --out " + dir.file("refused");
  const auto tied = run_command(one + " --init " + dir.file("tied.json") + " --micro-batch-order layer-major 2>&1");
  CHECK(tied.exit_code != 0);
  CHECK_THAT(tied.output, Catch::Contains("--micro-batch-order layer-major with tied embeddings (tie_word_embeddings "
                                          "true in config.json): not implemented yet"));
  const auto lora =
      run_command(one + " --init " + dir.file("three.json") + " --micro-batch-order layer-major --lora-rank 4 2>&1");
  CHECK(lora.exit_code != 0);
  CHECK_THAT(lora.output, Catch::Contains("--micro-batch-order layer-major with LoRA (--lora-rank): not implemented"));
  const auto tp = run_command(strata_binary() + " run -n 2 -- " + one + " --init " + dir.file("three.json") +
                              " --micro-batch-order layer-major --tp 2 2>&1");
  CHECK(tp.exit_code != 0);
  CHECK_THAT(tp.output, Catch::Contains("--micro-batch-order layer-major with tensor parallelism (--tp 2): not "
                                        "implemented yet"));
  const auto bad = run_command(one + " --init " + dir.file("three.json") + " --micro-batch-order vertical 2>&1");
  CHECK(bad.exit_code != 0);
  CHECK_THAT(bad.output, Catch::Contains("--micro-batch-order vertical: not a micro-batch order; one of step-major, "
                                         "layer-major, auto"));
  const std::string vertical = config(dir, "vertical", R"("stage": 1}, "strata": {"micro_batch_order": "vertical")", 0.0);
  const auto key = run_command(strata_binary() + " config check " + vertical + " 2>&1");
  CHECK(key.exit_code != 0);
  CHECK_THAT(key.output, Catch::Contains("strata.micro_batch_order"));
  // auto with the parameters on the device says why it keeps step-major.
  const std::string device = config(dir, "device", R"("stage": 1)", 0.0);
  const auto kept = run_command(strata_binary() + " finetune --config " + device + " --init " + dir.file("three.json") +
                                " --data " + kFinetuneExamples + "/data/gpl-3.0.txt --data-format text --seq 16 " +
                                "--steps 1 --micro-batch-order auto --out " + dir.file("kept") + " 2>&1");
  INFO(kept.output);
  CHECK(kept.exit_code == 0);
  CHECK_THAT(kept.output, Catch::Contains("--micro-batch-order auto: step-major (the parameters live on the device"));
}

TEST_CASE("layer-major with its boundaries in pinned host memory gives step-major's bits, and a pinned budget they "
          "do not fit is refused before step 1",
          "[finetune][layer-major]") {
  strata::test::TempDir dir;
  three_layers(dir);
  const std::string zero = R"("stage": 3, "sub_group_size": 5000, "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "cpu"})";
  const std::string ds = config(dir, "device", zero, 0.05);
  const std::string pinned = config(dir, "pinned", zero + R"(}, "strata": {"layer_major_boundaries": "cpu")", 0.05);
  constexpr int kSteps = 2;
  const Run step = finetune(dir, "step", ds, "step-major", kSteps);
  const Run layer = finetune(dir, "layer", pinned, "layer-major", kSteps);
  CHECK_THAT(layer.output, Catch::Contains("the layer-boundary activations and gradients take 0.1 MiB of pinned host "
                                           "memory (strata.layer_major_boundaries)"));
  check_same(layer, step, kSteps);
  // The boundaries count in strata.pinned_pool_size: a budget of 1 byte
  // holds none of the run's pinned buffers, and the refusal, before any
  // step, lists the boundaries among them (3 micro-batches x 5 chunks x 2 x
  // 16 rows x 64 x 4 bytes).
  const std::string tight = config(
      dir, "tight", zero + R"(}, "strata": {"layer_major_boundaries": "cpu", "pinned_pool_size": 1)", 0.05);
  const auto refused = run_command(strata_binary() + " finetune --config " + tight + " --init " +
                                   dir.file("three.json") + " --data " + kFinetuneExamples +
                                   "/data/gpl-3.0.txt --data-format text --seq 16 --steps 1 --micro-batch-order "
                                   "layer-major --out " + dir.file("tight_out") + " 2>&1");
  CHECK(refused.exit_code != 0);
  CHECK_THAT(refused.output, Catch::Contains("layer-major boundaries 122880 bytes"));
  CHECK_THAT(refused.output, Catch::Contains("or keep the boundaries on the device"));
  CHECK_THAT(refused.output, !Catch::Contains("step 1"));
}

TEST_CASE("layer-major with its boundaries on nvme gives step-major's bits, evaluation included, and needs a tier "
          "on nvme",
          "[finetune][layer-major]") {
  strata::test::TempDir dir;
  three_layers(dir);
  const std::string swap = dir.file("swap");
  const std::string zero = R"("stage": 3, "sub_group_size": 5000,
      "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("})";
  const std::string ds = config(dir, "device", zero, 0.05);
  const std::string on_nvme = config(
      dir, "on_nvme", zero + R"(}, "strata": {"layer_major_boundaries": "nvme", "keep_swap_files": true)", 0.05);
  constexpr int kSteps = 2;
  const std::string eval = " --eval-data " + kFinetuneExamples + "/data/gpl-3.0.txt --eval-batches 2 --eval-every 1";
  const Run step = finetune(dir, "step", ds, "step-major", kSteps, eval);
  const Run layer = finetune(dir, "layer", on_nvme, "layer-major", kSteps, eval);
  // Staging: 2 x 3 + 2 inputs of 2 x 16 rows x 64 x 4 bytes (8192, aligned already) and 3 gradients: 0.09 MiB.
  CHECK_THAT(layer.output, Catch::Contains("the layer-boundary activations and gradients take 0.1 MiB of nvme, "
                                           "through 0.1 MiB of pinned staging"));
  check_same(layer, step, kSteps);
  // Each rank's file: a place per chunk (5) and micro-batch (3), kept by strata.keep_swap_files.
  for (int r = 0; r < 2; ++r) {
    const std::string file = swap + "/layer_major/rank" + std::to_string(r) + "/boundaries.swp";
    REQUIRE(std::filesystem::exists(file));
    CHECK(std::filesystem::file_size(file) == 5 * 3 * 8192);
  }
  // Without a tier on nvme there is no nvme_path for the file: refused before step 1.
  const std::string cpu = config(dir, "cpu", R"("stage": 3, "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "cpu"}}, "strata": {"layer_major_boundaries": "nvme")", 0.0);
  const auto refused = run_command(strata_binary() + " finetune --config " + cpu + " --init " + dir.file("three.json") +
                                   " --data " + kFinetuneExamples +
                                   "/data/gpl-3.0.txt --data-format text --seq 16 --steps 1 --micro-batch-order "
                                   "layer-major --out " + dir.file("cpu_out") + " 2>&1");
  CHECK(refused.exit_code != 0);
  CHECK_THAT(refused.output, Catch::Contains("strata.layer_major_boundaries nvme puts the boundaries' file under the "
                                             "run's nvme_path, but no tier is on nvme"));
  CHECK_THAT(refused.output, !Catch::Contains("step 1 "));
}

TEST_CASE("strata-train --zero 3 --micro-batches 3: layer-major's losses are step-major's, bit for bit, its "
          "activations recomputed or kept, and the first is the resident model's",
          "[layer-major][strata-train]") {
  strata::test::TempDir dir;
  const std::string train = strata::test::build_dir() + "/bin/strata-train";
  std::vector<nlohmann::json> losses;
  for (const std::string run : {"step-major", "layer-major", "layer-major keep"}) {
    const std::string order = run.substr(0, run.find(' '));
    const bool keep = run.ends_with("keep");
    const std::string name = keep ? "layer-major-keep" : order;
    const std::string json = dir.file(name + ".json");
    const auto r = run_command(strata_binary() + " run -n 2 -- " + train +
                               " --zero 3 --offload-param nvme --offload-optimizer nvme --nvme-dir " +
                               dir.file(name + "_swap") +
                               " --layers 3 --hidden 64 --heads 2 --vocab 64 --seq 8 --batch 1 --steps 2 --warmup 1 "
                               "--rounds 1 --drive-test-mib 4 --micro-batches 3 --micro-batch-order " +
                               order + (keep ? " --layer-major-activations keep" : "") + " --json " + json + " 2>&1");
    INFO(r.output);
    REQUIRE(r.exit_code == 0);  // 1 when the first loss is not the resident model's
    CHECK_THAT(r.output, Catch::Contains("micro-batches per step: 3, " + order));
    // The optimizer armed for the step's backwards (layer-major: all m of
    // them, each layer's in a row) updates sub-groups during backward, and
    // its speculation holds (no clipping): nothing redone.
    std::smatch overlap;
    REQUIRE(std::regex_search(r.output, overlap, std::regex(R"(\((\d+) of (\d+) sub-groups during backward\))")));
    CHECK(std::stoi(overlap[1].str()) > 0);
    std::smatch redone;
    REQUIRE(std::regex_search(r.output, redone, std::regex(R"(speculated on (\d+) \((\d+) redone;)")));
    CHECK(std::stoi(redone[2].str()) == 0);
    if (order == "layer-major") {
      // Kept per micro-batch: the input of the 3 layers and of the head and one gradient, 3 x 5 x 8 rows x 64 x
      // 4 bytes = 0.0293 MiB; the working arenas one per chunk, or one per micro-batch of each chunk when kept.
      CHECK_THAT(r.output, Catch::Contains(keep ? "one per micro-batch of every layer and of the embedding, one the "
                                                  "head's (its backward follows its forward) (13 in all); 0.03 MiB of "
                                                : "one per layer, the embedding's and the head's (5 in all); 0.03 MiB of "));
      // Recompute: every chunk's forward again for each of its backwards (micro-batch 0 first, while its slot
      // holds the last forward's), the head's never: 3 layers + the embedding, 3 micro-batches each.
      CHECK_THAT(r.output, Catch::Contains(keep ? "layer-boundary activations and gradients, 3 micro-batches); 0 layer "
                                                  "forwards run again for backward per step"
                                                : "layer-boundary activations and gradients, 3 micro-batches); 12 layer "
                                                  "forwards run again for backward per step"));
      CHECK_THAT(r.output, Catch::Contains(keep ? "layer-major, activations keep" : "layer-major, activations recompute"));
    }
    std::ifstream in(json);
    const nlohmann::json out = nlohmann::json::parse(in);
    CHECK(out["config"]["micro_batches"] == 3);
    losses.push_back(out["rounds"][0]["losses"]);
  }
  REQUIRE(losses[0].size() == 3);
  CHECK(losses[1] == losses[0]);
  CHECK(losses[2] == losses[0]);
}
