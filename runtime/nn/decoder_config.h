// The decoder's configuration: one struct for every supported Hugging Face
// family, read from config.json. DecoderModel is one decoder (embedding, RMSNorm
// -> attention -> residual, RMSNorm -> SwiGLU MLP -> residual, final norm,
// lm_head); what differs between the families is which variant each piece
// is, and this struct says it:
//
//   model_type  attention biases      q/k norm  RoPE                      sliding window
//   llama       attention_bias (all)  -         default, linear, llama3   -
//   mistral     -                     -         default, linear, llama3   sliding_window (all layers)
//   qwen2       q, k, v (not o)       -         default, linear, llama3   use_sliding_window + layer_types
//   qwen3       attention_bias (all)  per head  default, linear, llama3   use_sliding_window + layer_types
//   mixtral     -                     -         default, linear, llama3   sliding_window (all layers)
//   qwen3_moe   attention_bias (all)  per head  default, linear, llama3   - (use_sliding_window false)
//   qwen2_moe   qkv_bias: q, k, v     -         default, linear, llama3   use_sliding_window + layer_types
//
// mixtral, qwen3_moe and qwen2_moe are mixtures of experts: every layer's MLP
// is num_experts SwiGLU experts (moe_intermediate_size wide) behind a router
// (runtime/nn/moe_mlp.h); mixtral always renormalises the top-k
// probabilities, qwen3_moe and qwen2_moe when norm_topk_prob. qwen2_moe adds
// a shared expert to every layer: a SwiGLU MLP shared_expert_intermediate_size
// wide that every token goes through, its output scaled per token by
// sigmoid(shared_expert_gate(x)) and added to the routed experts' (transformers'
// Qwen2MoeSparseMoeBlock). qwen2_moe's default layer_types differ from
// qwen2's: with use_sliding_window, the even layers below max_window_layers
// slide (Qwen2MoeConfig), where qwen2 slides the layers from max_window_layers
// on. With output_router_logits the training loss includes
// router_aux_loss_coef times transformers' load-balancing loss (transformers
// adds it only then).
//
// plus llama's mlp_bias, tied embeddings and the padding token (its embedding
// row gets no gradient from lookups, as in torch's nn.Embedding). The tensor
// names are Hugging Face's and the same in the dense families (hf_tensors);
// the MoE families name their router and experts as published checkpoints and
// transformers 5's save_pretrained do: mixtral
// "block_sparse_moe.gate" and "block_sparse_moe.experts.N.w1/w2/w3", qwen3_moe
// "mlp.gate" and "mlp.experts.N.gate_proj/up_proj/down_proj" (transformers 5
// fuses them in memory only; its fused names are refused as unknown tensors);
// qwen2_moe as qwen3_moe, plus "mlp.shared_expert.gate_proj/up_proj/down_proj"
// and "mlp.shared_expert_gate" ([1, hidden], no bias).
//
// Parsing refuses, before any work and naming the key, anything that would
// make strata compute something other than what transformers computes for the
// checkpoint: another model_type (gemma2, phi3, mixtral, ... named with what
// they need), another architectures class, a qwen2_moe with dense layers
// (decoder_sparse_step other than 1, mlp_only_layers), a RoPE type or key not listed
// above, hidden_act other than silu, attention dropout, quantization, custom
// modeling code, a family's key set to what that family does not have
// (attention_bias true on mistral, ...), and any key strata does not know
// (unless it is a generic Hugging Face key that no model computation reads:
// token ids, dtype, generation settings, ...). A config without model_type
// and architectures is strata's own sizes-only format: a llama.
//
// Thread-safety: plain value type. Errors: parse/load throw strata::Error —
// kIo for an unreadable file, kBadArgument naming the file, the key, its
// value and what is supported.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/ops.h"

namespace strata::nn {

struct DecoderConfig {
  // config.json's model_type: "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe" or "qwen2_moe".
  std::string model_type = "llama";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // the family's default when absent
  int64_t head_dim = 0;             // the family's default when absent (hidden / heads; qwen3: 128)
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  ops::Rope rope;                   // rope_theta and the rope_type's scaling
  bool tie_word_embeddings = false;
  bool attention_qkv_bias = false;  // q_proj, k_proj, v_proj have biases
  bool attention_o_bias = false;    // o_proj has a bias
  bool mlp_bias = false;            // gate/up/down_proj have biases (llama's mlp_bias)
  bool qk_norm = false;             // per-head RMSNorm of q and k before RoPE (qwen3)
  // Sliding-window attention: a query sees its `sliding_window` most recent
  // tokens (0: no window), in the layers sliding_layers marks (empty: every
  // layer, mistral's rule; else one entry per layer, from qwen's layer_types).
  int64_t sliding_window = 0;
  std::vector<bool> sliding_layers;
  // The token whose embedding row gets no gradient from lookups (-1: none).
  int64_t pad_token_id = -1;
  // Mixture of experts (mixtral, qwen3_moe, qwen2_moe; every layer sparse): 0
  // experts is a dense MLP. mixtral: num_local_experts, its intermediate_size
  // per expert, norm_topk_prob always true; qwen3_moe and qwen2_moe:
  // num_experts, moe_intermediate_size.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0;
  bool output_router_logits = false;  // the loss includes coef * the load-balancing loss
  // qwen2_moe's shared expert: its SwiGLU width (0: none, the other families).
  int64_t shared_expert_intermediate_size = 0;
  bool moe() const { return num_experts > 0; }
  bool shared_expert() const { return shared_expert_intermediate_size > 0; }
  // The config.json object this was parsed from (null when built in code):
  // to_json() keeps its other keys, so an export carries them.
  nlohmann::json source;

  // The attention mask of layer `layer` (its sliding window, or none).
  ops::AttentionMask attention_mask(int64_t layer) const;
  // Parameters of the whole model (embedding, layers with their biases and
  // norms, final norm, lm_head unless tied): the sum over hf_tensors().
  int64_t parameter_count() const;
  // Checks consistency (divisibility, positivity, sizes); throws kBadArgument naming the key.
  void validate() const;
  // config.json as transformers reads it for this model_type: the source's
  // keys, with every key strata models written from this struct (RoPE in the
  // source's style: rope_parameters, or rope_theta and rope_scaling).
  nlohmann::json to_json() const;
  // to_json() for weights saved in `dtype` ("torch_dtype", and "dtype" when
  // the source has it, say so).
  nlohmann::json to_hf_json(DType dtype) const;
};

// What one of `tp` tensor-parallel ranks computes of `c` (docs/DESIGN.md §5):
// num_attention_heads, num_key_value_heads and intermediate_size divided by
// tp (with fewer kv heads than ranks, one: the kv head its query heads use,
// shared with tp / num_key_value_heads ranks), everything else as it is —
// the shapes of its activations (vocab_size stays whole: the embedding's and
// lm_head's rows split by it, Embedding). Refused (kBadArgument, naming the
// sizes) when tp does not divide them or vocab_size (nor num_key_value_heads
// tp), and for what is not implemented with tensor parallelism yet: experts.
DecoderConfig tensor_parallel_share(const DecoderConfig& c, int tp);

// A tensor of the Hugging Face checkpoint: its name and shape.
struct HfTensor {
  std::string name;
  Shape shape;
};
// Every tensor the architecture uses, in the model's declaration order: the
// checkpoint must hold exactly these (a tied lm_head may repeat the embedding).
std::vector<HfTensor> hf_tensors(const DecoderConfig& config);

// The Hugging Face names of a MoE layer's pieces: "<layer>.<block>.gate.weight"
// (the router) and "<layer>.<block>.experts.N.<gate|up|down>.weight"; with a
// shared expert "<layer>.<block>.shared_expert.{gate,up,down}_proj.weight" and
// "<layer>.<block>.shared_expert_gate.weight".
struct MoeNames {
  const char* block;
  const char* gate;
  const char* up;
  const char* down;
};
MoeNames moe_names(const DecoderConfig& config);

// The families strata fine-tunes, for messages and --help.
const char* supported_model_types();

DecoderConfig parse_decoder_config(const nlohmann::json& json,
                               const std::string& source = "config.json");
DecoderConfig load_decoder_config(const std::string& path);
void save_decoder_config(const DecoderConfig& config, const std::string& path);

}  // namespace strata::nn
