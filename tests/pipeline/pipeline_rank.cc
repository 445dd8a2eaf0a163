// The rank program of the multi-process pipeline tests
// (pipeline_multiprocess_test.cc), one process per rank under `strata run`:
// joins the rendezvous from the launcher's environment, makes its process
// groups (world = pp x dp x tp), builds its stage's models
// (pipeline::make_stage_models) on a ResidentEngine (one step: the
// gradients) or a ZeroEngine (--steps of AdamW: the final parameters), runs
// each step through the PipelineExecutor on its dp rank's share of the batch
// and writes OUT/rank<R>.txt (pipeline_case.h).
//
//   pipeline_rank --out DIR [--nvme DIR] [--timeout-ms MS] <Case flags>
//
// Exit codes: 0 trained and wrote the file, 2 bad arguments, 3 an error was
// raised (printed as "pipeline rank program failed: <what>").
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "core/accelerator.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "partition/process_groups.h"
#include "partition/rendezvous.h"
#include "runtime/engine/resident_engine.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/nn/param_files.h"
#include "runtime/pipeline/executor.h"
#include "runtime/train/zero_config.h"
#include "tests/pipeline/pipeline_case.h"

namespace {
using namespace strata;
namespace pp = strata::test::pp;

struct Args {
  std::filesystem::path out, nvme;
  int timeout_ms = 30000;
  pp::Case c;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    STRATA_CHECK(i + 1 < argc, kBadArgument, "{} needs a value", flag);
    const std::string value = argv[++i];
    if (flag == "--out") {
      a.out = value;
    } else if (flag == "--nvme") {
      a.nvme = value;
    } else if (flag == "--timeout-ms") {
      a.timeout_ms = std::stoi(value);
    } else if (!a.c.parse(flag, value)) {
      strata::raise(ErrorCategory::kBadArgument, "unknown flag {}", flag);
    }
  }
  STRATA_CHECK(!a.out.empty(), kBadArgument, "--out is required");
  return a;
}

Tier tier_of(const std::string& name) {
  if (name == "device") return Tier::kDevice;
  if (name == "cpu") return Tier::kCpu;
  if (name == "nvme") return Tier::kNvme;
  strata::raise(ErrorCategory::kBadArgument, "unknown tier {}", name);
}

// ZeRO as the engine tests run it against one resident rank: Adam's eps 1
// (rounding-size gradient differences stay rounding-sized in the weights),
// several buckets per backward, one optimizer thread.
engine::ZeroEngineOptions zero_options(const pp::Case& c, const std::filesystem::path& nvme) {
  engine::ZeroEngineOptions o;
  o.stage = c.zero_stage;
  o.adam.lr = 1e-2f;
  o.adam.weight_decay = 0.01f;
  o.adam.eps = 1.0f;
  o.reduce_bucket_numel = 3000;
  o.persistence_threshold_numel = 0;
  o.optimizer_threads = 1;
  o.param_tier = tier_of(c.params);
  o.optimizer_tier = tier_of(c.optimizer);
  if (o.param_tier == Tier::kNvme || o.optimizer_tier == Tier::kNvme) o.nvme_path = nvme;
  if (c.reuse_distance >= 0) o.max_reuse_distance_numel = c.reuse_distance;
  return o;
}

int run(const Args& args) {
  const partition::RankInfo info = partition::RankInfo::from_env();
  const pp::Case& c = args.c;
  ops::set_cpu_threads(1);  // several ranks on 2 cores; the kernels give the same bits with any thread count
  const std::chrono::milliseconds timeout(args.timeout_ms);
  partition::Rendezvous rendezvous(info, timeout);
  auto accelerator = make_cpu_accelerator();
  const partition::ParallelLayout layout(info.world_size, c.tp, c.ep, c.pp);
  const int dp = layout.dp_size(), dp_rank = layout.dp_rank(info.rank);
  const pipeline::ScheduleSpec spec = c.spec();
  const nn::DecoderConfig config = pp::model_config(c);
  nn::DecoderModelOptions model_options = nn::model_options(DType::kF32, 16);
  model_options.checkpoint_activations = c.checkpoint;

  std::unique_ptr<engine::Engine> eng;
  train::ZeroCommunicators comms;
  std::unique_ptr<partition::Communicator> resident_pp;
  partition::Communicator* pipe = nullptr;
  if (c.engine == "resident") {
    STRATA_CHECK(dp == 1 && c.tp == 1, kBadArgument, "the resident engine runs pp alone");
    partition::CommunicatorOptions options;
    options.rank = info.rank;
    options.world_size = info.world_size;
    options.timeout = timeout;
    options.prefix = "test/pipeline";
    resident_pp = partition::make_group_communicator(*accelerator, rendezvous.store(), options,
                                                     layout.group_of(partition::GroupKind::kPipeline, info.rank));
    pipe = resident_pp.get();
    eng = std::make_unique<engine::ResidentEngine>(*accelerator);
  } else {
    comms = train::make_zero_communicators(*accelerator, rendezvous.store(), info.rank, info.world_size, timeout,
                                           "test/pipeline", c.ep, c.tp, c.pp);
    pipe = comms.pipeline.get();
    engine::ZeroEngineOptions options = zero_options(c, args.nvme);
    options.expert_parallel_size = c.ep;
    eng = std::make_unique<engine::ZeroEngine>(*accelerator, comms.comms(), options);
  }
  auto models = pipeline::make_stage_models(*eng, config, model_options, spec, *pipe);
  eng->finalize();
  for (const auto& model : models) nn::initialize_parameters(*eng, model->parameters(), pp::kInitSeed, pp::kInitStd);
  std::vector<nn::DecoderModel*> chunks;
  for (const auto& model : models) chunks.push_back(model.get());
  pipeline::PipelineExecutor executor(*eng, *pipe, spec, chunks);

  pp::Output out;
  out.rank = info.rank;
  out.stage = layout.pp_rank(info.rank);
  out.dp = dp_rank;
  out.tp = layout.tp_rank(info.rank);
  STRATA_CHECK(c.sequences % (dp * c.micro_batches) == 0, kBadArgument,
               "{} dp ranks x {} micro-batches do not divide {} sequences", dp, c.micro_batches, c.sequences);
  const int64_t per_rank = c.sequences / dp, per_micro = per_rank / c.micro_batches;
  auto* zero = dynamic_cast<engine::ZeroEngine*>(eng.get());
  for (int step = 0; step < c.steps; ++step) {
    const pp::Batch batch = pp::corpus(step, c.sequences, config.vocab_size);
    const size_t first = static_cast<size_t>(dp_rank * per_rank * pp::kSeq);
    const size_t rows = static_cast<size_t>(per_rank * pp::kSeq);
    double count = pp::counted(batch.targets.data() + first, rows);
    if (zero != nullptr) count = zero->global_sum(count);
    const int64_t gathers_before = zero != nullptr ? zero->gathers_issued() : 0;
    const auto micro_batch = [&](int i) {
      const size_t at = first + static_cast<size_t>(i * per_micro * pp::kSeq), n = static_cast<size_t>(per_micro * pp::kSeq);
      return pipeline::MicroBatch{std::span<const int32_t>(batch.ids).subspan(at, n),
                                  std::span<const int32_t>(batch.targets).subspan(at, n),
                                  {},
                                  per_micro,
                                  pp::kSeq};
    };
    nn::ForwardOptions forward;
    forward.normalizer = count;
    if (zero == nullptr) eng->zero_grad();
    const pipeline::StepStats stats = executor.run(micro_batch, forward);
    double loss = stats.loss_sum;
    if (zero != nullptr) loss = zero->global_sum(loss);
    double norm = 0;
    if (zero != nullptr) norm = zero->step(1e-2f).grad_norm;
    out.steps.push_back({loss / count, norm});
    std::string slots;
    for (int s : stats.slots) slots += (slots.empty() ? "" : ",") + std::to_string(s);
    out.stats.push_back(fmt::format("{} {} {} {} {} {} {} {}", step, stats.busy_seconds, stats.step_seconds, slots,
                                    stats.activation_nbytes, stats.weight_inputs_in_place, stats.weight_inputs_copied,
                                    zero != nullptr ? zero->gathers_issued() - gathers_before : 0));
  }
  out.held = eng->parameter_count();
  eng->compute_stream().synchronize();  // the last step's gradients (resident: read below) are final
  // Every tensor this rank holds, whole (tp shards placed by their slices).
  for (engine::ParamId id = 0; id < eng->parameter_count(); ++id) {
    const engine::ParamInfo& p = eng->param_info(id);
    const std::string& name = p.slice ? p.slice->tensor : p.name;
    out.tensors[name] = p.slice ? shape_numel(p.slice->tensor_shape) : p.numel();
    const auto add_runs = [&](int64_t first, const float* values, int64_t n) {
      nn::for_each_tensor_run(p, first, n, [&](int64_t at, int64_t from, int64_t count) {
        out.runs.push_back({name, at, std::vector<float>(values + (from - first), values + (from - first) + count)});
      });
    };
    if (zero == nullptr) {
      auto& resident = static_cast<engine::ResidentEngine&>(*eng);
      const TensorView g = resident.grad_storage(id);
      add_runs(0, g.as<float>(), g.numel());
    } else {
      eng->for_each_owned_range(id, engine::Engine::Access::kRead, [&](int64_t at, const TensorView& host) {
        add_runs(at, host.as<float>(), host.numel());
      });
    }
  }
  std::filesystem::create_directories(args.out);
  pp::write_output(args.out / ("rank" + std::to_string(info.rank) + ".txt"), out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline rank program: %s\n", e.what());
    return 2;
  }
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline rank program failed: %s\n", e.what());
    return 3;
  }
}
