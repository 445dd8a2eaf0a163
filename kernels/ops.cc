// The Ops front end (kernels/ops.h): every op's argument checks, written once
// so that every backend refuses the same calls with the same message, then the
// call into the backend. And the MatView helpers.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/ops.h"
#include "core/error.h"
#include "core/trace_recorder.h"

namespace strata::ops {

MatView MatView::of(const TensorView& t) {
  const Shape& s = t.desc.shape;
  const int64_t cols = s.empty() ? 1 : s.back();
  const int64_t rows = cols == 0 ? 0 : t.numel() / cols;
  return MatView{t.data, t.desc.dtype, rows, cols, cols};
}

MatView MatView::columns(int64_t c0, int64_t c1) const {
  STRATA_CHECK(0 <= c0 && c0 <= c1 && c1 <= cols, kBadArgument,
               "columns [{}, {}) of a matrix with {} columns", c0, c1, cols);
  return MatView{data == nullptr ? nullptr
                                 : static_cast<char*>(data) + c0 * static_cast<int64_t>(dtype_nbytes(dtype)),
                 dtype, rows, c1 - c0, ld};
}

MatView MatView::row_block(int64_t r0, int64_t r1) const {
  STRATA_CHECK(0 <= r0 && r0 <= r1 && r1 <= rows, kBadArgument, "rows [{}, {}) of a matrix with {} rows",
               r0, r1, rows);
  return MatView{data == nullptr ? nullptr
                                 : static_cast<char*>(data) + r0 * ld * static_cast<int64_t>(dtype_nbytes(dtype)),
                 dtype, r1 - r0, cols, ld};
}

namespace {
namespace check {

void float_tensor(std::string_view op, std::string_view what, const TensorView& t) {
  STRATA_CHECK(t.data != nullptr, kBadArgument, "{}: {} is empty (no data)", op, what);
  STRATA_CHECK(is_float_storage(t.desc.dtype), kBadArgument,
               "{}: {} has dtype {}; expected fp32, fp16 or bf16", op, what,
               dtype_name(t.desc.dtype));
  STRATA_CHECK(t.desc.tier != Tier::kNvme, kBadArgument, "{}: {} is on NVMe, not addressable", op,
               what);
}

void dtype(std::string_view op, std::string_view what, const TensorView& t, DType want) {
  STRATA_CHECK(t.data != nullptr, kBadArgument, "{}: {} is empty (no data)", op, what);
  STRATA_CHECK(t.desc.dtype == want, kBadArgument, "{}: {} has dtype {}; expected {}", op, what,
               dtype_name(t.desc.dtype), dtype_name(want));
}

void shape(std::string_view op, std::string_view what, const TensorView& t, const Shape& want) {
  STRATA_CHECK(t.desc.shape == want, kBadArgument, "{}: {} has shape {}; expected {}", op, what,
               shape_string(t.desc.shape), shape_string(want));
}

void same_dtype(std::string_view op, const TensorView& a, const TensorView& b) {
  STRATA_CHECK(a.desc.dtype == b.desc.dtype, kBadArgument,
               "{}: activations must share one dtype (got {} and {})", op,
               dtype_name(a.desc.dtype), dtype_name(b.desc.dtype));
}

void numel(std::string_view op, std::string_view what, const TensorView& t, int64_t want) {
  STRATA_CHECK(t.numel() == want, kBadArgument, "{}: {} has {} elements ({}); expected {}", op,
               what, t.numel(), shape_string(t.desc.shape), want);
}

void finite_scale(std::string_view op, float scale) {
  STRATA_CHECK(std::isfinite(scale), kBadArgument, "{}: scale {} is not finite", op, scale);
}

void attention_mask(std::string_view op, const AttentionMask& mask, const AttentionShape& s) {
  STRATA_CHECK(mask.window >= 0, kBadArgument, "{}: sliding window {} < 0", op, mask.window);
  STRATA_CHECK((mask.segment_start == nullptr) == (mask.segment_end == nullptr), kBadArgument,
               "{}: packed documents need both their starts and their ends", op);
  STRATA_CHECK(mask.q_offset >= 0 && mask.kv_offset >= 0, kBadArgument,
               "{}: block offsets must be >= 0 (queries at {}, keys at {})", op, mask.q_offset,
               mask.kv_offset);
  // The document arrays cover the whole sequence, so at least as far as both
  // blocks reach (a block of the sequence reads its part of them).
  const int64_t reach = std::max(mask.q_offset + s.seq, mask.kv_offset + s.keys());
  STRATA_CHECK(!mask.has_segments() || mask.seq >= reach, kBadArgument,
               "{}: the document arrays have {} entries per row, the sequence {}", op, mask.seq, reach);
  STRATA_CHECK(std::isfinite(mask.scale) && mask.scale >= 0, kBadArgument,
               "{}: score scale {} must be 0 (1/sqrt(head_dim)) or positive", op, mask.scale);
  STRATA_CHECK(std::isfinite(mask.softcap) && mask.softcap >= 0, kBadArgument,
               "{}: score soft cap {} must be 0 (none) or positive", op, mask.softcap);
  // A block's partial softmax would count the sink once per block.
  STRATA_CHECK(mask.sinks == nullptr || (mask.q_offset == 0 && mask.kv_offset == 0 && s.keys() == s.seq),
               kBadArgument,
               "{}: attention sinks with a key block of its own (context parallelism) are not implemented "
               "(queries at {}, keys at {}, {} keys for {} queries)",
               op, mask.q_offset, mask.kv_offset, s.keys(), s.seq);
}

void glu(std::string_view op, GluActivation act, const GluClamp& c) {
  STRATA_CHECK(act == GluActivation::kSilu || act == GluActivation::kGeluTanh || act == GluActivation::kClampedSwiglu,
               kBadArgument, "{}: unknown activation {}", op, static_cast<int>(act));
  if (act != GluActivation::kClampedSwiglu) return;
  STRATA_CHECK(std::isfinite(c.alpha) && std::isfinite(c.limit) && c.limit > 0, kBadArgument,
               "{}: the clamped SwiGLU needs a finite alpha and a positive finite limit (got {} and {})", op,
               c.alpha, c.limit);
}

void rope(std::string_view op, const Rope& r) {
  STRATA_CHECK(r.theta > 0 && std::isfinite(r.theta), kBadArgument, "{}: rope theta {} must be positive", op,
               r.theta);
  STRATA_CHECK(r.type == RopeType::kDefault || r.type == RopeType::kLinear || r.type == RopeType::kLlama3 ||
                   r.type == RopeType::kYarn,
               kBadArgument, "{}: unknown rope type {}", op, static_cast<int>(r.type));
  if (r.type == RopeType::kDefault) return;
  STRATA_CHECK(r.factor >= 1 && std::isfinite(r.factor), kBadArgument, "{}: rope factor {} must be >= 1", op,
               r.factor);
  if (r.type == RopeType::kYarn) {
    STRATA_CHECK(r.original_max_position_embeddings > 0 && std::isfinite(r.original_max_position_embeddings) &&
                     std::isfinite(r.beta_fast) && std::isfinite(r.beta_slow) && std::isfinite(r.mscale) &&
                     std::isfinite(r.mscale_all_dim) && std::isfinite(r.attention_factor) &&
                     r.attention_factor >= 0,
                 kBadArgument,
                 "{}: yarn rope needs a positive original_max_position_embeddings, finite betas and mscales and "
                 "a non-negative attention_factor (got {}, {}, {}, {}, {}, {})",
                 op, r.original_max_position_embeddings, r.beta_fast, r.beta_slow, r.mscale, r.mscale_all_dim,
                 r.attention_factor);
    return;
  }
  if (r.type != RopeType::kLlama3) return;
  STRATA_CHECK(r.low_freq_factor > 0 && r.high_freq_factor > r.low_freq_factor &&
                   std::isfinite(r.high_freq_factor) && r.original_max_position_embeddings > 0,
               kBadArgument,
               "{}: llama3 rope needs 0 < low_freq_factor < high_freq_factor and a positive "
               "original_max_position_embeddings (got {}, {}, {})",
               op, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings);
}

// A router's own consistency (moe_routing.h): kSigmoid's groups divide the
// experts, topk_groups of them hold at least top_k experts, a finite scaling.
void moe_router(std::string_view op, const MoeRouter& r, int64_t experts, int64_t top_k) {
  STRATA_CHECK(r.scores == MoeScores::kSoftmax || r.scores == MoeScores::kSigmoid, kBadArgument,
               "{}: unknown router scores {}", op, static_cast<int>(r.scores));
  if (r.scores == MoeScores::kSoftmax) {
    STRATA_CHECK(r.groups == 1 && r.topk_groups == 1 && r.scaling == 1.0f, kBadArgument,
                 "{}: the softmax router takes no groups or scaling (got groups {}, topk_groups {}, scaling {})",
                 op, r.groups, r.topk_groups, r.scaling);
    return;
  }
  STRATA_CHECK(r.groups >= 1 && experts % r.groups == 0 && r.topk_groups >= 1 && r.topk_groups <= r.groups,
               kBadArgument, "{}: {} groups with {} kept must divide the {} experts and keep at least one", op,
               r.groups, r.topk_groups, experts);
  STRATA_CHECK(r.topk_groups * (experts / r.groups) >= top_k, kBadArgument,
               "{}: top_k {} is more than the {} experts of the {} groups kept", op, top_k,
               r.topk_groups * (experts / r.groups), r.topk_groups);
  STRATA_CHECK(std::isfinite(r.scaling), kBadArgument, "{}: router scaling {} must be finite", op, r.scaling);
}

AttentionShape attention(std::string_view op, const TensorView& q, const TensorView& k,
                         const TensorView& v) {
  float_tensor(op, "q", q);
  float_tensor(op, "k", k);
  float_tensor(op, "v", v);
  same_dtype(op, q, k);
  same_dtype(op, q, v);
  STRATA_CHECK(q.desc.shape.size() == 4 && k.desc.shape.size() == 4, kBadArgument,
               "{}: q and k must be 4-D [batch, seq, heads, head_dim] (got {} and {})", op,
               shape_string(q.desc.shape), shape_string(k.desc.shape));
  AttentionShape s{q.desc.shape[0], q.desc.shape[1], q.desc.shape[2], k.desc.shape[2],
                   q.desc.shape[3], k.desc.shape[1]};
  STRATA_CHECK(s.batch > 0 && s.seq > 0 && s.heads > 0 && s.kv_heads > 0 && s.head_dim > 0 &&
                   s.kv_seq > 0 && s.heads % s.kv_heads == 0,
               kBadArgument,
               "{}: bad shape batch={} seq={} heads={} kv_heads={} head_dim={} keys={} (heads must be a "
               "multiple of kv_heads)",
               op, s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, s.kv_seq);
  shape(op, "k", k, {s.batch, s.kv_seq, s.kv_heads, s.head_dim});
  shape(op, "v", v, {s.batch, s.kv_seq, s.kv_heads, s.head_dim});
  return s;
}

void matrix(std::string_view op, std::string_view what, const MatView& m) {
  STRATA_CHECK(m.data != nullptr, kBadArgument, "{}: {} is empty (no data)", op, what);
  STRATA_CHECK(is_float_storage(m.dtype), kBadArgument,
               "{}: {} has dtype {}; expected fp32, fp16 or bf16", op, what, dtype_name(m.dtype));
  STRATA_CHECK(m.rows >= 0 && m.cols > 0 && m.ld >= m.cols, kBadArgument,
               "{}: {} is a bad matrix ({} x {}, ld {})", op, what, m.rows, m.cols, m.ld);
}

void elementwise(std::string_view op, std::initializer_list<const TensorView*> operands) {
  if (operands.size() == 0) return;
  const TensorView& first = **operands.begin();
  int index = 0;
  for (const TensorView* t : operands) {
    const std::string what = fmt::format("operand {}", index++);
    float_tensor(op, what, *t);
    same_dtype(op, first, *t);
    numel(op, what, *t, first.numel());
  }
}

void adam(std::string_view op, const TensorView& param, const TensorView& exp_avg,
          const TensorView& exp_avg_sq, const TensorView& grad, const TensorView& param_copy) {
  dtype(op, "param", param, DType::kF32);
  dtype(op, "exp_avg", exp_avg, DType::kF32);
  dtype(op, "exp_avg_sq", exp_avg_sq, DType::kF32);
  dtype(op, "grad", grad, DType::kF32);
  numel(op, "exp_avg", exp_avg, param.numel());
  numel(op, "exp_avg_sq", exp_avg_sq, param.numel());
  numel(op, "grad", grad, param.numel());
  if (param_copy.data != nullptr) {
    float_tensor(op, "param_copy", param_copy);
    numel(op, "param_copy", param_copy, param.numel());
  }
}

}  // namespace check

bool empty(const TensorView& t) { return t.data == nullptr; }
bool empty(const MatView& m) { return m.data == nullptr; }

// rope_forward and rope_backward take the same arguments.
void check_rope(std::string_view op, const TensorView& x, const TensorView& positions, const Rope& rope) {
  check::float_tensor(op, "x", x);
  check::rope(op, rope);
  check::dtype(op, "positions", positions, DType::kI32);
  STRATA_CHECK(x.desc.shape.size() == 3 && x.desc.shape[2] % 2 == 0, kBadArgument,
               "{}: x must be [rows, heads, head_dim] with an even head_dim, got {}", op,
               shape_string(x.desc.shape));
  check::numel(op, "positions", positions, x.desc.shape[0]);
  const int64_t head_dim = x.desc.shape[2], rotary = rope_rotary_dim(rope, head_dim);
  STRATA_CHECK(rope.rotary_offset >= 0 && rope.rotary_dim >= 0 && rotary > 0 && rotary % 2 == 0 &&
                   rope.rotary_offset + rotary <= head_dim,
               kBadArgument, "{}: the rotated dims [{}, {} + {}) must be an even, non-empty part of the {}-wide head",
               op, rope.rotary_offset, rope.rotary_offset, rotary, head_dim);
}

uint64_t nbytes(const TensorView& t) { return t.data == nullptr ? 0 : t.nbytes(); }
std::string brief(const TensorView& t) { return fmt::format("{} {}", shape_string(t.desc.shape), dtype_name(t.desc.dtype)); }
std::string brief(const MatView& m) { return fmt::format("{}x{} {}", m.rows, m.cols, dtype_name(m.dtype)); }

// An op's label, by what bounds it: arithmetic (a matrix product) or memory.
OpLabel arithmetic(int64_t flops, std::string shape) { return OpLabel{nullptr, flops, OpLabel{}.bytes, std::move(shape)}; }
OpLabel memory(uint64_t bytes, std::string shape) { return OpLabel{nullptr, 0, bytes, std::move(shape)}; }

// Key positions a query of a causal attention sees, summed over the sequence
// (a sliding window shortens the rows).
double visible_keys(int64_t seq, int64_t window) {
  const double s = static_cast<double>(seq);
  if (window <= 0 || window >= seq) return s * (s + 1) / 2;
  const double w = static_cast<double>(window);
  return w * (w + 1) / 2 + (s - w) * w;  // rows below the window's width, then full windows
}

// Attention's label: `products` products of head_dim-long rows per visible
// (query, key) pair of each head (an upper bound with packed documents: their
// ranges live where the kernels read them).
OpLabel attention_label(const AttentionShape& s, const AttentionMask& mask, const TensorView& q, int products) {
  const bool block = mask.q_offset != 0 || mask.kv_offset != 0 || s.keys() != s.seq;
  const double rows = block ? static_cast<double>(s.seq) * static_cast<double>(s.keys())  // a bound
                            : visible_keys(s.seq, mask.window);
  const double pairs = rows * static_cast<double>(s.batch * s.heads);
  return arithmetic(static_cast<int64_t>(2 * products * pairs * static_cast<double>(s.head_dim)),
                    brief(q) + " kv " + std::to_string(s.kv_heads));
}

}  // namespace

// While recording a trace, the op's label is on its context for the one
// enqueue_* call (the backend reads it when it enqueues); the label is built
// only then, so not recording costs one relaxed load.
class Ops::Labeled {
 public:
  template <typename Describe>
  Labeled(ComputeContext& ctx, const char* name, Describe&& describe) {
    if (!trace::enabled()) [[likely]] return;
    ctx_ = &ctx;
    ctx.op_label_ = describe();
    ctx.op_label_.name = name;
  }
  ~Labeled() {
    if (ctx_ != nullptr) ctx_->op_label_ = OpLabel{};
  }
  Labeled(const Labeled&) = delete;
  Labeled& operator=(const Labeled&) = delete;

 private:
  ComputeContext* ctx_ = nullptr;
};

std::unique_ptr<ComputeContext> Ops::make_context(Stream& stream) {
  std::unique_ptr<ComputeContext> ctx = new_context(stream);
  ctx->owner_ = this;
  return ctx;
}

ComputeContext& Ops::own(ComputeContext& ctx, const char* op) const {
  STRATA_CHECK(ctx.owner_ == this, kBadArgument, "{}: the context was made by another Ops object", op);
  return ctx;
}

namespace {
// The whole vocabulary of an embedding op's table rows `rows` (a shard when
// vocab > 0), refusing a shard that does not fit in it.
int64_t embedding_vocab(const char* op, int64_t rows, int64_t first_id, int64_t vocab) {
  if (vocab == 0) {
    STRATA_CHECK(first_id == 0, kBadArgument, "{}: first_id {} needs the whole vocabulary (vocab)", op, first_id);
    return rows;
  }
  STRATA_CHECK(first_id >= 0 && vocab > 0 && first_id + rows <= vocab, kBadArgument,
               "{}: a shard of {} rows from id {} does not fit a vocabulary of {}", op, rows, first_id, vocab);
  return vocab;
}
}  // namespace

void Ops::embedding_forward(ComputeContext& ctx, const TensorView& table, const TensorView& ids,
                            const TensorView& out, int64_t first_id, int64_t vocab, float scale) {
  constexpr const char* op = "embedding_forward";
  own(ctx, op);
  check::float_tensor(op, "table", table);
  check::dtype(op, "ids", ids, DType::kI32);
  check::float_tensor(op, "out", out);
  STRATA_CHECK(table.desc.shape.size() == 2, kBadArgument, "{}: table must be 2-D, got {}", op,
               shape_string(table.desc.shape));
  check::shape(op, "out", out, {ids.numel(), table.desc.shape[1]});
  vocab = embedding_vocab(op, table.desc.shape[0], first_id, vocab);
  Labeled label(ctx, op, [&] { return memory(nbytes(out) * 2 + nbytes(ids), brief(out)); });
  STRATA_CHECK(std::isfinite(scale), kBadArgument, "{}: scale {} is not finite", op, scale);
  enqueue_embedding_forward(ctx, table, ids, out, first_id, vocab, scale);
}

void Ops::embedding_backward(ComputeContext& ctx, const TensorView& dout, const TensorView& ids,
                             const TensorView& dtable, int64_t padding_idx, int64_t first_id, int64_t vocab,
                             float scale) {
  constexpr const char* op = "embedding_backward";
  own(ctx, op);
  if (empty(dtable)) return;  // a frozen table: no gradient
  check::float_tensor(op, "dout", dout);
  check::dtype(op, "ids", ids, DType::kI32);
  check::dtype(op, "dtable", dtable, DType::kF32);
  STRATA_CHECK(dtable.desc.shape.size() == 2, kBadArgument, "{}: dtable must be 2-D, got {}", op,
               shape_string(dtable.desc.shape));
  check::shape(op, "dout", dout, {ids.numel(), dtable.desc.shape[1]});
  vocab = embedding_vocab(op, dtable.desc.shape[0], first_id, vocab);
  if (ids.numel() == 0) return;
  Labeled label(ctx, op, [&] {
    return memory(nbytes(dout) + nbytes(ids) + static_cast<uint64_t>(dout.numel()) * 8, brief(dout));
  });
  STRATA_CHECK(std::isfinite(scale), kBadArgument, "{}: scale {} is not finite", op, scale);
  enqueue_embedding_backward(ctx, dout, ids, dtable, padding_idx, first_id, vocab, scale);
}

void Ops::rmsnorm_forward(ComputeContext& ctx, const TensorView& x, const TensorView& w, double eps,
                          const TensorView& y, const TensorView& rstd, float weight_offset) {
  constexpr const char* op = "rmsnorm_forward";
  own(ctx, op);
  check::float_tensor(op, "x", x);
  check::float_tensor(op, "w", w);
  check::float_tensor(op, "y", y);
  check::same_dtype(op, x, y);
  check::dtype(op, "rstd", rstd, DType::kF32);
  const MatView xm = MatView::of(x);
  check::shape(op, "w", w, {xm.cols});
  check::shape(op, "y", y, x.desc.shape);
  check::numel(op, "rstd", rstd, xm.rows);
  Labeled label(ctx, op, [&] { return memory(nbytes(x) + nbytes(y) + nbytes(w), brief(x)); });
  STRATA_CHECK(std::isfinite(weight_offset), kBadArgument, "{}: weight_offset {} is not finite", op, weight_offset);
  enqueue_rmsnorm_forward(ctx, x, w, eps, y, rstd, weight_offset);
}

void Ops::rmsnorm_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& x,
                           const TensorView& w, const TensorView& rstd, const TensorView& dx,
                           bool accumulate_dx, const TensorView& dw, float weight_offset) {
  constexpr const char* op = "rmsnorm_backward";
  own(ctx, op);
  for (auto [what, t] : {std::pair{"dy", &dy}, {"x", &x}, {"w", &w}, {"dx", &dx}}) {
    check::float_tensor(op, what, *t);
  }
  check::same_dtype(op, dy, x);
  check::same_dtype(op, dy, dx);
  check::dtype(op, "rstd", rstd, DType::kF32);
  const MatView xm = MatView::of(x);
  check::shape(op, "dy", dy, x.desc.shape);
  check::shape(op, "dx", dx, x.desc.shape);
  check::shape(op, "w", w, {xm.cols});
  if (!empty(dw)) {  // empty: a frozen weight
    check::dtype(op, "dw", dw, DType::kF32);
    check::shape(op, "dw", dw, {xm.cols});
  }
  check::numel(op, "rstd", rstd, xm.rows);
  if (xm.rows == 0) return;
  Labeled label(ctx, op, [&] {
    return memory(nbytes(dy) + nbytes(x) + nbytes(dx) * (accumulate_dx ? 2 : 1), brief(x));
  });
  STRATA_CHECK(std::isfinite(weight_offset), kBadArgument, "{}: weight_offset {} is not finite", op, weight_offset);
  enqueue_rmsnorm_backward(ctx, dy, x, w, rstd, dx, accumulate_dx, dw, weight_offset);
}

void Ops::linear_forward(ComputeContext& ctx, const MatView& x, const TensorView& w,
                         const TensorView& bias, const MatView& y, bool accumulate, float scale) {
  constexpr const char* op = "linear_forward";
  own(ctx, op);
  check::finite_scale(op, scale);
  check::matrix(op, "x", x);
  check::matrix(op, "y", y);
  check::float_tensor(op, "w", w);
  STRATA_CHECK(x.dtype == y.dtype, kBadArgument, "{}: x is {} but y is {}", op, dtype_name(x.dtype),
               dtype_name(y.dtype));
  STRATA_CHECK(w.desc.shape.size() == 2, kBadArgument, "{}: w must be 2-D, got {}", op,
               shape_string(w.desc.shape));
  const int64_t out = w.desc.shape[0], in = w.desc.shape[1];
  STRATA_CHECK(x.cols == in && y.cols == out && y.rows == x.rows, kBadArgument,
               "{}: x is {} x {}, w is [{}, {}], y is {} x {}", op, x.rows, x.cols, out, in, y.rows,
               y.cols);
  if (!empty(bias)) {
    check::float_tensor(op, "bias", bias);
    check::shape(op, "bias", bias, {out});
  }
  if (x.rows == 0) return;
  Labeled label(ctx, op, [&] {
    return arithmetic(2 * x.rows * in * out, brief(x) + " * " + brief(w));
  });
  enqueue_linear_forward(ctx, x, w, bias, y, accumulate, scale);
}

void Ops::linear_backward(ComputeContext& ctx, const MatView& dy, const MatView& x, const TensorView& w,
                          const MatView& dx, bool accumulate_dx, const TensorView& dw,
                          const TensorView& dbias, float scale) {
  constexpr const char* op = "linear_backward";
  own(ctx, op);
  check::finite_scale(op, scale);
  check::matrix(op, "dy", dy);
  check::matrix(op, "x", x);
  check::float_tensor(op, "w", w);
  STRATA_CHECK(w.desc.shape.size() == 2, kBadArgument, "{}: w must be 2-D, got {}", op,
               shape_string(w.desc.shape));
  const int64_t out = w.desc.shape[0], in = w.desc.shape[1], rows = dy.rows;
  STRATA_CHECK(dy.cols == out && x.cols == in && x.rows == rows && dy.dtype == x.dtype, kBadArgument,
               "{}: dy is {} x {} ({}), x is {} x {} ({}), w is [{}, {}]", op, dy.rows, dy.cols,
               dtype_name(dy.dtype), x.rows, x.cols, dtype_name(x.dtype), out, in);
  if (!empty(dx)) {
    check::matrix(op, "dx", dx);
    STRATA_CHECK(dx.rows == rows && dx.cols == in && dx.dtype == dy.dtype, kBadArgument,
                 "{}: dx is {} x {} ({}), expected {} x {} ({})", op, dx.rows, dx.cols,
                 dtype_name(dx.dtype), rows, in, dtype_name(dy.dtype));
  }
  if (!empty(dw)) {
    check::dtype(op, "dw", dw, DType::kF32);
    check::shape(op, "dw", dw, {out, in});
  }
  if (!empty(dbias)) {
    check::dtype(op, "dbias", dbias, DType::kF32);
    check::shape(op, "dbias", dbias, {out});
  }
  if (rows == 0) return;
  Labeled label(ctx, op, [&] {
    const int64_t gemm = 2 * rows * in * out;
    return arithmetic((empty(dx) ? 0 : gemm) + (empty(dw) ? 0 : gemm) + (empty(dbias) ? 0 : rows * out),
                      brief(dy) + " * " + brief(w));
  });
  enqueue_linear_backward(ctx, dy, x, w, dx, accumulate_dx, dw, dbias, scale);
}

void Ops::dropout(ComputeContext& ctx, const MatView& x, const MatView& out, float p, uint64_t seed,
                  bool accumulate) {
  constexpr const char* op = "dropout";
  own(ctx, op);
  check::matrix(op, "x", x);
  check::matrix(op, "out", out);
  STRATA_CHECK(x.rows == out.rows && x.cols == out.cols && x.dtype == out.dtype, kBadArgument,
               "{}: x is {} x {} ({}), out {} x {} ({})", op, x.rows, x.cols, dtype_name(x.dtype), out.rows, out.cols,
               dtype_name(out.dtype));
  STRATA_CHECK(p >= 0 && p < 1, kBadArgument, "{}: p {} is not in [0, 1)", op, p);
  STRATA_CHECK(!(accumulate && x.data == out.data), kBadArgument, "{}: accumulating into x itself", op);
  if (x.rows == 0) return;
  Labeled label(ctx, op, [&] {
    const uint64_t n = static_cast<uint64_t>(x.rows * x.cols) * dtype_nbytes(x.dtype);
    return memory((accumulate ? 3 : 2) * n, brief(x));
  });
  enqueue_dropout(ctx, x, out, p, seed, accumulate);
}

void Ops::copy(ComputeContext& ctx, const MatView& x, const MatView& out, bool accumulate) {
  constexpr const char* op = "copy";
  own(ctx, op);
  check::matrix(op, "x", x);
  check::matrix(op, "out", out);
  STRATA_CHECK(x.rows == out.rows && x.cols == out.cols && x.dtype == out.dtype, kBadArgument,
               "{}: x is {} x {} ({}), out {} x {} ({})", op, x.rows, x.cols, dtype_name(x.dtype), out.rows, out.cols,
               dtype_name(out.dtype));
  STRATA_CHECK(x.data != out.data, kBadArgument, "{}: x and out are the same matrix", op);
  if (x.rows == 0 || x.cols == 0) return;
  Labeled label(ctx, op, [&] {
    const uint64_t n = static_cast<uint64_t>(x.rows * x.cols) * dtype_nbytes(x.dtype);
    return memory((accumulate ? 3 : 2) * n, brief(x));
  });
  enqueue_dropout(ctx, x, out, 0.0f, 0, accumulate);
}

void Ops::rope_forward(ComputeContext& ctx, const TensorView& x, const TensorView& positions,
                       const Rope& rope) {
  own(ctx, "rope_forward");
  check_rope("rope_forward", x, positions, rope);
  Labeled label(ctx, "rope_forward", [&] { return memory(2 * nbytes(x), brief(x)); });
  enqueue_rope(ctx, x, positions, rope, +1);
}

void Ops::rope_backward(ComputeContext& ctx, const TensorView& dx, const TensorView& positions,
                        const Rope& rope) {
  own(ctx, "rope_backward");
  check_rope("rope_backward", dx, positions, rope);
  Labeled label(ctx, "rope_backward", [&] { return memory(2 * nbytes(dx), brief(dx)); });
  enqueue_rope(ctx, dx, positions, rope, -1);
}

void Ops::attention_forward(ComputeContext& ctx, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out, const TensorView& lse,
                            const AttentionMask& mask) {
  constexpr const char* op = "attention_forward";
  own(ctx, op);
  const AttentionShape s = check::attention(op, q, k, v);
  check::attention_mask(op, mask, s);
  check::float_tensor(op, "out", out);
  check::same_dtype(op, q, out);
  check::shape(op, "out", out, q.desc.shape);
  check::dtype(op, "lse", lse, DType::kF32);
  check::shape(op, "lse", lse, {s.batch, s.heads, s.seq});
  // Q K^T and P V.
  Labeled label(ctx, op, [&] { return attention_label(s, mask, q, 2); });
  enqueue_attention_forward(ctx, s, q, k, v, out, lse, mask);
}

void Ops::attention_backward(ComputeContext& ctx, const TensorView& dout, const TensorView& q,
                             const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& lse, const TensorView& dq, const TensorView& dk,
                             const TensorView& dv, const AttentionMask& mask) {
  constexpr const char* op = "attention_backward";
  own(ctx, op);
  const AttentionShape s = check::attention(op, q, k, v);
  check::attention_mask(op, mask, s);
  for (auto [what, t] : {std::pair{"dout", &dout}, {"out", &out}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}}) {
    check::float_tensor(op, what, *t);
    check::same_dtype(op, q, *t);
  }
  check::shape(op, "dout", dout, q.desc.shape);
  check::shape(op, "out", out, q.desc.shape);
  check::shape(op, "dq", dq, q.desc.shape);
  check::shape(op, "dk", dk, k.desc.shape);
  check::shape(op, "dv", dv, v.desc.shape);
  check::dtype(op, "lse", lse, DType::kF32);
  check::shape(op, "lse", lse, {s.batch, s.heads, s.seq});
  // Q K^T recomputed, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q.
  Labeled label(ctx, op, [&] { return attention_label(s, mask, q, 5); });
  enqueue_attention_backward(ctx, s, dout, q, k, v, out, lse, dq, dk, dv, mask);
}

void Ops::attention_sinks_backward(ComputeContext& ctx, const TensorView& dout, const TensorView& out,
                                   const TensorView& lse, const AttentionMask& mask, const TensorView& dsinks) {
  constexpr const char* op = "attention_sinks_backward";
  own(ctx, op);
  STRATA_CHECK(mask.sinks != nullptr, kBadArgument, "{}: the mask has no sinks", op);
  check::float_tensor(op, "dout", dout);
  check::float_tensor(op, "out", out);
  check::same_dtype(op, dout, out);
  STRATA_CHECK(out.desc.shape.size() == 4, kBadArgument,
               "{}: out must be 4-D [batch, seq, heads, head_dim] (got {})", op, shape_string(out.desc.shape));
  check::shape(op, "dout", dout, out.desc.shape);
  const AttentionShape s{out.desc.shape[0], out.desc.shape[1], out.desc.shape[2], out.desc.shape[2],
                         out.desc.shape[3]};
  check::attention_mask(op, mask, s);
  check::dtype(op, "lse", lse, DType::kF32);
  check::shape(op, "lse", lse, {s.batch, s.heads, s.seq});
  check::dtype(op, "dsinks", dsinks, DType::kF32);
  check::shape(op, "dsinks", dsinks, {s.heads});
  Labeled label(ctx, op, [&] { return memory(2 * nbytes(out) + nbytes(lse), brief(out)); });
  enqueue_attention_sinks_backward(ctx, s, dout, out, lse, mask, dsinks);
}

void Ops::attention_merge(ComputeContext& ctx, const TensorView& out, const TensorView& lse,
                          const TensorView& part, const TensorView& part_lse) {
  constexpr const char* op = "attention_merge";
  own(ctx, op);
  check::dtype(op, "out", out, DType::kF32);
  check::float_tensor(op, "part", part);
  STRATA_CHECK(out.desc.shape.size() == 4, kBadArgument,
               "{}: out must be 4-D [batch, seq, heads, head_dim] (got {})", op, shape_string(out.desc.shape));
  check::shape(op, "part", part, out.desc.shape);
  const AttentionShape s{out.desc.shape[0], out.desc.shape[1], out.desc.shape[2], out.desc.shape[2],
                         out.desc.shape[3]};
  check::dtype(op, "lse", lse, DType::kF32);
  check::dtype(op, "part_lse", part_lse, DType::kF32);
  check::shape(op, "lse", lse, {s.batch, s.heads, s.seq});
  check::shape(op, "part_lse", part_lse, {s.batch, s.heads, s.seq});
  Labeled label(ctx, op, [&] { return memory(2 * nbytes(out) + nbytes(part) + 3 * nbytes(lse), brief(out)); });
  enqueue_attention_merge(ctx, s, out, lse, part, part_lse);
}

void Ops::swiglu_forward(ComputeContext& ctx, const TensorView& gate, const TensorView& up,
                         const TensorView& out, GluActivation act, const GluClamp& clamp) {
  own(ctx, "swiglu_forward");
  check::elementwise("swiglu_forward", {&gate, &up, &out});
  check::glu("swiglu_forward", act, clamp);
  Labeled label(ctx, "swiglu_forward", [&] { return memory(3 * nbytes(out), brief(out)); });
  enqueue_swiglu_forward(ctx, gate, up, out, act, clamp);
}

void Ops::swiglu_backward(ComputeContext& ctx, const TensorView& dout, const TensorView& gate,
                          const TensorView& up, const TensorView& dgate, const TensorView& dup,
                          GluActivation act, const GluClamp& clamp) {
  own(ctx, "swiglu_backward");
  check::elementwise("swiglu_backward", {&dout, &gate, &up, &dgate, &dup});
  check::glu("swiglu_backward", act, clamp);
  Labeled label(ctx, "swiglu_backward", [&] { return memory(5 * nbytes(dout), brief(dout)); });
  enqueue_swiglu_backward(ctx, dout, gate, up, dgate, dup, act, clamp);
}

void Ops::add(ComputeContext& ctx, const TensorView& a, const TensorView& b, const TensorView& out) {
  own(ctx, "add");
  check::elementwise("add", {&a, &b, &out});
  Labeled label(ctx, "add", [&] { return memory(3 * nbytes(out), brief(out)); });
  enqueue_add(ctx, a, b, out);
}

void Ops::cross_entropy(ComputeContext& ctx, const TensorView& h, const TensorView& w,
                        const TensorView& targets, int64_t chunk_rows, const TensorView& lse,
                        const TensorView& stats, const CrossEntropyGrad* grad, float logit_softcap) {
  constexpr const char* op = "cross_entropy";
  own(ctx, op);
  check::float_tensor(op, "h", h);
  check::float_tensor(op, "w", w);
  check::dtype(op, "targets", targets, DType::kI32);
  check::dtype(op, "lse", lse, DType::kF32);
  check::dtype(op, "stats", stats, DType::kF64);
  check::numel(op, "stats", stats, 2);
  STRATA_CHECK(w.desc.shape.size() == 2 && chunk_rows > 0, kBadArgument,
               "{}: w must be [vocab, dim] (got {}) and chunk_rows > 0 (got {})", op,
               shape_string(w.desc.shape), chunk_rows);
  const int64_t vocab = w.desc.shape[0], dim = w.desc.shape[1], rows = targets.numel();
  check::shape(op, "h", h, {rows, dim});
  check::numel(op, "lse", lse, rows);
  if (grad != nullptr) {
    check::dtype(op, "normalizer", grad->normalizer, DType::kF64);
    check::numel(op, "normalizer", grad->normalizer, 1);
    check::float_tensor(op, "dh", grad->dh);
    check::same_dtype(op, h, grad->dh);
    check::shape(op, "dh", grad->dh, {rows, dim});
    if (!empty(grad->dw)) {
      check::dtype(op, "dw", grad->dw, DType::kF32);
      check::shape(op, "dw", grad->dw, {vocab, dim});
    }
  }
  if (rows == 0) return;
  Labeled label(ctx, op, [&] {
    const int64_t gemm = 2 * rows * vocab * dim;  // logits; with the gradient dh, and dw when wanted
    return arithmetic(gemm * (grad == nullptr ? 1 : (empty(grad->dw) ? 2 : 3)), brief(h) + " * " + brief(w));
  });
  STRATA_CHECK(std::isfinite(logit_softcap) && logit_softcap >= 0, kBadArgument,
               "{}: logit_softcap {} must be 0 (none) or positive", op, logit_softcap);
  enqueue_cross_entropy(ctx, h, w, targets, chunk_rows, lse, stats, grad, logit_softcap);
}

void Ops::vocab_parallel_parts(ComputeContext& ctx, const TensorView& logits, const TensorView& targets,
                               int64_t first_id, const TensorView& parts) {
  constexpr const char* op = "vocab_parallel_parts";
  own(ctx, op);
  check::float_tensor(op, "logits", logits);
  check::dtype(op, "targets", targets, DType::kI32);
  check::dtype(op, "parts", parts, DType::kF32);
  STRATA_CHECK(logits.desc.shape.size() == 2 && first_id >= 0, kBadArgument,
               "{}: logits must be [rows, shard vocabulary] (got {}) and first_id >= 0 (got {})", op,
               shape_string(logits.desc.shape), first_id);
  const int64_t n = logits.desc.shape[0];
  check::numel(op, "targets", targets, n);
  check::shape(op, "parts", parts, {2, n});
  if (n == 0) return;
  Labeled label(ctx, op, [&] { return memory(nbytes(logits) + nbytes(targets) + nbytes(parts), brief(logits)); });
  enqueue_vocab_parallel_parts(ctx, logits, targets, first_id, parts);
}

void Ops::vocab_parallel_loss(ComputeContext& ctx, const TensorView& logits, const TensorView& gathered,
                              const TensorView& targets, int64_t first_id, int64_t vocab, const TensorView& lse,
                              const TensorView& stats, const VocabParallelGrad* grad) {
  constexpr const char* op = "vocab_parallel_loss";
  own(ctx, op);
  check::float_tensor(op, "logits", logits);
  check::dtype(op, "gathered", gathered, DType::kF32);
  check::dtype(op, "targets", targets, DType::kI32);
  check::dtype(op, "lse", lse, DType::kF32);
  check::dtype(op, "stats", stats, DType::kF64);
  check::numel(op, "stats", stats, 2);
  STRATA_CHECK(logits.desc.shape.size() == 2 && gathered.desc.shape.size() == 3, kBadArgument,
               "{}: logits must be [rows, shard vocabulary] and gathered [ranks, 2, rows] (got {} and {})", op,
               shape_string(logits.desc.shape), shape_string(gathered.desc.shape));
  const int64_t n = logits.desc.shape[0], shard = logits.desc.shape[1], ranks = gathered.desc.shape[0];
  STRATA_CHECK(ranks >= 1 && first_id >= 0 && first_id + shard <= vocab, kBadArgument,
               "{}: a shard of {} columns from id {} does not fit a vocabulary of {}", op, shard, first_id, vocab);
  check::shape(op, "gathered", gathered, {ranks, 2, n});
  check::numel(op, "targets", targets, n);
  check::numel(op, "lse", lse, n);
  if (grad != nullptr) {
    check::dtype(op, "normalizer", grad->normalizer, DType::kF64);
    check::numel(op, "normalizer", grad->normalizer, 1);
  }
  if (n == 0) return;
  Labeled label(ctx, op, [&] {
    return memory(nbytes(logits) * (grad != nullptr ? 2 : 1) + nbytes(gathered) + nbytes(targets) + nbytes(lse),
                  brief(logits));
  });
  enqueue_vocab_parallel_loss(ctx, logits, gathered, targets, first_id, vocab, lse, stats, grad);
}

void Ops::count_targets(ComputeContext& ctx, const TensorView& targets, const TensorView& count) {
  constexpr const char* op = "count_targets";
  own(ctx, op);
  check::dtype(op, "targets", targets, DType::kI32);
  check::dtype(op, "count", count, DType::kF64);
  check::numel(op, "count", count, 1);
  Labeled label(ctx, op, [&] { return memory(nbytes(targets), brief(targets)); });
  enqueue_count_targets(ctx, targets, count);
}

namespace {

// The routing's shape: rows and k from indices [rows, k], E from probs [rows, E].
struct MoeShape {
  int64_t rows, experts, k;
};
MoeShape moe_shape(std::string_view op, const TensorView& probs, const TensorView& indices) {
  check::dtype(op, "probs", probs, DType::kF32);
  check::dtype(op, "indices", indices, DType::kI32);
  STRATA_CHECK(probs.desc.shape.size() == 2 && indices.desc.shape.size() == 2, kBadArgument,
               "{}: probs must be [rows, experts] and indices [rows, k] (got {} and {})", op,
               shape_string(probs.desc.shape), shape_string(indices.desc.shape));
  const MoeShape s{probs.desc.shape[0], probs.desc.shape[1], indices.desc.shape[1]};
  STRATA_CHECK(s.experts > 0 && s.k > 0 && s.k <= s.experts, kBadArgument,
               "{}: top-{} of {} experts (need 1 <= k <= experts)", op, s.k, s.experts);
  check::shape(op, "indices", indices, {s.rows, s.k});
  return s;
}

// x [rows, dim] and its permuted copy xp [rows * k, dim], one float dtype.
void moe_rows(std::string_view op, const char* xname, const TensorView& x, const char* xpname,
              const TensorView& xp, int64_t rows, int64_t k) {
  check::float_tensor(op, xname, x);
  check::float_tensor(op, xpname, xp);
  check::same_dtype(op, x, xp);
  STRATA_CHECK(x.desc.shape.size() == 2 && x.desc.shape[0] == rows, kBadArgument,
               "{}: {} must be [{}, dim], got {}", op, xname, rows, shape_string(x.desc.shape));
  check::shape(op, xpname, xp, {rows * k, x.desc.shape[1]});
}

// slots int32 [rows, k] and, when given, weights (and dweights) fp32 of the same shape.
void moe_slots(std::string_view op, const TensorView& slots, std::initializer_list<std::pair<const char*, const TensorView*>> per_slot) {
  check::dtype(op, "slots", slots, DType::kI32);
  STRATA_CHECK(slots.desc.shape.size() == 2, kBadArgument, "{}: slots must be [rows, k], got {}", op,
               shape_string(slots.desc.shape));
  for (const auto& [name, t] : per_slot) {
    check::dtype(op, name, *t, DType::kF32);
    check::shape(op, name, *t, slots.desc.shape);
  }
}

}  // namespace

void Ops::moe_route(ComputeContext& ctx, const TensorView& logits, int64_t top_k, bool renormalize,
                    const TensorView& probs, const TensorView& indices, const TensorView& weights,
                    const TensorView& offsets, const TensorView& slots, const TensorView& tokens,
                    const TensorView& aux_stats) {
  MoeRouter router;
  router.renormalize = renormalize;
  moe_route(ctx, logits, top_k, router, TensorView{}, probs, indices, weights, offsets, slots, tokens, aux_stats);
}

void Ops::moe_route(ComputeContext& ctx, const TensorView& logits, int64_t top_k, const MoeRouter& router,
                    const TensorView& correction_bias, const TensorView& probs, const TensorView& indices,
                    const TensorView& weights, const TensorView& offsets, const TensorView& slots,
                    const TensorView& tokens, const TensorView& aux_stats) {
  constexpr const char* op = "moe_route";
  own(ctx, op);
  check::float_tensor(op, "logits", logits);
  const MoeShape s = moe_shape(op, probs, indices);
  STRATA_CHECK(top_k == s.k, kBadArgument, "{}: top_k {} but indices has {} columns", op, top_k, s.k);
  check::shape(op, "logits", logits, {s.rows, s.experts});
  check::dtype(op, "weights", weights, DType::kF32);
  check::shape(op, "weights", weights, {s.rows, s.k});
  check::dtype(op, "offsets", offsets, DType::kI32);
  check::numel(op, "offsets", offsets, s.experts + 1);
  check::dtype(op, "slots", slots, DType::kI32);
  check::shape(op, "slots", slots, {s.rows, s.k});
  check::dtype(op, "tokens", tokens, DType::kI32);
  check::numel(op, "tokens", tokens, s.rows * s.k);
  if (!empty(aux_stats)) {
    check::dtype(op, "aux_stats", aux_stats, DType::kF64);
    check::numel(op, "aux_stats", aux_stats, 2 * s.experts);
  }
  check::moe_router(op, router, s.experts, s.k);
  STRATA_CHECK(router.scores == MoeScores::kSigmoid || empty(correction_bias), kBadArgument,
               "{}: a correction bias needs the sigmoid router", op);
  STRATA_CHECK(router.scores == MoeScores::kSoftmax || empty(aux_stats), kBadArgument,
               "{}: the sigmoid router has no load-balancing statistics", op);
  if (!empty(correction_bias)) {
    check::dtype(op, "correction_bias", correction_bias, DType::kF32);
    check::numel(op, "correction_bias", correction_bias, s.experts);
  }
  Labeled label(ctx, op, [&] { return memory(nbytes(logits) + nbytes(probs), brief(logits)); });
  enqueue_moe_route(ctx, logits, top_k, router, correction_bias, probs, indices, weights, offsets, slots, tokens,
                    aux_stats);
}

void Ops::moe_route_backward(ComputeContext& ctx, const TensorView& probs, const TensorView& indices,
                             const TensorView& weights, const TensorView& dweights, bool renormalize,
                             const TensorView& aux_grad, const TensorView& dlogits) {
  MoeRouter router;
  router.renormalize = renormalize;
  moe_route_backward(ctx, probs, indices, weights, dweights, router, aux_grad, dlogits);
}

void Ops::moe_route_backward(ComputeContext& ctx, const TensorView& probs, const TensorView& indices,
                             const TensorView& weights, const TensorView& dweights, const MoeRouter& router,
                             const TensorView& aux_grad, const TensorView& dlogits) {
  constexpr const char* op = "moe_route_backward";
  own(ctx, op);
  const MoeShape s = moe_shape(op, probs, indices);
  check::dtype(op, "weights", weights, DType::kF32);
  check::shape(op, "weights", weights, {s.rows, s.k});
  check::dtype(op, "dweights", dweights, DType::kF32);
  check::shape(op, "dweights", dweights, {s.rows, s.k});
  check::float_tensor(op, "dlogits", dlogits);
  check::shape(op, "dlogits", dlogits, {s.rows, s.experts});
  if (!empty(aux_grad)) {
    check::dtype(op, "aux_grad", aux_grad, DType::kF32);
    check::numel(op, "aux_grad", aux_grad, s.experts);
  }
  check::moe_router(op, router, s.experts, s.k);
  STRATA_CHECK(router.scores == MoeScores::kSoftmax || empty(aux_grad), kBadArgument,
               "{}: the sigmoid router has no load-balancing gradient", op);
  if (s.rows == 0) return;
  Labeled label(ctx, op, [&] { return memory(nbytes(probs) + nbytes(dlogits), brief(probs)); });
  enqueue_moe_route_backward(ctx, probs, indices, weights, dweights, router, aux_grad, dlogits);
}

void Ops::moe_gather(ComputeContext& ctx, const TensorView& x, const TensorView& tokens,
                     const TensorView& xp) {
  constexpr const char* op = "moe_gather";
  own(ctx, op);
  check::dtype(op, "tokens", tokens, DType::kI32);
  check::float_tensor(op, "x", x);
  const int64_t rows = x.desc.shape.empty() ? 0 : x.desc.shape[0];
  STRATA_CHECK(rows > 0 && tokens.numel() % rows == 0, kBadArgument,
               "{}: tokens has {} entries, not a multiple of x's {} rows", op, tokens.numel(), rows);
  moe_rows(op, "x", x, "xp", xp, rows, tokens.numel() / rows);
  Labeled label(ctx, op, [&] { return memory(2 * nbytes(xp), brief(xp)); });
  enqueue_moe_gather(ctx, x, tokens, xp);
}

void Ops::moe_gather_backward(ComputeContext& ctx, const TensorView& dxp, const TensorView& slots,
                              const TensorView& dx, bool accumulate) {
  constexpr const char* op = "moe_gather_backward";
  own(ctx, op);
  moe_slots(op, slots, {});
  moe_rows(op, "dx", dx, "dxp", dxp, slots.desc.shape[0], slots.desc.shape[1]);
  if (slots.numel() == 0) return;
  Labeled label(ctx, op, [&] { return memory(nbytes(dxp) + 2 * nbytes(dx), brief(dxp)); });
  enqueue_moe_gather_backward(ctx, dxp, slots, dx, accumulate);
}

void Ops::moe_combine(ComputeContext& ctx, const TensorView& yp, const TensorView& slots,
                      const TensorView& weights, const TensorView& y) {
  constexpr const char* op = "moe_combine";
  own(ctx, op);
  moe_slots(op, slots, {{"weights", &weights}});
  moe_rows(op, "y", y, "yp", yp, slots.desc.shape[0], slots.desc.shape[1]);
  if (slots.numel() == 0) return;
  Labeled label(ctx, op, [&] { return memory(nbytes(yp) + nbytes(y), brief(yp)); });
  enqueue_moe_combine(ctx, yp, slots, weights, y);
}

void Ops::moe_combine_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& yp,
                               const TensorView& slots, const TensorView& weights,
                               const TensorView& dyp, const TensorView& dweights) {
  constexpr const char* op = "moe_combine_backward";
  own(ctx, op);
  moe_slots(op, slots, {{"weights", &weights}, {"dweights", &dweights}});
  moe_rows(op, "dy", dy, "yp", yp, slots.desc.shape[0], slots.desc.shape[1]);
  moe_rows(op, "dy", dy, "dyp", dyp, slots.desc.shape[0], slots.desc.shape[1]);
  if (slots.numel() == 0) return;
  Labeled label(ctx, op, [&] { return memory(2 * nbytes(yp) + nbytes(dy), brief(yp)); });
  enqueue_moe_combine_backward(ctx, dy, yp, slots, weights, dyp, dweights);
}

void Ops::moe_aux_loss(ComputeContext& ctx, const TensorView& aux_stats, double rows, double scale,
                       const TensorView& aux, const TensorView& aux_grad) {
  constexpr const char* op = "moe_aux_loss";
  own(ctx, op);
  check::dtype(op, "aux_stats", aux_stats, DType::kF64);
  STRATA_CHECK(aux_stats.numel() > 0 && aux_stats.numel() % 2 == 0, kBadArgument,
               "{}: aux_stats must be [2, experts], got {}", op, shape_string(aux_stats.desc.shape));
  const int64_t experts = aux_stats.numel() / 2;
  STRATA_CHECK(rows > 0 && std::isfinite(rows) && std::isfinite(scale), kBadArgument,
               "{}: rows {} must be positive and scale {} finite", op, rows, scale);
  check::dtype(op, "aux", aux, DType::kF64);
  check::numel(op, "aux", aux, 1);
  check::dtype(op, "aux_grad", aux_grad, DType::kF32);
  check::numel(op, "aux_grad", aux_grad, experts);
  Labeled label(ctx, op, [&] { return memory(nbytes(aux_stats), brief(aux_stats)); });
  enqueue_moe_aux_loss(ctx, aux_stats, rows, scale, aux, aux_grad);
}

namespace {

// sigmoid_gated_add's operands: [rows, dim] rows and a [rows, 1] gate, one float dtype.
void gated_rows(const char* op, std::initializer_list<std::pair<const char*, const TensorView*>> rows,
                std::initializer_list<std::pair<const char*, const TensorView*>> gates) {
  const TensorView& first = *rows.begin()->second;
  for (const auto& [what, t] : rows) {
    check::float_tensor(op, what, *t);
    check::same_dtype(op, first, *t);
    STRATA_CHECK(t->desc.shape.size() == 2, kBadArgument, "{}: {} must be [rows, dim], got {}", op, what,
                 shape_string(t->desc.shape));
    check::shape(op, what, *t, first.desc.shape);
  }
  for (const auto& [what, t] : gates) {
    check::float_tensor(op, what, *t);
    check::same_dtype(op, first, *t);
    check::shape(op, what, *t, {first.desc.shape[0], 1});
  }
}

}  // namespace

void Ops::sigmoid_gated_add(ComputeContext& ctx, const TensorView& v, const TensorView& gate,
                            const TensorView& y) {
  constexpr const char* op = "sigmoid_gated_add";
  own(ctx, op);
  gated_rows(op, {{"v", &v}, {"y", &y}}, {{"gate", &gate}});
  if (v.numel() == 0) return;
  Labeled label(ctx, op, [&] { return memory(3 * nbytes(y) + nbytes(gate), brief(y)); });
  enqueue_sigmoid_gated_add(ctx, v, gate, y);
}

void Ops::sigmoid_gated_add_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& v,
                                     const TensorView& gate, const TensorView& dv, const TensorView& dgate) {
  constexpr const char* op = "sigmoid_gated_add_backward";
  own(ctx, op);
  gated_rows(op, {{"dy", &dy}, {"v", &v}, {"dv", &dv}}, {{"gate", &gate}, {"dgate", &dgate}});
  if (dy.numel() == 0) return;
  Labeled label(ctx, op, [&] { return memory(3 * nbytes(dy) + 2 * nbytes(gate), brief(dy)); });
  enqueue_sigmoid_gated_add_backward(ctx, dy, v, gate, dv, dgate);
}

void Ops::cast(ComputeContext& ctx, const TensorView& src, const TensorView& dst) {
  own(ctx, "cast");
  check::float_tensor("cast", "src", src);
  check::float_tensor("cast", "dst", dst);
  check::shape("cast", "dst", dst, src.desc.shape);
  Labeled label(ctx, "cast", [&] { return memory(nbytes(src) + nbytes(dst), brief(src) + " -> " + brief(dst)); });
  enqueue_cast(ctx, src, dst);
}

void Ops::dequantize_fp8_blocks(ComputeContext& ctx, const TensorView& weight, const TensorView& scale_inv,
                                int64_t block_rows, int64_t block_cols, const TensorView& out) {
  constexpr const char* op = "dequantize_fp8_blocks";
  own(ctx, op);
  check::dtype(op, "weight", weight, DType::kF8E4M3);
  STRATA_CHECK(weight.desc.shape.size() == 2, kBadArgument, "{}: weight must be [rows, cols], got {}", op,
               shape_string(weight.desc.shape));
  STRATA_CHECK(block_rows > 0 && block_cols > 0, kBadArgument, "{}: blocks of {} x {}; expected positive sizes", op,
               block_rows, block_cols);
  const kernels::Fp8Blocks shape{weight.desc.shape[0], weight.desc.shape[1], block_rows, block_cols};
  check::dtype(op, "scale_inv", scale_inv, DType::kF32);
  check::shape(op, "scale_inv", scale_inv, {shape.grid_rows(), shape.grid_cols()});
  check::float_tensor(op, "out", out);
  check::shape(op, "out", out, weight.desc.shape);
  for (const TensorView* t : {&weight, &scale_inv}) {
    STRATA_CHECK(t->desc.tier != Tier::kNvme, kBadArgument, "{}: an input is on NVMe, not addressable", op);
  }
  Labeled label(ctx, op, [&] {
    return memory(nbytes(weight) + nbytes(scale_inv) + nbytes(out), brief(weight) + " -> " + brief(out));
  });
  enqueue_dequantize_fp8_blocks(ctx, weight, scale_inv, shape, out);
}

void Ops::dequantize_mxfp4_blocks(ComputeContext& ctx, const TensorView& packed, const TensorView& scales,
                                  const TensorView& out) {
  constexpr const char* op = "dequantize_mxfp4_blocks";
  own(ctx, op);
  check::float_tensor(op, "out", out);
  STRATA_CHECK(out.desc.shape.size() == 2 && out.desc.shape[1] % 32 == 0, kBadArgument,
               "{}: out must be [rows, cols] with cols a multiple of 32 (MXFP4 blocks of 32), got {}", op,
               shape_string(out.desc.shape));
  const kernels::Mxfp4Blocks shape{out.desc.shape[0], out.desc.shape[1]};
  check::dtype(op, "packed", packed, DType::kU8);
  check::shape(op, "packed", packed, {shape.packed_nbytes()});
  check::dtype(op, "scales", scales, DType::kU8);
  check::shape(op, "scales", scales, {shape.rows, shape.cols / 32});
  for (const TensorView* t : {&packed, &scales}) {
    STRATA_CHECK(t->desc.tier != Tier::kNvme, kBadArgument, "{}: an input is on NVMe, not addressable", op);
  }
  Labeled label(ctx, op, [&] {
    return memory(nbytes(packed) + nbytes(scales) + nbytes(out), brief(packed) + " -> " + brief(out));
  });
  enqueue_dequantize_mxfp4_blocks(ctx, packed, scales, shape, out);
}

void Ops::adam_step(ComputeContext& ctx, const kernels::AdamCoefficients& coeffs, const TensorView& param,
                    const TensorView& exp_avg, const TensorView& exp_avg_sq, const TensorView& grad,
                    const TensorView& param_copy) {
  own(ctx, "adam_step");
  check::adam("adam_step", param, exp_avg, exp_avg_sq, grad, param_copy);
  if (param.numel() == 0) return;
  Labeled label(ctx, "adam_step", [&] {
    // Reads param, both moments and the gradient; writes param, the moments and the copy.
    return memory(7 * nbytes(param) + nbytes(param_copy), brief(param));
  });
  enqueue_adam_step(ctx, coeffs, param, exp_avg, exp_avg_sq, grad, param_copy);
}

void Ops::grad_sum_sq(ComputeContext& ctx, const TensorView& grad, float scale, const TensorView& out) {
  own(ctx, "grad_sum_sq");
  check::dtype("grad_sum_sq", "grad", grad, DType::kF32);
  check::dtype("grad_sum_sq", "out", out, DType::kF64);
  check::numel("grad_sum_sq", "out", out, 1);
  Labeled label(ctx, "grad_sum_sq", [&] { return memory(nbytes(grad), brief(grad)); });
  enqueue_grad_sum_sq(ctx, grad, scale, out);
}

std::unique_ptr<Ops> make_ops(Accelerator& accelerator) {
  return accelerator.backend() == Backend::kCuda ? make_cuda_ops(accelerator)
                                                 : make_cpu_ops(accelerator);
}

}  // namespace strata::ops
