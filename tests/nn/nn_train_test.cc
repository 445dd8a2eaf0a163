// A tiny Llama-style model trained for 50 AdamW steps on a fixed synthetic
// corpus, through Ops on the cpu accelerator, must lower its loss. The AdamW
// here is a plain scalar loop on purpose: this test checks the model, not the
// production optimizer (kernels/cpu/adam*).
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "runtime/nn/decoder_model.h"
#include "tests/nn/engine_rig.h"
#include "tests/nn/test_models.h"

using namespace strata;
using namespace strata::nn;

namespace {

// Decoupled-weight-decay Adam over every fp32 parameter, between steps (the
// compute stream is synchronised first; the cpu accelerator's memory is host memory).
class PlainAdamW {
 public:
  PlainAdamW(engine::ResidentEngine& engine, double lr, double weight_decay)
      : engine_(engine), lr_(lr), wd_(weight_decay) {
    for (ParamId id = 0; id < engine.parameter_count(); ++id) {
      m_.emplace_back(static_cast<size_t>(engine.param_info(id).numel()), 0.0f);
      v_.emplace_back(static_cast<size_t>(engine.param_info(id).numel()), 0.0f);
    }
  }
  void step() {
    engine_.compute_stream().synchronize();
    ++t_;
    const double c1 = 1 - std::pow(kBeta1, t_), c2 = 1 - std::pow(kBeta2, t_);
    for (ParamId id = 0; id < engine_.parameter_count(); ++id) {
      float* w = engine_.param_storage(id).as<float>();
      const float* g = engine_.grad_storage(id).as<float>();
      auto& m = m_[static_cast<size_t>(id)];
      auto& v = v_[static_cast<size_t>(id)];
      for (size_t i = 0; i < m.size(); ++i) {
        m[i] = static_cast<float>(kBeta1 * m[i] + (1 - kBeta1) * g[i]);
        v[i] = static_cast<float>(kBeta2 * v[i] + (1 - kBeta2) * g[i] * g[i]);
        const double update = (m[i] / c1) / (std::sqrt(v[i] / c2) + 1e-8);
        w[i] = static_cast<float>(w[i] - lr_ * (update + wd_ * w[i]));
      }
    }
  }

 private:
  static constexpr double kBeta1 = 0.9, kBeta2 = 0.999;
  engine::ResidentEngine& engine_;
  double lr_, wd_;
  int t_ = 0;
  std::vector<std::vector<float>> m_, v_;
};

}  // namespace

TEST_CASE("tiny model loss falls over 50 AdamW steps on a fixed corpus", "[nn][train]") {
  DecoderConfig c = tiny_llama(48, 48, 96, 2, 4, 2);
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  test::Rig rig;
  DecoderModel model(*rig.engine, c, model_options(DType::kF32, 16));
  rig.engine->finalize();
  initialize_parameters(*rig.engine, model.parameters(), 1234);
  PlainAdamW opt(*rig.engine, 3e-3, 0.01);

  // Corpus: sequences of an affine recurrence t' = (5 t + 3) mod V from seeded
  // starts; the next token is a function of the current one, so it is learnable.
  const int64_t batch = 4, seq = 24;
  std::mt19937 gen(42);
  std::vector<double> losses;
  for (int step = 0; step < 50; ++step) {
    std::vector<int32_t> ids(batch * seq), targets(batch * seq);
    for (int64_t b = 0; b < batch; ++b) {
      int32_t t = static_cast<int32_t>(gen() % c.vocab_size);
      for (int64_t s = 0; s < seq; ++s) {
        ids[b * seq + s] = t;
        t = static_cast<int32_t>((5 * t + 3) % c.vocab_size);
        targets[b * seq + s] = t;
      }
    }
    rig.engine->zero_grad();
    model.forward(ids, targets, batch, seq);
    model.backward();
    const double loss = model.loss();
    REQUIRE(std::isfinite(loss));
    opt.step();
    losses.push_back(loss);
  }
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += losses[i] / 5, last += losses[45 + i] / 5;
  INFO("loss at step 1: " << losses[0] << ", mean of steps 1-5: " << first
                          << ", of steps 46-50: " << last);
  CHECK(losses[0] == Approx(std::log(48.0)).margin(0.2));  // starts near uniform
  CHECK(last < 0.5 * first);
}
