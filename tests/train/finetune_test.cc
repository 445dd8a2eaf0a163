// `strata finetune` as a user runs it: real processes under `strata run`,
// real Gloo, real NVMe swap files; the byte-level example model on the
// example text. And every bad input a clear error before any training.
#include <algorithm>
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/nn/safetensors.h"
#include "tests/support/finetune_files.h"
#include "tests/support/killed_runs.h"
#include "tests/support/jsonl.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"

using strata::test::file_bytes;
using strata::test::kFinetuneExamples;
using strata::test::run_killed_and_resumed;
using strata::test::read_jsonl;
using strata::test::run_command;
using strata::test::small_model;
using strata::test::strata_binary;
using strata::test::write_file;

namespace {

}  // namespace

TEST_CASE("strata run -n 2 -- strata finetune: ZeRO-3 with parameters and optimizer on NVMe, the loss falls",
          "[finetune]") {
  strata::test::TempDir dir;
  const std::string swap = dir.file("swap");
  const std::string config = write_file(dir, "ds.json", R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "total_num_steps": 40}},
    "zero_optimization": {"stage": 3, "sub_group_size": 20000, "reduce_bucket_size": 20000,
      "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("}}})");
  const std::string out = dir.file("out");
  const auto run = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                               " --init " + small_model(dir) + " --data " + kFinetuneExamples +
                               "/data/gpl-3.0.txt --data-format text --steps 40 --seq 64 --out " + out + " --export " + out +
                               "/model --export-dtype fp32 --export-shard-size 50KB 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, Catch::Contains("ZeRO stage 3, params on nvme, optimizer state on nvme") &&
                             Catch::Contains("metrics.jsonl") && Catch::Contains("loss.svg"));
  const auto steps = read_jsonl(out + "/metrics.jsonl");
  REQUIRE(steps.size() == 40);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) {
    first += steps[i]["loss"].get<double>() / 5;
    last += steps[35 + i]["loss"].get<double>() / 5;
  }
  INFO("mean loss of steps 1-5 " << first << ", of steps 36-40 " << last);
  CHECK(first > 4.5);        // near log(256) = 5.55 at the start
  CHECK(last < first - 1.0);  // byte-level English: letter frequencies are learnt fast
  for (const auto& s : steps) {
    CHECK(s["applied"].get<bool>());
    CHECK(s["tokens"].get<int64_t>() > 0);
    CHECK(s.contains("lr"));
    CHECK(s.contains("grad_norm"));
    CHECK(s["breakdown_s"].contains("optimizer"));
    CHECK(s["breakdown_s"].contains("optimizer_hidden"));
    CHECK(s["optimizer_not_hidden_fraction"].get<double>() <= 1.0);
    // The optimizer thread speculates, or reads ahead after a step whose
    // clipping (at 1.0) fired; a speculation is rolled back exactly when it
    // fires. ZeRO-3 with the optimizer on NVMe: each step's update (what was
    // left after backward) overlaps the next forward.
    const bool clipped = s["grad_norm"].get<double>() > 1.0;
    CHECK((s["optimizer_overlap"] == "speculate" || s["optimizer_overlap"] == "read-ahead"));
    CHECK(s["optimizer_rolled_back"] == (s["optimizer_overlap"] == "speculate" && clipped));
    CHECK(s["optimizer_overlaps_forward"].get<bool>());
    CHECK(s["nvme_bytes"].get<uint64_t>() > 0);  // parameters and optimizer state stream through NVMe
  }
  // kAuto: after a step that clipped the next reads ahead, after one that did not it speculates.
  for (size_t i = 1; i < steps.size(); ++i) {
    CAPTURE(i);
    CHECK((steps[i]["optimizer_overlap"] == "read-ahead") == (steps[i - 1]["grad_norm"].get<double>() > 1.0));
  }
  // The schedule's warmup is visible in the metrics.
  CHECK(steps[0]["lr"].get<double>() < steps[5]["lr"].get<double>());
  std::ifstream svg(out + "/loss.svg");
  std::stringstream text;
  text << svg.rdbuf();
  CHECK_THAT(text.str(), Catch::StartsWith("<svg") && Catch::Contains("<polyline"));

  // The export is a sharded Hugging Face directory that loads back (here into
  // one rank, shard by shard) with what was learnt.
  const std::string model = out + "/model";
  CHECK(std::ifstream(model + "/config.json").good());
  const auto index = nlohmann::json::parse(std::ifstream(model + "/model.safetensors.index.json"));
  CHECK(index["weight_map"].size() == 2 + 2 * 9 + 1);  // embeddings, lm_head, 9 per layer, final norm
  const auto again = run_command(strata_binary() + " finetune --model " + model + " --data " + kFinetuneExamples +
                                 "/data/gpl-3.0.txt --data-format text --steps 3 --seq 64 --out " + out +
                                 "/again 2>&1");
  INFO(again.output);
  REQUIRE(again.exit_code == 0);
  const auto resumed = read_jsonl(out + "/again/metrics.jsonl");
  REQUIRE(resumed.size() == 3);
  CHECK(resumed[0]["loss"].get<double>() < first - 1.0);  // not a fresh model
}

TEST_CASE("strata finetune: bad input is a clear error before any training", "[finetune]") {
  strata::test::TempDir dir;
  const std::string model = small_model(dir);
  const std::string text = kFinetuneExamples + "/data/gpl-3.0.txt";
  const auto finetune = [&](const std::string& args) {
    return run_command(strata_binary() + " finetune --out " + dir.file("out") + " " + args + " 2>&1");
  };
  struct Case {
    std::string what, args, expect;
  };
  const std::string short_data = write_file(dir, "short.txt", "only a few bytes");
  const std::vector<Case> cases = {
      {"data shorter than one sample", "--init " + model + " --data " + short_data + " --data-format text --seq 64",
       short_data},
      {"fp16 and bf16 at once",
       "--config " +
           write_file(dir, "fp16.json",
                 R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}, "zero_optimization": {"stage": 3}})") +
           " --init " + model + " --data " + text + " --data-format text",
       "both true"},
      {"stage 0", "--config " + write_file(dir, "s0.json", R"({"zero_optimization": {"stage": 0}})") + " --init " + model +
                      " --data " + text + " --data-format text",
       "stage is 0"},
      {"an unknown config key",
       "--config " + write_file(dir, "typo.json", R"({"zero_optimisation": {"stage": 3}})") + " --init " + model +
           " --data " + text + " --data-format text",
       "unknown key"},
      {"a model directory without weights", "--model " + dir.path().string() + " --data " + text,
       "no config.json"},
      {"both --model and --init", "--model " + dir.path().string() + " --init " + model + " --data " + text,
       "exactly one"},
      {"a sequence longer than the model's positions", "--init " + model + " --data " + text + " --seq 4096",
       "max_position_embeddings"},
      {"a missing data file", "--init " + model + " --data " + dir.file("nope.bin"), "nope.bin"},
      {"a scheduler without its required key",
       "--config " + write_file(dir, "sched.json", R"({"zero_optimization": {"stage": 3},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})") +
           " --init " + model + " --data " + text + " --data-format text",
       "total_num_steps"},
      {"tensor parallelism that does not divide the ranks", "--init " + model + " --data " + text +
           " --data-format text --seq 32 --tp 2",
       "tensor parallelism 2 (--tp / tensor_parallel.autotp_size) does not divide the 1 ranks"},
      {"--tp and the config disagreeing",
       "--config " + write_file(dir, "tp.json", R"({"tensor_parallel": {"autotp_size": 4}})") + " --init " + model +
           " --data " + text + " --data-format text --seq 32 --tp 2",
       "--tp 2 and"},
      {"pipeline parallelism that does not divide the ranks", "--init " + model + " --data " + text +
           " --data-format text --seq 32 --pp 2",
       "pipeline parallelism 2 (--pp / pipeline_parallel.size) x tensor parallelism 1 does not divide the 1 ranks"},
      {"an unknown pipeline schedule", "--init " + model + " --data " + text + " --data-format text --seq 32 --pp 2 "
           "--pp-schedule zb-v",
       "--pp-schedule zb-v: not a pipeline schedule; one of gpipe, 1f1b, interleaved, zb-h1"},
      {"interleaved micro-batches that do not fill the groups",
       "--config " + write_file(dir, "ga3.json", R"({"gradient_accumulation_steps": 3})") + " --init " + model +
           " --data " + text + " --data-format text --seq 32 --pp 2 --pp-schedule interleaved --virtual-stages 2",
       "3 micro-batches is not a multiple of 2 stages"},
      {"more stages than layers", "--init " + model + " --data " + text + " --data-format text --seq 32 --pp 4",
       "the model's 2 decoder layers (num_hidden_layers) cannot fill 4 pipeline stages (pp 4)"},
      {"a mixture of experts' load-balancing loss over stages",
       "--init " + write_file(dir, "aux.json", R"({"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
    "output_router_logits": true, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128})") + " --data " + text + " --data-format text --seq 32 --pp 2",
       "--pp 2 with model_type mixtral's load-balancing loss (output_router_logits true): not implemented yet"},
      {"DeepSeek's bias balancing on a model without a correction bias",
       "--config " + write_file(dir, "bias.json", R"({"moe": {"router_bias_update_rate": 0.001}})") + " --init " +
           model + " --data " + text + " --data-format text --seq 32",
       "moe.router_bias_update_rate 0.001: model_type llama has no e_score_correction_bias"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    const auto result = finetune(c.args);
    INFO(result.output);
    CHECK(result.exit_code != 0);
    CHECK_THAT(result.output, Catch::Contains(c.expect));
  }
}

TEST_CASE("strata finetune in fp16 with dynamic loss scaling: the scale is reported and the loss falls", "[finetune]") {
  strata::test::TempDir dir;
  const std::string config = write_file(dir, "fp16.json", R"({"train_micro_batch_size_per_gpu": 4,
    "zero_optimization": {"stage": 3}, "fp16": {"enabled": true, "initial_scale_power": 12},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}})");
  const auto r = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                             " --init " + small_model(dir) + " --data " + kFinetuneExamples +
                             "/data/gpl-3.0.txt --data-format text --steps 30 --seq 64 --out " + dir.file("out") +
                             " 2>&1");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.output, Catch::Contains("(fp16)"));
  const auto steps = read_jsonl(dir.file("out") + "/metrics.jsonl");
  REQUIRE(steps.size() == 30);
  CHECK(steps[0]["loss_scale"].get<double>() == 4096.0);
  CHECK(steps[29]["loss"].get<double>() < steps[0]["loss"].get<double>() - 1.0);
}

TEST_CASE("strata finetune with activation checkpointing gives the same losses, bit for bit", "[finetune]") {
  strata::test::TempDir dir;
  const std::string model = small_model(dir);
  const std::string plain = write_file(dir, "plain.json", R"({"train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}})");
  const std::string cpu = write_file(dir, "cpu.json", R"({"train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "activation_checkpointing": {"cpu_checkpointing": true}})");
  const auto run = [&](const std::string& config, const std::string& flags, const std::string& out) {
    const auto r = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                               " --init " + model + " --data " + kFinetuneExamples +
                               "/data/gpl-3.0.txt --data-format text --steps 5 --seq 32 --out " + dir.file(out) +
                               " " + flags + " 2>&1");
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    std::vector<double> losses;
    for (const auto& step : read_jsonl(dir.file(out) + "/metrics.jsonl")) losses.push_back(step["loss"].get<double>());
    return losses;
  };
  const auto reference = run(plain, "", "plain");
  REQUIRE(reference.size() == 5);
  CHECK(run(plain, "--checkpoint-activations", "device") == reference);
  CHECK(run(cpu, "", "cpu") == reference);
}

namespace {

// The arguments of the checkpoint tests: 2 ranks, ZeRO-3 with parameters and
// optimizer state on NVMe, a checkpoint every 2 steps, an fp32 export.
// `init`: the model's config.json in dir (small_model's by default);
// `extra`: more keys of the ds_config ("key": value, ... with a trailing comma).
std::string resumable_args(const strata::test::TempDir& dir, const std::string& name, int steps,
                           const std::string& init = "small.json", const std::string& extra = "") {
  const std::string swap = dir.file(name + "_swap");
  static int configs = 0;
  const std::string config = write_file(dir, name + "_ds" + std::to_string(++configs) + ".json", R"({)" + extra + R"(
    "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
    "zero_optimization": {"stage": 3, "sub_group_size": 20000,
      "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("}}})");
  return "finetune --config " + config + " --init " + dir.file(init) + " --data " + kFinetuneExamples +
         "/data/gpl-3.0.txt --data-format text --seq 32 --steps " + std::to_string(steps) + " --save " +
         dir.file(name + "_ckpt") + " --save-every 2 --out " + dir.file(name + "_out") + " --export " +
         dir.file(name + "_model") + " --export-dtype fp32";
}

// The same resumable run ("killed", args from resumable_args) killed with
// SIGKILL at moments and resumed, at least 3 times, exports `file` with the
// bytes `expected` (an uninterrupted run's). `delays_ms`: the kills' delays,
// kill_delays_over the uninterrupted run's wall time (empty: fixed ones).
void expect_killed_run_exports(const strata::test::TempDir& dir, const std::string& args, const std::string& expected,
                               const std::string& file = "model.safetensors", std::vector<int> delays_ms = {}) {
  const int kills = run_killed_and_resumed(dir, args, dir.file("killed_ckpt"), std::move(delays_ms));
  INFO("killed " << kills << " times");
  CHECK(kills >= 3);
  CHECK(file_bytes(dir.file("killed_model") + "/" + file) == expected);
}

// An uninterrupted resumable run ("ref") on `run` (the launcher, e.g. strata
// run -n 2), then the same run killed and resumed, ending with the same export
// `file` bit for bit. `init`, `extra`: as resumable_args; `flags`: appended
// to both runs. Returns the uninterrupted run's output.
std::string expect_resumed_like_uninterrupted(const strata::test::TempDir& dir, const std::string& run, int steps,
                                              const std::string& init = "small.json", const std::string& flags = "",
                                              const std::string& file = "model.safetensors") {
  const auto [reference, took] =
      strata::test::run_timed(run + resumable_args(dir, "ref", steps, init) + flags + " 2>&1");
  INFO(reference.output);
  REQUIRE(reference.exit_code == 0);
  const std::string expected = file_bytes(dir.file("ref_model") + "/" + file);
  REQUIRE(expected.size() > 1000);
  expect_killed_run_exports(dir, run + resumable_args(dir, "killed", steps, init) + flags, expected, file,
                            strata::test::kill_delays_over(took));
  return reference.output;
}

// Two exports hold the same tensors (names, shapes) in `file`; the largest
// |a - b| over their fp32 values.
double max_export_difference(const std::string& a_dir, const std::string& b_dir,
                             const std::string& file = "model.safetensors") {
  const auto a_file = strata::nn::SafetensorsFile::open(a_dir + "/" + file);
  const auto b_file = strata::nn::SafetensorsFile::open(b_dir + "/" + file);
  REQUIRE(a_file.names() == b_file.names());
  double most = 0;
  for (const std::string& name : b_file.names()) {
    CAPTURE(name);
    REQUIRE(a_file.entry(name).shape == b_file.entry(name).shape);
    const auto a = a_file.view(name), b = b_file.view(name);
    for (int64_t i = 0; i < a.numel(); ++i) {
      most = std::max(most, static_cast<double>(std::fabs(a.as<float>()[i] - b.as<float>()[i])));
    }
  }
  return most;
}

// A tiny DeepSeek-V3 (dir/deepseek.json): 8 experts in 4 groups (2 kept), top
// 2 (two ranks split the experts), a shared expert, a dense first layer,
// q_lora, v_head_dim unlike the q/k head's.
void deepseek_model(const strata::test::TempDir& dir) {
  write_file(dir, "deepseek.json", R"({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": false})");
}

// Four layers (two per pipeline stage), tied embeddings: the first stage's
// lookup table is the last stage's lm_head, their gradients summed.
void tied4_model(const strata::test::TempDir& dir) {
  write_file(dir, "tied4.json", R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 176, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": true})");
}

}  // namespace

TEST_CASE("killed with SIGKILL at random moments and resumed, a run ends bit for bit like an uninterrupted one",
          "[finetune][checkpoint]") {
  strata::test::TempDir dir;
  small_model(dir);
  const std::string run = strata_binary() + " run -n 2 -- " + strata_binary() + " ";
  constexpr int kSteps = 30;
  expect_resumed_like_uninterrupted(dir, run, kSteps);
  // The metrics of the resumed run cover every step once.
  const auto steps = read_jsonl(dir.file("killed_out") + "/metrics.jsonl");
  REQUIRE(steps.size() == kSteps);
  for (int i = 0; i < kSteps; ++i) CHECK(steps[i]["step"].get<int>() == i + 1);
}

TEST_CASE("LoRA on a DeepSeek-V3's latent attention, its experts frozen and split over 2 ranks, killed with SIGKILL "
          "at random moments and resumed: the adapter comes out bit for bit like an uninterrupted run's",
          "[finetune][checkpoint][lora][moe]") {
  strata::test::TempDir dir;
  deepseek_model(dir);
  const std::string run = strata_binary() + " run -n 2 -- " + strata_binary() + " ";
  // Dropout too: its masks must be drawn again exactly after a resume.
  const std::string lora = " --lora-rank 4 --lora-alpha 16 --lora-dropout 0.1 --lora-targets "
                           "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj";
  constexpr int kSteps = 24;
  const std::string output =
      expect_resumed_like_uninterrupted(dir, run, kSteps, "deepseek.json", lora, "adapter_model.safetensors");
  CHECK_THAT(output, Catch::Contains("expert parallelism: 2 ranks split the 8 experts of each layer (4 each)") &&
                         Catch::Contains("20 adapter tensors"));
}

TEST_CASE("a Mixtral killed with SIGKILL at random moments and resumed ends bit for bit like an uninterrupted run",
          "[finetune][checkpoint][moe]") {
  strata::test::TempDir dir;
  // 8 experts, top 2, with the load-balancing loss: routing (and so which
  // experts each step skips) and the auxiliary gradient must resume exactly.
  // Two ranks split the experts (moe.expert_parallel_size left out: the
  // world size), so each rank's checkpoint holds its own experts.
  write_file(dir, "moe.json", R"({"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 48, "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
    "output_router_logits": true, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})");
  const std::string run = strata_binary() + " run -n 2 -- " + strata_binary() + " ";
  constexpr int kSteps = 24;
  const std::string output = expect_resumed_like_uninterrupted(dir, run, kSteps, "moe.json");
  CHECK_THAT(output, Catch::Contains("expert parallelism: 2 ranks split the 8 experts of each layer (4 each)"));
  // strata export gathers every expert from the rank that holds it.
  const auto exported = run_command(run + "export " + dir.file("ref_ckpt") + " " + dir.file("exported") +
                                    " --dtype fp32 2>&1");
  INFO(exported.output);
  REQUIRE(exported.exit_code == 0);
  CHECK(file_bytes(dir.file("exported") + "/model.safetensors") == file_bytes(dir.file("ref_model") + "/model.safetensors"));
  const auto ref_steps = read_jsonl(dir.file("ref_out") + "/metrics.jsonl");
  const auto steps = read_jsonl(dir.file("killed_out") + "/metrics.jsonl");
  REQUIRE(steps.size() == kSteps);
  REQUIRE(ref_steps.size() == kSteps);
  for (int i = 0; i < kSteps; ++i) {
    CHECK(steps[i]["aux_loss"] == ref_steps[i]["aux_loss"]);
    CHECK(steps[i]["router_imbalance"] == ref_steps[i]["router_imbalance"]);
  }
}

TEST_CASE("a DeepSeek-V3 (multi-head latent attention, the sigmoid router, a shared expert, a dense first layer) "
          "killed with SIGKILL at random moments and resumed ends bit for bit like an uninterrupted run",
          "[finetune][checkpoint][moe][deepseek]") {
  strata::test::TempDir dir;
  // 8 experts in 4 groups (2 kept), top 2, two ranks splitting the experts,
  // with DeepSeek's auxiliary-loss-free balancing: the routing, the
  // correction biases it moves after each step (state the checkpoints hold)
  // and each rank's experts must resume exactly.
  deepseek_model(dir);
  const std::string run = strata_binary() + " run -n 2 -- " + strata_binary() + " ";
  constexpr int kSteps = 20;
  const std::string output = expect_resumed_like_uninterrupted(dir, run, kSteps, "deepseek.json", " --moe-router-bias-update-rate 0.001");
  CHECK_THAT(output, Catch::Contains("expert parallelism: 2 ranks split the 8 experts of each layer (4 each)"));
  // The correction bias started at zero and moved by 0.001 a step towards
  // balance (the export, bit for bit the killed run's too, holds it).
  const auto model = strata::nn::SafetensorsFile::open(dir.file("ref_model") + "/model.safetensors");
  const auto bias = model.view("model.layers.1.mlp.gate.e_score_correction_bias");
  REQUIRE(bias.numel() == 8);
  REQUIRE(bias.desc.dtype == strata::DType::kF32);
  int moved = 0;
  for (int64_t i = 0; i < 8; ++i) {
    moved += bias.as<float>()[i] != 0.0f;
    CHECK(std::fabs(bias.as<float>()[i]) <= kSteps * 0.001f * 1.001f);
  }
  CHECK(moved > 0);
  const auto ref_steps = read_jsonl(dir.file("ref_out") + "/metrics.jsonl");
  const auto steps = read_jsonl(dir.file("killed_out") + "/metrics.jsonl");
  REQUIRE(steps.size() == kSteps);
  REQUIRE(ref_steps.size() == kSteps);
  for (int i = 0; i < kSteps; ++i) {
    CHECK(steps[i]["loss"] == ref_steps[i]["loss"]);
    CHECK(steps[i]["router_imbalance"] == ref_steps[i]["router_imbalance"]);
  }
  CHECK(ref_steps[kSteps - 1]["loss"].get<double>() < ref_steps[0]["loss"].get<double>());
}

TEST_CASE("a Gemma 3 and a gpt-oss killed with SIGKILL at random moments and resumed end bit for bit like "
          "uninterrupted runs",
          "[finetune][checkpoint][gemma][gpt_oss]") {
  // Gemma 3's pieces (GeGLU, (1 + w) norms, the scaled embedding, sandwich
  // and q/k norms, two RoPEs over sliding and full layers), and gpt-oss's
  // (attention sinks, biases, YaRN, the stacked experts with their biases
  // and clamped SwiGLU behind a biased router, split between the two ranks),
  // under ZeRO-3 on NVMe on two ranks: every one must resume exactly.
  const std::pair<const char*, const char*> kModels[] = {
      {"gemma.json", R"({"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 128, "query_pre_attn_scalar": 24, "sliding_window": 8,
    "sliding_window_pattern": 3, "rope_theta": 10000.0, "rope_local_base_freq": 100.0})"},
      {"gpt_oss.json", R"({"model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 128,
    "sliding_window": 8, "swiglu_limit": 1.0})"},
  };
  for (const auto& [file, config] : kModels) {
    INFO(file);
    strata::test::TempDir dir;
    write_file(dir, file, config);
    const std::string run = strata_binary() + " run -n 2 -- " + strata_binary() + " ";
    constexpr int kSteps = 24;
    expect_resumed_like_uninterrupted(dir, run, kSteps, file);
  }
}

TEST_CASE("a damaged newest checkpoint is named and the previous one used, --resume without one is an error",
          "[finetune][checkpoint]") {
  strata::test::TempDir dir;
  small_model(dir);
  const std::string run = strata_binary() + " run -n 2 -- " + strata_binary() + " ";
  const auto reference = run_command(run + resumable_args(dir, "ref", 8) + " 2>&1");
  REQUIRE(reference.exit_code == 0);
  const std::string expected = file_bytes(dir.file("ref_model") + "/model.safetensors");

  // strata export of the last checkpoint is the model the run exported; it
  // needs the checkpoint's world size.
  const auto exported = run_command(run + "export " + dir.file("ref_ckpt") + " " + dir.file("exported") +
                                    " --dtype fp32 2>&1");
  INFO(exported.output);
  REQUIRE(exported.exit_code == 0);
  CHECK(file_bytes(dir.file("exported") + "/model.safetensors") == expected);
  const auto alone = run_command(strata_binary() + " export " + dir.file("ref_ckpt") + " " + dir.file("x") + " 2>&1");
  CHECK(alone.exit_code != 0);
  CHECK_THAT(alone.output, Catch::Contains("strata run -n 2 -- strata export"));

  // --resume with nothing to resume from.
  const auto none = run_command(run + resumable_args(dir, "none", 8) + " --resume 2>&1");
  CHECK(none.exit_code != 0);
  CHECK_THAT(none.output, Catch::Contains("no complete checkpoint"));

  for (const std::string damage : {"truncate-shard", "truncate-manifest"}) {
    CAPTURE(damage);
    // A run of 6 steps keeps checkpoints 4 and 6; damage 6, resume to 8.
    const std::string name = damage == "truncate-shard" ? "shard" : "manifest";
    const auto first = run_command(run + resumable_args(dir, name, 6) + " 2>&1");
    REQUIRE(first.exit_code == 0);
    const std::string step6 = dir.file(name + "_ckpt") + "/step_00000006";
    const std::string victim =
        damage == "truncate-shard" ? step6 + "/rank1/params_fp32.bin" : step6 + "/manifest.json";
    std::filesystem::resize_file(victim, std::filesystem::file_size(victim) / 2);
    const auto resumed = run_command(run + resumable_args(dir, name, 8) + " --resume 2>&1");
    INFO(resumed.output);
    REQUIRE(resumed.exit_code == 0);
    CHECK_THAT(resumed.output, Catch::Contains("cannot be used") && Catch::Contains(victim) &&
                                   Catch::Contains("step_00000004 (step 4)"));
    CHECK(file_bytes(dir.file(name + "_model") + "/model.safetensors") == expected);
  }
}

TEST_CASE("a disk that fills during a checkpoint: a clear error naming the file, the earlier checkpoints intact",
          "[finetune][checkpoint]") {
  strata::test::TempDir dir;
  const std::string model = small_model(dir);
  const std::string config = write_file(dir, "mem.json", R"({"train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}})");
  const std::string run = strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                          " --init " + model + " --data " + kFinetuneExamples +
                          "/data/gpl-3.0.txt --data-format text --seq 32 --save-every 2 --export-dtype fp32";
  const auto reference =
      run_command(run + " --steps 8 --out " + dir.file("ref") + " --export " + dir.file("ref_model") + " 2>&1");
  REQUIRE(reference.exit_code == 0);
  const std::string ckpt = dir.file("ckpt");
  REQUIRE(run_command(run + " --steps 4 --out " + dir.file("out") + " --save " + ckpt + " 2>&1").exit_code == 0);
  // A file-size limit stands in for a full disk: writes past 100 KiB fail
  // (EFBIG; SIGXFSZ ignored, as a full disk raises no signal).
  const auto full = run_command("bash -c \"ulimit -f 200; trap '' XFSZ; " + run + " --steps 8 --out " +
                                dir.file("out") + " --save " + ckpt + " --resume\" 2>&1");
  INFO(full.output);
  CHECK(full.exit_code != 0);
  CHECK_THAT(full.output, Catch::Contains("step_00000006/rank") && Catch::Contains("File too large"));
  CHECK_FALSE(std::filesystem::exists(ckpt + "/step_00000006/manifest.json"));
  CHECK(std::filesystem::exists(ckpt + "/step_00000004/manifest.json"));
  // With room again, the run resumes from step 4 and ends where the uninterrupted one did.
  const auto again = run_command(run + " --steps 8 --out " + dir.file("out") + " --save " + ckpt + " --resume --export " +
                                 dir.file("model") + " 2>&1");
  INFO(again.output);
  REQUIRE(again.exit_code == 0);
  CHECK_THAT(again.output, Catch::Contains("step_00000004 (step 4)"));
  CHECK(file_bytes(dir.file("model") + "/model.safetensors") == file_bytes(dir.file("ref_model") + "/model.safetensors"));
}

TEST_CASE("strata finetune --freeze: the matching tensors come out bit-unchanged under ZeRO-3 on NVMe, the rest "
          "trains, and a pattern that matches nothing is an error",
          "[finetune][freeze]") {
  strata::test::TempDir dir;
  small_model(dir);
  const std::string data = " --data " + kFinetuneExamples + "/data/gpl-3.0.txt --data-format text --seq 32 ";
  // A model to start from, in fp32 (so the comparison below is of the very values loaded).
  const auto first = run_command(strata_binary() + " finetune --init " + dir.file("small.json") + data +
                                 "--steps 1 --out " + dir.file("o1") + " --export " + dir.file("base") +
                                 " --export-dtype fp32 2>&1");
  INFO(first.output);
  REQUIRE(first.exit_code == 0);
  const std::string swap = dir.file("swap");
  const std::string config = write_file(dir, "nvme.json", R"({"train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 3, "sub_group_size": 20000,
      "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("}}})");
  const std::string run = strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                          " --model " + dir.file("base") + data + "--steps 3 --export-dtype fp32 ";
  const auto frozen = run_command(run + "--out " + dir.file("o2") + " --export " + dir.file("tuned") +
                                  " --freeze 'model.embed_tokens.*' --freeze '*norm*' 2>&1");
  INFO(frozen.output);
  REQUIRE(frozen.exit_code == 0);
  // 2 layers of 9 tensors (2 of them norms), the final norm, the table and lm_head (untied): 21.
  CHECK_THAT(frozen.output, Catch::Contains("--freeze: 6 of 21 parameter tensors"));
  const auto base = strata::nn::SafetensorsFile::open(dir.file("base") + "/model.safetensors");
  const auto tuned = strata::nn::SafetensorsFile::open(dir.file("tuned") + "/model.safetensors");
  const auto bytes = [](const strata::nn::SafetensorsFile& f, const std::string& name) {
    const strata::TensorView v = f.view(name);
    return std::string(static_cast<const char*>(v.data), v.nbytes());
  };
  int unchanged = 0, trained = 0;
  for (const std::string& name : base.names()) {
    CAPTURE(name);
    const bool is_frozen = name == "model.embed_tokens.weight" || name.find("norm") != std::string::npos;
    if (is_frozen) {
      CHECK(bytes(base, name) == bytes(tuned, name));
      ++unchanged;
    } else {
      CHECK(bytes(base, name) != bytes(tuned, name));
      ++trained;
    }
  }
  CHECK(unchanged == 6);
  CHECK(trained == 15);
  // A pattern that matches nothing, and one that freezes everything.
  const auto typo = run_command(run + "--out " + dir.file("o3") + " --freeze 'model.embed.*' 2>&1");
  CHECK(typo.exit_code != 0);
  CHECK_THAT(typo.output, Catch::Contains("--freeze 'model.embed.*' matches no parameter of this model"));
  const auto all = run_command(run + "--out " + dir.file("o4") + " --freeze '*' 2>&1");
  CHECK(all.exit_code != 0);
  CHECK_THAT(all.output, Catch::Contains("nothing would be trained"));
}

TEST_CASE("tensor parallelism: a tp 2 x dp 2 finetune with sequence parallelism equals the tp 1 run step by step, "
          "its export holds whole tensors, and killed with SIGKILL and resumed it ends bit for bit like an "
          "uninterrupted run",
          "[finetune][checkpoint][tp]") {
  strata::test::TempDir dir;
  // Qwen2: q/k/v biases (column-parallel, split with their rows).
  write_file(dir, "qwen2.json", R"({"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})");
  const std::string run4 = strata_binary() + " run -n 4 -- " + strata_binary() + " ";
  const std::string run2 = strata_binary() + " run -n 2 -- " + strata_binary() + " ";
  constexpr int kSteps = 12;
  // Sequence parallelism (Megatron's) on top: each tp rank keeps half of each micro-batch's 2 x 32 tokens.
  const std::string tp2 = " --tp 2 --sequence-parallel";
  const auto [reference, reference_took] =
      strata::test::run_timed(run4 + resumable_args(dir, "ref", kSteps, "qwen2.json") + tp2 + " 2>&1");
  INFO(reference.output);
  REQUIRE(reference.exit_code == 0);
  CHECK_THAT(reference.output,
             Catch::Contains("tensor parallelism: 2 tp groups of 2 consecutive ranks split each layer (2 heads, 1 kv "
                             "head(s) and 88 MLP features per rank) and the embedding and lm_head (128 of the 256 "
                             "vocabulary rows per rank), sequence parallel (32 of each micro-batch's 64 tokens per "
                             "rank); ZeRO over 2 data-parallel rank(s)"));
  const std::string expected = file_bytes(dir.file("ref_model") + "/model.safetensors");
  REQUIRE(expected.size() > 1000);

  // The same 2 data-parallel ranks without tensor parallelism read the same
  // batches: the same losses to rounding (sums in another order), and an
  // export of the same tensors, whole.
  const auto whole = run_command(run2 + resumable_args(dir, "whole", kSteps, "qwen2.json") + " 2>&1");
  INFO(whole.output);
  REQUIRE(whole.exit_code == 0);
  const auto tp_steps = read_jsonl(dir.file("ref_out") + "/metrics.jsonl");
  const auto whole_steps = read_jsonl(dir.file("whole_out") + "/metrics.jsonl");
  REQUIRE(tp_steps.size() == kSteps);
  REQUIRE(whole_steps.size() == kSteps);
  for (int i = 0; i < kSteps; ++i) {
    CHECK(tp_steps[i]["loss"].get<double>() == Approx(whole_steps[i]["loss"].get<double>()).epsilon(1e-5));
    CHECK(tp_steps[i]["tokens"] == whole_steps[i]["tokens"]);
  }
  const double max_diff = max_export_difference(dir.file("ref_model"), dir.file("whole_model"));
  WARN("largest |tp 2 x dp 2 - dp 2| over the exported weights after " << kSteps << " steps: " << max_diff);
  CHECK(max_diff < 1e-4);

  // tp 4 with the model's 2 kv heads (two ranks share each), without
  // sequence parallelism, against one rank: the same losses, and the export
  // writes each shared head once.
  const auto four = run_command(run4 + resumable_args(dir, "four", 4, "qwen2.json") + " --tp 4 2>&1");
  INFO(four.output);
  REQUIRE(four.exit_code == 0);
  const auto one = run_command(strata_binary() + " " + resumable_args(dir, "one", 4, "qwen2.json") + " 2>&1");
  INFO(one.output);
  REQUIRE(one.exit_code == 0);
  const auto four_steps = read_jsonl(dir.file("four_out") + "/metrics.jsonl");
  const auto one_steps = read_jsonl(dir.file("one_out") + "/metrics.jsonl");
  REQUIRE(four_steps.size() == 4);
  REQUIRE(one_steps.size() == 4);
  for (int i = 0; i < 4; ++i) {
    CHECK(four_steps[i]["loss"].get<double>() == Approx(one_steps[i]["loss"].get<double>()).epsilon(1e-5));
  }
  const double four_diff = max_export_difference(dir.file("four_model"), dir.file("one_model"));
  CHECK(four_diff < 1e-4);

  // strata export gathers each tensor's tp shards from the checkpoint.
  const auto exported =
      run_command(run4 + "export " + dir.file("ref_ckpt") + " " + dir.file("exported") + " --dtype fp32 2>&1");
  INFO(exported.output);
  REQUIRE(exported.exit_code == 0);
  CHECK(file_bytes(dir.file("exported") + "/model.safetensors") == expected);
  // Loading those weights into tp shards (each rank its rows of every split
  // tensor, the vocabulary's included): the first step's loss is the whole
  // model's, and so is the evaluation after it (the vocabulary-parallel
  // loss without its backward).
  const std::string from_export = " finetune --model " + dir.file("exported") + " --data " + kFinetuneExamples +
                                  "/data/gpl-3.0.txt --data-format text --seq 32 --steps 1 --eval-data " +
                                  kFinetuneExamples + "/data/gpl-3.0.txt --eval-batches 2 --out ";
  const auto loaded_tp = run_command(run4 + from_export + dir.file("loaded_tp") + " --tp 4 2>&1");
  INFO(loaded_tp.output);
  REQUIRE(loaded_tp.exit_code == 0);
  const auto loaded = run_command(strata_binary() + from_export + dir.file("loaded") + " 2>&1");
  INFO(loaded.output);
  REQUIRE(loaded.exit_code == 0);
  const auto tp_metrics = read_jsonl(dir.file("loaded_tp") + "/metrics.jsonl");
  const auto whole_metrics = read_jsonl(dir.file("loaded") + "/metrics.jsonl");
  CHECK(tp_metrics[0]["loss"].get<double>() == Approx(whole_metrics[0]["loss"].get<double>()).epsilon(1e-6));
  REQUIRE(tp_metrics[0].contains("eval_loss"));
  CHECK(tp_metrics[0]["eval_loss"].get<double>() ==
        Approx(whole_metrics[0]["eval_loss"].get<double>()).epsilon(1e-6));
  // Sequence parallelism without tensor parallelism is refused before anything runs.
  const auto alone = run_command(run2 + resumable_args(dir, "alone", 2, "qwen2.json") + " --sequence-parallel 2>&1");
  CHECK(alone.exit_code != 0);
  CHECK_THAT(alone.output, Catch::Contains("--sequence-parallel needs tensor parallelism"));
  // A resume with another tensor parallelism is refused by name.
  const auto other = run_command(run4 + resumable_args(dir, "ref", kSteps + 2, "qwen2.json") + " --resume 2>&1");
  CHECK(other.exit_code != 0);
  CHECK_THAT(other.output, Catch::Contains("is cut for another parallel layout"));

  expect_killed_run_exports(dir, run4 + resumable_args(dir, "killed", kSteps, "qwen2.json") + tp2, expected,
                            "model.safetensors", strata::test::kill_delays_over(reference_took));
  const auto steps = read_jsonl(dir.file("killed_out") + "/metrics.jsonl");
  REQUIRE(steps.size() == kSteps);
  for (int i = 0; i < kSteps; ++i) CHECK(steps[i]["loss"] == tp_steps[i]["loss"]);
}

TEST_CASE("context parallelism: strata run -n 2 -- strata finetune --cp 2 equals one rank step by step, ring and "
          "Ulysses, killed with SIGKILL and resumed bit for bit, the refusals by name",
          "[finetune][checkpoint][cp]") {
  strata::test::TempDir dir;
  small_model(dir);  // 4 heads, 2 kv heads: Ulysses splits them 2 ways
  const std::string run2 = strata_binary() + " run -n 2 -- " + strata_binary() + " ";
  constexpr int kSteps = 10;
  // One rank on the same micro-batches (the two cp ranks read the same samples).
  const auto one = run_command(strata_binary() + " " + resumable_args(dir, "one", kSteps) + " 2>&1");
  INFO(one.output);
  REQUIRE(one.exit_code == 0);
  const auto one_steps = read_jsonl(dir.file("one_out") + "/metrics.jsonl");
  REQUIRE(one_steps.size() == kSteps);
  std::chrono::milliseconds ring_took{0};  // the killed run's uninterrupted twin
  for (const std::string method : {"ring", "ulysses"}) {
    const auto [cp, took] = strata::test::run_timed(run2 + resumable_args(dir, method, kSteps) +
                                                    " --cp 2 --cp-method " + method + " 2>&1");
    if (method == "ring") ring_took = took;
    INFO(cp.output);
    REQUIRE(cp.exit_code == 0);
    CHECK_THAT(cp.output, Catch::Contains("context parallelism: 1 cp groups of 2 ranks split each sequence of 32 tokens "
                                          "into 4 chunks of 8 (two per rank: 16 tokens of each sequence per rank), "
                                          "attention by " + method));
    const auto cp_steps = read_jsonl(dir.file(method + "_out") + "/metrics.jsonl");
    REQUIRE(cp_steps.size() == kSteps);
    for (int i = 0; i < kSteps; ++i) {
      CHECK(cp_steps[i]["loss"].get<double>() == Approx(one_steps[i]["loss"].get<double>()).epsilon(1e-5));
      CHECK(cp_steps[i]["tokens"] == one_steps[i]["tokens"]);
      CHECK(cp_steps[i]["grad_norm"].get<double>() == Approx(one_steps[i]["grad_norm"].get<double>()).epsilon(1e-5));
    }
    const double diff = max_export_difference(dir.file(method + "_model"), dir.file("one_model"));
    WARN("largest |cp 2 " << method << " - 1 rank| over the exported weights after " << kSteps << " steps: " << diff);
    CHECK(diff < 1e-4);
  }
  // cp 4 (8 chunks of 4 tokens, three hops per ring pass), cp 2 x tp 2 with
  // sequence parallelism (a ring per tp rank over its 2 heads and 1 kv head,
  // each tp rank 16 of a cp rank's 32 tokens) against one rank, and dp 2 x
  // cp 2 against the dp 2 run.
  const std::string run4 = strata_binary() + " run -n 4 -- " + strata_binary() + " ";
  const auto four = run_command(run4 + resumable_args(dir, "cp4", kSteps) + " --cp 4 2>&1");
  INFO(four.output);
  REQUIRE(four.exit_code == 0);
  const auto cp2tp2 =
      run_command(run4 + resumable_args(dir, "cp2tp2", kSteps) + " --cp 2 --tp 2 --sequence-parallel 2>&1");
  INFO(cp2tp2.output);
  REQUIRE(cp2tp2.exit_code == 0);
  CHECK_THAT(cp2tp2.output, Catch::Contains("sequence parallel (16 of a cp rank's 32 tokens of each micro-batch per "
                                            "rank)"));
  CHECK_THAT(cp2tp2.output, Catch::Contains("attention by ring over each tp rank's heads (a cp group per tp rank, "
                                            "stride 2)"));
  const auto dp2 = run_command(run2 + resumable_args(dir, "dp2", kSteps) + " 2>&1");
  INFO(dp2.output);
  REQUIRE(dp2.exit_code == 0);
  const auto dp2cp2 = run_command(run4 + resumable_args(dir, "dp2cp2", kSteps) + " --cp 2 2>&1");
  INFO(dp2cp2.output);
  REQUIRE(dp2cp2.exit_code == 0);
  // pp 2 x cp 2: each stage's cp pair splits every sequence, the boundaries
  // between stages a cp rank's rows (zb-h1: the weight gradients deferred too).
  const auto pp2cp2 =
      run_command(run4 + resumable_args(dir, "pp2cp2", kSteps) + " --cp 2 --pp 2 --pp-schedule zb-h1 2>&1");
  INFO(pp2cp2.output);
  REQUIRE(pp2cp2.exit_code == 0);
  for (const auto& [got, want] :
       {std::pair{"cp4", "one"}, std::pair{"cp2tp2", "one"}, std::pair{"dp2cp2", "dp2"}, std::pair{"pp2cp2", "one"}}) {
    const auto got_steps = read_jsonl(dir.file(std::string(got) + "_out") + "/metrics.jsonl");
    const auto want_steps = read_jsonl(dir.file(std::string(want) + "_out") + "/metrics.jsonl");
    REQUIRE(got_steps.size() == kSteps);
    REQUIRE(want_steps.size() == kSteps);
    for (int i = 0; i < kSteps; ++i) {
      CHECK(got_steps[i]["loss"].get<double>() == Approx(want_steps[i]["loss"].get<double>()).epsilon(1e-5));
      CHECK(got_steps[i]["tokens"] == want_steps[i]["tokens"]);
    }
    CHECK(max_export_difference(dir.file(std::string(got) + "_model"), dir.file(std::string(want) + "_model")) < 1e-4);
  }
  // Killed at moments (start-up, steps, checkpoints, the export) and resumed: the ring run's weights, bit for bit.
  const int kills = run_killed_and_resumed(dir, run2 + resumable_args(dir, "killed", kSteps) + " --cp 2",
                                           dir.file("killed_ckpt"), strata::test::kill_delays_over(ring_took));
  INFO("killed " << kills << " times");
  CHECK(kills >= 3);
  CHECK(file_bytes(dir.file("killed_model") + "/model.safetensors") ==
        file_bytes(dir.file("ring_model") + "/model.safetensors"));
  const auto killed_steps = read_jsonl(dir.file("killed_out") + "/metrics.jsonl");
  REQUIRE(killed_steps.size() == kSteps);
  for (int i = 0; i < kSteps; ++i) CHECK(killed_steps[i]["step"].get<int>() == i + 1);
  // strata export rebuilds the run's ZeRO partition over dp x cp from the checkpoint: the run's own export.
  const auto exported =
      run_command(run2 + "export " + dir.file("ring_ckpt") + " " + dir.file("exported") + " --dtype fp32 2>&1");
  INFO(exported.output);
  REQUIRE(exported.exit_code == 0);
  CHECK(file_bytes(dir.file("exported") + "/model.safetensors") ==
        file_bytes(dir.file("ring_model") + "/model.safetensors"));
  // The checkpoints record cp: resuming them as 2 data-parallel ranks is refused.
  const auto other = run_command(run2 + resumable_args(dir, "killed", kSteps + 2) + " --resume 2>&1");
  CHECK(other.exit_code != 0);
  CHECK_THAT(other.output, Catch::Contains("is cut for another parallel layout"));
  CHECK_THAT(other.output, Catch::Contains("context_parallel_size"));
  // Before any step: a sequence that does not cut into 2 x cp chunks, and what is not built yet.
  const std::string data = " --data " + kFinetuneExamples + "/data/gpl-3.0.txt --data-format text --steps 1 --out " +
                           dir.file("refused_out") + " --init " + dir.file("small.json");
  const auto odd = run_command(run2 + "finetune --cp 2 --seq 30" + data + " 2>&1");
  CHECK(odd.exit_code != 0);
  CHECK_THAT(odd.output, Catch::Contains("--seq 30 does not divide by 2 x --cp 2 = 4"));
  // LoRA's adapters are parameters like the others, summed over cp (decoder_cp_test checks its numbers).
  const auto lora = run_command(run2 + "finetune --cp 2 --seq 32 --lora-rank 4 --data " + kFinetuneExamples +
                                "/data/gpl-3.0.txt --data-format text --steps 1 --out " + dir.file("lora_out") +
                                " --init " + dir.file("small.json") + " 2>&1");
  INFO(lora.output);
  CHECK(lora.exit_code == 0);
  CHECK(read_jsonl(dir.file("lora_out") + "/metrics.jsonl").size() == 1);
  const auto ulysses4 = run_command(run4 + "finetune --cp 4 --cp-method ulysses --seq 32" + data + " 2>&1");
  CHECK(ulysses4.exit_code != 0);
  CHECK_THAT(ulysses4.output, Catch::Contains("num_key_value_heads 2 do not both divide by 4 (use \"method\": "
                                              "\"ring\")"));
  // Ulysses at cp 2 x tp 2 splits a tp rank's heads: the model's 2 kv heads leave one per tp rank.
  const auto tp = run_command(run4 + "finetune --cp 2 --tp 2 --cp-method ulysses --seq 32" + data + " 2>&1");
  CHECK(tp.exit_code != 0);
  CHECK_THAT(tp.output, Catch::Contains("with tensor parallelism 2 a rank holds 2 of the num_attention_heads 4 and 1 "
                                        "of the num_key_value_heads 2, which do not both divide by 2"));
}

TEST_CASE("pipeline parallelism: a pp 2 x dp 2 finetune equals the dp 2 run step by step, strata export gathers every "
          "stage, and killed with SIGKILL at random moments and resumed it ends bit for bit",
          "[finetune][checkpoint][pp]") {
  strata::test::TempDir dir;
  tied4_model(dir);
  const std::string run4 = strata_binary() + " run -n 4 -- " + strata_binary() + " ";
  const std::string run2 = strata_binary() + " run -n 2 -- " + strata_binary() + " ";
  constexpr int kSteps = 8;
  const std::string micro = R"("gradient_accumulation_steps": 4,)";
  const std::string pipeline = micro + R"( "pipeline_parallel": {"size": 2, "schedule": "1f1b"},)";
  const auto [reference, reference_took] =
      strata::test::run_timed(run4 + resumable_args(dir, "ref", kSteps, "tied4.json", pipeline) + " 2>&1");
  INFO(reference.output);
  REQUIRE(reference.exit_code == 0);
  CHECK_THAT(reference.output, Catch::Contains("pipeline parallelism: 2 stages of 2 rank(s) each, schedule 1f1b over 4 "
                                               "micro-batches; layers per stage: 2, 2"));
  const std::string expected = file_bytes(dir.file("ref_model") + "/model.safetensors");
  REQUIRE(expected.size() > 1000);

  // The same 2 data-parallel ranks without the pipeline read the same
  // batches: the same losses to rounding (the tied embedding's two halves of
  // the gradient add in another order), an export of the same tensors.
  const auto whole = run_command(run2 + resumable_args(dir, "whole", kSteps, "tied4.json", micro) + " 2>&1");
  INFO(whole.output);
  REQUIRE(whole.exit_code == 0);
  const auto pp_steps = read_jsonl(dir.file("ref_out") + "/metrics.jsonl");
  const auto whole_steps = read_jsonl(dir.file("whole_out") + "/metrics.jsonl");
  REQUIRE(pp_steps.size() == kSteps);
  REQUIRE(whole_steps.size() == kSteps);
  for (int i = 0; i < kSteps; ++i) {
    CHECK(pp_steps[i]["loss"].get<double>() == Approx(whole_steps[i]["loss"].get<double>()).epsilon(1e-5));
    CHECK(pp_steps[i]["tokens"] == whole_steps[i]["tokens"]);
    CHECK(pp_steps[i].contains("pipeline_idle_fraction"));
  }
  const double max_diff = max_export_difference(dir.file("ref_model"), dir.file("whole_model"));
  WARN("largest |pp 2 x dp 2 - dp 2| over the exported weights after " << kSteps << " steps: " << max_diff);
  CHECK(max_diff < 1e-4);

  // strata export assembles every stage's tensors from the checkpoint.
  const auto exported =
      run_command(run4 + "export " + dir.file("ref_ckpt") + " " + dir.file("exported") + " --dtype fp32 2>&1");
  INFO(exported.output);
  REQUIRE(exported.exit_code == 0);
  CHECK(file_bytes(dir.file("exported") + "/model.safetensors") == expected);
  // A resume with another pipeline is refused by name.
  const auto other = run_command(run4 + resumable_args(dir, "ref", kSteps + 2, "tied4.json", micro) + " --resume 2>&1");
  CHECK(other.exit_code != 0);
  CHECK_THAT(other.output, Catch::Contains("is cut for another parallel layout") &&
                               Catch::Contains("pipeline_parallel_size is 2 in the checkpoint, absent in this run"));

  expect_killed_run_exports(dir, run4 + resumable_args(dir, "killed", kSteps, "tied4.json", pipeline), expected,
                            "model.safetensors", strata::test::kill_delays_over(reference_took));
  const auto steps = read_jsonl(dir.file("killed_out") + "/metrics.jsonl");
  REQUIRE(steps.size() == kSteps);
  for (int i = 0; i < kSteps; ++i) CHECK(steps[i]["loss"] == pp_steps[i]["loss"]);
}

TEST_CASE("pipeline parallelism with LoRA: a pp 2 x dp 2 finetune of the adapters equals the dp 2 run step by step, "
          "its PEFT adapter holds every stage's, and killed with SIGKILL and resumed it ends bit for bit",
          "[finetune][checkpoint][pp][lora]") {
  strata::test::TempDir dir;
  tied4_model(dir);
  const std::string run4 = strata_binary() + " run -n 4 -- " + strata_binary() + " ";
  const std::string run2 = strata_binary() + " run -n 2 -- " + strata_binary() + " ";
  constexpr int kSteps = 8;
  // Dropout too: each micro-batch's masks are the same on its stages as on one rank.
  const std::string lora = " --lora-rank 4 --lora-alpha 16 --lora-targets all-linear --lora-dropout 0.1";
  const std::string micro = R"("gradient_accumulation_steps": 4,)";
  const std::string pipeline = micro + R"( "pipeline_parallel": {"size": 2, "schedule": "zb-h1"},)";
  const auto [reference, reference_took] =
      strata::test::run_timed(run4 + resumable_args(dir, "ref", kSteps, "tied4.json", pipeline) + lora + " 2>&1");
  INFO(reference.output);
  REQUIRE(reference.exit_code == 0);
  CHECK_THAT(reference.output, Catch::Contains("pipeline parallelism: 2 stages of 2 rank(s) each, schedule zb-h1"));
  const std::string expected = file_bytes(dir.file("ref_model") + "/adapter_model.safetensors");
  REQUIRE(expected.size() > 1000);

  // The same 2 data-parallel ranks without the pipeline: the same losses to
  // rounding, an adapter of the same tensors (every layer's, both stages').
  const auto whole = run_command(run2 + resumable_args(dir, "whole", kSteps, "tied4.json", micro) + lora + " 2>&1");
  INFO(whole.output);
  REQUIRE(whole.exit_code == 0);
  const auto pp_steps = read_jsonl(dir.file("ref_out") + "/metrics.jsonl");
  const auto whole_steps = read_jsonl(dir.file("whole_out") + "/metrics.jsonl");
  REQUIRE(pp_steps.size() == kSteps);
  REQUIRE(whole_steps.size() == kSteps);
  for (int i = 0; i < kSteps; ++i) {
    CHECK(pp_steps[i]["loss"].get<double>() == Approx(whole_steps[i]["loss"].get<double>()).epsilon(1e-5));
  }
  const auto adapter = strata::nn::SafetensorsFile::open(dir.file("ref_model") + "/adapter_model.safetensors");
  CHECK(adapter.names().size() == 4 * 7 * 2);  // 4 layers x 7 projections x lora_A, lora_B
  const double max_diff = max_export_difference(dir.file("ref_model"), dir.file("whole_model"), "adapter_model.safetensors");
  WARN("largest |pp 2 x dp 2 - dp 2| over the exported adapters after " << kSteps << " steps: " << max_diff);
  CHECK(max_diff < 1e-4);
  CHECK(file_bytes(dir.file("ref_model") + "/adapter_config.json") ==
        file_bytes(dir.file("whole_model") + "/adapter_config.json"));

  expect_killed_run_exports(dir, run4 + resumable_args(dir, "killed", kSteps, "tied4.json", pipeline) + lora, expected,
                            "adapter_model.safetensors", strata::test::kill_delays_over(reference_took));
}
