// strata::Error and the errno helpers.
#include "core/error.h"

#include <cstring>

#include "core/log.h"

namespace strata {

std::string_view category_name(ErrorCategory category) {
  switch (category) {
    case ErrorCategory::kBadArgument: return "bad argument";
    case ErrorCategory::kIo: return "I/O error";
    case ErrorCategory::kOutOfMemory: return "out of memory";
    case ErrorCategory::kCommunication: return "communication error";
    case ErrorCategory::kCuda: return "CUDA error";
    case ErrorCategory::kInternal: return "internal error";
  }
  return "unknown error";
}

Error::Error(ErrorCategory category, const std::string& message)
    : std::runtime_error(fmt::format("{}: {}", category_name(category), message)),
      category_(category),
      message_(message) {}

namespace detail {
void check_failed(ErrorCategory category, const char* condition, const char* file, int line,
                  const std::string& message) {
  // The message is for the user, in their terms; where the check sits in
  // strata's source is for a developer: the debug log. An internal error is
  // a bug in strata, which the user reports, so it carries its location.
  if (category == ErrorCategory::kInternal) {
    throw Error(category, fmt::format("{} (check `{}` failed at {}:{})", message, condition, file, line));
  }
  logger().debug("check `{}` failed at {}:{}: {}", condition, file, line, message);
  throw Error(category, message);
}
}  // namespace detail

void raise_errno(int err, std::string_view what) {
  char buffer[256];
  // GNU strerror_r returns a pointer that may or may not be `buffer`.
  const char* text = strerror_r(err, buffer, sizeof(buffer));
  throw Error(ErrorCategory::kIo, fmt::format("{}: {} (errno {})", what, text, err));
}

void check_errno(long rc, std::string_view what) {
  if (rc < 0) raise_errno(errno, what);
}

void check_errno_value(int err, std::string_view what) {
  if (err != 0) raise_errno(err, what);
}

bool ErrorSlot::set(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) return false;
  error_ = std::move(error);
  return true;
}

bool ErrorSlot::has_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_ != nullptr;
}

void ErrorSlot::rethrow_if_set() const {
  std::exception_ptr error = get();
  if (error) std::rethrow_exception(error);
}

std::exception_ptr ErrorSlot::get() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

}  // namespace strata
