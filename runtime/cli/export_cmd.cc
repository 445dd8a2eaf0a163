// `strata export CKPT DIR`: a finetune checkpoint as a Hugging Face directory.
#include <memory>

#include "runtime/cli/commands.h"
#include "runtime/config/size.h"
#include "core/error.h"
#include "runtime/train/export_checkpoint.h"

namespace strata::cli {

void add_export_command(CLI::App& app) {
  auto options = std::make_shared<train::ExportCheckpointOptions>();
  auto shard_size = std::make_shared<std::string>("5GB");
  CLI::App* cmd = app.add_subcommand(
      "export",
      "Write a `strata finetune` checkpoint as a Hugging Face directory (config.json + safetensors) that "
      "transformers loads. Run it with the checkpoint's world size: `strata run -n N -- strata export CKPT DIR`.");
  cmd->add_option("CKPT", options->checkpoint,
                  "The finetune --save directory (its newest complete checkpoint) or one step_<N> directory in it")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("DIR", options->out, "The Hugging Face directory to write")->required();
  cmd->add_option("--dtype", options->dtype,
                  "fp32, fp16, bf16 or fp8 (the decoder layers' linear weights block-quantized as DeepSeek's FP8 "
                  "checkpoints, 128 x 128 blocks or the source's, the rest bf16; default: the training dtype)")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16", "fp8"}));
  cmd->add_option("--shard-size", *shard_size,
                  "Largest safetensors file; past it the weights are sharded with model.safetensors.index.json")
      ->capture_default_str();
  on_selected(cmd, [options, shard_size] {
    const std::optional<uint64_t> nbytes = parse_size(*shard_size);
    STRATA_CHECK(nbytes && *nbytes > 0, kBadArgument, "--shard-size: \"{}\" is not a size (e.g. 5GB, 500MiB)",
                 *shard_size);
    options->shard_nbytes = *nbytes;
    train::export_checkpoint(*options);
    return 0;
  });
}

}  // namespace strata::cli
