// The timeline recorder (`--trace FILE`, docs/DESIGN.md §10): spans, instants and
// counters recorded into per-thread buffers and written, when recording
// stops, as Chrome trace-event JSON that Perfetto (ui.perfetto.dev) and
// chrome://tracing open. It lives in strata::core so that every layer (nvme,
// partition, offload, the engine) can record without depending on another.
//
// Recording is process-wide: start() turns it on, stop() turns it off and
// writes the file. While it is off, a Span costs one relaxed atomic load and
// a branch, so call sites stay in place unconditionally. While it is on, an
// event costs ~0.1-0.3 us, mostly its two clock reads (bench/PERFORMANCE.md).
//
//   trace::Options options;                             // (designated initializers
//   options.path = "trace.json";                        //  trip -Wmissing-field-initializers)
//   options.rank = rank;
//   options.world_size = world;
//   trace::Session session(options);                    // or trace::start(options)
//   trace::name_this_thread("io worker 0.1");           // once per long-lived thread
//   {
//     trace::Span span("io", "read");                   // begins now, on this thread's track
//     span.bytes(nbytes).offset(offset).detail("file", path);
//     ...                                               // the work
//   }                                                   // ends: one complete ("X") event
//   session.finish();                                   // writes trace.json (tmp + rename)
//
// How to instrument (the conventions the writer and the viewer rely on):
//   - Category: a string literal naming the subsystem: "io", "comm", "phase"
//     (training loop), "engine" (hooks, nc/cg/gg issue and wait), "optimizer",
//     "memory". Perfetto filters and colours by it.
//   - Name: what the span does ("read", "allgather", "forward", "gg", "adam").
//     Put the operator or parameter in detail("op", ...)/detail("param", ...),
//     not in the name, so that spans of one kind share a name.
//   - bytes(n): the bytes the span moved. The writer adds "GB/s" = n / duration.
//     value("flops", n): the arithmetic it did; the writer adds "GFLOP/s".
//     For collectives it is nccl-tests' "size" (allgather: the gathered
//     output; reduce-scatter: the input; allreduce: the buffer), so GB/s is algbw.
//   - One track per thread: a stream's worker thread, an I/O worker, the
//     optimizer thread each name themselves with name_this_thread(). A cpu
//     Stream's thread can be named from the engine with
//     stream.launch_host_func([] { trace::name_this_thread("stream compute"); }).
//   - Spans on one track must nest (Perfetto drops slices that overlap without
//     nesting). Work that starts on one thread and finishes on another (an
//     async NVMe read, a transfer a stream waits for, a CUDA stream's kernel
//     timed with events) is recorded by the thread that learns it finished,
//     with explicit times: complete(category, name, begin_ns, end_ns, args) on
//     that thread's track, or on a virtual track (make_track("gpu stream
//     compute")) when the thread's own track would not nest. We chose complete
//     events with explicit begin/end over async ("b"/"e") events because
//     Perfetto lays async events out in per-name tracks of the process, not on
//     the track of the stream or worker that did the work.
//   - Counters (bytes in flight, pinned bytes in use): counter("pinned bytes",
//     v) from any thread; one counter track per name in the process.
//   - Already recorded below the engine: every AioHandle worker ("io worker
//     H.W" tracks: "read"/"write" spans per run of a request's pieces, with
//     bytes, file, offset) and every Gloo collective (a "comm" span on the
//     stream thread that runs it, which is named "comm <traffic>" unless the
//     engine named it first), and every NCCL collective (a "comm" span on a
//     virtual track "nccl <traffic>" per communicator, timed by its watchdog
//     from seeing the collective start on the device to seeing it complete,
//     at 200 us resolution while recording). An AioHandle on_done callback runs on the worker
//     after that worker's span was recorded: time a request end to end (nc:
//     submit to HostEvent signalled) on a virtual track, not the worker's.
//   - Suggested for the engine: spans "gg"/"cg"/"nc issue" (category
//     "engine", detail("op", name), bytes) where each stage is issued or waited
//     for, the per-op stall as complete("engine", "param stall", begin, end)
//     on the compute stream's track, the optimizer thread(s) named
//     "optimizer" with a span per sub-group ("adam", value("sub_group", k),
//     bytes of state moved), and counter("gathered bytes", n).
//
// Files: the path may contain "{rank}", replaced by the rank; without it and
// with world_size > 1, ".rank<N>" goes before a ".json" extension (or at the
// end), so `strata run -n 2` writes trace.rank0.json and trace.rank1.json
// (expand_path). The file is created at start() (a temporary name beside it,
// so an unwritable path fails at once, not after a long run) and renamed into
// place by stop() (or at exit; a process killed by a signal leaves only the
// empty "<path>.tmp<pid>"). pid in the trace is the rank; tid is the OS thread id (or a
// virtual track's id); timestamps are CLOCK_MONOTONIC microseconds, so the
// files of ranks on one machine share a time axis.
//
// Bounds: each thread keeps at most Options::max_events_per_thread events
// and Options::max_string_bytes_per_thread bytes of names per session, in
// chunks allocated as they fill; later events of that thread are dropped and
// counted ("dropped_events" in the file's otherData; stop() returns the count).
// The first events are kept: the start of a run is never overwritten.
//
// Thread-safety: every function may be called from any thread. Recording
// takes no lock (each thread appends to its own buffer); start/stop/
// name_this_thread/make_track take a mutex. A Span must begin and end on the
// same thread. Events recorded while stop() runs may be left out; a span
// still open at stop() is written as a begin ("B") event without an end.
// Errors: start() and stop() throw strata::Error (below); recording never
// throws and never allocates except when a thread's buffer needs a new chunk.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

namespace strata::trace {

struct Options {
  std::string path;        // output file; "{rank}" substituted (see expand_path)
  int rank = 0;            // the trace's pid, and the "{rank}" in path
  int world_size = 1;      // > 1 without "{rank}" in path: ".rank<N>" is added
  std::string process_name;  // the process track's name; empty: "strata rank <N>"
  size_t max_events_per_thread = size_t{1} << 18;       // ~23 MiB per thread when full
  size_t max_string_bytes_per_thread = size_t{8} << 20;  // names, files, parameters
};

// What stop() wrote.
struct Summary {
  std::string path;         // the file written ("" if nothing was recording)
  uint64_t events = 0;      // events written (metadata not counted)
  uint64_t dropped = 0;     // events lost to the per-thread bounds
  int threads = 0;          // tracks with events
};

// The path a rank writes: pattern with "{rank}" replaced, else (world_size > 1)
// ".rank<N>" inserted before a trailing ".json" or appended.
std::string expand_path(std::string_view pattern, int rank, int world_size);

// Starts recording into a new session. Creates the output's temporary file
// now. Throws Error(kBadArgument) when recording is already on, the path is
// empty or a bound is 0; Error(kIo) naming the path and errno text when the
// file cannot be created (missing directory, no permission, a directory at
// that path). Registers an atexit hook so a process that exits without stop()
// still writes its trace.
void start(const Options& options);

// Stops recording and writes the Chrome JSON file (temporary file, then
// rename). Returns what was written; does nothing and returns an empty
// Summary when recording is off. Throws Error(kIo) when writing or renaming
// fails (recording is off afterwards either way, the temporary file removed).
Summary stop();

namespace detail {
// 0 while off; the current session's id (>= 1) while on.
extern std::atomic<uint32_t> g_session;
}  // namespace detail

// Whether recording is on: one relaxed load (the flag is read again, with
// ordering, before anything is recorded).
inline bool enabled() { return detail::g_session.load(std::memory_order_relaxed) != 0; }

// CLOCK_MONOTONIC in nanoseconds: the clock of every event. For explicit
// begin/end times (complete()).
int64_t now_ns();

// Names the calling thread's track. `replace` false: only if it has no name
// yet (a library naming threads it runs on but does not own, such as the
// communicators on a stream's thread). Works whether or not recording is on;
// the name is kept for later sessions while the thread lives.
void name_this_thread(std::string_view name, bool replace = true);

// A named track not tied to a thread (tid >= 1 << 30), e.g. a CUDA stream
// whose kernels are timed with events. Events go there with complete(track,
// ...) from any thread; the caller makes them nest. Tracks live for the process.
using Track = uint32_t;
constexpr Track kThisThread = 0;
Track make_track(std::string_view name);

// The optional arguments of an event. Keys are string literals (static
// storage); texts are copied when the event is recorded.
struct Args {
  static constexpr uint64_t kNoBytes = ~uint64_t{0};
  uint64_t bytes = kNoBytes;     // bytes moved; GB/s is derived from it
  int64_t offset = -1;           // file offset (-1: none)
  const char* detail_key = nullptr;  // "file", "op", "param", "comm", ...
  std::string_view detail;
  const char* value_key = nullptr;   // one named integer: "pieces", "step", "stall_us"
  int64_t value = 0;
};

// A complete event with explicit times (now_ns() clock) on the calling
// thread's track, or on `track`. end_ns < begin_ns is clamped to a zero duration.
void complete(const char* category, std::string_view name, int64_t begin_ns, int64_t end_ns,
              const Args& args = {});
void complete(Track track, const char* category, std::string_view name, int64_t begin_ns,
              int64_t end_ns, const Args& args = {});
// A thread-scoped instant event (a marker: "trace dropped", "step skipped").
void instant(const char* category, std::string_view name, const Args& args = {});
// A counter sample: the process's counter track `name` has `value` from now on.
void counter(std::string_view name, int64_t value);

struct Event;         // trace_buffer.h
class ThreadBuffer;   // trace_buffer.h

// A span on the calling thread's track (or a virtual one), from construction
// to destruction (or end()). Recorded only if recording was on when it began;
// the setters do nothing otherwise. Not copyable or movable; must end on the
// thread that began it.
class Span {
 public:
  Span(const char* category, std::string_view name) noexcept {
    if (enabled()) [[unlikely]] begin(kThisThread, category, name);
  }
  Span(Track track, const char* category, std::string_view name) noexcept {
    if (enabled()) [[unlikely]] begin(track, category, name);
  }
  ~Span() {
    if (event_ != nullptr) [[unlikely]] finish();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  // Setters: one branch when not recording.
  Span& bytes(uint64_t n) noexcept {
    if (event_ != nullptr) [[unlikely]] set_bytes(n);
    return *this;
  }
  Span& offset(int64_t file_offset) noexcept {
    if (event_ != nullptr) [[unlikely]] set_offset(file_offset);
    return *this;
  }
  // `key` is a string literal; `text` is copied now.
  Span& detail(const char* key, std::string_view text) noexcept {
    if (event_ != nullptr) [[unlikely]] set_detail(key, text);
    return *this;
  }
  Span& value(const char* key, int64_t v) noexcept {
    if (event_ != nullptr) [[unlikely]] set_value(key, v);
    return *this;
  }
  // Ends the span now (the destructor then does nothing).
  void end() noexcept {
    if (event_ != nullptr) finish();
  }
  bool recording() const { return event_ != nullptr; }

 private:
  void begin(Track track, const char* category, std::string_view name) noexcept;
  void finish() noexcept;
  bool live() const noexcept;
  void set_bytes(uint64_t n) noexcept;
  void set_offset(int64_t file_offset) noexcept;
  void set_detail(const char* key, std::string_view text) noexcept;
  void set_value(const char* key, int64_t v) noexcept;
  Event* event_ = nullptr;  // null: not recording
  ThreadBuffer* buffer_ = nullptr;
  uint32_t session_ = 0;
};

// Starts recording on construction and stops on destruction; finish() stops
// and reports errors, the destructor only logs them (so a run that fails
// still leaves its trace, up to the failure, for diagnosis).
class Session {
 public:
  explicit Session(const Options& options) { start(options); }
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  Summary finish();

 private:
  bool finished_ = false;
};

}  // namespace strata::trace
