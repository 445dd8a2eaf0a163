// Pipeline parallelism with ranks as real processes under `strata run` (issue
// 44): each rank holds its stages' layers (runtime/pipeline), the executor
// runs its schedule's action list, activations and gradients cross between
// processes over Gloo, and the result is held against ONE resident rank
// running the same micro-batches in order on the whole model.
//
// Resident engines (ZeRO off): after one step, every gradient of every stage
// is bit for bit the reference's — the same kernels on the same bytes, the
// micro-batches' contributions added in the same order by every schedule (B
// in micro-batch order, ZB-H1's W too) — and so is the loss; with tied
// embeddings the embedding's gradient is the sum of the first stage's
// lookups and the last stage's lm_head, added in another order than the
// reference's, so it agrees to rounding, and the two stages' copies agree bit
// for bit.
//
// ZeRO over each stage's dp group (stages 1-3, parameters and optimizer on
// cpu or NVMe), with tensor parallelism inside each stage: three steps of
// AdamW give one resident rank's losses, norms and parameters on the same
// global batch (zero::train_resident), within the engine tests' rounding
// argument — the sums run in another order (micro-batches, dp ranks, the
// two halves of a tied embedding), and Adam's eps 1 keeps that rounding-sized.
// The rank program is pipeline_rank.cc.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "runtime/engine/resident_engine.h"
#include "runtime/nn/decoder_model.h"
#include "tests/engine/zero_training.h"
#include "tests/pipeline/pipeline_case.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"

namespace {
using namespace strata;
namespace pp = strata::test::pp;
namespace zero = strata::test::zero;

const std::string kStrata = test::strata_binary();
const std::string kRankProgram = STRATA_PIPELINE_RANK_PROGRAM;

// Every tensor, whole, assembled from the ranks' runs; with the count of
// ranks that wrote each element and whether their copies agreed bit for bit.
struct Assembled {
  std::vector<pp::Output> ranks;
  std::map<std::string, std::vector<float>> tensors;
  std::map<std::string, std::vector<int>> writers;
  int64_t copies_differ = 0;
};

Assembled run_case(const pp::Case& c, const test::TempDir& dir, int world) {
  const std::string command = kStrata + " run -n " + std::to_string(world) + " -- " + kRankProgram + " --out " +
                              dir.file("out") + " --nvme " + dir.file("nvme") + c.flags();
  const test::CommandResult result = test::run_with_limit(command, 240);
  INFO(command << "\n" << result.output);
  REQUIRE(result.exit_code == 0);
  Assembled a;
  for (int rank = 0; rank < world; ++rank) {
    pp::Output out = pp::read_output(dir.file("out") + "/rank" + std::to_string(rank) + ".txt");
    REQUIRE(out.rank == rank);
    for (const auto& [name, numel] : out.tensors) {
      if (!a.tensors.contains(name)) {
        a.tensors[name].assign(static_cast<size_t>(numel), std::nanf(""));
        a.writers[name].assign(static_cast<size_t>(numel), 0);
      }
    }
    for (const auto& run : out.runs) {
      std::vector<float>& t = a.tensors.at(run.name);
      std::vector<int>& w = a.writers.at(run.name);
      REQUIRE(run.first + static_cast<int64_t>(run.values.size()) <= static_cast<int64_t>(t.size()));
      for (size_t i = 0; i < run.values.size(); ++i) {
        const size_t at = static_cast<size_t>(run.first) + i;
        if (w[at] > 0) a.copies_differ += std::memcmp(&t[at], &run.values[i], sizeof(float)) != 0;
        t[at] = run.values[i];
        ++w[at];
      }
    }
    a.ranks.push_back(std::move(out));
  }
  return a;
}

// The reference: the whole model on one ResidentEngine, the same micro-batches
// in order, the loss normalised by the step's count of targets.
struct Reference {
  double loss = 0;
  std::map<std::string, std::vector<float>> grads;
  int64_t expert_windows = 0, expert_windows_possible = 0;
};

Reference reference(const pp::Case& c) {
  ops::set_cpu_threads(1);
  auto accelerator = make_cpu_accelerator();
  engine::ResidentEngine eng(*accelerator);
  const nn::DecoderConfig config = pp::model_config(c);
  nn::DecoderModelOptions options = nn::model_options(DType::kF32, 16);
  options.checkpoint_activations = c.checkpoint;
  nn::DecoderModel model(eng, config, options);
  // Expert windows forward actually ran (the others were skipped: no token routed).
  int64_t expert_windows = 0;
  eng.set_hook_observer([&](engine::OpId op, engine::Phase phase, bool pre) {
    expert_windows += pre && phase == engine::Phase::kForward && eng.op_info(op).name.find(".experts.") != std::string::npos;
  });
  eng.finalize();
  nn::initialize_parameters(eng, model.parameters(), pp::kInitSeed, pp::kInitStd);
  const pp::Batch batch = pp::corpus(0, c.sequences, config.vocab_size);
  const double count = pp::counted(batch.targets.data(), batch.targets.size());
  const int64_t per_micro = c.sequences / c.micro_batches;
  const size_t n = static_cast<size_t>(per_micro * pp::kSeq);
  double loss = 0;
  for (int i = 0; i < c.micro_batches; ++i) {
    nn::ForwardOptions forward;
    forward.normalizer = count;
    model.forward(std::span<const int32_t>(batch.ids).subspan(i * n, n),
                  std::span<const int32_t>(batch.targets).subspan(i * n, n), per_micro, pp::kSeq, forward);
    model.backward();
    loss += model.loss_stats().sum;
  }
  eng.compute_stream().synchronize();
  Reference r;
  r.loss = loss / count;
  r.expert_windows = expert_windows;
  r.expert_windows_possible = config.moe() ? config.num_hidden_layers * config.num_experts * 3 * c.micro_batches : 0;
  for (engine::ParamId id = 0; id < eng.parameter_count(); ++id) {
    const TensorView g = eng.grad_storage(id);
    r.grads[eng.param_info(id).name] = std::vector<float>(g.as<float>(), g.as<float>() + g.numel());
  }
  return r;
}

}  // namespace

TEST_CASE("pipeline, resident stages as processes: every schedule gives one resident rank's gradients and loss",
          "[pipeline][multiprocess]") {
  std::vector<pp::Case> cases;
  const auto add = [&](int p, const std::string& schedule, int m, int v, bool tied, bool checkpoint = false,
                       const std::string& family = "llama") {
    pp::Case c;
    c.family = family;
    c.pp = p;
    c.schedule = schedule;
    c.micro_batches = m;
    c.virtual_stages = v;
    c.tied = tied;
    c.checkpoint = checkpoint;
    cases.push_back(c);
  };
  add(2, "1f1b", 4, 1, false);
  add(2, "1f1b", 4, 1, true);
  add(4, "1f1b", 4, 1, false);
  add(4, "1f1b", 8, 1, true);
  add(4, "gpipe", 4, 1, true);
  add(4, "zb-h1", 8, 1, false);
  add(2, "zb-h1", 4, 1, true, true);
  add(2, "interleaved", 4, 2, false);
  add(2, "interleaved", 4, 2, true);
  // Experts no token of a micro-batch went to are skipped, each micro-batch
  // others: a stage's backward of one must use its own routing, not that of
  // the forwards that ran since.
  add(2, "1f1b", 8, 1, false, false, "mixtral");
  add(2, "zb-h1", 8, 1, true, true, "mixtral");
  // Without checkpointing W reads the experts' inputs where forward left them (not copied).
  add(2, "zb-h1", 8, 1, false, false, "mixtral");
  for (const pp::Case& c : cases) {
    SECTION(c.describe()) {
      test::TempDir dir("strata-pipeline");
      const Assembled a = run_case(c, dir, c.pp);
      const Reference ref = reference(c);
      if (c.family == "mixtral") {
        INFO(ref.expert_windows << " of " << ref.expert_windows_possible << " expert windows ran");
        CHECK(ref.expert_windows > 0);
        CHECK(ref.expert_windows < ref.expert_windows_possible);  // the premise: micro-batches skip experts
      }
      // zb-h1's W reads the Linear inputs in place unless checkpointing shares them.
      int64_t in_place = 0, copied = 0;
      for (const pp::Output& rank : a.ranks) {
        std::istringstream line(rank.stats.back());
        std::string field;
        std::vector<std::string> fields;
        while (line >> field) fields.push_back(field);
        REQUIRE(fields.size() == 8);
        in_place += std::stoll(fields[5]);
        copied += std::stoll(fields[6]);
      }
      CAPTURE(in_place, copied);
      if (c.schedule != "zb-h1") {
        CHECK(in_place + copied == 0);
      } else if (c.checkpoint) {
        CHECK((in_place == 0 && copied > 0));
      } else {
        CHECK((in_place > 0 && copied == 0));
      }
      // The loss: the same per-token sums, added in the same order.
      for (const pp::Output& rank : a.ranks) {
        REQUIRE(rank.steps.size() == 1);
        CHECK(rank.steps[0].loss == ref.loss);
      }
      // Every tensor is held, by exactly one stage (a tied embedding by two,
      // whose copies agree bit for bit).
      REQUIRE(a.tensors.size() == ref.grads.size());
      CHECK(a.copies_differ == 0);
      for (const auto& [name, grad] : ref.grads) {
        CAPTURE(name);
        REQUIRE(a.tensors.contains(name));
        const std::vector<float>& got = a.tensors.at(name);
        REQUIRE(got.size() == grad.size());
        const bool tied_embedding = c.tied && name == "model.embed_tokens.weight";
        int most = 0, least = 2;
        for (int w : a.writers.at(name)) most = std::max(most, w), least = std::min(least, w);
        CHECK(least == (tied_embedding ? 2 : 1));
        CHECK(most == least);
        double max_diff = 0, max_ref = 0;
        bool identical = true;
        for (size_t i = 0; i < got.size(); ++i) {
          identical = identical && std::memcmp(&got[i], &grad[i], sizeof(float)) == 0;
          max_diff = std::max(max_diff, static_cast<double>(std::fabs(got[i] - grad[i])));
          max_ref = std::max(max_ref, static_cast<double>(std::fabs(grad[i])));
        }
        INFO("max |pipeline - resident| = " << max_diff << " of max " << max_ref);
        if (tied_embedding) {
          CHECK(max_diff <= 1e-6 * max_ref);  // two partial sums added in another order
        } else {
          CHECK(identical);
        }
      }
    }
  }
}

TEST_CASE("pipeline with ZeRO over each stage's dp group, and tp inside each stage: one resident rank's training",
          "[pipeline][multiprocess][zero]") {
  struct ZeroCase {
    pp::Case c;
    int dp = 1;
  };
  std::vector<ZeroCase> cases;
  const auto add = [&](int p, int dp, int tp, const std::string& schedule, int m, int v, bool tied, int stage,
                       const std::string& params, const std::string& optimizer, bool checkpoint = false,
                       const std::string& family = "llama") {
    ZeroCase z;
    z.dp = dp;
    pp::Case& c = z.c;
    c.pp = p;
    c.tp = tp;
    c.schedule = schedule;
    c.micro_batches = m;
    c.virtual_stages = v;
    c.tied = tied;
    c.engine = "zero";
    c.zero_stage = stage;
    c.params = params;
    c.optimizer = optimizer;
    c.checkpoint = checkpoint;
    c.family = family;
    c.steps = 3;
    cases.push_back(z);
  };
  add(2, 2, 1, "1f1b", 2, 1, true, 3, "nvme", "nvme");
  add(2, 2, 1, "zb-h1", 4, 1, false, 3, "nvme", "nvme");
  // Every schedule over pp 2 x dp 2 at stage 3 with parameters and optimizer on NVMe.
  add(2, 2, 1, "gpipe", 2, 1, false, 3, "nvme", "nvme");
  add(2, 2, 1, "interleaved", 2, 2, false, 3, "nvme", "nvme");
  add(2, 2, 1, "interleaved", 2, 2, true, 2, "device", "cpu");
  add(2, 1, 1, "gpipe", 4, 1, true, 1, "device", "cpu", true);
  add(2, 1, 2, "1f1b", 4, 1, true, 3, "cpu", "cpu");
  add(2, 1, 2, "zb-h1", 4, 1, false, 2, "device", "nvme", false, "qwen3");
  add(4, 1, 1, "1f1b", 4, 1, true, 3, "nvme", "nvme");
  // A mixture of experts: the experts run within a stage, split over its 2
  // dp ranks by expert parallelism (each holds 2 of the 4).
  add(2, 2, 1, "1f1b", 2, 1, false, 3, "cpu", "cpu", false, "mixtral");
  cases.back().c.ep = 2;
  add(2, 1, 1, "zb-h1", 4, 1, true, 2, "device", "nvme", false, "mixtral");
  // ZeRO-3 keeps a stage's parameters gathered for the step's micro-batches
  // while they fit stage3_max_reuse_distance (the cases above: each
  // gathered once per step); with 0 it gathers them for every use.
  add(2, 2, 1, "1f1b", 4, 1, true, 3, "cpu", "cpu");
  cases.back().c.reuse_distance = 0;
  for (const ZeroCase& z : cases) {
    const pp::Case& c = z.c;
    SECTION(c.describe() + (z.dp > 1 ? fmt::format(" x dp {}", z.dp) : "") + " " + c.family) {
      test::TempDir dir("strata-pipeline-zero");
      const Assembled a = run_case(c, dir, c.pp * z.dp * c.tp);
      zero::ResidentSpec spec;
      spec.steps = c.steps;
      spec.config = pp::model_config(c);
      spec.model.checkpoint_activations = c.checkpoint;
      spec.init_seed = pp::kInitSeed;
      spec.init_std = pp::kInitStd;
      spec.adam.lr = 1e-2f;
      spec.adam.weight_decay = 0.01f;
      spec.adam.eps = 1.0f;
      spec.batches = [&](int step, int64_t vocab) {
        pp::Batch b = pp::corpus(step, c.sequences, vocab);
        return zero::Batch{b.ids, b.targets, {}};
      };
      const zero::TrainResult ref = zero::train_resident(spec);
      for (const pp::Output& rank : a.ranks) {
        REQUIRE(rank.steps.size() == static_cast<size_t>(c.steps));
        for (int step = 0; step < c.steps; ++step) {
          CAPTURE(rank.rank, step);
          CHECK(rank.steps[static_cast<size_t>(step)].loss == Approx(ref.losses[static_cast<size_t>(step)]).epsilon(1e-6));
          CHECK(rank.steps[static_cast<size_t>(step)].norm ==
                Approx(ref.grad_norms[static_cast<size_t>(step)]).epsilon(1e-6));
        }
      }
      if (c.zero_stage == 3) {
        for (const pp::Output& rank : a.ranks) {
          // The last step's allgathers (its trace recorded in the first).
          std::istringstream last(rank.stats.back());
          std::string field;
          std::vector<std::string> fields;
          while (last >> field) fields.push_back(field);
          const int64_t gathers = std::stoll(fields.back());
          CAPTURE(rank.rank, gathers, rank.held);
          if (c.reuse_distance == 0) {
            CHECK(gathers >= c.micro_batches * rank.held);
          } else if (c.family == "mixtral") {
            CHECK(gathers <= rank.held);  // experts another ep member holds, or none routed to, are never gathered
          } else {
            CHECK(gathers == rank.held);
          }
        }
      }
      // Copies of one element on several ranks (tp replicas, a tied
      // embedding's two stages) agree bit for bit; every element is someone's.
      CHECK(a.copies_differ == 0);
      REQUIRE(a.tensors.size() == ref.names.size());
      double worst = 0;
      for (size_t p = 0; p < ref.names.size(); ++p) {
        const std::string& name = ref.names[p];
        CAPTURE(name);
        REQUIRE(a.tensors.contains(name));
        const std::vector<float>& got = a.tensors.at(name);
        REQUIRE(got.size() == ref.params[p].size());
        for (int w : a.writers.at(name)) REQUIRE(w >= 1);
        for (size_t i = 0; i < got.size(); ++i) {
          worst = std::max(worst, static_cast<double>(std::fabs(got[i] - ref.params[p][i])));
        }
      }
      INFO("max |pipeline - one resident rank| over the parameters = " << worst);
      CHECK(worst <= 2e-6);
    }
  }
}
