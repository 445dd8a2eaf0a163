// ZeroEngine checkpoints: a run saved after step k and resumed into fresh
// engines ends bit for bit where the uninterrupted run ends, for every stage
// and tier; a state of another world size or a truncated file is refused
// naming the file.
#include <catch2/catch.hpp>

#include <filesystem>

#include "kernels/ops.h"
#include "tests/engine/zero_training.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::test::zero;

TEST_CASE("save after step 3, resume in fresh engines: bit for bit the uninterrupted run", "[engine][zero][state]") {
  ops::set_cpu_threads(1);
  struct Case {
    int stage;
    Tier params, optimizer;
  };
  for (const Case& c : {Case{1, Tier::kDevice, Tier::kCpu}, Case{2, Tier::kDevice, Tier::kNvme},
                        Case{3, Tier::kCpu, Tier::kCpu}, Case{3, Tier::kNvme, Tier::kNvme},
                        Case{2, Tier::kDevice, Tier::kDevice}, Case{3, Tier::kDevice, Tier::kDevice}}) {
    CAPTURE(c.stage, tier_name(c.params), tier_name(c.optimizer));
    test::TempDir dir("strata-zero-state");
    TrainSpec spec;
    spec.world = 2;
    spec.steps = 5;
    spec.tied = true;
    spec.options = options_for(c.stage);
    spec.options.param_tier = c.params;
    spec.options.optimizer_tier = c.optimizer;
    spec.options.nvme_path = dir.path() / "swap";
    spec.options.sub_group_numel = 4096;
    const TrainResult whole = train_zero(spec);

    TrainSpec saving = spec;
    saving.save_dir = dir.path() / "ckpt";
    saving.save_after_step = 2;
    const TrainResult saved = train_zero(saving);
    CHECK(compare(saved, whole).identical);  // saving changes nothing

    TrainSpec resumed = spec;
    resumed.load_dir = saving.save_dir;
    resumed.first_step = 3;
    const TrainResult rest = train_zero(resumed);
    CHECK(compare(rest, whole).identical);
    REQUIRE(rest.losses.size() == 2);
    CHECK(rest.losses[0] == whole.losses[3]);
    CHECK(rest.losses[1] == whole.losses[4]);
  }
}

TEST_CASE("a checkpoint moves between the optimizer on the accelerator and the CPU optimizer, bit for bit",
          "[engine][zero][state]") {
  ops::set_cpu_threads(1);
  for (const auto& [saved_on, resumed_on] : {std::pair{Tier::kDevice, Tier::kNvme}, std::pair{Tier::kCpu, Tier::kDevice}}) {
    CAPTURE(tier_name(saved_on), tier_name(resumed_on));
    test::TempDir dir("strata-zero-state");
    TrainSpec spec;
    spec.world = 2;
    spec.steps = 5;
    spec.options = options_for(3);
    spec.options.nvme_path = dir.path() / "swap";
    spec.options.sub_group_numel = 4096;
    spec.options.optimizer_tier = saved_on;
    const TrainResult whole = train_zero(spec);

    TrainSpec saving = spec;
    saving.save_dir = dir.path() / "ckpt";
    saving.save_after_step = 2;
    train_zero(saving);
    TrainSpec resumed = spec;
    resumed.options.optimizer_tier = resumed_on;
    resumed.options.grad_tier = resumed_on == Tier::kNvme ? Tier::kNvme : Tier::kDevice;
    resumed.load_dir = saving.save_dir;
    resumed.first_step = 3;
    const TrainResult rest = train_zero(resumed);
    CHECK(compare(rest, whole).identical);
  }
}

TEST_CASE("a state of another world size, or with a truncated file, is refused naming the file",
          "[engine][zero][state]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-zero-state");
  TrainSpec spec;
  spec.world = 2;
  spec.steps = 1;
  spec.options = options_for(3);
  spec.save_dir = dir.path() / "ckpt";
  spec.save_after_step = 0;
  train_zero(spec);
  const auto rank0 = spec.save_dir / "rank0";
  REQUIRE(std::filesystem::exists(rank0 / "engine.json"));
  REQUIRE(std::filesystem::exists(rank0 / "params_fp32.bin"));

  TrainSpec one = spec;
  one.world = 1;
  one.save_after_step = -1;
  one.load_dir = spec.save_dir;
  CHECK_THROWS_WITH(train_zero(one), Catch::Contains("written by a run of 2 ranks; this run has 1") &&
                                         Catch::Contains("rank0/engine.json"));

  std::filesystem::resize_file(rank0 / "exp_avg_fp32.bin", 100);
  TrainSpec two = spec;
  two.save_after_step = -1;
  two.load_dir = spec.save_dir;
  CHECK_THROWS_WITH(train_zero(two), Catch::Contains("exp_avg_fp32.bin has 100 bytes"));
}
