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
//   gemma2      attention_bias (all)  -         default, linear, llama3   layer_types (default: even layers)
//   gemma3_text attention_bias (all)  per head  two: full and sliding     layer_types or sliding_window_pattern
//   gpt_oss     attention_bias (all)  -         yarn by default           layer_types (default: even layers)
//
// Gemma 2 and 3 (gemma2, gemma3_text: transformers' Gemma2ForCausalLM and
// Gemma3ForCausalLM) change more than the variants above: GeGLU with gelu's
// tanh approximation (hidden_activation gelu_pytorch_tanh), RMSNorm times
// (1 + w) computed in fp32 (norm_weight_offset 1: every norm, q/k norms
// included), the embedding times sqrt(hidden_size) rounded to the model's
// dtype, "sandwich" norms (post_attention_layernorm on the attention's output
// and post_feedforward_layernorm on the MLP's, before each residual add; the
// MLP's input norm is pre_feedforward_layernorm), the attention scores scaled
// by query_pre_attn_scalar^-1/2 instead of head_dim^-1/2. Gemma 2 soft-caps
// the attention scores (attn_logit_softcapping) and the logits
// (final_logit_softcapping: c * tanh(x / c)); Gemma 3 has q/k norms and its
// sliding layers their own RoPE (rope_parameters.sliding_attention, or the
// older rope_local_base_freq), and transformers' Gemma3 ignores
// attn_logit_softcapping. Both default to tied embeddings and pad_token_id 0.
//
// A gemma3 config.json (Gemma3ForConditionalGeneration, the published Gemma 3
// 4B-27B) parses to its text model: text_config read as gemma3_text, tied by
// the top level's tie_word_embeddings, with `multimodal` set (the whole
// config, where the text model's tensors sit in the files, the image
// placeholder ids, the vision tower's parameter count). The vision tower and
// projector are never run: their tensors are carried to the export unchanged
// (is_carried_tensor), and to_json() writes the gemma3 config back.
//
// gpt-oss (gpt_oss: transformers' GptOssForCausalLM) is a mixture of experts
// with pieces of its own, each an optional field below: attention sinks (one
// learned logit per query head in each softmax row's denominator,
// "self_attn.sinks"), a router with a bias ("mlp.router.weight" and ".bias";
// the softmax over the top-k logits, which is the softmax renormalised over
// the top k: norm_topk_prob), experts with biases and the clamped SwiGLU
// (swiglu_alpha, swiglu_limit), stored stacked as transformers' GptOssExperts
// holds them ("mlp.experts.gate_up_proj" [E, hidden, 2 I], gate and up
// interleaved along its last dimension, "mlp.experts.gate_up_proj_bias" [E,
// 2 I], "mlp.experts.down_proj" [E, I, hidden], "mlp.experts.down_proj_bias"
// [E, hidden]; x W rather than x W^T). Its RoPE defaults to YaRN (factor 32
// over 4096 positions, truncate false, theta 150000) and its layers to
// sliding (window 128) and full attention in turn.
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
// checkpoint: another model_type (gemma, phi3, olmo2, ... named with
// what they need), another architectures class, a qwen2_moe with dense layers
// (decoder_sparse_step other than 1, mlp_only_layers), a RoPE type or key not listed
// above, hidden_act other than silu, attention dropout, quantization other
// than FP8 blocks and MXFP4 (checkpoint_quant.h), custom modeling code, and any key transformers' code for the model_type can compute
// with that strata does not read (transformers_config_keys.inc, generated by
// scripts/make-config-keys from transformers' configuration classes and
// modeling files). What transformers itself ignores passes: generic keys no
// model computation reads (dtype, generation settings), underscore-prefixed
// bookkeeping, special-token ids other than padding, and keys the family's
// configuration class does not take (attention_bias on mistral, use_mrope on
// qwen2, ...) -- logged once and kept in to_json(). A config without
// model_type and architectures is strata's own sizes-only format: a llama.
//
// Thread-safety: plain value type. Errors: parse/load throw strata::Error —
// kIo for an unreadable file, kBadArgument naming the file, the key, its
// value and what is supported.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/ops.h"
#include "runtime/nn/checkpoint_quant.h"

namespace strata::nn {

// The self-attention a decoder layer computes (runtime/nn/attention.h, one
// SelfAttention kind each). kGqa: grouped-query attention, RoPE on the whole
// head (gqa_attention.h) -- every family here. Multi-head latent attention
// (DeepSeek-V3, Kimi K2) is the second: kMla (mla_attention.h).
enum class AttentionKind { kGqa, kMla };

// Where a model's tensors sit in its checkpoint's files: "model.X" at
// text_prefix + "X", "lm_head.weight" at `head`. A causal LM's names are the
// model's own; Gemma3ForConditionalGeneration's text model sits under
// "language_model.model." (the published checkpoints, and what transformers
// 5 writes: it saves in the 4.x layout) or "model.language_model." (its
// in-memory names, which some saves keep), its lm_head at
// "language_model.lm_head.weight" or "lm_head.weight".
struct CheckpointNames {
  std::string text_prefix = "model.";
  std::string head = "lm_head.weight";
  // PEFT's names of the text model's modules on the loaded
  // Gemma3ForConditionalGeneration (transformers 5's in-memory
  // "model.language_model.*"); empty: the model's own.
  std::string peft_prefix;
  // The name of adapter tensor `name` in PEFT's adapter_model.safetensors
  // (kPeftPrefix + the module's name in the transformers model).
  std::string adapter_name(const std::string& name) const;
  // The file's name of model tensor `name`.
  std::string file_name(const std::string& name) const;
  // The model's name of the file's tensor `name`; nullopt when it is not the text model's.
  std::optional<std::string> model_name(const std::string& name) const;
};

// What a gemma3 checkpoint has besides its text model.
struct Multimodal {
  nlohmann::json config;  // the whole config.json (text_config is rewritten from the text model by to_json)
  CheckpointNames names{"language_model.model.", "language_model.lm_head.weight", "model.language_model."};
  // The image placeholder ids (image_token_index, boi_token_index,
  // eoi_token_index): strata trains on text and cannot fill them.
  std::vector<std::pair<std::string, int64_t>> image_tokens;
  // Parameters of the vision tower and the projector (from vision_config).
  int64_t vision_parameters = 0;
};

// Whether `name` is a tensor of a gemma3 checkpoint's vision tower or
// multi-modal projector ("vision_tower.*", "multi_modal_projector.*", with or
// without transformers 5's "model." before them).
bool is_vision_tensor(const std::string& name);

struct DecoderConfig {
  // config.json's model_type: "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe",
  // "deepseek_v3", "kimi_k2", "glm4_moe", "gemma2", "gemma3_text" or "gpt_oss".
  std::string model_type = "llama";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // the family's default when absent
  int64_t head_dim = 0;             // the family's default when absent (hidden / heads; qwen3: 128)
  AttentionKind attention = AttentionKind::kGqa;
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
  // Multi-head latent attention (deepseek_v3, kimi_k2; AttentionKind::kMla):
  // q through q_a_proj [q_lora_rank] -> q_a_layernorm -> q_b_proj (q_lora_rank
  // 0: q_proj), keys and values from the kv_lora_rank latent of
  // kv_a_proj_with_mqa (which also gives the one rope key all heads share)
  // through kv_a_layernorm and kv_b_proj. head_dim is the q/k head,
  // qk_nope_head_dim + qk_rope_head_dim; rope rotates the last
  // qk_rope_head_dim of it (interleaved pairs with rope_interleave), at
  // that width's frequencies; v_head_dim the value head.
  int64_t q_lora_rank = 0, kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool rope_interleave = true;
  // The DeepSeek mixture of experts (deepseek_v3, kimi_k2): the sigmoid
  // router (ops::MoeScores::kSigmoid) with its e_score_correction_bias, the
  // group-limited choice (n_group groups, the topk_group best kept), the
  // weights times routed_scaling_factor; n_shared_experts shared experts --
  // one ungated SwiGLU MLP n_shared_experts x moe_intermediate_size wide
  // (shared_expert_intermediate_size) every token goes through, named
  // "mlp.shared_experts"; the first first_k_dense_replace layers dense
  // (intermediate_size wide). transformers computes no load-balancing loss
  // for them (output_router_logits changes nothing).
  bool sigmoid_router = false;
  int64_t n_group = 1, topk_group = 1;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0;
  // DeepSeek's multi-token prediction modules (num_nextn_predict_layers):
  // transformers ignores their weights (model.layers.<num_hidden_layers>.*),
  // and so does the training; they are carried to the export unchanged.
  int64_t mtp_layers = 0;
  // Gemma 2 and 3 (see above); the defaults are every other family's.
  ops::GluActivation hidden_act = ops::GluActivation::kSilu;
  float norm_weight_offset = 0;       // 1: Gemma's RMSNorm, x * rstd * (1 + w)
  bool scale_embedding = false;       // embeddings times sqrt(hidden_size), in the model's dtype
  bool sandwich_norms = false;        // post-attention and post-feedforward norms
  double query_pre_attn_scalar = 0;   // the scores times its ^-1/2 (0: head_dim's)
  double attn_logit_softcapping = 0;  // 0: none
  double final_logit_softcapping = 0; // 0: none
  // The RoPE of the sliding-window layers when it is not `rope` (Gemma 3's
  // local layers); nullopt: every layer rotates by `rope`.
  std::optional<ops::Rope> sliding_rope;
  // A gemma3 checkpoint (Gemma3ForConditionalGeneration): this struct is its
  // text model (text_config, model_type gemma3_text, tie_word_embeddings the
  // top level's: transformers ties by it); set only then.
  std::optional<Multimodal> multimodal;
  // gpt-oss's pieces (see above); the defaults are every other family's.
  bool attention_sinks = false;   // "self_attn.sinks" [num_attention_heads]
  bool router_bias = false;       // the router's bias [E]
  // The experts as strided views of stacked [E, in, out] tensors with biases,
  // gate and up interleaved (MoeMlp); false: a tensor per expert and projection.
  bool stacked_experts = false;
  ops::GluActivation expert_act = ops::GluActivation::kSilu;  // kClampedSwiglu: gpt-oss's
  ops::GluClamp glu_clamp;        // swiglu_alpha and swiglu_limit (kClampedSwiglu only)
  bool moe() const { return num_experts > 0; }
  bool shared_expert() const { return shared_expert_intermediate_size > 0; }
  // Whether layer `layer`'s MLP is the mixture of experts (else dense).
  bool layer_moe(int64_t layer) const { return moe() && layer >= first_k_dense_replace; }
  // Whether some layer is dense / sparse.
  bool any_dense_layer() const { return !moe() || first_k_dense_replace > 0; }
  bool any_moe_layer() const { return moe() && first_k_dense_replace < num_hidden_layers; }
  // qwen2_moe scales its shared expert by sigmoid(shared_expert_gate(x)); DeepSeek's is ungated.
  bool shared_expert_gated() const { return shared_expert() && !sigmoid_router; }
  // The router's rule (kernels/moe_routing.h).
  ops::MoeRouter router() const;
  // The attention scores' scale: 1 / sqrt(head_dim), times YaRN's mscale^2
  // for multi-head latent attention (transformers' yarn_apply_mscale).
  double attention_scale() const;
  // How the checkpoint's weights are quantized (quantization_config:
  // checkpoint_quant.h): read and dequantized exactly into the model's dtype;
  // an export writes them dequantized, without the key.
  CheckpointQuant quant;
  // The config.json object this was parsed from (null when built in code):
  // to_json() keeps its other keys, so an export carries them.
  nlohmann::json source;

  // The attention mask of layer `layer` (its sliding window, or none), with
  // the scores' scale and soft cap (Gemma's).
  ops::AttentionMask attention_mask(int64_t layer) const;
  // The RoPE of layer `layer` (sliding_rope on a sliding layer that has one).
  const ops::Rope& rope_of(int64_t layer) const;
  bool gemma() const { return model_type == "gemma2" || model_type == "gemma3_text"; }
  bool gpt_oss() const { return model_type == "gpt_oss"; }
  // Parameters of the whole model (embedding, layers with their biases and
  // norms, final norm, lm_head unless tied): the sum over hf_tensors().
  int64_t parameter_count() const;
  // What one token computes with: parameter_count() less the routed experts
  // a token does not use (per MoE layer num_experts - num_experts_per_tok of
  // them: their matrices and, gpt-oss's, their biases); the input
  // embedding's table is included (input_embedding_count() says how much of
  // it is that lookup). parameter_count() for a dense model.
  int64_t active_parameter_count() const;
  // What the checkpoint holds: parameter_count(), plus a gemma3 checkpoint's
  // vision tower (SigLIP, from vision_config) and multi-modal projector,
  // which strata carries untrained (transformers' count of the whole
  // Gemma3ForConditionalGeneration).
  int64_t checkpoint_parameter_count() const;
  // The input embedding's vocab_size x hidden_size table when it is not tied
  // to lm_head (a lookup, no arithmetic: published active counts such as
  // gpt-oss's 5.1B leave it out); 0 when tied (then it is the output
  // projection too, which computes).
  int64_t input_embedding_count() const;
  // Checks consistency (divisibility, positivity, sizes); throws kBadArgument naming the key.
  void validate() const;
  // config.json as transformers reads it for this model_type: the source's
  // keys, with every key strata models written from this struct (RoPE in the
  // source's style: rope_parameters, or rope_theta and rope_scaling).
  nlohmann::json to_json() const;
  // to_json() for weights saved in `dtype` ("torch_dtype", and "dtype" when
  // the source has it, say so), without quantization_config (the weights are
  // written dequantized).
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
// A checkpoint tensor that is a buffer, not a parameter (the sigmoid
// router's e_score_correction_bias): loaded, never trained, exported
// unchanged, and not counted by parameter_count (transformers' count).
bool is_buffer_tensor(const std::string& name);
// The dtype an export writes tensor `name` in when asked for `dtype`: fp32
// for what transformers keeps in fp32 whatever the model's dtype (the
// sigmoid router's weight and correction bias), else `dtype`.
DType export_dtype(const DecoderConfig& config, const std::string& name, DType dtype);
// Whether `name` is a weight of DeepSeek's multi-token prediction modules
// (model.layers.<num_hidden_layers + i>.*, i < mtp_layers), which
// transformers ignores: not trained, carried to an export unchanged.
bool is_mtp_tensor(const DecoderConfig& config, const std::string& name);
// Whether the checkpoint's tensor `name` (a file's name) is carried to the
// export untrained: an MTP module's, or a gemma3 checkpoint's vision tower
// and projector.
bool is_carried_tensor(const DecoderConfig& config, const std::string& name);
// Where the model's tensors sit in its checkpoint (CheckpointNames{} but for gemma3).
const CheckpointNames& checkpoint_names(const DecoderConfig& config);

// The Hugging Face names of a MoE layer's pieces: "<layer>.<block>.gate.weight"
// (the router) and "<layer>.<block>.experts.N.<gate|up|down>.weight"; with a
// shared expert "<layer>.<block>.shared_expert.{gate,up,down}_proj.weight" and
// "<layer>.<block>.shared_expert_gate.weight".
struct MoeNames {
  const char* block;
  const char* gate;
  const char* up;
  const char* down;
  const char* shared = "shared_expert";  // DeepSeek: "shared_experts"
  const char* router = "gate";           // gpt-oss: "router"
};
MoeNames moe_names(const DecoderConfig& config);

// The families strata fine-tunes, for messages and --help.
const char* supported_model_types();

DecoderConfig parse_decoder_config(const nlohmann::json& json,
                               const std::string& source = "config.json");
DecoderConfig load_decoder_config(const std::string& path);
void save_decoder_config(const DecoderConfig& config, const std::string& path);

}  // namespace strata::nn
