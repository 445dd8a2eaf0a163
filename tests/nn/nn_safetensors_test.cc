// safetensors reader/writer: round trips and corrupt files that must fail with
// errors naming the tensor (model weights by HF name: nn_weights_test.cc).
#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/nn/safetensors.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::nn;

namespace {

// Writes a file from a raw header string and data bytes (header length as given
// unless overridden), for building corrupt files.
// A file with `header` (padded with spaces to 8 bytes, as conforming writers
// do, unless pad is false) and data_nbytes bytes of data.
void write_raw(const std::string& path, std::string header, size_t data_nbytes,
               int64_t header_len_override = -1, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary);
  uint64_t len =
      header_len_override >= 0 ? static_cast<uint64_t>(header_len_override) : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((len >> (8 * i)) & 0xff));
  out << header;
  out << std::string(data_nbytes, '\x01');
}

void expect_open_error(const std::string& path, const std::string& needle) {
  try {
    SafetensorsFile::open(path);
    FAIL("expected an error mentioning '" << needle << "'");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.category() == ErrorCategory::kBadArgument);
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("safetensors round trip of fp32, fp16 and bf16 tensors with metadata",
          "[nn][safetensors]") {
  test::TempDir dir("nn-st");
  Tensor a = Tensor::host(DType::kF32, {3, 4});
  Tensor b = Tensor::host(DType::kBF16, {5});
  Tensor c = Tensor::host(DType::kF16, {2, 1, 3});
  for (int i = 0; i < 12; ++i) a.as<float>()[i] = 0.5f * static_cast<float>(i) - 2.0f;
  for (int i = 0; i < 5; ++i) b.as<BFloat16>()[i] = float_to_bf16(1.0f + static_cast<float>(i));
  for (int i = 0; i < 6; ++i) c.as<Half>()[i] = float_to_half(-3.0f * static_cast<float>(i));
  SafetensorsWriter w;
  w.add("a.weight", a.view());
  w.add("b", b.view());
  w.add("c.bias", c.view());
  w.set_metadata("format", "pt");
  REQUIRE_THROWS_AS(w.add("b", b.view()), Error);
  w.write(dir.file("x.safetensors"));

  const SafetensorsFile f = SafetensorsFile::open(dir.file("x.safetensors"));
  CHECK(f.names() == std::vector<std::string>{"a.weight", "b", "c.bias"});
  CHECK(f.metadata().at("format") == "pt");
  CHECK(f.entry("c.bias").shape == Shape{2, 1, 3});
  CHECK(f.entry("b").dtype == DType::kBF16);
  CHECK(std::memcmp(f.view("a.weight").data, a.data(), a.nbytes()) == 0);
  CHECK(std::memcmp(f.view("b").data, b.data(), b.nbytes()) == 0);
  CHECK(std::memcmp(f.view("c.bias").data, c.data(), c.nbytes()) == 0);
  // The data section starts 8-byte aligned.
  CHECK(reinterpret_cast<uintptr_t>(f.view("a.weight").data) % 8 == 0);

  Tensor back = Tensor::host(DType::kF32, {5});
  REQUIRE_THROWS_WITH(f.read("b", back.view()), Catch::Contains("'b'") && Catch::Contains("dtype"));
  f.read("b", back.view(), /*allow_convert=*/true);
  CHECK(back.as<float>()[4] == 5.0f);
  Tensor wrong_shape = Tensor::host(DType::kF32, {4, 3});
  REQUIRE_THROWS_WITH(f.read("a.weight", wrong_shape.view()),
                      Catch::Contains("'a.weight'") && Catch::Contains("shape"));
  REQUIRE_THROWS_WITH(f.entry("missing"), Catch::Contains("'missing'"));
}

TEST_CASE("corrupt safetensors files fail with clear errors", "[nn][safetensors]") {
  test::TempDir dir("nn-st-bad");
  const std::string p = dir.file("bad.safetensors");
  const std::string good = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";

  write_raw(p, "", 0);
  expect_open_error(p, "not valid JSON");
  { std::ofstream(p, std::ios::binary) << "abc"; }
  expect_open_error(p, "too short");
  write_raw(p, good, 16, /*header_len_override=*/1 << 20);
  expect_open_error(p, "header length");
  write_raw(p, "{\"w\": [", 16);
  expect_open_error(p, "not valid JSON");
  write_raw(p, "[1, 2]", 0);
  expect_open_error(p, "JSON object");
  write_raw(p, good, 8);  // data section too short
  expect_open_error(p, "'w' data_offsets [0, 16] out of range");
  write_raw(p, R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", 16);
  expect_open_error(p, "'w' has 16 bytes but shape [2, 3]");
  write_raw(p, R"({"w":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})", 16);
  expect_open_error(p, "'w' has dtype 'I64'");
  write_raw(p, R"({"w":{"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]}})", 16);
  expect_open_error(p, "'w' has a shape entry");
  write_raw(p, R"({"w":{"dtype":"F32","shape":[2,2]}})", 16);
  expect_open_error(p, "'w' needs");
  write_raw(p, R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[8,4]}})", 16);
  expect_open_error(p, "'w' data_offsets");
  write_raw(
      p,
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      16);
  expect_open_error(p, "overlap");
  write_raw(
      p, R"({"__metadata__":{"k":1},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 16);
  expect_open_error(p, "__metadata__");

  // A deeply nested value is refused by depth, never echoed (dump() of it
  // would recurse off the stack) nor built (a 100 MB header of '[' would cost gigabytes).
  write_raw(p, "{\"w\":" + std::string(200000, '[') + std::string(200000, ']') + "}", 0);
  expect_open_error(p, "nested deeper than 64 levels");
  write_raw(p, R"({"w":[[[[1]]]]})", 0);
  expect_open_error(p, "got a list of 1");  // a nested list is counted, not shown
  // An element-misaligned tensor is refused (header not padded to 8 bytes).
  write_raw(p, R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}} )", 16, -1, /*pad=*/false);
  expect_open_error(p, "not a multiple of its 4-byte elements");
  // A zero-sized tensor may share its offset with the next one (the reference
  // writer produces this); it is not an overlap.
  write_raw(p, R"({"b":{"dtype":"BF16","shape":[8],"data_offsets":[0,16]},"z":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})",
            16);
  CHECK(SafetensorsFile::open(p).entry("z").shape == Shape{0});

  write_raw(p, good, 16);  // and the well-formed one opens
  CHECK(SafetensorsFile::open(p).entry("w").shape == Shape{2, 2});
  try {
    SafetensorsFile::open(dir.file("absent.safetensors"));
    FAIL("expected kIo");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::kIo);
    CHECK(std::string(e.what()).find("absent.safetensors") != std::string::npos);
  }
}

TEST_CASE("safetensors: dimensions past int64 are refused, also after a 0 (issue 16)", "[nn][safetensors][issue16]") {
  test::TempDir dir("nn-st-issue16");
  const std::string p = dir.file("bad.safetensors");
  // After a 0 the element count stays 0, so 2^63 passed the overflow check and
  // became a negative int64 dimension.
  write_raw(p, R"({"w":{"dtype":"F32","shape":[0,9223372036854775808],"data_offsets":[0,0]}})", 0);
  expect_open_error(p, "'w' has shape dimension 9223372036854775808");
  // Non-zero dimensions whose product overflows, hidden behind a 0.
  write_raw(p, R"({"w":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})", 0);
  expect_open_error(p, "'w' has shape dimension 4294967296");
  // The largest count that still fits with 8-byte elements opens (as a 0-sized tensor).
  write_raw(p, R"({"w":{"dtype":"F32","shape":[0,1152921504606846975],"data_offsets":[0,0]}})", 0);
  CHECK(SafetensorsFile::open(p).entry("w").shape == Shape{0, 1152921504606846975});
}

TEST_CASE("safetensors: a tensor name given twice is refused (issue 16)", "[nn][safetensors][issue16]") {
  test::TempDir dir("nn-st-issue16");
  const std::string p = dir.file("bad.safetensors");
  // A name given twice was accepted, the last entry silently winning.
  write_raw(p,
            R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
            16);
  expect_open_error(p, "header key 'w' appears more than once");
}

TEST_CASE("safetensors: a huge tensor name is not echoed whole (issue 16)", "[nn][safetensors][issue16]") {
  test::TempDir dir("nn-st-issue16");
  const std::string p = dir.file("bad.safetensors");
  // A 1 MB tensor name is quoted cut and escaped, not echoed whole.
  const std::string name = std::string(1 << 20, 'n') + "\\u0001";
  write_raw(p, "{\"" + name + R"(":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})", 16);
  try {
    SafetensorsFile::open(p);
    FAIL("expected an error");
  } catch (const Error& e) {
    const std::string what = e.what();
    INFO(what.substr(0, 400));
    CHECK(what.size() < 1000);
    CHECK(what.find("has dtype 'I64'") != std::string::npos);
    CHECK(what.find("bytes)") != std::string::npos);
  }
  // A number beyond double's range in the header is a JSON error, not an escape.
  write_raw(p, R"({"w":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}})", 4);
  expect_open_error(p, "out of range");
}

// HF config.json comes with the downloaded weights, so it is untrusted input
// too (tests/fuzz/decoder_config_fuzzer.cc); these were found by that fuzzer.
TEST_CASE("HF config.json: an integer above 2^63 - 1 is refused, not wrapped (issue 16)", "[nn][config][issue16]") {
  const nlohmann::json base = {{"vocab_size", 16},         {"hidden_size", 16},        {"intermediate_size", 24},
                               {"num_hidden_layers", 1},   {"num_attention_heads", 2}, {"num_key_value_heads", 1}};
  CHECK(parse_decoder_config(base).parameter_count() > 0);
  // Above 2^63 - 1 get<int64_t>() wrapped (2^64 - 1 became -1).
  nlohmann::json j = base;
  j["vocab_size"] = 18446744073709551615ull;
  REQUIRE_THROWS_WITH(parse_decoder_config(j), Catch::Contains("'vocab_size'") && Catch::Contains("2^63 - 1"));
}

TEST_CASE("HF config.json: sizes whose products overflow int64 are refused (issue 16)", "[nn][config][issue16]") {
  const nlohmann::json base = {{"vocab_size", 16},         {"hidden_size", 16},        {"intermediate_size", 24},
                               {"num_hidden_layers", 1},   {"num_attention_heads", 2}, {"num_key_value_heads", 1}};
  nlohmann::json j = base;
  // Positive sizes whose products overflow int64 in parameter_count() and the model's shapes.
  j = base;
  j["hidden_size"] = int64_t{1} << 40;
  j["intermediate_size"] = int64_t{1} << 40;
  REQUIRE_THROWS_WITH(parse_decoder_config(j), Catch::Contains("parameters, beyond what strata counts"));
  // One head of hidden_size - 1 dimensions: head_dim itself is near 2^63, so
  // even the estimate's 2 x head_dim overflowed before it was promoted.
  j = base;
  j["vocab_size"] = std::numeric_limits<int64_t>::max();
  j["hidden_size"] = std::numeric_limits<int64_t>::max() - 1;
  j["num_attention_heads"] = 1;
  j["num_key_value_heads"] = 1;
  REQUIRE_THROWS_WITH(parse_decoder_config(j), Catch::Contains("parameters, beyond what strata counts"));
  j = base;
  j["max_position_embeddings"] = int64_t{1} << 62;
  REQUIRE_THROWS_WITH(parse_decoder_config(j), Catch::Contains("max_position_embeddings"));
}

TEST_CASE("HF config.json: a JSON error quotes the file bounded and escaped (issue 16)", "[nn][config][issue16]") {
  test::TempDir dir("nn-hf-config");
  const std::string path = dir.file("config.json");
  {
    std::ofstream out(path, std::ios::binary);
    out << "{\"vocab_size\": \"" << std::string(100000, 'v') << "\xff";  // unterminated, invalid UTF-8
  }
  try {
    load_decoder_config(path);
    FAIL("expected an error");
  } catch (const Error& e) {
    const std::string what = e.what();
    INFO(what.substr(0, 400));
    CHECK(e.category() == ErrorCategory::kBadArgument);
    CHECK(what.size() < 1000);  // nlohmann's message quoted the whole 100 KB token
    CHECK(what.find('\xff') == std::string::npos);
  }
}
