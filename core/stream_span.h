// A span of a stream's work on the timeline (--trace): it begins when the
// stream reaches the point where the span was opened (the work enqueued
// before it has run) and ends when the stream reaches the point where it was
// closed (the work enqueued inside it has run), so a phase ("forward",
// "backward") encloses its ops instead of timing the host enqueueing them.
// Both ends are host functions on the stream, recorded on the thread that
// runs them: a cpu stream's own thread, the track its ops are on.
//
//   {
//     StreamSpan phase(engine.compute_stream(), "phase", "forward");
//     model.forward(...);   // enqueues ops
//   }                       // the span ends when the last of them has run
//
// While recording is off it costs one relaxed load and enqueues nothing.
// Not copyable; open and close it on one thread. `category` and `name` are
// string literals.
#pragma once

#include <cstdint>
#include <memory>

#include "core/accelerator.h"
#include "core/trace_recorder.h"

namespace strata {

class StreamSpan {
 public:
  StreamSpan(Stream& stream, const char* category, const char* name) {
    if (!trace::enabled()) [[likely]] return;
    stream_ = &stream;
    category_ = category;
    name_ = name;
    begin_ = std::make_shared<int64_t>(0);
    stream.launch_host_func([begin = begin_] { *begin = trace::now_ns(); });
  }
  // A span that cannot be enqueued (the stream failed) is dropped: the
  // stream's error reaches its owner through synchronize, not through here.
  ~StreamSpan() {
    try {
      end();
    } catch (...) {
    }
  }
  StreamSpan(const StreamSpan&) = delete;
  StreamSpan& operator=(const StreamSpan&) = delete;

  // Closes the span now (at the stream's current end); the destructor then does nothing.
  void end() {
    if (stream_ == nullptr) return;
    stream_->launch_host_func([begin = std::move(begin_), category = category_, name = name_] {
      trace::complete(category, name, *begin, trace::now_ns());
    });
    stream_ = nullptr;
  }

 private:
  Stream* stream_ = nullptr;
  const char* category_ = nullptr;
  const char* name_ = nullptr;
  std::shared_ptr<int64_t> begin_;
};

}  // namespace strata
