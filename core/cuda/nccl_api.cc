// NCCL looked up with dlopen/dlsym on first use (nccl_api.h says why and in
// which order).
#include "core/cuda/nccl_api.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"

#ifndef STRATA_NCCL_BUILD_LIBRARY
#define STRATA_NCCL_BUILD_LIBRARY ""
#endif

namespace strata::nccl {
namespace {

constexpr const char* kSoname = "libnccl.so.2";

std::string loaded_path(void* handle) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr) return map->l_name;
  return kSoname;
}

template <typename Fn>
void resolve(void* handle, const std::string& path, const char* name, Fn& out) {
  void* symbol = dlsym(handle, name);
  STRATA_CHECK(symbol != nullptr, kCuda,
               "the NCCL at {} has no {} (strata needs NCCL 2.14 or later; set STRATA_NCCL_LIBRARY to another)",
               path, name);
  out = reinterpret_cast<Fn>(symbol);
}

Api load() {
  Api api;
  std::vector<std::string> tried;
  void* handle = dlopen(kSoname, RTLD_NOW | RTLD_NOLOAD);
  if (handle != nullptr) {
    api.path = "already loaded (" + loaded_path(handle) + ")";
  } else {
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("STRATA_NCCL_LIBRARY"); env != nullptr && *env != '\0') candidates.push_back(env);
    candidates.push_back(kSoname);
    if (*STRATA_NCCL_BUILD_LIBRARY != '\0') candidates.push_back(STRATA_NCCL_BUILD_LIBRARY);
    for (const std::string& candidate : candidates) {
      // RTLD_LOCAL: its symbols stay out of the global scope, where a
      // library loaded later could bind to them instead of its own.
      handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) {
        api.path = loaded_path(handle);
        break;
      }
      const char* why = dlerror();
      tried.push_back(candidate + ": " + (why != nullptr ? why : "not found"));
    }
  }
  if (handle == nullptr) {
    std::string list;
    for (const std::string& t : tried) list += (list.empty() ? "" : "; ") + t;
    raise(ErrorCategory::kCuda, "NCCL could not be loaded ({}); install NCCL 2 or set STRATA_NCCL_LIBRARY", list);
  }
  resolve(handle, api.path, "ncclGetVersion", api.GetVersion);
  resolve(handle, api.path, "ncclGetErrorString", api.GetErrorString);
  resolve(handle, api.path, "ncclGetUniqueId", api.GetUniqueId);
  resolve(handle, api.path, "ncclCommInitRankConfig", api.CommInitRankConfig);
  resolve(handle, api.path, "ncclCommFinalize", api.CommFinalize);
  resolve(handle, api.path, "ncclCommDestroy", api.CommDestroy);
  resolve(handle, api.path, "ncclCommAbort", api.CommAbort);
  resolve(handle, api.path, "ncclCommGetAsyncError", api.CommGetAsyncError);
  resolve(handle, api.path, "ncclAllGather", api.AllGather);
  resolve(handle, api.path, "ncclReduceScatter", api.ReduceScatter);
  resolve(handle, api.path, "ncclAllReduce", api.AllReduce);
  resolve(handle, api.path, "ncclBroadcast", api.Broadcast);
  resolve(handle, api.path, "ncclSend", api.Send);
  resolve(handle, api.path, "ncclRecv", api.Recv);
  resolve(handle, api.path, "ncclGroupStart", api.GroupStart);
  resolve(handle, api.path, "ncclGroupEnd", api.GroupEnd);
  return api;  // the handle stays open for the process's life
}

}  // namespace

const Api& api() {
  static const Api loaded = load();
  return loaded;
}

}  // namespace strata::nccl
