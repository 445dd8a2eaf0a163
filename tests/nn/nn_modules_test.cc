// runtime/nn modules on Engine v2 and the cpu Ops: TiledLinear equals Linear,
// the hook protocol (windows, one tile at a time, gradients complete at their
// last use), 16-bit storage, initialisation, HF names and config parsing, and a
// whole-model gradient check against finite differences.
#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <set>
#include <vector>

#include "core/error.h"
#include "kernels/dropout_mask.h"
#include "runtime/nn/linear.h"
#include "runtime/nn/decoder_model.h"
#include "tests/nn/engine_rig.h"
#include "tests/nn/grad_check.h"
#include "tests/nn/test_models.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::nn;
using engine::Phase;

namespace {

std::vector<float> random_floats(size_t n, uint32_t seed) {
  return test::to_float(test::random_vector(n, seed));
}

DecoderConfig tiny_config() {
  DecoderConfig c = tiny_llama(32, 32, 48, 2, 4, 2);
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope.theta = 10000.0;
  return c;
}

struct Batch {
  std::vector<int32_t> ids, targets;
  int64_t batch, seq;
};

Batch make_batch(int64_t batch, int64_t seq, int64_t vocab, int ignore_at = -1) {
  Batch b{{}, {}, batch, seq};
  for (int64_t i = 0; i < batch * seq; ++i) {
    b.ids.push_back(static_cast<int32_t>((i * 5 + 3) % vocab));
    b.targets.push_back(i == ignore_at ? ops::kIgnoreIndex
                                       : static_cast<int32_t>((i * 3 + 1) % vocab));
  }
  return b;
}

double eval_loss(DecoderModel& model, const Batch& b) {
  ForwardOptions eval;
  eval.backward = false;
  model.forward(b.ids, b.targets, b.batch, b.seq, eval);
  return model.loss();
}

}  // namespace

TEST_CASE("TiledLinear equals Linear for several split factors", "[nn][tiled]") {
  const int64_t rows = 6, in = 10, out = 7;
  const auto x = random_floats(rows * in, 1), w = random_floats(out * in, 2),
             b = random_floats(out, 3), dy = random_floats(rows * out, 4);
  for (auto [is, os] : {std::pair{1, 1}, {2, 1}, {1, 3}, {3, 2}, {10, 7}, {4, 5}}) {
    INFO("in_splits " << is << " out_splits " << os);
    test::Rig rig;
    Linear ref(*rig.engine, "ref", in, out, true);
    TiledLinear tiled(*rig.engine, "tiled", in, out, is, os, true);
    REQUIRE(tiled.parameters().size() == static_cast<size_t>(is * os + os));
    rig.engine->finalize();
    rig.set_param(ref.weight(), w);
    rig.set_param(ref.bias(), b);
    // Tiles take their block of the full weight (slices say where).
    for (ParamId id : tiled.parameters()) {
      const auto& p = rig.engine->param_info(id);
      REQUIRE(p.slice);
      std::vector<float> block(static_cast<size_t>(p.numel()));
      if (p.shape.size() == 2) {
        for (int64_t r = 0; r < p.shape[0]; ++r)
          for (int64_t c = 0; c < p.shape[1]; ++c)
            block[r * p.shape[1] + c] = w[(p.slice->offset[0] + r) * in + p.slice->offset[1] + c];
      } else {
        for (int64_t c = 0; c < p.shape[0]; ++c) block[c] = b[p.slice->offset[0] + c];
      }
      rig.set_param(id, block);
    }
    Tensor xd = rig.upload(x, DType::kF32, {rows, in}), dyd = rig.upload(dy, DType::kF32, {rows, out});
    Tensor y_ref = rig.zeros(DType::kF32, {rows, out}), y = rig.zeros(DType::kF32, {rows, out});
    Tensor dx_ref = rig.zeros(DType::kF32, {rows, in}), dx = rig.zeros(DType::kF32, {rows, in});
    auto m = [](const Tensor& t) { return MatView::of(t.view()); };
    ref.forward(m(xd), m(y_ref));
    tiled.forward(m(xd), m(y));
    ref.backward(m(dyd), m(xd), m(dx_ref), false);
    tiled.backward(m(dyd), m(xd), m(dx), false);
    const auto yr = rig.download(y_ref.view()), yt = rig.download(y.view());
    const auto dxr = rig.download(dx_ref.view()), dxt = rig.download(dx.view());
    for (size_t i = 0; i < yr.size(); ++i) REQUIRE(yt[i] == Approx(yr[i]).margin(1e-5));
    for (size_t i = 0; i < dxr.size(); ++i) REQUIRE(dxt[i] == Approx(dxr[i]).margin(1e-5));
    const auto dw_ref = rig.grad_values(ref.weight()), db_ref = rig.grad_values(ref.bias());
    for (ParamId id : tiled.parameters()) {
      const auto& p = rig.engine->param_info(id);
      const auto g = rig.grad_values(id);
      for (size_t e = 0; e < g.size(); ++e) {
        const double want =
            p.shape.size() == 2
                ? dw_ref[(p.slice->offset[0] + e / p.shape[1]) * in + p.slice->offset[1] + e % p.shape[1]]
                : db_ref[p.slice->offset[0] + e];
        REQUIRE(g[e] == Approx(want).margin(1e-5));
      }
    }
  }
  test::Rig rig;
  REQUIRE_THROWS_AS(TiledLinear(*rig.engine, "bad", in, out, 11, 1, false), Error);
}

TEST_CASE("a Linear's LoRA adapter with dropout computes, forward and backward, what its formulas say",
          "[nn][lora]") {
  const int64_t rows = 7, in = 6, out = 5, r = 2;
  const double p = 0.4, s = 1.5;
  LoraSpec spec{r, s * r, false, {"q_proj"}, p};
  test::Rig rig;
  Linear lin(*rig.engine, "l.q_proj", in, out, false, DType::kF32, &spec);
  REQUIRE(lin.adapted());
  rig.engine->finalize();
  const auto w = random_floats(out * in, 11), a = random_floats(r * in, 12), b = random_floats(out * r, 13),
             x = random_floats(rows * in, 14), dy = random_floats(rows * out, 15);
  rig.set_param(lin.weight(), w);
  rig.set_param(lin.lora_a(), a);
  rig.set_param(lin.lora_b(), b);
  Tensor xd_t = rig.upload(x, DType::kF32, {rows, in}), dy_t = rig.upload(dy, DType::kF32, {rows, out});
  Tensor y_t = rig.zeros(DType::kF32, {rows, out}), dx_t = rig.zeros(DType::kF32, {rows, in});
  Tensor h = rig.zeros(DType::kF32, {rows, r}), dh = rig.zeros(DType::kF32, {rows, r});
  Tensor xs = rig.zeros(DType::kF32, {rows * in}), dxs = rig.zeros(DType::kF32, {rows * in});
  LoraScratch scratch{h.view(), dh.view(), xs.view(), dxs.view(), static_cast<float>(p), 77};
  auto m = [](const Tensor& t) { return MatView::of(t.view()); };
  lin.forward(m(xd_t), m(y_t), Phase::kForward, scratch);
  lin.backward(m(dy_t), m(xd_t), m(dx_t), false, scratch);
  // The reference, in double, with the op's mask.
  const uint64_t seed = lin.mask_seed(77);
  std::vector<double> xdrop(rows * in), hh(rows * r, 0), y(rows * out, 0), dhh(rows * r, 0), dx(rows * in, 0);
  std::vector<double> da(r * in, 0), db(out * r, 0);
  int dropped = 0;
  for (int64_t i = 0; i < rows * in; ++i) {
    const bool keep = ops::dropout_keep(seed, static_cast<uint64_t>(i), static_cast<float>(p));
    dropped += !keep;
    xdrop[i] = keep ? x[i] / (1 - p) : 0.0;
  }
  CHECK(dropped > 0);
  CHECK(dropped < rows * in);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t k = 0; k < r; ++k)
      for (int64_t c = 0; c < in; ++c) hh[i * r + k] += xdrop[i * in + c] * a[k * in + c];
    for (int64_t o = 0; o < out; ++o) {
      double v = 0;
      for (int64_t c = 0; c < in; ++c) v += x[i * in + c] * w[o * in + c];
      for (int64_t k = 0; k < r; ++k) v += s * hh[i * r + k] * b[o * r + k];
      y[i * out + o] = v;
    }
    for (int64_t k = 0; k < r; ++k)
      for (int64_t o = 0; o < out; ++o) dhh[i * r + k] += s * dy[i * out + o] * b[o * r + k];
    for (int64_t c = 0; c < in; ++c) {
      double base = 0, adapter = 0;
      for (int64_t o = 0; o < out; ++o) base += dy[i * out + o] * w[o * in + c];
      for (int64_t k = 0; k < r; ++k) adapter += dhh[i * r + k] * a[k * in + c];
      const bool keep = ops::dropout_keep(seed, static_cast<uint64_t>(i * in + c), static_cast<float>(p));
      dx[i * in + c] = base + (keep ? adapter / (1 - p) : 0.0);
    }
  }
  for (int64_t k = 0; k < r; ++k)
    for (int64_t c = 0; c < in; ++c)
      for (int64_t i = 0; i < rows; ++i) da[k * in + c] += dhh[i * r + k] * xdrop[i * in + c];
  for (int64_t o = 0; o < out; ++o)
    for (int64_t k = 0; k < r; ++k)
      for (int64_t i = 0; i < rows; ++i) db[o * r + k] += s * dy[i * out + o] * hh[i * r + k];
  auto close = [](const char* what, const std::vector<float>& got, const std::vector<double>& want) {
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO(what << "[" << i << "]");
      CHECK(got[i] == Approx(want[i]).margin(1e-5));
    }
  };
  close("y", rig.download(y_t.view()), y);
  close("dx", rig.download(dx_t.view()), dx);
  close("dA", rig.grad_values(lin.lora_a()), da);
  close("dB", rig.grad_values(lin.lora_b()), db);
  // Evaluation (dropout 0) computes without the mask.
  scratch.dropout = 0;
  lin.forward(m(xd_t), m(y_t), Phase::kForward, scratch);
  const auto y_eval = rig.download(y_t.view());
  double moved = 0;
  for (size_t i = 0; i < y_eval.size(); ++i) moved = std::max(moved, std::abs(y_eval[i] - y[i]));
  CHECK(moved > 1e-3);
}

TEST_CASE("TiledLinear fetches one tile at a time through the hooks", "[nn][tiled][hooks]") {
  test::Rig rig;
  TiledLinear tiled(*rig.engine, "model.big", 8, 6, 2, 3, false);
  rig.engine->finalize();
  std::vector<std::string> events;
  int in_flight = 0, max_in_flight = 0;
  rig.engine->set_hook_observer([&](OpId op, Phase, bool pre) {
    const auto& info = rig.engine->op_info(op);
    REQUIRE(info.params.size() == 1);
    in_flight += pre ? 1 : -1;
    max_in_flight = std::max(max_in_flight, in_flight);
    events.push_back(std::string(pre ? "pre " : "post ") + rig.engine->param_info(info.params[0]).name);
  });
  Tensor x = rig.upload(random_floats(3 * 8, 5), DType::kF32, {3, 8});
  Tensor y = rig.zeros(DType::kF32, {3, 6});
  Tensor dx = rig.zeros(DType::kF32, {3, 8});
  tiled.forward(MatView::of(x.view()), MatView::of(y.view()));
  tiled.backward(MatView::of(y.view()), MatView::of(x.view()), MatView::of(dx.view()), false);
  rig.engine->compute_stream().synchronize();
  CHECK(max_in_flight == 1);
  CHECK(in_flight == 0);
  REQUIRE(events.size() == 2 * 2 * 6);
  CHECK(events[0] == "pre model.big.weight.tile_0_0");
  CHECK(events[1] == "post model.big.weight.tile_0_0");
  CHECK(events[2] == "pre model.big.weight.tile_0_1");
}

TEST_CASE("model hooks bracket every parameter use in forward and backward", "[nn][hooks]") {
  for (bool tied : {false, true}) {
    INFO("tied " << tied);
    DecoderConfig c = tiny_config();
    c.tie_word_embeddings = tied;
    test::Rig rig;
    DecoderModel model(*rig.engine, c);
    rig.engine->finalize();
    initialize_parameters(*rig.engine, model.parameters(), 7);
    std::map<ParamId, int> fwd, bwd;
    std::vector<OpId> open;
    rig.engine->set_hook_observer([&](OpId op, Phase phase, bool pre) {
      if (pre) {
        REQUIRE(open.empty());  // the model never nests windows
        open.push_back(op);
        for (ParamId p : rig.engine->op_info(op).params) ++(phase == Phase::kBackward ? bwd : fwd)[p];
      } else {
        REQUIRE(open.size() == 1);
        REQUIRE(open.back() == op);
        open.pop_back();
      }
    });
    const Batch b = make_batch(2, 8, c.vocab_size);
    model.forward(b.ids, b.targets, b.batch, b.seq);
    model.backward();
    CHECK(open.empty());
    for (ParamId id : model.parameters()) {
      const auto& name = rig.engine->param_info(id).name;
      INFO(name);
      const bool head = name == "lm_head.weight";
      const bool shared = tied && name == "model.embed_tokens.weight";
      // The training forward runs lm_head only in its backward window (fused loss).
      CHECK(fwd[id] == (head ? 0 : 1));
      CHECK(bwd[id] == (shared ? 2 : 1));
      CHECK(rig.engine->uses_of(id) == (shared ? 2 : 1));
    }
  }
}

TEST_CASE("a gradient is reported complete at its last use in backward (tied embeddings)",
          "[nn][hooks]") {
  DecoderConfig c = tiny_config();
  c.tie_word_embeddings = true;
  test::Rig rig;
  DecoderModel model(*rig.engine, c);
  rig.engine->finalize();
  initialize_parameters(*rig.engine, model.parameters(), 8);
  const ParamId embed = rig.engine->find_parameter("model.embed_tokens.weight");
  std::map<ParamId, int> ready_count;
  std::vector<float> embed_at_ready;
  bool embed_op_done = false;
  rig.engine->set_hook_observer([&](OpId op, Phase phase, bool pre) {
    if (!pre && phase == Phase::kBackward && rig.engine->op_info(op).name == "model.embed_tokens")
      embed_op_done = true;
  });
  rig.engine->set_grad_ready_callback([&](ParamId id, Event& ready) {
    ++ready_count[id];
    if (id != embed) return;
    CHECK(embed_op_done);  // not at lm_head, its first use in backward
    ready.synchronize();
    embed_at_ready = rig.grad_values(id);
  });
  const Batch b = make_batch(2, 8, c.vocab_size);
  rig.engine->zero_grad();
  model.forward(b.ids, b.targets, b.batch, b.seq);
  model.backward();
  for (ParamId id : model.parameters()) CHECK(ready_count[id] == 1);
  REQUIRE(!embed_at_ready.empty());
  CHECK(embed_at_ready == rig.grad_values(embed));  // nothing was added after "ready"
}

TEST_CASE("modules touch parameter memory only inside their hook windows", "[nn][hooks]") {
  // ResidentEngine refuses param()/grad() outside a window of an op listing the
  // parameter, and grad() outside a backward window: a full training step (with
  // 16-bit storage, biases, tied and untied) must never trip it.
  for (bool tied : {false, true}) {
    DecoderConfig c = tiny_config();
    c.tie_word_embeddings = tied;
    c.attention_qkv_bias = c.attention_o_bias = true;
    test::Rig rig;
    DecoderModel model(*rig.engine, c, model_options(DType::kBF16));
    rig.engine->finalize();
    initialize_parameters(*rig.engine, model.parameters(), 3);
    const Batch b = make_batch(2, 6, c.vocab_size);
    REQUIRE_NOTHROW(model.forward(b.ids, b.targets, b.batch, b.seq));
    REQUIRE_NOTHROW(model.backward());
    REQUIRE(std::isfinite(model.loss()));
    // And the check itself bites.
    REQUIRE_THROWS_WITH(rig.engine->param(model.parameters()[0]),
                        Catch::Contains("outside a hook window"));
    REQUIRE_THROWS_WITH(rig.engine->grad(model.parameters()[0]),
                        Catch::Contains("outside a backward window"));
  }
}

TEST_CASE("engine declarations: errors and ids", "[nn][engine]") {
  test::Rig rig;
  auto& e = *rig.engine;
  const ParamId a = e.declare_parameter({"a", DType::kF32, {2, 3}, std::nullopt});
  CHECK(a == 0);
  REQUIRE_THROWS_WITH(e.declare_parameter({"a", DType::kF32, {2}, std::nullopt}),
                      Catch::Contains("declared twice"));
  REQUIRE_THROWS_WITH(e.declare_parameter({"z", DType::kF32, {0, 3}, std::nullopt}),
                      Catch::Contains("shape"));
  REQUIRE_THROWS_WITH(e.declare_parameter({"i", DType::kI32, {3}, std::nullopt}),
                      Catch::Contains("dtype"));
  REQUIRE_THROWS_WITH(e.declare_operator("op", {5}), Catch::Contains("unknown parameter id 5"));
  const OpId op = e.declare_operator("op", {a});
  REQUIRE_THROWS_WITH(e.pre_op(op, Phase::kForward), Catch::Contains("before finalize"));
  e.finalize();
  REQUIRE_THROWS_WITH(e.declare_parameter({"b", DType::kF32, {2}, std::nullopt}),
                      Catch::Contains("after finalize"));
  REQUIRE_THROWS_AS(e.finalize(), Error);
  REQUIRE_THROWS_WITH(e.pre_op(99, Phase::kForward), Catch::Contains("unknown operator id 99"));
  REQUIRE_THROWS_WITH(e.find_parameter("nope"), Catch::Contains("no parameter named 'nope'"));
  e.pre_op(op, Phase::kForward);
  CHECK(e.param(a).desc.shape == Shape{2, 3});
  REQUIRE_THROWS_WITH(e.post_op(op, Phase::kBackward), Catch::Contains("closes no open window"));
  e.post_op(op, Phase::kForward);
}

TEST_CASE("model parameters carry Hugging Face names and the configured count", "[nn]") {
  for (bool tied : {false, true}) {
    DecoderConfig c = tiny_config();
    c.tie_word_embeddings = tied;
    c.attention_qkv_bias = c.attention_o_bias = !tied;
    test::Rig rig;
    DecoderModel model(*rig.engine, c);
    int64_t total = 0;
    std::set<std::string> names;
    for (ParamId id : model.parameters()) {
      total += rig.engine->param_info(id).numel();
      names.insert(rig.engine->param_info(id).name);
    }
    CHECK(total == c.parameter_count());
    CHECK(names.contains("model.embed_tokens.weight"));
    CHECK(names.contains("model.layers.1.self_attn.q_proj.weight"));
    CHECK(names.contains("model.layers.0.self_attn.k_proj.weight"));
    CHECK(names.contains("model.layers.0.mlp.gate_proj.weight"));
    CHECK(names.contains("model.layers.1.post_attention_layernorm.weight"));
    CHECK(names.contains("model.norm.weight"));
    CHECK(names.contains("lm_head.weight") == !tied);
    CHECK(names.contains("model.layers.0.self_attn.o_proj.bias") == !tied);
  }
}

TEST_CASE("whole-model gradients match finite differences (fp32, tied, untied, tiled MLP)",
          "[nn][grad]") {
  for (int variant = 0; variant < 3; ++variant) {
    const bool tied = variant == 1;
    DecoderConfig c = tiny_config();
    c.tie_word_embeddings = tied;
    test::Rig rig;
    DecoderModelOptions options = model_options(DType::kF32, 5);
    if (variant == 2) options.mlp_tiling = {2, 3};
    DecoderModel model(*rig.engine, c, options);
    rig.engine->finalize();
    initialize_parameters(*rig.engine, model.parameters(), 11, /*std=*/0.3);
    const Batch b = make_batch(2, 6, c.vocab_size, /*ignore_at=*/4);
    rig.engine->zero_grad();
    model.forward(b.ids, b.targets, b.batch, b.seq);
    model.backward();
    // For each parameter, the element with the largest gradient (the one a
    // wiring mistake would disturb most) and one fixed element.
    for (ParamId id : model.parameters()) {
      const std::vector<float> g = rig.grad_values(id);
      std::vector<float> data = rig.param_values(id);
      const auto n = static_cast<int64_t>(g.size());
      int64_t best = 0;
      for (int64_t i = 1; i < n; ++i) best = std::abs(g[i]) > std::abs(g[best]) ? i : best;
      for (int64_t i : {best, n / 3}) {
        const float saved = data[i];
        const float h = 1e-2f;
        data[i] = saved + h;
        rig.set_param(id, data);
        const double up = eval_loss(model, b);
        data[i] = saved - h;
        rig.set_param(id, data);
        const double down = eval_loss(model, b);
        data[i] = saved;
        rig.set_param(id, data);
        const double numeric = (up - down) / (2.0 * h);
        INFO("variant " << variant << " " << rig.engine->param_info(id).name << "[" << i
                        << "] analytic " << g[i] << " numeric " << numeric);
        CHECK(std::abs(numeric - g[i]) <= 2e-3 + 2e-2 * std::abs(numeric));
      }
    }
  }
}

TEST_CASE("bf16 and fp16 storage compute like fp32 on the rounded values", "[nn][dtype]") {
  const DecoderConfig c = tiny_config();
  const Batch b = make_batch(2, 8, c.vocab_size);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    test::Rig low_rig, ref_rig;
    DecoderModel low(*low_rig.engine, c, model_options(dtype));
    DecoderModel ref(*ref_rig.engine, c, model_options(DType::kF32));
    low_rig.engine->finalize();
    ref_rig.engine->finalize();
    initialize_parameters(*low_rig.engine, low.parameters(), 3);
    // The reference holds exactly the 16-bit values, widened.
    const auto lp = low.parameters(), rp = ref.parameters();
    REQUIRE(lp.size() == rp.size());
    for (size_t i = 0; i < lp.size(); ++i) {
      REQUIRE(low_rig.engine->param_info(lp[i]).dtype == dtype);
      ref_rig.set_param(rp[i], low_rig.param_values(lp[i]));
    }
    low_rig.engine->zero_grad();
    ref_rig.engine->zero_grad();
    low.forward(b.ids, b.targets, b.batch, b.seq);
    ref.forward(b.ids, b.targets, b.batch, b.seq);
    const double l_low = low.loss(), l_ref = ref.loss();
    CHECK(l_low == Approx(l_ref).epsilon(1e-6));
    CHECK(std::abs(l_low - std::log(32.0)) < 0.5);  // small init: near-uniform prediction
    low.backward();
    ref.backward();
    for (size_t k = 0; k < lp.size(); ++k) {
      const auto g_low = low_rig.grad_values(lp[k]), g_ref = ref_rig.grad_values(rp[k]);
      for (size_t i = 0; i < g_low.size(); ++i) REQUIRE(g_low[i] == Approx(g_ref[i]).margin(1e-6));
    }
  }
}

TEST_CASE("16-bit activations on the cpu accelerator stay close to fp32", "[nn][dtype]") {
  const DecoderConfig c = tiny_config();
  const Batch b = make_batch(2, 8, c.vocab_size);
  test::Rig ref_rig, low_rig;
  DecoderModelOptions low_options = model_options(DType::kBF16);
  low_options.activation_dtype = DType::kBF16;
  DecoderModel ref(*ref_rig.engine, c, model_options(DType::kBF16));
  DecoderModel low(*low_rig.engine, c, low_options);
  CHECK(ref.activation_dtype() == DType::kF32);  // the cpu default
  ref_rig.engine->finalize();
  low_rig.engine->finalize();
  initialize_parameters(*ref_rig.engine, ref.parameters(), 5, 0.2);
  initialize_parameters(*low_rig.engine, low.parameters(), 5, 0.2);
  ref.forward(b.ids, b.targets, b.batch, b.seq);
  low.forward(b.ids, b.targets, b.batch, b.seq);
  // bf16 activations round every intermediate to 8 significant bits
  // (relative 2^-9); through two layers that stays well inside 2%.
  CHECK(low.loss() == Approx(ref.loss()).epsilon(2e-2));
  CHECK(low.loss() != ref.loss());  // the activations really were 16-bit
}

TEST_CASE("initialisation is keyed by name and element, not by order or tiling", "[nn]") {
  test::Rig a, b, t;
  Linear la(*a.engine, "x.proj", 4, 3, true);
  Linear lb(*b.engine, "x.proj", 4, 3, true);
  TiledLinear lt(*t.engine, "x.proj", 4, 3, 2, 2, true);
  a.engine->finalize();
  b.engine->finalize();
  t.engine->finalize();
  initialize_parameters(*a.engine, la.parameters(), 5);
  auto params = lb.parameters();
  std::reverse(params.begin(), params.end());
  initialize_parameters(*b.engine, params, 5);
  initialize_parameters(*t.engine, lt.parameters(), 5);
  const auto wa = a.param_values(la.weight()), wb = b.param_values(lb.weight());
  CHECK(wa == wb);
  CHECK(wa[0] != wa[1]);
  CHECK(a.param_values(la.bias())[0] == 0.0f);
  // Tile (1, 1) holds rows [2, 3) x columns [2, 4) of the untiled weight.
  const auto tile = t.param_values(t.engine->find_parameter("x.proj.weight.tile_1_1"));
  REQUIRE(tile.size() == 2);
  CHECK(tile[0] == wa[2 * 4 + 2]);
  CHECK(tile[1] == wa[2 * 4 + 3]);
}

TEST_CASE("HF config.json is parsed with defaults and clear errors", "[nn][config]") {
  const auto j = nlohmann::json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "hidden_act": "silu", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 176,
    "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 4096,
    "tie_word_embeddings": true, "rope_scaling": null })");
  const DecoderConfig c = parse_decoder_config(j);
  CHECK(c.hidden_size == 64);
  CHECK(c.head_dim == 8);
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.rope.theta == 500000.0);
  CHECK(c.rms_norm_eps == 1e-5);
  CHECK(c.tie_word_embeddings);

  test::TempDir dir("nn-config");
  save_decoder_config(c, dir.file("config.json"));
  const DecoderConfig back = load_decoder_config(dir.file("config.json"));
  CHECK(back.to_json() == c.to_json());

  auto expect_error = [&](nlohmann::json bad, const std::string& needle) {
    try {
      parse_decoder_config(bad);
      FAIL("expected an error mentioning " << needle);
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  auto missing = j;
  missing.erase("hidden_size");
  expect_error(missing, "hidden_size");
  auto wrong_type = j;
  wrong_type["num_hidden_layers"] = "three";
  expect_error(wrong_type, "num_hidden_layers");
  auto bad_heads = j;
  bad_heads["num_key_value_heads"] = 3;
  expect_error(bad_heads, "num_key_value_heads");
  auto scaling = j;
  scaling["rope_scaling"] = {{"type", "longrope"}, {"factor", 2.0}, {"original_max_position_embeddings", 4096}};
  expect_error(scaling, "rope_scaling: rope_type \"longrope\" (a string) is not supported");
  auto act = j;
  act["hidden_act"] = "gelu";
  expect_error(act, "hidden_act");
  // Newer transformers nest RoPE settings under rope_parameters.
  auto nested = j;
  nested.erase("rope_theta");
  nested["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 250000.0}};
  CHECK(parse_decoder_config(nested).rope.theta == 250000.0);
  nested["rope_parameters"]["rope_type"] = "dynamic";
  expect_error(nested, "rope_type \"dynamic\" (a string) is not supported");
  REQUIRE_THROWS_AS(load_decoder_config(dir.file("absent.json")), Error);
}
