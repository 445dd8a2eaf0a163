// The cuda implementation of Ops (kernels/ops.h): its own argument limits
// (device memory, 32-bit extents; the front end has checked the rest), the
// per-stream context (cuBLAS handle and workspace), stream-ordered scratch,
// the row-major GEMMs through cuBLAS, and the orchestration of the kernels in
// kernels/cuda/*.cu.
//
// GEMMs: cublasGemmEx with CUBLAS_COMPUTE_32F (fp32 accumulation; tensor cores
// for 16-bit inputs, no TF32 for fp32) and reduced-precision split-K
// reductions disallowed. Weight gradients go straight into their fp32
// accumulators (16-bit A and B, fp32 C, beta = 1). cuBLAS wants A and B of
// one type, so a parameter stored in another dtype than the activations is
// cast into scratch first.
//
// Nothing here synchronises with the host. Scratch comes from the context's
// accelerator and is released with deallocate_after an event recorded after
// the op's last kernel. A CUDA launch or cuBLAS failure is made the stream's
// error (a host function that throws it), as the Ops contract says; argument
// errors and scratch allocation failures throw before anything is enqueued.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <string>
#include <utility>

#include "kernels/cuda/launch.h"
#include "kernels/ops.h"
#include "core/error.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/device_guard.h"

namespace strata::ops {
namespace {

using cuda::Storage;

Storage storage(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return Storage::kF16;
    case DType::kBF16:
      return Storage::kBF16;
    default:
      return Storage::kF32;
  }
}

// The coefficients the device update reads, field for field (launch.h cannot
// see kernels/optimizer.h).
cuda::AdamScalars adam_scalars(const kernels::AdamCoefficients& c) {
  cuda::AdamScalars k;
  k.beta1 = c.beta1;
  k.beta2 = c.beta2;
  k.one_minus_beta1 = c.one_minus_beta1;
  k.one_minus_beta2 = c.one_minus_beta2;
  k.eps = c.eps;
  k.step_size = c.step_size;
  k.inv_bias2_sqrt = c.inv_bias2_sqrt;
  k.decay = c.decay;
  k.l2 = c.l2;
  k.grad_scale = c.grad_scale;
  return k;
}

cudaDataType_t blas_type(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

int64_t esize(DType dtype) {
  return static_cast<int64_t>(dtype_nbytes(dtype));
}

const char* offset(const void* p, int64_t bytes) {
  return static_cast<const char*>(p) + bytes;
}
char* offset(void* p, int64_t bytes) {
  return static_cast<char*>(p) + bytes;
}

// A launch or cuBLAS failure inside an op, turned into the stream's error at
// the op boundary (run()).
struct LaunchFailure {
  std::string message;
};

void check_status(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw LaunchFailure{
        fmt::format("{}: {} ({})", what, cudaGetErrorString(status), cudaGetErrorName(status))};
  }
}
void check_launch(const char* what) {
  check_status(cudaGetLastError(), what);
}
void check_blas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw LaunchFailure{fmt::format("{}: cuBLAS {}", what, cublasGetStatusString(status))};
  }
}

// cuBLAS's recommended workspace on Hopper (smaller suffices before it).
constexpr size_t kBlasWorkspaceNbytes = size_t{32} << 20;

class CudaContext final : public ComputeContext {
 public:
  CudaContext(Accelerator& accelerator, Stream& stream) : ComputeContext(accelerator, stream) {
    STRATA_CHECK(stream.native_handle() != nullptr, kBadArgument,
                 "cuda Ops: make_context needs a stream of the cuda accelerator");
    STRATA_CUDA_CHECK(cudaStreamGetDevice(cuda_stream(), &device_));
    DeviceGuard scope(device_);
    event_ = accelerator.create_event();
    STRATA_CUBLAS_CHECK(cublasCreate(&handle_));
    try {
      STRATA_CUBLAS_CHECK(cublasSetStream(handle_, cuda_stream()));
      // fp32 accumulation throughout: no split-K reductions in 16-bit.
      STRATA_CUBLAS_CHECK(cublasSetMathMode(
          handle_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                             CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
      workspace_ = accelerator.allocate(kBlasWorkspaceNbytes);
      STRATA_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_, kBlasWorkspaceNbytes));
    } catch (...) {
      cublasDestroy(handle_);
      if (workspace_ != nullptr) accelerator.deallocate(workspace_);
      throw;
    }
  }

  ~CudaContext() override {
    // cuBLAS work queued with the workspace may still run: free it in stream order.
    release(workspace_);
    try {
      DeviceGuard guard(device_);
      cublasDestroy(handle_);
    } catch (const Error&) {
      cublasDestroy(handle_);  // on whatever device is current: better than leaking the handle
    }
  }

  void* blas_handle() const override { return handle_; }
  cublasHandle_t handle() const { return handle_; }
  cudaStream_t cuda_stream() const { return static_cast<cudaStream_t>(stream().native_handle()); }
  int device() const { return device_; }

  // Frees ptr (from accelerator().allocate) once the work queued so far on
  // this context's stream has run. Never throws: if the event cannot be
  // recorded the block is leaked, since freeing it now could hand it to new
  // work while queued kernels still use it.
  void release(void* ptr) noexcept {
    if (ptr == nullptr) return;
    try {
      stream().record(*event_);
      accelerator().deallocate_after(ptr, *event_);
    } catch (...) {
    }
  }

 private:
  int device_ = 0;
  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::unique_ptr<Event> event_;  // re-recorded per release; deallocate_after keeps its point
};

// Device scratch for one op, released in stream order when it goes out of
// scope (after the op has enqueued everything that uses it).
class Scratch {
 public:
  Scratch(CudaContext& ctx, size_t nbytes)
      : ctx_(&ctx), ptr_(nbytes == 0 ? nullptr : ctx.accelerator().allocate(nbytes)) {}
  ~Scratch() { ctx_->release(ptr_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  CudaContext* ctx_;
  void* ptr_;
};

// Row-major C[m, n] = alpha op(A) op(B) + beta C, where op(A) is [m, k] (A stored
// [k, m] when trans_a) and op(B) is [k, n] (B stored [n, k] when trans_b).
// cuBLAS is column-major, and a row-major X with row stride ld is the
// column-major X^T with the same ld, so it computes C^T = op(B)^T op(A)^T:
// the operands swap places and m, n swap.
struct Operand {
  const void* data;
  DType dtype;
  int64_t ld;
};
void gemm(CudaContext& c, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
          const Operand& a, const Operand& b, float beta, void* cdata, DType ctype, int64_t ldc,
          const char* what, float alpha = 1.0f) {
  if (m == 0 || n == 0) return;
  check_blas(cublasGemmEx(c.handle(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                          trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
                          static_cast<int>(m), static_cast<int>(k), &alpha, b.data,
                          blas_type(b.dtype), static_cast<int>(b.ld), a.data, blas_type(a.dtype),
                          static_cast<int>(a.ld), &beta, cdata, blas_type(ctype),
                          static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             what);
}

bool empty(const TensorView& t) {
  return t.data == nullptr;
}
bool empty(const MatView& m) {
  return m.data == nullptr;
}

// cuBLAS and our grids take 32-bit extents.
void check_int(std::string_view op, std::string_view what, int64_t value) {
  STRATA_CHECK(value <= INT_MAX, kBadArgument, "{}: {} = {} exceeds what the cuda ops support ({})",
               op, what, value, INT_MAX);
}

// Device memory only: a kernel cannot address pageable host memory (a
// Tier::kCpu view), and touching it would fault the whole CUDA context.
void check_device(std::string_view op, std::string_view what, const TensorView& t) {
  STRATA_CHECK(t.desc.tier == Tier::kDevice, kBadArgument,
               "{}: {} is {} memory; the cuda ops need device tensors", op, what,
               tier_name(t.desc.tier));
}
// Every view in `views` (all present) is device memory.
void check_device(std::string_view op, std::initializer_list<std::pair<const char*, const TensorView*>> views) {
  for (const auto& [what, t] : views) check_device(op, what, *t);
}

class CudaOps final : public Ops {
 public:
  explicit CudaOps(Accelerator& accelerator) : Ops(accelerator, Backend::kCuda) {
    STRATA_CHECK(accelerator.backend() == Backend::kCuda, kBadArgument,
                 "make_cuda_ops needs a cuda accelerator, got {}", accelerator.name());
  }

 private:
  std::unique_ptr<ComputeContext> new_context(Stream& stream) override {
    return std::make_unique<CudaContext>(accelerator(), stream);
  }

  void enqueue_embedding_forward(ComputeContext& ctx, const TensorView& table, const TensorView& ids,
                         const TensorView& out, int64_t first_id, int64_t /*vocab*/, float scale) override {
    constexpr const char* op = "embedding_forward";
    CudaContext& c = context(ctx);
    check_device(op, {{"table", &table}, {"ids", &ids}, {"out", &out}});
    const int64_t held = table.desc.shape[0], dim = table.desc.shape[1], rows = ids.numel();
    run(c, op, [&] {
      cuda::launch_embedding_forward(storage(table.desc.dtype), table.data, ids.as<int32_t>(), rows,
                                     first_id, held, dim, storage(out.desc.dtype), out.data, scale,
                                     c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_embedding_backward(ComputeContext& ctx, const TensorView& dout, const TensorView& ids,
                          const TensorView& dtable, int64_t padding_idx, int64_t first_id,
                          int64_t /*vocab*/, float scale) override {
    constexpr const char* op = "embedding_backward";
    CudaContext& c = context(ctx);
    check_device(op, {{"dout", &dout}, {"ids", &ids}, {"dtable", &dtable}});
    const int64_t held = dtable.desc.shape[0], dim = dtable.desc.shape[1], rows = ids.numel();
    check_int(op, "rows", rows);
    run(c, op, [&] {
      const size_t nbytes = cuda::embedding_backward_scratch_nbytes(rows);
      Scratch scratch(c, nbytes);
      check_status(cuda::launch_embedding_backward(
                       storage(dout.desc.dtype), dout.data, ids.as<int32_t>(), rows, first_id, held, dim,
                       padding_idx, dtable.as<float>(), scratch.get(), nbytes, scale, c.cuda_stream()),
                   op);
      check_launch(op);
    });
  }

  void enqueue_rmsnorm_forward(ComputeContext& ctx, const TensorView& x, const TensorView& w, double eps,
                       const TensorView& y, const TensorView& rstd, float weight_offset) override {
    constexpr const char* op = "rmsnorm_forward";
    CudaContext& c = context(ctx);
    check_device(op, {{"x", &x}, {"w", &w}, {"y", &y}, {"rstd", &rstd}});
    const MatView xm = MatView::of(x);
    run(c, op, [&] {
      cuda::launch_rmsnorm_forward(storage(x.desc.dtype), x.data, storage(w.desc.dtype), w.data,
                                   xm.rows, xm.cols, static_cast<float>(eps), y.data,
                                   rstd.as<float>(), weight_offset, c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_rmsnorm_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& x,
                        const TensorView& w, const TensorView& rstd, const TensorView& dx,
                        bool accumulate_dx, const TensorView& dw, float weight_offset) override {
    constexpr const char* op = "rmsnorm_backward";
    CudaContext& c = context(ctx);
    check_device(op, {{"dy", &dy}, {"x", &x}, {"w", &w}, {"rstd", &rstd}, {"dx", &dx}});
    if (!empty(dw)) check_device(op, "dw", dw);
    const MatView xm = MatView::of(x);
    run(c, op, [&] {
      const Storage t = storage(x.desc.dtype);
      const int64_t splits = empty(dw) ? 1 : cuda::column_sum_splits(xm.rows, xm.cols);
      Scratch partial(c, splits > 1 ? static_cast<size_t>(splits * xm.cols) * 4 : 0);
      cuda::launch_rmsnorm_backward_dx(t, dy.data, x.data, storage(w.desc.dtype), w.data,
                                       rstd.as<float>(), xm.rows, xm.cols, dx.data, accumulate_dx,
                                       weight_offset, c.cuda_stream());
      check_launch(op);
      if (empty(dw)) return;  // a frozen weight
      // dw += sum over rows of dy * x * rstd.
      cuda::launch_column_sum(t, dy.data, xm.cols, x.data, xm.cols, rstd.as<float>(), xm.rows,
                              xm.cols, splits, partial.as<float>(), dw.as<float>(),
                              c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_linear_forward(ComputeContext& ctx, const MatView& x, const TensorView& w,
                      const TensorView& bias, const MatView& y, bool accumulate,
                      float scale) override {
    constexpr const char* op = "linear_forward";
    CudaContext& c = context(ctx);
    check_device(op, "w", w);
    if (!empty(bias)) check_device(op, "bias", bias);
    const int64_t out = w.desc.shape[0], in = w.desc.shape[1], rows = x.rows;
    for (auto [what, v] :
         {std::pair{"rows", rows}, {"in", in}, {"out", out}, {"x.ld", x.ld}, {"y.ld", y.ld}}) {
      check_int(op, what, v);
    }
    run(c, op, [&] {
      Scratch w_cast(c,
                     w.desc.dtype == x.dtype ? 0 : static_cast<size_t>(out * in * esize(x.dtype)));
      const void* wd = weight_as(c, w, x.dtype, w_cast, op);
      gemm(c, false, true, rows, out, in, {x.data, x.dtype, x.ld}, {wd, x.dtype, in},
           accumulate ? 1.0f : 0.0f, y.data, y.dtype, y.ld, op, scale);
      if (!empty(bias)) {
        cuda::launch_add_bias(storage(y.dtype), y.data, y.ld, storage(bias.desc.dtype), bias.data,
                              rows, out, c.cuda_stream());
        check_launch(op);
      }
    });
  }

  void enqueue_linear_backward(ComputeContext& ctx, const MatView& dy, const MatView& x,
                       const TensorView& w, const MatView& dx, bool accumulate_dx,
                       const TensorView& dw, const TensorView& dbias, float scale) override {
    constexpr const char* op = "linear_backward";
    CudaContext& c = context(ctx);
    check_device(op, "w", w);
    if (!empty(dw)) check_device(op, "dw", dw);
    if (!empty(dbias)) check_device(op, "dbias", dbias);
    const int64_t out = w.desc.shape[0], in = w.desc.shape[1], rows = dy.rows;
    for (auto [what, v] : {std::pair{"rows", rows},
                           {"in", in},
                           {"out", out},
                           {"dy.ld", dy.ld},
                           {"x.ld", x.ld},
                           {"dx.ld", dx.ld}}) {
      check_int(op, what, v);
    }
    run(c, op, [&] {
      const bool cast_w = !empty(dx) && w.desc.dtype != dy.dtype;
      Scratch w_cast(c, cast_w ? static_cast<size_t>(out * in * esize(dy.dtype)) : 0);
      const int64_t splits = empty(dbias) ? 1 : cuda::column_sum_splits(rows, out);
      Scratch partial(c, splits > 1 ? static_cast<size_t>(splits * out) * 4 : 0);
      if (!empty(dx)) {
        const void* wd = weight_as(c, w, dy.dtype, w_cast, op);
        // dx [rows, in] = dy [rows, out] W [out, in]
        gemm(c, false, false, rows, in, out, {dy.data, dy.dtype, dy.ld}, {wd, dy.dtype, in},
             accumulate_dx ? 1.0f : 0.0f, dx.data, dx.dtype, dx.ld, op, scale);
      }
      if (!empty(dw)) {
        // dw [out, in] += dy^T [out, rows] x [rows, in], straight into fp32.
        gemm(c, true, false, out, in, rows, {dy.data, dy.dtype, dy.ld}, {x.data, x.dtype, x.ld},
             1.0f, dw.data, DType::kF32, in, op, scale);
      }
      if (!empty(dbias)) {
        cuda::launch_column_sum(storage(dy.dtype), dy.data, dy.ld, nullptr, 0, nullptr, rows, out,
                                splits, partial.as<float>(), dbias.as<float>(), c.cuda_stream());
        check_launch(op);
      }
    });
  }

  void enqueue_dropout(ComputeContext& ctx, const MatView& x, const MatView& out, float p, uint64_t seed,
                       bool accumulate) override {
    constexpr const char* op = "dropout";
    CudaContext& c = context(ctx);
    for (auto [what, v] : {std::pair{"rows", x.rows}, {"cols", x.cols}, {"x.ld", x.ld}, {"out.ld", out.ld}}) {
      check_int(op, what, v);
    }
    run(c, op, [&] {
      cuda::launch_dropout(storage(x.dtype), x.data, x.ld, out.data, out.ld, x.rows, x.cols, p, seed, accumulate,
                           c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_rope(ComputeContext& ctx, const TensorView& x, const TensorView& positions,
                    const Rope& rope_params, int sign) override {
    const char* op = sign > 0 ? "rope_forward" : "rope_backward";
    CudaContext& c = context(ctx);
    check_device(op, {{"x", &x}, {"positions", &positions}});
    const int64_t rows = x.desc.shape[0], heads = x.desc.shape[1], head_dim = x.desc.shape[2];
    run(c, op, [&] {
      cuda::launch_rope(storage(x.desc.dtype), x.data, positions.as<int32_t>(), rows, heads,
                        head_dim, rope_params, static_cast<double>(sign), c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_attention_forward(ComputeContext& ctx, const AttentionShape& s, const TensorView& q,
                                 const TensorView& k, const TensorView& v, const TensorView& out,
                                 const TensorView& lse, const AttentionMask& mask) override {
    constexpr const char* op = "attention_forward";
    CudaContext& c = context(ctx);
    check_device(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}});
    const cuda::AttentionDims d = attention_dims(op, s, mask);
    run(c, op, [&] {
      check_status(cuda::launch_attention_forward(storage(q.desc.dtype), q.data, k.data, v.data, d,
                                                  out.data, lse.as<float>(), c.cuda_stream()),
                   op);
    });
  }

  void enqueue_attention_backward(ComputeContext& ctx, const AttentionShape& s, const TensorView& dout,
                                  const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const TensorView& lse, const TensorView& dq,
                                  const TensorView& dk, const TensorView& dv,
                                  const AttentionMask& mask) override {
    constexpr const char* op = "attention_backward";
    CudaContext& c = context(ctx);
    check_device(op, {{"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse},
                      {"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
    const cuda::AttentionDims d = attention_dims(op, s, mask);
    run(c, op, [&] {
      const Storage t = storage(q.desc.dtype);
      const cuda::AttentionBackwardPlan plan = cuda::plan_attention_backward(t, d);
      Scratch workspace(c, plan.workspace_nbytes);
      check_status(cuda::launch_attention_backward(t, dout.data, q.data, k.data, v.data, out.data,
                                                   lse.as<float>(), d, dq.data, dk.data, dv.data,
                                                   plan, workspace.get(), c.cuda_stream()),
                   op);
    });
  }

  void enqueue_attention_sinks_backward(ComputeContext& ctx, const AttentionShape& s, const TensorView& dout,
                                        const TensorView& out, const TensorView& lse, const AttentionMask& mask,
                                        const TensorView& dsinks) override {
    constexpr const char* op = "attention_sinks_backward";
    CudaContext& c = context(ctx);
    check_device(op, {{"dout", &dout}, {"out", &out}, {"lse", &lse}, {"dsinks", &dsinks}});
    const cuda::AttentionDims d{s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, mask, s.keys()};
    run(c, op, [&] {
      cuda::launch_attention_sinks_backward(storage(out.desc.dtype), dout.data, out.data, lse.as<const float>(),
                                            mask.sinks, d, dsinks.as<float>(), c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_attention_merge(ComputeContext& ctx, const AttentionShape& s, const TensorView& out,
                               const TensorView& lse, const TensorView& part,
                               const TensorView& part_lse) override {
    constexpr const char* op = "attention_merge";
    CudaContext& c = context(ctx);
    check_device(op, {{"out", &out}, {"lse", &lse}, {"part", &part}, {"part_lse", &part_lse}});
    run(c, op, [&] {
      cuda::launch_attention_merge(storage(part.desc.dtype), out.as<float>(), lse.as<float>(), part.data,
                                   part_lse.as<const float>(), s.batch, s.seq, s.heads, s.head_dim,
                                   c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_moe_route(ComputeContext& ctx, const TensorView& logits, int64_t top_k, const MoeRouter& router,
                         const TensorView& correction_bias, const TensorView& probs, const TensorView& indices,
                         const TensorView& weights, const TensorView& offsets, const TensorView& slots,
                         const TensorView& tokens, const TensorView& aux_stats) override {
    constexpr const char* op = "moe_route";
    CudaContext& c = context(ctx);
    check_device(op, {{"logits", &logits}, {"probs", &probs}, {"indices", &indices}, {"weights", &weights},
                      {"offsets", &offsets}, {"slots", &slots}, {"tokens", &tokens}});
    if (!empty(aux_stats)) check_device(op, "aux_stats", aux_stats);
    if (!empty(correction_bias)) check_device(op, "correction_bias", correction_bias);
    check_int(op, "rows * experts", probs.numel());
    STRATA_CHECK(router.groups <= kMaxMoeGroupWords * 64, kBadArgument,
                 "{}: {} expert groups; the cuda router holds at most {}", op, router.groups,
                 kMaxMoeGroupWords * 64);
    run(c, op, [&] {
      cuda::launch_moe_route(storage(logits.desc.dtype), logits.data, probs.desc.shape[0],
                             probs.desc.shape[1], top_k, router,
                             empty(correction_bias) ? nullptr : correction_bias.as<float>(), probs.as<float>(),
                             indices.as<int32_t>(), weights.as<float>(), offsets.as<int32_t>(),
                             slots.as<int32_t>(), tokens.as<int32_t>(),
                             empty(aux_stats) ? nullptr : aux_stats.as<double>(), c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_moe_route_backward(ComputeContext& ctx, const TensorView& probs, const TensorView& indices,
                                  const TensorView& weights, const TensorView& dweights, const MoeRouter& router,
                                  const TensorView& aux_grad, const TensorView& dlogits) override {
    constexpr const char* op = "moe_route_backward";
    CudaContext& c = context(ctx);
    check_device(op, {{"probs", &probs}, {"indices", &indices}, {"weights", &weights},
                      {"dweights", &dweights}, {"dlogits", &dlogits}});
    if (!empty(aux_grad)) check_device(op, "aux_grad", aux_grad);
    run(c, op, [&] {
      cuda::launch_moe_route_backward(probs.as<float>(), indices.as<int32_t>(), weights.as<float>(),
                                      dweights.as<float>(), probs.desc.shape[0], probs.desc.shape[1],
                                      indices.desc.shape[1], router,
                                      empty(aux_grad) ? nullptr : aux_grad.as<float>(),
                                      storage(dlogits.desc.dtype), dlogits.data, c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_moe_gather(ComputeContext& ctx, const TensorView& x, const TensorView& tokens,
                          const TensorView& xp) override {
    constexpr const char* op = "moe_gather";
    CudaContext& c = context(ctx);
    check_device(op, {{"x", &x}, {"tokens", &tokens}, {"xp", &xp}});
    run(c, op, [&] {
      cuda::launch_moe_gather(storage(x.desc.dtype), x.data, tokens.as<int32_t>(), xp.desc.shape[0],
                              xp.desc.shape[1], xp.data, c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_moe_gather_backward(ComputeContext& ctx, const TensorView& dxp, const TensorView& slots,
                                   const TensorView& dx, bool accumulate) override {
    constexpr const char* op = "moe_gather_backward";
    CudaContext& c = context(ctx);
    check_device(op, {{"dxp", &dxp}, {"slots", &slots}, {"dx", &dx}});
    run(c, op, [&] {
      cuda::launch_moe_gather_backward(storage(dx.desc.dtype), dxp.data, slots.as<int32_t>(),
                                       slots.desc.shape[0], slots.desc.shape[1], dx.desc.shape[1],
                                       accumulate, dx.data, c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_moe_combine(ComputeContext& ctx, const TensorView& yp, const TensorView& slots,
                           const TensorView& weights, const TensorView& y) override {
    constexpr const char* op = "moe_combine";
    CudaContext& c = context(ctx);
    check_device(op, {{"yp", &yp}, {"slots", &slots}, {"weights", &weights}, {"y", &y}});
    run(c, op, [&] {
      cuda::launch_moe_combine(storage(y.desc.dtype), yp.data, slots.as<int32_t>(), weights.as<float>(),
                               slots.desc.shape[0], slots.desc.shape[1], y.desc.shape[1], y.data,
                               c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_moe_combine_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& yp,
                                    const TensorView& slots, const TensorView& weights,
                                    const TensorView& dyp, const TensorView& dweights) override {
    constexpr const char* op = "moe_combine_backward";
    CudaContext& c = context(ctx);
    check_device(op, {{"dy", &dy}, {"yp", &yp}, {"slots", &slots}, {"weights", &weights}, {"dyp", &dyp},
                      {"dweights", &dweights}});
    check_int(op, "rows * k * 32", slots.numel() * 32);
    run(c, op, [&] {
      cuda::launch_moe_combine_backward(storage(dy.desc.dtype), dy.data, yp.data, slots.as<int32_t>(),
                                        weights.as<float>(), slots.desc.shape[0], slots.desc.shape[1],
                                        dy.desc.shape[1], dyp.data, dweights.as<float>(), c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_moe_aux_loss(ComputeContext& ctx, const TensorView& aux_stats, double rows, double scale,
                            const TensorView& aux, const TensorView& aux_grad) override {
    constexpr const char* op = "moe_aux_loss";
    CudaContext& c = context(ctx);
    check_device(op, {{"aux_stats", &aux_stats}, {"aux", &aux}, {"aux_grad", &aux_grad}});
    run(c, op, [&] {
      cuda::launch_moe_aux_loss(aux_stats.as<double>(), aux_stats.numel() / 2, rows, scale,
                                aux.as<double>(), aux_grad.as<float>(), c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_sigmoid_gated_add(ComputeContext& ctx, const TensorView& v, const TensorView& gate,
                                 const TensorView& y) override {
    constexpr const char* op = "sigmoid_gated_add";
    CudaContext& c = context(ctx);
    check_device(op, {{"v", &v}, {"gate", &gate}, {"y", &y}});
    run(c, op, [&] {
      cuda::launch_sigmoid_gated_add(storage(y.desc.dtype), v.data, gate.data, y.desc.shape[0], y.desc.shape[1],
                                     y.data, c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_sigmoid_gated_add_backward(ComputeContext& ctx, const TensorView& dy, const TensorView& v,
                                          const TensorView& gate, const TensorView& dv,
                                          const TensorView& dgate) override {
    constexpr const char* op = "sigmoid_gated_add_backward";
    CudaContext& c = context(ctx);
    check_device(op, {{"dy", &dy}, {"v", &v}, {"gate", &gate}, {"dv", &dv}, {"dgate", &dgate}});
    check_int(op, "rows * 32", dy.desc.shape[0] * 32);
    run(c, op, [&] {
      cuda::launch_sigmoid_gated_add_backward(storage(dy.desc.dtype), dy.data, v.data, gate.data,
                                              dy.desc.shape[0], dy.desc.shape[1], dv.data, dgate.data,
                                              c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_swiglu_forward(ComputeContext& ctx, const TensorView& gate, const TensorView& up,
                      const TensorView& out, GluActivation act, const GluClamp& clamp) override {
    constexpr const char* op = "swiglu_forward";
    CudaContext& c = context(ctx);
    check_device(op, {{"gate", &gate}, {"up", &up}, {"out", &out}});
    run(c, op, [&] {
      cuda::launch_swiglu_forward(storage(gate.desc.dtype), gate.data, up.data, gate.numel(),
                                  out.data, act, clamp, c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_swiglu_backward(ComputeContext& ctx, const TensorView& dout, const TensorView& gate,
                       const TensorView& up, const TensorView& dgate,
                       const TensorView& dup, GluActivation act, const GluClamp& clamp) override {
    constexpr const char* op = "swiglu_backward";
    CudaContext& c = context(ctx);
    check_device(op, {{"dout", &dout}, {"gate", &gate}, {"up", &up}, {"dgate", &dgate}, {"dup", &dup}});
    run(c, op, [&] {
      cuda::launch_swiglu_backward(storage(gate.desc.dtype), dout.data, gate.data, up.data,
                                   gate.numel(), dgate.data, dup.data, act, clamp, c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_add(ComputeContext& ctx, const TensorView& a, const TensorView& b,
           const TensorView& out) override {
    constexpr const char* op = "add";
    CudaContext& c = context(ctx);
    check_device(op, {{"a", &a}, {"b", &b}, {"out", &out}});
    run(c, op, [&] {
      cuda::launch_add(storage(a.desc.dtype), a.data, b.data, a.numel(), out.data, c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_cross_entropy(ComputeContext& ctx, const TensorView& h, const TensorView& w,
                     const TensorView& targets, int64_t chunk_rows, const TensorView& lse,
                     const TensorView& stats, const CrossEntropyGrad* grad, float logit_softcap) override;

  void enqueue_count_targets(ComputeContext& ctx, const TensorView& targets,
                     const TensorView& count) override {
    constexpr const char* op = "count_targets";
    CudaContext& c = context(ctx);
    check_device(op, {{"targets", &targets}, {"count", &count}});
    run(c, op, [&] {
      cuda::launch_count_targets(targets.as<int32_t>(), targets.numel(), count.as<double>(),
                                 c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_vocab_parallel_parts(ComputeContext& ctx, const TensorView& logits, const TensorView& targets,
                                    int64_t first_id, const TensorView& parts) override {
    constexpr const char* op = "vocab_parallel_parts";
    CudaContext& c = context(ctx);
    check_device(op, {{"logits", &logits}, {"targets", &targets}, {"parts", &parts}});
    const int64_t n = logits.desc.shape[0], shard = logits.desc.shape[1];
    check_int(op, "rows", n);
    run(c, op, [&] {
      cuda::launch_vocab_parallel_parts(storage(logits.desc.dtype), logits.data, targets.as<int32_t>(), n, shard,
                                        first_id, parts.as<float>(), c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_vocab_parallel_loss(ComputeContext& ctx, const TensorView& logits, const TensorView& gathered,
                                   const TensorView& targets, int64_t first_id, int64_t /*vocab*/,
                                   const TensorView& lse, const TensorView& stats,
                                   const VocabParallelGrad* grad) override {
    constexpr const char* op = "vocab_parallel_loss";
    CudaContext& c = context(ctx);
    check_device(op, {{"logits", &logits}, {"gathered", &gathered}, {"targets", &targets}, {"lse", &lse},
                      {"stats", &stats}});
    if (grad != nullptr) check_device(op, "normalizer", grad->normalizer);
    const int64_t n = logits.desc.shape[0], shard = logits.desc.shape[1], ranks = gathered.desc.shape[0];
    check_int(op, "rows", n);
    run(c, op, [&] {
      Scratch loss(c, static_cast<size_t>(n) * 4);  // before the first launch: a failure enqueues nothing
      cuda::launch_vocab_parallel_loss(storage(logits.desc.dtype), logits.data, gathered.as<float>(), ranks,
                                       targets.as<int32_t>(), n, shard, first_id, lse.as<float>(), loss.as<float>(),
                                       grad == nullptr ? nullptr : grad->normalizer.as<double>(),
                                       grad == nullptr ? 0.0 : grad->grad_scale, c.cuda_stream());
      check_launch(op);
      cuda::launch_ce_stats(loss.as<float>(), targets.as<int32_t>(), n, stats.as<double>(), c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_cast(ComputeContext& ctx, const TensorView& src, const TensorView& dst) override {
    constexpr const char* op = "cast";
    CudaContext& c = context(ctx);
    check_device(op, {{"src", &src}, {"dst", &dst}});
    if (src.data == dst.data && src.desc.dtype == dst.desc.dtype) return;
    run(c, op, [&] {
      cuda::launch_cast(storage(src.desc.dtype), src.data, storage(dst.desc.dtype), dst.data,
                        src.numel(), c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_dequantize_fp8_blocks(ComputeContext& ctx, const TensorView& weight, const TensorView& scale_inv,
                                     const kernels::Fp8Blocks& shape, const TensorView& out) override {
    constexpr const char* op = "dequantize_fp8_blocks";
    CudaContext& c = context(ctx);
    check_device(op, {{"weight", &weight}, {"scale_inv", &scale_inv}, {"out", &out}});
    run(c, op, [&] {
      cuda::launch_dequantize_fp8_blocks(weight.as<uint8_t>(), scale_inv.as<float>(), shape.rows, shape.cols,
                                         shape.block_rows, shape.block_cols, storage(out.desc.dtype), out.data,
                                         c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_dequantize_mxfp4_blocks(ComputeContext& ctx, const TensorView& packed, const TensorView& scales,
                                       const kernels::Mxfp4Blocks& shape, const TensorView& out) override {
    constexpr const char* op = "dequantize_mxfp4_blocks";
    CudaContext& c = context(ctx);
    check_device(op, {{"packed", &packed}, {"scales", &scales}, {"out", &out}});
    run(c, op, [&] {
      cuda::launch_dequantize_mxfp4_blocks(packed.as<uint8_t>(), scales.as<uint8_t>(), shape.numel(),
                                           storage(out.desc.dtype), out.data, c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_adam_step(ComputeContext& ctx, const kernels::AdamCoefficients& coeffs,
                 const TensorView& param, const TensorView& exp_avg, const TensorView& exp_avg_sq,
                 const TensorView& grad, const TensorView& param_copy) override {
    constexpr const char* op = "adam_step";
    CudaContext& c = context(ctx);
    check_device(op, {{"param", &param}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}, {"grad", &grad}});
    if (!empty(param_copy)) check_device(op, "param_copy", param_copy);
    // An fp32 copy that is param itself already holds the new values (as on cpu).
    const bool copy = !empty(param_copy) && param_copy.data != param.data;
    run(c, op, [&] {
      cuda::launch_adam_step(adam_scalars(coeffs), param.as<float>(), exp_avg.as<float>(),
                             exp_avg_sq.as<float>(), grad.as<float>(), param.numel(),
                             storage(copy ? param_copy.desc.dtype : DType::kF32),
                             copy ? param_copy.data : nullptr, c.cuda_stream());
      check_launch(op);
    });
  }

  void enqueue_grad_sum_sq(ComputeContext& ctx, const TensorView& grad, float scale,
                   const TensorView& out) override {
    constexpr const char* op = "grad_sum_sq";
    CudaContext& c = context(ctx);
    check_device(op, {{"grad", &grad}, {"out", &out}});
    run(c, op, [&] {
      // One fp64 partial per block of the first pass; none (and out = 0) for an empty grad.
      Scratch partial(c, static_cast<size_t>(cuda::grad_sum_sq_blocks(grad.numel())) * 8);
      cuda::launch_grad_sum_sq(grad.as<float>(), grad.numel(), scale, partial.as<double>(),
                               out.as<double>(), c.cuda_stream());
      check_launch(op);
    });
  }

 private:
  // The front end has checked that these Ops made the context.
  static CudaContext& context(ComputeContext& ctx) { return static_cast<CudaContext&>(ctx); }

  // Runs an op's enqueueing on the context's device; a launch or cuBLAS
  // failure becomes the stream's error (reported by later events and
  // synchronize), like a failing kernel on the cpu backend.
  template <typename Fn>
  void run(CudaContext& c, const char* op, Fn&& fn) {
    DeviceGuard scope(c.device());
    try {
      fn();
    } catch (LaunchFailure& failure) {
      std::string message = fmt::format("cuda {}: {}", op, failure.message);
      c.stream().launch_host_func(
          [message = std::move(message)] { throw Error(ErrorCategory::kCuda, message); });
    }
  }

  // w's data in `dtype`: w itself, or w cast into `scratch`.
  static const void* weight_as(CudaContext& c, const TensorView& w, DType dtype,
                               const Scratch& scratch, const char* op) {
    if (w.desc.dtype == dtype) return w.data;
    cuda::launch_cast(storage(w.desc.dtype), w.data, storage(dtype), scratch.get(), w.numel(),
                      c.cuda_stream());
    check_launch(op);
    return scratch.get();
  }

  static cuda::AttentionDims attention_dims(const char* op, const AttentionShape& s,
                                            const AttentionMask& mask) {
    STRATA_CHECK(s.head_dim <= cuda::kMaxAttentionHeadDim, kBadArgument,
                 "{}: head_dim {} is not supported by the cuda attention kernels (at most {})", op,
                 s.head_dim, cuda::kMaxAttentionHeadDim);
    STRATA_CHECK(s.batch <= 65535 && s.heads <= 65535 && s.seq <= INT_MAX / 2 && s.keys() <= INT_MAX / 2,
                 kBadArgument, "{}: batch {} and heads {} must be at most 65535, seq {} and keys {} at most {}", op,
                 s.batch, s.heads, s.seq, s.keys(), INT_MAX / 2);
    // Key blocks (context parallelism: keys != seq, global offsets, document
    // arrays covering the whole sequence) and sinks (device memory, like the
    // document arrays) are the kernels' own: the front end has checked them.
    return {s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, mask, s.keys()};
  }

};

void CudaOps::enqueue_cross_entropy(ComputeContext& ctx, const TensorView& h, const TensorView& w,
                            const TensorView& targets, int64_t chunk_rows, const TensorView& lse,
                            const TensorView& stats, const CrossEntropyGrad* grad, float logit_softcap) {
  constexpr const char* op = "cross_entropy";
  CudaContext& c = context(ctx);
  check_device(op, {{"h", &h}, {"w", &w}, {"targets", &targets}, {"lse", &lse}, {"stats", &stats}});
  if (grad != nullptr) {
    check_device(op, {{"normalizer", &grad->normalizer}, {"dh", &grad->dh}});
    if (!empty(grad->dw)) check_device(op, "dw", grad->dw);
  }
  const int64_t vocab = w.desc.shape[0], dim = w.desc.shape[1], rows = targets.numel();
  const int64_t chunk = std::min(chunk_rows, std::max<int64_t>(rows, 1));
  for (auto [what, value] : {std::pair{"rows", rows}, {"vocab", vocab}, {"dim", dim}}) {
    check_int(op, what, value);
  }
  run(c, op, [&] {
    const DType at = h.desc.dtype;
    const Storage st = storage(at);
    const cudaStream_t stream = c.cuda_stream();
    // Everything is allocated before the first launch, so an allocation
    // failure throws with nothing enqueued.
    Scratch w_cast(c, w.desc.dtype == at ? 0 : static_cast<size_t>(vocab * dim * esize(at)));
    Scratch logits(c, static_cast<size_t>(chunk * vocab) * 4);
    // The logits gradient feeds two GEMMs with h's type; fp32 overwrites the logits in place.
    Scratch grad16(c, grad != nullptr && at != DType::kF32
                          ? static_cast<size_t>(chunk * vocab * esize(at))
                          : 0);
    Scratch loss(c, static_cast<size_t>(rows) * 4);
    const void* wd = weight_as(c, w, at, w_cast, op);
    void* g = grad == nullptr ? nullptr : (at == DType::kF32 ? logits.get() : grad16.get());
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t n = std::min(chunk, rows - r0);
      const void* hc = offset(h.data, r0 * dim * esize(at));
      // logits [n, vocab] = h [n, dim] W^T, in fp32.
      gemm(c, false, true, n, vocab, dim, {hc, at, dim}, {wd, at, dim}, 0.0f, logits.get(),
           DType::kF32, vocab, op);
      cuda::launch_ce_rows(logits.as<float>(), targets.as<int32_t>() + r0, n, vocab,
                           lse.as<float>() + r0, loss.as<float>() + r0, st, g,
                           grad == nullptr ? nullptr : grad->normalizer.as<double>(),
                           grad == nullptr ? 0.0 : grad->grad_scale, logit_softcap, stream);
      check_launch(op);
      if (grad == nullptr) continue;
      // dh [n, dim] = G [n, vocab] W [vocab, dim]; dw [vocab, dim] += G^T h.
      gemm(c, false, false, n, dim, vocab, {g, at, vocab}, {wd, at, dim}, 0.0f,
           offset(grad->dh.data, r0 * dim * esize(at)), at, dim, op);
      if (!empty(grad->dw)) {
        gemm(c, true, false, vocab, dim, n, {g, at, vocab}, {hc, at, dim}, 1.0f, grad->dw.data,
             DType::kF32, dim, op);
      }
    }
    cuda::launch_ce_stats(loss.as<float>(), targets.as<int32_t>(), rows, stats.as<double>(),
                          stream);
    check_launch(op);
  });
}

}  // namespace

std::unique_ptr<Ops> make_cuda_ops(Accelerator& accelerator) {
  return std::make_unique<CudaOps>(accelerator);
}

}  // namespace strata::ops
