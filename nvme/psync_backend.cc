// pread/pwrite backend (the reference), and make_backend which picks one.
#include <unistd.h>

#include <cerrno>
#include <deque>

#include "nvme/backends.h"
#include "core/error.h"

namespace strata::nvme {
namespace {

// Pieces run synchronously on the worker thread inside wait(), one per call
// to pread/pwrite, so results (short counts, errno) are reported exactly as
// the kernel gives them; the handle does the resuming.
class PsyncQueue final : public IoQueue {
 public:
  explicit PsyncQueue(size_t depth) : depth_(depth) {}
  size_t capacity() const override { return depth_; }
  void prepare(const IoPiece& piece) override { pending_.push_back(piece); }
  void submit() override {}
  void wait(std::vector<IoCompletion>& out, size_t min_count) override {
    size_t n = std::min(pending_.size(), std::max<size_t>(min_count, 1));
    for (size_t i = 0; i < n; ++i) {
      IoPiece piece = pending_.front();
      pending_.pop_front();
      ssize_t rc = piece.op == IoOp::kRead
                       ? ::pread(piece.fd, piece.buf, piece.nbytes, static_cast<off_t>(piece.offset))
                       : ::pwrite(piece.fd, piece.buf, piece.nbytes, static_cast<off_t>(piece.offset));
      out.push_back({piece.user_data, rc < 0 ? -static_cast<long>(errno) : static_cast<long>(rc)});
    }
  }

 private:
  size_t depth_;
  std::deque<IoPiece> pending_;
};

class PsyncBackend final : public IoBackend {
 public:
  std::string_view name() const override { return "psync"; }
  std::unique_ptr<IoQueue> create_queue(size_t depth) override {
    return std::make_unique<PsyncQueue>(depth);
  }
};

}  // namespace

std::unique_ptr<IoBackend> make_psync_backend() { return std::make_unique<PsyncBackend>(); }

std::unique_ptr<IoBackend> make_backend(EngineKind kind) {
  switch (kind) {
    case EngineKind::kUring: return make_uring_backend();
    case EngineKind::kAio: return make_aio_backend();
    case EngineKind::kPsync: return make_psync_backend();
  }
  raise(ErrorCategory::kBadArgument, "unknown engine kind {}", static_cast<int>(kind));
}

}  // namespace strata::nvme
