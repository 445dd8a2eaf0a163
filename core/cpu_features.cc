// CPUID/XGETBV feature detection.
#include "core/cpu_features.h"

#include <unistd.h>

#include <fstream>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace strata {
namespace {

std::string read_model_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown";
}

CpuFeatures detect() {
  CpuFeatures f;
  f.model = read_model_name();
  f.logical_cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = (ecx >> 27) & 1, fma = (ecx >> 12) & 1, avx = (ecx >> 28) & 1;
  f.f16c = (ecx >> 29) & 1;
  unsigned long long xcr0 = 0;
  if (osxsave) {
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<unsigned long long>(hi) << 32) | lo;
  }
  const bool ymm_enabled = (xcr0 & 0x6) == 0x6;
  const bool zmm_enabled = (xcr0 & 0xe6) == 0xe6;
  if (__get_cpuid_max(0, nullptr) >= 7) {
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    const bool avx2 = (ebx >> 5) & 1;
    const bool avx512f = (ebx >> 16) & 1, avx512dq = (ebx >> 17) & 1, avx512bw = (ebx >> 30) & 1,
               avx512vl = (ebx >> 31) & 1;
    f.avx2 = avx && avx2 && fma && ymm_enabled;
    // The *_avx512.cc kernels are compiled with -mavx512{f,bw,vl,dq}: all four must be present.
    f.avx512f = avx512f && avx512dq && avx512bw && avx512vl && zmm_enabled;
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    f.avx512_bf16 = f.avx512f && ((eax >> 5) & 1);
  }
  f.f16c = f.f16c && ymm_enabled;
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace strata
