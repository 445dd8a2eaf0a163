// The trace recorder: per-thread buffers registered on first use, the
// process-wide session (start/stop) and the recording calls. The publication
// protocol between a thread and the writer is in trace_buffer.h.
#include "core/trace_recorder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "core/trace_buffer.h"
#include "core/trace_writer.h"

namespace strata::trace {

namespace detail {
std::atomic<uint32_t> g_session{0};
}  // namespace detail

// ---- ThreadBuffer ------------------------------------------------------------------

ThreadBuffer::ThreadBuffer(int64_t thread_id, size_t max_events, size_t max_string_bytes) : tid(thread_id) {
  reset(0, max_events, max_string_bytes);
}

void ThreadBuffer::reset(uint32_t new_session, size_t max_events, size_t max_string_bytes) noexcept {
  // Chunks are kept for the next session when the bounds did not change, so a
  // thread that records in every session allocates once.
  const size_t event_slots = (max_events + kEventsPerChunk - 1) / kEventsPerChunk;
  const size_t string_slots = (max_string_bytes + kStringChunk - 1) / kStringChunk;
  if (event_slots != chunk_slots_ || string_slots != string_slots_) {
    chunks_.reset(new (std::nothrow) std::unique_ptr<Event[]>[event_slots]);
    strings_.reset(new (std::nothrow) std::unique_ptr<char[]>[string_slots]);
    chunk_slots_ = chunks_ ? event_slots : 0;
    string_slots_ = strings_ ? string_slots : 0;
  }
  max_events_ = std::min(max_events, chunk_slots_ * kEventsPerChunk);
  max_string_bytes_ = std::min(max_string_bytes, string_slots_ * kStringChunk);
  reserved_ = 0;
  string_pos_ = 0;
  count.store(0, std::memory_order_relaxed);
  dropped.store(0, std::memory_order_relaxed);
  session.store(new_session, std::memory_order_release);
}

Event* ThreadBuffer::reserve() noexcept {
  if (reserved_ >= max_events_) return nullptr;
  std::unique_ptr<Event[]>& chunk = chunks_[reserved_ / kEventsPerChunk];
  if (!chunk) {
    chunk.reset(new (std::nothrow) Event[kEventsPerChunk]);
    if (!chunk) return nullptr;
  }
  Event* e = &chunk[reserved_ % kEventsPerChunk];
  ++reserved_;
  // Relaxed: the writer reads done only after acquiring the count that
  // publishes this slot, which this thread stores after this line.
  e->done.store(0, std::memory_order_relaxed);
  e->detail_key = nullptr;
  e->value_key = nullptr;
  e->bytes = Args::kNoBytes;
  e->offset = -1;
  e->value = 0;
  e->track = 0;
  return e;
}

bool ThreadBuffer::store(std::string_view text, uint32_t& at, uint16_t& len) noexcept {
  text = text.substr(0, kMaxString);
  // A text never spans two chunks: skip the rest of this one if it does not fit.
  size_t pos = string_pos_;
  if (pos / kStringChunk != (pos + text.size()) / kStringChunk && (pos + text.size()) % kStringChunk != 0) {
    pos = (pos / kStringChunk + 1) * kStringChunk;
  }
  if (pos + text.size() > max_string_bytes_) return false;
  std::unique_ptr<char[]>& chunk = strings_[pos / kStringChunk];
  if (!chunk) {
    chunk.reset(new (std::nothrow) char[kStringChunk]);
    if (!chunk) return false;
  }
  std::memcpy(chunk.get() + pos % kStringChunk, text.data(), text.size());
  at = static_cast<uint32_t>(pos);
  len = static_cast<uint16_t>(text.size());
  string_pos_ = pos + text.size();
  return true;
}

std::string ThreadBuffer::name() const {
  std::lock_guard lock(name_mutex_);
  return name_;
}

void ThreadBuffer::set_name(std::string_view name, bool replace) {
  std::lock_guard lock(name_mutex_);
  if (replace || name_.empty()) name_ = name;
}

// ---- the registry -------------------------------------------------------------------

namespace {

struct Registry {
  std::mutex mutex;  // guards everything below; start/stop/name/track only
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  std::vector<std::string> tracks;
  uint32_t last_session = 0;
  Options options;
  std::string path, tmp_path;
  std::FILE* file = nullptr;
  bool atexit_registered = false;
  // Bounds of the current session, read by threads resetting their buffer.
  std::atomic<size_t> max_events{Options{}.max_events_per_thread};
  std::atomic<size_t> max_string_bytes{Options{}.max_string_bytes_per_thread};
};

// Never destroyed: threads and the atexit hook may use it during exit.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

// The calling thread's buffer, created and registered on first use; marked
// dead when the thread exits (the registry keeps it until it is written).
struct Holder {
  std::shared_ptr<ThreadBuffer> buffer;
  ~Holder() {
    if (buffer) buffer->alive.store(false, std::memory_order_release);
  }
};
thread_local Holder t_holder;

ThreadBuffer* this_thread_buffer() noexcept {
  if (t_holder.buffer) return t_holder.buffer.get();
  try {
    Registry& r = registry();
    auto buffer = std::make_shared<ThreadBuffer>(static_cast<int64_t>(::syscall(SYS_gettid)),
                                                 r.max_events.load(std::memory_order_relaxed),
                                                 r.max_string_bytes.load(std::memory_order_relaxed));
    std::lock_guard lock(r.mutex);
    r.buffers.push_back(buffer);
    t_holder.buffer = std::move(buffer);
  } catch (...) {
    return nullptr;  // out of memory: this thread records nothing
  }
  return t_holder.buffer.get();
}

// The calling thread's buffer, ready for the current session, or nullptr
// when recording is off (or this thread cannot record).
ThreadBuffer* recording_buffer() noexcept {
  const uint32_t session = detail::g_session.load(std::memory_order_acquire);
  if (session == 0) return nullptr;
  ThreadBuffer* b = this_thread_buffer();
  if (b == nullptr) return nullptr;
  if (b->session.load(std::memory_order_relaxed) != session) {
    Registry& r = registry();
    b->reset(session, r.max_events.load(std::memory_order_relaxed),
             r.max_string_bytes.load(std::memory_order_relaxed));
  }
  return b;
}

// A new event of `kind` with its begin fields and name, not yet published.
Event* open_event(ThreadBuffer* b, Track track, const char* category, std::string_view name, EventKind kind,
                  int64_t begin_ns) noexcept {
  Event* e = b->reserve();
  if (e == nullptr || !b->store(name, e->name_at, e->name_len)) {
    b->dropped.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  e->kind = kind;
  e->category = category;
  e->track = track;
  e->begin_ns = begin_ns;
  e->end_ns = begin_ns;
  return e;
}

void fill_args(ThreadBuffer* b, Event* e, const Args& args) noexcept {
  e->bytes = args.bytes;
  e->offset = args.offset;
  e->value_key = args.value_key;
  e->value = args.value;
  if (args.detail_key != nullptr && b->store(args.detail, e->detail_at, e->detail_len)) {
    e->detail_key = args.detail_key;
  }
}

// A finished event (complete with explicit times, instant, counter) in one go.
void record(Track track, const char* category, std::string_view name, EventKind kind, int64_t begin_ns,
            int64_t end_ns, const Args& args) noexcept {
  ThreadBuffer* b = recording_buffer();
  if (b == nullptr) return;
  Event* e = open_event(b, track, category, name, kind, begin_ns);
  if (e == nullptr) return;
  e->end_ns = end_ns;
  fill_args(b, e, args);
  e->done.store(1, std::memory_order_relaxed);  // published by the count below
  b->publish();
}

std::string errno_text() { return fmt::format("{} (errno {})", std::strerror(errno), errno); }

// Drops the buffers of threads that have exited (their events are written).
void prune_dead(Registry& r) {
  std::erase_if(r.buffers, [](const std::shared_ptr<ThreadBuffer>& b) {
    return !b->alive.load(std::memory_order_acquire);
  });
}

void stop_at_exit() {
  try {
    const Summary s = stop();
    if (!s.path.empty()) std::fprintf(stderr, "strata: trace written to %s at exit\n", s.path.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata: the trace could not be written at exit: %s\n", e.what());
  }
}

}  // namespace

// ---- public functions ---------------------------------------------------------------

std::string expand_path(std::string_view pattern, int rank, int world_size) {
  std::string path(pattern);
  const std::string rank_text = std::to_string(rank);
  bool substituted = false;
  for (size_t at = path.find("{rank}"); at != std::string::npos; at = path.find("{rank}", at + rank_text.size())) {
    path.replace(at, 6, rank_text);
    substituted = true;
  }
  if (substituted || world_size <= 1) return path;
  const std::string suffix = ".rank" + rank_text;
  constexpr std::string_view kJson = ".json";
  if (path.size() > kJson.size() && path.ends_with(kJson)) {
    return path.insert(path.size() - kJson.size(), suffix);
  }
  return path + suffix;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void start(const Options& options) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  STRATA_CHECK(detail::g_session.load() == 0, kBadArgument, "a trace is already being recorded (to {})", r.path);
  STRATA_CHECK(!options.path.empty(), kBadArgument, "the trace file path is empty");
  STRATA_CHECK(options.max_events_per_thread > 0 && options.max_string_bytes_per_thread > 0, kBadArgument,
               "trace bounds must be positive (max_events_per_thread {}, max_string_bytes_per_thread {})",
               options.max_events_per_thread, options.max_string_bytes_per_thread);
  STRATA_CHECK(options.max_string_bytes_per_thread <= (size_t{1} << 32), kBadArgument,
               "max_string_bytes_per_thread {} is over 4 GiB", options.max_string_bytes_per_thread);
  const std::string path = expand_path(options.path, options.rank, options.world_size);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    raise(ErrorCategory::kIo, "cannot write the trace to {}: it is a directory", path);
  }
  // Created now, beside the final name (rename() stays in one filesystem),
  // so that a bad path fails before the run rather than after it.
  const std::string tmp = fmt::format("{}.tmp{}", path, ::getpid());
  std::FILE* file = std::fopen(tmp.c_str(), "w");
  if (file == nullptr) raise(ErrorCategory::kIo, "cannot create the trace file {}: {}", path, errno_text());
  prune_dead(r);
  r.options = options;
  r.path = path;
  r.tmp_path = tmp;
  r.file = file;
  r.max_events.store(options.max_events_per_thread, std::memory_order_relaxed);
  r.max_string_bytes.store(options.max_string_bytes_per_thread, std::memory_order_relaxed);
  if (++r.last_session == 0) r.last_session = 1;
  if (!r.atexit_registered) {
    std::atexit(stop_at_exit);
    r.atexit_registered = true;
  }
  detail::g_session.store(r.last_session, std::memory_order_release);
}

Summary stop() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const uint32_t session = detail::g_session.load();
  if (session == 0) return {};
  detail::g_session.store(0);

  WriteInput input;
  input.rank = r.options.rank;
  input.world_size = r.options.world_size;
  input.process_name = r.options.process_name;
  input.max_events_per_thread = r.options.max_events_per_thread;
  input.tracks = r.tracks;
  for (const auto& b : r.buffers) {
    if (b->session.load(std::memory_order_acquire) != session) continue;
    WriteInput::Thread t;
    t.buffer = b.get();
    t.count = b->count.load(std::memory_order_acquire);
    t.name = b->name();
    t.dropped = b->dropped.load(std::memory_order_relaxed);
    input.threads.push_back(std::move(t));
  }
  std::FILE* file = r.file;
  r.file = nullptr;
  Summary summary;
  try {
    summary = write_chrome_json(file, r.path, input);
    if (std::fflush(file) != 0) raise(ErrorCategory::kIo, "writing the trace {} failed: {}", r.path, errno_text());
  } catch (...) {
    std::fclose(file);
    std::remove(r.tmp_path.c_str());
    throw;
  }
  if (std::fclose(file) != 0) {
    const std::string why = errno_text();
    std::remove(r.tmp_path.c_str());
    raise(ErrorCategory::kIo, "writing the trace {} failed: {}", r.path, why);
  }
  if (std::rename(r.tmp_path.c_str(), r.path.c_str()) != 0) {
    const std::string why = errno_text();
    std::remove(r.tmp_path.c_str());
    raise(ErrorCategory::kIo, "cannot rename the trace {} to {}: {}", r.tmp_path, r.path, why);
  }
  prune_dead(r);
  summary.path = r.path;
  if (summary.dropped > 0) {
    logger().warn("trace {}: {} events dropped (more than {} events or {} bytes of names on a thread); raise the "
                  "bounds or trace a shorter run",
                  r.path, summary.dropped, r.options.max_events_per_thread, r.options.max_string_bytes_per_thread);
  }
  return summary;
}

void name_this_thread(std::string_view name, bool replace) {
  if (ThreadBuffer* b = this_thread_buffer()) b->set_name(name, replace);
}

Track make_track(std::string_view name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.tracks.emplace_back(name);
  return static_cast<Track>(r.tracks.size());
}

void complete(const char* category, std::string_view name, int64_t begin_ns, int64_t end_ns, const Args& args) {
  complete(kThisThread, category, name, begin_ns, end_ns, args);
}

void complete(Track track, const char* category, std::string_view name, int64_t begin_ns, int64_t end_ns,
              const Args& args) {
  if (!enabled()) return;
  record(track, category, name, EventKind::kComplete, begin_ns, std::max(begin_ns, end_ns), args);
}

void instant(const char* category, std::string_view name, const Args& args) {
  if (!enabled()) return;
  const int64_t t = now_ns();
  record(kThisThread, category, name, EventKind::kInstant, t, t, args);
}

void counter(std::string_view name, int64_t value) {
  if (!enabled()) return;
  Args args;
  args.value = value;
  const int64_t t = now_ns();
  record(kThisThread, "counter", name, EventKind::kCounter, t, t, args);
}

// ---- Span -----------------------------------------------------------------------------

void Span::begin(Track track, const char* category, std::string_view name) noexcept {
  ThreadBuffer* b = recording_buffer();
  if (b == nullptr) return;
  event_ = open_event(b, track, category, name, EventKind::kComplete, now_ns());
  if (event_ == nullptr) return;
  buffer_ = b;
  session_ = b->session.load(std::memory_order_relaxed);
  b->publish();  // the begin fields: a span open at stop() is written as "B"
}

bool Span::live() const noexcept {
  // A stop() and a start() since begin() reset this thread's buffer: the slot
  // may hold another event now.
  return buffer_->session.load(std::memory_order_relaxed) == session_;
}

void Span::finish() noexcept {
  if (live()) {
    event_->end_ns = std::max(event_->begin_ns, now_ns());
    event_->done.store(1, std::memory_order_release);
  }
  event_ = nullptr;
}

void Span::set_bytes(uint64_t n) noexcept {
  if (live()) event_->bytes = n;
}

void Span::set_offset(int64_t file_offset) noexcept {
  if (live()) event_->offset = file_offset;
}

void Span::set_detail(const char* key, std::string_view text) noexcept {
  if (live() && buffer_->store(text, event_->detail_at, event_->detail_len)) event_->detail_key = key;
}

void Span::set_value(const char* key, int64_t v) noexcept {
  if (live()) {
    event_->value_key = key;
    event_->value = v;
  }
}

// ---- Session --------------------------------------------------------------------------

Summary Session::finish() {
  finished_ = true;
  return stop();
}

Session::~Session() {
  if (finished_) return;
  try {
    const Summary s = stop();
    if (!s.path.empty()) logger().info("trace written to {} ({} events)", s.path, s.events);
  } catch (const std::exception& e) {
    logger().error("the trace could not be written: {}", e.what());
  }
}

}  // namespace strata::trace
