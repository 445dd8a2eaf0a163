// Configuration: DeepSpeed configs accepted, every kind of bad input rejected
// with the message that names the key and what it accepts, docs in sync.
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>

#include "runtime/config/config.h"
#include "runtime/config/schema.h"
#include "runtime/config/size.h"

using namespace strata;
using Catch::Contains;

namespace {

// The problems reported for `text`, or an empty list when it is valid.
std::vector<std::string> problems_of(const std::string& text) {
  try {
    parse_config_text(text, "test.json");
    return {};
  } catch (const ConfigError& e) {
    return e.problems();
  }
}

std::string only_problem(const std::string& text) {
  auto problems = problems_of(text);
  REQUIRE(problems.size() == 1);
  return problems.front();
}

}  // namespace

TEST_CASE("a typical DeepSpeed ZeRO-3 NVMe-offload config is accepted", "[config]") {
  const Config c = load_config_file(STRATA_SOURCE_DIR "/tests/runtime/configs/ds_zero3_nvme.json");
  REQUIRE(c.zero.stage == 3);
  REQUIRE(c.zero.offload_param.device == OffloadDevice::kNvme);
  REQUIRE(c.zero.offload_optimizer.nvme_path == "/local_nvme");
  REQUIRE(c.zero.offload_param.buffer_numel == 100000000);
  REQUIRE(c.zero.reduce_bucket_numel == 500000000);  // "auto" means the default
  REQUIRE(c.aio.thread_count == 1);                   // from intra_op_parallelism
  REQUIRE(c.fp16.enabled);
  REQUIRE(c.optimizer.lr == Approx(3e-5));
  REQUIRE(c.micro_batch_size == 2);
  REQUIRE(c.no_effect_keys.size() == 3);
  REQUIRE(c.effective["strata"]["io_engine"] == "uring");  // strata defaults filled in
}

TEST_CASE("defaults are DeepSpeed's and written once", "[config]") {
  const Config c = default_config();
  REQUIRE(c.aio.block_size == 1048576);
  REQUIRE(c.aio.queue_depth == 8);
  REQUIRE(c.aio.thread_count == 1);
  REQUIRE(c.zero.offload_param.buffer_count == 5);
  REQUIRE(c.zero.offload_optimizer.buffer_count == 4);
  REQUIRE(c.zero.sub_group_numel == 1000000000);
  REQUIRE(c.zero.prefetch_bucket_numel == 50000000);
  REQUIRE(c.zero.param_persistence_threshold_numel == 100000);
  REQUIRE(c.zero.offload_param.pin_memory);
  for (const auto& f : config_fields()) {
    REQUIRE(c.effective.contains(nlohmann::json::json_pointer("/" + [&] {
      std::string p = f.path;
      std::replace(p.begin(), p.end(), '.', '/');
      return p;
    }())));
  }
}

TEST_CASE("unknown keys are errors naming the closest valid key", "[config]") {
  REQUIRE_THAT(only_problem(R"({"zero_optimization": {"stage3_prefetch_bucket": 5}})"),
               Contains("zero_optimization.stage3_prefetch_bucket: unknown key") &&
                   Contains("did you mean \"zero_optimization.stage3_prefetch_bucket_size\""));
  REQUIRE_THAT(only_problem(R"({"aio": {"thread_cont": 2}})"),
               Contains("aio.thread_cont: unknown key (did you mean \"aio.thread_count\"?)"));
  REQUIRE_THAT(only_problem(R"({"train_micro_batch_size": 2})"),
               Contains("did you mean \"train_micro_batch_size_per_gpu\""));
  // A key in the wrong section points at where it belongs.
  REQUIRE_THAT(only_problem(R"({"stage": 3})"), Contains("did you mean \"zero_optimization.stage\""));
  REQUIRE_THAT(only_problem(R"({"completely_unrelated_thing": 1})"),
               Contains("completely_unrelated_thing: unknown key") && !Contains("did you mean"));
}

TEST_CASE("wrong types and values name the full path and the accepted values", "[config]") {
  REQUIRE(only_problem(R"({"zero_optimization": {"offload_param": {"device": "ssd"}}})") ==
          "zero_optimization.offload_param.device: \"ssd\" is not one of none, cpu, nvme");
  REQUIRE_THAT(only_problem(R"({"zero_optimization": {"stage": 4}})"),
               Contains("zero_optimization.stage: 4 (a number) is not an integer 0..3"));
  REQUIRE_THAT(only_problem(R"({"zero_optimization": {"stage": "three"}})"),
               Contains("\"three\" (a string) is not an integer 0..3"));
  REQUIRE_THAT(only_problem(R"({"bf16": {"enabled": "yes"}})"), Contains("bf16.enabled") && Contains("true or false"));
  REQUIRE_THAT(only_problem(R"({"optimizer": {"params": {"betas": [0.9]}}})"),
               Contains("optimizer.params.betas") && Contains("a list of two numbers"));
  REQUIRE_THAT(only_problem(R"({"aio": {"block_size": "1 lightyear"}})"),
               Contains("aio.block_size: \"1 lightyear\"") && Contains("\"1GB\""));
  REQUIRE_THAT(only_problem(R"({"zero_optimization": 3})"),
               Contains("zero_optimization: expected an object"));
  REQUIRE_THAT(only_problem("[1, 2]"), Contains("top level must be a JSON object"));
}

TEST_CASE("all problems are listed at once", "[config]") {
  const auto problems = problems_of(
      R"({"zero_optimization": {"offload_param": {"device": "ssd"}}, "aio": {"queue_depth": 0}, "bogus": 1})");
  REQUIRE(problems.size() == 3);
}

TEST_CASE("inconsistent combinations say why", "[config]") {
  REQUIRE_THAT(only_problem(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})"),
               Contains("offload_param.device is \"cpu\" but zero_optimization.stage is 2") &&
                   Contains("needs stage 3"));
  REQUIRE_THAT(
      only_problem(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})"),
      Contains("offload_optimizer.nvme_path is not set"));
  REQUIRE_THAT(only_problem(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})"),
               Contains("choose one 16-bit format"));
  REQUIRE_THAT(only_problem(R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})"),
               Contains("not divisible"));
  REQUIRE_THAT(only_problem(R"({"aio": {"block_size": 5000}})"), Contains("multiple of 4096"));
  REQUIRE_THAT(only_problem(R"({"aio": {"block_size": "4GiB"}})"), Contains("over 1 GiB"));
  REQUIRE_THAT(only_problem(R"({"aio": {"intra_op_parallelism": 2, "thread_count": 3}})"),
               Contains("aio.thread_count: conflicts with aio.intra_op_parallelism"));
}

TEST_CASE("sizes accept numbers and unit strings", "[config]") {
  REQUIRE(parse_size("1GB") == 1000000000u);
  REQUIRE(parse_size("1GiB") == (1ull << 30));
  REQUIRE(parse_size("4 KiB") == 4096u);
  REQUIRE(parse_size("4k") == 4096u);
  REQUIRE(parse_size("1e9") == 1000000000u);
  REQUIRE_FALSE(parse_size("1.5B"));
  REQUIRE_FALSE(parse_size("-1"));
  REQUIRE_FALSE(parse_size("12 parsecs"));
  const Config c = parse_config_text(R"({"aio": {"block_size": "4MiB"}, "zero_optimization": {"sub_group_size": "2G"}})");
  REQUIRE(c.aio.block_size == 4u << 20);
  REQUIRE(c.zero.sub_group_numel == 2ull << 30);
  REQUIRE(format_size(1536) == "1.50 KiB");
}

TEST_CASE("syntax errors and unreadable files name where", "[config]") {
  REQUIRE_THAT(only_problem("{\"a\": 1,\n \"b\": [1, 2,\n }"), Contains("3:2: JSON syntax error"));
  REQUIRE_THROWS_WITH(load_config_file("/nonexistent/strata.json"),
                      Contains("cannot read config file /nonexistent/strata.json") &&
                          Contains("No such file"));
}

TEST_CASE("docs/config.md is generated from the schema", "[config][docs]") {
  std::ifstream file(STRATA_SOURCE_DIR "/docs/config.md");
  REQUIRE(file.good());
  std::stringstream text;
  text << file.rdbuf();
  INFO("regenerate with: build/bin/strata config docs > docs/config.md");
  REQUIRE(text.str() == config_reference_markdown());
}
