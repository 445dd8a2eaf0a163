// Fault-injecting backend wrapper: fails or shortens chosen pieces so tests can
// reach error paths (EIO, short completions) the kernel will not produce on demand.
#include <algorithm>
#include <cerrno>
#include <deque>
#include <thread>
#include <vector>

#include "nvme/backends.h"
#include "core/error.h"

namespace strata::nvme {

std::optional<IoFault> FaultPlan::next(IoOp op) {
  std::lock_guard lock(mutex_);
  ++all_;
  (op == IoOp::kRead ? reads_ : writes_)++;
  for (const IoFault& fault : faults_) {
    if (fault.op && *fault.op != op) continue;
    uint64_t count = !fault.op ? all_ : (op == IoOp::kRead ? reads_ : writes_);
    if (count == fault.nth || (fault.repeat && count > fault.nth)) {
      fired_.fetch_add(1);
      return fault;
    }
  }
  return std::nullopt;
}

namespace {

class FaultQueue final : public IoQueue {
 public:
  FaultQueue(std::unique_ptr<IoQueue> inner, std::shared_ptr<FaultPlan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)) {}

  size_t capacity() const override { return inner_->capacity(); }

  void prepare(const IoPiece& piece) override {
    std::optional<IoFault> fault = plan_->next(piece.op);
    if (!fault) {
      inner_->prepare(piece);
      ++inner_in_flight_;
      return;
    }
    if (fault->kind == IoFault::Kind::kBrokenQueue) {
      broken_ = true;
      lost_.push_back(piece.user_data);
      return;
    }
    if (fault->kind == IoFault::Kind::kSlow) {
      // Held on the I/O worker that prepares it, as a disk that is slow to
      // take the request holds it; then transferred in full.
      std::this_thread::sleep_for(fault->delay);
      inner_->prepare(piece);
      ++inner_in_flight_;
      return;
    }
    if (fault->kind == IoFault::Kind::kError) {
      synthetic_.push_back({piece.user_data, -static_cast<long>(fault->error)});
      return;
    }
    size_t nbytes = std::min(fault->short_nbytes, piece.nbytes);
    if (nbytes == 0) {
      synthetic_.push_back({piece.user_data, 0});
      return;
    }
    // A real transfer of the first nbytes, so resumption is tested against the file.
    IoPiece shortened = piece;
    shortened.nbytes = nbytes;
    inner_->prepare(shortened);
    ++inner_in_flight_;
  }

  void submit() override {
    // Fails before handing this batch to the inner queue; pieces of earlier
    // batches are still in the kernel and complete through wait().
    if (broken_) strata::raise(strata::ErrorCategory::kIo, "injected queue failure (submit)");
    inner_->submit();
  }

  void take_unsubmitted(std::vector<uint64_t>& user_data) override {
    user_data.insert(user_data.end(), lost_.begin(), lost_.end());
    lost_.clear();
    const size_t before = user_data.size();
    inner_->take_unsubmitted(user_data);
    inner_in_flight_ -= std::min(inner_in_flight_, user_data.size() - before);
  }

  void wait(std::vector<IoCompletion>& out, size_t min_count) override {
    size_t got = take_synthetic(synthetic_, out);
    if (got >= min_count && got > 0) return;
    size_t need = std::min(min_count > got ? min_count - got : 1, inner_in_flight_);
    size_t before = out.size();
    inner_->wait(out, need);
    inner_in_flight_ -= out.size() - before;
  }

  bool register_buffers(const std::vector<iovec>& buffers) override {
    return inner_->register_buffers(buffers);
  }
  void unregister_buffers() override { inner_->unregister_buffers(); }

 private:
  std::unique_ptr<IoQueue> inner_;
  std::shared_ptr<FaultPlan> plan_;
  std::deque<IoCompletion> synthetic_;
  std::vector<uint64_t> lost_;  // pieces the broken queue swallowed
  size_t inner_in_flight_ = 0;
  bool broken_ = false;
};

class FaultBackend final : public IoBackend {
 public:
  FaultBackend(std::unique_ptr<IoBackend> inner, std::shared_ptr<FaultPlan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)) {}
  std::string_view name() const override { return "fault"; }
  std::unique_ptr<IoQueue> create_queue(size_t depth) override {
    return std::make_unique<FaultQueue>(inner_->create_queue(depth), plan_);
  }

 private:
  std::unique_ptr<IoBackend> inner_;
  std::shared_ptr<FaultPlan> plan_;
};

class FileFaultAdapter final : public FileFaults {
 public:
  explicit FileFaultAdapter(std::shared_ptr<FaultPlan> plan) : plan_(std::move(plan)) {}
  int before(FileOp op, const std::filesystem::path&, size_t& nbytes) override {
    if (op != FileOp::kWrite) return 0;
    const std::optional<IoFault> fault = plan_->next(IoOp::kWrite);
    if (!fault) return 0;
    switch (fault->kind) {
      case IoFault::Kind::kError: return fault->error;
      case IoFault::Kind::kShort: nbytes = std::min(nbytes, fault->short_nbytes); return 0;
      case IoFault::Kind::kBrokenQueue: return EIO;
      case IoFault::Kind::kSlow: std::this_thread::sleep_for(fault->delay); return 0;
    }
    return 0;
  }

 private:
  std::shared_ptr<FaultPlan> plan_;
};

}  // namespace

std::shared_ptr<FileFaults> file_faults(std::shared_ptr<FaultPlan> plan) {
  STRATA_CHECK(plan != nullptr, kBadArgument, "file_faults needs a plan");
  return std::make_shared<FileFaultAdapter>(std::move(plan));
}

std::unique_ptr<IoBackend> make_fault_backend(std::unique_ptr<IoBackend> inner,
                                              std::shared_ptr<FaultPlan> plan) {
  STRATA_CHECK(inner != nullptr && plan != nullptr, kBadArgument,
               "make_fault_backend needs an inner backend and a plan");
  return std::make_unique<FaultBackend>(std::move(inner), std::move(plan));
}

}  // namespace strata::nvme
