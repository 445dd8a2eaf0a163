// strata-train's --zero flags (zero_bench.h): the ZeroEngine's options, the
// coordinator's budgets, aio, the micro-batch order and the optimizer's
// overlap, each settable as its ds_config key is.
#include <CLI/CLI.hpp>

#include <optional>
#include <string>

#include "bench/strata-train/zero_bench.h"
#include "runtime/config/size.h"

namespace strata::bench::train {

namespace {

// Element counts as a ds_config writes them: 1e6 (or 1M) as well as 1000000.
CLI::Validator count_transform() {
  return CLI::Validator(
      [](std::string& text) {
        const std::optional<uint64_t> n = parse_size(text);
        if (!n) return "not a count of elements: " + text + " (e.g. 1000000 or 1e6)";
        text = std::to_string(*n);
        return std::string();
      },
      "COUNT");
}

}  // namespace

void add_zero_flags(CLI::App& app, ZeroFlags& f) {
  engine::ZeroEngineOptions& e = f.engine;
  app.add_option("--zero", f.stage, "train through a ZeroEngine at this ZeRO stage (1, 2 or 3) instead of the "
                                    "resident benchmark")
      ->check(CLI::Range(1, 3));
  app.add_option("--offload-param", f.offload_param, "--zero 3: where parameter shards live")
      ->capture_default_str()->check(CLI::IsMember({"none", "cpu", "nvme"}));
  app.add_option("--offload-optimizer", f.offload_optimizer,
                 "optimizer state: none keeps it on the accelerator and updates it there (needs --offload-param "
                 "none), cpu in host memory and nvme on the drive (both updated by the CPU Adam)")
      ->capture_default_str()->check(CLI::IsMember({"none", "cpu", "nvme"}));
  app.add_option("--offload-grad", f.offload_grad,
                 "the gradient shard: auto as a config gets it (nvme with --offload-optimizer nvme, else none), none "
                 "(accelerator memory) or nvme (swapped with the optimizer state)")
      ->capture_default_str()->check(CLI::IsMember({"auto", "none", "nvme"}));
  app.add_flag("--no-resident", f.no_resident,
               "leave out the resident reference model (the whole model and its gradients per rank): no resident "
               "step in the bound, no first-loss check; peak host RSS is then the ZeRO engine's alone");
  app.add_flag("--layer-breakdown", f.layer_breakdown,
               "--zero 3: print the step by decoder layer (windows, skipped windows, gathers, bytes gathered and "
               "read, stall on parameters); on by itself with --experts, and always in --json");
  app.add_option("--nvme-dir", f.nvme_dir, "directory for swap files and the drive bandwidth probe (an nvme tier)");
  app.add_option("--ranks", f.ranks, "ranks as threads of this process when not started by `strata run` (default 1)")
      ->check(CLI::Range(0, 64));
  app.add_option("--ep", f.expert_parallel,
                 "--experts: moe.expert_parallel_size, the ranks that split each layer's experts between them (each "
                 "holds experts / ep and runs them on every member's tokens, exchanged all-to-all); must divide "
                 "--ranks and --experts")
      ->capture_default_str()->check(CLI::Range(1, 4096));
  app.add_option("--cp", f.context_parallel,
                 "context parallelism: cp groups of this many ranks, each rank holding 2 of 2 x N chunks of every "
                 "sequence (its attention through the ring or Ulysses); ZeRO runs over dp x cp, dp = ranks / N; "
                 "must divide --ranks, and 2 x N must divide --seq")
      ->capture_default_str()->check(CLI::Range(1, 64));
  app.add_option("--cp-method", f.context_method,
                 "--cp: ring (keys and values passed around the ring) or ulysses (all-to-alls from sequence to heads; "
                 "--heads and --kv-heads must divide by --cp)")
      ->capture_default_str()->check(CLI::IsMember({"ring", "ulysses"}));
  app.add_flag("--vs-unoffloaded", f.vs_unoffloaded,
               "also time the same stage with nothing offloaded (parameters and optimizer state on the device), "
               "alternating step by step");
  app.add_option("--lr", f.lr, "AdamW learning rate (weight decay 0.01)")->capture_default_str();
  app.add_option("--drive-test-mib", f.drive_test_mib, "size of the drive bandwidth probe's file")
      ->capture_default_str()->check(CLI::Range(4, 1 << 20));
  app.add_option("--prefetch-bucket", e.prefetch_bucket_numel, "stage3_prefetch_bucket_size (elements)")
      ->transform(count_transform())->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--max-live", e.max_live_parameters_numel, "stage3_max_live_parameters (elements)")
      ->transform(count_transform())->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--reuse-distance", e.max_reuse_distance_numel, "stage3_max_reuse_distance (elements)")
      ->transform(count_transform())->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--persistence", e.persistence_threshold_numel, "stage3_param_persistence_threshold (elements)")
      ->transform(count_transform())->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--param-buffers", e.param_buffer_count, "offload_param.buffer_count")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--param-buffer-size", e.param_buffer_numel, "offload_param.buffer_size (elements)")
      ->transform(count_transform())->capture_default_str()->check(CLI::PositiveNumber);
  // Left out: chosen from the model's decoder layers at finalize, as for a
  // ds_config without the keys (runtime/engine/zero_sizes.h).
  e.reduce_bucket_numel = engine::kChooseFromModel;
  e.sub_group_numel = engine::kChooseFromModel;
  app.add_option("--reduce-bucket", e.reduce_bucket_numel,
                 "reduce_bucket_size (elements; default: one decoder layer's gradients, chosen from the model)")
      ->transform(count_transform())->check(CLI::PositiveNumber);
  app.add_option("--sub-group", e.sub_group_numel,
                 "sub_group_size (elements): the optimizer's unit, and so how finely it can overlap backward "
                 "(default: one decoder layer's share of the shard, chosen from the model)")
      ->transform(count_transform())->check(CLI::PositiveNumber);
  app.add_flag("!--no-overlap-optimizer", f.overlap_optimizer,
               "run the optimizer in step() only, instead of updating each sub-group during backward as soon as its "
               "gradient is final");
  app.add_flag("!--no-overlap-forward", e.overlap_next_forward,
               "ZeRO-3: finish each step's update in step(), instead of on the optimizer thread while the next "
               "forward runs (that forward's gathers of a sub-group wait for its update only)");
  app.add_option("--overlap-policy", f.overlap_policy,
                 "what the optimizer does during backward: auto (speculate unless the last step clipped, then read "
                 "ahead), speculate, read-ahead")
      ->capture_default_str()->check(CLI::IsMember({"auto", "speculate", "read-ahead"}));
  app.add_option("--micro-batch-order", f.micro_batch_order,
                 "with --micro-batches: step-major (each micro-batch through the whole model in turn), layer-major "
                 "(all through each decoder layer before the next, backwards layer by layer) or auto (layer-major "
                 "with --offload-param cpu or nvme) -- strata.micro_batch_order")
      ->capture_default_str()->check(CLI::IsMember({"step-major", "layer-major", "auto"}));
  app.add_option("--layer-major-activations", f.layer_major_activations,
                 "layer-major: recompute (each layer's forward again before its backwards, one micro-batch's "
                 "activations per layer at a time) or keep (every micro-batch's activations kept from its forward to "
                 "its backward, nothing recomputed) -- strata.layer_major_activations")
      ->capture_default_str()->check(CLI::IsMember({"recompute", "keep"}));
  app.add_option("--gradient-clipping", e.gradient_clipping,
                 "gradient_clipping: the global gradient norm's maximum (0: no clipping); where it fires, what the "
                 "optimizer speculated during backward is redone")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--optimizer-buffers", e.optimizer_buffer_count,
                 "offload_optimizer.buffer_count: pinned buffers of one sub-group's state each, for the NVMe "
                 "optimizer's pipeline and its reads during backward")
      ->capture_default_str()->check(CLI::Range(2, 4096));
  app.add_option("--aio-block-size", e.aio.block_size, "aio.block_size (bytes)")->capture_default_str();
  app.add_option("--aio-queue-depth", e.aio.queue_depth, "aio.queue_depth")->capture_default_str();
  app.add_option("--aio-threads", e.aio.thread_count, "aio.thread_count")->capture_default_str();
}

}  // namespace strata::bench::train
