// DeepSpeed's monitors, as finetune's rank 0 writes them each step
// (ds_config csv_monitor / tensorboard, runtime/config/config.h):
//   csv_monitor: OUTPUT/JOB/<name with / as _>.csv, a "step,<name>" header
//     then one "step,value" line per step, appended to (DeepSpeed's csvMonitor
//     layout; a resumed run continues the files).
//   tensorboard: OUTPUT/JOB/events.out.tfevents.<time>.<host>, TensorFlow's
//     event file: TFRecord framing (length, masked CRC-32C of it, the bytes,
//     their masked CRC-32C) around Event protos encoded by protobuf from the
//     event schema (runtime/train/tensorboard/event.proto); the first event
//     names the file version, then one scalar summary per value and step.
// The values: train/loss, train/lr, train/grad_norm, train/tokens_per_second
// and, after an evaluation, eval/loss.
//
// Ownership: owns its files. Thread-safety: one thread. Errors: Error(kIo)
// naming the file.
#pragma once

#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

#include "runtime/config/config.h"

namespace strata::train {

class CsvMonitor {
 public:
  // `dir`: output_path/job_name (created).
  explicit CsvMonitor(std::filesystem::path dir);
  ~CsvMonitor();
  CsvMonitor(const CsvMonitor&) = delete;
  CsvMonitor& operator=(const CsvMonitor&) = delete;
  void write(const std::string& name, int64_t step, double value);
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  std::map<std::string, std::FILE*> files_;
};

class TensorBoardMonitor {
 public:
  // `dir`: output_path/job_name (created). Error(kBadArgument) when this
  // strata was built without protobuf.
  explicit TensorBoardMonitor(std::filesystem::path dir);
  ~TensorBoardMonitor();
  TensorBoardMonitor(const TensorBoardMonitor&) = delete;
  TensorBoardMonitor& operator=(const TensorBoardMonitor&) = delete;
  void write(const std::string& name, int64_t step, double value);
  const std::filesystem::path& path() const { return path_; }

 private:
  void append(const std::string& event);  // one record
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

// Whether this strata writes TensorBoard files (built with protobuf).
bool tensorboard_available();

// The monitor directory of a section: output_path (else `fallback`) / job_name.
std::filesystem::path monitor_dir(const MonitorConfig& monitor, const std::filesystem::path& fallback);

}  // namespace strata::train
