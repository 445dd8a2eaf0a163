// Tiny models for the nn tests: a config from its sizes, and model options
// (storage dtype, cross-entropy chunk).
#pragma once

#include <cstdint>

#include "runtime/nn/decoder_config.h"
#include "runtime/nn/decoder_model.h"

namespace strata::nn {

// A Llama config with these sizes and head_dim = hidden / heads; every other
// field keeps DecoderConfig's default.
inline DecoderConfig tiny_llama(int64_t vocab, int64_t hidden, int64_t intermediate, int64_t layers,
                              int64_t heads, int64_t kv_heads) {
  DecoderConfig c;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = intermediate;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = hidden / heads;
  return c;
}

inline DecoderModelOptions model_options(DType dtype, int64_t loss_chunk_rows = 256) {
  DecoderModelOptions o;
  o.dtype = dtype;
  o.loss_chunk_rows = loss_chunk_rows;
  return o;
}

}  // namespace strata::nn
