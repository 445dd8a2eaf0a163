// Pipeline schedules as data (docs/DESIGN.md §5.4, issue 44): for each rank
// of a pipeline of p stages, the list of actions it runs in one training step
// of m micro-batches — forward (F), backward (B), weight gradient (W), and
// the sends and receives of activations and gradients between them. One
// executor (runtime/pipeline/executor.h) runs any list, so a new schedule is
// a new function here.
//
// Virtual stages: a rank holds v chunks of layers (v = 1 but for
// `interleaved`); chunk k of rank r is virtual stage k*p + r (Megatron's
// placement), so the model's layers run through virtual stages 0 .. v*p-1
// in order and a rank passes activations to the next rank (the last rank to
// the first, one chunk up).
//
// Schedules, by name:
//   gpipe        every forward, then every backward: m micro-batches in
//                flight on every rank.
//   1f1b         Megatron's: p - r - 1 warm-up forwards on rank r, then one
//                forward and one backward in turn, then the cool-down
//                backwards: at most p - r micro-batches in flight.
//   interleaved  Megatron's interleaved 1F1B over v chunks per rank:
//                micro-batches in groups of p (m must be a multiple of p,
//                p at least 2),
//                warm-up 2(p - r - 1) + (v - 1)p chunk-forwards; the bubble
//                shrinks by v.
//   zb-h1        Zero Bubble's ZB-H1: 1F1B's order of F and B, with the
//                backward split into B (input gradient, on the critical path)
//                and W (weight gradients), rank r deferring its W's by r
//                backwards into what would be bubble: at most p micro-batches
//                in flight, 1F1B's peak.
//   layer-major  one rank (p = 1), the decoder as v chunks: the embedding,
//                each layer, the head (GreedySnake's vertical order,
//                docs/DESIGN.md §5.5): every
//                micro-batch through chunk k before chunk k + 1, then the
//                backwards chunk by chunk from the top, each chunk's over
//                every micro-batch in order; each chunk's parameters are
//                used by m forwards in a row and m backwards in a row. The
//                top chunk (the head) runs each micro-batch's backward right
//                after its forward: its forward adds the loss's gradient, so
//                it cannot be recomputed. Its boundaries are handed over in
//                memory (no transfer actions): the executor keeps each
//                micro-batch's input to every chunk and the gradient flowing
//                down, and recomputes a chunk's forward from its kept input
//                before its backward. In flight (between F and B):
//                (v - 1) m + 1, each holding only its boundary.
//
// Communication (runtime/pipeline/executor.h runs it so): a send is handed
// to the rank's send stream, which sends in order, each once its data exists
// and the one before it is done (a send waits for its receiver, never the
// rank's compute); consecutive receives are one exchange on the compute
// stream, which waits for their data. The list puts each compute's receives
// right before it and its sends right after it. The n-th send from rank a to
// rank b pairs with b's n-th receive from a; simulate() checks that they name
// the same transfer and that no rank waits forever.
//
// Thread-safety: pure functions. Errors: Error(kBadArgument) naming the
// schedule and the rule a size breaks.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace strata::pipeline {

enum class ScheduleKind : uint8_t { kGpipe, k1F1B, kInterleaved, kZbH1, kLayerMajor };
// "gpipe", "1f1b", "interleaved", "zb-h1", "layer-major".
std::string_view schedule_name(ScheduleKind kind);
// nullopt for a name that is none of them.
std::optional<ScheduleKind> parse_schedule(std::string_view name);
// The pipeline schedules' names, for errors and help: "gpipe, 1f1b,
// interleaved, zb-h1" (layer-major is no pipeline: parse_schedule knows it,
// --pp-schedule does not offer it).
std::string schedule_names();

struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int stages = 2;          // p: ranks in the pipeline
  int micro_batches = 1;   // m: per training step
  int virtual_stages = 1;  // v: chunks per rank (interleaved: 2 or more)
  // Refuses sizes the schedule cannot run (p < 1, m < 1, v != 1 outside
  // interleaved, interleaved with v < 2 or m not a multiple of p), naming the rule.
  void check() const;
  // Whether the backward is split into B and W (zb-h1).
  bool split_backward() const { return kind == ScheduleKind::kZbH1; }
  // Whether neighbouring virtual stages share a rank, their boundaries
  // handed over in memory rather than sent (layer-major).
  bool local_handoff() const { return kind == ScheduleKind::kLayerMajor; }
};

enum class ActionKind : uint8_t {
  kForward,         // F: the micro-batch through the chunk's layers
  kBackward,        // B: its backward (split: the input gradient only)
  kWeight,          // W: the weight gradients of a split backward
  kSendActivation,  // the chunk's output to the next virtual stage
  kRecvActivation,  // the chunk's input from the previous virtual stage
  kSendGradient,    // the gradient at the chunk's input to the previous virtual stage
  kRecvGradient,    // the gradient at the chunk's output from the next virtual stage
};
// "F", "B", "W", "send-activation", ...
std::string_view action_name(ActionKind kind);

struct Action {
  ActionKind kind = ActionKind::kForward;
  int micro_batch = 0;
  int chunk = 0;   // the rank's chunk (virtual stage chunk * p + rank)
  int peer = -1;   // sends and receives: the pp rank on the other side
  bool compute() const { return kind == ActionKind::kForward || kind == ActionKind::kBackward || kind == ActionKind::kWeight; }
  bool sends() const { return kind == ActionKind::kSendActivation || kind == ActionKind::kSendGradient; }
  bool operator==(const Action&) const = default;
  // "F3", "B3.1" (micro-batch 3, chunk 1), "send-activation 3 to 2".
  std::string describe() const;
};

struct Schedule {
  ScheduleSpec spec;
  std::vector<std::vector<Action>> ranks;  // per pp rank, in order
};

// The schedule `spec` names (spec.check() first).
Schedule make_schedule(const ScheduleSpec& spec);
// Each schedule's compute order on every rank, communication inserted.
Schedule gpipe(int stages, int micro_batches);
Schedule one_f_one_b(int stages, int micro_batches);
Schedule interleaved(int stages, int micro_batches, int virtual_stages);
Schedule zb_h1(int stages, int micro_batches);
Schedule layer_major(int micro_batches, int chunks);

// What a run of a schedule takes, in any unit: a chunk's forward, its input
// gradient (B of a split backward) and its weight gradients (W); a whole
// backward costs backward + weight. `transfer`: each exchange.
struct Costs {
  double forward = 1, backward = 1, weight = 1, transfer = 0;
};

// A schedule run on an ideal machine as the executor runs it (see
// Communication above): every compute takes its cost, a send is done once
// its receiver has posted the receive, a receive once its sender has posted
// the send (Gloo's and NCCL's rendezvous), each exchange then `transfer`.
struct Simulation {
  // Empty when the schedule ran to its end; else what went wrong: a rank
  // waiting forever ("deadlock: ..."), a send paired with a receive of
  // another transfer, an action before its input exists (B before its F, W
  // before its B, F or B of a chunk without the received input).
  std::string error;
  double makespan = 0;             // when the last rank ends
  std::vector<double> busy;        // per rank: time computing
  std::vector<int> peak_in_flight; // per rank: most micro-batch chunks forwarded and not yet done with backward
  // 1 - busy / makespan, per rank: the share of the step a rank waits.
  std::vector<double> idle_fraction() const;
  double max_idle_fraction() const;
};
Simulation simulate(const Schedule& schedule, const Costs& costs = {});
// The same with each compute action's own cost: cost(rank, index of the
// action in that rank's list) — a step's measured durations replayed, the
// schedule's idle for exactly those. `transfer` as Costs'.
using ActionCost = std::function<double(int rank, size_t action)>;
Simulation simulate(const Schedule& schedule, const ActionCost& cost, double transfer = 0);

// The bubble the literature gives for `spec` (every stage alike, costs as
// above): 1F1B and GPipe (p-1)/(m+p-1); interleaved (p-1)/(v m + p-1); ZB-H1
// (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)), a third of 1F1B's with unit costs.
double bubble_formula(const ScheduleSpec& spec, const Costs& costs = {});
// The peak of micro-batch chunks in flight the schedule promises per rank:
// gpipe m; 1f1b min(p - r, m); interleaved min(2(p - r - 1) + (v - 1)p + 1, v m);
// zb-h1 min(p, m); layer-major (v - 1) m + 1.
int promised_in_flight(const ScheduleSpec& spec, int rank);

}  // namespace strata::pipeline
