// strata::Error, the one exception type of the library, and the checks that
// raise it. Every layer reports failures through these so that a caller sees
// one kind of error carrying a category and the context (file:offset, rank, key).
#pragma once

#include <fmt/core.h>  // fmt::format and its checked format strings; fmt/format.h costs each includer twice as much

#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>

namespace strata {

enum class ErrorCategory {
  kBadArgument,    // caller passed something invalid (config, shape, alignment)
  kIo,             // file or device I/O failed
  kOutOfMemory,    // a budget or allocator could not satisfy a request
  kCommunication,  // a collective, rendezvous or peer failed or timed out
  kCuda,           // CUDA runtime, cuBLAS or NCCL reported an error
  kInternal,       // a broken invariant inside strata
};

std::string_view category_name(ErrorCategory category);

// Thrown by every strata function that fails. what() is "<category>: <message>".
class Error : public std::runtime_error {
 public:
  Error(ErrorCategory category, const std::string& message);
  ErrorCategory category() const noexcept { return category_; }
  // The message without the category prefix.
  const std::string& message() const noexcept { return message_; }

 private:
  ErrorCategory category_;
  std::string message_;
};

// Throws Error(category, formatted message).
template <typename... Args>
[[noreturn]] void raise(ErrorCategory category, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(category, fmt::format(format, std::forward<Args>(args)...));
}

namespace detail {
[[noreturn]] void check_failed(ErrorCategory category, const char* condition, const char* file,
                               int line, const std::string& message);
}  // namespace detail

// STRATA_CHECK(cond, category, "format {}", args...): throws Error when cond is false,
// with the formatted message (say what is wrong in the user's terms: the key,
// flag, file or value). The failed condition and its source location go to the
// debug log; only a kInternal error (a bug) carries them in its message.
#define STRATA_CHECK(cond, category, ...)                                                    \
  do {                                                                                       \
    if (!(cond)) [[unlikely]] {                                                              \
      ::strata::detail::check_failed(::strata::ErrorCategory::category, #cond, __FILE__,     \
                                     __LINE__, ::fmt::format(__VA_ARGS__));                  \
    }                                                                                        \
  } while (0)

// errno helpers. `what` says what was being done ("pwrite /nvme/x.swp at offset 4096").
// Throws Error(kIo) with the errno text when rc < 0 (errno is read) or, for
// check_errno_value, when err != 0.
void check_errno(long rc, std::string_view what);
void check_errno_value(int err, std::string_view what);
[[noreturn]] void raise_errno(int err, std::string_view what);

// Holds the first error raised on a background thread so that the owning
// object can rethrow it on the caller's thread (from wait(), synchronize(), ...).
// Thread-safe.
class ErrorSlot {
 public:
  // Stores `error` unless an earlier error is already stored. Returns true if stored.
  bool set(std::exception_ptr error);
  bool has_error() const;
  // Rethrows the stored error, if any. The error stays stored (sticky).
  void rethrow_if_set() const;
  std::exception_ptr get() const;

 private:
  mutable std::mutex mutex_;
  std::exception_ptr error_;
};

}  // namespace strata
