// Loading and saving parameters as Hugging Face safetensors, by parameter name
// (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, ...,
// lm_head.weight); TiledLinear tiles are cut from, and written into, the
// untiled tensor their ParameterSlice names. Both stream: each rank reads or
// writes only the ranges it owns (Engine::for_each_owned_range), tensor by
// tensor, so no whole model is ever assembled in host memory. Values are
// converted between the file's dtype and the parameter's storage dtype.
// Thread-safety: none. Errors: strata::Error from the safetensors reader and
// writer (missing tensor, shape mismatch, corrupt file, I/O), naming the
// tensor and the file.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "runtime/engine/engine.h"

namespace strata::nn {

// Reads every parameter in `params` from `path`, parameter "x" from the
// file's tensor prefix + "x" (PEFT's adapter files prefix "base_model.model.").
// A tensor in the file that no parameter claims is an error unless
// allow_unused (HF files may carry e.g. rotary buffers).
void load_parameters(engine::Engine& engine, const std::vector<engine::ParamId>& params,
                     const std::string& path, bool allow_unused = false,
                     const std::string& prefix = "");
// The same with parameter "x" read from the file's tensor file_name("x")
// (a gemma3 checkpoint's text model: nn::CheckpointNames::file_name).
void load_parameters(engine::Engine& engine, const std::vector<engine::ParamId>& params,
                     const std::string& path, bool allow_unused,
                     const std::function<std::string(const std::string&)>& file_name);
// Where the values of a Hugging Face tensor come from: writes its elements
// [first, first + n) (row-major), as dst_dtype, to dst.
using TensorSource = std::function<void(int64_t first, int64_t n, void* dst, DType dst_dtype)>;
// Loads parameter `id` (the ranges this rank owns) from its tensor's `source`
// (a dequantizing reader, checkpoint_quant.h); the caller checked the shape.
void load_parameter(engine::Engine& engine, engine::ParamId id, const TensorSource& source);
// Writes every parameter in its storage dtype (tiles as their untiled
// tensor), named prefix + its name. Needs a rank that owns every element (a
// resident engine, or world size 1); sharded checkpoints are the engine's business.
void save_parameters(engine::Engine& engine, const std::vector<engine::ParamId>& params,
                     const std::string& path, const std::string& prefix = "");

// Where elements [first, first + n) of parameter `p` lie in the Hugging Face
// tensor they belong to (its slice's, else its own): fn(tensor_element,
// param_element, count) for each contiguous run — the whole range for a
// parameter that is its tensor, row segments for a 2-D block (a TiledLinear
// tile, a tensor-parallel shard), single elements for a strided view whose
// last stride is not 1 (gpt-oss's stacked experts, read and written element
// by element: slow for the published sizes).
using TensorRunFn = std::function<void(int64_t tensor_element, int64_t param_element, int64_t count)>;
void for_each_tensor_run(const engine::ParamInfo& p, int64_t first, int64_t n, const TensorRunFn& fn);

}  // namespace strata::nn
