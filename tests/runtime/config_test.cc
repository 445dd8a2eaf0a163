// Configuration: DeepSpeed configs accepted, every kind of bad input rejected
// with the message that names the key and what it accepts, docs in sync.
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "nvme/io_options.h"
#include "runtime/config/config.h"
#include "runtime/config/schema.h"
#include "runtime/config/size.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/train/zero_config.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

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
  const Config c = load_config_file(strata::test::source_dir() + "/tests/runtime/configs/ds_zero3_nvme.json");
  REQUIRE(c.zero.stage == 3);
  REQUIRE(c.zero.offload_param.device == OffloadDevice::kNvme);
  REQUIRE(c.zero.offload_optimizer.nvme_path == "/local_nvme");
  REQUIRE(c.zero.offload_param.buffer_numel == 100000000);
  REQUIRE(c.zero.reduce_bucket_numel == 500000000);  // "auto" means the default
  REQUIRE(c.aio.thread_count == 1);                   // from intra_op_parallelism
  REQUIRE(c.fp16.enabled);
  REQUIRE(c.optimizer.lr == Approx(3e-5));
  REQUIRE(c.micro_batch_size == 2);
  // Accepted, unused, and named: three DeepSpeed-only keys, pin_memory twice,
  // max_in_cpu, overlap_comm and contiguous_gradients.
  REQUIRE(c.no_effect_keys.size() == 8);
  REQUIRE(c.effective["aio"]["engine"] == "uring");  // defaults filled in
  REQUIRE(c.aio.engine == "uring");
}

TEST_CASE("defaults are DeepSpeed's and written once", "[config]") {
  const Config c = default_config();
  REQUIRE(c.aio.block_size == 1048576);
  REQUIRE(c.aio.queue_depth == 8);
  REQUIRE(c.aio.thread_count == 1);
  REQUIRE(c.zero.offload_param.buffer_count == 5);
  REQUIRE(c.zero.offload_optimizer.buffer_count == 4);
  // Not DeepSpeed's 1e9 / 5e8: left out, they are chosen from the model at
  // finalize (tests/engine/zero_sizes_test.cc); null in the effective config.
  REQUIRE(c.zero.sub_group_numel == 0);
  REQUIRE(c.zero.reduce_bucket_numel == 0);
  REQUIRE(c.effective["zero_optimization"]["sub_group_size"].is_null());
  REQUIRE(c.effective["zero_optimization"]["reduce_bucket_size"].is_null());
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
  // The value is shown, with the range each number must be in.
  REQUIRE(only_problem(R"({"optimizer": {"params": {"betas": [1.0, 0.999]}}})") ==
          "optimizer.params.betas: [1.0,0.999] is not a list of two numbers 0..0.9999999");
  // "No upper bound" means any finite number: 1e308 is a (huge) clipping threshold.
  REQUIRE(problems_of(R"({"gradient_clipping": 1e308})").empty());
  REQUIRE(only_problem(R"({"gradient_clipping": -1})") == "gradient_clipping: -1 (a number) is not a number >= 0");
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
  REQUIRE_THAT(only_problem(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"},
                                     "offload_optimizer": {"device": "cpu"}}})"),
               Contains("offload_param.device is \"cpu\" but zero_optimization.stage is 2") &&
                   Contains("needs stage 3"));
  REQUIRE_THAT(only_problem(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})"),
               Contains("offload_param.device is \"cpu\" but offload_optimizer.device is \"none\""));
  REQUIRE_THAT(only_problem(R"({"zero_optimization": {"stage": 3,
                                 "offload_param": {"device": "nvme", "nvme_path": "/a"},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}})"),
               Contains("differ"));
  REQUIRE_THAT(only_problem(R"({"zero_optimization": {"stage": 0}})"), Contains("zero_optimization.stage is 0"));
  // The engine's own limits, through the one mapping (engine_options.h).
  REQUIRE_THAT(only_problem(R"({"optimizer": {"params": {"eps": 0}}})"), Contains("optimizer eps must be > 0"));
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
  std::ifstream file(strata::test::source_dir() + "/docs/config.md");
  REQUIRE(file.good());
  std::stringstream text;
  text << file.rdbuf();
  INFO("regenerate with: build/bin/strata config docs > docs/config.md");
  REQUIRE(text.str() == config_reference_markdown());
}

// --- Bad input found by probing and fuzzing (issue 16) ----------------------

TEST_CASE("a number beyond double's range is a syntax problem with line:column, not a crash", "[config][issue16]") {
  // nlohmann throws out_of_range (not parse_error) for these; it used to
  // escape parse_config_text and end `strata config check` in std::terminate.
  REQUIRE_THAT(only_problem("{\"fp16\": {\"initial_scale_power\": 1e400}}"),
               Contains("1:34: JSON number 1e400 is out of range"));
  REQUIRE_THAT(only_problem("{\"fp16\":\n {\"initial_scale_power\":1e30016}}"), Contains("2:") && Contains("out of range"));
  REQUIRE_THAT(only_problem("1e400"), Contains("JSON number 1e400 is out of range"));
  REQUIRE_THAT(only_problem("[-1e400]"), Contains("out of range"));
}

TEST_CASE("an integer key's upper bound fits the int it is read into", "[config][issue16]") {
  // 1e12 used to be accepted and read with get<int>() as -727379968.
  REQUIRE_THAT(only_problem(R"({"fp16": {"loss_scale_window": 1e12}})"),
               Contains("fp16.loss_scale_window") && Contains("1..2147483647"));
  REQUIRE(parse_config_text(R"({"fp16": {"loss_scale_window": 2147483647}})").fp16.loss_scale_window == 2147483647);
  // Every integer key at its documented maximum builds the typed config with
  // that value (build() refuses to narrow a value that does not fit).
  for (const auto& f : config_fields()) {
    if (f.kind != FieldKind::kInt) continue;
    INFO(f.path << " at " << f.max);
    std::string pointer = "/" + f.path;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    nlohmann::json doc = nlohmann::json::object();
    doc[nlohmann::json::json_pointer(pointer)] = static_cast<int64_t>(f.max);
    try {
      const Config c = parse_config(doc);
      CHECK(c.effective[nlohmann::json::json_pointer(pointer)].get<int64_t>() == static_cast<int64_t>(f.max));
    } catch (const ConfigError&) {
      // A combination rule may refuse it (that is not the bound's business).
    }
  }
}

TEST_CASE("integers are compared exactly, not through double", "[config][issue16]") {
  // 2^53 + 1 rounds to 2^53 as a double: it used to pass the check and be stored as given.
  REQUIRE_THAT(only_problem(R"({"strata": {"seed": 9007199254740993}})"), Contains("strata.seed"));
  REQUIRE(parse_config_text(R"({"strata": {"seed": 9007199254740992}})").strata.seed == 9007199254740992ull);
  // A size given as an integer keeps every digit.
  REQUIRE(parse_config_text(R"({"strata": {"pinned_pool_size": 18000000000000000001}})").strata.pinned_pool_nbytes ==
          18000000000000000001ull);
}

TEST_CASE("the seed's limit is said, as 2^53", "[config][issue16]") {
  REQUIRE_THAT(only_problem(R"({"strata": {"seed": 18446744073709551615}})"),
               Contains("strata.seed: 18446744073709551615 (a number) is not an integer 0..2^53"));
}

TEST_CASE("aio limits are the I/O engine's own", "[config][issue16]") {
  // The schema accepted queue_depth up to 65536 and thread_count up to 1024;
  // the engine refuses more than 4096 and 256.
  for (const char* key : {"queue_depth", "thread_count"}) {
    const ConfigField* f = find_config_field(std::string("aio.") + key);
    REQUIRE(f != nullptr);
    const int max = static_cast<int>(f->max);
    INFO(key << " schema max " << max);
    nvme::AioOptions at_max, over;
    (std::string(key) == "queue_depth" ? at_max.queue_depth : at_max.thread_count) = max;
    (std::string(key) == "queue_depth" ? over.queue_depth : over.thread_count) = max + 1;
    REQUIRE_NOTHROW(at_max.validate());
    REQUIRE_THROWS(over.validate());
    const Config c = parse_config_text(fmt::format(R"({{"aio": {{"{}": {}}}}})", key, max));
    nvme::AioOptions from_config;
    from_config.queue_depth = c.aio.queue_depth;
    from_config.thread_count = c.aio.thread_count;
    REQUIRE_NOTHROW(from_config.validate());
    REQUIRE_THAT(only_problem(fmt::format(R"({{"aio": {{"{}": {}}}}})", key, max + 1)), Contains(std::string("aio.") + key));
  }
  REQUIRE(find_config_field("aio.queue_depth")->max == 4096);
  REQUIRE(find_config_field("aio.thread_count")->max == 256);
}

TEST_CASE("a long unknown key costs no suggestion search and is not echoed whole", "[config][issue16]") {
  const std::string key(1 << 20, 'k');
  const std::string problem = only_problem("{\"" + key + "\": 1}");
  REQUIRE_THAT(problem, Contains("unknown key") && Contains("(1048576 bytes)"));
  REQUIRE(problem.size() < 300);
  // No edit distance for keys past 64 characters: a long extension of a valid
  // key, which the prefix rule would otherwise match, gets no suggestion.
  REQUIRE_THAT(only_problem("{\"train_micro_batch_size_per_gpu" + std::string(40, 'x') + "\": 1}"),
               Contains("unknown key") && !Contains("did you mean"));
  // Control characters in a key are escaped, not printed.
  REQUIRE_THAT(only_problem("{\"a\\nb\\u0007\": 1}"), Contains("a\\nb\\x07: unknown key"));
}

TEST_CASE("the problems listed are bounded, the rest are counted", "[config][issue16]") {
  std::string text = "{";
  for (int i = 0; i < 10000; ++i) text += fmt::format("{}\"unknown_{}\": {}", i == 0 ? "" : ",", i, i);
  text += "}";
  const auto problems = problems_of(text);
  REQUIRE(problems.size() == 51);
  REQUIRE(problems.back() == "... and 9950 more problems");
}

TEST_CASE("a key given twice is a problem, not a silent overwrite", "[config][issue16]") {
  REQUIRE_THAT(only_problem(R"({"aio": {"queue_depth": 8, "queue_depth": 16}})"),
               Contains("aio.queue_depth: given more than once"));
}

TEST_CASE("strings and bytes from the file are quoted escaped and bounded", "[config][issue16]") {
  // A binary file: the byte nlohmann stopped at is escaped, not echoed raw.
  const std::string problem = only_problem("\x89PNG\r\n");
  REQUIRE_THAT(problem, Contains("1:1: JSON syntax error") && Contains("\\x89"));
  REQUIRE(problem.find('\x89') == std::string::npos);
  const std::string enum_problem = only_problem("{\"optimizer\": {\"type\": \"" + std::string(100000, 'A') + "\"}}");
  REQUIRE(enum_problem.size() < 400);
  REQUIRE_THAT(enum_problem, Contains("(100000 bytes)"));
  REQUIRE_THAT(only_problem(R"({"strata": {"trace_path": "a\u0000b"}})"), Contains("strata.trace_path"));
  // Nesting is bounded, not paid for in memory.
  REQUIRE_THAT(only_problem(std::string(100000, '[') + std::string(100000, ']')), Contains("nested deeper than 64"));
}

TEST_CASE("a directory, an oversized file: named as such", "[config][issue16]") {
  test::TempDir dir("config-dir");
  // Was "JSON syntax error ... unexpected end of input".
  REQUIRE_THROWS_WITH(load_config_file(dir.path().string()), Contains("Is a directory"));
  const std::string big = dir.file("big.json");
  {
    std::ofstream out(big);
    out << "{\"x\": \"" << std::string((16 << 20) + 10, 'x') << "\"}";
  }
  REQUIRE_THROWS_WITH(load_config_file(big), Contains("larger than 16777216 bytes"));
}

TEST_CASE("aio.engine chooses the I/O backend, strata.io_engine is its older name", "[config]") {
  CHECK(strata::parse_config_text(R"({"aio": {"engine": "aio"}})").aio.engine == "aio");
  CHECK(strata::parse_config_text(R"({"strata": {"io_engine": "psync"}})").aio.engine == "psync");
  REQUIRE_THROWS_WITH(strata::parse_config_text(R"({"aio": {"engine": "spdk"}})"),
                      Catch::Contains("aio.engine"));
  REQUIRE_THROWS_WITH(
      strata::parse_config_text(R"({"aio": {"engine": "aio"}, "strata": {"io_engine": "psync"}})"),
      Catch::Contains("conflicts with aio.engine"));
}

TEST_CASE("the scheduler block: checked with the schedule's own rules, kept as given", "[config]") {
  using strata::parse_config_text;
  const auto good = parse_config_text(
      R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}}})");
  CHECK(good.scheduler["type"] == "WarmupCosineLR");
  CHECK(good.scheduler["params"].size() == 2);  // not padded with defaults of other types
  CHECK(parse_config_text("{}").scheduler.is_null());
  const auto problems = [](const char* text) {
    try {
      parse_config_text(text);
    } catch (const strata::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("valid");
  };
  CHECK_THAT(problems(R"({"scheduler": {"type": "OneCycle"}})"), Catch::Contains("scheduler.type"));
  CHECK_THAT(problems(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})"),
             Catch::Contains("total_num_steps: required by WarmupDecayLR"));
  CHECK_THAT(problems(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}})"),
             Catch::Contains("warmup_steps"));
}

TEST_CASE("aio.auto_tune and strata.overlap_optimizer parse, with their defaults and combinations", "[config]") {
  const Config defaults = parse_config_text("{}", "test.json");
  CHECK_FALSE(defaults.aio.auto_tune);
  CHECK(defaults.strata.overlap_optimizer);
  const Config c = parse_config_text(R"({"aio": {"auto_tune": true}, "strata": {"overlap_optimizer": false}})",
                                     "test.json");
  CHECK(c.aio.auto_tune);
  CHECK_FALSE(c.strata.overlap_optimizer);
  REQUIRE_THAT(only_problem(R"({"aio": {"auto_tune": true, "engine": "psync"}})"),
               Contains("auto_tune") && Contains("psync"));
  REQUIRE_THAT(only_problem(R"({"aio": {"auto_tune": 1}})"), Contains("aio.auto_tune") && Contains("true or false"));
}

TEST_CASE("NVMe optimizer offload is accepted at stages 1 and 2 (beyond DeepSpeed, which asks for stage 3)",
          "[config]") {
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    CHECK(problems_of(R"({"zero_optimization": {"stage": )" + std::to_string(stage) +
                      R"(, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/swap"}}})")
              .empty());
  }
  CHECK_THAT(only_problem(R"({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/swap"}}})"),
             Contains("zero_optimization.stage is 0"));
}

TEST_CASE("the effective configuration is itself a valid configuration that gives the same effective one",
          "[config]") {
  // run.json records it and `strata plan --check` parses it back; a user may
  // copy it from `strata config` output.
  for (const std::string& text :
       {std::string("{}"),
        std::string(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "bf16": {"enabled": true},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/s"},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/s"}},
            "fp16": {"enabled": false}, "gradient_clipping": 1.0})")}) {
    CAPTURE(text);
    const strata::Config first = strata::parse_config_text(text, "given");
    const strata::Config again = strata::parse_config(first.effective, "effective");
    CHECK(again.effective == first.effective);
  }
}

TEST_CASE("sub_group_size and reduce_bucket_size: left out chosen from the model, given kept, \"auto\" the "
          "Trainer's",
          "[config][zero_sizes]") {
  // Left out (or null, as the effective config writes it): 0, the engine's
  // kChooseFromModel, and the engine options carry it to finalize.
  for (const char* text : {R"({"zero_optimization": {"stage": 3}})",
                           R"({"zero_optimization": {"stage": 3, "sub_group_size": null, "reduce_bucket_size": null}})"}) {
    CAPTURE(text);
    const Config c = parse_config_text(text);
    CHECK(c.zero.sub_group_numel == 0);
    CHECK(c.zero.reduce_bucket_numel == 0);
  }
  // Given: kept as given, DeepSpeed's own defaults too.
  const Config given = parse_config_text(
      R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e9, "reduce_bucket_size": 2e6}})");
  CHECK(given.zero.sub_group_numel == 1000000000);
  CHECK(given.zero.reduce_bucket_numel == 2000000);
  // "auto" is a value given (a Hugging Face Trainer config), never the
  // per-layer choice: without the model DeepSpeed's 5e8, as before (finetune
  // fills the Trainer's hidden_size^2 first: trainer_flags_test.cc).
  const Config automatic = parse_config_text(R"({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})");
  CHECK(automatic.zero.reduce_bucket_numel == kDeepSpeedReduceBucketNumel);
  CHECK(automatic.zero.sub_group_numel == 0);
  CHECK(automatic.effective["zero_optimization"]["reduce_bucket_size"] == kDeepSpeedReduceBucketNumel);
  // Zero is not a size: leave the key out to have it chosen.
  CHECK_THAT(only_problem(R"({"zero_optimization": {"sub_group_size": 0}})"),
             Contains("zero_optimization.sub_group_size"));
}

TEST_CASE("moe.expert_parallel_size: the world size when left out and it divides the experts or checked when given",
          "[config][moe]") {
  nn::DecoderConfig dense;
  nn::DecoderConfig moe;
  moe.model_type = "mixtral";
  moe.num_experts = 8;
  REQUIRE(moe.moe());
  const Config absent = parse_config_text("{}", "ds.json");
  CHECK(absent.expert_parallel_size == 0);
  CHECK(train::choose_expert_parallel_size(absent, moe, 4, "ds.json") == 4);
  CHECK(train::choose_expert_parallel_size(absent, moe, 3, "ds.json") == 1);  // 3 does not divide 8
  CHECK(train::choose_expert_parallel_size(absent, dense, 4, "ds.json") == 1);
  const Config null = parse_config_text(R"({"moe": {"expert_parallel_size": null}})", "ds.json");
  CHECK(null.expert_parallel_size == 0);
  const Config two = parse_config_text(R"({"moe": {"expert_parallel_size": 2}})", "ds.json");
  CHECK(train::choose_expert_parallel_size(two, moe, 4, "ds.json") == 2);
  REQUIRE_THROWS_WITH(train::choose_expert_parallel_size(two, moe, 3, "ds.json"),
                      Contains("moe.expert_parallel_size 2 does not divide the world size 3"));
  REQUIRE_THROWS_WITH(train::choose_expert_parallel_size(two, dense, 2, "ds.json"),
                      Contains("the model (model_type llama) has no experts"));
  const Config three = parse_config_text(R"({"moe": {"expert_parallel_size": 3}})", "ds.json");
  REQUIRE_THROWS_WITH(train::choose_expert_parallel_size(three, moe, 3, "ds.json"),
                      Contains("does not divide the model's 8 experts"));
  CHECK_THAT(problems_of(R"({"moe": {"expert_parallel_size": 0}})").front(), Contains("moe.expert_parallel_size"));
  CHECK_THAT(problems_of(R"({"moe": {"expert_paralel_size": 2}})").front(), Contains("moe.expert_parallel_size"));
}

TEST_CASE("tensor_parallel.autotp_size and sequence_parallel are read and tp with expert parallelism refused",
          "[config][tp]") {
  CHECK(parse_config_text("{}", "ds.json").tensor_parallel_size == 1);
  CHECK(parse_config_text(R"({"tensor_parallel": {"autotp_size": 2}})", "ds.json").tensor_parallel_size == 2);
  CHECK_THAT(problems_of(R"({"tensor_parallel": {"autotp_size": 0}})").front(),
             Contains("tensor_parallel.autotp_size"));
  CHECK(parse_config_text(R"({"tensor_parallel": {"autotp_size": 2}, "sequence_parallel": true})", "ds.json")
            .sequence_parallel);
  CHECK_FALSE(parse_config_text("{}", "ds.json").sequence_parallel);
  CHECK_THAT(only_problem(R"({"tensor_parallel": {"autotp_size": 2}, "moe": {"expert_parallel_size": 2}})"),
             Contains("not implemented for mixture-of-experts models yet"));
}
