// ParamHome: where this rank's shard of one dtype group's parameters lives
// between uses — ZeRO's home tier — and the one way anything reads or writes
// it. Three implementations, chosen once by make_param_home:
//   device: accelerator memory (offload_param.device none);
//   cpu:    pinned host memory (offload_param.device cpu);
//   nvme:   a flat file of the shard under nvme_path/param/rank<r>/
//           (offload_param.device nvme), preallocated, read and written with
//           the I/O engine (O_DIRECT).
// Whatever the tier, a shard starts zero-filled (padding included), and the
// host reaches a range of it the same way: host_range() gives a host view —
// the memory itself where the host can address it (a cpu home; a device home
// on the cpu accelerator), else a pinned window filled on demand — and
// store_host_range() writes that view back. The parameter coordinator reads
// slices for its gathers with memory() (device and cpu homes: the bytes an
// allgather or a host-to-device copy reads in place) or read_async().
//
// Ranges: host_range and store_host_range take element ranges aligned to the
// layout's alignment (slice and sub-group boundaries are) of at most
// max_range_numel() elements; for_each_chunk walks the whole shard in such
// ranges.
//
// The window: homes of one engine share one pinned HostWindow (one range is
// in use at a time), which grows to the largest range any of them serves.
//
// Ownership: borrows the accelerator, the stream its device copies run on,
// the window and (nvme) the I/O handle, which must outlive it; owns its memory
// or swap file (removed at destruction unless keep_files).
// Thread-safety: one thread drives host_range/store_host_range/for_each_chunk
// (and, for a device home, the borrowed stream); read_async and write_async
// may be called from any thread while no host range of the same bytes is
// being stored.
// Errors: Error(kOutOfMemory) when the shard does not fit; Error(kIo) naming
// the file for a failed read or write (nvme), from the call or, for
// read_async, through `done`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "core/accelerator.h"
#include "core/tensor.h"

namespace strata::nvme {
class AioHandle;
}

namespace strata::offload {

// Pinned staging for host views of homes that the host cannot address: one
// buffer, grown to the largest size asked (or announced with expect()), then
// kept. Ownership: borrows the accelerator; owns the buffer.
class HostWindow {
 public:
  explicit HostWindow(Accelerator& accelerator) : accelerator_(accelerator) {}
  ~HostWindow();
  HostWindow(const HostWindow&) = delete;
  HostWindow& operator=(const HostWindow&) = delete;

  // A range of nbytes will be asked for: the first growth allocates enough
  // for it too, so the window is allocated once.
  void expect(size_t nbytes);
  // At least nbytes of pinned memory, valid until a later get() that grows it.
  void* get(size_t nbytes);
  size_t nbytes() const { return nbytes_; }

 private:
  Accelerator& accelerator_;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  size_t expected_ = 0;
};

struct ParamHomeOptions {
  Tier tier = Tier::kDevice;
  DType dtype = DType::kF32;
  size_t numel = 0;            // elements of the shard
  size_t chunk_numel = 1;      // for_each_chunk's range: a multiple of the alignment
  size_t max_range_numel = 1;  // the largest range asked for (>= chunk_numel)
  // nvme: the file <nvme_path>/param/rank<rank>/<key>.swp; the key is unique
  // among an engine's homes (empty: the dtype's name).
  std::filesystem::path nvme_path;
  std::string key;
  int rank = 0;
  bool keep_files = false;  // nvme: leave the file on disk (strata.keep_swap_files)
  // nvme: the values of the last `cached_writes` write_async calls of at most
  // chunk_numel elements stay in pinned memory (that many chunks), and a
  // read_async of a range one of them holds is copied from there instead of
  // read back from the drive — the next forward's gathers of what the
  // optimizer has just written. 0: none.
  size_t cached_writes = 0;
};

class ParamHome {
 public:
  virtual ~ParamHome() = default;
  ParamHome(const ParamHome&) = delete;
  ParamHome& operator=(const ParamHome&) = delete;

  Tier tier() const { return options_.tier; }
  DType dtype() const { return options_.dtype; }
  size_t numel() const { return options_.numel; }
  size_t nbytes() const { return options_.numel * dtype_nbytes(options_.dtype); }
  size_t max_range_numel() const { return options_.max_range_numel; }

  // The shard in memory: accelerator memory (device) or pinned host memory
  // (cpu); nullptr on nvme, which has no addressable copy.
  virtual void* memory() const = 0;
  // The host reads and writes memory() in place (a cpu home, or a device home
  // on an accelerator whose memory is host memory).
  virtual bool host_addressable() const = 0;

  // A host view of elements [first, first + numel), valid until the next
  // host_range of any home sharing the window; `load`: holding the home's
  // values (else undefined, to be written in full). Blocks until loaded.
  virtual void* host_range(size_t first, size_t numel, bool load) = 0;
  // Writes the view host_range(first, numel) returned back to the home (a
  // no-op where the view is the home). Blocks until written.
  virtual void store_host_range(size_t first, size_t numel) = 0;
  // Calls fn(first, numel) over the whole shard in chunk_numel ranges.
  void for_each_chunk(const std::function<void(size_t first, size_t numel)>& fn) const;

  // Copies bytes [offset, offset + nbytes) of the shard into `dst` (pinned
  // host memory) and calls done(nullptr) once they are there, or done(error).
  // nvme: an asynchronous read, `done` runs on an I/O worker; cpu and device:
  // the copy is made, and `done` called, before this returns.
  using DoneFn = std::function<void(std::exception_ptr error)>;
  virtual void read_async(void* dst, size_t nbytes, uint64_t offset, DoneFn done) = 0;
  // The other way: bytes [offset, offset + nbytes) of the shard from `src`
  // (pinned host memory, O_DIRECT-aligned for nvme, unchanged until `done`),
  // then done(nullptr) or done(error). nvme: an asynchronous write, `done` on
  // an I/O worker; cpu and device: the copy is made, and `done` called,
  // before this returns. Not while a host range of the same bytes is in use.
  // A read_async of these bytes issued after this returns gives them (from a
  // cached copy, or from the drive once `done` has been called).
  virtual void write_async(const void* src, size_t nbytes, uint64_t offset, DoneFn done) = 0;

 protected:
  explicit ParamHome(const ParamHomeOptions& options) : options_(options) {}
  ParamHomeOptions options_;
};

// Creates the home the options name, zero-filled. `stream` carries a device
// home's copies; `aio` is required for nvme.
std::unique_ptr<ParamHome> make_param_home(const ParamHomeOptions& options, Accelerator& accelerator,
                                           Stream& stream, HostWindow& window, nvme::AioHandle* aio);

}  // namespace strata::offload
