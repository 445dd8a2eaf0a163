// libaio backend: one io_context per queue, a fixed pool of iocbs.
#include <libaio.h>

#include <cerrno>
#include <deque>
#include <thread>

#include "nvme/backends.h"
#include "core/error.h"

namespace strata::nvme {
namespace {

class AioQueue final : public IoQueue {
 public:
  explicit AioQueue(size_t depth) : depth_(depth), iocbs_(depth), events_(depth) {
    int rc = io_setup(static_cast<int>(depth), &ctx_);
    if (rc < 0) {
      raise_errno(-rc, fmt::format("io_setup(nr_events={}) (see /proc/sys/fs/aio-max-nr)", depth));
    }
    for (auto& cb : iocbs_) free_.push_back(&cb);
  }
  ~AioQueue() override { io_destroy(ctx_); }

  size_t capacity() const override { return depth_; }

  void prepare(const IoPiece& piece) override {
    STRATA_CHECK(!free_.empty(), kInternal, "libaio queue full (depth {})", depth_);
    iocb* cb = free_.back();
    free_.pop_back();
    if (piece.op == IoOp::kRead) {
      io_prep_pread(cb, piece.fd, piece.buf, piece.nbytes, static_cast<long long>(piece.offset));
    } else {
      io_prep_pwrite(cb, piece.fd, piece.buf, piece.nbytes, static_cast<long long>(piece.offset));
    }
    cb->data = reinterpret_cast<void*>(static_cast<uintptr_t>(piece.user_data));
    pending_.push_back(cb);
  }

  void submit() override {
    size_t done = 0;
    while (done < pending_.size()) {
      int rc = io_submit(ctx_, static_cast<long>(pending_.size() - done), pending_.data() + done);
      if (rc == -EINTR) continue;
      if (rc == -EAGAIN) {
        std::this_thread::yield();
        continue;
      }
      if (rc < 0) {
        // io_submit refused the first remaining iocb (EBADF, EINVAL, ...): that
        // piece completes with the error, as io_uring reports it; the rest go on.
        iocb* refused = pending_[done];
        synthetic_.push_back({static_cast<uint64_t>(reinterpret_cast<uintptr_t>(refused->data)), rc});
        free_.push_back(refused);
        ++done;
        continue;
      }
      done += static_cast<size_t>(rc);
    }
    pending_.clear();
  }

  void wait(std::vector<IoCompletion>& out, size_t min_count) override {
    size_t got = take_synthetic(synthetic_, out);
    if (got > 0 && got >= min_count) return;
    do {
      int rc = io_getevents(ctx_, static_cast<long>(min_count > got ? min_count - got : 0),
                            static_cast<long>(events_.size()), events_.data(), nullptr);
      if (rc == -EINTR) continue;
      if (rc < 0) raise_errno(-rc, "io_getevents");
      for (int i = 0; i < rc; ++i) {
        const io_event& ev = events_[i];
        // res carries bytes transferred or a negated errno in an unsigned field.
        out.push_back({static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ev.data)),
                       static_cast<long>(ev.res)});
        free_.push_back(ev.obj);
      }
      got += static_cast<size_t>(rc);
    } while (got < min_count);
  }

 private:
  io_context_t ctx_ = nullptr;
  size_t depth_;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> free_;
  std::vector<iocb*> pending_;
  std::deque<IoCompletion> synthetic_;  // pieces io_submit refused, reported by wait()
  std::vector<io_event> events_;
};

class AioBackend final : public IoBackend {
 public:
  std::string_view name() const override { return "aio"; }
  std::unique_ptr<IoQueue> create_queue(size_t depth) override {
    return std::make_unique<AioQueue>(depth);
  }
};

}  // namespace

std::unique_ptr<IoBackend> make_aio_backend() { return std::make_unique<AioBackend>(); }

}  // namespace strata::nvme
