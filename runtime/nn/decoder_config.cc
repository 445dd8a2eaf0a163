// The decoder configuration's own rules: consistency, the tensor list and
// parameter count, writing config.json back, and the file entry points.
// Parsing, with every family's key policy, is in config_families.cc.
#include "runtime/nn/decoder_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>

#include "core/error.h"
#include "runtime/config/json_text.h"
#include "runtime/nn/lora.h"

namespace strata::nn {

ops::AttentionMask DecoderConfig::attention_mask(int64_t layer) const {
  const bool windowed =
      sliding_window > 0 && (sliding_layers.empty() ||
                             (layer >= 0 && static_cast<size_t>(layer) < sliding_layers.size() &&
                              sliding_layers[static_cast<size_t>(layer)]));
  ops::AttentionMask mask{windowed ? sliding_window : 0};
  if (attention == AttentionKind::kMla) mask.scale = attention_scale();
  if (query_pre_attn_scalar > 0) mask.scale = static_cast<float>(1.0 / std::sqrt(query_pre_attn_scalar));
  mask.softcap = static_cast<float>(attn_logit_softcapping);
  return mask;
}

ops::MoeRouter DecoderConfig::router() const {
  ops::MoeRouter r;
  r.renormalize = norm_topk_prob;
  if (sigmoid_router) {
    r.scores = ops::MoeScores::kSigmoid;
    r.groups = n_group;
    r.topk_groups = topk_group;
    r.scaling = static_cast<float>(routed_scaling_factor);
  }
  return r;
}

double DecoderConfig::attention_scale() const {
  double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  // transformers' yarn_apply_mscale (DeepseekV3Attention): a rope_type other
  // than default with a nonzero mscale_all_dim (only yarn takes that key here).
  if (attention == AttentionKind::kMla && rope.type == ops::RopeType::kYarn && rope.mscale_all_dim != 0) {
    const double m = ops::yarn_mscale(rope.factor, rope.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

const ops::Rope& DecoderConfig::rope_of(int64_t layer) const {
  return sliding_rope.has_value() && attention_mask(layer).window > 0 ? *sliding_rope : rope;
}

void DecoderConfig::validate() const {
  auto positive = [](const char* key, int64_t v) {
    STRATA_CHECK(v > 0, kBadArgument, "key '{}' must be positive, got {}", key, v);
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("head_dim", head_dim);
  positive("max_position_embeddings", max_position_embeddings);
  STRATA_CHECK(
      num_attention_heads % num_key_value_heads == 0, kBadArgument,
      "key 'num_attention_heads' ({}) must be a multiple of 'num_key_value_heads' ({})",
      num_attention_heads, num_key_value_heads);
  STRATA_CHECK(head_dim % 2 == 0, kBadArgument, "key 'head_dim' ({}) must be even for rotary embedding",
                       head_dim);
  STRATA_CHECK(rms_norm_eps > 0, kBadArgument, "key 'rms_norm_eps' must be positive, got {}",
                       rms_norm_eps);
  STRATA_CHECK(rope.theta > 0, kBadArgument, "key 'rope_theta' must be positive, got {}", rope.theta);
  if (rope.type != ops::RopeType::kDefault) {
    STRATA_CHECK(rope.factor >= 1, kBadArgument, "RoPE key 'factor' must be at least 1, got {}",
                         rope.factor);
  }
  if (rope.type == ops::RopeType::kYarn) {
    STRATA_CHECK(rope.original_max_position_embeddings > 0, kBadArgument,
                 "yarn RoPE key 'original_max_position_embeddings' must be positive, got {}",
                 rope.original_max_position_embeddings);
    STRATA_CHECK(rope.attention_factor >= 0, kBadArgument, "yarn RoPE key 'attention_factor' must be positive, got {}",
                 rope.attention_factor);
  }
  if (rope.type == ops::RopeType::kLlama3) {
    STRATA_CHECK(rope.low_freq_factor > 0 && rope.high_freq_factor > rope.low_freq_factor, kBadArgument,
                         "llama3 RoPE needs 0 < low_freq_factor < high_freq_factor, got {} and {}",
                         rope.low_freq_factor, rope.high_freq_factor);
    STRATA_CHECK(
        rope.original_max_position_embeddings > 0, kBadArgument,
        "llama3 RoPE key 'original_max_position_embeddings' must be positive, got {}",
        rope.original_max_position_embeddings);
  }
  STRATA_CHECK(sliding_window >= 0, kBadArgument, "key 'sliding_window' must be positive, got {}",
                       sliding_window);
  STRATA_CHECK(
      sliding_layers.empty() || static_cast<int64_t>(sliding_layers.size()) == num_hidden_layers, kBadArgument,
      "key 'layer_types' has {} entries for {} layers (num_hidden_layers)", sliding_layers.size(),
      num_hidden_layers);
  STRATA_CHECK(pad_token_id >= -1 && pad_token_id < vocab_size, kBadArgument,
                       "key 'pad_token_id' ({}) must be a token of the vocabulary [0, {}) or null",
                       pad_token_id, vocab_size);
  // The family's fixed shape (what transformers' modeling code for it builds).
  const bool llama = model_type == "llama", mistral = model_type == "mistral",
             qwen2 = model_type == "qwen2", qwen3 = model_type == "qwen3",
             mixtral = model_type == "mixtral", qwen3_moe = model_type == "qwen3_moe",
             qwen2_moe = model_type == "qwen2_moe", gemma3 = model_type == "gemma3_text",
             deepseek = model_type == "deepseek_v3" || model_type == "kimi_k2", glm = model_type == "glm4_moe",
             oss = gpt_oss();
  STRATA_CHECK((attention == AttentionKind::kMla) == deepseek, kBadArgument,
               "model_type {} {} multi-head latent attention", model_type, deepseek ? "has" : "has no");
  STRATA_CHECK(sigmoid_router == (deepseek || glm) && (first_k_dense_replace == 0 || deepseek || glm), kBadArgument,
               "model_type {} {} the sigmoid router with dense first layers", model_type,
               deepseek || glm ? "has" : "has no");
  STRATA_CHECK((rope.rotary_dim == 0 && rope.rotary_offset == 0 && !rope.interleaved) || deepseek || glm,
               kBadArgument, "model_type {} rotates the whole head", model_type);
  if (glm) {
    STRATA_CHECK(!attention_o_bias, kBadArgument, "model_type glm4_moe has no o_proj bias");
    STRATA_CHECK(rope.rotary_offset == 0 && !rope.interleaved && rope.rotary_dim > 0 && rope.rotary_dim <= head_dim &&
                     rope.rotary_dim % 2 == 0,
                 kBadArgument, "model_type glm4_moe rotates an even part of the head from its start (got {} of {})",
                 rope.rotary_dim, head_dim);
  }
  if (deepseek || glm) {
    STRATA_CHECK(n_group >= 1 && topk_group >= 1 && topk_group <= n_group && num_experts % n_group == 0,
                 kBadArgument,
                 "keys 'n_group' ({}) and 'topk_group' ({}): 1 <= topk_group <= n_group, and n_group divides the "
                 "{} experts",
                 n_group, topk_group, num_experts);
    STRATA_CHECK(topk_group * (num_experts / n_group) >= num_experts_per_tok, kBadArgument,
                 "keys 'topk_group' ({}) groups of {} experts hold fewer than num_experts_per_tok ({})", topk_group,
                 num_experts / n_group, num_experts_per_tok);
    STRATA_CHECK(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0, kBadArgument,
                 "key 'routed_scaling_factor' must be positive, got {}", routed_scaling_factor);
    STRATA_CHECK(first_k_dense_replace >= 0, kBadArgument, "key 'first_k_dense_replace' must be >= 0, got {}",
                 first_k_dense_replace);
    STRATA_CHECK(mtp_layers >= 0, kBadArgument, "key 'num_nextn_predict_layers' must be >= 0, got {}", mtp_layers);
  }
  if (deepseek) {
    positive("kv_lora_rank", kv_lora_rank);
    positive("qk_nope_head_dim", qk_nope_head_dim);
    positive("qk_rope_head_dim", qk_rope_head_dim);
    positive("v_head_dim", v_head_dim);
    STRATA_CHECK(q_lora_rank >= 0, kBadArgument, "key 'q_lora_rank' must be positive or null, got {}", q_lora_rank);
    STRATA_CHECK(head_dim == qk_nope_head_dim + qk_rope_head_dim, kBadArgument,
                 "the q/k head ({}) must be qk_nope_head_dim + qk_rope_head_dim ({} + {})", head_dim,
                 qk_nope_head_dim, qk_rope_head_dim);
    STRATA_CHECK(v_head_dim <= head_dim, kBadArgument,
                 "key 'v_head_dim' ({}) wider than the q/k head ({}) is not implemented", v_head_dim, head_dim);
    STRATA_CHECK(qk_rope_head_dim % 2 == 0, kBadArgument, "key 'qk_rope_head_dim' ({}) must be even", qk_rope_head_dim);
    STRATA_CHECK(num_key_value_heads == num_attention_heads, kBadArgument,
                 "multi-head latent attention expands the latent into every head: num_key_value_heads ({}) must "
                 "equal num_attention_heads ({})",
                 num_key_value_heads, num_attention_heads);
  }
  STRATA_CHECK(llama || mistral || qwen2 || qwen3 || mixtral || qwen3_moe || qwen2_moe || deepseek || glm || gemma() ||
                   oss,
               kBadArgument,
                       "model_type \"{}\" is not supported; supported: {}",
                       printable_excerpt(model_type, 80), supported_model_types());
  STRATA_CHECK(!(llama || qwen3 || qwen3_moe || deepseek || gemma() || oss) || attention_qkv_bias == attention_o_bias,
               kBadArgument,
                       "model_type {}: attention_bias gives q/k/v and o_proj biases together",
                       model_type);
  STRATA_CHECK(!(mistral || mixtral) || (!attention_qkv_bias && !attention_o_bias), kBadArgument,
                       "model_type {} has no attention biases", model_type);
  STRATA_CHECK(!qwen2 || (attention_qkv_bias && !attention_o_bias), kBadArgument,
                       "model_type qwen2 has q/k/v biases and no o_proj bias");
  STRATA_CHECK(!qwen2_moe || !attention_o_bias, kBadArgument,
               "model_type qwen2_moe has no o_proj bias (qkv_bias switches the q/k/v biases)");
  STRATA_CHECK(!mlp_bias || llama, kBadArgument, "model_type {} has no MLP biases (mlp_bias is llama's)",
                       model_type);
  STRATA_CHECK(qk_norm == (qwen3 || qwen3_moe || gemma3) || glm, kBadArgument, "model_type {} {} per-head q/k norms",
                       model_type, qwen3 || qwen3_moe || gemma3 ? "has" : "has no");
  // Gemma's pieces come together, and only with Gemma.
  const bool gemma_pieces = hidden_act == ops::GluActivation::kGeluTanh && norm_weight_offset == 1 &&
                            scale_embedding && sandwich_norms;
  const bool llama_pieces = hidden_act == ops::GluActivation::kSilu && norm_weight_offset == 0 && !scale_embedding &&
                            !sandwich_norms && query_pre_attn_scalar == 0 && attn_logit_softcapping == 0 &&
                            final_logit_softcapping == 0 && !sliding_rope.has_value();
  STRATA_CHECK(gemma() ? gemma_pieces : llama_pieces, kBadArgument,
               "model_type {} {} GeGLU, (1 + w) norms, a scaled embedding and sandwich norms", model_type,
               gemma() ? "needs" : "has no");
  STRATA_CHECK(query_pre_attn_scalar >= 0 && attn_logit_softcapping >= 0 && final_logit_softcapping >= 0,
               kBadArgument,
               "keys 'query_pre_attn_scalar' ({}), 'attn_logit_softcapping' ({}) and 'final_logit_softcapping' ({}) "
               "must be positive (or null: none)",
               query_pre_attn_scalar, attn_logit_softcapping, final_logit_softcapping);
  STRATA_CHECK(!sliding_rope.has_value() || sliding_rope->theta > 0, kBadArgument,
               "the sliding layers' rope_theta must be positive, got {}", sliding_rope ? sliding_rope->theta : 0.0);
  STRATA_CHECK(moe() == (mixtral || qwen3_moe || qwen2_moe || deepseek || glm || oss), kBadArgument,
               "model_type {} {} a mixture of experts (num_experts {})", model_type,
               mixtral || qwen3_moe || qwen2_moe || deepseek || glm || oss ? "is" : "is not", num_experts);
  // gpt-oss's pieces come together, and only with gpt-oss.
  const bool oss_pieces = attention_sinks && router_bias && stacked_experts &&
                          expert_act == ops::GluActivation::kClampedSwiglu && norm_topk_prob;
  const bool no_oss_pieces = !attention_sinks && !router_bias && !stacked_experts &&
                             expert_act == ops::GluActivation::kSilu;
  STRATA_CHECK(oss ? oss_pieces : no_oss_pieces, kBadArgument,
               "model_type {} {} attention sinks, a router bias and stacked experts with the clamped SwiGLU "
               "(softmax over the top k)",
               model_type, oss ? "needs" : "has no");
  if (oss) {
    STRATA_CHECK(std::isfinite(glu_clamp.alpha) && std::isfinite(glu_clamp.limit) && glu_clamp.limit > 0,
                 kBadArgument, "keys 'swiglu_alpha' ({}) and 'swiglu_limit' ({}) must be finite, the limit positive",
                 glu_clamp.alpha, glu_clamp.limit);
  }
  STRATA_CHECK((shared_expert() == qwen2_moe || deepseek || glm) && shared_expert_intermediate_size >= 0, kBadArgument,
               "model_type {} {} a shared expert (shared_expert_intermediate_size {})", model_type,
               qwen2_moe ? "has" : "has no", shared_expert_intermediate_size);
  if (moe()) {
    STRATA_CHECK(num_experts_per_tok >= 1 && num_experts_per_tok <= num_experts, kBadArgument,
                 "key 'num_experts_per_tok' ({}) must be between 1 and the number of experts ({})",
                 num_experts_per_tok, num_experts);
    positive("moe_intermediate_size", moe_intermediate_size);
    STRATA_CHECK(!mixtral || norm_topk_prob, kBadArgument,
                 "model_type mixtral always renormalises the top-k probabilities");
    STRATA_CHECK(std::isfinite(router_aux_loss_coef), kBadArgument,
                 "key 'router_aux_loss_coef' must be finite, got {}", router_aux_loss_coef);
  }
  STRATA_CHECK(sliding_window == 0 || !(llama || qwen3_moe), kBadArgument,
               "model_type {} has no sliding window here", model_type);
  STRATA_CHECK(
      sliding_layers.empty() || qwen2 || qwen3 || qwen2_moe || gemma() || oss, kBadArgument,
      "model_type {} applies a sliding window to every layer or none (no layer_types)", model_type);
  // parameter_count() and the model's shapes multiply these in int64; every
  // such product is at most the parameter count (or the RoPE table), so
  // bounding those two, estimated in double, keeps all of them exact.
  // Every operand is a double before the first product: int64 arithmetic
  // here could overflow on exactly the sizes this check exists to refuse.
  const double mla = attention == AttentionKind::kMla
                         ? static_cast<double>(hidden_size) * static_cast<double>(q_lora_rank + kv_lora_rank) +
                               static_cast<double>(num_attention_heads) *
                                   static_cast<double>(head_dim + v_head_dim) *
                                   static_cast<double>(q_lora_rank + kv_lora_rank + hidden_size)
                         : 0.0;
  const double h = static_cast<double>(hidden_size), d = static_cast<double>(head_dim),
               q = static_cast<double>(num_attention_heads) * d,
               kv = static_cast<double>(num_key_value_heads) * d,
               ff = moe() ? static_cast<double>(num_experts) * static_cast<double>(moe_intermediate_size)
                          : static_cast<double>(intermediate_size);
  const double router = moe() ? static_cast<double>(num_experts) * h : 0.0;
  // The shared expert's three projections and its gate.
  const double shared = shared_expert() ? 3 * h * static_cast<double>(shared_expert_intermediate_size) + h : 0.0;
  const double layer =
      2 * h * q + 2 * h * kv + 3 * h * ff + 2 * ff + q + 2 * kv + 6 * h + 2 * d + router + shared + mla +
      3 * h * static_cast<double>(intermediate_size);
  const double parameters =
      static_cast<double>(vocab_size) * h * 2 + static_cast<double>(num_hidden_layers) * layer + h;
  constexpr double kMaxCount = 0x1p62;
  STRATA_CHECK(
      parameters < kMaxCount, kBadArgument,
      "the sizes give about {:.3g} parameters, beyond what strata counts (2^62): check vocab_size, "
      "hidden_size, intermediate_size, num_hidden_layers and the head counts",
      parameters);
  STRATA_CHECK(
      static_cast<double>(max_position_embeddings) * d < kMaxCount, kBadArgument,
      "key 'max_position_embeddings' ({}) x head_dim ({}) is beyond 2^62", max_position_embeddings,
      head_dim);
}

std::vector<HfTensor> hf_tensors(const DecoderConfig& c) {
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim, inter = c.intermediate_size;
  std::vector<HfTensor> out;
  auto add = [&](std::string name, Shape shape) {
    out.push_back({std::move(name), std::move(shape)});
  };
  // The order of DecoderModel's declarations (decoder_model.cc, attention.cc).
  add("model.embed_tokens.weight", {c.vocab_size, h});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    add(p + "input_layernorm.weight", {h});
    auto linear = [&](const std::string& name, int64_t in, int64_t out_features, bool bias) {
      add(p + name + ".weight", {out_features, in});
      if (bias) add(p + name + ".bias", {out_features});
    };
    if (c.attention == AttentionKind::kMla) {
      // MlaAttention's order: q (low-rank or whole), the kv latent and rope key, kv_b, o.
      const int64_t heads = c.num_attention_heads;
      if (c.q_lora_rank > 0) {
        linear("self_attn.q_a_proj", h, c.q_lora_rank, c.attention_qkv_bias);
        add(p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank});
        linear("self_attn.q_b_proj", c.q_lora_rank, q, false);
      } else {
        linear("self_attn.q_proj", h, q, false);
      }
      linear("self_attn.kv_a_proj_with_mqa", h, c.kv_lora_rank + c.qk_rope_head_dim, c.attention_qkv_bias);
      add(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank});
      linear("self_attn.kv_b_proj", c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim), false);
      linear("self_attn.o_proj", heads * c.v_head_dim, h, c.attention_o_bias);
    } else {
      // gpt-oss's sinks: GqaAttention's own parameter, so before its projections.
      if (c.attention_sinks) add(p + "self_attn.sinks", {c.num_attention_heads});
      linear("self_attn.q_proj", h, q, c.attention_qkv_bias);
      linear("self_attn.k_proj", h, kv, c.attention_qkv_bias);
      linear("self_attn.v_proj", h, kv, c.attention_qkv_bias);
      linear("self_attn.o_proj", q, h, c.attention_o_bias);
    }
    if (c.qk_norm) {
      add(p + "self_attn.q_norm.weight", {c.head_dim});
      add(p + "self_attn.k_norm.weight", {c.head_dim});
    }
    add(p + "post_attention_layernorm.weight", {h});
    if (c.sandwich_norms) {
      // Gemma: post_attention_layernorm normalises the attention's output;
      // the MLP's input norm and output norm follow (DecoderLayer's order).
      add(p + "pre_feedforward_layernorm.weight", {h});
      linear("mlp.gate_proj", h, inter, c.mlp_bias);
      linear("mlp.up_proj", h, inter, c.mlp_bias);
      linear("mlp.down_proj", inter, h, c.mlp_bias);
      add(p + "post_feedforward_layernorm.weight", {h});
      continue;
    }
    if (c.layer_moe(l)) {
      // The router, then each expert's gate, up and down projections (MoeMlp's order).
      const MoeNames n = moe_names(c);
      // The sigmoid router's correction bias (a buffer: fp32, never trained; MoeMlp's own, so first).
      if (c.sigmoid_router) add(p + n.block + ".gate.e_score_correction_bias", {c.num_experts});
      linear(fmt::format("{}.{}", n.block, n.router), h, c.num_experts, c.router_bias);
      if (c.stacked_experts) {
        // gpt-oss: every expert's projections stacked, x W ([E, in, out]), with biases.
        const int64_t i = c.moe_intermediate_size, e = c.num_experts;
        const std::string x = p + n.block + ".experts.";
        add(x + "gate_up_proj", {e, h, 2 * i});
        add(x + "gate_up_proj_bias", {e, 2 * i});
        add(x + "down_proj", {e, i, h});
        add(x + "down_proj_bias", {e, h});
        continue;
      }
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string x = fmt::format("{}{}.experts.{}.", p, n.block, e);
        add(x + n.gate + ".weight", {c.moe_intermediate_size, h});
        add(x + n.up + ".weight", {c.moe_intermediate_size, h});
        add(x + n.down + ".weight", {h, c.moe_intermediate_size});
      }
      if (c.shared_expert()) {
        // qwen2_moe: the shared expert (a plain MLP), then its gate (Qwen2MoeSparseMoeBlock's order).
        const int64_t s = c.shared_expert_intermediate_size;
        const std::string x = p + n.block + "." + n.shared + ".";
        add(x + "gate_proj.weight", {s, h});
        add(x + "up_proj.weight", {s, h});
        add(x + "down_proj.weight", {h, s});
        if (c.shared_expert_gated()) add(p + n.block + ".shared_expert_gate.weight", {1, h});
      }
      continue;
    }
    linear("mlp.gate_proj", h, inter, c.mlp_bias);
    linear("mlp.up_proj", h, inter, c.mlp_bias);
    linear("mlp.down_proj", inter, h, c.mlp_bias);
  }
  add("model.norm.weight", {h});
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, h});
  return out;
}

MoeNames moe_names(const DecoderConfig& c) {
  if (c.model_type == "mixtral") return {"block_sparse_moe", "w1", "w3", "w2"};
  if (c.stacked_experts) return {"mlp", "gate_up_proj", "gate_up_proj", "down_proj", "shared_expert", "router"};
  if (c.sigmoid_router) return {"mlp", "gate_proj", "up_proj", "down_proj", "shared_experts"};
  return {"mlp", "gate_proj", "up_proj", "down_proj"};
}

bool is_buffer_tensor(const std::string& name) { return name.ends_with(".e_score_correction_bias"); }

bool is_mtp_tensor(const DecoderConfig& config, const std::string& name) {
  for (int64_t i = 0; i < config.mtp_layers; ++i) {
    if (name.starts_with(fmt::format("model.layers.{}.", config.num_hidden_layers + i))) return true;
  }
  return false;
}

std::string CheckpointNames::file_name(const std::string& name) const {
  if (name == "lm_head.weight") return head;
  if (name.starts_with("model.")) return text_prefix + name.substr(6);
  return name;
}

std::optional<std::string> CheckpointNames::model_name(const std::string& name) const {
  if (name == head) return std::string("lm_head.weight");
  if (name.starts_with(text_prefix)) return "model." + name.substr(text_prefix.size());
  return std::nullopt;
}

std::string CheckpointNames::adapter_name(const std::string& name) const {
  const std::string module = !peft_prefix.empty() && name.starts_with("model.") ? peft_prefix + name.substr(6) : name;
  return std::string(kPeftPrefix) + module;
}

bool is_vision_tensor(const std::string& name) {
  const std::string_view n = std::string_view(name).starts_with("model.") ? std::string_view(name).substr(6) : name;
  return n.starts_with("vision_tower.") || n.starts_with("multi_modal_projector.");
}

bool is_carried_tensor(const DecoderConfig& config, const std::string& name) {
  return is_mtp_tensor(config, name) || (config.multimodal && is_vision_tensor(name));
}

const CheckpointNames& checkpoint_names(const DecoderConfig& config) {
  static const CheckpointNames kOwn;
  return config.multimodal ? config.multimodal->names : kOwn;
}

DType export_dtype(const DecoderConfig& config, const std::string& name, DType dtype) {
  // DeepseekV3's and Glm4Moe's _keep_in_fp32_modules_strict: "e_score_correction_bias", "gate.weight".
  const bool router = config.sigmoid_router && (is_buffer_tensor(name) || name.ends_with(".mlp.gate.weight"));
  return router ? DType::kF32 : dtype;
}

int64_t DecoderConfig::parameter_count() const {
  int64_t n = 0;
  for (const HfTensor& t : hf_tensors(*this)) {
    if (!is_buffer_tensor(t.name)) n += shape_numel(t.shape);
  }
  return n;
}

int64_t DecoderConfig::active_parameter_count() const {
  if (!moe()) return parameter_count();
  // The routed experts' tensors (one expert's each, or gpt-oss's E stacked in
  // dimension 0): E equal shares, of which a token uses num_experts_per_tok.
  int64_t experts_numel = 0;
  for (const HfTensor& t : hf_tensors(*this)) {
    if (t.name.find(".experts.") != std::string::npos) experts_numel += shape_numel(t.shape);
  }
  const int64_t idle = experts_numel / num_experts * (num_experts - num_experts_per_tok);
  return parameter_count() - idle;
}

int64_t DecoderConfig::input_embedding_count() const {
  return tie_word_embeddings ? 0 : vocab_size * hidden_size;
}

namespace {

const char* architecture_of(const std::string& model_type) {
  if (model_type == "mistral") return "MistralForCausalLM";
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  if (model_type == "qwen3") return "Qwen3ForCausalLM";
  if (model_type == "mixtral") return "MixtralForCausalLM";
  if (model_type == "qwen3_moe") return "Qwen3MoeForCausalLM";
  if (model_type == "qwen2_moe") return "Qwen2MoeForCausalLM";
  if (model_type == "deepseek_v3" || model_type == "kimi_k2") return "DeepseekV3ForCausalLM";
  if (model_type == "glm4_moe") return "Glm4MoeForCausalLM";
  if (model_type == "gemma2") return "Gemma2ForCausalLM";
  if (model_type == "gemma3_text") return "Gemma3ForCausalLM";
  if (model_type == "gpt_oss") return "GptOssForCausalLM";
  return "LlamaForCausalLM";
}

// rope_parameters / rope_scaling as transformers reads it.
nlohmann::json rope_json(const ops::Rope& r, bool with_theta) {
  nlohmann::json j = nlohmann::json::object();
  j["rope_type"] = r.type == ops::RopeType::kLlama3   ? "llama3"
                   : r.type == ops::RopeType::kLinear ? "linear"
                   : r.type == ops::RopeType::kYarn   ? "yarn"
                                                      : "default";
  if (with_theta) j["rope_theta"] = r.theta;
  if (r.type != ops::RopeType::kDefault) j["factor"] = r.factor;
  if (r.type == ops::RopeType::kLlama3) {
    j["low_freq_factor"] = r.low_freq_factor;
    j["high_freq_factor"] = r.high_freq_factor;
    j["original_max_position_embeddings"] =
        static_cast<int64_t>(r.original_max_position_embeddings);
  }
  if (r.type == ops::RopeType::kYarn) {
    // What the source gave, in transformers' terms (0: not given).
    j["original_max_position_embeddings"] = static_cast<int64_t>(r.original_max_position_embeddings);
    if (r.beta_fast != 0) j["beta_fast"] = r.beta_fast;
    if (r.beta_slow != 0) j["beta_slow"] = r.beta_slow;
    if (r.mscale != 0) j["mscale"] = r.mscale;
    if (r.mscale_all_dim != 0) j["mscale_all_dim"] = r.mscale_all_dim;
    if (r.attention_factor > 0) j["attention_factor"] = r.attention_factor;
    if (!r.truncate) j["truncate"] = false;
  }
  return j;
}

}  // namespace

int64_t DecoderConfig::checkpoint_parameter_count() const {
  return parameter_count() + (multimodal ? multimodal->vision_parameters : 0);
}

nlohmann::json DecoderConfig::to_json() const {
  if (multimodal) {
    // The gemma3 config.json with the text model as its text_config (the
    // tie is the top level's; the text_config keeps its own key as it was).
    DecoderConfig text = *this;
    text.multimodal.reset();
    nlohmann::json t = text.to_json();
    if (!source.contains("architectures")) t.erase("architectures");
    if (!source.contains("tie_word_embeddings")) t.erase("tie_word_embeddings");
    if (source.contains("tie_word_embeddings")) t["tie_word_embeddings"] = source["tie_word_embeddings"];
    nlohmann::json j = multimodal->config;
    j["text_config"] = std::move(t);
    return j;
  }
  nlohmann::json j = source.is_object() ? source : nlohmann::json::object();
  j["model_type"] = model_type;
  if (!j.contains("architectures")) j["architectures"] = {architecture_of(model_type)};
  if (gemma()) {
    j["hidden_activation"] = "gelu_pytorch_tanh";
  } else {
    j["hidden_act"] = "silu";
  }
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  // DeepseekV3Config's head_dim is the rope part (its __post_init__ sets it so).
  j["head_dim"] = attention == AttentionKind::kMla ? qk_rope_head_dim : head_dim;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  if (pad_token_id >= 0) {
    j["pad_token_id"] = pad_token_id;
  } else if (j.contains("pad_token_id")) {
    j["pad_token_id"] = nullptr;
  }
  // RoPE in the source's style: transformers 5 nests it in rope_parameters,
  // older releases read rope_theta and rope_scaling (and newer ones still do).
  if (sliding_rope.has_value()) {
    // Gemma 3: one RoPE per layer type (transformers 5's form).
    j["rope_parameters"] = {{"full_attention", rope_json(rope, true)},
                            {"sliding_attention", rope_json(*sliding_rope, true)}};
    j.erase("rope_theta");
    j.erase("rope_scaling");
    j.erase("rope_local_base_freq");
  } else if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    j["rope_parameters"] = rope_json(rope, true);
    // glm4_moe's partial rotary embedding (transformers 5 keeps it in rope_parameters).
    if (model_type == "glm4_moe") {
      j["rope_parameters"]["partial_rotary_factor"] =
          static_cast<double>(rope.rotary_dim) / static_cast<double>(head_dim);
      j.erase("partial_rotary_factor");
    }
    j.erase("rope_theta");
    j.erase("rope_scaling");
  } else {
    if (model_type == "glm4_moe") {
      j["partial_rotary_factor"] = static_cast<double>(rope.rotary_dim) / static_cast<double>(head_dim);
    }
    j["rope_theta"] = rope.theta;
    j["rope_scaling"] =
        rope.type == ops::RopeType::kDefault ? nlohmann::json(nullptr) : rope_json(rope, false);
  }
  if (gemma() || gpt_oss()) {
    j["sliding_window"] = sliding_window > 0 ? nlohmann::json(sliding_window) : nlohmann::json(nullptr);
    nlohmann::json types = nlohmann::json::array();
    for (int64_t l = 0; l < num_hidden_layers; ++l) {
      types.push_back(!sliding_layers.empty() && sliding_layers[static_cast<size_t>(l)] ? "sliding_attention"
                                                                                         : "full_attention");
    }
    j["layer_types"] = types;  // wins over sliding_window_pattern in transformers
  }
  if (gpt_oss()) {
    j["attention_bias"] = attention_qkv_bias;
    // The shortest decimal that reads back as the kernels' float (0.8, not 0.800000011920929).
    const auto decimal = [](float v) { return std::stod(fmt::format("{}", v)); };
    j["swiglu_limit"] = decimal(glu_clamp.limit);
    // GptOssConfig's own key since transformers 5 (older releases fix alpha at 1.702).
    if (j.contains("swiglu_alpha") || glu_clamp.alpha != 1.702f) j["swiglu_alpha"] = decimal(glu_clamp.alpha);
  }
  if (gemma()) {
    j["attention_bias"] = attention_qkv_bias;
    // An int in transformers' Gemma configs (a float there is refused by its strict config class).
    const double qpas = query_pre_attn_scalar;
    j["query_pre_attn_scalar"] =
        qpas == std::floor(qpas) ? nlohmann::json(static_cast<int64_t>(qpas)) : nlohmann::json(qpas);
    if (model_type == "gemma2") {
      j["attn_logit_softcapping"] = attn_logit_softcapping > 0 ? nlohmann::json(attn_logit_softcapping) : nlohmann::json(nullptr);
    }
    j["final_logit_softcapping"] =
        final_logit_softcapping > 0 ? nlohmann::json(final_logit_softcapping) : nlohmann::json(nullptr);
  }
  if (model_type == "llama") {
    j["attention_bias"] = attention_qkv_bias;
    j["mlp_bias"] = mlp_bias;
  } else if (model_type == "qwen3" || model_type == "qwen3_moe") {
    j["attention_bias"] = attention_qkv_bias;
  }
  if (model_type == "qwen2_moe") j["qkv_bias"] = attention_qkv_bias;
  if (sigmoid_router) {
    // DeepseekV3Config's and Glm4MoeConfig's names (n_routed_experts is the expert count).
    j["attention_bias"] = attention_qkv_bias;
    if (attention == AttentionKind::kMla) {
      j["q_lora_rank"] = q_lora_rank > 0 ? nlohmann::json(q_lora_rank) : nlohmann::json(nullptr);
      j["kv_lora_rank"] = kv_lora_rank;
      j["qk_nope_head_dim"] = qk_nope_head_dim;
      j["qk_rope_head_dim"] = qk_rope_head_dim;
      j["v_head_dim"] = v_head_dim;
      j["rope_interleave"] = rope_interleave;
    } else {
      j["use_qk_norm"] = qk_norm;
    }
    j["n_routed_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["n_shared_experts"] = moe_intermediate_size > 0 ? shared_expert_intermediate_size / moe_intermediate_size : 0;
    j["n_group"] = n_group;
    j["topk_group"] = topk_group;
    j["routed_scaling_factor"] = routed_scaling_factor;
    j["norm_topk_prob"] = norm_topk_prob;
    j["first_k_dense_replace"] = first_k_dense_replace;
  } else if (moe()) {
    // The expert count under the source's key (save_pretrained writes
    // num_local_experts for mixtral and qwen3_moe; Qwen2MoeConfig knows num_experts only).
    const bool plain = j.contains("num_experts") || model_type == "qwen2_moe";
    j[plain ? "num_experts" : "num_local_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
    j["output_router_logits"] = output_router_logits;
    if (model_type == "qwen3_moe" || model_type == "qwen2_moe") {
      j["moe_intermediate_size"] = moe_intermediate_size;
      j["norm_topk_prob"] = norm_topk_prob;
    }
    if (model_type == "qwen3_moe") j["use_sliding_window"] = false;
    if (shared_expert()) j["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
  }
  if (model_type == "mistral" || model_type == "mixtral") {
    j["sliding_window"] =
        sliding_window > 0 ? nlohmann::json(sliding_window) : nlohmann::json(nullptr);
  } else if (model_type == "qwen2" || model_type == "qwen3" || model_type == "qwen2_moe") {
    j["use_sliding_window"] = sliding_window > 0;
    if (sliding_window > 0) j["sliding_window"] = sliding_window;
    // layer_types wins over max_window_layers in transformers; written when
    // there is a window or the source had it.
    if (sliding_window > 0 || j.contains("layer_types")) {
      nlohmann::json types = nlohmann::json::array();
      for (int64_t l = 0; l < num_hidden_layers; ++l) {
        types.push_back(attention_mask(l).window > 0 ? "sliding_attention" : "full_attention");
      }
      j["layer_types"] = types;
    }
  }
  return j;
}

nlohmann::json DecoderConfig::to_hf_json(DType dtype) const {
  nlohmann::json j = to_json();
  const char* name = dtype == DType::kF32   ? "float32"
                     : dtype == DType::kF16 ? "float16"
                                            : "bfloat16";
  j["torch_dtype"] = name;
  if (j.contains("dtype")) j["dtype"] = name;  // transformers 5's name for it
  if (multimodal) {
    // A text_config that names a dtype names the export's too.
    for (const char* key : {"torch_dtype", "dtype"}) {
      if (j["text_config"].contains(key)) j["text_config"][key] = name;
    }
  }
  j.erase("quantization_config");             // the weights are written dequantized
  return j;
}

const char* supported_model_types() {
  return "llama (Llama 2, Llama 3 and 3.1-3.3 with rope_type llama3, SmolLM, TinyLlama), mistral "
         "(Mistral 7B, "
         "with or without a sliding window), qwen2 (Qwen2, Qwen2.5), qwen3 (dense Qwen3), mixtral "
         "(Mixtral 8x7B, 8x22B), qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B) and qwen2_moe "
         "(Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), deepseek_v3 (DeepSeek-V3, R1), kimi_k2 (Kimi K2), glm4_moe (GLM-4.5, "
         "GLM-4.5-Air), gemma2 (Gemma 2), gemma3_text (Gemma 3 1B), gemma3 (the text model of Gemma 3 "
         "4B-27B as published, Gemma3ForConditionalGeneration: the vision tower is carried untrained) and "
         "gpt_oss (gpt-oss-20b, gpt-oss-120b in bf16 or fp32; not their MXFP4 checkpoints)";
}

DecoderConfig load_decoder_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) raise_errno(errno, "open model config " + path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    // The message quotes the input (a 1 MB token, raw bytes): bound and escape it.
    raise(ErrorCategory::kBadArgument, "{}: not valid JSON: {}", path,
          printable_excerpt(e.what(), 240));
  }
  return parse_decoder_config(j, path);
}

void save_decoder_config(const DecoderConfig& config, const std::string& path) {
  std::ofstream out(path);
  if (!out) raise_errno(errno, "create model config " + path);
  out << config.to_json().dump(2) << "\n";
  out.close();
  STRATA_CHECK(out.good(), kIo, "writing model config {} failed", path);
}

DecoderConfig tensor_parallel_share(const DecoderConfig& c, int tp) {
  STRATA_CHECK(tp >= 1, kBadArgument, "tensor parallelism must be at least 1, got {}", tp);
  if (tp == 1) return c;
  STRATA_CHECK(c.attention != AttentionKind::kMla, kBadArgument,
               "model_type {}: tensor parallelism is not implemented for multi-head latent attention yet", c.model_type);
  STRATA_CHECK(!c.moe(), kBadArgument,
               "model_type {}: tensor parallelism is not implemented for mixture-of-experts layers yet (use "
               "expert parallelism: moe.expert_parallel_size)",
               c.model_type);
  STRATA_CHECK(c.num_attention_heads % tp == 0, kBadArgument,
               "tensor parallelism {} does not divide num_attention_heads {}", tp, c.num_attention_heads);
  // Fewer kv heads than ranks: each kv head on the tp / KV ranks whose q heads use it.
  STRATA_CHECK(c.num_key_value_heads % tp == 0 || tp % c.num_key_value_heads == 0, kBadArgument,
               "tensor parallelism {} and num_key_value_heads {}: one must divide the other (each rank holds "
               "whole kv heads, or shares one with the ranks whose query heads use it)",
               tp, c.num_key_value_heads);
  STRATA_CHECK(c.intermediate_size % tp == 0, kBadArgument,
               "tensor parallelism {} does not divide intermediate_size {}", tp, c.intermediate_size);
  // The embedding and lm_head split by vocabulary rows (Megatron pads the
  // vocabulary instead; strata would then export padded tensors, or none).
  STRATA_CHECK(c.vocab_size % tp == 0, kBadArgument,
               "tensor parallelism {} does not divide vocab_size {} (the embedding and lm_head are split by "
               "vocabulary rows)",
               tp, c.vocab_size);
  DecoderConfig share = c;
  share.num_attention_heads /= tp;
  share.num_key_value_heads = std::max<int64_t>(c.num_key_value_heads / tp, 1);
  share.intermediate_size /= tp;
  return share;
}

}  // namespace strata::nn
