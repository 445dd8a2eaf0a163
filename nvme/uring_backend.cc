// io_uring backend: one ring per queue; fixed buffers when registered.
#include <liburing.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>

#include "nvme/backends.h"
#include "core/error.h"
#include "core/log.h"

namespace strata::nvme {
namespace {

class UringQueue final : public IoQueue {
 public:
  explicit UringQueue(size_t depth) : depth_(depth) {
    int rc = io_uring_queue_init(static_cast<unsigned>(depth), &ring_, 0);
    if (rc < 0) raise_errno(-rc, fmt::format("io_uring_queue_init(entries={})", depth));
  }
  ~UringQueue() override {
    if (registered_) io_uring_unregister_buffers(&ring_);
    io_uring_queue_exit(&ring_);
  }

  size_t capacity() const override { return depth_; }

  void prepare(const IoPiece& piece) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      // Only when the caller exceeded capacity(); submitting frees the ring's slots.
      submit();
      sqe = io_uring_get_sqe(&ring_);
      STRATA_CHECK(sqe != nullptr, kInternal, "io_uring submission queue full (depth {})", depth_);
    }
    const bool fixed = registered_ && piece.fixed_index >= 0;
    unsigned nbytes = static_cast<unsigned>(piece.nbytes);
    if (piece.op == IoOp::kRead) {
      if (fixed) {
        io_uring_prep_read_fixed(sqe, piece.fd, piece.buf, nbytes, piece.offset, piece.fixed_index);
      } else {
        io_uring_prep_read(sqe, piece.fd, piece.buf, nbytes, piece.offset);
      }
    } else {
      if (fixed) {
        io_uring_prep_write_fixed(sqe, piece.fd, piece.buf, nbytes, piece.offset,
                                  piece.fixed_index);
      } else {
        io_uring_prep_write(sqe, piece.fd, piece.buf, nbytes, piece.offset);
      }
    }
    io_uring_sqe_set_data64(sqe, piece.user_data);
    ++prepared_;
    unsubmitted_.push_back(piece.user_data);
  }

  void submit() override {
    while (prepared_ > 0) {
      int rc = io_uring_submit(&ring_);
      if (rc == -EINTR) continue;
      if (rc == -EAGAIN || rc == -EBUSY) {
        // The kernel is short of resources or the CQ is full; let completions drain.
        std::this_thread::yield();
        continue;
      }
      if (rc < 0) raise_errno(-rc, "io_uring_submit");
      consumed(static_cast<size_t>(rc));
      if (rc == 0) std::this_thread::yield();
    }
  }

  void submit_and_wait(std::vector<IoCompletion>& out, size_t min_count) override {
    if (prepared_ > 0 && min_count > 0) {
      // One io_uring_enter submits everything prepared and sleeps until
      // min_count completions are there (min_count <= pieces in flight).
      int rc = io_uring_submit_and_wait(&ring_, static_cast<unsigned>(min_count));
      if (rc >= 0) {
        consumed(static_cast<size_t>(rc));
      } else if (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        raise_errno(-rc, "io_uring_submit_and_wait");
      }
    }
    submit();  // anything left (EINTR, partial submission)
    wait(out, min_count);
  }

  void wait(std::vector<IoCompletion>& out, size_t min_count) override {
    size_t got = 0;
    while (true) {
      io_uring_cqe* cqes[64];
      unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, 64);
      for (unsigned i = 0; i < n; ++i) {
        out.push_back({io_uring_cqe_get_data64(cqes[i]), static_cast<long>(cqes[i]->res)});
      }
      io_uring_cq_advance(&ring_, n);
      got += n;
      if (got >= min_count && (n > 0 || min_count == 0)) return;
      if (n > 0) continue;
      // Sleep until all that is still missing has arrived (one wakeup).
      io_uring_cqe* cqe = nullptr;
      const size_t missing = min_count > got ? min_count - got : 1;
      int rc = io_uring_wait_cqe_nr(&ring_, &cqe, static_cast<unsigned>(missing));
      if (rc == -EINTR || rc == -EAGAIN) continue;
      if (rc < 0) raise_errno(-rc, "io_uring_wait_cqe");
    }
  }

  void take_unsubmitted(std::vector<uint64_t>& user_data) override {
    // Their SQEs stay in the ring unsubmitted; the handle never submits on a
    // queue that failed, it only reaps what the kernel already has.
    user_data.insert(user_data.end(), unsubmitted_.begin(), unsubmitted_.end());
    unsubmitted_.clear();
    prepared_ = 0;
  }

  bool register_buffers(const std::vector<iovec>& buffers) override {
    unregister_buffers();
    if (buffers.empty()) return false;
    int rc = io_uring_register_buffers(&ring_, buffers.data(), static_cast<unsigned>(buffers.size()));
    if (rc < 0) {
      warn_once("nvme-uring-register",
                fmt::format("io_uring could not register {} fixed buffers ({}); using unregistered "
                            "I/O (raise RLIMIT_MEMLOCK or keep each buffer under 1 GiB)",
                            buffers.size(), std::strerror(-rc)));
      return false;
    }
    registered_ = true;
    return true;
  }

  void unregister_buffers() override {
    if (registered_) io_uring_unregister_buffers(&ring_);
    registered_ = false;
  }

 private:
  io_uring ring_{};
  size_t depth_;
  // The kernel consumed the oldest n prepared SQEs.
  void consumed(size_t n) {
    n = std::min(n, prepared_);
    prepared_ -= n;
    unsubmitted_.erase(unsubmitted_.begin(), unsubmitted_.begin() + static_cast<long>(n));
  }

  size_t prepared_ = 0;
  std::deque<uint64_t> unsubmitted_;  // user_data of prepared SQEs, oldest first
  bool registered_ = false;
};

class UringBackend final : public IoBackend {
 public:
  std::string_view name() const override { return "uring"; }
  std::unique_ptr<IoQueue> create_queue(size_t depth) override {
    return std::make_unique<UringQueue>(depth);
  }
};

}  // namespace

std::unique_ptr<IoBackend> make_uring_backend() { return std::make_unique<UringBackend>(); }

}  // namespace strata::nvme
