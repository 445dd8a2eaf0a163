// Every config rule in one place: for a table of ds_configs, `strata config
// check`, `strata finetune`, `strata plan` and the C API accept exactly the
// same ones, and refuse the others with the same message (the one
// parse_config lists, engine_options.h's mapping included). Real processes
// for the commands; the C API in this process on one rank.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "runtime/capi/strata.h"
#include "tests/support/finetune_files.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"

using strata::test::kFinetuneExamples;
using strata::test::run_with_limit;
using strata::test::small_model;
using strata::test::strata_binary;
using strata::test::write_file;

namespace {

struct Case {
  const char* what;
  std::string config;  // the ds_config (JSON)
  const char* refusal;  // a piece of the one message every front end prints; nullptr: accepted
};

std::vector<Case> cases(const std::string& swap, const std::string& other_swap) {
  return {
      {"no keys (the defaults: stage 1)", "{}", nullptr},
      {"ZeRO-3, parameters and optimizer on NVMe in one directory",
       R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ")" + swap +
           R"("}, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("}}})",
       nullptr},
      {"stage 0", R"({"zero_optimization": {"stage": 0}})", "zero_optimization.stage is 0"},
      {"parameter offload below stage 3",
       R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}})",
       "parameter offload needs stage 3"},
      {"parameters offloaded, the optimizer not",
       R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})",
       "offload_param.device is \"cpu\" but offload_optimizer.device is \"none\""},
      {"two NVMe paths",
       R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ")" + swap +
           R"("}, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + other_swap + R"("}}})",
       "differ"},
      {"an NVMe optimizer without its path",
       R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})",
       "offload_optimizer.nvme_path is not set"},
      {"one optimizer pipeline buffer",
       R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 1}}})",
       "zero_optimization.offload_optimizer.buffer_count"},
      {"no live parameters", R"({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0}})",
       "zero_optimization.stage3_max_live_parameters"},
      {"eps 0 (the engine's own limit)", R"({"optimizer": {"type": "AdamW", "params": {"eps": 0}}})",
       "optimizer eps must be > 0"},
      {"fp16 and bf16", R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", "choose one 16-bit format"},
      {"context parallelism with layer-major micro-batches",
       R"({"context_parallel": {"size": 2}, "strata": {"micro_batch_order": "layer-major"}})",
       "context_parallel.size 2 with strata.micro_batch_order \"layer-major\": context parallelism with it is not "
       "implemented"},
      {"an unknown context-parallel method", R"({"context_parallel": {"method": "striped"}})",
       "context_parallel.method"},
  };
}

// The C API on one rank: accepted, or the status and message.
std::string capi_refusal(const std::string& config) {
  strata_engine* engine = nullptr;
  const strata_status status = strata_engine_create(config.c_str(), &engine);
  if (status == STRATA_OK) {
    strata_engine_destroy(engine);
    return "";
  }
  return strata_last_error();
}

}  // namespace

TEST_CASE("config check, finetune, plan and the C API accept and refuse the same configs, with the same message",
          "[config]") {
  strata::test::TempDir dir("strata-config-rules");
  const std::string model = small_model(dir);
  const std::string data = kFinetuneExamples + "/data/gpl-3.0.txt";
  int n = 0;
  for (const Case& c : cases(dir.file("swap"), dir.file("swap2"))) {
    DYNAMIC_SECTION(c.what) {
      const std::string file = write_file(dir, "ds" + std::to_string(n++) + ".json", c.config);
      const auto check = run_with_limit(strata_binary() + " config check -q " + file, 60);
      const auto finetune = run_with_limit(strata_binary() + " finetune --config " + file + " --init " + model +
                                               " --data " + data + " --data-format text --steps 1 --seq 16 --out " +
                                               dir.file("out"),
                                           120);
      const auto plan = run_with_limit(strata_binary() + " plan --config " + file + " --params 1B", 60);
      const std::string capi = capi_refusal(c.config);
      INFO("config: " << c.config);
      INFO("config check: " << check.output);
      INFO("finetune: " << finetune.output);
      INFO("plan: " << plan.output);
      INFO("C API: " << capi);
      if (c.refusal == nullptr) {
        CHECK(check.exit_code == 0);
        CHECK(finetune.exit_code == 0);
        CHECK(plan.exit_code == 0);
        CHECK(capi.empty());
      } else {
        CHECK(check.exit_code == 1);
        CHECK(finetune.exit_code != 0);
        CHECK(plan.exit_code != 0);
        CHECK_FALSE(capi.empty());
        for (const std::string* out : {&check.output, &finetune.output, &plan.output, &capi}) {
          CHECK(out->find(c.refusal) != std::string::npos);
        }
        // The user's terms, never the internal check or a source path.
        for (const std::string* out : {&check.output, &finetune.output, &plan.output, &capi}) {
          CHECK(out->find("check `") == std::string::npos);
          CHECK(out->find(".cc:") == std::string::npos);
        }
      }
    }
  }
}
