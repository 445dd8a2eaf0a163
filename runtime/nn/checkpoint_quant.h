// Quantized Hugging Face checkpoints as strata reads them: config.json's
// quantization_config, the tensors a quantized weight is stored as, and their
// exact dequantization into the model's float storage (docs/DESIGN.md §4.2.2).
//
// Two formats, each computed as transformers computes it:
//   - FP8 block quantization (quant_method "fp8": DeepSeek-V3/R1, Kimi K2,
//     Qwen3-FP8): a weight [rows, cols] is stored F8_E4M3 (torch's
//     float8_e4m3fn) with "<name>_scale_inv", an fp32 grid of
//     ceil(rows / block_rows) x ceil(cols / block_cols); element (i, j) is
//     float(w[i, j]) * scale_inv[i / block_rows, j / block_cols] in fp32,
//     then rounded once to the model's dtype. Edge blocks are ragged
//     (kv_a_proj_with_mqa [576, 7168] has a [5, 56] grid, the last row block
//     64 rows). This is transformers' _dequantize_fp8_weight (FP8Linear's
//     dequantization) in fp32; its load-time Fp8Dequantize derives the block
//     from the grid's shape instead and so mis-blocks ragged tensors.
//   - MXFP4 (quant_method "mxfp4": gpt-oss's experts): "<name>_blocks" uint8
//     [E, R, G, 16] (two e2m1 values per byte, the low nibble first) and
//     "<name>_scales" uint8 [E, R, G] (e8m0 exponents, bias 127, one per 32
//     values) are the tensor [E, G * 32, R]: transformers'
//     convert_moe_packed_tensors (its FP4 table, ldexp by scale - 127 in fp32,
//     then the transpose of the last two dims).
// Which weights are quantized is read from the files (a weight stored
// F8_E4M3, or as _blocks and _scales); the rest are read as they are (bf16
// embeddings, norms, routers). A quantized weight whose module
// modules_to_not_convert names, a scale grid of the wrong shape or dtype, a
// missing companion or a companion without its weight is refused, naming the
// tensor and its file.
//
// Thread-safety: plain values and pure functions. Errors: Error(kBadArgument)
// naming the config key or the tensor and file.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace strata::nn {

enum class QuantMethod { kNone, kFp8Block, kMxfp4 };

// config.json's quantization_config, as far as it changes what strata reads.
struct CheckpointQuant {
  QuantMethod method = QuantMethod::kNone;
  // FP8: weight_block_size [block_rows, block_cols] (DeepSeek's 128 x 128).
  int64_t block_rows = 128, block_cols = 128;
  // FP8 scale_fmt "ue8m0" (DeepSeek-V3.1): the fp32 scales are powers of two;
  // the arithmetic is the same.
  bool ue8m0 = false;
  // Modules transformers leaves unquantized (modules_to_not_convert, or
  // MiniMax's ignored_layers): a prefix up to a module boundary, a regex with
  // that boundary, or a suffix, as transformers' should_convert_module reads
  // them. The regexes strata matches have '.' and '*' (what published configs
  // use: "model.layers.*.self_attn"); other regex syntax is refused by name.
  std::vector<std::string> modules_to_not_convert;
  bool quantized() const { return method != QuantMethod::kNone; }
  // Whether modules_to_not_convert names module `module` ("model.layers.0.mlp.gate").
  bool not_converted(const std::string& module) const;
};

// Reads quantization_config `qc` of a model_type `model_type` config
// (`where`: the file, for messages). Refused by name: quant_method other than
// "fp8" and "mxfp4" (bitsandbytes, gptq, awq, ... compute something else);
// for fp8, fmt other than "e4m3", a weight_block_size that is not two
// positive integers (null: per-tensor scales), activation_scheme "static"
// (scaled inputs), modules_to_convert (FP8 embeddings), expert_dtype "fp4";
// mxfp4 on a model_type other than gpt_oss (transformers' MXFP4 reads
// gpt-oss's experts only). Keys transformers' config class ignores pass.
CheckpointQuant parse_checkpoint_quant(const nlohmann::json& qc, const std::string& where,
                                       const std::string& model_type);

// One tensor of a checkpoint, as its header gives it.
struct CheckpointTensor {
  std::string file;
  DType dtype = DType::kF32;
  Shape shape;
  bool e8m0 = false;  // stored F8_E8M0, read as its exponent bytes (kU8): SafetensorsEntry::e8m0
};
// Every tensor of a checkpoint (all its files), by name.
using CheckpointTensors = std::map<std::string, CheckpointTensor>;

// A model tensor the checkpoint stores quantized.
struct QuantizedTensor {
  QuantMethod method = QuantMethod::kNone;
  std::string data;   // the FP8 weight (the model's own name) or the MXFP4 "_blocks"
  std::string scale;  // "_scale_inv" or "_scales"
  Shape shape;        // the dequantized tensor's
};

// The checkpoint's tensors as the model sees them: each quantized weight
// under its model name with its dequantized shape (and how to read it), each
// other tensor as it is; the companions (scales, blocks) consumed. Checks
// every quantized tensor and companion (dtype, shape, presence, the config's
// method and modules_to_not_convert), naming the tensor and its file; `where`
// names the checkpoint. Without quantization, a quantized tensor is refused.
struct DequantizedView {
  std::map<std::string, Shape> shapes;               // model name -> shape
  std::map<std::string, std::string> files;          // model name -> file holding it (its data)
  std::map<std::string, QuantizedTensor> quantized;  // model name -> its stored form
};
DequantizedView dequantized_view(const CheckpointQuant& quant, const CheckpointTensors& tensors,
                                 const std::string& where);

// An FP8 weight's scale grid in fp32: an fp32 grid's values, or those of an
// F8_E8M0 one (kU8 exponent bytes: transformers' ue8m0 saves), 2^(byte - 127)
// exactly as torch widens float8_e8m0fnu (0xff NaN, 0 the subnormal 2^-127).
std::vector<float> fp32_scale_grid(const TensorView& scale_inv);

// Elements [first, first + n) (row-major) of an FP8 weight `weight`
// (F8_E4M3 [rows, cols]) dequantized by `scale_inv` (fp32 or F8_E8M0 grid) with
// block_rows x block_cols blocks, into dst (n elements of float storage type
// dst_dtype).
void dequantize_fp8_block(const TensorView& weight, const TensorView& scale_inv, int64_t block_rows,
                          int64_t block_cols, int64_t first, int64_t n, void* dst, DType dst_dtype);
// Elements [first, first + n) (row-major over [E, G * 32, R]) of the MXFP4
// tensor of `blocks` (uint8 [E, R, G, 16]) and `scales` (uint8 [E, R, G]) into dst.
void dequantize_mxfp4(const TensorView& blocks, const TensorView& scales, int64_t first, int64_t n, void* dst,
                      DType dst_dtype);

}  // namespace strata::nn
