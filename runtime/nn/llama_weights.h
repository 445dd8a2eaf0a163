// Loading and saving a module's parameters as Hugging Face safetensors, by
// parameter name (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight,
// ..., lm_head.weight); TiledLinear tiles are cut from and reassembled into the
// untiled tensor their Parameter::slice names. Values are converted between the
// file's dtype and the parameter's storage dtype.
// Thread-safety: none. Errors: strata::Error from SafetensorsFile (missing
// tensor, shape mismatch, corrupt file), naming the tensor and the file.
#pragma once

#include <string>
#include <vector>

#include "runtime/nn/engine.h"

namespace strata::nn {

// Reads every parameter from `path`. A tensor in the file that no parameter
// claims is an error unless allow_unused (HF files may carry e.g. rotary buffers).
void load_parameters(Engine& engine, const std::vector<Parameter*>& params, const std::string& path,
                     bool allow_unused = false);
// Writes every parameter in its storage dtype.
void save_parameters(Engine& engine, const std::vector<Parameter*>& params,
                     const std::string& path);

}  // namespace strata::nn
