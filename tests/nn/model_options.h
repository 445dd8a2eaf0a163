// Model options shared by the nn tests: a dtype and the cross-entropy chunk.
#pragma once

#include <cstdint>

#include "runtime/nn/llama_model.h"

namespace strata::nn {

inline LlamaModelOptions model_options(DType dtype, int64_t loss_chunk_rows = 256) {
  LlamaModelOptions o;
  o.dtype = dtype;
  o.loss_chunk_rows = loss_chunk_rows;
  return o;
}

}  // namespace strata::nn
