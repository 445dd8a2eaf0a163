// Per-decoder-layer activation checkpointing in DecoderModel
// (DecoderModelOptions::checkpoint_activations / cpu_checkpointing): the same
// loss and gradients as without, bit for bit on the cpu accelerator; a smaller
// arena, by exactly the activations of all but one layer; and the recompute
// bracketed by Phase::kRecompute hook windows.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/nn/decoder_model.h"
#include "tests/nn/engine_rig.h"
#include "tests/nn/golden_checks.h"
#include "tests/support/tolerances.h"
#include "tests/nn/test_models.h"

using namespace strata;
using namespace strata::nn;

namespace {

enum class Mode { kNone, kDevice, kCpu };

const char* mode_name(Mode m) {
  return m == Mode::kNone ? "no checkpointing" : m == Mode::kDevice ? "device checkpoints"
                                                                    : "cpu checkpoints";
}

DecoderModelOptions options_for(Mode mode, DecoderModelOptions o) {
  o.checkpoint_activations = mode != Mode::kNone;
  o.cpu_checkpointing = mode == Mode::kCpu;
  return o;
}

struct Batch {
  std::vector<int32_t> ids, targets;
  int64_t batch, seq;
};

Batch make_batch(const DecoderConfig& c, int64_t batch, int64_t seq, uint32_t seed) {
  std::mt19937 gen(seed);
  Batch b{{}, {}, batch, seq};
  for (int64_t i = 0; i < batch * seq; ++i) {
    b.ids.push_back(static_cast<int32_t>(gen() % static_cast<uint32_t>(c.vocab_size)));
    // Some ignored targets, as in real packed data.
    b.targets.push_back(i % 7 == 3 ? ops::kIgnoreIndex
                                   : static_cast<int32_t>(gen() % static_cast<uint32_t>(c.vocab_size)));
  }
  return b;
}

struct Result {
  std::vector<double> loss_sums;                   // per micro-batch
  std::map<std::string, std::vector<float>> grads;  // accumulated over the micro-batches
  size_t arena_nbytes = 0;
};

// Two micro-batches of different shapes (the arena is laid out again between
// them) accumulated into one gradient, from the same counter-based init.
Result train(const DecoderConfig& c, const DecoderModelOptions& options, Mode mode) {
  test::Rig rig;
  DecoderModel model(*rig.engine, c, options_for(mode, options));
  rig.engine->finalize();
  initialize_parameters(*rig.engine, model.parameters(), 77, 0.2);
  rig.engine->zero_grad();
  Result r;
  for (const Batch& b : {make_batch(c, 2, 11, 1), make_batch(c, 3, 6, 2)}) {
    model.forward(b.ids, b.targets, b.batch, b.seq);
    model.backward();
    r.loss_sums.push_back(model.loss_stats().sum);
    r.arena_nbytes = model.arena_nbytes();
  }
  for (ParamId id : model.parameters()) r.grads[rig.engine->param_info(id).name] = rig.grad_values(id);
  return r;
}

void check_same(const DecoderConfig& c, const DecoderModelOptions& options) {
  const Result want = train(c, options, Mode::kNone);
  // Guard against a vacuous comparison: the reference really has gradients.
  size_t nonzero = 0;
  for (const auto& [name, g] : want.grads) {
    for (float v : g) nonzero += v != 0.0f;
  }
  REQUIRE(nonzero > 0);
  for (Mode mode : {Mode::kDevice, Mode::kCpu}) {
    const Result got = train(c, options, mode);
    INFO(mode_name(mode));
    // One layer is its own top layer: nothing is recomputed and nothing saved.
    if (c.num_hidden_layers > 1) {
      CHECK(got.arena_nbytes < want.arena_nbytes);
    } else {
      CHECK(got.arena_nbytes == want.arena_nbytes);
    }
    REQUIRE(got.loss_sums.size() == want.loss_sums.size());
    for (size_t i = 0; i < want.loss_sums.size(); ++i) {
      INFO("micro-batch " << i);
      CHECK(got.loss_sums[i] == want.loss_sums[i]);  // bitwise: the same kernels on the same data
    }
    REQUIRE(got.grads.size() == want.grads.size());
    for (const auto& [name, g] : want.grads) {
      const std::vector<float>& o = got.grads.at(name);
      REQUIRE(o.size() == g.size());
      size_t differ = 0;
      for (size_t i = 0; i < g.size(); ++i) differ += std::memcmp(&o[i], &g[i], sizeof(float)) != 0;
      INFO("gradient of " << name << ": " << differ << " of " << g.size() << " elements differ");
      CHECK(differ == 0);
    }
  }
}

}  // namespace

TEST_CASE("checkpointing: loss and gradients equal bit for bit (fp32, cpu)", "[nn][checkpoint]") {
  SECTION("3 layers, multi-head, untied") {
    DecoderConfig c = tiny_llama(40, 32, 64, 3, 4, 4);
    check_same(c, model_options(DType::kF32, 8));
  }
  SECTION("4 layers, grouped-query heads, tied embeddings") {
    DecoderConfig c = tiny_llama(40, 32, 64, 4, 4, 2);
    c.tie_word_embeddings = true;
    check_same(c, model_options(DType::kF32, 8));
  }
  SECTION("3 layers, GQA, tiled MLP, biases, bf16 storage and activations") {
    DecoderConfig c = tiny_llama(40, 32, 64, 3, 4, 1);
    c.attention_qkv_bias = c.attention_o_bias = true;
    c.mlp_bias = true;
    DecoderModelOptions o = model_options(DType::kBF16, 8);
    o.activation_dtype = DType::kBF16;
    o.mlp_tiling = {2, 3};
    check_same(c, o);
  }
  SECTION("1 layer: nothing to recompute, still equal") {
    check_same(tiny_llama(40, 32, 64, 1, 4, 2), model_options(DType::kF32, 8));
  }
}

TEST_CASE("checkpointing: the arena keeps one layer's activations instead of all",
          "[nn][checkpoint]") {
  // Sizes chosen so every arena view is a multiple of the 256-byte alignment,
  // which makes the saving exact: (layers - 1) x one layer's activations, plus,
  // with cpu checkpoints, layers - 1 residual buffers moved to host memory.
  const int64_t layers = 8, hidden = 64, inter = 128, heads = 4, kv_heads = 2, vocab = 64;
  const int64_t batch = 2, seq = 32, rows = batch * seq, hd = hidden / heads;
  const DecoderConfig c = tiny_llama(vocab, hidden, inter, layers, heads, kv_heads);
  const int64_t layer_numel = 5 * rows * hidden + 2 * rows * kv_heads * hd + 3 * rows * inter +
                              2 * rows + batch * heads * seq;  // DecoderActs, fp32
  const auto layer_nbytes = static_cast<size_t>(layer_numel) * sizeof(float);
  const auto residual_nbytes = static_cast<size_t>(rows * hidden) * sizeof(float);
  const Batch b = make_batch(c, batch, seq, 3);
  std::map<Mode, size_t> arena, host;
  for (Mode mode : {Mode::kNone, Mode::kDevice, Mode::kCpu}) {
    test::Rig rig;
    DecoderModel model(*rig.engine, c, options_for(mode, model_options(DType::kF32, 16)));
    rig.engine->finalize();
    initialize_parameters(*rig.engine, model.parameters(), 5);
    CHECK(model.arena_nbytes() == 0);
    model.forward(b.ids, b.targets, batch, seq);
    model.backward();
    CHECK(std::isfinite(model.loss()));
    arena[mode] = model.arena_nbytes();
    host[mode] = model.host_checkpoint_nbytes();
  }
  INFO("arena bytes: none " << arena[Mode::kNone] << ", device checkpoints "
                            << arena[Mode::kDevice] << ", cpu checkpoints " << arena[Mode::kCpu]);
  CHECK(arena[Mode::kNone] - arena[Mode::kDevice] == (layers - 1) * layer_nbytes);
  CHECK(arena[Mode::kDevice] - arena[Mode::kCpu] == (layers - 1) * residual_nbytes);
  CHECK(arena[Mode::kDevice] < 0.5 * arena[Mode::kNone]);
  CHECK(arena[Mode::kCpu] < arena[Mode::kDevice]);
  // Checkpoints of the 7 recomputed layers on the host; none otherwise.
  CHECK(host[Mode::kNone] == 0);
  CHECK(host[Mode::kDevice] == 0);
  CHECK(host[Mode::kCpu] == (layers - 1) * residual_nbytes);
}

TEST_CASE("checkpointing: the recompute runs in kRecompute windows, once per recomputed op",
          "[nn][checkpoint]") {
  const int64_t layers = 3;
  DecoderConfig c = tiny_llama(40, 32, 64, layers, 4, 2);
  for (Mode mode : {Mode::kNone, Mode::kDevice, Mode::kCpu}) {
    INFO(mode_name(mode));
    test::Rig rig;
    DecoderModelOptions o = options_for(mode, model_options(DType::kF32, 8));
    o.mlp_tiling = {1, 2};  // tile windows are recomputed too
    DecoderModel model(*rig.engine, c, o);
    rig.engine->finalize();
    initialize_parameters(*rig.engine, model.parameters(), 9);
    struct Window {
      OpId op;
      Phase phase;
    };
    std::vector<Window> windows;  // in order of pre_op
    rig.engine->set_hook_observer([&](OpId op, Phase phase, bool pre) {
      if (pre) windows.push_back({op, phase});
    });
    const Batch b = make_batch(c, 2, 5, 4);
    model.forward(b.ids, b.targets, b.batch, b.seq);
    const size_t forward_end = windows.size();
    CHECK(std::none_of(windows.begin(), windows.end(),
                       [](const Window& w) { return w.phase == Phase::kRecompute; }));
    // ResidentEngine throws if param() or grad() is used outside a window that
    // lists the parameter (grad() in a backward one), so the recompute's
    // kernels read weights only inside their kRecompute windows.
    model.backward();
    CHECK(std::isfinite(model.loss()));

    // Per op: its forward windows, and its recompute windows in backward.
    std::map<OpId, int> forwards, recomputes;
    for (size_t i = 0; i < windows.size(); ++i) {
      if (windows[i].phase == Phase::kForward) ++forwards[windows[i].op];
      if (windows[i].phase == Phase::kRecompute) {
        CHECK(i >= forward_end);
        ++recomputes[windows[i].op];
      }
    }
    // Layer of an op, from its name ("model.layers.<l>.…"); -1 outside the layers.
    auto layer_of = [&](OpId op) -> int64_t {
      const std::string& name = rig.engine->op_info(op).name;
      const std::string prefix = "model.layers.";
      if (name.rfind(prefix, 0) != 0) return -1;
      return std::stoll(name.substr(prefix.size()));
    };
    size_t decoder_ops = 0;
    for (OpId op = 0; op < rig.engine->operator_count(); ++op) {
      const int64_t l = layer_of(op);
      INFO(rig.engine->op_info(op).name);
      if (l < 0) {
        CHECK(recomputes.count(op) == 0);
        continue;
      }
      ++decoder_ops;
      CHECK(forwards[op] == 1);
      // Every layer's ops but the top layer's (its activations are still in
      // the scratch when backward starts) run again exactly once.
      const int want = mode != Mode::kNone && l + 1 < layers ? 1 : 0;
      CHECK(recomputes[op] == want);
    }
    // Per layer: 2 norms, q k v o, and gate, up, down in 2 tiles each.
    CHECK(decoder_ops == static_cast<size_t>(layers) * 12);

    // Order: a layer's recompute comes after the backward of the layer above
    // and before its own backward.
    if (mode != Mode::kNone) {
      int64_t current = layers;  // the layer whose backward or recompute runs now
      bool recomputing = false;
      for (size_t i = forward_end; i < windows.size(); ++i) {
        const int64_t l = layer_of(windows[i].op);
        if (l < 0) continue;
        if (windows[i].phase == Phase::kRecompute) {
          if (!recomputing || l != current) {
            CHECK(l == current - 1);
            current = l;
            recomputing = true;
          }
        } else {
          REQUIRE(windows[i].phase == Phase::kBackward);
          if (recomputing || l != current) {
            CHECK(l == (recomputing ? current : current - 1));
            current = l;
            recomputing = false;
          }
        }
      }
      CHECK(current == 0);
    }
  }
}

TEST_CASE("checkpointing: cpu_checkpointing without checkpoint_activations is refused",
          "[nn][checkpoint]") {
  test::Rig rig;
  DecoderModelOptions o = model_options(DType::kF32, 8);
  o.cpu_checkpointing = true;
  try {
    DecoderModel model(*rig.engine, tiny_llama(40, 32, 64, 2, 4, 2), o);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::kBadArgument);
    CHECK_THAT(e.what(), Catch::Contains("checkpoint_activations"));
  }
}

TEST_CASE("checkpointing: an evaluation forward gives the same loss and allows no backward",
          "[nn][checkpoint]") {
  const DecoderConfig c = tiny_llama(40, 32, 64, 3, 4, 2);
  const Batch b = make_batch(c, 2, 6, 6);
  double losses[2] = {0, 0};
  for (Mode mode : {Mode::kNone, Mode::kCpu}) {
    test::Rig rig;
    DecoderModel model(*rig.engine, c, options_for(mode, model_options(DType::kF32, 8)));
    rig.engine->finalize();
    initialize_parameters(*rig.engine, model.parameters(), 3);
    ForwardOptions eval;
    eval.backward = false;
    model.forward(b.ids, b.targets, b.batch, b.seq, eval);
    losses[mode == Mode::kCpu] = model.loss_stats().sum;
    CHECK_THROWS_AS(model.backward(), Error);
  }
  CHECK(losses[0] == losses[1]);
}

TEST_CASE("golden: activation checkpointing matches transformers (fp32)", "[nn][golden][checkpoint]") {
  for (const char* name : {"llama_untied_f32", "llama_tied_f32"}) {
    for (bool cpu : {false, true}) {
      INFO((cpu ? "cpu" : "device") << " checkpoints");
      test::check_golden(Backend::kCpu, name, "loss", "grads.safetensors", test::kGoldenF32,
                         std::nullopt, /*checkpoint_activations=*/true, cpu);
    }
  }
}
