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
      CHECK(st[1] == 2 * counted);
      CHECK(st[0] == Approx(2 * loss_ref).epsilon(std::max(tol, 1e-5)));
      expect_near(f.read(lse.back()), lse_ref, std::max(tol, 1e-5), "lse");
    }
    // Every rank computed the same loss, bit for bit.
    for (double x : rank_stats) CHECK(x == rank_stats.front());
    expect_near(dh_sum, dh_ref, tol, "dh summed over the shards");
    expect_near(dw_all, dw_ref, tol, "dw, the shards' rows");
  }

  // The embedding: each shard looks up its rows and zeros for the others'.
  const std::vector<int32_t> ids = {0, 39, 5, 5, 17, 20, 1, 38, 9, 0, 21, 30, 12};
  const int64_t padding_idx = 5;
  Vec table = normal_vec(vocab * dim, 13, 1.0), dout = normal_vec(rows * dim, 14, 1.0);
  const TensorView doutv = f.tensor(dout, act, {rows, dim});
  const TensorView idv = f.ints(ids);
  for (int tp : {1, 2, 4, 8}) {
    INFO(dtype_name(act) << ", embedding tp " << tp);
    const int64_t shard = vocab / tp;
    Vec out_sum(rows * dim, 0.0), dtable_all;
    for (int t = 0; t < tp; ++t) {
      Vec ts(table.begin() + t * shard * dim, table.begin() + (t + 1) * shard * dim);
      const TensorView tab = f.tensor(ts, act, {shard, dim});
      const TensorView out = f.zeros(act, {rows, dim}), dtable = f.zeros(DType::kF32, {shard, dim});
      f.ops->embedding_forward(*f.ctx, tab, idv, out, t * shard, vocab);
      f.ops->embedding_backward(*f.ctx, doutv, idv, dtable, padding_idx, t * shard, vocab);
      const Vec o = f.read(out), d = f.read(dtable);
      for (size_t i = 0; i < out_sum.size(); ++i) out_sum[i] += o[i];
      dtable_all.insert(dtable_all.end(), d.begin(), d.end());
    }
    Vec out_ref(rows * dim), dtable_ref(vocab * dim, 0.0), table_rounded = table;
    f.tensor(table_rounded, act, {vocab, dim});
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < dim; ++c) {
        out_ref[r * dim + c] = table_rounded[ids[r] * dim + c];
        if (ids[r] != padding_idx) dtable_ref[ids[r] * dim + c] += dout[r * dim + c];
      }
    }
    CHECK(out_sum == out_ref);  // one shard's row plus zeros: exact
    expect_near(dtable_all, dtable_ref, 1e-6, "embedding dtable, the shards' rows");
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
}

}  // namespace strata::test::vocab
