// strata-train --zero: see zero_bench.h; formulas in PERFORMANCE.md.
#include "bench/strata-train/zero_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "bench/common/json_output.h"
#include "bench/common/stats.h"
#include "bench/strata-train/drive_bandwidth.h"
#include "kernels/ops.h"
#include "partition/communicator.h"
#include "partition/rendezvous.h"
#include "partition/store.h"
#include "core/accelerator.h"
#include "core/directory_lock.h"
#include "core/error.h"
#include "core/log.h"
#include "core/trace_recorder.h"
#include "runtime/engine/resident_engine.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/pipeline/executor.h"
#include "runtime/train/micro_batch_order.h"
#include "runtime/train/run_report.h"
#include "runtime/train/zero_config.h"

namespace strata::bench::train {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
constexpr auto kTimeout = std::chrono::milliseconds(600'000);  // a slow step on a loaded machine is not a dead peer

// Sums of small f64 vectors over ranks, on a communicator and stream of the
// bench's own (the engine's control communicator belongs to the engine).
class RankSum {
 public:
  RankSum(Accelerator& accelerator, partition::StoreClient& store, int rank, int world)
      : accelerator_(accelerator), rank_(rank), world_(world), stream_(accelerator.create_stream()) {
    partition::CommunicatorOptions o;
    o.rank = rank;
    o.world_size = world;
    o.timeout = kTimeout;
    o.prefix = "strata-train/bench";
    comm_ = partition::make_communicator(accelerator, store, o);
  }
  std::vector<double> sum(std::vector<double> values) {
    const size_t nbytes = values.size() * sizeof(double);
    void* device = accelerator_.allocate(nbytes);
    try {
      accelerator_.copy_async(device, values.data(), nbytes, CopyKind::kHostToDevice, *stream_);
      comm_->allreduce(device, device, values.size(), DType::kF64, partition::ReduceOp::kSum, *stream_);
      accelerator_.copy_async(values.data(), device, nbytes, CopyKind::kDeviceToHost, *stream_);
      stream_->synchronize();
    } catch (...) {
      accelerator_.deallocate(device);
      throw;
    }
    accelerator_.deallocate(device);
    return values;
  }
  // Every rank's `value`, indexed by rank.
  std::vector<double> each(double value) {
    std::vector<double> v(static_cast<size_t>(world_), 0.0);
    v[static_cast<size_t>(rank_)] = value;
    return sum(std::move(v));
  }
  double max(double value) {
    const auto v = each(value);
    return *std::max_element(v.begin(), v.end());
  }
  void barrier() { sum({0.0}); }

 private:
  Accelerator& accelerator_;
  int rank_, world_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<partition::Communicator> comm_;
};

// One ZeRO step as rank 0 saw it.
struct StepFigures {
  double step = 0, compute = 0, stall = 0, rank_wait = 0, grad_wait = 0, optimizer = 0, other = 0, loss = 0;
  // The optimizer overlapping backward: its thread's time before step() (kept
  // work only), the part of `optimizer` spent waiting for that thread, and of
  // the optimizer's own time the share compute waited for.
  double optimizer_hidden = 0, optimizer_drain = 0, optimizer_not_hidden = 1, sub_groups_overlapped = 0, sub_groups = 0;
  double grad_norm = 0;
  bool clipped = false;  // --gradient-clipping fired (the global norm above it)
  bool speculated = false, read_ahead = false, rolled_back = false;  // the optimizer thread's mode, and its redo
  double sub_groups_read_ahead = 0;
  double sub_groups_prefetched = 0;  // speculated: state read before the gradient was final
  double nvme_read = 0, nvme_written = 0, param_read = 0, gathered = 0;  // bytes
  double peak_gathered = 0;  // most bytes of full parameters gathered at once (this rank)
  std::vector<engine::OpStall> ops;
  std::vector<offload::LayerFetch> layers;  // stage 3: the step by decoder layer
};

// Field by field medians of a round's steps.
StepFigures median_of(const std::vector<StepFigures>& steps) {
  const auto med = [&](double StepFigures::*field) {
    std::vector<double> v;
    for (const auto& s : steps) v.push_back(s.*field);
    return median(v);
  };
  StepFigures m;
  for (double StepFigures::*f : {&StepFigures::step, &StepFigures::compute, &StepFigures::stall, &StepFigures::rank_wait,
                                 &StepFigures::grad_wait, &StepFigures::optimizer, &StepFigures::other,
                                 &StepFigures::loss, &StepFigures::nvme_read, &StepFigures::nvme_written,
                                 &StepFigures::param_read, &StepFigures::gathered, &StepFigures::peak_gathered,
                                 &StepFigures::optimizer_hidden,
                                 &StepFigures::optimizer_drain, &StepFigures::optimizer_not_hidden,
                                 &StepFigures::sub_groups_overlapped, &StepFigures::sub_groups}) {
    m.*f = med(f);
  }
  return m;
}

struct Round {
  StepFigures zero;           // rank 0, medians over the round's steps
  double resident = 0;        // the same step resident: max over ranks of their medians
  double drive_bytes = 0;     // parameter bytes read per step by the ranks sharing a drive
  double io_bound = 0, bound = 0, ratio = 0;
  double worst_stall = 0;     // max over ranks of their median stall
  std::vector<double> losses; // rank 0's ZeRO losses in this round
  double unoffloaded = 0;     // --vs-unoffloaded: the same stage with nothing offloaded (rank 0's median)
};

Tier param_tier(const std::string& s) { return s == "nvme" ? Tier::kNvme : s == "cpu" ? Tier::kCpu : Tier::kDevice; }
// none: the optimizer on the accelerator (its state in accelerator memory);
// cpu and nvme: the CPU Adam with state in host memory or swapped from NVMe.
Tier optimizer_tier(const std::string& s) { return s == "nvme" ? Tier::kNvme : s == "cpu" ? Tier::kCpu : Tier::kDevice; }

}  // namespace

nn::DecoderModelOptions model_options(const ModelRun& run) {
  nn::DecoderModelOptions o;
  o.dtype = parse_dtype(run.dtype);
  o.checkpoint_activations = run.checkpoint_activations || run.cpu_checkpointing;
  o.cpu_checkpointing = run.cpu_checkpointing;
  o.skip_unrouted_experts = run.skip_unrouted_experts;
  return o;
}

nn::DecoderModelOptions model_options(const ModelRun& run, const ZeroFlags& flags) {
  nn::DecoderModelOptions o = model_options(run);
  o.context_method = nn::parse_context_method(flags.context_method, "--cp-method");
  return o;
}

namespace {

struct RankSetup {
  int rank = 0, world = 1, ranks_per_drive = 1;
  bool processes = false;
};

// The global batch: dp x batch sequences of random tokens (dp = world / cp),
// each target the next token; the same every step (so the loss falls as the
// model learns it). This rank's share is rows [d * batch, (d + 1) * batch) of
// its dp rank d = rank / cp: the members of a cp group take the same rows (the
// model takes its chunks of them).
void rank_batch(const ModelRun& run, const RankSetup& r, int cp, std::vector<int32_t>& ids,
                std::vector<int32_t>& targets) {
  std::mt19937 gen(1);
  const auto vocab = static_cast<uint32_t>(run.config.vocab_size);
  ids.clear();
  targets.clear();
  for (int64_t s = 0; s < run.batch * (r.world / cp); ++s) {
    std::vector<int32_t> tokens(static_cast<size_t>(run.seq + 1));
    for (auto& t : tokens) t = static_cast<int32_t>(gen() % vocab);
    if (s / run.batch != r.rank / cp) continue;
    ids.insert(ids.end(), tokens.begin(), tokens.end() - 1);
    targets.insert(targets.end(), tokens.begin() + 1, tokens.end());
  }
}

void print_header(const ModelRun& run, const ZeroFlags& flags, const engine::ZeroEngineOptions& o,
                  const RankSetup& r, double param_count, size_t param_nbytes) {
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  fmt::print("strata-train --zero {}: {} rank(s) ({}) | params on {}, optimizer state on {}, gradients on {}{} | hidden {} inter {} "
             "layers {} heads {}/{} vocab {} | {} x {} sequences of {} tokens per step (dp ranks x --batch) | {} | {} threads per rank | "
             "OPENBLAS_CORETYPE={} | OpenBLAS core {}\n",
             o.stage, r.world, r.processes ? "processes" : "threads", tier_name(o.param_tier),
             tier_name(o.optimizer_tier), tier_name(o.grad_tier),
             o.param_tier == Tier::kNvme || o.optimizer_tier == Tier::kNvme || o.grad_tier == Tier::kNvme
                 ? " under " + flags.nvme_dir
                 : "",
             run.config.hidden_size, run.config.intermediate_size, run.config.num_hidden_layers,
             run.config.num_attention_heads, run.config.num_key_value_heads, run.config.vocab_size,
             r.world / flags.context_parallel, run.batch, run.seq, run.dtype, run.threads, coretype != nullptr ? coretype : "(unset)",
             run.accelerator == "cpu" ? ops::cpu_blas_core() : "-");
  if (run.config.moe()) {
    fmt::print("experts: {} per layer of width {}, top {} | {}\n", run.config.num_experts,
               run.config.moe_intermediate_size, run.config.num_experts_per_tok,
               run.skip_unrouted_experts ? "routed fetch: experts no rank routed a token to are not fetched"
                                         : "--all-experts: every expert fetched every step");
  }
  fmt::print("parameters {:.1f} M ({:.1f} MiB) | sub-group {} / reduce bucket {} elements ({}) | prefetch bucket {} "
             "/ max live {} / reuse distance {} elements | {} staging buffers | aio: {} x {} KiB, queue depth {}, {} "
             "thread(s)\n",
             param_count / 1e6, static_cast<double>(param_nbytes) / (1 << 20), o.sub_group_numel,
             o.reduce_bucket_numel,
             flags.engine.sub_group_numel == engine::kChooseFromModel ||
                     flags.engine.reduce_bucket_numel == engine::kChooseFromModel
                 ? "chosen from the model's layers: see the \"ZeRO sizes\" log line"
                 : "as given",
             o.prefetch_bucket_numel,
             o.max_live_parameters_numel, o.max_reuse_distance_numel, o.param_buffer_count,
             nvme::engine_kind_name(o.aio.engine), o.aio.block_size >> 10, o.aio.queue_depth, o.aio.thread_count);
}

double mib(double bytes) { return bytes / (1 << 20); }

}  // namespace

engine::ZeroEngineOptions zero_options(const ModelRun& run, const ZeroFlags& flags) {
  engine::ZeroEngineOptions o = flags.engine;
  o.stage = flags.stage;
  o.param_tier = param_tier(flags.offload_param);
  o.optimizer_tier = optimizer_tier(flags.offload_optimizer);
  o.grad_tier = flags.offload_grad == "nvme" || (flags.offload_grad == "auto" && o.optimizer_tier == Tier::kNvme)
                    ? Tier::kNvme
                    : Tier::kDevice;
  const bool nvme = o.param_tier == Tier::kNvme || o.optimizer_tier == Tier::kNvme || o.grad_tier == Tier::kNvme;
  if (nvme) o.nvme_path = std::filesystem::path(flags.nvme_dir) / "strata-train-swap";
  o.adam.lr = flags.lr;
  o.adam.weight_decay = 0.01f;
  o.optimizer_threads = run.threads;
  o.overlap_optimizer = flags.overlap_optimizer;
  o.expert_parallel_size = flags.expert_parallel;
  if (run.dtype == "fp16") o.loss_scaling = engine::LossScalerOptions{};
  o.validate();
  return o;
}

namespace {

// The whole benchmark on one rank; rank 0 prints and writes the JSON.
// Returns whether every check held.
bool run_rank(const ModelRun& run, const ZeroFlags& flags, const RankSetup& r, Accelerator& accelerator,
              partition::StoreClient& store) {
  const engine::ZeroEngineOptions o = zero_options(run, flags);

  const strata::train::ZeroCommunicators comms =
      strata::train::make_zero_communicators(accelerator, store, r.rank, r.world, kTimeout, "strata-train/zero",
                                             flags.expert_parallel, 1, 1, flags.context_parallel);
  RankSum ranks(accelerator, store, r.rank, r.world);
  engine::ZeroEngine eng(accelerator, comms.comms(), o);
  eng.set_overlap_policy(flags.overlap_policy == "speculate"    ? offload::OverlapPolicy::kSpeculate
                         : flags.overlap_policy == "read-ahead" ? offload::OverlapPolicy::kReadAhead
                                                                : offload::OverlapPolicy::kAuto);
  // The step's micro-batches one after another, or layer by layer through the pipeline executor.
  // auto as strata finetune chooses it (runtime/train/micro_batch_order.h).
  const bool keep_activations = flags.layer_major_activations == "keep";
  const std::optional<plan::OrderPlan> predicted_orders = strata::train::predict_run_orders(
      run.config, o.stage, o.param_tier, o.max_reuse_distance_numel, o.max_live_parameters_numel, run.batch, run.seq,
      flags.micro_batches, run.checkpoint_activations || run.cpu_checkpointing, r.world, r.world, keep_activations);
  strata::train::MicroBatchOrderContext order_context{
      o.param_tier, flags.micro_batches, 1, 1, flags.expert_parallel, false, run.config.tie_word_embeddings,
      run.config.moe() && run.config.output_router_logits};
  order_context.predicted = predicted_orders ? &*predicted_orders : nullptr;
  const strata::train::MicroBatchOrderChoice order =
      strata::train::choose_micro_batch_order(flags.micro_batch_order, "--micro-batch-order", order_context);
  const bool layer_major = order.order == strata::train::MicroBatchOrder::kLayerMajor;
  STRATA_CHECK(!layer_major || !flags.vs_unoffloaded, kBadArgument,
               "--vs-unoffloaded times step-major only: leave it out with --micro-batch-order layer-major");
  std::vector<std::unique_ptr<nn::DecoderModel>> models;
  if (layer_major) {
    models = pipeline::make_layer_models(eng, run.config, model_options(run));
  } else {
    models.push_back(std::make_unique<nn::DecoderModel>(eng, run.config, model_options(run, flags)));
  }
  nn::DecoderModel& model = *models.front();
  eng.finalize();
  for (const auto& m : models) nn::initialize_parameters(eng, m->parameters(), 0);
  std::unique_ptr<pipeline::PipelineExecutor> executor;
  if (layer_major) {
    std::vector<nn::DecoderModel*> chunks;
    for (const auto& m : models) chunks.push_back(m.get());
    executor = std::make_unique<pipeline::PipelineExecutor>(
        eng, pipeline::ScheduleSpec{pipeline::ScheduleKind::kLayerMajor, 1, flags.micro_batches,
                                    static_cast<int>(chunks.size())},
        chunks, pipeline::BoundaryHome::kDevice, pipeline::BoundaryNvme{},
        keep_activations ? pipeline::LayerActivations::kKeep : pipeline::LayerActivations::kRecompute);
  }
  if (r.rank == 0) {
    fmt::print("micro-batches per step: {}, {}{}{}\n", flags.micro_batches,
               strata::train::micro_batch_order_name(order.order),
               layer_major ? fmt::format(", activations {}", flags.layer_major_activations) : std::string(),
               order.said.empty() ? "" : " (" + order.said + ")");
  }
  // --vs-unoffloaded: the same stage and budgets with parameters and
  // optimizer state on the device, trained alongside (its own communicators),
  // to tell what offloading costs from what ZeRO costs.
  const bool offloaded = o.param_tier != Tier::kDevice || o.optimizer_tier != Tier::kDevice;
  std::optional<strata::train::ZeroCommunicators> plain_comms;
  std::unique_ptr<engine::ZeroEngine> plain;
  std::unique_ptr<nn::DecoderModel> plain_model;
  if (flags.vs_unoffloaded && offloaded) {
    engine::ZeroEngineOptions po = o;
    po.param_tier = Tier::kDevice;
    po.optimizer_tier = Tier::kDevice;
    po.grad_tier = Tier::kDevice;
    plain_comms.emplace(strata::train::make_zero_communicators(accelerator, store, r.rank, r.world, kTimeout,
                                                               "strata-train/unoffloaded", flags.expert_parallel));
    plain = std::make_unique<engine::ZeroEngine>(accelerator, plain_comms->comms(), po);
    plain_model = std::make_unique<nn::DecoderModel>(*plain, run.config, model_options(run));
    plain->finalize();
    nn::initialize_parameters(*plain, plain_model->parameters(), 0);
  }
  // The same step with everything resident: this rank's micro-batch on a
  // ResidentEngine with the same weights (no partitioning, no offload, no
  // gradient reduction, no optimizer), all ranks at once as in the ZeRO step.
  // --no-resident: none (peak host RSS is then the ZeRO engine's alone).
  std::unique_ptr<engine::ResidentEngine> resident;
  std::unique_ptr<nn::DecoderModel> resident_model;
  if (!flags.no_resident) {
    resident = std::make_unique<engine::ResidentEngine>(accelerator);
    resident_model = std::make_unique<nn::DecoderModel>(*resident, run.config, model_options(run));
    resident->finalize();
    nn::initialize_parameters(*resident, resident_model->parameters(), 0);
  }

  std::vector<int32_t> ids, targets;
  rank_batch(run, r, flags.context_parallel, ids, targets);
  // A cp group's members hold the same rows: each counts 1/cp of them.
  const double local_count = static_cast<double>(targets.size()) / flags.context_parallel;
  const double global_tokens = local_count * r.world * flags.micro_batches;
  size_t param_nbytes = 0;
  double param_count = 0;
  for (engine::ParamId id = 0; id < eng.parameter_count(); ++id) {
    param_nbytes += eng.param_info(id).nbytes();
    param_count += static_cast<double>(eng.param_info(id).numel());
  }
  if (r.rank == 0) print_header(run, flags, eng.options(), r, param_count, param_nbytes);
  if (r.rank == 0 && flags.context_parallel > 1) {
    fmt::print("context parallelism ({}): {} cp group(s) of {} ranks, each rank 2 chunks of {} tokens of every "
               "sequence; ZeRO over dp {} x cp {}\n",
               flags.context_method, r.world / flags.context_parallel, flags.context_parallel,
               run.seq / (2 * flags.context_parallel), r.world / flags.context_parallel, flags.context_parallel);
  }

  // The drive's read bandwidth, measured by rank 0 while the others wait.
  std::vector<DriveBandwidth> drive;
  const auto probe_drive = [&] {
    if (o.param_tier != Tier::kNvme) return;
    ranks.barrier();
    DriveBandwidth bw;
    if (r.rank == 0) {
      bw = measure_read_bandwidth(accelerator, o.nvme_path, o.aio, static_cast<size_t>(flags.drive_test_mib) << 20);
    }
    bw.read_bytes_per_s = ranks.sum({bw.read_bytes_per_s})[0];
    drive.push_back(bw);
  };

  bool activations_said = false;
  const auto zero_step = [&](engine::ZeroEngine& z, nn::DecoderModel& zm, pipeline::PipelineExecutor* layers) {
    StepFigures f;
    trace::Span span("phase", "zero step");  // --trace
    const auto start = Clock::now();
    const double read0 = static_cast<double>(z.nvme_bytes_read());
    const double written0 = static_cast<double>(z.nvme_bytes_written());
    const double global_count = z.global_sum(local_count * flags.micro_batches);
    nn::ForwardOptions forward;
    forward.normalizer = global_count;
    forward.grad_scale = z.loss_scale();
    double loss_sum = 0;
    // The micro-batches (each this rank's same tokens), their gradients accumulated.
    trace::Span phase("phase", layers != nullptr ? "layer-major forwards and backwards" : "forwards and backwards");
    if (layers != nullptr) {
      // Each layer's gradient is final after its m backwards: its update overlaps the backwards of the layers below.
      if (flags.overlap_optimizer) z.prepare_step(flags.lr, flags.micro_batches);
      const pipeline::StepStats stats =
          layers->run([&](int) { return pipeline::MicroBatch{ids, targets, {}, run.batch, run.seq}; }, forward);
      loss_sum = stats.loss_sum;
      if (!activations_said && r.rank == 0) {
        // The first step lays the activations out: each layer's working arenas (one, or one per micro-batch
        // with --layer-major-activations keep), and each micro-batch's boundaries.
        int arenas = 0;
        for (const int slots : stats.slots) arenas += slots;
        fmt::print("layer-major activations: {:.2f} MiB ({:.2f} MiB of working arenas, {} ({} in all); {:.2f} MiB of "
                   "layer-boundary activations and gradients, {} micro-batches); {} layer forwards run again for "
                   "backward per step\n",
                   static_cast<double>(stats.activation_nbytes) / (1 << 20),
                   static_cast<double>(stats.activation_nbytes - stats.boundary_nbytes) / (1 << 20),
                   keep_activations
                       ? "one per micro-batch of every layer and of the embedding, one the head's (its backward "
                         "follows its forward)"
                       : "one per layer, the embedding's and the head's",
                   arenas,
                   static_cast<double>(stats.boundary_nbytes) / (1 << 20), flags.micro_batches,
                   stats.recomputed_forwards);
      }
      activations_said = true;
    }
    for (int m = 0; layers == nullptr && m < flags.micro_batches; ++m) {
      // The optimizer may update each sub-group during the last backward, as soon as its gradient is final.
      if (flags.overlap_optimizer && m + 1 == flags.micro_batches) z.prepare_step(flags.lr);
      {
        trace::Span forward_phase("phase", "forward");
        zm.forward(ids, targets, run.batch, run.seq, forward);
      }
      trace::Span backward_phase("phase", "backward");
      zm.backward();
      loss_sum += zm.loss_stats().sum;
    }
    // Compute is done here, so step() waits only for the gradient tail.
    z.compute_stream().synchronize();
    phase.end();
    const double until_step = seconds_since(start);
    f.loss = z.global_sum(loss_sum) / global_count;
    f.rank_wait = seconds_since(start) - until_step;  // mostly: waiting for the slowest rank's compute
    trace::Span stepping("phase", "step()");
    const engine::StepResult stepped = z.step(flags.lr);
    stepping.end();
    f.step = seconds_since(start);
    const engine::PrefetchStats p = z.last_step_prefetch();
    // The last step's update overlapping this forward: what compute waited for it (the join before
    // backward, the stall of gathers behind it) is the optimizer's, not compute's or the prefetch's.
    const double update_stall = p.update_stall_seconds();
    const double update_wait = stepped.previous_update_wait_seconds;
    f.stall = p.param_stall_seconds() - update_stall;
    f.compute = until_step - p.param_stall_seconds() - (update_wait - update_stall);
    f.grad_wait = stepped.grad_wait_seconds;
    f.optimizer = stepped.optimizer_seconds + update_wait;
    f.optimizer_hidden = stepped.optimizer_overlapped_seconds +
                         std::max(0.0, stepped.previous_update_seconds - update_wait);
    f.optimizer_drain = stepped.optimizer_drain_seconds;
    f.optimizer_not_hidden = stepped.optimizer_not_hidden_fraction();
    f.sub_groups_overlapped = static_cast<double>(stepped.sub_groups_overlapped);
    f.sub_groups = static_cast<double>(stepped.sub_groups);
    f.grad_norm = stepped.grad_norm;
    f.speculated = stepped.overlap_mode == offload::OverlapMode::kSpeculate;
    f.read_ahead = stepped.overlap_mode == offload::OverlapMode::kReadAhead;
    f.rolled_back = stepped.rolled_back;
    f.sub_groups_read_ahead = static_cast<double>(stepped.sub_groups_read_ahead);
    f.sub_groups_prefetched = static_cast<double>(stepped.sub_groups_prefetched);
    f.clipped = o.gradient_clipping > 0 && stepped.grad_norm > o.gradient_clipping;
    f.other = f.step - f.compute - f.stall - f.rank_wait - f.grad_wait - f.optimizer;
    f.nvme_read = static_cast<double>(z.nvme_bytes_read()) - read0;
    f.nvme_written = static_cast<double>(z.nvme_bytes_written()) - written0;
    f.param_read = static_cast<double>(p.read_nbytes);
    f.gathered = static_cast<double>(p.gather_nbytes);
    f.peak_gathered = static_cast<double>(p.peak_gathered_nbytes);
    f.ops = p.op_stalls();
    f.layers = p.per_layer();
    return f;
  };
  double resident_loss = 0;
  const auto resident_step = [&] {
    if (!resident) return 0.0;
    trace::Span span("phase", "resident step");
    const auto start = Clock::now();
    resident->zero_grad();
    for (int m = 0; m < flags.micro_batches; ++m) {  // as many micro-batches as the ZeRO step's
      resident_model->forward(ids, targets, run.batch, run.seq);
      resident_model->backward();
      resident_loss = resident_model->loss();
    }
    return seconds_since(start);
  };

  probe_drive();
  std::vector<Round> rounds;
  std::vector<double> all_losses;
  std::map<std::pair<std::string, int>, std::pair<double, int64_t>> op_totals;  // (name, phase) -> seconds, windows
  std::vector<offload::LayerFetch> layer_totals;  // per layer slot (layer + 1), summed over the timed steps
  int timed_steps = 0, clipped_steps = 0, speculated_steps = 0, rolled_back_steps = 0, read_ahead_steps = 0;
  double read_ahead_sub_groups = 0, prefetched_sub_groups = 0;
  double max_norm = 0, min_norm = std::numeric_limits<double>::infinity();
  const std::string table_head = fmt::format(
      "{:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>9} {:>7} {:>9}", "round", "step s",
      "tok/s", "compute", "p.stall", "r.wait", "g.wait", "optim", "other", "nvme rd MB", "nvme wr MB", "resident",
      "io bound", "ratio", "loss");
  if (r.rank == 0) fmt::print("{}\n", table_head);
  // Rounds of `steps` ZeRO steps, then the same steps resident (all ranks at
  // once), so that load from outside hits both alike. The ZeRO steps run back
  // to back: each step's update overlaps the next one's forward
  // (overlap_next_forward), so the round's first step only follows another
  // untimed one, and the last one's update ends before the resident steps.
  for (int round = 0; round < run.rounds; ++round) {
    Round rd;
    std::vector<StepFigures> steps;
    std::vector<double> resident_s, unoffloaded_s;
    // The first step records the trace; later rounds warm the update overlapping the forward.
    const int warm = round == 0 ? std::max(run.warmup, 1) : o.overlap_next_forward ? 1 : 0;
    for (int s = 0; s < warm + run.steps; ++s) {
      ranks.barrier();
      StepFigures f = zero_step(eng, model, executor.get());
      all_losses.push_back(f.loss);
      rd.losses.push_back(f.loss);
      if (s < warm) continue;
      for (const auto& x : f.ops) {
        auto& t = op_totals[{x.name, static_cast<int>(x.phase)}];
        t.first += x.seconds;
        t.second += x.windows;
      }
      if (layer_totals.size() < f.layers.size()) layer_totals.resize(f.layers.size());
      for (size_t k = 0; k < f.layers.size(); ++k) {
        layer_totals[k] += f.layers[k];
        layer_totals[k].layer = f.layers[k].layer;
      }
      ++timed_steps;
      clipped_steps += f.clipped;
      speculated_steps += f.speculated;
      rolled_back_steps += f.rolled_back;
      read_ahead_steps += f.read_ahead;
      read_ahead_sub_groups += f.sub_groups_read_ahead;
      if (f.speculated) prefetched_sub_groups += f.sub_groups_prefetched;
      min_norm = std::min(min_norm, f.grad_norm);
      max_norm = std::max(max_norm, f.grad_norm);
      steps.push_back(std::move(f));
    }
    eng.join_update();
    if (plain) {
      for (int s = 0; s < warm + run.steps; ++s) {
        ranks.barrier();
        const double t = zero_step(*plain, *plain_model, nullptr).step;
        if (s >= warm) unoffloaded_s.push_back(t);
      }
      plain->join_update();
    }
    for (int s = 0; s < warm + run.steps; ++s) {
      ranks.barrier();
      const double resident_t = resident_step();  // the first lays out the arena: warmup too
      if (s >= warm) resident_s.push_back(resident_t);
    }
    rd.zero = median_of(steps);
    rd.worst_stall = ranks.max(rd.zero.stall);
    rd.drive_bytes = ranks.sum({rd.zero.param_read})[0] / (r.world / r.ranks_per_drive);
    rd.resident = ranks.max(median(resident_s));
    rd.unoffloaded = median(unoffloaded_s);
    rounds.push_back(std::move(rd));
  }
  probe_drive();
  // The resident model never steps: its loss is the initial weights' on this
  // rank's micro-batch; averaged over ranks (equal counts) it is the global
  // loss the ZeRO engine's first step saw.
  const double resident_global_loss = ranks.sum({resident_loss})[0] / r.world;
  const double loss_spread = ranks.max(all_losses.back()) + ranks.max(-all_losses.back());

  std::vector<double> bw;
  for (const auto& d : drive) bw.push_back(d.read_bytes_per_s);
  const double drive_bw = median(bw);
  for (Round& rd : rounds) {
    rd.io_bound = drive_bw > 0 ? rd.drive_bytes / drive_bw : 0;
    rd.bound = std::max(rd.resident, rd.io_bound);
    rd.ratio = rd.bound > 0 ? rd.zero.step / rd.bound : 0;  // 0: no bound (--no-resident, nothing on NVMe)
  }
  // Peak host RSS (VmHWM) of each rank's process after the rounds; ranks as
  // threads share one process, whose peak every rank reads.
  const std::vector<double> peak_rss = ranks.each(static_cast<double>(strata::train::peak_rss_nbytes()));
  const double max_peak_rss = *std::max_element(peak_rss.begin(), peak_rss.end());
  if (r.rank != 0) return true;

  // ---- report (rank 0) -----------------------------------------------------------------
  for (size_t k = 0; k < rounds.size(); ++k) {
    const Round& rd = rounds[k];
    const StepFigures& z = rd.zero;
    fmt::print("{:>5} {:>9.3f} {:>9.1f} {:>9.3f} {:>9.3f} {:>9.3f} {:>9.3f} {:>9.3f} {:>9.3f} {:>10.1f} {:>10.1f} "
               "{:>9.3f} {:>9.3f} {:>7.3f} {:>9.4f}\n",
               k, z.step, global_tokens / z.step, z.compute, z.stall, z.rank_wait, z.grad_wait, z.optimizer, z.other,
               z.nvme_read / 1e6, z.nvme_written / 1e6, rd.resident, rd.io_bound, rd.ratio, rd.losses.back());
  }
  const auto over_rounds = [&](auto get) {
    std::vector<double> v;
    for (const Round& rd : rounds) v.push_back(get(rd));
    return median(v);
  };
  const double step = over_rounds([](const Round& rd) { return rd.zero.step; });
  const double compute = over_rounds([](const Round& rd) { return rd.zero.compute; });
  const double stall = over_rounds([](const Round& rd) { return rd.zero.stall; });
  const double grad_wait = over_rounds([](const Round& rd) { return rd.zero.grad_wait; });
  const double rank_wait = over_rounds([](const Round& rd) { return rd.zero.rank_wait; });
  const double optimizer = over_rounds([](const Round& rd) { return rd.zero.optimizer; });
  const double optimizer_hidden = over_rounds([](const Round& rd) { return rd.zero.optimizer_hidden; });
  const double optimizer_drain = over_rounds([](const Round& rd) { return rd.zero.optimizer_drain; });
  const double not_hidden = over_rounds([](const Round& rd) { return rd.zero.optimizer_not_hidden; });
  const double overlapped = over_rounds([](const Round& rd) { return rd.zero.sub_groups_overlapped; });
  const double sub_groups_total = over_rounds([](const Round& rd) { return rd.zero.sub_groups; });
  const double other = over_rounds([](const Round& rd) { return rd.zero.other; });
  const double resident_step_s = over_rounds([](const Round& rd) { return rd.resident; });
  const double io_bound = over_rounds([](const Round& rd) { return rd.io_bound; });
  const double ratio = over_rounds([](const Round& rd) { return rd.ratio; });
  const double worst_stall = over_rounds([](const Round& rd) { return rd.worst_stall; });
  const double nvme_read = over_rounds([](const Round& rd) { return rd.zero.nvme_read; });
  const double nvme_written = over_rounds([](const Round& rd) { return rd.zero.nvme_written; });
  const double param_read = over_rounds([](const Round& rd) { return rd.zero.param_read; });
  const double gathered = over_rounds([](const Round& rd) { return rd.zero.gathered; });
  const double peak_gathered = over_rounds([](const Round& rd) { return rd.zero.peak_gathered; });
  const double drive_bytes = over_rounds([](const Round& rd) { return rd.drive_bytes; });
  const double bound = std::max(resident_step_s, io_bound);

  // Correctness: the first step's loss is the resident model's on the same
  // weights and batch, the loss is finite and falls, ranks agree on it.
  const bool finite = std::all_of(all_losses.begin(), all_losses.end(), [](double l) { return std::isfinite(l); });
  const bool matches = !resident || std::fabs(all_losses.front() - resident_global_loss) <=
                                         1e-4 * std::max(1.0, resident_global_loss);
  const bool falls = all_losses.back() < all_losses.front();
  const bool agree = loss_spread == 0;
  const bool ok = finite && matches && falls && agree;

  fmt::print("median: {:.3f} s/step, {:.1f} tok/s | compute {:.3f} s, stall on params {:.3f} s ({:.1f}%; worst rank "
             "{:.1f}%), waiting for the other ranks {:.3f} s, stall on gradients {:.3f} s, optimizer {:.3f} s, other "
             "{:.3f} s\n",
             step, global_tokens / step, compute, stall, 100 * stall / step, 100 * worst_stall / step, rank_wait,
             grad_wait, optimizer, other);
  // The optimizer's own time: what step() spent on it (less waiting for its
  // thread, which overlaps that thread's work) plus the thread's hidden time.
  const double optimizer_own = optimizer - optimizer_drain + optimizer_hidden;
  fmt::print("optimizer (rank 0): {:.3f} s of its own per step ({:.1f}% of the step) | {:.3f} s hidden behind "
             "backward and the next forward ({:.0f} of {} sub-groups during backward), {:.3f} s waited for (in "
             "step(), {:.3f} s of it draining the optimizer thread, and before backward) | not hidden: {:.1f}% of its "
             "time{}\n",
             optimizer_own, 100 * optimizer_own / step, optimizer_hidden, overlapped, sub_groups_total, optimizer,
             optimizer_drain, 100 * not_hidden,
             !flags.overlap_optimizer ? " (--no-overlap-optimizer)"
             : !o.overlap_next_forward ? " (--no-overlap-forward)"
                                       : "");
  fmt::print("gradient norm {:.3g} to {:.3g}; clipping at {:g} fired on {} of {} timed steps | the optimizer "
             "thread speculated on {} ({} redone; {:.1f} sub-groups' state read before their gradient was final "
             "per such step), read ahead on {} ({:.1f} sub-groups' state read during backward per such step)\n",
             min_norm, max_norm, o.gradient_clipping, clipped_steps, timed_steps, speculated_steps, rolled_back_steps,
             speculated_steps > 0 ? prefetched_sub_groups / speculated_steps : 0.0, read_ahead_steps,
             read_ahead_steps > 0 ? read_ahead_sub_groups / read_ahead_steps : 0.0);
  fmt::print("bytes per step (rank 0): NVMe read {:.1f} MB (parameters {:.1f} MB), NVMe written {:.1f} MB, "
             "parameters gathered {:.1f} MB (at most {:.1f} MB gathered at once)\n",
             nvme_read / 1e6, param_read / 1e6, nvme_written / 1e6, gathered / 1e6, peak_gathered / 1e6);
  if (!drive.empty()) {
    fmt::print("drive: {:.2f} GB/s sequential O_DIRECT read{} (median of {} probes of {:.0f} MiB, before and after "
               "the rounds); {:.1f} MB of parameters read per step by the {} rank(s) sharing it\n",
               drive_bw / 1e9, drive.front().direct ? "" : " (O_DIRECT refused: page cache)", drive.size(),
               mib(static_cast<double>(drive.front().file_nbytes)), drive_bytes / 1e6, r.ranks_per_drive);
  }
  if (resident) {
    fmt::print("bound: max(resident {:.3f} s, I/O {:.3f} s) = {:.3f} s | step / bound = {:.3f}x (median of the "
               "rounds' ratios)\n",
               resident_step_s, io_bound, bound, ratio);
  } else {
    fmt::print("bound: I/O {:.3f} s only (--no-resident: no resident step) | step / I/O bound = {}\n", io_bound,
               io_bound > 0 ? fmt::format("{:.3f}x", ratio) : std::string("-"));
  }
  fmt::print("peak host RSS (VmHWM): {:.1f} MB{}\n", max_peak_rss / 1e6,
             r.processes ? fmt::format(" (the largest rank process's; {} processes)", r.world)
                         : fmt::format(" (this process: {} rank threads{})", r.world,
                                       resident ? ", each with its resident reference model" : ""));
  const double unoffloaded = over_rounds([](const Round& rd) { return rd.unoffloaded; });
  const double offload_ratio = over_rounds([](const Round& rd) { return rd.zero.step / rd.unoffloaded; });
  if (unoffloaded > 0) {
    fmt::print("the same ZeRO-{} step with nothing offloaded: {:.3f} s | offloaded / not = {:.3f}x, not offloaded / "
               "resident = {:.3f}x\n",
               o.stage, unoffloaded, offload_ratio, resident ? unoffloaded / resident_step_s : 0.0);
  }
  fmt::print("correctness: {} | losses finite: {} | first loss {:.5f} vs resident {} | loss falls {:.4f} -> "
             "{:.4f}: {} | ranks agree: {}\n",
             ok ? "ok" : "FAILED", finite ? "yes" : "NO", all_losses.front(),
             resident ? fmt::format("{:.5f}: {}", resident_global_loss, matches ? "yes" : "NO")
                      : std::string("not checked (--no-resident)"),
             all_losses.front(), all_losses.back(), falls ? "yes" : "NO", agree ? "yes" : "NO");
  // Where compute waited, over the timed steps (rank 0).
  std::vector<std::pair<double, std::string>> worst;
  nlohmann::json ops_json = nlohmann::json::array();
  for (const auto& [key, value] : op_totals) {
    const std::string phase(engine::phase_name(static_cast<engine::Phase>(key.second)));
    worst.emplace_back(value.first / timed_steps, key.first + " (" + phase + ")");
    ops_json.push_back({{"op", key.first}, {"phase", phase}, {"seconds_per_step", value.first / timed_steps},
                        {"windows_per_step", static_cast<double>(value.second) / timed_steps}});
  }
  std::sort(worst.begin(), worst.end(), std::greater<>());
  if (!worst.empty()) {
    fmt::print("stall by op (rank 0, mean per step):");
    for (size_t k = 0; k < std::min<size_t>(worst.size(), 6); ++k) {
      fmt::print(" {} {:.1f} ms;", worst[k].second, 1e3 * worst[k].first);
    }
    fmt::print("\n");
  }
  // The step by decoder layer (rank 0, mean per timed step): what routing
  // changes is where the bytes and the stall go.
  nlohmann::json layers_json = nlohmann::json::array();
  const double per_step = 1.0 / std::max(timed_steps, 1);
  for (const offload::LayerFetch& l : layer_totals) {
    layers_json.push_back({{"layer", l.layer}, {"windows_per_step", l.windows * per_step},
                           {"skipped_windows_per_step", l.skipped_windows * per_step},
                           {"gathers_per_step", l.gathers * per_step},
                           {"gathered_bytes_per_step", static_cast<double>(l.gather_nbytes) * per_step},
                           {"param_read_bytes_per_step", static_cast<double>(l.read_nbytes) * per_step},
                           {"param_stall_s_per_step", l.stall_seconds * per_step},
                           {"stalled_windows_per_step", l.stalled_windows * per_step}});
  }
  if (!layer_totals.empty() && (run.config.moe() || flags.layer_breakdown)) {
    fmt::print("by decoder layer (rank 0, mean per step; \"-\": outside the layers):\n{:>6} {:>9} {:>9} {:>9} {:>12} "
               "{:>12} {:>10} {:>9}\n",
               "layer", "windows", "skipped", "gathers", "gathered MB", "param rd MB", "stall ms", "stalled");
    for (const offload::LayerFetch& l : layer_totals) {
      fmt::print("{:>6} {:>9.1f} {:>9.1f} {:>9.1f} {:>12.2f} {:>12.2f} {:>10.2f} {:>9.1f}\n",
                 l.layer < 0 ? std::string("-") : std::to_string(l.layer), l.windows * per_step,
                 l.skipped_windows * per_step, l.gathers * per_step,
                 static_cast<double>(l.gather_nbytes) * per_step / 1e6,
                 static_cast<double>(l.read_nbytes) * per_step / 1e6, 1e3 * l.stall_seconds * per_step,
                 l.stalled_windows * per_step);
    }
  }

  if (!run.json.empty()) {
    nlohmann::json rounds_json = nlohmann::json::array();
    for (const Round& rd : rounds) {
      const StepFigures& z = rd.zero;
      rounds_json.push_back({{"step_s", z.step}, {"tokens_per_s", global_tokens / z.step}, {"compute_s", z.compute},
                             {"param_stall_s", z.stall}, {"rank_wait_s", z.rank_wait}, {"grad_wait_s", z.grad_wait},
                             {"optimizer_s", z.optimizer}, {"optimizer_hidden_s", z.optimizer_hidden},
                             {"optimizer_drain_s", z.optimizer_drain},
                             {"optimizer_not_hidden_fraction", z.optimizer_not_hidden},
                             {"other_s", z.other}, {"nvme_read_bytes", z.nvme_read},
                             {"nvme_written_bytes", z.nvme_written}, {"param_read_bytes", z.param_read},
                             {"gathered_bytes", z.gathered}, {"resident_step_s", rd.resident},
                             {"io_bound_s", rd.io_bound}, {"bound_s", rd.bound}, {"ratio", rd.ratio},
                             {"worst_rank_param_stall_s", rd.worst_stall}, {"losses", rd.losses},
                             {"unoffloaded_step_s", rd.unoffloaded}});
    }
    const char* coretype = std::getenv("OPENBLAS_CORETYPE");
    nlohmann::json out = {
        {"mode", "zero"},
        {"config", {{"hidden", run.config.hidden_size}, {"intermediate", run.config.intermediate_size},
                    {"layers", run.config.num_hidden_layers}, {"heads", run.config.num_attention_heads},
                    {"kv_heads", run.config.num_key_value_heads}, {"vocab", run.config.vocab_size},
                    {"batch_per_rank", run.batch}, {"micro_batches", flags.micro_batches},
                    {"micro_batch_order", strata::train::micro_batch_order_name(order.order)},
                    {"layer_major_activations", flags.layer_major_activations}, {"seq", run.seq}, {"dtype", run.dtype},
                    {"parameters", param_count}, {"experts", run.config.num_experts},
                    {"top_k", run.config.num_experts_per_tok}, {"expert_intermediate", run.config.moe_intermediate_size},
                    {"routed_fetch", run.config.moe() && run.skip_unrouted_experts}}},
        {"zero", {{"stage", o.stage}, {"offload_param", tier_name(o.param_tier)},
                  {"offload_optimizer", tier_name(o.optimizer_tier)}, {"offload_grad", tier_name(o.grad_tier)},
                  {"resident_reference", !flags.no_resident}, {"nvme_dir", flags.nvme_dir},
                  {"ranks", r.world}, {"processes", r.processes}, {"context_parallel", flags.context_parallel},
                  {"context_parallel_method", flags.context_parallel > 1 ? nlohmann::json(flags.context_method)
                                                                         : nlohmann::json()},
                  {"context_buffer_bytes", model.context_buffer_nbytes()}, {"prefetch_bucket", o.prefetch_bucket_numel},
                  {"max_live", o.max_live_parameters_numel}, {"reuse_distance", o.max_reuse_distance_numel},
                  {"param_buffer_count", o.param_buffer_count}, {"param_buffer_size", o.param_buffer_numel},
                  {"aio_block_size", o.aio.block_size}, {"aio_queue_depth", o.aio.queue_depth},
                  {"aio_threads", o.aio.thread_count}, {"sub_group_size", eng.options().sub_group_numel},
                  {"reduce_bucket_size", eng.options().reduce_bucket_numel},
                  {"zero_sizes", eng.zero_sizes().to_json()},
                  {"overlap_optimizer", flags.overlap_optimizer}, {"overlap_next_forward", o.overlap_next_forward}, {"gradient_clipping", o.gradient_clipping},
                  {"overlap_policy", flags.overlap_policy},
                  {"optimizer_buffer_count", o.optimizer_buffer_count}}},
        {"threads_per_rank", run.threads},
        {"openblas_coretype_env", coretype != nullptr ? coretype : ""},
        {"openblas_core", run.accelerator == "cpu" ? ops::cpu_blas_core() : "-"},
        {"device", accelerator.name()},
        {"rounds", rounds_json},
        {"median", {{"step_s", step}, {"tokens_per_s", global_tokens / step}, {"compute_s", compute},
                    {"param_stall_s", stall}, {"param_stall_fraction", stall / step}, {"rank_wait_s", rank_wait},
                    {"worst_rank_param_stall_s", worst_stall}, {"grad_wait_s", grad_wait},
                    {"optimizer_s", optimizer}, {"optimizer_hidden_s", optimizer_hidden},
                    {"optimizer_drain_s", optimizer_drain}, {"optimizer_own_s", optimizer_own},
                    {"optimizer_share_of_step", optimizer_own / step},
                    {"optimizer_not_hidden_fraction", not_hidden}, {"sub_groups_overlapped", overlapped},
                    {"sub_groups", sub_groups_total}, {"other_s", other}, {"nvme_read_bytes", nvme_read},
                    {"nvme_written_bytes", nvme_written}, {"param_read_bytes", param_read},
                    {"gathered_bytes", gathered}, {"peak_gathered_bytes", peak_gathered},
                    {"drive_param_read_bytes", drive_bytes},
                    {"resident_step_s", resident_step_s}, {"io_bound_s", io_bound}, {"bound_s", bound},
                    {"ratio", ratio}, {"unoffloaded_step_s", unoffloaded}, {"clipped_steps", clipped_steps},
                    {"speculated_steps", speculated_steps}, {"rolled_back_steps", rolled_back_steps},
                    {"read_ahead_steps", read_ahead_steps},
                    {"timed_steps", timed_steps}}},
        {"drive_read_bytes_per_s", drive_bw},
        {"host_peak_rss_bytes", max_peak_rss},
        {"host_peak_rss_bytes_per_rank", peak_rss},
        {"op_stalls", ops_json},
        {"layers", layers_json},
        {"correctness", {{"ok", ok}, {"losses_finite", finite}, {"first_loss", all_losses.front()},
                         {"resident_loss", resident ? nlohmann::json(resident_global_loss) : nlohmann::json()},
                         {"first_loss_matches_resident", resident ? nlohmann::json(matches) : nlohmann::json()},
                         {"last_loss", all_losses.back()}, {"loss_falls", falls}, {"ranks_agree", agree}}}};
    write_json_output(run.json, out, 1);
  }
  return ok;
}

}  // namespace

int run_zero(const ModelRun& run, const ZeroFlags& flags) {
  const bool nvme = flags.offload_param == "nvme" || flags.offload_optimizer == "nvme" || flags.offload_grad == "nvme";
  STRATA_CHECK(flags.stage == 3 || flags.offload_param == "none", kBadArgument,
               "--offload-param {} needs --zero 3 (only stage 3 partitions the parameters)", flags.offload_param);
  STRATA_CHECK(flags.offload_param == "none" || flags.offload_optimizer != "none", kBadArgument,
               "--offload-param {} needs --offload-optimizer cpu or nvme: the optimizer on the accelerator (none) "
               "needs the parameters there",
               flags.offload_param);
  if (nvme && flags.nvme_dir.empty()) raise(ErrorCategory::kBadArgument, "an nvme tier needs --nvme-dir DIR");
  STRATA_CHECK(flags.expert_parallel == 1 || run.config.moe(), kBadArgument,
               "--ep {} splits experts between ranks: give --experts too", flags.expert_parallel);
  STRATA_CHECK(!run.config.moe() || run.config.num_experts % flags.expert_parallel == 0, kBadArgument,
               "--ep {} does not divide --experts {}", flags.expert_parallel, run.config.num_experts);
  if (flags.context_parallel > 1) {
    STRATA_CHECK(run.seq % (2 * flags.context_parallel) == 0, kBadArgument,
                 "--seq {} does not divide by 2 x --cp {} = {}: context parallelism cuts every sequence into two "
                 "chunks per rank",
                 run.seq, flags.context_parallel, 2 * flags.context_parallel);
    STRATA_CHECK(!flags.vs_unoffloaded, kBadArgument, "--vs-unoffloaded times the run without --cp: leave it out with --cp");
    nn::refuse_unsupported_with_context_parallel(
        fmt::format("--cp {}", flags.context_parallel),
        {{nn::CpFeature::kExperts, run.config.moe(), "--experts"},
         {nn::CpFeature::kLayerMajor, flags.micro_batch_order != "step-major",
          fmt::format("--micro-batch-order {}", flags.micro_batch_order)}});
    nn::check_context_parallel(run.config.num_attention_heads, run.config.num_key_value_heads, flags.context_parallel,
                               nn::parse_context_method(flags.context_method, "--cp-method"));
  } else {
    STRATA_CHECK(flags.context_method == "ring", kBadArgument, "--cp-method goes with --cp of 2 or more");
  }
  if (nvme) ensure_run_directory(flags.nvme_dir, "--nvme-dir");
  const bool processes = std::getenv("RANK") != nullptr || std::getenv("OMPI_COMM_WORLD_RANK") != nullptr;
  // Ranks as threads share this process's cores; more ranks than cores
  // oversubscribe them (each rank also runs its own compute and I/O threads),
  // and the run measures the scheduler, or does not finish.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (!processes && flags.ranks > cores) {
    raise(ErrorCategory::kBadArgument,
          "--ranks {}: {} ranks as threads of this process on {} CPU cores would oversubscribe them (a rank is "
          "busy the whole step); use at most --ranks {}, or start them as processes with `strata run -n N -- "
          "strata-train ...`",
          flags.ranks, flags.ranks, cores, cores);
  }
  std::atomic<bool> ok{true};
  if (processes) {
    const partition::RankInfo info = partition::RankInfo::from_env();
    STRATA_CHECK(flags.ranks == 0 || flags.ranks == info.world_size, kBadArgument,
                 "--ranks {} under a launcher with WORLD_SIZE {}: leave --ranks out", flags.ranks, info.world_size);
    set_log_rank(info.rank, info.world_size);
    std::unique_ptr<Accelerator> accelerator = make_accelerator(run.accelerator);
    partition::Rendezvous rendezvous(info, kTimeout);
    RankSetup r{info.rank, info.world_size, info.local_world_size, true};
    STRATA_CHECK(info.world_size % flags.context_parallel == 0, kBadArgument, "--cp {} does not divide the {} ranks",
                 flags.context_parallel, info.world_size);
    ok = run_rank(run, flags, r, *accelerator, rendezvous.store());
  } else {
    const int world = std::max(flags.ranks, 1);
    STRATA_CHECK(world % flags.context_parallel == 0, kBadArgument, "--cp {} does not divide --ranks {}",
                 flags.context_parallel, world);
    partition::StoreServer server("127.0.0.1", 0);
    std::unique_ptr<Accelerator> accelerator = make_accelerator(run.accelerator);
    std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
    std::vector<std::thread> threads;
    for (int rank = 0; rank < world; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          partition::StoreClient store("127.0.0.1", server.port(), rank, kTimeout);
          if (!run_rank(run, flags, RankSetup{rank, world, world, false}, *accelerator, store)) ok = false;
        } catch (...) {
          errors[static_cast<size_t>(rank)] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }
  return ok ? 0 : 1;
}

}  // namespace strata::bench::train
