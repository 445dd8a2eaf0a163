// strata-adam --nvme: a full NVMe-offloaded optimizer step over N parameters,
// timed beside its lower bound max(read alone, write alone, update alone)
// measured in the same run on the same files, pool and I/O handle.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "bench/common/pattern.h"
#include "bench/common/stats.h"
#include "bench/strata-adam/adam_bench.h"
#include "nvme/aio_handle.h"
#include "offload/optimizer_swapper.h"
#include "offload/pinned_pool.h"
#include "core/error.h"
#include "core/log.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

constexpr uint64_t kMasterSalt = 21, kGradSalt = 22;

struct Freer {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

NvmeStepResult run_nvme_step(const NvmeStepOptions& o) {
  NvmeStepResult r;
  r.numel = o.numel;
  r.sub_group_numel = std::min(o.sub_group_numel, o.numel);
  r.buffer_count = o.buffer_count;
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();

  offload::PinnedBufferPool pool({o.buffer_count, offload::OptimizerSwapper::record_nbytes(r.sub_group_numel),
                                  std::chrono::milliseconds(600000), "optimizer pool"});
  nvme::AioHandle aio(o.aio);
  const bool fixed = aio.register_buffers(pool.regions());

  // Gradient and 16-bit copy of the whole shard stay in memory, as in training.
  const size_t gsize = dtype_nbytes(o.grad_dtype);
  std::unique_ptr<void, Freer> grad(std::aligned_alloc(4096, (o.numel * gsize + 4095) / 4096 * 4096));
  std::unique_ptr<void, Freer> copy(std::aligned_alloc(4096, (o.numel * 2 + 4095) / 4096 * 4096));
  STRATA_CHECK(grad && copy, kOutOfMemory, "strata-adam: cannot allocate gradient/copy of {} elements", o.numel);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (size_t i = 0; i < o.numel; ++i) {
    const float g = pseudo(i, kGradSalt);
    if (o.grad_dtype == DType::kF32) static_cast<float*>(grad.get())[i] = g;
    else if (o.grad_dtype == DType::kBF16) static_cast<BFloat16*>(grad.get())[i] = float_to_bf16(g);
    else static_cast<Half*>(grad.get())[i] = float_to_half(g);
  }
  std::memset(copy.get(), 0, o.numel * 2);

  offload::OptimizerSwapperOptions so;
  so.numel = o.numel;
  so.sub_group_numel = r.sub_group_numel;
  so.state_tier = Tier::kNvme;
  so.adam.weight_decay = 0.01f;
  so.threads = threads;
  so.nvme_path = o.dir;
  so.group = "strata-adam-bench";
  offload::OptimizerSwapper swapper(so, &pool, &aio);
  r.sub_groups = swapper.sub_group_count();
  logger().info("strata-adam: {} parameters in {} sub-groups of {}, {} pool buffers of {} MiB, io_uring "
                "fixed buffers: {}", o.numel, r.sub_groups, r.sub_group_numel, o.buffer_count,
                pool.buffer_nbytes() >> 20, fixed ? "yes" : "no");

  auto start = Clock::now();
  swapper.initialize([](size_t first, size_t numel, float* out) {
    for (size_t i = 0; i < numel; ++i) out[i] = pseudo(first + i, kMasterSalt);
  });
  r.init_seconds = seconds_since(start);

  offload::StepInputs in;
  in.grad = grad.get();
  in.grad_dtype = o.grad_dtype;
  in.grad_scale = 1.0f;
  in.param16 = copy.get();
  in.param16_dtype = o.copy_dtype;
  std::vector<offload::StepTimings> timings;
  for (int s = 0; s < o.steps; ++s) {
    swapper.step(in);
    timings.push_back(swapper.last_timings());
    if (s == 0) {
      // Check sub-groups 0 and last against the scalar formula from the known start.
      size_t bad = 0, checked = 0;
      for (size_t k : {size_t{0}, r.sub_groups - 1}) {
        const auto [first, n] = swapper.sub_group_range(k);
        const size_t ns = std::min<size_t>(n, 65536);
        std::vector<float> p(n), m(n), v(n), rp(ns), rm(ns, 0.0f), rv(ns, 0.0f);
        std::vector<uint16_t> rc(ns);
        swapper.load_sub_group(k, p.data(), m.data(), v.data());
        for (size_t i = 0; i < ns; ++i) rp[i] = pseudo(first + i, kMasterSalt);
        const auto c = kernels::adam_coefficients(so.adam, 1, 1.0f);
        kernels::AdamBuffers b{rp.data(), rm.data(), rv.data(),
                               static_cast<const char*>(grad.get()) + first * gsize, o.grad_dtype,
                               rc.data(), o.copy_dtype, ns};
        kernels::adam_step(c, b, kernels::CpuIsa::kScalar, 1);
        const uint16_t* got_copy = static_cast<const uint16_t*>(copy.get()) + first;
        for (size_t i = 0; i < ns; ++i) {
          bad += std::abs(p[i] - rp[i]) > 1e-6f + 1e-6f * std::abs(rp[i]);
          bad += std::abs(v[i] - rv[i]) > 1e-12f + 1e-6f * std::abs(rv[i]);
          const uint16_t expect = o.copy_dtype == DType::kBF16 ? float_to_bf16(p[i]).bits : float_to_half(p[i]).bits;
          bad += got_copy[i] != expect;
        }
        checked += ns;
      }
      r.correct = bad == 0;
      r.check_detail = fmt::format("{} elements of sub-groups 0 and last after step 1, {} mismatches", checked, bad);
    }
  }

  // The median step, with its own breakdown.
  std::vector<double> totals;
  for (const auto& step : timings) totals.push_back(step.total_seconds);
  const auto& t = timings[median_index(totals)];
  r.step_seconds = t.total_seconds;
  r.step_update_seconds = t.update_seconds;
  r.step_read_wait_seconds = t.read_wait_seconds;
  r.step_write_wait_seconds = t.write_wait_seconds;
  r.step_commit_seconds = t.commit_seconds;
  r.bytes_read = static_cast<double>(t.bytes_read);
  r.bytes_written = static_cast<double>(t.bytes_written);

  r.read_alone_seconds = swapper.time_read_alone();
  r.write_alone_seconds = swapper.time_write_alone();
  r.read_write_alone_seconds = swapper.time_read_write_alone();
  // Update alone: every sub-group's kernel over one in-memory record (no I/O).
  {
    offload::PinnedBuffer buf = pool.acquire();
    const auto c = kernels::adam_coefficients(so.adam, swapper.step_count() + 1, 1.0f);
    double total = 0;
    for (size_t k = 0; k < r.sub_groups; ++k) {
      const auto [first, n] = swapper.sub_group_range(k);
      if (k == 0) swapper.load_sub_group(0, buf.as<float>(), buf.as<float>() + n, buf.as<float>() + 2 * n);
      float* p = buf.as<float>();
      kernels::AdamBuffers b{p, p + n, p + 2 * n, static_cast<const char*>(grad.get()) + first * gsize,
                             o.grad_dtype, static_cast<char*>(copy.get()) + first * 2, o.copy_dtype, n};
      start = Clock::now();
      kernels::adam_step(c, b, std::nullopt, threads);
      total += seconds_since(start);
    }
    r.update_alone_seconds = total;
  }
  r.lower_bound_seconds = std::max({r.read_alone_seconds, r.write_alone_seconds, r.update_alone_seconds});
  r.ratio = r.step_seconds / r.lower_bound_seconds;
  r.duplex_bound_seconds = std::max(r.read_write_alone_seconds, r.update_alone_seconds);
  r.duplex_ratio = r.step_seconds / r.duplex_bound_seconds;
  r.read_gb_per_s = r.bytes_read / r.read_alone_seconds / 1e9;
  r.write_gb_per_s = r.bytes_written / r.write_alone_seconds / 1e9;
  return r;
}

}  // namespace strata::bench
