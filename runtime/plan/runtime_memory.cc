// The runtime's own memory, item by item (runtime_memory.h). Each item names
// the allocation it mirrors; when that code changes, change the item (the
// plan tests compare the arena with a real LlamaModel's).
#include "runtime/plan/runtime_memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "offload/optimizer_swapper.h"
#include "partition/layout.h"
#include "runtime/nn/llama_model.h"
#include "core/error.h"

namespace strata::plan {
namespace {

size_t align256(size_t nbytes) {
  return (nbytes + 255) / 256 * 256;
}

size_t view_nbytes(DType dtype, std::initializer_list<int64_t> shape) {
  size_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<size_t>(d);
  return align256(numel * dtype_nbytes(dtype));
}

// The parameters LlamaModel declares: the architecture's Hugging Face
// tensors (nn::hf_tensors, the model's own list), for the partition layout.
std::vector<partition::ParamSpec> llama_params(const nn::LlamaConfig& c, DType dtype) {
  std::vector<partition::ParamSpec> out;
  for (nn::HfTensor& t : nn::hf_tensors(c)) out.push_back({std::move(t.name), std::move(t.shape), dtype});
  return out;
}

// The adapters LlamaModel declares with `lora` (nn::Linear): for each targeted
// projection weight [out, in], lora_A [r, in] and lora_B [out, r], fp32.
std::vector<partition::ParamSpec> lora_params(const nn::LlamaConfig& c, const nn::LoraSpec& lora) {
  std::vector<partition::ParamSpec> out;
  constexpr std::string_view kWeight = ".weight";
  for (const nn::HfTensor& t : nn::hf_tensors(c)) {
    const std::string_view name = t.name;
    if (name.size() <= kWeight.size() || name.substr(name.size() - kWeight.size()) != kWeight) continue;
    const std::string module(name.substr(0, name.size() - kWeight.size()));
    if (!lora.targets_module(module)) continue;
    out.push_back({module + ".lora_A.weight", Shape{lora.rank, t.shape[1]}, DType::kF32});
    out.push_back({module + ".lora_B.weight", Shape{t.shape[0], lora.rank}, DType::kF32});
  }
  return out;
}

// ZeroEngine's optimizer_sub_group_numel (zero_engine.cc): sub_group_size
// rounded up to the alignment, at most the shard.
size_t optimizer_sub_group_numel(const partition::PartitionLayout& layout, DType dtype,
                                 int64_t sub_group_numel) {
  const int64_t align_numel = static_cast<int64_t>(layout.alignment_nbytes() / dtype_nbytes(dtype));
  const int64_t limit = (sub_group_numel + align_numel - 1) / align_numel * align_numel;
  return static_cast<size_t>(std::min(limit, std::max<int64_t>(layout.shard_numel(), 1)));
}

}  // namespace

std::string_view where_name(Where where) {
  switch (where) {
    case Where::kDevice:
      return "device";
    case Where::kPinned:
      return "pinned host";
    case Where::kHost:
      return "host";
    case Where::kNvme:
      return "nvme";
  }
  return "?";
}

std::vector<engine::SizedParam> llama_sized_params(const nn::LlamaConfig& c, DType dtype, const nn::LoraSpec& lora) {
  std::vector<engine::SizedParam> sized;
  for (const partition::ParamSpec& p : llama_params(c, dtype)) {
    sized.push_back({p.name, shape_numel(p.shape), p.dtype, !lora.enabled()});
  }
  if (lora.enabled()) {
    for (const partition::ParamSpec& p : lora_params(c, lora)) sized.push_back({p.name, shape_numel(p.shape), p.dtype, true});
  }
  return sized;
}

size_t llama_arena_nbytes(const nn::LlamaConfig& model, DType t, int64_t batch, int64_t seq,
                          bool checkpoint_activations, bool cpu_checkpointing, const nn::LoraSpec& lora,
                          int expert_parallel, int tensor_parallel, bool sequence_parallel) {
  // A tensor-parallel rank's share of the heads and MLP features.
  const nn::LlamaConfig c = nn::tensor_parallel_share(model, tensor_parallel);
  const int64_t rows = batch * seq, hidden = c.hidden_size, inter = c.intermediate_size;
  // The residual stream's and the norms' rows: this rank's block with sequence parallelism.
  const int64_t local = sequence_parallel ? rows / tensor_parallel : rows;
  const int64_t heads = c.num_attention_heads, kv_heads = c.num_key_value_heads, hd = c.head_dim;
  const auto layers = static_cast<size_t>(c.num_hidden_layers);
  const DType f32 = DType::kF32;
  // The residual stream: every layer's input, or two alternating buffers when
  // the checkpoints live in host memory.
  size_t n = (cpu_checkpointing ? 2 : layers + 1) * view_nbytes(t, {local, hidden});
  // The MLP's saved activations and backward scratch: gate, up and their
  // product; or a mixture of experts' routing, its rows in expert order and
  // each expert's gate, up, product and output (llama_model.cc, MoeActs).
  const int64_t experts = c.num_experts, k = c.num_experts_per_tok, mi = c.moe_intermediate_size;
  const int64_t rk = rows * k;
  // The rows the experts run on: every ep member's tokens to this member's experts.
  const bool ep = expert_parallel > 1;
  const int64_t erk = expert_parallel * rk;
  // qwen2_moe's shared expert: its MLP's three [rows, width] buffers, its
  // output and its gate's logit, saved and again as backward scratch.
  const size_t shared = c.shared_expert() ? 3 * view_nbytes(t, {rows, c.shared_expert_intermediate_size}) +
                                                view_nbytes(t, {rows, hidden}) + view_nbytes(t, {rows, 1})
                                          : 0;
  const size_t mlp_acts =
      !c.moe() ? 3 * view_nbytes(t, {rows, inter})
               : view_nbytes(t, {rows, experts}) + view_nbytes(f32, {rows, experts}) +
                     view_nbytes(DType::kI32, {rows, k}) + view_nbytes(f32, {rows, k}) +
                     view_nbytes(DType::kI32, {experts + 1}) + view_nbytes(DType::kI32, {rows, k}) +
                     view_nbytes(DType::kI32, {rk}) + 2 * view_nbytes(t, {rk, hidden}) +
                     3 * view_nbytes(t, {erk, mi}) +
                     (ep ? view_nbytes(t, {erk, hidden}) + 2 * view_nbytes(DType::kI32, {erk}) : 0) + shared;
  const size_t mlp_scratch =
      !c.moe() ? 3 * view_nbytes(t, {rows, inter})
               : 2 * view_nbytes(t, {rk, hidden}) + 3 * view_nbytes(t, {erk, mi}) +
                     view_nbytes(f32, {rows, k}) + view_nbytes(t, {rows, experts}) +
                     view_nbytes(DType::kF64, {2, experts}) + view_nbytes(DType::kF64, {1}) +
                     view_nbytes(f32, {experts}) + (ep ? 3 * view_nbytes(t, {erk, hidden}) : 0) + shared;
  // What one decoder layer saves for backward; one set with checkpointing.
  const size_t acts = view_nbytes(t, {local, hidden}) + view_nbytes(f32, {local}) +
                      view_nbytes(t, {rows, heads, hd}) + 2 * view_nbytes(t, {rows, kv_heads, hd}) +
                      view_nbytes(t, {rows, heads * hd}) + view_nbytes(f32, {batch, heads, seq}) +
                      2 * view_nbytes(t, {local, hidden}) + view_nbytes(f32, {local}) +
                      mlp_acts +
                      // Qwen3's q/k before their norms and the norms' rstd.
                      (c.qk_norm ? view_nbytes(t, {rows, heads, hd}) + view_nbytes(t, {rows, kv_heads, hd}) +
                                       view_nbytes(f32, {rows * heads}) + view_nbytes(f32, {rows * kv_heads})
                                 : 0);
  n += (checkpoint_activations ? 1 : layers) * acts;
  // Backward scratch shared by the layers, the final norm, loss and inputs.
  n += view_nbytes(t, {local, hidden}) + view_nbytes(t, {rows, heads, hd}) +
       2 * view_nbytes(t, {rows, kv_heads, hd}) + view_nbytes(t, {rows, heads * hd}) + mlp_scratch +
       (c.qk_norm && tensor_parallel > 1 ? view_nbytes(f32, {2, hd}) : 0) +  // the q/k norms' summed gradient
       (tensor_parallel > model.num_key_value_heads  // shared kv heads' summed gradients
            ? view_nbytes(f32, {model.num_key_value_heads * hd * (hidden + (c.attention_qkv_bias ? 1 : 0))})
            : 0);
  // dres, final_ln, rstd_f, the loss's lse.
  n += view_nbytes(t, {local, hidden}) + view_nbytes(t, {rows, hidden}) + view_nbytes(f32, {local}) +
       view_nbytes(f32, {rows});
  if (sequence_parallel) {  // gathered, partial, dgathered, the norms' summed gradient, final_ln_local
    n += 3 * view_nbytes(t, {rows, hidden}) + view_nbytes(f32, {hidden}) + view_nbytes(t, {local, hidden});
  }
  n += view_nbytes(DType::kF64, {2}) + 2 * view_nbytes(DType::kF64, {1});
  n += 5 * view_nbytes(DType::kI32, {rows});  // ids, targets, positions, document starts and ends
  if (lora.enabled()) {
    n += 2 * view_nbytes(t, {rows, lora.rank});  // LoraScratch h and dh
    if (lora.dropout > 0) {  // xd and dxd, for the widest targeted input
      n += 2 * view_nbytes(t, {rows * nn::lora_widest_input(c, lora)});
    }
  }
  return n;
}

RuntimeMemory runtime_memory(const RuntimeInputs& in) {
  nn::LlamaConfig c = in.model;
  c.validate();
  in.zero.validate();
  STRATA_CHECK(in.micro_batch >= 1 && in.seq >= 1 && in.world_size >= 1, kBadArgument,
               "plan: micro-batch {}, sequence {} and world size {} must all be at least 1",
               in.micro_batch, in.seq, in.world_size);
  STRATA_CHECK(!in.cpu_checkpointing || in.checkpoint_activations, kBadArgument,
               "plan: cpu_checkpointing needs activation checkpointing");
  if (in.lora.enabled()) in.lora.validate();
  const DType pd = in.param_dtype;
  // The sizes the engine's finalize will use: the same choice from the same
  // parameters (the base frozen under LoRA, the adapters trained).
  const engine::ZeroSizes sizes =
      engine::choose_zero_sizes(llama_sized_params(c, pd, in.lora), in.world_size, in.zero.sub_group_numel,
                                in.zero.reduce_bucket_numel, partition::kDefaultAlignmentNbytes);
  engine::ZeroEngineOptions z = in.zero;
  z.sub_group_numel = sizes.sub_group_numel;
  z.reduce_bucket_numel = sizes.reduce_bucket_numel;
  const double pe = static_cast<double>(dtype_nbytes(pd));
  const double world = in.world_size;
  partition::LayoutOptions layout_options;
  layout_options.world_size = in.world_size;
  layout_options.sub_group_numel = z.sub_group_numel;
  // ZeroEngine's groups (on_finalize): one per (dtype, frozen). Without LoRA
  // every parameter trains in the parameter dtype; with it the base is a
  // frozen group and the fp32 adapters the trained one.
  struct Group {
    std::unique_ptr<partition::PartitionLayout> layout;
    double elem = 0;  // bytes per element
    bool frozen = false;
    double padded_numel = 0, largest_slice = 0, largest_full = 0;
    size_t opt_sub_group = 0;  // its sub-group (the home's chunk; the optimizer's record)
  };
  std::vector<Group> groups;
  const auto add_group = [&](std::vector<partition::ParamSpec> specs, DType dtype, bool frozen) {
    Group g;
    g.layout = std::make_unique<partition::PartitionLayout>(std::move(specs), layout_options);
    g.elem = static_cast<double>(dtype_nbytes(dtype));
    g.frozen = frozen;
    g.opt_sub_group = optimizer_sub_group_numel(*g.layout, dtype, z.sub_group_numel);
    groups.push_back(std::move(g));
  };
  add_group(llama_params(c, pd), pd, in.lora.enabled());
  if (in.lora.enabled()) add_group(lora_params(c, in.lora), DType::kF32, false);
  // Over every group, in bytes (the gathers hold all of them); over the
  // trained group, in elements (gradients and optimizer state).
  double shard_nbytes = 0, padded_nbytes = 0, persistent_nbytes = 0, largest_full_nbytes = 0;
  for (Group& g : groups) {
    for (const auto& slot : g.layout->params()) {
      const double full = static_cast<double>(slot.slice_numel) * world;  // a gather's output
      g.padded_numel += full;
      g.largest_slice = std::max(g.largest_slice, static_cast<double>(slot.slice_numel));
      g.largest_full = std::max(g.largest_full, full);
      if (slot.numel <= z.persistence_threshold_numel) persistent_nbytes += g.elem * full;
    }
    shard_nbytes += static_cast<double>(g.layout->shard_nbytes());
    padded_nbytes += g.elem * g.padded_numel;
    largest_full_nbytes = std::max(largest_full_nbytes, g.elem * g.largest_full);
  }
  const Group& trained = groups.back();
  const double shard_numel = static_cast<double>(trained.layout->shard_numel());
  const double padded_numel = trained.padded_numel, largest_slice = trained.largest_slice,
               largest_full = trained.largest_full;
  const size_t opt_sub_group = trained.opt_sub_group;
  const std::string lora_basis =
      in.lora.enabled() ? fmt::format(" (the LoRA adapters; the base is frozen)") : "";

  RuntimeMemory out;
  out.zero_sizes = sizes;
  bool during_steps = false;  // set for the items below that the steps allocate
  auto add = [&](std::string name, Where where, double nbytes, bool bound, std::string basis) {
    if (nbytes <= 0) return;
    out.items.push_back({std::move(name), where, nbytes, bound, std::move(basis), during_steps});
    (where == Where::kDevice   ? out.device_nbytes
     : where == Where::kPinned ? out.pinned_nbytes
     : where == Where::kHost   ? out.host_nbytes
                               : out.nvme_nbytes) += nbytes;
  };

  // ---- device ------------------------------------------------------------------
  const int64_t rows = in.micro_batch * in.seq;
  // The model runner allocates its arena and scratch at the first forward.
  during_steps = true;
  add("activation arena", Where::kDevice,
      static_cast<double>(llama_arena_nbytes(c, in.activation_dtype, in.micro_batch, in.seq,
                                             in.checkpoint_activations, in.cpu_checkpointing,
                                             in.lora, in.zero.expert_parallel_size)),
      false,
      fmt::format("LlamaModel's arena: {} rows x hidden {} / intermediate {}, {}", rows,
                  c.hidden_size, c.intermediate_size,
                  in.checkpoint_activations
                      ? "one layer's activations + the checkpoints"
                      : fmt::format("{} layers' activations", c.num_hidden_layers)));
  // The fused loss forms logits chunk rows at a time (llama_model.cc: 64 MiB of fp32, at least 64
  // rows).
  const int64_t chunk_rows = std::max<int64_t>(64, (int64_t{64} << 20) / (4 * c.vocab_size));
  add("loss logits scratch", Where::kDevice,
      4.0 * static_cast<double>(std::min(chunk_rows, rows) * c.vocab_size), false,
      fmt::format("{} rows x vocab {} fp32", std::min(chunk_rows, rows), c.vocab_size));
  // Linear backward accumulating into dx stages the product in a [rows, in] fp32 scratch
  // (ops_cpu.cc).
  if (in.device_is_host) {
    // A mixture of experts accumulates into its permuted rows (rows x top-k x hidden).
    const int64_t dx_rows = c.moe() ? rows * c.num_experts_per_tok : rows;
    add("backward dx scratch", Where::kDevice,
        4.0 * static_cast<double>(dx_rows * std::max(c.hidden_size, c.intermediate_size)), true,
        c.moe() ? "rows x top-k x max(hidden, intermediate) fp32 (cpu ops)"
                : "rows x max(hidden, intermediate) fp32 (cpu ops)");
  }
  during_steps = false;  // the engine's storage: finalize
  if (z.param_tier == strata::Tier::kDevice) {
    add("parameter shard (home)", Where::kDevice, shard_nbytes, false,
        "this rank's shard of every parameter");
  }
  if (z.stage < 3) {
    add("full parameters", Where::kDevice, padded_nbytes, false,
        "stages 1/2 keep every parameter gathered");
  }
  if (z.stage == 1) {
    add("full fp32 gradients", Where::kDevice, 4.0 * padded_numel, false,
        "stage 1 accumulates whole gradients until the step" + lora_basis);
  }
  if (z.grad_tier == strata::Tier::kDevice) {
    add("fp32 gradient shard", Where::kDevice, 4.0 * shard_numel, false,
        "GradShard in accelerator memory" + lora_basis);
  }
  if (z.optimizer_tier == strata::Tier::kDevice) {
    add("optimizer state", Where::kDevice, 12.0 * shard_numel, false,
        "fp32 master + 2 moments of the shard (DeviceOptimizer)" + lora_basis);
  }
  during_steps = true;  // gathers and gradients: forward and backward
  if (z.stage == 3) {
    // Persistent parameters stay gathered; the rest within the prefetch
    // bucket ahead plus the operator being run, at most max_live (and never
    // more than the whole model).
    // In bytes, the budgets' elements taken at the parameter dtype's size.
    const double rest = padded_nbytes - persistent_nbytes;
    const double live =
        std::min({rest, pe * static_cast<double>(z.prefetch_bucket_numel) + 2 * largest_full_nbytes,
                  pe * static_cast<double>(z.max_live_parameters_numel) + largest_full_nbytes});
    add("gathered parameters", Where::kDevice, persistent_nbytes + live, true,
        fmt::format("persistent ({:.0f} elements) + within prefetch {} / max live {} elements",
                    persistent_nbytes / pe, z.prefetch_bucket_numel, z.max_live_parameters_numel));
  }
  if (z.stage >= 2) {
    // A full fp32 gradient lives from its first use in backward until its
    // bucket is reduced: the open bucket and two in flight (bucket_reducer.cc),
    // each up to reduce_bucket_size plus one parameter.
    const double bucket = static_cast<double>(z.reduce_bucket_numel) + largest_full;
    add("fp32 gradients awaiting reduction", Where::kDevice,
        4.0 * std::min(padded_numel, 3 * bucket), true,
        fmt::format("open bucket + 2 in flight of reduce_bucket_size {}{}", z.reduce_bucket_numel,
                    lora_basis));
    add("reduce-scatter buffers", Where::kDevice,
        4.0 * (1 + 1 / world) * std::min(padded_numel, 2 * bucket), true,
        "2 buckets in flight: send (all ranks' slices) + receive (this rank's)");
  }

  // ---- pinned and pageable host ----------------------------------------------------
  during_steps = false;  // finalize, except where said
  if (z.param_tier == strata::Tier::kCpu) {
    add("parameter shard (home)", Where::kPinned, shard_nbytes, false,
        "this rank's shard of every parameter");
  }
  if (z.param_tier == strata::Tier::kNvme) {
    // ParamCoordinator: per home (group), min(buffer_count, members) buffers of its largest slice.
    for (const Group& g : groups) {
      const double count = std::min(static_cast<double>(z.param_buffer_count),
                                    static_cast<double>(g.layout->params().size()));
      add(groups.size() > 1 ? (g.frozen ? "NVMe read staging (frozen base)"
                                        : "NVMe read staging (adapters)")
                            : "NVMe read staging",
          Where::kPinned, count * g.elem * g.largest_slice, false,
          fmt::format("{:.0f} buffers of the largest slice ({:.0f} elements)", count,
                      g.largest_slice));
    }
  }
  if (z.param_tier != strata::Tier::kDevice) {
    // offload/param_home.h HostWindow: one window, shared by the homes, of a
    // sub-group or the largest slice.
    double window = 0;
    for (const Group& g : groups)
      window = std::max(window, g.elem * std::max(static_cast<double>(g.opt_sub_group), g.largest_slice));
    add("parameter home window", Where::kPinned, window, false,
        "the optimizer's sub-group of 16/32-bit values (the parameter homes' window)");
  }
  if (z.optimizer_tier == strata::Tier::kNvme) {
    add("optimizer pipeline buffers", Where::kPinned,
        static_cast<double>(z.optimizer_buffer_count *
                            offload::OptimizerSwapper::buffer_nbytes(opt_sub_group, z.grad_tier == strata::Tier::kNvme)),
        false,
        fmt::format("{} buffers of one sub-group's fp32 master + 2 moments{} ({} elements){}",
                    z.optimizer_buffer_count, z.grad_tier == strata::Tier::kNvme ? " + its gradient" : "",
                    opt_sub_group, lora_basis));
  } else if (z.optimizer_tier == strata::Tier::kCpu) {
    add("optimizer state", Where::kHost, 12.0 * shard_numel, false,
        "fp32 master + 2 moments of the shard" + lora_basis);
  }
  if (z.grad_tier == strata::Tier::kNvme) {
    add("gradient shard scratch", Where::kPinned, 4.0 * 2 * largest_slice, false,
        "2 slices for accumulation (GradShard)");
    during_steps = true;
    add("gradient shard window", Where::kPinned, 4.0 * static_cast<double>(opt_sub_group), false,
        "one sub-group read for the optimizer (GradShard)");
  }
  during_steps = true;  // the model runner's, at the first forward
  add("input staging", Where::kPinned, 20.0 * static_cast<double>(rows) + 24, false,
      "ids, targets, positions, document starts and ends");
  if (in.cpu_checkpointing && c.num_hidden_layers > 1) {
    add("activation checkpoints", Where::kPinned,
        static_cast<double>((c.num_hidden_layers - 1) *
                            view_nbytes(in.activation_dtype, {rows, c.hidden_size})),
        false, "every layer's input but the top one's");
  }

  // ---- NVMe ----------------------------------------------------------------------
  during_steps = false;
  if (z.param_tier == strata::Tier::kNvme) {
    add("parameter file", Where::kNvme, shard_nbytes, false,
        groups.size() > 1 ? "this rank's shard (a file per group: frozen base, adapters)"
                          : "this rank's shard");
  }
  if (z.grad_tier == strata::Tier::kNvme) {
    add("fp32 gradient file", Where::kNvme, 4.0 * shard_numel, false,
        "this rank's gradient shard" + lora_basis);
  }
  if (z.optimizer_tier == strata::Tier::kNvme) {
    const double records = std::ceil(shard_numel / static_cast<double>(opt_sub_group));
    add("optimizer state files", Where::kNvme,
        2 * records * static_cast<double>(offload::OptimizerSwapper::record_nbytes(opt_sub_group)),
        false, "two slots (crash-safe commit) of fp32 master + 2 moments per sub-group" + lora_basis);
  }
  return out;
}

}  // namespace strata::plan
