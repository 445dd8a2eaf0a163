// Argument checks every Ops implementation runs before it enqueues work, and
// the MatView helpers; shared so that both backends refuse the same calls.
#include <cmath>

#include "kernels/ops.h"
#include "core/error.h"

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

void attention_mask(std::string_view op, const AttentionMask& mask, int64_t seq) {
  STRATA_CHECK(mask.window >= 0, kBadArgument, "{}: sliding window {} < 0", op, mask.window);
  STRATA_CHECK((mask.segment_start == nullptr) == (mask.segment_end == nullptr), kBadArgument,
               "{}: packed documents need both their starts and their ends", op);
  STRATA_CHECK(!mask.has_segments() || mask.seq == seq, kBadArgument,
               "{}: the document arrays have {} entries per row, the sequence {}", op, mask.seq, seq);
}

void rope(std::string_view op, const Rope& r) {
  STRATA_CHECK(r.theta > 0 && std::isfinite(r.theta), kBadArgument, "{}: rope theta {} must be positive", op,
               r.theta);
  STRATA_CHECK(r.type == RopeType::kDefault || r.type == RopeType::kLinear || r.type == RopeType::kLlama3,
               kBadArgument, "{}: unknown rope type {}", op, static_cast<int>(r.type));
  if (r.type == RopeType::kDefault) return;
  STRATA_CHECK(r.factor >= 1 && std::isfinite(r.factor), kBadArgument, "{}: rope factor {} must be >= 1", op,
               r.factor);
  if (r.type != RopeType::kLlama3) return;
  STRATA_CHECK(r.low_freq_factor > 0 && r.high_freq_factor > r.low_freq_factor &&
                   std::isfinite(r.high_freq_factor) && r.original_max_position_embeddings > 0,
               kBadArgument,
               "{}: llama3 rope needs 0 < low_freq_factor < high_freq_factor and a positive "
               "original_max_position_embeddings (got {}, {}, {})",
               op, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings);
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
                   q.desc.shape[3]};
  STRATA_CHECK(s.batch > 0 && s.seq > 0 && s.heads > 0 && s.kv_heads > 0 && s.head_dim > 0 &&
                   s.heads % s.kv_heads == 0,
               kBadArgument,
               "{}: bad shape batch={} seq={} heads={} kv_heads={} head_dim={} (heads must be a "
               "multiple of kv_heads)",
               op, s.batch, s.seq, s.heads, s.kv_heads, s.head_dim);
  shape(op, "k", k, {s.batch, s.seq, s.kv_heads, s.head_dim});
  shape(op, "v", v, {s.batch, s.seq, s.kv_heads, s.head_dim});
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

std::unique_ptr<Ops> make_ops(Accelerator& accelerator) {
  return accelerator.backend() == Backend::kCuda ? make_cuda_ops(accelerator)
                                                 : make_cpu_ops(accelerator);
}

}  // namespace strata::ops
