// Loads OpenBLAS's OpenMP build with dlopen after choosing its core (blas.h).
#include "kernels/cpu/blas.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string_view>

#include "core/cpu_features.h"
#include "core/error.h"
#include "core/log.h"

namespace strata::blas {
namespace {

// The best OpenBLAS core for this CPU, or "" to let OpenBLAS decide.
std::string core_for_this_cpu() {
  const CpuFeatures& f = cpu_features();
  if (f.avx512f) return f.avx512_bf16 ? "Cooperlake" : "SkylakeX";
  if (f.avx2) return "Haswell";
  return "";
}

// The library to load: STRATA_OPENBLAS when set (a relocated copy, as the
// GPU machine's bundle carries: scripts/gpu-check sets it), else the OpenMP
// build this strata was compiled against.
const char* openblas_path() {
  const char* given = std::getenv("STRATA_OPENBLAS");
  return given != nullptr && *given != '\0' ? given : STRATA_OPENBLAS_PATH;
}

template <typename Fn>
Fn symbol(void* handle, const char* name) {
  void* p = dlsym(handle, name);
  STRATA_CHECK(p != nullptr, kInternal, "OpenBLAS ({}) has no symbol {}: {}", openblas_path(), name, dlerror());
  return reinterpret_cast<Fn>(p);
}

Api load() {
  Api a;
  const char* given = std::getenv("OPENBLAS_CORETYPE");
  if (given != nullptr && *given != '\0') {
    a.core_source = "OPENBLAS_CORETYPE set in the environment";
  } else if (const std::string core = core_for_this_cpu(); !core.empty()) {
    // Before OpenBLAS is loaded, which is when it reads the variable.
    setenv("OPENBLAS_CORETYPE", core.c_str(), 0);
    a.core_source = "chosen by strata from the CPU's features";
  } else {
    a.core_source = "OpenBLAS's own detection";
  }
  void* handle = dlopen(openblas_path(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr && openblas_path() != std::string_view(STRATA_OPENBLAS_PATH)) {
    raise(ErrorCategory::kBadArgument, "STRATA_OPENBLAS={}: cannot load it as OpenBLAS: {}", openblas_path(),
          dlerror());
  }
  STRATA_CHECK(handle != nullptr, kInternal,
               "cannot load OpenBLAS from {}: {} (scripts/setup installs libopenblas-openmp-dev)", openblas_path(),
               dlerror());
  a.sgemm = symbol<decltype(&cblas_sgemm)>(handle, "cblas_sgemm");
  a.dgemm = symbol<decltype(&cblas_dgemm)>(handle, "cblas_dgemm");
  a.core = symbol<char* (*)()>(handle, "openblas_get_corename")();
  a.config = symbol<char* (*)()>(handle, "openblas_get_config")();
  logger().debug("OpenBLAS core {} ({}); {}", a.core, a.core_source, a.config);
  return a;
}

}  // namespace

const Api& api() {
  static const Api loaded = load();
  return loaded;
}

}  // namespace strata::blas
