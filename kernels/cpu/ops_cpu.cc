// The cpu implementation of Ops (kernels/ops.h). The front end has checked
// each op's arguments; here it enqueues one task on the context's stream; the
// task runs on the stream's own thread, so OpenMP teams and OpenBLAS's (OpenMP)
// GEMMs run there and the calling thread goes on, as with a GPU stream.
//
// Compute is fp32. fp32 tensors are used in place; 16-bit activations are
// widened into the context's scratch, computed, and narrowed back; 16-bit
// weights of Linear are widened in blocks of rows (kWeightBlockRows) so the
// fp32 copy of a block stays in cache and no whole fp32 weight ever exists.
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstring>
#include <vector>

#include "kernels/cpu/attention_blocked.h"
#include "kernels/dropout_mask.h"
#include "kernels/cpu/blas.h"
#include "kernels/cpu/nn_gemm.h"
#include "kernels/cpu/vec_math.h"
#include "kernels/nn_ops.h"
#include "kernels/op_totals.h"
#include "kernels/ops.h"
#include "core/error.h"
#include "core/trace_recorder.h"

namespace strata::ops {
namespace {

using nn::cpu::detail::gemm;
using nn::cpu::detail::kMinParallelWork;

std::atomic<int> g_cpu_threads{0};

// Rows of a 16-bit weight widened at a time by Linear: 64 rows x 4096 inputs
// of fp32 is 1 MiB, a block that stays in L2 while its GEMM runs.
constexpr int64_t kWeightBlockRows = 64;

// Scratch buffers of one context. Used only by tasks on the context's stream,
// which run one at a time on that stream's thread, so no locking is needed.
// Buffers grow to the largest request of their slot and are reused after.
class CpuContext final : public ComputeContext {
 public:
  CpuContext(Accelerator& accelerator, Stream& stream) : ComputeContext(accelerator, stream) {}
  ~CpuContext() override {
    for (Buffer& b : buffers_) accelerator().deallocate(b.ptr);
  }
  void* blas_handle() const override { return nullptr; }

  template <typename T>
  T* scratch(size_t slot, int64_t numel) {
    Buffer& b = buffers_.at(slot);
    const size_t nbytes = static_cast<size_t>(std::max<int64_t>(numel, 1)) * sizeof(T);
    if (b.nbytes < nbytes) {
      accelerator().deallocate(b.ptr);
      b.ptr = nullptr;
      b.nbytes = 0;
      b.ptr = accelerator().allocate(nbytes);
      b.nbytes = nbytes;
    }
    return static_cast<T*>(b.ptr);
  }

 private:
  struct Buffer {
    void* ptr = nullptr;
    size_t nbytes = 0;
  };
  std::array<Buffer, 8> buffers_{};
};

// A matrix in fp32: the tensor's own memory (fp32) or a contiguous scratch copy.
struct F32Mat {
  float* data;
  int64_t ld;
};

void convert_rows(const void* src, DType src_dtype, int64_t src_ld, void* dst, DType dst_dtype,
                  int64_t dst_ld, int64_t rows, int64_t cols) {
  const size_t se = dtype_nbytes(src_dtype), de = dtype_nbytes(dst_dtype);
#pragma omp parallel for schedule(static) if (rows * cols >= kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    convert(static_cast<const char*>(src) + r * src_ld * static_cast<int64_t>(se), src_dtype,
            static_cast<char*>(dst) + r * dst_ld * static_cast<int64_t>(de), dst_dtype,
            static_cast<size_t>(cols));
  }
}

// row(r, out_row) for each of `rows` rows of `cols` elements of `out`, rows
// in parallel when the work is large (the block dequantizers: each row's
// blocks are its own).
template <typename RowFn>
void for_each_out_row(int64_t rows, int64_t cols, const TensorView& out, RowFn row) {
  const size_t row_nbytes = static_cast<size_t>(cols) * dtype_nbytes(out.desc.dtype);
#pragma omp parallel for schedule(static) if (rows * cols >= kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r) row(r, static_cast<char*>(out.data) + static_cast<size_t>(r) * row_nbytes);
}

// `m` as fp32 for reading.
F32Mat widen(CpuContext& c, size_t slot, const MatView& m) {
  if (m.dtype == DType::kF32) return {static_cast<float*>(m.data), m.ld};
  float* buf = c.scratch<float>(slot, m.rows * m.cols);
  convert_rows(m.data, m.dtype, m.ld, buf, DType::kF32, m.cols, m.rows, m.cols);
  return {buf, m.cols};
}
const float* widen(CpuContext& c, size_t slot, const TensorView& t) {
  return widen(c, slot, MatView::of(t)).data;
}

// `m` as fp32 for writing; with `load`, holding m's current values (for += and in place).
F32Mat stage(CpuContext& c, size_t slot, const MatView& m, bool load) {
  if (m.dtype == DType::kF32) return {static_cast<float*>(m.data), m.ld};
  float* buf = c.scratch<float>(slot, m.rows * m.cols);
  if (load) convert_rows(m.data, m.dtype, m.ld, buf, DType::kF32, m.cols, m.rows, m.cols);
  return {buf, m.cols};
}
float* stage(CpuContext& c, size_t slot, const TensorView& t, bool load) {
  return stage(c, slot, MatView::of(t), load).data;
}

// Writes a staged fp32 matrix back into `m` (nothing to do when m is fp32).
void commit(const F32Mat& f, const MatView& m) {
  if (m.dtype != DType::kF32) convert_rows(f.data, DType::kF32, f.ld, m.data, m.dtype, m.ld, m.rows, m.cols);
}
void commit(const float* f, const TensorView& t) {
  const MatView m = MatView::of(t);
  commit(F32Mat{const_cast<float*>(f), m.cols}, m);
}

// The losses' checks when their work runs: every target kIgnoreIndex or in
// [0, vocab); with a gradient, the normalizer (read now, as the op promises)
// positive. Returns the gradient's scale, grad_scale / normalizer (0 without).
double checked_loss_scale(const char* op, const int32_t* targets, int64_t rows, int64_t vocab,
                          const TensorView* normalizer, double grad_scale) {
  for (int64_t r = 0; r < rows; ++r) {
    STRATA_CHECK(targets[r] == kIgnoreIndex || (targets[r] >= 0 && targets[r] < vocab), kBadArgument,
                 "{}: target {} at row {} is outside [0, {}) and not {}", op, targets[r], r, vocab, kIgnoreIndex);
  }
  if (normalizer == nullptr) return 0;
  const double n = normalizer->as<const double>()[0];
  STRATA_CHECK(n > 0, kBadArgument, "{}: the loss normalizer is {} (no counted targets?)", op, n);
  return grad_scale / n;
}

// Calls fn(begin, end) on contiguous chunks of [0, n), in parallel when n is large.
template <typename Fn>
void for_chunks(int64_t n, Fn&& fn) {
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t k = 0; k < chunks; ++k) fn(k * kChunk, std::min(n, (k + 1) * kChunk));
}

bool empty(const TensorView& t) { return t.data == nullptr; }

// A norm's weight as fp32 plus weight_offset (Gemma's 1 + w), or as it is.
const float* offset_weight(CpuContext& c, size_t slot, const TensorView& w, float weight_offset) {
  const float* wf = widen(c, slot, w);
  if (weight_offset == 0.0f) return wf;
  float* out = c.scratch<float>(slot == 1 ? 5 : 6, w.numel());
  for (int64_t i = 0; i < w.numel(); ++i) out[i] = wf[i] + weight_offset;
  return out;
}

// gelu with torch's tanh approximation (gelu_pytorch_tanh) and its derivative.
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
float gelu_tanh(float x) { return 0.5f * x * (1.0f + std::tanh(kGeluC * (x + 0.044715f * x * x * x))); }
float gelu_tanh_derivative(float x) {
  const float t = std::tanh(kGeluC * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluC * (1.0f + 3.0f * 0.044715f * x * x);
}
bool empty(const MatView& m) { return m.data == nullptr; }

class CpuOps final : public Ops {
 public:
  explicit CpuOps(Accelerator& accelerator) : Ops(accelerator, Backend::kCpu) {}

 private:
  std::unique_ptr<ComputeContext> new_context(Stream& stream) override {
    return std::make_unique<CpuContext>(accelerator(), stream);
  }

  void enqueue_embedding_forward(ComputeContext& ctx, const TensorView& table, const TensorView& ids,
                         const TensorView& out, int64_t first_id, int64_t vocab, float scale) override {
    const int64_t held = table.desc.shape[0], dim = table.desc.shape[1], rows = ids.numel();
    enqueue(ctx, [=](CpuContext& c) {
      const auto* id = ids.as<const int32_t>();
      const size_t te = dtype_nbytes(table.desc.dtype), oe = dtype_nbytes(out.desc.dtype);
      for (int64_t r = 0; r < rows; ++r) {
        STRATA_CHECK(id[r] >= 0 && id[r] < vocab, kBadArgument,
                     "embedding: token id {} at position {} is outside the vocabulary [0, {})",
                     id[r], r, vocab);
      }
      if (scale != 1.0f) {
        // Each row times the scale in fp32, rounded once into out's dtype
        // (transformers: the 16-bit row times the 16-bit scale).
        float* of = stage(c, 1, out, false);
#pragma omp parallel for schedule(static) if (rows * dim >= kMinParallelWork)
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = of + r * dim;
          const int64_t local = id[r] - first_id;
          if (local < 0 || local >= held) {
            std::fill_n(dst, dim, 0.0f);
            continue;
          }
          convert(table.as<const char>() + local * dim * static_cast<int64_t>(te), table.desc.dtype, dst,
                  DType::kF32, static_cast<size_t>(dim));
          for (int64_t i = 0; i < dim; ++i) dst[i] *= scale;
        }
        commit(of, out);
        return;
      }
#pragma omp parallel for schedule(static) if (rows * dim >= kMinParallelWork)
      for (int64_t r = 0; r < rows; ++r) {
        char* dst = out.as<char>() + r * dim * static_cast<int64_t>(oe);
        const int64_t local = id[r] - first_id;
        if (local < 0 || local >= held) {  // another rank's row: this rank adds zeros
          std::memset(dst, 0, static_cast<size_t>(dim) * oe);
          continue;
        }
        convert(table.as<const char>() + local * dim * static_cast<int64_t>(te), table.desc.dtype, dst,
                out.desc.dtype, static_cast<size_t>(dim));
      }
    });
  }

  void enqueue_embedding_backward(ComputeContext& ctx, const TensorView& dout, const TensorView& ids,
                          const TensorView& dtable, int64_t padding_idx, int64_t first_id, int64_t vocab,
                          float scale) override {
    const int64_t held = dtable.desc.shape[0], dim = dtable.desc.shape[1], rows = ids.numel();
    enqueue(ctx, [=](CpuContext& c) {
      const float* d = widen(c, 0, dout);
      if (scale != 1.0f) {
        float* scaled = c.scratch<float>(1, rows * dim);
        for (int64_t i = 0; i < rows * dim; ++i) scaled[i] = d[i] * scale;
        d = scaled;
      }
      nn::cpu::embedding_backward<float>(d, ids.as<const int32_t>(), rows, vocab, dim,
                                         dtable.as<float>(), padding_idx, first_id, held);
    });
  }

  void enqueue_rmsnorm_forward(ComputeContext& ctx, const TensorView& x, const TensorView& w, double eps,
                       const TensorView& y, const TensorView& rstd, float weight_offset) override {
    const MatView xm = MatView::of(x);
    enqueue(ctx, [=](CpuContext& c) {
      float* yf = stage(c, 2, y, false);
      nn::cpu::rmsnorm_forward<float>(widen(c, 0, x), offset_weight(c, 1, w, weight_offset), xm.rows, xm.cols,
                                      eps, yf,
                                      rstd.as<float>());
      commit(yf, y);
    });
  }

  void enqueue_rmsnorm_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& x,
                        const TensorView& w, const TensorView& rstd, const TensorView& dx,
                        bool accumulate_dx, const TensorView& dw, float weight_offset) override {
    const MatView xm = MatView::of(x);
    enqueue(ctx, [=](CpuContext& c) {
      const int64_t n = xm.rows * xm.cols;
      // The kernel overwrites its dx; accumulation goes through a scratch buffer.
      float* out = accumulate_dx ? c.scratch<float>(4, n) : stage(c, 3, dx, false);
      nn::cpu::rmsnorm_backward<float>(widen(c, 0, dy), widen(c, 1, x), offset_weight(c, 2, w, weight_offset),
                                       rstd.as<const float>(), xm.rows, xm.cols, out,
                                       empty(dw) ? nullptr : dw.as<float>());
      if (accumulate_dx) {
        float* acc = stage(c, 3, dx, true);
        nn::cpu::add<float>(acc, out, n, acc);
        commit(acc, dx);
      } else {
        commit(out, dx);
      }
    });
  }

  void enqueue_linear_forward(ComputeContext& ctx, const MatView& x, const TensorView& w,
                      const TensorView& bias, const MatView& y, bool accumulate,
                              float scale) override {
    const int64_t out = w.desc.shape[0], in = w.desc.shape[1], rows = x.rows;
    enqueue(ctx, [=](CpuContext& c) {
      const F32Mat xf = widen(c, 0, x);
      const F32Mat yf = stage(c, 1, y, accumulate);
      const float* bf = empty(bias) ? nullptr : widen(c, 2, bias);
      if (w.desc.dtype == DType::kF32) {
        gemm<float>(false, true, rows, out, in, scale, xf.data, xf.ld, w.as<const float>(), in,
                    accumulate ? 1.0f : 0.0f, yf.data, yf.ld);
      } else {
        for (int64_t o0 = 0; o0 < out; o0 += kWeightBlockRows) {
          const int64_t bo = std::min(kWeightBlockRows, out - o0);
          float* wb = c.scratch<float>(3, bo * in);
          convert_rows(w.as<const char>() + o0 * in * 2, w.desc.dtype, in, wb, DType::kF32, in, bo,
                       in);
          gemm<float>(false, true, rows, bo, in, scale, xf.data, xf.ld, wb, in,
                      accumulate ? 1.0f : 0.0f, yf.data + o0, yf.ld);
        }
      }
      if (bf != nullptr) {
#pragma omp parallel for schedule(static) if (rows * out >= kMinParallelWork)
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t o = 0; o < out; ++o) yf.data[r * yf.ld + o] += bf[o];
        }
      }
      commit(yf, y);
    });
  }

  void enqueue_linear_backward(ComputeContext& ctx, const MatView& dy, const MatView& x,
                       const TensorView& w, const MatView& dx, bool accumulate_dx,
                       const TensorView& dw, const TensorView& dbias, float scale) override {
    const int64_t out = w.desc.shape[0], in = w.desc.shape[1], rows = dy.rows;
    enqueue(ctx, [=](CpuContext& c) {
      const F32Mat dyf = widen(c, 0, dy);
      const F32Mat xf = widen(c, 1, x);
      if (!empty(dx)) {
        const F32Mat dxf = stage(c, 2, dx, accumulate_dx);
        if (w.desc.dtype == DType::kF32) {
          gemm<float>(false, false, rows, in, out, scale, dyf.data, dyf.ld, w.as<const float>(), in,
                      accumulate_dx ? 1.0f : 0.0f, dxf.data, dxf.ld);
        } else {
          for (int64_t o0 = 0; o0 < out; o0 += kWeightBlockRows) {
            const int64_t bo = std::min(kWeightBlockRows, out - o0);
            float* wb = c.scratch<float>(3, bo * in);
            convert_rows(w.as<const char>() + o0 * in * 2, w.desc.dtype, in, wb, DType::kF32, in,
                         bo, in);
            const bool first = o0 == 0;
            gemm<float>(false, false, rows, in, bo, scale, dyf.data + o0, dyf.ld, wb, in,
                        first && !accumulate_dx ? 0.0f : 1.0f, dxf.data, dxf.ld);
          }
        }
        commit(dxf, dx);
      }
      if (!empty(dw)) {
        gemm<float>(true, false, out, in, rows, scale, dyf.data, dyf.ld, xf.data, xf.ld, 1.0f,
                    dw.as<float>(), in);
      }
      if (!empty(dbias)) {
        float* db = dbias.as<float>();
#pragma omp parallel for schedule(static) if (rows * out >= kMinParallelWork)
        for (int64_t o = 0; o < out; ++o) {
          float acc = 0;
          for (int64_t r = 0; r < rows; ++r) acc += dyf.data[r * dyf.ld + o];
          db[o] += acc;
        }
      }
    });
  }

  void enqueue_rope(ComputeContext& ctx, const TensorView& x, const TensorView& positions,
                    const Rope& rope_params, int sign) override {
    const int64_t rows = x.desc.shape[0], heads = x.desc.shape[1], head_dim = x.desc.shape[2];
    enqueue(ctx, [=](CpuContext& c) {
      float* xf = stage(c, 0, x, true);
      if (sign < 0) {
        nn::cpu::rope_backward<float>(xf, positions.as<const int32_t>(), rows, heads, head_dim,
                                      rope_params);
      } else {
        nn::cpu::rope_forward<float>(xf, positions.as<const int32_t>(), rows, heads, head_dim,
                                     rope_params);
      }
      commit(xf, x);
    });
  }

  void enqueue_attention_forward(ComputeContext& ctx, const AttentionShape& s, const TensorView& q,
                                 const TensorView& k, const TensorView& v, const TensorView& out,
                                 const TensorView& lse, const AttentionMask& mask) override {
    enqueue(ctx, [=](CpuContext& c) {
      float* of = stage(c, 3, out, false);
      cpu::attention_forward(widen(c, 0, q), widen(c, 1, k), widen(c, 2, v), s, mask, of,
                             lse.as<float>());
      commit(of, out);
    });
  }

  void enqueue_attention_backward(ComputeContext& ctx, const AttentionShape& s, const TensorView& dout,
                                  const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const TensorView& lse, const TensorView& dq,
                                  const TensorView& dk, const TensorView& dv,
                                  const AttentionMask& mask) override {
    enqueue(ctx, [=](CpuContext& c) {
      float* dqf = stage(c, 5, dq, false);
      float* dkf = stage(c, 6, dk, false);
      float* dvf = stage(c, 7, dv, false);
      cpu::attention_backward(widen(c, 0, dout), widen(c, 1, q), widen(c, 2, k), widen(c, 3, v),
                              widen(c, 4, out), lse.as<const float>(), s, mask, dqf, dkf, dvf);
      commit(dqf, dq);
      commit(dkf, dk);
      commit(dvf, dv);
    });
  }

  void enqueue_attention_sinks_backward(ComputeContext& ctx, const AttentionShape& s, const TensorView& dout,
                                        const TensorView& out, const TensorView& lse, const AttentionMask& mask,
                                        const TensorView& dsinks) override {
    enqueue(ctx, [=](CpuContext& c) {
      nn::cpu::attention_sinks_backward<float>(widen(c, 0, dout), widen(c, 1, out), lse.as<const float>(), s,
                                               mask.sinks, dsinks.as<float>());
    });
  }

  void enqueue_attention_merge(ComputeContext& ctx, const AttentionShape& s, const TensorView& out,
                               const TensorView& lse, const TensorView& part,
                               const TensorView& part_lse) override {
    enqueue(ctx, [=](CpuContext& c) {
      cpu::attention_merge(s, out.as<float>(), lse.as<float>(), widen(c, 0, part),
                           part_lse.as<const float>());
    });
  }

  void enqueue_swiglu_forward(ComputeContext& ctx, const TensorView& gate, const TensorView& up,
                      const TensorView& out, GluActivation act, const GluClamp& clamp) override {
    enqueue(ctx, [=](CpuContext& c) {
      float* of = stage(c, 2, out, false);
      const float* g = widen(c, 0, gate);
      const float* u = widen(c, 1, up);
      if (act == GluActivation::kClampedSwiglu) {
        for_chunks(gate.numel(), [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) of[i] = clamped_swiglu(g[i], u[i], clamp);
        });
      } else if (act == GluActivation::kGeluTanh) {
        for_chunks(gate.numel(), [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) of[i] = gelu_tanh(g[i]) * u[i];
        });
      } else {
        for_chunks(gate.numel(), [&](int64_t b, int64_t e) { vec::swiglu(g + b, u + b, e - b, of + b); });
      }
      commit(of, out);
    });
  }

  void enqueue_swiglu_backward(ComputeContext& ctx, const TensorView& dout, const TensorView& gate,
                       const TensorView& up, const TensorView& dgate,
                       const TensorView& dup, GluActivation act, const GluClamp& clamp) override {
    enqueue(ctx, [=](CpuContext& c) {
      float* dgf = stage(c, 3, dgate, false);
      float* duf = stage(c, 4, dup, false);
      const float* d = widen(c, 0, dout);
      const float* g = widen(c, 1, gate);
      const float* u = widen(c, 2, up);
      if (act == GluActivation::kClampedSwiglu) {
        for_chunks(gate.numel(), [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) clamped_swiglu_backward(d[i], g[i], u[i], clamp, dgf + i, duf + i);
        });
      } else if (act == GluActivation::kGeluTanh) {
        for_chunks(gate.numel(), [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            dgf[i] = d[i] * u[i] * gelu_tanh_derivative(g[i]);
            duf[i] = d[i] * gelu_tanh(g[i]);
          }
        });
      } else {
        for_chunks(gate.numel(), [&](int64_t b, int64_t e) {
          vec::swiglu_backward(d + b, g + b, u + b, e - b, dgf + b, duf + b);
        });
      }
      commit(dgf, dgate);
      commit(duf, dup);
    });
  }

  void enqueue_add(ComputeContext& ctx, const TensorView& a, const TensorView& b,
           const TensorView& out) override {
    enqueue(ctx, [=](CpuContext& c) {
      // Widen both inputs before staging the output: out may alias a or b.
      const float* af = widen(c, 0, a);
      const float* bf = widen(c, 1, b);
      float* of = stage(c, 2, out, false);
      nn::cpu::add<float>(af, bf, a.numel(), of);
      commit(of, out);
    });
  }

  void enqueue_dropout(ComputeContext& ctx, const MatView& x, const MatView& out, float p, uint64_t seed,
                       bool accumulate) override {
    enqueue(ctx, [=](CpuContext& c) {
      const F32Mat xf = widen(c, 0, x);
      const F32Mat of = stage(c, 1, out, accumulate);
      const float scale = 1.0f / (1.0f - p);
      const int64_t rows = x.rows, cols = x.cols;
#pragma omp parallel for schedule(static) if (rows * cols >= kMinParallelWork)
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t col = 0; col < cols; ++col) {
          const auto index = static_cast<uint64_t>(r * cols + col);
          const float v = dropout_keep(seed, index, p) ? xf.data[r * xf.ld + col] * scale : 0.0f;
          float& o = of.data[r * of.ld + col];
          o = accumulate ? o + v : v;
        }
      }
      commit(of, out);
    });
  }

  void enqueue_cross_entropy(ComputeContext& ctx, const TensorView& h, const TensorView& w,
                     const TensorView& targets, int64_t chunk_rows, const TensorView& lse,
                     const TensorView& stats, const CrossEntropyGrad* grad, float logit_softcap) override;

  void enqueue_count_targets(ComputeContext& ctx, const TensorView& targets,
                     const TensorView& count) override {
    enqueue(ctx, [=](CpuContext&) {
      count.as<double>()[0] +=
          static_cast<double>(nn::cpu::count_targets(targets.as<const int32_t>(), targets.numel()));
    });
  }

  // ---- vocabulary-parallel cross-entropy: rows of this rank's logits ------------
  void enqueue_vocab_parallel_parts(ComputeContext& ctx, const TensorView& logits, const TensorView& targets,
                                    int64_t first_id, const TensorView& parts) override {
    const int64_t n = logits.desc.shape[0], shard = logits.desc.shape[1];
    enqueue(ctx, [=](CpuContext& c) {
      const float* l = widen(c, 0, logits);
      const auto* tgt = targets.as<const int32_t>();
      float* lse = parts.as<float>();
      float* target_logit = lse + n;
#pragma omp parallel for schedule(static) if (n * shard >= kMinParallelWork)
      for (int64_t r = 0; r < n; ++r) {
        const float* lr = l + r * shard;
        const float m = vec::max(lr, shard);
        lse[r] = static_cast<float>(static_cast<double>(m) + std::log(vec::exp_shifted(lr, shard, m, nullptr)));
        const int64_t local = static_cast<int64_t>(tgt[r]) - first_id;
        target_logit[r] = tgt[r] != kIgnoreIndex && local >= 0 && local < shard ? lr[local] : 0.0f;
      }
    });
  }

  void enqueue_vocab_parallel_loss(ComputeContext& ctx, const TensorView& logits, const TensorView& gathered,
                                   const TensorView& targets, int64_t first_id, int64_t vocab, const TensorView& lse,
                                   const TensorView& stats, const VocabParallelGrad* grad) override {
    const int64_t n = logits.desc.shape[0], shard = logits.desc.shape[1], ranks = gathered.desc.shape[0];
    const bool want_grad = grad != nullptr;
    VocabParallelGrad g;
    if (want_grad) g = *grad;
    enqueue(ctx, [=](CpuContext& c) {
      const auto* tgt = targets.as<const int32_t>();
      const double scale =
          checked_loss_scale("vocab_parallel_loss", tgt, n, vocab, want_grad ? &g.normalizer : nullptr, g.grad_scale);
      const float* parts = gathered.as<const float>();
      float* lse_out = lse.as<float>();
      // The whole vocabulary's log-sum-exp and target logit, ranks in order.
      double loss = 0, counted = 0;
      for (int64_t r = 0; r < n; ++r) {
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t p = 0; p < ranks; ++p) m = std::max(m, static_cast<double>(parts[(p * 2) * n + r]));
        double sum = 0, target_logit = 0;
        for (int64_t p = 0; p < ranks; ++p) {
          sum += std::exp(static_cast<double>(parts[(p * 2) * n + r]) - m);
          target_logit += parts[(p * 2 + 1) * n + r];
        }
        const double row_lse = m + std::log(sum);
        lse_out[r] = static_cast<float>(row_lse);
        if (tgt[r] != kIgnoreIndex) {
          loss += row_lse - target_logit;
          counted += 1;
        }
      }
      stats.as<double>()[0] += loss;
      stats.as<double>()[1] += counted;
      if (!want_grad) return;
      float* d = stage(c, 0, logits, true);
#pragma omp parallel for schedule(static) if (n * shard >= kMinParallelWork)
      for (int64_t r = 0; r < n; ++r) {
        float* dr = d + r * shard;
        if (tgt[r] == kIgnoreIndex) {
          std::fill(dr, dr + shard, 0.0f);
          continue;
        }
        // d loss / d logit = scale * (softmax - onehot) on this rank's columns.
        const float row_lse = lse_out[r];
        for (int64_t col = 0; col < shard; ++col) dr[col] = static_cast<float>(scale) * std::exp(dr[col] - row_lse);
        const int64_t local = static_cast<int64_t>(tgt[r]) - first_id;
        if (local >= 0 && local < shard) dr[local] -= static_cast<float>(scale);
      }
      commit(d, logits);
    });
  }

  // ---- mixture of experts (small bookkeeping; rows of dim copied or summed) ----
  void enqueue_moe_route(ComputeContext& ctx, const TensorView& logits, int64_t top_k, const MoeRouter& router,
                         const TensorView& correction_bias, const TensorView& probs, const TensorView& indices,
                         const TensorView& weights, const TensorView& offsets, const TensorView& slots,
                         const TensorView& tokens, const TensorView& aux_stats) override {
    enqueue(ctx, [=](CpuContext& c) {
      const int64_t rows = probs.desc.shape[0], experts = probs.desc.shape[1], k = top_k;
      const float* lf = widen(c, 0, logits);
      const float* bias = empty(correction_bias) ? nullptr : correction_bias.as<const float>();
      float* p = probs.as<float>();
      int32_t* idx = indices.as<int32_t>();
      float* w = weights.as<float>();
      std::vector<uint64_t> allowed(static_cast<size_t>((router.groups + 63) / 64));
      for (int64_t r = 0; r < rows; ++r) {
        const float* l = lf + r * experts;
        float* pr = p + r * experts;
        if (router.scores == MoeScores::kSigmoid) {
          for (int64_t e = 0; e < experts; ++e) pr[e] = 1.0f / (1.0f + std::exp(-l[e]));
        } else {
          float m = l[0];
          for (int64_t e = 1; e < experts; ++e) m = std::max(m, l[e]);
          float sum = 0;
          for (int64_t e = 0; e < experts; ++e) sum += (pr[e] = std::exp(l[e] - m));
          for (int64_t e = 0; e < experts; ++e) pr[e] /= sum;
        }
        moe_choose(router, pr, bias, experts, k, allowed.data(), idx + r * k, w + r * k);
      }
      // Counting sort of the assignments by expert, stable in (row, j).
      int32_t* off = offsets.as<int32_t>();
      std::fill(off, off + experts + 1, 0);
      for (int64_t a = 0; a < rows * k; ++a) ++off[idx[a] + 1];
      for (int64_t e = 0; e < experts; ++e) off[e + 1] += off[e];
      std::vector<int32_t> next(off, off + experts);
      int32_t* slot = slots.as<int32_t>();
      int32_t* tok = tokens.as<int32_t>();
      for (int64_t a = 0; a < rows * k; ++a) {
        const int32_t s = next[static_cast<size_t>(idx[a])]++;
        slot[a] = s;
        tok[s] = static_cast<int32_t>(a / k);
      }
      if (!empty(aux_stats)) {
        double* st = aux_stats.as<double>();
        for (int64_t e = 0; e < experts; ++e) {
          st[e] += off[e + 1] - off[e];
          double psum = 0;
          for (int64_t r = 0; r < rows; ++r) psum += p[r * experts + e];
          st[experts + e] += psum;
        }
      }
    });
  }

  void enqueue_moe_route_backward(ComputeContext& ctx, const TensorView& probs, const TensorView& indices,
                                  const TensorView& weights, const TensorView& dweights, const MoeRouter& router,
                                  const TensorView& aux_grad, const TensorView& dlogits) override {
    enqueue(ctx, [=](CpuContext& c) {
      const int64_t rows = probs.desc.shape[0], experts = probs.desc.shape[1], k = indices.desc.shape[1];
      float* dl = stage(c, 0, dlogits, false);
      const float* p = probs.as<const float>();
      const int32_t* idx = indices.as<const int32_t>();
      const float* w = weights.as<const float>();
      const float* dw = dweights.as<const float>();
      const float* ag = empty(aux_grad) ? nullptr : aux_grad.as<const float>();
#pragma omp parallel for schedule(static) if (rows * experts >= kMinParallelWork)
      for (int64_t r = 0; r < rows; ++r) {
        const float* pr = p + r * experts;
        float* dp = dl + r * experts;  // d loss / d probs first (moe_dprob), then through the scores
        for (int64_t e = 0; e < experts; ++e) {
          dp[e] = moe_dprob(router, pr, idx + r * k, w + r * k, dw + r * k, k, ag, e);
        }
        if (router.scores == MoeScores::kSigmoid) {
          for (int64_t e = 0; e < experts; ++e) dp[e] *= pr[e] * (1.0f - pr[e]);
        } else {
          float pd = 0;
          for (int64_t e = 0; e < experts; ++e) pd += pr[e] * dp[e];
          for (int64_t e = 0; e < experts; ++e) dp[e] = pr[e] * (dp[e] - pd);
        }
      }
      commit(dl, dlogits);
    });
  }

  void enqueue_moe_gather(ComputeContext& ctx, const TensorView& x, const TensorView& tokens,
                          const TensorView& xp) override {
    enqueue(ctx, [=](CpuContext&) {
      const int64_t n = xp.desc.shape[0], dim = xp.desc.shape[1];
      const auto row_bytes = static_cast<size_t>(dim) * dtype_nbytes(x.desc.dtype);
      const int32_t* tok = tokens.as<const int32_t>();
      for (int64_t s = 0; s < n; ++s) {
        std::memcpy(xp.as<char>() + static_cast<size_t>(s) * row_bytes,
                    x.as<const char>() + static_cast<size_t>(tok[s]) * row_bytes, row_bytes);
      }
    });
  }

  void enqueue_moe_gather_backward(ComputeContext& ctx, const TensorView& dxp, const TensorView& slots,
                                   const TensorView& dx, bool accumulate) override {
    enqueue(ctx, [=](CpuContext& c) {
      const int64_t rows = slots.desc.shape[0], k = slots.desc.shape[1], dim = dx.desc.shape[1];
      float* dxf = stage(c, 1, dx, accumulate);
      const float* dpf = widen(c, 0, dxp);
      const int32_t* slot = slots.as<const int32_t>();
#pragma omp parallel for schedule(static) if (rows * dim * k >= kMinParallelWork)
      for (int64_t r = 0; r < rows; ++r) {
        float* out = dxf + r * dim;
        if (!accumulate) std::fill(out, out + dim, 0.0f);
        for (int64_t j = 0; j < k; ++j) {
          const float* in = dpf + static_cast<int64_t>(slot[r * k + j]) * dim;
          for (int64_t d = 0; d < dim; ++d) out[d] += in[d];
        }
      }
      commit(dxf, dx);
    });
  }

  void enqueue_moe_combine(ComputeContext& ctx, const TensorView& yp, const TensorView& slots,
                           const TensorView& weights, const TensorView& y) override {
    enqueue(ctx, [=](CpuContext& c) {
      const int64_t rows = slots.desc.shape[0], k = slots.desc.shape[1], dim = y.desc.shape[1];
      float* yf = stage(c, 1, y, false);
      const float* ypf = widen(c, 0, yp);
      const int32_t* slot = slots.as<const int32_t>();
      const float* w = weights.as<const float>();
#pragma omp parallel for schedule(static) if (rows * dim * k >= kMinParallelWork)
      for (int64_t r = 0; r < rows; ++r) {
        float* out = yf + r * dim;
        std::fill(out, out + dim, 0.0f);
        for (int64_t j = 0; j < k; ++j) {
          const float* in = ypf + static_cast<int64_t>(slot[r * k + j]) * dim;
          const float wj = w[r * k + j];
          for (int64_t d = 0; d < dim; ++d) out[d] += wj * in[d];
        }
      }
      commit(yf, y);
    });
  }

  void enqueue_moe_combine_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& yp,
                                    const TensorView& slots, const TensorView& weights,
                                    const TensorView& dyp, const TensorView& dweights) override {
    enqueue(ctx, [=](CpuContext& c) {
      const int64_t rows = slots.desc.shape[0], k = slots.desc.shape[1], dim = dy.desc.shape[1];
      float* dypf = stage(c, 2, dyp, false);
      const float* dyf = widen(c, 0, dy);
      const float* ypf = widen(c, 1, yp);
      const int32_t* slot = slots.as<const int32_t>();
      const float* w = weights.as<const float>();
      float* dw = dweights.as<float>();
#pragma omp parallel for schedule(static) if (rows * dim * k >= kMinParallelWork)
      for (int64_t r = 0; r < rows; ++r) {
        const float* g = dyf + r * dim;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t s = slot[r * k + j];
          const float* in = ypf + s * dim;
          float* out = dypf + s * dim;
          const float wj = w[r * k + j];
          float dot = 0;
          for (int64_t d = 0; d < dim; ++d) {
            out[d] = wj * g[d];
            dot += g[d] * in[d];
          }
          dw[r * k + j] = dot;
        }
      }
      commit(dypf, dyp);
    });
  }

  void enqueue_sigmoid_gated_add(ComputeContext& ctx, const TensorView& v, const TensorView& gate,
                                 const TensorView& y) override {
    enqueue(ctx, [=](CpuContext& c) {
      const int64_t rows = y.desc.shape[0], dim = y.desc.shape[1];
      float* yf = stage(c, 2, y, true);
      const float* vf = widen(c, 0, v);
      const float* sf = widen(c, 1, gate);
#pragma omp parallel for schedule(static) if (rows * dim >= kMinParallelWork)
      for (int64_t r = 0; r < rows; ++r) {
        const float g = 1.0f / (1.0f + std::exp(-sf[r]));
        for (int64_t d = 0; d < dim; ++d) yf[r * dim + d] += g * vf[r * dim + d];
      }
      commit(yf, y);
    });
  }

  void enqueue_sigmoid_gated_add_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& v,
                                          const TensorView& gate, const TensorView& dv,
                                          const TensorView& dgate) override {
    enqueue(ctx, [=](CpuContext& c) {
      const int64_t rows = dy.desc.shape[0], dim = dy.desc.shape[1];
      float* dvf = stage(c, 3, dv, false);
      float* dsf = stage(c, 4, dgate, false);
      const float* dyf = widen(c, 0, dy);
      const float* vf = widen(c, 1, v);
      const float* sf = widen(c, 2, gate);
#pragma omp parallel for schedule(static) if (rows * dim >= kMinParallelWork)
      for (int64_t r = 0; r < rows; ++r) {
        const float g = 1.0f / (1.0f + std::exp(-sf[r]));
        float dot = 0;
        for (int64_t d = 0; d < dim; ++d) {
          dvf[r * dim + d] = g * dyf[r * dim + d];
          dot += dyf[r * dim + d] * vf[r * dim + d];
        }
        dsf[r] = g * (1.0f - g) * dot;
      }
      commit(dvf, dv);
      commit(dsf, dgate);
    });
  }

  void enqueue_moe_aux_loss(ComputeContext& ctx, const TensorView& aux_stats, double rows, double scale,
                            const TensorView& aux, const TensorView& aux_grad) override {
    enqueue(ctx, [=](CpuContext&) {
      const int64_t experts = aux_stats.numel() / 2;
      const double* st = aux_stats.as<const double>();
      double sum = 0;
      for (int64_t e = 0; e < experts; ++e) {
        sum += (st[e] / rows) * (st[experts + e] / rows);
        aux_grad.as<float>()[e] =
            static_cast<float>(scale * static_cast<double>(experts) * st[e] / (rows * rows));
      }
      aux.as<double>()[0] = static_cast<double>(experts) * sum;
    });
  }

  void enqueue_cast(ComputeContext& ctx, const TensorView& src, const TensorView& dst) override {
    enqueue(ctx, [=](CpuContext&) {
      const MatView s = MatView::of(src), d = MatView::of(dst);
      convert_rows(s.data, s.dtype, s.ld, d.data, d.dtype, d.ld, s.rows, s.cols);
    });
  }

  void enqueue_dequantize_fp8_blocks(ComputeContext& ctx, const TensorView& weight, const TensorView& scale_inv,
                                     const kernels::Fp8Blocks& shape, const TensorView& out) override {
    enqueue(ctx, [=](CpuContext&) {
      // Row by row (each row's runs are independent), the reader's arithmetic.
      const int64_t cols = shape.cols;
      for_each_out_row(shape.rows, cols, out, [&](int64_t r, void* out_row) {
        kernels::dequantize_fp8_blocks(weight.as<uint8_t>() + r * cols, scale_inv.as<float>(), shape, r * cols, cols,
                                       out_row, out.desc.dtype);
      });
    });
  }

  void enqueue_dequantize_mxfp4_blocks(ComputeContext& ctx, const TensorView& packed, const TensorView& scales,
                                       const kernels::Mxfp4Blocks& shape, const TensorView& out) override {
    enqueue(ctx, [=](CpuContext&) {
      // Row by row (each row's blocks are its own), the reader's value table.
      const int64_t cols = shape.cols;
      for_each_out_row(shape.rows, cols, out, [&](int64_t r, void* out_row) {
        kernels::dequantize_mxfp4(packed.as<uint8_t>() + r * cols / 2, scales.as<uint8_t>(), r * cols, cols, out_row,
                                  out.desc.dtype);
      });
    });
  }

  void enqueue_adam_step(ComputeContext& ctx, const kernels::AdamCoefficients& coeffs, const TensorView& param,
                 const TensorView& exp_avg, const TensorView& exp_avg_sq, const TensorView& grad,
                 const TensorView& param_copy) override {
    enqueue(ctx, [=](CpuContext&) {
      const DType copy = param_copy.data == nullptr ? DType::kF32 : param_copy.desc.dtype;
      kernels::AdamBuffers b;
      b.param = param.as<float>();
      b.exp_avg = exp_avg.as<float>();
      b.exp_avg_sq = exp_avg_sq.as<float>();
      b.grad = grad.data;
      b.grad_dtype = DType::kF32;
      b.numel = static_cast<size_t>(param.numel());
      if (copy != DType::kF32) {  // the kernel writes a 16-bit copy itself
        b.param16 = param_copy.data;
        b.param16_dtype = copy;
      }
      kernels::adam_step(coeffs, b);  // its default ISA; threads: this stream thread's team
      if (param_copy.data != nullptr && copy == DType::kF32 && param_copy.data != param.data) {
        std::memcpy(param_copy.data, param.data, param.nbytes());
      }
    });
  }

  void enqueue_grad_sum_sq(ComputeContext& ctx, const TensorView& grad, float scale, const TensorView& out) override {
    enqueue(ctx, [=](CpuContext&) {
      out.as<double>()[0] =
          kernels::grad_stats(grad.data, DType::kF32, static_cast<size_t>(grad.numel()), scale).sum_sq;
    });
  }

 private:
  template <typename Fn>
  void enqueue(ComputeContext& ctx, Fn&& fn) {
    auto& c = static_cast<CpuContext&>(ctx);
    if (ctx.op_label().name != nullptr) [[unlikely]] {  // recording a trace: time the task
      ctx.stream().launch_host_func([&c, fn = std::forward<Fn>(fn), label = ctx.op_label()] {
        set_team_size();
        const int64_t begin = trace::now_ns();
        fn(c);
        const int64_t end = trace::now_ns();
        trace::Args args;
        args.bytes = label.flops > 0 ? trace::Args::kNoBytes : label.bytes;
        args.detail_key = "shape";
        args.detail = label.shape;
        if (label.flops > 0) {
          args.value_key = "flops";
          args.value = label.flops;
        }
        trace::complete("op", label.name, begin, end, args);
        add_op_total(label.name, end - begin, label.flops, label.bytes);
      });
      return;
    }
    ctx.stream().launch_host_func([&c, fn = std::forward<Fn>(fn)] {
      set_team_size();
      fn(c);
    });
  }

  // OpenMP's team size is per thread: set it on the stream's thread.
  static void set_team_size() {
    const int threads = g_cpu_threads.load(std::memory_order_relaxed);
    if (threads > 0 && omp_get_max_threads() != threads) omp_set_num_threads(threads);
  }

};

void CpuOps::enqueue_cross_entropy(ComputeContext& ctx, const TensorView& h, const TensorView& w,
                           const TensorView& targets, int64_t chunk_rows, const TensorView& lse,
                           const TensorView& stats, const CrossEntropyGrad* grad, float logit_softcap) {
  const int64_t vocab = w.desc.shape[0], dim = w.desc.shape[1], rows = targets.numel();
  CrossEntropyGrad g;
  if (grad != nullptr) g = *grad;
  const bool want_grad = grad != nullptr;
  enqueue(ctx, [=](CpuContext& c) {
    const float* hf = widen(c, 0, h);
    // The whole weight is widened once when it is 16-bit: a softmax row needs
    // every vocabulary column, so per-block widening would repeat per row chunk.
    const float* wf = widen(c, 1, w);
    float* dhf = want_grad ? stage(c, 2, g.dh, false) : nullptr;
    const int64_t chunk = std::min(chunk_rows, std::max<int64_t>(rows, 1));
    float* logits = c.scratch<float>(3, chunk * vocab);
    float* caps = logit_softcap > 0 ? c.scratch<float>(4, chunk * vocab) : nullptr;
    const auto* tgt = targets.as<const int32_t>();
    float* lse_out = lse.as<float>();
    const double scale =
        checked_loss_scale("cross_entropy", tgt, rows, vocab, want_grad ? &g.normalizer : nullptr, g.grad_scale);
    double loss = 0, counted = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t n = std::min(chunk, rows - r0);
      gemm<float>(false, true, n, vocab, dim, 1.0f, hf + r0 * dim, dim, wf, dim, 0.0f, logits,
                  vocab);
#pragma omp parallel for schedule(static) reduction(+ : loss, counted) if (n * vocab >= kMinParallelWork)
      for (int64_t r = 0; r < n; ++r) {
        float* lr = logits + r * vocab;
        const int32_t t = tgt[r0 + r];
        const bool counts = t != kIgnoreIndex;
        float* slope = nullptr;  // with a soft cap: 1 - tanh^2 of each logit (the cap's derivative)
        if (logit_softcap > 0) {
          slope = caps + r * vocab;
          for (int64_t j = 0; j < vocab; ++j) {
            lr[j] = logit_softcap * std::tanh(lr[j] / logit_softcap);
            slope[j] = 1.0f - (lr[j] / logit_softcap) * (lr[j] / logit_softcap);
          }
        }
        const double logit_t = counts ? lr[t] : 0.0;  // before the exponentials replace it
        const float m = vec::max(lr, vocab);
        // In place: the gradient needs the exponentials, the loss only their sum.
        const double sum = vec::exp_shifted(lr, vocab, m, want_grad ? lr : nullptr);
        const double row_lse = static_cast<double>(m) + std::log(sum);
        lse_out[r0 + r] = static_cast<float>(row_lse);
        if (counts) {
          loss += row_lse - logit_t;
          counted += 1;
        }
        if (want_grad) {
          // d loss / d logit = scale * (softmax - onehot); ignored rows give 0.
          vec::scale(lr, vocab, counts ? static_cast<float>(scale / sum) : 0.0f);
          if (counts) lr[t] -= static_cast<float>(scale);
          if (slope != nullptr) {
            for (int64_t j = 0; j < vocab; ++j) lr[j] *= slope[j];
          }
        }
      }
      if (want_grad) {
        gemm<float>(false, false, n, dim, vocab, 1.0f, logits, vocab, wf, dim, 0.0f,
                    dhf + r0 * dim, dim);
        if (!empty(g.dw)) {
          gemm<float>(true, false, vocab, dim, n, 1.0f, logits, vocab, hf + r0 * dim, dim, 1.0f,
                      g.dw.as<float>(), dim);
        }
      }
    }
    if (want_grad) commit(dhf, g.dh);
    stats.as<double>()[0] += loss;
    stats.as<double>()[1] += counted;
  });
}

}  // namespace

void set_cpu_threads(int threads) { g_cpu_threads.store(std::max(threads, 0)); }

std::string cpu_blas_core() {
  const blas::Api& a = blas::api();
  return a.core + " (" + a.core_source + ")";
}

std::unique_ptr<Ops> make_cpu_ops(Accelerator& accelerator) {
  return std::make_unique<CpuOps>(accelerator);
}

}  // namespace strata::ops
