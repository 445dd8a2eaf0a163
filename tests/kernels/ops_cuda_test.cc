// The cuda Ops against the exact references (the double templates of
// kernels/nn_ops.h, run on the same rounded inputs) for every op, forward and
// backward, in fp32, fp16 and bf16, with the tolerances of
// tests/support/tolerances.h (section 2). Also: attention at many shapes (seq not a
// multiple of a tile, seq 1, GQA groups 1/2/3/4, head_dim 20..128, seq 4096),
// a query block against a key block at global offsets (context parallelism)
// and key blocks merged by their log-sum-exps, gpt-oss's attention sinks;
// strided, accumulating, mixed-dtype Linear; the fused cross-entropy with
// ignored targets, several chunk sizes, stats over two calls and a normalizer
// written by an earlier kernel; bitwise determinism; that no op waits for the
// stream; that scratch is returned; argument errors. (The optimizer ops:
// ops_cuda_optimizer_test.cc.) SKIPPED without a GPU.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda_peak.h"
#include "kernels/nn_ops.h"
#include "kernels/dropout_mask.h"
#include "kernels/ops.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "tests/runtime/accelerator_contract.h"
#include "tests/kernels/cuda_ops_fixture.h"
#include "tests/kernels/glu_reference.h"
#include "tests/kernels/moe_op_checks.h"
#include "tests/kernels/vocab_parallel_checks.h"
#include "tests/support/tolerances.h"

using namespace strata;
using namespace strata::ops;
using namespace strata::test;

namespace ref = strata::nn::cpu;

namespace {

const DType kDtypes[] = {DType::kF32, DType::kF16, DType::kBF16};

Vec random_vec(size_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> d(-scale, scale);
  Vec v(n);
  for (auto& x : v) x = d(gen);
  return v;
}


// |got - want| <= abs * max(max|want|, scale_floor) + rel * |want| for every
// element. scale_floor is the size of the terms where the exact result can
// cancel to zero (attention gradients at seq 1: dS = P (dP - delta) = 0).
// An infinite want (the lse -inf of a row that sees no key) must be got
// exactly, and does not count in the scale.
void expect_close(const std::string& what, const Vec& got, const Vec& want, const OpTol& tol,
                  double scale_floor = 0.0) {
  REQUIRE(got.size() == want.size());
  double scale = scale_floor;
  for (double w : want) scale = std::isfinite(w) ? std::max(scale, std::abs(w)) : scale;
  size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::abs(got[i] - want[i]);
    const double allowed = tol.abs * scale + tol.rel * std::abs(want[i]);
    const bool ok = std::isfinite(want[i]) ? diff <= allowed : got[i] == want[i];  // false for NaN
    const double ratio = ok ? (allowed > 0 ? diff / allowed : 0.0) : INFINITY;
    if (!ok) ++bad;
    if (ratio > worst_ratio || (!ok && bad == 1)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  INFO(what << ": " << bad << " of " << got.size() << " elements out of tolerance (abs " << tol.abs
            << " x max " << scale << ", rel " << tol.rel << "); worst at " << worst << ": got "
            << (got.empty() ? 0.0 : got[worst]) << " want " << (want.empty() ? 0.0 : want[worst]));
  CHECK(bad == 0);
}

// Another float dtype than dt, for mixed parameter/activation dtypes.
DType other(DType dt) {
  return dt == DType::kF32 ? DType::kBF16 : DType::kF32;
}

}  // namespace

TEST_CASE("cuda ops: a kernel's first launch returns while another stream waits on a host event",
          "[ops][cuda]") {
  // Lazy module loading (CUDA's default since 12.2) loads a kernel at its
  // first launch and can wait for the whole context; a stream parked on a host
  // event that this thread signals only after the launch would never let it
  // finish. strata loads kernels eagerly (core/cuda/cuda_accelerator.cc). This
  // is the binary's first test case (CTest runs each in a process of its own;
  // the whole binary runs them in this order), so this add is the process's
  // first kernel launch either way.
  Fixture f;
  auto parked = f.acc->create_stream();
  auto gate = f.acc->create_host_event();
  GateGuard guard(*gate, std::chrono::seconds(10));
  parked->wait(*gate);
  Vec a = {1, 2, 3, 4}, b = {10, 20, 30, 40};
  const TensorView ta = f.tensor(a, DType::kF32, {4});
  const TensorView tb = f.tensor(b, DType::kF32, {4});
  const TensorView out = f.zeros(DType::kF32, {4});
  f.ops->add(*f.ctx, ta, tb, out);
  const Vec sum = f.read(out);
  const bool returned_while_parked = !guard.fired() && !gate->query();
  REQUIRE_FALSE(guard.open());
  REQUIRE(returned_while_parked);
  parked->synchronize();
  REQUIRE(sum == Vec{11, 22, 33, 44});
}

TEST_CASE("cuda ops: embedding forward and deterministic backward", "[ops][cuda]") {
  Fixture f;
  const int64_t vocab = 50, rows = 33;
  std::vector<int32_t> ids(rows);
  for (int64_t r = 0; r < rows; ++r) ids[r] = r % 5 == 0 ? 3 : static_cast<int32_t>(r * 7 % vocab);
  for (int64_t dim : {40, 37}) {  // vectorised rows and the scalar path
    for (DType dt : kDtypes) {
      for (DType table_dt : {dt, other(dt)}) {
        INFO("dim " << dim << " out " << dtype_name(dt) << " table " << dtype_name(table_dt));
        Vec table = random_vec(vocab * dim, 1), dout = random_vec(rows * dim, 2);
        Vec dtable0 = random_vec(vocab * dim, 3);
        auto t = f.tensor(table, table_dt, {vocab, dim});
        auto d_ids = f.ints(ids);
        auto out = f.zeros(dt, {rows, dim});
        f.ops->embedding_forward(*f.ctx, t, d_ids, out);
        Vec want(rows * dim);
        ref::embedding_forward<double>(table.data(), ids.data(), rows, vocab, dim, want.data());
        expect_close("embedding out", f.read(out), want, kEmbeddingOut.of(dt));

        auto d_dout = f.tensor(dout, dt, {rows, dim});
        auto dtable = f.tensor(dtable0, DType::kF32, {vocab, dim});
        Vec again0 = dtable0;
        auto dtable_again = f.tensor(again0, DType::kF32, {vocab, dim});
        f.ops->embedding_backward(*f.ctx, d_dout, d_ids, dtable, -1);
        f.ops->embedding_backward(*f.ctx, d_dout, d_ids, dtable_again, -1);
        Vec want_dt = dtable0;
        ref::embedding_backward<double>(dout.data(), ids.data(), rows, vocab, dim, want_dt.data());
        expect_close("embedding dtable", f.read(dtable), want_dt, kEmbeddingGrad.of(dt));
        CHECK(f.bytes(dtable) == f.bytes(dtable_again));  // no atomics: bitwise repeatable
        // With id 3 (every fifth row) as the padding index, its row is left alone.
        f.ops->embedding_backward(*f.ctx, d_dout, d_ids, dtable, 3);
        ref::embedding_backward<double>(dout.data(), ids.data(), rows, vocab, dim, want_dt.data(), 3);
        expect_close("embedding dtable (padding_idx)", f.read(dtable), want_dt, kEmbeddingGrad.of(dt));
      }
    }
  }
}

TEST_CASE("cuda ops: rmsnorm forward and backward", "[ops][cuda]") {
  Fixture f;
  const double eps = 1e-5;
  // (17, 300): scalar path, one row split of the dw sums; (300, 512): 8-wide
  // loads and dw summed in several ordered partials; (96, 128) and (40, 8):
  // Qwen3's per-head q/k norms, rows x heads rows of head_dim.
  for (auto [rows, dim] : {std::pair<int64_t, int64_t>{17, 300}, {300, 512}, {96, 128}, {40, 8}}) {
    for (DType dt : kDtypes) {
      for (DType w_dt : {dt, other(dt)}) {
        INFO("rows " << rows << " dim " << dim << " dtype " << dtype_name(dt) << " w "
                     << dtype_name(w_dt));
        Vec x = random_vec(rows * dim, 4), w = random_vec(dim, 5), dy = random_vec(rows * dim, 6);
        Vec dx0 = random_vec(rows * dim, 7), dw0 = random_vec(dim, 8);
        auto d_x = f.tensor(x, dt, {rows, dim});
        auto d_w = f.tensor(w, w_dt, {dim});
        auto d_dy = f.tensor(dy, dt, {rows, dim});
        auto y = f.zeros(dt, {rows, dim});
        auto rstd = f.zeros(DType::kF32, {rows});
        f.ops->rmsnorm_forward(*f.ctx, d_x, d_w, eps, y, rstd);
        Vec want_y(rows * dim), want_rstd(rows);
        ref::rmsnorm_forward<double>(x.data(), w.data(), rows, dim, eps, want_y.data(),
                                     want_rstd.data());
        const bool per_head = dim <= 128;
        expect_close("rmsnorm y", f.read(y), want_y, (per_head ? kRmsnormPerHeadY : kRmsnormY).of(dt));
        expect_close("rmsnorm rstd", f.read(rstd), want_rstd, kRmsnormRstd.of(dt));

        // Twice: overwriting dx, then adding into dx0; dw accumulates both.
        auto dx = f.zeros(dt, {rows, dim});
        auto dx_acc = f.tensor(dx0, dt, {rows, dim});
        auto dw = f.tensor(dw0, DType::kF32, {dim});
        f.ops->rmsnorm_backward(*f.ctx, d_dy, d_x, d_w, rstd, dx, false, dw);
        f.ops->rmsnorm_backward(*f.ctx, d_dy, d_x, d_w, rstd, dx_acc, true, dw);
        Vec want_dx(rows * dim), want_dw = dw0;
        ref::rmsnorm_backward<double>(dy.data(), x.data(), w.data(), want_rstd.data(), rows, dim,
                                      want_dx.data(), want_dw.data());
        ref::rmsnorm_backward<double>(dy.data(), x.data(), w.data(), want_rstd.data(), rows, dim,
                                      want_dx.data(), want_dw.data());
        Vec want_dx_acc = dx0;
        for (size_t i = 0; i < want_dx.size(); ++i) want_dx_acc[i] += want_dx[i];
        const OpTolRow& dx_tol = per_head ? kRmsnormPerHeadDx : kRmsnormDx;
        expect_close("rmsnorm dx", f.read(dx), want_dx, dx_tol.of(dt));
        expect_close("rmsnorm dx (accumulated)", f.read(dx_acc), want_dx_acc, dx_tol.of(dt));
        expect_close("rmsnorm dw", f.read(dw), want_dw, (per_head ? kRmsnormPerHeadDw : kRmsnormDw).of(dt));
      }
    }
  }
}

TEST_CASE("cuda ops: linear on column blocks with accumulation bias and mixed weight dtype",
          "[ops][cuda]") {
  Fixture f;
  // x = columns [2, 26) of [rows, 30]; y = columns [1, 14) of [rows, 16];
  // dx = columns [3, 27) of [rows, 32]: strides and offsets that are not
  // multiples of 8 elements, so cuBLAS also runs unaligned.
  const int64_t rows = 19, in = 24, out = 13;
  const int64_t ldx = 30, ldy = 16, lddx = 32, x0 = 2, y0c = 1, dx0c = 3;
  for (DType dt : kDtypes) {
    for (DType w_dt : {dt, other(dt)}) {
      INFO("activations " << dtype_name(dt) << " weight/bias " << dtype_name(w_dt));
      Vec x = random_vec(rows * ldx, 9), w = random_vec(out * in, 10), b = random_vec(out, 11);
      Vec y0 = random_vec(rows * ldy, 12), dy = random_vec(rows * ldy, 13);
      Vec dx0 = random_vec(rows * lddx, 14), dw0 = random_vec(out * in, 15),
          db0 = random_vec(out, 16);
      auto d_x = f.tensor(x, dt, {rows, ldx});
      auto d_w = f.tensor(w, w_dt, {out, in});
      auto d_b = f.tensor(b, w_dt, {out});
      auto d_y = f.tensor(y0, dt, {rows, ldy});
      auto d_y2 = f.zeros(dt, {rows, ldy});
      auto d_dy = f.tensor(dy, dt, {rows, ldy});
      auto d_dx = f.tensor(dx0, dt, {rows, lddx});
      auto d_dw = f.tensor(dw0, DType::kF32, {out, in});
      auto d_db = f.tensor(db0, DType::kF32, {out});
      auto d_dw2 = f.zeros(DType::kF32, {out, in});
      const MatView xm = MatView::of(d_x).columns(x0, x0 + in);
      const MatView ym = MatView::of(d_y).columns(y0c, y0c + out);
      const MatView dym = MatView::of(d_dy).columns(y0c, y0c + out);
      const MatView dxm = MatView::of(d_dx).columns(dx0c, dx0c + in);

      // A scale (a LoRA adapter's alpha / r) on the first forward and backward.
      const float scale = 2.5f;
      f.ops->linear_forward(*f.ctx, xm, d_w, d_b, ym, true, scale);
      f.ops->linear_forward(*f.ctx, xm, d_w, {}, MatView::of(d_y2).columns(y0c, y0c + out), false);
      f.ops->linear_backward(*f.ctx, dym, xm, d_w, dxm, true, d_dw, d_db, scale);
      // dx and dbias not wanted: only dw.
      f.ops->linear_backward(*f.ctx, dym, xm, d_w, MatView{}, false, d_dw2, {});

      Vec want_y = y0, want_y2(rows * ldy, 0.0), want_dx = dx0, want_dw = dw0, want_db = db0;
      Vec want_dw2(out * in, 0.0);
      ref::linear_forward<double>(x.data() + x0, ldx, w.data(), b.data(), rows, in, out,
                                  want_y.data() + y0c, ldy, true, scale);
      ref::linear_forward<double>(x.data() + x0, ldx, w.data(), nullptr, rows, in, out,
                                  want_y2.data() + y0c, ldy, false);
      ref::linear_backward<double>(dy.data() + y0c, ldy, x.data() + x0, ldx, w.data(), rows, in,
                                   out, want_dx.data() + dx0c, lddx, true, want_dw.data(),
                                   want_db.data(), double{scale});
      ref::linear_backward<double>(dy.data() + y0c, ldy, x.data() + x0, ldx, w.data(), rows, in,
                                   out, nullptr, 0, false, want_dw2.data(), nullptr);
      // Whole matrices: the columns outside the blocks must be untouched.
      expect_close("linear y (accumulate, bias)", f.read(d_y), want_y, kLinearOut.of(dt));
      expect_close("linear y", f.read(d_y2), want_y2, kLinearOut.of(dt));
      expect_close("linear dx (accumulate)", f.read(d_dx), want_dx, kLinearOut.of(dt));
      expect_close("linear dw", f.read(d_dw), want_dw, kLinearParamGrad.of(dt));
      expect_close("linear dbias", f.read(d_db), want_db, kLinearParamGrad.of(dt));
      expect_close("linear dw (alone)", f.read(d_dw2), want_dw2, kLinearParamGrad.of(dt));
    }
  }
}

TEST_CASE("cuda ops: dropout draws the cpu's seeded mask, scales, accumulates", "[ops][cuda]") {
  Fixture f;
  const int64_t rows = 70, cols = 130, ld = cols + 5;
  const float p = 0.25f;
  const uint64_t seed = 0xfeed;
  for (DType dt : kDtypes) {
    INFO(dtype_name(dt));
    Vec x = random_vec(rows * ld, 31), acc0 = random_vec(rows * cols, 32);
    auto d_x = f.tensor(x, dt, {rows, ld});
    auto out = f.zeros(dt, {rows, cols});
    auto acc = f.tensor(acc0, dt, {rows, cols});
    const MatView xm = MatView::of(d_x).columns(2, 2 + cols);
    f.ops->dropout(*f.ctx, xm, MatView::of(out), p, seed, false);
    f.ops->dropout(*f.ctx, xm, MatView::of(acc), p, seed, true);
    Vec want(rows * cols), want_acc(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const auto i = static_cast<size_t>(r * cols + c);
        want[i] = ops::dropout_keep(seed, i, p) ? x[r * ld + 2 + c] / (1.0 - p) : 0.0;
        want_acc[i] = acc0[i] + want[i];
      }
    }
    expect_close("dropout", f.read(out), want, kDropout.of(dt));
    expect_close("dropout accumulated", f.read(acc), want_acc, kDropout.of(dt));
  }
}

TEST_CASE("cuda ops: rotary embedding and its inverse", "[ops][cuda]") {
  Fixture f;
  const int64_t rows = 40, heads = 3;
  std::vector<int32_t> pos(rows);
  for (int64_t r = 0; r < rows; ++r) pos[r] = r == 7 ? 100000 : static_cast<int32_t>(r * 97 % 4096);
  // Llama 3.1's scaled frequencies (all three bands at head_dim 128, theta 5e5).
  const Rope llama3{RopeType::kLlama3, 500000.0, 8.0, 1.0, 4.0, 8192.0};
  for (const Rope& rope : {Rope{}, llama3}) {
    for (int64_t head_dim : {16, 128}) {
      for (DType dt : kDtypes) {
        INFO("head_dim " << head_dim << " dtype " << dtype_name(dt) << " rope type "
                         << static_cast<int>(rope.type));
        Vec x = random_vec(rows * heads * head_dim, 17);
        auto d_x = f.tensor(x, dt, {rows, heads, head_dim});
        auto d_pos = f.ints(pos);
        f.ops->rope_forward(*f.ctx, d_x, d_pos, rope);
        Vec want = x;
        ref::rope_forward<double>(want.data(), pos.data(), rows, heads, head_dim, rope);
        const bool scaled = rope.type != RopeType::kDefault;
        expect_close("rope forward", f.read(d_x), want, (scaled ? kRopeScaled : kRope).of(dt));
        f.ops->rope_backward(*f.ctx, d_x, d_pos, rope);
        expect_close("rope backward(forward(x))", f.read(d_x), x,
                     (scaled ? kRopeScaledRoundTrip : kRopeRoundTrip).of(dt));
      }
    }
  }
}

namespace {

// Forward and backward of one attention shape in one dtype against the
// reference; backward runs from the device's own out and lse (as training
// does; lse and out are checked separately), and twice, to check that it is
// bitwise repeatable. A key block of its own (s.kv_seq, mask.q_offset /
// kv_offset) is checked the same way: the cpu kernel is the contract. With
// sinks, also their gradient (attention_sinks_backward, accumulating).
// `host_mask`: the reference's mask when `mask` holds device pointers (packed
// documents, sinks).
void check_attention(Fixture& f, const AttentionShape& s, DType dt, AttentionMask mask = {},
                     const AttentionMask* host_mask = nullptr) {
  const AttentionMask& ref_mask = host_mask != nullptr ? *host_mask : mask;
  INFO("batch " << s.batch << " seq " << s.seq << " keys " << s.keys() << " heads " << s.heads << " kv_heads "
                << s.kv_heads << " head_dim " << s.head_dim << " dtype " << dtype_name(dt) << " window "
                << mask.window << " offsets " << mask.q_offset << ", " << mask.kv_offset << " documents "
                << mask.has_segments() << " sinks " << (mask.sinks != nullptr));
  const int64_t nq = s.batch * s.seq * s.heads * s.head_dim;
  const int64_t nkv = s.batch * s.keys() * s.kv_heads * s.head_dim;
  const int64_t nl = s.batch * s.heads * s.seq;
  const Shape q_shape{s.batch, s.seq, s.heads, s.head_dim};
  const Shape kv_shape{s.batch, s.keys(), s.kv_heads, s.head_dim};
  const uint32_t seed = static_cast<uint32_t>(s.seq * 31 + s.head_dim);
  // Scores of a few units, like a trained model's: softmax rows neither flat nor one-hot.
  Vec q = random_vec(nq, seed, 1.5), k = random_vec(nkv, seed + 1, 1.5);
  Vec v = random_vec(nkv, seed + 2), dout = random_vec(nq, seed + 3);
  auto d_q = f.tensor(q, dt, q_shape);
  auto d_k = f.tensor(k, dt, kv_shape);
  auto d_v = f.tensor(v, dt, kv_shape);
  auto d_dout = f.tensor(dout, dt, q_shape);
  auto out = f.zeros(dt, q_shape);
  auto lse = f.zeros(DType::kF32, {s.batch, s.heads, s.seq});
  f.ops->attention_forward(*f.ctx, d_q, d_k, d_v, out, lse, mask);
  Vec want_out(nq), want_lse(nl);
  ref::attention_forward<double>(q.data(), k.data(), v.data(), s, want_out.data(), want_lse.data(),
                                 ref_mask);
  const Vec got_out = f.read(out), got_lse = f.read(lse);
  const bool windowed = mask.window > 0 || mask.has_segments() || s.keys() != s.seq || mask.q_offset > 0 ||
                        mask.kv_offset > 0;
  const OpTolRow& out_tol = windowed ? kAttentionWindowOut : kAttentionOut;
  const OpTolRow& lse_tol = windowed ? kAttentionWindowLse : kAttentionLse;
  const OpTolRow& grad_tol = windowed ? kAttentionWindowGrad : kAttentionGrad;
  expect_close("attention out", got_out, want_out, out_tol.of(dt));
  expect_close("attention lse", got_lse, want_lse, lse_tol.of(dt));

  auto dq = f.zeros(dt, q_shape), dk = f.zeros(dt, kv_shape), dv = f.zeros(dt, kv_shape);
  auto dq2 = f.zeros(dt, q_shape), dk2 = f.zeros(dt, kv_shape), dv2 = f.zeros(dt, kv_shape);
  f.ops->attention_backward(*f.ctx, d_dout, d_q, d_k, d_v, out, lse, dq, dk, dv, mask);
  f.ops->attention_backward(*f.ctx, d_dout, d_q, d_k, d_v, out, lse, dq2, dk2, dv2, mask);
  Vec want_dq(nq), want_dk(nkv), want_dv(nkv);
  ref::attention_backward<double>(dout.data(), q.data(), k.data(), v.data(), got_out.data(),
                                  got_lse.data(), s, want_dq.data(), want_dk.data(),
                                  want_dv.data(), ref_mask);
  // dO, V are O(1): the terms of dP and delta, the scale of dq/dk's errors.
  expect_close("attention dq", f.read(dq), want_dq, grad_tol.of(dt), 1.0);
  expect_close("attention dk", f.read(dk), want_dk, grad_tol.of(dt), 1.0);
  expect_close("attention dv", f.read(dv), want_dv, grad_tol.of(dt), 1.0);
  CHECK(f.bytes(dq) == f.bytes(dq2));
  CHECK(f.bytes(dk) == f.bytes(dk2));
  CHECK(f.bytes(dv) == f.bytes(dv2));
  if (mask.sinks == nullptr) return;
  // dsinks accumulates: it starts at 0.25 on both sides.
  Vec want_dsinks(static_cast<size_t>(s.heads), 0.25);
  auto dsinks = f.tensor(want_dsinks, DType::kF32, {s.heads});
  f.ops->attention_sinks_backward(*f.ctx, d_dout, out, lse, mask, dsinks);
  ref::attention_sinks_backward<double>(dout.data(), got_out.data(), got_lse.data(), s, ref_mask.sinks,
                                        want_dsinks.data());
  expect_close("attention dsinks", f.read(dsinks), want_dsinks, kAttentionGrad.of(dt), 1.0);
}

AttentionShape shape(int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                     int64_t head_dim) {
  return AttentionShape{batch, seq, heads, kv_heads, head_dim};
}

// A query block of `seq` tokens against a key block of `keys` tokens.
AttentionShape block(int64_t batch, int64_t seq, int64_t keys, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return AttentionShape{batch, seq, heads, kv_heads, head_dim, keys};
}

// Packed documents over `batch` rows of `tokens` positions: the first
// position of each position's document and one past its last, row-major,
// the documents' lengths cycling through kLengths (each row from its own place).
struct Documents {
  std::vector<int32_t> start, end;
};
Documents documents(int64_t batch, int64_t tokens) {
  constexpr int32_t kLengths[] = {1, 7, 30, 2, 66, 5, 130};
  Documents docs{std::vector<int32_t>(static_cast<size_t>(batch * tokens)),
                 std::vector<int32_t>(static_cast<size_t>(batch * tokens))};
  for (int64_t b = 0; b < batch; ++b) {
    int32_t at = 0;
    for (size_t d = static_cast<size_t>(b); at < tokens; ++d) {
      const int32_t stop = std::min<int32_t>(static_cast<int32_t>(tokens), at + kLengths[d % std::size(kLengths)]);
      for (int32_t i = at; i < stop; ++i) {
        docs.start[static_cast<size_t>(b * tokens + i)] = at;
        docs.end[static_cast<size_t>(b * tokens + i)] = stop;
      }
      at = stop;
    }
  }
  return docs;
}

// `mask` (host and device forms) with the documents `docs` of rows of `tokens` positions.
void add_documents(Fixture& f, const Documents& docs, int64_t tokens, AttentionMask& host, AttentionMask& device) {
  host.segment_start = docs.start.data();
  host.segment_end = docs.end.data();
  host.seq = device.seq = tokens;
  const TensorView d_start = f.ints(docs.start), d_end = f.ints(docs.end);
  device.segment_start = d_start.as<int32_t>();
  device.segment_end = d_end.as<int32_t>();
}

}  // namespace

TEST_CASE("cuda ops: causal GQA attention at many shapes", "[ops][cuda]") {
  Fixture f;
  // seq not a multiple of the 64/128 (16-bit) or 32 (fp32) tiles; seq 1;
  // GQA groups 1, 2, 3, 4; head_dim 20 (scalar loads, padded to 64), 32, 64,
  // 96 and 128; few kv heads and a small batch (dK/dV split over query heads
  // with ordered partial sums) and a large batch (no split, group 2).
  const AttentionShape shapes[] = {
      shape(2, 70, 6, 2, 32),  shape(1, 1, 4, 4, 64),    shape(1, 333, 4, 1, 128),
      shape(2, 200, 8, 4, 64), shape(1, 130, 2, 1, 20),  shape(1, 129, 4, 2, 96),
      shape(1, 256, 8, 2, 64), shape(70, 256, 2, 1, 16), shape(3, 64, 2, 2, 128),
  };
  for (const AttentionShape& s : shapes) {
    for (DType dt : kDtypes) check_attention(f, s, dt);
  }
}

TEST_CASE("cuda ops: sliding-window attention (Mistral, Qwen2 sliding layers)", "[ops][cuda]") {
  Fixture f;
  // Windows of 1 (itself), inside one tile, across tiles (not a multiple of
  // the 32/64 tiles), a multiple of 64, and one longer than seq (no effect).
  const std::pair<AttentionShape, int64_t> cases[] = {
      {shape(2, 70, 6, 2, 32), 1},   {shape(1, 200, 4, 2, 64), 13},  {shape(1, 333, 4, 1, 128), 100},
      {shape(2, 256, 8, 2, 64), 64}, {shape(1, 130, 2, 1, 20), 500},
  };
  for (const auto& [s, window] : cases) {
    for (DType dt : kDtypes) check_attention(f, s, dt, AttentionMask{window});
  }
}

TEST_CASE("cuda ops: packed documents (a block-diagonal causal mask), with and without a window", "[ops][cuda]") {
  Fixture f;
  const std::pair<AttentionShape, int64_t> cases[] = {
      {shape(2, 70, 6, 2, 32), 0}, {shape(1, 333, 4, 1, 128), 0}, {shape(2, 200, 4, 2, 64), 13}};
  for (const auto& [s, window] : cases) {
    const Documents docs = documents(s.batch, s.seq);
    AttentionMask host{window}, device{window};
    add_documents(f, docs, s.seq, host, device);
    for (DType dt : kDtypes) check_attention(f, s, dt, device, &host);
  }
}

TEST_CASE("cuda ops: a query block against a key block at global offsets (ring attention's blocks)",
          "[ops][cuda][cp]") {
  Fixture f;
  struct Case {
    AttentionShape s;
    int64_t q_offset, kv_offset, window;
  };
  // Keys wholly before the queries (no mask at all); straddling the diagonal
  // with keys != seq and a GQA group of 4 at head_dim 128; keys wholly after
  // the queries (every row sees nothing: out 0, lse -inf, no gradient);
  // windows smaller than a block, so that some rows see a part of the block
  // and later rows none of it; a window that reaches past the block's start.
  const Case cases[] = {
      {block(2, 70, 100, 6, 2, 64), 130, 0, 0},  {block(1, 96, 80, 4, 1, 128), 64, 40, 0},
      {block(2, 64, 64, 4, 2, 64), 0, 64, 0},    {block(1, 100, 130, 4, 2, 64), 200, 60, 50},
      {block(1, 33, 47, 2, 2, 128), 47, 0, 20},  {block(2, 40, 90, 4, 2, 64), 100, 30, 300},
  };
  for (const Case& c : cases) {
    AttentionMask mask{c.window};
    mask.q_offset = c.q_offset;
    mask.kv_offset = c.kv_offset;
    for (DType dt : kDtypes) check_attention(f, c.s, dt, mask);
  }
  // Packed documents over the whole sequence (arrays of 230 entries a row),
  // with and without a window.
  for (int64_t window : {0, 13}) {
    const AttentionShape s = block(2, 70, 90, 6, 2, 64);
    const Documents docs = documents(s.batch, 230);
    AttentionMask host{window}, device{window};
    add_documents(f, docs, 230, host, device);
    host.q_offset = device.q_offset = 128;
    host.kv_offset = device.kv_offset = 30;
    for (DType dt : kDtypes) check_attention(f, s, dt, device, &host);
  }
}

namespace {

// Tokens [t0, t1) of x [batch, tokens, width].
Vec token_rows(const Vec& x, int64_t batch, int64_t tokens, int64_t width, int64_t t0, int64_t t1) {
  Vec out;
  for (int64_t b = 0; b < batch; ++b) {
    const auto from = x.begin() + (b * tokens + t0) * width;
    out.insert(out.end(), from, from + (t1 - t0) * width);
  }
  return out;
}

// One query block of the whole sequence against the key blocks that split
// it, as ring attention runs them: each block's forward merged into an fp32
// accumulator by attention_merge gives the attention over all the keys (the
// reference with one key block of every token); each block's backward from
// the merged out and lse gives its share: the dq shares sum to the whole dq,
// and each block's dk, dv are the whole dk, dv's rows of that block.
void check_merged_blocks(Fixture& f, DType dt, int64_t window) {
  const int64_t batch = 2, tokens = 160, heads = 4, kv_heads = 2, d = 64;
  const int64_t q0 = 96, seq = tokens - q0;  // the query block: the last 64 tokens
  const int64_t cuts[] = {0, 70, tokens};     // key blocks [0, 70), [70, 160)
  INFO("dtype " << dtype_name(dt) << " window " << window);
  const int64_t q_row = heads * d, kv_row = kv_heads * d;
  Vec q = rounded(random_vec(static_cast<size_t>(batch * seq * q_row), 71, 1.5), dt);
  Vec k = rounded(random_vec(static_cast<size_t>(batch * tokens * kv_row), 72, 1.5), dt);
  Vec v = rounded(random_vec(static_cast<size_t>(batch * tokens * kv_row), 73), dt);
  Vec dout = rounded(random_vec(static_cast<size_t>(batch * seq * q_row), 74), dt);
  const Shape q_shape{batch, seq, heads, d}, lse_shape{batch, heads, seq};
  auto d_q = f.tensor(q, dt, q_shape), d_dout = f.tensor(dout, dt, q_shape);
  auto acc = f.zeros(DType::kF32, q_shape);
  Vec none(static_cast<size_t>(batch * heads * seq), -INFINITY);
  auto acc_lse = f.tensor(none, DType::kF32, lse_shape);
  struct Block {
    TensorView k, v;
    AttentionMask mask;
  };
  std::vector<Block> blocks;
  for (size_t i = 0; i + 1 < std::size(cuts); ++i) {
    const int64_t n = cuts[i + 1] - cuts[i];
    Vec kb = token_rows(k, batch, tokens, kv_row, cuts[i], cuts[i + 1]);
    Vec vb = token_rows(v, batch, tokens, kv_row, cuts[i], cuts[i + 1]);
    AttentionMask mask{window};
    mask.q_offset = q0;
    mask.kv_offset = cuts[i];
    blocks.push_back({f.tensor(kb, dt, {batch, n, kv_heads, d}), f.tensor(vb, dt, {batch, n, kv_heads, d}), mask});
    auto part = f.zeros(dt, q_shape), part_lse = f.zeros(DType::kF32, lse_shape);
    f.ops->attention_forward(*f.ctx, d_q, blocks.back().k, blocks.back().v, part, part_lse, mask);
    f.ops->attention_merge(*f.ctx, acc, acc_lse, part, part_lse);
  }
  const AttentionShape whole = block(batch, seq, tokens, heads, kv_heads, d);
  AttentionMask whole_mask{window};
  whole_mask.q_offset = q0;
  const size_t nq = q.size(), nkv = k.size(), nl = none.size();
  Vec want_out(nq), want_lse(nl);
  ref::attention_forward<double>(q.data(), k.data(), v.data(), whole, want_out.data(), want_lse.data(), whole_mask);
  const Vec got_out = f.read(acc), got_lse = f.read(acc_lse);
  expect_close("merged out", got_out, want_out, kAttentionWindowOut.of(dt));
  expect_close("merged lse", got_lse, want_lse, kAttentionWindowLse.of(dt));

  // Backward from the merged out (in the activations' dtype, as the model keeps it) and lse.
  Vec out_dt = got_out;
  auto d_out = f.tensor(out_dt, dt, q_shape);
  Vec want_dq(nq), want_dk(nkv), want_dv(nkv);
  ref::attention_backward<double>(dout.data(), q.data(), k.data(), v.data(), out_dt.data(), got_lse.data(), whole,
                                  want_dq.data(), want_dk.data(), want_dv.data(), whole_mask);
  Vec dq_sum(nq, 0.0);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t n = cuts[i + 1] - cuts[i];
    auto dq = f.zeros(dt, q_shape), dk = f.zeros(dt, {batch, n, kv_heads, d}), dv = f.zeros(dt, {batch, n, kv_heads, d});
    f.ops->attention_backward(*f.ctx, d_dout, d_q, blocks[i].k, blocks[i].v, d_out, acc_lse, dq, dk, dv,
                              blocks[i].mask);
    const Vec got_dq = f.read(dq);
    for (size_t j = 0; j < nq; ++j) dq_sum[j] += got_dq[j];
    expect_close("block dk", f.read(dk), token_rows(want_dk, batch, tokens, kv_row, cuts[i], cuts[i + 1]),
                 kAttentionWindowGrad.of(dt), 1.0);
    expect_close("block dv", f.read(dv), token_rows(want_dv, batch, tokens, kv_row, cuts[i], cuts[i + 1]),
                 kAttentionWindowGrad.of(dt), 1.0);
  }
  // Two rounded shares: twice the tolerance of one.
  const OpTol one = kAttentionWindowGrad.of(dt);
  expect_close("summed dq", dq_sum, want_dq, OpTol{2 * one.abs, 2 * one.rel}, 1.0);
}

}  // namespace

TEST_CASE("cuda ops: key blocks merged by their log-sum-exps give the whole sequence's attention, forward and "
          "backward",
          "[ops][cuda][cp]") {
  Fixture f;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    check_merged_blocks(f, dt, 0);
    check_merged_blocks(f, dt, 40);  // a window shorter than either key block
  }
}

TEST_CASE("cuda ops: attention at seq 4096 (no shared-memory row limit)", "[ops][cuda]") {
  Fixture f;
  for (DType dt : kDtypes) check_attention(f, shape(1, 4096, 4, 2, 64), dt);
  check_attention(f, shape(1, 4096, 2, 1, 128), DType::kBF16);
}

TEST_CASE("cuda ops: attention refuses head_dim above 128", "[ops][cuda]") {
  Fixture f;
  auto q = f.zeros(DType::kBF16, {1, 8, 2, 256}), k = f.zeros(DType::kBF16, {1, 8, 1, 256});
  auto lse = f.zeros(DType::kF32, {1, 2, 8});
  try {
    f.ops->attention_forward(*f.ctx, q, k, k, q, lse, {});
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::kBadArgument);
    CHECK_THAT(e.message(), Catch::Contains("head_dim 256"));
  }
}

TEST_CASE("cuda ops: mixture-of-experts routing, permutation, combine and their backwards match the reference",
          "[ops][cuda][moe]") {
  Fixture f;
  for (DType act : {DType::kF32, DType::kBF16}) strata::test::moe::check_moe_ops(f, act);
}

TEST_CASE("cuda ops: the sigmoid group-limited router with its correction bias and scaling is transformers' "
          "DeepseekV3TopkRouter, forward and backward",
          "[ops][cuda][moe]") {
  Fixture f;
  strata::test::moe::check_sigmoid_router(f);
}

TEST_CASE("cuda ops: the vocabulary-parallel loss and embedding over 1, 2, 4 and 8 shards give the whole "
          "vocabulary's loss, dh, dw and lookups",
          "[ops][cuda][tp]") {
  Fixture f;
  strata::test::vocab::check_vocab_parallel_ops(f, DType::kF32, 1e-4);
  strata::test::vocab::check_vocab_parallel_ops(f, DType::kBF16, 2e-2);
  strata::test::vocab::check_vocab_parallel_refusals(f);
}

TEST_CASE("cuda ops: the sigmoid-gated add of a shared expert and its backward match the reference",
          "[ops][cuda][moe]") {
  Fixture f;
  for (DType act : {DType::kF32, DType::kBF16}) strata::test::moe::check_sigmoid_gated_add(f, act);
}

TEST_CASE("cuda ops: gpt-oss's clamped SwiGLU by its definition", "[ops][cuda][gpt_oss]") {
  Fixture f;
  const GluClamp clamp{1.702f, 7.0f};
  for (DType dt : kDtypes) {
    INFO(dtype_name(dt));
    const int64_t n = 4999;  // 8-wide accesses and a scalar tail; values on both sides of both clamps
    Vec g = random_vec(n, 90, 10.0), u = random_vec(n, 91, 10.0), d = random_vec(n, 92);
    auto d_g = f.tensor(g, dt, {n}), d_u = f.tensor(u, dt, {n}), d_d = f.tensor(d, dt, {n});
    auto o = f.zeros(dt, {n}), dg = f.zeros(dt, {n}), du = f.zeros(dt, {n});
    f.ops->swiglu_forward(*f.ctx, d_g, d_u, o, GluActivation::kClampedSwiglu, clamp);
    f.ops->swiglu_backward(*f.ctx, d_d, d_g, d_u, dg, du, GluActivation::kClampedSwiglu, clamp);
    Vec want_o(n), want_dg(n), want_du(n);
    for (int64_t i = 0; i < n; ++i) {
      strata::test::clamped_swiglu_reference(g[i], u[i], d[i], 1.702, 7.0, &want_o[i], &want_dg[i], &want_du[i]);
    }
    expect_close("clamped swiglu out", f.read(o), want_o, kSwiglu.of(dt));
    expect_close("clamped swiglu dgate", f.read(dg), want_dg, kSwiglu.of(dt));
    expect_close("clamped swiglu dup", f.read(du), want_du, kSwiglu.of(dt));
  }
}

TEST_CASE("cuda ops: gpt-oss's attention sinks join every softmax row, forward, backward and their own gradient",
          "[ops][cuda][gpt_oss]") {
  Fixture f;
  // gpt-oss alternates sliding-window layers (with sinks) and full ones;
  // packed documents too. Sinks of a few units, like the scores: some rows
  // give the sink most of their weight, others little.
  const std::pair<AttentionShape, int64_t> cases[] = {
      {shape(2, 70, 6, 2, 64), 0}, {shape(1, 130, 4, 1, 128), 32}, {shape(2, 70, 6, 2, 32), 0}};
  for (size_t i = 0; i < std::size(cases); ++i) {
    const auto& [s, window] = cases[i];
    Vec sinks = random_vec(static_cast<size_t>(s.heads), 80 + static_cast<uint32_t>(i), 3.0);
    auto d_sinks = f.tensor(sinks, DType::kF32, {s.heads});
    const std::vector<float> host_sinks(sinks.begin(), sinks.end());
    AttentionMask host{window}, device{window};
    host.sinks = host_sinks.data();
    device.sinks = d_sinks.as<const float>();
    const Documents docs = documents(s.batch, s.seq);
    if (i == 2) add_documents(f, docs, s.seq, host, device);
    for (DType dt : kDtypes) check_attention(f, s, dt, device, &host);
  }
}

TEST_CASE("cuda ops: swiglu add and cast", "[ops][cuda]") {
  Fixture f;
  // 5000: 8-wide accesses; 4999: a scalar tail; offset views: unaligned, all scalar.
  for (int64_t n : {5000, 4999}) {
    for (bool unaligned : {false, true}) {
      for (DType dt : kDtypes) {
        INFO("n " << n << " unaligned " << unaligned << " dtype " << dtype_name(dt));
        const int64_t pad = unaligned ? 1 : 0;
        Vec g = random_vec(n + pad, 18, 4.0), u = random_vec(n + pad, 19),
            d = random_vec(n + pad, 20);
        auto view = [&](Vec& v) {
          TensorView t = f.tensor(v, dt, {n + pad});
          t.data = static_cast<char*>(t.data) + pad * static_cast<int64_t>(dtype_nbytes(dt));
          t.desc.shape = {n};
          v.erase(v.begin(), v.begin() + pad);
          return t;
        };
        auto d_g = view(g), d_u = view(u), d_d = view(d);
        auto o = f.zeros(dt, {n}), dg = f.zeros(dt, {n}), du = f.zeros(dt, {n});
        auto sum = f.zeros(dt, {n});
        f.ops->swiglu_forward(*f.ctx, d_g, d_u, o);
        f.ops->swiglu_backward(*f.ctx, d_d, d_g, d_u, dg, du);
        f.ops->add(*f.ctx, d_g, d_u, sum);
        Vec want_o(n), want_dg(n), want_du(n), want_sum(n);
        ref::swiglu_forward<double>(g.data(), u.data(), n, want_o.data());
        ref::swiglu_backward<double>(d.data(), g.data(), u.data(), n, want_dg.data(),
                                     want_du.data());
        ref::add<double>(g.data(), u.data(), n, want_sum.data());
        expect_close("swiglu out", f.read(o), want_o, kSwiglu.of(dt));
        expect_close("swiglu dgate", f.read(dg), want_dg, kSwiglu.of(dt));
        expect_close("swiglu dup", f.read(du), want_du, kSwiglu.of(dt));
        expect_close("add", f.read(sum), want_sum, kAdd.of(dt));
        f.ops->add(*f.ctx, d_d, d_u, d_d);  // out aliases a
        Vec want_alias(n);
        ref::add<double>(d.data(), u.data(), n, want_alias.data());
        expect_close("add in place", f.read(d_d), want_alias, kAdd.of(dt));
      }
    }
  }
  for (DType src : kDtypes) {
    for (DType dst : kDtypes) {
      INFO("cast " << dtype_name(src) << " -> " << dtype_name(dst));
      Vec v = random_vec(1001, 21, 100.0);
      auto s = f.tensor(v, src, {7, 143});
      auto d = f.zeros(dst, {7, 143});
      f.ops->cast(*f.ctx, s, d);
      const Vec got = f.read(d);
      expect_close("cast", got, v, kCast.of(dst));
      CHECK(got == rounded(v, dst));  // round to nearest even, as strata::convert
    }
  }
}

namespace {

struct CeCase {
  int64_t rows, dim, vocab, chunk;
  DType w_dt;  // the weight's dtype; kF64 means "the activations' dtype"
};

void check_cross_entropy(Fixture& f, const CeCase& cc, DType dt) {
  const DType w_dt = cc.w_dt == DType::kF64 ? dt : cc.w_dt;
  INFO("rows " << cc.rows << " dim " << cc.dim << " vocab " << cc.vocab << " chunk " << cc.chunk
               << " h " << dtype_name(dt) << " w " << dtype_name(w_dt));
  std::vector<int32_t> targets(cc.rows);
  for (int64_t r = 0; r < cc.rows; ++r) {
    targets[r] = r % 9 == 4 ? kIgnoreIndex : static_cast<int32_t>(r * 37 % cc.vocab);
  }
  Vec h = random_vec(cc.rows * cc.dim, 22), w = random_vec(cc.vocab * cc.dim, 23, 0.3);
  Vec dw0 = random_vec(cc.vocab * cc.dim, 24, 0.01);
  auto d_h = f.tensor(h, dt, {cc.rows, cc.dim});
  auto d_w = f.tensor(w, w_dt, {cc.vocab, cc.dim});
  // cuBLAS multiplies in one dtype, so a weight stored in another dtype is
  // used rounded to h's: that is what the exact reference must see.
  w = rounded(w, dt);
  auto d_t = f.ints(targets);
  auto lse = f.zeros(DType::kF32, {cc.rows});
  auto lse2 = f.zeros(DType::kF32, {cc.rows});
  auto stats = f.zeros(DType::kF64, {2});
  auto normalizer = f.zeros(DType::kF64, {1});
  auto dh = f.zeros(dt, {cc.rows, cc.dim});
  auto dw = f.tensor(dw0, DType::kF32, {cc.vocab, cc.dim});
  // The normalizer is produced by an earlier kernel on the same stream and
  // read by the gradient kernel when it runs (no host round trip between).
  // grad_scale plays the loss scale (it keeps fp16 gradients normal).
  const double grad_scale = 64.0;
  f.ops->count_targets(*f.ctx, d_t, normalizer);
  Ops::CrossEntropyGrad grad{normalizer, grad_scale, dh, dw};
  f.ops->cross_entropy(*f.ctx, d_h, d_w, d_t, cc.chunk, lse, stats, &grad);
  f.ops->cross_entropy(*f.ctx, d_h, d_w, d_t, cc.chunk, lse2, stats, nullptr);  // stats accumulate

  ref::CrossEntropyShape rs;
  rs.rows = cc.rows;
  rs.dim = cc.dim;
  rs.vocab = cc.vocab;
  rs.chunk_rows = cc.chunk;
  Vec want_lse(cc.rows), want_dh(cc.rows * cc.dim), want_dw = dw0;
  const double loss =
      ref::cross_entropy_forward<double>(h.data(), w.data(), targets.data(), rs, want_lse.data());
  const auto count = static_cast<double>(ref::count_targets(targets.data(), cc.rows));
  ref::cross_entropy_backward<double>(h.data(), w.data(), targets.data(), want_lse.data(), rs,
                                      grad_scale / count, want_dh.data(), want_dw.data());
  const Vec got_stats = f.read(stats);
  CHECK(f.read(normalizer)[0] == count);
  CHECK(got_stats[1] == 2 * count);
  expect_close("ce loss sum (two calls)", {got_stats[0]}, {2 * loss}, kCrossEntropyLoss.of(dt));
  expect_close("ce lse", f.read(lse), want_lse, kCrossEntropyLse.of(dt));
  CHECK(f.bytes(lse) == f.bytes(lse2));
  expect_close("ce dh", f.read(dh), want_dh, kCrossEntropyDh.of(dt));
  expect_close("ce dw", f.read(dw), want_dw, kCrossEntropyDw.of(dt));
}

}  // namespace

TEST_CASE("cuda ops: fused cross-entropy loss statistics and gradients", "[ops][cuda]") {
  Fixture f;
  // 45 rows in chunks of 16 (16+16+13), 7, one chunk, and a chunk larger than
  // the rows; every 9th target ignored; a weight in another dtype.
  const CeCase cases[] = {
      {45, 32, 1000, 16, DType::kF64}, {45, 32, 1000, 7, DType::kF64},
      {45, 64, 1000, 45, DType::kF64}, {45, 32, 1000, 1000, DType::kF64},
      {45, 32, 1000, 16, DType::kF32}, {45, 32, 1000, 16, DType::kBF16},
  };
  for (const CeCase& cc : cases) {
    for (DType dt : kDtypes) check_cross_entropy(f, cc, dt);
  }
}

TEST_CASE("cuda ops: count_targets accumulates", "[ops][cuda]") {
  Fixture f;
  std::vector<int32_t> targets(3000);
  for (size_t i = 0; i < targets.size(); ++i) targets[i] = i % 7 == 0 ? kIgnoreIndex : 5;
  auto t = f.ints(targets);
  auto count = f.zeros(DType::kF64, {1});
  f.ops->count_targets(*f.ctx, t, count);
  f.ops->count_targets(*f.ctx, t, count);
  CHECK(f.read(count)[0] == 2.0 * (3000 - 429));
}

TEST_CASE("cuda ops only enqueue: they return while the stream is held", "[ops][cuda]") {
  Fixture f;
  const DType dt = DType::kBF16;
  const Shape q_shape{1, 300, 4, 64}, kv_shape{1, 300, 2, 64};
  Vec q = random_vec(300 * 4 * 64, 30), k = random_vec(300 * 2 * 64, 31),
      v = random_vec(300 * 2 * 64, 32), h = random_vec(300 * 64, 33),
      w = random_vec(500 * 64, 34, 0.3), x = random_vec(300 * 64, 35), lw = random_vec(64 * 64, 36),
      nw = random_vec(64, 37);
  std::vector<int32_t> targets(300);
  for (int i = 0; i < 300; ++i) targets[i] = i % 5 == 0 ? kIgnoreIndex : i;
  auto d_q = f.tensor(q, dt, q_shape), d_k = f.tensor(k, dt, kv_shape),
       d_v = f.tensor(v, dt, kv_shape), d_h = f.tensor(h, dt, {300, 64}),
       d_w = f.tensor(w, DType::kF32, {500, 64}), d_x = f.tensor(x, dt, {300, 64}),
       d_lw = f.tensor(lw, DType::kF32, {64, 64}), d_nw = f.tensor(nw, dt, {64}),
       d_t = f.ints(targets);

  // All the ops' outputs, twice: gated by a host event, and not.
  struct Outputs {
    TensorView out, lse, dq, dk, dv, y, dx, dlw, ce_lse, stats, norm, dh, dw, rstd, yn, dxn, dwn;
  };
  auto make = [&] {
    return Outputs{f.zeros(dt, q_shape),
                   f.zeros(DType::kF32, {1, 4, 300}),
                   f.zeros(dt, q_shape),
                   f.zeros(dt, kv_shape),
                   f.zeros(dt, kv_shape),
                   f.zeros(dt, {300, 64}),
                   f.zeros(dt, {300, 64}),
                   f.zeros(DType::kF32, {64, 64}),
                   f.zeros(DType::kF32, {300}),
                   f.zeros(DType::kF64, {2}),
                   f.zeros(DType::kF64, {1}),
                   f.zeros(dt, {300, 64}),
                   f.zeros(DType::kF32, {500, 64}),
                   f.zeros(DType::kF32, {300}),
                   f.zeros(dt, {300, 64}),
                   f.zeros(dt, {300, 64}),
                   f.zeros(DType::kF32, {64})};
  };
  auto enqueue_all = [&](const Outputs& o) {
    f.ops->attention_forward(*f.ctx, d_q, d_k, d_v, o.out, o.lse, {});
    f.ops->attention_backward(*f.ctx, d_q, d_q, d_k, d_v, o.out, o.lse, o.dq, o.dk, o.dv, {});
    f.ops->linear_forward(*f.ctx, MatView::of(d_x), d_lw, {}, MatView::of(o.y), false);
    f.ops->linear_backward(*f.ctx, MatView::of(o.y), MatView::of(d_x), d_lw, MatView::of(o.dx),
                           false, o.dlw, {});
    f.ops->count_targets(*f.ctx, d_t, o.norm);
    Ops::CrossEntropyGrad grad{o.norm, 1.0, o.dh, o.dw};
    f.ops->cross_entropy(*f.ctx, d_h, d_w, d_t, 64, o.ce_lse, o.stats, &grad);
    f.ops->rmsnorm_forward(*f.ctx, d_x, d_nw, 1e-5, o.yn, o.rstd);
    f.ops->rmsnorm_backward(*f.ctx, o.yn, d_x, d_nw, o.rstd, o.dxn, false, o.dwn);
  };
  const Outputs plain = make(), gated = make();
  enqueue_all(plain);
  f.stream->synchronize();

  auto gate = f.acc->create_host_event();
  f.stream->wait(*gate);
  auto enqueued = std::async(std::launch::async, [&] { enqueue_all(gated); });
  const bool returned = enqueued.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  const cudaError_t held = cudaStreamQuery(static_cast<cudaStream_t>(f.stream->native_handle()));
  gate->signal();  // releases an op that (wrongly) waited, so the test cannot hang
  enqueued.get();
  CHECK(returned);
  CHECK(held == cudaErrorNotReady);
  f.stream->synchronize();
  // The same bits as the run that never waited (every op is deterministic).
  for (auto [a, b] : {std::pair{plain.out, gated.out},
                      {plain.lse, gated.lse},
                      {plain.dq, gated.dq},
                      {plain.dk, gated.dk},
                      {plain.dv, gated.dv},
                      {plain.y, gated.y},
                      {plain.dx, gated.dx},
                      {plain.dlw, gated.dlw},
                      {plain.ce_lse, gated.ce_lse},
                      {plain.stats, gated.stats},
                      {plain.dh, gated.dh},
                      {plain.dw, gated.dw},
                      {plain.yn, gated.yn},
                      {plain.dxn, gated.dxn},
                      {plain.dwn, gated.dwn}}) {
    CHECK(f.bytes(a) == f.bytes(b));
  }
}

TEST_CASE("cuda ops return their scratch memory to the accelerator", "[ops][cuda]") {
  Fixture f;
  Vec q = random_vec(2 * 256 * 8 * 64, 40), h = random_vec(100 * 64, 41),
      w = random_vec(3000 * 64, 42, 0.3);
  auto d_q = f.tensor(q, DType::kBF16, {2, 256, 8, 64});
  auto d_kv = f.zeros(DType::kBF16, {2, 256, 2, 64});
  auto out = f.zeros(DType::kBF16, {2, 256, 8, 64}), dq = f.zeros(DType::kBF16, {2, 256, 8, 64});
  auto dk = f.zeros(DType::kBF16, {2, 256, 2, 64}), dv = f.zeros(DType::kBF16, {2, 256, 2, 64});
  auto lse = f.zeros(DType::kF32, {2, 8, 256});
  auto d_h = f.tensor(h, DType::kBF16, {100, 64});
  auto d_w = f.tensor(w, DType::kF32, {3000, 64});  // cast into scratch
  std::vector<int32_t> targets(100, 7);
  auto d_t = f.ints(targets);
  auto ce_lse = f.zeros(DType::kF32, {100}), stats = f.zeros(DType::kF64, {2});
  f.stream->synchronize();
  const size_t before = f.acc->memory_stats().in_use_nbytes;
  f.ops->attention_forward(*f.ctx, d_q, d_kv, d_kv, out, lse, {});
  f.ops->attention_backward(*f.ctx, d_q, d_q, d_kv, d_kv, out, lse, dq, dk, dv, {});
  f.ops->cross_entropy(*f.ctx, d_h, d_w, d_t, 32, ce_lse, stats, nullptr);
  f.stream->synchronize();
  CHECK(f.acc->memory_stats().in_use_nbytes == before);
}

TEST_CASE("cuda ops refuse bad arguments before enqueueing anything", "[ops][cuda]") {
  Fixture f;
  auto x = f.zeros(DType::kF32, {3, 4});
  auto w = f.zeros(DType::kF32, {2, 4});
  auto y_bad = f.zeros(DType::kF32, {3, 3});
  CHECK_THROWS_WITH(f.ops->linear_forward(*f.ctx, MatView::of(x), w, {}, MatView::of(y_bad), false),
                    Catch::Contains("linear_forward"));
  auto ids_f = f.zeros(DType::kF32, {3});
  CHECK_THROWS_WITH(f.ops->embedding_forward(*f.ctx, w, ids_f, x),
                    Catch::Contains("ids has dtype fp32; expected int32"));
  // Host memory is not addressable by the kernels.
  Tensor host = Tensor::host(DType::kF32, {3, 4});
  CHECK_THROWS_WITH(f.ops->add(*f.ctx, host.view(), x, x), Catch::Contains("device tensors"));
  // A context of another backend.
  auto cpu = make_cpu_accelerator();
  auto cpu_stream = cpu->create_stream();
  auto cpu_ops = make_cpu_ops(*cpu);
  auto cpu_ctx = cpu_ops->make_context(*cpu_stream);
  CHECK_THROWS_WITH(f.ops->add(*cpu_ctx, x, x, x), Catch::Contains("add: the context was made by another Ops object"));
  f.stream->synchronize();  // nothing was enqueued that could fail
}

TEST_CASE("measure_bf16_gemm_tflops reports a tensor-core rate", "[ops][cuda]") {
  Fixture f;
  const double tflops = measure_bf16_gemm_tflops(*f.acc, 4096, 4096, 4096, 5);
  INFO("bf16 GEMM 4096^3: " << tflops << " TFLOP/s");
  CHECK(tflops > 20.0);  // any sm_80+ part; an H100 gives several hundred
}

// Timings for the performance work (not run by default: `ops_cuda_tests
// "[.bench]"`): attention at the bench model's shape, next to the GEMM peak.
TEST_CASE("bench: bf16 attention at seq 2048 with 16 heads of 128", "[.bench][cuda]") {
  Fixture f;
  const AttentionShape s{4, 2048, 16, 16, 128};
  const Shape shape4{4, 2048, 16, 128};
  auto q = f.zeros(DType::kBF16, shape4), out = f.zeros(DType::kBF16, shape4);
  auto dq = f.zeros(DType::kBF16, shape4), dk = f.zeros(DType::kBF16, shape4),
       dv = f.zeros(DType::kBF16, shape4);
  auto lse = f.zeros(DType::kF32, {4, 16, 2048});
  f.acc->memset_async(q.data, 0x3c, q.nbytes(), *f.stream);
  const double causal_flops = 4.0 * s.batch * s.heads * s.seq * s.seq * s.head_dim / 2;
  auto time = [&](auto&& fn) {
    fn();
    f.stream->synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) fn();
    f.stream->synchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10;
  };
  const double fwd = time([&] { f.ops->attention_forward(*f.ctx, q, q, q, out, lse, {}); });
  const double bwd =
      time([&] { f.ops->attention_backward(*f.ctx, q, q, q, q, out, lse, dq, dk, dv, {}); });
  const double peak = measure_bf16_gemm_tflops(*f.acc, 8192, 8192, 8192, 5);
  WARN("attention forward " << fwd * 1e3 << " ms = " << causal_flops / fwd / 1e12
                            << " TFLOP/s; backward " << bwd * 1e3 << " ms = "
                            << 2.5 * causal_flops / bwd / 1e12 << " TFLOP/s (FA2 count: 2.5x "
                            << "forward); bf16 GEMM peak " << peak << " TFLOP/s");
}
