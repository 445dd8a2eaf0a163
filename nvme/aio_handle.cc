// AioHandle: request splitting, per-worker submission loops, completion
// checking (short transfers resumed, EINTR/EAGAIN retried, errors with context).
#include "nvme/aio_handle.h"

#include <string.h>

#include <cerrno>
#include <chrono>
#include <algorithm>
#include <deque>
#include <iterator>
#include <optional>

#include "core/error.h"
#include "core/log.h"
#include "core/trace_recorder.h"

namespace strata::nvme {
namespace {

constexpr int kMaxRetries = 10000;  // EINTR/EAGAIN resubmissions of one piece before giving up

std::string errno_text(int err) {
  const char* name = strerrorname_np(err);
  return fmt::format("{} ({})", strerror(err), name ? name : fmt::format("errno {}", err));
}

const char* op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

// Pieces a worker with a backlog hands to the kernel at once (see
// worker_loop): a quarter of its queue, so the queue stays at least 3/4 full
// while each system call carries several adjacent pieces for the block
// layer's plug to merge (four 1 MiB pieces make one 4 MiB request).
size_t refill_batch(size_t depth) { return std::max<size_t>(1, depth / 4); }

// Handles are numbered in creation order for their workers' track names.
std::atomic<int> g_handle_count{0};

// The timeline of one worker (trace_recorder.h): a span per run of one
// request's pieces that the worker had in flight together, from the first
// piece's submission to the last one's completion, with the run's bytes, file
// and first offset. Several requests are in flight at once, so runs overlap;
// each span starts no earlier than the worker's previous span ended, so the
// worker's track nests (Perfetto drops overlapping slices) and each span's
// GB/s is the worker's throughput over that stretch. Runs are keyed by their
// request; a run starts only while tracing is on.
class WorkerTimeline {
 public:
  bool empty() const { return runs_.empty(); }
  void taken(const void* request, uint64_t offset) {
    Run& run = runs_[request];
    if (run.outstanding++ == 0) {  // a new run (finished runs are erased)
      run.begin_ns = trace::now_ns();
      run.offset = offset;
    }
  }
  void finished(const void* request, size_t nbytes, bool ok, const char* op, const std::string& path) {
    auto it = runs_.find(request);
    if (it == runs_.end()) return;  // taken before tracing started
    Run& run = it->second;
    run.bytes += ok ? nbytes : 0;
    ++run.pieces;
    if (--run.outstanding != 0) return;
    const int64_t end = trace::now_ns();
    trace::Args args;
    args.bytes = run.bytes;
    args.offset = static_cast<int64_t>(run.offset);
    args.detail_key = "file";
    args.detail = path;
    args.value_key = "pieces";
    args.value = run.pieces;
    trace::complete("io", op, std::max(run.begin_ns, last_end_ns_), end, args);
    last_end_ns_ = end;
    runs_.erase(it);
  }

 private:
  struct Run {
    int64_t begin_ns = 0;
    uint64_t offset = 0, bytes = 0;
    size_t outstanding = 0;
    int64_t pieces = 0;
  };
  std::unordered_map<const void*, Run> runs_;
  int64_t last_end_ns_ = 0;
};

}  // namespace

struct AioHandle::Request {
  IoOp op;
  std::string path;
  uint64_t offset;
  size_t nbytes;
  size_t pieces_left = 0;  // guarded by AioHandle::mutex_
  std::exception_ptr error;
  Ticket ticket = 0;
  // Set for a callback request (no ticket handed out): called once by the
  // worker that finishes the last piece, and moved out before the call. Such
  // a request stays in requests_ until on_done has returned, so wait_all()
  // (and the destructor) wait for the callback too.
  AioHandle::DoneFn on_done;
  bool callback = false;
};

struct AioHandle::Piece {
  std::shared_ptr<Request> request;
  const File* file = nullptr;
  char* buf = nullptr;
  size_t nbytes = 0;
  uint64_t offset = 0;
  size_t done = 0;  // bytes already transferred (short completions resumed)
  int fixed_index = -1;
  int retries = 0;
  // The setting this piece was cut with: its worker keeps at most `depth`
  // pieces in flight while this one is next in its inbox.
  size_t depth = 1;
  int tune_tag = OnlineTuner::kUntracked;
  bool tune_overtime = false;
  bool tune_started = false;  // handed to the kernel (the tuner was told)
  bool urgent = false;  // IoPriority::kUrgent: taken before the normal pieces waiting
  uint64_t id = 0;  // key in the worker's in-flight table
  std::chrono::steady_clock::time_point started;
};

struct AioHandle::Worker {
  std::unique_ptr<IoQueue> queue;
  std::thread thread;
  std::mutex mutex;  // guards inbox, stop
  std::condition_variable cv;
  std::deque<std::unique_ptr<Piece>> inbox;
  bool stop = false;
  std::vector<uint64_t> latencies_ns;  // guarded by mutex
};

AioHandle::AioHandle(const AioOptions& options, std::unique_ptr<IoBackend> backend)
    : options_(options), backend_(std::move(backend)) {
  options_.validate();
  if (!backend_) backend_ = make_backend(options_.engine);
  for (int i = 0; i < options_.thread_count; ++i) {
    auto worker = std::make_unique<Worker>();
    // Deep enough for every setting auto_tune may pick (ring sizes are fixed).
    worker->queue = backend_->create_queue(static_cast<size_t>(options_.max_queue_depth()));
    workers_.push_back(std::move(worker));
  }
  const int handle_index = g_handle_count.fetch_add(1);
  tuner_ = std::make_unique<OnlineTuner>(
      options_, fmt::format("I/O handle {}, {}, {} worker{}", handle_index, backend_->name(),
                            options_.thread_count, options_.thread_count == 1 ? "" : "s"));
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker* w = workers_[i].get();
    w->thread = std::thread([this, w, handle_index, i] {
      trace::name_this_thread(fmt::format("io worker {}.{}", handle_index, i));
      worker_loop(*w);
    });
  }
}

AioHandle::~AioHandle() {
  wait_all();
  // Finished requests nobody waited for: their errors would otherwise vanish.
  for (const auto& [ticket, request] : requests_) {
    if (!request->error) continue;
    try {
      std::rethrow_exception(request->error);
    } catch (const std::exception& e) {
      logger().error("I/O error not collected before the handle was destroyed: {}", e.what());
    }
  }
  requests_.clear();
  for (auto& worker : workers_) {
    {
      std::lock_guard lock(worker->mutex);
      worker->stop = true;
    }
    worker->cv.notify_one();
  }
  for (auto& worker : workers_) worker->thread.join();
}

std::string_view AioHandle::backend_name() const { return backend_->name(); }

AioStats AioHandle::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

Ticket AioHandle::submit_read(const File& file, void* buf, size_t nbytes, uint64_t offset, IoPriority priority) {
  return submit(IoOp::kRead, file, buf, nbytes, offset, nullptr, priority);
}

Ticket AioHandle::submit_write(const File& file, const void* buf, size_t nbytes, uint64_t offset,
                               IoPriority priority) {
  // The buffer is only read from for writes; the piece type is shared with reads.
  return submit(IoOp::kWrite, file, const_cast<void*>(buf), nbytes, offset, nullptr, priority);
}

void AioHandle::submit_read(const File& file, void* buf, size_t nbytes, uint64_t offset, DoneFn on_done,
                            IoPriority priority) {
  STRATA_CHECK(on_done != nullptr, kBadArgument, "read of {} with an empty completion callback", file.path());
  submit(IoOp::kRead, file, buf, nbytes, offset, std::move(on_done), priority);
}

void AioHandle::submit_write(const File& file, const void* buf, size_t nbytes, uint64_t offset,
                             DoneFn on_done, IoPriority priority) {
  STRATA_CHECK(on_done != nullptr, kBadArgument, "write of {} with an empty completion callback", file.path());
  submit(IoOp::kWrite, file, const_cast<void*>(buf), nbytes, offset, std::move(on_done), priority);
}

void AioHandle::read(const File& file, void* buf, size_t nbytes, uint64_t offset, IoPriority priority) {
  wait(submit_read(file, buf, nbytes, offset, priority));
}

void AioHandle::write(const File& file, const void* buf, size_t nbytes, uint64_t offset, IoPriority priority) {
  wait(submit_write(file, buf, nbytes, offset, priority));
}

int AioHandle::find_fixed_index(const void* buf, size_t nbytes) const {
  if (!fixed_active_) return -1;
  auto p = reinterpret_cast<uintptr_t>(buf);
  for (size_t i = 0; i < fixed_.size(); ++i) {
    auto base = reinterpret_cast<uintptr_t>(fixed_[i].iov_base);
    if (p >= base && p + nbytes <= base + fixed_[i].iov_len) return static_cast<int>(i);
  }
  return -1;
}

namespace {

// A completion callback's exception has nowhere to go (no caller waits).
void call_done(const AioHandle::DoneFn& on_done, std::exception_ptr error) {
  try {
    on_done(std::move(error));
  } catch (const std::exception& e) {
    logger().error("I/O completion callback threw (dropped): {}", e.what());
  } catch (...) {
    logger().error("I/O completion callback threw a non-standard exception (dropped)");
  }
}

}  // namespace

Ticket AioHandle::submit(IoOp op, const File& file, void* buf, size_t nbytes, uint64_t offset, DoneFn on_done,
                         IoPriority priority) {
  STRATA_CHECK(file.is_open(), kBadArgument, "{} of a closed file", op_name(op));
  STRATA_CHECK(buf != nullptr || nbytes == 0, kBadArgument, "{} of {} with a null buffer",
               op_name(op), file.path());
  const size_t align = file.alignment();
  if (align > 1) {
    auto address = reinterpret_cast<uintptr_t>(buf);
    if (address % align != 0 || offset % align != 0 || nbytes % align != 0) {
      raise(ErrorCategory::kBadArgument,
            "{} of {} (O_DIRECT): buffer address {}, file offset {} and length {} must each be a "
            "multiple of {} bytes (misaligned: {}{}{})",
            op_name(op), file.path(), buf, offset, nbytes, align,
            address % align ? "buffer " : "", offset % align ? "offset " : "",
            nbytes % align ? "length" : "");
    }
  }
  auto request = std::make_shared<Request>();
  request->op = op;
  request->path = file.path();
  request->offset = offset;
  request->nbytes = nbytes;

  if (on_done && nbytes == 0) {
    call_done(on_done, nullptr);  // nothing to transfer: done now
    return 0;
  }
  std::vector<std::vector<std::unique_ptr<Piece>>> per_worker(workers_.size());
  Ticket ticket;
  {
    std::lock_guard lock(mutex_);
    // Cut the request (the tuner says how long each piece is and how deep its
    // worker's queue may be; the pieces tile [offset, offset + nbytes) exactly).
    std::vector<std::unique_ptr<Piece>> pieces;
    for (size_t at = 0; at < nbytes;) {
      const OnlineTuner::Cut cut = tuner_->cut(op, nbytes - at);
      auto piece = std::make_unique<Piece>();
      piece->request = request;
      piece->file = &file;
      piece->buf = static_cast<char*>(buf) + at;
      piece->nbytes = cut.nbytes;
      piece->offset = offset + at;
      piece->fixed_index = find_fixed_index(piece->buf, piece->nbytes);
      piece->depth = static_cast<size_t>(cut.queue_depth);
      piece->tune_tag = cut.tag;
      piece->tune_overtime = cut.overtime;
      piece->urgent = priority == IoPriority::kUrgent;
      pieces.push_back(std::move(piece));
      at += cut.nbytes;
    }
    ticket = next_ticket_++;
    request->ticket = ticket;
    request->callback = on_done != nullptr;
    request->on_done = std::move(on_done);
    request->pieces_left = pieces.size();
    requests_.emplace(ticket, request);
    // Each worker takes a contiguous run of pieces (not every n-th piece), so
    // the pieces it submits together are adjacent in the file and in memory and
    // the block layer can merge them into larger requests. While auto_tune
    // measures, each candidate's stretch of the request is spread over the
    // workers on its own, so all workers run the same candidate at a time.
    for (size_t begin = 0; begin < pieces.size();) {
      size_t end = begin + 1;
      while (end < pieces.size() && pieces[end]->tune_tag == pieces[begin]->tune_tag) ++end;
      const size_t count = end - begin;
      const size_t run = (count + workers_.size() - 1) / workers_.size();
      for (size_t i = 0; i < count; ++i) {
        per_worker[next_worker_].push_back(std::move(pieces[begin + i]));
        if ((i + 1) % run == 0 || i + 1 == count) next_worker_ = (next_worker_ + 1) % workers_.size();
      }
      begin = end;
    }
  }
  for (size_t w = 0; w < workers_.size(); ++w) {
    if (per_worker[w].empty()) continue;
    {
      std::lock_guard lock(workers_[w]->mutex);
      std::deque<std::unique_ptr<Piece>>& inbox = workers_[w]->inbox;
      if (priority == IoPriority::kUrgent) {
        // After the urgent pieces already waiting, before every normal one.
        auto at = std::find_if(inbox.begin(), inbox.end(), [](const auto& p) { return !p->urgent; });
        inbox.insert(at, std::make_move_iterator(per_worker[w].begin()), std::make_move_iterator(per_worker[w].end()));
      } else {
        for (auto& piece : per_worker[w]) inbox.push_back(std::move(piece));
      }
    }
    workers_[w]->cv.notify_one();
  }
  return ticket;
}

void AioHandle::finish_piece(Piece& piece, std::exception_ptr error) {
  Request& request = *piece.request;
  tuner_->finished(request.op, piece.tune_tag, piece.nbytes, error == nullptr, piece.tune_started,
                   piece.tune_overtime);
  DoneFn on_done;
  std::exception_ptr request_error;
  {
    std::lock_guard lock(mutex_);
    if (error && !request.error) request.error = error;
    ++stats_.pieces;
    if (!error) {
      (request.op == IoOp::kRead ? stats_.bytes_read : stats_.bytes_written) += piece.nbytes;
      if (piece.fixed_index >= 0) ++stats_.fixed_pieces;
    }
    if (--request.pieces_left != 0) return;
    if (!request.callback) {
      done_cv_.notify_all();
      return;
    }
    on_done = std::move(request.on_done);
    request_error = request.error;
  }
  // Outside the lock: the callback may submit more I/O to this handle.
  call_done(on_done, std::move(request_error));
  on_done = nullptr;  // what it captured goes before wait_all() can return
  {
    std::lock_guard lock(mutex_);
    requests_.erase(request.ticket);
  }
  done_cv_.notify_all();
}

void AioHandle::worker_loop(Worker& worker) {
  IoQueue& queue = *worker.queue;
  const size_t capacity = queue.capacity();
  // The queue depth in force: that of the piece next in the inbox (each piece
  // carries its setting, so auto_tune's candidates each run at their own depth).
  auto depth_of = [&](const Piece& piece) { return std::clamp<size_t>(piece.depth, 1, capacity); };
  size_t depth = std::min<size_t>(capacity, static_cast<size_t>(options_.queue_depth));
  std::unordered_map<uint64_t, std::unique_ptr<Piece>> in_flight;
  std::vector<Piece*> to_submit;
  std::vector<IoCompletion> completions;
  uint64_t next_id = 1;
  // Set once the queue itself failed (submit threw): from then on every new
  // piece of this worker fails with this text, so no waiter is left hanging,
  // while pieces the kernel already has are still reaped — their buffers stay
  // in use until the kernel is done with them, so they must not be reported
  // finished before that.
  std::optional<std::string> broken;
  WorkerTimeline timeline;
  // auto_tune: per direction, the candidate of this worker's in-flight tuning
  // pieces and how many there are. A piece of another candidate waits until
  // they have all finished, so candidates never share busy time.
  struct Measuring {
    int tag = OnlineTuner::kUntracked;
    size_t in_flight = 0;
  } measuring[2];
  auto measuring_of = [&](const Piece& piece) -> Measuring& {
    return measuring[piece.request->op == IoOp::kRead ? 0 : 1];
  };
  auto must_drain_before = [&](const Piece& piece) {
    if (piece.tune_tag < 0) return false;
    const Measuring& m = measuring_of(piece);
    return m.in_flight > 0 && m.tag != piece.tune_tag;
  };
  // Every piece this worker took from its inbox finishes through here.
  auto finish = [&](Piece& piece, std::exception_ptr error) {
    if (piece.tune_tag >= 0 && piece.tune_started) --measuring_of(piece).in_flight;
    if (!timeline.empty()) {
      const Request& r = *piece.request;
      timeline.finished(&r, piece.nbytes, error == nullptr, op_name(r.op), r.path);
    }
    finish_piece(piece, std::move(error));
  };

  auto piece_error = [](const Piece& piece, uint64_t at, const std::string& why) {
    const Request& r = *piece.request;
    return std::make_exception_ptr(
        Error(ErrorCategory::kIo,
              fmt::format("{} of {} (request offset {}, {} bytes) failed at offset {} (piece of {} "
                          "bytes, {} done): {}",
                          op_name(r.op), r.path, r.offset, r.nbytes, at, piece.nbytes, piece.done,
                          why)));
  };

  auto broken_error = [&](const Piece& piece) {
    return piece_error(piece, piece.offset + piece.done,
                       fmt::format("I/O worker queue ({}) failed: {}", backend_->name(), *broken));
  };
  auto fail_ids = [&](const std::vector<uint64_t>& ids) {
    for (uint64_t id : ids) {
      auto it = in_flight.find(id);
      if (it == in_flight.end()) continue;
      finish(*it->second, broken_error(*it->second));
      in_flight.erase(it);
    }
  };
  auto fail_all = [&] {
    for (auto& [id, piece] : in_flight) finish(*piece, broken_error(*piece));
    in_flight.clear();
    to_submit.clear();
  };

  while (true) {
    // Take new pieces: up to the free depth. With a backlog, only once `batch`
    // slots are free, so the pieces go to the kernel together (one system
    // call, one block-layer plug that merges adjacent pieces). With
    // overlap_events off, only when the queue is empty (batches complete
    // before the next one is submitted).
    bool backlog = false;
    {
      std::unique_lock lock(worker.mutex);
      if (in_flight.empty()) {
        worker.cv.wait(lock, [&] { return worker.stop || !worker.inbox.empty(); });
        if (worker.inbox.empty() && worker.stop) return;
      }
      if (!worker.inbox.empty()) depth = depth_of(*worker.inbox.front());
      const size_t free_slots = depth > in_flight.size() ? depth - in_flight.size() : 0;
      const bool may_refill = options_.overlap_events
                                  ? free_slots >= std::min(refill_batch(depth), worker.inbox.size())
                                  : in_flight.empty();
      while (may_refill && !worker.inbox.empty() &&
             in_flight.size() < depth_of(*worker.inbox.front()) &&
             !must_drain_before(*worker.inbox.front())) {
        std::unique_ptr<Piece> piece = std::move(worker.inbox.front());
        worker.inbox.pop_front();
        if (broken) {
          lock.unlock();
          finish_piece(*piece, broken_error(*piece));
          lock.lock();
          continue;
        }
        Piece* raw = piece.get();
        raw->id = next_id++;
        if (record_latency_.load(std::memory_order_relaxed)) {
          raw->started = std::chrono::steady_clock::now();
        }
        if (trace::enabled()) [[unlikely]] timeline.taken(raw->request.get(), raw->offset);
        if (raw->tune_tag >= 0) {
          Measuring& m = measuring_of(*raw);
          m.tag = raw->tune_tag;
          ++m.in_flight;
          tuner_->started(raw->request->op, raw->tune_tag);
          raw->tune_started = true;
        }
        in_flight.emplace(raw->id, std::move(piece));
        to_submit.push_back(raw);
      }
      backlog = !worker.inbox.empty();
      if (backlog) depth = depth_of(*worker.inbox.front());
    }
    if (in_flight.empty()) continue;
    size_t prepared = 0;  // pieces of to_submit handed to queue.prepare() so far
    try {
      if (!to_submit.empty()) {
        for (Piece* piece : to_submit) {
          IoPiece io;
          io.op = piece->request->op;
          io.fd = piece->file->fd();
          io.buf = piece->buf + piece->done;
          io.nbytes = piece->nbytes - piece->done;
          io.offset = piece->offset + piece->done;
          io.fixed_index = piece->fixed_index;
          io.user_data = piece->id;
          queue.prepare(io);
          ++prepared;
          if (options_.single_submit) queue.submit();
        }
        to_submit.clear();
      }
      completions.clear();
      if (broken) {
        queue.wait(completions, 1);  // only reap what the kernel already has
      } else {
        // Without a backlog, completions are reported as soon as they come;
        // with one, the worker sleeps until `batch` slots are free again.
        // (Past a switch to a shallower setting, in_flight may exceed depth:
        // no slot is free until it has drained below.)
        size_t want = in_flight.size();
        if (options_.overlap_events) {
          const size_t batch = refill_batch(depth);
          const size_t free_slots = depth > in_flight.size() ? depth - in_flight.size() : 0;
          want = backlog && batch > free_slots ? std::min(batch - free_slots, in_flight.size()) : 1;
        }
        queue.submit_and_wait(completions, want);
      }
    } catch (const std::exception& e) {
      if (!broken) {
        broken = e.what();
        logger().error("I/O worker queue ({}) failed, failing its requests: {}", backend_->name(),
                       e.what());
        // Pieces that never reached the kernel fail now; the rest are reaped.
        std::vector<uint64_t> lost;
        queue.take_unsubmitted(lost);
        for (size_t i = prepared; i < to_submit.size(); ++i) lost.push_back(to_submit[i]->id);
        to_submit.clear();
        fail_ids(lost);
      } else {
        // Not even reaping works: nothing more can be learnt about these
        // pieces. Fail them rather than hang, and say what that risks.
        logger().error("I/O worker queue ({}) cannot reap completions ({}); failing {} pieces whose "
                       "transfers may still be in progress in the kernel (their buffers may still "
                       "be read or written)",
                       backend_->name(), e.what(), in_flight.size());
        fail_all();
      }
      continue;
    }
    for (const IoCompletion& c : completions) {
      auto it = in_flight.find(c.user_data);
      if (it == in_flight.end()) {
        logger().error("I/O completion for unknown piece id {}", c.user_data);
        continue;
      }
      Piece& piece = *it->second;
      const IoOp op = piece.request->op;
      const uint64_t at = piece.offset + piece.done;
      const size_t remaining = piece.nbytes - piece.done;
      std::exception_ptr error;
      bool resubmit = false;
      if (c.result == -EINTR || c.result == -EAGAIN) {
        if (++piece.retries > kMaxRetries) {
          error = piece_error(piece, at, fmt::format("{} after {} retries",
                                                     errno_text(static_cast<int>(-c.result)),
                                                     kMaxRetries));
        } else {
          resubmit = true;
          std::lock_guard lock(mutex_);
          ++stats_.retried;
        }
      } else if (c.result < 0) {
        error = piece_error(piece, at, errno_text(static_cast<int>(-c.result)));
      } else if (c.result == 0) {
        error = op == IoOp::kRead
                    ? piece_error(piece, at, "read past end of file")
                    : piece_error(piece, at, "write transferred 0 bytes (no progress)");
      } else if (static_cast<size_t>(c.result) < remaining) {
        piece.done += static_cast<size_t>(c.result);
        const uint64_t next = piece.offset + piece.done;
        if (piece.file->direct() && next % kDirectIoAlignment != 0) {
          // O_DIRECT cannot resume at an unaligned offset; for reads this is EOF.
          uint64_t size = 0;
          try {
            size = piece.file->size_nbytes();
          } catch (...) {
          }
          error = piece_error(
              piece, next,
              op == IoOp::kRead && next >= size
                  ? fmt::format("read past end of file (file size {} bytes)", size)
                  : std::string("short O_DIRECT transfer ended at an unaligned offset"));
        } else {
          resubmit = true;
          std::lock_guard lock(mutex_);
          ++stats_.short_resumed;
        }
      } else {
        piece.done = piece.nbytes;
      }
      if (resubmit && broken) {
        resubmit = false;  // a failed queue takes no new submissions
        error = broken_error(piece);
      }
      if (resubmit) {
        to_submit.push_back(&piece);
        continue;
      }
      std::unique_ptr<Piece> owned = std::move(it->second);
      in_flight.erase(it);
      if (record_latency_.load(std::memory_order_relaxed) &&
          owned->started != std::chrono::steady_clock::time_point{}) {
        auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - owned->started)
                      .count();
        std::lock_guard lock(worker.mutex);
        worker.latencies_ns.push_back(static_cast<uint64_t>(ns));
      }
      finish(*owned, error);
    }
  }
}

void AioHandle::wait(Ticket ticket) {
  std::shared_ptr<Request> request;
  {
    std::unique_lock lock(mutex_);
    auto it = requests_.find(ticket);
    STRATA_CHECK(it != requests_.end(), kBadArgument,
                 "I/O ticket {} is unknown or was already waited on", ticket);
    request = it->second;
    done_cv_.wait(lock, [&] { return request->pieces_left == 0; });
    requests_.erase(ticket);
  }
  if (request->error) std::rethrow_exception(request->error);
}

bool AioHandle::done(Ticket ticket) const {
  std::lock_guard lock(mutex_);
  auto it = requests_.find(ticket);
  STRATA_CHECK(it != requests_.end(), kBadArgument,
               "I/O ticket {} is unknown or was already waited on", ticket);
  return it->second->pieces_left == 0;
}

void AioHandle::wait(std::span<const Ticket> tickets) {
  std::exception_ptr first;
  for (Ticket ticket : tickets) {
    try {
      wait(ticket);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void AioHandle::wait_all() {
  std::unique_lock lock(mutex_);
  done_cv_.wait(lock, [&] {
    for (const auto& [ticket, request] : requests_) {
      // A callback request leaves the table once its on_done has returned.
      if (request->pieces_left != 0 || request->callback) return false;
    }
    return true;
  });
}

bool AioHandle::register_buffers(const std::vector<iovec>& buffers) {
  std::lock_guard lock(mutex_);
  for (const auto& [ticket, request] : requests_) {
    STRATA_CHECK(request->pieces_left == 0, kBadArgument,
                 "register_buffers needs an idle handle, but ticket {} is in flight", ticket);
  }
  for (auto& worker : workers_) worker->queue->unregister_buffers();
  fixed_.clear();
  fixed_active_ = false;
  if (!options_.register_buffers || buffers.empty()) return false;
  bool ok = true;
  for (auto& worker : workers_) ok = ok && worker->queue->register_buffers(buffers);
  if (!ok) {
    for (auto& worker : workers_) worker->queue->unregister_buffers();
    return false;
  }
  fixed_ = buffers;
  fixed_active_ = true;
  return true;
}

std::vector<uint64_t> AioHandle::take_latencies_ns() {
  std::vector<uint64_t> all;
  for (auto& worker : workers_) {
    std::lock_guard lock(worker->mutex);
    all.insert(all.end(), worker->latencies_ns.begin(), worker->latencies_ns.end());
    worker->latencies_ns.clear();
  }
  return all;
}

void AioHandle::unregister_buffers() { register_buffers({}); }

}  // namespace strata::nvme
