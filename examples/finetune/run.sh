#!/usr/bin/env bash
# Fine-tune a small Hugging Face Llama with ZeRO-3, parameters and optimizer
# state on NVMe, on 2 ranks, then export it.
#
#   examples/finetune/run.sh [MODEL_DIR] [WORK_DIR]
#
# MODEL_DIR: a Hugging Face directory (config.json + model.safetensors, or
# sharded with model.safetensors.index.json) of a Llama with a byte-level
# vocabulary (256). Without it, the script first makes one: byte_llama.json
# trained from random weights for 100 steps and exported (the "tiny HF model").
# Uses the build in $STRATA_BUILD_DIR (default: build/).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
strata="${STRATA_BUILD_DIR:-$root/build}/bin/strata"
work="${2:-$(mktemp -d "${TMPDIR:-/tmp}/strata-finetune.XXXXXX")}"
mkdir -p "$work"
cd "$work"  # ds_zero3_nvme.json keeps its swap files in ./swap
data=(--data "$here/data/gpl-3.0.txt" --data-format text --seq 256)
model="${1:-}"
if [ -z "$model" ]; then
  model="$work/base"
  "$strata" run -n 2 -- "$strata" finetune --config "$here/ds_zero3_nvme.json" --init "$here/byte_llama.json" \
    "${data[@]}" --steps 100 --out "$work/base_out" --export "$model" --export-dtype fp32
fi
"$strata" run -n 2 -- "$strata" finetune --config "$here/ds_zero3_nvme.json" --model "$model" \
  "${data[@]}" --steps 100 --out "$work/out" --export "$work/finetuned"
echo "fine-tuned model: $work/finetuned (metrics: $work/out/metrics.jsonl)"
