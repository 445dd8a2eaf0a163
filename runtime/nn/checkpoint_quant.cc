// quantization_config, the stored forms of quantized weights, and their
// dequantization (FP8 blocks, MXFP4), term for term as transformers computes them.
#include "runtime/nn/checkpoint_quant.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <cmath>
#include <mutex>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "kernels/fp8_blocks.h"
#include "kernels/mxfp4_blocks.h"
#include "runtime/config/json_describe.h"
#include "runtime/config/json_text.h"

namespace strata::nn {
namespace {

using nlohmann::json;

constexpr std::string_view kScaleInv = "_scale_inv";
constexpr std::string_view kBlocks = "_blocks";
constexpr std::string_view kScales = "_scales";

std::string text(std::string_view s) { return printable_excerpt(s, 120); }

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string strip(const std::string& s, std::string_view suffix) { return s.substr(0, s.size() - suffix.size()); }

// Logs once per key that a quantization_config key passes unread.
void note_ignored(const std::string& where, const std::string& key, const std::string& method) {
  static std::mutex mutex;
  static std::set<std::string> noted;
  {
    const std::lock_guard lock(mutex);
    if (!noted.insert(method + "/" + key).second) return;
  }
  logger().info("{}: quantization_config key '{}' is not read by transformers' {} quantization; it passes unread",
                where, text(key), method);
}

std::vector<std::string> module_list(const json& v, const std::string& where, const char* key) {
  std::vector<std::string> out;
  if (v.is_null()) return out;
  STRATA_CHECK(v.is_array(), kBadArgument, "{}: quantization_config.{} must be a list of module names, got {}",
               where, key, describe_json(v));
  for (const json& m : v) {
    STRATA_CHECK(m.is_string(), kBadArgument, "{}: quantization_config.{} holds {}, not a module name", where, key,
                 describe_json(m));
    const std::string name = m.get<std::string>();
    // The patterns published are module names and "model.layers.*.self_attn":
    // '.' (any character) and '*' (the one before, repeated) are the regex
    // strata matches; anything else would need a regex engine's meaning.
    const bool plain = name.size() <= 512 && !name.empty() && name[0] != '*' &&
                       name.find_first_of("[](){}+?|^$\\") == std::string::npos &&
                       name.find("**") == std::string::npos;
    STRATA_CHECK(plain, kBadArgument,
                 "{}: quantization_config.{} holds '{}'; strata matches module names with '.' and '*' (as "
                 "\"model.layers.*.self_attn\"), not other regex syntax",
                 where, key, text(name));
    out.push_back(name);
  }
  return out;
}

CheckpointQuant parse_fp8(const json& qc, const std::string& where) {
  CheckpointQuant q;
  q.method = QuantMethod::kFp8Block;
  for (auto it = qc.begin(); it != qc.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "quant_method" || key == "dequantize") continue;  // dequantize: what strata does anyway
    if (key == "fmt") {
      STRATA_CHECK(v == "e4m3", kBadArgument,
                   "{}: quantization_config.fmt is {}; strata reads FP8 e4m3 weights (\"e4m3\")", where,
                   describe_json(v));
    } else if (key == "weight_block_size") {
      // An integer in [1, 2^30] (compared as doubles: no cast of an out-of-range value).
      const auto positive = [](const json& d) {
        return d.is_number_integer() && d.get<double>() >= 1 && d.get<double>() <= double{1 << 30};
      };
      STRATA_CHECK(v.is_array() && v.size() == 2 && positive(v[0]) && positive(v[1]),
                   kBadArgument,
                   "{}: quantization_config.weight_block_size is {}; strata reads block-quantized FP8 "
                   "([rows, cols] of positive integers, DeepSeek's [128, 128]), not per-tensor scales",
                   where, describe_json(v));
      q.block_rows = v[0].get<int64_t>();
      q.block_cols = v[1].get<int64_t>();
    } else if (key == "activation_scheme") {
      STRATA_CHECK(v.is_string() && (v == "dynamic" || v == "DYNAMIC" || v == "Dynamic"), kBadArgument,
                   "{}: quantization_config.activation_scheme is {}; strata reads the weights of \"dynamic\" "
                   "checkpoints only (\"static\" ones quantize the inputs with stored activation scales)",
                   where, describe_json(v));
    } else if (key == "scale_fmt") {
      STRATA_CHECK(v.is_null() || v == "float" || v == "ue8m0", kBadArgument,
                   "{}: quantization_config.scale_fmt is {}; strata reads \"float\" and \"ue8m0\"", where,
                   describe_json(v));
      q.ue8m0 = v == "ue8m0";
    } else if (key == "modules_to_not_convert" || key == "ignored_layers") {
      for (std::string& m : module_list(v, where, key.c_str())) q.modules_to_not_convert.push_back(std::move(m));
    } else if (key == "modules_to_convert") {
      STRATA_CHECK(v.is_null() || (v.is_array() && v.empty()), kBadArgument,
                   "{}: quantization_config.modules_to_convert is {}: FP8 embeddings, which strata does not read",
                   where, describe_json(v));
    } else if (key == "expert_dtype") {
      STRATA_CHECK(v.is_null() || v == "fp8", kBadArgument,
                   "{}: quantization_config.expert_dtype is {}; strata reads FP8 experts (\"fp8\"), not "
                   "FP4-packed ones",
                   where, describe_json(v));
    } else {
      note_ignored(where, key, "fp8");
    }
  }
  return q;
}

CheckpointQuant parse_mxfp4(const json& qc, const std::string& where, const std::string& model_type) {
  STRATA_CHECK(model_type == "gpt_oss", kBadArgument,
               "{}: quantization_config.quant_method is \"mxfp4\" on model_type \"{}\"; transformers' MXFP4 "
               "reads gpt-oss's experts only (model_type gpt_oss)",
               where, model_type);
  CheckpointQuant q;
  q.method = QuantMethod::kMxfp4;
  for (auto it = qc.begin(); it != qc.end(); ++it) {
    const std::string& key = it.key();
    if (key == "quant_method" || key == "dequantize") continue;
    if (key == "modules_to_not_convert") {
      q.modules_to_not_convert = module_list(it.value(), where, "modules_to_not_convert");
    } else {
      note_ignored(where, key, "mxfp4");
    }
  }
  return q;
}

// The grid of an FP8 weight's scales.
Shape scale_grid(const CheckpointQuant& q, const Shape& weight) {
  return {(weight[0] + q.block_rows - 1) / q.block_rows, (weight[1] + q.block_cols - 1) / q.block_cols};
}

// Which prefixes of `text` the regex `pattern` (literal characters, '.' any
// character, '*' the element before repeated) matches whole: result[p] for
// text[0, p). Dynamic programming, linear in each: no backtracking.
std::vector<bool> matched_prefixes(const std::string& pattern, const std::string& text) {
  struct Element {
    char c;
    bool any, repeated;
  };
  std::vector<Element> elements;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '*' && !elements.empty()) {
      elements.back().repeated = true;
      continue;
    }
    elements.push_back({pattern[i], pattern[i] == '.', false});
  }
  // can[j]: the elements so far match text[0, j).
  std::vector<bool> can(text.size() + 1, false), next(text.size() + 1);
  can[0] = true;
  for (const Element& e : elements) {
    std::fill(next.begin(), next.end(), false);
    for (size_t j = 0; j <= text.size(); ++j) {
      if (e.repeated && (can[j] || (j > 0 && next[j - 1] && (e.any || text[j - 1] == e.c)))) next[j] = true;
      if (j > 0 && can[j - 1] && (e.any || text[j - 1] == e.c)) next[j] = true;
    }
    std::swap(can, next);
  }
  return can;
}

}  // namespace

bool CheckpointQuant::not_converted(const std::string& module) const {
  for (const std::string& key : modules_to_not_convert) {
    if (ends_with(module, key)) return true;
    // re.match(key + boundary): the key matches a prefix that ends at a
    // module boundary (the prefix ends in '.', or '.' or the end follows it).
    const std::vector<bool> matched = matched_prefixes(key, module);
    for (size_t p = 0; p <= module.size(); ++p) {
      const bool boundary = p == module.size() || module[p] == '.' || (p > 0 && module[p - 1] == '.');
      if (boundary && matched[p]) return true;
    }
  }
  return false;
}

CheckpointQuant parse_checkpoint_quant(const json& qc, const std::string& where, const std::string& model_type) {
  STRATA_CHECK(qc.is_object(), kBadArgument, "{}: key 'quantization_config' must be an object, got {}", where,
               describe_json(qc));
  const json method = qc.contains("quant_method") ? qc["quant_method"] : json(nullptr);
  if (method == "fp8") return parse_fp8(qc, where);
  if (method == "mxfp4") return parse_mxfp4(qc, where, model_type);
  raise(ErrorCategory::kBadArgument,
        "{}: quantization_config.quant_method is {}: strata reads FP8 block-quantized checkpoints (\"fp8\", "
        "DeepSeek-V3 and Kimi K2's) and gpt-oss's MXFP4 (\"mxfp4\"), dequantized exactly; other methods compute "
        "other weights (load the unquantized model)",
        where, describe_json(method));
}

DequantizedView dequantized_view(const CheckpointQuant& quant, const CheckpointTensors& tensors,
                                 const std::string& where) {
  DequantizedView view;
  std::set<std::string> companions;
  auto in_file = [&](const std::string& name) { return tensors.at(name).file; };
  for (const auto& [name, t] : tensors) {
    if (t.dtype == DType::kF8E4M3) {
      STRATA_CHECK(quant.method == QuantMethod::kFp8Block, kBadArgument,
                   "{}: tensor '{}' (in {}) is FP8 (F8_E4M3), but config.json has no FP8 quantization_config "
                   "(quant_method \"fp8\" with its weight_block_size) to say how it is scaled",
                   where, name, t.file);
      STRATA_CHECK(t.shape.size() == 2, kBadArgument,
                   "{}: FP8 tensor '{}' (in {}) has shape {}; strata reads block-quantized 2-D weights", where, name,
                   t.file, shape_string(t.shape));
      const std::string scale = name + std::string(kScaleInv);
      const auto s = tensors.find(scale);
      STRATA_CHECK(s != tensors.end(), kBadArgument,
                   "{}: FP8 tensor '{}' (in {}) has no '{}' beside it: its values cannot be scaled", where, name,
                   t.file, scale);
      const Shape grid = scale_grid(quant, t.shape);
      // fp32, or F8_E8M0 (transformers' ue8m0 saves); plain uint8 bytes are not a scale.
      const bool grid_dtype = s->second.dtype == DType::kF32 || (s->second.dtype == DType::kU8 && s->second.e8m0);
      STRATA_CHECK(grid_dtype && s->second.shape == grid, kBadArgument,
                   "{}: '{}' (in {}) is {} {}, but FP8 tensor '{}' {} with weight_block_size [{}, {}] needs an fp32 "
                   "(or F8_E8M0) grid {} (a corrupt or truncated scale grid)",
                   where, scale, s->second.file, dtype_name(s->second.dtype), shape_string(s->second.shape), name,
                   shape_string(t.shape), quant.block_rows, quant.block_cols, shape_string(grid));
      const std::string module = ends_with(name, ".weight") ? strip(name, ".weight") : name;
      STRATA_CHECK(!quant.not_converted(module), kBadArgument,
                   "{}: tensor '{}' (in {}) is FP8, but quantization_config.modules_to_not_convert leaves module "
                   "'{}' unquantized: the checkpoint and its config.json disagree",
                   where, name, t.file, module);
      companions.insert(scale);
      view.quantized[name] = QuantizedTensor{QuantMethod::kFp8Block, name, scale, t.shape};
      view.shapes[name] = t.shape;
      view.files[name] = t.file;
      continue;
    }
    if (ends_with(name, kBlocks) && t.dtype == DType::kU8) {
      const std::string base = strip(name, kBlocks);
      const std::string scales = base + std::string(kScales);
      STRATA_CHECK(quant.method == QuantMethod::kMxfp4, kBadArgument,
                   "{}: tensor '{}' (in {}) holds MXFP4 blocks, but config.json has no MXFP4 quantization_config "
                   "(quant_method \"mxfp4\")",
                   where, name, t.file);
      const auto s = tensors.find(scales);
      STRATA_CHECK(s != tensors.end(), kBadArgument,
                   "{}: MXFP4 blocks '{}' (in {}) have no '{}' beside them: their values cannot be scaled", where,
                   name, t.file, scales);
      STRATA_CHECK(t.shape.size() == 4 && t.shape[3] == 16, kBadArgument,
                   "{}: MXFP4 blocks '{}' (in {}) have shape {}; gpt-oss's are [experts, rows, groups, 16] (32 "
                   "four-bit values per group)",
                   where, name, t.file, shape_string(t.shape));
      const Shape grid{t.shape[0], t.shape[1], t.shape[2]};
      STRATA_CHECK(s->second.dtype == DType::kU8 && s->second.shape == grid, kBadArgument,
                   "{}: '{}' (in {}) is {} {}, but MXFP4 blocks '{}' {} need uint8 exponents {} (a corrupt or "
                   "truncated scale grid)",
                   where, scales, s->second.file, dtype_name(s->second.dtype), shape_string(s->second.shape), name,
                   shape_string(t.shape), shape_string(grid));
      STRATA_CHECK(!tensors.contains(base), kBadArgument,
                   "{}: the checkpoint holds both '{}' and its MXFP4 blocks '{}' (in {})", where, base, name,
                   t.file);
      const std::string module = base.substr(0, base.rfind('.') == std::string::npos ? base.size() : base.rfind('.'));
      STRATA_CHECK(!quant.not_converted(module), kBadArgument,
                   "{}: tensor '{}' (in {}) is MXFP4, but quantization_config.modules_to_not_convert leaves module "
                   "'{}' unquantized: the checkpoint and its config.json disagree",
                   where, name, t.file, module);
      companions.insert(scales);
      const Shape shape{t.shape[0], t.shape[2] * 32, t.shape[1]};
      view.quantized[base] = QuantizedTensor{QuantMethod::kMxfp4, name, scales, shape};
      view.shapes[base] = shape;
      view.files[base] = t.file;
      continue;
    }
  }
  for (const auto& [name, t] : tensors) {
    if (view.quantized.contains(name) || companions.contains(name)) continue;
    if (ends_with(name, kBlocks) && view.quantized.contains(strip(name, kBlocks))) continue;
    // A scale whose weight is not FP8 would be dropped, leaving the weight unscaled.
    STRATA_CHECK(!ends_with(name, kScaleInv) || !tensors.contains(strip(name, kScaleInv)), kBadArgument,
                 "{}: '{}' (in {}) scales '{}' (in {}), which is {}, not FP8 (F8_E4M3)", where, name, t.file,
                 strip(name, kScaleInv), in_file(strip(name, kScaleInv)),
                 dtype_name(tensors.at(strip(name, kScaleInv)).dtype));
    STRATA_CHECK(is_float_storage(t.dtype), kBadArgument,
                 "{}: tensor '{}' (in {}) is {}, and no quantized weight of config.json's quantization_config "
                 "claims it",
                 where, name, t.file, dtype_name(t.dtype));
    view.shapes[name] = t.shape;
    view.files[name] = t.file;
  }
  return view;
}

std::vector<float> fp32_scale_grid(const TensorView& scale_inv) {
  const auto n = static_cast<size_t>(scale_inv.numel());
  STRATA_CHECK(scale_inv.desc.dtype == DType::kF32 || scale_inv.desc.dtype == DType::kU8, kInternal,
               "fp32_scale_grid: a {} grid", dtype_name(scale_inv.desc.dtype));
  std::vector<float> out(n);
  if (scale_inv.desc.dtype == DType::kF32) {
    std::memcpy(out.data(), scale_inv.data, n * sizeof(float));
    return out;
  }
  const auto* e = static_cast<const uint8_t*>(scale_inv.data);
  for (size_t i = 0; i < n; ++i) {
    // The exponent in a float's exponent field: exact, 0 the subnormal 2^-127.
    out[i] = e[i] == 0xff ? std::numeric_limits<float>::quiet_NaN()
             : e[i] == 0  ? std::bit_cast<float>(uint32_t{1} << 22)
                          : std::bit_cast<float>(static_cast<uint32_t>(e[i]) << 23);
  }
  return out;
}

void dequantize_fp8_block(const TensorView& weight, const TensorView& scale_inv, int64_t block_rows,
                          int64_t block_cols, int64_t first, int64_t n, void* dst, DType dst_dtype) {
  if (scale_inv.desc.dtype == DType::kU8) {
    // F8_E8M0 exponents: the same arithmetic on their fp32 values.
    std::vector<float> grid = fp32_scale_grid(scale_inv);
    dequantize_fp8_block(weight, TensorView{TensorDesc{DType::kF32, scale_inv.desc.shape, Tier::kCpu}, grid.data()},
                         block_rows, block_cols, first, n, dst, dst_dtype);
    return;
  }
  STRATA_CHECK(weight.desc.dtype == DType::kF8E4M3 && weight.desc.shape.size() == 2 &&
                   scale_inv.desc.dtype == DType::kF32 && scale_inv.desc.shape.size() == 2 && block_rows > 0 &&
                   block_cols > 0 && first >= 0 && n >= 0 && first + n <= weight.numel() &&
                   is_float_storage(dst_dtype),
               kInternal, "dequantize_fp8_block: bad arguments");
  const int64_t cols = weight.desc.shape[1], grid_cols = scale_inv.desc.shape[1];
  STRATA_CHECK(scale_inv.desc.shape[0] == (weight.desc.shape[0] + block_rows - 1) / block_rows &&
                   grid_cols == (cols + block_cols - 1) / block_cols,
               kInternal, "dequantize_fp8_block: grid {} for weight {}", shape_string(scale_inv.desc.shape),
               shape_string(weight.desc.shape));
  // The one arithmetic of FP8 blocks, shared with Ops::dequantize_fp8_blocks' backends.
  const kernels::Fp8Blocks shape{weight.desc.shape[0], cols, block_rows, block_cols};
  kernels::dequantize_fp8_blocks(static_cast<const uint8_t*>(weight.data) + first,
                                 static_cast<const float*>(scale_inv.data), shape, first, n, dst, dst_dtype);
}

void dequantize_mxfp4(const TensorView& blocks, const TensorView& scales, int64_t first, int64_t n, void* dst,
                      DType dst_dtype) {
  const Shape& b = blocks.desc.shape;
  STRATA_CHECK(blocks.desc.dtype == DType::kU8 && scales.desc.dtype == DType::kU8 && b.size() == 4 && b[3] == 16 &&
                   scales.desc.shape == Shape({b[0], b[1], b[2]}) && first >= 0 && n >= 0 &&
                   first + n <= blocks.numel() * 2 && is_float_storage(dst_dtype),
               kInternal, "dequantize_mxfp4: bad arguments");
  // The output [E, groups * 32, rows]: the stacked [experts, in, width].
  const kernels::Mxfp4Stacked shape{b[0], b[2] * 32, b[1]};
  kernels::dequantize_mxfp4_stacked(static_cast<const uint8_t*>(blocks.data), static_cast<const uint8_t*>(scales.data),
                                    shape, first, n, dst, dst_dtype);
}

}  // namespace strata::nn
