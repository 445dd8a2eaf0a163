// CUDA nn operators against the CPU double-precision reference, run on the
// same (16-bit-rounded) inputs, with one tolerance table per storage dtype.
// Built only with CUDA; reports SKIPPED (exit 77) where no GPU is present.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/nn_cuda_ops.h"
#include "kernels/nn_ops.h"
#include "runtime/core/error.h"
#include "runtime/cuda/cuda_check.h"
#include "tests/nn/grad_check.h"

using namespace strata;
namespace ncpu = strata::nn::cpu;
namespace ncuda = strata::nn::cuda;
using Vec = std::vector<double>;

namespace {

// The one tolerance table: |cuda - reference| <= abs + rel * |reference|.
// fp32 runs exact fp32 math (no TF32); bf16 stores every activation with an
// 8-bit mantissa (relative step 2^-8), and errors compound across a few
// roundings inside an operator.
struct Tolerance {
  double abs, rel;
};
Tolerance tolerance(DType dtype) {
  return dtype == DType::kBF16 ? Tolerance{3e-2, 3e-2} : Tolerance{2e-5, 2e-5};
}

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t nbytes) {
    STRATA_CUDA_CHECK(cudaMalloc(&ptr_, std::max<size_t>(nbytes, 1)));
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

struct Fixture {
  Fixture() {
    STRATA_CUDA_CHECK(cudaStreamCreate(&stream));
    ctx = std::make_unique<ncuda::BlasContext>(stream);
  }
  ~Fixture() {
    ctx.reset();
    cudaStreamDestroy(stream);
  }
  cudaStream_t stream = nullptr;
  std::unique_ptr<ncuda::BlasContext> ctx;
};

// Rounds v to dtype in place (so the reference sees exactly what the device sees)
// and uploads it.
std::unique_ptr<DeviceBuffer> upload(Vec& v, DType dtype) {
  std::vector<float> f(v.begin(), v.end());
  std::vector<uint8_t> bytes(f.size() * dtype_nbytes(dtype));
  convert(f.data(), DType::kF32, bytes.data(), dtype, f.size());
  convert(bytes.data(), dtype, f.data(), DType::kF32, f.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = f[i];
  auto buf = std::make_unique<DeviceBuffer>(bytes.size());
  STRATA_CUDA_CHECK(cudaMemcpy(buf->get(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
  return buf;
}

std::unique_ptr<DeviceBuffer> upload_f32(const Vec& v) {
  Vec copy = v;
  return upload(copy, DType::kF32);
}

template <typename I>
std::unique_ptr<DeviceBuffer> upload_ints(const std::vector<I>& v) {
  auto buf = std::make_unique<DeviceBuffer>(v.size() * sizeof(I));
  STRATA_CUDA_CHECK(cudaMemcpy(buf->get(), v.data(), v.size() * sizeof(I), cudaMemcpyHostToDevice));
  return buf;
}

Vec download(const DeviceBuffer& buf, DType dtype, size_t numel) {
  STRATA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> bytes(numel * dtype_nbytes(dtype));
  STRATA_CUDA_CHECK(cudaMemcpy(bytes.data(), buf.get(), bytes.size(), cudaMemcpyDeviceToHost));
  std::vector<float> f(numel);
  convert(bytes.data(), dtype, f.data(), DType::kF32, numel);
  return Vec(f.begin(), f.end());
}

void expect_close(const std::string& what, const Vec& got, const Vec& want, DType dtype) {
  REQUIRE(got.size() == want.size());
  const Tolerance t = tolerance(dtype);
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= t.abs + t.rel * std::abs(want[i]))) {
      if (bad++ == 0) first_bad = i;
    }
  }
  INFO(what << " (" << dtype_name(dtype) << "): " << bad << " of " << got.size()
            << " out of tolerance; first at " << first_bad << ": got "
            << (bad ? got[first_bad] : 0.0) << " want " << (bad ? want[first_bad] : 0.0));
  CHECK(bad == 0);
}

const DType kDtypes[] = {DType::kF32, DType::kBF16};

}  // namespace

TEST_CASE("cuda embedding matches cpu", "[nn][cuda]") {
  Fixture fx;
  const int64_t vocab = 50, dim = 40, rows = 33;
  std::vector<int32_t> ids(rows);
  for (int64_t r = 0; r < rows; ++r) ids[r] = static_cast<int32_t>((r * 7) % vocab);
  for (DType dt : kDtypes) {
    Vec table = test::random_vector(vocab * dim, 1), dout = test::random_vector(rows * dim, 2);
    auto d_table = upload(table, dt);
    auto d_dout = upload(dout, dt);
    auto d_ids = upload_ints(ids);
    DeviceBuffer d_out(rows * dim * dtype_nbytes(dt));
    auto d_dtable = upload_f32(Vec(vocab * dim, 0.0));
    ncuda::embedding_forward(*fx.ctx, dt, d_table->get(), d_ids->as<int32_t>(), rows, vocab, dim,
                             d_out.get());
    ncuda::embedding_backward(*fx.ctx, dt, d_dout->get(), d_ids->as<int32_t>(), rows, vocab, dim,
                              d_dtable->as<float>());
    Vec out(rows * dim), dtable(vocab * dim, 0.0);
    ncpu::embedding_forward(table.data(), ids.data(), rows, vocab, dim, out.data());
    ncpu::embedding_backward(dout.data(), ids.data(), rows, vocab, dim, dtable.data());
    expect_close("embedding out", download(d_out, dt, out.size()), out, dt);
    expect_close("embedding dtable", download(*d_dtable, DType::kF32, dtable.size()), dtable, dt);
  }
}

TEST_CASE("cuda rmsnorm matches cpu", "[nn][cuda]") {
  Fixture fx;
  const int64_t rows = 17, dim = 300;
  for (DType dt : kDtypes) {
    Vec x = test::random_vector(rows * dim, 3), w = test::random_vector(dim, 4),
        dy = test::random_vector(rows * dim, 5);
    auto d_x = upload(x, dt), d_w = upload(w, dt), d_dy = upload(dy, dt);
    DeviceBuffer d_y(x.size() * dtype_nbytes(dt)), d_dx(x.size() * dtype_nbytes(dt)),
        d_rstd(rows * 4);
    auto d_dw = upload_f32(Vec(dim, 0.0));
    ncuda::rmsnorm_forward(*fx.ctx, dt, d_x->get(), d_w->get(), rows, dim, 1e-5, d_y.get(),
                           d_rstd.as<float>());
    ncuda::rmsnorm_backward(*fx.ctx, dt, d_dy->get(), d_x->get(), d_w->get(), d_rstd.as<float>(),
                            rows, dim, d_dx.get(), d_dw->as<float>());
    Vec y(x.size()), rstd(rows), dx(x.size()), dw(dim, 0.0);
    ncpu::rmsnorm_forward(x.data(), w.data(), rows, dim, 1e-5, y.data(), rstd.data());
    ncpu::rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), rows, dim, dx.data(),
                           dw.data());
    expect_close("rmsnorm y", download(d_y, dt, y.size()), y, dt);
    expect_close("rmsnorm rstd", download(d_rstd, DType::kF32, rows), rstd, dt);
    expect_close("rmsnorm dx", download(d_dx, dt, dx.size()), dx, dt);
    expect_close("rmsnorm dw", download(*d_dw, DType::kF32, dim), dw, dt);
  }
}

TEST_CASE("cuda linear (strided, accumulating, with bias) matches cpu", "[nn][cuda]") {
  Fixture fx;
  const int64_t rows = 19, in = 24, out = 13, ldx = 30, ldy = 16;
  for (DType dt : kDtypes) {
    Vec x = test::random_vector(rows * ldx, 6), w = test::random_vector(out * in, 7),
        b = test::random_vector(out, 8), y0 = test::random_vector(rows * ldy, 9),
        dy = test::random_vector(rows * ldy, 10);
    auto d_x = upload(x, dt), d_w = upload(w, dt), d_b = upload(b, dt), d_y = upload(y0, dt),
         d_dy = upload(dy, dt);
    DeviceBuffer d_dx(rows * in * dtype_nbytes(dt));
    auto d_dw = upload_f32(Vec(out * in, 0.0));
    auto d_db = upload_f32(Vec(out, 0.0));
    ncuda::linear_forward(*fx.ctx, dt, d_x->get(), ldx, d_w->get(), d_b->get(), rows, in, out,
                          d_y->get(), ldy, true);
    ncuda::linear_backward(*fx.ctx, dt, d_dy->get(), ldy, d_x->get(), ldx, d_w->get(), rows, in,
                           out, d_dx.get(), in, false, d_dw->as<float>(), d_db->as<float>());
    Vec y = y0, dx(rows * in), dw(out * in, 0.0), db(out, 0.0);
    ncpu::linear_forward(x.data(), ldx, w.data(), b.data(), rows, in, out, y.data(), ldy, true);
    ncpu::linear_backward(dy.data(), ldy, x.data(), ldx, w.data(), rows, in, out, dx.data(), in,
                          false, dw.data(), db.data());
    expect_close("linear y", download(*d_y, dt, y.size()), y, dt);
    expect_close("linear dx", download(d_dx, dt, dx.size()), dx, dt);
    expect_close("linear dw", download(*d_dw, DType::kF32, dw.size()), dw, dt);
    expect_close("linear db", download(*d_db, DType::kF32, db.size()), db, dt);
  }
  Vec x(4, 1.0);
  auto d_x = upload(x, DType::kF16);
  REQUIRE_THROWS_AS(ncuda::linear_forward(*fx.ctx, DType::kF16, d_x->get(), 2, d_x->get(), nullptr,
                                          1, 2, 1, d_x->get(), 1, false),
                    Error);
}

TEST_CASE("cuda rope matches cpu", "[nn][cuda]") {
  Fixture fx;
  const int64_t rows = 40, heads = 3, head_dim = 16;
  std::vector<int32_t> pos(rows);
  for (int64_t r = 0; r < rows; ++r) pos[r] = static_cast<int32_t>(r * 97 % 4096);
  for (DType dt : kDtypes) {
    Vec x = test::random_vector(rows * heads * head_dim, 11);
    auto d_x = upload(x, dt);
    auto d_pos = upload_ints(pos);
    ncuda::rope_forward(*fx.ctx, dt, d_x->get(), d_pos->as<int32_t>(), rows, heads, head_dim,
                        10000.0);
    Vec y = x;
    ncpu::rope_forward(y.data(), pos.data(), rows, heads, head_dim, 10000.0);
    expect_close("rope forward", download(*d_x, dt, y.size()), y, dt);
    ncuda::rope_backward(*fx.ctx, dt, d_x->get(), d_pos->as<int32_t>(), rows, heads, head_dim,
                         10000.0);
    expect_close("rope backward(forward(x))", download(*d_x, dt, x.size()), x, dt);
  }
}

TEST_CASE("cuda GQA attention matches cpu", "[nn][cuda]") {
  Fixture fx;
  // A short sequence (fewer keys than threads in a block) and a long one with a
  // Llama-sized head (strided loops, longer softmax rows).
  auto shape =
      GENERATE(std::vector<int64_t>{2, 70, 6, 2, 32}, std::vector<int64_t>{1, 333, 4, 1, 128});
  ncpu::AttentionShape s;
  s.batch = shape[0];
  s.seq = shape[1];
  s.heads = shape[2];
  s.kv_heads = shape[3];
  s.head_dim = shape[4];
  INFO("batch " << s.batch << " seq " << s.seq << " heads " << s.heads << " kv_heads " << s.kv_heads
                << " head_dim " << s.head_dim);
  const size_t nq = s.batch * s.seq * s.heads * s.head_dim, nkv = nq / (s.heads / s.kv_heads),
               nl = s.batch * s.heads * s.seq;
  for (DType dt : kDtypes) {
    Vec q = test::random_vector(nq, 12), k = test::random_vector(nkv, 13),
        v = test::random_vector(nkv, 14), dout = test::random_vector(nq, 15);
    auto d_q = upload(q, dt), d_k = upload(k, dt), d_v = upload(v, dt), d_dout = upload(dout, dt);
    DeviceBuffer d_out(nq * dtype_nbytes(dt)), d_lse(nl * 4), d_dq(nq * dtype_nbytes(dt)),
        d_dk(nkv * dtype_nbytes(dt)), d_dv(nkv * dtype_nbytes(dt));
    ncuda::attention_forward(*fx.ctx, dt, d_q->get(), d_k->get(), d_v->get(), s, d_out.get(),
                             d_lse.as<float>());
    Vec out(nq), lse(nl), dq(nq), dk(nkv), dv(nkv);
    ncpu::attention_forward(q.data(), k.data(), v.data(), s, out.data(), lse.data());
    expect_close("attention out", download(d_out, dt, nq), out, dt);
    expect_close("attention lse", download(d_lse, DType::kF32, nl), lse, dt);
    // Backward from the device's own forward output, as training would run it.
    Vec dev_out = download(d_out, dt, nq);
    ncuda::attention_backward(*fx.ctx, dt, d_dout->get(), d_q->get(), d_k->get(), d_v->get(),
                              d_out.get(), d_lse.as<float>(), s, d_dq.get(), d_dk.get(),
                              d_dv.get());
    ncpu::attention_backward(dout.data(), q.data(), k.data(), v.data(), dev_out.data(), lse.data(),
                             s, dq.data(), dk.data(), dv.data());
    expect_close("attention dq", download(d_dq, dt, nq), dq, dt);
    expect_close("attention dk", download(d_dk, dt, nkv), dk, dt);
    expect_close("attention dv", download(d_dv, dt, nkv), dv, dt);
  }
}

TEST_CASE("cuda swiglu and residual add match cpu", "[nn][cuda]") {
  Fixture fx;
  const int64_t n = 5000;
  for (DType dt : kDtypes) {
    Vec g = test::random_vector(n, 16, 4.0), u = test::random_vector(n, 17),
        d = test::random_vector(n, 18);
    auto d_g = upload(g, dt), d_u = upload(u, dt), d_d = upload(d, dt);
    DeviceBuffer d_o(n * dtype_nbytes(dt)), d_dg(n * dtype_nbytes(dt)), d_du(n * dtype_nbytes(dt)),
        d_sum(n * dtype_nbytes(dt));
    ncuda::swiglu_forward(*fx.ctx, dt, d_g->get(), d_u->get(), n, d_o.get());
    ncuda::swiglu_backward(*fx.ctx, dt, d_d->get(), d_g->get(), d_u->get(), n, d_dg.get(),
                           d_du.get());
    ncuda::add(*fx.ctx, dt, d_g->get(), d_u->get(), n, d_sum.get());
    Vec o(n), dg(n), du(n), sum(n);
    ncpu::swiglu_forward(g.data(), u.data(), n, o.data());
    ncpu::swiglu_backward(d.data(), g.data(), u.data(), n, dg.data(), du.data());
    ncpu::add(g.data(), u.data(), n, sum.data());
    expect_close("swiglu out", download(d_o, dt, n), o, dt);
    expect_close("swiglu dgate", download(d_dg, dt, n), dg, dt);
    expect_close("swiglu dup", download(d_du, dt, n), du, dt);
    expect_close("add", download(d_sum, dt, n), sum, dt);
  }
}

TEST_CASE("cuda chunked cross-entropy matches cpu", "[nn][cuda]") {
  Fixture fx;
  ncpu::CrossEntropyShape s;
  s.rows = 45;
  s.dim = 32;
  s.vocab = 1000;
  s.chunk_rows = 16;  // 16 + 16 + 13
  std::vector<int32_t> targets(s.rows);
  for (int64_t r = 0; r < s.rows; ++r)
    targets[r] = r % 9 == 4 ? ncpu::kIgnoreIndex : static_cast<int32_t>(r * 37 % s.vocab);
  const double scale = 1.0 / static_cast<double>(ncpu::count_targets(targets.data(), s.rows));
  for (DType dt : kDtypes) {
    Vec h = test::random_vector(s.rows * s.dim, 19),
        w = test::random_vector(s.vocab * s.dim, 20, 0.3);
    auto d_h = upload(h, dt), d_w = upload(w, dt);
    auto d_t = upload_ints(targets);
    DeviceBuffer d_lse(s.rows * 4), d_dh(s.rows * s.dim * dtype_nbytes(dt));
    auto d_dw = upload_f32(Vec(s.vocab * s.dim, 0.0));
    const double total = ncuda::cross_entropy_forward(*fx.ctx, dt, d_h->get(), d_w->get(),
                                                      d_t->as<int32_t>(), s, d_lse.as<float>());
    ncuda::cross_entropy_backward(*fx.ctx, dt, d_h->get(), d_w->get(), d_t->as<int32_t>(),
                                  d_lse.as<float>(), s, scale, d_dh.get(), d_dw->as<float>());
    Vec lse(s.rows), dh(h.size()), dw(w.size(), 0.0);
    const double ref =
        ncpu::cross_entropy_forward(h.data(), w.data(), targets.data(), s, lse.data());
    ncpu::cross_entropy_backward(h.data(), w.data(), targets.data(), lse.data(), s, scale,
                                 dh.data(), dw.data());
    const Tolerance t = tolerance(dt);
    CHECK(std::abs(total - ref) <= t.abs * s.rows + t.rel * std::abs(ref));
    expect_close("ce lse", download(d_lse, DType::kF32, s.rows), lse, dt);
    expect_close("ce dh", download(d_dh, dt, dh.size()), dh, dt);
    expect_close("ce dw", download(*d_dw, DType::kF32, dw.size()), dw, dt);
  }
}
