// The finetune job's resources before step 1 (run_setup.h).
#include "runtime/train/run_setup.h"

#include <fmt/format.h>

#include <filesystem>
#include <system_error>

#include "core/error.h"
#include "core/log.h"
#include "core/tensor.h"
#include "runtime/pipeline/kept_boundaries.h"

namespace strata::train {

std::vector<std::shared_ptr<DirectoryLock>> own_run_directories(const engine::ZeroEngineOptions& zero,
                                                                const FinetuneOptions& options, int rank) {
  std::vector<std::shared_ptr<DirectoryLock>> owned;
  const bool nvme = zero.param_tier == Tier::kNvme || zero.optimizer_tier == Tier::kNvme ||
                    zero.grad_tier == Tier::kNvme;
  if (nvme) {
    ensure_run_directory(zero.nvme_path, "nvme_path");
    owned.push_back(DirectoryLock::acquire(zero.nvme_path, rank_lock_file_name(rank), "nvme_path"));
  }
  if (!options.save_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options.save_dir, ec);
    if (ec) {
      raise(ErrorCategory::kIo, "--save {}: cannot create the checkpoint directory: {}", options.save_dir.string(),
            ec.message());
    }
    owned.push_back(DirectoryLock::acquire(options.save_dir, rank_lock_file_name(rank), "--save"));
  }
  return owned;
}

void check_pinned_budget(const Config& config, const std::string& source, const plan::RuntimeInputs& inputs) {
  const uint64_t budget = config.strata.pinned_pool_nbytes;
  if (budget == 0) return;  // sized from the buffer counts
  const plan::RuntimeMemory memory = plan::runtime_memory(inputs);
  if (memory.pinned_nbytes <= static_cast<double>(budget)) return;
  std::string items;
  for (const plan::MemoryItem& item : memory.items) {
    if (item.where != plan::Where::kPinned || item.nbytes <= 0) continue;
    items += fmt::format("{}{} {:.0f} bytes{}", items.empty() ? "" : ", ", item.name, item.nbytes,
                         item.upper_bound ? " at most" : "");
  }
  const bool layer_major = inputs.layer_major.micro_batches > 0;
  const bool boundaries_pinned = layer_major && inputs.layer_major.boundaries != pipeline::BoundaryHome::kDevice;
  raise(ErrorCategory::kBadArgument,
        "{}: strata.pinned_pool_size is {} bytes, but this run pins {:.0f} bytes per rank ({}). Raise "
        "strata.pinned_pool_size, or lower what sizes those buffers (offload_optimizer.buffer_count, "
        "offload_param.buffer_count and buffer_size, sub_group_size, train_micro_batch_size_per_gpu x --seq{})",
        source, budget, memory.pinned_nbytes, items,
        // Layer-major does not combine with context parallelism (refused), so one suggestion or the other.
        boundaries_pinned ? fmt::format(", gradient_accumulation_steps; or keep the boundaries on the device{} "
                                        "(strata.layer_major_boundaries)",
                                        inputs.layer_major.boundaries == pipeline::BoundaryHome::kNvme ? ""
                                                                                                        : " or nvme")
        : layer_major                 ? std::string()
        : inputs.context_parallel > 1 ? fmt::format(" / --cp {}", inputs.context_parallel)
                                      : std::string("; or split each sequence over more ranks, --cp"));
}

void log_quantized_base(const engine::Engine& engine, const nn::DecoderConfig& config,
                        const engine::ZeroEngineOptions& zero) {
  if (!config.quant.quantized()) return;
  const char* format = config.quant.method == nn::QuantMethod::kFp8Block ? "FP8" : "MXFP4";
  const char* unit = config.quant.method == nn::QuantMethod::kFp8Block ? "e4m3" : "4-bit codes";
  int64_t kept = 0, stored_bytes = 0, scale_bytes = 0, dequantized_bytes = 0, other_bytes = 0;
  DType compute_dtype = DType::kBF16;  // what the kept weights are dequantized to (the base's dtype)
  for (engine::ParamId id = 0; id < engine.parameter_count(); ++id) {
    const engine::ParamInfo& p = engine.param_info(id);
    if (!p.frozen) continue;
    if (p.blocks) {
      ++kept;
      const int64_t grid = shape_numel(p.blocks->scale_shape()) * static_cast<int64_t>(dtype_nbytes(p.blocks->scale_dtype()));
      // FP8: a byte per element and the fp32 grid; MXFP4: half a byte per element and a byte per 32.
      const bool fp8 = p.blocks->format == kernels::QuantBlocks::Format::kFp8;
      stored_bytes += fp8 ? p.blocks->stored_nbytes() : p.blocks->mxfp4.packed_nbytes();
      scale_bytes += grid;
      dequantized_bytes += static_cast<int64_t>(p.nbytes());
      compute_dtype = p.dtype;
    } else {
      other_bytes += static_cast<int64_t>(p.nbytes());
    }
  }
  if (kept == 0) {
    logger().info("finetune: the {} checkpoint's frozen weights are dequantized to the run's dtype (a frozen base "
                  "stays {} with LoRA at ZeRO stage 3)",
                  format, format);
    return;
  }
  constexpr double kMiB = 1 << 20;
  const auto mib = [&](int64_t n) { return static_cast<double>(n) / kMiB; };
  logger().info("finetune: the frozen base keeps {} {} weights in {} on {}: {:.3f} MiB of {} and {:.3f} MiB of "
                "scales, where the run's {} would take {:.3f} MiB ({:.2f}x); its other {:.3f} MiB are stored as the "
                "run's (embedding, norms, unquantized weights)",
                kept, format, format, tier_name(zero.param_tier), mib(stored_bytes), unit, mib(scale_bytes),
                dtype_name(compute_dtype), mib(dequantized_bytes),
                static_cast<double>(stored_bytes + scale_bytes) / static_cast<double>(dequantized_bytes),
                mib(other_bytes));
}

}  // namespace strata::train
