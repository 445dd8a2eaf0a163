// Which weights an FP8 export writes block-quantized (--export-dtype fp8,
// docs/DESIGN.md §5.3; the quantizer is kernels/fp8_quantize.h).
//
// Thread-safety: a pure function. Errors: none.
#pragma once

#include <string>

#include "core/tensor.h"
#include "runtime/nn/checkpoint_quant.h"

namespace strata::nn {

// Whether an FP8 export writes model tensor `name` of `shape`
// block-quantized, given the source's quantization `source`: a 2-D ".weight"
// of a decoder layer ("model.layers.<i>.") whose module is a linear
// projection -- attention's, the dense MLP's, each expert's and the shared
// experts' -- as transformers' FineGrainedFP8 replaces nn.Linear and DeepSeek
// quantizes its checkpoints (for an FP8 source: exactly what it held in FP8);
// never the embedding, lm_head, norms, biases or a router or gate ("gate",
// "router", "shared_expert_gate": they score experts), nor a module the
// source's modules_to_not_convert names.
bool fp8_export_weight(const std::string& name, const Shape& shape, const CheckpointQuant& source);

}  // namespace strata::nn
