// Pipeline schedules as data (runtime/pipeline/schedule.h): the lists match
// the published examples (REFERENCE.md: Megatron's 1F1B and interleaved
// warm-up, Zero Bubble's ZB-H1), every F precedes its B precedes its W,
// sends and receives pair up and a simulation of Gloo's exchange never
// deadlocks, the peak of micro-batches in flight is what each schedule
// promises, and the bubble from a simulation with unit costs is the
// formula's.
#include <catch2/catch.hpp>

#include <sstream>
#include <string>
#include <vector>

#include "runtime/pipeline/schedule.h"

using namespace strata;
using namespace strata::pipeline;

namespace {

// A rank's compute actions as text: "F0 F1 B0 W0 ...".
std::string computes(const Schedule& s, int rank) {
  std::string out;
  for (const Action& a : s.ranks[static_cast<size_t>(rank)]) {
    if (a.compute()) out += (out.empty() ? "" : " ") + a.describe();
  }
  return out;
}

int count_before_first_backward(const Schedule& s, int rank) {
  int forwards = 0;
  for (const Action& a : s.ranks[static_cast<size_t>(rank)]) {
    if (a.kind == ActionKind::kBackward) break;
    forwards += a.kind == ActionKind::kForward;
  }
  return forwards;
}

}  // namespace

TEST_CASE("schedules: 1F1B and ZB-H1 at p = 4, m = 8 are REFERENCE.md's lists") {
  const Schedule f = one_f_one_b(4, 8);
  CHECK(computes(f, 0) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  CHECK(computes(f, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
  for (int r = 0; r < 4; ++r) CHECK(count_before_first_backward(f, r) == 4 - r - 1 + 1);  // warm-up p - r - 1, then F B
  const Schedule z = zb_h1(4, 8);
  CHECK(computes(z, 0) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7");
  CHECK(computes(z, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7");
  // The exchanges of 1F1B's steady state: a forward's output goes with the
  // next backward's gradient request (Megatron's send_forward_recv_backward).
  const std::vector<Action>& rank1 = f.ranks[1];
  std::ostringstream text;
  for (const Action& a : rank1) text << a.describe() << "; ";
  INFO(text.str());
  CHECK(text.str().find("F3; send-activation 3 to 2; recv-gradient 1 from 2; B1;") != std::string::npos);
  CHECK(text.str().find("B1; send-gradient 1 to 0; recv-activation 4 from 0; F4;") != std::string::npos);
}

TEST_CASE("schedules: interleaved places virtual stage k*p + r on rank r, warm-up 2(p - r - 1) + (v - 1)p") {
  const int p = 4, m = 8, v = 2;
  const Schedule s = interleaved(p, m, v);
  for (int r = 0; r < p; ++r) {
    CHECK(count_before_first_backward(s, r) == 2 * (p - r - 1) + (v - 1) * p + 1);
  }
  // Micro-batches in groups of p through chunk 0, then chunk 1.
  CHECK(computes(s, 0).rfind("F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 F4 F5 F6 B0.1 F7 B1.1 F4.1 B2.1", 0) == 0);
  // Chunk 1 of rank 0 (virtual stage 4) takes its input from rank 3's chunk 0 (virtual stage 3).
  bool found = false;
  for (const Action& a : s.ranks[0]) {
    if (a.kind == ActionKind::kRecvActivation && a.chunk == 1) {
      CHECK(a.peer == 3);
      found = true;
    }
    if (a.kind == ActionKind::kRecvActivation) CHECK(a.chunk == 1);  // chunk 0 of rank 0 reads the data
  }
  CHECK(found);
  // m not a multiple of p is refused with the rule.
  REQUIRE_THROWS_WITH(interleaved(4, 6, 2),
                      Catch::Contains("runs micro-batches in groups of the pipeline size (Megatron's rule): 6 "
                                      "micro-batches is not a multiple of 4 stages; use 4 or 8"));
  REQUIRE_THROWS_WITH(interleaved(4, 8, 1), Catch::Contains("virtual_stages 1; it needs 2 or more"));
  REQUIRE_THROWS_WITH(interleaved(1, 8, 2), Catch::Contains("it needs 2 or more stages, not 1"));
  REQUIRE_THROWS_WITH(make_schedule({ScheduleKind::k1F1B, 4, 8, 2}),
                      Catch::Contains("1f1b runs one chunk of layers per rank: virtual_stages 2 needs the interleaved"));
  REQUIRE_THROWS_WITH(one_f_one_b(4, 0), Catch::Contains("0 micro-batches; at least 1 is needed"));
  CHECK(parse_schedule("zb-h1") == ScheduleKind::kZbH1);
  CHECK_FALSE(parse_schedule("zb-v").has_value());
}

TEST_CASE("schedules: every list is ordered, pairs its transfers, never deadlocks, keeps its memory promise") {
  std::vector<ScheduleSpec> specs;
  for (int p : {1, 2, 3, 4, 5, 8}) {
    for (int m : {1, 2, 3, 4, 7, 8, 16}) {
      specs.push_back({ScheduleKind::kGpipe, p, m, 1});
      specs.push_back({ScheduleKind::k1F1B, p, m, 1});
      specs.push_back({ScheduleKind::kZbH1, p, m, 1});
      for (int v : {2, 3, 4}) {
        if (m % p == 0 && p > 1) specs.push_back({ScheduleKind::kInterleaved, p, m, v});
      }
    }
  }
  for (const ScheduleSpec& spec : specs) {
    INFO(schedule_name(spec.kind) << " p " << spec.stages << " m " << spec.micro_batches << " v " << spec.virtual_stages);
    const Schedule s = make_schedule(spec);
    REQUIRE(static_cast<int>(s.ranks.size()) == spec.stages);
    // Exactly one F and one B (and W when split) per micro-batch and chunk on every rank.
    for (const auto& list : s.ranks) {
      int computes_seen = 0;
      for (const Action& a : list) computes_seen += a.compute();
      CHECK(computes_seen == spec.micro_batches * spec.virtual_stages * (spec.split_backward() ? 3 : 2));
    }
    // simulate() checks F < B < W per micro-batch chunk, the inputs received
    // before use, each send paired with the receive of the same transfer,
    // and that no rank waits forever (Gloo's exchange, the stricter backend).
    const Simulation sim = simulate(s);
    REQUIRE(sim.error.empty());
    for (int r = 0; r < spec.stages; ++r) {
      CAPTURE(r);
      CHECK(sim.peak_in_flight[static_cast<size_t>(r)] == promised_in_flight(spec, r));
    }
  }
}

TEST_CASE("schedules: the simulation finds deadlocks, mispaired transfers and out-of-order actions") {
  using K = ActionKind;
  // Rank 1's first receive names micro-batch 1 where rank 0 sends micro-batch 0.
  Schedule mispaired = one_f_one_b(2, 2);
  REQUIRE(mispaired.ranks[1][0].kind == K::kRecvActivation);
  mispaired.ranks[1][0].micro_batch = 1;
  CHECK_THAT(simulate(mispaired).error, Catch::Contains("rank 0's send-activation 0 to 1 (action 1) is paired with "
                                                        "rank 1's recv-activation 1 from 0 (action 0): another transfer"));
  Schedule stuck = one_f_one_b(2, 1);
  std::swap(stuck.ranks[1][0], stuck.ranks[1][1]);  // rank 1 computes F0 before receiving its input
  CHECK_THAT(simulate(stuck).error, Catch::Contains("rank 1's F0 (action 0) runs before its input was received"));
  Schedule backwards = one_f_one_b(1, 2);
  std::swap(backwards.ranks[0][0], backwards.ranks[0][1]);
  CHECK_THAT(simulate(backwards).error, Catch::Contains("rank 0's B0 (action 0) runs before its forward"));
  // Rank 0 waits for a gradient before sending the activation that produces it.
  Schedule cycle = one_f_one_b(2, 1);
  cycle.ranks[0] = {{K::kRecvGradient, 0, 0, 1}, {K::kForward, 0, 0, -1}, {K::kSendActivation, 0, 0, 1},
                    {K::kBackward, 0, 0, -1}};
  CHECK_THAT(simulate(cycle).error, Catch::Contains("deadlock: every unfinished rank waits for a peer: rank 0's "
                                                    "recv-gradient 0 from 1 (action 0); rank 1's recv-activation 0"));
  Schedule lonely = one_f_one_b(2, 1);
  lonely.ranks[1].erase(lonely.ranks[1].begin());  // rank 1 never receives the activation
  CHECK_THAT(simulate(lonely).error, Catch::Contains("has no partner: rank 0 sends rank 1 1 transfers, which receives 0"));
}

TEST_CASE("schedules: the bubble of a unit-cost simulation is the formula's, ZB-H1's a third of 1F1B's") {
  const Costs unit;  // F = B = W = 1, a whole backward 2
  for (int p : {2, 4, 8}) {
    for (int m : {4, 8, 16, 32}) {
      INFO("p " << p << " m " << m);
      for (ScheduleKind kind : {ScheduleKind::kGpipe, ScheduleKind::k1F1B, ScheduleKind::kZbH1}) {
        const ScheduleSpec spec{kind, p, m, 1};
        const Simulation sim = simulate(make_schedule(spec), unit);
        REQUIRE(sim.error.empty());
        INFO(schedule_name(kind));
        // 1F1B and GPipe: every stage idles (p - 1)(F + B) of (m + p - 1)(F + B).
        if (kind != ScheduleKind::kZbH1) {
          for (double idle : sim.idle_fraction()) CHECK(idle == Approx(bubble_formula(spec, unit)).margin(1e-12));
        } else {
          // The formula assumes a steady state (m >= p); below, ZB-H1 still beats 1F1B.
          if (m >= p) CHECK(sim.max_idle_fraction() == Approx(bubble_formula(spec, unit)).margin(1e-12));
          CHECK(sim.max_idle_fraction() < bubble_formula({ScheduleKind::k1F1B, p, m, 1}, unit));
        }
      }
      if (m % p == 0) {
        for (int v : {2, 4}) {
          const ScheduleSpec spec{ScheduleKind::kInterleaved, p, m, v};
          // A chunk costs 1/v of a stage.
          const Costs chunk{1.0 / v, 1.0 / v, 1.0 / v, 0};
          const Simulation sim = simulate(make_schedule(spec), chunk);
          REQUIRE(sim.error.empty());
          INFO("interleaved v " << v);
          CHECK(sim.max_idle_fraction() == Approx(bubble_formula(spec, unit)).margin(1e-9));
        }
      }
    }
  }
  // p = 4, m = 8: 1F1B 3/11, ZB-H1 3/27 (a third of the bubble time), interleaved v 2: 3/19.
  CHECK(bubble_formula({ScheduleKind::k1F1B, 4, 8, 1}) == Approx(3.0 / 11));
  CHECK(bubble_formula({ScheduleKind::kZbH1, 4, 8, 1}) == Approx(3.0 / 27));
  CHECK(bubble_formula({ScheduleKind::kInterleaved, 4, 8, 2}) == Approx(3.0 / 19));
}

TEST_CASE("schedules: layer-major runs every micro-batch through a chunk before the next, backwards from the top (the "
          "head's right after its forward), on one rank without transfers") {
  const Schedule s = make_schedule({ScheduleKind::kLayerMajor, 1, 3, 2});
  REQUIRE(s.ranks.size() == 1);
  CHECK(computes(s, 0) == "F0 F1 F2 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 B0 B1 B2");
  for (const Action& a : s.ranks[0]) CHECK(a.compute());  // boundaries handed over in memory
  CHECK(parse_schedule("layer-major") == ScheduleKind::kLayerMajor);
  const Simulation sim = simulate(s);
  INFO(sim.error);
  REQUIRE(sim.error.empty());
  CHECK(sim.peak_in_flight[0] == 4);
  CHECK(promised_in_flight(s.spec, 0) == 4);
  CHECK(bubble_formula(s.spec) == 0);
  // A chunk run before the one below forwarded it, or a backward before the one above's, is found.
  Schedule early = s;
  std::swap(early.ranks[0][2], early.ranks[0][3]);  // F0.1 before F2: fine; F0.1 first is not
  Schedule wrong{s.spec, {{Action{ActionKind::kForward, 0, 1, -1}, Action{ActionKind::kForward, 0, 0, -1}}}};
  CHECK_THAT(simulate(wrong).error, Catch::Contains("rank 0's F0.1 (action 0) runs before the chunk below forwarded it"));
  CHECK(simulate(early).error.empty());
  Schedule down{s.spec, {{Action{ActionKind::kForward, 0, 0, -1}, Action{ActionKind::kForward, 0, 1, -1},
                          Action{ActionKind::kBackward, 0, 0, -1}}}};
  CHECK_THAT(simulate(down).error, Catch::Contains("rank 0's B0 (action 2) runs before the chunk above ran its backward"));
  CHECK_THROWS_WITH(make_schedule({ScheduleKind::kLayerMajor, 2, 3, 2}),
                    Catch::Contains("schedule layer-major runs every layer on one rank: 2 stages; it needs 1"));
}
