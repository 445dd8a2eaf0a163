// --trace end to end: `strata finetune` under `strata run -n 2` writes one
// trace per rank with I/O worker, communicator and training-loop tracks; a
// bad trace path fails before training; the C API's strata_trace_start/stop
// follow its status conventions and record the hook windows and the I/O.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "runtime/capi/strata.h"
#include "tests/runtime/trace_checks.h"
#include "tests/support/finetune_files.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using strata::test::read_trace;
using strata::test::kFinetuneExamples;
using strata::test::run_command;
using strata::test::small_model;
using strata::test::strata_binary;
using strata::test::write_file;

namespace {

std::string nvme_config(const strata::test::TempDir& dir) {
  const std::string swap = dir.file("swap");
  return write_file(dir, "ds.json", R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 3, "sub_group_size": 20000, "reduce_bucket_size": 20000,
      "offload_param": {"device": "nvme", "nvme_path": ")" + swap + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("}}})");
}

}  // namespace

TEST_CASE("strata run -n 2 -- strata finetune --trace: a Perfetto trace per rank with I/O and comm tracks",
          "[trace][finetune]") {
  strata::test::TempDir dir("trace-finetune");
  const auto run = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " +
                               nvme_config(dir) + " --init " + small_model(dir) + " --data " + kFinetuneExamples +
                               "/data/gpl-3.0.txt --data-format text --steps 2 --seq 32 --out " + dir.file("out") +
                               " --trace " + dir.file("trace.json") + " 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK_THAT(run.output, Catch::Contains("trace.rank0.json") && Catch::Contains("ui.perfetto.dev"));
  for (int rank = 0; rank < 2; ++rank) {
    INFO("rank " << rank);
    const auto t = read_trace(dir.file("trace.rank" + std::to_string(rank) + ".json"), rank);
    CHECK(t.process_name == "strata finetune rank " + std::to_string(rank));
    CHECK(t.json["otherData"]["dropped_events"] == 0);
    // The training loop's phases on its own track, one step span per step.
    const auto loop = t.tids_named("train loop");
    REQUIRE(loop.size() == 1);
    CHECK(t.of("phase", "step").size() == 2);
    CHECK(t.of("phase", "forward").size() == 4);  // 2 steps x 2 micro-batches
    CHECK(t.of("phase", "backward").size() == 4);
    CHECK(t.of("phase", "optimizer step").size() == 2);
    for (const auto& e : t.of("phase")) CHECK(loop.count(e["tid"].get<int64_t>()) == 1);
    // Parameters and optimizer state stream through NVMe: I/O worker tracks
    // with reads and writes of the swap files.
    const auto io_tracks = t.tids_named("io worker ");
    CHECK_FALSE(io_tracks.empty());
    for (const std::string op : {"read", "write"}) {
      const auto spans = t.of("io", op);
      CHECK_FALSE(spans.empty());
      for (const auto& e : spans) {
        CHECK(io_tracks.count(e["tid"].get<int64_t>()) == 1);
        CHECK(e["args"]["bytes"].get<uint64_t>() > 0);
        CHECK_THAT(e["args"]["file"].get<std::string>(), Catch::Contains(dir.file("swap")));
      }
    }
    // The three communicators' collectives, each on a track named after it.
    for (const auto& [traffic, collective] : {std::pair<std::string, std::string>{"gather", "allgather"},
                                              {"reduce", "reduce_scatter"}, {"control", "allreduce"}}) {
      INFO(traffic);
      const auto tracks = t.tids_named("comm " + traffic);
      REQUIRE(tracks.size() == 1);
      const auto spans = t.of("comm", collective);
      REQUIRE_FALSE(spans.empty());
      bool on_track = false;
      for (const auto& e : spans) {
        CHECK(e["args"]["bytes"].get<uint64_t>() > 0);
        on_track = on_track || (tracks.count(e["tid"].get<int64_t>()) == 1 &&
                                e["args"]["comm"] == "strata/finetune/" + traffic);
      }
      CHECK(on_track);
    }
  }
}

TEST_CASE("strata-train --trace: every op a span on the compute stream with its FLOPs or bytes, inside its phase",
          "[trace]") {
  strata::test::TempDir dir("trace-train");
  const std::string path = dir.file("train.json");
  const auto run = run_command(strata::test::build_dir() + "/bin/strata-train --accelerator cpu --layers 2 "
                               "--hidden 64 --heads 4 --vocab 256 --batch 2 --seq 32 --steps 1 --rounds 1 --warmup 1 "
                               "--threads 1 --trace " + path + " 2>&1");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  // The per-op table a person would otherwise build from the trace.
  CHECK_THAT(run.output, Catch::Contains("time by op") && Catch::Contains("linear_backward") &&
                             Catch::Contains("GFLOP/s") && Catch::Contains("GB/s"));
  const auto t = read_trace(path, 0);
  const auto stream = t.tids_named("compute stream");
  REQUIRE(stream.size() == 1);
  const int64_t tid = *stream.begin();
  const auto ops = t.of("op");
  REQUIRE(ops.size() > 20);
  std::set<std::string> names;
  for (const auto& op : ops) {
    CHECK(op["tid"].get<int64_t>() == tid);
    names.insert(op["name"].get<std::string>());
    const auto& args = op["args"];
    CHECK(args["shape"].is_string());
    // A matrix product says its arithmetic and rate, the rest their bytes and bandwidth.
    CHECK((args.contains("flops") ? args.contains("GFLOP/s") && args["flops"].get<int64_t>() > 0
                                  : args.contains("bytes")));
  }
  for (const std::string want : {"embedding_forward", "rmsnorm_forward", "linear_forward", "rope_forward",
                                 "attention_forward", "swiglu_forward", "add", "cross_entropy", "linear_backward",
                                 "attention_backward", "rmsnorm_backward", "embedding_backward"}) {
    CHECK(names.count(want) == 1);
  }
  const auto contains = [](const nlohmann::json& outer, const nlohmann::json& inner) {
    const double b = outer["ts"].get<double>(), e = b + outer["dur"].get<double>();
    const double ib = inner["ts"].get<double>(), ie = ib + inner["dur"].get<double>();
    return b <= ib && ie <= e;
  };
  // Two steps (warmup and the timed one), each phase on the stream's track,
  // enclosing every op of that step's phase (the cross-entropy, with its
  // fused gradient, is the last op of forward).
  for (const std::string phase : {"forward", "backward"}) {
    INFO(phase);
    const auto spans = t.of("phase", phase);
    REQUIRE(spans.size() == 2);
    for (const auto& span : spans) CHECK(span["tid"].get<int64_t>() == tid);
  }
  int enclosed = 0;
  for (const auto& op : ops) {
    const std::string name = op["name"];
    const bool backward = name.find("backward") != std::string::npos;
    bool inside = false;
    for (const auto& span : t.of("phase", backward ? "backward" : "forward")) inside = inside || contains(span, op);
    enclosed += inside;
    if (name != "count_targets" && name != "add") CHECK(inside);  // adds run in both phases
  }
  CHECK(enclosed == static_cast<int>(ops.size()));
}

TEST_CASE("strata finetune --trace: an unwritable path fails before training, naming it", "[trace][finetune]") {
  strata::test::TempDir dir("trace-finetune");
  const std::string bad = dir.file("missing/dir/t-{rank}.json");
  const auto run = run_command(strata_binary() + " finetune --init " + small_model(dir) + " --data " + kFinetuneExamples +
                               "/data/gpl-3.0.txt --data-format text --steps 1 --seq 32 --out " + dir.file("out") +
                               " --trace " + bad + " 2>&1");
  INFO(run.output);
  CHECK(run.exit_code != 0);
  CHECK_THAT(run.output, Catch::Contains(dir.file("missing/dir/t-0.json")) &&
                             Catch::Contains("No such file or directory"));
  CHECK_FALSE(std::filesystem::exists(dir.file("out/metrics.jsonl")));  // no step was taken
}

TEST_CASE("C API: strata_trace_start/stop record the hook windows and the NVMe traffic", "[trace][capi]") {
  strata::test::TempDir dir("trace-capi");
  // Argument and order errors: statuses, with strata_last_error naming the function.
  CHECK(strata_trace_start(nullptr) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(strata_last_error(), Catch::Contains("strata_trace_start: path is NULL"));
  CHECK(strata_trace_start("") == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(strata_trace_stop() == STRATA_ERROR_INVALID_STATE);
  CHECK_THAT(strata_last_error(), Catch::Contains("strata_trace_stop: no trace is being recorded"));
  const std::string bad = dir.file("missing/t.json");
  CHECK(strata_trace_start(bad.c_str()) == STRATA_ERROR_IO);
  CHECK_THAT(strata_last_error(), Catch::Contains(bad) && Catch::Contains("No such file or directory"));

  const std::string path = dir.file("capi.json");
  REQUIRE(strata_trace_start(path.c_str()) == STRATA_OK);
  CHECK(strata_trace_start(path.c_str()) == STRATA_ERROR_INVALID_STATE);

  const std::string config = R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": ")" + dir.file("swap") + R"("},
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.file("swap") + R"("}},
    "strata": {"accelerator": "cpu"}})";
  strata_engine* e = nullptr;
  REQUIRE(strata_engine_create(config.c_str(), &e) == STRATA_OK);
  const int64_t shape[] = {64, 64};
  int32_t w = -1, op = -1;
  REQUIRE(strata_register_param(e, "fc.weight", STRATA_DTYPE_F32, 2, shape, nullptr, nullptr, nullptr, &w) ==
          STRATA_OK);
  REQUIRE(strata_register_op(e, "fc", 1, &w, &op) == STRATA_OK);
  REQUIRE(strata_finalize(e) == STRATA_OK);
  std::vector<float> grad(64 * 64, 0.01f);
  for (int step = 0; step < 2; ++step) {
    REQUIRE(strata_fetch(e, op, STRATA_PHASE_FORWARD) == STRATA_OK);
    REQUIRE(strata_release(e, op, STRATA_PHASE_FORWARD) == STRATA_OK);
    REQUIRE(strata_fetch(e, op, STRATA_PHASE_BACKWARD) == STRATA_OK);
    REQUIRE(strata_add_grad(e, w, grad.data()) == STRATA_OK);
    REQUIRE(strata_release(e, op, STRATA_PHASE_BACKWARD) == STRATA_OK);
    REQUIRE(strata_step(e, 1e-3f, nullptr) == STRATA_OK);
  }
  REQUIRE(strata_engine_destroy(e) == STRATA_OK);
  REQUIRE(strata_trace_stop() == STRATA_OK);
  CHECK(strata_trace_stop() == STRATA_ERROR_INVALID_STATE);

  const auto t = read_trace(path, 0);
  const auto fetches = t.of("capi", "strata_fetch");
  REQUIRE(fetches.size() == 4);
  CHECK(fetches[0]["args"]["op"] == "fc");
  CHECK(t.of("capi", "strata_release").size() == 4);
  CHECK(t.of("capi", "strata_step").size() == 2);
  CHECK(t.tids_named("caller").count(fetches[0]["tid"].get<int64_t>()) == 1);
  CHECK_FALSE(t.of("io").empty());
  CHECK_FALSE(t.tids_named("io worker ").empty());
}
