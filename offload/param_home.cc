// The three parameter homes (device, pinned cpu, nvme file) and the shared
// pinned window through which the host reaches the ones it cannot address.
#include "offload/param_home.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "nvme/aio_handle.h"
#include "nvme/swap_space.h"

namespace strata::offload {

HostWindow::~HostWindow() {
  if (data_ != nullptr) accelerator_.deallocate_pinned(data_);
}

void HostWindow::expect(size_t nbytes) { expected_ = std::max(expected_, nbytes); }

void* HostWindow::get(size_t nbytes) {
  if (nbytes > nbytes_) {
    // Grows once to everything announced: bounded by the largest slice and
    // sub_group_size, not by the model.
    const size_t want = std::max(nbytes, expected_);
    if (data_ != nullptr) accelerator_.deallocate_pinned(data_);
    data_ = nullptr;
    nbytes_ = 0;
    data_ = accelerator_.allocate_pinned(want);
    nbytes_ = want;
  }
  return data_;
}

void ParamHome::for_each_chunk(const std::function<void(size_t, size_t)>& fn) const {
  const size_t chunk = options_.chunk_numel;
  for (size_t first = 0; first < options_.numel; first += chunk) fn(first, std::min(chunk, options_.numel - first));
}

namespace {

void check_range(const ParamHomeOptions& options, size_t first, size_t numel) {
  STRATA_CHECK(first + numel <= options.numel && numel <= options.max_range_numel, kInternal,
               "parameter home range [{}, {}) outside the shard ({} elements) or above its largest range ({})", first,
               first + numel, options.numel, options.max_range_numel);
}

// Accelerator memory. On the cpu accelerator that is host memory, viewed in place.
class DeviceHome final : public ParamHome {
 public:
  DeviceHome(const ParamHomeOptions& options, Accelerator& accelerator, Stream& stream, HostWindow& window)
      : ParamHome(options), accelerator_(accelerator), stream_(stream), window_(window) {
    memory_ = accelerator_.allocate(nbytes());
    accelerator_.memset_async(memory_, 0, nbytes(), stream_);
    stream_.synchronize();
    if (!host_addressable()) window_.expect(options.max_range_numel * dtype_nbytes(options.dtype));
  }
  ~DeviceHome() override { accelerator_.deallocate(memory_); }

  void* memory() const override { return memory_; }
  bool host_addressable() const override { return accelerator_.host_addressable(); }

  void* host_range(size_t first, size_t numel, bool load) override {
    check_range(options_, first, numel);
    char* at = static_cast<char*>(memory_) + first * dtype_nbytes(dtype());
    if (host_addressable()) return at;
    const size_t nbytes = numel * dtype_nbytes(dtype());
    void* view = window_.get(nbytes);
    if (load) {
      accelerator_.copy_async(view, at, nbytes, CopyKind::kDeviceToHost, stream_);
      stream_.synchronize();
    }
    return view;
  }

  void store_host_range(size_t first, size_t numel) override {
    if (host_addressable()) return;
    const size_t nbytes = numel * dtype_nbytes(dtype());
    accelerator_.copy_async(static_cast<char*>(memory_) + first * dtype_nbytes(dtype()), window_.get(nbytes), nbytes,
                            CopyKind::kHostToDevice, stream_);
    stream_.synchronize();
  }

  void read_async(void* dst, size_t nbytes, uint64_t offset, DoneFn done) override {
    std::exception_ptr error;
    try {
      accelerator_.copy_async(dst, static_cast<const char*>(memory_) + offset, nbytes, CopyKind::kDeviceToHost,
                              stream_);
      stream_.synchronize();
    } catch (...) {
      error = std::current_exception();
    }
    done(error);
  }

  void write_async(const void* src, size_t nbytes, uint64_t offset, DoneFn done) override {
    std::exception_ptr error;
    try {
      accelerator_.copy_async(static_cast<char*>(memory_) + offset, src, nbytes, CopyKind::kHostToDevice, stream_);
      stream_.synchronize();
    } catch (...) {
      error = std::current_exception();
    }
    done(error);
  }

 private:
  Accelerator& accelerator_;
  Stream& stream_;
  HostWindow& window_;
  void* memory_ = nullptr;
};

// Pinned host memory: the host's view is the home itself.
class PinnedHome final : public ParamHome {
 public:
  PinnedHome(const ParamHomeOptions& options, Accelerator& accelerator)
      : ParamHome(options), accelerator_(accelerator) {
    memory_ = accelerator_.allocate_pinned(nbytes());
    std::memset(memory_, 0, nbytes());
  }
  ~PinnedHome() override { accelerator_.deallocate_pinned(memory_); }

  void* memory() const override { return memory_; }
  bool host_addressable() const override { return true; }
  void* host_range(size_t first, size_t numel, bool /*load*/) override {
    check_range(options_, first, numel);
    return static_cast<char*>(memory_) + first * dtype_nbytes(dtype());
  }
  void store_host_range(size_t, size_t) override {}
  void read_async(void* dst, size_t nbytes, uint64_t offset, DoneFn done) override {
    std::memcpy(dst, static_cast<const char*>(memory_) + offset, nbytes);
    done(nullptr);
  }
  void write_async(const void* src, size_t nbytes, uint64_t offset, DoneFn done) override {
    std::memcpy(static_cast<char*>(memory_) + offset, src, nbytes);
    done(nullptr);
  }

 private:
  Accelerator& accelerator_;
  void* memory_ = nullptr;
};

// The values of an NVMe home's last writes, in pinned slots of one chunk
// each, oldest reused first: a read of a range the slots hold is a copy.
// A slot whose write is in flight is not reused (the drive reads from it);
// when none is free a write goes around the cache. Any slot overlapping a
// range written (through the cache or around it) is dropped first, so a slot
// never holds older values than the home. Thread-safe (one mutex: writes
// and reads come from the optimizer's thread, I/O workers and the gathers).
class WriteCache {
 public:
  WriteCache(Accelerator& accelerator, size_t slots, size_t slot_nbytes) : accelerator_(accelerator) {
    for (size_t i = 0; i < slots; ++i) {
      slots_.push_back(Slot{accelerator.allocate_pinned(slot_nbytes), slot_nbytes});
    }
  }
  ~WriteCache() {
    for (Slot& slot : slots_) accelerator_.deallocate_pinned(slot.data);
  }
  WriteCache(const WriteCache&) = delete;
  WriteCache& operator=(const WriteCache&) = delete;

  // A slot now holding src's bytes for [offset, offset + nbytes), its write
  // to be started from it (ended(): when it ends); nullptr when none is free
  // or big enough. Either way no other slot overlaps the range any more.
  void* put(const void* src, size_t nbytes, uint64_t offset) {
    Slot* slot = nullptr;
    {
      std::lock_guard lock(mutex_);
      drop_locked(nbytes, offset);
      for (Slot& s : slots_) {
        if (s.writing || s.capacity < nbytes) continue;
        if (slot == nullptr || !s.valid || (slot->valid && s.age < slot->age)) slot = &s;
      }
      if (slot == nullptr) return nullptr;
      slot->valid = false;
      slot->writing = true;  // reserved: neither read nor reused while filled
    }
    std::memcpy(slot->data, src, nbytes);
    std::lock_guard lock(mutex_);
    slot->offset = offset;
    slot->nbytes = nbytes;
    slot->age = ++clock_;
    slot->valid = true;
    return slot->data;
  }
  // The write from `data` (put's slot) ended; a failed one leaves nothing cached.
  void ended(const void* data, bool ok) {
    std::lock_guard lock(mutex_);
    for (Slot& s : slots_) {
      if (s.data != data) continue;
      s.writing = false;
      if (!ok) s.valid = false;
    }
  }
  // Copies [offset, offset + nbytes) into dst when slots hold all of it (a
  // parameter's slice may cross a sub-group boundary: two slots).
  bool get(void* dst, size_t nbytes, uint64_t offset) {
    std::lock_guard lock(mutex_);
    std::vector<const Slot*> pieces;
    for (uint64_t at = offset; at < offset + nbytes;) {
      const auto holds = std::find_if(slots_.begin(), slots_.end(), [&](const Slot& s) {
        return s.valid && s.offset <= at && at < s.offset + s.nbytes;
      });
      if (holds == slots_.end()) return false;
      pieces.push_back(&*holds);
      at = holds->offset + holds->nbytes;
    }
    for (const Slot* s : pieces) {
      const uint64_t begin = std::max(offset, s->offset);
      const uint64_t end = std::min(offset + nbytes, s->offset + s->nbytes);
      std::memcpy(static_cast<char*>(dst) + (begin - offset), static_cast<const char*>(s->data) + (begin - s->offset),
                  end - begin);
    }
    return true;
  }
  // Slots overlapping [offset, offset + nbytes) forgotten (written around the cache).
  void drop(size_t nbytes, uint64_t offset) {
    std::lock_guard lock(mutex_);
    drop_locked(nbytes, offset);
  }

 private:
  struct Slot {
    void* data = nullptr;
    size_t capacity = 0;
    uint64_t offset = 0;
    size_t nbytes = 0;
    uint64_t age = 0;      // of its put: the oldest is reused first
    bool valid = false;    // holds the home's bytes of its range
    bool writing = false;  // being filled, or its write in flight
  };
  void drop_locked(size_t nbytes, uint64_t offset) {
    for (Slot& s : slots_) {
      if (s.valid && offset < s.offset + s.nbytes && s.offset < offset + nbytes) s.valid = false;
    }
  }

  Accelerator& accelerator_;
  std::mutex mutex_;
  std::vector<Slot> slots_;
  uint64_t clock_ = 0;
};

// A preallocated swap file, reached through the I/O engine.
class NvmeHome final : public ParamHome {
 public:
  NvmeHome(const ParamHomeOptions& options, Accelerator& accelerator, HostWindow& window, nvme::AioHandle& aio)
      : ParamHome(options),
        window_(window),
        aio_(aio),
        swap_(nvme::SwapSpaceOptions{options.nvme_path, "param", options.rank, true, options.keep_files}) {
    if (options.cached_writes > 0) {
      cache_ = std::make_unique<WriteCache>(accelerator, options.cached_writes,
                                            options.chunk_numel * dtype_nbytes(options.dtype));
    }
    file_ = &swap_.create({options.key.empty() ? std::string(dtype_name(options.dtype)) : options.key, nbytes()});
    window_.expect(options.max_range_numel * dtype_nbytes(options.dtype));
    // The file may hold an earlier run's bytes: zeros, so padding is zero as
    // in the other homes (through the window, one bounded range at a time).
    for_each_chunk([&](size_t first, size_t numel) {
      std::memset(host_range(first, numel, /*load=*/false), 0, numel * dtype_nbytes(dtype()));
      store_host_range(first, numel);
    });
  }

  void* memory() const override { return nullptr; }
  bool host_addressable() const override { return false; }

  void* host_range(size_t first, size_t numel, bool load) override {
    check_range(options_, first, numel);
    const size_t nbytes = numel * dtype_nbytes(dtype());
    void* view = window_.get(nbytes);
    if (load) aio_.read(*file_, view, nbytes, first * dtype_nbytes(dtype()), kPriority);
    return view;
  }

  void store_host_range(size_t first, size_t numel) override {
    const size_t nbytes = numel * dtype_nbytes(dtype());
    if (cache_) cache_->drop(nbytes, first * dtype_nbytes(dtype()));
    aio_.write(*file_, window_.get(nbytes), nbytes, first * dtype_nbytes(dtype()), kPriority);
  }

  void read_async(void* dst, size_t nbytes, uint64_t offset, DoneFn done) override {
    if (cache_ && cache_->get(dst, nbytes, offset)) {
      done(nullptr);
      return;
    }
    aio_.submit_read(*file_, dst, nbytes, offset, std::move(done), kPriority);
  }

  void write_async(const void* src, size_t nbytes, uint64_t offset, DoneFn done) override {
    if (cache_) {
      if (void* slot = cache_->put(src, nbytes, offset)) {
        // Written from the slot: src is no longer read, the slot is free again once it ends.
        try {
          aio_.submit_write(*file_, slot, nbytes, offset,
                            [cache = cache_.get(), slot, done = std::move(done)](std::exception_ptr error) {
                              cache->ended(slot, error == nullptr);
                              done(std::move(error));
                            },
                            kPriority);
        } catch (...) {
          cache_->ended(slot, false);
          throw;
        }
        return;
      }
    }
    aio_.submit_write(*file_, src, nbytes, offset, std::move(done), kPriority);
  }

 private:
  // The home shares the I/O handle with the optimizer's state and the
  // gradient shards; a gather's read (compute waits for it) and the new
  // values the next forward waits for go ahead of that streaming.
  static constexpr nvme::IoPriority kPriority = nvme::IoPriority::kUrgent;

  HostWindow& window_;
  nvme::AioHandle& aio_;
  nvme::SwapSpace swap_;
  nvme::File* file_ = nullptr;
  std::unique_ptr<WriteCache> cache_;  // cached_writes > 0
};

}  // namespace

std::unique_ptr<ParamHome> make_param_home(const ParamHomeOptions& options, Accelerator& accelerator,
                                           Stream& stream, HostWindow& window, nvme::AioHandle* aio) {
  STRATA_CHECK(options.chunk_numel >= 1 && options.max_range_numel >= options.chunk_numel, kInternal,
               "parameter home ranges: chunk {} and largest {} elements", options.chunk_numel,
               options.max_range_numel);
  switch (options.tier) {
    case Tier::kDevice:
      return std::make_unique<DeviceHome>(options, accelerator, stream, window);
    case Tier::kCpu:
      return std::make_unique<PinnedHome>(options, accelerator);
    case Tier::kNvme:
      STRATA_CHECK(aio != nullptr, kInternal, "an nvme parameter home needs the I/O engine");
      return std::make_unique<NvmeHome>(options, accelerator, window, *aio);
  }
  raise(ErrorCategory::kInternal, "unknown parameter tier {}", static_cast<int>(options.tier));
}

}  // namespace strata::offload
