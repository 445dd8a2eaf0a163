// `strata plan --check`: the metrics.jsonl and run.json parsers' errors, the
// runtime's activation arena against a real DecoderModel's, and a real
// `strata finetune` run (2 ranks, ZeRO-3, NVMe) compared with its plan by the
// strata binary within the default 15%.
#include "runtime/plan/plan_check.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/accelerator.h"
#include "core/error.h"
#include "runtime/engine/resident_engine.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/config/config.h"
#include "runtime/engine/zero_sizes.h"
#include "runtime/plan/runtime_memory.h"
#include "runtime/train/zero_config.h"
#include "runtime/train/run_report.h"
#include "tests/support/finetune_files.h"
#include "tests/support/plan_check.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using strata::Error;
using strata::plan::parse_metrics;
using strata::test::run_command;
using strata::test::strata_binary;

namespace {

const std::string kExamples = strata::test::source_dir() + "/examples/finetune";

// A sanitizer build's processes (this one and the strata it runs) carry
// shadow memory, redzones and a quarantine of freed blocks: their resident
// set is not the runtime's, so no plan can predict it. There the host tier is
// measured but not held to the tolerance (device and NVMe still are).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

std::string record(int step, uint64_t device, uint64_t rss) {
  return nlohmann::json{{"step", step},
                        {"loss", 1.0},
                        {"memory", {{"device_peak_bytes", device}, {"host_peak_rss_bytes", rss}}}}
      .dump();
}

}  // namespace

TEST_CASE("parse_metrics: the highest peaks over the steps", "[plan][check]") {
  const auto m = parse_metrics(
      record(1, 100, 1000) + "\n" + record(2, 300, 900) + "\n\n" + record(3, 200, 1100) + "\n",
      "m.jsonl");
  CHECK(m.steps == 3);
  CHECK(m.device_peak_nbytes == 300);
  CHECK(m.host_peak_rss_nbytes == 1100);
}

TEST_CASE("parse_metrics: bad files are errors naming the file and line", "[plan][check]") {
  using Catch::Contains;
  CHECK_THROWS_WITH(parse_metrics("", "m.jsonl"),
                    Contains("m.jsonl") && Contains("no step records"));
  CHECK_THROWS_WITH(parse_metrics("\n  \n", "m.jsonl"), Contains("no step records"));
  // A run killed while writing its last record.
  const std::string cut = record(2, 1, 1).substr(0, 20);
  CHECK_THROWS_WITH(parse_metrics(record(1, 1, 1) + "\n" + cut, "m.jsonl"),
                    Contains("m.jsonl:2") && Contains("truncated"));
  // Garbage in the middle is corrupt, not truncated.
  CHECK_THROWS_WITH(
      parse_metrics(record(1, 1, 1) + "\n{oops\n" + record(3, 1, 1) + "\n", "m.jsonl"),
      Contains("m.jsonl:2") && Contains("not a JSON object"));
  CHECK_THROWS_WITH(parse_metrics("[1, 2]\n", "m.jsonl"),
                    Contains("m.jsonl:1") && Contains("not a JSON object"));
  CHECK_THROWS_WITH(parse_metrics(R"({"step": 1, "loss": 2})"
                                  "\n",
                                  "m.jsonl"),
                    Contains("m.jsonl:1") && Contains("\"memory\""));
  CHECK_THROWS_WITH(
      parse_metrics(R"({"step": 1, "memory": {"device_peak_bytes": -5, "host_peak_rss_bytes": 1}})"
                    "\n",
                    "m.jsonl"),
      Contains("m.jsonl:1") && Contains("memory.device_peak_bytes"));
  CHECK_THROWS_WITH(
      parse_metrics(R"({"memory": {"device_peak_bytes": 5, "host_peak_rss_bytes": 1}})"
                    "\n",
                    "m.jsonl"),
      Contains("m.jsonl:1") && Contains("\"step\""));
  CHECK_THROWS_WITH(strata::plan::read_metrics("/nonexistent/metrics.jsonl"),
                    Contains("/nonexistent/metrics.jsonl") && Contains("does not exist"));
}

TEST_CASE("run.json records the ZeRO sizes chosen from the model, and reads back as what ran",
          "[plan][check][zero_sizes]") {
  // A ds_config without sub_group_size / reduce_bucket_size: the engine
  // chooses them at finalize; finetune records its choice with
  // configured_run_record, and the plan chooses the same from the same model.
  const strata::Config config =
      strata::parse_config_text(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})");
  REQUIRE(config.zero.sub_group_numel == 0);
  strata::plan::RuntimeInputs in;
  in.model = strata::nn::load_decoder_config(kExamples + "/byte_llama.json");
  in.world_size = 2;
  in.zero = strata::train::zero_engine_options(config, "ds.json");
  const strata::plan::RuntimeMemory planned = strata::plan::runtime_memory(in);
  const strata::engine::ZeroSizes& sizes = planned.zero_sizes;
  CHECK(sizes.sub_group_chosen);
  CHECK(sizes.reduce_bucket_chosen);
  CHECK(sizes.layers == in.model.num_hidden_layers);
  CHECK(sizes.sub_group_numel > 0);
  CHECK(sizes.sub_group_numel < sizes.layer_numel);  // a layer's share of one rank's shard (2 ranks)
  CHECK(sizes.reduce_bucket_numel > sizes.layer_numel);  // a layer's gradients and a norm's

  const auto record = strata::train::configured_run_record(config.effective, in.model.to_json(), sizes);
  const auto back = strata::train::parse_run_record(strata::train::run_record_json(record), "run.json");
  CHECK(back.zero_sizes["sub_group_size"] == sizes.sub_group_numel);
  CHECK(back.zero_sizes["reduce_bucket_size"] == sizes.reduce_bucket_numel);
  CHECK(back.zero_sizes["sub_group_size_chosen"] == true);
  CHECK(back.zero_sizes["why"].get<std::string>() == sizes.describe());
  // `strata plan --check` reads the ds_config back: the sizes that ran, now given.
  const strata::Config again = strata::parse_config(back.ds_config, "run.json");
  CHECK(again.zero.sub_group_numel == static_cast<uint64_t>(sizes.sub_group_numel));
  CHECK(again.zero.reduce_bucket_numel == static_cast<uint64_t>(sizes.reduce_bucket_numel));
  in.zero = strata::train::zero_engine_options(again, "run.json");
  const strata::plan::RuntimeMemory replanned = strata::plan::runtime_memory(in);
  CHECK_FALSE(replanned.zero_sizes.sub_group_chosen);
  CHECK(replanned.pinned_nbytes == planned.pinned_nbytes);
  CHECK(replanned.device_nbytes == planned.device_nbytes);
  CHECK_THROWS_WITH(strata::train::parse_run_record(R"({"argv": [], "cwd": "/", "world_size": 1, "zero_sizes": 3})",
                                                    "d/run.json"),
                    Catch::Contains("\"zero_sizes\" is not a JSON object"));
}

TEST_CASE("run.json round-trips, and a bad one names the file and key", "[plan][check]") {
  strata::train::RunRecord r;
  r.argv = {"strata", "finetune", "--seq", "64"};
  r.cwd = "/tmp/x";
  r.world_size = 2;
  const auto back = strata::train::parse_run_record(strata::train::run_record_json(r), "run.json");
  CHECK(back.argv == r.argv);
  CHECK(back.cwd == r.cwd);
  CHECK(back.world_size == 2);
  CHECK(back.ds_config.is_null());
  r.ds_config = {{"zero_optimization", {{"stage", 3}}}};
  r.model_config = {{"hidden_size", 64}};
  const auto with_configs = strata::train::parse_run_record(strata::train::run_record_json(r), "run.json");
  CHECK(with_configs.ds_config == r.ds_config);
  CHECK(with_configs.model_config == r.model_config);
  using Catch::Contains;
  CHECK_THROWS_WITH(strata::train::parse_run_record(R"({"argv": [], "cwd": "/", "world_size": 1, "ds_config": 3})",
                                                    "d/run.json"),
                    Contains("d/run.json") && Contains("\"ds_config\" is not a JSON object"));
  CHECK_THROWS_WITH(strata::train::parse_run_record("{\"argv\": [", "d/run.json"),
                    Contains("d/run.json") && Contains("not a JSON object"));
  CHECK_THROWS_WITH(
      strata::train::parse_run_record(R"({"cwd": "/", "world_size": 1})", "d/run.json"),
      Contains("\"argv\""));
  CHECK_THROWS_WITH(
      strata::train::parse_run_record(R"({"argv": [], "cwd": "/", "world_size": 0})", "d/run.json"),
      Contains("\"world_size\""));
  CHECK_THROWS_WITH(strata::train::parse_run_record(R"({"argv": [1], "cwd": "/", "world_size": 1})",
                                                    "d/run.json"),
                    Contains("not a string"));
}

namespace {

// A small GQA Llama for the arena checks.
strata::nn::DecoderConfig arena_config(int64_t vocab, int64_t hidden, int64_t intermediate, int64_t layers,
                                     int64_t head_dim) {
  strata::nn::DecoderConfig c;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = intermediate;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = head_dim;
  c.max_position_embeddings = 64;
  return c;
}

// The arena a DecoderModel of `c` with `options` allocates for one batch x seq step.
size_t model_arena_nbytes(const strata::nn::DecoderConfig& c, const strata::nn::DecoderModelOptions& options,
                          int64_t batch, int64_t seq) {
  auto accelerator = strata::make_cpu_accelerator();
  strata::engine::ResidentEngine engine(*accelerator);
  strata::nn::DecoderModel model(engine, c, options);
  engine.finalize();
  strata::nn::initialize_parameters(engine, model.parameters(), 7);
  std::vector<int32_t> ids(batch * seq, 5), targets(batch * seq, 6);
  model.forward(ids, targets, batch, seq);
  model.backward();
  (void)model.loss();
  return model.arena_nbytes();
}

}  // namespace

TEST_CASE("the plan's activation arena is the one DecoderModel allocates", "[plan][check]") {
  const strata::nn::DecoderConfig c = arena_config(256, 64, 176, 3, 16);
  const int64_t batch = 3, seq = 20;
  for (const bool checkpointing : {false, true}) {
    for (const bool cpu_checkpointing : {false, true}) {
      if (cpu_checkpointing && !checkpointing) continue;
      strata::nn::DecoderModelOptions options;
      options.checkpoint_activations = checkpointing;
      options.cpu_checkpointing = cpu_checkpointing;
      INFO("checkpointing " << checkpointing << ", cpu " << cpu_checkpointing);
      CHECK(strata::plan::decoder_arena_nbytes(c, strata::DType::kF32, batch, seq, checkpointing,
                                             cpu_checkpointing) == model_arena_nbytes(c, options, batch, seq));
    }
  }
}

TEST_CASE("the plan's activation arena with LoRA adapters (with and without dropout) is the one DecoderModel allocates",
          "[plan][check]") {
  const strata::nn::DecoderConfig c = arena_config(64, 32, 48, 2, 8);
  const int64_t batch = 2, seq = 12;
  for (const double dropout : {0.0, 0.1}) {
    INFO("dropout " << dropout);
    strata::nn::DecoderModelOptions options;
    options.lora.rank = 3;
    options.lora.alpha = 8;
    options.lora.dropout = dropout;
    options.lora.targets = strata::nn::parse_lora_targets(dropout > 0 ? "q_proj,down_proj" : "all-linear");
    const size_t arena = model_arena_nbytes(c, options, batch, seq);
    CHECK(strata::plan::decoder_arena_nbytes(c, strata::DType::kF32, batch, seq, false, false, options.lora) == arena);
    CHECK(strata::plan::decoder_arena_nbytes(c, strata::DType::kF32, batch, seq, false, false) < arena);
  }
}

namespace {
// Each measured tier of a --check JSON within 15% of its prediction (the
// host's skipped under sanitizers), the swap files exactly when
// `nvme_exact`; returns how many tiers were measured.
int check_measured_tiers(const nlohmann::json& j, bool nvme_exact) {
  int measured = 0;
  for (const auto& tier : j["tiers"]) {
    if (tier["measured_bytes"].is_null()) continue;
    ++measured;
    INFO(tier["tier"]);
    if (nvme_exact && tier["tier"] == "nvme") CHECK(tier["predicted_bytes"] == tier["measured_bytes"]);
    if (kSanitized && tier["tier"] == "host resident") continue;
    CHECK(tier["ratio"].get<double>() > 0.85);
    CHECK(tier["ratio"].get<double>() < 1.15);
  }
  return measured;
}
}  // namespace

TEST_CASE("strata plan --check: a LoRA finetune (2 ranks, ZeRO-3, base and optimizer on NVMe) "
          "agrees with its plan, its swap files exactly",
          "[plan][check][finetune]") {
  strata::test::TempDir dir("plan-check-lora");
  // The quick start's config, keeping its swap files so the NVMe tier is measured.
  std::ifstream example(std::string(kExamples) + "/ds_zero3_nvme.json");
  auto ds = nlohmann::json::parse(example);
  ds["strata"]["keep_swap_files"] = true;
  // Without its sizes: the engine chooses them from the adapters' layers, and
  // the plan, choosing from the same tensor list, predicts the swap files exactly.
  ds["zero_optimization"].erase("sub_group_size");
  ds["zero_optimization"].erase("reduce_bucket_size");
  strata::test::write_file(dir, "ds.json", ds.dump());
  const std::string out = dir.file("out");
  const auto run = run_command(
      "cd " + dir.path().string() + " && " + strata_binary() + " run -n 2 -- " + strata_binary() +
      " finetune --config ds.json --init " + kExamples + "/byte_llama.json --data " + kExamples +
      "/data/gpl-3.0.txt --data-format text --steps 2 --seq 256 --lora-rank 8 --lora-targets "
      "all-linear --out " + out + " 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);

  const auto check = run_command(strata_binary() + " plan --check " + out + " --json");
  INFO(check.output);
  const auto j = nlohmann::json::parse(check.output);
  if (!kSanitized) {
    CHECK(check.exit_code == 0);
    CHECK(j["ok"] == true);
  }
  CHECK(j["run"]["lora"]["rank"] == 8);
  {
    std::ifstream record_file(out + "/run.json");
    const auto record = nlohmann::json::parse(record_file);
    CHECK(record["zero_sizes"]["sub_group_size_chosen"] == true);
    CHECK(record["zero_sizes"]["reduce_bucket_size_chosen"] == true);
    CHECK(record["ds_config"]["zero_optimization"]["sub_group_size"] == record["zero_sizes"]["sub_group_size"]);
    CHECK_THAT(run.output, Catch::Contains("ZeRO sizes: sub_group_size"));
  }
  CHECK(j["run"]["lora"]["targets"].size() == 7);
  // The base's and the adapters' parameter files, the adapters' gradient
  // file and optimizer slots: exactly what the plan lists.
  CHECK(check_measured_tiers(j, true) == 3);
  // Without the run's LoRA flags the plan would be the full model's: the
  // optimizer state files are the adapters' only, far smaller.
  double optimizer_files = 0, parameter_file = 0;
  for (const auto& item : j["items"]) {
    if (item["name"] == "optimizer state files") optimizer_files = item["bytes"].get<double>();
    if (item["name"] == "parameter file") parameter_file = item["bytes"].get<double>();
  }
  CHECK(optimizer_files > 0);
  CHECK(optimizer_files < parameter_file);
}

TEST_CASE("strata plan --check: a tensor- and sequence-parallel finetune (tp 2 x dp 2, ZeRO-3, parameters and "
          "optimizer on NVMe) agrees with its plan, its swap files exactly",
          "[plan][check][finetune][tp]") {
  strata::test::TempDir dir("plan-check-tp");
  std::ifstream example(std::string(kExamples) + "/ds_zero3_nvme.json");
  auto ds = nlohmann::json::parse(example);
  ds["strata"]["keep_swap_files"] = true;
  ds["zero_optimization"].erase("sub_group_size");  // chosen from rank 0's tensors, by the plan too
  ds["zero_optimization"].erase("reduce_bucket_size");
  strata::test::write_file(dir, "ds.json", ds.dump());
  const std::string out = dir.file("out");
  const auto run = run_command("cd " + dir.path().string() + " && " + strata_binary() + " run -n 4 -- " +
                               strata_binary() + " finetune --config ds.json --init " + kExamples +
                               "/byte_llama.json --data " + kExamples +
                               "/data/gpl-3.0.txt --data-format text --steps 2 --seq 128 --tp 2 --sequence-parallel "
                               "--out " + out + " 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  const auto check = run_command(strata_binary() + " plan --check " + out + " --json");
  INFO(check.output);
  const auto j = nlohmann::json::parse(check.output);
  if (!kSanitized) {
    CHECK(check.exit_code == 0);
    CHECK(j["ok"] == true);
  }
  // Rank 0's files: its replicated tensors' group and its tp shards' group,
  // each a parameter file and optimizer slots, exactly what the plan lists.
  CHECK(check_measured_tiers(j, true) == 3);
  // The arena is a tp rank's with sequence parallelism: what decoder_arena_nbytes gives.
  double arena = 0;
  for (const auto& item : j["items"]) {
    if (item["name"] == "activation arena") arena = item["bytes"].get<double>();
  }
  const strata::nn::DecoderConfig c = strata::nn::load_decoder_config(std::string(kExamples) + "/byte_llama.json");
  CHECK(arena == static_cast<double>(strata::plan::decoder_arena_nbytes(c, strata::DType::kF32, 4, 128, false, false,
                                                                       {}, 1, 2, true)));
}

TEST_CASE("strata plan --check: a real 2-rank ZeRO-3 NVMe finetune agrees with its plan within 15%",
          "[plan][check][finetune]") {
  strata::test::TempDir dir("plan-check");
  // The quick start's model and config (examples/finetune), copied (removed
  // below: --check must not need them), fewer steps: the config's relative
  // swap path lands in the run's working directory.
  const std::string out = dir.file("out");
  std::filesystem::copy_file(std::string(kExamples) + "/ds_zero3_nvme.json", dir.file("ds.json"));
  std::filesystem::copy_file(std::string(kExamples) + "/byte_llama.json", dir.file("model.json"));
  const auto run = run_command(
      "cd " + dir.path().string() + " && " + strata_binary() + " run -n 2 -- " + strata_binary() +
      " finetune --config ds.json --init model.json --data " + kExamples +
      "/data/gpl-3.0.txt --data-format text --steps 2 --seq 256 --out " + out + " 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  REQUIRE(std::filesystem::exists(out + "/run.json"));

  const auto check = run_command(strata_binary() + " plan --check " + out + " --json");
  INFO(check.output);
  if (!kSanitized) {
    CHECK(check.exit_code == 0);
    CHECK(nlohmann::json::parse(check.output)["ok"] == true);
  }
  const auto j = nlohmann::json::parse(check.output);
  CHECK(j["run"]["world_size"] == 2);
  CHECK(j["run"]["seq"] == 256);
  int measured = 0;
  for (const auto& tier : j["tiers"]) {
    if (tier["measured_bytes"].is_null()) continue;
    ++measured;
    if (kSanitized && tier["tier"] == "host resident") continue;
    INFO(tier["tier"]);
    CHECK(tier["ratio"].get<double>() > 0.85);
    CHECK(tier["ratio"].get<double>() < 1.15);
  }
  CHECK(measured == 2);  // device and host resident; the swap files are gone after the run

  // The configurations come from run.json as the run read them: the files
  // may change or go, the prediction stays.
  CHECK_THAT(j["run"]["sources"]["config"].get<std::string>(), Catch::Contains("as the run read it"));
  std::filesystem::remove(dir.file("ds.json"));
  strata::test::write_file(dir, "model.json", "{ not json");
  const auto again = run_command(strata_binary() + " plan --check " + out + " --json");
  INFO(again.output);
  REQUIRE(again.exit_code == check.exit_code);
  const auto k = nlohmann::json::parse(again.output);
  for (size_t t = 0; t < j["tiers"].size(); ++t) {
    CHECK(k["tiers"][t]["predicted_bytes"] == j["tiers"][t]["predicted_bytes"]);
  }

  // A tolerance no prediction meets fails with exit status 1 and says which tier.
  const auto strict =
      run_command(strata_binary() + " plan --check " + out + "/metrics.jsonl --tolerance 0% 2>&1");
  INFO(strict.output);
  CHECK(strict.exit_code == 1);
  CHECK_THAT(strict.output, Catch::Contains("NO") && Catch::Contains("outside 0%"));

  // Flags of a planned job mean nothing to --check, and --check's flags nothing without it.
  const auto mixed = run_command(strata_binary() + " plan --check " + out + " --gpus 8 2>&1");
  CHECK(mixed.exit_code != 0);
  CHECK_THAT(mixed.output, Catch::Contains("--gpus") && Catch::Contains("--check"));
  const auto stray = run_command(strata_binary() + " plan --params 7.5B --tolerance 5% 2>&1");
  CHECK(stray.exit_code != 0);
  CHECK_THAT(stray.output, Catch::Contains("--tolerance goes with --check"));

  // A truncated metrics file is an error naming the file and line, not a comparison.
  std::ifstream in(out + "/metrics.jsonl");
  std::string first;
  std::getline(in, first);
  const std::string broken = dir.file("broken");
  std::filesystem::create_directories(broken);
  std::filesystem::copy_file(out + "/run.json", broken + "/run.json");
  strata::test::write_file(dir, "broken/metrics.jsonl", first + "\n" + first.substr(0, first.size() / 2));
  const auto bad = run_command(strata_binary() + " plan --check " + broken + " 2>&1");
  INFO(bad.output);
  CHECK(bad.exit_code != 0);
  CHECK_THAT(bad.output, Catch::Contains("metrics.jsonl:2") && Catch::Contains("truncated"));
}

TEST_CASE("strata plan --check on a live run measures rank 0's swap files against the plan",
          "[plan][check][finetune]") {
  strata::test::TempDir dir("plan-check-live");
  const std::string out = dir.file("out"), done = dir.file("rc");
  // In the background, long enough (60 steps, ~20 s) to be checked while its swap files exist.
  const std::string start = "(cd " + dir.path().string() + " && " + strata_binary() +
                            " run -n 2 -- " + strata_binary() + " finetune --config " + kExamples +
                            "/ds_zero3_nvme.json --init " + kExamples + "/byte_llama.json --data " +
                            kExamples +
                            "/data/gpl-3.0.txt --data-format text --steps 60 --seq 256 --out " +
                            out + " > " + dir.file("log") + " 2>&1; echo $? > " + done + ") &";
  REQUIRE(std::system(start.c_str()) == 0);
  const auto wait_for = [](const std::function<bool()>& ready, int seconds) {
    for (int i = 0; i < seconds * 10 && !ready(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return ready();
  };
  const bool stepped = wait_for(
      [&] {
        std::ifstream metrics(out + "/metrics.jsonl");
        std::string line;
        return std::getline(metrics, line) && !metrics.eof();  // one whole line
      },
      120);
  std::optional<nlohmann::json> j;
  if (stepped) {
    const auto check = run_command(strata_binary() + " plan --check " + out + " --json");
    INFO(check.output);
    if (!kSanitized) CHECK(check.exit_code == 0);
    j = nlohmann::json::parse(check.output);
  }
  // Never leave the run behind, whatever happened above.
  REQUIRE(wait_for([&] { return std::filesystem::exists(done); }, 180));
  std::ifstream log(dir.file("log"));
  INFO(std::string(std::istreambuf_iterator<char>(log), {}));
  REQUIRE(stepped);
  REQUIRE(j.has_value());
  bool nvme_measured = false;
  for (const auto& tier : (*j)["tiers"]) {
    if (tier["tier"] != "nvme") continue;
    REQUIRE_FALSE(tier["measured_bytes"].is_null());
    nvme_measured = true;
    // The swap files are preallocated: the prediction is their exact size.
    CHECK(tier["measured_bytes"] == tier["predicted_bytes"]);
  }
  CHECK(nvme_measured);
}

TEST_CASE("the plan's micro-batch slots per pipeline chunk are the schedule's micro-batches in flight",
          "[plan][check][pp]") {
  namespace pipeline = strata::pipeline;
  for (const pipeline::ScheduleKind kind : {pipeline::ScheduleKind::kGpipe, pipeline::ScheduleKind::k1F1B,
                                            pipeline::ScheduleKind::kZbH1, pipeline::ScheduleKind::kInterleaved}) {
    for (int p = 2; p <= 4; ++p) {
      for (int m = p; m <= 8; m += p) {
        const int v = kind == pipeline::ScheduleKind::kInterleaved ? 2 : 1;
        const pipeline::Schedule schedule = pipeline::make_schedule({kind, p, m, v});
        const pipeline::Simulation sim = pipeline::simulate(schedule);
        REQUIRE(sim.error.empty());
        for (int r = 0; r < p; ++r) {
          CAPTURE(pipeline::schedule_name(kind), p, m, r);
          const strata::plan::ChunkSlots slots = strata::plan::pipeline_chunk_slots(schedule, r);
          int total = 0;
          for (int n : slots.slots) total += n;
          // One chunk: its slots are the rank's peak in flight; several: each chunk's own peaks add up to at least it.
          if (v == 1) CHECK(total == sim.peak_in_flight[static_cast<size_t>(r)]);
          CHECK(total >= sim.peak_in_flight[static_cast<size_t>(r)]);
          CHECK(total <= v * m);
          // Only a split backward leaves weight gradients waiting, on at most its slots.
          CHECK((slots.awaiting_weight_grads[0] > 0) == schedule.spec.split_backward());
          CHECK(slots.awaiting_weight_grads[0] <= slots.slots[0]);
        }
      }
    }
  }
}

namespace {

// A finetune of byte_llama under `strata run -n ranks` with the example's
// ZeRO-3 NVMe config, 4 micro-batches (sizes chosen from the tensors, by the
// plan too) and `strata` / `pipeline` merged in, 2 steps of seq 64 into
// dir/out; then `strata plan --check` of it, as JSON.
nlohmann::json check_accumulating_run(const strata::test::TempDir& dir, int ranks, const nlohmann::json& strata_keys,
                                      const nlohmann::json& pipeline = nullptr) {
  std::ifstream example(std::string(kExamples) + "/ds_zero3_nvme.json");
  auto ds = nlohmann::json::parse(example);
  if (!strata_keys.is_null()) ds["strata"] = strata_keys;
  ds["zero_optimization"].erase("sub_group_size");
  ds["zero_optimization"].erase("reduce_bucket_size");
  ds["gradient_accumulation_steps"] = 4;
  if (!pipeline.is_null()) ds["pipeline_parallel"] = pipeline;
  strata::test::write_file(dir, "ds.json", ds.dump());
  const std::string out = dir.file("out");
  const auto run = run_command("cd " + dir.path().string() + " && " + strata_binary() + " run -n " +
                               std::to_string(ranks) + " -- " + strata_binary() +
                               " finetune --config ds.json --init " + kExamples + "/byte_llama.json --data " +
                               kExamples + "/data/gpl-3.0.txt --data-format text --steps 2 --seq 64 --out " + out +
                               " 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  const auto check = run_command(strata_binary() + " plan --check " + out + " --json");
  INFO(check.output);
  return nlohmann::json::parse(check.output);
}

// Every tier of a check `j` measured; the activations row `activations` and
// the swap files exactly as predicted; the device peak within the tolerance
// (the host row of so small a run is the process's own allocator slack: check_notes).
void check_exact_tiers(const nlohmann::json& j, const std::string& activations) {
  for (const auto& tier : j["tiers"]) {
    CAPTURE(tier["tier"]);
    REQUIRE(!tier["measured_bytes"].is_null());
    if (tier["tier"] == "device (cpu)" && !kSanitized) CHECK(tier["within_tolerance"] == true);
  }
  strata::test::check_tier_exact(j, activations);
  strata::test::check_tier_exact(j, "nvme");
}

// The same with `pipeline` (the swap files kept to be measured, or not).
nlohmann::json check_pipeline_run(const strata::test::TempDir& dir, int ranks, const nlohmann::json& pipeline,
                                  bool keep_swap_files) {
  return check_accumulating_run(dir, ranks,
                                keep_swap_files ? nlohmann::json{{"keep_swap_files", true}} : nlohmann::json(nullptr),
                                pipeline);
}

}  // namespace

TEST_CASE("strata plan --check: a pipeline-parallel finetune (pp 2 x dp 2, zb-h1, 4 micro-batches, ZeRO-3, "
          "parameters and optimizer on NVMe) is checked as pp rank 0's share: its arenas and swap files exactly",
          "[plan][check][finetune][pp]") {
  strata::test::TempDir dir("plan-check-pp");
  const auto j = check_pipeline_run(dir, 4, {{"size", 2}, {"schedule", "zb-h1"}}, true);
  CHECK(j["run"]["pipeline"]["size"] == 2);
  CHECK(j["run"]["pipeline"]["schedule"] == "zb-h1");
  CHECK(j["run"]["pipeline"]["layers"] == nlohmann::json({2, 2}));
  // pp rank 0's arenas (zb-h1 keeps 2 micro-batches in flight on it: 2
  // slots of 2 layers) and its stage's swap files (the embedding and layers
  // 0-1 only), exactly; its device peak within the tolerance (the host row
  // of so small a run is the process's own allocator slack: check_notes).
  check_exact_tiers(j, "activations (pp rank 0)");
  const strata::nn::DecoderConfig c = strata::nn::load_decoder_config(std::string(kExamples) + "/byte_llama.json");
  strata::nn::DecoderConfig two = c;
  two.num_hidden_layers = 2;
  for (const auto& item : j["items"]) {
    CHECK(item["name"] != "loss logits scratch");  // the last stage's
    if (item["name"] == "activation arenas") {
      CHECK(item["bytes"] == 2 * strata::plan::decoder_arena_nbytes(two, strata::DType::kF32, 4, 64, false, false));
    }
  }
}

TEST_CASE("strata plan --check: a layer-major finetune (2 ranks, 4 micro-batches, ZeRO-3 on NVMe) is checked: its "
          "arenas and boundaries, recomputing or keeping, on the device or nvme, exactly",
          "[plan][check][finetune][layer-major]") {
  const strata::nn::DecoderConfig c = strata::nn::load_decoder_config(std::string(kExamples) + "/byte_llama.json");
  for (const bool keep : {false, true}) {
    for (const std::string boundaries : {"device", "nvme"}) {
      CAPTURE(keep, boundaries);
      strata::test::TempDir dir("plan-check-layer-major");
      const auto j = check_accumulating_run(dir, 2,
                                            {{"micro_batch_order", "layer-major"},
                                             {"layer_major_activations", keep ? "keep" : "recompute"},
                                             {"layer_major_boundaries", boundaries},
                                             {"keep_swap_files", true}});
      CHECK(j["run"]["micro_batch_order"] == nlohmann::json({{"order", "layer-major"},
                                                             {"micro_batches", 4},
                                                             {"activations", keep ? "keep" : "recompute"},
                                                             {"boundaries", boundaries}}));
      check_exact_tiers(j, "activations (layer-major)");
      // The arenas: each of the 4 layers' (one layer each), the embedding's
      // and the head's (no layer, no layer scratch); one each recomputing;
      // keeping, one per micro-batch, but the head's (each micro-batch's
      // backward follows its forward there). The boundaries: 4 micro-batches
      // x (5 chunk inputs + the gradient flowing down) of 4 x 64 rows x 128 fp32.
      const auto arena = [&](const strata::pipeline::StagePart& part) {
        return strata::plan::decoder_chunk_arena_nbytes(c, part, strata::DType::kF32, 4, 64, false, false);
      };
      size_t arenas = (keep ? 4 : 1) * arena({0, 0, true, false}) + arena({4, 0, false, true});
      for (int64_t l = 0; l < 4; ++l) arenas += (keep ? 4 : 1) * arena({l, 1, false, false});
      CHECK(arena({0, 0, true, false}) < arena({0, 1, false, false}));
      const size_t boundary = 4 * 64 * 128 * 4;
      bool boundaries_seen = false;
      for (const auto& item : j["items"]) {
        CAPTURE(item["name"]);
        if (item["name"] == "activation arenas") CHECK(item["bytes"] == arenas);
        if (item["name"] == "layer-major boundaries") {
          boundaries_seen = true;
          CHECK(item["where"] == boundaries);
          // On nvme the file has a place per (chunk, micro-batch) instead, the
          // gradients in pinned memory: as many places, each already aligned.
          CHECK(item["bytes"] == 4 * 6 * boundary);
        }
      }
      CHECK(boundaries_seen);
    }
  }
}

TEST_CASE("strata plan --check holds a 1F1B and an interleaved pipeline run's device peak within its tolerance",
          "[plan][check][finetune][pp]") {
  // pp 2, 4 micro-batches, ZeRO-3 on NVMe. The executor waits for each
  // compute action before it enqueues the next: a host a step ahead of the
  // stream held every micro-batch's stream-ordered frees (gradients awaiting
  // reduction, gathered parameters) at once, 1.29x (1F1B) and 1.16x
  // (interleaved) the prediction here.
  for (const std::string schedule : {"1f1b", "interleaved"}) {
    CAPTURE(schedule);
    strata::test::TempDir dir("plan-check-pp-" + schedule);
    nlohmann::json pipeline = {{"size", 2}, {"schedule", schedule}};
    if (schedule == "interleaved") pipeline["virtual_stages"] = 2;
    const auto j = check_pipeline_run(dir, 2, pipeline, false);
    CHECK(j["run"]["pipeline"]["schedule"] == schedule);
    int held = 0;
    for (const auto& tier : j["tiers"]) {
      CAPTURE(tier["tier"]);
      if (tier["tier"] == "activations (pp rank 0)") {
        CHECK(tier["predicted_bytes"] == tier["measured_bytes"]);
        ++held;
      }
      if (tier["tier"] == "device (cpu)" && !kSanitized) {
        CHECK(tier["within_tolerance"] == true);
        ++held;
      }
    }
    CHECK(held == (kSanitized ? 1 : 2));
  }
}

TEST_CASE("context parallelism: a sequence whose activation checkpoints exceed strata.pinned_pool_size at cp 1 and "
          "cp 2 trains at cp 4 within it, and strata plan --check holds the cp run to its plan",
          "[plan][check][finetune][cp]") {
  strata::test::TempDir dir("plan-check-cp");
  // 4 layers of hidden 64 with checkpoints in pinned host memory: at --seq
  // 1024 the 3 lower layers' inputs are 3 x 1024 x 64 fp32 = 786432 bytes on
  // one rank, half that at cp 2, a quarter at cp 4; the budget, 256 KiB,
  // holds only the last (with the staged inputs: ids, targets and positions
  // per row, the document arrays over the whole sequence).
  strata::test::write_file(dir, "long.json", R"({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})");
  strata::test::write_file(dir, "ds.json", R"({"train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
    "activation_checkpointing": {"cpu_checkpointing": true}, "strata": {"pinned_pool_size": 262144}})");
  const std::string finetune = " finetune --config ds.json --init long.json --data " + kExamples +
                               "/data/gpl-3.0.txt --data-format text --steps 2 --seq 1024 --out ";
  const std::string in_dir = "cd " + dir.path().string() + " && ";
  const auto one = run_command(in_dir + strata_binary() + finetune + "out1 2>&1");
  CHECK(one.exit_code != 0);
  CHECK_THAT(one.output, Catch::Contains("strata.pinned_pool_size is 262144 bytes, but this run pins") &&
                             Catch::Contains("activation checkpoints 786432 bytes") &&
                             Catch::Contains("split each sequence over more ranks, --cp"));
  const auto two = run_command(in_dir + strata_binary() + " run -n 2 -- " + strata_binary() + finetune +
                               "out2 --cp 2 2>&1");
  CHECK(two.exit_code != 0);
  CHECK_THAT(two.output, Catch::Contains("activation checkpoints 393216 bytes"));
  const auto four = run_command(in_dir + strata_binary() + " run -n 4 -- " + strata_binary() + finetune +
                                "out4 --cp 4 2>&1");
  INFO(four.output);
  REQUIRE(four.exit_code == 0);
  const auto check = run_command(strata_binary() + " plan --check " + dir.file("out4") + " --json");
  INFO(check.output);
  const auto j = nlohmann::json::parse(check.output);
  // The cp rank's arena and its ring buffers as the run counts them, exactly;
  // the pinned staging and checkpoints within the budget.
  strata::test::check_tier_exact(j, "activations (cp rank, s/4)");
  double pinned = 0;
  for (const auto& item : j["items"]) {
    if (item["where"] == "pinned host") pinned += item["bytes"].get<double>();
    if (item["name"] == "activation checkpoints") CHECK(item["bytes"] == 196608);
  }
  CHECK(pinned <= 262144);
  // The device row is measured and held too (the host row of so small a run
  // is the process's own allocator slack: check_notes says so).
  for (const auto& tier : j["tiers"]) {
    if (tier["tier"] != "device (cpu)" || kSanitized) continue;
    CHECK(tier["ratio"].get<double>() > 0.85);
    CHECK(tier["ratio"].get<double>() < 1.15);
  }
}
