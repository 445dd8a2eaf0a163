// Each CPU operator's backward against central finite differences of its own
// forward, in double precision (the reference), plus float-vs-double agreement.
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <string>
#include <vector>

#include "kernels/nn_ops.h"
#include "core/error.h"
#include "tests/nn/grad_check.h"
#include "tests/support/test_paths.h"

using namespace strata::nn::cpu;
using strata::test::check_gradient;
using strata::test::random_vector;
using strata::test::weighted_sum;
using Vec = std::vector<double>;

namespace {

// attention_backward's dq, dk, dv against central differences of
// sum(out * r), out = attention_forward(q, k, v) under `mask` (whose sinks,
// if any, both read).
void check_attention_gradients(Vec& q, Vec& k, Vec& v, const Vec& r, const Vec& out, const Vec& lse,
                               const AttentionShape& s, const AttentionMask& mask) {
  auto loss = [&] {
    Vec o(q.size()), l(lse.size());
    attention_forward(q.data(), k.data(), v.data(), s, o.data(), l.data(), mask);
    return weighted_sum(o, r);
  };
  Vec dq(q.size()), dk(k.size()), dv(v.size());
  attention_backward(r.data(), q.data(), k.data(), v.data(), out.data(), lse.data(), s, dq.data(), dk.data(),
                     dv.data(), mask);
  check_gradient("dq", q, dq, loss);
  check_gradient("dk", k, dk, loss);
  check_gradient("dv", v, dv, loss);
}

}  // namespace

TEST_CASE("embedding backward matches finite differences", "[nn][grad]") {
  const int64_t vocab = 7, dim = 5, rows = 6;
  const std::vector<int32_t> ids = {3, 0, 3, 6, 1, 3};  // repeats: gradients must add up
  Vec table = random_vector(vocab * dim, 1);
  const Vec r = random_vector(rows * dim, 2);
  auto loss = [&] {
    Vec out(rows * dim);
    embedding_forward(table.data(), ids.data(), rows, vocab, dim, out.data());
    return weighted_sum(out, r);
  };
  Vec dtable(vocab * dim, 0.0);
  embedding_backward(r.data(), ids.data(), rows, vocab, dim, dtable.data());
  check_gradient("dtable", table, dtable, loss);

  const std::vector<int32_t> bad = {0, 7};
  Vec out(2 * dim);
  REQUIRE_THROWS_AS(embedding_forward(table.data(), bad.data(), 2, vocab, dim, out.data()),
                    strata::Error);
}

TEST_CASE("rmsnorm backward matches finite differences", "[nn][grad]") {
  const int64_t rows = 4, dim = 6;
  Vec x = random_vector(rows * dim, 3), w = random_vector(dim, 4);
  const Vec r = random_vector(rows * dim, 5);
  auto loss = [&] {
    Vec y(rows * dim), rstd(rows);
    rmsnorm_forward(x.data(), w.data(), rows, dim, 1e-5, y.data(), rstd.data());
    return weighted_sum(y, r);
  };
  Vec y(rows * dim), rstd(rows), dx(rows * dim), dw(dim, 0.0);
  rmsnorm_forward(x.data(), w.data(), rows, dim, 1e-5, y.data(), rstd.data());
  rmsnorm_backward(r.data(), x.data(), w.data(), rstd.data(), rows, dim, dx.data(), dw.data());
  check_gradient("dx", x, dx, loss);
  check_gradient("dw", w, dw, loss);
  // Forward against the definition.
  double ms = 0;
  for (int64_t c = 0; c < dim; ++c) ms += x[c] * x[c] / dim;
  CHECK(y[2] == Approx(x[2] / std::sqrt(ms + 1e-5) * w[2]).epsilon(1e-12));
}

TEST_CASE("linear backward matches finite differences (with and without bias)", "[nn][grad]") {
  const int64_t rows = 5, in = 4, out = 3;
  for (bool with_bias : {false, true}) {
    Vec x = random_vector(rows * in, 6), w = random_vector(out * in, 7), b = random_vector(out, 8);
    const Vec r = random_vector(rows * out, 9);
    auto loss = [&] {
      Vec y(rows * out);
      linear_forward(x.data(), in, w.data(), with_bias ? b.data() : nullptr, rows, in, out,
                     y.data(), out, false);
      return weighted_sum(y, r);
    };
    Vec dx(rows * in), dw(out * in, 0.0), db(out, 0.0);
    linear_backward(r.data(), out, x.data(), in, w.data(), rows, in, out, dx.data(), in, false,
                    dw.data(), with_bias ? db.data() : nullptr);
    check_gradient("dx", x, dx, loss);
    check_gradient("dw", w, dw, loss);
    if (with_bias) check_gradient("db", b, db, loss);
    // Forward against the definition.
    Vec y(rows * out);
    linear_forward(x.data(), in, w.data(), with_bias ? b.data() : nullptr, rows, in, out, y.data(),
                   out, false);
    double expect = with_bias ? b[1] : 0.0;
    for (int64_t c = 0; c < in; ++c) expect += x[2 * in + c] * w[1 * in + c];
    CHECK(y[2 * out + 1] == Approx(expect).epsilon(1e-12));
  }
}

TEST_CASE("rope backward matches finite differences and is the inverse rotation (YaRN: the scaled transpose)",
          "[nn][grad]") {
  const int64_t rows = 5, heads = 2, head_dim = 6;
  const std::vector<int32_t> pos = {0, 1, 2, 7, 100};
  const strata::ops::Rope llama3{strata::ops::RopeType::kLlama3, 10000.0, 8.0, 1.0, 4.0, 64.0};
  // YaRN: cos and sin times its attention factor (0.1 ln 8 + 1 here), so
  // backward (the transpose) undoes forward up to the factor's square.
  strata::ops::Rope yarn;
  yarn.type = strata::ops::RopeType::kYarn;
  yarn.theta = 10.0;
  yarn.factor = 8.0;
  yarn.original_max_position_embeddings = 16.0;
  REQUIRE(strata::ops::rope_attention_scale(yarn) == Approx(0.1 * std::log(8.0) + 1.0));
  for (const strata::ops::Rope& rope : {strata::ops::Rope{}, llama3, yarn}) {
    const double scale = strata::ops::rope_attention_scale(rope);
    Vec x = random_vector(rows * heads * head_dim, 10);
    const Vec r = random_vector(x.size(), 11);
    auto loss = [&] {
      Vec y = x;
      rope_forward(y.data(), pos.data(), rows, heads, head_dim, rope);
      return weighted_sum(y, r);
    };
    Vec dx = r;
    rope_backward(dx.data(), pos.data(), rows, heads, head_dim, rope);
    check_gradient("dx", x, dx, loss);

    Vec y = x;
    rope_forward(y.data(), pos.data(), rows, heads, head_dim, rope);
    CHECK(y[0] == Approx(scale * x[0]).epsilon(1e-14));  // position 0 only scales (by 1 but for YaRN)
    CHECK(y[3 * heads * head_dim] != Approx(scale * x[3 * heads * head_dim]));
    rope_backward(y.data(), pos.data(), rows, heads, head_dim, rope);
    for (size_t i = 0; i < x.size(); ++i) REQUIRE(y[i] == Approx(scale * scale * x[i]).margin(1e-12));
    REQUIRE_THROWS_AS(rope_forward(y.data(), pos.data(), rows, heads, int64_t{5}, rope), strata::Error);
  }
}

TEST_CASE("llama3 rope frequencies follow transformers' three bands", "[nn][grad]") {
  // head_dim 8, theta 10000: wavelengths 2 pi x {1, 10, 100, 1000}; with a
  // 64-token original context and factors 1 / 4 the bands are < 16 (kept),
  // > 64 (divided by the factor 8) and between (interpolated).
  const strata::ops::Rope r{strata::ops::RopeType::kLlama3, 10000.0, 8.0, 1.0, 4.0, 64.0};
  CHECK(strata::ops::rope_inv_freq(r, 0, 8) == Approx(1.0).epsilon(1e-15));
  CHECK(strata::ops::rope_inv_freq(r, 2, 8) == Approx(0.01 / 8).epsilon(1e-13));
  CHECK(strata::ops::rope_inv_freq(r, 3, 8) == Approx(0.001 / 8).epsilon(1e-13));
  const double wavelen = 2 * std::numbers::pi / 0.1, smooth = (64.0 / wavelen - 1.0) / 3.0;
  CHECK(strata::ops::rope_inv_freq(r, 1, 8) == Approx((1 - smooth) * 0.1 / 8 + smooth * 0.1).epsilon(1e-13));
  const strata::ops::Rope linear{strata::ops::RopeType::kLinear, 10000.0, 4.0};
  CHECK(strata::ops::rope_inv_freq(linear, 1, 8) == Approx(0.1 / 4).epsilon(1e-13));
}

TEST_CASE("yarn rope frequencies and attention factor are transformers' _compute_yarn_parameters", "[nn][grad]") {
  // scripts/make-golden (yarn_frequencies.json): transformers' fp32 inverse
  // frequencies and attention factor for parameter sets covering each branch
  // (defaults, mscale with and without mscale_all_dim, an explicit
  // attention_factor, truncate off, DeepSeek-V3's and Kimi K2's values, factor 1).
  std::ifstream in(strata::test::source_dir() + "/tests/data/golden/yarn_frequencies.json");
  REQUIRE(in.good());
  const nlohmann::json fixture = nlohmann::json::parse(in);
  REQUIRE(fixture.at("cases").size() >= 7);
  for (const nlohmann::json& c : fixture.at("cases")) {
    INFO(c.dump());
    const nlohmann::json& p = c.at("rope_parameters");
    strata::ops::Rope r;
    r.type = strata::ops::RopeType::kYarn;
    r.theta = c.at("rope_theta").get<double>();
    r.factor = p.at("factor").get<double>();
    r.original_max_position_embeddings = p.at("original_max_position_embeddings").get<double>();
    r.beta_fast = p.value("beta_fast", 32.0);
    r.beta_slow = p.value("beta_slow", 1.0);
    r.mscale = p.value("mscale", 0.0);
    r.mscale_all_dim = p.value("mscale_all_dim", 0.0);
    r.attention_factor = p.value("attention_factor", 0.0);
    r.truncate = p.value("truncate", true);
    const int64_t head_dim = c.at("head_dim").get<int64_t>();
    const std::vector<double> want = c.at("inv_freq").get<std::vector<double>>();
    REQUIRE(static_cast<int64_t>(want.size()) == head_dim / 2);
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      INFO("i " << i);
      // transformers computes in fp32: agreement to its rounding.
      CHECK(strata::ops::rope_inv_freq(r, i, head_dim) == Approx(want[static_cast<size_t>(i)]).epsilon(2e-6));
    }
    CHECK(strata::ops::rope_attention_scale(r) == Approx(c.at("attention_factor").get<double>()).epsilon(1e-12));
  }
}

TEST_CASE("sliding-window attention: the definition, and backward by finite differences",
          "[nn][grad]") {
  AttentionShape s;
  s.batch = 1;
  s.seq = 7;
  s.heads = 2;
  s.kv_heads = 1;
  s.head_dim = 3;
  const AttentionMask mask{3};
  const size_t nq = s.batch * s.seq * s.heads * s.head_dim, nkv = nq / 2;
  Vec q = random_vector(nq, 40), k = random_vector(nkv, 41), v = random_vector(nkv, 42);
  const Vec r = random_vector(nq, 43);
  Vec out(nq), lse(s.batch * s.heads * s.seq);
  attention_forward(q.data(), k.data(), v.data(), s, out.data(), lse.data(), mask);
  // Query 5 of head 1 sees keys 3, 4, 5 only.
  {
    const int64_t h = 1, i = 5, d = s.head_dim;
    double p[3], sum = 0;
    for (int64_t j = 3; j <= 5; ++j) {
      double sc = 0;
      for (int64_t c = 0; c < d; ++c) sc += q[(i * s.heads + h) * d + c] * k[j * d + c];
      p[j - 3] = std::exp(sc / std::sqrt(double(d)));
      sum += p[j - 3];
    }
    for (int64_t c = 0; c < d; ++c) {
      double o = 0;
      for (int64_t j = 3; j <= 5; ++j) o += p[j - 3] / sum * v[j * d + c];
      CHECK(out[(i * s.heads + h) * d + c] == Approx(o).epsilon(1e-12));
    }
  }
  check_attention_gradients(q, k, v, r, out, lse, s, mask);
}

TEST_CASE("GQA causal attention: forward matches the definition, backward finite differences",
          "[nn][grad]") {
  AttentionShape s;
  s.batch = 2;
  s.seq = 5;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 3;
  const size_t nq = s.batch * s.seq * s.heads * s.head_dim;
  const size_t nkv = s.batch * s.seq * s.kv_heads * s.head_dim;
  Vec q = random_vector(nq, 12), k = random_vector(nkv, 13), v = random_vector(nkv, 14);
  const Vec r = random_vector(nq, 15);
  Vec out(nq), lse(s.batch * s.heads * s.seq);
  auto loss = [&] {
    Vec o(nq), l(lse.size());
    attention_forward(q.data(), k.data(), v.data(), s, o.data(), l.data());
    return weighted_sum(o, r);
  };
  attention_forward(q.data(), k.data(), v.data(), s, out.data(), lse.data());

  // Definition, for batch 1, head 3 (kv head 1), query 3: softmax over keys 0..3.
  {
    const int64_t b = 1, h = 3, kh = 1, i = 3, d = s.head_dim;
    std::vector<double> p(i + 1);
    double sum = 0;
    for (int64_t j = 0; j <= i; ++j) {
      double sc = 0;
      for (int64_t c = 0; c < d; ++c) {
        sc += q[((b * s.seq + i) * s.heads + h) * d + c] *
              k[((b * s.seq + j) * s.kv_heads + kh) * d + c];
      }
      p[j] = std::exp(sc / std::sqrt(double(d)));
      sum += p[j];
    }
    for (int64_t c = 0; c < d; ++c) {
      double o = 0;
      for (int64_t j = 0; j <= i; ++j)
        o += p[j] / sum * v[((b * s.seq + j) * s.kv_heads + kh) * d + c];
      CHECK(out[((b * s.seq + i) * s.heads + h) * d + c] == Approx(o).epsilon(1e-12));
    }
    // Causality: the first query sees only the first value.
    for (int64_t c = 0; c < d; ++c) {
      CHECK(out[(b * s.seq * s.heads + h) * d + c] ==
            Approx(v[(b * s.seq * s.kv_heads + kh) * d + c]));
    }
  }

  Vec dq(nq), dk(nkv), dv(nkv);
  attention_backward(r.data(), q.data(), k.data(), v.data(), out.data(), lse.data(), s, dq.data(),
                     dk.data(), dv.data());
  check_gradient("dq", q, dq, loss);
  check_gradient("dk", k, dk, loss);
  check_gradient("dv", v, dv, loss);

  AttentionShape bad = s;
  bad.kv_heads = 3;
  REQUIRE_THROWS_AS(attention_forward(q.data(), k.data(), v.data(), bad, out.data(), lse.data()),
                    strata::Error);
}

TEST_CASE("swiglu backward matches finite differences", "[nn][grad]") {
  const int64_t n = 12;
  Vec g = random_vector(n, 16, 3.0), u = random_vector(n, 17);
  const Vec r = random_vector(n, 18);
  auto loss = [&] {
    Vec o(n);
    swiglu_forward(g.data(), u.data(), n, o.data());
    return weighted_sum(o, r);
  };
  Vec dg(n), du(n), o(n);
  swiglu_backward(r.data(), g.data(), u.data(), n, dg.data(), du.data());
  check_gradient("dgate", g, dg, loss);
  check_gradient("dup", u, du, loss);
  swiglu_forward(g.data(), u.data(), n, o.data());
  CHECK(o[4] == Approx(g[4] / (1 + std::exp(-g[4])) * u[4]).epsilon(1e-14));
}

TEST_CASE("residual add", "[nn][grad]") {
  Vec a = random_vector(9, 19), b = random_vector(9, 20), o(9);
  add(a.data(), b.data(), 9, o.data());
  for (int i = 0; i < 9; ++i) CHECK(o[i] == a[i] + b[i]);
  add(o.data(), b.data(), 9, o.data());  // in place
  for (int i = 0; i < 9; ++i) CHECK(o[i] == Approx(a[i] + 2 * b[i]));
}

TEST_CASE("chunked cross-entropy: definition, chunk independence, finite differences",
          "[nn][grad]") {
  CrossEntropyShape s;
  s.rows = 7;
  s.dim = 4;
  s.vocab = 9;
  s.chunk_rows = 3;  // 7 rows: chunks of 3, 3, 1
  Vec h = random_vector(s.rows * s.dim, 21), w = random_vector(s.vocab * s.dim, 22);
  const std::vector<int32_t> targets = {0, 8, kIgnoreIndex, 4, 4, 1, 7};
  REQUIRE(count_targets(targets.data(), s.rows) == 6);
  Vec lse(s.rows);
  const double total = cross_entropy_forward(h.data(), w.data(), targets.data(), s, lse.data());

  double expect = 0;
  for (int64_t r = 0; r < s.rows; ++r) {
    if (targets[r] == kIgnoreIndex) continue;
    std::vector<double> logits(s.vocab);
    double z = 0;
    for (int64_t c = 0; c < s.vocab; ++c) {
      for (int64_t e = 0; e < s.dim; ++e) logits[c] += h[r * s.dim + e] * w[c * s.dim + e];
      z += std::exp(logits[c]);
    }
    expect += std::log(z) - logits[targets[r]];
  }
  CHECK(total == Approx(expect).epsilon(1e-12));
  for (int64_t chunk : {1, 2, 7, 100}) {
    CrossEntropyShape c = s;
    c.chunk_rows = chunk;
    Vec l(s.rows);
    CHECK(cross_entropy_forward(h.data(), w.data(), targets.data(), c, l.data()) ==
          Approx(total).epsilon(1e-13));
  }

  const double scale = 1.0 / 6;  // mean over counted targets
  auto loss = [&] {
    Vec l(s.rows);
    return scale * cross_entropy_forward(h.data(), w.data(), targets.data(), s, l.data());
  };
  Vec dh(h.size()), dw(w.size(), 0.0);
  cross_entropy_backward(h.data(), w.data(), targets.data(), lse.data(), s, scale, dh.data(),
                         dw.data());
  check_gradient("dh", h, dh, loss);
  check_gradient("dw", w, dw, loss);
  for (int64_t e = 0; e < s.dim; ++e) CHECK(dh[2 * s.dim + e] == 0.0);  // ignored row

  const std::vector<int32_t> bad = {0, 9, 0, 0, 0, 0, 0};
  REQUIRE_THROWS_AS(cross_entropy_forward(h.data(), w.data(), bad.data(), s, lse.data()),
                    strata::Error);
}

TEST_CASE("float kernels agree with the double reference", "[nn]") {
  AttentionShape s;
  s.batch = 2;
  s.seq = 16;
  s.heads = 4;
  s.kv_heads = 1;
  s.head_dim = 8;
  const size_t nq = s.batch * s.seq * s.heads * s.head_dim, nkv = nq / 4;
  const Vec q = random_vector(nq, 30), k = random_vector(nkv, 31), v = random_vector(nkv, 32),
            r = random_vector(nq, 33);
  Vec out(nq), lse(s.batch * s.heads * s.seq), dq(nq), dk(nkv), dv(nkv);
  attention_forward(q.data(), k.data(), v.data(), s, out.data(), lse.data());
  attention_backward(r.data(), q.data(), k.data(), v.data(), out.data(), lse.data(), s, dq.data(),
                     dk.data(), dv.data());
  auto qf = strata::test::to_float(q), kf = strata::test::to_float(k),
       vf = strata::test::to_float(v), rf = strata::test::to_float(r);
  std::vector<float> outf(nq), lsef(lse.size()), dqf(nq), dkf(nkv), dvf(nkv);
  attention_forward(qf.data(), kf.data(), vf.data(), s, outf.data(), lsef.data());
  attention_backward(rf.data(), qf.data(), kf.data(), vf.data(), outf.data(), lsef.data(), s,
                     dqf.data(), dkf.data(), dvf.data());
  for (size_t i = 0; i < nq; ++i) REQUIRE(outf[i] == Approx(out[i]).margin(1e-5));
  for (size_t i = 0; i < nq; ++i) REQUIRE(dqf[i] == Approx(dq[i]).margin(1e-4));
  for (size_t i = 0; i < nkv; ++i) REQUIRE(dkf[i] == Approx(dk[i]).margin(1e-4));
  for (size_t i = 0; i < nkv; ++i) REQUIRE(dvf[i] == Approx(dv[i]).margin(1e-4));
}

TEST_CASE("Gemma's attention scores: query_pre_attn_scalar's scale and the soft cap, by definition and finite "
          "differences",
          "[nn][grad][gemma]") {
  AttentionShape s;
  s.batch = 1;
  s.seq = 7;
  s.heads = 2;
  s.kv_heads = 1;
  s.head_dim = 3;
  AttentionMask mask{3};
  mask.scale = 0.8f;   // not 1/sqrt(head_dim)
  mask.softcap = 0.7f;  // small enough to bend these scores
  const size_t nq = s.batch * s.seq * s.heads * s.head_dim, nkv = nq / 2;
  Vec q = random_vector(nq, 50, 2.0), k = random_vector(nkv, 51, 2.0), v = random_vector(nkv, 52);
  const Vec r = random_vector(nq, 53);
  Vec out(nq), lse(s.batch * s.heads * s.seq);
  attention_forward(q.data(), k.data(), v.data(), s, out.data(), lse.data(), mask);
  {
    // Query 5 of head 1: softmax over keys 3..5 of cap * tanh(scale * q.k / cap).
    const int64_t h = 1, i = 5, d = s.head_dim;
    double p[3], sum = 0;
    for (int64_t j = 3; j <= 5; ++j) {
      double sc = 0;
      for (int64_t c = 0; c < d; ++c) sc += q[(i * s.heads + h) * d + c] * k[j * d + c];
      p[j - 3] = std::exp(double(mask.softcap) * std::tanh(double(mask.scale) * sc / double(mask.softcap)));
      sum += p[j - 3];
    }
    for (int64_t c = 0; c < d; ++c) {
      double o = 0;
      for (int64_t j = 3; j <= 5; ++j) o += p[j - 3] / sum * v[j * d + c];
      CHECK(out[(i * s.heads + h) * d + c] == Approx(o).epsilon(1e-6));
    }
  }
  check_attention_gradients(q, k, v, r, out, lse, s, mask);
}

TEST_CASE("gpt-oss's attention sinks: the definition, and backward (the sinks' too) by finite differences",
          "[nn][grad][gpt_oss]") {
  AttentionShape s;
  s.batch = 2;
  s.seq = 6;
  s.heads = 2;
  s.kv_heads = 1;
  s.head_dim = 3;
  std::vector<float> sinks = {0.4f, -0.7f};
  AttentionMask mask{3};
  mask.sinks = sinks.data();
  const size_t nq = s.batch * s.seq * s.heads * s.head_dim, nkv = nq / 2;
  Vec q = random_vector(nq, 60, 2.0), k = random_vector(nkv, 61, 2.0), v = random_vector(nkv, 62);
  const Vec r = random_vector(nq, 63);
  Vec out(nq), lse(s.batch * s.heads * s.seq);
  attention_forward(q.data(), k.data(), v.data(), s, out.data(), lse.data(), mask);
  {
    // Batch 1, query 4 of head 1: transformers' eager_attention_forward -- the
    // scores of keys 2..4 and the sink in one softmax, the sink's column dropped.
    const int64_t b = 1, h = 1, i = 4, d = s.head_dim;
    double p[3], sum = std::exp(double(sinks[h]));
    for (int64_t j = 2; j <= 4; ++j) {
      double sc = 0;
      for (int64_t c = 0; c < d; ++c) sc += q[((b * s.seq + i) * s.heads + h) * d + c] * k[(b * s.seq + j) * d + c];
      p[j - 2] = std::exp(sc / std::sqrt(double(d)));
      sum += p[j - 2];
    }
    for (int64_t c = 0; c < d; ++c) {
      double o = 0;
      for (int64_t j = 2; j <= 4; ++j) o += p[j - 2] / sum * v[(b * s.seq + j) * d + c];
      CHECK(out[((b * s.seq + i) * s.heads + h) * d + c] == Approx(o).epsilon(1e-12));
    }
    CHECK(lse[(b * s.heads + h) * s.seq + i] == Approx(std::log(sum)).epsilon(1e-12));
  }
  check_attention_gradients(q, k, v, r, out, lse, s, mask);
  auto loss = [&] {
    Vec o(nq), l(lse.size());
    attention_forward(q.data(), k.data(), v.data(), s, o.data(), l.data(), mask);
    return weighted_sum(o, r);
  };
  Vec dsinks(2, 0.0);
  attention_sinks_backward(r.data(), out.data(), lse.data(), s, sinks.data(), dsinks.data());
  // The sinks are fp32: central differences of a step fp32 holds exactly.
  for (size_t h = 0; h < sinks.size(); ++h) {
    const float keep = sinks[h], step = 1.0f / 1024;
    sinks[h] = keep + step;
    const double up = loss();
    sinks[h] = keep - step;
    const double down = loss();
    sinks[h] = keep;
    INFO("dsinks[" << h << "]");
    CHECK(dsinks[h] == Approx((up - down) / (2.0 * step)).epsilon(1e-4).margin(1e-7));
    CHECK(std::abs(dsinks[h]) > 1e-3);  // the sinks do move this loss
  }
}
