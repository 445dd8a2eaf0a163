#!/usr/bin/env bash
# Fine-tune a chat model on examples/chat/train.jsonl (300 short conversations
# written for this example), evaluating on eval.jsonl, then export it:
#
#   examples/chat/run.sh MODEL_DIR [WORK_DIR]
#
# MODEL_DIR: a Hugging Face chat model of a supported family with its
# tokenizer.json and chat template, e.g. SmolLM2-135M-Instruct downloaded with
# `huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir smollm2`.
# Steps:
#   1. strata data prepare: the conversations through the model's chat
#      template and tokenizer; only the assistant turns are trained
#   2. strata finetune on 2 ranks, ZeRO-3, packed documents, evaluation every
#      EVAL_EVERY steps, the checkpoint of the lowest evaluation loss kept
#   3. the export: weights, config.json, tokenizer, chat template and
#      generation config, ready for transformers' generate()
# Sizes from the environment (the test suite runs it tiny): STEPS (60), SEQ
# (512), EVAL_EVERY (20), RANKS (2). Uses the build in $STRATA_BUILD_DIR
# (default: build/).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
strata="${STRATA_BUILD_DIR:-$root/build}/bin/strata"
model="${1:?usage: examples/chat/run.sh MODEL_DIR [WORK_DIR]}"
work="${2:-$(mktemp -d "${TMPDIR:-/tmp}/strata-chat.XXXXXX")}"
mkdir -p "$work"
venv=()
[ -n "${STRATA_DATA_VENV:-}" ] && venv=(--venv "$STRATA_DATA_VENV")

"$strata" data prepare --model "$model" --input "$here/train.jsonl" --format chat --out "$work/train.sd" "${venv[@]}"
"$strata" data prepare --model "$model" --input "$here/eval.jsonl" --format chat --out "$work/eval.sd" "${venv[@]}"
"$strata" run -n "${RANKS:-2}" -- "$strata" finetune --config "$here/ds_config.json" --model "$model" \
  --data "$work/train.sd" --eval-data "$work/eval.sd" --eval-every "${EVAL_EVERY:-20}" \
  --steps "${STEPS:-60}" --seq "${SEQ:-512}" --out "$work/out" --save "$work/checkpoints" --keep-best \
  --export "$work/chat"
echo "fine-tuned chat model: $work/chat (metrics: $work/out/metrics.jsonl, curve: $work/out/loss.svg)"
