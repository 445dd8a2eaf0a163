// Attention of query blocks against key blocks at global offsets (context
// parallelism's kernels: kernels/attention_mask.h's q_offset/kv_offset,
// Ops::attention_merge) against the whole sequence's attention: the sequence
// cut into 2·cp chunks, every chunk pair run, the partial outputs merged by
// their log-sum-exps, and the backward of every pair from the merged output
// and lse summed (dq over the key chunks, dk/dv over the query chunks). In
// double precision (the reference templates, to 1e-12) and through the cpu
// Ops in fp32 (the blocked kernels and the merge op, to fp32's tolerance),
// for GQA, sliding windows narrower and wider than a chunk, and packed documents.
// Also the ranges the cuda kernels walk (attention_block_ranges.h) against
// the cpu kernels' visible pairs.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/accelerator.h"
#include "kernels/attention_block_ranges.h"
#include "kernels/attention_merge.h"
#include "kernels/nn_ops.h"
#include "kernels/ops.h"

using namespace strata;
using namespace strata::ops;
using Vec = std::vector<double>;

namespace {

Vec random_vec(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> d(-1.0, 1.0);
  Vec v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

// Rows [first, first + n) of each of `batch` rows of `seq` tokens of `width` values.
Vec chunk_of(const Vec& x, int64_t batch, int64_t seq, int64_t width, int64_t first, int64_t n) {
  Vec out(static_cast<size_t>(batch * n * width));
  for (int64_t b = 0; b < batch; ++b) {
    std::copy_n(x.begin() + (b * seq + first) * width, n * width, out.begin() + b * n * width);
  }
  return out;
}
void add_chunk(Vec& x, const Vec& part, int64_t batch, int64_t seq, int64_t width, int64_t first, int64_t n) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < n * width; ++i) x[(b * seq + first) * width + i] += part[b * n * width + i];
  }
}
// lse [batch, heads, seq] <-> a chunk [batch, heads, n].
Vec lse_chunk(const Vec& lse, int64_t batch, int64_t heads, int64_t seq, int64_t first, int64_t n) {
  return chunk_of(lse, batch * heads, seq, 1, first, n);
}
void put_lse_chunk(Vec& lse, const Vec& part, int64_t batch, int64_t heads, int64_t seq, int64_t first, int64_t n) {
  for (int64_t r = 0; r < batch * heads; ++r) std::copy_n(part.begin() + r * n, n, lse.begin() + r * seq + first);
}

void expect_close(const Vec& got, const Vec& want, double rel, const char* what) {
  REQUIRE(got.size() == want.size());
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(what << "[" << i << "] got " << got[i] << " want " << want[i] << " (scale " << scale << ")");
    REQUIRE(std::abs(got[i] - want[i]) <= rel * std::max(scale, 1e-3));
  }
}

// Packed documents of lengths 3, 17, 40, 1, 29, ... over rows of `seq`.
void documents(int64_t batch, int64_t seq, std::vector<int32_t>& start, std::vector<int32_t>& end) {
  constexpr int32_t kLengths[] = {3, 17, 40, 1, 29, 9};
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
}

struct Case {
  int64_t cp, chunk, batch, heads, kv_heads, head_dim, window;
  bool packed;
};

struct Tensors {
  std::unique_ptr<Accelerator> acc = make_cpu_accelerator();
  std::unique_ptr<Stream> stream = acc->create_stream();
  std::unique_ptr<Ops> ops = make_cpu_ops(*acc);
  std::unique_ptr<ComputeContext> ctx = ops->make_context(*stream);
  std::vector<Tensor> keep;
  ~Tensors() { stream->synchronize(); }  // no op still reads a tensor being freed
  TensorView of(const Vec& v, Shape shape) {
    Tensor t = acc->allocate_tensor(DType::kF32, shape);
    for (size_t i = 0; i < v.size(); ++i) t.view().as<float>()[i] = static_cast<float>(v[i]);
    keep.push_back(std::move(t));
    return keep.back().view();
  }
  TensorView filled(Shape shape, float value) {
    Tensor t = acc->allocate_tensor(DType::kF32, shape);
    std::fill_n(t.view().as<float>(), t.numel(), value);
    keep.push_back(std::move(t));
    return keep.back().view();
  }
  Vec read(const TensorView& t) {
    stream->synchronize();
    return Vec(t.as<const float>(), t.as<const float>() + t.numel());
  }
};

void check_blocks(const Case& c) {
  const int64_t chunks = 2 * c.cp, seq = chunks * c.chunk, n = c.chunk;
  const int64_t qw = c.heads * c.head_dim, kw = c.kv_heads * c.head_dim;
  const Vec q = random_vec(static_cast<size_t>(c.batch * seq * qw), 1),
            k = random_vec(static_cast<size_t>(c.batch * seq * kw), 2),
            v = random_vec(static_cast<size_t>(c.batch * seq * kw), 3),
            dout = random_vec(static_cast<size_t>(c.batch * seq * qw), 4);
  std::vector<int32_t> seg_start, seg_end;
  AttentionMask mask{c.window};
  if (c.packed) {
    documents(c.batch, seq, seg_start, seg_end);
    mask.segment_start = seg_start.data();
    mask.segment_end = seg_end.data();
    mask.seq = seq;
  }
  // The whole sequence in double.
  const nn::cpu::AttentionShape whole{c.batch, seq, c.heads, c.kv_heads, c.head_dim};
  Vec out(q.size()), lse(static_cast<size_t>(c.batch * c.heads * seq));
  nn::cpu::attention_forward<double>(q.data(), k.data(), v.data(), whole, out.data(), lse.data(), mask);
  Vec dq(q.size()), dk(k.size()), dv(v.size());
  nn::cpu::attention_backward<double>(dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(), whole,
                                      dq.data(), dk.data(), dv.data(), mask);

  // Every chunk pair in double, merged by the merge formula (in double here).
  const nn::cpu::AttentionShape block{c.batch, n, c.heads, c.kv_heads, c.head_dim, n};
  Vec bout(q.size(), 0.0), blse(lse.size(), -std::numeric_limits<double>::infinity());
  int64_t skipped = 0;
  auto pair_mask = [&](int64_t qc, int64_t kc) {
    AttentionMask m = mask;
    m.q_offset = qc * n;
    m.kv_offset = kc * n;
    return m;
  };
  for (int64_t qc = 0; qc < chunks; ++qc) {
    const Vec qb = chunk_of(q, c.batch, seq, qw, qc * n, n);
    Vec acc_o = chunk_of(bout, c.batch, seq, qw, qc * n, n), acc_l = lse_chunk(blse, c.batch, c.heads, seq, qc * n, n);
    for (int64_t kc = 0; kc < chunks; ++kc) {
      const AttentionMask m = pair_mask(qc, kc);
      if (!block_has_visible(m, n, n)) {
        ++skipped;
        continue;
      }
      Vec po(qb.size()), pl(acc_l.size());
      nn::cpu::attention_forward<double>(qb.data(), chunk_of(k, c.batch, seq, kw, kc * n, n).data(),
                                         chunk_of(v, c.batch, seq, kw, kc * n, n).data(), block, po.data(),
                                         pl.data(), m);
      for (int64_t b = 0; b < c.batch; ++b) {
        for (int64_t h = 0; h < c.heads; ++h) {
          for (int64_t i = 0; i < n; ++i) {
            double& l = acc_l[(b * c.heads + h) * n + i];
            const double p = pl[(b * c.heads + h) * n + i];
            if (p == -std::numeric_limits<double>::infinity()) continue;
            const double merged = l == -std::numeric_limits<double>::infinity()
                                      ? p
                                      : std::max(l, p) + std::log1p(std::exp(std::min(l, p) - std::max(l, p)));
            const double keep = std::exp(l - merged), take = std::exp(p - merged);
            for (int64_t e = 0; e < c.head_dim; ++e) {
              const int64_t at = (b * n + i) * qw + h * c.head_dim + e;
              acc_o[at] = acc_o[at] * keep + po[at] * take;
            }
            l = merged;
          }
        }
      }
    }
    for (int64_t b = 0; b < c.batch; ++b) {
      std::copy_n(acc_o.begin() + b * n * qw, n * qw, bout.begin() + (b * seq + qc * n) * qw);
    }
    put_lse_chunk(blse, acc_l, c.batch, c.heads, seq, qc * n, n);
  }
  // Causal: the pairs whose keys all follow their queries are skipped, and
  // with a window those whose keys all precede it.
  // chunk kc is visible from chunk qc iff 0 <= qc - kc <= reach.
  const int64_t reach = c.window > 0 ? (n + c.window - 2) / n : chunks;
  int64_t want_skipped = chunks * (chunks - 1) / 2;
  for (int64_t gap = reach + 1; gap < chunks; ++gap) want_skipped += chunks - gap;
  CHECK(skipped == want_skipped);
  CHECK(skipped >= chunks * (chunks - 1) / 2);
  expect_close(bout, out, 1e-12, "merged out (double)");
  expect_close(blse, lse, 1e-12, "merged lse (double)");

  Vec bdq(dq.size(), 0.0), bdk(dk.size(), 0.0), bdv(dv.size(), 0.0);
  for (int64_t qc = 0; qc < chunks; ++qc) {
    for (int64_t kc = 0; kc < chunks; ++kc) {
      const AttentionMask m = pair_mask(qc, kc);
      if (!block_has_visible(m, n, n)) continue;
      const Vec kb = chunk_of(k, c.batch, seq, kw, kc * n, n), vb = chunk_of(v, c.batch, seq, kw, kc * n, n);
      Vec pdq(static_cast<size_t>(c.batch * n * qw)), pdk(kb.size()), pdv(vb.size());
      nn::cpu::attention_backward<double>(
          chunk_of(dout, c.batch, seq, qw, qc * n, n).data(), chunk_of(q, c.batch, seq, qw, qc * n, n).data(),
          kb.data(), vb.data(), chunk_of(out, c.batch, seq, qw, qc * n, n).data(),
          lse_chunk(lse, c.batch, c.heads, seq, qc * n, n).data(), block, pdq.data(), pdk.data(), pdv.data(), m);
      add_chunk(bdq, pdq, c.batch, seq, qw, qc * n, n);
      add_chunk(bdk, pdk, c.batch, seq, kw, kc * n, n);
      add_chunk(bdv, pdv, c.batch, seq, kw, kc * n, n);
    }
  }
  expect_close(bdq, dq, 1e-12, "summed dq (double)");
  expect_close(bdk, dk, 1e-12, "summed dk (double)");
  expect_close(bdv, dv, 1e-12, "summed dv (double)");

  // The same through the cpu Ops in fp32: the blocked kernels and attention_merge.
  Tensors t;
  const Shape qs{c.batch, n, c.heads, c.head_dim}, ks{c.batch, n, c.kv_heads, c.head_dim},
      ls{c.batch, c.heads, n};
  Vec oout(out.size()), olse(lse.size()), odq(dq.size(), 0.0), odk(dk.size(), 0.0), odv(dv.size(), 0.0);
  for (int64_t qc = 0; qc < chunks; ++qc) {
    const TensorView qb = t.of(chunk_of(q, c.batch, seq, qw, qc * n, n), qs);
    const TensorView acc_o = t.filled(qs, 0.0f), acc_l = t.filled(ls, -std::numeric_limits<float>::infinity());
    const TensorView po = t.filled(qs, 0.0f), pl = t.filled(ls, 0.0f);
    for (int64_t kc = 0; kc < chunks; ++kc) {
      const AttentionMask m = pair_mask(qc, kc);
      if (!block_has_visible(m, n, n)) continue;
      t.ops->attention_forward(*t.ctx, qb, t.of(chunk_of(k, c.batch, seq, kw, kc * n, n), ks),
                               t.of(chunk_of(v, c.batch, seq, kw, kc * n, n), ks), po, pl, m);
      t.ops->attention_merge(*t.ctx, acc_o, acc_l, po, pl);
    }
    add_chunk(oout, t.read(acc_o), c.batch, seq, qw, qc * n, n);
    put_lse_chunk(olse, t.read(acc_l), c.batch, c.heads, seq, qc * n, n);
  }
  expect_close(oout, out, 2e-5, "merged out (cpu ops, fp32)");
  expect_close(olse, lse, 2e-5, "merged lse (cpu ops, fp32)");
  for (int64_t qc = 0; qc < chunks; ++qc) {
    for (int64_t kc = 0; kc < chunks; ++kc) {
      const AttentionMask m = pair_mask(qc, kc);
      if (!block_has_visible(m, n, n)) continue;
      const TensorView pdq = t.filled(qs, 0.0f), pdk = t.filled(ks, 0.0f), pdv = t.filled(ks, 0.0f);
      t.ops->attention_backward(*t.ctx, t.of(chunk_of(dout, c.batch, seq, qw, qc * n, n), qs),
                                t.of(chunk_of(q, c.batch, seq, qw, qc * n, n), qs),
                                t.of(chunk_of(k, c.batch, seq, kw, kc * n, n), ks),
                                t.of(chunk_of(v, c.batch, seq, kw, kc * n, n), ks),
                                t.of(chunk_of(oout, c.batch, seq, qw, qc * n, n), qs),
                                t.of(lse_chunk(olse, c.batch, c.heads, seq, qc * n, n), ls), pdq, pdk, pdv, m);
      add_chunk(odq, t.read(pdq), c.batch, seq, qw, qc * n, n);
      add_chunk(odk, t.read(pdk), c.batch, seq, kw, kc * n, n);
      add_chunk(odv, t.read(pdv), c.batch, seq, kw, kc * n, n);
    }
  }
  expect_close(odq, dq, 5e-5, "summed dq (cpu ops, fp32)");
  expect_close(odk, dk, 5e-5, "summed dk (cpu ops, fp32)");
  expect_close(odv, dv, 5e-5, "summed dv (cpu ops, fp32)");
}

}  // namespace

TEST_CASE("attention blocks: 2·cp chunk pairs at global offsets, merged by their lse, give the whole sequence's "
          "attention and gradients",
          "[ops][cpu][cp]") {
  // cp, chunk, batch, heads, kv heads, head_dim, window, packed documents.
  for (const Case& c : {Case{2, 12, 2, 4, 2, 8, 0, false},   // GQA, causal
                        Case{2, 12, 1, 4, 1, 8, 5, false},   // a window narrower than a chunk
                        Case{3, 10, 1, 2, 2, 8, 14, false},  // a window wider than a chunk
                        Case{2, 20, 2, 4, 2, 8, 0, true},    // packed documents across chunks
                        Case{2, 20, 1, 4, 2, 8, 7, true},    // documents and a narrow window
                        Case{2, 70, 1, 2, 1, 16, 0, false}}) {  // chunks longer than a query tile (64)
    INFO("cp " << c.cp << " chunk " << c.chunk << " batch " << c.batch << " heads " << c.heads << "/" << c.kv_heads
               << " window " << c.window << (c.packed ? " packed" : ""));
    check_blocks(c);
  }
}

TEST_CASE("attention blocks: a query that sees none of a block's keys gets out 0 and lse -inf, and the merge keeps "
          "the other side exactly",
          "[ops][cpu][cp]") {
  Tensors t;
  // Queries at 0..3 against keys at 2..5: query 0 and 1 see none of them.
  AttentionMask m;
  m.kv_offset = 2;
  const Vec q = random_vec(4 * 2 * 4, 5), kv = random_vec(4 * 1 * 4, 6);
  const TensorView qv = t.of(q, {1, 4, 2, 4}), kvv = t.of(kv, {1, 4, 1, 4});
  const TensorView out = t.filled({1, 4, 2, 4}, 7.0f), lse = t.filled({1, 2, 4}, 7.0f);
  t.ops->attention_forward(*t.ctx, qv, kvv, kvv, out, lse, m);
  const Vec o = t.read(out), l = t.read(lse);
  for (int64_t h = 0; h < 2; ++h) {
    CHECK(l[h * 4 + 0] == -std::numeric_limits<double>::infinity());
    CHECK(l[h * 4 + 1] == -std::numeric_limits<double>::infinity());
    CHECK(std::isfinite(l[h * 4 + 2]));
    CHECK(l[h * 4 + 2] == Approx(std::log(std::exp(0.0))).margin(10));  // one key: lse = its score
  }
  for (int64_t e = 0; e < 2 * 2 * 4; ++e) CHECK(o[e] == 0.0);  // rows 0 and 1
  // Query row 2 sees key 2 (block-local 0) alone: its output is that value row.
  for (int64_t e = 0; e < 4; ++e) CHECK(o[2 * 8 + e] == Approx(kv[e]).epsilon(1e-6));
  // Merging a side of -inf changes nothing; merging into -inf takes the part.
  CHECK(merge_weights(1.5f, -INFINITY).keep == 1.0f);
  CHECK(merge_weights(1.5f, -INFINITY).take == 0.0f);
  CHECK(merge_weights(-INFINITY, 0.25f).lse == 0.25f);
  CHECK(merge_weights(-INFINITY, 0.25f).take == 1.0f);
  CHECK(merge_weights(0.0f, 0.0f).lse == Approx(std::log(2.0)));
  CHECK(merge_weights(0.0f, 0.0f).keep == Approx(0.5));
}

TEST_CASE("attention blocks: the ranges a tiled kernel walks hold exactly the visible pairs (a key's queries, "
          "a tile's keys and queries)",
          "[ops][cpu][cp]") {
  // The cuda kernels' loops (attention_block_ranges.h): a key's queries must
  // be exactly the queries whose visible_block_keys hold it, and a tile's
  // range must cover every key (query) its rows see, or a kernel would skip
  // a pair. Random blocks of a 300-token sequence: offsets, keys != queries,
  // windows (some wider than everything), packed documents.
  std::mt19937 gen(46);
  auto draw = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); };
  constexpr int kTokens = 300;
  std::vector<int32_t> start(kTokens), end(kTokens);
  for (int trial = 0; trial < 400; ++trial) {
    const int seq = draw(1, 90), kv = draw(1, 90);
    AttentionMask m{draw(0, 2) == 0 ? 0 : draw(1, 200)};
    m.q_offset = trial % 4 == 0 ? 0 : draw(0, kTokens - seq);
    m.kv_offset = trial % 4 == 0 ? 0 : draw(0, kTokens - kv);
    if (draw(0, 1) == 0) {
      for (int at = 0; at < kTokens;) {
        const int stop = std::min(kTokens, at + draw(1, 60));
        std::fill(start.begin() + at, start.begin() + stop, at);
        std::fill(end.begin() + at, end.begin() + stop, stop);
        at = stop;
      }
      m.segment_start = start.data();
      m.segment_end = end.data();
      m.seq = kTokens;
    }
    INFO("trial " << trial << ": " << seq << " queries at " << m.q_offset << ", " << kv << " keys at "
                  << m.kv_offset << ", window " << m.window << (m.has_segments() ? ", documents" : ""));
    // seen[i * kv + j]: query i sees key j (the cpu kernel's definition).
    std::vector<char> seen(static_cast<size_t>(seq * kv), 0);
    for (int i = 0; i < seq; ++i) {
      const BlockRange r = visible_block_keys(m, i, kv);
      for (int64_t j = r.first; j < r.last; ++j) seen[static_cast<size_t>(i * kv + j)] = 1;
    }
    int bad_keys = 0, bad_tiles = 0;
    for (int j = 0; j < kv; ++j) {
      const BlockRange r = seeing_block_queries(m, j, seq);
      for (int i = 0; i < seq; ++i) bad_keys += (i >= r.first && i < r.last) != (seen[static_cast<size_t>(i * kv + j)] != 0);
    }
    for (int tile : {16, 32, 64}) {
      for (int q0 = 0; q0 < seq; q0 += tile) {
        const BlockRange r = tile_block_keys(m, q0, std::min(q0 + tile, seq), kv);
        for (int i = q0; i < std::min(q0 + tile, seq); ++i)
          for (int j = 0; j < kv; ++j) bad_tiles += seen[static_cast<size_t>(i * kv + j)] && !(j >= r.first && j < r.last);
      }
      for (int k0 = 0; k0 < kv; k0 += tile) {
        const BlockRange r = tile_seeing_queries(m, k0, std::min(k0 + tile, kv), seq);
        for (int j = k0; j < std::min(k0 + tile, kv); ++j)
          for (int i = 0; i < seq; ++i) bad_tiles += seen[static_cast<size_t>(i * kv + j)] && !(i >= r.first && i < r.last);
      }
    }
    CHECK(bad_keys == 0);
    CHECK(bad_tiles == 0);
  }
}

TEST_CASE("attention blocks: bad offsets, key blocks and merges are refused by name", "[ops][cpu][cp]") {
  Tensors t;
  const TensorView q = t.filled({1, 4, 2, 4}, 0.1f), k = t.filled({1, 6, 1, 4}, 0.1f);
  const TensorView out = t.filled({1, 4, 2, 4}, 0.0f), lse = t.filled({1, 2, 4}, 0.0f);
  AttentionMask m;
  m.q_offset = -1;
  REQUIRE_THROWS_WITH(t.ops->attention_forward(*t.ctx, q, k, k, out, lse, m),
                      Catch::Contains("attention_forward: block offsets must be >= 0"));
  std::vector<int32_t> start(8, 0), end(8, 8);
  AttentionMask docs;
  docs.segment_start = start.data();
  docs.segment_end = end.data();
  docs.seq = 8;
  docs.q_offset = 2;  // queries reach 6, keys 6: fits in 8; keys at 4 reach 10: does not
  t.ops->attention_forward(*t.ctx, q, k, k, out, lse, docs);
  t.stream->synchronize();  // the queued op reads start/end, which die before t
  docs.kv_offset = 4;
  REQUIRE_THROWS_WITH(t.ops->attention_forward(*t.ctx, q, k, k, out, lse, docs),
                      Catch::Contains("the document arrays have 8 entries per row, the sequence 10"));
  const TensorView v_short = t.filled({1, 5, 1, 4}, 0.1f);
  REQUIRE_THROWS_WITH(t.ops->attention_forward(*t.ctx, q, k, v_short, out, lse, {}),
                      Catch::Contains("attention_forward: v has shape [1, 5, 1, 4]; expected [1, 6, 1, 4]"));
  const TensorView half = t.filled({1, 2, 3}, 0.0f);
  REQUIRE_THROWS_WITH(t.ops->attention_merge(*t.ctx, out, lse, out, half),
                      Catch::Contains("attention_merge: part_lse has shape"));
  Tensor bf = t.acc->allocate_tensor(DType::kBF16, {1, 4, 2, 4});
  REQUIRE_THROWS_WITH(t.ops->attention_merge(*t.ctx, bf.view(), lse, out, lse),
                      Catch::Contains("attention_merge: out has dtype bf16; expected fp32"));
}
