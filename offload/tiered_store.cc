// The tiered tensor store: home allocation per tier, and moves submitted to an
// accelerator stream (copies, or NVMe I/O run as a host function in stream
// order) with one event per shard that orders its next move.
#include "offload/tiered_store.h"

#include <cstdint>

#include "core/error.h"
#include "core/log.h"

namespace strata::offload {

std::string_view residency_name(Residency state) {
  switch (state) {
    case Residency::kResident: return "resident";
    case Residency::kInFlight: return "in flight";
    case Residency::kAbsent: return "absent";
  }
  return "unknown";
}

struct TieredStore::Shard {
  std::string key;
  TensorDesc desc;
  void* home = nullptr;          // device or pinned host memory; nullptr for nvme
  size_t io_nbytes = 0;          // nbytes rounded up for O_DIRECT
  Residency state = Residency::kResident;
  Residency after_move = Residency::kResident;  // the state once `event` completes
  bool moving = false;
  std::unique_ptr<Event> event;  // the shard's last move
};

TieredStore::TieredStore(Accelerator& accelerator, nvme::AioHandle* aio, nvme::SwapSpace* swap)
    : accelerator_(accelerator), aio_(aio), swap_(swap) {}

TieredStore::~TieredStore() {
  for (auto& [key, s] : shards_) {
    try {
      if (s->moving) s->event->synchronize();
    } catch (const std::exception& e) {
      logger().warn("tiered store: pending move of '{}' failed at destruction: {}", key, e.what());
    }
    if (s->home == nullptr) continue;
    if (s->desc.tier == Tier::kDevice) accelerator_.deallocate(s->home);
    else accelerator_.deallocate_pinned(s->home);
  }
}

void TieredStore::add(const std::string& key, const TensorDesc& desc) {
  std::lock_guard lock(mutex_);
  STRATA_CHECK(shards_.count(key) == 0, kBadArgument, "tiered store: shard '{}' already exists", key);
  auto s = std::make_unique<Shard>();
  s->key = key;
  s->desc = desc;
  s->io_nbytes = (desc.nbytes() + nvme::kDirectIoAlignment - 1) / nvme::kDirectIoAlignment *
                 nvme::kDirectIoAlignment;
  s->event = accelerator_.create_event();
  switch (desc.tier) {
    case Tier::kDevice:
      s->home = accelerator_.allocate(desc.nbytes());
      break;
    case Tier::kCpu:
      s->home = accelerator_.allocate_pinned(desc.nbytes());
      break;
    case Tier::kNvme:
      STRATA_CHECK(aio_ != nullptr && swap_ != nullptr, kBadArgument,
                   "tiered store: shard '{}' has home nvme but the store has no swap space", key);
      swap_->create(nvme::SwapFileSpec{key, s->io_nbytes});
      s->state = Residency::kAbsent;
      break;
  }
  shards_.emplace(key, std::move(s));
}

bool TieredStore::contains(const std::string& key) const {
  std::lock_guard lock(mutex_);
  return shards_.count(key) != 0;
}

TieredStore::Shard& TieredStore::shard(const std::string& key) {
  auto it = shards_.find(key);
  STRATA_CHECK(it != shards_.end(), kBadArgument, "tiered store: no shard '{}'", key);
  return *it->second;
}

const TieredStore::Shard& TieredStore::shard(const std::string& key) const {
  auto it = shards_.find(key);
  STRATA_CHECK(it != shards_.end(), kBadArgument, "tiered store: no shard '{}'", key);
  return *it->second;
}

const TensorDesc& TieredStore::desc(const std::string& key) const {
  std::lock_guard lock(mutex_);
  return shard(key).desc;
}

TensorView TieredStore::home_view(const std::string& key) const {
  std::lock_guard lock(mutex_);
  const Shard& s = shard(key);
  STRATA_CHECK(s.home != nullptr, kBadArgument,
               "tiered store: shard '{}' lives on nvme and has no home memory; fetch it", key);
  return TensorView{s.desc, s.home};
}

Event& TieredStore::move_async(Shard& s, void* host, bool to_home, Stream& stream) {
  STRATA_CHECK(host != nullptr, kBadArgument, "tiered store: null host buffer for shard '{}'", s.key);
  // Order after the shard's previous move, wherever it was submitted.
  if (s.moving) stream.wait(*s.event);
  const size_t nbytes = s.desc.nbytes();
  switch (s.desc.tier) {
    case Tier::kDevice:
      accelerator_.copy_async(to_home ? s.home : host, to_home ? host : s.home, nbytes,
                              to_home ? CopyKind::kHostToDevice : CopyKind::kDeviceToHost, stream);
      s.after_move = Residency::kResident;
      break;
    case Tier::kCpu:
      accelerator_.copy_async(to_home ? s.home : host, to_home ? host : s.home, nbytes,
                              CopyKind::kHostToHost, stream);
      s.after_move = Residency::kResident;
      break;
    case Tier::kNvme: {
      STRATA_CHECK(reinterpret_cast<uintptr_t>(host) % nvme::kDirectIoAlignment == 0, kBadArgument,
                   "tiered store: buffer for nvme shard '{}' must be {}-byte aligned", s.key,
                   nvme::kDirectIoAlignment);
      nvme::File* file = &swap_->file(s.key);
      nvme::AioHandle* aio = aio_;
      const size_t io_nbytes = s.io_nbytes;
      const std::string key = s.key;
      // NVMe I/O as a host function: it runs when the stream reaches it, and
      // its error becomes the stream's (rethrown by the event).
      stream.launch_host_func([=] {
        try {
          if (to_home) aio->write(*file, host, io_nbytes, 0);
          else aio->read(*file, host, io_nbytes, 0);
        } catch (const Error& e) {
          raise(e.category(), "tiered store: {} of shard '{}' failed: {}", to_home ? "store" : "fetch",
                key, e.message());
        }
      });
      s.after_move = to_home ? Residency::kAbsent : Residency::kResident;
      break;
    }
  }
  stream.record(*s.event);
  s.moving = true;
  s.state = Residency::kInFlight;
  return *s.event;
}

Event& TieredStore::fetch_async(const std::string& key, void* host_dst, Stream& stream) {
  std::lock_guard lock(mutex_);
  return move_async(shard(key), host_dst, false, stream);
}

Event& TieredStore::store_async(const std::string& key, const void* host_src, Stream& stream) {
  std::lock_guard lock(mutex_);
  // The source is only read; one code path serves both directions.
  return move_async(shard(key), const_cast<void*>(host_src), true, stream);
}

void TieredStore::wait(const std::string& key) {
  Event* event = nullptr;
  {
    std::lock_guard lock(mutex_);
    Shard& s = shard(key);
    if (!s.moving) return;
    event = s.event.get();
  }
  try {
    event->synchronize();
  } catch (...) {
    // Reported here, once: the shard is no longer moving; a failed fetch left
    // no usable copy, so an nvme shard is absent (a cpu/device home unchanged).
    std::lock_guard lock(mutex_);
    Shard& s = shard(key);
    s.moving = false;
    s.state = s.desc.tier == Tier::kNvme ? Residency::kAbsent : Residency::kResident;
    throw;
  }
  std::lock_guard lock(mutex_);
  Shard& s = shard(key);
  if (s.moving && s.event->query()) {
    s.moving = false;
    s.state = s.after_move;
  }
}

void TieredStore::release(const std::string& key) {
  std::lock_guard lock(mutex_);
  Shard& s = shard(key);
  STRATA_CHECK(!s.moving, kBadArgument, "tiered store: release of '{}' while a move is in flight", key);
  if (s.desc.tier == Tier::kNvme) s.state = Residency::kAbsent;
}

Residency TieredStore::state(const std::string& key) {
  std::lock_guard lock(mutex_);
  Shard& s = shard(key);
  if (s.moving && s.event->query()) {
    // Complete, so synchronize() does not block; it tells success from
    // failure. A failed move stays in flight until wait() reports it.
    try {
      s.event->synchronize();
      s.moving = false;
      s.state = s.after_move;
    } catch (const std::exception&) {
    }
  }
  return s.state;
}

}  // namespace strata::offload
