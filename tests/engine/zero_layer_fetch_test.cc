// Per-layer fetch accounting (issue 27 item 3; offload/layer_fetch.h): the
// decoder layer index of an operator's name, which layer a parameter counts for,
// and a Mixtral under ZeRO-3 with parameters on NVMe whose per-layer figures
// add up to the step's and follow the routing: a layer gathers exactly its
// parameters less the experts skipped there, and a layer with experts skipped
// reads fewer bytes than the same layer with every expert routed; on the
// timeline each layer's counters peak at its step's figures.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "core/trace_recorder.h"
#include "offload/layer_fetch.h"
#include "runtime/engine/zero_sizes.h"
#include "tests/engine/zero_training.h"
#include "tests/runtime/trace_checks.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::test::zero;
using engine::layer_index_of;
using offload::LayerFetch;

namespace {

// A Mixtral (16 experts of width 64) under ZeRO-3 with parameters and
// optimizer state on NVMe under `swap`, on one token per sequence
// (repeated_tokens: a step routes to at most 8 of the 16 experts per layer).
TrainSpec nvme_mixtral(const std::filesystem::path& swap) {
  TrainSpec spec;
  spec.config = mixtral_config(16, 64, /*aux=*/false);
  spec.steps = 3;
  spec.options = options_for(3);
  spec.options.param_tier = Tier::kNvme;
  spec.options.optimizer_tier = Tier::kNvme;
  spec.options.nvme_path = swap;
  spec.batches = repeated_tokens;
  return spec;
}

LayerFetch sum(const std::vector<LayerFetch>& layers) {
  LayerFetch total;
  for (const LayerFetch& l : layers) total += l;
  return total;
}

}  // namespace

TEST_CASE("layer_index_of: the number of layer_of's component, -1 without one", "[engine][moe]") {
  CHECK(layer_index_of("model.layers.3.block_sparse_moe.experts.5.w1") == 3);
  CHECK(layer_index_of("model.layers.12.self_attn.q_proj") == 12);
  CHECK(layer_index_of("transformer.h.7.attn") == 7);
  CHECK(layer_index_of("model.layers.7") == 7);
  CHECK(layer_index_of("model.embed_tokens") == -1);
  CHECK(layer_index_of("model.norm") == -1);
  CHECK(layer_index_of("lm_head") == -1);
  CHECK(layer_index_of("model.layers.3x.mlp") == -1);
  CHECK(layer_index_of("model.layers.99999999999.mlp") == -1);
}

TEST_CASE("LayerTally: a parameter counts for the layer its operators share, none when they differ",
          "[engine][moe]") {
  // op 0 (no layer) and op 3 (layer 1) share parameter 0 (a tied embedding);
  // ops 1 and 2 (layer 0) share parameter 1; parameter 3 is listed by none.
  const std::vector<std::vector<engine::ParamId>> params{{0}, {1, 2}, {1}, {0, 4}};
  const offload::LayerTally tally({-1, 0, 0, 1}, 5,
                                  [&](engine::OpId op) -> const std::vector<engine::ParamId>& { return params[op]; });
  CHECK(tally.slots() == 3);
  CHECK(tally.param_layer(0) == -1);
  CHECK(tally.param_layer(1) == 0);
  CHECK(tally.param_layer(2) == 0);
  CHECK(tally.param_layer(3) == -1);
  CHECK(tally.param_layer(4) == 1);
  std::vector<LayerFetch> counts;
  tally.of_param(counts, 4).gathers += 2;
  ++tally.of_op(counts, 0).windows;
  REQUIRE(counts.size() == 3);
  CHECK(counts[0].layer == -1);
  CHECK(counts[0].windows == 1);
  CHECK(counts[2].layer == 1);
  CHECK(counts[2].gathers == 2);
}

TEST_CASE("MoE under ZeRO-3 on NVMe, per layer: the layers add up to the step, skipped experts' layers fetch fewer bytes",
          "[engine][zero][moe][nvme]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-zero-layer-fetch");
  TrainSpec spec = nvme_mixtral(dir.path() / "routed");
  const TrainResult routed = train_zero(spec);
  // Random tokens: (nearly) every expert routed every step.
  spec.batches = {};
  spec.options.nvme_path = dir.path() / "all";
  const TrainResult all = train_zero(spec);

  const int64_t layers = spec.config->num_hidden_layers;
  std::vector<int64_t> params_of_layer(static_cast<size_t>(layers) + 1, 0);  // per slot (layer + 1)
  for (const std::string& name : routed.names) ++params_of_layer[static_cast<size_t>(layer_index_of(name) + 1)];

  for (size_t s = 1; s < routed.prefetch.size(); ++s) {
    CAPTURE(s);
    for (const TrainResult* run : {&routed, &all}) {
      const engine::PrefetchStats& p = run->prefetch[s];
      const std::vector<LayerFetch> per_layer = p.per_layer();
      REQUIRE(per_layer.size() == static_cast<size_t>(layers) + 1);
      const LayerFetch total = sum(per_layer);
      CHECK(total.windows == p.windows);
      CHECK(total.skipped_windows == p.skipped_windows);
      CHECK(total.gathers == p.gathers);
      CHECK(total.gather_nbytes == p.gather_nbytes);
      CHECK(total.reads == p.reads);
      CHECK(total.read_nbytes == p.read_nbytes);
      CHECK(total.stalled_windows == p.stalled_windows());
      CHECK(total.stall_seconds == Approx(p.param_stall_seconds()).margin(1e-9));
      // Every parameter that runs is gathered once a step; an expert no rank
      // routed to skips 6 windows (3 projections, forward and backward).
      for (size_t slot = 0; slot < per_layer.size(); ++slot) {
        CAPTURE(slot);
        CHECK(per_layer[slot].layer == static_cast<int32_t>(slot) - 1);
        CHECK(per_layer[slot].gathers == params_of_layer[slot] - per_layer[slot].skipped_windows / 2);
      }
      CHECK(per_layer[0].skipped_windows == 0);  // embedding, final norm, lm_head: never skipped
    }
    const std::vector<LayerFetch> r = routed.prefetch[s].per_layer(), a = all.prefetch[s].per_layer();
    CHECK(r[0].read_nbytes == a[0].read_nbytes);
    for (int64_t layer = 0; layer < layers; ++layer) {
      const auto slot = static_cast<size_t>(layer + 1);
      CAPTURE(layer);
      INFO("routed: " << r[slot].skipped_windows << " skipped, " << r[slot].read_nbytes << " bytes read; all: "
                      << a[slot].skipped_windows << " skipped, " << a[slot].read_nbytes << " read");
      REQUIRE(r[slot].skipped_windows > a[slot].skipped_windows);
      CHECK(r[slot].read_nbytes < a[slot].read_nbytes);
      CHECK(r[slot].gather_nbytes < a[slot].gather_nbytes);
    }
  }
}

TEST_CASE("MoE under ZeRO-3 on NVMe, per layer on the timeline: each layer's counters peak at its step's figures",
          "[engine][zero][moe][nvme][trace]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-zero-layer-trace");
  const TrainSpec spec = nvme_mixtral(dir.path() / "swap");
  trace::Options o;
  o.path = dir.file("trace.json");
  trace::start(o);
  const TrainResult routed = train_zero(spec);
  trace::stop();

  // Each counter track's highest sample.
  const test::TraceFile file = test::read_trace(o.path, 0);
  std::map<std::string, int64_t> peak;
  for (const auto& e : file.events) {
    if (e["ph"] != "C") continue;
    int64_t& p = peak[e["name"].get<std::string>()];
    p = std::max(p, e["args"]["value"].get<int64_t>());
  }
  const int64_t layers = spec.config->num_hidden_layers;
  for (int64_t slot = 0; slot <= layers; ++slot) {
    const std::string layer = slot == 0 ? std::string("no layer") : "layer " + std::to_string(slot - 1);
    CAPTURE(layer);
    uint64_t read = 0, gathered = 0;
    double stall = 0;
    for (const engine::PrefetchStats& p : routed.prefetch) {
      const LayerFetch l = p.per_layer().at(static_cast<size_t>(slot));
      read = std::max(read, l.read_nbytes);
      gathered = std::max(gathered, l.gather_nbytes);
      stall = std::max(stall, l.stall_seconds);
    }
    REQUIRE(peak.count("param bytes read: " + layer) == 1);
    CHECK(peak["param bytes read: " + layer] == static_cast<int64_t>(read));
    CHECK(peak["param bytes gathered: " + layer] == static_cast<int64_t>(gathered));
    if (stall > 0) CHECK(static_cast<double>(peak["param stall us: " + layer]) == Approx(stall * 1e6).margin(2));
  }
}
