// An I/O backend for tests that passes everything to a real one, calling a
// hook before each piece is prepared (delay reads, kill the process at the
// n-th read, ...). The hook runs on the I/O worker preparing the piece.
#pragma once

#include <functional>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "nvme/io_backend.h"

namespace strata::test {

using PieceHook = std::function<void(const nvme::IoPiece&)>;

class HookedQueue final : public nvme::IoQueue {
 public:
  HookedQueue(std::unique_ptr<nvme::IoQueue> inner, PieceHook hook) : inner_(std::move(inner)), hook_(std::move(hook)) {}
  size_t capacity() const override { return inner_->capacity(); }
  void prepare(const nvme::IoPiece& piece) override {
    hook_(piece);
    inner_->prepare(piece);
  }
  void submit() override { inner_->submit(); }
  void wait(std::vector<nvme::IoCompletion>& out, size_t min_count) override { inner_->wait(out, min_count); }
  void take_unsubmitted(std::vector<uint64_t>& user_data) override { inner_->take_unsubmitted(user_data); }
  void submit_and_wait(std::vector<nvme::IoCompletion>& out, size_t min_count) override {
    inner_->submit_and_wait(out, min_count);
  }
  bool register_buffers(const std::vector<iovec>& buffers) override { return inner_->register_buffers(buffers); }
  void unregister_buffers() override { inner_->unregister_buffers(); }

 private:
  std::unique_ptr<nvme::IoQueue> inner_;
  PieceHook hook_;
};

class HookedBackend final : public nvme::IoBackend {
 public:
  HookedBackend(std::unique_ptr<nvme::IoBackend> inner, PieceHook hook)
      : inner_(std::move(inner)), hook_(std::move(hook)) {}
  std::string_view name() const override { return inner_->name(); }
  std::unique_ptr<nvme::IoQueue> create_queue(size_t depth) override {
    return std::make_unique<HookedQueue>(inner_->create_queue(depth), hook_);
  }

 private:
  std::unique_ptr<nvme::IoBackend> inner_;
  PieceHook hook_;
};

}  // namespace strata::test
