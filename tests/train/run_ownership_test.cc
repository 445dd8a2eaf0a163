// A run owns its files, tested as a user runs strata: real `strata run -n 2 --
// strata finetune` processes. A second run given the same nvme_path or --save
// is refused naming the first, whose losses do not change; a lock left by a
// killed run is taken over; a missing nvme_path is created only under an
// existing parent; Ctrl-C and SIGTERM remove the swap files (unless
// strata.keep_swap_files), keep the checkpoints and exit 130 / 143; --steps at
// or below a checkpoint's step is an error; the documented keys
// steps_per_print, strata.trace_path and strata.pinned_pool_size do what
// docs/config.md says.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support/finetune_files.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"

using strata::test::kFinetuneExamples;
using strata::test::run_command;
using strata::test::run_with_limit;
using strata::test::small_model;
using strata::test::strata_binary;
using strata::test::write_file;
namespace fs = std::filesystem;

namespace {

std::vector<double> losses_of(const std::string& metrics) {
  std::ifstream in(metrics);
  std::vector<double> losses;
  for (std::string line; std::getline(in, line);) losses.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return losses;
}

// A ds_config: ZeRO-3, parameters and optimizer state on NVMe under `swap`
// (empty: in memory), with `extra` keys spliced into "strata".
std::string ds_config(const strata::test::TempDir& dir, const std::string& name, const std::string& swap,
                      const std::string& strata_keys = "") {
  const std::string offload =
      swap.empty() ? ""
                   : R"(, "offload_param": {"device": "nvme", "nvme_path": ")" + swap +
                         R"("}, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + R"("})";
  return write_file(dir, name, R"({"train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 3, "sub_group_size": 20000)" + offload + R"(},
    "strata": {"log_level": "info")" + (strata_keys.empty() ? "" : ", " + strata_keys) + "}}");
}

std::string finetune(const strata::test::TempDir& dir, const std::string& config, int steps, const std::string& out,
                     const std::string& extra = "") {
  return strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config + " --init " +
         dir.file("small.json") + " --data " + kFinetuneExamples + "/data/gpl-3.0.txt --data-format text --seq 32 " +
         "--steps " + std::to_string(steps) + " --out " + dir.file(out) + " " + extra;
}

size_t swap_files_under(const fs::path& root) {
  size_t n = 0;
  std::error_code ec;
  if (!fs::exists(root)) return 0;
  for (const auto& entry : fs::recursive_directory_iterator(root, ec)) n += entry.path().extension() == ".swp";
  return n;
}

// Runs `first` in the background, waits until it holds `lock`, runs `second`
// in the foreground; "SECOND=rc" and "FIRST=rc" end the output.
strata::test::CommandResult run_two(const strata::test::TempDir& dir, const std::string& first,
                                    const std::string& second, const std::string& lock) {
  const std::string script = write_file(dir, "two.sh", "#!/usr/bin/env bash\nset -u\n(" + first + " > " +
                                                           dir.file("first.log") + " 2>&1; echo $? > " +
                                                           dir.file("first.rc") + ") &\n"
                                                           "for i in $(seq 500); do [ -e " + lock +
                                                           " ] && break; sleep 0.01; done\n" + second +
                                                           " 2>&1; echo SECOND=$?\nwait\necho FIRST=$(cat " +
                                                           dir.file("first.rc") + ")\ncat " + dir.file("first.log") +
                                                           "\n");
  return run_with_limit("bash " + script, 120);
}

}  // namespace

TEST_CASE("two runs on one nvme_path or one --save: the second is refused naming the first, which runs on unchanged",
          "[finetune][ownership]") {
  strata::test::TempDir dir;
  small_model(dir);
  const std::string swap = dir.file("swap");
  const std::string nvme = ds_config(dir, "nvme.json", swap);
  const auto reference = run_command(finetune(dir, nvme, 12, "ref") + " 2>&1");
  INFO(reference.output);
  REQUIRE(reference.exit_code == 0);
  const std::vector<double> expected = losses_of(dir.file("ref/metrics.jsonl"));
  REQUIRE(expected.size() == 12);
  CHECK(swap_files_under(swap) == 0);
  CHECK_FALSE(fs::exists(swap + "/strata-rank0.lock"));  // released cleanly: removed

  // One nvme_path.
  {
    const auto r = run_two(dir, finetune(dir, nvme, 12, "first"), finetune(dir, nvme, 12, "second"),
                           swap + "/strata-rank0.lock");
    INFO(r.output);
    CHECK_THAT(r.output, Catch::Contains("SECOND=1") && Catch::Contains("FIRST=0"));
    CHECK_THAT(r.output, Catch::Contains("nvme_path " + swap + " is in use by another run") &&
                             Catch::Contains("strata finetune"));
    CHECK(losses_of(dir.file("first/metrics.jsonl")) == expected);
    CHECK_FALSE(fs::exists(dir.file("second/metrics.jsonl")));
  }
  // One --save.
  {
    const std::string save = "--save " + dir.file("ckpt") + " --save-every 5";
    const std::string other_swap = ds_config(dir, "nvme2.json", dir.file("swap2"));  // only --save is shared
    const auto r = run_two(dir, finetune(dir, nvme, 12, "first2", save), finetune(dir, other_swap, 12, "second2", save),
                           dir.file("ckpt") + "/strata-rank0.lock");
    INFO(r.output);
    CHECK_THAT(r.output, Catch::Contains("SECOND=1") && Catch::Contains("FIRST=0"));
    CHECK_THAT(r.output, Catch::Contains("--save " + dir.file("ckpt") + " is in use by another run"));
    CHECK(losses_of(dir.file("first2/metrics.jsonl")) == expected);
    CHECK(fs::exists(dir.file("ckpt") + "/step_00000012/manifest.json"));
  }
}

TEST_CASE("a lock left by a killed run is taken over with a notice and a missing nvme_path needs its parent",
          "[finetune][ownership]") {
  strata::test::TempDir dir;
  small_model(dir);
  const std::string swap = dir.file("swap");
  fs::create_directories(swap);
  // What a run killed with SIGKILL leaves: its lock files, no longer locked.
  for (const char* rank : {"0", "1"}) {
    write_file(dir, std::string("swap/strata-rank") + rank + ".lock",
               R"J({"pid": 999999, "host": "gone", "started": "earlier", "command": "strata finetune (killed)"})J");
  }
  const auto taken = run_command(finetune(dir, ds_config(dir, "nvme.json", swap), 3, "out") + " 2>&1");
  INFO(taken.output);
  REQUIRE(taken.exit_code == 0);
  CHECK_THAT(taken.output, Catch::Contains("taking over the lock") && Catch::Contains("pid 999999 on host gone"));
  CHECK_FALSE(fs::exists(swap + "/strata-rank0.lock"));

  const std::string typo = dir.file("no-such-dir") + "/swap";
  const auto refused = run_command(finetune(dir, ds_config(dir, "typo.json", typo), 3, "typo") + " 2>&1");
  INFO(refused.output);
  CHECK(refused.exit_code == 1);
  CHECK_THAT(refused.output, Catch::Contains("nvme_path " + typo + " does not exist, and neither does its parent"));
  CHECK_FALSE(fs::exists(dir.file("no-such-dir")));
  const std::string fresh = dir.file("fresh");
  const auto created = run_command(finetune(dir, ds_config(dir, "fresh.json", fresh), 2, "fresh") + " 2>&1");
  INFO(created.output);
  CHECK(created.exit_code == 0);
  CHECK_THAT(created.output, Catch::Contains("created nvme_path " + fresh));
}

TEST_CASE("Ctrl-C and SIGTERM remove the swap files, keep the checkpoints and exit 130 / 143", "[finetune][signals]") {
  strata::test::TempDir dir;
  small_model(dir);
  struct Case {
    const char* signal;
    int code;
    bool keep;
  };
  for (const Case c : {Case{"TERM", 143, false}, Case{"INT", 130, false}, Case{"INT", 130, true}}) {
    CAPTURE(c.signal, c.keep);
    const std::string name = std::string(c.signal) + (c.keep ? "_keep" : "");
    const std::string swap = dir.file(name + "_swap"), ckpt = dir.file(name + "_ckpt");
    const std::string config =
        ds_config(dir, name + ".json", swap, c.keep ? R"("keep_swap_files": true)" : "");
    // Interrupted once a checkpoint exists, in the middle of the run.
    const std::string script = write_file(
        dir, name + ".sh",
        "#!/usr/bin/env bash\nset -u\n" + finetune(dir, config, 100000, name + "_out", "--save " + ckpt +
                                                                               " --save-every 2") +
            " > " + dir.file(name + ".log") + " 2>&1 &\npid=$!\n"
            "for i in $(seq 1500); do ls " + ckpt + "/step_*/manifest.json >/dev/null 2>&1 && break; sleep 0.02; done\n"
            "kill -" + c.signal + " $pid\nwait $pid\necho EXIT=$?\ncat " + dir.file(name + ".log") + "\n");
    const auto r = run_with_limit("bash " + script, 120);
    INFO(r.output);
    CHECK_THAT(r.output, Catch::Contains("EXIT=" + std::to_string(c.code)));
    CHECK_THAT(r.output, Catch::Contains(std::string("stopped by SIG") + c.signal));
    if (c.keep) {
      CHECK(swap_files_under(swap) > 0);
    } else {
      CHECK(swap_files_under(swap) == 0);
    }
    CHECK_FALSE(fs::exists(swap + "/strata-rank0.lock"));
    bool checkpoint = false;
    for (const auto& entry : fs::directory_iterator(ckpt)) checkpoint |= fs::exists(entry.path() / "manifest.json");
    CHECK(checkpoint);
  }
  // keep_swap_files also keeps them after a clean end.
  const std::string swap = dir.file("clean_swap");
  const auto clean =
      run_command(finetune(dir, ds_config(dir, "clean.json", swap, R"("keep_swap_files": true)"), 2, "clean") + " 2>&1");
  INFO(clean.output);
  REQUIRE(clean.exit_code == 0);
  CHECK(swap_files_under(swap) > 0);
}

TEST_CASE("finetune: --steps below the checkpoint's step is an error, at it finishes the run, and flags take whole "
          "numbers in range",
          "[finetune][checkpoint]") {
  strata::test::TempDir dir;
  small_model(dir);
  const std::string config = ds_config(dir, "memory.json", "");
  const std::string save = "--save " + dir.file("ckpt") + " --save-every 2 --export-dtype fp32 --export ";
  REQUIRE(run_command(finetune(dir, config, 4, "out", save + dir.file("first")) + " 2>&1").exit_code == 0);
  {
    const auto r = run_command(finetune(dir, config, 3, "again", save + dir.file("x") + " --resume") + " 2>&1");
    INFO(r.output);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.output, Catch::Contains("--steps 3: the checkpoint in " + dir.file("ckpt") +
                                         " is at step 4 already, past the last step asked for"));
  }
  // At the checkpoint's step (a run killed after its last checkpoint, during
  // the export): the same command finishes it, so restarting until it
  // succeeds ends, with the model the uninterrupted run exported.
  const auto finished = run_command(finetune(dir, config, 4, "again", save + dir.file("second") + " --resume") + " 2>&1");
  INFO(finished.output);
  CHECK(finished.exit_code == 0);
  CHECK_THAT(finished.output, Catch::Contains("training is complete; exporting it"));
  const auto bytes = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  CHECK(bytes(dir.file("second") + "/model.safetensors") == bytes(dir.file("first") + "/model.safetensors"));
  struct Case {
    std::string flag, expect;
  };
  for (const Case& c : {Case{"--steps 0", "--steps: must be a whole number >= 1, got \"0\""},
                        Case{"--steps 1.5", "--steps: must be a whole number >= 1, got \"1.5\""},
                        Case{"--seed -1", "--seed: must be a whole number from 0 to 18446744073709551615"},
                        Case{"--seed 1e23", "got \"1e23\""}}) {
    CAPTURE(c.flag);
    const auto r = run_command(strata_binary() + " finetune --init " + dir.file("small.json") + " --data " +
                               kFinetuneExamples + "/data/gpl-3.0.txt --data-format text " + c.flag + " 2>&1");
    CHECK(r.exit_code != 0);
    CHECK(r.exit_code < 128);
    CHECK_THAT(r.output, Catch::Contains(c.expect));
    CHECK_THAT(r.output, !Catch::Contains("179769"));  // not a 300-digit range
  }
}

TEST_CASE("steps_per_print, strata.trace_path and strata.pinned_pool_size do what docs/config.md says",
          "[finetune][config]") {
  strata::test::TempDir dir;
  small_model(dir);
  const std::string trace = dir.file("run.json");
  const auto r = run_command(strata_binary() + " finetune --config " +
                             write_file(dir, "print.json", R"({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 3,
    "zero_optimization": {"stage": 3}, "strata": {"trace_path": ")" + trace + R"("}})") +
                             " --init " + dir.file("small.json") + " --data " + kFinetuneExamples +
                             "/data/gpl-3.0.txt --data-format text --seq 32 --steps 7 --out " + dir.file("out") +
                             " 2>&1");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  // Steps 1 (the first), 3, 6 and 7 (the last).
  for (const char* step : {"step 1/7", "step 3/7", "step 6/7", "step 7/7"}) CHECK_THAT(r.output, Catch::Contains(step));
  for (const char* step : {"step 2/7", "step 4/7", "step 5/7"}) CHECK_THAT(r.output, !Catch::Contains(step));
  CHECK(fs::file_size(trace) > 100);
  CHECK_THAT(r.output, Catch::Contains(trace));

  const auto unwritable = run_command(strata_binary() + " finetune --config " +
                                      write_file(dir, "trace.json", R"({"zero_optimization": {"stage": 3},
    "strata": {"trace_path": "/proc/no-such-dir/run.json"}})") +
                                      " --init " + dir.file("small.json") + " --data " + kFinetuneExamples +
                                      "/data/gpl-3.0.txt --data-format text --seq 32 --steps 2 --out " +
                                      dir.file("out2") + " 2>&1");
  INFO(unwritable.output);
  CHECK(unwritable.exit_code == 1);
  CHECK_THAT(unwritable.output, Catch::Contains("/proc/no-such-dir/run.json"));

  const auto pinned = run_command(finetune(dir, ds_config(dir, "pinned.json", dir.file("swap"),
                                                          R"("pinned_pool_size": 4096)"),
                                           2, "pinned") +
                                  " 2>&1");
  INFO(pinned.output);
  CHECK(pinned.exit_code == 1);
  CHECK_THAT(pinned.output, Catch::Contains("strata.pinned_pool_size is 4096 bytes, but this run pins") &&
                                Catch::Contains("optimizer pipeline buffers"));
  const auto roomy = run_command(finetune(dir, ds_config(dir, "roomy.json", dir.file("swap2"),
                                                         R"("pinned_pool_size": "1GiB")"),
                                          2, "roomy") +
                                 " 2>&1");
  INFO(roomy.output);
  CHECK(roomy.exit_code == 0);
}

TEST_CASE("a token outside the vocabulary is found before step 1 and the launcher names the rank that read it",
          "[finetune][messages]") {
  strata::test::TempDir dir;
  // A u16 token file of 4000 tokens below 256 but one 300 at position 1000
  // (rank 0's half), for the byte-level model of vocab 256.
  std::vector<uint16_t> tokens(4000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i * 7 % 256);
  tokens[1000] = 300;
  const std::string data = dir.file("tokens.bin");
  {
    std::ofstream out(data, std::ios::binary);
    out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
  }
  const auto r = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --init " +
                             small_model(dir) + " --data " + data + " --data-format u16 --seq 32 --steps 3 --out " +
                             dir.file("out") + " 2>&1");
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.output, Catch::Contains("token 300 at position 1000 is outside the model's vocabulary [0, 256)") &&
                           Catch::Contains("before step 1"));
  CHECK_THAT(r.output, Catch::Contains("strata run: failed: rank 0"));
  CHECK_FALSE(fs::exists(dir.file("out/metrics.jsonl")));
}

TEST_CASE("an allocation too large for the machine names the keys that size it", "[finetune][messages]") {
  strata::test::TempDir dir;
  const std::string huge_vocab = write_file(dir, "huge.json", R"({"vocab_size": 1000000000000, "hidden_size": 64,
    "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5})");
  const std::string text = " --data " + kFinetuneExamples + "/data/gpl-3.0.txt --data-format text --seq 32 --steps 2";
  const auto vocab = run_command(strata_binary() + " finetune --init " + huge_vocab + text + " --out " +
                                 dir.file("a") + " 2>&1");
  INFO(vocab.output);
  CHECK(vocab.exit_code == 1);
  CHECK_THAT(vocab.output, Catch::Contains("out of memory") && Catch::Contains("vocab_size 1000000000000"));
  const std::string buffers = write_file(dir, "buffers.json", R"({"zero_optimization": {"stage": 3,
    "offload_param": {"device": "nvme", "nvme_path": ")" + dir.file("swap") + R"("},
    "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.file("swap") + R"(", "buffer_count": 1048576}}})");
  const auto buffer = run_command(strata_binary() + " finetune --config " + buffers + " --init " + small_model(dir) +
                                  text + " --out " + dir.file("b") + " 2>&1");
  INFO(buffer.output);
  CHECK(buffer.exit_code == 1);
  CHECK_THAT(buffer.output, Catch::Contains("out of memory") &&
                                Catch::Contains("offload_optimizer.buffer_count 1048576"));
}
