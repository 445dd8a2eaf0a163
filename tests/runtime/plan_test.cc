// `strata plan`: the papers' figures (ZeRO's 7.5B / N_d = 64 table and
// ZeRO-Infinity's 0.1T model), the efficiency model, placements and the
// recommendation, and the command as a user runs it, bad input included.
#include "runtime/plan/plan.h"
#include "runtime/plan/order_plan.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "runtime/config/config.h"
#include "core/error.h"
#include "runtime/train/zero_config.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using namespace strata::plan;
using strata::test::run_command;
using strata::test::strata_binary;

namespace {

// Rounds to one decimal, as the papers print their tables.
double one_decimal(double value) {
  return std::round(value * 10) / 10;
}

PlanInputs paper_7_5b() {
  PlanInputs in;
  in.model.param_count = 7'500'000'000;
  in.machine.data_parallel = 64;  // 4 DGX-2 nodes of 16 GPUs
  in.machine.gpus_per_node = 16;
  in.machine.nodes = 4;
  return in;
}

const PlacementPlan& find(const Plan& plan, Placement p) {
  for (const auto& pp : plan.placements) {
    if (pp.placement == p) return pp;
  }
  FAIL("placement missing: " << describe(p));
  throw;
}

// `strata plan --model` on a llama-shaped config.json written to a temporary
// directory, with the flags every run of a test shares: the tp, cp and pp
// tests' setup.
struct LlamaPlan {
  strata::test::TempDir dir;
  std::string plan;  // the command up to the flags each run adds

  LlamaPlan(int64_t vocab, int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads, int64_t kv_heads,
            int64_t max_positions, const std::string& flags) {
    std::ofstream(dir.file("config.json"))
        << nlohmann::json{{"model_type", "llama"},          {"vocab_size", vocab},
                          {"hidden_size", hidden},          {"intermediate_size", intermediate},
                          {"num_hidden_layers", layers},    {"num_attention_heads", heads},
                          {"num_key_value_heads", kv_heads}, {"max_position_embeddings", max_positions},
                          {"rms_norm_eps", 1e-5},           {"tie_word_embeddings", false}}
               .dump();
    plan = strata_binary() + " plan --model " + dir.file("config.json") + " " + flags + " ";
  }
  strata::test::CommandResult run(const std::string& flags) const { return run_command(plan + flags + " 2>&1"); }
  // The plan with `flags` added, as --json prints it (it must run).
  nlohmann::json json(const std::string& flags) const {
    const auto result = run(flags + " --json");
    INFO(result.output);
    REQUIRE(result.exit_code == 0);
    return nlohmann::json::parse(result.output);
  }
  // The plan with `flags` added, refused: its message.
  std::string refusal(const std::string& flags) const {
    const auto result = run(flags);
    CHECK(result.exit_code != 0);
    return result.output;
  }
  // A ds_config beside the model, for --config.
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(dir.file(name)) << text;
    return dir.file(name);
  }
};

}  // namespace

TEST_CASE("plan: ZeRO paper's 7.5B model on N_d = 64 (Figure 1)", "[plan]") {
  constexpr int64_t kPsi = 7'500'000'000;
  CHECK(one_decimal(zero_model_states_per_rank(kPsi, 0, 64) / 1e9) == 120.0);
  CHECK(one_decimal(zero_model_states_per_rank(kPsi, 1, 64) / 1e9) == 31.4);
  CHECK(one_decimal(zero_model_states_per_rank(kPsi, 2, 64) / 1e9) == 16.6);
  CHECK(one_decimal(zero_model_states_per_rank(kPsi, 3, 64) / 1e9) == 1.9);

  // The plan's placements without offload hold exactly those model states on the GPU.
  const Plan plan = make_plan(paper_7_5b());
  const std::array<double, 4> expected{120.0, 31.4, 16.6, 1.9};
  for (int stage = 0; stage <= 3; ++stage) {
    const PlacementPlan& pp = find(plan, {stage, Tier::kGpu, Tier::kGpu});
    const double model_states = pp.param16.gpu + pp.grad16.gpu + pp.optimizer.gpu;
    CHECK(one_decimal(model_states / 1e9) == expected[static_cast<size_t>(stage)]);
    CHECK(model_states == plan.zero_stage_nbytes[static_cast<size_t>(stage)]);
    CHECK(pp.total.cpu == 0);
    CHECK(pp.total.nvme == 0);
  }
  CHECK(plan.model_states_nbytes == 120e9);
}

TEST_CASE("plan: ZeRO-Infinity's 0.1T model has 1.83 TB of model states (Table 1)", "[plan]") {
  // 80 layers of hidden size 10K, where the paper's K is 1024 and its TB is
  // 2^40 bytes: 12·L·h² = 1.007e11 parameters, 20 bytes each (fp32 gradients counted).
  const int64_t psi = transformer_param_count(80, 10 * 1024);
  CHECK(psi == 100'663'296'000);
  PlanInputs in;
  in.model.param_count = psi;
  in.model.layers = 80;
  in.model.hidden = 10 * 1024;
  const Plan plan = make_plan(in);
  CHECK(plan.model_states_with_grad32_nbytes == 240.0 * 80 * 10240.0 * 10240.0);
  CHECK(std::round(plan.model_states_with_grad32_nbytes / 0x1p40 * 100) / 100 == 1.83);
  // ZeRO's own count, 16 bytes per parameter, is 4/5 of it.
  CHECK(plan.model_states_nbytes == 0.8 * plan.model_states_with_grad32_nbytes);
}

TEST_CASE("plan: ZeRO-Infinity's bandwidth figures", "[plan]") {
  // Parameters and gradients: AIT = seq·bsz; at the smallest batch (1, seq
  // 1024) and 70 TFLOPS, 50% efficiency needs about 70 GB/s.
  CHECK(bandwidth_for_efficiency(1024, 0.5, 70e12) == Approx(68.4e9).epsilon(0.01));
  CHECK(efficiency(1024, 68.359375e9, 70e12) == Approx(0.5));
  // Activation checkpoints (AIT = 24·h·c_i) need a few GB/s for 90% at h = 8K.
  const double checkpoints = bandwidth_for_efficiency(24.0 * 8192, 0.9, 70e12);
  CHECK(checkpoints > 1e9);
  CHECK(checkpoints < 4e9);

  // The plan's per-rank intensities are the paper's on one rank: everything
  // offloaded to CPU moves 2 bytes x 4 per parameter (3 loads with recompute,
  // 1 gradient), and the optimizer reads and writes 16 bytes per parameter.
  PlanInputs in;
  in.model.param_count = 1'000'000'000;
  in.training.seq = 1024;
  in.training.micro_batch = 2;
  const Plan plan = make_plan(in);
  CHECK(plan.ait_params_grads == 2048);
  CHECK(plan.ait_optimizer == 512);
  for (Tier optimizer : {Tier::kCpu, Tier::kNvme}) {
    const PlacementPlan& pp = find(plan, {3, Tier::kCpu, optimizer});
    REQUIRE(pp.traffic.size() == 2);
    CHECK(pp.traffic[0].name == "params_grads");
    CHECK(pp.traffic[0].ait == Approx(2048));
    CHECK(pp.traffic[1].name == "optimizer");
    CHECK(pp.traffic[1].ait == Approx(512));
  }
  // With N_d ranks each moves only its shard over its own link
  // (bandwidth-centric partitioning): the intensity per rank grows N_d-fold.
  in.machine.data_parallel = 8;
  in.machine.gpus_per_node = 8;
  const Plan spread = make_plan(in);
  CHECK(find(spread, {3, Tier::kCpu, Tier::kCpu}).traffic[0].ait == Approx(8 * 2048));
  // Without offload there is no host traffic, and without an interconnect
  // bandwidth no collective is counted: compute alone.
  CHECK(find(spread, {3, Tier::kGpu, Tier::kGpu}).traffic.empty());
  CHECK(find(spread, {3, Tier::kGpu, Tier::kGpu}).predicted_efficiency == 1.0);
}

TEST_CASE("plan: the valid placements are ds_config's", "[plan]") {
  const auto all = valid_placements();
  CHECK(all.size() == 14);  // stage 0; 1 and 2 x optimizer gpu|cpu|nvme; stage 3 x 3 x 3 but params offloaded with optimizer gpu
  for (const Placement& p : all) CHECK(placement_valid(p));
  CHECK(placement_valid({1, Tier::kGpu, Tier::kNvme}));  // beyond DeepSpeed: any stage swaps its optimizer shard
  CHECK_FALSE(placement_valid({3, Tier::kCpu, Tier::kGpu}));
  // Every combination: valid and run by strata (stage >= 1; stage 0 is
  // planned for reference only) exactly when the config accepts it.
  const auto device = [](Tier t) { return t == Tier::kGpu ? "none" : t == Tier::kCpu ? "cpu" : "nvme"; };
  for (int stage = 0; stage <= 3; ++stage) {
    for (Tier params : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) {
      for (Tier optimizer : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) {
        CAPTURE(stage, device(params), device(optimizer));
        const std::string text = std::string(R"({"zero_optimization": {"stage": )") + std::to_string(stage) +
                                 R"(, "offload_param": {"device": ")" + device(params) +
                                 R"(", "nvme_path": "/tmp/swap"}, "offload_optimizer": {"device": ")" +
                                 device(optimizer) + R"(", "nvme_path": "/tmp/swap"}}})";
        bool accepted = true;
        try {
          const strata::Config config = strata::parse_config_text(text, "ds.json");
          strata::train::zero_engine_options(config, "ds.json");
        } catch (const strata::Error& e) {
          INFO(e.what());
          accepted = false;
        }
        CHECK((placement_valid({stage, params, optimizer}) && stage >= 1) == accepted);
      }
    }
  }
}

TEST_CASE("plan: activations and working memory follow ZeRO-Infinity's formulas", "[plan]") {
  PlanInputs in;
  in.model.param_count = transformer_param_count(4, 1024);
  in.model.layers = 4;
  in.model.hidden = 1024;
  in.model.heads = 16;
  in.training.seq = 512;
  in.training.micro_batch = 2;
  const Plan plan = make_plan(in);
  REQUIRE(plan.activations_checkpointed);
  REQUIRE(plan.activations_full);
  // 2·bsz·seq·h·L/c_i checkpoints; bsz·seq·(16h + 2·heads·seq) per layer.
  CHECK(plan.activations_checkpointed->checkpoints == 2.0 * 2 * 512 * 1024 * 4);
  const double layer = 2.0 * 512 * (16 * 1024 + 2 * 16 * 512);
  CHECK(plan.activations_checkpointed->working == layer);
  CHECK(plan.activations_full->total() == 4 * layer);
  // The h->4h linear, weight and gradient in 16 bits: 4·h·4h bytes.
  CHECK(plan.working_whole_nbytes == 4.0 * 1024 * 4096);
  CHECK(plan.working_tiled_nbytes == plan.working_whole_nbytes / 16);

  // At h = 64K that is 64 GiB (ZeRO-Infinity §5.1.3).
  in.model.hidden = 64 * 1024;
  in.model.param_count = transformer_param_count(4, in.model.hidden);
  CHECK(make_plan(in).working_whole_nbytes == 0x1p36);

  // A vocabulary wider than the MLP makes the embedding the largest operator.
  in.model.hidden = 1024;
  in.model.vocab = 50'000;
  in.model.param_count = transformer_param_count(4, 1024);
  const Plan with_vocab = make_plan(in);
  CHECK(with_vocab.largest_operator_numel == 50'000.0 * 1024);
}

TEST_CASE("plan: the recommendation is the fastest placement that fits", "[plan]") {
  PlanInputs in = paper_7_5b();
  in.machine.data_parallel = 1;
  in.machine.gpus_per_node = 1;
  in.machine.nodes = 1;
  in.machine.host_nbytes = 1e12;
  in.machine.nvme_nbytes = 4e12;
  in.machine.gpu_nbytes = 80e9;
  Plan plan = make_plan(in);
  REQUIRE(plan.recommended);
  const PlacementPlan& pick = plan.placements[*plan.recommended];
  CHECK(pick.fits());
  for (const auto& pp : plan.placements) {
    if (pp.fits() && pp.placement.stage >= 1) CHECK(pp.predicted_efficiency <= pick.predicted_efficiency + 1e-3);
  }
  // 120 GB of model states do not fit on an 80 GB GPU: something is offloaded.
  CHECK(pick.placement.optimizer != Tier::kGpu);
  CHECK_FALSE(find(plan, {0, Tier::kGpu, Tier::kGpu}).fits());
  CHECK_THAT(find(plan, {0, Tier::kGpu, Tier::kGpu}).shortfall, Catch::Contains("GPU needs 12"));
  CHECK_THAT(plan.reason, Catch::Contains("does not fit"));

  // With room for everything stage 1 on the GPU wins: nothing to move. Stage
  // 0 fits too, and is planned (ZeRO's baseline), but strata does not run it.
  in.machine.gpu_nbytes = 400e9;
  plan = make_plan(in);
  REQUIRE(plan.recommended);
  CHECK(find(plan, {0, Tier::kGpu, Tier::kGpu}).fits());
  CHECK(plan.placements[*plan.recommended].placement == Placement{1, Tier::kGpu, Tier::kGpu});

  // Unknown GPU memory: nothing is known to fit, and the plan says so.
  in.machine.gpu_nbytes.reset();
  plan = make_plan(in);
  CHECK_FALSE(plan.recommended);
  CHECK_THAT(plan.reason, Catch::Contains("no placement is known to fit"));
}

TEST_CASE("plan: the largest operator is tiled when it does not fit whole", "[plan]") {
  PlanInputs in;
  in.model.layers = 4;
  in.model.hidden = 64 * 1024;
  in.model.param_count = transformer_param_count(4, in.model.hidden);
  in.machine.gpu_nbytes = 32e9;  // less than the 64 GiB operator
  in.machine.host_nbytes = 2e12;
  in.machine.nvme_nbytes = 100e12;
  const Plan plan = make_plan(in);
  const PlacementPlan& pp = find(plan, {3, Tier::kNvme, Tier::kNvme});
  CHECK(pp.fits());
  CHECK(pp.needs_tiling);
  CHECK(pp.working.gpu == plan.working_tiled_nbytes);
}

TEST_CASE("plan: LoRA keeps the base's weights only and trains the adapters in fp32", "[plan]") {
  // ψ = 1000 frozen, ψ_a = 100 adapters, N_d = 2, no shape: model states alone.
  PlanInputs in;
  in.model.param_count = 1000;
  in.lora = LoraShape{8, {"q_proj", "v_proj"}, 100};
  in.machine.data_parallel = 2;
  in.machine.gpus_per_node = 2;
  const Plan plan = make_plan(in);
  REQUIRE(plan.lora);
  // Base 2 B/param = 2000; adapters (4 + 4 + 12) B/param = 2000; full
  // fine-tuning of the base 16 B/param = 16000.
  CHECK(plan.lora->base_nbytes == 2000);
  CHECK(plan.lora->adapter_nbytes == 2000);
  CHECK(plan.lora->full_finetune_nbytes == 16000);
  CHECK(plan.lora->ratio == 0.25);
  CHECK(plan.model_states_nbytes == 4000);
  // ZeRO's stages over the adapters' states, the base's weights whole below stage 3.
  CHECK(plan.zero_stage_nbytes[0] == 4000);
  CHECK(plan.zero_stage_nbytes[1] == 2000 + 400 + 400 + 600);
  CHECK(plan.zero_stage_nbytes[2] == 2000 + 400 + 800);
  CHECK(plan.zero_stage_nbytes[3] == 2000);
  // A frozen weight has no weight gradient: 3 passes for the base, 4 for the
  // adapters (checkpointing), 2 flops per parameter and token, 1024 tokens.
  CHECK(plan.flops_per_step == 2.0 * 1024 * (3 * 1000 + 4 * 100));

  const PlacementPlan& s1 = find(plan, {1, Tier::kGpu, Tier::kGpu});
  CHECK(s1.param16.gpu == 2 * 1000 + 4 * 100);
  CHECK(s1.grad16.gpu == 4 * 100);
  CHECK(s1.optimizer.gpu == 12 * 50);
  CHECK(s1.grad32.gpu == 0);
  CHECK(s1.total.gpu == 2400 + 400 + 600);
  // Stage 3, parameters and optimizer on CPU: the shard of base and adapters
  // on CPU, the adapters' optimizer state and fp32 gradient shard beside it;
  // on the GPU the prefetch bucket (16-bit, capped by ψ + ψ_a) and the reduce
  // bucket of the adapters' fp32 gradients.
  const PlacementPlan& s3 = find(plan, {3, Tier::kCpu, Tier::kCpu});
  CHECK(s3.param16.cpu == (2 * 1000 + 4 * 100) / 2);
  CHECK(s3.grad16.gpu == 0);
  CHECK(s3.optimizer.cpu == 12 * 50);
  CHECK(s3.grad32.cpu == 4 * 50);
  CHECK(s3.total.cpu == 1200 + 600 + 200);
  CHECK(s3.buffers.gpu == 2 * 1100 + 4 * 100);
  CHECK(s3.total.gpu == 2600);
  // Its traffic: 3 loads of the weight shard up, the adapters' fp32 gradient
  // shard down (their update stays on the host, where the shard lives).
  REQUIRE(!s3.traffic.empty());
  CHECK(s3.traffic[0].name == "params_grads");
  CHECK(s3.traffic[0].nbytes == 3 * 1200 + 4 * 50);
  // Stage 2 with the optimizer on CPU: the adapters' gradient shard down and
  // their updated shard up; the frozen base never moves.
  CHECK(find(plan, {2, Tier::kGpu, Tier::kCpu}).traffic[0].nbytes == 4 * 50 + 4 * 50);

  // Without LoRA the same base is ZeRO's.
  in.lora.reset();
  const Plan full = make_plan(in);
  CHECK(!full.lora);
  CHECK(full.model_states_nbytes == 16000);
  CHECK(find(full, {1, Tier::kGpu, Tier::kGpu}).total.gpu == 2000 + 2000 + 6000);

  // With a shape: the operator is fetched without a gradient, and the two
  // [rows, r] 16-bit scratch buffers join the working activations.
  in.model.layers = 2;
  in.model.hidden = 32;
  in.model.heads = 4;
  in.model.intermediate = 48;
  const Plan no_lora = make_plan(in);
  in.lora = LoraShape{8, {"q_proj", "v_proj"}, 100};
  const Plan with_lora = make_plan(in);
  CHECK(with_lora.working_whole_nbytes == 2 * 32 * 48);
  CHECK(no_lora.working_whole_nbytes == 4 * 32 * 48);
  CHECK(with_lora.activations_checkpointed->working ==
        no_lora.activations_checkpointed->working + 2 * 1024 * 8 * 2);

  in.lora->adapter_count = 0;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("LoRA adapters"));
  in.lora->adapter_count = 100;
  in.lora->rank = 0;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("LoRA rank"));
}

TEST_CASE("plan: bad inputs are errors that name them", "[plan]") {
  PlanInputs in;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("parameter count"));
  in.model.param_count = 1000;
  in.target_efficiency = 1.0;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("target efficiency"));
  in.target_efficiency = 0.9;
  in.machine.gpu_cpu_bw = -1;
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("GPU<->CPU bandwidth"));
  in.machine.gpu_cpu_bw = 25e9;
  in.model.layers = 4;  // without a hidden size
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("hidden"));
  CHECK_THROWS_AS(zero_model_states_per_rank(1000, 4, 1), strata::Error);
}

// --- The command -------------------------------------------------------------

TEST_CASE("strata plan --json: the ZeRO figures and every placement", "[plan][cli]") {
  const auto result = run_command(strata_binary() +
                                  " plan --params 7.5B --dp 64 --gpus 16 --gpu-mem 32GB "
                                  "--host-mem 1.5TB --nvme-capacity 30TB --json");
  REQUIRE(result.exit_code == 0);
  const auto plan = nlohmann::json::parse(result.output);
  CHECK(plan["model"]["param_count"] == 7'500'000'000);
  CHECK(plan["machine"]["data_parallel"] == 64);
  CHECK(plan["machine"]["gpus_per_node"] == 16);
  CHECK(plan["machine"]["gpu_bytes"] == 32'000'000'000);
  CHECK(plan["sources"]["data_parallel"] == "--dp");
  const auto& stages = plan["model_states"]["zero_stages"];
  REQUIRE(stages.size() == 4);
  CHECK(stages[0]["bytes_per_rank"] == 120'000'000'000);
  CHECK(stages[1]["bytes_per_rank"] == 31'406'250'000);
  CHECK(stages[2]["bytes_per_rank"] == 16'640'625'000);
  CHECK(stages[3]["bytes_per_rank"] == 1'875'000'000);
  REQUIRE(plan["placements"].size() == 14);
  for (const auto& pp : plan["placements"]) {
    CHECK(pp.contains("gpu"));
    CHECK(pp["gpu"].contains("total_bytes"));
    CHECK(pp["predicted_efficiency"].get<double>() > 0);
    CHECK(pp["predicted_efficiency"].get<double>() <= 1);
  }
  REQUIRE(plan["recommendation"].is_object());
  CHECK(plan["recommendation"]["stage"].get<int>() >= 1);
  CHECK(!plan["reason"].get<std::string>().empty());
  CHECK(plan["bandwidth_needed_bytes_per_s"].contains("params_grads"));

  // The table prints the paper's figures as it does.
  const auto text =
      run_command(strata_binary() + " plan --params 7.5B --dp 64 --gpus 16 --gpu-mem 32GB");
  REQUIRE(text.exit_code == 0);
  CHECK_THAT(text.output, Catch::Contains("120.0 GB") && Catch::Contains("31.4 GB") &&
                              Catch::Contains("16.6 GB") && Catch::Contains("1.9 GB") &&
                              Catch::Contains("Recommended"));
}

TEST_CASE("strata plan: the 0.1T model from layers and hidden size", "[plan][cli]") {
  const auto result =
      run_command(strata_binary() + " plan --layers 80 --hidden 10240 --gpu-mem 32GB --json");
  REQUIRE(result.exit_code == 0);
  const auto plan = nlohmann::json::parse(result.output);
  CHECK(plan["model"]["param_count"] == 100'663'296'000);
  CHECK(plan["model_states"]["bytes_with_fp32_grads"] == 2'013'265'920'000);
  CHECK(plan["activations"]["checkpointed"].is_object());
  CHECK(plan["working_memory"]["whole_bytes"] == 4 * 10240 * 40960);
  // In binary units the paper's 1.83 TB is 1875 GiB.
  const auto text =
      run_command(strata_binary() + " plan --layers 80 --hidden 10240 --gpu-mem 32GB --units GiB");
  REQUIRE(text.exit_code == 0);
  CHECK_THAT(text.output, Catch::Contains("1875.0 GiB at 20 B/param"));
}

TEST_CASE("strata plan: a Hugging Face config and a ds_config", "[plan][cli]") {
  strata::test::TempDir dir;
  {
    std::ofstream out(dir.file("config.json"));
    out << R"({"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
               "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 2048})";
  }
  const auto result =
      run_command(strata_binary() + " plan --model " + dir.path().string() + " --config " +
                  strata::test::source_dir() +
                  "/tests/runtime/configs/ds_zero3_nvme.json --gpus 1 --gpu-mem 16GB "
                  "--nvme-path " +
                  dir.path().string() + " --seq 512 --json");
  REQUIRE(result.exit_code == 0);
  const auto plan = nlohmann::json::parse(result.output);
  CHECK(plan["model"]["layers"] == 8);
  CHECK(plan["model"]["heads"] == 16);
  CHECK(plan["model"]["vocab"] == 32000);
  // DecoderConfig::parameter_count: embedding and lm_head 2·32000·1024, 8 layers
  // of q,o 1024² + k,v 2·1024·256 + MLP 3·1024·2816 + two norms, the final norm.
  CHECK(plan["model"]["param_count"] == 155'730'944);
  // train_micro_batch_size_per_gpu and gradient_accumulation_steps come from the config.
  CHECK(plan["training"]["micro_batch"] == 2);
  CHECK(plan["training"]["grad_accumulation"] == 2);
  CHECK(plan["training"]["seq"] == 512);
  CHECK(plan["machine"]["nvme_bytes"].get<uint64_t>() > 0);
  int configured = 0;
  for (const auto& pp : plan["placements"]) {
    if (!pp["configured"].get<bool>()) continue;
    ++configured;
    CHECK(pp["stage"] == 3);
    CHECK(pp["params"] == "nvme");
    CHECK(pp["optimizer"] == "nvme");
  }
  CHECK(configured == 1);
  CHECK(plan["working_memory"]["operator"].get<std::string>().find("embedding") !=
        std::string::npos);
}

TEST_CASE("strata plan: bad input names the flag or file", "[plan][cli]") {
  struct Case {
    std::string args, expected;
  };
  const std::vector<Case> cases = {
      {"--model /nonexistent/strata/config.json", "/nonexistent/strata/config.json"},
      {"--layers -5 --hidden 1024", "--layers"},
      {"--params -7B", "--params"},
      {"--params 7.5X", "--params"},
      {"--params 7.5B --gpu-mem lots", "--gpu-mem"},
      {"--params 7.5B --bw-nvme -3", "--bw-nvme"},
      {"--params 7.5B --target-efficiency 1.5", "--target-efficiency"},
      {"--params 7.5B --dp 64 --gpus 8 --nodes 1", "--dp 64"},
      {"--layers 32", "--hidden"},
      {"", "no model"},
      {"--params 7.5B --config /nonexistent/ds.json", "/nonexistent/ds.json"},
      {"--params 7.5B --nvme-path /nonexistent/nvme", "/nonexistent/nvme"},
  };
  for (const Case& c : cases) {
    INFO(c.args);
    const auto result = run_command(strata_binary() + " plan " + c.args + " 2>&1");
    CHECK(result.exit_code == 1);
    CHECK_THAT(result.output, Catch::Contains(c.expected));
    CHECK_THAT(result.output, !Catch::Contains("internal error"));
  }
  // A model file that is not a Llama config.
  strata::test::TempDir dir;
  {
    std::ofstream out(dir.file("config.json"));
    out << R"({"hidden_size": 1024})";
  }
  const auto result =
      run_command(strata_binary() + " plan --model " + dir.file("config.json") + " 2>&1");
  CHECK(result.exit_code == 1);
  CHECK_THAT(result.output, Catch::Contains("config.json") && Catch::Contains("vocab_size"));
}

TEST_CASE("strata plan --model of a mixture of experts: compute counts the active parameters, memory every expert",
          "[plan][cli][moe]") {
  const auto plan = [](const std::string& fixture) {
    const auto result = run_command(strata_binary() + " plan --model " + strata::test::source_dir() + "/tests/data/golden/" +
                                    fixture + " --gpu-mem 1GB --json");
    REQUIRE(result.exit_code == 0);
    return nlohmann::json::parse(result.output);
  };
  // Mixtral: 2 layers, hidden 32, 8 experts of width 8, top 2: a token skips
  // 6 experts x 3 matrices of 8 x 32 per layer, 2 x 6 x 768 = 9216 parameters.
  const auto mixtral = plan("mixtral_untied_f32");
  const int64_t total = mixtral["model"]["param_count"].get<int64_t>();
  CHECK(mixtral["model"]["experts"] == 8);
  CHECK(mixtral["model"]["experts_per_token"] == 2);
  CHECK(mixtral["model"]["intermediate"] == 8);
  CHECK(mixtral["model"]["active_param_count"].get<int64_t>() == total - 9216);
  // flops: 2 per active parameter and token, 4 passes (checkpointing), seq 1024.
  CHECK(mixtral["compute"]["flops_per_step"].get<double>() ==
        Approx(2.0 * 4 * 1024 * static_cast<double>(total - 9216)));
  // Model states: every parameter, 16 bytes each at stage 0.
  CHECK(mixtral["model_states"]["zero_stages"][0]["bytes_per_rank"].get<double>() == Approx(16.0 * total));
  // qwen3_moe's expert width is moe_intermediate_size, not intermediate_size.
  const auto qwen = plan("qwen3_moe_untied_f32");
  CHECK(qwen["model"]["experts"] == 8);
  CHECK(qwen["model"]["intermediate"] == 8);
  CHECK(qwen["model"]["shared_expert_intermediate"] == 0);
  // qwen2_moe: the same 9216 idle routed-expert parameters; its shared expert
  // (3 x 16 x 32 per layer) and gate (32) are active for every token.
  const auto qwen2 = plan("qwen2_moe_untied_f32");
  const int64_t qwen2_total = qwen2["model"]["param_count"].get<int64_t>();
  CHECK(qwen2["model"]["shared_expert_intermediate"] == 16);
  CHECK(qwen2["model"]["active_param_count"].get<int64_t>() == qwen2_total - 9216);
  // A dense model: every parameter is active.
  const auto dense = plan("llama_untied_f32");
  CHECK(dense["model"]["experts"] == 0);
  CHECK(dense["model"]["active_param_count"] == dense["model"]["param_count"]);
}

TEST_CASE("strata plan says what its active count includes: gpt-oss-120b's 5.71B with the input embedding and "
          "OpenAI's 5.13B without it, Gemma 3 27B's text model as transformers counts it",
          "[plan][cli][moe]") {
  const std::string configs = strata::test::source_dir() + "/tests/data/configs/";
  const auto oss = run_command(strata_binary() + " plan --model " + configs + "gpt-oss-120b.json --gpu-mem 141GB 2>&1");
  INFO(oss.output);
  REQUIRE(oss.exit_code == 0);
  CHECK_THAT(oss.output, Catch::Contains("Model     116.83B parameters"));
  CHECK_THAT(oss.output, Catch::Contains("active per token: 5.71B parameters with the input embedding, 5.13B "
                                         "without it (its 201088 x 2880 table is a lookup"));
  const auto json = run_command(strata_binary() + " plan --model " + configs + "gpt-oss-120b.json --gpu-mem 141GB --json");
  REQUIRE(json.exit_code == 0);
  const auto j = nlohmann::json::parse(json.output);
  CHECK(j["model"]["param_count"] == 116829156672);  // transformers 5.24's (tests/nn/nn_real_configs_test.cc)
  CHECK(j["model"]["active_param_count"] == 5711982912);
  CHECK(j["model"]["active_param_count_without_input_embedding"] == 5132849472);
  // Gemma 3 27B: the published checkpoint's text_config as a config.json
  // (the same text model as the multimodal one, below): transformers' 27,009,346,304
  // (scripts/count-hf-params), every parameter active, the embedding tied.
  strata::test::TempDir dir;
  std::ifstream in(configs + "gemma-3-27b-it.json");
  const auto published = nlohmann::json::parse(in);
  std::ofstream(dir.file("gemma3_text.json")) << published.at("text_config").dump();
  const auto gemma = run_command(strata_binary() + " plan --model " + dir.file("gemma3_text.json") +
                                 " --gpu-mem 141GB --json");
  INFO(gemma.output);
  REQUIRE(gemma.exit_code == 0);
  const auto g = nlohmann::json::parse(gemma.output);
  CHECK(g["model"]["param_count"] == 27009346304);
  CHECK(g["model"]["active_param_count"] == 27009346304);
  CHECK(g["model"]["active_param_count_without_input_embedding"] == 27009346304);
  const auto text = run_command(strata_binary() + " plan --model " + dir.file("gemma3_text.json") + " --gpu-mem 141GB 2>&1");
  CHECK_THAT(text.output, Catch::Contains("active per token: 27.01B parameters, the embedding included (tied to "
                                          "lm_head"));
  // The published multimodal config: its text model planned, the whole
  // checkpoint counted as transformers counts Gemma3ForConditionalGeneration.
  const auto mm = run_command(strata_binary() + " plan --model " + configs + "gemma-3-27b-it.json --gpu-mem 141GB --json");
  INFO(mm.output);
  REQUIRE(mm.exit_code == 0);
  const auto m = nlohmann::json::parse(mm.output);
  CHECK(m["model"]["param_count"] == 27009346304);
  CHECK(m["model"]["checkpoint_param_count"] == 27432406640);
  CHECK(g["model"]["checkpoint_param_count"] == 27009346304);
  const auto mm_text = run_command(strata_binary() + " plan --model " + configs + "gemma-3-27b-it.json --gpu-mem 141GB 2>&1");
  CHECK_THAT(mm_text.output, Catch::Contains("Gemma3ForConditionalGeneration checkpoint of 27.43B parameters: its vision "
                                             "tower and projector (423.06M) are carried to the export untrained"));
}

TEST_CASE("strata plan --model of a mixture of experts on 4 GPUs: expert parallelism as finetune chooses it",
          "[plan][cli][moe]") {
  const auto plan = [](const std::string& args) {
    const auto result = run_command(strata_binary() + " plan --model " + strata::test::source_dir() +
                                    "/tests/data/golden/mixtral_untied_f32 --gpu-mem 1GB --gpus 4 --seq 512 " + args +
                                    " 2>&1");
    INFO(result.output);
    REQUIRE(result.exit_code == 0);
    return result.output;
  };
  // 8 experts over 4 ranks: 2 each; micro-batch 1 x 512 tokens x top 2 = 1024
  // rows per rank, up to 4096 received; per layer (hidden 32, width 8) at most
  // 2 bytes x 4096 x (3 x 8 + 32); the exchange 4 x 2 layers x 1024 x 32 x 2
  // bytes x 3/4.
  const auto ep = nlohmann::json::parse(plan("--json"))["expert_parallel"];
  CHECK(ep["size"] == 4);
  CHECK(ep["experts_per_rank"] == 2);
  CHECK(ep["max_rows_per_rank"] == 4096);
  CHECK(ep["max_expert_activation_bytes_per_layer"].get<double>() == Approx(2.0 * 4096 * 56));
  CHECK(ep["exchange_bytes_per_micro_step"].get<double>() == Approx(4.0 * 2 * 1024 * 32 * 2 * 0.75));
  CHECK_THAT(plan(""), Catch::Contains("expert parallelism 4 (moe.expert_parallel_size): each rank holds 2 experts"));
  // 3 ranks do not divide 8 experts: every rank holds every expert, nothing said.
  const auto three = run_command(strata_binary() + " plan --model " + strata::test::source_dir() +
                                 "/tests/data/golden/mixtral_untied_f32 --gpu-mem 1GB --gpus 3 --json");
  REQUIRE(three.exit_code == 0);
  CHECK_FALSE(nlohmann::json::parse(three.output).contains("expert_parallel"));
}

TEST_CASE("plan: an FP8 checkpoint's LoRA base counts 1 byte per FP8 parameter and its scales at ZeRO-3, 2 below",
          "[plan][quant]") {
  // ψ = 1000 blocks of 128 x 128, 800 of them FP8; ψ_a = 100; N_d = 2.
  constexpr double kBlock = 128 * 128;
  PlanInputs in;
  in.model.param_count = static_cast<int64_t>(1000 * kBlock);
  in.lora = LoraShape{8, {"q_proj", "v_proj"}, 100};
  in.lora->quantized_param_count = static_cast<int64_t>(800 * kBlock);
  in.machine.data_parallel = 2;
  in.machine.gpus_per_node = 2;
  const Plan plan = make_plan(in);
  REQUIRE(plan.lora);
  const double base = 2 * 200 * kBlock + 800 * kBlock + 4 * 800;  // 16-bit rest, e4m3, a scale per block
  CHECK(plan.lora->base_nbytes == Approx(base));
  CHECK(plan.lora->base_bytes_per_param == Approx(base / (1000 * kBlock)));
  CHECK(plan.lora->base_bytes_per_param < 1.21);
  CHECK(plan.zero_stage_nbytes[3] == Approx((base + 2000) / 2));
  CHECK(plan.zero_stage_nbytes[2] == Approx(2 * 1000 * kBlock + 400 + 800));  // below stage 3: dequantized
  CHECK(find(plan, {3, Tier::kNvme, Tier::kCpu}).param16.nvme == Approx((base + 400) / 2));
  CHECK(find(plan, {1, Tier::kGpu, Tier::kGpu}).param16.gpu == Approx(2 * 1000 * kBlock + 400));
  // Without FP8 weights the base is 16-bit at every stage.
  in.lora->quantized_param_count = 0;
  CHECK(make_plan(in).lora->base_bytes_per_param == 2);
  in.lora->quantized_param_count = static_cast<int64_t>(1001 * kBlock);
  CHECK_THROWS_WITH(make_plan(in), Catch::Contains("FP8 parameters"));
  // MXFP4 (gpt-oss's experts): 4.25 bits each.
  in.lora->quantized_param_count = static_cast<int64_t>(640 * kBlock);
  in.lora->quantized_bytes_per_param = 17.0 / 32.0;
  in.lora->quantized_format = "MXFP4";
  CHECK(make_plan(in).lora->base_nbytes == Approx(2 * 360 * kBlock + 640 * kBlock * 17 / 32));
}

TEST_CASE("strata plan --lora-rank: the adapters counted from the model's shapes", "[plan][cli]") {
  const std::string model = strata::test::source_dir() + "/tests/data/golden/llama_untied_f32";
  const auto lora = [&](const std::string& args) {
    const auto result = run_command(strata_binary() + " plan " + args + " --gpu-mem 1GB --json");
    REQUIRE(result.exit_code == 0);
    return nlohmann::json::parse(result.output);
  };
  // GQA: hidden 32, 4 heads of 8, 2 key/value heads (k, v are 32 -> 16),
  // intermediate 48, 2 layers. Rank 8: q, o 8·(32+32) = 512, k, v 8·(32+16)
  // = 384, gate, up, down 8·(32+48) = 640.
  const auto all = lora("--model " + model + " --lora-rank 8 --lora-targets all-linear");
  CHECK(all["lora"]["adapter_param_count"] == 2 * (2 * 512 + 2 * 384 + 3 * 640));
  CHECK(all["lora"]["base_param_count"] == 19'424);
  CHECK(all["model"]["param_count"] == 19'424);
  CHECK(all["lora"]["rank"] == 8);
  CHECK(all["lora"]["targets"].size() == 7);
  CHECK(all["lora"]["base_bytes"] == 2 * 19'424);
  CHECK(all["lora"]["adapter_bytes"] == 20 * 7'424);
  CHECK(all["lora"]["model_states_bytes"] == 2 * 19'424 + 20 * 7'424);
  CHECK(all["lora"]["full_finetune_bytes"] == 16 * 19'424);
  CHECK(all["lora"]["ratio_to_full_finetune"].get<double>() ==
        Approx((2.0 * 19'424 + 20.0 * 7'424) / (16.0 * 19'424)));
  CHECK(all["model_states"]["bytes"] == 2 * 19'424 + 20 * 7'424);
  // PEFT's default targets, q_proj and v_proj.
  const auto qv = lora("--model " + model + " --lora-rank 8");
  CHECK(qv["lora"]["adapter_param_count"] == 2 * (512 + 384));
  CHECK(qv["lora"]["targets"] == nlohmann::json({"q_proj", "v_proj"}));
  // PEFT's own adapters (the golden fixtures, written by PEFT 0.21.2): the
  // plan counts every element of adapter_model.safetensors.
  for (const char* fixture : {"lora_llama_f32_all", "lora_qwen2_f32_attn"}) {
    INFO(fixture);
    const std::string dir = strata::test::source_dir() + "/tests/data/golden/" + fixture;
    std::ifstream config_file(dir + "/adapter_config.json");
    const auto peft = nlohmann::json::parse(config_file);
    std::string targets;
    for (const auto& t : peft.at("target_modules"))
      targets += (targets.empty() ? "" : ",") + t.get<std::string>();
    std::ifstream weights(dir + "/adapter_model.safetensors", std::ios::binary);
    uint64_t header_size = 0;
    weights.read(reinterpret_cast<char*>(&header_size), 8);  // little-endian, as this host
    std::string header(header_size, '\0');
    weights.read(header.data(), static_cast<std::streamsize>(header_size));
    int64_t numel = 0;
    const auto tensors = nlohmann::json::parse(header);
    for (auto it = tensors.begin(); it != tensors.end(); ++it) {
      if (it.key() == "__metadata__") continue;
      int64_t n = 1;
      for (const auto& d : it.value().at("shape")) n *= d.get<int64_t>();
      numel += n;
    }
    REQUIRE(numel > 0);
    const auto planned = lora("--model " + dir + " --lora-rank " +
                              std::to_string(peft.at("r").get<int>()) + " --lora-targets " + targets);
    CHECK(planned["lora"]["adapter_param_count"] == numel);
  }
  // From sizes: every attention projection hidden x hidden.
  const auto sizes =
      lora("--layers 2 --hidden 32 --intermediate 48 --lora-rank 8 --lora-targets all-linear");
  CHECK(sizes["lora"]["adapter_param_count"] == 2 * (4 * 512 + 3 * 640));
  // Without --lora-rank there is no LoRA section.
  CHECK(!lora("--model " + model).contains("lora"));
  // An FP8 checkpoint (tests/data/golden/fp8_llama: its 14 layer weights
  // FP8, 245,760 elements): the base at a byte per FP8 parameter at ZeRO-3.
  const auto fp8 = lora("--model " + strata::test::source_dir() + "/tests/data/golden/fp8_llama --lora-rank 4");
  CHECK(fp8["lora"]["base_quantized_param_count"] == 245'760);
  CHECK(fp8["lora"]["base_quantized_format"] == "FP8");
  const double fp8_base = fp8["lora"]["base_param_count"].get<double>();
  CHECK(fp8["lora"]["base_bytes"].get<double>() ==
        Approx(2 * (fp8_base - 245'760) + 245'760 + 4 * 245'760 / 16384.0).margin(1));
  CHECK(lora("--model " + model + " --lora-rank 8")["lora"]["base_quantized_param_count"] == 0);
  // gpt-oss's MXFP4 checkpoint (tests/data/golden/mxfp4_gpt_oss): its 4
  // stacked expert tensors, 49,152 elements, at 4.25 bits; the rest 16-bit.
  const auto mxfp4 = lora("--model " + strata::test::source_dir() + "/tests/data/golden/mxfp4_gpt_oss --lora-rank 4");
  CHECK(mxfp4["lora"]["base_quantized_param_count"] == 2 * (4 * 64 * 64 + 4 * 32 * 64));
  CHECK(mxfp4["lora"]["base_quantized_format"] == "MXFP4");
  const double mxfp4_base = mxfp4["lora"]["base_param_count"].get<double>();
  CHECK(mxfp4["lora"]["base_bytes"].get<double>() == Approx(2 * (mxfp4_base - 49'152) + 49'152 * 17 / 32.0).margin(1));

  const auto text = run_command(strata_binary() + " plan --model " + model +
                                " --lora-rank 8 --lora-targets all-linear --gpu-mem 1GB");
  REQUIRE(text.exit_code == 0);
  CHECK_THAT(text.output, Catch::Contains("LoRA rank 8 on q_proj,k_proj,v_proj,o_proj") &&
                              Catch::Contains("7424 parameters") &&
                              Catch::Contains("20 B/param") && Catch::Contains("16 B/param"));

  struct Case {
    std::string args, expected;
  };
  const std::vector<Case> refusals = {
      {"--params 7B --lora-rank 8", "--params alone"},
      {"--model " + model + " --lora-targets q_proj", "--lora-targets needs --lora-rank"},
      {"--model " + model + " --lora-rank 0", "--lora-rank"},
      {"--model " + model + " --lora-rank x", "--lora-rank"},
      {"--model " + model + " --lora-rank 8 --lora-targets lm_head", "'lm_head' is not a projection"},
      {"--model " + model + " --lora-rank 8 --lora-targets q_proj,q_proj", "'q_proj' twice"},
      {"--model " + model + " --lora-rank 8 --lora-targets q_proj,", "empty name"},
      {"--layers 2 --hidden 32 --lora-rank 8 --lora-targets up_proj", "--intermediate"},
  };
  for (const Case& c : refusals) {
    INFO(c.args);
    const auto result = run_command(strata_binary() + " plan " + c.args + " 2>&1");
    CHECK(result.exit_code == 1);
    CHECK_THAT(result.output, Catch::Contains(c.expected));
    CHECK_THAT(result.output, !Catch::Contains("internal error"));
  }
}

TEST_CASE("strata plan --help explains the flags", "[plan][cli]") {
  const auto result = run_command(strata_binary() + " plan --help");
  REQUIRE(result.exit_code == 0);
  for (const char* flag :
       {"--model", "--params", "--layers", "--hidden", "--seq", "--batch", "--config", "--gpus",
        "--gpu-mem", "--host-mem", "--nvme-path", "--nvme-capacity", "--dp", "--bw-gpu-cpu",
        "--bw-nvme", "--peak-tflops", "--target-efficiency", "--json", "--lora-rank",
        "--lora-targets"}) {
    CHECK_THAT(result.output, Catch::Contains(flag));
  }
  CHECK_THAT(run_command(strata_binary() + " --help").output, Catch::Contains("plan"));
}

TEST_CASE("strata plan --tp: one rank's model states, activations and tp traffic, and what it refuses",
          "[plan][cli][tp]") {
  // Llama-2-7B's shape.
  const LlamaPlan l7b(32000, 4096, 11008, 32, 32, 32, 4096, "--gpus 8 --gpu-mem 80GB --seq 4096 --bw-interconnect 100");
  const auto j = l7b.json("--tp 4 --sequence-parallel");
  const auto& tp = j["tensor_parallel"];
  CHECK(tp["size"] == 4);
  CHECK(tp["ranks"] == 8);
  CHECK(tp["sequence_parallel"] == true);
  // Rank 0: a quarter of every projection and of the embedding's and lm_head's rows, the norms whole.
  const int64_t h = 4096, inter = 11008, layers = 32, vocab = 32000;
  const int64_t per_rank = layers * (4 * h * h / 4 + 3 * h * inter / 4 + 2 * h) + 2 * vocab / 4 * h + h;
  CHECK(tp["parameters_per_rank"] == per_rank);
  CHECK(j["model"]["param_count"] == per_rank);
  CHECK(j["machine"]["data_parallel"] == 2);
  CHECK(j["training"]["tensor_parallel"] == 4);
  // Stage 3's model states per rank: 16 bytes per parameter over the 2 data-parallel ranks.
  CHECK(j["model_states"]["zero_stages"][3]["bytes_per_rank"].get<double>() ==
        Approx(16.0 * static_cast<double>(per_rank) / 2));
  // Megatron's sequence-parallel traffic per micro-step, 16-bit: per layer 10
  // gathers or reduce-scatters of s x h (4 more when the layer is
  // recomputed: the plan checkpoints every layer but the top one), 4 more
  // per micro-step (the final norm's output and the embedding's gradient
  // gathered, the embedding's output and the loss's dh reduce-scattered),
  // each moving (t - 1) / t of the buffer per rank.
  const double buffer = 2.0 * 4096 * h, share = 3.0 / 4;
  CHECK(tp["collective_bytes_per_micro_step"].get<double>() ==
        Approx(share * buffer * (layers * 10 + (layers - 1) * 4 + 4)));
  bool traffic = false;
  for (const auto& placement : j["placements"]) {
    for (const auto& t : placement["traffic"]) traffic |= t["class"] == "tensor parallel";
  }
  CHECK(traffic);
  // The text names the split and the ranks.
  const auto text = l7b.run("--tp 4");
  INFO(text.output);
  CHECK(text.exit_code == 0);
  CHECK_THAT(text.output, Catch::Contains("tensor parallelism 4 x data parallelism 2 = 8 ranks: each holds 8 heads, 8 "
                                          "kv head(s) and 2752 MLP features") &&
                              Catch::Contains("a tp 4 rank's"));
  // Refused as strata finetune refuses them.
  CHECK_THAT(l7b.refusal("--tp 3"), Catch::Contains("does not divide num_attention_heads 32"));
  const auto shapeless = run_command(strata_binary() + " plan --params 7B --tp 2 2>&1");
  CHECK(shapeless.exit_code != 0);
  CHECK_THAT(shapeless.output, Catch::Contains("give --model"));
  CHECK_THAT(l7b.refusal("--sequence-parallel"), Catch::Contains("--sequence-parallel needs tensor parallelism"));
  const std::string tp_config = l7b.write("tp.json", R"({"tensor_parallel": {"autotp_size": 2}})");
  CHECK_THAT(l7b.refusal("--tp 4 --config " + tp_config), Catch::Contains("disagree"));
  CHECK(l7b.json("--config " + tp_config)["tensor_parallel"]["size"] == 2);
}

TEST_CASE("strata plan --cp: a rank's activations at s/cp, the ring's and Ulysses' bytes per layer, and what it "
          "refuses",
          "[plan][cli][cp]") {
  // Llama-3-8B's shape: 32 heads and 8 kv heads of 128.
  const LlamaPlan l8b(128256, 4096, 14336, 32, 32, 8, 131072,
                      "--gpus 8 --gpu-mem 80GB --seq 32768 --bw-interconnect 100");
  const auto j = l8b.json("--cp 4");
  const auto& cp = j["context_parallel"];
  CHECK(cp["size"] == 4);
  CHECK(cp["method"] == "ring");
  CHECK(cp["data_parallel"] == 2);
  CHECK(cp["tokens_per_rank"] == 8192);
  CHECK(j["machine"]["data_parallel"] == 8);  // ZeRO partitions over dp x cp, as finetune's
  CHECK(j["training"]["context_parallel"] == 4);
  // The ring, 16-bit: (cp - 1)/cp · 2·s·b·h_kv per layer forward; backward
  // 2cp - 1 hops (the keys and values again, the dk/dv accumulators one hop
  // behind, the last one home); a micro-step's layers, and the recompute's
  // forward of every checkpointed layer but the top one.
  const double s = 32768, h_kv = 8 * 128, h = 32 * 128, layers = 32;
  const double forward = 3.0 / 4 * 2 * s * h_kv * 2, backward = 7.0 / 4 * 2 * s * h_kv * 2;
  CHECK(cp["bytes_per_layer_forward"].get<double>() == Approx(forward));
  CHECK(cp["bytes_per_layer_backward"].get<double>() == Approx(backward));
  CHECK(cp["bytes_per_micro_step"].get<double>() == Approx(layers * (forward + backward) + (layers - 1) * forward));
  bool traffic = false;
  for (const auto& placement : j["placements"]) {
    for (const auto& t : placement["traffic"]) traffic |= t["class"] == "context parallel";
  }
  CHECK(traffic);
  // A rank's activations follow s/cp: strata's arena (the document arrays
  // stay the whole sequence's) and the plan's formulas against cp 1's.
  const double arena = cp["activation_arena_bytes_per_rank"].get<double>();
  const double arena1 = cp["activation_arena_bytes_at_cp_1"].get<double>();
  CHECK(arena == Approx(arena1 / 4).epsilon(0.01));
  CHECK(cp["attention_buffer_bytes_per_rank"].get<double>() > 0);
  const auto j1 = l8b.json("");
  CHECK(j["activations"]["checkpointed"]["checkpoint_bytes"].get<double>() ==
        Approx(j1["activations"]["checkpointed"]["checkpoint_bytes"].get<double>() / 4));
  // Ulysses: each all-to-all sends (cp - 1)/cp of a rank's s/cp tokens: q, k, v and out
  // forward (16-bit) and lse (fp32); backward q, k, v, out, dout, lse there and dq, dk, dv back.
  const auto ju = l8b.json("--cp 4 --cp-method ulysses");
  const auto& u = ju["context_parallel"];
  CHECK(u["method"] == "ulysses");
  const double sent = 3.0 / 4 * s / 4;
  CHECK(u["bytes_per_layer_forward"].get<double>() == Approx(sent * ((2 * h + 2 * h_kv) * 2 + 32 * 4)));
  CHECK(u["bytes_per_layer_backward"].get<double>() == Approx(sent * ((4 * h + 4 * h_kv) * 2 + 32 * 4)));
  // With tp 2 each tp rank's cp group moves its 4 kv heads.
  const auto jt = l8b.json("--cp 2 --tp 2 --sequence-parallel");
  CHECK(jt["context_parallel"]["data_parallel"] == 2);
  CHECK(jt["context_parallel"]["bytes_per_layer_forward"].get<double>() == Approx(1.0 / 2 * 2 * s * 4 * 128 * 2));
  const auto text = l8b.run("--cp 4");
  INFO(text.output);
  CHECK(text.exit_code == 0);
  CHECK_THAT(text.output, Catch::Contains("context parallelism 4 (ring) x data parallelism 2: each rank holds 8192 of "
                                          "every sequence's 32768 tokens"));
  // Refused as strata finetune refuses them.
  CHECK_THAT(l8b.refusal("--cp 3"), Catch::Contains("--seq 32768 does not divide by 2 x --cp 3 = 6"));
  CHECK_THAT(l8b.refusal("--cp 4 --tp 4 --cp-method ulysses"), Catch::Contains("a rank holds 8 of the num_attention_heads 32 and 2 of the "
                                           "num_key_value_heads 8, which do not both divide by 4"));
  CHECK_THAT(l8b.refusal("--cp 16"), Catch::Contains("--cp 16 does not divide the 8 data-parallel ranks"));
  const auto shapeless = run_command(strata_binary() + " plan --params 7B --cp 2 2>&1");
  CHECK(shapeless.exit_code != 0);
  CHECK_THAT(shapeless.output, Catch::Contains("give --model"));
  CHECK_THAT(l8b.refusal("--cp-method ring"), Catch::Contains("--cp-method goes with --cp"));
}

TEST_CASE("strata plan --pp: each stage's layers, parameters, activations in flight, point-to-point bytes and how "
          "ZeRO-3 gathers, the bubble, and what it refuses",
          "[plan][cli][pp]") {
  const LlamaPlan m(1000, 64, 176, 8, 4, 4, 256, "--gpus 8 --seq 128 --batch 1");
  const auto j = m.json("--grad-accum 8 --pp 4");
  const auto& pp = j["pipeline_parallel"];
  CHECK(pp["size"] == 4);
  CHECK(pp["schedule"] == "1f1b");
  CHECK(pp["micro_batches"] == 8);
  CHECK(pp["bubble"].get<double>() == Approx(3.0 / 11));
  CHECK(j["machine"]["data_parallel"] == 2);  // 8 GPUs / 4 stages
  // Two layers a stage; the embedding on the first, the final norm and lm_head on the last.
  const int64_t h = 64, inter = 176, vocab = 1000;
  const int64_t layer = 4 * h * h + 3 * h * inter + 2 * h;
  const std::vector<int64_t> params = {2 * layer + vocab * h, 2 * layer, 2 * layer, 2 * layer + h + vocab * h};
  CHECK(pp["whole_parameters"] == 8 * layer + 2 * vocab * h + h);
  CHECK(j["model"]["param_count"] == params[3]);  // the model states planned are the largest stage's
  const auto& stages = pp["stages"];
  REQUIRE(stages.size() == 4);
  // One boundary transfer: [1 x 128, 64] in 16 bits; the first and last stage send one a micro-batch, the others two.
  const double transfer = 128.0 * h * 2;
  const double per_micro_batch = stages[3]["activation_bytes"].get<double>();
  CHECK(per_micro_batch > 0);
  for (int s = 0; s < 4; ++s) {
    CAPTURE(s);
    const auto& st = stages[static_cast<size_t>(s)];
    CHECK(st["layers"] == 2);
    CHECK(st["parameters"] == params[static_cast<size_t>(s)]);
    CHECK(st["micro_batches_in_flight"] == 4 - s);  // 1F1B: p - r
    CHECK(st["activation_bytes"].get<double>() == Approx(per_micro_batch * (4 - s)));
    CHECK(st["p2p_bytes_sent_per_step"].get<double>() == Approx(transfer * 8 * (s == 0 || s == 3 ? 1 : 2)));
    CHECK(st["zero3_parameters_kept_for_the_step"] == true);  // the default limits hold every stage
    CHECK(st["zero3_gathers_per_parameter_per_step"] == 1);
  }

  // ZB-H1 from the ds_config: p micro-batches in flight everywhere, its bubble; a
  // reuse distance that only the middle stages fit: the others re-gather for
  // every use (a forward, a recompute and a backward per micro-batch: the plan checkpoints).
  const std::string zb_config =
      m.write("ds.json", R"({"gradient_accumulation_steps": 8, "pipeline_parallel": {"size": 4, "schedule": "zb-h1"},
      "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": )" + std::to_string(2 * layer + 1000) + "}}");
  const auto z = m.json("--config " + zb_config);
  REQUIRE(z["training"]["activation_checkpointing"] == true);
  const auto& zp = z["pipeline_parallel"];
  CHECK(zp["schedule"] == "zb-h1");
  CHECK(zp["bubble"].get<double>() == Approx(3.0 / 27));
  for (int s = 0; s < 4; ++s) {
    CAPTURE(s);
    const auto& st = zp["stages"][static_cast<size_t>(s)];
    const bool middle = s == 1 || s == 2;
    CHECK(st["micro_batches_in_flight"] == 4);
    CHECK(st["zero3_parameters_kept_for_the_step"] == middle);
    CHECK(st["zero3_gathers_per_parameter_per_step"] == (middle ? 1 : 8 * 3));
  }

  // Refusals, in the flags' terms.
  const auto no_model = run_command(strata_binary() + " plan --layers 8 --hidden 64 --pp 2 2>&1");
  CHECK(no_model.exit_code != 0);
  CHECK_THAT(no_model.output, Catch::Contains("--pp 2: the stages split the model's layers: give --model"));
  CHECK_THAT(m.refusal("--pp-schedule zb-h1"), Catch::Contains("--pp-schedule and --virtual-stages shape a pipeline: give --pp"));
  CHECK_THAT(m.refusal("--pp 4 --grad-accum 6 --pp-schedule interleaved --virtual-stages 2"), Catch::Contains("6 micro-batches is not a multiple of 4 stages"));
  // Without a pipeline there is no pipeline section (ScheduleSpec's own default is 2 stages).
  CHECK_FALSE(m.json("").contains("pipeline_parallel"));
}

TEST_CASE("plan: the micro-batch orders' parameter reads and step bounds", "[plan][layer-major]") {
  // 1000 parameters, the largest chunk and layer 100, 2000 bytes per fetch of
  // every parameter, 8 micro-batches, 1000 B/s from the home, 3 s of compute.
  OrderInputs in;
  in.param_count = 1000;
  in.largest_chunk_params = 100;
  in.largest_layer_params = 100;
  in.shard_nbytes = 2000;
  in.micro_batches = 8;
  in.read_bandwidth = 1000;
  in.step_major_compute_seconds = 3;
  in.max_reuse_distance = 250;  // twice the largest layer, not the model
  in.max_live = 500;
  OrderPlan p = predict_micro_batch_orders(in);
  CHECK_FALSE(p.whole_model_kept);
  CHECK(p.chunks_kept);
  // Step-major: a forward and a backward fetch per micro-batch (the recompute
  // beside the backward: a layer fits the distance), 2 x 8; layer-major 2.
  CHECK(p.step_major.fetches == 16);
  CHECK(p.step_major.param_read_nbytes == 32000);
  CHECK(p.step_major.io_seconds == 32);
  CHECK(p.step_major.step_seconds == 32);  // max(compute 3, reads 32)
  CHECK(p.layer_major.fetches == 2);
  CHECK(p.layer_major.param_read_nbytes == 4000);
  CHECK(p.layer_major.compute_seconds == 3);  // checkpointing recomputes in both orders
  CHECK(p.layer_major.step_seconds == 4);
  CHECK(p.speedup() == 8);
  CHECK(p.read_ratio() == 8);
  CHECK_THAT(p.describe(), Catch::Contains("layer-major fetches each parameter twice per step, step-major 16 times"));
  // Reads below compute: the bound is compute's.
  in.read_bandwidth = 1e6;
  CHECK(predict_micro_batch_orders(in).speedup() == 1);
  in.read_bandwidth = 1000;
  // A distance below twice the largest layer: layer-major fetches what step-major does.
  in.max_reuse_distance = 150;
  p = predict_micro_batch_orders(in);
  CHECK_FALSE(p.chunks_kept);
  CHECK(p.layer_major.fetches == 16);
  CHECK_THAT(p.describe(), Catch::Contains("layer-major fetches what step-major does"));
  // A live budget below the largest chunk (the head) likewise.
  in.max_reuse_distance = 250;
  in.largest_chunk_params = 300;
  in.max_live = 250;
  CHECK_FALSE(predict_micro_batch_orders(in).chunks_kept);
  in.largest_chunk_params = 100;
  in.max_live = 500;
  // Below a layer: the recompute fetches again, 3 per micro-batch.
  in.max_reuse_distance = 50;
  CHECK(predict_micro_batch_orders(in).step_major.fetches == 24);
  // Without checkpointing layer-major still recomputes: 4 passes against 3.
  in.activation_checkpointing = false;
  CHECK(predict_micro_batch_orders(in).step_major.fetches == 16);
  in.max_reuse_distance = 250;
  p = predict_micro_batch_orders(in);
  CHECK(p.layer_major.compute_seconds == Approx(4.0));
  CHECK(p.step_major.compute_seconds == 3);
  // Unless it keeps every micro-batch's activations (strata.layer_major_activations keep): 3 passes, as step-major.
  in.layer_major_keeps_activations = true;
  CHECK(predict_micro_batch_orders(in).layer_major.compute_seconds == 3);
  in.layer_major_keeps_activations = false;
  // The whole model kept gathered (DeepSpeed's default budgets): one fetch per step in both orders.
  in.max_reuse_distance = in.max_live = 1'000'000'000;
  p = predict_micro_batch_orders(in);
  CHECK(p.whole_model_kept);
  CHECK(p.step_major.fetches == 1);
  CHECK(p.layer_major.fetches == 1);
  CHECK_THROWS_WITH(predict_micro_batch_orders(OrderInputs{}), Catch::Contains("must be above 0"));
}

TEST_CASE("strata plan --micro-batch-order: both orders predicted on the config's placement, and auto's choice",
          "[plan][cli][layer-major]") {
  strata::test::TempDir dir;
  // The 59.6M strata-train model's shape, ZeRO-3 on NVMe with budgets below the model, 8 micro-batches.
  {
    std::ofstream out(dir.file("ds.json"));
    out << R"({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
      "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ")" << dir.file("swap")
        << R"("}, "offload_optimizer": {"device": "nvme", "nvme_path": ")" << dir.file("swap") << R"("},
      "stage3_max_reuse_distance": 8e6, "stage3_max_live_parameters": 2e7}})";
  }
  const std::string plan = strata_binary() + " plan --layers 16 --hidden 512 --intermediate 1408 --vocab 8000 " +
                           "--seq 16 --config " + dir.file("ds.json") + " --bw-nvme 2 ";
  const auto result = run_command(plan + "--micro-batch-order auto --json 2>&1");
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  const auto order = nlohmann::json::parse(result.output)["micro_batch_order"];
  CHECK(order["order"] == "layer-major");
  CHECK(order["auto_chooses"] == "layer-major");
  CHECK(order["source"] == "--micro-batch-order");
  // A layer: 4 x 512^2 + 3 x 512 x 1408 + 2 x 512; the head (lm_head and the norm) is the largest chunk.
  CHECK(order["largest_layer_parameters"] == 3'212'288);
  CHECK(order["largest_chunk_parameters"] == 8000 * 512 + 512);
  CHECK(order["step_major"]["fetches_per_step"] == 16);
  CHECK(order["layer_major"]["fetches_per_step"] == 2);
  CHECK(order["step_major"]["param_read_bytes_per_step"].get<double>() ==
        Approx(8 * order["layer_major"]["param_read_bytes_per_step"].get<double>()));
  // At the default 70 TFLOPS the reads bound the step: 8x fewer of them, 8x the speed.
  CHECK(order["predicted_speedup"].get<double>() == Approx(8));
  CHECK_THAT(order["auto_says"].get<std::string>(),
             Catch::Contains("--micro-batch-order auto: layer-major, predicted") &&
                 Catch::Contains("s/step against step-major's"));
  // On a machine whose compute bounds the step (10 GFLOP/s, this CPU's order)
  // the orders tie: auto predicts no gain and stays step-major, saying so.
  const auto slow = run_command(plan + "--peak-tflops 0.01 --micro-batch-order auto --json 2>&1");
  REQUIRE(slow.exit_code == 0);
  const auto slow_order = nlohmann::json::parse(slow.output)["micro_batch_order"];
  CHECK(slow_order["predicted_speedup"].get<double>() == Approx(1));
  CHECK(slow_order["order"] == "step-major");
  CHECK(slow_order["auto_chooses"] == "step-major");
  CHECK_THAT(slow_order["auto_says"].get<std::string>(),
             Catch::Contains("auto: step-major, predicted") && Catch::Contains("but compute bounds the step"));
  // The text names both orders and the config's default (step-major) as the order run.
  const auto text = run_command(plan + "2>&1");
  CHECK_THAT(text.output, Catch::Contains("micro-batch order step-major (strata.micro_batch_order: step-major); auto "
                                          "would choose layer-major"));
  CHECK_THAT(text.output, Catch::Contains("layer-major fetches every parameter 2 time(s) per step"));
  // What finetune refuses, the plan refuses by the same name.
  const auto refused = run_command(plan + "--micro-batch-order layer-major --lora-rank 4 2>&1");
  CHECK(refused.exit_code != 0);
  CHECK_THAT(refused.output, Catch::Contains("--micro-batch-order layer-major with LoRA (--lora-rank): not implemented"));
}
