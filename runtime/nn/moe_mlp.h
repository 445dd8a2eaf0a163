// The mixture-of-experts MLP of mixtral, qwen3_moe and qwen2_moe
// (transformers' MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock /
// Qwen2MoeSparseMoeBlock): a router (a bias-free linear to E logits), softmax
// in fp32, the top k experts of each token (ties to the lower expert, as
// torch.topk), their probabilities renormalised to sum to 1 when the config
// says so (mixtral always; qwen3_moe and qwen2_moe with norm_topk_prob),
// each expert a SwiGLU MLP, and the weighted sum of the k experts' outputs.
// No capacity limit: no token is dropped.
//
// gpt-oss (DecoderConfig::stacked_experts; transformers' GptOssMLP): the
// router ("<name>.router") has a bias, the softmax over the top-k logits is
// the renormalised top-k softmax, and each expert's gate, up and down are
// Linears with biases whose parameters ("<name>.experts.N.gate.weight", ...)
// are strided views of the stacked checkpoint tensors (LinearSlices: expert
// N's block of "<name>.experts.gate_up_proj", gate its even columns and up
// its odd ones, transposed; "<name>.experts.down_proj" likewise), so the
// experts run, fetch and skip as every family's do; the activation is the
// clamped SwiGLU (DecoderConfig::expert_act, glu_clamp).
//
// qwen2_moe adds a shared expert: a dense SwiGLU MLP (Mlp,
// shared_expert_intermediate_size wide) that every token goes through, its
// output scaled per token by sigmoid of a bias-free linear to one logit
// ("<name>.shared_expert_gate") and added to the routed experts' sum
// (ops.h, sigmoid_gated_add). Its parameters are ordinary dense parameters
// (not marked as experts: they are never skipped, exchanged or split between
// ep members); it runs on this rank's own rows after the routed experts, and
// its backward first.
//
// The layer permutes the token rows by expert (a stable order: by expert,
// then token), runs each expert's three projections as ordinary GEMMs over its
// contiguous block of rows, and scatters the weighted outputs back
// (ops.h, moe_*).
//
// Parameters: the router "<name>.gate.weight" [E, hidden] and, for each
// expert, "<name>.experts.N.<gate>.weight", "<up>" [moe_intermediate, hidden]
// and "<down>" [hidden, moe_intermediate] (mixtral: w1, w3, w2; qwen3_moe and
// qwen2_moe: gate_proj, up_proj, down_proj); qwen2_moe's shared expert
// "<name>.shared_expert.{gate,up,down}_proj.weight" [shared width, hidden] /
// [hidden, shared width] and its gate "<name>.shared_expert_gate.weight"
// [1, hidden]. Every expert projection is a Linear with its own parameter and
// its own operator (hook window), so a partitioning engine fetches one
// expert's matrices alone.
//
// Routed fetch: after the router, the ranks agree (Engine::sum_over_ranks of
// the per-expert row counts: one small collective per layer forward) on the
// experts any rank routed a token to. An expert some rank uses runs its
// windows on every rank (with no rows where it got none); an expert no rank
// uses has its windows skipped (Engine::skip_op) in forward, the recompute
// and backward of that micro-batch, so a ZeRO-3 engine never gathers it and
// has no gradient of it to reduce (it adds zero either way). Before the
// experts run, forward advises the engine of the agreed set
// (Engine::plan_skip), so prefetch fetches exactly the routed experts. The
// agreed set is host state of this layer for the current micro-batch (the
// one thing a module keeps besides descriptors): forward writes it, the
// recompute and backward of the same micro-batch read it.
//
// CONTRACT — one host synchronisation per layer forward: the size of each
// expert's row block is data-dependent, and the GEMMs need it on the host, so
// forward copies the E + 1 offsets to pinned host memory and waits for the
// compute stream once, after the router (followed by the routing agreement,
// a collective of E doubles that blocks the host too). Backward (and the recompute of
// activation checkpointing, which syncs again) reuse the host copy: no sync.
// On the cpu accelerator ops run in order on one stream thread anyway; on
// cuda this stalls the launch queue once per MoE layer (a grouped GEMM that
// reads the offsets on the device is the way to remove it).
//
// The load-balancing loss (transformers' load_balancing_loss_func): forward
// accumulates, per expert, the number of assignments and the sum of the
// router probabilities into the caller's aux_stats (fp64 [2, E], summed over
// every layer); DecoderModel turns them into the loss and its gradient per
// probability (aux_grad), which backward adds before the softmax.
// Expert parallelism (Engine::expert_group() of size P > 1; docs/DESIGN.md
// §4.2): member i of the ep group holds experts [i E/P, (i+1) E/P) and runs
// only those. The routing agreement becomes every rank's per-expert counts
// (one sum_over_ranks of dp_size x E doubles, each rank filling its row),
// from which every rank knows what each ep member sends it. The rows in
// expert order are contiguous per owner, so one exchange (Engine::
// exchange_experts) sends each member its experts' rows; the received rows
// (by source member, then expert) are permuted to expert order (moe_gather
// with a permutation uploaded from the host), the experts run as above, and
// their outputs go back the same way before the combine. Backward mirrors it:
// dyp to the owners, dxp back. Other members' experts' windows are never
// opened here. The activation buffers of the experts hold up to P x rows x k
// rows (every member's tokens to this member's experts); more is refused.
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include <memory>
#include <vector>

#include "runtime/nn/attention.h"
#include "runtime/nn/linear.h"
#include "runtime/nn/decoder_config.h"

namespace strata::nn {

// Saved by MoeMlp::forward (views of the arena; rows tokens, k experts each,
// E experts, I = moe_intermediate_size): logits [rows, E] (activation dtype),
// probs fp32 [rows, E], indices int32 [rows, k], weights fp32 [rows, k],
// offsets int32 [E + 1], slots int32 [rows, k], tokens int32 [rows * k], xp
// [rows * k, hidden] (the rows in expert order), gate, up, act [rows * k, I],
// yp [rows * k, hidden] (each expert's output); host_offsets: pinned host
// memory for E + 1 int32, the offsets as forward read them.
// With expert parallelism (P > 1 members) gate, up and act hold up to
// P x rows x k rows, and: xr [P rows k, hidden] (the received rows in expert
// order), perm and inverse int32 [P rows k] (received position of each
// expert-order row, and back), host_perm pinned host memory for 2 P rows k
// int32 (shared by the layers); exchange and expert_out [P rows k, hidden] are scratch that every
// layer shares (nothing in them outlives one exchange).
// A micro-batch's routing in one layer as the host keeps it from its forward
// to its backward: which experts any rank routed to and, with expert
// parallelism, the exchange planned for it. DecoderModel keeps one per layer
// in each micro-batch's arena (pipeline schedules run a later micro-batch's
// forward before an earlier one's backward, each in its own arena).
struct MoeRouting {
  std::vector<uint8_t> routed;  // per expert: some rank routed a token to it
  // Expert parallelism: what this member receives and where it goes.
  partition::AllToAllSplits to_owners;  // xp's rows to the members that hold them; received by source member
  std::vector<int64_t> offsets;         // this member's experts' blocks in expert order (E/P + 1)
  int64_t received = 0;                 // rows this member's experts run on
  std::vector<int32_t> held_offsets;    // offsets as int32 (block's type)
  std::vector<int32_t> perm;            // the received rows' permutation to expert order, then its inverse
};
struct MoeActs {
  TensorView logits, probs, indices, weights, offsets, slots, tokens;
  TensorView xp, gate, up, act, yp;
  int32_t* host_offsets = nullptr;
  TensorView xr, perm, inverse, exchange, expert_out;
  int32_t* host_perm = nullptr;
  // The shared expert (qwen2_moe; empty otherwise): its MLP's gate, up, act
  // [rows, shared_expert_intermediate_size], its output shared_out [rows,
  // hidden] and its gate's logit shared_logit [rows, 1].
  MlpActs shared;
  TensorView shared_out, shared_logit;
  // This micro-batch's routing in this layer (owned by the arena); null: the layer's own.
  MoeRouting* routing = nullptr;
  // The sigmoid router in a 16-bit model: its input in fp32 [rows, hidden]
  // (transformers computes DeepseekV3TopkRouter's logits in fp32 from the
  // fp32 weight; logits and dlogits are then fp32 too). Empty otherwise.
  TensorView x32;
};
// Backward scratch: dyp, dxp [rows * k, hidden]; dact, dgate, dup [rows * k,
// I]; dweights fp32 [rows, k]; dlogits [rows, E] (activation dtype).
// With expert parallelism dact, dgate, dup hold P x rows x k rows, and dxr
// [P rows k, hidden] is the experts' input gradient in expert order.
// The shared expert: its MLP's scratch [rows, shared width], dshared_out
// [rows, hidden] and dshared_logit [rows, 1].
struct MoeGrads {
  TensorView dyp, dxp, dact, dgate, dup, dweights, dlogits;
  TensorView dxr;
  MlpGrads shared;
  TensorView dshared_out, dshared_logit;
  // With MoeActs::x32: the router's input gradient in fp32 and in the
  // activation dtype [rows, hidden].
  TensorView dx32, dx16;
};
// The load-balancing loss's state, shared by the layers of one model: forward
// adds into stats (fp64 [2, E]) when it is not empty; backward adds aux_grad
// (fp32 [E], d loss / d probability) when it is not empty.
struct MoeAux {
  TensorView stats, aux_grad;
};

// DeepSeek-V3's auxiliary-loss-free balancing: the step each expert's
// correction bias takes after an optimizer step, rate * sign(mean(load) -
// load[e]) -- +rate for an expert under the mean, -rate over it, 0 at it
// (sign(0) = 0) --, `load` the tokens routed to each expert (whole counts,
// compared exactly: sign(sum - E load[e])).
std::vector<float> correction_bias_steps(const std::vector<double>& load, float rate);

class MoeMlp : public Module {
 public:
  // skip_unrouted: false runs every expert's windows (DecoderModelOptions::skip_unrouted_experts).
  MoeMlp(engine::Engine& engine, std::string name, const DecoderConfig& config, DType dtype = DType::kF32,
         bool skip_unrouted = true);
  // x, y [rows, hidden]. Synchronises the compute stream once (see above).
  void forward(const TensorView& x, const MoeActs& acts, const MoeAux& aux, const TensorView& y,
               Phase phase = Phase::kForward);
  // dx [rows, hidden] = the input gradient (+= when accumulate_dx), through the
  // experts and the router; adds every parameter's gradient.
  void backward(const TensorView& dy, const TensorView& x, const MoeActs& acts, const MoeGrads& grads,
                const MoeAux& aux, const TensorView& dx, bool accumulate_dx);

  int64_t experts() const { return experts_; }
  bool has_shared_expert() const { return shared_ != nullptr; }
  int64_t top_k() const { return top_k_; }
  // Tokens routed to each expert by every rank (the counts the ranks agree
  // on), summed over the forwards since reset_load(); empty before any.
  const std::vector<double>& load() const { return load_; }
  void reset_load() { load_.clear(); }
  // Whether the router has DeepSeek's e_score_correction_bias (the sigmoid router).
  bool has_correction_bias() const { return correction_bias_ >= 0; }
  // DeepSeek-V3's auxiliary-loss-free balancing, called after an optimizer
  // step: b_i += rate * sign(mean load - load_i) in fp32 for every expert i,
  // load() the tokens routed to it since reset_load() (every rank's: every
  // rank writes the same values; nothing routed since: unchanged). Writes the
  // bias through Engine::for_each_owned_range (kBadArgument without a
  // correction bias); not inside a hook window or between prepare_step and step.
  void update_correction_bias(float rate);

 private:
  struct Expert {
    std::unique_ptr<Linear> gate, up, down;
  };
  // The micro-batch's routed experts (routing(acts)) from every rank's row
  // counts, and the engine advised of it; with expert parallelism also its
  // exchange (and the permutation uploaded).
  void agree_routing(const MoeActs& acts);
  // The micro-batch's routing: the acts' own, else the layer's.
  MoeRouting& routing(const MoeActs& a) { return a.routing != nullptr ? *a.routing : routing_; }
  bool expert_parallel() const { return engine_.expert_group().size > 1; }
  size_t first_expert() const;  // this member's first expert (0 without expert parallelism)
  size_t held_experts() const;  // how many it holds
  void plan_exchange(const std::vector<double>& counts, const MoeActs& acts);
  // Forward / backward of the experts this rank holds, rows already in
  // expert order (`in`: xp or xr; `out`: yp or expert_out): the j-th held
  // expert's rows are [offsets[j], offsets[j + 1]) (host).
  void experts_forward(const TensorView& in, const MoeActs& a, const TensorView& out, const int32_t* offsets,
                       Phase phase);
  void experts_backward(const TensorView& dout, const TensorView& in, const MoeActs& a, const MoeGrads& g,
                        const TensorView& din, const int32_t* offsets);

  int64_t hidden_, inter_, experts_, top_k_;
  bool renormalize_;
  ops::MoeRouter rule_;  // the config's router (DecoderConfig::router)
  ops::GluActivation act_;  // the experts' activation (gpt-oss: the clamped SwiGLU)
  ops::GluClamp clamp_;
  // The sigmoid router's e_score_correction_bias (fp32 [E], frozen: a
  // buffer) and the window the routing reads it in; -1 without.
  ParamId correction_bias_ = -1;
  OpId route_op_ = -1;
  bool skip_unrouted_;
  std::unique_ptr<Linear> router_;
  std::vector<Expert> experts_list_;
  std::unique_ptr<Mlp> shared_;          // qwen2_moe's shared expert, DeepSeek's shared experts (null otherwise)
  std::unique_ptr<Linear> shared_gate_;  // qwen2_moe's gate: hidden -> 1 logit, no bias (null: ungated)
  MoeRouting routing_;            // the last micro-batch's, for acts without their own
  std::vector<double> load_;     // per expert: tokens routed since reset_load()
};

}  // namespace strata::nn
