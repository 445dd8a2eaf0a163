// The mixture-of-experts MLP of mixtral and qwen3_moe (transformers'
// MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock): a router (a bias-free
// linear to E logits), softmax in fp32, the top k experts of each token (ties
// to the lower expert, as torch.topk), their probabilities renormalised to sum
// to 1 when the config says so (mixtral always; qwen3_moe with
// norm_topk_prob), each expert a SwiGLU MLP, and the weighted sum of the k
// experts' outputs. No capacity limit: no token is dropped.
//
// The layer permutes the token rows by expert (a stable order: by expert,
// then token), runs each expert's three projections as ordinary GEMMs over its
// contiguous block of rows, and scatters the weighted outputs back
// (ops.h, moe_*).
//
// Parameters: the router "<name>.gate.weight" [E, hidden] and, for each
// expert, "<name>.experts.N.<gate>.weight", "<up>" [moe_intermediate, hidden]
// and "<down>" [hidden, moe_intermediate] (mixtral: w1, w3, w2; qwen3_moe:
// gate_proj, up_proj, down_proj). Every expert projection is a Linear with its
// own parameter and its own operator (hook window), so a partitioning engine
// fetches one expert's matrices alone.
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
// every layer); LlamaModel turns them into the loss and its gradient per
// probability (aux_grad), which backward adds before the softmax.
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include <memory>
#include <vector>

#include "runtime/nn/linear.h"
#include "runtime/nn/llama_config.h"

namespace strata::nn {

// Saved by MoeMlp::forward (views of the arena; rows tokens, k experts each,
// E experts, I = moe_intermediate_size): logits [rows, E] (activation dtype),
// probs fp32 [rows, E], indices int32 [rows, k], weights fp32 [rows, k],
// offsets int32 [E + 1], slots int32 [rows, k], tokens int32 [rows * k], xp
// [rows * k, hidden] (the rows in expert order), gate, up, act [rows * k, I],
// yp [rows * k, hidden] (each expert's output); host_offsets: pinned host
// memory for E + 1 int32, the offsets as forward read them.
struct MoeActs {
  TensorView logits, probs, indices, weights, offsets, slots, tokens;
  TensorView xp, gate, up, act, yp;
  int32_t* host_offsets = nullptr;
};
// Backward scratch: dyp, dxp [rows * k, hidden]; dact, dgate, dup [rows * k,
// I]; dweights fp32 [rows, k]; dlogits [rows, E] (activation dtype).
struct MoeGrads {
  TensorView dyp, dxp, dact, dgate, dup, dweights, dlogits;
};
// The load-balancing loss's state, shared by the layers of one model: forward
// adds into stats (fp64 [2, E]) when it is not empty; backward adds aux_grad
// (fp32 [E], d loss / d probability) when it is not empty.
struct MoeAux {
  TensorView stats, aux_grad;
};

class MoeMlp : public Module {
 public:
  // skip_unrouted: false runs every expert's windows (LlamaModelOptions::skip_unrouted_experts).
  MoeMlp(engine::Engine& engine, std::string name, const LlamaConfig& config, DType dtype = DType::kF32,
         bool skip_unrouted = true);
  // x, y [rows, hidden]. Synchronises the compute stream once (see above).
  void forward(const TensorView& x, const MoeActs& acts, const MoeAux& aux, const TensorView& y,
               Phase phase = Phase::kForward);
  // dx [rows, hidden] = the input gradient (+= when accumulate_dx), through the
  // experts and the router; adds every parameter's gradient.
  void backward(const TensorView& dy, const TensorView& x, const MoeActs& acts, const MoeGrads& grads,
                const MoeAux& aux, const TensorView& dx, bool accumulate_dx);

  int64_t experts() const { return experts_; }
  int64_t top_k() const { return top_k_; }
  // Tokens routed to each expert by every rank (the counts the ranks agree
  // on), summed over the forwards since reset_load(); empty before any.
  const std::vector<double>& load() const { return load_; }
  void reset_load() { load_.clear(); }

 private:
  struct Expert {
    std::unique_ptr<Linear> gate, up, down;
  };
  // Expert e's rows of a [rows * k, cols] buffer.
  MatView block(const TensorView& t, size_t e, const MoeActs& acts) const;
  // routed_ from every rank's row counts, and the engine advised of it.
  void agree_routing(const MoeActs& acts);

  int64_t hidden_, inter_, experts_, top_k_;
  bool renormalize_;
  bool skip_unrouted_;
  std::unique_ptr<Linear> router_;
  std::vector<Expert> experts_list_;
  std::vector<uint8_t> routed_;  // per expert: some rank routed a token to it (this micro-batch)
  std::vector<double> load_;     // per expert: tokens routed since reset_load()
};

}  // namespace strata::nn
