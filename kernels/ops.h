// Ops: the model operators of a Llama-style decoder behind one interface with
// one implementation per accelerator (docs/DESIGN.md §4.1): cpu (OpenBLAS + OpenMP +
// our SIMD, run on the cpu stream's thread) and cuda (cuBLAS + our kernels).
// Model code calls Ops only, so it never names a device.
//
// Calling convention. Every op takes a ComputeContext (the stream it runs on,
// the accelerator that owns its scratch memory, the BLAS handle bound to that
// stream) and TensorViews of accelerator memory. An op only ENQUEUES work on
// the context's stream and returns; it never synchronises with the host. Views
// must stay valid, and must not be written by other streams, until that work
// has run (order later users after it with an event). Scratch memory comes
// from the context's accelerator and is released in stream order.
//
// Dtypes. Activations and parameters are fp32, fp16 or bf16 ("float storage");
// the activations of one call share one dtype, and a parameter may be stored in
// any float dtype (the op converts where it must). Arithmetic is fp32 with fp32
// (or wider) accumulation on every backend. Parameter gradients (dw, dbias,
// dtable) are fp32 accumulators: ops ADD into them, so micro-batches and tiles
// can sum into one buffer. Activation gradients are overwritten unless an
// `accumulate` flag says otherwise. Indices (ids, targets, positions) are int32;
// loss statistics are fp64.
//
// Layout: row-major; "rows" = tokens (batch * seq). Outputs never alias inputs
// unless an op says "in place".
//
// Errors. Shapes and dtypes are checked on the calling thread before anything
// is enqueued, once for every backend (the public ops below are a front end
// that validates, then calls its backend; kernels/ops.cc): a mismatch throws
// Error(kBadArgument) naming the op and the offending argument, and nothing is
// enqueued. A backend then refuses, the same way, what only it cannot do
// (cuda: a view that is not device memory, an extent over 2^31 - 1). Failures while the work runs
// (a CUDA launch or cuBLAS error on cuda; a kernel exception on cpu) become the
// stream's error, rethrown by Stream::synchronize and by events recorded after
// it. Token ids, targets and positions are not range-checked on the device
// (that would need a host round trip): out-of-range values give unspecified
// results without out-of-bounds memory access; callers validate them on the
// host before uploading (DecoderModel does).
//
// Thread-safety: an Ops object is immutable after creation and may be shared
// by threads; a ComputeContext belongs to one stream and must be used by one
// thread at a time.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>

#include "kernels/attention_mask.h"
#include "kernels/fp8_blocks.h"
#include "kernels/glu.h"
#include "kernels/mxfp4_blocks.h"
#include "kernels/moe_routing.h"
#include "kernels/optimizer.h"
#include "kernels/rope_frequencies.h"
#include "core/accelerator.h"
#include "core/tensor.h"

namespace strata::ops {

// Targets equal to this contribute nothing to the loss (PyTorch's ignore_index).
inline constexpr int32_t kIgnoreIndex = -100;

// A row-major matrix inside a tensor: rows x cols elements, consecutive rows
// `ld` elements apart (ld >= cols). Lets an op address a column block of a wider
// matrix (TiledLinear) without a copy.
struct MatView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0, cols = 0, ld = 0;

  // The whole tensor as a matrix: its last dimension is the columns, all
  // leading dimensions are rows (a 1-D tensor is one row).
  static MatView of(const TensorView& t);
  // Columns [c0, c1) of this matrix (same rows and ld).
  MatView columns(int64_t c0, int64_t c1) const;
  // Rows [r0, r1) of this matrix (same cols and ld): an expert's token block.
  MatView row_block(int64_t r0, int64_t r1) const;
};

class Ops;

// What the op being enqueued is, for the timeline (--trace): set by the Ops
// front end while recording, for the duration of one backend enqueue_* call.
// The cpu backend times the op's task on its stream thread and records it as
// an "op" span with these arguments (and adds it to op_totals.h); the cuda
// backend does not time ops yet (it would need an event pair per op).
struct OpLabel {
  const char* name = nullptr;  // the op ("linear_forward"); null: not recording
  int64_t flops = 0;           // a matrix product's arithmetic (a multiply-add counts 2); 0: memory-bound
  uint64_t bytes = ~uint64_t{0};  // the bytes a memory-bound op reads and writes; ~0: not given
  std::string shape;           // its operands in brief ("512x64 bf16 * [128, 64]")
};

// Where an op's work runs. Created by Ops::make_context for one stream; owns
// the backend's BLAS handle for it. Not copyable.
class ComputeContext {
 public:
  virtual ~ComputeContext() = default;
  Accelerator& accelerator() const { return *accelerator_; }
  Stream& stream() const { return *stream_; }
  // cublasHandle_t bound to stream() on cuda; nullptr on cpu.
  virtual void* blas_handle() const = 0;
  // The op being enqueued, while recording a trace (name null otherwise).
  const OpLabel& op_label() const { return op_label_; }

 protected:
  ComputeContext(Accelerator& accelerator, Stream& stream)
      : accelerator_(&accelerator), stream_(&stream) {}

 private:
  friend class Ops;
  Accelerator* accelerator_;
  Stream* stream_;
  const Ops* owner_ = nullptr;  // set by Ops::make_context
  OpLabel op_label_;
};

// Shape of causal self-attention with grouped-query heads.
struct AttentionShape {
  int64_t batch = 0, seq = 0;
  int64_t heads = 0;     // query heads
  int64_t kv_heads = 0;  // key/value heads; heads % kv_heads == 0
  int64_t head_dim = 0;
  // Keys (and values) per row when they are a block of their own (context
  // parallelism: attention_mask.h's q_offset/kv_offset); 0: seq.
  int64_t kv_seq = 0;
  int64_t keys() const { return kv_seq > 0 ? kv_seq : seq; }
};

class Ops {
 public:
  virtual ~Ops() = default;
  Ops(const Ops&) = delete;
  Ops& operator=(const Ops&) = delete;

  Backend backend() const { return backend_; }
  Accelerator& accelerator() const { return accelerator_; }
  // A context for work on `stream` (a stream of accelerator()). Every op
  // refuses a context made by another Ops object.
  std::unique_ptr<ComputeContext> make_context(Stream& stream);

  // ---- embedding: out[r, :] = table[ids[r], :] --------------------------------
  // table [vocab, dim], ids int32 [rows], out [rows, dim].
  //
  // A vocabulary shard (Megatron's vocabulary-parallel embedding): with
  // `vocab` > 0 the table holds rows [first_id, first_id + table rows) of a
  // vocab-row table; an id outside the shard gives a zero row (another rank
  // holds it; the model sums the ranks' outputs) and adds no gradient.
  // padding_idx is then a global id too. vocab 0: the table is whole.
  // first_id 0 with vocab = table rows gives the whole table's results bit for
  // bit, and so do the shards: their lookups summed, their dtable rows
  // concatenated (a repeated id's rows are summed in the same order).
  //
  // scale: every looked-up row times it (Gemma's sqrt(hidden_size), given
  // already rounded to the table's dtype as transformers does), and the
  // gradient likewise; 1: the rows as they are.
  void embedding_forward(ComputeContext& ctx, const TensorView& table,
                                 const TensorView& ids, const TensorView& out, int64_t first_id = 0,
                                 int64_t vocab = 0, float scale = 1.0f);
  // dtable (fp32 [vocab, dim]) += scatter of dout [rows, dim] by ids, except
  // the rows whose id is padding_idx (torch's nn.Embedding(padding_idx): that
  // row gets no gradient from lookups); padding_idx < 0: none. An empty dtable
  // (a frozen table) does nothing.
  void embedding_backward(ComputeContext& ctx, const TensorView& dout,
                                  const TensorView& ids, const TensorView& dtable,
                                  int64_t padding_idx, int64_t first_id = 0, int64_t vocab = 0,
                                  float scale = 1.0f);

  // ---- RMSNorm: y = x / sqrt(mean(x^2) + eps) * (weight_offset + w) ----------
  // x, y [rows, dim]; w [dim]; rstd fp32 [rows] is saved for backward.
  // weight_offset 0 (Llama's norm) or 1 (Gemma's, whose weights are stored as
  // w - 1: the product in fp32, rounded once, as transformers' Gemma RMSNorm).
  void rmsnorm_forward(ComputeContext& ctx, const TensorView& x, const TensorView& w,
                               double eps, const TensorView& y, const TensorView& rstd,
                               float weight_offset = 0.0f);
  // dx [rows, dim] is overwritten (added into when accumulate_dx); dw fp32 [dim]
  // +=, or an empty view (a frozen weight: no gradient).
  void rmsnorm_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& x,
                                const TensorView& w, const TensorView& rstd, const TensorView& dx,
                                bool accumulate_dx, const TensorView& dw, float weight_offset = 0.0f);

  // ---- Linear: y = scale * x W^T (+ b) -----------------------------------------
  // x [rows, in], W [out, in] (the Hugging Face layout), bias [out] or an empty
  // view, y [rows, out]. accumulate: y += ... instead of y = .... `scale` (finite)
  // multiplies the product inside the GEMM (its alpha), never the bias: a LoRA
  // adapter's alpha / r costs nothing.
  void linear_forward(ComputeContext& ctx, const MatView& x, const TensorView& w,
                      const TensorView& bias, const MatView& y, bool accumulate,
                      float scale = 1.0f);
  // The backward of that: dx = scale * dy W (+= when accumulate_dx), dw (fp32
  // [out, in]) += scale * dy^T x, dbias (fp32 [out]) += column sums of dy.
  // dx, dw and dbias may each be empty (not wanted).
  void linear_backward(ComputeContext& ctx, const MatView& dy, const MatView& x,
                       const TensorView& w, const MatView& dx, bool accumulate_dx,
                       const TensorView& dw, const TensorView& dbias, float scale = 1.0f);

  // ---- dropout with a mask regenerated from a seed ---------------------------------
  // out (+= when accumulate) = x * keep / (1 - p) elementwise, keep =
  // dropout_keep(seed, r * cols + c, p) (kernels/dropout_mask.h): the same
  // seed gives the same mask on every backend and every call, so the backward
  // of a dropout is this op again on the gradient (accumulate into dx), with no
  // mask stored. x and out [rows, cols] of one dtype, may be strided, must not
  // overlap unless they are the same view (then not accumulate). 0 <= p < 1.
  void dropout(ComputeContext& ctx, const MatView& x, const MatView& out, float p, uint64_t seed,
               bool accumulate);

  // ---- strided copy: out = x (+= when accumulate) ------------------------------
  // x and out [rows, cols] of one dtype, may be strided (a column block of a
  // wider matrix), must not overlap. Exact (dropout's kernel at p = 0: every
  // element kept, scaled by exactly 1), on every backend.
  void copy(ComputeContext& ctx, const MatView& x, const MatView& out, bool accumulate);

  // ---- rotary position embedding (Hugging Face "rotate_half") ------------------
  // In place on x [rows, heads, head_dim]: pairs (i, i + head_dim/2) rotate by
  // positions[row] * rope_inv_freq(rope, i, head_dim) -- or, with the rope's
  // rotary_offset/rotary_dim/interleaved, the pairs rope_pair names of the
  // rotated part, at its width's frequencies -- (rope_frequencies.h: the
  // default, linear, llama3 and yarn frequencies), cos and sin times
  // rope_attention_scale(rope) (YaRN's attention factor, else 1: then the
  // backward is the transpose, not the inverse). positions int32 [rows]. head_dim even.
  void rope_forward(ComputeContext& ctx, const TensorView& x, const TensorView& positions,
                            const Rope& rope);
  // The inverse rotation, in place on the gradient.
  void rope_backward(ComputeContext& ctx, const TensorView& dx,
                             const TensorView& positions, const Rope& rope);

  // ---- causal self-attention, grouped-query heads, scale 1/sqrt(head_dim) ------
  // (or mask.scale; with mask.softcap the scores soft-capped: attention_mask.h)
  // q, out [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim];
  // lse fp32 [batch, heads, seq] (log-sum-exp of each softmax row, saved so that
  // backward recomputes probabilities; no [seq, seq] matrix is kept). `mask`
  // says which keys a query sees beyond causality (attention_mask.h: a sliding
  // window); backward must get the forward's mask.
  void attention_forward(ComputeContext& ctx, const TensorView& q, const TensorView& k,
                                 const TensorView& v, const TensorView& out, const TensorView& lse,
                                 const AttentionMask& mask);
  //
  // A block of queries against a block of keys (context parallelism: ring
  // attention): k, v [batch, kv_seq, kv_heads, head_dim] may hold another
  // number of tokens than q, and mask.q_offset / mask.kv_offset place both
  // blocks in the whole sequence, where causality, the window and the
  // documents are evaluated. out is then the attention over this key block
  // alone and lse its log-sum-exp; a query that sees none of its keys gets
  // out 0 and lse -inf. attention_merge combines the blocks' results.
  // dq, dk, dv are overwritten. For a key block, backward takes the merged
  // out and lse of all blocks (the probabilities exp(s - lse) and the row
  // sums dO.O of the whole softmax, as FlashAttention's backward) and gives
  // this block's share: dq summed over the blocks is the gradient, and so is
  // each block's dk, dv summed over the query blocks.
  void attention_backward(ComputeContext& ctx, const TensorView& dout,
                                  const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const TensorView& lse,
                                  const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                  const AttentionMask& mask);

  // The attention sinks' gradient (mask.sinks, attention_mask.h; gpt-oss):
  // dsinks fp32 [heads] += -sum over batch and queries of exp(sink_h - lse)
  // <dout, out>, the sink's probability times the row's dO.O (the softmax's
  // backward, the sink attending to no value). dout, out [batch, seq, heads,
  // head_dim] and lse fp32 [batch, heads, seq] as attention_backward takes
  // them; mask.sinks must be set.
  void attention_sinks_backward(ComputeContext& ctx, const TensorView& dout, const TensorView& out,
                                const TensorView& lse, const AttentionMask& mask, const TensorView& dsinks);

  // Merges a key block's attention into the result so far, exactly in fp32:
  // lse' = log(exp(lse) + exp(part_lse)), out' = out exp(lse - lse') +
  // part exp(part_lse - lse'), in place on out and lse. out, part [batch,
  // seq, heads, head_dim] (out fp32, the accumulator; part any float dtype),
  // lse, part_lse fp32 [batch, heads, seq]. A row with lse -inf (no key seen
  // yet) takes the part's; a part with -inf leaves the row as it is.
  void attention_merge(ComputeContext& ctx, const TensorView& out, const TensorView& lse,
                       const TensorView& part, const TensorView& part_lse);

  // ---- gated MLP: out = act(gate) * up ------------------------------------------
  // act (kernels/glu.h): silu (SwiGLU, the default), gelu with the tanh
  // approximation (GeGLU: Gemma's gelu_pytorch_tanh), or gpt-oss's clamped
  // SwiGLU with `clamp`'s alpha and limit ((clamp(up) + 1) * g * sigmoid(alpha g),
  // g = min(gate, limit); `clamp` is read for that activation only).
  void swiglu_forward(ComputeContext& ctx, const TensorView& gate, const TensorView& up,
                              const TensorView& out, GluActivation act = GluActivation::kSilu,
                              const GluClamp& clamp = {});
  void swiglu_backward(ComputeContext& ctx, const TensorView& dout,
                               const TensorView& gate, const TensorView& up,
                               const TensorView& dgate, const TensorView& dup,
                               GluActivation act = GluActivation::kSilu, const GluClamp& clamp = {});

  // ---- residual: out = a + b (out may alias a or b) ----------------------------
  void add(ComputeContext& ctx, const TensorView& a, const TensorView& b,
                   const TensorView& out);

  // ---- cross-entropy over the vocabulary, fused with the output projection ------
  // logits = h W^T are formed chunk_rows rows at a time (scratch of chunk_rows x
  // vocab), so the [rows, vocab] logits never exist. h [rows, dim], W [vocab,
  // dim], targets int32 [rows] (kIgnoreIndex rows count for nothing).
  //
  // Forward: lse fp32 [rows] (saved); stats fp64 [2] ACCUMULATES: stats[0] += sum
  // of the per-row losses, stats[1] += number of counted (not ignored) rows.
  //
  // With `grad` set (training), the same pass also computes the gradient of
  //   loss = grad_scale * (sum of per-row losses) / normalizer[0]
  // where normalizer is an fp64 [1] device scalar read when the work runs (so it
  // may be produced by earlier stream work: a count, an allreduce): dh [rows,
  // dim] is overwritten and dw (fp32 [vocab, dim]) accumulated. This is the
  // whole backward of the loss: the logits are formed once per step, not twice.
  struct CrossEntropyGrad {
    TensorView normalizer;  // fp64 [1]
    double grad_scale = 1.0;
    TensorView dh;          // [rows, dim]
    TensorView dw;          // fp32 [vocab, dim], +=; may be empty
  };
  //
  // logit_softcap > 0: the logits are capped to c * tanh(logit / c) before the
  // softmax (Gemma 2's final_logit_softcapping), the gradient through the cap.
  void cross_entropy(ComputeContext& ctx, const TensorView& h, const TensorView& w,
                             const TensorView& targets, int64_t chunk_rows, const TensorView& lse,
                             const TensorView& stats, const CrossEntropyGrad* grad,
                             float logit_softcap = 0.0f);
  // count fp64 [1] += number of targets that are not kIgnoreIndex.
  void count_targets(ComputeContext& ctx, const TensorView& targets,
                             const TensorView& count);

  // ---- vocabulary-parallel cross-entropy (Megatron's, tensor parallelism) -------
  // Each rank holds rows [first_id, first_id + V) of the output projection
  // and forms a chunk's logits [n, V] = h W^T itself (linear_forward, in the
  // activation dtype), so no rank forms the whole vocabulary's. Per chunk:
  // vocab_parallel_parts writes parts fp32 [2, n]: row 0 the log-sum-exp of
  // each logits row over this rank's columns, row 1 the logit of the row's
  // target when this rank holds it, else 0 (and 0 for kIgnoreIndex).
  void vocab_parallel_parts(ComputeContext& ctx, const TensorView& logits, const TensorView& targets,
                            int64_t first_id, const TensorView& parts);
  // Then, with every rank's parts gathered fp32 [tp, 2, n] (rank-major, an
  // allgather): lse fp32 [n] = the log-sum-exp over the whole vocabulary
  // (the parts combined in a fixed order, so every rank gets the same bits);
  // stats fp64 [2] += (the sum over counted rows of lse - target logit, the
  // counted rows), the same on every rank. targets must be kIgnoreIndex or in
  // [0, vocab) (vocab: the whole vocabulary; the caller validates them, as
  // for cross_entropy). With `grad` the logits are
  // overwritten with d loss / d logits over this rank's columns, for
  //   loss = grad_scale * (sum of per-row losses) / normalizer[0]
  // (normalizer an fp64 [1] device scalar read when the work runs; ignored
  // rows zero); the caller's linear_backward then gives this rank's partial
  // dh (summed over tp by the caller) and its shard's dw.
  struct VocabParallelGrad {
    TensorView normalizer;  // fp64 [1]
    double grad_scale = 1.0;
  };
  void vocab_parallel_loss(ComputeContext& ctx, const TensorView& logits, const TensorView& gathered,
                           const TensorView& targets, int64_t first_id, int64_t vocab, const TensorView& lse,
                           const TensorView& stats, const VocabParallelGrad* grad);

  // ---- mixture of experts: routing, permutation by expert, weighted combine ------
  // rows tokens routed over E experts, k of them each (1 <= k <= E); rows * k
  // "assignments" (r, j), ordered by expert into "slots".
  //
  // moe_route: logits [rows, E] (float storage) -> probs fp32 [rows, E] = the
  // softmax in fp32; indices int32 [rows, k] = the k largest, descending, ties
  // to the lower expert (torch.topk's order); weights fp32 [rows, k] = their
  // probabilities, divided by their sum when `renormalize`; offsets int32
  // [E + 1]: expert e's assignments are slots [offsets[e], offsets[e + 1]);
  // slots int32 [rows, k] = the slot of assignment (r, j); tokens int32
  // [rows * k] = the row of each slot. Within an expert, slots follow the rows
  // (stable, deterministic). aux_stats fp64 [2, E], unless empty, ACCUMULATES
  // per expert the number of assignments (row 0) and the sum of probs over
  // rows (row 1): the load-balancing loss's statistics (moe_aux_loss).
  void moe_route(ComputeContext& ctx, const TensorView& logits, int64_t top_k, bool renormalize,
                 const TensorView& probs, const TensorView& indices, const TensorView& weights,
                 const TensorView& offsets, const TensorView& slots, const TensorView& tokens,
                 const TensorView& aux_stats);
  // The same with any router (moe_routing.h): kSoftmax as above; kSigmoid
  // (DeepSeek-V3's) with probs = the sigmoid scores, the choice by probs +
  // correction_bias (fp32 [E]; empty: none) within router.topk_groups of
  // router.groups groups, weights the chosen probs (renormalised with
  // transformers' 1e-20) times router.scaling. kSigmoid takes no aux_stats
  // (transformers' sigmoid routers have no load-balancing loss).
  void moe_route(ComputeContext& ctx, const TensorView& logits, int64_t top_k, const MoeRouter& router,
                 const TensorView& correction_bias, const TensorView& probs, const TensorView& indices,
                 const TensorView& weights, const TensorView& offsets, const TensorView& slots,
                 const TensorView& tokens, const TensorView& aux_stats);
  // The backward of moe_route's weights: dweights fp32 [rows, k] -> dlogits
  // [rows, E] (float storage, overwritten) through the renormalisation and the
  // softmax; aux_grad fp32 [E], unless empty, is d loss / d probs[r, e] of the
  // load-balancing loss (the same for every row), added before the softmax's
  // backward. The top-k choice itself has no gradient.
  void moe_route_backward(ComputeContext& ctx, const TensorView& probs, const TensorView& indices,
                          const TensorView& weights, const TensorView& dweights, bool renormalize,
                          const TensorView& aux_grad, const TensorView& dlogits);
  // The same with the forward's router: kSigmoid's through its scaling, its
  // renormalisation and the sigmoid (dlogit = dp p (1 - p)); no aux_grad.
  void moe_route_backward(ComputeContext& ctx, const TensorView& probs, const TensorView& indices,
                          const TensorView& weights, const TensorView& dweights, const MoeRouter& router,
                          const TensorView& aux_grad, const TensorView& dlogits);
  // xp [rows * k, dim]: slot s holds x[tokens[s]] (x [rows, dim], same dtype).
  void moe_gather(ComputeContext& ctx, const TensorView& x, const TensorView& tokens,
                  const TensorView& xp);
  // dx [rows, dim] = sum over j of dxp[slots[r, j]] (+= when accumulate).
  void moe_gather_backward(ComputeContext& ctx, const TensorView& dxp, const TensorView& slots,
                           const TensorView& dx, bool accumulate);
  // y [rows, dim] = sum over j (ascending) of weights[r, j] * yp[slots[r, j]].
  void moe_combine(ComputeContext& ctx, const TensorView& yp, const TensorView& slots,
                   const TensorView& weights, const TensorView& y);
  // dyp [rows * k, dim]: slot slots[r, j] = weights[r, j] * dy[r]; dweights
  // fp32 [rows, k] = <dy[r], yp[slots[r, j]]> (both overwritten).
  void moe_combine_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& yp,
                            const TensorView& slots, const TensorView& weights,
                            const TensorView& dyp, const TensorView& dweights);
  // The load-balancing loss of transformers' load_balancing_loss_func from
  // moe_route's aux_stats summed over every layer: with n = `rows` (tokens
  // times layers), aux fp64 [1] = E * sum_e (count_e / n) * (probsum_e / n),
  // and aux_grad fp32 [E] = scale * E * count_e / n^2 (the gradient of scale *
  // aux with respect to each probability; the counts carry none).
  void moe_aux_loss(ComputeContext& ctx, const TensorView& aux_stats, double rows, double scale,
                    const TensorView& aux, const TensorView& aux_grad);
  // A gated shared expert (qwen2_moe): y[r] += sigmoid(gate[r]) * v[r], with
  // v and y [rows, dim] and gate [rows, 1] (the gate's logit), one float
  // storage dtype; computed in fp32, y rounded once.
  void sigmoid_gated_add(ComputeContext& ctx, const TensorView& v, const TensorView& gate,
                         const TensorView& y);
  // Its backward from dy [rows, dim]: dv[r] = sigmoid(gate[r]) * dy[r] and
  // dgate[r] = sigmoid'(gate[r]) * <dy[r], v[r]> (both overwritten).
  void sigmoid_gated_add_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& v,
                                  const TensorView& gate, const TensorView& dv, const TensorView& dgate);

  // ---- casts: dst = src converted (same shape, any float storage dtypes) ---------
  void cast(ComputeContext& ctx, const TensorView& src, const TensorView& dst);

  // ---- FP8 block-quantized weights (kernels/fp8_blocks.h) -------------------------
  // out (float storage, [rows, cols]) = weight (fp8_e4m3 [rows, cols])
  // dequantized by scale_inv (fp32 [ceil(rows / block_rows), ceil(cols /
  // block_cols)], ragged edge blocks): kernels::dequantize_fp8_blocks' bits
  // on every backend. A frozen base kept in FP8 is dequantized so per gather.
  void dequantize_fp8_blocks(ComputeContext& ctx, const TensorView& weight, const TensorView& scale_inv,
                             int64_t block_rows, int64_t block_cols, const TensorView& out);

  // ---- MXFP4 weights (kernels/mxfp4_blocks.h) -----------------------------------
  // out (float storage, [rows, cols], cols a multiple of 32) = the kept
  // form's `packed` codes (uint8 [rows * cols / 2], two per byte in element
  // order) scaled by `scales` (uint8 e8m0 [rows, cols / 32], one per 32
  // elements): the checkpoint reader's bits (kernels::dequantize_mxfp4) on
  // every backend. A frozen MXFP4 expert kept so at home is dequantized per gather.
  void dequantize_mxfp4_blocks(ComputeContext& ctx, const TensorView& packed, const TensorView& scales,
                               const TensorView& out);

  // ---- the optimizer on the accelerator (offload_optimizer.device none) ---------
  // One Adam/AdamW update of n elements, in place: param (the fp32 master),
  // exp_avg and exp_avg_sq are fp32 [n], grad fp32 [n]; param_copy, unless
  // empty (no data), receives the new values in its float dtype (the 16-bit
  // parameter, or an fp32 copy). The arithmetic is kernels::adam_step's
  // operation for operation (FMA where it fuses, IEEE square root and
  // division, round-to-nearest-even copies), so every backend gives the bits
  // of its AVX2/AVX-512 kernel; the cpu backend runs that kernel.
  void adam_step(ComputeContext& ctx, const kernels::AdamCoefficients& coeffs,
                         const TensorView& param, const TensorView& exp_avg,
                         const TensorView& exp_avg_sq, const TensorView& grad,
                         const TensorView& param_copy);
  // out fp64 [1] = the sum over fp32 grad of x*x, x = grad*scale (an fp32
  // product) widened to fp64 — kernels::grad_stats's sum, not finite when an
  // element is not (its `finite` is std::isfinite of the sum).
  // Deterministic on each backend: the same inputs (and, on cpu, the same
  // thread count) give the same bits; backends may differ in rounding.
  void grad_sum_sq(ComputeContext& ctx, const TensorView& grad, float scale,
                           const TensorView& out);

 protected:
  Ops(Accelerator& accelerator, Backend backend) : accelerator_(accelerator), backend_(backend) {}

 private:
  // What a backend implements. The public op above has checked every
  // argument the contract names (shapes, dtypes, empty views, the context's
  // owner) before it calls one of these, so a backend checks only its own
  // limits (cuda: device memory, 32-bit extents), before it enqueues anything.
  // `ctx` is always one this backend's new_context made.
  virtual std::unique_ptr<ComputeContext> new_context(Stream& stream) = 0;
  // vocab: the whole vocabulary (the table's rows when it is whole).
  virtual void enqueue_embedding_forward(ComputeContext& ctx, const TensorView& table,
                                         const TensorView& ids, const TensorView& out, int64_t first_id,
                                         int64_t vocab, float scale) = 0;
  virtual void enqueue_embedding_backward(ComputeContext& ctx, const TensorView& dout,
                                          const TensorView& ids, const TensorView& dtable,
                                          int64_t padding_idx, int64_t first_id, int64_t vocab,
                                          float scale) = 0;
  virtual void enqueue_rmsnorm_forward(ComputeContext& ctx, const TensorView& x, const TensorView& w,
                                       double eps, const TensorView& y, const TensorView& rstd,
                                       float weight_offset) = 0;
  virtual void enqueue_rmsnorm_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& x,
                                        const TensorView& w, const TensorView& rstd,
                                        const TensorView& dx, bool accumulate_dx,
                                        const TensorView& dw, float weight_offset) = 0;
  // rows > 0.
  virtual void enqueue_linear_forward(ComputeContext& ctx, const MatView& x, const TensorView& w,
                                      const TensorView& bias, const MatView& y, bool accumulate,
                                      float scale) = 0;
  // rows > 0.
  virtual void enqueue_linear_backward(ComputeContext& ctx, const MatView& dy, const MatView& x,
                                       const TensorView& w, const MatView& dx, bool accumulate_dx,
                                       const TensorView& dw, const TensorView& dbias, float scale) = 0;
  // rows > 0, 0 <= p < 1.
  virtual void enqueue_dropout(ComputeContext& ctx, const MatView& x, const MatView& out, float p,
                               uint64_t seed, bool accumulate) = 0;
  // sign +1: the forward rotation, -1: its inverse. x is [rows, heads, head_dim].
  virtual void enqueue_rope(ComputeContext& ctx, const TensorView& x, const TensorView& positions,
                            const Rope& rope, int sign) = 0;
  virtual void enqueue_attention_forward(ComputeContext& ctx, const AttentionShape& shape,
                                         const TensorView& q, const TensorView& k,
                                         const TensorView& v, const TensorView& out,
                                         const TensorView& lse, const AttentionMask& mask) = 0;
  virtual void enqueue_attention_backward(ComputeContext& ctx, const AttentionShape& shape,
                                          const TensorView& dout, const TensorView& q,
                                          const TensorView& k, const TensorView& v,
                                          const TensorView& out, const TensorView& lse,
                                          const TensorView& dq, const TensorView& dk,
                                          const TensorView& dv, const AttentionMask& mask) = 0;
  virtual void enqueue_attention_sinks_backward(ComputeContext& ctx, const AttentionShape& shape,
                                                const TensorView& dout, const TensorView& out,
                                                const TensorView& lse, const AttentionMask& mask,
                                                const TensorView& dsinks) = 0;
  virtual void enqueue_attention_merge(ComputeContext& ctx, const AttentionShape& shape,
                                       const TensorView& out, const TensorView& lse,
                                       const TensorView& part, const TensorView& part_lse) = 0;
  virtual void enqueue_swiglu_forward(ComputeContext& ctx, const TensorView& gate,
                                      const TensorView& up, const TensorView& out, GluActivation act,
                                      const GluClamp& clamp) = 0;
  virtual void enqueue_swiglu_backward(ComputeContext& ctx, const TensorView& dout,
                                       const TensorView& gate, const TensorView& up,
                                       const TensorView& dgate, const TensorView& dup,
                                       GluActivation act, const GluClamp& clamp) = 0;
  virtual void enqueue_add(ComputeContext& ctx, const TensorView& a, const TensorView& b,
                           const TensorView& out) = 0;
  // rows > 0.
  virtual void enqueue_cross_entropy(ComputeContext& ctx, const TensorView& h, const TensorView& w,
                                     const TensorView& targets, int64_t chunk_rows,
                                     const TensorView& lse, const TensorView& stats,
                                     const CrossEntropyGrad* grad, float logit_softcap) = 0;
  virtual void enqueue_count_targets(ComputeContext& ctx, const TensorView& targets,
                                     const TensorView& count) = 0;
  // n > 0.
  virtual void enqueue_vocab_parallel_parts(ComputeContext& ctx, const TensorView& logits,
                                            const TensorView& targets, int64_t first_id,
                                            const TensorView& parts) = 0;
  virtual void enqueue_vocab_parallel_loss(ComputeContext& ctx, const TensorView& logits,
                                           const TensorView& gathered, const TensorView& targets,
                                           int64_t first_id, int64_t vocab, const TensorView& lse,
                                           const TensorView& stats, const VocabParallelGrad* grad) = 0;
  virtual void enqueue_moe_route(ComputeContext& ctx, const TensorView& logits, int64_t top_k,
                                 const MoeRouter& router, const TensorView& correction_bias,
                                 const TensorView& probs, const TensorView& indices, const TensorView& weights,
                                 const TensorView& offsets, const TensorView& slots,
                                 const TensorView& tokens, const TensorView& aux_stats) = 0;
  virtual void enqueue_moe_route_backward(ComputeContext& ctx, const TensorView& probs,
                                          const TensorView& indices, const TensorView& weights,
                                          const TensorView& dweights, const MoeRouter& router,
                                          const TensorView& aux_grad, const TensorView& dlogits) = 0;
  virtual void enqueue_moe_gather(ComputeContext& ctx, const TensorView& x, const TensorView& tokens,
                                  const TensorView& xp) = 0;
  virtual void enqueue_moe_gather_backward(ComputeContext& ctx, const TensorView& dxp,
                                           const TensorView& slots, const TensorView& dx,
                                           bool accumulate) = 0;
  virtual void enqueue_moe_combine(ComputeContext& ctx, const TensorView& yp, const TensorView& slots,
                                   const TensorView& weights, const TensorView& y) = 0;
  virtual void enqueue_moe_combine_backward(ComputeContext& ctx, const TensorView& dy,
                                            const TensorView& yp, const TensorView& slots,
                                            const TensorView& weights, const TensorView& dyp,
                                            const TensorView& dweights) = 0;
  virtual void enqueue_moe_aux_loss(ComputeContext& ctx, const TensorView& aux_stats, double rows,
                                    double scale, const TensorView& aux,
                                    const TensorView& aux_grad) = 0;
  // rows > 0.
  virtual void enqueue_sigmoid_gated_add(ComputeContext& ctx, const TensorView& v, const TensorView& gate,
                                         const TensorView& y) = 0;
  virtual void enqueue_sigmoid_gated_add_backward(ComputeContext& ctx, const TensorView& dy,
                                                  const TensorView& v, const TensorView& gate,
                                                  const TensorView& dv, const TensorView& dgate) = 0;
  virtual void enqueue_cast(ComputeContext& ctx, const TensorView& src, const TensorView& dst) = 0;
  virtual void enqueue_dequantize_fp8_blocks(ComputeContext& ctx, const TensorView& weight,
                                             const TensorView& scale_inv, const kernels::Fp8Blocks& shape,
                                             const TensorView& out) = 0;
  virtual void enqueue_dequantize_mxfp4_blocks(ComputeContext& ctx, const TensorView& packed,
                                               const TensorView& scales, const kernels::Mxfp4Blocks& shape,
                                               const TensorView& out) = 0;
  // numel > 0.
  virtual void enqueue_adam_step(ComputeContext& ctx, const kernels::AdamCoefficients& coeffs,
                                 const TensorView& param, const TensorView& exp_avg,
                                 const TensorView& exp_avg_sq, const TensorView& grad,
                                 const TensorView& param_copy) = 0;
  virtual void enqueue_grad_sum_sq(ComputeContext& ctx, const TensorView& grad, float scale,
                                   const TensorView& out) = 0;

  // The context after checking that these Ops made it (Error(kBadArgument) naming `op`).
  ComputeContext& own(ComputeContext& ctx, const char* op) const;
  // Labels a context's op for one enqueue_* call while recording a trace (ops.cc).
  class Labeled;

  Accelerator& accelerator_;
  const Backend backend_;
};

// The cpu implementation. Never fails.
std::unique_ptr<Ops> make_cpu_ops(Accelerator& accelerator);
// Threads each cpu op uses (its OpenMP team, which OpenBLAS's GEMMs share), for
// every cpu Ops object of the process; 0 (the default): OpenMP's default
// (OMP_NUM_THREADS, else one per core). Takes effect from the next op that runs.
void set_cpu_threads(int threads);
// The OpenBLAS kernel set the cpu ops use and why ("SkylakeX (chosen by strata
// from the CPU's features)"); loads OpenBLAS if needed (kernels/cpu/blas.h).
std::string cpu_blas_core();
// The cuda implementation; Error(kCuda) in builds without CUDA.
std::unique_ptr<Ops> make_cuda_ops(Accelerator& accelerator);
// The implementation for `accelerator`'s backend.
std::unique_ptr<Ops> make_ops(Accelerator& accelerator);

}  // namespace strata::ops
