// Export: gather each tensor to rank 0 from the owned ranges, convert, write.
#include "runtime/train/hf_export.h"

#include "runtime/nn/fp8_export.h"
#include "runtime/nn/param_files.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/durable_file.h"
#include "core/error.h"
#include "kernels/fp8_quantize.h"
#include "runtime/nn/safetensors.h"
#include "runtime/nn/safetensors_stream.h"
#include "runtime/train/export_dir.h"

namespace strata::train {
namespace fs = std::filesystem;
namespace {

// An allgather of host buffers through accelerator memory (NCCL needs device
// buffers; on the cpu accelerator this is a copy more than necessary).
void allgather_host(partition::Communicator& comm, Accelerator& accelerator, Stream& stream, const void* send,
                    void* recv, size_t numel, DType dtype) {
  const size_t nbytes = numel * dtype_nbytes(dtype), world = static_cast<size_t>(comm.world_size());
  void* device_send = accelerator.allocate(std::max<size_t>(nbytes, 1));
  void* device_recv = accelerator.allocate(std::max<size_t>(nbytes * world, 1));
  try {
    if (nbytes > 0) accelerator.copy_async(device_send, send, nbytes, CopyKind::kHostToDevice, stream);
    comm.allgather(device_send, device_recv, numel, dtype, stream);
    if (nbytes > 0) accelerator.copy_async(recv, device_recv, nbytes * world, CopyKind::kDeviceToHost, stream);
    stream.synchronize();
  } catch (...) {
    accelerator.deallocate(device_send);
    accelerator.deallocate(device_recv);
    throw;
  }
  accelerator.deallocate(device_send);
  accelerator.deallocate(device_recv);
}

// Parameter `id` whole, in its storage dtype, on rank 0 (empty elsewhere).
std::vector<char> gather_to_rank0(engine::Engine& engine, partition::Communicator& comm, Stream& stream,
                                  engine::ParamId id) {
  const engine::ParamInfo& info = engine.param_info(id);
  const size_t element_nbytes = dtype_nbytes(info.dtype);
  // This rank's range as (first, count), exact in doubles up to 2^53 elements.
  double range[2] = {0, 0};
  std::vector<char> local;
  engine.for_each_owned_range(id, engine::Engine::Access::kRead, [&](int64_t first, const TensorView& host) {
    STRATA_CHECK(range[1] == 0, kInternal, "export: '{}' has more than one owned range on a rank", info.name);
    range[0] = static_cast<double>(first);
    range[1] = static_cast<double>(host.numel());
    local.assign(static_cast<const char*>(host.data), static_cast<const char*>(host.data) + host.nbytes());
  });
  const int world = comm.world_size();
  std::vector<double> ranges(2 * static_cast<size_t>(world));
  allgather_host(comm, engine.accelerator(), stream, range, ranges.data(), 2, DType::kF64);
  size_t max_count = 0;
  for (int r = 0; r < world; ++r) max_count = std::max(max_count, static_cast<size_t>(ranges[2 * r + 1]));
  local.resize(max_count * element_nbytes);
  std::vector<char> all(max_count * element_nbytes * static_cast<size_t>(world));
  allgather_host(comm, engine.accelerator(), stream, local.data(), all.data(), max_count, info.dtype);
  if (comm.rank() != 0) return {};
  std::vector<char> whole(info.nbytes());
  size_t covered = 0;
  for (int r = 0; r < world; ++r) {
    const auto first = static_cast<size_t>(ranges[2 * r]), count = static_cast<size_t>(ranges[2 * r + 1]);
    STRATA_CHECK(first + count <= static_cast<size_t>(info.numel()), kInternal,
                 "export: rank {} owns [{}, {}) of '{}' ({} elements)", r, first, first + count, info.name, info.numel());
    std::copy_n(all.data() + static_cast<size_t>(r) * max_count * element_nbytes, count * element_nbytes,
                whole.data() + first * element_nbytes);
    covered += count;
  }
  STRATA_CHECK(covered == static_cast<size_t>(info.numel()), kInternal,
               "export: the ranks own {} of the {} elements of '{}'", covered, info.numel(), info.name);
  return whole;
}

// A parameter whole on rank 0 as fp32 (empty elsewhere).
std::vector<float> gather_f32_to_rank0(engine::Engine& engine, partition::Communicator& comm, Stream& stream,
                                       engine::ParamId id) {
  const std::vector<char> whole = gather_to_rank0(engine, comm, stream, id);
  if (whole.empty()) return {};
  const engine::ParamInfo& info = engine.param_info(id);
  std::vector<float> out(static_cast<size_t>(info.numel()));
  convert(whole.data(), info.dtype, out.data(), DType::kF32, out.size());
  return out;
}

// The merge's adapters on rank 0, by parameter name.
using AdapterValues = std::map<std::string, std::vector<float>>;

// w [out, in] += s * (B [out, r] A [r, in]), each row of B A formed first and
// then scaled, as PEFT's delta weight ((B @ A) * scaling).
void add_lora_delta(float* w, const std::vector<float>& a, const std::vector<float>& b, size_t out, size_t in,
                    float scaling) {
  const size_t r = a.size() / in;
  std::vector<float> row(in);
  for (size_t o = 0; o < out; ++o) {
    std::fill(row.begin(), row.end(), 0.0f);
    for (size_t k = 0; k < r; ++k) {
      const float bk = b[o * r + k];
      const float* ak = a.data() + k * in;
      for (size_t i = 0; i < in; ++i) row[i] += bk * ak[i];
    }
    for (size_t i = 0; i < in; ++i) w[o * in + i] += row[i] * scaling;
  }
}

// The untiled tensors, in parameter order; a tile names its tensor in its slice.
struct TensorPlan {
  std::string name;
  Shape shape;
  std::vector<engine::ParamId> parts;  // this rank's (none: another pipeline stage's tensor)
  DType dtype;                         // written in: the export's, or fp32 for what transformers keeps in fp32
  int stage = 0;                       // the pipeline stage that assembles it
  // FP8 export: assembled in fp32 (dtype), written as e4m3 and its scale grid `grid`.
  bool fp8 = false;
  Shape grid = {};
  uint64_t nbytes() const { return static_cast<uint64_t>(shape_numel(shape)) * dtype_nbytes(dtype); }
  // What the file holds of it.
  uint64_t written_nbytes() const {
    return fp8 ? static_cast<uint64_t>(shape_numel(shape)) + static_cast<uint64_t>(shape_numel(grid)) * sizeof(float)
               : nbytes();
  }
};

std::string scale_name(const std::string& weight) { return weight + "_scale_inv"; }

// An FP8-exported tensor's fp32 values (`values`, whole) quantized per block
// (kernels/fp8_quantize.h) and written with its scale grid.
void write_fp8(nn::SafetensorsStreamWriter& file, const TensorPlan& t, const std::vector<char>& values,
               const nn::CheckpointQuant& quant) {
  const auto numel = static_cast<size_t>(shape_numel(t.shape));
  std::vector<float> x(numel);
  std::memcpy(x.data(), values.data(), numel * sizeof(float));
  for (size_t i = 0; i < numel; ++i) {
    STRATA_CHECK(std::isfinite(x[i]), kBadArgument,
                 "export: '{}' holds {} (element {}): FP8 (e4m3) has no infinities or NaN to write it with; export "
                 "it in bf16",
                 t.name, x[i], i);
  }
  const kernels::Fp8Blocks shape{t.shape[0], t.shape[1], quant.block_rows, quant.block_cols};
  std::vector<uint8_t> codes(numel);
  std::vector<float> scales(static_cast<size_t>(shape.grid_numel()));
  kernels::quantize_fp8_blocks(x.data(), shape, quant.ue8m0, codes.data(), scales.data());
  file.write(t.name, 0, codes.data(), codes.size());
  file.write(scale_name(t.name), 0, scales.data(), scales.size() * sizeof(float));
}

// The quantization_config of an FP8 export of `config` holding `tensors`:
// the source's as it had it, or for a source that was not FP8 transformers'
// FineGrainedFP8Config (128 x 128 blocks, dynamic activations) naming the
// modules it would otherwise convert that stay unquantized: lm_head and each
// decoder layer's 2-D weight fp8_export_weight leaves (routers, gates).
nlohmann::json fp8_export_config(const nn::DecoderConfig& config, const std::vector<TensorPlan>& tensors) {
  if (config.quant.method == nn::QuantMethod::kFp8Block && config.source.contains("quantization_config")) {
    return config.source["quantization_config"];
  }
  nlohmann::json unconverted = nlohmann::json::array({"lm_head"});
  for (const TensorPlan& t : tensors) {
    if (t.shape.size() == 2 && t.name.starts_with("model.layers.") && t.name.ends_with(".weight") && !t.fp8) {
      const std::string module = t.name.substr(0, t.name.size() - 7);
      if (module.find("norm") == std::string::npos) unconverted.push_back(module);
    }
  }
  return {{"quant_method", "fp8"},
          {"fmt", "e4m3"},
          {"activation_scheme", "dynamic"},
          {"weight_block_size", {config.quant.block_rows, config.quant.block_cols}},
          {"scale_fmt", "float"},
          {"modules_to_not_convert", unconverted}};
}

// Pipeline parallelism: every stage's tensors (names and shapes, in each
// stage's order), stage by stage, a tensor two stages hold (a tied
// embedding) the first one's. `local` is this stage's plan.
std::vector<TensorPlan> pipeline_plan(engine::Engine& engine, partition::Communicator& pipeline, Stream& stream,
                                      std::vector<TensorPlan> local) {
  nlohmann::json mine = nlohmann::json::array();
  for (const TensorPlan& t : local) mine.push_back({t.name, t.shape});
  const std::string text = mine.dump();
  const int stages = pipeline.world_size();
  const double length = static_cast<double>(text.size());
  std::vector<double> lengths(static_cast<size_t>(stages));
  allgather_host(pipeline, engine.accelerator(), stream, &length, lengths.data(), 1, DType::kF64);
  const auto longest = static_cast<size_t>(*std::max_element(lengths.begin(), lengths.end()));
  // As 32-bit words (the collectives move typed elements).
  const size_t words = (longest + 3) / 4;
  std::vector<int32_t> padded(words, 0), all(words * static_cast<size_t>(stages));
  std::memcpy(padded.data(), text.data(), text.size());
  allgather_host(pipeline, engine.accelerator(), stream, padded.data(), all.data(), words, DType::kI32);
  std::vector<TensorPlan> global;
  std::set<std::string> seen;
  for (int s = 0; s < stages; ++s) {
    const char* begin = reinterpret_cast<const char*>(all.data() + static_cast<size_t>(s) * words);
    const nlohmann::json list = nlohmann::json::parse(begin, begin + static_cast<size_t>(lengths[static_cast<size_t>(s)]));
    for (const nlohmann::json& entry : list) {
      const std::string name = entry[0].get<std::string>();
      if (!seen.insert(name).second) continue;
      TensorPlan t{name, entry[1].get<Shape>(), {}, DType::kF32, s};  // dtype: set by the caller
      if (s == pipeline.rank()) {
        for (const TensorPlan& own : local) {
          if (own.name == name) t.parts = own.parts;
        }
      }
      global.push_back(std::move(t));
    }
  }
  return global;
}

}  // namespace

ExportResult export_hf_model(engine::Engine& engine, partition::Communicator& comm, const nn::DecoderConfig& config,
                             const std::vector<engine::ParamId>& params, const fs::path& dir,
                             const ExportOptions& options, partition::Communicator* tensor_comm,
                             partition::Communicator* pipeline_comm) {
  STRATA_CHECK(is_float_storage(options.dtype), kBadArgument, "export dtype must be fp32, fp16 or bf16, got {}",
               dtype_name(options.dtype));
  STRATA_CHECK(options.max_shard_nbytes > 0, kBadArgument, "export: max shard size must be > 0");
  std::vector<TensorPlan> tensors;
  std::map<std::string, size_t> index_of;
  // Each tensor under the checkpoint's name (a gemma3 checkpoint's text model under its prefix).
  const nn::CheckpointNames& names = nn::checkpoint_names(config);
  for (engine::ParamId id : params) {
    const engine::ParamInfo& info = engine.param_info(id);
    const std::string& name = info.slice ? info.slice->tensor : info.name;
    auto [it, inserted] = index_of.emplace(name, tensors.size());
    if (inserted) {
      tensors.push_back({names.file_name(name), info.slice ? info.slice->tensor_shape : info.shape, {},
                         nn::export_dtype(config, name, options.dtype)});
    }
    tensors[it->second].parts.push_back(id);
  }
  auto stream = engine.accelerator().create_stream();
  const int stage = pipeline_comm != nullptr ? pipeline_comm->rank() : 0;
  if (pipeline_comm != nullptr && pipeline_comm->world_size() > 1) {
    tensors = pipeline_plan(engine, *pipeline_comm, *stream, std::move(tensors));
    for (TensorPlan& t : tensors) t.dtype = nn::export_dtype(config, t.name, options.dtype);
  }
  if (options.fp8) {
    STRATA_CHECK(config.quant.method != nn::QuantMethod::kMxfp4 && !config.gpt_oss(), kBadArgument,
                 "export dtype fp8 of model_type {}: gpt-oss's experts are fused 3-D tensors (MXFP4 in its "
                 "checkpoints), which strata does not write as FP8 blocks; export bf16",
                 config.model_type);
    STRATA_CHECK(!config.multimodal, kBadArgument,
                 "export dtype fp8 of a gemma3 checkpoint: its text model sits under language_model.* beside the "
                 "vision tower, and strata writes FP8 blocks only for a text model's own names; export bf16");
    for (TensorPlan& t : tensors) {
      if (!nn::fp8_export_weight(t.name, t.shape, config.quant)) continue;
      t.fp8 = true;
      t.dtype = DType::kF32;
      t.grid = {(t.shape[0] + config.quant.block_rows - 1) / config.quant.block_rows,
                (t.shape[1] + config.quant.block_cols - 1) / config.quant.block_cols};
    }
  }
  // Shards of at most max_shard_nbytes (a larger tensor gets a file of its own).
  std::vector<std::vector<size_t>> shards;
  uint64_t shard_nbytes = 0, total_nbytes = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const uint64_t n = tensors[t].written_nbytes();
    if (shards.empty() || (shard_nbytes > 0 && shard_nbytes + n > options.max_shard_nbytes)) {
      shards.emplace_back();
      shard_nbytes = 0;
    }
    shards.back().push_back(t);
    shard_nbytes += n;
    total_nbytes += n;
  }
  // The carried tensors (ExportOptions::carried) go in a last shard of their own.
  const size_t files = shards.size() + (options.carried.empty() ? 0 : 1);
  const auto file_name = [&](size_t s) {
    return files == 1 ? std::string("model.safetensors") : fmt::format("model-{:05}-of-{:05}.safetensors", s + 1, files);
  };
  // With tensor parallelism the ranks of dp rank 0 (tp group 0) hold each
  // tp shard whole after the dp gather; tp rank 0 of them gathers the shards.
  const int tp = tensor_comm != nullptr ? tensor_comm->world_size() : 1;
  // Each stage's first rank assembles its stage's tensors; the first stage's writes them all.
  const bool assembler = comm.rank() == 0 && (tensor_comm == nullptr || tensor_comm->rank() == 0);
  const bool writer = assembler && stage == 0;
  // Rank 0 writes into a staging directory that replaces `dir` whole at the
  // end (export_dir.h): a directory never holds weights of two exports.
  std::optional<ExportStaging> staging;
  if (writer) {
    staging.emplace(dir);
    // The source's model_type, architectures and keys, with the export's dtype.
    nlohmann::json hf = config.to_hf_json(options.dtype);
    if (options.fp8) hf["quantization_config"] = fp8_export_config(config, tensors);
    write_file_durably(staging->dir() / "config.json", hf.dump(2) + "\n");
    for (const auto& [name, contents] : options.files) write_file_durably(staging->dir() / name, contents);
  }
  // Merging: every adapter on rank 0 first (they are small).
  AdapterValues adapters;
  if (options.merge) {
    for (engine::ParamId id : options.merge->adapters) {
      adapters[engine.param_info(id).name] = gather_f32_to_rank0(engine, comm, *stream, id);
    }
  }
  ExportResult result;
  result.tensor_nbytes = total_nbytes;
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const fs::path path = dir / file_name(s);
    std::unique_ptr<nn::SafetensorsStreamWriter> file;
    if (writer) {
      const fs::path staged = staging->dir() / file_name(s);
      std::vector<nn::SafetensorsDecl> decls;
      for (size_t t : shards[s]) {
        const TensorPlan& plan = tensors[t];
        if (plan.fp8) {
          decls.push_back({plan.name, DType::kF8E4M3, plan.shape});
          decls.push_back({scale_name(plan.name), DType::kF32, plan.grid});
        } else {
          decls.push_back({plan.name, plan.dtype, plan.shape});
        }
      }
      file = std::make_unique<nn::SafetensorsStreamWriter>(staged.string(), decls,
                                                           std::map<std::string, std::string>{{"format", "pt"}});
    }
    for (size_t t : shards[s]) {
      const TensorPlan& tensor = tensors[t];
      weight_map[tensor.name] = file_name(s);
      if (tensor.fp8) weight_map[scale_name(tensor.name)] = file_name(s);
      const size_t out_element = dtype_nbytes(tensor.dtype);
      // Another stage's tensor: its first rank sends it whole to the writer.
      const uint64_t tag = uint64_t{4} << 56 | t;
      const std::string what = fmt::format("exported tensor {}", tensor.name);
      if (tensor.stage != stage) {
        if (!writer) continue;
        std::vector<char> received(static_cast<size_t>(tensor.nbytes()));
        const partition::P2POp op =
            partition::P2POp::recv(tensor.stage, received.data(), tensor.dtype, tensor.shape, tag, what);
        pipeline_comm->exchange(std::span<const partition::P2POp>(&op, 1), *stream)->synchronize();
        if (tensor.fp8) {
          write_fp8(*file, tensor, received, config.quant);
        } else {
          file->write(tensor.name, 0, received.data(), received.size());
        }
        continue;
      }
      // The whole tensor, assembled on a later stage's first rank for the
      // writer, or by the writer to quantize it whole (FP8).
      std::vector<char> assembled;
      if (assembler && (!writer || tensor.fp8)) assembled.resize(static_cast<size_t>(tensor.nbytes()));
      const auto emit = [&](size_t offset, const char* data, size_t nbytes) {
        if (writer && !tensor.fp8) {
          file->write(tensor.name, offset, data, nbytes);
        } else {
          std::copy_n(data, nbytes, assembled.data() + offset);
        }
      };
      for (engine::ParamId id : tensor.parts) {
        const engine::ParamInfo& info = engine.param_info(id);
        std::vector<char> whole = gather_to_rank0(engine, comm, *stream, id);
        // The blocks of the tensor this parameter gives the writer: itself,
        // or with tensor parallelism every tp rank's shard, placed by its rank.
        size_t blocks = 1;
        std::vector<double> offsets;  // per tp rank, its block's offset in each dimension
        if (info.tp_split && tp > 1) {
          if (comm.rank() != 0) continue;
          std::vector<char> all(whole.size() * static_cast<size_t>(tp));
          allgather_host(*tensor_comm, engine.accelerator(), *stream, whole.data(), all.data(),
                         static_cast<size_t>(info.numel()), info.dtype);
          whole = std::move(all);
          blocks = static_cast<size_t>(tp);
          // Where each rank's block goes (ranks sharing a kv head hold the same one).
          const size_t dims = info.slice->offset.size();
          std::vector<double> mine(info.slice->offset.begin(), info.slice->offset.end());
          offsets.resize(dims * blocks);
          allgather_host(*tensor_comm, engine.accelerator(), *stream, mine.data(), offsets.data(), dims, DType::kF64);
        }
        if (!assembler) continue;
        const DType out_dtype = tensor.dtype;
        const auto block_numel = static_cast<size_t>(info.numel());
        std::vector<char> converted(block_numel * blocks * out_element);
        const std::string stem = info.name.size() > 7 && info.name.ends_with(".weight")
                                     ? info.name.substr(0, info.name.size() - 7)
                                     : std::string();
        const auto a = adapters.find(stem + ".lora_A.weight"), b = adapters.find(stem + ".lora_B.weight");
        if (!stem.empty() && a != adapters.end() && b != adapters.end()) {
          // W + s B A in fp32, then one conversion (adapted weights are never tiled).
          STRATA_CHECK(!info.slice && info.shape.size() == 2, kBadArgument,
                       "export: '{}' has an adapter but is not a whole matrix", info.name);
          std::vector<float> merged(block_numel);
          convert(whole.data(), info.dtype, merged.data(), DType::kF32, merged.size());
          add_lora_delta(merged.data(), a->second, b->second, static_cast<size_t>(info.shape[0]),
                         static_cast<size_t>(info.shape[1]), static_cast<float>(options.merge->spec.scaling()));
          convert(merged.data(), DType::kF32, converted.data(), out_dtype, merged.size());
        } else {
          convert(whole.data(), info.dtype, converted.data(), out_dtype, block_numel * blocks);
        }
        if (!info.slice) {
          emit(0, converted.data(), converted.size());
          continue;
        }
        // A block (a tile, a tp shard): each of its elements' runs in the tensor.
        std::set<std::vector<int64_t>> written;
        for (size_t block = 0; block < blocks; ++block) {
          engine::ParamInfo placed = info;
          if (blocks > 1) {
            // tp rank `block`'s shard: the same shape at its own offset; a copy written once.
            const size_t dims = info.slice->offset.size();
            for (size_t d = 0; d < dims; ++d) placed.slice->offset[d] = static_cast<int64_t>(offsets[block * dims + d]);
            if (!written.insert(placed.slice->offset).second) continue;
          }
          const char* data = converted.data() + block * block_numel * out_element;
          nn::for_each_tensor_run(placed, 0, static_cast<int64_t>(block_numel), [&](int64_t at, int64_t from, int64_t n) {
            emit(static_cast<size_t>(at) * out_element, data + static_cast<size_t>(from) * out_element,
                 static_cast<size_t>(n) * out_element);
          });
        }
      }
      if (writer && tensor.fp8) write_fp8(*file, tensor, assembled, config.quant);
      if (assembler && !writer) {
        const partition::P2POp op = partition::P2POp::send(0, assembled.data(), tensor.dtype, tensor.shape, tag, what);
        pipeline_comm->exchange(std::span<const partition::P2POp>(&op, 1), *stream)->synchronize();
      }
    }
    if (writer) file->commit();
    result.files.push_back(path);
  }
  if (writer && !options.carried.empty()) {
    // The untrained tensors, copied as the source holds them.
    const std::string name = file_name(shards.size());
    std::map<std::filesystem::path, nn::SafetensorsFile> sources;
    std::vector<nn::SafetensorsDecl> decls;
    for (const auto& [tensor, source] : options.carried) {
      auto it = sources.find(source);
      if (it == sources.end()) it = sources.emplace(source, nn::SafetensorsFile::open(source.string())).first;
    }
    // A carried FP8 weight (DeepSeek's MTP module in an FP8 checkpoint) is
    // written dequantized, its "_scale_inv" consumed: the export's
    // config.json has no quantization_config to scale it by.
    const auto view_of = [&](const std::string& tensor) { return sources.at(options.carried.at(tensor)).view(tensor); };
    // An FP8 export copies them as they are, scales included.
    const auto scale_of = [&](const std::string& tensor, const TensorView& v) {
      if (options.fp8) return std::string();
      const std::string scale = tensor + "_scale_inv";
      STRATA_CHECK(v.desc.dtype != DType::kF8E4M3 ||
                       (options.quant.method == nn::QuantMethod::kFp8Block && options.carried.contains(scale)),
                   kBadArgument, "carried tensor '{}' is FP8 without its '{}' or the model's FP8 quantization_config",
                   tensor, scale);
      return v.desc.dtype == DType::kF8E4M3 ? scale : std::string();
    };
    std::set<std::string> consumed;
    for (const auto& [tensor, source] : options.carried) {
      const TensorView v = view_of(tensor);
      if (const std::string scale = scale_of(tensor, v); !scale.empty()) consumed.insert(scale);
    }
    for (const auto& [tensor, source] : options.carried) {
      if (consumed.contains(tensor)) continue;
      const TensorView v = view_of(tensor);
      decls.push_back({tensor, v.desc.dtype == DType::kF8E4M3 ? options.dtype : v.desc.dtype, v.desc.shape});
    }
    nn::SafetensorsStreamWriter file((staging->dir() / name).string(), decls, {{"format", "pt"}});
    for (const auto& [tensor, source] : options.carried) {
      if (consumed.contains(tensor)) continue;
      const TensorView v = view_of(tensor);
      if (const std::string scale = scale_of(tensor, v); !scale.empty()) {
        Tensor values = Tensor::host(options.dtype, v.desc.shape);
        nn::dequantize_fp8_block(v, view_of(scale), options.quant.block_rows, options.quant.block_cols, 0,
                                 v.numel(), values.data(), options.dtype);
        file.write(tensor, 0, values.data(), values.nbytes());
        total_nbytes += values.nbytes();
      } else {
        file.write(tensor, 0, v.data, v.nbytes());
        total_nbytes += v.nbytes();
      }
      weight_map[tensor] = name;
    }
    file.commit();
    result.files.push_back(dir / name);
  }
  if (writer && files > 1) {
    const nlohmann::json index = {{"metadata", {{"total_size", total_nbytes}}}, {"weight_map", weight_map}};
    write_file_durably(staging->dir() / "model.safetensors.index.json", index.dump(2) + "\n");
    result.files.push_back(dir / "model.safetensors.index.json");
  }
  if (writer) staging->commit();
  return result;
}

ExportResult export_lora_adapter(engine::Engine& engine, partition::Communicator& comm, const nn::LoraSpec& spec,
                                 const std::vector<engine::ParamId>& adapters, const std::string& base_model,
                                 const fs::path& dir, const ExportOptions& options,
                                 partition::Communicator* pipeline_comm) {
  constexpr const char* kFile = "adapter_model.safetensors";
  std::vector<TensorPlan> tensors;
  for (engine::ParamId id : adapters) {
    const engine::ParamInfo& info = engine.param_info(id);
    tensors.push_back({options.names.adapter_name(info.name), info.shape, {id}, DType::kF32});
  }
  auto stream = engine.accelerator().create_stream();
  const int stage = pipeline_comm != nullptr ? pipeline_comm->rank() : 0;
  if (pipeline_comm != nullptr && pipeline_comm->world_size() > 1) {
    tensors = pipeline_plan(engine, *pipeline_comm, *stream, std::move(tensors));
    for (TensorPlan& t : tensors) t.dtype = DType::kF32;
  }
  // Each stage's first rank gathers its stage's adapters; the first stage's writes them all.
  const bool assembler = comm.rank() == 0;
  const bool writer = assembler && stage == 0;
  std::optional<ExportStaging> staging;
  std::vector<nn::SafetensorsDecl> decls;
  ExportResult result;
  for (const TensorPlan& t : tensors) {
    decls.push_back({t.name, DType::kF32, t.shape});
    result.tensor_nbytes += t.nbytes();
  }
  std::unique_ptr<nn::SafetensorsStreamWriter> file;
  if (writer) {
    staging.emplace(dir);
    // What PEFT's LoraConfig needs to rebuild the adapter (the rest are its defaults).
    const double whole_alpha = std::round(spec.alpha);
    const nlohmann::json config = {
        {"peft_type", "LORA"},
        {"task_type", "CAUSAL_LM"},
        {"base_model_name_or_path", base_model.empty() ? nlohmann::json() : nlohmann::json(base_model)},
        {"r", spec.rank},
        {"lora_alpha", whole_alpha == spec.alpha ? nlohmann::json(static_cast<int64_t>(whole_alpha))
                                                 : nlohmann::json(spec.alpha)},
        {"lora_dropout", spec.dropout},
        {"target_modules", spec.targets},
        {"bias", "none"},
        {"use_rslora", spec.rslora},
        {"use_dora", false},
        {"fan_in_fan_out", false},
        {"init_lora_weights", true},
        {"inference_mode", true},
        {"modules_to_save", nullptr},
        {"layers_to_transform", nullptr},
        {"layers_pattern", nullptr},
        {"rank_pattern", nlohmann::json::object()},
        {"alpha_pattern", nlohmann::json::object()}};
    write_file_durably(staging->dir() / "adapter_config.json", config.dump(2) + "\n");
    for (const auto& [name, contents] : options.files) write_file_durably(staging->dir() / name, contents);
    file = std::make_unique<nn::SafetensorsStreamWriter>((staging->dir() / kFile).string(), decls,
                                                         std::map<std::string, std::string>{{"format", "pt"}});
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorPlan& t = tensors[i];
    // Another stage's adapter: its first rank sends it to the writer.
    const uint64_t tag = uint64_t{5} << 56 | i;
    const std::string what = fmt::format("exported adapter {}", t.name);
    if (t.stage != stage) {
      if (!writer) continue;
      std::vector<float> received(static_cast<size_t>(shape_numel(t.shape)));
      const partition::P2POp op = partition::P2POp::recv(t.stage, received.data(), DType::kF32, t.shape, tag, what);
      pipeline_comm->exchange(std::span<const partition::P2POp>(&op, 1), *stream)->synchronize();
      file->write(t.name, 0, received.data(), received.size() * sizeof(float));
      continue;
    }
    STRATA_CHECK(t.parts.size() == 1, kInternal, "export: adapter {} is not one parameter", t.name);
    std::vector<float> values = gather_f32_to_rank0(engine, comm, *stream, t.parts.front());
    if (writer) {
      file->write(t.name, 0, values.data(), values.size() * sizeof(float));
    } else if (assembler) {
      const partition::P2POp op = partition::P2POp::send(0, values.data(), DType::kF32, t.shape, tag, what);
      pipeline_comm->exchange(std::span<const partition::P2POp>(&op, 1), *stream)->synchronize();
    }
  }
  if (writer) {
    file->commit();
    staging->commit();
  }
  result.files.push_back(dir / kFile);
  return result;
}

std::string export_dtype_label(const ExportOptions& options) {
  return (options.fp8 ? "fp8 and " : "") + std::string(dtype_name(options.dtype));
}

void set_export_dtype(ExportOptions& options, const std::string& name, DType train_dtype, const std::string& flag) {
  options.fp8 = name == "fp8";
  if (name.empty() || options.fp8) {
    // FP8: the quantized weights e4m3, the rest bf16 as DeepSeek's checkpoints hold them.
    options.dtype = options.fp8 ? DType::kBF16 : train_dtype;
    return;
  }
  STRATA_CHECK(name == "fp32" || name == "fp16" || name == "bf16", kBadArgument,
               "{} {}: strata exports fp32, fp16, bf16 or fp8 (block-quantized FP8 as DeepSeek's checkpoints are); "
               "other formats and quantizations (int8, nf4, gptq, awq, mxfp4, ...) are not written",
               flag, name);
  options.dtype = parse_dtype(name);
}

}  // namespace strata::train
