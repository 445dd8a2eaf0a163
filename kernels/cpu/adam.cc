// Dispatcher of the CPU optimizer kernels: picks the ISA (STRATA_ISA, CPUID,
// then timing: class Calibration), derives the per-step coefficients once, and
// splits the work across OpenMP threads in SIMD-aligned chunks so results do
// not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cpu/adam_impl.h"
#include "kernels/optimizer.h"
#include "core/cpu_features.h"
#include "core/error.h"

namespace strata::kernels {
namespace {

// Chunks are multiples of this many elements (one cache line of every 16-bit
// array, four of every fp32 array), so threads never share a cache line.
constexpr size_t kChunkAlignNumel = 64;
// Below this a single thread is faster than waking the team.
constexpr size_t kMinParallelNumel = size_t{1} << 16;

int thread_count(size_t numel, int threads) {
  if (numel < kMinParallelNumel) return 1;
  const int wanted = threads > 0 ? threads : omp_get_max_threads();
  const size_t most = numel / (kMinParallelNumel / 4);
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(static_cast<size_t>(wanted), most)));
}

// [begin, end) of chunk `index` out of `count` over numel elements.
std::pair<size_t, size_t> chunk_range(size_t numel, int index, int count) {
  const size_t blocks = (numel + kChunkAlignNumel - 1) / kChunkAlignNumel;
  const size_t per = blocks / static_cast<size_t>(count), extra = blocks % static_cast<size_t>(count);
  const size_t i = static_cast<size_t>(index);
  const size_t first = i * per + std::min(i, extra);
  const size_t last = first + per + (i < extra ? 1 : 0);
  return {std::min(numel, first * kChunkAlignNumel), std::min(numel, last * kChunkAlignNumel)};
}

void check_supported(CpuIsa chosen) {
  STRATA_CHECK(isa_supported(chosen), kBadArgument,
               "instruction set '{}' is not supported by this CPU ({})", isa_name(chosen),
               cpu_features().model);
}

using AdamRange = void (*)(const AdamCoefficients&, const AdamBuffers&, size_t, size_t);
using SumSqRange = double (*)(const void*, DType, size_t, size_t, float);

AdamRange adam_range_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return detail::adam_range_avx512;
    case CpuIsa::kAvx2: return detail::adam_range_avx2;
    case CpuIsa::kScalar: break;
  }
  return detail::adam_range_scalar;
}

SumSqRange sum_sq_range_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return detail::sum_sq_range_avx512;
    case CpuIsa::kAvx2: return detail::sum_sq_range_avx2;
    case CpuIsa::kScalar: break;
  }
  return detail::sum_sq_range_scalar;
}

// STRATA_ISA when set (validated), else nullopt.
std::optional<CpuIsa> forced_isa() {
  const char* forced = std::getenv("STRATA_ISA");
  if (forced == nullptr || *forced == '\0') return std::nullopt;
  const CpuIsa isa = parse_isa(forced);
  STRATA_CHECK(isa_supported(isa), kBadArgument,
               "STRATA_ISA={} but this CPU ({}) does not support it; supported: scalar{}{}",
               forced, cpu_features().model, isa_supported(CpuIsa::kAvx2) ? ", avx2" : "",
               isa_supported(CpuIsa::kAvx512) ? ", avx512" : "");
  return isa;
}

CpuIsa widest_isa() {
  if (isa_supported(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (isa_supported(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

// The ISA grad_stats and an unset STRATA_ISA start from. Read once per process.
CpuIsa static_isa() {
  static const CpuIsa isa = forced_isa().value_or(widest_isa());
  return isa;
}

// Which of AVX-512 and AVX2 adam_step uses by default, chosen by timing the
// first kTrialsPerIsa * 2 updates of at least kCalibrationMinNumel elements
// that ask for no ISA, alternately with each (they are real updates: the
// calibration costs no extra work or memory). Why measure instead of a rule:
// Adam is memory-bound at every size that matters, and which kernel streams
// memory faster is a property of the machine, not of the instruction set — on
// an AMD Zen 5 EPYC the AVX2 kernel ran 33% faster than the (then fully masked)
// AVX-512 one, on the Intel Xeon of bench/strata-adam/PERFORMANCE.md they tie
// out of cache and AVX-512 wins in cache. Timing the caller's own updates
// measures the regime the caller is in. Results cannot depend on the choice:
// both kernels run the same operation sequence on every element, tail
// included, so they are bit-identical (tests/kernels/avx512_test.cc).
class Calibration {
 public:
  static constexpr int kTrialsPerIsa = 3;
  static constexpr size_t kCalibrationMinNumel = size_t{1} << 20;  // >= ~1 ms: timeable

  Calibration() {
    forced_ = forced_isa();
    active_ = !forced_ && isa_supported(CpuIsa::kAvx512) && isa_supported(CpuIsa::kAvx2);
    chosen_.store(forced_.value_or(widest_isa()));
    if (!active_) done_.store(true);
  }

  // The ISA for an update of numel elements that asks for none; `trial` is set
  // when this update is one of the timed ones.
  CpuIsa pick(size_t numel, bool& trial) {
    trial = false;
    if (done_.load(std::memory_order_acquire) || numel < kCalibrationMinNumel) return chosen_.load();
    std::lock_guard<std::mutex> lock(mutex_);
    if (handed_out_ >= 2 * kTrialsPerIsa) return chosen_.load();
    trial = true;
    return handed_out_++ % 2 == 0 ? CpuIsa::kAvx512 : CpuIsa::kAvx2;
  }

  void record(CpuIsa isa, double seconds, size_t numel) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& mine = isa == CpuIsa::kAvx512 ? avx512_ : avx2_;
    mine.push_back(seconds / static_cast<double>(numel) * 1e9);
    if (avx512_.size() < kTrialsPerIsa || avx2_.size() < kTrialsPerIsa) return;
    avx512_ns_ = median(avx512_);
    avx2_ns_ = median(avx2_);
    // AVX2 must win by more than noise; in a tie AVX-512 is kept because it is
    // the faster one on data in cache (fewer instructions per element).
    chosen_.store(avx2_ns_ < 0.97 * avx512_ns_ ? CpuIsa::kAvx2 : CpuIsa::kAvx512);
    done_.store(true, std::memory_order_release);
  }

  CpuIsa current() const { return chosen_.load(); }

  DefaultIsaInfo info() {
    std::lock_guard<std::mutex> lock(mutex_);
    DefaultIsaInfo out;
    out.isa = chosen_.load();
    if (forced_) {
      out.basis = "STRATA_ISA";
    } else if (!active_) {
      out.basis = "widest supported";
    } else if (done_.load()) {
      out.basis = "calibrated";
    } else {
      out.basis = "calibrating";
    }
    out.avx512_ns_per_param = avx512_ns_;
    out.avx2_ns_per_param = avx2_ns_;
    out.trials = static_cast<int>(avx512_.size() + avx2_.size());
    return out;
  }

 private:
  static double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
  }

  std::mutex mutex_;
  std::optional<CpuIsa> forced_;
  bool active_ = false;
  std::atomic<CpuIsa> chosen_{CpuIsa::kScalar};
  std::atomic<bool> done_{false};
  int handed_out_ = 0;
  std::vector<double> avx512_, avx2_;
  double avx512_ns_ = 0, avx2_ns_ = 0;
};

Calibration& calibration() {
  static Calibration instance;
  return instance;
}

void run_adam(AdamRange range, const AdamCoefficients& coeffs, const AdamBuffers& b, int count) {
  if (count == 1) {
    range(coeffs, b, 0, b.numel);
    return;
  }
#pragma omp parallel num_threads(count)
  {
    const auto [begin, end] = chunk_range(b.numel, omp_get_thread_num(), omp_get_num_threads());
    range(coeffs, b, begin, end);
  }
}

}  // namespace

std::string_view isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

CpuIsa parse_isa(std::string_view text) {
  if (text == "scalar") return CpuIsa::kScalar;
  if (text == "avx2") return CpuIsa::kAvx2;
  if (text == "avx512") return CpuIsa::kAvx512;
  raise(ErrorCategory::kBadArgument, "unknown instruction set '{}' (accepted: scalar, avx2, avx512)",
        text);
}

bool isa_supported(CpuIsa isa) {
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2: return f.avx2 && f.f16c;
    case CpuIsa::kAvx512: return f.avx512f && f.f16c;  // avx512f implies BW/VL here (cpu_features)
  }
  return false;
}

std::vector<CpuIsa> supported_isas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

CpuIsa default_isa() { return calibration().current(); }

DefaultIsaInfo default_isa_info() { return calibration().info(); }

void AdamConfig::validate() const {
  STRATA_CHECK(std::isfinite(lr) && lr >= 0.0f, kBadArgument, "optimizer lr must be >= 0, got {}", lr);
  STRATA_CHECK(beta1 >= 0.0f && beta1 < 1.0f, kBadArgument, "optimizer betas[0] must be in [0, 1), got {}", beta1);
  STRATA_CHECK(beta2 >= 0.0f && beta2 < 1.0f, kBadArgument, "optimizer betas[1] must be in [0, 1), got {}", beta2);
  STRATA_CHECK(eps > 0.0f && std::isfinite(eps), kBadArgument, "optimizer eps must be > 0, got {}", eps);
  STRATA_CHECK(weight_decay >= 0.0f && std::isfinite(weight_decay), kBadArgument,
               "optimizer weight_decay must be >= 0, got {}", weight_decay);
}

AdamCoefficients adam_coefficients(const AdamConfig& config, int64_t step, float grad_scale) {
  config.validate();
  STRATA_CHECK(step >= 1, kBadArgument, "Adam step number must be >= 1 (1-based), got {}", step);
  AdamCoefficients c;
  c.lr = config.lr;
  c.beta1 = config.beta1;
  c.beta2 = config.beta2;
  c.one_minus_beta1 = 1.0f - config.beta1;
  c.one_minus_beta2 = 1.0f - config.beta2;
  c.eps = config.eps;
  // Bias corrections in double, as PyTorch computes them in Python floats.
  const double bias1 = 1.0 - std::pow(static_cast<double>(config.beta1), static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(static_cast<double>(config.beta2), static_cast<double>(step));
  c.step_size = static_cast<float>(static_cast<double>(config.lr) / bias1);
  c.inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(bias2));
  if (config.adamw) {
    c.decay = 1.0f - config.lr * config.weight_decay;
    c.l2 = 0.0f;
  } else {
    c.decay = 1.0f;
    c.l2 = config.weight_decay;
  }
  c.grad_scale = grad_scale;
  return c;
}

void adam_step(const AdamCoefficients& coeffs, const AdamBuffers& b, std::optional<CpuIsa> isa,
               int threads) {
  if (b.numel == 0) return;
  STRATA_CHECK(b.param && b.exp_avg && b.exp_avg_sq && b.grad, kBadArgument,
               "adam_step over {} elements got a null param, moment or gradient pointer", b.numel);
  STRATA_CHECK(b.param16 == nullptr || b.param16_dtype != DType::kF32, kBadArgument,
               "adam_step: the parameter copy must be fp16 or bf16, got {}", dtype_name(b.param16_dtype));
  bool trial = false;
  const CpuIsa chosen = isa ? *isa : calibration().pick(b.numel, trial);
  check_supported(chosen);
  const auto start = std::chrono::steady_clock::now();
  run_adam(adam_range_for(chosen), coeffs, b, thread_count(b.numel, threads));
  if (trial) {
    calibration().record(
        chosen, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
        b.numel);
  }
}

double GradStats::norm() const { return std::sqrt(sum_sq); }

GradStats merge(const GradStats& a, const GradStats& b) {
  return GradStats{a.sum_sq + b.sum_sq, a.finite && b.finite};
}

GradStats grad_stats(const void* grad, DType grad_dtype, size_t numel, float scale,
                     std::optional<CpuIsa> isa, int threads) {
  if (numel == 0) return GradStats{};
  STRATA_CHECK(grad != nullptr, kBadArgument, "grad_stats over {} elements got a null gradient", numel);
  // Not the timed choice of adam_step: the sum's rounding depends on the ISA,
  // and a clipping norm must not depend on timing.
  const CpuIsa chosen = isa ? *isa : static_isa();
  check_supported(chosen);
  const SumSqRange range = sum_sq_range_for(chosen);
  const int count = thread_count(numel, threads);
  double sum = 0.0;
  if (count == 1) {
    sum = range(grad, grad_dtype, 0, numel, scale);
  } else {
    // Partials summed in chunk order so the result is reproducible for a thread count.
    std::vector<double> partial(static_cast<size_t>(count), 0.0);
#pragma omp parallel num_threads(count)
    {
      const int index = omp_get_thread_num();
      const auto [begin, end] = chunk_range(numel, index, omp_get_num_threads());
      partial[static_cast<size_t>(index)] = range(grad, grad_dtype, begin, end, scale);
    }
    for (double p : partial) sum += p;
  }
  return GradStats{sum, std::isfinite(sum)};
}

float combined_grad_scale(const GradStats& stats, float loss_scale, float max_norm) {
  STRATA_CHECK(loss_scale > 0.0f && std::isfinite(loss_scale), kBadArgument,
               "loss scale must be a positive finite number, got {}", loss_scale);
  if (!stats.finite) return 0.0f;
  double factor = 1.0 / static_cast<double>(loss_scale);
  if (max_norm > 0.0f) {
    const double norm = stats.norm() * factor;  // norm of the unscaled gradient
    const double coef = static_cast<double>(max_norm) / (norm + 1e-6);
    if (coef < 1.0) factor *= coef;
  }
  return static_cast<float>(factor);
}

void scale_inplace(void* grad, DType grad_dtype, size_t numel, float factor, int threads) {
  if (numel == 0) return;
  STRATA_CHECK(grad != nullptr, kBadArgument, "scale_inplace over {} elements got a null gradient", numel);
  const int count = thread_count(numel, threads);
  // Simple enough that the compiler vectorises the fp32 loop; 16-bit values
  // round back to nearest even.
#pragma omp parallel num_threads(count)
  {
    const auto [begin, end] = chunk_range(numel, omp_get_thread_num(), omp_get_num_threads());
    if (grad_dtype == DType::kF32) {
      float* g = static_cast<float*>(grad);
      for (size_t i = begin; i < end; ++i) g[i] *= factor;
    } else if (grad_dtype == DType::kBF16) {
      BFloat16* g = static_cast<BFloat16*>(grad);
      for (size_t i = begin; i < end; ++i) g[i] = float_to_bf16(bf16_to_float(g[i]) * factor);
    } else {
      Half* g = static_cast<Half*>(grad);
      for (size_t i = begin; i < end; ++i) g[i] = float_to_half(half_to_float(g[i]) * factor);
    }
  }
}

}  // namespace strata::kernels
