#!/usr/bin/env bash
# Runs one of strata.torch's tests (tests/python/torch/<test>.py) with the
# build's library and the venv scripts/torch-venv makes (torch, transformers,
# peft, accelerate at python/strata/torch/requirements.txt), alone, under
# `strata run -n 2`, or under `torchrun --nproc_per_node 2`.
#   run_torch_test.sh BUILD_DIR SOURCE_DIR alone|strata-run|torchrun TEST
set -euo pipefail
build_dir="$1"; source_dir="$2"; how="$3"; test="$4"
venv="$("$source_dir/scripts/torch-venv" --check)" || {
  echo "run_torch_test: strata.torch's venv is missing; scripts/torch-venv makes it (the torch:venv test runs it)" >&2
  exit 1
}
export PYTHONPATH="$source_dir/python"
export STRATA_LIBRARY="$build_dir/runtime/libstrata_runtime.so"
export PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
cd "$source_dir/tests/python/torch"
case "$how" in
  alone) exec "$venv/bin/python" "$test.py" ;;
  strata-run) exec "$build_dir/bin/strata" run -n 2 -- "$venv/bin/python" "$test.py" ;;
  torchrun) exec "$venv/bin/torchrun" --standalone --nproc_per_node 2 "$test.py" ;;  # --standalone: a free port, not 29500
  *) echo "run_torch_test: '$how' is not alone, strata-run or torchrun" >&2; exit 2 ;;
esac
