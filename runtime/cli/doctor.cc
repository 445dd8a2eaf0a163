// `strata doctor`: what this machine offers for offloaded training — CPU ISA,
// memory and lock limits, huge pages, CUDA devices and library versions,
// io_uring, and for one directory: filesystem, free space and O_DIRECT.
#include <fcntl.h>
#include <liburing.h>
#include <sys/resource.h>
#include <sys/statfs.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "runtime/cli/commands.h"
#include "core/accelerator.h"
#include "core/cpu_features.h"
#include "core/host_memory.h"

namespace strata::cli {
namespace {

using nlohmann::json;

// Values from /proc/meminfo in bytes (the file states kB).
std::map<std::string, uint64_t> read_meminfo() {
  std::map<std::string, uint64_t> values;
  std::ifstream file("/proc/meminfo");
  std::string key;
  uint64_t value = 0;
  std::string unit;
  while (file >> key >> value) {
    std::getline(file, unit);
    key.pop_back();  // trailing ':'
    values[key] = unit.find("kB") != std::string::npos ? value * 1024 : value;
  }
  return values;
}

std::string read_first_line(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return line;
}

std::string filesystem_name(long type) {
  switch (static_cast<unsigned long>(type)) {
    case 0xEF53: return "ext4";
    case 0x58465342: return "xfs";
    case 0x01021994: return "tmpfs";
    case 0x9123683E: return "btrfs";
    case 0x794c7630: return "overlayfs";
    case 0x6969: return "nfs";
    case 0x2fc12fc1: return "zfs";
    case 0xF2F52010: return "f2fs";
    case 0xFF534D42: return "cifs";
    default: return fmt::format("unknown (0x{:x})", static_cast<unsigned long>(type));
  }
}

std::string human_bytes(double nbytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (nbytes >= 1024 && unit < 4) nbytes /= 1024, ++unit;
  return fmt::format("{:.1f} {}", nbytes, units[unit]);
}

std::string version_string(int encoded, int major_div, int minor_div, int minor_mod) {
  if (encoded <= 0) return "unknown";
  return fmt::format("{}.{}", encoded / major_div, (encoded / minor_div) % minor_mod);
}

// Creates a scratch file in dir and tries an aligned O_DIRECT write and read.
json probe_directory(const std::string& dir) {
  json out;
  out["path"] = dir;
  struct statfs fs {};
  if (statfs(dir.c_str(), &fs) != 0) {
    out["error"] = fmt::format("statfs {}: {}", dir, std::strerror(errno));
    return out;
  }
  out["filesystem"] = filesystem_name(fs.f_type);
  out["free_bytes"] = static_cast<uint64_t>(fs.f_bavail) * fs.f_bsize;
  out["total_bytes"] = static_cast<uint64_t>(fs.f_blocks) * fs.f_bsize;
  std::string path = (std::filesystem::path(dir) / "strata-doctor-XXXXXX").string();
  const int plain_fd = mkstemp(path.data());
  if (plain_fd < 0) {
    out["o_direct"] = false;
    out["o_direct_detail"] = fmt::format("cannot create a file in {}: {}", dir, std::strerror(errno));
    return out;
  }
  close(plain_fd);
  const int fd = open(path.c_str(), O_RDWR | O_DIRECT);
  if (fd < 0) {
    out["o_direct"] = false;
    out["o_direct_detail"] = fmt::format("open with O_DIRECT: {}", std::strerror(errno));
  } else {
    void* block = allocate_locked_host(4096);
    std::memset(block, 0x5a, 4096);
    const bool ok = pwrite(fd, block, 4096, 0) == 4096 && pread(fd, block, 4096, 0) == 4096;
    out["o_direct"] = ok;
    out["o_direct_detail"] = ok ? "4 KiB aligned write and read succeeded"
                                : fmt::format("aligned I/O failed: {}", std::strerror(errno));
    free_locked_host(block, 4096);
    close(fd);
  }
  unlink(path.c_str());
  return out;
}

json probe_io_uring() {
  json out;
  io_uring ring{};
  const int rc = io_uring_queue_init(8, &ring, 0);
  out["supported"] = rc == 0;
  if (rc == 0) {
    io_uring_probe* probe = io_uring_get_probe_ring(&ring);
    if (probe) {
      out["read_write_fixed"] = io_uring_opcode_supported(probe, IORING_OP_READ_FIXED) != 0;
      io_uring_free_probe(probe);
    }
    io_uring_queue_exit(&ring);
  } else {
    out["detail"] = fmt::format("io_uring_queue_init: {}", std::strerror(-rc));
  }
  utsname uts{};
  uname(&uts);
  out["kernel"] = uts.release;
  return out;
}

json collect(const std::string& dir) {
  json report;
  const CpuFeatures& cpu = cpu_features();
  report["cpu"] = {{"model", cpu.model},
                   {"logical_cores", cpu.logical_cores},
                   {"avx2", cpu.avx2},
                   {"avx512", cpu.avx512f},
                   {"avx512_bf16", cpu.avx512_bf16},
                   {"f16c", cpu.f16c}};
  auto meminfo = read_meminfo();
  const size_t memlock = memlock_limit_nbytes();
  report["memory"] = {
      {"total_bytes", meminfo["MemTotal"]},
      {"available_bytes", meminfo["MemAvailable"]},
      {"memlock_limit_bytes", memlock == SIZE_MAX ? json("unlimited") : json(memlock)},
      {"hugepages_total", meminfo["HugePages_Total"]},
      {"hugepages_free", meminfo["HugePages_Free"]},
      {"hugepage_bytes", meminfo["Hugepagesize"]},
      {"transparent_hugepages", read_first_line("/sys/kernel/mm/transparent_hugepage/enabled")}};
  const CudaInfo cuda = cuda_info();
  json devices = json::array();
  for (const auto& d : cuda.devices) {
    devices.push_back({{"index", d.index},
                       {"name", d.name},
                       {"compute_capability", fmt::format("{}.{}", d.compute_major, d.compute_minor)},
                       {"total_bytes", d.total_nbytes},
                       {"free_bytes", d.free_nbytes},
                       {"pci_bus_id", d.pci_bus_id}});
  }
  report["cuda"] = {{"built", cuda.built},
                    {"driver", version_string(cuda.driver_version, 1000, 10, 100)},
                    {"runtime", version_string(cuda.runtime_version, 1000, 10, 100)},
                    {"cublas", version_string(cuda.cublas_version, 10000, 100, 100)},
                    {"nccl", version_string(cuda.nccl_version, 10000, 100, 100)},
                    {"devices", devices}};
  if (!cuda.error.empty()) report["cuda"]["detail"] = cuda.error;
  report["io_uring"] = probe_io_uring();
  report["directory"] = probe_directory(dir);
  return report;
}

std::string yes_no(const json& value) { return value.is_boolean() && value.get<bool>() ? "yes" : "no"; }

void print_report(const json& r) {
  const json& cpu = r["cpu"];
  std::cout << "CPU\n"
            << fmt::format("  model            {}\n", cpu["model"].get<std::string>())
            << fmt::format("  logical cores    {}\n", cpu["logical_cores"].get<int>())
            << fmt::format("  ISA              AVX2 {}, AVX-512 {}, AVX-512 BF16 {}, F16C {}\n",
                           yes_no(cpu["avx2"]), yes_no(cpu["avx512"]), yes_no(cpu["avx512_bf16"]),
                           yes_no(cpu["f16c"]));
  const json& mem = r["memory"];
  std::cout << "Memory\n"
            << fmt::format("  total            {}\n", human_bytes(mem["total_bytes"].get<double>()))
            << fmt::format("  available        {}\n", human_bytes(mem["available_bytes"].get<double>()))
            << fmt::format("  RLIMIT_MEMLOCK   {}\n",
                           mem["memlock_limit_bytes"].is_string()
                               ? std::string("unlimited")
                               : human_bytes(mem["memlock_limit_bytes"].get<double>()))
            << fmt::format("  huge pages       {} total, {} free, {} each; THP: {}\n",
                           mem["hugepages_total"].get<uint64_t>(), mem["hugepages_free"].get<uint64_t>(),
                           human_bytes(mem["hugepage_bytes"].get<double>()),
                           mem["transparent_hugepages"].get<std::string>());
  const json& cuda = r["cuda"];
  std::cout << "CUDA\n";
  if (!cuda["built"].get<bool>()) {
    std::cout << "  backend          not built (configure with -DSTRATA_CUDA=ON)\n";
  } else {
    std::cout << fmt::format("  driver {}, runtime {}, cuBLAS {}, NCCL {}\n",
                             cuda["driver"].get<std::string>(), cuda["runtime"].get<std::string>(),
                             cuda["cublas"].get<std::string>(), cuda["nccl"].get<std::string>());
  }
  if (cuda["devices"].empty()) {
    std::cout << "  devices          no GPU"
              << (cuda.contains("detail") ? fmt::format(" ({})", cuda["detail"].get<std::string>()) : "")
              << "\n";
  }
  for (const auto& d : cuda["devices"]) {
    std::cout << fmt::format("  cuda:{}           {} (sm {}), {} total, {} free, PCI {}\n",
                             d["index"].get<int>(), d["name"].get<std::string>(),
                             d["compute_capability"].get<std::string>(),
                             human_bytes(d["total_bytes"].get<double>()),
                             human_bytes(d["free_bytes"].get<double>()), d["pci_bus_id"].get<std::string>());
  }
  const json& uring = r["io_uring"];
  std::cout << "io_uring\n"
            << fmt::format("  supported        {} (kernel {}){}\n", yes_no(uring["supported"]),
                           uring["kernel"].get<std::string>(),
                           uring.contains("detail") ? " — " + uring["detail"].get<std::string>() : "");
  const json& dir = r["directory"];
  std::cout << fmt::format("Directory {}\n", dir["path"].get<std::string>());
  if (dir.contains("error")) {
    std::cout << "  " << dir["error"].get<std::string>() << "\n";
    return;
  }
  std::cout << fmt::format("  filesystem       {}\n", dir["filesystem"].get<std::string>())
            << fmt::format("  free space       {} of {}\n", human_bytes(dir["free_bytes"].get<double>()),
                           human_bytes(dir["total_bytes"].get<double>()))
            << fmt::format("  O_DIRECT         {} ({})\n", yes_no(dir["o_direct"]),
                           dir["o_direct_detail"].get<std::string>());
}

}  // namespace

void add_doctor_command(CLI::App& app) {
  struct Options {
    std::string dir = std::filesystem::temp_directory_path().string();
    bool json = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* doctor = app.add_subcommand(
      "doctor", "Report what this machine offers for offloaded training: CPU ISA, memory and "
                "lock limits, huge pages, GPUs, NCCL/cuBLAS, io_uring, and a directory's "
                "filesystem, free space and O_DIRECT support");
  doctor->add_option("--dir", options->dir, "Directory to probe for NVMe offload (swap files go here)")
      ->capture_default_str()
      ->check(CLI::ExistingDirectory);
  doctor->add_flag("--json", options->json, "Print the report as JSON");
  on_selected(doctor, [options] {
    const json report = collect(options->dir);
    if (options->json) {
      std::cout << report.dump(2) << "\n";
    } else {
      print_report(report);
    }
    return 0;
  });
}

}  // namespace strata::cli
