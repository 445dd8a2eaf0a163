// Reading a Hugging Face model directory (single or sharded safetensors),
// with the check that the checkpoint's tensors are the architecture's.
#include "runtime/train/hf_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "runtime/engine/state_file.h"
#include "runtime/nn/param_files.h"
#include "runtime/nn/safetensors.h"

namespace strata::train {
namespace fs = std::filesystem;
namespace {

constexpr const char* kHead = "lm_head.weight";
constexpr const char* kEmbed = "model.embed_tokens.weight";

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Buffers old checkpoints carry that transformers derives from config.json
// and ignores when loading: not weights of the model.
bool derived_buffer(const std::string& name) {
  return ends_with(name, ".rotary_emb.inv_freq");
}

// The weights of a directory: its one file, or the index's files and map.
struct WeightFiles {
  fs::path index;                                 // empty: a single model.safetensors
  std::map<std::string, std::string> weight_map;  // tensor -> file (sharded)
  std::set<std::string> files;
};

WeightFiles weight_files(const fs::path& dir) {
  WeightFiles w;
  const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
  if (fs::exists(index) && fs::exists(single)) {
    // Two saves' weights (a re-export into the same directory by another
    // tool): loading either could be the stale one.
    raise(ErrorCategory::kBadArgument,
          "--model {}: holds both {} and {}, weights of two different saves; loaders pick one of them, so remove the "
          "stale one (or export again into an empty directory)",
          dir.string(), single.string(), index.string());
  }
  if (!fs::exists(index)) {
    STRATA_CHECK(
        fs::exists(single), kBadArgument,
        "--model {}: neither model.safetensors nor model.safetensors.index.json is there",
        dir.string());
    w.files.insert("model.safetensors");
    return w;
  }
  w.index = index;
  nlohmann::json doc;
  {
    std::ifstream in(index);
    if (!in.good()) raise(ErrorCategory::kIo, "cannot read {}", index.string());
    doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  }
  STRATA_CHECK(
      doc.is_object() && doc.contains("weight_map") && doc["weight_map"].is_object(), kBadArgument,
      "{}: not a safetensors index (no \"weight_map\" object)", index.string());
  for (const auto& [tensor, file] : doc["weight_map"].items()) {
    STRATA_CHECK(file.is_string(), kBadArgument, "{}: the weight_map entry of '{}' is not a file name",
                         index.string(), tensor);
    const std::string name = file.get<std::string>();
    STRATA_CHECK(
        name.find('/') == std::string::npos && name != ".." && name != "." && !name.empty(), kBadArgument,
        "{}: tensor '{}' maps to '{}', which is not a file name in the directory", index.string(),
        tensor, name);
    w.weight_map[tensor] = name;
    w.files.insert(name);
  }
  return w;
}

// What a tensor the architecture does not use suggests about the checkpoint.
std::string unused_hint(const std::string& name, const nn::DecoderConfig& c) {
  auto has = [&](std::string_view part) { return name.find(part) != std::string::npos; };
  if (has("self_attn.q_proj.bias") || has("self_attn.k_proj.bias") ||
      has("self_attn.v_proj.bias")) {
    return "q/k/v biases: a Qwen2 checkpoint (model_type qwen2), or a llama/qwen3 with "
           "attention_bias true";
  }
  if (has("self_attn.o_proj.bias"))
    return "an o_proj bias: a llama or qwen3 with attention_bias true";
  if (has("q_norm.weight") || has("k_norm.weight")) {
    return "per-head q/k norms: a Qwen3 checkpoint (model_type qwen3)";
  }
  if (has("mlp.") && ends_with(name, ".bias")) return "MLP biases: a llama with mlp_bias true";
  if (has("self_attn.sinks") || has("mlp.router.")) {
    return "attention sinks or a biased router: a gpt-oss checkpoint (model_type gpt_oss)";
  }
  if (c.moe() && !c.stacked_experts && (has("experts.gate_up_proj") || has("experts.down_proj"))) {
    return "transformers 5's fused expert tensors, its in-memory layout: save the model with "
           "save_pretrained, which writes one tensor per expert and projection";
  }
  if (has("shared_expert")) return "a shared expert: a Qwen2-MoE checkpoint (model_type qwen2_moe)";
  if (has("experts") || has("block_sparse_moe") || has("mlp.gate.weight")) {
    return "mixture-of-experts weights (Mixtral, Qwen-MoE)";
  }
  if (has("feedforward_layernorm") || has("post_attention_norm"))
    return "extra norms (Gemma, OLMo 2)";
  if (has("qkv_proj") || has("gate_up_proj")) return "fused projections (Phi-3)";
  if (name == kHead && c.tie_word_embeddings) {
    return "an lm_head while tie_word_embeddings is true";
  }
  return "a weight of another architecture or size";
}

}  // namespace

void check_hf_checkpoint(const nn::DecoderConfig& config, const fs::path& dir) {
  const WeightFiles w = weight_files(dir);
  struct Found {
    std::string file;
    Shape shape;
  };
  nn::CheckpointTensors stored;  // as the files hold them
  std::map<std::string, nn::SafetensorsFile> opened;
  for (const std::string& file : w.files) {
    const fs::path path = dir / file;
    STRATA_CHECK(fs::exists(path), kBadArgument, "{}: the weights file {} is missing",
                         w.index.empty() ? dir.string() : w.index.string(), path.string());
    nn::SafetensorsFile f = nn::SafetensorsFile::open(path.string());
    for (const std::string& name : f.names()) {
      const nn::SafetensorsEntry& e = f.entry(name);
      const auto [it, fresh] = stored.emplace(name, nn::CheckpointTensor{file, e.dtype, e.shape, e.e8m0});
      STRATA_CHECK(fresh, kBadArgument, "--model {}: tensor '{}' is in both {} and {}", dir.string(),
                           name, it->second.file, file);
      STRATA_CHECK(
          w.index.empty() || (w.weight_map.contains(name) && w.weight_map.at(name) == file), kBadArgument,
          "{}: {} holds tensor '{}', which the index's weight_map does not map to it",
          w.index.string(), file, name);
    }
    opened.emplace(file, std::move(f));
  }
  for (const auto& [name, file] : w.weight_map) {
    STRATA_CHECK(stored.contains(name), kBadArgument,
                         "{}: the weight_map maps '{}' to {}, which does not hold it",
                         w.index.string(), name, file);
  }
  // Quantized weights (config.json's quantization_config) as the model sees
  // them: dequantized shapes under their own names, their scales consumed.
  const nn::DequantizedView view = nn::dequantized_view(config.quant, stored, "--model " + dir.string());
  // By the model's names (a gemma3 checkpoint's text model sits under its own prefix);
  // the vision tower and projector of a gemma3 checkpoint are carried, unread.
  const nn::CheckpointNames& names = nn::checkpoint_names(config);
  std::map<std::string, Found> found;
  std::vector<std::string> unused;
  size_t vision = 0;
  for (const auto& [name, shape] : view.shapes) {
    if (config.multimodal && nn::is_vision_tensor(name)) {
      ++vision;
      continue;
    }
    const std::optional<std::string> model = names.model_name(name);
    if (!model) {
      if (!derived_buffer(name)) unused.push_back(name);
      continue;
    }
    found.emplace(*model, Found{view.files.at(name), shape});
  }
  std::map<std::string, Shape> expected;
  for (nn::HfTensor& t : nn::hf_tensors(config))
    expected.emplace(std::move(t.name), std::move(t.shape));

  // Unused tensors first: they say the checkpoint is another model.
  size_t mtp = 0;
  for (const auto& [name, f] : found) {
    if (expected.contains(name) || derived_buffer(name)) continue;
    if (nn::is_mtp_tensor(config, name)) {
      ++mtp;
      continue;
    }
    if (name == kHead && config.tie_word_embeddings && found.contains(kEmbed)) {
      // Tied: the file may store the shared matrix twice, but only if it is the same.
      const nn::SafetensorsFile& hf = opened.at(f.file);
      const nn::SafetensorsFile& ef = opened.at(found.at(kEmbed).file);
      const TensorView h = hf.view(names.file_name(kHead)), e = ef.view(names.file_name(kEmbed));
      STRATA_CHECK(
          h.desc.dtype == e.desc.dtype && h.desc.shape == e.desc.shape &&
              std::memcmp(h.data, e.data, h.nbytes()) == 0, kBadArgument,
          "--model {}: config.json ties lm_head to embed_tokens (tie_word_embeddings), but the "
          "checkpoint's '{}' differs from '{}'; the model is untied (set tie_word_embeddings to "
          "false)",
          dir.string(), names.file_name(kHead), names.file_name(kEmbed));
      continue;
    }
    unused.push_back(names.file_name(name));
  }
  if (!unused.empty()) {
    std::sort(unused.begin(), unused.end());
    const std::string& first = unused.front();
    raise(ErrorCategory::kBadArgument,
          "--model {}: the checkpoint's tensor '{}' (in {}) is not used by model_type \"{}\" as "
          "config.json "
          "describes it ({}){}; training without it would make another model than the "
          "checkpoint's, so strata "
          "refuses. Fix config.json (model_type and its keys) to describe the checkpoint",
          dir.string(), first, view.files.at(first), config.model_type, unused_hint(first, config),
          unused.size() > 1 ? fmt::format(", and {} more tensors are unused", unused.size() - 1)
                            : "");
  }
  if (mtp > 0) {
    logger().info(
        "--model {}: {} tensors of the multi-token prediction module{} (model.layers.{}{}.*), which transformers' {} "
        "ignores, are not trained and are carried to the export unchanged",
        dir.string(), mtp, config.mtp_layers > 1 ? "s" : "", config.num_hidden_layers,
        config.mtp_layers > 1 ? fmt::format("-{}", config.num_hidden_layers + config.mtp_layers - 1) : "",
        config.to_json().at("architectures")[0].get<std::string>());
  }
  if (vision > 0) {
    logger().info("--model {}: {} tensors of the vision tower and projector are passed through unchanged: not "
                  "trained, not used (strata trains the text model of Gemma3ForConditionalGeneration)",
                  dir.string(), vision);
  }
  for (const auto& [name, shape] : expected) {
    const auto it = found.find(name);
    STRATA_CHECK(it != found.end(), kBadArgument,
                         "--model {}: the checkpoint has no tensor '{}', which model_type \"{}\" "
                         "with this config.json "
                         "uses",
                         dir.string(), names.file_name(name), config.model_type);
    STRATA_CHECK(it->second.shape == shape, kBadArgument,
                         "--model {}: tensor '{}' (in {}) has shape {}, but config.json gives {}",
                         dir.string(), names.file_name(name), it->second.file, shape_string(it->second.shape),
                         shape_string(shape));
  }
}

nn::DecoderConfig load_hf_config(const fs::path& dir) {
  STRATA_CHECK(fs::is_directory(dir), kBadArgument,
                       "--model {}: not a directory (expected a Hugging Face model "
                       "directory with config.json and model.safetensors)",
                       dir.string());
  const fs::path config = dir / "config.json";
  STRATA_CHECK(fs::exists(config), kBadArgument, "--model {}: no config.json", dir.string());
  // transformers loads such a directory as the base WITH the adapter on top;
  // its weights alone would be another model.
  STRATA_CHECK(!fs::exists(dir / "adapter_config.json"), kBadArgument,
               "--model {}: holds adapter_config.json, a PEFT adapter that transformers would apply on top of these "
               "weights, and strata does not load adapters: merge it into the model first (PEFT's "
               "merge_and_unload), or give a directory of the base alone",
               dir.string());
  nn::DecoderConfig c = nn::load_decoder_config(config.string());
  if (c.multimodal) {
    // Where the text model sits: the published (and transformers 5's saved)
    // "language_model.model.", or transformers 5's in-memory "model.language_model.".
    const WeightFiles w = weight_files(dir);
    for (const std::string& file : w.files) {
      if (!fs::exists(dir / file)) continue;  // check_hf_checkpoint names it
      const nn::SafetensorsFile f = nn::SafetensorsFile::open((dir / file).string());
      for (const std::string& name : f.names()) {
        if (name.starts_with("model.language_model.")) c.multimodal->names = {"model.language_model.", "lm_head.weight", "model.language_model."};
      }
    }
  }
  check_hf_checkpoint(c, dir);
  return c;
}

std::map<std::string, fs::path> carried_hf_tensors(const nn::DecoderConfig& config, const fs::path& dir) {
  std::map<std::string, fs::path> carried;
  if (config.mtp_layers == 0 && !config.multimodal) return carried;
  const WeightFiles w = weight_files(dir);
  for (const std::string& file : w.files) {
    const nn::SafetensorsFile f = nn::SafetensorsFile::open((dir / file).string());
    for (const std::string& name : f.names()) {
      if (nn::is_carried_tensor(config, name)) carried.emplace(name, dir / file);
    }
  }
  return carried;
}

namespace {

// Every weights file of a directory mapped once, and what each holds.
struct Catalogue {
  WeightFiles w;
  std::map<std::string, nn::SafetensorsFile> opened;
  nn::CheckpointTensors stored;
};

// An expert's weight [out, in] as a view of a stacked MXFP4 tensor [E, in,
// width] (gpt-oss: ParameterSlice strides {step, width}, base e * in * width
// + first): row o is the checkpoint's block column e * width + first + o *
// step (kernels/mxfp4_blocks.h). nullopt: not such a view.
struct Mxfp4View {
  kernels::Mxfp4Stacked stacked;
  int64_t first_column = 0, column_step = 0;
};
std::optional<Mxfp4View> mxfp4_view(const engine::ParamInfo& p, const nn::QuantizedTensor& q) {
  if (q.method != nn::QuantMethod::kMxfp4 || !p.slice || p.shape.size() != 2) return std::nullopt;
  const engine::ParameterSlice& s = *p.slice;
  if (s.strides.size() != 2 || s.tensor_shape.size() != 3) return std::nullopt;
  const int64_t in = s.tensor_shape[1], width = s.tensor_shape[2], step = s.strides[0];
  if (s.strides[1] != width || p.shape[1] != in || in % 32 != 0 || step <= 0 || s.base < 0) return std::nullopt;
  const int64_t expert = s.base / (in * width), first = s.base % (in * width);
  if (first >= width || first + (p.shape[0] - 1) * step >= width) return std::nullopt;
  return Mxfp4View{{s.tensor_shape[0], in, width}, expert * width + first, step};
}

Catalogue open_catalogue(const fs::path& dir) {
  Catalogue c;
  c.w = weight_files(dir);
  for (const std::string& file : c.w.files) {
    nn::SafetensorsFile f = nn::SafetensorsFile::open((dir / file).string());
    for (const std::string& name : f.names()) {
      const nn::SafetensorsEntry& e = f.entry(name);
      c.stored.emplace(name, nn::CheckpointTensor{file, e.dtype, e.shape, e.e8m0});
    }
    c.opened.emplace(file, std::move(f));
  }
  return c;
}

}  // namespace

int64_t keep_quantized_frozen(engine::Engine& engine, const std::vector<engine::ParamId>& params,
                              const fs::path& dir, const nn::CheckpointQuant& quant) {
  if (!quant.quantized()) return 0;
  const Catalogue c = open_catalogue(dir);
  const nn::DequantizedView view = nn::dequantized_view(quant, c.stored, dir.string());
  int64_t kept = 0;
  for (engine::ParamId id : params) {
    const engine::ParamInfo& info = engine.param_info(id);
    if (!info.frozen) continue;
    if (info.slice) {
      // An expert's weight viewing gpt-oss's stacked MXFP4 tensor; other slices (tiles, tp shards) are dequantized.
      const auto q = view.quantized.find(info.slice->tensor);
      if (q != view.quantized.end() && mxfp4_view(info, q->second)) {
        engine.store_blocks(id, kernels::QuantBlocks::of(kernels::Mxfp4Blocks{info.shape[0], info.shape[1]}));
        ++kept;
      }
      continue;
    }
    const auto q = view.quantized.find(info.name);
    if (q == view.quantized.end() || q->second.shape != info.shape) {
      continue;  // load_hf_weights names a shape that differs
    }
    if (q->second.method != nn::QuantMethod::kFp8Block) continue;  // a whole stacked MXFP4 tensor: dequantized
    const Shape& s = info.shape;
    engine.store_blocks(id, kernels::QuantBlocks::of(kernels::Fp8Blocks{s[0], s[1], quant.block_rows, quant.block_cols}));
    ++kept;
  }
  return kept;
}

void load_hf_weights(engine::Engine& engine, const std::vector<engine::ParamId>& params,
                     const fs::path& dir, const std::set<std::string>& carried, const nn::CheckpointQuant& quant,
                     const nn::CheckpointNames& names) {
  Catalogue catalogue = open_catalogue(dir);
  const WeightFiles& w = catalogue.w;
  const std::map<std::string, nn::SafetensorsFile>& opened = catalogue.opened;
  const nn::CheckpointTensors& stored = catalogue.stored;
  const nn::DequantizedView view = nn::dequantized_view(quant, stored, dir.string());
  // Each parameter goes with the file its (untiled) tensor lives in; a
  // quantized one with the reader that dequantizes it.
  std::map<std::string, std::vector<engine::ParamId>> by_file;
  std::vector<std::pair<engine::ParamId, const nn::QuantizedTensor*>> dequantized;
  std::set<std::string> wanted;
  for (engine::ParamId id : params) {
    const auto& info = engine.param_info(id);
    const std::string tensor = names.file_name(info.slice ? info.slice->tensor : info.name);
    wanted.insert(tensor);
    if (const auto q = view.quantized.find(tensor); q != view.quantized.end()) {
      const Shape& shape = info.slice ? info.slice->tensor_shape : info.shape;
      STRATA_CHECK(q->second.shape == shape, kBadArgument,
                   "{}: quantized tensor '{}' has shape {} dequantized, but the model's '{}' needs {}",
                   (dir / view.files.at(tensor)).string(), tensor, shape_string(q->second.shape), info.name,
                   shape_string(shape));
      dequantized.emplace_back(id, &q->second);
      continue;
    }
    if (w.index.empty()) {
      by_file["model.safetensors"].push_back(id);
      continue;
    }
    const auto it = w.weight_map.find(tensor);
    STRATA_CHECK(it != w.weight_map.end(), kBadArgument, "{}: the weight_map has no file for tensor '{}'",
                         w.index.string(), tensor);
    by_file[it->second].push_back(id);
  }
  // No file may hold a weight the model leaves out (check_hf_checkpoint says
  // why in the model's terms; this is the same rule for any caller), but
  // what it carries untrained (`carried`: the MTP modules).
  const std::string head = names.file_name(kHead), embed = names.file_name(kEmbed);
  for (const auto& [name, file] : view.files) {
    const bool tied_head = name == head && !wanted.contains(head) && wanted.contains(embed) &&
                           (w.index.empty() || w.weight_map.at(embed) == file);
    STRATA_CHECK(wanted.contains(name) || derived_buffer(name) || tied_head || carried.contains(name),
                 kBadArgument, "{}: tensor '{}' matches no parameter of the model", (dir / file).string(), name);
  }
  for (const auto& [file, ids] : by_file) {
    // Unused tensors were refused above; the tied lm_head is compared with the embedding here.
    nn::load_parameters(engine, ids, (dir / file).string(), /*allow_unused=*/true,
                        [&](const std::string& name) { return names.file_name(name); });
  }
  // Quantized weights: dequantized range by range from the mapped files, in fp32, rounded once to the parameter's dtype.
  for (const auto& entry : dequantized) {
    // Named copies, not structured bindings: the lambda below captures q,
    // which clang before 16 cannot do with a binding.
    const engine::ParamId id = entry.first;
    const nn::QuantizedTensor* q = entry.second;
    const TensorView data = opened.at(stored.at(q->data).file).view(q->data);
    const TensorView scale = opened.at(stored.at(q->scale).file).view(q->scale);
    if (const auto& kept = engine.param_info(id).blocks) {
      // Kept quantized by the engine (keep_quantized_frozen): FP8's bytes and
      // scales as stored, MXFP4's packed into its kept form.
      if (kept->format == kernels::QuantBlocks::Format::kFp8) {
        std::vector<float> grid = nn::fp32_scale_grid(scale);  // an F8_E8M0 grid's values in fp32
        const TensorView grid_view{TensorDesc{DType::kF32, scale.desc.shape, Tier::kCpu}, grid.data()};
        engine.write_blocks(id, grid_view, [&](int64_t first, const TensorView& host) {
          std::memcpy(host.data, static_cast<const uint8_t*>(data.data) + first, static_cast<size_t>(host.numel()));
        });
      } else {
        // The rows' block columns of the stacked tensor, codes and scales as stored.
        const engine::ParamInfo& info = engine.param_info(id);
        const std::optional<Mxfp4View> v = mxfp4_view(info, *q);
        STRATA_CHECK(v.has_value(), kInternal, "'{}' kept in MXFP4 is not a view of '{}'", info.name, q->data);
        const auto* blocks = static_cast<const uint8_t*>(data.data);
        const auto* scales = static_cast<const uint8_t*>(scale.data);
        const int64_t per_row = v->stacked.in / 32;
        std::vector<uint8_t> grid(static_cast<size_t>(kept->mxfp4.scale_numel()));
        for (int64_t o = 0; o < info.shape[0]; ++o) {
          std::memcpy(grid.data() + o * per_row, scales + (v->first_column + o * v->column_step) * per_row,
                      static_cast<size_t>(per_row));
        }
        const TensorView grid_view{TensorDesc{DType::kU8, kept->scale_shape(), Tier::kCpu}, grid.data()};
        engine.write_blocks(id, grid_view, [&](int64_t first, const TensorView& host) {
          kernels::pack_mxfp4_columns(blocks, scales, v->stacked, v->first_column, v->column_step, info.shape[0],
                                      first, host.numel(), host.as<uint8_t>());
        });
      }
      continue;
    }
    if (const std::optional<Mxfp4View> v = mxfp4_view(engine.param_info(id), *q)) {
      // An expert's weight: its rows are whole block columns of the stacked
      // tensor, dequantized row by row (one pass, the codes in order).
      const auto* blocks = static_cast<const uint8_t*>(data.data);
      const auto* scales = static_cast<const uint8_t*>(scale.data);
      engine.for_each_owned_range(id, engine::Engine::Access::kWrite, [&](int64_t first, const TensorView& host) {
        kernels::dequantize_mxfp4_columns(blocks, scales, v->stacked, v->first_column, v->column_step, first,
                                          host.numel(), host.data, host.desc.dtype);
      });
      continue;
    }
    nn::load_parameter(engine, id, [&](int64_t first, int64_t n, void* dst, DType dst_dtype) {
      if (q->method == nn::QuantMethod::kFp8Block) {
        nn::dequantize_fp8_block(data, scale, quant.block_rows, quant.block_cols, first, n, dst, dst_dtype);
      } else {
        nn::dequantize_mxfp4(data, scale, first, n, dst, dst_dtype);
      }
    });
  }
}

nlohmann::json hf_weights_identity(const fs::path& dir, bool checksums) {
  WeightFiles w = weight_files(dir);
  if (!w.index.empty()) w.files.insert(w.index.filename().string());
  nlohmann::json out = nlohmann::json::array();
  for (const std::string& name : w.files) {  // a std::set: name order
    engine::StateFile f;
    if (checksums) {
      f = engine::checksum_file(dir, name);
    } else {
      std::error_code ec;
      f.nbytes = fs::file_size(dir / name, ec);
      STRATA_CHECK(!ec, kIo, "{}: cannot read its size: {}", (dir / name).string(), ec.message());
    }
    out.push_back({{"file", name}, {"bytes", f.nbytes}, {"crc32", f.crc32}});
  }
  return out;
}

}  // namespace strata::train
