// The runtime's own memory, item by item (runtime_memory.h). Each item names
// the allocation it mirrors; when that code changes, change the item (the
// plan tests compare the arena with a real DecoderModel's).
#include "runtime/plan/runtime_memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "offload/optimizer_swapper.h"
#include "partition/layout.h"
#include "kernels/fp8_blocks.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/pipeline/stages.h"
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

// The adapters DecoderModel declares with `lora` (nn::Linear): for each targeted
// projection weight [out, in], lora_A [r, in] and lora_B [out, r], fp32.
std::vector<partition::ParamSpec> lora_params(const nn::DecoderConfig& c, const nn::LoraSpec& lora) {
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

// What pp rank `rank` holds of the model (RuntimeInputs::pipeline): its
// chunks, and which tensors (by Hugging Face name) are its.
struct StageShare {
  std::vector<pipeline::StagePart> chunks;
  bool embedding = false, head = false;
  bool holds(const nn::DecoderConfig& c, std::string_view name) const {
    constexpr std::string_view kLayers = "model.layers.";
    if (name.substr(0, kLayers.size()) == kLayers) {
      const std::string_view rest = name.substr(kLayers.size());
      const int64_t layer = std::stoll(std::string(rest.substr(0, rest.find('.'))));
      for (const pipeline::StagePart& part : chunks) {
        if (layer >= part.first_layer && layer < part.first_layer + part.layers) return true;
      }
      return false;
    }
    // The embedding where the tokens come in, and as the tied lm_head at the end.
    if (name.substr(0, 19) == "model.embed_tokens.") return embedding || (head && c.tie_word_embeddings);
    return head;  // the final norm and lm_head
  }
};

StageShare stage_share(const RuntimeInputs& in) {
  StageShare share;
  const pipeline::ScheduleSpec& spec = in.pipeline;
  for (int k = 0; k < spec.virtual_stages; ++k) {
    share.chunks.push_back(pipeline::stage_part(in.pipeline_split, spec.stages, in.pipeline_rank, k));
    share.embedding = share.embedding || share.chunks.back().embedding;
    share.head = share.head || share.chunks.back().head;
  }
  return share;
}

}  // namespace

ChunkSlots pipeline_chunk_slots(const pipeline::Schedule& schedule, int rank) {
  const std::vector<pipeline::Action>& list = schedule.ranks.at(static_cast<size_t>(rank));
  const auto chunks = static_cast<size_t>(schedule.spec.virtual_stages);
  ChunkSlots out{std::vector<int>(chunks, 0), std::vector<int>(chunks, 0)};
  // Each (chunk, micro-batch)'s first and last action.
  std::map<std::pair<int, int>, std::pair<size_t, size_t>> span;
  for (size_t i = 0; i < list.size(); ++i) {
    const auto [it, inserted] = span.try_emplace({list[i].chunk, list[i].micro_batch}, i, i);
    it->second.second = i;
  }
  std::vector<int> held(chunks, 0), awaiting(chunks, 0);
  for (size_t i = 0; i < list.size(); ++i) {
    const pipeline::Action& a = list[i];
    const auto k = static_cast<size_t>(a.chunk);
    const auto& [first, last] = span.at({a.chunk, a.micro_batch});
    if (first == i) out.slots[k] = std::max(out.slots[k], ++held[k]);
    if (a.kind == pipeline::ActionKind::kBackward && schedule.spec.split_backward()) {
      out.awaiting_weight_grads[k] = std::max(out.awaiting_weight_grads[k], ++awaiting[k]);
    }
    if (a.kind == pipeline::ActionKind::kWeight) --awaiting[k];
    if (last == i) --held[k];
  }
  return out;
}

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

std::vector<RankParam> decoder_rank_params(const nn::DecoderConfig& c, DType dtype, int tp) {
  std::vector<RankParam> out;
  const nn::DecoderConfig share = nn::tensor_parallel_share(c, tp);  // refuses what does not split
  const auto ends_with = [](std::string_view name, std::string_view tail) {
    return name.size() >= tail.size() && name.substr(name.size() - tail.size()) == tail;
  };
  for (nn::HfTensor& t : nn::hf_tensors(c)) {
    RankParam p{{std::move(t.name), std::move(t.shape), dtype}, false};
    if (tp > 1) {
      const std::string& n = p.spec.name;
      const bool kv = n.find(".k_proj.") != std::string::npos || n.find(".v_proj.") != std::string::npos;
      const bool column = kv || n.find(".q_proj.") != std::string::npos || n.find(".gate_proj.") != std::string::npos ||
                          n.find(".up_proj.") != std::string::npos;
      const bool row = ends_with(n, ".o_proj.weight") || ends_with(n, ".down_proj.weight");
      // The embedding and lm_head by vocabulary rows (nn::Embedding).
      const bool vocab = n == "model.embed_tokens.weight" || n == "lm_head.weight";
      if (vocab) {
        p.spec.shape[0] /= tp;
      } else if (column) {
        p.spec.shape[0] = kv ? share.num_key_value_heads * share.head_dim : p.spec.shape[0] / tp;
      } else if (row) {
        p.spec.shape[1] /= tp;
      }
      p.split = column || row || vocab;
    }
    out.push_back(std::move(p));
  }
  return out;
}

ModelShape decoder_model_shape(const nn::DecoderConfig& c) {
  ModelShape m;
  m.param_count = c.parameter_count();
  m.layers = c.num_hidden_layers;
  m.hidden = c.hidden_size;
  m.heads = c.num_attention_heads;
  m.intermediate = c.moe() ? c.moe_intermediate_size : c.intermediate_size;
  m.vocab = c.vocab_size;
  if (c.moe()) {
    m.experts = c.num_experts;
    m.experts_per_token = c.num_experts_per_tok;
    m.shared_expert_intermediate = c.shared_expert_intermediate_size;
    // Every routed expert but the token's k is idle (its matrices and,
    // gpt-oss's, biases; DeepSeek's first first_k_dense_replace layers are
    // dense). A shared expert (qwen2_moe, DeepSeek) and its gate are active
    // for every token: in param_count and never idle.
    m.active_param_count = c.active_parameter_count();
  }
  m.input_embedding_count = c.input_embedding_count();
  return m;
}

bool stored_fp8(const nn::DecoderConfig& c, std::string_view name, const Shape& shape) {
  if (c.quant.method != nn::QuantMethod::kFp8Block || shape.size() != 2 || !name.starts_with("model.layers.") ||
      !name.ends_with(".weight") || name.ends_with("mlp.gate.weight")) {
    return false;
  }
  return !c.quant.not_converted(std::string(name.substr(0, name.size() - 7)));
}

bool keeps_fp8_base(const nn::DecoderConfig& c, const nn::LoraSpec& lora, int zero_stage, int tensor_parallel) {
  return c.quant.method == nn::QuantMethod::kFp8Block && lora.enabled() && zero_stage == 3 && tensor_parallel == 1;
}

std::vector<engine::SizedParam> decoder_sized_params(const nn::DecoderConfig& c, DType dtype, const nn::LoraSpec& lora,
                                                   int tensor_parallel, bool fp8_base) {
  std::vector<engine::SizedParam> sized;
  for (const RankParam& p : decoder_rank_params(c, dtype, tensor_parallel)) {
    const bool fp8 = fp8_base && stored_fp8(c, p.spec.name, p.spec.shape);
    sized.push_back({p.spec.name, shape_numel(p.spec.shape), fp8 ? DType::kF8E4M3 : p.spec.dtype, !lora.enabled()});
  }
  if (lora.enabled()) {
    for (const partition::ParamSpec& p : lora_params(c, lora)) sized.push_back({p.name, shape_numel(p.shape), p.dtype, true});
  }
  return sized;
}

size_t decoder_arena_nbytes(const nn::DecoderConfig& model, DType t, int64_t batch, int64_t seq,
                          bool checkpoint_activations, bool cpu_checkpointing, const nn::LoraSpec& lora,
                          int expert_parallel, int tensor_parallel, bool sequence_parallel, int context_parallel) {
  return decoder_chunk_arena_nbytes(model, {0, model.num_hidden_layers, true, true}, t, batch, seq,
                                    checkpoint_activations, cpu_checkpointing, lora, expert_parallel, tensor_parallel,
                                    sequence_parallel, context_parallel);
}

size_t decoder_chunk_arena_nbytes(const nn::DecoderConfig& model, const pipeline::StagePart& part, DType t,
                                  int64_t batch, int64_t seq, bool checkpoint_activations, bool cpu_checkpointing,
                                  const nn::LoraSpec& lora, int expert_parallel, int tensor_parallel,
                                  bool sequence_parallel, int context_parallel) {
  // A tensor-parallel rank's share of the heads and MLP features.
  const nn::DecoderConfig c = nn::tensor_parallel_share(model, tensor_parallel);
  // A cp rank's tokens of each sequence (every one without context parallelism).
  const int64_t whole_seq = seq;
  seq /= context_parallel;
  const int64_t rows = batch * seq, hidden = c.hidden_size, inter = c.intermediate_size;
  // The residual stream's and the norms' rows: this rank's block with sequence parallelism.
  const int64_t local = sequence_parallel ? rows / tensor_parallel : rows;
  const auto layers = static_cast<size_t>(part.layers);
  // A chunk of the embedding or the head alone keeps no layer's activations
  // and has none of the layers' backward scratch.
  const bool any_layer = layers > 0;
  // The attention kind's saved activations per layer and its backward scratch (nn::attention_arena).
  const nn::AttentionArena attention = nn::attention_arena(model, tensor_parallel, batch, seq, t);
  const DType f32 = DType::kF32;
  // The residual stream: every layer's input, or two alternating buffers when
  // the checkpoints live in host memory.
  size_t n = (cpu_checkpointing ? 2 : layers + 1) * view_nbytes(t, {local, hidden});
  // The MLP's saved activations and backward scratch: gate, up and their
  // product; or a mixture of experts' routing, its rows in expert order and
  // each expert's gate, up, product and output (decoder_model.cc, MoeActs).
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
  // The sigmoid router (DeepSeek, GLM) computes in fp32: its logits and their
  // gradient, and in a 16-bit model its input and input gradient in fp32.
  const DType router_t = c.sigmoid_router ? f32 : t;
  const size_t router_x32 = c.sigmoid_router && t != f32 ? view_nbytes(f32, {rows, hidden}) : 0;
  const size_t dense_acts = 3 * view_nbytes(t, {rows, inter});
  const size_t moe_acts =
      !c.moe() ? 0
               : view_nbytes(router_t, {rows, experts}) + router_x32 + view_nbytes(f32, {rows, experts}) +
                     view_nbytes(DType::kI32, {rows, k}) + view_nbytes(f32, {rows, k}) +
                     view_nbytes(DType::kI32, {experts + 1}) + view_nbytes(DType::kI32, {rows, k}) +
                     view_nbytes(DType::kI32, {rk}) + 2 * view_nbytes(t, {rk, hidden}) +
                     3 * view_nbytes(t, {erk, mi}) +
                     (ep ? view_nbytes(t, {erk, hidden}) + 2 * view_nbytes(DType::kI32, {erk}) : 0) + shared;
  const size_t mlp_scratch =
      !any_layer ? 0
                 : (c.any_dense_layer() ? 3 * view_nbytes(t, {rows, inter}) : 0) +
                       (!c.moe() ? 0
                                 : 2 * view_nbytes(t, {rk, hidden}) + 3 * view_nbytes(t, {erk, mi}) +
                                       view_nbytes(f32, {rows, k}) + view_nbytes(router_t, {rows, experts}) +
                                       (router_x32 > 0 ? router_x32 + view_nbytes(t, {rows, hidden}) : 0) +
                                       view_nbytes(DType::kF64, {2, experts}) + view_nbytes(DType::kF64, {1}) +
                                       view_nbytes(f32, {experts}) + (ep ? 3 * view_nbytes(t, {erk, hidden}) : 0) +
                                       shared);
  // What one decoder layer saves for backward (its MLP's kind: DeepSeek's
  // first layers are dense); one set holding both kinds with checkpointing.
  const size_t common = view_nbytes(t, {local, hidden}) + view_nbytes(f32, {local}) +
                        nn::arena_nbytes(attention.saved) + 2 * view_nbytes(t, {local, hidden}) +
                        view_nbytes(f32, {local}) +
                        // Sandwich norms (Gemma): each block's output before its norm, and that norm's rstd.
                        (c.sandwich_norms ? 2 * (view_nbytes(t, {local, hidden}) + view_nbytes(f32, {local})) : 0);
  if (checkpoint_activations) {
    if (any_layer) n += common + (c.any_moe_layer() ? moe_acts : 0) + (c.any_dense_layer() ? dense_acts : 0);
  } else {
    for (int64_t l = part.first_layer; l < part.first_layer + part.layers; ++l) {
      n += common + (c.layer_moe(l) ? moe_acts : dense_acts);
    }
  }
  // Backward scratch shared by the layers, the final norm, loss and inputs.
  n += view_nbytes(t, {local, hidden}) + (any_layer ? nn::arena_nbytes(attention.scratch) : 0) + mlp_scratch +
       (c.sandwich_norms ? view_nbytes(t, {local, hidden}) : 0);
  // dres, final_ln, rstd_f, the loss's lse.
  n += view_nbytes(t, {local, hidden}) + view_nbytes(t, {rows, hidden}) + view_nbytes(f32, {local}) +
       view_nbytes(f32, {rows});
  if (sequence_parallel) {  // gathered and partial (a chunk with layers), dgathered, the norms' summed gradient, final_ln_local
    n += (any_layer ? 3 : 1) * view_nbytes(t, {rows, hidden}) + view_nbytes(f32, {hidden}) +
         view_nbytes(t, {local, hidden});
  }
  n += view_nbytes(DType::kF64, {2}) + 2 * view_nbytes(DType::kF64, {1});
  // ids, targets, positions; document starts and ends over the whole sequences.
  n += 3 * view_nbytes(DType::kI32, {rows}) + 2 * view_nbytes(DType::kI32, {batch * whole_seq});
  if (lora.enabled() && any_layer) {
    n += 2 * view_nbytes(t, {rows, lora.rank});  // LoraScratch h and dh
    if (lora.dropout > 0) {  // xd and dxd, for the widest targeted input
      n += 2 * view_nbytes(t, {rows * nn::lora_widest_input(c, lora)});
    }
  }
  return n;
}

RuntimeMemory runtime_memory(const RuntimeInputs& in) {
  nn::DecoderConfig c = in.model;
  c.validate();
  in.zero.validate();
  STRATA_CHECK(in.micro_batch >= 1 && in.seq >= 1 && in.world_size >= 1, kBadArgument,
               "plan: micro-batch {}, sequence {} and world size {} must all be at least 1",
               in.micro_batch, in.seq, in.world_size);
  const int tp = in.tensor_parallel;
  STRATA_CHECK(tp >= 1 && in.world_size % tp == 0, kBadArgument,
               "plan: tensor parallelism {} does not divide the {} ranks", tp, in.world_size);
  // Context parallelism: each rank holds seq / cp tokens of every sequence, two chunks of seq / 2cp.
  const int cp = in.context_parallel;
  STRATA_CHECK(cp == 1 || (cp > 1 && in.seq % (2 * cp) == 0), kBadArgument,
               "plan: context parallelism {} cuts each sequence into 2 x {} chunks, but seq {} does not divide by {}",
               cp, cp, in.seq, 2 * cp);
  STRATA_CHECK(!in.sequence_parallel || (tp > 1 && in.micro_batch * (in.seq / cp) % tp == 0), kBadArgument,
               "plan: sequence parallelism needs tensor parallelism of 2 or more dividing micro-batch x seq{} ({} x {})",
               cp > 1 ? " / cp" : "", in.micro_batch, in.seq / cp);
  STRATA_CHECK(tp == 1 || !in.lora.enabled(), kBadArgument,
               "plan: LoRA with tensor parallelism is not implemented (strata finetune refuses it)");
  if (cp > 1) {
    nn::refuse_unsupported_with_context_parallel(fmt::format("plan: context parallelism {}", cp),
                                                 nn::context_parallel_uses(c, in.lora.enabled(), in.pipeline.stages));
  }
  STRATA_CHECK(cp == 1 || in.pipeline.stages == 1, kBadArgument,
               "plan: context parallelism with pipeline stages trains (strata finetune), but strata plan does not "
               "model its memory yet");
  // Pipeline parallelism: this pp rank's share of the model.
  const int pp = in.pipeline.stages;
  STRATA_CHECK(pp >= 1 && in.world_size % (tp * pp) == 0, kBadArgument,
               "plan: pipeline parallelism {} x tensor parallelism {} does not divide the {} ranks", pp, tp,
               in.world_size);
  std::optional<StageShare> stage;
  if (pp > 1) {
    in.pipeline.check();
    STRATA_CHECK(static_cast<int>(in.pipeline_split.size()) == pp * in.pipeline.virtual_stages, kBadArgument,
                 "plan: {} layer counts for {} x {} virtual pipeline stages", in.pipeline_split.size(), pp,
                 in.pipeline.virtual_stages);
    stage = stage_share(in);
  }
  STRATA_CHECK(in.layer_major.micro_batches == 0 || (pp == 1 && cp == 1 && tp == 1), kBadArgument,
               "plan: layer-major micro-batches with pipeline, context or tensor parallelism: strata finetune "
               "refuses them");
  const auto ours = [&](std::string_view name) { return !stage || stage->holds(c, name); };
  // ZeRO partitions over the data-parallel ranks.
  const int dp = in.world_size / (tp * pp);
  STRATA_CHECK(!in.cpu_checkpointing || in.checkpoint_activations, kBadArgument,
               "plan: cpu_checkpointing needs activation checkpointing");
  if (in.lora.enabled()) in.lora.validate();
  const DType pd = in.param_dtype;
  // The sizes the engine's finalize will use: the same choice from the same
  // parameters (the base frozen under LoRA, the adapters trained).
  // A LoRA base from an FP8 checkpoint at ZeRO-3: its stored-FP8 weights
  // stay FP8 at home (docs/DESIGN.md §4.2.2), a group of e4m3 bytes.
  const bool fp8_base = keeps_fp8_base(c, in.lora, in.zero.stage, tp);
  std::vector<engine::SizedParam> sized_params = decoder_sized_params(c, pd, in.lora, tp, fp8_base);
  std::erase_if(sized_params, [&](const engine::SizedParam& p) { return !ours(p.name); });
  const engine::ZeroSizes sizes =
      engine::choose_zero_sizes(sized_params, dp, in.zero.sub_group_numel, in.zero.reduce_bucket_numel,
                                partition::kDefaultAlignmentNbytes);
  engine::ZeroEngineOptions z = in.zero;
  z.sub_group_numel = sizes.sub_group_numel;
  z.reduce_bucket_numel = sizes.reduce_bucket_numel;
  const double pe = static_cast<double>(dtype_nbytes(pd));
  const double world = dp;
  partition::LayoutOptions layout_options;
  layout_options.world_size = dp;
  layout_options.sub_group_numel = z.sub_group_numel;
  // ZeroEngine's groups (on_finalize): one per (dtype, frozen, tp split), in
  // the order of their first parameter. Without LoRA every parameter trains
  // in the parameter dtype (with tp, the split ones a group of their own);
  // with it the base is a frozen group and the fp32 adapters the trained one.
  struct Group {
    std::unique_ptr<partition::PartitionLayout> layout;
    double elem = 0;  // bytes per element at home
    // Bytes per element a gather holds: elem, or for an FP8 group the
    // dequantized full copy (the parameter dtype) and the e4m3 bytes gathered into.
    double gathered_elem = 0;
    bool frozen = false;
    double padded_numel = 0, largest_slice = 0, largest_full = 0;
    // The slices of the parameters whose slice has padding (a world of one's
    // reducer copies only these: bucket_reducer.cc).
    double padding_slices_numel = 0;
    size_t opt_sub_group = 0;  // its sub-group (the home's chunk; the optimizer's record)
    std::string label;         // when there are several: "frozen base", "adapters", "replicated", "tp shards"
  };
  std::vector<Group> groups;
  double fp8_scale_nbytes = 0;  // every FP8 weight's whole fp32 scale grid
  int64_t fp8_weights = 0;
  const auto add_group = [&](std::vector<partition::ParamSpec> specs, DType dtype, bool frozen, std::string label) {
    Group g;
    g.label = std::move(label);
    g.layout = std::make_unique<partition::PartitionLayout>(std::move(specs), layout_options);
    g.elem = static_cast<double>(dtype_nbytes(dtype));
    g.gathered_elem = dtype == DType::kF8E4M3 ? g.elem + static_cast<double>(dtype_nbytes(pd)) : g.elem;
    g.frozen = frozen;
    g.opt_sub_group = optimizer_sub_group_numel(*g.layout, dtype, z.sub_group_numel);
    groups.push_back(std::move(g));
  };
  {
    std::vector<partition::ParamSpec> specs[3];  // whole, split, FP8
    std::vector<int> order;                      // of the groups' first parameters
    for (RankParam& p : decoder_rank_params(c, pd, tp)) {
      if (!ours(p.spec.name)) continue;  // another pipeline stage's
      const int kind = fp8_base && stored_fp8(c, p.spec.name, p.spec.shape) ? 2 : p.split;
      if (kind == 2) {
        p.spec.dtype = DType::kF8E4M3;
        const kernels::Fp8Blocks blocks{p.spec.shape[0], p.spec.shape[1], c.quant.block_rows, c.quant.block_cols};
        fp8_scale_nbytes += 4.0 * static_cast<double>(blocks.grid_numel());
        ++fp8_weights;
      }
      if (specs[kind].empty()) order.push_back(kind);
      specs[kind].push_back(std::move(p.spec));
    }
    for (int s : order) {
      add_group(std::move(specs[s]), s == 2 ? DType::kF8E4M3 : pd, in.lora.enabled(),
                s == 2 ? "FP8 base" : in.lora.enabled() ? "frozen base" : s ? "tp shards" : "replicated");
    }
  }
  if (in.lora.enabled()) {
    std::vector<partition::ParamSpec> adapters = lora_params(c, in.lora);
    std::erase_if(adapters, [&](const partition::ParamSpec& p) { return !ours(p.name); });
    add_group(std::move(adapters), DType::kF32, false, "adapters");
  }
  // Over every group, in bytes (the gathers hold all of them); over the
  // trained groups, in elements (gradients and optimizer state).
  double shard_nbytes = 0, padded_nbytes = 0, persistent_nbytes = 0, largest_full_nbytes = 0;
  for (Group& g : groups) {
    for (const auto& slot : g.layout->params()) {
      const double full = static_cast<double>(slot.slice_numel) * world;  // a gather's output
      g.padded_numel += full;
      g.largest_slice = std::max(g.largest_slice, static_cast<double>(slot.slice_numel));
      g.largest_full = std::max(g.largest_full, full);
      if (slot.owned_numel(0) != slot.slice_numel) g.padding_slices_numel += static_cast<double>(slot.slice_numel);
      if (slot.numel <= z.persistence_threshold_numel) persistent_nbytes += g.gathered_elem * full;
    }
    shard_nbytes += static_cast<double>(g.layout->shard_nbytes());
    padded_nbytes += g.gathered_elem * g.padded_numel;
    largest_full_nbytes = std::max(largest_full_nbytes, g.gathered_elem * g.largest_full);
  }
  // The trained groups: each has its gradient shard, reducer and optimizer
  // state (a shared pool of pipeline buffers on NVMe).
  std::vector<const Group*> trained;
  double shard_numel = 0, padded_numel = 0;
  for (const Group& g : groups) {
    if (g.frozen) continue;
    trained.push_back(&g);
    shard_numel += static_cast<double>(g.layout->shard_numel());
    padded_numel += g.padded_numel;
  }
  const auto sum_trained = [&](auto&& f) {
    double total = 0;
    for (const Group* g : trained) total += f(*g);
    return total;
  };
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
  // This rank's rows (with context parallelism its two chunks of every sequence).
  const int64_t rows = in.micro_batch * in.seq / cp;
  // The residual stream's rows: this rank's share with sequence parallelism.
  const int64_t local_rows = in.sequence_parallel ? rows / tp : rows;
  // This rank's MLP features (all of them without tensor parallelism).
  const int64_t intermediate = nn::tensor_parallel_share(c, tp).intermediate_size;
  // The model runner allocates its arena and scratch at the first forward.
  during_steps = true;
  // Arenas (one per micro-batch slot of each chunk with a pipeline) and
  // their host checkpoints, and the pinned inputs each one stages.
  int arenas = 1;
  double host_checkpoint_nbytes =
      in.cpu_checkpointing && c.num_hidden_layers > 1
          ? static_cast<double>((c.num_hidden_layers - 1) * view_nbytes(in.activation_dtype, {local_rows, c.hidden_size}))
          : 0;
  // The model in chunks, each an arena per micro-batch slot: pp rank
  // pipeline_rank's stages, or layer-major's layers between the embedding
  // and the head (pipeline::make_layer_models).
  const RuntimeInputs::LayerMajor& lm = in.layer_major;
  std::vector<pipeline::StagePart> parts;
  ChunkSlots slots;
  if (stage) {
    parts = stage->chunks;
    slots = pipeline_chunk_slots(pipeline::make_schedule(in.pipeline), in.pipeline_rank);
  } else if (lm.micro_batches > 0) {
    parts.push_back({0, 0, true, false});
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) parts.push_back({l, 1, false, false});
    parts.push_back({c.num_hidden_layers, 0, false, true});
    const int chunks = static_cast<int>(parts.size());
    // Keeping, a slot holds a micro-batch from its forward to its backward, as
    // a pipeline's does; recomputing, every micro-batch computes in one.
    slots = lm.keep_activations
                ? pipeline_chunk_slots(pipeline::layer_major(lm.micro_batches, chunks), 0)
                : ChunkSlots{std::vector<int>(static_cast<size_t>(chunks), 1), std::vector<int>(static_cast<size_t>(chunks), 0)};
  }
  if (!parts.empty()) {
    double arena_nbytes = 0, deferred_nbytes = 0;
    std::string per_chunk;
    arenas = 0;
    host_checkpoint_nbytes = 0;
    for (size_t k = 0; k < parts.size(); ++k) {
      const pipeline::StagePart& part = parts[k];
      arena_nbytes += slots.slots[k] * static_cast<double>(decoder_chunk_arena_nbytes(
                                           c, part, in.activation_dtype, in.micro_batch, in.seq,
                                           in.checkpoint_activations, in.cpu_checkpointing, in.lora,
                                           in.zero.expert_parallel_size, tp, in.sequence_parallel));
      arenas += slots.slots[k];
      if (in.cpu_checkpointing && part.layers > 1) {
        host_checkpoint_nbytes += slots.slots[k] * static_cast<double>((part.layers - 1) *
                                                                       view_nbytes(in.activation_dtype, {local_rows, c.hidden_size}));
      }
      // zb-h1: each Linear's output gradient dy [rows, out] copied at B until
      // W (its input x is read in place from the slot; LoRA-adapted
      // projections compute their weight gradients at once, none deferred).
      if (slots.awaiting_weight_grads[k] > 0) {
        const nn::DecoderConfig share = nn::tensor_parallel_share(c, tp);
        const int64_t q = share.num_attention_heads * share.head_dim, kv = share.num_key_value_heads * share.head_dim;
        const std::pair<const char*, int64_t> outs[] = {{"q_proj", q}, {"k_proj", kv}, {"v_proj", kv}, {"o_proj", c.hidden_size},
                                                        {"gate_proj", share.intermediate_size}, {"up_proj", share.intermediate_size},
                                                        {"down_proj", c.hidden_size}};
        int64_t out_features = 0;
        for (const auto& [name, n] : outs) {
          if (!in.lora.enabled() || !in.lora.targets_module(name)) out_features += n;
        }
        deferred_nbytes += slots.awaiting_weight_grads[k] * static_cast<double>(part.layers) *
                           static_cast<double>(rows * out_features * static_cast<int64_t>(dtype_nbytes(in.activation_dtype)));
      }
      if (stage) per_chunk += fmt::format("{}{} x {} layers", per_chunk.empty() ? "" : " + ", slots.slots[k], part.layers);
    }
    if (stage) {
      add("activation arenas", Where::kDevice, arena_nbytes, false,
          fmt::format("DecoderModel's arena per micro-batch slot of pp rank {}'s layers: {} (slots x layers, the "
                      "{} schedule's micro-batches in flight), {} rows x hidden {} / intermediate {}",
                      in.pipeline_rank, per_chunk, pipeline::schedule_name(in.pipeline.kind), rows, c.hidden_size,
                      intermediate));
      add("deferred weight-gradient inputs", Where::kDevice, deferred_nbytes, true,
          "zb-h1: each Linear's output gradient copied at B, held until its W, for the most micro-batches between "
          "them (the attention and MLP projections' output widths x rows)");
    } else {
      add("activation arenas", Where::kDevice, arena_nbytes, false,
          fmt::format("layer-major: DecoderModel's arena of each of the {} layers, the embedding's and the head's, "
                      "{} ({} in all), {} rows x hidden {} / intermediate {}",
                      c.num_hidden_layers,
                      lm.keep_activations ? fmt::format("one per micro-batch ({}; strata.layer_major_activations keep)",
                                                        lm.micro_batches)
                                          : std::string("one that every micro-batch recomputes in"),
                      arenas, rows, c.hidden_size, intermediate));
      // Each micro-batch's input to every chunk but the embedding's, and the
      // gradient flowing down: [rows, hidden] in the activation dtype.
      const int chunks = static_cast<int>(parts.size());
      const size_t boundary = static_cast<size_t>(local_rows * c.hidden_size) * dtype_nbytes(in.activation_dtype);
      const pipeline::KeptBoundariesSize kept = pipeline::kept_boundaries_size(lm.boundaries, chunks, lm.micro_batches, boundary);
      const std::string shape = fmt::format("{} micro-batches x ({} chunk inputs + the gradient flowing down) of "
                                            "{} rows x hidden {}",
                                            lm.micro_batches, chunks - 1, local_rows, c.hidden_size);
      switch (lm.boundaries) {
        case pipeline::BoundaryHome::kDevice:
          add("layer-major boundaries", Where::kDevice, static_cast<double>(kept.memory_nbytes), false, shape);
          break;
        case pipeline::BoundaryHome::kPinnedHost:
          add("layer-major boundaries", Where::kPinned, static_cast<double>(kept.memory_nbytes), false,
              shape + " (strata.layer_major_boundaries cpu)");
          break;
        case pipeline::BoundaryHome::kNvme:
          add("layer-major boundaries' staging", Where::kPinned, static_cast<double>(kept.memory_nbytes), false,
              fmt::format("strata.layer_major_boundaries nvme: {} staging buffers and the {} gradients flowing down",
                          2 * lm.micro_batches + 2, lm.micro_batches));
          add("layer-major boundaries", Where::kNvme, static_cast<double>(kept.file_nbytes), false,
              shape + ", less the gradients: a place per (chunk, micro-batch) of a file under nvme_path/layer_major");
          break;
      }
    }
  } else {
    add("activation arena", Where::kDevice,
        static_cast<double>(decoder_arena_nbytes(c, in.activation_dtype, in.micro_batch, in.seq,
                                                 in.checkpoint_activations, in.cpu_checkpointing, in.lora,
                                                 in.zero.expert_parallel_size, tp, in.sequence_parallel, cp)),
        false,
        fmt::format("DecoderModel's arena: {} rows{} x hidden {} / intermediate {}{}, {}", rows,
                    cp > 1 ? fmt::format(" (cp {}'s share: {} of each sequence's {} tokens)", cp, in.seq / cp, in.seq)
                           : std::string(),
                    c.hidden_size, intermediate,
                    tp == 1                  ? ""
                    : in.sequence_parallel ? fmt::format(" (tp {}'s share; the residual stream's {} rows)", tp,
                                                         local_rows)
                                           : fmt::format(" (tp {}'s share)", tp),
                    in.checkpoint_activations ? "one layer's activations + the checkpoints"
                                              : fmt::format("{} layers' activations", c.num_hidden_layers)));
    // The ring's or Ulysses' buffers: the attention's own, beside the arena, on a tp rank's heads.
    const nn::DecoderConfig heads = nn::tensor_parallel_share(c, tp);
    add("context-parallel attention buffers", Where::kDevice,
        static_cast<double>(nn::context_buffer_nbytes(in.context_method, cp, in.micro_batch, in.seq,
                                                      heads.num_attention_heads, heads.num_key_value_heads,
                                                      c.head_dim, in.activation_dtype)),
        false,
        fmt::format("{} over {} ranks: {} tokens (b x s / cp) of {} heads and {} kv heads x head_dim {}{}",
                    nn::context_method_name(in.context_method), cp, rows, heads.num_attention_heads,
                    heads.num_key_value_heads, c.head_dim,
                    in.context_method == nn::ContextMethod::kRing
                        ? " (k/v ring buffers, and the larger of forward's block output and fp32 merged outputs "
                          "and backward's block gradients and two sets of dk/dv accumulators)"
                        : " (heads / cp over the whole sequence, with their gradients, and the all-to-alls' blocks)"));
  }
  // The loss forms logits chunk rows at a time (nn::default_loss_chunk_rows:
  // 64 MiB of fp32, at least 64 rows): the fused loss in its own fp32
  // scratch; with tensor parallelism the model's (DecoderModel::Arena::
  // vocab_memory): this rank's vocabulary rows in the activation dtype, and
  // each row's two parts, gathered from every rank.
  const int64_t chunk = std::min(nn::default_loss_chunk_rows(c, tp), rows), shard = c.vocab_size / tp;
  if (!stage || stage->head) {  // with a pipeline, the last stage's
    add("loss logits scratch", Where::kDevice,
        tp == 1 ? 4.0 * static_cast<double>(chunk * c.vocab_size)
                : static_cast<double>(view_nbytes(in.activation_dtype, {chunk, shard}) +
                                      view_nbytes(DType::kF32, {2 * chunk}) + view_nbytes(DType::kF32, {tp * 2 * chunk})),
        false,
        tp == 1 ? fmt::format("{} rows x vocab {} fp32", chunk, c.vocab_size)
                : fmt::format("{} rows x vocab {} / tp {} (this rank's rows) + their parts", chunk, c.vocab_size, tp));
  }
  // Linear backward accumulating into dx stages the product in a [rows, in] fp32 scratch
  // (ops_cpu.cc).
  if (in.device_is_host) {
    // A mixture of experts accumulates into its permuted rows (rows x top-k x hidden).
    const int64_t dx_rows = c.moe() ? rows * c.num_experts_per_tok : rows;
    add("backward dx scratch", Where::kDevice,
        4.0 * static_cast<double>(dx_rows * std::max(c.hidden_size, intermediate)), true,
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
  if (fp8_weights > 0) {
    // ZeroEngine::Fp8Scales: on the accelerator for the gathers'
    // dequantization, on the host for reads of the owned ranges.
    const std::string grids = fmt::format("the FP8 base's {} weights' whole fp32 scale grids ({} x {} blocks)",
                                          fp8_weights, c.quant.block_rows, c.quant.block_cols);
    add("FP8 scale grids", Where::kDevice, fp8_scale_nbytes, false, grids + ", for the gathers");
    add("FP8 scale grids (host copy)", Where::kHost, fp8_scale_nbytes, false, grids + ", for owned reads");
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
    // each up to reduce_bucket_size plus one parameter; per trained group (its reducer).
    const auto bucket = [&](const Group& g) { return static_cast<double>(z.reduce_bucket_numel) + g.largest_full; };
    add("fp32 gradients awaiting reduction", Where::kDevice,
        sum_trained([&](const Group& g) { return 4.0 * std::min(g.padded_numel, 3 * bucket(g)); }), true,
        fmt::format("open bucket + 2 in flight of reduce_bucket_size {}{}{}", z.reduce_bucket_numel,
                    trained.size() > 1 ? " per group" : "", lora_basis));
    if (world > 1) {
      add("reduce-scatter buffers", Where::kDevice,
          sum_trained([&](const Group& g) { return 4.0 * (1 + 1 / world) * std::min(g.padded_numel, 2 * bucket(g)); }),
          true, "2 buckets in flight: send (all ranks' slices) + receive (this rank's)");
    } else {
      add("padded gradient copies", Where::kDevice,
          sum_trained([&](const Group& g) { return 4.0 * std::min(g.padding_slices_numel, 2 * bucket(g)); }), true,
          "a world of one reduces in place: only padded slices are copied, 2 buckets in flight");
    }
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
      add(groups.size() > 1 ? "NVMe read staging (" + g.label + ")" : std::string("NVMe read staging"),
          Where::kPinned, count * g.elem * g.largest_slice, false,
          fmt::format("{:.0f} buffers of the largest slice ({:.0f} elements)", count,
                      g.largest_slice));
    }
  }
  {
    // engine::cached_param_writes sub-groups of new values per trained home (zero_engine.cc).
    const auto cached = [&](const Group& g) {
      const size_t slots = engine::cached_param_writes(
          z, z.param_tier, g.opt_sub_group, std::max(g.opt_sub_group, static_cast<size_t>(g.largest_slice)));
      return static_cast<double>(slots) * g.elem * static_cast<double>(g.opt_sub_group);
    };
    const double nbytes = sum_trained(cached);
    if (nbytes > 0) {
      add("parameter writes kept for the next forward", Where::kPinned, nbytes, false,
          fmt::format("the new values of the last sub-groups written (the largest slice's and {} more), read by "
                      "the next forward's gathers",
                      engine::kCachedParamWrites));
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
    // offload/shard_optimizer.cc: the trained groups in order share a pool
    // while its buffers hold their sub-group; a bigger one makes a new pool.
    double pools = 0, pool_buffer = 0;
    size_t largest_sub_group = 0;
    for (const Group* g : trained) {
      const size_t record = offload::OptimizerSwapper::buffer_nbytes(g->opt_sub_group, z.grad_tier == strata::Tier::kNvme);
      if (pool_buffer < static_cast<double>(record)) {
        pool_buffer = static_cast<double>(record);
        pools += static_cast<double>(z.optimizer_buffer_count) * pool_buffer;
      }
      largest_sub_group = std::max(largest_sub_group, g->opt_sub_group);
    }
    add("optimizer pipeline buffers", Where::kPinned, pools, false,
        fmt::format("{} buffers of one sub-group's fp32 master + 2 moments{} ({} elements){}",
                    z.optimizer_buffer_count, z.grad_tier == strata::Tier::kNvme ? " + its gradient" : "",
                    largest_sub_group, lora_basis));
  } else if (z.optimizer_tier == strata::Tier::kCpu) {
    add("optimizer state", Where::kHost, 12.0 * shard_numel, false,
        "fp32 master + 2 moments of the shard" + lora_basis);
  }
  if (z.grad_tier == strata::Tier::kNvme) {
    add("gradient shard scratch", Where::kPinned, sum_trained([](const Group& g) { return 4.0 * 2 * g.largest_slice; }),
        false, "2 slices for accumulation (GradShard, per trained group)");
    during_steps = true;
    add("gradient shard window", Where::kPinned,
        sum_trained([](const Group& g) { return 4.0 * static_cast<double>(g.opt_sub_group); }), false,
        "one sub-group read for the optimizer (GradShard, per trained group)");
  }
  during_steps = true;  // the model runner's, at the first forward
  // ids, targets and positions per row; document starts and ends over the whole sequences.
  add("input staging", Where::kPinned,
      arenas * (12.0 * static_cast<double>(rows) + 8.0 * static_cast<double>(in.micro_batch * in.seq) + 24), false,
      arenas > 1 ? fmt::format("ids, targets, positions, document starts and ends, per arena ({})", arenas)
                 : std::string("ids, targets, positions, document starts and ends"));
  add("activation checkpoints", Where::kPinned, host_checkpoint_nbytes, false,
      stage ? "every layer's input but the top one's, per arena" : "every layer's input but the top one's");

  // ---- NVMe ----------------------------------------------------------------------
  during_steps = false;
  if (z.param_tier == strata::Tier::kNvme) {
    add("parameter file", Where::kNvme, shard_nbytes, false,
        groups.size() > 1 ? fmt::format("this rank's shard (a file per group: {})", [&] {
          std::string labels;
          for (const Group& g : groups) labels += (labels.empty() ? "" : ", ") + g.label;
          return labels;
        }())
                          : std::string("this rank's shard"));
  }
  if (z.grad_tier == strata::Tier::kNvme) {
    add("fp32 gradient file", Where::kNvme, 4.0 * shard_numel, false,
        "this rank's gradient shard" + lora_basis);
  }
  if (z.optimizer_tier == strata::Tier::kNvme) {
    add("optimizer state files", Where::kNvme, sum_trained([](const Group& g) {
          const double records = std::ceil(static_cast<double>(g.layout->shard_numel()) / static_cast<double>(g.opt_sub_group));
          return 2 * records * static_cast<double>(offload::OptimizerSwapper::record_nbytes(g.opt_sub_group));
        }),
        false, "two slots (crash-safe commit) of fp32 master + 2 moments per sub-group" + lora_basis);
  }
  return out;
}

}  // namespace strata::plan
