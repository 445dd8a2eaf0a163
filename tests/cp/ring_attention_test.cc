// Ring attention (runtime/nn/ring_attention.h) over cp ranks as threads with
// real Gloo communicators over loopback: each rank holds chunks r and
// 2cp−1−r of q, k, v; its out, lse and dq, dk, dv chunks must equal one
// rank's attention over the whole sequence (Ops::attention_forward/backward
// in fp32 on the cpu), for GQA, a sliding window narrower than a chunk and
// packed documents; the bytes sent are the formula's, the causal pairs skipped.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <random>
#include <vector>

#include "kernels/ops.h"
#include "runtime/nn/ring_attention.h"
#include "runtime/nn/ulysses_attention.h"
#include "partition/process_groups.h"
#include "tests/support/rank_threads.h"

using namespace strata;
using Vec = std::vector<float>;

namespace {

Vec random_vec(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  Vec v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

struct Case {
  int cp;
  int64_t chunk, batch, heads, kv_heads, head_dim, window;
  bool packed;
  int dp = 1;  // the cp groups of a dp x cp layout, each its own ring
  bool ulysses = false;  // the all-to-all method instead of the ring
};

// The whole sequence's tensors, [batch, seq, width] (lse [batch, heads, seq]).
struct Whole {
  Vec q, k, v, dout, out, lse, dq, dk, dv;
  std::vector<int32_t> seg_start, seg_end;
};

TensorView view_of(Vec& v, Shape shape) { return TensorView{TensorDesc{DType::kF32, std::move(shape)}, v.data()}; }

// Rows [first, first + n) of each batch row, as a [batch, n, width] vector; and back.
Vec rows_of(const Vec& x, int64_t batch, int64_t seq, int64_t width, int64_t first, int64_t n) {
  Vec out(static_cast<size_t>(batch * n * width));
  for (int64_t b = 0; b < batch; ++b)
    std::copy_n(x.begin() + (b * seq + first) * width, n * width, out.begin() + b * n * width);
  return out;
}

void expect_close(const Vec& got, const Vec& want, double rel, const char* what, int rank, int chunk) {
  REQUIRE(got.size() == want.size());
  double scale = 1e-3;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::abs(w)));
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(what << " of rank " << rank << " chunk " << chunk << " [" << i << "] got " << got[i] << " want " << want[i]);
    REQUIRE(std::abs(got[i] - want[i]) <= rel * scale);
  }
}

void check_ring(const Case& c) {
  const int64_t chunks = 2 * c.cp, seq = chunks * c.chunk, n = c.chunk;
  const int64_t qw = c.heads * c.head_dim, kw = c.kv_heads * c.head_dim;
  Whole w;
  w.q = random_vec(static_cast<size_t>(c.batch * seq * qw), 11);
  w.k = random_vec(static_cast<size_t>(c.batch * seq * kw), 12);
  w.v = random_vec(static_cast<size_t>(c.batch * seq * kw), 13);
  w.dout = random_vec(w.q.size(), 14);
  ops::AttentionMask mask{c.window};
  if (c.packed) {  // documents of 5, 23, 2, 40, 9, ... tokens, crossing chunks
    constexpr int32_t kLengths[] = {5, 23, 2, 40, 9};
    w.seg_start.resize(static_cast<size_t>(c.batch * seq));
    w.seg_end.resize(w.seg_start.size());
    for (int64_t b = 0; b < c.batch; ++b) {
      int32_t at = 0;
      for (size_t d = static_cast<size_t>(b); at < seq; ++d) {
        const int32_t stop = std::min<int32_t>(static_cast<int32_t>(seq), at + kLengths[d % 5]);
        for (int32_t i = at; i < stop; ++i) {
          w.seg_start[static_cast<size_t>(b * seq + i)] = at;
          w.seg_end[static_cast<size_t>(b * seq + i)] = stop;
        }
        at = stop;
      }
    }
    mask.segment_start = w.seg_start.data();
    mask.segment_end = w.seg_end.data();
    mask.seq = seq;
  }
  // One rank's attention over the whole sequence.
  {
    auto acc = make_cpu_accelerator();
    auto stream = acc->create_stream();
    auto ops = ops::make_cpu_ops(*acc);
    auto ctx = ops->make_context(*stream);
    w.out.resize(w.q.size());
    w.lse.resize(static_cast<size_t>(c.batch * c.heads * seq));
    w.dq.resize(w.q.size());
    w.dk.resize(w.k.size());
    w.dv.resize(w.v.size());
    const Shape qs{c.batch, seq, c.heads, c.head_dim}, ks{c.batch, seq, c.kv_heads, c.head_dim};
    ops->attention_forward(*ctx, view_of(w.q, qs), view_of(w.k, ks), view_of(w.v, ks), view_of(w.out, qs),
                           view_of(w.lse, {c.batch, c.heads, seq}), mask);
    ops->attention_backward(*ctx, view_of(w.dout, qs), view_of(w.q, qs), view_of(w.k, ks), view_of(w.v, ks),
                            view_of(w.out, qs), view_of(w.lse, {c.batch, c.heads, seq}), view_of(w.dq, qs),
                            view_of(w.dk, ks), view_of(w.dv, ks), mask);
    stream->synchronize();
  }

  std::mutex mu;
  const int world = c.dp * c.cp;
  const partition::ParallelLayout layout(world, 1, 1, 1, c.cp);
  std::vector<uint64_t> bytes_forward(static_cast<size_t>(world)), bytes_total(static_cast<size_t>(world));
  std::vector<int64_t> skipped(static_cast<size_t>(world));
  // Per job rank and local chunk: out, lse, dq, dk, dv.
  std::vector<std::array<std::array<Vec, 5>, 2>> got(static_cast<size_t>(world));
  test::run_rank_threads(world, std::chrono::milliseconds(10000), [&](int job_rank, partition::StoreClient& store,
                                                                      Accelerator& acc) {
    partition::CommunicatorOptions options;
    options.rank = job_rank;
    options.world_size = world;
    options.timeout = std::chrono::milliseconds(10000);
    partition::ProcessGroups groups = partition::make_process_groups(acc, store, options, layout);
    partition::Communicator& comm = *groups.cp;
    const int rank = layout.cp_rank(job_rank);
    auto stream_owned = acc.create_stream();
    Stream& stream = *stream_owned;
    auto ops = ops::make_cpu_ops(acc);
    auto ctx = ops->make_context(stream);
    auto comm_stream = acc.create_stream();
    nn::RingAttention ring(*ops, *ctx, comm, *comm_stream);
    nn::UlyssesAttention ulysses(*ops, *ctx, comm);
    std::array<std::array<Vec, 11>, 2> mine;  // q k v out lse dout dq dk dv
    nn::RingChunks t;
    std::array<TensorView, 2> dout, dq, dk, dv;
    const Shape qs{c.batch, n, c.heads, c.head_dim}, ks{c.batch, n, c.kv_heads, c.head_dim},
        ls{c.batch, c.heads, n};
    for (int l = 0; l < 2; ++l) {
      const int64_t first = nn::cp_chunk(c.cp, rank, l) * n;
      auto& m = mine[static_cast<size_t>(l)];
      m[0] = rows_of(w.q, c.batch, seq, qw, first, n);
      m[1] = rows_of(w.k, c.batch, seq, kw, first, n);
      m[2] = rows_of(w.v, c.batch, seq, kw, first, n);
      m[3].assign(m[0].size(), 0.0f);
      m[4].assign(static_cast<size_t>(c.batch * c.heads * n), 0.0f);
      m[5] = rows_of(w.dout, c.batch, seq, qw, first, n);
      m[6].assign(m[0].size(), 0.0f);
      m[7].assign(m[1].size(), 0.0f);
      m[8].assign(m[1].size(), 0.0f);
      t.q[l] = view_of(m[0], qs);
      t.k[l] = view_of(m[1], ks);
      t.v[l] = view_of(m[2], ks);
      t.out[l] = view_of(m[3], qs);
      t.lse[l] = view_of(m[4], ls);
      dout[l] = view_of(m[5], qs);
      dq[l] = view_of(m[6], qs);
      dk[l] = view_of(m[7], ks);
      dv[l] = view_of(m[8], ks);
    }
    if (c.ulysses) {
      ulysses.forward(t, mask);
    } else {
      ring.forward(t, mask);
    }
    stream.synchronize();
    const uint64_t after_forward = c.ulysses ? ulysses.bytes_sent() : ring.bytes_sent();
    if (c.ulysses) {
      ulysses.backward(t, dout, dq, dk, dv, mask);
    } else {
      ring.backward(t, dout, dq, dk, dv, mask);
    }
    stream.synchronize();
    comm_stream->synchronize();
    std::lock_guard lock(mu);
    bytes_forward[static_cast<size_t>(job_rank)] = after_forward;
    bytes_total[static_cast<size_t>(job_rank)] = c.ulysses ? ulysses.bytes_sent() : ring.bytes_sent();
    skipped[static_cast<size_t>(job_rank)] = ring.pairs_skipped();
    for (int l = 0; l < 2; ++l) {
      auto& m = mine[static_cast<size_t>(l)];
      got[static_cast<size_t>(job_rank)][static_cast<size_t>(l)] = {m[3], m[4], m[6], m[7], m[8]};
    }
  });
  for (int jr = 0; jr < world; ++jr) {
    const int r = layout.cp_rank(jr);
    for (int l = 0; l < 2; ++l) {
      const int64_t first = nn::cp_chunk(c.cp, r, l) * n;
      const auto& g = got[static_cast<size_t>(jr)][static_cast<size_t>(l)];
      expect_close(g[0], rows_of(w.out, c.batch, seq, qw, first, n), 2e-5, "out", r, l);
      expect_close(g[1], rows_of(w.lse, c.batch * c.heads, seq, 1, first, n), 2e-5, "lse", r, l);
      expect_close(g[2], rows_of(w.dq, c.batch, seq, qw, first, n), 5e-5, "dq", r, l);
      expect_close(g[3], rows_of(w.dk, c.batch, seq, kw, first, n), 5e-5, "dk", r, l);
      expect_close(g[4], rows_of(w.dv, c.batch, seq, kw, first, n), 5e-5, "dv", r, l);
    }
    // Forward: cp - 1 hops of this rank's share of keys and values (kv heads only):
    // (cp - 1)/cp · 2·s·b·h_kv·d elements; backward the same plus cp hops of
    // their gradients (one behind the keys, the last one home; none at cp 1).
    const uint64_t kv_bytes = static_cast<uint64_t>(2 * 2 * c.batch * n * kw) * 4;
    const uint64_t dkv_hops = c.cp > 1 ? static_cast<uint64_t>(c.cp) : 0;
    if (c.ulysses) {
      // Ulysses: every all-to-all sends (cp - 1)/cp of a rank's share: forward q, k, v
      // to heads and out, lse back; backward q, k, v, out, dout, lse to heads and dq, dk, dv back.
      const auto share = [&](int64_t width) { return static_cast<uint64_t>(2 * c.batch * n * width) * 4; };
      const uint64_t part = static_cast<uint64_t>(c.cp - 1), whole = static_cast<uint64_t>(c.cp);
      const uint64_t fwd = share(qw) + 2 * share(kw) + share(qw) + share(c.heads);
      const uint64_t bwd = 3 * share(qw) + 2 * share(kw) + share(c.heads) + share(qw) + 2 * share(kw);
      CHECK(bytes_forward[static_cast<size_t>(jr)] * whole == fwd * part);
      CHECK(bytes_total[static_cast<size_t>(jr)] * whole == (fwd + bwd) * part);
      continue;
    }
    CHECK(bytes_forward[static_cast<size_t>(jr)] == static_cast<uint64_t>(c.cp - 1) * kv_bytes);
    CHECK(bytes_total[static_cast<size_t>(jr)] == static_cast<uint64_t>(2 * (c.cp - 1)) * kv_bytes + dkv_hops * kv_bytes);
  }
  // Causal: of the 2cp x 2cp chunk pairs, those whose keys follow the queries are never computed.
  int64_t total_skipped = 0;
  for (int64_t s : skipped) total_skipped += s;
  if (!c.ulysses) CHECK(total_skipped >= c.dp * chunks * (chunks - 1) / 2);
}

}  // namespace

TEST_CASE("ring attention over cp Gloo ranks gives one rank's attention, lse and gradients", "[cp]") {
  for (const Case& c : {Case{2, 16, 2, 4, 2, 8, 0, false},   // GQA, causal
                        Case{3, 12, 1, 4, 1, 8, 0, false},   // three ranks
                        Case{2, 16, 1, 4, 2, 8, 6, false},   // a window narrower than a chunk
                        Case{4, 10, 1, 2, 1, 8, 0, true},    // packed documents across chunks and ranks
                        Case{1, 16, 1, 2, 2, 8, 0, false},   // cp 1: one rank, no hops
                        Case{2, 8, 1, 2, 1, 8, 0, false, 2}}) {  // the cp groups of dp 2 x cp 2
    INFO("dp " << c.dp << " cp " << c.cp << " chunk " << c.chunk << " heads " << c.heads << "/" << c.kv_heads << " window " << c.window
               << (c.packed ? " packed" : ""));
    check_ring(c);
  }
}

TEST_CASE("ulysses attention over cp Gloo ranks gives one rank's attention, lse and gradients, and heads that do not "
          "divide by cp are refused by name",
          "[cp]") {
  for (Case c : {Case{2, 16, 2, 4, 2, 8, 0, false},  // GQA, causal
                 Case{2, 16, 1, 4, 2, 8, 6, false},  // a window narrower than a chunk
                 Case{4, 10, 1, 4, 4, 8, 0, true},   // packed documents, a head per rank
                 Case{2, 8, 1, 2, 2, 8, 0, false, 2}}) {  // the cp groups of dp 2 x cp 2
    c.ulysses = true;
    INFO("dp " << c.dp << " cp " << c.cp << " chunk " << c.chunk << " heads " << c.heads << "/" << c.kv_heads
               << " window " << c.window << (c.packed ? " packed" : ""));
    check_ring(c);
  }
  Case kv{2, 8, 1, 4, 1, 8, 0, false};
  kv.ulysses = true;
  REQUIRE_THROWS_WITH(check_ring(kv), Catch::Contains("ulysses attention: the 1 key/value heads do not divide by the "
                                                      "context-parallel size 2"));
  Case heads{3, 8, 1, 4, 1, 8, 0, false};
  heads.ulysses = true;
  REQUIRE_THROWS_WITH(check_ring(heads), Catch::Contains("ulysses attention: the 4 attention heads do not divide by "
                                                         "the context-parallel size 3"));
}
