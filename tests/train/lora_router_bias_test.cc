// DeepSeek's auxiliary-loss-free balancing with LoRA, as a user runs it
// (`strata finetune --lora-rank ... --moe-router-bias-update-rate`): the
// correction biases are buffers, not trained parameters, so they move after
// each applied step beside the adapters; the checkpoints keep them (a resume
// from an earlier step exports the same bytes), the merged export carries
// them, and an adapter-only export, which has no place for them, is refused
// by name (docs/DESIGN.md §4.2.1).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/nn/safetensors.h"
#include "tests/support/finetune_files.h"
#include "tests/support/jsonl.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using strata::test::run_command;
using strata::test::strata_binary;
using strata::test::write_file;
namespace fs = std::filesystem;

namespace {

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("LoRA with the router bias update: the biases move, checkpoints keep them, the merged export carries them, "
          "and an adapter-only export is refused by name",
          "[finetune][lora][deepseek]") {
  strata::test::TempDir dir("lora-router-bias");
  const std::string model = strata::test::source_dir() + "/tests/data/golden/deepseek_v3_qlora_bf16";
  {
    std::ofstream out(dir.file("tokens.u16"), std::ios::binary);
    for (int i = 0; i < 64; ++i) {
      const auto t = static_cast<uint16_t>((i * 11 + 5) % 37);
      out.write(reinterpret_cast<const char*>(&t), sizeof t);
    }
    REQUIRE(out.good());
  }
  const std::string config = write_file(dir, "ds.json", R"({"train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1, "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}, "zero_optimization": {"stage": 3}})");
  constexpr float kRate = 0.01f;
  const std::string common = strata_binary() + " finetune --config " + config + " --model " + model + " --data " +
                             dir.file("tokens.u16") + " --data-format u16 --seq 8 --lora-rank 4 --lora-alpha 8 " +
                             "--lora-targets q_b_proj,o_proj --moe-router-bias-update-rate 0.01 --steps 3 ";
  const auto refused = run_command(common + "--out " + dir.file("r") + " --export " + dir.file("adapter") + " 2>&1");
  CHECK(refused.exit_code != 0);
  CHECK_THAT(refused.output, Catch::Contains("--moe-router-bias-update-rate 0.01 with --lora-rank") &&
                                 Catch::Contains("--merge-lora") && Catch::Contains("e_score_correction_bias"));

  const auto run = run_command(common + "--out " + dir.file("a") + " --save " + dir.file("ckpt") +
                               " --save-every 1 --keep-checkpoints 3 --merge-lora --export " + dir.file("m1") + " 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  const std::string bias = "model.layers.1.mlp.gate.e_score_correction_bias";
  const auto source = strata::nn::SafetensorsFile::open(model + "/model.safetensors");
  const auto exported = strata::nn::SafetensorsFile::open(dir.file("m1") + "/model.safetensors");
  const auto before = source.view(bias), after = exported.view(bias);
  REQUIRE(after.desc.dtype == strata::DType::kF32);
  REQUIRE(after.numel() == 8);
  int moved = 0;
  for (int64_t i = 0; i < after.numel(); ++i) {
    const float b0 = strata::load_as_float(before.data, before.desc.dtype, static_cast<size_t>(i));
    const float b1 = static_cast<const float*>(after.data)[i];
    INFO("expert " << i << ": " << b0 << " -> " << b1);
    // Three steps of +-rate or 0 each.
    CHECK(std::abs(b1 - b0) <= 3 * kRate * 1.0001f);
    if (b1 != b0) ++moved;
  }
  CHECK(moved > 0);
  // Resumed from step 1 (the newer checkpoints removed), the run exports the same bytes: the step-1 checkpoint
  // held the moved biases (without them the resumed steps would route, and move them, from the source's).
  std::vector<fs::path> steps;
  for (const auto& entry : fs::directory_iterator(dir.file("ckpt"))) {
    if (entry.path().filename().string().starts_with("step_")) steps.push_back(entry.path());
  }
  std::sort(steps.begin(), steps.end());
  REQUIRE(steps.size() == 3);
  for (size_t i = 1; i < steps.size(); ++i) fs::remove_all(steps[i]);
  const auto resumed = run_command(common + "--out " + dir.file("b") + " --save " + dir.file("ckpt") +
                                   " --resume --merge-lora --export " + dir.file("m2") + " 2>&1");
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  CHECK(strata::test::read_jsonl(dir.file("b") + "/metrics.jsonl").size() == 2);  // steps 2 and 3 trained again
  CHECK(file_bytes(dir.file("m2") + "/model.safetensors") == file_bytes(dir.file("m1") + "/model.safetensors"));
}
