// Frozen parameters (Engine::freeze): no gradient, no reduction, no optimizer
// state; under ZeRO-3 still partitioned, offloaded and gathered. One rank
// equals the resident reference that leaves them out of its optimizer, bit for
// bit, at every stage; on two ranks with parameters and optimizer state on
// NVMe the frozen parameters come out bit-unchanged, the others equal one
// rank to rounding, and a checkpoint saved and resumed mid-run continues
// exactly.
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>

#include "tests/engine/zero_training.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::test::zero;

namespace {

// Layer 0's attention projections and input norm, layer 1's down projection,
// and the embedding table (a frozen RMSNorm has no weight gradient, a frozen
// table's lookup no backward at all).
bool frozen_name(const std::string& name) {
  return name.rfind("model.layers.0.self_attn.", 0) == 0 || name == "model.layers.1.mlp.down_proj.weight" ||
         name == "model.layers.0.input_layernorm.weight" || name == "model.embed_tokens.weight";
}

size_t frozen_count(const TrainResult& r) {
  size_t n = 0;
  for (const auto& name : r.names) n += frozen_name(name) ? 1 : 0;
  return n;
}

}  // namespace

TEST_CASE("frozen parameters: one rank equals the resident engine that does not train them, bit for bit",
          "[engine][zero][frozen]") {
  ops::set_cpu_threads(1);
  ResidentSpec resident;
  resident.adam = options_for(3).adam;
  resident.frozen = frozen_name;
  const TrainResult reference = train_resident(resident);
  REQUIRE(frozen_count(reference) == 7);
  for (size_t p = 0; p < reference.names.size(); ++p) {
    if (frozen_name(reference.names[p])) CHECK(reference.params[p] == reference.initial_params[p]);
  }
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    TrainSpec spec;
    spec.options = options_for(stage);
    spec.frozen = frozen_name;
    const TrainResult zero = train_zero(spec);
    CHECK(compare(zero, reference).identical);
    CHECK(zero.losses == reference.losses);
    CHECK(zero.grad_norms == reference.grad_norms);
  }
}

TEST_CASE("frozen parameters on two ranks with everything on NVMe: bit-unchanged, and a resumed run continues exactly",
          "[engine][zero][frozen][nvme]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-zero-frozen");
  TrainSpec one;
  one.options = options_for(3);
  one.options.adam.eps = 1.0f;  // rounding-size differences stay rounding-size (see the two-rank test)
  one.frozen = frozen_name;
  one.steps = 4;
  TrainSpec two = one;
  two.world = 2;
  two.options.param_tier = Tier::kNvme;
  two.options.optimizer_tier = Tier::kNvme;
  two.options.grad_tier = Tier::kNvme;
  two.options.nvme_path = dir.path() / "swap";
  const TrainResult a = train_zero(one), b = train_zero(two);
  ResidentSpec initial;  // the initial values, to hold the frozen ones against
  initial.steps = 0;
  const TrainResult start = train_resident(initial);
  REQUIRE(frozen_count(b) == 7);
  for (size_t p = 0; p < b.names.size(); ++p) {
    CAPTURE(b.names[p]);
    if (frozen_name(b.names[p])) {
      CHECK(b.params[p] == start.params[p]);
    } else {
      CHECK(b.params[p] != start.params[p]);  // trained
    }
  }
  const Diff d = compare(b, a);
  INFO("max |2 ranks - 1 rank| = " << d.max_abs);
  CHECK(d.max_abs <= 2e-6);

  // Saved after step 1, resumed from step 2: the same end, bit for bit.
  TrainSpec save = two;
  save.save_dir = dir.path() / "ckpt";
  save.save_after_step = 1;
  const TrainResult saved = train_zero(save);
  CHECK(compare(saved, b).identical);
  for (const auto& f : std::filesystem::directory_iterator(save.save_dir / "rank0")) {
    const std::string name = f.path().filename().string();
    const bool ok = name.find("frozen") == std::string::npos || name == "params_fp32_frozen.bin";
    CHECK(ok);  // no optimizer state for the frozen group
  }
  CHECK(std::filesystem::exists(save.save_dir / "rank0" / "params_fp32_frozen.bin"));
  TrainSpec resume = two;
  resume.load_dir = save.save_dir;
  resume.first_step = 2;
  const TrainResult resumed = train_zero(resume);
  CHECK(compare(resumed, b).identical);

  // A run that freezes another set cannot load that checkpoint.
  TrainSpec other = resume;
  other.frozen = [](const std::string& name) { return name.rfind("model.layers.0.self_attn.", 0) == 0; };
  other.collect_errors = true;
  const TrainResult refused = train_zero(other);
  REQUIRE(refused.errors[0] != nullptr);
  CHECK_THROWS_WITH(std::rethrow_exception(refused.errors[0]), Catch::Contains("--freeze"));
}
