#!/usr/bin/env bash
# examples/chat/run.sh end to end at a tiny size: a chat model with SmolLM2's
# tokenizer and template (tests/data/tokenizer/smollm2) and random weights of a
# tiny Llama (made by `strata finetune --init ... --export`), then prepare ->
# finetune on 2 ranks with evaluation -> export; the export must hold the
# tokenizer, the template, the generation config and the source's model_type,
# and so must `strata export` of the run's checkpoint.
set -euo pipefail
build="$1"; source="$2"; venv="$3"
strata="$build/bin/strata"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cat > "$work/tiny.json" <<'JSON'
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 32,
 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
 "bos_token_id": 1, "eos_token_id": 2}
JSON
"$strata" finetune --init "$work/tiny.json" --data "$source/examples/chat/train.jsonl" --data-format text \
  --steps 1 --seq 16 --out "$work/init_out" --export "$work/base" > "$work/init.log" 2>&1 \
  || { cat "$work/init.log"; exit 1; }
cp "$source"/tests/data/tokenizer/smollm2/* "$work/base/"
STRATA_BUILD_DIR="$build" STRATA_DATA_VENV="$venv" STEPS=6 SEQ=128 EVAL_EVERY=3 RANKS=2 \
  "$source/examples/chat/run.sh" "$work/base" "$work/run" 2>&1 | tee "$work/run.log"
fail=0
check() { if ! eval "$1"; then echo "FAILED: $2"; fail=1; fi; }
for dir in "$work/run/chat"; do
  for f in config.json model.safetensors tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
    check "[ -f '$dir/$f' ]" "$dir has $f"
  done
  check "cmp -s '$dir/chat_template.jinja' '$source/tests/data/tokenizer/smollm2/chat_template.jinja'" "the template is the source's"
  check "cmp -s '$dir/tokenizer.json' '$source/tests/data/tokenizer/smollm2/tokenizer.json'" "the tokenizer is the source's"
  check "grep -q '\"model_type\": \"llama\"' '$dir/config.json'" "model_type llama"
  check "grep -q '\"LlamaForCausalLM\"' '$dir/config.json'" "architectures kept"
  check "grep -q '\"eos_token_id\": 2' '$dir/generation_config.json'" "generation_config.json has the eos id"
  check "grep -q '\"eos_token_id\": 2' '$dir/config.json'" "config.json keeps the eos id"
done
check "grep -q 'eval_loss' '$work/run/out/metrics.jsonl'" "metrics.jsonl has eval_loss"
check "[ -f '$work/run/checkpoints/best.json' ]" "--keep-best wrote best.json"
# strata export of the checkpoint carries the same files (from the manifest).
"$strata" run -n 2 -- "$strata" export "$work/run/checkpoints" "$work/exported" > "$work/export.log" 2>&1 \
  || { cat "$work/export.log"; fail=1; }
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
  check "cmp -s '$work/exported/$f' '$work/run/chat/$f'" "strata export carries $f"
done
[ "$fail" -eq 0 ] && echo "chat example: all checks passed"
exit "$fail"
