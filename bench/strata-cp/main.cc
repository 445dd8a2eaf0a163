// strata-cp: how much of ring attention's key/value exchange is hidden behind
// the block compute (nn::RingAttention, context parallelism). cp ranks are
// threads of this process with real Gloo communicators over loopback, each
// holding chunks c and 2cp-1-c of random q, k, v (fp32, causal). Per round,
// separated by barriers, every rank times:
//   ring      RingAttention::forward (hops on a stream of their own, each
//             overlapped with the blocks in hand),
//   compute   the same chunk pairs and merges, in the ring's order, on the
//             keys and values it receives (every rank's are seeded, so each
//             holds them all), no hop (the anchor: what the ring costs
//             without communication; the ring's out and lse must equal its
//             bit for bit, the correctness column),
//   exchange  the same cp-1 hops of the same bytes, no compute.
// hidden = (compute + exchange - ring) / exchange, the share of the
// exchange's time the ring did not add (1: all of it overlapped; 0: none),
// and ring / compute, the ring's cost over its compute alone: per round, then
// the median over --rounds of rank 0's (each rank computes the same amount:
// Megatron's causal load balance).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/common/json_output.h"
#include "bench/common/stats.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "partition/process_groups.h"
#include "partition/store.h"
#include "runtime/nn/ring_attention.h"

namespace {
using namespace strata;
using Clock = std::chrono::steady_clock;

struct Flags {
  int cp = 2;
  int64_t seq = 4096, batch = 1, heads = 8, kv_heads = 2, head_dim = 64;
  int rounds = 7;
  std::string json;  // --json: the results as JSON ("-": stdout)
};

struct Times {
  std::vector<double> ring, compute, exchange;
  int64_t mismatches = 0;  // rounds x chunks whose ring out or lse differs from the anchor's
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void run_rank(const Flags& f, int rank, partition::StoreClient& store, Accelerator& acc, Times& times) {
  partition::CommunicatorOptions options;
  options.rank = rank;
  options.world_size = f.cp;
  options.timeout = std::chrono::milliseconds(120000);
  partition::Communicator* comm = nullptr;
  const partition::ParallelLayout layout(f.cp, 1, 1, 1, f.cp);
  partition::ProcessGroups groups = partition::make_process_groups(acc, store, options, layout);
  comm = groups.cp.get();
  auto stream = acc.create_stream();
  auto comm_stream = acc.create_stream();
  auto ops = ops::make_cpu_ops(acc);
  auto ctx = ops->make_context(*stream);
  nn::RingAttention ring(*ops, *ctx, *comm, *comm_stream);
  const int64_t chunk = f.seq / (2 * f.cp);
  const Shape qs{f.batch, chunk, f.heads, f.head_dim}, ks{f.batch, chunk, f.kv_heads, f.head_dim},
      ls{f.batch, f.heads, chunk};
  std::vector<Tensor> held;
  const auto tensor = [&](const Shape& shape, uint32_t seed) {
    Tensor t = acc.allocate_tensor(DType::kF32, shape);
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    float* p = static_cast<float*>(t.data());
    for (int64_t i = 0; i < shape_numel(shape); ++i) p[i] = d(gen);
    held.push_back(std::move(t));
    return held.back().view();
  };
  // Every rank's keys and values (seeded by rank and chunk): this rank's are
  // the ring's, the others' let the anchor compute what the ring receives.
  std::vector<std::array<TensorView, 2>> k_of(static_cast<size_t>(f.cp)), v_of(static_cast<size_t>(f.cp));
  for (int r = 0; r < f.cp; ++r) {
    for (int l = 0; l < 2; ++l) {
      const auto seed = static_cast<uint32_t>(r * 16 + l * 4);
      k_of[static_cast<size_t>(r)][static_cast<size_t>(l)] = tensor(ks, seed + 1);
      v_of[static_cast<size_t>(r)][static_cast<size_t>(l)] = tensor(ks, seed + 2);
    }
  }
  nn::RingChunks t;
  std::array<TensorView, 2> anchor_out, anchor_lse;
  for (int l = 0; l < 2; ++l) {
    const auto seed = static_cast<uint32_t>(rank * 16 + l * 4);
    t.q[l] = tensor(qs, seed);
    t.k[l] = k_of[static_cast<size_t>(rank)][static_cast<size_t>(l)];
    t.v[l] = v_of[static_cast<size_t>(rank)][static_cast<size_t>(l)];
    t.out[l] = tensor(qs, seed + 3);
    t.lse[l] = tensor(ls, seed + 5);
    anchor_out[static_cast<size_t>(l)] = tensor(qs, seed + 6);
    anchor_lse[static_cast<size_t>(l)] = tensor(ls, seed + 7);
  }
  const TensorView part = tensor(qs, 99), part_lse = tensor(ls, 98);
  const TensorView acc32[2] = {tensor(qs, 97), tensor(qs, 96)};
  std::array<TensorView, 4> into = {tensor(ks, 90), tensor(ks, 91), tensor(ks, 92), tensor(ks, 93)};
  const ops::AttentionMask causal;
  const auto barrier = [&] { comm->barrier(*stream)->synchronize(); };
  for (int round = 0; round < f.rounds + 1; ++round) {  // round 0: warm-up
    barrier();
    auto start = Clock::now();
    ring.forward(t, causal);
    stream->synchronize();
    const double ring_s = seconds_since(start);
    barrier();
    // The ring's pairs and merges, in its order, on the keys and values it receives, held here.
    start = Clock::now();
    bool started[2] = {false, false};
    for (int s = 0; s < f.cp; ++s) {
      const int src = (rank - s + f.cp) % f.cp;
      for (int lq = 0; lq < 2; ++lq) {
        for (int lk : {lq, 1 - lq}) {
          ops::AttentionMask m = causal;
          m.q_offset = nn::cp_chunk(f.cp, rank, lq) * chunk;
          m.kv_offset = nn::cp_chunk(f.cp, src, lk) * chunk;
          if (!ops::block_has_visible(m, chunk, chunk)) continue;
          const TensorView& k = k_of[static_cast<size_t>(src)][static_cast<size_t>(lk)];
          const TensorView& v = v_of[static_cast<size_t>(src)][static_cast<size_t>(lk)];
          const TensorView& lse = anchor_lse[static_cast<size_t>(lq)];
          if (!started[lq]) {  // as the ring: the first block starts the row's lse and the fp32 sum
            ops->attention_forward(*ctx, t.q[lq], k, v, part, lse, m);
            ops->cast(*ctx, part, acc32[lq]);
            started[lq] = true;
          } else {
            ops->attention_forward(*ctx, t.q[lq], k, v, part, part_lse, m);
            ops->attention_merge(*ctx, acc32[lq], lse, part, part_lse);
          }
        }
      }
    }
    for (int lq = 0; lq < 2; ++lq) ops->cast(*ctx, acc32[lq], anchor_out[static_cast<size_t>(lq)]);
    stream->synchronize();
    const double compute_s = seconds_since(start);
    barrier();
    // The ring's hops alone: cp - 1 of k0 k1 v0 v1, to the next rank, from the previous.
    start = Clock::now();
    for (int s = 0; s + 1 < f.cp; ++s) {
      std::vector<partition::P2POp> hop;
      const TensorView from[4] = {t.k[0], t.k[1], t.v[0], t.v[1]};
      for (size_t i = 0; i < 4; ++i) {
        const uint64_t tag = (static_cast<uint64_t>(s) << 8) | 0x80 | i;
        hop.push_back(partition::P2POp::send((rank + 1) % f.cp, from[i].data, DType::kF32, ks, tag, "bench hop"));
        hop.push_back(partition::P2POp::recv((rank + f.cp - 1) % f.cp, into[i].data, DType::kF32, ks, tag,
                                             "bench hop"));
      }
      comm->exchange(hop, *comm_stream)->synchronize();
    }
    const double exchange_s = seconds_since(start);
    // Correctness: the ring's out and lse are the anchor's, bit for bit (the same blocks, merged in the same order).
    for (size_t l = 0; l < 2; ++l) {
      times.mismatches += std::memcmp(t.out[l].data, anchor_out[l].data, t.out[l].nbytes()) != 0;
      times.mismatches += std::memcmp(t.lse[l].data, anchor_lse[l].data, t.lse[l].nbytes()) != 0;
    }
    if (round > 0) {
      times.ring.push_back(ring_s);
      times.compute.push_back(compute_s);
      times.exchange.push_back(exchange_s);
    }
  }
  barrier();
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app("strata-cp: ring attention's exchange hidden behind its block compute (cp ranks as threads, Gloo)");
  app.add_option("--cp", f.cp, "context-parallel ranks (threads)")->capture_default_str()->check(CLI::Range(2, 64));
  app.add_option("--seq", f.seq, "tokens per sequence (divisible by 2 x cp)")->capture_default_str();
  app.add_option("--batch", f.batch, "sequences")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--heads", f.heads, "query heads")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--kv-heads", f.kv_heads, "key/value heads (dividing --heads)")->capture_default_str();
  app.add_option("--head-dim", f.head_dim, "head width")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--rounds", f.rounds, "timed rounds (after one warm-up)")->capture_default_str()->check(
      CLI::Range(1, 1000));
  app.add_option("--json", f.json, "write the results as JSON to this file (\"-\": stdout)");
  CLI11_PARSE(app, argc, argv);
  try {
    bench::check_json_path(f.json);
    STRATA_CHECK(f.seq > 0 && f.seq % (2 * f.cp) == 0, kBadArgument, "--seq {} does not divide by 2 x --cp {}", f.seq,
                 f.cp);
    STRATA_CHECK(f.kv_heads > 0 && f.heads % f.kv_heads == 0, kBadArgument, "--kv-heads {} does not divide --heads {}",
                 f.kv_heads, f.heads);
    ops::set_cpu_threads(1);  // one core per rank thread
    partition::StoreServer server("127.0.0.1", 0);
    auto acc = make_cpu_accelerator();
    std::vector<Times> times(static_cast<size_t>(f.cp));
    std::vector<std::exception_ptr> errors(static_cast<size_t>(f.cp));
    std::vector<std::thread> threads;
    for (int r = 0; r < f.cp; ++r) {
      threads.emplace_back([&, r] {
        try {
          partition::StoreClient store("127.0.0.1", server.port(), r, std::chrono::milliseconds(120000));
          run_rank(f, r, store, *acc, times[static_cast<size_t>(r)]);
        } catch (...) {
          errors[static_cast<size_t>(r)] = std::current_exception();
        }
      });
    }
    for (auto& th : threads) th.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
    const Times& t0 = times[0];
    const double ring = bench::median(t0.ring), compute = bench::median(t0.compute),
                 exchange = bench::median(t0.exchange);
    // Per round (the three phases back to back), then the median: drift between rounds cancels.
    std::vector<double> hidden, cost;
    for (size_t i = 0; i < t0.ring.size(); ++i) {
      hidden.push_back(std::clamp((t0.compute[i] + t0.exchange[i] - t0.ring[i]) / t0.exchange[i], 0.0, 1.0));
      cost.push_back(t0.ring[i] / t0.compute[i]);
    }
    const int64_t chunk = f.seq / (2 * f.cp);
    const double hop_bytes = 4.0 * static_cast<double>(f.batch * chunk * f.kv_heads * f.head_dim) * 4;
    std::printf("strata-cp: cp %d, seq %lld (chunks of %lld), batch %lld, heads %lld/%lld x %lld, fp32 causal; "
                "%d rounds, medians of rank 0\n",
                f.cp, static_cast<long long>(f.seq), static_cast<long long>(chunk), static_cast<long long>(f.batch),
                static_cast<long long>(f.heads), static_cast<long long>(f.kv_heads), static_cast<long long>(f.head_dim),
                f.rounds);
    int64_t mismatches = 0;
    for (const Times& t : times) mismatches += t.mismatches;
    std::printf("  compute (anchor)  %.2f ms   the ring's chunk pairs and merges on keys and values held here, no "
                "hop\n",
                compute * 1e3);
    std::printf("  exchange          %.2f ms   %d hops of %.2f MB (k and v of both chunks), no compute: %.2f GB/s\n",
                exchange * 1e3, f.cp - 1, hop_bytes / 1e6, (f.cp - 1) * hop_bytes / exchange / 1e9);
    std::printf("  ring forward      %.2f ms   %.3f x compute (median of the rounds' ratios)\n", ring * 1e3,
                bench::median(cost));
    std::printf("  hidden            %.0f%% of the exchange's time: (compute + exchange - ring) / exchange, median of "
                "the rounds' (each clamped to 0..100%%)\n",
                100.0 * bench::median(hidden));
    std::printf("  correct           %s\n", mismatches == 0 ? "yes: every rank's ring out and lse equal the anchor's, bit "
                                                               "for bit, every round"
                                                             : "NO: the ring's out or lse differs from the anchor's");
    if (!f.json.empty()) {
      bench::write_json_output(f.json, {{"cp", f.cp},
                                 {"seq", f.seq},
                                 {"batch", f.batch},
                                 {"heads", f.heads},
                                 {"kv_heads", f.kv_heads},
                                 {"head_dim", f.head_dim},
                                 {"rounds", f.rounds},
                                 {"hop_bytes", hop_bytes},
                                 {"ring_s", t0.ring},
                                 {"compute_s", t0.compute},
                                 {"exchange_s", t0.exchange},
                                 {"median_ring_over_compute", bench::median(cost)},
                                 {"median_hidden", bench::median(hidden)},
                                 {"correct", mismatches == 0}});
    }
    return mismatches == 0 ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "strata-cp: %s\n", e.what());
    return 1;
  }
}
