// The micro-batch orders' parameter reads and step times, predicted.
#include "runtime/plan/order_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string>

#include "core/error.h"
#include "runtime/plan/runtime_memory.h"

namespace strata::plan {

OrderPlan predict_micro_batch_orders(const OrderInputs& in) {
  STRATA_CHECK(in.param_count > 0 && in.largest_chunk_params > 0 && in.largest_layer_params > 0, kBadArgument,
               "micro-batch order plan: the model's parameters ({}), largest chunk ({}) and layer ({}) must be above 0",
               in.param_count, in.largest_chunk_params, in.largest_layer_params);
  STRATA_CHECK(in.micro_batches >= 1, kBadArgument, "micro-batch order plan: {} micro-batches (gradient "
               "accumulation steps) must be at least 1", in.micro_batches);
  STRATA_CHECK(in.shard_nbytes > 0 && in.read_bandwidth > 0 && in.step_major_compute_seconds >= 0, kBadArgument,
               "micro-batch order plan: the shard's bytes ({}) and the read bandwidth ({}) must be above 0, the "
               "compute ({} s) at least 0",
               in.shard_nbytes, in.read_bandwidth, in.step_major_compute_seconds);
  OrderPlan plan;
  const auto m = static_cast<double>(in.micro_batches);
  const auto fits = [&](double numel) {
    return numel <= static_cast<double>(in.max_reuse_distance) && numel <= static_cast<double>(in.max_live);
  };
  plan.whole_model_kept = fits(static_cast<double>(in.param_count));
  // A layer's recompute and backward alternate: its last projection's next
  // use is about two layers' windows away. The embedding's and the head's
  // uses follow one another at once: they need only the live budget.
  plan.chunks_kept = fits(2.0 * static_cast<double>(in.largest_layer_params)) &&
                     static_cast<double>(in.largest_chunk_params) <= static_cast<double>(in.max_live);
  // Step-major: a forward and a backward fetch per micro-batch; the
  // recompute shares the backward's when a layer's windows fit the distance.
  const double per_micro_batch =
      in.activation_checkpointing && !fits(static_cast<double>(in.largest_layer_params)) ? 3 : 2;
  plan.step_major.fetches = plan.whole_model_kept ? 1 : m * per_micro_batch;
  plan.layer_major.fetches = plan.whole_model_kept ? 1 : plan.chunks_kept ? 2 : m * per_micro_batch;
  plan.step_major.compute_seconds = in.step_major_compute_seconds;
  // Layer-major recomputes every layer's forward: 4 passes where step-major without checkpointing has 3
  // (none when it keeps the activations).
  const bool same_passes = in.activation_checkpointing || in.layer_major_keeps_activations;
  plan.layer_major.compute_seconds = in.step_major_compute_seconds * (same_passes ? 1.0 : 4.0 / 3.0);
  for (OrderPrediction* p : {&plan.step_major, &plan.layer_major}) {
    p->param_read_nbytes = p->fetches * in.shard_nbytes;
    p->io_seconds = p->param_read_nbytes / in.read_bandwidth;
    p->step_seconds = std::max(p->compute_seconds, p->io_seconds);
  }
  return plan;
}

OrderInputs order_inputs(const PlanInputs& inputs, double step_major_compute_seconds, int64_t largest_chunk_params,
                         int64_t largest_layer_params, Tier params, int64_t max_reuse_distance, int64_t max_live) {
  const Machine& hw = inputs.machine;
  OrderInputs in;
  in.param_count = inputs.model.param_count;
  in.largest_chunk_params = largest_chunk_params;
  in.largest_layer_params = largest_layer_params;
  // This rank's share of one fetch of every 16-bit parameter (the plan's dtype).
  in.shard_nbytes = static_cast<double>(in.param_count) * kParam16Bytes / static_cast<double>(hw.data_parallel);
  in.micro_batches = inputs.training.grad_accumulation;
  in.activation_checkpointing = inputs.training.activation_checkpointing;
  in.layer_major_keeps_activations = inputs.training.layer_major_keeps_activations;
  in.max_reuse_distance = max_reuse_distance;
  in.max_live = max_live;
  in.read_bandwidth = params == Tier::kNvme ? hw.nvme_read_bw / static_cast<double>(hw.gpus_per_node) : hw.gpu_cpu_bw;
  in.step_major_compute_seconds = step_major_compute_seconds;
  return in;
}

ChunkSizes largest_chunk_and_layer(const nn::DecoderConfig& model, int tensor_parallel) {
  int64_t embedding = 0, head = 0;
  std::map<int64_t, int64_t> layers;
  for (const RankParam& p : decoder_rank_params(model, DType::kBF16, tensor_parallel)) {
    const std::string& n = p.spec.name;
    const int64_t numel = shape_numel(p.spec.shape);
    if (n.rfind("model.layers.", 0) == 0) {
      layers[std::stoll(n.substr(13, n.find('.', 13) - 13))] += numel;
    } else if (n.rfind("model.embed_tokens.", 0) == 0) {
      embedding += numel;
      if (model.tie_word_embeddings) head += numel;  // the head's lm_head
    } else {
      head += numel;  // the final norm and lm_head
    }
  }
  ChunkSizes sizes;
  for (const auto& entry : layers) sizes.largest_layer = std::max(sizes.largest_layer, entry.second);
  sizes.largest_chunk = std::max({embedding, head, sizes.largest_layer});
  return sizes;
}

OrderPlan predict_micro_batch_orders_for(const nn::DecoderConfig& model, const TrainingShape& training,
                                         const Machine& hardware, Tier params, int64_t max_reuse_distance,
                                         int64_t max_live) {
  PlanInputs inputs;
  inputs.model = decoder_model_shape(model);
  inputs.training = training;
  inputs.machine = hardware;
  const Plan plan = make_plan(inputs);
  const ChunkSizes sizes = largest_chunk_and_layer(model);
  return predict_micro_batch_orders(order_inputs(inputs, plan.compute_seconds, sizes.largest_chunk,
                                                 sizes.largest_layer, params, max_reuse_distance, max_live));
}

std::string OrderPlan::describe() const {
  if (whole_model_kept) {
    return "the whole model fits stage3_max_reuse_distance and stage3_max_live_parameters: both orders fetch each "
           "parameter once per step";
  }
  if (!chunks_kept) {
    return "stage3_max_reuse_distance or stage3_max_live_parameters is below twice the largest layer (or the live "
           "budget below the embedding or the head): layer-major fetches what step-major does";
  }
  return fmt::format("layer-major fetches each parameter twice per step, step-major {:g} times", step_major.fetches);
}

}  // namespace strata::plan
