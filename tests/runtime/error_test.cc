// strata::Error, STRATA_CHECK, errno helpers, ErrorSlot, tensors.
#include <catch2/catch.hpp>

#include <fcntl.h>

#include <thread>

#include "core/error.h"
#include "core/tensor.h"

using namespace strata;

TEST_CASE("STRATA_CHECK throws the user's message, and only an internal error names the check and its location",
          "[error]") {
  try {
    const int rank = 3;
    STRATA_CHECK(rank < 2, kCommunication, "rank {} out of range", rank);
    FAIL("no throw");
  } catch (const Error& e) {
    REQUIRE(e.category() == ErrorCategory::kCommunication);
    REQUIRE(std::string(e.what()) == "communication error: rank 3 out of range");
  }
  try {
    const int slots = 5;
    STRATA_CHECK(slots <= 4, kInternal, "{} slots", slots);
    FAIL("no throw");
  } catch (const Error& e) {
    REQUIRE(e.category() == ErrorCategory::kInternal);
    REQUIRE_THAT(e.what(), Catch::StartsWith("internal error: 5 slots"));
    REQUIRE_THAT(e.what(), Catch::Contains("slots <= 4") && Catch::Contains("error_test.cc"));
  }
}

TEST_CASE("check_errno carries errno text and what was done", "[error]") {
  const int fd = ::open("/nonexistent/strata/file", O_RDONLY);
  REQUIRE_THROWS_MATCHES(check_errno(fd, "open /nonexistent/strata/file"), Error,
                         Catch::Matchers::Predicate<Error>([](const Error& e) {
                           return e.category() == ErrorCategory::kIo &&
                                  std::string(e.what()).find("No such file or directory") != std::string::npos &&
                                  std::string(e.what()).find("/nonexistent/strata/file") != std::string::npos;
                         }));
  REQUIRE_NOTHROW(check_errno(0, "fine"));
}

TEST_CASE("ErrorSlot keeps the first error from another thread", "[error]") {
  ErrorSlot slot;
  REQUIRE_NOTHROW(slot.rethrow_if_set());
  std::thread t([&] {
    try {
      raise(ErrorCategory::kIo, "first");
    } catch (...) {
      slot.set(std::current_exception());
    }
    try {
      raise(ErrorCategory::kIo, "second");
    } catch (...) {
      REQUIRE_FALSE(slot.set(std::current_exception()));
    }
  });
  t.join();
  REQUIRE_THROWS_WITH(slot.rethrow_if_set(), "I/O error: first");
  REQUIRE_THROWS_WITH(slot.rethrow_if_set(), "I/O error: first");  // sticky
}

TEST_CASE("Tensor ownership: host tensors free themselves, views do not own", "[tensor]") {
  Tensor t = Tensor::host(DType::kBF16, {4, 3});
  REQUIRE(t.numel() == 12);
  REQUIRE(t.nbytes() == 24);
  REQUIRE(reinterpret_cast<uintptr_t>(t.data()) % 64 == 0);
  TensorView view = t.view();
  Tensor moved = std::move(t);
  REQUIRE_FALSE(t.defined());
  REQUIRE(moved.data() == view.data);
  REQUIRE(shape_string(moved.desc().shape) == "[4, 3]");
  bool freed = false;
  { Tensor custom(TensorDesc{DType::kF32, {1}, Tier::kCpu}, &freed, [&](void*) { freed = true; }); }
  REQUIRE(freed);
  REQUIRE_THROWS_AS(shape_numel({2, -1}), Error);
}
