// The tiered tensor store: every shard has a home tier (device, cpu or nvme)
// and a residency state (resident, in flight, absent). Moves between the home
// and a caller's host buffer are asynchronous, run in stream order, and are
// ordered per shard by events: a move waits for the shard's previous move.
//
// Residency: kResident — the shard's bytes are addressable now (a device/cpu
// home, or an nvme shard fetched into a buffer and not yet released);
// kInFlight — a move was submitted and has not been observed complete;
// kAbsent — the bytes are only in the nvme file.
//
// Thread-safety: all methods may be called from any thread (one mutex).
// Ownership: the store owns home memory (device and pinned host) and the swap
// files' content; the accelerator, I/O handle and swap space belong to the
// caller and must outlive it. Host buffers passed to moves must stay valid
// until the move's event completes. Destruction waits for pending moves.
// Errors: Error(kBadArgument) for unknown/duplicate keys or misaligned
// buffers; a failed move is rethrown (Error(kIo) naming key, file and offset)
// by wait(key) and by the event's synchronize(), on every backend. A move
// queued on a stream whose earlier work failed, or after a wait on a failed
// event, did not happen (or moved undefined bytes): it reports that error the
// same way. A failed fetch never makes an nvme shard resident.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "nvme/aio_handle.h"
#include "nvme/swap_space.h"
#include "core/accelerator.h"
#include "core/tensor.h"

namespace strata::offload {

enum class Residency : uint8_t { kResident, kInFlight, kAbsent };
std::string_view residency_name(Residency state);  // "resident", "in flight", "absent"

class TieredStore {
 public:
  // aio and swap may be nullptr when no shard lives on nvme.
  TieredStore(Accelerator& accelerator, nvme::AioHandle* aio, nvme::SwapSpace* swap);
  ~TieredStore();
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  // Registers a shard; desc.tier is its home. device: accelerator memory;
  // cpu: pinned host memory; nvme: a preallocated swap file named `key`.
  // Home memory starts zeroed (device: unspecified until stored).
  void add(const std::string& key, const TensorDesc& desc);
  bool contains(const std::string& key) const;
  const TensorDesc& desc(const std::string& key) const;
  // The home memory of a device/cpu shard (Error(kBadArgument) for nvme).
  TensorView home_view(const std::string& key) const;

  // Copies the home bytes into host_dst (pinned, 4096-aligned, room for
  // round_up(nbytes, 4096) bytes) in `stream` order, after the shard's last move.
  // The shard is in flight until the returned event completes, then resident.
  Event& fetch_async(const std::string& key, void* host_dst, Stream& stream);
  // Copies host_src into the home in stream order, after the shard's last move.
  // An nvme shard is absent once the write completes; others resident.
  Event& store_async(const std::string& key, const void* host_src, Stream& stream);
  // Waits for the shard's last move; rethrows its error (after which an nvme
  // shard is absent). Updates the state.
  void wait(const std::string& key);
  // Declares the fetched copy of an nvme shard no longer used: absent again.
  void release(const std::string& key);
  // Current state (observes completed moves without blocking).
  Residency state(const std::string& key);

 private:
  struct Shard;
  Shard& shard(const std::string& key);
  const Shard& shard(const std::string& key) const;
  Event& move_async(Shard& s, void* host, bool to_home, Stream& stream);

  Accelerator& accelerator_;
  nvme::AioHandle* aio_;
  nvme::SwapSpace* swap_;
  mutable std::mutex mutex_;
  std::map<std::string, std::unique_ptr<Shard>> shards_;
};

}  // namespace strata::offload
