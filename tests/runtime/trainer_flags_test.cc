// Hugging Face Trainer ds_configs: "auto" filled from finetune's Trainer-like
// flags or refused naming key and flag (runtime/config/trainer_flags.h);
// csv_monitor / tensorboard / wandb sections.
#include <catch2/catch.hpp>

#include "runtime/config/config.h"
#include "runtime/config/trainer_flags.h"

using namespace strata;

namespace {

// The config a Trainer user writes (DeepSpeed's own "auto" examples).
constexpr const char* kTrainerConfig = R"({
  "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                "warmup_num_steps": "auto", "total_num_steps": "auto"}},
  "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                        "stage3_param_persistence_threshold": "auto"}})";

Config with_flags(const TrainerFlags& flags, const char* text = kTrainerConfig) {
  return parse_config_text(text, "ds.json", [&](nlohmann::json doc) {
    return apply_trainer_flags(std::move(doc), flags, "ds.json");
  });
}

}  // namespace

TEST_CASE("Trainer auto values are filled from the Trainer-like flags, never silently defaulted", "[config]") {
  TrainerFlags flags;
  flags.lr = 2e-5;
  flags.weight_decay = 0.1;
  flags.micro_batch = 4;
  flags.grad_accum = 8;
  flags.warmup_steps = 30;
  flags.bf16 = true;
  flags.steps = 500;
  flags.hidden_size = 64;
  const Config c = with_flags(flags);
  CHECK(c.optimizer.lr == Approx(2e-5));
  CHECK(c.optimizer.weight_decay == Approx(0.1));
  CHECK(c.micro_batch_size == 4);
  CHECK(c.gradient_accumulation_steps == 8);
  CHECK(c.train_batch_size == 0);  // derived from the two and the world size
  CHECK(c.bf16);
  CHECK(c.scheduler["params"]["warmup_max_lr"].get<double>() == Approx(2e-5));
  CHECK(c.scheduler["params"]["warmup_min_lr"].get<double>() == 0);
  CHECK(c.scheduler["params"]["warmup_num_steps"].get<int64_t>() == 30);
  CHECK(c.scheduler["params"]["total_num_steps"].get<int64_t>() == 500);
  CHECK(c.zero.reduce_bucket_numel == 64 * 64);

  // A flag not given: refused, naming the key and the flag (the learning rate is not 1e-3 by accident).
  TrainerFlags missing = flags;
  missing.lr.reset();
  REQUIRE_THROWS_WITH(with_flags(missing), Catch::Contains("optimizer.params.lr: \"auto\" is filled from --lr") &&
                                               Catch::Contains("scheduler.params.warmup_max_lr"));
  // An "auto" no flag fills.
  REQUIRE_THROWS_WITH(with_flags(flags, R"({"gradient_clipping": "auto", "zero_optimization": {"stage": 3}})"),
                      Catch::Contains("gradient_clipping: \"auto\" is a Hugging Face Trainer value"));
  // A key whose own values include "auto" keeps it: it is not a Trainer placeholder.
  CHECK(with_flags(flags, R"({"zero_optimization": {"stage": 3}, "strata": {"accelerator": "auto"}})").strata.accelerator ==
        "auto");
  // A flag beside an explicit value that differs: which one? Refused.
  REQUIRE_THROWS_WITH(with_flags(flags, R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                            "zero_optimization": {"stage": 3}})"),
                      Catch::Contains("optimizer.params.lr: 0.001 here, but --lr says 2e-05"));
  // The built-in defaults take the flags.
  TrainerFlags override = flags;
  override.override_values = true;
  CHECK(with_flags(override, R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                 "zero_optimization": {"stage": 3}})")
            .optimizer.lr == Approx(2e-5));
}

TEST_CASE("strata config check refuses a Trainer auto value naming the finetune flag, derived sizes keep the "
          "default",
          "[config]") {
  REQUIRE_THROWS_WITH(parse_config_text(R"({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                                           "zero_optimization": {"stage": 3}})"),
                      Catch::Contains("optimizer.params.lr: \"auto\" is a Hugging Face Trainer value: strata "
                                      "finetune fills it from --lr"));
  const Config c = parse_config_text(R"({"train_batch_size": "auto",
                                         "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})");
  CHECK(c.train_batch_size == 0);
  CHECK(c.zero.reduce_bucket_numel == 500000000);
  REQUIRE_THROWS_WITH(parse_config_text(R"({"gradient_clipping": "auto", "zero_optimization": {"stage": 3}})"),
                      Catch::Contains("gradient_clipping: \"auto\" is a Hugging Face Trainer value strata has no flag"));
}

TEST_CASE("csv_monitor and tensorboard sections are read, wandb is refused with the reason", "[config]") {
  const Config c = parse_config_text(R"({"zero_optimization": {"stage": 3},
      "csv_monitor": {"enabled": true, "output_path": "logs/", "job_name": "run1"},
      "tensorboard": {"enabled": false, "output_path": "tb/", "job_name": "run1"}})");
  CHECK(c.csv_monitor.enabled);
  CHECK(c.csv_monitor.output_path == "logs/");
  CHECK(c.csv_monitor.job_name == "run1");
  CHECK(!c.tensorboard.enabled);
  REQUIRE_THROWS_WITH(parse_config_text(R"({"zero_optimization": {"stage": 3}, "wandb": {"enabled": true,
                                           "project": "p"}})"),
                      Catch::Contains("wandb.enabled is true") && Catch::Contains("network") &&
                          Catch::Contains("csv_monitor"));
}
