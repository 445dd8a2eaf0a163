// DecoderLayer and LlamaModel, and counter-based parameter initialisation.
#include "runtime/nn/llama_model.h"

#include <cmath>
#include <numbers>

#include "kernels/nn_ops.h"
#include "runtime/core/error.h"

namespace strata::nn {

DecoderLayer::DecoderLayer(Engine& engine, std::string name, const LlamaConfig& c, DType dtype,
                           MlpTiling mlp_tiling)
    : Module(engine, std::move(name)) {
  input_layernorm_ = std::make_unique<RMSNorm>(engine, child_name("input_layernorm"), c.hidden_size,
                                               c.rms_norm_eps, dtype);
  self_attn_ = std::make_unique<Attention>(engine, child_name("self_attn"), c, dtype);
  post_attention_layernorm_ = std::make_unique<RMSNorm>(
      engine, child_name("post_attention_layernorm"), c.hidden_size, c.rms_norm_eps, dtype);
  mlp_ = std::make_unique<Mlp>(engine, child_name("mlp"), c, dtype, mlp_tiling);
  add_child(*input_layernorm_);
  add_child(*self_attn_);
  add_child(*post_attention_layernorm_);
  add_child(*mlp_);
}

Activations DecoderLayer::forward(const Activations& x, int64_t batch, int64_t seq) {
  rows_ = batch * seq;
  const auto n = static_cast<int64_t>(x.size());
  Activations h = self_attn_->forward(input_layernorm_->forward(x, rows_), batch, seq);
  cpu::add(x.data(), h.data(), n, h.data());
  Activations y = mlp_->forward(post_attention_layernorm_->forward(h, rows_), rows_);
  cpu::add(h.data(), y.data(), n, y.data());
  return y;
}

Activations DecoderLayer::backward(const Activations& dy) {
  // y = h + mlp(norm2(h)), h = x + attn(norm1(x)): the residual passes dy through.
  const auto n = static_cast<int64_t>(dy.size());
  Activations dh = post_attention_layernorm_->backward(mlp_->backward(dy));
  cpu::add(dy.data(), dh.data(), n, dh.data());
  Activations dx = input_layernorm_->backward(self_attn_->backward(dh));
  cpu::add(dh.data(), dx.data(), n, dx.data());
  return dx;
}

namespace {

// A module that only owns lm_head.weight (its kernel runs inside LlamaModel).
class LmHead : public Module {
 public:
  LmHead(Engine& engine, int64_t vocab, int64_t hidden, DType dtype) : Module(engine, "lm_head") {
    weight = &add_parameter("weight", dtype, {vocab, hidden});
  }
  Parameter* weight;
};

}  // namespace

LlamaModel::LlamaModel(Engine& engine, const LlamaConfig& config, LlamaModelOptions options)
    : Module(engine, "model"), config_(config), options_(options) {
  config_.validate();
  embed_tokens_ = std::make_unique<Embedding>(
      engine, child_name("embed_tokens"), config_.vocab_size, config_.hidden_size, options_.dtype);
  add_child(*embed_tokens_);
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    layers_.push_back(std::make_unique<DecoderLayer>(engine,
                                                     child_name("layers." + std::to_string(l)),
                                                     config_, options_.dtype, options_.mlp_tiling));
    add_child(*layers_.back());
  }
  norm_ = std::make_unique<RMSNorm>(engine, child_name("norm"), config_.hidden_size,
                                    config_.rms_norm_eps, options_.dtype);
  add_child(*norm_);
  if (config_.tie_word_embeddings) {
    lm_head_param_ = &embed_tokens_->weight();
  } else {
    auto head =
        std::make_unique<LmHead>(engine, config_.vocab_size, config_.hidden_size, options_.dtype);
    lm_head_param_ = head->weight;
    lm_head_ = std::move(head);
    add_child(*lm_head_);
  }
}

double LlamaModel::forward(const std::vector<int32_t>& ids, const std::vector<int32_t>& targets,
                           int64_t batch, int64_t seq) {
  const int64_t rows = batch * seq;
  STRATA_CHECK(batch > 0 && seq > 0 && seq <= config_.max_position_embeddings, kBadArgument,
               "model: batch {} x seq {} invalid (max_position_embeddings {})", batch, seq,
               config_.max_position_embeddings);
  check_numel(name_, "ids", ids.size(), static_cast<size_t>(rows));
  check_numel(name_, "targets", targets.size(), static_cast<size_t>(rows));
  batch_ = batch;
  seq_ = seq;
  targets_ = targets;
  counted_ = cpu::count_targets(targets.data(), rows);
  STRATA_CHECK(counted_ > 0, kBadArgument, "model: every target is ignored ({})",
               cpu::kIgnoreIndex);

  Activations h = embed_tokens_->forward(ids);
  for (auto& layer : layers_) h = layer->forward(h, batch, seq);
  final_hidden_ = norm_->forward(h, rows);

  cpu::CrossEntropyShape s{rows, config_.hidden_size, config_.vocab_size, options_.loss_chunk_rows};
  lse_.resize(static_cast<size_t>(rows));
  Parameter* params[] = {lm_head_param_};
  engine_.pre_forward("lm_head", params);
  const double total = cpu::cross_entropy_forward(
      final_hidden_.data(), load(*lm_head_param_, scratch_), targets.data(), s, lse_.data());
  engine_.post_forward("lm_head", params);
  return total / static_cast<double>(counted_);
}

void LlamaModel::backward() {
  STRATA_CHECK(counted_ > 0, kBadArgument, "model: backward() without a forward()");
  const int64_t rows = batch_ * seq_;
  cpu::CrossEntropyShape s{rows, config_.hidden_size, config_.vocab_size, options_.loss_chunk_rows};
  Activations dh(final_hidden_.size());
  Parameter* params[] = {lm_head_param_};
  engine_.pre_backward("lm_head", params);
  cpu::cross_entropy_backward(final_hidden_.data(), load(*lm_head_param_, scratch_),
                              targets_.data(), lse_.data(), s, 1.0 / static_cast<double>(counted_),
                              dh.data(), grad(*lm_head_param_));
  engine_.post_backward("lm_head", params);
  dh = norm_->backward(dh);
  for (auto it = layers_.rbegin(); it != layers_.rend(); ++it) dh = (*it)->backward(dh);
  embed_tokens_->backward(dh);
  counted_ = 0;
}

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return h;
}

// Standard normal from two counter-derived uniforms (Box-Muller).
double normal_at(uint64_t key, uint64_t index) {
  const uint64_t a = splitmix64(key ^ splitmix64(2 * index));
  const uint64_t b = splitmix64(key ^ splitmix64(2 * index + 1));
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1p-53;  // (0, 1]
  const double u2 = static_cast<double>(b >> 11) * 0x1p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

void initialize_parameters(Engine& engine, const std::vector<Parameter*>& params, uint64_t seed,
                           double std) {
  std::vector<float> values;
  for (Parameter* p : params) {
    const TensorView v = engine.data(*p);
    values.resize(static_cast<size_t>(v.numel()));
    const bool is_bias =
        ends_with(p->name, ".bias") || p->name.find(".bias.tile_") != std::string::npos;
    const bool is_norm = p->desc.shape.size() == 1 && !is_bias;
    const uint64_t key = splitmix64(seed) ^ fnv1a(p->name);
    for (size_t i = 0; i < values.size(); ++i) {
      values[i] = is_bias ? 0.0f : is_norm ? 1.0f : static_cast<float>(std * normal_at(key, i));
    }
    convert(values.data(), DType::kF32, v.data, v.desc.dtype, values.size());
  }
}

}  // namespace strata::nn
