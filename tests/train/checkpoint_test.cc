// Checkpoints and exports that know what they hold (runtime/train/checkpoint.h,
// hf_export.h): a checkpoint of another model or an edited manifest is
// refused or skipped with the reason, a write that fails (the nvme fault plan
// driving the durable files) leaves the previous checkpoint and the previous
// export as they were, and a re-export replaces the directory whole.
// One rank in this process, real Gloo over loopback, a small Llama.
#include <catch2/catch.hpp>

#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "core/durable_file.h"
#include "core/error.h"
#include "nvme/io_backend.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/hf_export.h"
#include "runtime/train/hf_model.h"
#include "tests/engine/zero_rig.h"
#include "tests/support/temp_dir.h"

using namespace strata;
namespace fs = std::filesystem;

namespace {

nn::DecoderConfig small_config(int heads) {
  nn::DecoderConfig c;
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 1;
  c.num_attention_heads = heads;
  c.num_key_value_heads = heads;
  c.head_dim = 32 / heads;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.validate();
  return c;
}

nlohmann::json model_of(const nn::DecoderConfig& config) { return {{"config", config.to_json()}, {"dtype", "fp32"}}; }

using Body = std::function<void(engine::ZeroEngine&, nn::DecoderModel&, partition::Communicator&)>;

// A one-rank ZeRO-3 engine holding `config`, initialised with `seed`.
void with_model(const nn::DecoderConfig& config, uint64_t seed, const Body& body) {
  test::run_zero_ranks(1, [&](int, Accelerator& accelerator, engine::ZeroComms comms) {
    engine::ZeroEngineOptions options;
    options.stage = 3;
    engine::ZeroEngine engine(accelerator, comms, options);
    nn::DecoderModel model(engine, config, {});
    engine.finalize();
    nn::initialize_parameters(engine, model.parameters(), seed, 0.2);
    body(engine, model, *comms.control);
  });
}

std::string contents(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

struct ScopedFaults {
  explicit ScopedFaults(std::vector<nvme::IoFault> faults) {
    set_file_faults(nvme::file_faults(std::make_shared<nvme::FaultPlan>(std::move(faults))));
  }
  ~ScopedFaults() { set_file_faults(nullptr); }
};

nvme::IoFault enospc_at_write(uint64_t nth) {
  return nvme::IoFault{.nth = nth, .kind = nvme::IoFault::Kind::kError, .error = ENOSPC, .op = nvme::IoOp::kWrite};
}

}  // namespace

TEST_CASE("a checkpoint of another model is refused naming the key and both values", "[checkpoint]") {
  test::TempDir dir;
  const nn::DecoderConfig four_heads = small_config(4);
  with_model(four_heads, 1, [&](engine::ZeroEngine& engine, nn::DecoderModel&, partition::Communicator&) {
    train::Checkpoints(dir.path(), 2).save(engine, {2, 10, model_of(four_heads)});
  });
  struct Case {
    std::string what;
    nn::DecoderConfig config;
    std::string expect;
  };
  nn::DecoderConfig eps = four_heads, theta = four_heads;
  eps.rms_norm_eps = 1e-6;
  theta.rope.theta = 500000;
  // Two heads of 16 have the same parameter shapes as four of 8: only the manifest can tell.
  for (const Case& c : {Case{"heads", small_config(2), "the model's num_attention_heads (config.json) is 4 in the "
                                                       "checkpoint, 2 in this run"},
                        Case{"rms_norm_eps", eps, "rms_norm_eps"}, Case{"rope_theta", theta, "rope_theta"}}) {
    CAPTURE(c.what);
    with_model(c.config, 1, [&](engine::ZeroEngine& engine, nn::DecoderModel&, partition::Communicator&) {
      train::Checkpoints checkpoints(dir.path(), 2);
      checkpoints.expect_model(model_of(c.config));
      try {
        checkpoints.find_and_load(engine);
        FAIL("a checkpoint of another model was loaded");
      } catch (const Error& e) {
        CHECK(e.category() == ErrorCategory::kBadArgument);
        CHECK_THAT(e.message(), Catch::Contains("checkpoint of another model") && Catch::Contains(c.expect));
      }
    });
  }
  // Another parameter dtype (bf16 / fp16 of the ds_config) is another model too.
  with_model(four_heads, 1, [&](engine::ZeroEngine& engine, nn::DecoderModel&, partition::Communicator&) {
    train::Checkpoints checkpoints(dir.path(), 2);
    nlohmann::json bf16 = model_of(four_heads);
    bf16["dtype"] = "bf16";
    checkpoints.expect_model(bf16);
    CHECK_THROWS_WITH(checkpoints.find_and_load(engine),
                      Catch::Contains("parameter dtype") && Catch::Contains("\"fp32\" in the checkpoint"));
    // The same model loads.
    checkpoints.expect_model(model_of(four_heads));
    const auto loaded = checkpoints.find_and_load(engine);
    REQUIRE(loaded.has_value());
    CHECK(loaded->step == 2);
    CHECK(loaded->data_cursor == 10);
  });
}

TEST_CASE("an edited manifest is detected by its checksum and the previous checkpoint used", "[checkpoint]") {
  test::TempDir dir;
  const nn::DecoderConfig config = small_config(4);
  with_model(config, 1, [&](engine::ZeroEngine& engine, nn::DecoderModel&, partition::Communicator&) {
    train::Checkpoints checkpoints(dir.path(), 2);
    checkpoints.save(engine, {2, 20, model_of(config)});
    checkpoints.save(engine, {4, 40, model_of(config)});
  });
  const fs::path manifest = dir.path() / "step_00000004" / "manifest.json";
  for (const auto& [from, to] : {std::pair<std::string, std::string>{"\"step\": 4", "\"step\": 3"},
                                 {"\"data_cursor\": 40", "\"data_cursor\": 1000000000000000"}}) {
    CAPTURE(to);
    const std::string original = contents(manifest);
    std::string edited = original;
    REQUIRE(edited.find(from) != std::string::npos);
    edited.replace(edited.find(from), from.size(), to);
    write_file_durably(manifest, edited);
    with_model(config, 1, [&](engine::ZeroEngine& engine, nn::DecoderModel&, partition::Communicator&) {
      train::Checkpoints checkpoints(dir.path(), 2);
      checkpoints.expect_model(model_of(config));
      std::vector<std::string> rejected;
      const auto loaded = checkpoints.find_and_load(engine, std::nullopt, &rejected);
      REQUIRE(loaded.has_value());
      CHECK(loaded->step == 2);
      REQUIRE(rejected.size() == 1);
      CHECK_THAT(rejected[0], Catch::Contains(manifest.string()) && Catch::Contains("manifest_crc32") &&
                                  Catch::Contains("edited or is corrupt"));
    });
    CHECK_THROWS_WITH(train::newest_checkpoint(dir.path()), Catch::Contains("edited or is corrupt"));
    write_file_durably(manifest, original);
  }
  CHECK(train::newest_checkpoint(dir.path()).state.step == 4);
}

TEST_CASE("a write that fails during a checkpoint or an export leaves the previous one intact", "[checkpoint]") {
  test::TempDir dir;
  const nn::DecoderConfig config = small_config(4);
  const fs::path ckpt = dir.path() / "ckpt", model_dir = dir.path() / "model";
  train::ExportOptions one_file;
  one_file.dtype = DType::kF32;
  train::ExportOptions sharded = one_file;
  sharded.max_shard_nbytes = 4096;
  with_model(config, 1, [&](engine::ZeroEngine& engine, nn::DecoderModel& model, partition::Communicator& comm) {
    train::Checkpoints checkpoints(ckpt, 2);
    checkpoints.save(engine, {2, 20, model_of(config)});
    train::export_hf_model(engine, comm, config, model.parameters(), model_dir, one_file);
  });
  const std::string exported = contents(model_dir / "model.safetensors");
  REQUIRE(exported.size() > 10000);
  for (const uint64_t nth : {1, 3, 7}) {
    CAPTURE(nth);
    with_model(config, 2, [&](engine::ZeroEngine& engine, nn::DecoderModel& model, partition::Communicator& comm) {
      {
        ScopedFaults faults({enospc_at_write(nth)});
        train::Checkpoints checkpoints(ckpt, 2);
        CHECK_THROWS_WITH(checkpoints.save(engine, {4, 40, model_of(config)}),
                          Catch::Contains("step_00000004") && Catch::Contains("No space left on device (errno 28)"));
      }
      {
        ScopedFaults faults({enospc_at_write(nth)});
        CHECK_THROWS_WITH(
            train::export_hf_model(engine, comm, config, model.parameters(), model_dir, sharded),
            Catch::Contains("No space left on device (errno 28)"));
      }
    });
    CHECK_FALSE(fs::exists(ckpt / "step_00000004" / "manifest.json"));
    CHECK(train::newest_checkpoint(ckpt).state.step == 2);
    // The previous export, whole and alone: no shard, no index, no staging directory.
    CHECK(contents(model_dir / "model.safetensors") == exported);
    size_t entries = 0;
    for ([[maybe_unused]] const auto& entry : fs::directory_iterator(model_dir)) ++entries;
    CHECK(entries == 2);  // config.json, model.safetensors
    size_t siblings = 0;
    for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir.path())) ++siblings;
    CHECK(siblings == 2);  // ckpt, model
  }
}

TEST_CASE("a re-export replaces the directory whole, both ways and a directory with both layouts is refused",
          "[export]") {
  test::TempDir dir;
  const nn::DecoderConfig config = small_config(4);
  const fs::path model_dir = dir.path() / "model";
  train::ExportOptions one_file;
  one_file.dtype = DType::kF32;
  train::ExportOptions sharded = one_file;
  sharded.max_shard_nbytes = 4096;
  const auto names = [&] {
    std::set<std::string> out;
    for (const auto& entry : fs::directory_iterator(model_dir)) out.insert(entry.path().filename().string());
    return out;
  };
  with_model(config, 1, [&](engine::ZeroEngine& engine, nn::DecoderModel& model, partition::Communicator& comm) {
    train::export_hf_model(engine, comm, config, model.parameters(), model_dir, one_file);
    write_file_durably(model_dir / "README.md", "mine\n");  // not the export's: carried over
    const auto shards = train::export_hf_model(engine, comm, config, model.parameters(), model_dir, sharded);
    REQUIRE(shards.files.size() > 2);
    std::set<std::string> expected = {"README.md", "config.json"};
    for (const auto& f : shards.files) expected.insert(f.filename().string());
    CHECK(names() == expected);  // no model.safetensors beside the shards
    train::export_hf_model(engine, comm, config, model.parameters(), model_dir, one_file);
    CHECK(names() == std::set<std::string>{"README.md", "config.json", "model.safetensors"});
    CHECK(contents(model_dir / "README.md") == "mine\n");
  });
  // Weights of two saves side by side (another tool wrote one of them): refused, naming both.
  const fs::path mixed = dir.path() / "mixed";
  fs::create_directories(mixed);
  fs::copy_file(model_dir / "config.json", mixed / "config.json");
  fs::copy_file(model_dir / "model.safetensors", mixed / "model.safetensors");
  write_file_durably(mixed / "model.safetensors.index.json", R"({"weight_map": {}})");
  with_model(config, 1, [&](engine::ZeroEngine& engine, nn::DecoderModel& model, partition::Communicator&) {
    CHECK_THROWS_WITH(train::load_hf_weights(engine, model.parameters(), mixed),
                      Catch::Contains((mixed / "model.safetensors").string()) &&
                          Catch::Contains((mixed / "model.safetensors.index.json").string()));
  });
}
