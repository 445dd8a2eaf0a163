// runtime/nn modules: TiledLinear equals Linear, hook protocol, 16-bit storage,
// HF config parsing, and a whole-model gradient check against finite differences.
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <vector>

#include "kernels/nn_ops.h"
#include "runtime/core/error.h"
#include "runtime/nn/linear.h"
#include "runtime/nn/llama_model.h"
#include "tests/nn/test_models.h"
#include "tests/nn/grad_check.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::nn;

namespace {

std::vector<float> random_floats(size_t n, uint32_t seed) {
  return test::to_float(test::random_vector(n, seed));
}

LlamaConfig tiny_config() {
  LlamaConfig c = tiny_llama(32, 32, 48, 2, 4, 2);
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  return c;
}

void set_param(Engine& engine, Parameter& p, const std::vector<float>& values) {
  const TensorView v = engine.data(p);
  REQUIRE(static_cast<size_t>(v.numel()) == values.size());
  convert(values.data(), DType::kF32, v.data, v.desc.dtype, values.size());
}

}  // namespace

TEST_CASE("TiledLinear equals Linear for several split factors", "[nn][tiled]") {
  const int64_t rows = 6, in = 10, out = 7;
  const auto x = random_floats(rows * in, 1), w = random_floats(out * in, 2),
             b = random_floats(out, 3), dy = random_floats(rows * out, 4);
  ResidentEngine ref_engine;
  Linear ref(ref_engine, "ref", in, out, true);
  set_param(ref_engine, ref.weight(), w);
  set_param(ref_engine, *ref.bias(), b);
  const Activations y_ref = ref.forward(x, rows);
  const Activations dx_ref = ref.backward(dy);
  const float* dw_ref = ref_engine.grad(ref.weight()).as<float>();
  const float* db_ref = ref_engine.grad(*ref.bias()).as<float>();

  for (auto [is, os] : {std::pair{1, 1}, {2, 1}, {1, 3}, {3, 2}, {10, 7}, {4, 5}}) {
    INFO("in_splits " << is << " out_splits " << os);
    ResidentEngine engine;
    TiledLinear tiled(engine, "tiled", in, out, is, os, true);
    REQUIRE(engine.parameters().size() == static_cast<size_t>(is * os + os));
    tiled.set_full(w.data(), b.data());
    std::vector<float> w_back(w.size()), b_back(b.size());
    tiled.get_full(w_back.data(), b_back.data());
    REQUIRE(w_back == w);
    REQUIRE(b_back == b);
    const Activations y = tiled.forward(x, rows);
    const Activations dx = tiled.backward(dy);
    for (size_t i = 0; i < y.size(); ++i) REQUIRE(y[i] == Approx(y_ref[i]).margin(1e-5));
    for (size_t i = 0; i < dx.size(); ++i) REQUIRE(dx[i] == Approx(dx_ref[i]).margin(1e-5));
    std::vector<float> dw(w.size()), db(b.size());
    tiled.get_full_grad(dw.data(), db.data());
    for (size_t i = 0; i < dw.size(); ++i) REQUIRE(dw[i] == Approx(dw_ref[i]).margin(1e-5));
    for (size_t i = 0; i < db.size(); ++i) REQUIRE(db[i] == Approx(db_ref[i]).margin(1e-5));
  }
  ResidentEngine engine;
  REQUIRE_THROWS_AS(TiledLinear(engine, "bad", in, out, 11, 1, false), Error);
}

TEST_CASE("TiledLinear fetches one tile at a time through the hooks", "[nn][tiled][hooks]") {
  ResidentEngine engine;
  TiledLinear tiled(engine, "model.big", 8, 6, 2, 3, false);
  std::vector<std::string> events;
  int in_flight = 0, max_in_flight = 0;
  engine.set_hook_observer(
      [&](HookPhase phase, const std::string& module, std::span<Parameter* const> ps) {
        REQUIRE(module == "model.big");
        REQUIRE(ps.size() == 1);
        const bool pre = phase == HookPhase::kPreForward || phase == HookPhase::kPreBackward;
        in_flight += pre ? 1 : -1;
        max_in_flight = std::max(max_in_flight, in_flight);
        events.push_back(std::string(pre ? "pre " : "post ") + ps[0]->name);
      });
  tiled.forward(random_floats(3 * 8, 5), 3);
  tiled.backward(random_floats(3 * 6, 6));
  CHECK(max_in_flight == 1);
  CHECK(in_flight == 0);
  REQUIRE(events.size() == 2 * 2 * 6);
  CHECK(events[0] == "pre model.big.weight.tile_0_0");
  CHECK(events[1] == "post model.big.weight.tile_0_0");
  CHECK(events[2] == "pre model.big.weight.tile_0_1");
}

TEST_CASE("model hooks bracket every parameter use in forward and backward", "[nn][hooks]") {
  ResidentEngine engine;
  LlamaModel model(engine, tiny_config());
  initialize_parameters(engine, model.parameters(), 7);
  std::map<std::string, int> pre_fwd, post_fwd, pre_bwd, post_bwd;
  std::set<std::string> open;
  engine.set_hook_observer(
      [&](HookPhase phase, const std::string&, std::span<Parameter* const> ps) {
        for (Parameter* p : ps) {
          switch (phase) {
            case HookPhase::kPreForward:
              ++pre_fwd[p->name];
              REQUIRE(open.insert(p->name).second);
              break;
            case HookPhase::kPostForward:
              ++post_fwd[p->name];
              REQUIRE(open.erase(p->name) == 1);
              break;
            case HookPhase::kPreBackward:
              ++pre_bwd[p->name];
              REQUIRE(open.insert(p->name).second);
              break;
            case HookPhase::kPostBackward:
              ++post_bwd[p->name];
              REQUIRE(open.erase(p->name) == 1);
              break;
          }
        }
      });
  std::vector<int32_t> ids(2 * 8), targets(2 * 8);
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<int32_t>(i * 7 % 32), targets[i] = static_cast<int32_t>(i % 32);
  model.forward(ids, targets, 2, 8);
  model.backward();
  CHECK(open.empty());
  for (Parameter* p : model.parameters()) {
    INFO(p->name);
    CHECK(pre_fwd[p->name] == 1);
    CHECK(post_fwd[p->name] == 1);
    CHECK(pre_bwd[p->name] == 1);
    CHECK(post_bwd[p->name] == 1);
  }
}

namespace {

// Delegates to a ResidentEngine but refuses data()/grad() for a parameter
// outside its pre/post window, and grad() outside backward: the contract an
// offloading engine relies on to release memory after post_forward.
class StrictEngine final : public Engine {
 public:
  void register_parameter(Parameter& p) override { inner.register_parameter(p); }
  void pre_forward(const std::string& m, std::span<Parameter* const> ps) override {
    open_all(ps, false);
    inner.pre_forward(m, ps);
  }
  void post_forward(const std::string& m, std::span<Parameter* const> ps) override {
    close_all(ps);
    inner.post_forward(m, ps);
  }
  void pre_backward(const std::string& m, std::span<Parameter* const> ps) override {
    open_all(ps, true);
    inner.pre_backward(m, ps);
  }
  void post_backward(const std::string& m, std::span<Parameter* const> ps) override {
    close_all(ps);
    inner.post_backward(m, ps);
  }
  TensorView data(const Parameter& p) override {
    if (strict && !open_.contains(p.id)) throw std::logic_error("data() outside hooks: " + p.name);
    return inner.data(p);
  }
  TensorView grad(const Parameter& p) override {
    if (strict && (!open_.contains(p.id) || !open_[p.id])) {
      throw std::logic_error("grad() outside a backward window: " + p.name);
    }
    return inner.grad(p);
  }
  ResidentEngine inner;
  bool strict = false;

 private:
  void open_all(std::span<Parameter* const> ps, bool backward) {
    for (Parameter* p : ps) {
      if (!open_.emplace(p->id, backward).second)
        throw std::logic_error("opened twice: " + p->name);
    }
  }
  void close_all(std::span<Parameter* const> ps) {
    for (Parameter* p : ps) {
      if (open_.erase(p->id) != 1) throw std::logic_error("closed without open: " + p->name);
    }
  }
  std::map<int64_t, bool> open_;  // id -> opened for backward
};

}  // namespace

TEST_CASE("modules touch parameter memory only inside their hook windows", "[nn][hooks]") {
  for (bool tied : {false, true}) {
    LlamaConfig c = tiny_config();
    c.tie_word_embeddings = tied;
    c.attention_bias = true;
    StrictEngine engine;
    LlamaModel model(engine, c, model_options(DType::kBF16));
    TiledLinear tiled(engine, "extra.tiled", 8, 6, 2, 3, true);
    initialize_parameters(engine, engine.inner.parameters(), 3);
    engine.strict = true;
    std::vector<int32_t> ids(12), targets(12);
    for (int i = 0; i < 12; ++i) ids[i] = (i * 5) % 32, targets[i] = (i * 3) % 32;
    REQUIRE_NOTHROW(model.forward(ids, targets, 2, 6));
    REQUIRE_NOTHROW(model.backward());
    REQUIRE_NOTHROW(tiled.forward(random_floats(3 * 8, 1), 3));
    REQUIRE_NOTHROW(tiled.backward(random_floats(3 * 6, 2)));
    // And the check itself bites.
    REQUIRE_THROWS_AS(engine.data(*engine.inner.parameters()[0]), std::logic_error);
  }
}

TEST_CASE("model parameters carry Hugging Face names and the configured count", "[nn]") {
  for (bool tied : {false, true}) {
    LlamaConfig c = tiny_config();
    c.tie_word_embeddings = tied;
    c.attention_bias = !tied;
    ResidentEngine engine;
    LlamaModel model(engine, c);
    int64_t total = 0;
    std::set<std::string> names;
    for (Parameter* p : model.parameters()) {
      total += p->desc.numel();
      names.insert(p->name);
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
    LlamaConfig c = tiny_config();
    c.tie_word_embeddings = tied;
    ResidentEngine engine;
    LlamaModelOptions options = model_options(DType::kF32, 5);
    if (variant == 2) options.mlp_tiling = {2, 3};
    LlamaModel model(engine, c, options);
    initialize_parameters(engine, model.parameters(), 11, /*std=*/0.3);
    const int64_t batch = 2, seq = 6;
    std::vector<int32_t> ids(batch * seq), targets(batch * seq);
    for (int64_t i = 0; i < batch * seq; ++i) {
      ids[i] = static_cast<int32_t>((i * 5 + 3) % c.vocab_size);
      targets[i] = i == 4 ? cpu::kIgnoreIndex : static_cast<int32_t>((i * 3 + 1) % c.vocab_size);
    }
    engine.zero_grad();
    model.forward(ids, targets, batch, seq);
    model.backward();
    // For each parameter, the element with the largest gradient (the one a
    // wiring mistake would disturb most) and one fixed element.
    for (Parameter* p : model.parameters()) {
      float* data = engine.data(*p).as<float>();
      const float* g = engine.grad(*p).as<float>();
      const int64_t n = p->desc.numel();
      int64_t best = 0;
      for (int64_t i = 1; i < n; ++i) best = std::abs(g[i]) > std::abs(g[best]) ? i : best;
      for (int64_t i : {best, n / 3}) {
        const float saved = data[i];
        const float h = 1e-2f;
        data[i] = saved + h;
        const double up = model.forward(ids, targets, batch, seq);
        data[i] = saved - h;
        const double down = model.forward(ids, targets, batch, seq);
        data[i] = saved;
        const double numeric = (up - down) / (2.0 * h);
        INFO("variant " << variant << " " << p->name << "[" << i << "] analytic " << g[i]
                        << " numeric " << numeric);
        CHECK(std::abs(numeric - g[i]) <= 2e-3 + 2e-2 * std::abs(numeric));
      }
    }
  }
}

TEST_CASE("bf16 and fp16 storage compute like fp32 on the rounded values", "[nn][dtype]") {
  const LlamaConfig c = tiny_config();
  std::vector<int32_t> ids(16), targets(16);
  for (int i = 0; i < 16; ++i) ids[i] = (i * 11) % 32, targets[i] = (i * 7 + 2) % 32;
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    ResidentEngine low_engine, ref_engine;
    LlamaModel low(low_engine, c, model_options(dtype));
    LlamaModel ref(ref_engine, c, model_options(DType::kF32));
    initialize_parameters(low_engine, low.parameters(), 3);
    // The reference holds exactly the 16-bit values, widened.
    auto lp = low.parameters(), rp = ref.parameters();
    REQUIRE(lp.size() == rp.size());
    for (size_t i = 0; i < lp.size(); ++i) {
      REQUIRE(lp[i]->desc.dtype == dtype);
      const TensorView src = low_engine.data(*lp[i]);
      convert(src.data, dtype, ref_engine.data(*rp[i]).data, DType::kF32,
              static_cast<size_t>(src.numel()));
    }
    const double l_low = low.forward(ids, targets, 2, 8);
    const double l_ref = ref.forward(ids, targets, 2, 8);
    CHECK(l_low == Approx(l_ref).epsilon(1e-6));
    CHECK(std::abs(l_low - std::log(32.0)) < 0.5);  // small init: near-uniform prediction
    low.backward();
    ref.backward();
    const float* g_low = low_engine.grad(*lp[0]).as<float>();
    const float* g_ref = ref_engine.grad(*rp[0]).as<float>();
    for (int64_t i = 0; i < lp[0]->desc.numel(); ++i)
      REQUIRE(g_low[i] == Approx(g_ref[i]).margin(1e-6));
  }
}

TEST_CASE("initialisation is keyed by name and element, not by order", "[nn]") {
  ResidentEngine a, b;
  Linear la(a, "x.proj", 4, 3, true);
  Linear lb(b, "x.proj", 4, 3, true);
  initialize_parameters(a, la.parameters(), 5);
  auto params = lb.parameters();
  std::reverse(params.begin(), params.end());
  initialize_parameters(b, params, 5);
  const float* wa = a.data(la.weight()).as<float>();
  const float* wb = b.data(lb.weight()).as<float>();
  for (int i = 0; i < 12; ++i) CHECK(wa[i] == wb[i]);
  CHECK(wa[0] != wa[1]);
  CHECK(a.data(*la.bias()).as<float>()[0] == 0.0f);
}

TEST_CASE("HF config.json is parsed with defaults and clear errors", "[nn][config]") {
  const auto j = nlohmann::json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "hidden_act": "silu", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 176,
    "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 4096,
    "tie_word_embeddings": true, "rope_scaling": null })");
  const LlamaConfig c = parse_llama_config(j);
  CHECK(c.hidden_size == 64);
  CHECK(c.head_dim == 8);
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.rope_theta == 500000.0);
  CHECK(c.rms_norm_eps == 1e-5);
  CHECK(c.tie_word_embeddings);

  test::TempDir dir("nn-config");
  save_llama_config(c, dir.file("config.json"));
  const LlamaConfig back = load_llama_config(dir.file("config.json"));
  CHECK(back.to_json() == c.to_json());

  auto expect_error = [&](nlohmann::json bad, const std::string& needle) {
    try {
      parse_llama_config(bad);
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
  scaling["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  expect_error(scaling, "rope_scaling");
  auto act = j;
  act["hidden_act"] = "gelu";
  expect_error(act, "hidden_act");
  // Newer transformers nest RoPE settings under rope_parameters.
  auto nested = j;
  nested.erase("rope_theta");
  nested["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 250000.0}};
  CHECK(parse_llama_config(nested).rope_theta == 250000.0);
  nested["rope_parameters"]["rope_type"] = "llama3";
  expect_error(nested, "rope_type \"llama3\" (a string) is not supported");
  REQUIRE_THROWS_AS(load_llama_config(dir.file("absent.json")), Error);
}
