// A trainer's parameter groups through the engine (the C API's
// strata_set_lr_scale and strata_read/write_optimizer_state, issue 42):
// parameters with an lr scale of their own form groups of their own whose
// step uses lr x scale -- scale 2 everywhere is the run at twice the lr, bit
// for bit, and scale 0 leaves a parameter as freezing it does while the rest
// train as before; the Adam moments read by parameter and written back
// continue exactly, with the optimizer state in memory, on NVMe and on the
// accelerator, on two ranks.
#include <catch2/catch.hpp>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tests/engine/zero_training.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::test::zero;

namespace {

bool attention(const std::string& name) { return name.find(".self_attn.") != std::string::npos; }

}  // namespace

TEST_CASE("lr scales: 2 everywhere is twice the lr, 0 is as frozen, bit for bit",
          "[engine][zero][param_groups]") {
  ops::set_cpu_threads(1);
  for (int stage : {2, 3}) {
    CAPTURE(stage);
    TrainSpec doubled;
    doubled.options = options_for(stage);
    doubled.lr_scale = [](const std::string&) { return 2.0f; };
    TrainSpec twice = doubled;
    twice.lr_scale = nullptr;
    twice.lr = [](int) { return 2 * kLr; };
    const TrainResult a = train_zero(doubled), b = train_zero(twice);
    CHECK(compare(a, b).identical);
    CHECK(a.losses == b.losses);

    TrainSpec still;  // no clipping: the others' updates do not depend on the frozen ones
    still.options = options_for(stage);
    still.lr_scale = [](const std::string& name) { return attention(name) ? 0.0f : 1.0f; };
    TrainSpec frozen = still;
    frozen.lr_scale = nullptr;
    frozen.frozen = attention;
    const TrainResult c = train_zero(still), d = train_zero(frozen);
    CHECK(compare(c, d).identical);
    CHECK(c.losses == d.losses);
  }
}

TEST_CASE("Adam moments read by parameter and written back continue exactly, and written changed change the run",
          "[engine][zero][param_groups]") {
  ops::set_cpu_threads(1);
  const test::TempDir swap("strata-param-groups");
  for (Tier optimizer : {Tier::kCpu, Tier::kNvme, Tier::kDevice}) {
    CAPTURE(static_cast<int>(optimizer));
    TrainSpec plain;
    plain.world = 2;
    plain.options = options_on(3, optimizer == Tier::kDevice ? Tier::kDevice : Tier::kCpu, optimizer, swap.path());
    plain.options.sub_group_numel = 2000;  // several sub-groups, parameters across their edges
    plain.lr_scale = [](const std::string& name) { return attention(name) ? 3.0f : 1.0f; };
    const TrainResult want = train_zero(plain);

    for (float factor : {1.0f, 0.5f}) {
      CAPTURE(factor);
      std::mutex mutex;
      std::vector<int64_t> visited(2, 0), owned(2, 0);
      TrainSpec round_trip = plain;
      round_trip.after_step = [&](int rank, int step, engine::ZeroEngine& eng) {
        if (step != 0) return;
        std::map<std::pair<engine::ParamId, int64_t>, std::vector<float>> m, v;
        eng.read_moments([&](engine::ParamId id, int64_t first, size_t count, const float* a, const float* b) {
          m[{id, first}].assign(a, a + count);
          v[{id, first}].assign(b, b + count);
        });
        int64_t n = 0;
        for (const auto& [key, values] : m) n += static_cast<int64_t>(values.size());
        int64_t trained = 0;
        for (engine::ParamId id = 0; id < eng.parameter_count(); ++id) {
          eng.for_each_owned_range(id, engine::Engine::Access::kRead,
                                   [&](int64_t, const TensorView& host) { trained += host.numel(); });
        }
        const int64_t steps = eng.step_count();
        eng.write_moments(
            [&](engine::ParamId id, int64_t first, size_t count, float* a, float* b) {
              const auto& ma = m.at({id, first});
              const auto& vb = v.at({id, first});
              REQUIRE(ma.size() == count);
              for (size_t i = 0; i < count; ++i) a[i] = ma[i] * factor, b[i] = vb[i];
            },
            steps);
        std::lock_guard lock(mutex);
        visited[static_cast<size_t>(rank)] = n;
        owned[static_cast<size_t>(rank)] = trained;
      };
      const TrainResult got = train_zero(round_trip);
      CHECK(visited == owned);  // every owned element of every (trained) parameter, once
      CHECK(visited[0] > 0);
      if (factor == 1.0f) {
        CHECK(compare(got, want).identical);
        CHECK(got.losses == want.losses);
      } else {
        CHECK(got.losses[0] == want.losses[0]);
        CHECK_FALSE(compare(got, want).identical);
      }
    }
  }
}
