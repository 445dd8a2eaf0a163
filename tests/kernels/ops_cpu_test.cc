// The cpu Ops against the double-precision reference templates (kernels/nn_ops.h)
// for every op, forward and backward, in fp32, bf16 and fp16 storage; strided
// and accumulating Linear; the fused cross-entropy; argument checks; and that
// an op enqueues and returns without waiting for its work; the optimizer ops
// (adam_step, grad_sum_sq) give the bits of kernels::adam_step / grad_stats.
#include <catch2/catch.hpp>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "kernels/nn_ops.h"
#include "kernels/ops.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "kernels/dropout_mask.h"
#include "tests/kernels/glu_reference.h"
#include "tests/kernels/moe_op_checks.h"
#include "tests/kernels/optimizer_op_checks.h"
#include "tests/kernels/vocab_parallel_checks.h"

using namespace strata;
using namespace strata::ops;
using strata::test::normal_floats;
using Vec = std::vector<double>;

namespace {

Vec random_vec(size_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> d(-scale, scale);
  Vec v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

// The value a stored element of `dtype` holds for x (what the op reads).
double rounded(double x, DType dtype) {
  double slot = 0;  // room for any element type
  store_from_float(&slot, dtype, 0, static_cast<float>(x));
  return load_as_float(&slot, dtype, 0);
}

// Relative tolerance per storage dtype of the op's inputs and outputs: 16-bit
// outputs are rounded once (2^-8 for bf16, 2^-11 for fp16, relative), fp32
// compute adds ~1e-6; references are computed from the rounded inputs.
double tol_of(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return 1e-2;
    case DType::kF16: return 2e-3;
    default: return 2e-5;
  }
}

struct Fixture {
  std::unique_ptr<Accelerator> acc = make_cpu_accelerator();
  std::unique_ptr<Stream> stream = acc->create_stream();
  std::unique_ptr<Ops> ops = make_cpu_ops(*acc);
  std::unique_ptr<ComputeContext> ctx = ops->make_context(*stream);
  std::vector<Tensor> keep;

  // A tensor holding v (rounded to dtype); v is replaced by the rounded values.
  TensorView tensor(Vec& v, DType dtype, Shape shape) {
    Tensor t = acc->allocate_tensor(dtype, shape);
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = rounded(v[i], dtype);
      store_from_float(t.data(), dtype, i, static_cast<float>(v[i]));
    }
    keep.push_back(std::move(t));
    return keep.back().view();
  }
  TensorView zeros(DType dtype, Shape shape) {
    Tensor t = acc->allocate_tensor(dtype, shape);
    std::memset(t.data(), 0, t.nbytes());
    keep.push_back(std::move(t));
    return keep.back().view();
  }
  TensorView ints(const std::vector<int32_t>& v) {
    Tensor t = acc->allocate_tensor(DType::kI32, {static_cast<int64_t>(v.size())});
    std::memcpy(t.data(), v.data(), v.size() * 4);
    keep.push_back(std::move(t));
    return keep.back().view();
  }
  Vec read(const TensorView& t) {
    stream->synchronize();
    Vec out(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < out.size(); ++i) {
      out[i] = t.desc.dtype == DType::kF64 ? static_cast<const double*>(t.data)[i]
                                           : load_as_float(t.data, t.desc.dtype, i);
    }
    return out;
  }
};

void expect_close(const Vec& got, const Vec& want, double rel, const char* what) {
  REQUIRE(got.size() == want.size());
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(what << "[" << i << "] got " << got[i] << " want " << want[i] << " (scale " << scale << ")");
    REQUIRE(std::abs(got[i] - want[i]) <= rel * std::max(scale, 1e-3) + 1e-7);
  }
}

const DType kDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

}  // namespace

TEST_CASE("cpu ops: embedding, rmsnorm, rope, swiglu, add and cast match the reference",
          "[ops][cpu]") {
  for (DType dt : kDtypes) {
    INFO("dtype " << dtype_name(dt));
    Fixture f;
    const double tol = tol_of(dt);
    const int64_t rows = 6, dim = 8, vocab = 5;
    // embedding
    Vec table = random_vec(vocab * dim, 1);
    const std::vector<int32_t> ids = {0, 4, 2, 2, 1, 3};
    auto tv = f.tensor(table, dt, {vocab, dim});
    auto out = f.zeros(dt, {rows, dim});
    f.ops->embedding_forward(*f.ctx, tv, f.ints(ids), out);
    Vec ref(rows * dim);
    nn::cpu::embedding_forward<double>(table.data(), ids.data(), rows, vocab, dim, ref.data());
    expect_close(f.read(out), ref, tol, "embedding");
    Vec dout = random_vec(rows * dim, 2);
    auto dtab = f.zeros(DType::kF32, {vocab, dim});
    f.ops->embedding_backward(*f.ctx, f.tensor(dout, dt, {rows, dim}), f.ints(ids), dtab, -1);
    // +=, with id 2 (twice in ids) as the padding index: its row gets nothing more.
    f.ops->embedding_backward(*f.ctx, f.tensor(dout, dt, {rows, dim}), f.ints(ids), dtab, 2);
    Vec dref(vocab * dim, 0.0);
    nn::cpu::embedding_backward<double>(dout.data(), ids.data(), rows, vocab, dim, dref.data());
    const Vec once = dref;
    nn::cpu::embedding_backward<double>(dout.data(), ids.data(), rows, vocab, dim, dref.data(), 2);
    for (int64_t c = 0; c < dim; ++c) REQUIRE(dref[2 * dim + c] == once[2 * dim + c]);
    REQUIRE(dref[0] == 2 * once[0]);
    expect_close(f.read(dtab), dref, 2e-6, "embedding dtable");

    // rmsnorm (with accumulate_dx)
    Vec x = random_vec(rows * dim, 3), w = random_vec(dim, 4), dy = random_vec(rows * dim, 5);
    auto xv = f.tensor(x, dt, {rows, dim}), wv = f.tensor(w, dt, {dim});
    auto y = f.zeros(dt, {rows, dim}), rstd = f.zeros(DType::kF32, {rows});
    f.ops->rmsnorm_forward(*f.ctx, xv, wv, 1e-5, y, rstd);
    Vec yref(rows * dim), rref(rows);
    nn::cpu::rmsnorm_forward<double>(x.data(), w.data(), rows, dim, 1e-5, yref.data(), rref.data());
    expect_close(f.read(y), yref, tol, "rmsnorm y");
    expect_close(f.read(rstd), rref, 1e-5, "rmsnorm rstd");
    Vec dx0 = random_vec(rows * dim, 6);
    auto dx = f.tensor(dx0, dt, {rows, dim});
    auto dw = f.zeros(DType::kF32, {dim});
    f.ops->rmsnorm_backward(*f.ctx, f.tensor(dy, dt, {rows, dim}), xv, wv, rstd, dx, true, dw);
    Vec dxref(rows * dim), dwref(dim, 0.0);
    nn::cpu::rmsnorm_backward<double>(dy.data(), x.data(), w.data(), rref.data(), rows, dim,
                                      dxref.data(), dwref.data());
    for (size_t i = 0; i < dxref.size(); ++i) dxref[i] += dx0[i];
    expect_close(f.read(dx), dxref, tol, "rmsnorm dx (accumulated)");
    expect_close(f.read(dw), dwref, tol, "rmsnorm dw");

    // rope (default and llama3 frequencies) forward and backward match the reference.
    const int64_t heads = 2, hd = 8;
    std::vector<int32_t> pos = {0, 1, 2, 3, 40, 5000};
    for (const Rope& rope : {Rope{}, Rope{RopeType::kLlama3, 10000.0, 8.0, 1.0, 4.0, 64.0}}) {
      Vec r = random_vec(rows * heads * hd, 7);
      auto rv = f.tensor(r, dt, {rows, heads, hd});
      f.ops->rope_forward(*f.ctx, rv, f.ints(pos), rope);
      Vec rref2 = r;
      nn::cpu::rope_forward<double>(rref2.data(), pos.data(), rows, heads, hd, rope);
      expect_close(f.read(rv), rref2, tol, "rope");
      f.ops->rope_backward(*f.ctx, rv, f.ints(pos), rope);
      nn::cpu::rope_backward<double>(rref2.data(), pos.data(), rows, heads, hd, rope);
      expect_close(f.read(rv), rref2, tol, "rope backward");
    }

    // swiglu and add
    Vec g = random_vec(rows * dim, 8, 3.0), u = random_vec(rows * dim, 9);
    auto gv = f.tensor(g, dt, {rows, dim}), uv = f.tensor(u, dt, {rows, dim});
    auto act = f.zeros(dt, {rows, dim});
    f.ops->swiglu_forward(*f.ctx, gv, uv, act);
    Vec aref(rows * dim);
    nn::cpu::swiglu_forward<double>(g.data(), u.data(), rows * dim, aref.data());
    expect_close(f.read(act), aref, tol, "swiglu");
    auto dg = f.zeros(dt, {rows, dim}), du = f.zeros(dt, {rows, dim});
    f.ops->swiglu_backward(*f.ctx, f.tensor(dy, dt, {rows, dim}), gv, uv, dg, du);
    Vec dgref(rows * dim), duref(rows * dim);
    nn::cpu::swiglu_backward<double>(dy.data(), g.data(), u.data(), rows * dim, dgref.data(),
                                     duref.data());
    expect_close(f.read(dg), dgref, tol, "swiglu dgate");
    expect_close(f.read(du), duref, tol, "swiglu dup");
    f.ops->add(*f.ctx, gv, uv, gv);  // out aliases a
    Vec sum(rows * dim);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = g[i] + u[i];
    expect_close(f.read(gv), sum, tol, "add (aliased)");

    // cast to every dtype and back
    for (DType to : kDtypes) {
      auto c = f.zeros(to, {rows, dim});
      f.ops->cast(*f.ctx, uv, c);
      expect_close(f.read(c), u, std::max(tol, tol_of(to)), "cast");
    }
  }
}

TEST_CASE("cpu ops: linear with bias, strides, accumulation, a scale and mixed weight dtype",
          "[ops][cpu]") {
  for (DType act : kDtypes) {
    for (DType wdt : kDtypes) {
      INFO("activations " << dtype_name(act) << ", weight " << dtype_name(wdt));
      Fixture f;
      const double tol = std::max(tol_of(act), tol_of(wdt));
      // x is columns [2, 2 + in) of a [rows, 13] matrix, y columns [1, 1 + out)
      // of a [rows, 90] one: out > the widening block (64 rows) so blocks are exercised.
      const int64_t rows = 5, in = 9, out = 70, ldx = 13, ldy = 90;
      Vec xw = random_vec(rows * ldx, 10), w = random_vec(out * in, 11), b = random_vec(out, 12),
          y0 = random_vec(rows * ldy, 13), dy = random_vec(rows * ldy, 14),
          dx0 = random_vec(rows * ldx, 15);
      auto xv = f.tensor(xw, act, {rows, ldx});
      auto wv = f.tensor(w, wdt, {out, in});
      auto bv = f.tensor(b, wdt, {out});
      auto yv = f.tensor(y0, act, {rows, ldy});
      const MatView x = MatView::of(xv).columns(2, 2 + in), y = MatView::of(yv).columns(1, 1 + out);
      // A scale as a LoRA adapter's alpha / r: the product's, not the bias's.
      const float scale = 2.5f;
      f.ops->linear_forward(*f.ctx, x, wv, bv, y, /*accumulate=*/true, scale);
      Vec yref = y0;
      nn::cpu::linear_forward<double>(xw.data() + 2, ldx, w.data(), b.data(), rows, in, out,
                                      yref.data() + 1, ldy, true, scale);
      expect_close(f.read(yv), yref, tol, "linear y (+=, strided, untouched columns kept)");

      auto dyv = f.tensor(dy, act, {rows, ldy});
      auto dxv = f.tensor(dx0, act, {rows, ldx});
      auto dw = f.zeros(DType::kF32, {out, in}), db = f.zeros(DType::kF32, {out});
      f.ops->linear_backward(*f.ctx, MatView::of(dyv).columns(1, 1 + out), x, wv,
                             MatView::of(dxv).columns(2, 2 + in), /*accumulate_dx=*/false, dw, db,
                             scale);
      Vec dxref = dx0, dwref(out * in, 0.0), dbref(out, 0.0);
      nn::cpu::linear_backward<double>(dy.data() + 1, ldy, xw.data() + 2, ldx, w.data(), rows, in,
                                       out, dxref.data() + 2, ldx, false, dwref.data(),
                                       dbref.data(), double{scale});
      expect_close(f.read(dxv), dxref, tol, "linear dx (overwritten block only)");
      expect_close(f.read(dw), dwref, tol, "linear dw");
      expect_close(f.read(db), dbref, tol, "linear dbias");
    }
  }
}

namespace {

// Document ranges for `batch` rows of `seq` (kernels/attention_mask.h), held in the vectors.
AttentionMask packed_mask(int64_t batch, int64_t seq, int64_t window, std::vector<int32_t>& start,
                          std::vector<int32_t>& end) {
  constexpr int32_t kLengths[] = {1, 7, 30, 2, 66, 5};
  start.resize(static_cast<size_t>(batch * seq));
  end.resize(start.size());
  for (int64_t b = 0; b < batch; ++b) {
    int32_t at = 0;
    for (size_t d = static_cast<size_t>(b); at < seq; ++d) {
      const int32_t stop = std::min<int32_t>(static_cast<int32_t>(seq), at + kLengths[d % std::size(kLengths)]);
      for (int32_t i = at; i < stop; ++i) {
        start[static_cast<size_t>(b * seq + i)] = at;
        end[static_cast<size_t>(b * seq + i)] = stop;
      }
      at = stop;
    }
  }
  AttentionMask mask{window};
  mask.segment_start = start.data();
  mask.segment_end = end.data();
  mask.seq = seq;
  return mask;
}

}  // namespace

TEST_CASE("cpu ops: dropout keeps the seeded mask, scales by 1/(1-p), accumulates, and is its own backward",
          "[ops][cpu]") {
  for (DType dt : kDtypes) {
    INFO(dtype_name(dt));
    Fixture f;
    // x is columns [1, 1 + cols) of a [rows, cols + 3] matrix: the mask follows the logical index.
    const int64_t rows = 64, cols = 100, ld = cols + 3;
    const float p = 0.3f;
    const uint64_t seed = 0x1234;
    Vec xw = random_vec(rows * ld, 21), acc0 = random_vec(rows * cols, 22);
    auto xv = f.tensor(xw, dt, {rows, ld});
    auto out = f.zeros(dt, {rows, cols});
    auto acc = f.tensor(acc0, dt, {rows, cols});
    const MatView x = MatView::of(xv).columns(1, 1 + cols);
    f.ops->dropout(*f.ctx, x, MatView::of(out), p, seed, false);
    f.ops->dropout(*f.ctx, x, MatView::of(acc), p, seed, true);
    const Vec got = f.read(out), got_acc = f.read(acc);
    Vec want(rows * cols), want_acc(rows * cols);
    int64_t kept = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const auto i = static_cast<size_t>(r * cols + c);
        const bool keep = dropout_keep(seed, i, p);
        kept += keep;
        want[i] = keep ? xw[r * ld + 1 + c] / (1.0 - p) : 0.0;
        want_acc[i] = acc0[i] + want[i];
      }
    }
    expect_close(got, want, tol_of(dt), "dropout");
    expect_close(got_acc, want_acc, tol_of(dt), "dropout, accumulated");
    // The kept fraction is 1 - p to within 5 standard deviations (6400 draws).
    const double n = rows * cols, sd = std::sqrt(n * p * (1 - p));
    CHECK(std::abs(static_cast<double>(kept) - n * (1 - p)) < 5 * sd);
    // Another seed, another mask.
    auto other = f.zeros(dt, {rows, cols});
    f.ops->dropout(*f.ctx, x, MatView::of(other), p, seed + 1, false);
    CHECK(f.read(other) != got);
  }
  Fixture f;
  Vec v = random_vec(8, 1);
  auto t = f.tensor(v, DType::kF32, {2, 4});
  REQUIRE_THROWS_WITH(f.ops->dropout(*f.ctx, MatView::of(t), MatView::of(t), 1.0f, 1, false),
                      Catch::Contains("dropout: p 1 is not in [0, 1)"));
  REQUIRE_THROWS_WITH(f.ops->dropout(*f.ctx, MatView::of(t), MatView::of(t), 0.5f, 1, true),
                      Catch::Contains("accumulating into x itself"));
}

TEST_CASE("cpu ops: GQA causal attention, with and without a sliding window, packed documents or not, matches "
          "the reference",
          "[ops][cpu]") {
  for (DType dt : kDtypes) {
    // Windows: none, only itself, shorter than a query block (64), spanning blocks.
    for (auto [batch, seq, heads, kv, hd, window] :
         {std::tuple{2, 13, 4, 2, 8, 0}, {1, 1, 2, 1, 4, 0}, {1, 70, 4, 1, 16, 0}, {2, 33, 2, 2, 8, 0},
          {2, 13, 4, 2, 8, 1}, {2, 13, 4, 2, 8, 5}, {1, 150, 4, 2, 8, 70}, {1, 70, 2, 1, 8, 64}}) {
     for (bool packed : {false, true}) {
      INFO(dtype_name(dt) << " batch " << batch << " seq " << seq << " heads " << heads << "/" << kv
                          << " head_dim " << hd << " window " << window << (packed ? " packed" : ""));
      // Packed: each row holds documents of lengths 1, 7, 30, 2, 66, ... (some
      // within a query block, some across blocks), the last cut by the row's end.
      std::vector<int32_t> seg_start, seg_end;
      const AttentionMask mask = packed ? packed_mask(batch, seq, window, seg_start, seg_end) : AttentionMask{window};
      Fixture f;
      const double tol = tol_of(dt);
      const size_t nq = static_cast<size_t>(batch * seq * heads * hd), nkv = nq / heads * kv;
      Vec q = random_vec(nq, 20), k = random_vec(nkv, 21), v = random_vec(nkv, 22),
          dout = random_vec(nq, 23);
      auto qv = f.tensor(q, dt, {batch, seq, heads, hd}), kv_ = f.tensor(k, dt, {batch, seq, kv, hd}),
           vv = f.tensor(v, dt, {batch, seq, kv, hd});
      auto ov = f.zeros(dt, {batch, seq, heads, hd}), lse = f.zeros(DType::kF32, {batch, heads, seq});
      f.ops->attention_forward(*f.ctx, qv, kv_, vv, ov, lse, mask);
      nn::cpu::AttentionShape s{batch, seq, heads, kv, hd};
      Vec oref(nq), lref(static_cast<size_t>(batch * heads * seq));
      nn::cpu::attention_forward<double>(q.data(), k.data(), v.data(), s, oref.data(), lref.data(),
                                         mask);
      expect_close(f.read(ov), oref, tol, "attention out");
      expect_close(f.read(lse), lref, 1e-4, "attention lse");
      // Backward from the op's own (rounded) output, as a model would.
      Vec o_used = f.read(ov);
      auto dq = f.zeros(dt, {batch, seq, heads, hd}), dk = f.zeros(dt, {batch, seq, kv, hd}),
           dv = f.zeros(dt, {batch, seq, kv, hd});
      f.ops->attention_backward(*f.ctx, f.tensor(dout, dt, {batch, seq, heads, hd}), qv, kv_, vv,
                                ov, lse, dq, dk, dv, mask);
      Vec dqr(nq), dkr(nkv), dvr(nkv);
      nn::cpu::attention_backward<double>(dout.data(), q.data(), k.data(), v.data(), o_used.data(),
                                          lref.data(), s, dqr.data(), dkr.data(), dvr.data(), mask);
      expect_close(f.read(dq), dqr, 2 * tol, "attention dq");
      expect_close(f.read(dk), dkr, 2 * tol, "attention dk");
      expect_close(f.read(dv), dvr, 2 * tol, "attention dv");
     }
    }
  }
}

TEST_CASE("cpu ops: attention with Gemma's score scale and soft cap, and with gpt-oss's sinks (their gradient "
          "included), matches the reference",
          "[ops][cpu][gemma][gpt_oss]") {
  // Sinks large and small against the scores: some rows mostly sink.
  std::vector<float> sinks = {2.5f, -1.0f, 0.3f, 6.0f};
  for (const bool with_sinks : {false, true}) {
   for (DType dt : kDtypes) {
    // Query blocks of 64 rows: seq 70 crosses one; window 5 leaves rows with few keys.
    for (auto [batch, seq, heads, kv, hd, window] : {std::tuple{2, 13, 4, 2, 8, 0}, {1, 70, 4, 1, 16, 5}}) {
      INFO(dtype_name(dt) << " seq " << seq << " window " << window << (with_sinks ? " sinks" : " Gemma"));
      AttentionMask mask{window};
      if (with_sinks) {
        mask.sinks = sinks.data();
      } else {
        mask.scale = 0.6f;
        mask.softcap = 1.2f;
      }
      Fixture f;
      const double tol = tol_of(dt);
      const size_t nq = static_cast<size_t>(batch * seq * heads * hd), nkv = nq / heads * kv;
      const uint32_t seed = with_sinks ? 70 : 60;
      Vec q = random_vec(nq, seed, 2.0), k = random_vec(nkv, seed + 1, 2.0), v = random_vec(nkv, seed + 2),
          dout = random_vec(nq, seed + 3);
      auto qv = f.tensor(q, dt, {batch, seq, heads, hd}), kv_ = f.tensor(k, dt, {batch, seq, kv, hd}),
           vv = f.tensor(v, dt, {batch, seq, kv, hd});
      auto ov = f.zeros(dt, {batch, seq, heads, hd}), lse = f.zeros(DType::kF32, {batch, heads, seq});
      f.ops->attention_forward(*f.ctx, qv, kv_, vv, ov, lse, mask);
      nn::cpu::AttentionShape s{batch, seq, heads, kv, hd};
      Vec oref(nq), lref(static_cast<size_t>(batch * heads * seq));
      nn::cpu::attention_forward<double>(q.data(), k.data(), v.data(), s, oref.data(), lref.data(), mask);
      expect_close(f.read(ov), oref, tol, "attention out");
      expect_close(f.read(lse), lref, 1e-4, "attention lse");
      Vec o_used = f.read(ov);
      auto dout_t = f.tensor(dout, dt, {batch, seq, heads, hd});
      auto dq = f.zeros(dt, {batch, seq, heads, hd}), dk = f.zeros(dt, {batch, seq, kv, hd}),
           dv = f.zeros(dt, {batch, seq, kv, hd});
      f.ops->attention_backward(*f.ctx, dout_t, qv, kv_, vv, ov, lse, dq, dk, dv, mask);
      Vec dqr(nq), dkr(nkv), dvr(nkv);
      nn::cpu::attention_backward<double>(dout.data(), q.data(), k.data(), v.data(), o_used.data(), lref.data(), s,
                                          dqr.data(), dkr.data(), dvr.data(), mask);
      expect_close(f.read(dq), dqr, 2 * tol, "attention dq");
      expect_close(f.read(dk), dkr, 2 * tol, "attention dk");
      expect_close(f.read(dv), dvr, 2 * tol, "attention dv");
      if (!with_sinks) continue;
      // The sinks' gradient adds into what is there.
      Vec ds0 = {0.5, 0.0, -0.25, 1.0};
      auto ds = f.tensor(ds0, DType::kF32, {heads});
      f.ops->attention_sinks_backward(*f.ctx, dout_t, ov, lse, mask, ds);
      Vec dsr = ds0;
      nn::cpu::attention_sinks_backward<double>(dout.data(), o_used.data(), lref.data(), s, sinks.data(), dsr.data());
      expect_close(f.read(ds), dsr, 2 * tol, "attention dsinks");
    }
   }
  }
}

TEST_CASE("cpu ops: attention sinks are refused with a key block of its own and without sinks", "[ops][cpu][gpt_oss]") {
  Fixture f;
  const int64_t b = 1, s = 4, h = 2, d = 4;
  std::vector<float> sinks = {0.0f, 1.0f};
  AttentionMask mask;
  mask.sinks = sinks.data();
  mask.q_offset = 4;
  auto q = f.zeros(DType::kF32, {b, s, h, d}), k = f.zeros(DType::kF32, {b, s, h, d}),
       v = f.zeros(DType::kF32, {b, s, h, d}), o = f.zeros(DType::kF32, {b, s, h, d}),
       lse = f.zeros(DType::kF32, {b, h, s}), ds = f.zeros(DType::kF32, {h});
  REQUIRE_THROWS_WITH(f.ops->attention_forward(*f.ctx, q, k, v, o, lse, mask),
                      Catch::Contains("attention sinks with a key block of its own"));
  REQUIRE_THROWS_WITH(f.ops->attention_sinks_backward(*f.ctx, o, o, lse, AttentionMask{}, ds),
                      Catch::Contains("the mask has no sinks"));
  mask.q_offset = 0;
  REQUIRE_THROWS_WITH(f.ops->attention_sinks_backward(*f.ctx, o, o, lse, mask, f.zeros(DType::kF32, {h + 1})),
                      Catch::Contains("dsinks"));
}

TEST_CASE("cpu ops: gpt-oss's clamped SwiGLU by its definition, the clamps' gradients included", "[ops][cpu][gpt_oss]") {
  const GluClamp clamp{1.702f, 7.0f};
  for (DType dt : kDtypes) {
    INFO(dtype_name(dt));
    Fixture f;
    const double tol = tol_of(dt);
    // Values on both sides of both clamps (|x| up to 10 against the limit 7).
    const int64_t n = 64;
    Vec g = random_vec(n, 80, 10.0), u = random_vec(n, 81, 10.0), dy = random_vec(n, 82);
    auto gv = f.tensor(g, dt, {n}), uv = f.tensor(u, dt, {n}), out = f.zeros(dt, {n});
    f.ops->swiglu_forward(*f.ctx, gv, uv, out, GluActivation::kClampedSwiglu, clamp);
    auto dg = f.zeros(dt, {n}), du = f.zeros(dt, {n});
    f.ops->swiglu_backward(*f.ctx, f.tensor(dy, dt, {n}), gv, uv, dg, du, GluActivation::kClampedSwiglu, clamp);
    Vec want(n), dgw(n), duw(n);
    int clamped_gate = 0, clamped_up = 0;
    for (int64_t i = 0; i < n; ++i) {
      strata::test::clamped_swiglu_reference(g[i], u[i], dy[i], 1.702, 7.0, &want[i], &dgw[i], &duw[i]);
      clamped_gate += g[i] > 7.0;
      clamped_up += std::abs(u[i]) > 7.0;
    }
    REQUIRE(clamped_gate > 0);
    REQUIRE(clamped_up > 0);
    expect_close(f.read(out), want, tol, "clamped swiglu");
    expect_close(f.read(dg), dgw, tol, "clamped swiglu dgate");
    expect_close(f.read(du), duw, tol, "clamped swiglu dup");
  }
  Fixture f;
  auto t = f.zeros(DType::kF32, {4});
  REQUIRE_THROWS_WITH(f.ops->swiglu_forward(*f.ctx, t, t, t, GluActivation::kClampedSwiglu, GluClamp{1.702f, 0.0f}),
                      Catch::Contains("positive finite limit"));
}

TEST_CASE("cpu ops: fused cross-entropy gives the loss, dh and dw of the reference",
          "[ops][cpu]") {
  for (DType dt : kDtypes) {
    for (int64_t chunk : {1, 4, 64}) {
      INFO(dtype_name(dt) << " chunk " << chunk);
      Fixture f;
      const double tol = tol_of(dt);
      const int64_t rows = 9, dim = 6, vocab = 37;
      Vec h = random_vec(rows * dim, 30, 2.0), w = random_vec(vocab * dim, 31);
      std::vector<int32_t> targets = {3, kIgnoreIndex, 0, 36, 5, 5, kIgnoreIndex, 1, 20};
      auto hv = f.tensor(h, dt, {rows, dim}), wv = f.tensor(w, dt, {vocab, dim});
      auto tv = f.ints(targets);
      auto lse = f.zeros(DType::kF32, {rows}), stats = f.zeros(DType::kF64, {2});
      auto count = f.zeros(DType::kF64, {1});
      auto dh = f.zeros(dt, {rows, dim}), dw = f.zeros(DType::kF32, {vocab, dim});
      f.ops->count_targets(*f.ctx, tv, count);
      Ops::CrossEntropyGrad grad{count, 2.0, dh, dw};
      f.ops->cross_entropy(*f.ctx, hv, wv, tv, chunk, lse, stats, &grad);
      f.ops->cross_entropy(*f.ctx, hv, wv, tv, chunk, lse, stats, nullptr);  // stats accumulate
      nn::cpu::CrossEntropyShape s{rows, dim, vocab, chunk};
      Vec lref(rows), dhref(rows * dim), dwref(vocab * dim, 0.0);
      const double total = nn::cpu::cross_entropy_forward<double>(h.data(), w.data(),
                                                                  targets.data(), s, lref.data());
      nn::cpu::cross_entropy_backward<double>(h.data(), w.data(), targets.data(), lref.data(), s,
                                              2.0 / 7.0, dhref.data(), dwref.data());
      const Vec st = f.read(stats);
      CHECK(f.read(count)[0] == 7.0);
      CHECK(st[1] == 14.0);
      CHECK(st[0] == Approx(2 * total).epsilon(std::max(tol, 1e-5)));
      expect_close(f.read(lse), lref, 1e-4, "cross-entropy lse");
      expect_close(f.read(dh), dhref, tol, "cross-entropy dh");
      expect_close(f.read(dw), dwref, tol, "cross-entropy dw");
    }
  }
}

TEST_CASE("cpu ops: the vocabulary-parallel loss and embedding over 1, 2, 4 and 8 shards give the whole "
          "vocabulary's loss, dh, dw and lookups",
          "[ops][cpu][tp]") {
  Fixture f;
  strata::test::vocab::check_vocab_parallel_ops(f, DType::kF32, 2e-5);
  strata::test::vocab::check_vocab_parallel_ops(f, DType::kBF16, 2e-2);
  strata::test::vocab::check_vocab_parallel_refusals(f);
}

TEST_CASE("cpu ops: vocab_parallel_loss refuses a target outside the whole vocabulary, not just the shard, "
          "and a zero normalizer",
          "[ops][cpu][tp]") {
  // Shard [10, 20) of a vocabulary of 20: target 25 is no rank's, -1 is not
  // kIgnoreIndex. A stream's error is final: a fresh fixture for each.
  for (int32_t bad : {25, 20, -1}) {
    INFO("target " << bad);
    Fixture f;
    const TensorView logits = f.zeros(DType::kF32, {3, 10}), gathered = f.zeros(DType::kF32, {2, 2, 3});
    const TensorView lse = f.zeros(DType::kF32, {3}), stats = f.zeros(DType::kF64, {2});
    f.ops->vocab_parallel_loss(*f.ctx, logits, gathered, f.ints({1, kIgnoreIndex, bad}), 10, 20, lse, stats, nullptr);
    REQUIRE_THROWS_WITH(f.stream->synchronize(),
                        Catch::Contains("vocab_parallel_loss: target " + std::to_string(bad) +
                                        " at row 2 is outside [0, 20)"));
  }
  Fixture f;
  const TensorView logits = f.zeros(DType::kF32, {3, 10}), gathered = f.zeros(DType::kF32, {2, 2, 3});
  const TensorView lse = f.zeros(DType::kF32, {3}), stats = f.zeros(DType::kF64, {2});
  // The same targets are accepted (the evaluation), then the gradient's normalizer 0 is refused.
  const TensorView targets = f.ints({1, kIgnoreIndex, 19});
  f.ops->vocab_parallel_loss(*f.ctx, logits, gathered, targets, 10, 20, lse, stats, nullptr);
  CHECK(f.read(stats)[1] == 2.0);
  Vec zero = {0.0};
  const Ops::VocabParallelGrad grad{f.tensor(zero, DType::kF64, {1}), 1.0};
  f.ops->vocab_parallel_loss(*f.ctx, logits, gathered, targets, 10, 20, lse, stats, &grad);
  REQUIRE_THROWS_WITH(f.stream->synchronize(), Catch::Contains("vocab_parallel_loss: the loss normalizer is 0"));
}

TEST_CASE("cpu ops refuse bad arguments before enqueueing anything", "[ops][cpu]") {
  Fixture f;
  Vec a = random_vec(12, 1), b = random_vec(8, 2);
  auto x = f.tensor(a, DType::kF32, {3, 4});
  auto w = f.tensor(b, DType::kF32, {2, 4});
  auto y_bad = f.zeros(DType::kF32, {3, 3});
  REQUIRE_THROWS_WITH(
      f.ops->linear_forward(*f.ctx, MatView::of(x), w, {}, MatView::of(y_bad), false),
      Catch::Contains("linear_forward"));
  auto y16 = f.zeros(DType::kBF16, {3, 2});
  REQUIRE_THROWS_WITH(f.ops->linear_forward(*f.ctx, MatView::of(x), w, {}, MatView::of(y16), false),
                      Catch::Contains("x is fp32 but y is bf16"));
  auto ids_f = f.zeros(DType::kF32, {3});
  REQUIRE_THROWS_WITH(f.ops->embedding_forward(*f.ctx, w, ids_f, x),
                      Catch::Contains("ids has dtype fp32; expected int32"));
  auto q = f.zeros(DType::kF32, {1, 4, 3, 2}), k = f.zeros(DType::kF32, {1, 4, 2, 2});
  auto lse = f.zeros(DType::kF32, {1, 3, 4});
  REQUIRE_THROWS_WITH(f.ops->attention_forward(*f.ctx, q, k, k, q, lse, {}),
                      Catch::Contains("multiple of kv_heads"));
  auto q2 = f.zeros(DType::kF32, {1, 4, 2, 2});
  REQUIRE_THROWS_WITH(f.ops->attention_forward(*f.ctx, q2, k, k, q2, f.zeros(DType::kF32, {1, 2, 4}),
                                               AttentionMask{-1}),
                      Catch::Contains("sliding window -1 < 0"));
  auto r = f.zeros(DType::kF32, {4, 2, 2});
  REQUIRE_THROWS_WITH(f.ops->rope_forward(*f.ctx, r, f.ints({0, 1, 2, 3}), Rope{RopeType::kDefault, -1.0}),
                      Catch::Contains("rope theta -1 must be positive"));
  // A context belongs to the Ops object that made it (the front end checks, so
  // a backend can rely on its own context type).
  std::unique_ptr<Ops> other = make_cpu_ops(*f.acc);
  std::unique_ptr<ComputeContext> other_ctx = other->make_context(*f.stream);
  REQUIRE_THROWS_WITH(f.ops->add(*other_ctx, x, x, x),
                      Catch::Contains("add: the context was made by another Ops object"));
  // Out-of-range token ids are refused by the cpu kernel: a stream error.
  auto table = f.zeros(DType::kF32, {2, 4});
  f.ops->embedding_forward(*f.ctx, table, f.ints({0, 5, 1}), x);
  REQUIRE_THROWS_WITH(f.stream->synchronize(), Catch::Contains("outside the vocabulary"));
}

TEST_CASE("cpu ops enqueue on the stream and return without waiting", "[ops][cpu]") {
  Fixture f;
  std::atomic<bool> release{false}, ran{false};
  // Hold the stream's thread until the op has been enqueued.
  f.stream->launch_host_func([&] {
    while (!release.load()) std::this_thread::yield();
  });
  Vec a = random_vec(64 * 64, 1);
  auto x = f.tensor(a, DType::kF32, {64, 64});
  auto y = f.zeros(DType::kF32, {64, 64});
  f.ops->linear_forward(*f.ctx, MatView::of(x), x, {}, MatView::of(y), false);
  Vec h = random_vec(4 * 64, 2);
  auto stats = f.zeros(DType::kF64, {2}), lse = f.zeros(DType::kF32, {4});
  f.ops->cross_entropy(*f.ctx, f.tensor(h, DType::kF32, {4, 64}), x, f.ints({1, 2, 3, 4}), 2, lse,
                       stats, nullptr);
  f.stream->launch_host_func([&] { ran = true; });
  CHECK_FALSE(ran.load());  // the calls returned while the stream was held
  CHECK(static_cast<const double*>(stats.data)[1] == 0.0);
  release = true;
  f.stream->synchronize();
  CHECK(ran.load());
  CHECK(static_cast<const double*>(stats.data)[1] == 4.0);
}

namespace {

// An fp32 tensor holding exactly v's bits.
TensorView floats(Fixture& f, const std::vector<float>& v) {
  Tensor t = f.acc->allocate_tensor(DType::kF32, {static_cast<int64_t>(v.size())});
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * sizeof(float));
  f.keep.push_back(std::move(t));
  return f.keep.back().view();
}

bool same_bits(const void* a, const void* b, size_t nbytes) {
  return nbytes == 0 || std::memcmp(a, b, nbytes) == 0;
}

// The bits the optimizer ops promise are the AVX2 kernel's (AVX-512 gives the
// same); a CPU without AVX2, or STRATA_ISA=scalar, runs scalar in the op too.
std::optional<kernels::CpuIsa> reference_isa() {
  if (kernels::default_isa() == kernels::CpuIsa::kScalar) return std::nullopt;
  return kernels::CpuIsa::kAvx2;
}

}  // namespace

TEST_CASE("cpu ops: adam_step is kernels::adam_step bit for bit, with no, fp32 and 16-bit copies",
          "[ops][cpu][adam]") {
  // 70001 is split over OpenMP threads, 1 and 7 are all tail.
  for (const size_t n : {size_t{1}, size_t{7}, size_t{1000}, size_t{70001}}) {
    for (const bool adamw : {true, false}) {
      for (const std::optional<DType> copy :
           {std::optional<DType>{}, std::optional{DType::kF32}, std::optional{DType::kBF16},
            std::optional{DType::kF16}}) {
        INFO("n " << n << (adamw ? " adamw" : " adam (L2)") << " copy "
                  << (copy ? dtype_name(*copy) : "none"));
        Fixture f;
        kernels::AdamConfig config;
        config.lr = 1e-2f;
        config.weight_decay = 0.05f;
        config.adamw = adamw;
        // State as after some training: moments not zero, so every term counts.
        std::vector<float> p = normal_floats(n, 1, 1.0f), m = normal_floats(n, 2, 0.1f),
                           v = normal_floats(n, 3, 0.01f);
        for (float& x : v) x *= x;
        const std::vector<float> p0 = p;
        auto param = floats(f, p), exp_avg = floats(f, m), exp_avg_sq = floats(f, v);
        TensorView copy_view;
        if (copy) copy_view = f.zeros(*copy, {static_cast<int64_t>(n)});
        std::vector<uint16_t> ref16(n, 0);
        for (int step = 1; step <= 3; ++step) {
          INFO("step " << step);
          const std::vector<float> g =
              normal_floats(n, 10u + static_cast<uint32_t>(step), 2.0f, true);
          // grad_scale not a power of two, so the scaling FMA rounds.
          const auto coeffs = kernels::adam_coefficients(config, step, 0.37f);
          f.ops->adam_step(*f.ctx, coeffs, param, exp_avg, exp_avg_sq, floats(f, g), copy_view);
          kernels::AdamBuffers b;
          b.param = p.data();
          b.exp_avg = m.data();
          b.exp_avg_sq = v.data();
          b.grad = g.data();
          b.numel = n;
          if (copy && *copy != DType::kF32) {
            b.param16 = ref16.data();
            b.param16_dtype = *copy;
          }
          kernels::adam_step(coeffs, b, reference_isa());
          f.stream->synchronize();
          CHECK(same_bits(param.data, p.data(), n * 4));
          CHECK(same_bits(exp_avg.data, m.data(), n * 4));
          CHECK(same_bits(exp_avg_sq.data, v.data(), n * 4));
          if (copy == DType::kF32) CHECK(same_bits(copy_view.data, p.data(), n * 4));
          if (copy && *copy != DType::kF32) CHECK(same_bits(copy_view.data, ref16.data(), n * 2));
        }
        CHECK(p != p0);  // the update moved the parameter: the comparison is not of no-ops
      }
    }
  }
}

TEST_CASE("cpu ops: grad_sum_sq is grad_stats' sum bit for bit and overwrites out",
          "[ops][cpu][grad]") {
  // Equal thread counts on the stream's thread and here, so the partial sums
  // split alike (grad_stats' bits depend on the thread count).
  constexpr int kThreads = 3;
  set_cpu_threads(kThreads);
  struct Reset {
    ~Reset() { set_cpu_threads(0); }
  } reset;
  Fixture f;
  const float scale = 0.37f;
  // 0: nothing to add; 70001: split over the threads (more than 2^16 elements).
  for (const size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{70001}}) {
    INFO("n " << n);
    const std::vector<float> g = normal_floats(n, 20, 3.0f, true);
    auto grad = floats(f, g);
    auto out = f.zeros(DType::kF64, {1});
    static_cast<double*>(out.data)[0] = 12345.0;  // stale: must be overwritten, not added to
    f.ops->grad_sum_sq(*f.ctx, grad, scale, out);
    const double want =
        kernels::grad_stats(g.data(), DType::kF32, n, scale, std::nullopt, kThreads).sum_sq;
    const double got = f.read(out)[0];
    CHECK(std::memcmp(&got, &want, sizeof(double)) == 0);
    // And it is the sum the contract names: (fp32 product)^2 in double.
    long double exact = 0;
    for (float x : g) {
      const double xs = static_cast<double>(x * scale);
      exact += static_cast<long double>(xs * xs);
    }
    CHECK(std::abs(got - static_cast<double>(exact)) <= 1e-12 * static_cast<double>(exact));
    if (n == 0) CHECK(got == 0.0);
  }

  // Not finite when an element is not: Inf, NaN, and an fp32 product that
  // overflows (finite in double, so the product must be taken in fp32).
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const auto& [what, bad, s] :
       {std::tuple{"inf", inf, 1.0f}, {"nan", nan, 1.0f}, {"fp32 overflow", 1e30f, 1e10f}}) {
    INFO(what);
    std::vector<float> g = normal_floats(1000, 21, 1.0f);
    g[617] = bad;
    auto out = f.zeros(DType::kF64, {1});
    f.ops->grad_sum_sq(*f.ctx, floats(f, g), s, out);
    const double got = f.read(out)[0];
    CHECK_FALSE(std::isfinite(got));
    if (std::isnan(bad)) CHECK(std::isnan(got));
  }
}

TEST_CASE("cpu ops: adam_step and grad_sum_sq refuse bad arguments before enqueueing",
          "[ops][cpu][adam]") {
  Fixture f;
  const std::vector<float> ones(8, 1.0f);
  auto p = floats(f, ones), m = floats(f, ones), v = floats(f, ones), g = floats(f, ones);
  auto short_m = floats(f, std::vector<float>(7, 1.0f));
  auto g16 = f.zeros(DType::kBF16, {8});
  auto ints = f.ints(std::vector<int32_t>(8, 0));
  auto copy_short = f.zeros(DType::kBF16, {7});
  const auto coeffs = kernels::adam_coefficients({}, 1);
  const auto refused = [](auto&& call, const char* message) { strata::test::expect_bad_argument(call, message); };
  refused([&] { f.ops->adam_step(*f.ctx, coeffs, p, short_m, v, g, {}); }, "exp_avg");
  refused([&] { f.ops->adam_step(*f.ctx, coeffs, p, m, v, g16, {}); }, "grad");
  refused([&] { f.ops->adam_step(*f.ctx, coeffs, p, m, v, g, ints); }, "param_copy");
  refused([&] { f.ops->adam_step(*f.ctx, coeffs, p, m, v, g, copy_short); }, "param_copy");
  auto out = f.zeros(DType::kF64, {1}), out2 = f.zeros(DType::kF64, {2});
  auto out32 = f.zeros(DType::kF32, {1});
  refused([&] { f.ops->grad_sum_sq(*f.ctx, g16, 1.0f, out); }, "grad");
  refused([&] { f.ops->grad_sum_sq(*f.ctx, g, 1.0f, out32); }, "out");
  refused([&] { f.ops->grad_sum_sq(*f.ctx, g, 1.0f, out2); }, "out");
  f.stream->synchronize();
  // Nothing ran: the state is as it was.
  CHECK(f.read(p) == Vec(8, 1.0));
  CHECK(f.read(m) == Vec(8, 1.0));
  CHECK(f.read(v) == Vec(8, 1.0));
}

TEST_CASE("cpu ops: mixture-of-experts routing, permutation, combine and their backwards match the reference",
          "[ops][cpu][moe]") {
  Fixture f;
  for (DType act : {DType::kF32, DType::kBF16}) strata::test::moe::check_moe_ops(f, act);
}

TEST_CASE("cpu ops: the sigmoid group-limited router with its correction bias and scaling is transformers' "
          "DeepseekV3TopkRouter, forward and backward",
          "[ops][cpu][moe]") {
  Fixture f;
  strata::test::moe::check_sigmoid_router(f);
}

TEST_CASE("cpu ops: the sigmoid-gated add of a shared expert and its backward match the reference",
          "[ops][cpu][moe]") {
  Fixture f;
  for (DType act : {DType::kF32, DType::kBF16}) strata::test::moe::check_sigmoid_gated_add(f, act);
  // The gate is one logit per row.
  CHECK_THROWS_WITH(f.ops->sigmoid_gated_add(*f.ctx, f.zeros(DType::kF32, {4, 3}), f.zeros(DType::kF32, {4, 3}),
                                             f.zeros(DType::kF32, {4, 3})),
                    Catch::Contains("gate has shape [4, 3]; expected [4, 1]"));
}

TEST_CASE("cpu ops: moe ops refuse bad arguments before enqueueing", "[ops][cpu][moe]") {
  Fixture f;
  Vec l(12, 0.0);
  const TensorView logits = f.tensor(l, DType::kF32, {4, 3});
  const TensorView probs = f.zeros(DType::kF32, {4, 3}), idx = f.zeros(DType::kI32, {4, 2}),
                   w = f.zeros(DType::kF32, {4, 2}), off = f.zeros(DType::kI32, {4}),
                   slots = f.zeros(DType::kI32, {4, 2}), tok = f.zeros(DType::kI32, {8});
  CHECK_THROWS_WITH(f.ops->moe_route(*f.ctx, logits, 3, true, probs, idx, w, off, slots, tok, {}),
                    Catch::Contains("top_k 3 but indices has 2 columns"));
  CHECK_THROWS_WITH(f.ops->moe_route(*f.ctx, logits, 2, true, probs, idx, w, f.zeros(DType::kI32, {3}), slots,
                                     tok, {}),
                    Catch::Contains("offsets has 3 elements"));
  CHECK_THROWS_WITH(f.ops->moe_gather(*f.ctx, logits, f.zeros(DType::kI32, {8}), f.zeros(DType::kBF16, {8, 3})),
                    Catch::Contains("activations must share one dtype"));
  CHECK_THROWS_WITH(f.ops->sigmoid_gated_add(*f.ctx, f.zeros(DType::kF32, {4, 3}), f.zeros(DType::kBF16, {4, 1}),
                                             f.zeros(DType::kF32, {4, 3})),
                    Catch::Contains("activations must share one dtype"));
}
