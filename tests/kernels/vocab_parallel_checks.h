// Megatron's vocabulary-parallel embedding and cross-entropy ops (ops.h:
// embedding_forward/backward with a vocabulary shard, vocab_parallel_parts,
// vocab_parallel_loss), for any backend's test fixture (tensor, zeros, ints,
// read, ops, ctx: ops_cpu_test.cc's and cuda_ops_fixture.h's). The vocabulary
// is cut into tp shards as tensor-parallel ranks hold it, each shard's ops
// run as a rank runs them, the gather between them done by hand: the sum of
// the shards' lookups is the whole table's, their table gradients are its
// rows, and the loss, log-sum-exp, summed dh and concatenated dw are the
// double-precision reference's (kernels/nn_ops.h) on the whole vocabulary.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/nn_ops.h"
#include "kernels/ops.h"
#include "tests/kernels/expect_near.h"

namespace strata::test::vocab {

using Vec = std::vector<double>;

inline Vec normal_vec(size_t n, uint32_t seed, double scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> d(0.0, scale);
  Vec v(n);
  for (double& x : v) x = d(gen);
  return v;
}


// `act`: the logits' (activation) dtype; h and w are stored in it too.
template <typename Fixture>
void check_vocab_parallel_ops(Fixture& f, DType act, double tol) {
  const int64_t rows = 13, dim = 24, vocab = 40;
  Vec h = normal_vec(rows * dim, 11, 1.0), w = normal_vec(vocab * dim, 12, 0.5);
  // Ignored rows, a repeated target, both ends of the vocabulary; at tp 8
  // some shards hold no row's target.
  const std::vector<int32_t> targets = {3, ops::kIgnoreIndex, 0, 39, 17, 17, ops::kIgnoreIndex, 1, 20, 21, 38, 5, 12};
  const double counted = 11, grad_scale = 2.0;
  const TensorView hv = f.tensor(h, act, {rows, dim});  // h, w: the rounded values from here on
  Vec w_rounded = w;
  f.tensor(w_rounded, act, {vocab, dim});
  w = w_rounded;
  // The reference on the whole vocabulary, in double.
  nn::cpu::CrossEntropyShape s{rows, dim, vocab, rows};
  Vec lse_ref(rows), dh_ref(rows * dim), dw_ref(vocab * dim, 0.0);
  const double loss_ref = nn::cpu::cross_entropy_forward<double>(h.data(), w.data(), targets.data(), s, lse_ref.data());
  nn::cpu::cross_entropy_backward<double>(h.data(), w.data(), targets.data(), lse_ref.data(), s,
                                          grad_scale / counted, dh_ref.data(), dw_ref.data());
  const TensorView tv = f.ints(targets);
  Vec normalizer_value = {counted};
  const TensorView normalizer = f.tensor(normalizer_value, DType::kF64, {1});
  // The unsplit op the model runs without tensor parallelism (evaluation,
  // then training, as below): the shards must give its loss too.
  Vec whole_stats, whole_lse, whole_dh, whole_dw;
  {
    const TensorView wv = f.tensor(w_rounded, act, {vocab, dim});
    const TensorView st = f.zeros(DType::kF64, {2}), l = f.zeros(DType::kF32, {rows});
    const TensorView dh = f.zeros(act, {rows, dim}), dw = f.zeros(DType::kF32, {vocab, dim});
    f.ops->cross_entropy(*f.ctx, hv, wv, tv, rows, l, st, nullptr);
    const ops::Ops::CrossEntropyGrad grad{normalizer, grad_scale, dh, dw};
    f.ops->cross_entropy(*f.ctx, hv, wv, tv, 5, l, st, &grad);  // chunks of 5 rows
    whole_stats = f.read(st);
    whole_lse = f.read(l);
    whole_dh = f.read(dh);
    whole_dw = f.read(dw);
    INFO(dtype_name(act) << ", the unsplit cross_entropy");
    CHECK(whole_stats[1] == 2 * counted);
    CHECK(whole_stats[0] == Approx(2 * loss_ref).epsilon(std::max(tol, 1e-5)));
  }

  for (int tp : {1, 2, 4, 8}) {
    INFO(dtype_name(act) << ", tp " << tp);
    const int64_t shard = vocab / tp;
    std::vector<TensorView> logits, parts, stats, lse;
    std::vector<Vec> w_shards;
    Vec gathered_host;
    for (int t = 0; t < tp; ++t) {
      Vec ws(w.begin() + t * shard * dim, w.begin() + (t + 1) * shard * dim);
      const TensorView wv = f.tensor(ws, act, {shard, dim});
      w_shards.push_back(ws);
      logits.push_back(f.zeros(act, {rows, shard}));
      parts.push_back(f.zeros(DType::kF32, {2, rows}));
      f.ops->linear_forward(*f.ctx, ops::MatView::of(hv), wv, TensorView{}, ops::MatView::of(logits.back()), false);
      f.ops->vocab_parallel_parts(*f.ctx, logits.back(), tv, t * shard, parts.back());
      const Vec p = f.read(parts.back());
      gathered_host.insert(gathered_host.end(), p.begin(), p.end());
    }
    const TensorView gathered = f.tensor(gathered_host, DType::kF32, {tp, 2, rows});
    Vec dh_sum(rows * dim, 0.0), dw_all;
    std::vector<double> rank_stats;
    std::vector<Vec> rank_lse;
    for (int t = 0; t < tp; ++t) {
      Vec ws = w_shards[static_cast<size_t>(t)];
      const TensorView wv = f.tensor(ws, act, {shard, dim});
      stats.push_back(f.zeros(DType::kF64, {2}));
      lse.push_back(f.zeros(DType::kF32, {rows}));
      // Evaluation first (the stats accumulate; the logits stay), then training.
      f.ops->vocab_parallel_loss(*f.ctx, logits[t], gathered, tv, t * shard, vocab, lse.back(), stats.back(), nullptr);
      const ops::Ops::VocabParallelGrad grad{normalizer, grad_scale};
      f.ops->vocab_parallel_loss(*f.ctx, logits[t], gathered, tv, t * shard, vocab, lse.back(), stats.back(), &grad);
      const TensorView dh = f.zeros(act, {rows, dim}), dw = f.zeros(DType::kF32, {shard, dim});
      f.ops->linear_backward(*f.ctx, ops::MatView::of(logits[t]), ops::MatView::of(hv), wv, ops::MatView::of(dh), false, dw,
                             TensorView{});
      const Vec dhv = f.read(dh), dwv = f.read(dw), st = f.read(stats.back());
      for (size_t i = 0; i < dh_sum.size(); ++i) dh_sum[i] += dhv[i];
      dw_all.insert(dw_all.end(), dwv.begin(), dwv.end());
      rank_stats.push_back(st[0]);
      rank_lse.push_back(f.read(lse.back()));
      CHECK(st[1] == 2 * counted);
      CHECK(st[0] == Approx(2 * loss_ref).epsilon(std::max(tol, 1e-5)));
      CHECK(st[0] == Approx(whole_stats[0]).epsilon(std::max(tol, 1e-5)));
      expect_near(rank_lse.back(), lse_ref, std::max(tol, 1e-5), "lse");
      expect_near(rank_lse.back(), whole_lse, std::max(tol, 1e-5), "lse against the unsplit cross_entropy");
    }
    // Every rank computed the same loss and log-sum-exp, bit for bit.
    for (double x : rank_stats) CHECK(x == rank_stats.front());
    for (const Vec& l : rank_lse) CHECK(l == rank_lse.front());
    expect_near(dh_sum, dh_ref, tol, "dh summed over the shards");
    expect_near(dw_all, dw_ref, tol, "dw, the shards' rows");
    expect_near(dh_sum, whole_dh, tol, "dh summed over the shards, against the unsplit cross_entropy");
    expect_near(dw_all, whole_dw, tol, "dw, the shards' rows, against the unsplit cross_entropy");
  }

  // The embedding: each shard looks up its rows and zeros for the others'.
  // Id 0 three times (the backward's sum order shows), the padding id in
  // different shards as tp grows (5: the first shard, then the second at tp 8;
  // 30: the last but one or last shard), dtable starting nonzero (+=).
  const std::vector<int32_t> ids = {0, 39, 5, 5, 17, 20, 1, 38, 0, 0, 21, 30, 12};
  Vec table = normal_vec(vocab * dim, 13, 1.0), dout = normal_vec(rows * dim, 14, 1.0);
  Vec dtable0 = normal_vec(vocab * dim, 15, 0.1);
  const TensorView doutv = f.tensor(dout, act, {rows, dim});
  const TensorView idv = f.ints(ids);
  Vec table_rounded = table, dtable0_rounded = dtable0;
  const TensorView whole_table = f.tensor(table_rounded, act, {vocab, dim});
  f.tensor(dtable0_rounded, DType::kF32, {vocab, dim});  // dtable0: the fp32 values from here on
  dtable0 = dtable0_rounded;
  // The whole table's lookup, today's op (no shard), is what the shards sum to, bit for bit.
  const TensorView out_whole_v = f.zeros(act, {rows, dim});
  f.ops->embedding_forward(*f.ctx, whole_table, idv, out_whole_v);
  const Vec out_whole = f.read(out_whole_v);
  Vec out_ref(rows * dim);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < dim; ++c) out_ref[r * dim + c] = table_rounded[ids[r] * dim + c];
  }
  CHECK(out_whole == out_ref);  // a copy: exact
  for (int64_t padding_idx : {int64_t{5}, int64_t{30}, int64_t{-1}}) {
    Vec dtable_copy = dtable0;
    const TensorView dtable_whole_v = f.tensor(dtable_copy, DType::kF32, {vocab, dim});
    f.ops->embedding_backward(*f.ctx, doutv, idv, dtable_whole_v, padding_idx);
    const Vec dtable_whole = f.read(dtable_whole_v);
    Vec dtable_ref = dtable0;
    for (int64_t r = 0; r < rows; ++r) {
      if (ids[r] == padding_idx) continue;
      for (int64_t c = 0; c < dim; ++c) dtable_ref[ids[r] * dim + c] += dout[r * dim + c];
    }
    {
      INFO(dtype_name(act) << ", embedding backward, whole table, padding_idx " << padding_idx);
      expect_near(dtable_whole, dtable_ref, 1e-6, "embedding dtable, whole table");
      if (padding_idx >= 0) {  // the padding row keeps its value: no lookup adds to it
        const Vec pad_row(dtable_whole.begin() + padding_idx * dim, dtable_whole.begin() + (padding_idx + 1) * dim);
        CHECK(pad_row == Vec(dtable0.begin() + padding_idx * dim, dtable0.begin() + (padding_idx + 1) * dim));
      }
    }
    for (int tp : {1, 2, 4, 8}) {
      INFO(dtype_name(act) << ", embedding tp " << tp << ", padding_idx " << padding_idx);
      const int64_t shard = vocab / tp;
      Vec out_sum(rows * dim, 0.0), dtable_all;
      for (int t = 0; t < tp; ++t) {
        Vec ts(table.begin() + t * shard * dim, table.begin() + (t + 1) * shard * dim);
        Vec ds(dtable0.begin() + t * shard * dim, dtable0.begin() + (t + 1) * shard * dim);
        const TensorView tab = f.tensor(ts, act, {shard, dim});
        const TensorView out = f.zeros(act, {rows, dim}), dtable = f.tensor(ds, DType::kF32, {shard, dim});
        f.ops->embedding_forward(*f.ctx, tab, idv, out, t * shard, vocab);
        f.ops->embedding_backward(*f.ctx, doutv, idv, dtable, padding_idx, t * shard, vocab);
        const Vec o = f.read(out), d = f.read(dtable);
        for (size_t i = 0; i < out_sum.size(); ++i) out_sum[i] += o[i];
        dtable_all.insert(dtable_all.end(), d.begin(), d.end());
      }
      CHECK(out_sum == out_whole);        // one shard's row plus zeros: exact
      CHECK(dtable_all == dtable_whole);  // the same sums in the same order: exact
    }
  }
}

// What the front end refuses, naming the op and the tensor.
template <typename Fixture>
void check_vocab_parallel_refusals(Fixture& f) {
  const TensorView logits = f.zeros(DType::kF32, {4, 10}), targets = f.ints({1, 2, 3, 4});
  const TensorView lse = f.zeros(DType::kF32, {4}), stats = f.zeros(DType::kF64, {2});
  CHECK_THROWS_WITH(f.ops->vocab_parallel_parts(*f.ctx, logits, targets, 0, f.zeros(DType::kF32, {2, 3})),
                    Catch::Contains("vocab_parallel_parts") && Catch::Contains("parts"));
  CHECK_THROWS_WITH(f.ops->vocab_parallel_loss(*f.ctx, logits, f.zeros(DType::kF32, {2, 2, 3}), targets, 0, 20, lse,
                                               stats, nullptr),
                    Catch::Contains("vocab_parallel_loss") && Catch::Contains("gathered"));
  CHECK_THROWS_WITH(f.ops->vocab_parallel_loss(*f.ctx, logits, f.zeros(DType::kF32, {2, 2, 4}), targets, 15, 20, lse,
                                               stats, nullptr),
                    Catch::Contains("does not fit a vocabulary of 20"));
  CHECK_THROWS_WITH(f.ops->embedding_forward(*f.ctx, f.zeros(DType::kF32, {10, 4}), targets,
                                             f.zeros(DType::kF32, {4, 4}), 15, 20),
                    Catch::Contains("embedding_forward") && Catch::Contains("does not fit a vocabulary of 20"));
  // Wrong dtypes and shapes, each named.
  const TensorView gathered = f.zeros(DType::kF32, {2, 2, 4});
  CHECK_THROWS_WITH(f.ops->vocab_parallel_parts(*f.ctx, logits, targets, 0, f.zeros(DType::kBF16, {2, 4})),
                    Catch::Contains("vocab_parallel_parts: parts has dtype bf16; expected fp32"));
  CHECK_THROWS_WITH(f.ops->vocab_parallel_parts(*f.ctx, logits, f.zeros(DType::kF32, {4}), 0,
                                                f.zeros(DType::kF32, {2, 4})),
                    Catch::Contains("vocab_parallel_parts: targets has dtype fp32; expected int32"));
  CHECK_THROWS_WITH(f.ops->vocab_parallel_parts(*f.ctx, logits, f.ints({1, 2, 3}), 0, f.zeros(DType::kF32, {2, 4})),
                    Catch::Contains("vocab_parallel_parts: targets has 3 elements"));
  CHECK_THROWS_WITH(f.ops->vocab_parallel_parts(*f.ctx, f.zeros(DType::kF32, {40}), targets, 0,
                                                f.zeros(DType::kF32, {2, 4})),
                    Catch::Contains("vocab_parallel_parts: logits must be [rows, shard vocabulary]"));
  CHECK_THROWS_WITH(f.ops->vocab_parallel_loss(*f.ctx, logits, f.zeros(DType::kF64, {2, 2, 4}), targets, 0, 20, lse,
                                               stats, nullptr),
                    Catch::Contains("vocab_parallel_loss: gathered has dtype fp64; expected fp32"));
  CHECK_THROWS_WITH(f.ops->vocab_parallel_loss(*f.ctx, logits, gathered, targets, 0, 20, f.zeros(DType::kF32, {5}),
                                               stats, nullptr),
                    Catch::Contains("vocab_parallel_loss: lse has 5 elements"));
  CHECK_THROWS_WITH(f.ops->vocab_parallel_loss(*f.ctx, logits, gathered, targets, 0, 20, lse,
                                               f.zeros(DType::kF32, {2}), nullptr),
                    Catch::Contains("vocab_parallel_loss: stats has dtype fp32; expected fp64"));
  const ops::Ops::VocabParallelGrad bad_grad{f.zeros(DType::kF32, {1}), 1.0};
  CHECK_THROWS_WITH(f.ops->vocab_parallel_loss(*f.ctx, logits, gathered, targets, 0, 20, lse, stats, &bad_grad),
                    Catch::Contains("vocab_parallel_loss: normalizer has dtype fp32; expected fp64"));
  CHECK_THROWS_WITH(f.ops->embedding_backward(*f.ctx, f.zeros(DType::kF32, {4, 4}), targets,
                                              f.zeros(DType::kF32, {10, 4}), -1, 15, 20),
                    Catch::Contains("embedding_backward") && Catch::Contains("does not fit a vocabulary of 20"));
  CHECK_THROWS_WITH(f.ops->embedding_forward(*f.ctx, f.zeros(DType::kF32, {10, 4}), targets,
                                             f.zeros(DType::kF32, {4, 4}), 10),
                    Catch::Contains("embedding_forward: first_id 10 needs the whole vocabulary"));
}

}  // namespace strata::test::vocab
