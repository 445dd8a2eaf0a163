// `strata data prepare`: JSONL -> prepared data, by the Python tool
// python/strata_data/prepare.py (Hugging Face `tokenizers` and Jinja2, the
// ecosystem's own tokenizer and chat-template code; it makes its virtual
// environment when the Python it runs on lacks them). This command finds the
// tool (installed beside the Python binding, or in the source tree this
// binary was built from) and runs it with the same arguments.
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/cli/commands.h"

#ifndef STRATA_SOURCE_PYTHON_DIR
#define STRATA_SOURCE_PYTHON_DIR ""
#endif
#ifndef STRATA_INSTALL_LIBDIR
#define STRATA_INSTALL_LIBDIR "lib"
#endif

namespace strata::cli {
namespace {

std::filesystem::path find_prepare_tool() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::vector<std::filesystem::path> candidates;
  if (!ec) {
    candidates.push_back(exe.parent_path().parent_path() / STRATA_INSTALL_LIBDIR / "strata" / "python");
  }
  if (std::string(STRATA_SOURCE_PYTHON_DIR).size() > 0) candidates.emplace_back(STRATA_SOURCE_PYTHON_DIR);
  for (const auto& dir : candidates) {
    const std::filesystem::path tool = dir / "strata_data" / "prepare.py";
    if (std::filesystem::is_regular_file(tool, ec)) return tool;
  }
  raise(ErrorCategory::kBadArgument,
        "strata data prepare: its Python tool (strata_data/prepare.py) is not installed beside this strata");
}

}  // namespace

void add_data_command(CLI::App& app) {
  CLI::App* data = app.add_subcommand("data", "Prepare fine-tuning data");
  data->require_subcommand(1);
  CLI::App* prepare = data->add_subcommand(
      "prepare",
      "Tokenize JSONL as people fine-tune on into strata's prepared-data file (tokens, a loss-mask bit per token, "
      "document boundaries; docs/DESIGN.md) with the model's own tokenizer.json and chat template (Hugging Face "
      "tokenizers and Jinja2, installed into a virtual environment the first time: --venv DIR, default "
      "~/.cache/strata/data-venv). --format chat: {\"messages\": [{\"role\", \"content\"}, ...]} rendered by the "
      "chat template, only the assistant turns trained; prompt-completion: {\"prompt\", \"completion\"}, only the "
      "completion (and EOS) trained; text: {\"text\"}, all trained. A malformed line is refused naming FILE:LINE. "
      "Usage: strata data prepare --model HF_DIR --input FILE.jsonl --format chat|prompt-completion|text --out "
      "DATA [--max-length N] [--venv DIR]");
  prepare->allow_extras();
  prepare->prefix_command();
  on_selected(prepare, [prepare]() -> int {
    const std::filesystem::path tool = find_prepare_tool();
    std::vector<std::string> argv{"python3", tool.string()};
    for (const std::string& a : prepare->remaining()) argv.push_back(a);
    std::vector<char*> raw;
    for (std::string& a : argv) raw.push_back(a.data());
    raw.push_back(nullptr);
    ::execvp("python3", raw.data());
    raise_errno(errno, "strata data prepare: run python3 (Debian: apt-get install python3 python3-venv)");
  });
}

}  // namespace strata::cli
