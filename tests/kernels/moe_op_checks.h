// The mixture-of-experts ops (ops.h, moe_*) against a plain double-precision
// reference, for any backend's test fixture (tensor, zeros, read, ops, ctx:
// ops_cpu_test.cc's and cuda_ops_fixture.h's): routing with a tie (lower
// expert first, as torch.topk) and an expert no token chose, with and without
// renormalisation; the stable permutation; gather/combine and their
// backwards; the router's backward against central differences of the
// routed weights; the load-balancing loss and its gradient.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "tests/kernels/expect_near.h"
#include "tests/support/test_paths.h"

namespace strata::test::moe {

using Vec = std::vector<double>;


// Softmax of one row and the top-k (descending, lower index first on ties).
inline Vec softmax(const double* l, int64_t n) {
  const double m = *std::max_element(l, l + n);
  Vec p(static_cast<size_t>(n));
  double s = 0;
  for (int64_t e = 0; e < n; ++e) s += (p[e] = std::exp(l[e] - m));
  for (double& x : p) x /= s;
  return p;
}
inline std::vector<int> top_k(const Vec& p, int64_t k) {
  std::vector<int> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
  order.resize(static_cast<size_t>(k));
  return order;
}
// The routed weights of a row for fixed experts `chosen`.
inline Vec routed(const double* l, int64_t n, const std::vector<int>& chosen, bool renormalize) {
  const Vec p = softmax(l, n);
  Vec w;
  double s = 0;
  for (int e : chosen) s += p[e];
  for (int e : chosen) w.push_back(renormalize ? p[e] / s : p[e]);
  return w;
}

template <typename Fixture>
void check_moe_ops(Fixture& f, DType act) {
  const int64_t rows = 13, experts = 6, k = 2, dim = 10;
  std::mt19937 gen(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  Vec logits(static_cast<size_t>(rows * experts));
  for (double& x : logits) x = normal(gen);
  for (int64_t r = 0; r < rows; ++r) logits[r * experts + 4] = -9.0;  // expert 4: never chosen
  for (int64_t e = 0; e < experts; ++e) logits[2 * experts + e] = 0.5;  // row 2: a six-way tie
  for (bool renormalize : {true, false}) {
    INFO("activations " << dtype_name(act) << ", renormalize " << renormalize);
    Vec lv = logits;
    const TensorView d_logits = f.tensor(lv, act, {rows, experts});  // lv: the rounded values
    TensorView probs = f.zeros(DType::kF32, {rows, experts}), indices = f.zeros(DType::kI32, {rows, k}),
               weights = f.zeros(DType::kF32, {rows, k}), offsets = f.zeros(DType::kI32, {experts + 1}),
               slots = f.zeros(DType::kI32, {rows, k}), tokens = f.zeros(DType::kI32, {rows * k});
    const TensorView stats = f.zeros(DType::kF64, {2, experts});
    // Twice: the statistics accumulate, everything else is overwritten.
    for (int pass = 0; pass < 2; ++pass) {
      f.ops->moe_route(*f.ctx, d_logits, k, renormalize, probs, indices, weights, offsets, slots, tokens,
                       stats);
    }
    // The reference routing.
    Vec want_p, want_w, want_idx, want_stats(static_cast<size_t>(2 * experts), 0.0);
    std::vector<std::vector<int>> chosen;
    for (int64_t r = 0; r < rows; ++r) {
      const Vec p = softmax(lv.data() + r * experts, experts);
      want_p.insert(want_p.end(), p.begin(), p.end());
      chosen.push_back(top_k(p, k));
      const Vec w = routed(lv.data() + r * experts, experts, chosen.back(), renormalize);
      want_w.insert(want_w.end(), w.begin(), w.end());
      for (int e : chosen.back()) {
        want_idx.push_back(e);
        want_stats[static_cast<size_t>(e)] += 2;
      }
      for (int64_t e = 0; e < experts; ++e) want_stats[static_cast<size_t>(experts + e)] += 2 * p[e];
    }
    CHECK(chosen[2] == std::vector<int>{0, 1});  // the tie: lower experts first
    expect_near(f.read(probs), want_p, 1e-6, "probs");
    CHECK(f.read(indices) == want_idx);
    expect_near(f.read(weights), want_w, 1e-6, "weights");
    expect_near(f.read(stats), want_stats, 1e-6, "aux_stats");  // sums of fp32 probabilities
    // Offsets, slots and tokens: a counting sort, stable in (row, j).
    Vec want_off(static_cast<size_t>(experts + 1), 0.0), want_slot(static_cast<size_t>(rows * k)),
        want_tok(static_cast<size_t>(rows * k));
    for (double e : want_idx) want_off[static_cast<size_t>(e) + 1] += 1;
    for (size_t e = 0; e < static_cast<size_t>(experts); ++e) want_off[e + 1] += want_off[e];
    Vec next(want_off.begin(), want_off.end() - 1);
    for (size_t a = 0; a < want_idx.size(); ++a) {
      const double s = next[static_cast<size_t>(want_idx[a])]++;
      want_slot[a] = s;
      want_tok[static_cast<size_t>(s)] = static_cast<double>(a / k);
    }
    CHECK(want_off[4] == want_off[5]);  // expert 4 has no rows
    CHECK(f.read(offsets) == want_off);
    CHECK(f.read(slots) == want_slot);
    CHECK(f.read(tokens) == want_tok);

    // Gather, combine and their backwards.
    Vec x(static_cast<size_t>(rows * dim)), yp(static_cast<size_t>(rows * k * dim)), dy(x.size());
    for (double& v : x) v = normal(gen);
    for (double& v : yp) v = normal(gen);
    for (double& v : dy) v = normal(gen);
    const TensorView d_x = f.tensor(x, act, {rows, dim}), d_yp = f.tensor(yp, act, {rows * k, dim}),
                     d_dy = f.tensor(dy, act, {rows, dim});
    TensorView xp = f.zeros(act, {rows * k, dim}), y = f.zeros(act, {rows, dim}),
               dyp = f.zeros(act, {rows * k, dim}), dweights = f.zeros(DType::kF32, {rows, k}),
               dx = f.zeros(act, {rows, dim});
    f.ops->moe_gather(*f.ctx, d_x, tokens, xp);
    f.ops->moe_combine(*f.ctx, d_yp, slots, weights, y);
    f.ops->moe_combine_backward(*f.ctx, d_dy, d_yp, slots, weights, dyp, dweights);
    f.ops->moe_gather_backward(*f.ctx, d_yp, slots, dx, false);
    const Vec got_w = f.read(weights);
    Vec want_xp(xp.numel()), want_y(y.numel(), 0.0), want_dyp(dyp.numel()), want_dw(dweights.numel()),
        want_dx(dx.numel(), 0.0);
    for (int64_t s = 0; s < rows * k; ++s) {
      for (int64_t d = 0; d < dim; ++d) want_xp[s * dim + d] = x[static_cast<size_t>(want_tok[s]) * dim + d];
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < k; ++j) {
        const auto s = static_cast<int64_t>(want_slot[r * k + j]);
        const double w = got_w[r * k + j];
        double dot = 0;
        for (int64_t d = 0; d < dim; ++d) {
          want_y[r * dim + d] += w * yp[s * dim + d];
          want_dyp[s * dim + d] = w * dy[r * dim + d];
          want_dx[r * dim + d] += yp[s * dim + d];
          dot += dy[r * dim + d] * yp[s * dim + d];
        }
        want_dw[r * k + j] = dot;
      }
    }
    const double tol = act == DType::kF32 ? 1e-6 : 1e-2;
    CHECK(f.read(xp) == want_xp);  // a copy: exact
    expect_near(f.read(y), want_y, tol, "combine");
    expect_near(f.read(dyp), want_dyp, tol, "combine_backward dyp");
    expect_near(f.read(dweights), want_dw, 1e-5, "combine_backward dweights");
    expect_near(f.read(dx), want_dx, tol, "gather_backward");
    f.ops->moe_gather_backward(*f.ctx, d_yp, slots, dx, true);  // accumulates
    for (double& v : want_dx) v *= 2;
    expect_near(f.read(dx), want_dx, tol, "gather_backward accumulate");

    // The router's backward: the gradient of sum_j dw[r, j] w_j + sum_e g_e p_e
    // with respect to the logits (top-k fixed), by central differences in double.
    Vec dwv(static_cast<size_t>(rows * k)), aux_g(static_cast<size_t>(experts));
    for (double& v : dwv) v = normal(gen);
    for (double& v : aux_g) v = normal(gen);
    const TensorView d_dw = f.tensor(dwv, DType::kF32, {rows, k}),
                     d_aux = f.tensor(aux_g, DType::kF32, {experts});
    TensorView dlogits = f.zeros(act, {rows, experts});
    f.ops->moe_route_backward(*f.ctx, probs, indices, weights, d_dw, renormalize, d_aux, dlogits);
    const Vec got_p = f.read(probs);
    Vec want_dl(static_cast<size_t>(rows * experts));
    for (int64_t r = 0; r < rows; ++r) {
      auto objective = [&](const Vec& l) {
        const Vec w = routed(l.data(), experts, chosen[r], renormalize);
        const Vec p = softmax(l.data(), experts);
        double v = 0;
        for (int64_t j = 0; j < k; ++j) v += dwv[r * k + j] * w[j];
        for (int64_t e = 0; e < experts; ++e) v += aux_g[e] * p[e];
        return v;
      };
      // Around the probabilities the op saw (its fp32 softmax), as logits.
      Vec l(static_cast<size_t>(experts));
      for (int64_t e = 0; e < experts; ++e) l[e] = std::log(got_p[r * experts + e]);
      for (int64_t e = 0; e < experts; ++e) {
        const double h = 1e-5;
        Vec lp = l, lm = l;
        lp[e] += h;
        lm[e] -= h;
        want_dl[r * experts + e] = (objective(lp) - objective(lm)) / (2 * h);
      }
    }
    expect_near(f.read(dlogits), want_dl, act == DType::kF32 ? 1e-5 : 1e-2, "route_backward");

    // The load-balancing loss from the statistics.
    const double n = 2.0 * rows, scale = 0.25;
    TensorView aux = f.zeros(DType::kF64, {1}), aux_grad = f.zeros(DType::kF32, {experts});
    f.ops->moe_aux_loss(*f.ctx, stats, n, scale, aux, aux_grad);
    double want_aux = 0;
    Vec want_ag(static_cast<size_t>(experts));
    const Vec got_stats = f.read(stats);  // the reference from the same sums
    for (int64_t e = 0; e < experts; ++e) {
      want_aux += (got_stats[e] / n) * (got_stats[experts + e] / n);
      want_ag[e] = scale * experts * got_stats[e] / (n * n);
    }
    want_aux *= experts;
    expect_near(f.read(aux), Vec{want_aux}, 1e-9, "aux loss");
    expect_near(f.read(aux_grad), want_ag, 1e-6, "aux grad");
  }
}

// qwen2_moe's gated shared expert: y += sigmoid(gate) * v per row, and its
// backward (dgate against central differences of sum dy . y in double).
template <typename Fixture>
void check_sigmoid_gated_add(Fixture& f, DType act) {
  INFO("activations " << dtype_name(act));
  const int64_t rows = 7, dim = 37;  // dim > 32: a warp's lanes loop
  std::mt19937 gen(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  Vec v(static_cast<size_t>(rows * dim)), y(v.size()), dy(v.size()), s(static_cast<size_t>(rows));
  for (Vec* x : {&v, &y, &dy, &s}) {
    for (double& e : *x) e = normal(gen);
  }
  s[3] = 6.0;  // a gate nearly open
  s[4] = -6.0;  // and one nearly shut
  const TensorView d_v = f.tensor(v, act, {rows, dim}), d_y = f.tensor(y, act, {rows, dim}),
                   d_dy = f.tensor(dy, act, {rows, dim}), d_s = f.tensor(s, act, {rows, 1});
  TensorView dv = f.zeros(act, {rows, dim}), ds = f.zeros(act, {rows, 1});
  f.ops->sigmoid_gated_add(*f.ctx, d_v, d_s, d_y);
  f.ops->sigmoid_gated_add_backward(*f.ctx, d_dy, d_v, d_s, dv, ds);
  auto sigmoid = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  Vec want_y(y.size()), want_dv(v.size()), want_ds(s.size());
  for (int64_t r = 0; r < rows; ++r) {
    const double g = sigmoid(s[r]);
    auto objective = [&](double gate) {
      double o = 0;
      for (int64_t d = 0; d < dim; ++d) o += dy[r * dim + d] * (y[r * dim + d] + sigmoid(gate) * v[r * dim + d]);
      return o;
    };
    for (int64_t d = 0; d < dim; ++d) {
      want_y[r * dim + d] = y[r * dim + d] + g * v[r * dim + d];
      want_dv[r * dim + d] = g * dy[r * dim + d];
    }
    const double h = 1e-5;
    want_ds[r] = (objective(s[r] + h) - objective(s[r] - h)) / (2 * h);
  }
  const double tol = act == DType::kF32 ? 1e-6 : 1e-2;
  expect_near(f.read(d_y), want_y, tol, "sigmoid_gated_add y");
  expect_near(f.read(dv), want_dv, tol, "sigmoid_gated_add_backward dv");
  expect_near(f.read(ds), want_ds, act == DType::kF32 ? 1e-5 : 1e-2, "sigmoid_gated_add_backward dgate");
}

// The sigmoid router (moe_routing.h, kSigmoid) against transformers'
// DeepseekV3TopkRouter (scripts/make-golden-moe: sigmoid_router.json): its
// group-limited choice with the correction bias, its weights (the unbiased
// scores, renormalised with 1e-20, times routed_scaling_factor), and the
// gradient of sum(weights * r) with respect to the logits, autograd's. fp32
// logits (transformers' router computes in fp32).
template <typename Fixture>
void check_sigmoid_router(Fixture& f) {
  std::ifstream in(strata::test::source_dir() + "/tests/data/golden/sigmoid_router.json");
  REQUIRE(in.good());
  const nlohmann::json fixture = nlohmann::json::parse(in);
  REQUIRE(fixture.at("cases").size() == 3);
  for (const nlohmann::json& c : fixture.at("cases")) {
    const int64_t rows = c.at("rows"), experts = c.at("experts"), k = c.at("k");
    INFO("experts " << experts << ", groups " << c.at("n_group") << " keeping " << c.at("topk_group") << ", k " << k);
    ops::MoeRouter router;
    router.scores = ops::MoeScores::kSigmoid;
    router.renormalize = c.at("norm_topk_prob").get<bool>();
    router.groups = c.at("n_group");
    router.topk_groups = c.at("topk_group");
    router.scaling = c.at("routed_scaling_factor").get<float>();
    Vec logits = c.at("logits").get<Vec>(), bias = c.at("bias").get<Vec>(), r = c.at("r").get<Vec>();
    const TensorView d_logits = f.tensor(logits, DType::kF32, {rows, experts}),
                     d_bias = f.tensor(bias, DType::kF32, {experts});
    TensorView probs = f.zeros(DType::kF32, {rows, experts}), indices = f.zeros(DType::kI32, {rows, k}),
               weights = f.zeros(DType::kF32, {rows, k}), offsets = f.zeros(DType::kI32, {experts + 1}),
               slots = f.zeros(DType::kI32, {rows, k}), tokens = f.zeros(DType::kI32, {rows * k});
    f.ops->moe_route(*f.ctx, d_logits, k, router, d_bias, probs, indices, weights, offsets, slots, tokens, {});
    const Vec got_idx = f.read(indices), got_w = f.read(weights);
    // transformers' topk(sorted=False) orders the chosen experts as it likes:
    // compare each row's set, and each expert's weight, and send the
    // gradient of each chosen expert to its place in our order.
    Vec dw(static_cast<size_t>(rows * k));
    for (int64_t row = 0; row < rows; ++row) {
      INFO("row " << row);
      std::set<int> want, got;
      for (int64_t j = 0; j < k; ++j) {
        want.insert(c.at("indices")[row][j].get<int>());
        got.insert(static_cast<int>(got_idx[row * k + j]));
      }
      REQUIRE(got == want);
      for (int64_t j = 0; j < k; ++j) {
        const int e = static_cast<int>(got_idx[row * k + j]);
        for (int64_t i = 0; i < k; ++i) {
          if (c.at("indices")[row][i].get<int>() != e) continue;
          CHECK(got_w[row * k + j] == Approx(c.at("weights")[row][i].get<double>()).epsilon(1e-6));
          dw[row * k + j] = r[row * k + i];
        }
      }
    }
    // Our choice is in descending order of the biased score.
    const Vec got_p = f.read(probs);
    for (int64_t row = 0; row < rows; ++row) {
      for (int64_t j = 1; j < k; ++j) {
        const auto a = static_cast<size_t>(got_idx[row * k + j - 1]), b = static_cast<size_t>(got_idx[row * k + j]);
        CHECK(got_p[row * experts + a] + bias[a] >= got_p[row * experts + b] + bias[b]);
      }
    }
    const TensorView d_dw = f.tensor(dw, DType::kF32, {rows, k});
    TensorView dlogits = f.zeros(DType::kF32, {rows, experts});
    f.ops->moe_route_backward(*f.ctx, probs, indices, weights, d_dw, router, {}, dlogits);
    expect_near(f.read(dlogits), c.at("dlogits").get<Vec>(), 1e-6, "sigmoid route_backward");
  }
  // What the sigmoid router does not take.
  ops::MoeRouter bad;
  bad.scores = ops::MoeScores::kSigmoid;
  bad.groups = 3;
  Vec l(16, 0.0);
  const TensorView d_l = f.tensor(l, DType::kF32, {2, 8});
  TensorView p = f.zeros(DType::kF32, {2, 8}), idx = f.zeros(DType::kI32, {2, 2}), w = f.zeros(DType::kF32, {2, 2}),
             off = f.zeros(DType::kI32, {9}), sl = f.zeros(DType::kI32, {2, 2}), tok = f.zeros(DType::kI32, {4}),
             stats = f.zeros(DType::kF64, {2, 8});
  CHECK_THROWS_WITH(f.ops->moe_route(*f.ctx, d_l, 2, bad, {}, p, idx, w, off, sl, tok, {}),
                    Catch::Contains("3 groups") && Catch::Contains("divide the 8 experts"));
  bad.groups = 8;
  bad.topk_groups = 1;
  CHECK_THROWS_WITH(f.ops->moe_route(*f.ctx, d_l, 2, bad, {}, p, idx, w, off, sl, tok, {}),
                    Catch::Contains("top_k 2 is more than the 1 experts"));
  bad.groups = 4;
  bad.topk_groups = 2;
  CHECK_THROWS_WITH(f.ops->moe_route(*f.ctx, d_l, 2, bad, {}, p, idx, w, off, sl, tok, stats),
                    Catch::Contains("no load-balancing statistics"));
}

}  // namespace strata::test::moe
