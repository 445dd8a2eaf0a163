// What strata's own training loop holds per rank, item by item: a DecoderModel
// (runtime/nn) on the ZeroEngine (runtime/engine), as `strata finetune` runs
// it. The papers' formulas in plan.h count model states, activations and the
// largest operator as a GPU framework of 2021 held them; this runtime keeps an
// activation arena laid out by the model runner, gathers parameters within the
// stage-3 budgets, reduces gradients in buckets, and stages NVMe traffic
// through pinned buffers sized by the ds_config. Those are the lines here, so
// `strata plan --check` can set a prediction beside a measured run.
//
// Each item mirrors the allocation it names (the code it follows is cited at
// the item), from the same pure inputs the runtime uses: the partition layout
// (partition::PartitionLayout), the engine options (train::zero_engine_options
// of the ds_config) and the model config. An item is either exact (the
// runtime allocates exactly that) or an upper bound (what is live at once
// depends on stream timing: gathers, gradients waiting for their bucket).
//
// Not counted, and said so by the report: the process itself (code,
// libraries, thread stacks, BLAS and communicator buffers), which is measured
// rather than predicted; op scratch for 16-bit weights on the cpu backend;
// the cuda backend's caching allocator.
//
// Thread-safety: pure functions. Errors: Error(kBadArgument) for a model or
// options the runtime itself would refuse (checked by their own validate()).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/engine/zero_sizes.h"
#include "runtime/nn/context_attention.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/nn/lora.h"
#include "runtime/pipeline/kept_boundaries.h"
#include "runtime/pipeline/schedule.h"
#include "runtime/pipeline/stages.h"
#include "runtime/plan/plan.h"

namespace strata::plan {

struct RuntimeInputs {
  nn::DecoderConfig model;
  DType param_dtype = DType::kF32;       // parameter storage (bf16/fp16 with mixed precision)
  DType activation_dtype = DType::kF32;  // DecoderModel's: fp32 on the cpu accelerator
  int64_t micro_batch = 1;
  int64_t seq = 256;
  bool checkpoint_activations = false;
  bool cpu_checkpointing = false;  // checkpoints in pinned host memory
  int world_size = 1;
  engine::ZeroEngineOptions zero;
  // The cpu accelerator: "device" memory is host memory of the process.
  bool device_is_host = true;
  // LoRA (`strata finetune --lora-rank`; rank 0: none): the base is frozen, a
  // group of its own with its weights only (no gradient shard, reduce buckets
  // or optimizer state), and the fp32 adapters are the trained group.
  nn::LoraSpec lora;
  // Tensor parallelism (`--tp`, tensor_parallel.autotp_size): world_size
  // counts every rank; ZeRO partitions over world_size / tensor_parallel.
  // The items are tp rank 0's (decoder_rank_params); with sequence parallelism
  // its arena holds its rows' share (decoder_arena_nbytes).
  int tensor_parallel = 1;
  bool sequence_parallel = false;
  // Context parallelism (`--cp`, context_parallel.size): `seq` is the whole
  // sequence, of which each rank holds seq / context_parallel tokens (its two
  // chunks): its arena those rows (with sequence parallelism their share),
  // the document arrays over the whole sequences, and beside the arena the
  // ring's or Ulysses' buffers (nn::context_buffer_nbytes). world_size still
  // counts every rank: ZeRO partitions over world_size / tensor_parallel =
  // dp x cp.
  int context_parallel = 1;
  nn::ContextMethod context_method = nn::ContextMethod::kRing;
  // Pipeline parallelism (pipeline.stages > 1): the items are pp rank
  // `pipeline_rank`'s. Its chunks' layers (pipeline::stage_part of
  // `pipeline_split`, the layers per virtual stage), the embedding where it
  // holds virtual stage 0, the final norm, lm_head and loss where it holds
  // the last (a tied embedding on both); each chunk an arena per
  // micro-batch slot, as many as the schedule keeps in flight on it
  // (pipeline_chunk_slots); zb-h1's deferred weight gradients' copies.
  // world_size counts every rank: ZeRO partitions over world_size /
  // (tensor_parallel x stages).
  pipeline::ScheduleSpec pipeline{.stages = 1};
  std::vector<int64_t> pipeline_split;
  int pipeline_rank = 0;
  // Layer-major micro-batches (strata.micro_batch_order; docs/DESIGN.md §5.5),
  // when micro_batches > 0: the model as single-layer chunks between the
  // embedding's and the head's (pipeline::make_layer_models), each with one
  // arena every micro-batch reuses, or one per micro-batch when it keeps their
  // activations (strata.layer_major_activations keep); and every
  // micro-batch's boundaries where `boundaries` keeps them
  // (pipeline::KeptBoundaries: device, pinned host, or a file under
  // zero.nvme_path through pinned staging).
  struct LayerMajor {
    int micro_batches = 0;  // gradient_accumulation_steps; 0: step-major
    bool keep_activations = false;
    pipeline::BoundaryHome boundaries = pipeline::BoundaryHome::kDevice;
  } layer_major;
};

// The micro-batch slots each chunk of pp rank `rank` makes in a step of
// `schedule` (pipeline::PipelineExecutor's: a slot from the micro-batch's
// first action on the chunk to its last), and for a split backward the most
// micro-batches between their B and their W (whose output gradients wait,
// copied, for W).
struct ChunkSlots {
  std::vector<int> slots, awaiting_weight_grads;
};
ChunkSlots pipeline_chunk_slots(const pipeline::Schedule& schedule, int rank);

// Where an item lives. kPinned and kHost are both host memory (resident);
// kPinned is page-locked (mlock), so it is resident from allocation on.
enum class Where { kDevice, kPinned, kHost, kNvme };
std::string_view where_name(Where where);  // "device", "pinned host", "host", "nvme"

struct MemoryItem {
  std::string name;  // "activation arena"
  Where where = Where::kDevice;
  double nbytes = 0;
  bool upper_bound = false;  // false: exactly what the runtime allocates
  std::string basis;         // how it is sized, for the report
  // Allocated by the steps (first forward, backward, optimizer) rather than
  // at setup (finalize, weights): what a process resident at the start of its
  // first step does not hold yet.
  bool during_steps = false;
};

struct RuntimeMemory {
  std::vector<MemoryItem> items;
  // sub_group_size and reduce_bucket_size as the engine will use them: chosen
  // from the model's layers where RuntimeInputs::zero leaves them to choose
  // (engine::choose_zero_sizes, the engine's own function), else as given.
  engine::ZeroSizes zero_sizes;
  double device_nbytes = 0, pinned_nbytes = 0, host_nbytes = 0, nvme_nbytes = 0;  // sums per Where
  // What the process holds resident beyond its own baseline: pinned + host,
  // plus device memory when the device is host memory (the cpu accelerator).
  double resident_nbytes(bool device_is_host) const {
    return pinned_nbytes + host_nbytes + (device_is_host ? device_nbytes : 0);
  }
  // The part of resident_nbytes allocated at setup (items not during_steps).
  double setup_resident_nbytes(bool device_is_host) const {
    double total = 0;
    for (const MemoryItem& item : items) {
      if (item.during_steps || item.where == Where::kNvme ||
          (item.where == Where::kDevice && !device_is_host))
        continue;
      total += item.nbytes;
    }
    return total;
  }
};

// The parameters DecoderModel declares for `model` (in `dtype`) and, with
// `lora`, its fp32 adapters, as the engine's size choice sees them: the base
// trained without LoRA and frozen with it (engine::choose_zero_sizes); with
// `fp8_base` (keeps_fp8_base) the weights stored_fp8 names in e4m3.
std::vector<engine::SizedParam> decoder_sized_params(const nn::DecoderConfig& model, DType dtype,
                                                   const nn::LoraSpec& lora, int tensor_parallel = 1,
                                                   bool fp8_base = false);

// The plan's shape of `model` (strata plan --model): its parameters, layers,
// widths and vocabulary; with experts their count, width and the active
// parameters; the input embedding (a lookup).
ModelShape decoder_model_shape(const nn::DecoderConfig& model);

// Whether a block-quantized FP8 checkpoint of `model` stores the tensor
// `name` of `shape` in FP8, as the published ones do: the layers' 2-D
// weights but the router's (mlp.gate) and modules_to_not_convert's. False
// for a model that is not FP8.
bool stored_fp8(const nn::DecoderConfig& model, std::string_view name, const Shape& shape);
// Whether strata finetune keeps those weights in FP8 at home (docs/DESIGN.md
// §4.2.2): a LoRA base (frozen, whole tensors) at ZeRO-3; stages 1/2 and tp
// shards dequantize at load.
bool keeps_fp8_base(const nn::DecoderConfig& model, const nn::LoraSpec& lora, int zero_stage, int tensor_parallel);

// One parameter as tensor-parallel rank 0 of `tensor_parallel` declares it:
// DecoderModel's column-parallel q/k/v and gate/up (weight and bias: their rows
// / tp, or one kv head's rows when tp exceeds the kv heads) and row-parallel
// o and down weights (their columns / tp), the embedding and lm_head (their
// vocabulary rows / tp) are `split` (the ZeroEngine groups them apart); the
// norms and row-parallel biases whole. Without tensor parallelism, every tensor whole.
struct RankParam {
  partition::ParamSpec spec;
  bool split = false;
};
std::vector<RankParam> decoder_rank_params(const nn::DecoderConfig& model, DType dtype, int tensor_parallel);

// The activation arena of DecoderModel::ensure_arena (runtime/nn/decoder_model.cc)
// for a batch x seq, in bytes: every view rounded up to 256 bytes.
// LoRA adapters add their two [rows, r] scratch views, and with dropout two
// [rows x the widest targeted input] ones (nn::LoraScratch). With expert
// parallelism (expert_parallel > 1) the experts' buffers hold expert_parallel
// x rows x k rows, plus the exchange's (nn::MoeActs). With tensor
// parallelism (tensor_parallel > 1) one rank's: its heads and MLP features
// (nn::tensor_parallel_share); with sequence parallelism as well, the
// residual stream and the norms hold its rows / tensor_parallel rows, plus
// the gathers' scratch (nn::DecoderModelOptions::sequence_parallel). With
// context parallelism (context_parallel > 1) `seq` is the whole sequence: the
// rows are a cp rank's batch x seq / context_parallel, the document arrays
// the whole sequences' (nn::ContextLayout).
size_t decoder_arena_nbytes(const nn::DecoderConfig& model, DType activation_dtype, int64_t batch,
                          int64_t seq, bool checkpoint_activations, bool cpu_checkpointing,
                          const nn::LoraSpec& lora = {}, int expert_parallel = 1, int tensor_parallel = 1,
                          bool sequence_parallel = false, int context_parallel = 1);
// The arena of one chunk of the model (nn::DecoderModelOptions::stage: a
// pipeline stage's, or layer-major's single layers, embedding and head): its
// layers' activations, each layer's MLP by its own index (DeepSeek's first
// layers are dense), and none of the layers' backward scratch or LoRA's
// when it holds no layer. decoder_arena_nbytes is the whole model's chunk.
size_t decoder_chunk_arena_nbytes(const nn::DecoderConfig& model, const pipeline::StagePart& part,
                                  DType activation_dtype, int64_t batch, int64_t seq, bool checkpoint_activations,
                                  bool cpu_checkpointing, const nn::LoraSpec& lora = {}, int expert_parallel = 1,
                                  int tensor_parallel = 1, bool sequence_parallel = false, int context_parallel = 1);

// Per rank, item by item. Throws Error(kBadArgument) for inputs the runtime refuses.
RuntimeMemory runtime_memory(const RuntimeInputs& inputs);

}  // namespace strata::plan
