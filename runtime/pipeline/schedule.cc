// Pipeline schedules: each one's compute order per rank, the exchanges
// between computes, and the simulation that checks and times them.
#include "runtime/pipeline/schedule.h"

#include <algorithm>
#include <map>
#include <set>

#include "core/error.h"

namespace strata::pipeline {

std::string_view schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGpipe: return "gpipe";
    case ScheduleKind::k1F1B: return "1f1b";
    case ScheduleKind::kInterleaved: return "interleaved";
    case ScheduleKind::kZbH1: return "zb-h1";
    case ScheduleKind::kLayerMajor: return "layer-major";
  }
  raise(ErrorCategory::kInternal, "unknown schedule");
}

std::optional<ScheduleKind> parse_schedule(std::string_view name) {
  for (ScheduleKind kind : {ScheduleKind::kGpipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved, ScheduleKind::kZbH1,
                            ScheduleKind::kLayerMajor}) {
    if (schedule_name(kind) == name) return kind;
  }
  return std::nullopt;
}

std::string schedule_names() { return "gpipe, 1f1b, interleaved, zb-h1"; }

void ScheduleSpec::check() const {
  const std::string_view name = schedule_name(kind);
  STRATA_CHECK(stages >= 1, kBadArgument, "pipeline schedule {}: {} stages; at least 1 is needed", name, stages);
  STRATA_CHECK(micro_batches >= 1, kBadArgument, "pipeline schedule {}: {} micro-batches; at least 1 is needed", name,
               micro_batches);
  if (kind == ScheduleKind::kLayerMajor) {
    STRATA_CHECK(stages == 1, kBadArgument,
                 "schedule layer-major runs every layer on one rank: {} stages; it needs 1 (no pipeline parallelism)",
                 stages);
    STRATA_CHECK(virtual_stages >= 1, kBadArgument, "schedule layer-major: {} chunks of layers; at least 1 is needed",
                 virtual_stages);
    return;
  }
  if (kind != ScheduleKind::kInterleaved) {
    STRATA_CHECK(virtual_stages == 1, kBadArgument,
                 "pipeline schedule {} runs one chunk of layers per rank: virtual_stages {} needs the interleaved "
                 "schedule",
                 name, virtual_stages);
    return;
  }
  STRATA_CHECK(stages >= 2, kBadArgument,
               "pipeline schedule interleaved passes chunks between ranks: it needs 2 or more stages, not {}", stages);
  STRATA_CHECK(virtual_stages >= 2, kBadArgument,
               "pipeline schedule interleaved: virtual_stages {}; it needs 2 or more chunks of layers per rank (1 is "
               "1f1b)",
               virtual_stages);
  STRATA_CHECK(micro_batches % stages == 0, kBadArgument,
               "pipeline schedule interleaved runs micro-batches in groups of the pipeline size (Megatron's rule): "
               "{} micro-batches is not a multiple of {} stages; use {} or {}",
               micro_batches, stages, std::max(stages, micro_batches / stages * stages),
               (micro_batches / stages + 1) * stages);
}

std::string_view action_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward: return "F";
    case ActionKind::kBackward: return "B";
    case ActionKind::kWeight: return "W";
    case ActionKind::kSendActivation: return "send-activation";
    case ActionKind::kRecvActivation: return "recv-activation";
    case ActionKind::kSendGradient: return "send-gradient";
    case ActionKind::kRecvGradient: return "recv-gradient";
  }
  raise(ErrorCategory::kInternal, "unknown action");
}

std::string Action::describe() const {
  const std::string mb = chunk == 0 ? std::to_string(micro_batch) : fmt::format("{}.{}", micro_batch, chunk);
  if (compute()) return fmt::format("{}{}", action_name(kind), mb);
  return fmt::format("{} {} {} {}", action_name(kind), mb, sends() ? "to" : "from", peer);
}

namespace {

using ComputeOrder = std::vector<std::vector<Action>>;  // per rank, compute actions only

Action compute(ActionKind kind, int micro_batch, int chunk = 0) { return Action{kind, micro_batch, chunk, -1}; }

// The exchanges around each compute action (see schedule.h): before a
// rank's first compute its receives; between two computes the first's sends
// and the second's receives; after the last its sends.
Schedule with_communication(const ScheduleSpec& spec, const ComputeOrder& order) {
  const int p = spec.stages, stages = p * spec.virtual_stages;
  Schedule schedule{spec, {}};
  for (int r = 0; r < p; ++r) {
    const auto virtual_stage = [&](const Action& a) { return a.chunk * p + r; };
    // The neighbour of virtual stage s: its rank and chunk.
    const auto place = [&](int s) { return std::pair{s % p, s / p}; };
    auto receives = [&](const Action& a, std::vector<Action>& out) {
      const int s = virtual_stage(a);
      if (a.kind == ActionKind::kForward && s > 0) {
        out.push_back({ActionKind::kRecvActivation, a.micro_batch, a.chunk, place(s - 1).first});
      } else if (a.kind == ActionKind::kBackward && s + 1 < stages) {
        out.push_back({ActionKind::kRecvGradient, a.micro_batch, a.chunk, place(s + 1).first});
      }
    };
    auto sends = [&](const Action& a, std::vector<Action>& out) {
      const int s = virtual_stage(a);
      if (a.kind == ActionKind::kForward && s + 1 < stages) {
        out.push_back({ActionKind::kSendActivation, a.micro_batch, a.chunk, place(s + 1).first});
      } else if (a.kind == ActionKind::kBackward && s > 0) {
        out.push_back({ActionKind::kSendGradient, a.micro_batch, a.chunk, place(s - 1).first});
      }
    };
    std::vector<Action> list;
    const std::vector<Action>& computes = order[static_cast<size_t>(r)];
    for (size_t i = 0; i < computes.size(); ++i) {
      if (i > 0) sends(computes[i - 1], list);
      receives(computes[i], list);
      list.push_back(computes[i]);
    }
    if (!computes.empty()) sends(computes.back(), list);
    schedule.ranks.push_back(std::move(list));
  }
  return schedule;
}

// 1F1B's order of F and B on rank r (Megatron's forward_backward_pipelining_without_interleaving).
std::vector<Action> one_f_one_b_order(int p, int m, int r) {
  const int warmup = std::min(p - r - 1, m);
  std::vector<Action> order;
  for (int i = 0; i < warmup; ++i) order.push_back(compute(ActionKind::kForward, i));
  for (int i = 0; i < m - warmup; ++i) {
    order.push_back(compute(ActionKind::kForward, warmup + i));
    order.push_back(compute(ActionKind::kBackward, i));
  }
  for (int i = m - warmup; i < m; ++i) order.push_back(compute(ActionKind::kBackward, i));
  return order;
}

}  // namespace

Schedule gpipe(int stages, int micro_batches) {
  const ScheduleSpec spec{ScheduleKind::kGpipe, stages, micro_batches, 1};
  spec.check();
  ComputeOrder order(static_cast<size_t>(stages));
  for (auto& rank : order) {
    for (int i = 0; i < micro_batches; ++i) rank.push_back(compute(ActionKind::kForward, i));
    for (int i = 0; i < micro_batches; ++i) rank.push_back(compute(ActionKind::kBackward, i));
  }
  return with_communication(spec, order);
}

Schedule one_f_one_b(int stages, int micro_batches) {
  const ScheduleSpec spec{ScheduleKind::k1F1B, stages, micro_batches, 1};
  spec.check();
  ComputeOrder order;
  for (int r = 0; r < stages; ++r) order.push_back(one_f_one_b_order(stages, micro_batches, r));
  return with_communication(spec, order);
}

Schedule interleaved(int stages, int micro_batches, int virtual_stages) {
  const ScheduleSpec spec{ScheduleKind::kInterleaved, stages, micro_batches, virtual_stages};
  spec.check();
  const int p = stages, m = micro_batches, v = virtual_stages, total = m * v;
  // Megatron's get_model_chunk_id and micro-batch of the k-th forward (and,
  // chunks reversed, backward) step: micro-batches in groups of p, each group
  // through chunk 0, then chunk 1, ...
  const auto chunk_of = [&](int k, bool forward) {
    const int chunk = k % (p * v) / p;
    return forward ? chunk : v - 1 - chunk;
  };
  const auto micro_batch_of = [&](int k) { return k / (p * v) * p + k % p; };
  ComputeOrder order;
  for (int r = 0; r < p; ++r) {
    const int warmup = m == p ? total : std::min(2 * (p - r - 1) + (v - 1) * p, total);
    std::vector<Action> rank;
    for (int k = 0; k < warmup; ++k) rank.push_back(compute(ActionKind::kForward, micro_batch_of(k), chunk_of(k, true)));
    for (int k = 0; k < total - warmup; ++k) {
      const int f = warmup + k;
      rank.push_back(compute(ActionKind::kForward, micro_batch_of(f), chunk_of(f, true)));
      rank.push_back(compute(ActionKind::kBackward, micro_batch_of(k), chunk_of(k, false)));
    }
    for (int k = total - warmup; k < total; ++k) {
      rank.push_back(compute(ActionKind::kBackward, micro_batch_of(k), chunk_of(k, false)));
    }
    order.push_back(std::move(rank));
  }
  return with_communication(spec, order);
}

Schedule zb_h1(int stages, int micro_batches) {
  const ScheduleSpec spec{ScheduleKind::kZbH1, stages, micro_batches, 1};
  spec.check();
  const int m = micro_batches;
  ComputeOrder order;
  for (int r = 0; r < stages; ++r) {
    // 1F1B's F and B; rank r's W of micro-batch j right after its B of j + r
    // (the last ones after the last B), so its B's reach rank r - 1 sooner.
    std::vector<Action> rank;
    int next_weight = 0;
    for (const Action& a : one_f_one_b_order(stages, m, r)) {
      rank.push_back(a);
      if (a.kind == ActionKind::kBackward && a.micro_batch >= r) {
        rank.push_back(compute(ActionKind::kWeight, next_weight++));
      }
    }
    while (next_weight < m) rank.push_back(compute(ActionKind::kWeight, next_weight++));
    order.push_back(std::move(rank));
  }
  return with_communication(spec, order);
}

Schedule layer_major(int micro_batches, int chunks) {
  const ScheduleSpec spec{ScheduleKind::kLayerMajor, 1, micro_batches, chunks};
  spec.check();
  std::vector<Action> rank;
  for (int k = 0; k + 1 < chunks; ++k) {
    for (int i = 0; i < micro_batches; ++i) rank.push_back(compute(ActionKind::kForward, i, k));
  }
  // The top chunk's backward right after its forward: the head's forward adds
  // the loss's gradient, so it is the one chunk the executor cannot recompute.
  for (int i = 0; i < micro_batches; ++i) {
    rank.push_back(compute(ActionKind::kForward, i, chunks - 1));
    rank.push_back(compute(ActionKind::kBackward, i, chunks - 1));
  }
  for (int k = chunks - 2; k >= 0; --k) {
    for (int i = 0; i < micro_batches; ++i) rank.push_back(compute(ActionKind::kBackward, i, k));
  }
  // No transfers: one rank, the boundaries handed over in memory (local_handoff).
  return Schedule{spec, {std::move(rank)}};
}

Schedule make_schedule(const ScheduleSpec& spec) {
  spec.check();
  switch (spec.kind) {
    case ScheduleKind::kGpipe: return gpipe(spec.stages, spec.micro_batches);
    case ScheduleKind::k1F1B: return one_f_one_b(spec.stages, spec.micro_batches);
    case ScheduleKind::kInterleaved: return interleaved(spec.stages, spec.micro_batches, spec.virtual_stages);
    case ScheduleKind::kZbH1: return zb_h1(spec.stages, spec.micro_batches);
    case ScheduleKind::kLayerMajor: return layer_major(spec.micro_batches, spec.virtual_stages);
  }
  raise(ErrorCategory::kInternal, "unknown schedule");
}

// ---- simulation ------------------------------------------------------------------------

std::vector<double> Simulation::idle_fraction() const {
  std::vector<double> idle;
  for (double b : busy) idle.push_back(makespan > 0 ? 1.0 - b / makespan : 0.0);
  return idle;
}

double Simulation::max_idle_fraction() const {
  const std::vector<double> idle = idle_fraction();
  return idle.empty() ? 0.0 : *std::max_element(idle.begin(), idle.end());
}

Simulation simulate(const Schedule& schedule, const Costs& costs) {
  const bool split = schedule.spec.split_backward();
  return simulate(
      schedule,
      [&](int rank, size_t index) {
        const Action& a = schedule.ranks[static_cast<size_t>(rank)][index];
        return a.kind == ActionKind::kForward  ? costs.forward
               : a.kind == ActionKind::kWeight ? costs.weight
               : split                         ? costs.backward
                                               : costs.backward + costs.weight;
      },
      costs.transfer);
}

Simulation simulate(const Schedule& schedule, const ActionCost& action_cost, double transfer) {
  const int p = schedule.spec.stages;
  const bool split = schedule.spec.split_backward();
  Simulation sim;
  sim.busy.assign(static_cast<size_t>(p), 0.0);
  sim.peak_in_flight.assign(static_cast<size_t>(p), 0);
  const auto describe_at = [&](int rank, size_t action) {
    return fmt::format("rank {}'s {} (action {})", rank, schedule.ranks[static_cast<size_t>(rank)][action].describe(),
                       action);
  };
  // Pair the n-th send from a to b with b's n-th receive from a; they must
  // name one transfer. partner[r][i]: (rank, action) of action i's other side.
  std::map<std::pair<int, int>, std::vector<size_t>> sends, recvs;  // keyed (from, to): action indexes
  for (int r = 0; r < p; ++r) {
    const auto& list = schedule.ranks[static_cast<size_t>(r)];
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].compute()) continue;
      STRATA_CHECK(list[i].peer >= 0 && list[i].peer < p && list[i].peer != r, kBadArgument,
                   "{} names peer {}, not another rank of {}", describe_at(r, i), list[i].peer, p);
      if (list[i].sends()) {
        sends[{r, list[i].peer}].push_back(i);
      } else {
        recvs[{list[i].peer, r}].push_back(i);
      }
    }
  }
  std::vector<std::vector<std::pair<int, size_t>>> partner(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) partner[static_cast<size_t>(r)].assign(schedule.ranks[static_cast<size_t>(r)].size(), {-1, 0});
  std::set<std::pair<int, int>> pairs;
  for (const auto& [key, list] : sends) pairs.insert(key);
  for (const auto& [key, list] : recvs) pairs.insert(key);
  for (const auto& [from, to] : pairs) {
    const std::vector<size_t>& s = sends[{from, to}];
    const std::vector<size_t>& r = recvs[{from, to}];
    for (size_t n = 0; n < std::max(s.size(), r.size()); ++n) {
      if (n >= s.size() || n >= r.size()) {
        sim.error = fmt::format("{} has no partner: rank {} sends rank {} {} transfers, which receives {}",
                                n < s.size() ? describe_at(from, s[n]) : describe_at(to, r[n]), from, to, s.size(),
                                r.size());
        return sim;
      }
      const Action& a = schedule.ranks[static_cast<size_t>(from)][s[n]];
      const Action& b = schedule.ranks[static_cast<size_t>(to)][r[n]];
      const bool same_kind = (a.kind == ActionKind::kSendActivation && b.kind == ActionKind::kRecvActivation) ||
                             (a.kind == ActionKind::kSendGradient && b.kind == ActionKind::kRecvGradient);
      // The receiver's chunk is the sender's neighbour: one virtual stage up (activations) or down (gradients).
      const int from_stage = a.chunk * p + from, to_stage = b.chunk * p + to;
      const bool adjacent = a.kind == ActionKind::kSendActivation ? to_stage == from_stage + 1 : to_stage == from_stage - 1;
      if (!same_kind || a.micro_batch != b.micro_batch || !adjacent) {
        sim.error = fmt::format("{} is paired with {}: another transfer", describe_at(from, s[n]), describe_at(to, r[n]));
        return sim;
      }
      partner[static_cast<size_t>(from)][s[n]] = {to, r[n]};
      partner[static_cast<size_t>(to)][r[n]] = {from, s[n]};
    }
  }

  // The run: each rank's compute stream takes its list in order; a send goes
  // to the rank's send stream (first in, first out), which posts it once its
  // data exists and the sends before it are done, and is done once the
  // receiver has posted the receive; consecutive receives are one exchange on
  // the compute stream, posted together, done once every sender has posted.
  // posted[r][i]: when action i of rank r was posted (-1: not yet).
  std::vector<std::vector<double>> posted(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) posted[static_cast<size_t>(r)].assign(schedule.ranks[static_cast<size_t>(r)].size(), -1.0);
  std::vector<size_t> cursor(static_cast<size_t>(p), 0);
  std::vector<double> clock(static_cast<size_t>(p), 0.0);
  struct SendStream {
    std::vector<std::pair<size_t, double>> queue;  // (action, when its data exists)
    size_t next = 0;
    double free_at = 0;
  };
  std::vector<SendStream> send_streams(static_cast<size_t>(p));
  using Key = std::pair<int, int>;  // (micro-batch, chunk)
  std::vector<std::map<Key, int>> progress(static_cast<size_t>(p));  // 1 forwarded, 2 backward done, 3 weights done
  std::vector<std::set<Key>> have_input(static_cast<size_t>(p)), have_grad(static_cast<size_t>(p));
  std::vector<int> in_flight(static_cast<size_t>(p), 0);
  const int stages = p * schedule.spec.virtual_stages;
  const auto advance_sends = [&](int r) {
    bool moved = false;
    SendStream& stream = send_streams[static_cast<size_t>(r)];
    while (stream.next < stream.queue.size()) {
      const auto [action, ready] = stream.queue[stream.next];
      double& at = posted[static_cast<size_t>(r)][action];
      if (at < 0) {
        at = std::max(ready, stream.free_at);
        moved = true;
      }
      const auto [peer, theirs] = partner[static_cast<size_t>(r)][action];
      const double received = posted[static_cast<size_t>(peer)][theirs];
      if (received < 0) break;
      stream.free_at = std::max(at, received) + transfer;
      ++stream.next;
      moved = true;
    }
    return moved;
  };
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < p; ++r) {
      const auto R = static_cast<size_t>(r);
      const auto& list = schedule.ranks[R];
      moved |= advance_sends(r);
      while (cursor[R] < list.size()) {
        const Action& a = list[cursor[R]];
        if (a.sends()) {
          send_streams[R].queue.push_back({cursor[R]++, clock[R]});
          moved = true;
          continue;
        }
        if (!a.compute()) {
          // The receives up to the next compute or send: one exchange.
          size_t end = cursor[R];
          while (end < list.size() && !list[end].compute() && !list[end].sends()) ++end;
          double done = clock[R];
          bool all = true;
          for (size_t i = cursor[R]; i < end; ++i) {
            if (posted[R][i] < 0) {
              posted[R][i] = clock[R];
              moved = true;
            }
            const auto [peer, theirs] = partner[R][i];
            const double sent = posted[static_cast<size_t>(peer)][theirs];
            all = all && sent >= 0;
            done = std::max(done, sent);
          }
          if (!all) break;
          for (size_t i = cursor[R]; i < end; ++i) {
            (list[i].kind == ActionKind::kRecvActivation ? have_input : have_grad)[R].insert(
                {list[i].micro_batch, list[i].chunk});
          }
          clock[R] = done + transfer;
          cursor[R] = end;
          moved = true;
          continue;
        }
        const Key key{a.micro_batch, a.chunk};
        const int s = a.chunk * p + r;
        int& state = progress[R][key];
        std::string wrong;
        // A boundary handed over in memory exists once the neighbouring chunk has run.
        const bool local = schedule.spec.local_handoff();
        const auto neighbour = [&](int chunk) {
          const auto it = progress[R].find({a.micro_batch, chunk});
          return it == progress[R].end() ? 0 : it->second;
        };
        if (a.kind == ActionKind::kForward) {
          if (state != 0) wrong = "runs twice";
          const bool input = local ? neighbour(a.chunk - 1) >= 1 : have_input[R].count(key) > 0;
          if (s > 0 && !input) wrong = local ? "runs before the chunk below forwarded it" : "runs before its input was received";
        } else if (a.kind == ActionKind::kBackward) {
          if (state != 1) wrong = state == 0 ? "runs before its forward" : "runs twice";
          const bool grad = local ? neighbour(a.chunk + 1) >= 2 : have_grad[R].count(key) > 0;
          if (s + 1 < stages && !grad) {
            wrong = local ? "runs before the chunk above ran its backward" : "runs before its output's gradient was received";
          }
        } else {
          if (!split) wrong = "splits a backward the schedule does not split";
          if (state != 2) wrong = state < 2 ? "runs before its backward" : "runs twice";
        }
        if (!wrong.empty()) {
          sim.error = fmt::format("{} {}", describe_at(r, cursor[R]), wrong);
          return sim;
        }
        state = a.kind == ActionKind::kForward ? 1 : a.kind == ActionKind::kBackward ? 2 : 3;
        const double cost = action_cost(r, cursor[R]);
        if (a.kind == ActionKind::kForward) {
          sim.peak_in_flight[R] = std::max(sim.peak_in_flight[R], ++in_flight[R]);
        } else if ((a.kind == ActionKind::kBackward && !split) || a.kind == ActionKind::kWeight) {
          --in_flight[R];
        }
        clock[R] += cost;
        sim.busy[R] += cost;
        ++cursor[R];
        moved = true;
      }
      moved |= advance_sends(r);
    }
  }
  std::string stuck;
  for (int r = 0; r < p; ++r) {
    const auto R = static_cast<size_t>(r);
    if (cursor[R] < schedule.ranks[R].size()) stuck += (stuck.empty() ? "" : "; ") + describe_at(r, cursor[R]);
    const SendStream& stream = send_streams[R];
    if (stream.next < stream.queue.size()) {
      stuck += (stuck.empty() ? "" : "; ") + describe_at(r, stream.queue[stream.next].first) + " on its send stream";
    }
    sim.makespan = std::max({sim.makespan, clock[R], stream.free_at});
  }
  if (!stuck.empty()) {
    sim.error = "deadlock: every unfinished rank waits for a peer: " + stuck;
    return sim;
  }
  // Every chunk of every micro-batch ran forward, backward and (split) weights.
  const int last = split ? 3 : 2;
  for (int r = 0; r < p; ++r) {
    for (int i = 0; i < schedule.spec.micro_batches; ++i) {
      for (int k = 0; k < schedule.spec.virtual_stages; ++k) {
        const auto it = progress[static_cast<size_t>(r)].find({i, k});
        if (it == progress[static_cast<size_t>(r)].end() || it->second != last) {
          sim.error = fmt::format("rank {} never finishes micro-batch {} of chunk {}", r, i, k);
          return sim;
        }
      }
    }
  }
  return sim;
}

double bubble_formula(const ScheduleSpec& spec, const Costs& costs) {
  const double p = spec.stages, m = spec.micro_batches, v = spec.virtual_stages;
  switch (spec.kind) {
    case ScheduleKind::kGpipe:
    case ScheduleKind::k1F1B: return (p - 1) / (m + p - 1);
    case ScheduleKind::kInterleaved: return (p - 1) / (v * m + p - 1);
    case ScheduleKind::kLayerMajor: return 0;  // one rank: nothing to wait for
    case ScheduleKind::kZbH1: {
      const double bubble = (p - 1) * (costs.forward + costs.backward - costs.weight);
      return bubble / (m * (costs.forward + costs.backward + costs.weight) + bubble);
    }
  }
  raise(ErrorCategory::kInternal, "unknown schedule");
}

int promised_in_flight(const ScheduleSpec& spec, int rank) {
  const int p = spec.stages, m = spec.micro_batches, v = spec.virtual_stages;
  switch (spec.kind) {
    case ScheduleKind::kGpipe: return m;
    case ScheduleKind::k1F1B: return std::min(p - rank, m);
    case ScheduleKind::kInterleaved:
      return m == p ? v * m : std::min(2 * (p - rank - 1) + (v - 1) * p + 1, v * m);
    case ScheduleKind::kZbH1: return std::min(p, m);
    case ScheduleKind::kLayerMajor: return (v - 1) * m + 1;
  }
  raise(ErrorCategory::kInternal, "unknown schedule");
}

}  // namespace strata::pipeline
